"""How one request samples: pure Python, frozen, validated when built.

Ranges follow the OpenAI API and vLLM; a bad value raises ValueError naming the field. Values are
normalized once: numbers to float, `top_k=-1` to 0, `stop` and `stop_token_ids` to tuples, and
`logit_bias` to a fresh dict that nobody may mutate afterwards.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from flint_sched.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_ABS_LOGIT_BIAS = 100.0
MAX_ABS_PENALTY = 2.0
_GREEDY_TEMPERATURE = 1e-5


def _check_int(name: str, value: object, min_value: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if min_value is not None and value < min_value:
        raise ValueError(f"{name} must be >= {min_value}, got {value}")
    return value


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _check_token_ids(name: str, ids: object) -> tuple[int, ...]:
    """A list of token ids (each an int >= 0) as a tuple; ValueError naming `name` otherwise."""
    if ids is None or isinstance(ids, (str, bytes, Mapping)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"{name} must be a list of ints, got {ids!r}")
    ids = tuple(ids)
    for token_id in ids:
        _check_int(f"{name} entry", token_id, min_value=0)
    return ids


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; `n` copies are fanned out by the engine, not the scheduler."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    max_tokens: int = 16
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False     # a matched stop string (or stop token's text) stays in the text
    # vLLM's: every token but these is masked (None: all allowed)
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's: words never to write: the last token of a word's token sequence is masked whenever the
    # output so far ends in the tokens before it; the engine tokenizes them into bad_words_token_ids
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    structured_outputs: StructuredOutputsParams | None = None
    prompt_logprobs: int | None = None
    # vLLM's: mixed into the prefix cache's keys, so only requests with the same salt share cached KV
    # (one tenant cannot learn from hit timings which prompts another sent)
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        values = {
            "n": _check_int("n", self.n, min_value=1),
            "temperature": _check_float("temperature", self.temperature),
            "top_p": _check_float("top_p", self.top_p),
            "top_k": _check_int("top_k", self.top_k, min_value=-1),
            "min_p": _check_float("min_p", self.min_p),
            "presence_penalty": _check_float("presence_penalty", self.presence_penalty),
            "frequency_penalty": _check_float("frequency_penalty", self.frequency_penalty),
            "repetition_penalty": _check_float("repetition_penalty", self.repetition_penalty),
            "logit_bias": self._checked_logit_bias(),
            "stop": self._checked_stop(),
            "stop_token_ids": self._checked_stop_token_ids(),
            "allowed_token_ids": self._checked_allowed_token_ids(),
            "bad_words": self._checked_bad_words(),
            "bad_words_token_ids": self._checked_bad_words_token_ids(),
            "max_tokens": _check_int("max_tokens", self.max_tokens, min_value=1),
            "min_tokens": _check_int("min_tokens", self.min_tokens, min_value=0),
            "ignore_eos": _check_bool("ignore_eos", self.ignore_eos),
            "skip_special_tokens": _check_bool("skip_special_tokens", self.skip_special_tokens),
            "include_stop_str_in_output": _check_bool("include_stop_str_in_output", self.include_stop_str_in_output),
        }
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, min_value=0)
            if self.logprobs > MAX_LOGPROBS:
                raise ValueError(f"logprobs must be <= {MAX_LOGPROBS}, got {self.logprobs}")
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, min_value=0)
            if self.prompt_logprobs > MAX_LOGPROBS:
                raise ValueError(f"prompt_logprobs must be <= {MAX_LOGPROBS}, got {self.prompt_logprobs}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {self.cache_salt!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams, got {self.structured_outputs!r}")
        if values["temperature"] < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < values["top_p"] <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= values["min_p"] <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if abs(values[name]) > MAX_ABS_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2], got {values[name]}")
        if values["repetition_penalty"] <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if values["min_tokens"] > values["max_tokens"]:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if values["top_k"] == -1:
            values["top_k"] = 0
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def _checked_logit_bias(self) -> dict[int, float]:
        if not isinstance(self.logit_bias, Mapping):
            raise ValueError(f"logit_bias must map token ids to biases, got {self.logit_bias!r}")
        checked = {}
        for token_id, bias in self.logit_bias.items():
            _check_int("logit_bias token id", token_id, min_value=0)
            bias = _check_float("logit_bias value", bias)
            if abs(bias) > MAX_ABS_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
            checked[token_id] = bias
        return checked

    def _checked_stop(self) -> tuple[str, ...]:
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is None or isinstance(stop, (bytes, Mapping)) or not hasattr(stop, "__iter__"):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        stop = tuple(stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must hold non-empty strings, got {self.stop!r}")
        return stop

    def _checked_stop_token_ids(self) -> tuple[int, ...]:
        return _check_token_ids("stop_token_ids", self.stop_token_ids)

    def _checked_allowed_token_ids(self) -> tuple[int, ...] | None:
        if self.allowed_token_ids is None:
            return None
        ids = _check_token_ids("allowed_token_ids", self.allowed_token_ids)
        if not ids:
            raise ValueError("allowed_token_ids must not be empty (leave it out to allow every token)")
        return ids

    def _checked_bad_words(self) -> tuple[str, ...]:
        words = self.bad_words
        if isinstance(words, (str, bytes, Mapping)) or not hasattr(words, "__iter__"):
            raise ValueError(f"bad_words must be a list of strings, got {words!r}")
        words = tuple(words)
        if not all(isinstance(w, str) and w.strip() for w in words):
            raise ValueError(f"bad_words must hold non-blank strings, got {self.bad_words!r}")
        return words

    def _checked_bad_words_token_ids(self) -> tuple[tuple[int, ...], ...]:
        sequences = self.bad_words_token_ids
        if isinstance(sequences, (str, bytes, Mapping)) or not hasattr(sequences, "__iter__"):
            raise ValueError(f"bad_words_token_ids must be a list of token id lists, got {sequences!r}")
        checked = tuple(_check_token_ids("bad_words_token_ids", ids) for ids in sequences)
        if not all(checked):
            raise ValueError(f"bad_words_token_ids entries must be non-empty lists of ints, got {sequences!r}")
        return checked

    @property
    def is_greedy(self) -> bool:
        """True when sampling is argmax (temperature 0, as vLLM compares: below 1e-5)."""
        return self.temperature < _GREEDY_TEMPERATURE


def reads_history(params: SamplingParams) -> bool:
    """Whether choosing a token reads the request's earlier output tokens (penalties count them,
    min_tokens bans eos until enough are out, a grammar's mask follows them, a bad word of several
    tokens is banned by what came before its last): such a request cannot sample before the
    previous step's token is known on the host (async scheduling waits for it)."""
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
                or params.min_tokens or params.structured_outputs is not None
                or any(len(ids) > 1 for ids in params.bad_words_token_ids))
