"""A test executor that replays scripts instead of running the model (`serve --scripted-executor`).

A script maps a prompt substring to what the model "says": texts (each tokenized alone, special-token
text becoming its id) and token ids. A request follows the longest key in its decoded prompt ("" fits
all), then emits eos. The next token depends only on how many the request has made (preemption-safe).
"""

from __future__ import annotations

import json
from pathlib import Path

from flint_sched.core.plan import ScheduledRequest, StepPlan, StepResult, TokenLogprobs

SCRIPTED_LOGPROB = -0.25      # every scripted token's logprob; alternatives get lower ones


class ScriptedExecutor:
    def __init__(self, scripts: dict[str, list[str | int]], tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.scripts = sorted(((key, self._tokenize(key, pieces)) for key, pieces in scripts.items()),
                              key=lambda item: -len(item[0]))
        self._chosen: dict[str, list[int]] = {}        # request id -> its script's token ids

    @classmethod
    def from_file(cls, path: str | Path, tokenizer) -> "ScriptedExecutor":
        try:
            scripts = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"cannot read the executor script {path}: {error}") from error
        if not isinstance(scripts, dict):
            raise ValueError(f"executor script {path}: expected a JSON object of prompt substring -> outputs")
        return cls(scripts, tokenizer)

    def _tokenize(self, key: str, pieces) -> list[int]:
        if not isinstance(pieces, list):
            raise ValueError(f"script {key!r}: expected a list of texts and token ids")
        ids: list[int] = []
        for piece in pieces:
            if isinstance(piece, str):
                ids.extend(self.tokenizer.encode(piece))
            elif isinstance(piece, int) and not isinstance(piece, bool):
                ids.append(piece)
            else:
                raise ValueError(f"script {key!r}: {piece!r} is neither a text nor a token id")
        return ids

    def _script_of(self, entry: ScheduledRequest) -> list[int]:
        script = self._chosen.get(entry.request_id)
        if script is None:
            prompt = self.tokenizer.decode(entry.prompt_token_ids)
            script = next((ids for key, ids in self.scripts if key in prompt), [])
            self._chosen[entry.request_id] = script
        return script

    def _logprobs(self, token_id: int, num_top: int) -> TokenLogprobs:
        alternatives = [token_id] + [i for i in range(num_top + 1) if i != token_id]
        top = [(i, SCRIPTED_LOGPROB - rank) for rank, i in enumerate(alternatives[:num_top])]
        return TokenLogprobs(token_id, SCRIPTED_LOGPROB, top)

    def execute(self, plan: StepPlan) -> StepResult:
        for request_id in plan.finished_request_ids:
            self._chosen.pop(request_id, None)
        tokens, logprobs = {}, {}
        for entry in plan.scheduled_requests:
            if not entry.samples:
                continue
            script = self._script_of(entry)
            produced = len(entry.output_token_ids)
            token = script[produced] if produced < len(script) else self.eos_token_id
            tokens[entry.request_id] = [token]
            if entry.sampling_params.logprobs is not None:
                logprobs[entry.request_id] = [self._logprobs(token, entry.sampling_params.logprobs)]
        return StepResult(tokens, logprobs or None)
