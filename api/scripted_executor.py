"""A test executor that replays scripts instead of running the model (`serve --scripted-executor`).

A script maps a prompt substring to what the model "says": texts (each tokenized alone, special-token
text becoming its id), token ids, and `{"sleep_s": x}`: the step that samples the next token takes
x seconds (the longest such wait of its requests): a slow model, or with a huge x a hung GPU. A request
follows the longest key in its decoded prompt ("" fits all), then emits eos. The next token depends
only on how many the request has made (preemption-safe).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from flint_sched.core.plan import ScheduledRequest, StepPlan, StepResult, TokenLogprobs

SCRIPTED_LOGPROB = -0.25      # every scripted token's logprob; alternatives get lower ones


@dataclass
class Script:
    token_ids: list[int] = field(default_factory=list)
    sleep_s: dict[int, float] = field(default_factory=dict)   # token index -> seconds slept before it


class ScriptedExecutor:
    def __init__(self, scripts: dict[str, list[str | int]], tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.scripts = sorted(((key, self._tokenize(key, pieces)) for key, pieces in scripts.items()),
                              key=lambda item: -len(item[0]))
        self._chosen: dict[str, Script] = {}           # request id -> its script

    @classmethod
    def from_file(cls, path: str | Path, tokenizer) -> "ScriptedExecutor":
        try:
            scripts = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"cannot read the executor script {path}: {error}") from error
        if not isinstance(scripts, dict):
            raise ValueError(f"executor script {path}: expected a JSON object of prompt substring -> outputs")
        return cls(scripts, tokenizer)

    def _tokenize(self, key: str, pieces) -> Script:
        if not isinstance(pieces, list):
            raise ValueError(f"script {key!r}: expected a list of texts and token ids")
        script = Script()
        for piece in pieces:
            if isinstance(piece, str):
                script.token_ids.extend(self.tokenizer.encode(piece))
            elif isinstance(piece, int) and not isinstance(piece, bool):
                script.token_ids.append(piece)
            elif isinstance(piece, dict) and set(piece) == {"sleep_s"} and isinstance(piece["sleep_s"], int | float):
                index = len(script.token_ids)
                script.sleep_s[index] = script.sleep_s.get(index, 0.0) + float(piece["sleep_s"])
            else:
                raise ValueError(f"script {key!r}: {piece!r} is neither a text, a token id nor a sleep")
        return script

    def _script_of(self, entry: ScheduledRequest) -> Script:
        script = self._chosen.get(entry.request_id)
        if script is None:
            prompt = self.tokenizer.decode(entry.prompt_token_ids)
            script = next((s for key, s in self.scripts if key in prompt), Script())
            self._chosen[entry.request_id] = script
        return script

    def _logprobs(self, token_id: int, num_top: int) -> TokenLogprobs:
        alternatives = [token_id] + [i for i in range(num_top + 1) if i != token_id]
        top = [(i, SCRIPTED_LOGPROB - rank) for rank, i in enumerate(alternatives[:num_top])]
        return TokenLogprobs(token_id, SCRIPTED_LOGPROB, top)

    def execute(self, plan: StepPlan) -> StepResult:
        for request_id in plan.finished_request_ids:
            self._chosen.pop(request_id, None)
        tokens, logprobs, sleep_s = {}, {}, 0.0
        for entry in plan.scheduled_requests:
            if not entry.samples:
                continue
            script = self._script_of(entry)
            produced = len(entry.output_token_ids)
            sleep_s = max(sleep_s, script.sleep_s.get(produced, 0.0))
            token = script.token_ids[produced] if produced < len(script.token_ids) else self.eos_token_id
            tokens[entry.request_id] = [token]
            if entry.sampling_params.logprobs is not None:
                logprobs[entry.request_id] = [self._logprobs(token, entry.sampling_params.logprobs)]
        time.sleep(sleep_s)
        return StepResult(tokens, logprobs or None)
