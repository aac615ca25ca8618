"""StructuredOutputsParams -> llguidance matchers, compiled once per grammar and copied per request.

The llguidance tokenizer is built from the `tokenizers` JSON on first use (~1 s at a 151,552-token
vocabulary), with the tokenizer's stop ids as its end tokens: a finished grammar allows only those,
so a constrained request ends like any other, on a stop token. `compile` raises ValueError for an
invalid schema, regex or grammar (the server's 400); call it off the event loop. Thread-safe.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict

import llguidance

from flint_sched.structured.params import StructuredOutputsParams
from flint_sched.tokenizer import FlintTokenizer

CACHE_SIZE = 512
# NOTE: JSON as json.dumps writes it, with no other whitespace: with vLLM's default (any whitespace
# between tokens) a weak or confused model can spend its whole budget on whitespace (flint-tiny did).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not yet checked)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.json if kind == "json" else '{"type":"object"}'
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults=JSON_OPTIONS, overrides={"lenient": not params.strict})
        except ValueError as error:
            raise ValueError(f"invalid JSON schema: {error}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    try:
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as error:
        raise ValueError(f"invalid grammar: {error}") from None


class GrammarCompiler:
    """Compiled grammars for one tokenizer, the most recent CACHE_SIZE kept."""

    def __init__(self, tokenizer: FlintTokenizer, cache_size: int = CACHE_SIZE):
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[StructuredOutputsParams, llguidance.LLMatcher] = OrderedDict()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                t = self.tokenizer
                self._ll_tokenizer = llguidance.LLTokenizer(t.backend.to_str(), n_vocab=t.vocab_size,
                                                            eos_token=list(t.eos_token_ids))
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The matcher of `params` in its start state (shared: copy it before use); ValueError if invalid."""
        params = dataclasses.replace(params, begin_after_token=None)
        with self._lock:
            matcher = self._cache.get(params)
            if matcher is not None:
                self._cache.move_to_end(params)
                return matcher
        tokenizer = self.ll_tokenizer
        matcher = llguidance.LLMatcher(tokenizer, grammar_text(params), log_level=0)
        if matcher.is_error():
            raise ValueError(_short(matcher.get_error()))
        with self._lock:
            self._cache[params] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def new_matcher(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for one request."""
        return self.compile(params).deep_copy()


def _short(message: str) -> str:
    """llguidance's error without its parser-state dump."""
    return message.split("\n<state>")[0].strip()
