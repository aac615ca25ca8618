"""What output a request is constrained to, as vLLM's `StructuredOutputsParams` names it: pure data.

Exactly one of `json` (a JSON schema), `json_object` (any JSON object), `regex`, `choice` (one of
some strings) or `grammar` (Lark or GBNF/EBNF) is set. Values are normalized when built (the schema
to its compact JSON text, choices to a tuple), so equal constraints compare and hash equal: the
compiler caches by this object. `strict` makes unsupported JSON-schema keywords an error instead
of being ignored (OpenAI's `json_schema.strict`). `begin_after_token`: the output is free until this
token has been generated (the reasoning's end, `</think>`, as vLLM leaves reasoning unconstrained).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    strict: bool = False
    begin_after_token: int | None = None

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured outputs need exactly one of json, json_object, regex, choice or grammar, "
                             f"got {given or 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"regex must be a string, got {self.regex!r}")
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar.strip()):
            raise ValueError("grammar must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice) or not self.choice:
                raise ValueError(f"choice must be a non-empty list of strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.begin_after_token is not None and (isinstance(self.begin_after_token, bool)
                                                   or not isinstance(self.begin_after_token, int)):
            raise ValueError(f"begin_after_token must be a token id, got {self.begin_after_token!r}")
        if not isinstance(self.strict, bool):
            raise ValueError(f"strict must be a bool, got {self.strict!r}")

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))


def _schema_text(schema) -> str:
    """A schema as compact JSON text (property order kept: it is the order of generation)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as error:
            raise ValueError(f"the JSON schema is not valid JSON: {error}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
