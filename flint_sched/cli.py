"""The `flint-sched` command: argparse lives here and nowhere else."""

from __future__ import annotations

import argparse
import json
import sys
import time

from flint_sched.checkpoint.common import CheckpointError
from flint_sched.config import PRESETS, ConfigError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="flint-tiny",
                   help="a .gguf file, a Hugging Face directory, or a preset (%(default)s)")
    p.add_argument("--load-format", default="auto", choices=("auto", "gguf", "safetensors", "dummy"))
    p.add_argument("--weight-format", default="nvfp4", choices=("nvfp4", "bf16"),
                   help="weights made by --load-format dummy")
    p.add_argument("--hf-config-path", default=None, help="config.json overriding the checkpoint's own")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (or its directory) overriding the checkpoint's")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (%(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None)


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from flint_sched.checkpoint.make import make_checkpoint
    from flint_sched.config import preset
    start = time.perf_counter()
    out = make_checkpoint(preset(args.preset), args.format, args.seed, args.out, args.device,
                          progress=not args.no_progress)
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from flint_sched.llm import LLM
    from flint_sched.sampling_params import SamplingParams
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    llm = LLM(args.model, progress=not args.json, load_format=args.load_format, weight_format=args.weight_format,
              hf_config_path=args.hf_config_path, tokenizer=args.tokenizer, device=args.device, seed=args.seed,
              max_model_len=args.max_model_len)
    for prompt, result in zip(args.prompt, llm.generate(args.prompt, params), strict=True):
        choice = result.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "prompt_token_ids": result.prompt_token_ids,
                              "output_token_ids": choice.token_ids, "text": choice.text,
                              "finish_reason": choice.finish_reason}, ensure_ascii=False))
        else:
            print(prompt + choice.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flint-sched", description="Serve the Flint model.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-checkpoint", help="write a seeded random checkpoint")
    p.add_argument("--preset", required=True, choices=PRESETS)
    p.add_argument("--format", required=True, choices=("gguf-nvfp4", "hf-bf16"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="where to generate and quantize: cpu, cuda, auto")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("out", help="the .gguf file (gguf-nvfp4) or the directory (hf-bf16) to write")
    p.set_defaults(func=cmd_make_checkpoint)

    p = sub.add_parser("generate", help="generate text offline")
    _add_model_args(p)
    p.add_argument("--prompt", action="append", required=True, help="may be given several times")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"flint-sched: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
