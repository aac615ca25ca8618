"""Per-step overhead of constrained decoding in the sampler, at batch 1 and 64 (CPU or GPU).

Each step samples B rows of random logits [B, V] through executor/sampler.py twice: plain, and with
every row under a JSON schema (its matcher advanced by the token sampled last step, the mask filled
on the host and applied). Reported: median ms per step of each, the difference, and the host fill
alone, after --warmup-steps steps under the schema; and the warm-up's own cost (a new schema's
lexer states are built lazily by llguidance and cached with the compiled grammar, so the first
requests under a schema pay more per step than the later ones). A request whose grammar ends (a
stop token) starts over. Run:
python benchmarks/bench_structured.py [--vocab-size 151552] [--device cuda] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from flint_sched.core.plan import ScheduledRequest  # noqa: E402
from flint_sched.executor.grammar_masks import GrammarMasks  # noqa: E402
from flint_sched.executor.sampler import sampled_step  # noqa: E402
from flint_sched.sampling_params import SamplingParams  # noqa: E402
from flint_sched.structured import StructuredOutputsParams  # noqa: E402
from flint_sched.structured.compiler import GrammarCompiler  # noqa: E402
from flint_sched.tokenizer import FlintTokenizer, build_tokenizer  # noqa: E402

SCHEMA = {"type": "object", "required": ["name", "tags", "address"], "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 5},
    "address": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "maxLength": 30}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}


def entries_for(batch: int, params: SamplingParams) -> list[ScheduledRequest]:
    return [ScheduledRequest(f"r{i}", [1], 1, [0], i, True, params, [1], [], False) for i in range(batch)]


def timed_steps(logits: torch.Tensor, entries: list[ScheduledRequest], eos: frozenset[int],
                masks: GrammarMasks | None, num_steps: int) -> list[float]:
    generator = torch.Generator(device=logits.device).manual_seed(0)
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        result = sampled_step(logits, entries, eos, generator, masks)
        times.append(time.perf_counter() - start)          # the token ids are read back: synchronized
        for e in entries:
            token = result.sampled_token_ids[e.request_id][0]
            if token in eos:
                e.output_token_ids.clear()                 # done: start over with a fresh matcher
            else:
                e.output_token_ids.append(token)
    return times


def run(tokenizer: FlintTokenizer, batch: int, device: str, num_steps: int, warmup_steps: int) -> dict[str, float]:
    vocab = tokenizer.vocab_size
    logits = torch.randn(batch, vocab, device=device)
    eos = frozenset(tokenizer.eos_token_ids)
    masks = GrammarMasks(GrammarCompiler(tokenizer))
    plain = entries_for(batch, SamplingParams(temperature=1.0))
    constrained = entries_for(batch, SamplingParams(
        temperature=1.0, structured_outputs=StructuredOutputsParams(json=SCHEMA)))
    fill_times = []
    original_fill = masks.fill

    def fill(entries):
        start = time.perf_counter()
        filled = original_fill(entries)
        fill_times.append(time.perf_counter() - start)
        return filled

    masks.fill = fill
    timed_steps(logits, plain, eos, None, 3)
    warmup = timed_steps(logits, constrained, eos, masks, warmup_steps)
    fill_times.clear()
    plain_ms = 1e3 * statistics.median(timed_steps(logits, plain, eos, None, num_steps))
    grammar_ms = 1e3 * statistics.median(timed_steps(logits, constrained, eos, masks, num_steps))
    return {"plain_ms": plain_ms, "grammar_ms": grammar_ms, "fill_ms": 1e3 * statistics.median(fill_times),
            "warmup_ms": 1e3 * sum(warmup), "warmup_max_ms": 1e3 * max(warmup)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=151552, help="of the generated tokenizer")
    parser.add_argument("--tokenizer", help="a tokenizer.json or its directory instead")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--num-steps", type=int, default=40)
    parser.add_argument("--warmup-steps", type=int, default=100,
                        help="steps under the schema before timing (its lexer states built and cached)")
    args = parser.parse_args()
    tokenizer = (FlintTokenizer.from_file(args.tokenizer) if args.tokenizer
                 else build_tokenizer(args.vocab_size, seed=0))
    print(f"vocabulary {tokenizer.vocab_size}, device {args.device}, {torch.get_num_threads()} CPU threads")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        r = run(tokenizer, batch, args.device, args.num_steps, args.warmup_steps)
        extra_ms = r["grammar_ms"] - r["plain_ms"]
        print(f"batch {batch:3d}: sampler {r['plain_ms']:7.2f} ms plain, {r['grammar_ms']:7.2f} ms with a JSON "
              f"schema per row (+{extra_ms:.2f} ms; mask fill on the host {r['fill_ms']:.2f} ms); the "
              f"{args.warmup_steps} warm-up steps took {r['warmup_ms']:.0f} ms, the slowest {r['warmup_max_ms']:.0f} ms")


if __name__ == "__main__":
    main()
