"""Tokenizer, incremental detokenizer and chat template for Flint (GLM-4.7 format)."""

from flint_sched.tokenizer.bpe import SPECIAL_TOKENS, build_tokenizer
from flint_sched.tokenizer.chat import default_chat_template, render_chat
from flint_sched.tokenizer.detokenizer import IncrementalDetokenizer
from flint_sched.tokenizer.gguf_vocab import read_gguf_tokenizer, write_gguf_tokenizer
from flint_sched.tokenizer.tokenizer import GLM_STOP_TOKENS, FlintTokenizer

__all__ = [
    "GLM_STOP_TOKENS",
    "SPECIAL_TOKENS",
    "FlintTokenizer",
    "IncrementalDetokenizer",
    "build_tokenizer",
    "default_chat_template",
    "read_gguf_tokenizer",
    "render_chat",
    "write_gguf_tokenizer",
]
