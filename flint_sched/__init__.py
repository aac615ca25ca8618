"""flint-sched: a serving engine for the Flint mixture-of-experts model."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`from flint_sched import LLM, SamplingParams, StructuredOutputsParams` without importing torch
    at package import."""
    if name == "LLM":
        from flint_sched.llm import LLM
        return LLM
    if name == "SamplingParams":
        from flint_sched.sampling_params import SamplingParams
        return SamplingParams
    if name == "StructuredOutputsParams":
        from flint_sched.structured import StructuredOutputsParams
        return StructuredOutputsParams
    raise AttributeError(f"module 'flint_sched' has no attribute {name!r}")
