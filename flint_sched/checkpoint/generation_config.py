"""A checkpoint's `generation_config.json` as the server's sampling defaults, as vLLM reads it
(`--generation-config auto`, its default): the sampling fields the file sets to other than Hugging
Face's own defaults become the defaults of requests that leave them out (`max_new_tokens`: the most
a request without `max_tokens` may generate). "vllm" reads none; a folder, the file in it.
"""

from __future__ import annotations

import json
from pathlib import Path

from flint_sched.sampling_params import SamplingParams

FILE = "generation_config.json"
# generation_config.json's names -> SamplingParams' names
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# transformers' GenerationConfig defaults: a file repeating one sets nothing (vLLM reads the diff)
HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def find(choice: str, model: str | None, hf_config_path: str | None) -> Path | None:
    """The generation_config.json that `choice` ("auto", "vllm" or a folder) names for a checkpoint
    (paths already local): beside --hf-config-path's config, else in the model's directory."""
    if choice == "vllm":
        return None
    if choice != "auto":
        path = Path(choice)
        if not path.is_dir():
            raise ValueError(f"--generation-config {choice!r}: expected auto, vllm or a folder holding {FILE}")
        return path / FILE if (path / FILE).is_file() else None
    source = Path(hf_config_path) if hf_config_path is not None else Path(model) if model is not None else None
    if source is None or not source.exists():          # a preset's name: its generated file sets nothing
        return None
    folder = source if source.is_dir() else source.parent
    return folder / FILE if (folder / FILE).is_file() else None


def sampling_defaults(path: Path | None) -> dict:
    """The sampling defaults a generation_config.json sets ({} for none)."""
    if path is None:
        return {}
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: cannot read it as JSON ({error})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{path}: expected a JSON object")
    defaults = {FIELDS[name]: value for name, value in fields.items()
                if name in FIELDS and value is not None and HF_DEFAULTS.get(name) != value}
    try:
        SamplingParams(**defaults)                     # checked here, before the weights load
    except ValueError as error:
        raise ValueError(f"{path}: {error} (--generation-config vllm leaves the file out)") from None
    return defaults
