"""Structured outputs: grammar-constrained decoding (JSON schemas, regexes, choices, grammars).

params.py is pure data (it rides in SamplingParams); compiler.py turns it into llguidance matchers,
cached by grammar; executor/grammar_masks.py applies their token masks in the sampler.
"""

from flint_sched.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
