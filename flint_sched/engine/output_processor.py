"""Per-choice post-processing of sampled tokens: detokenize, stop strings, logprobs, finish."""

from __future__ import annotations

from flint_sched.core.plan import RequestStepOutput
from flint_sched.engine.outputs import CompletionOutput
from flint_sched.engine.stop_strings import StopStringChecker
from flint_sched.sampling_params import SamplingParams
from flint_sched.tokenizer import FlintTokenizer, IncrementalDetokenizer


class ChoiceState:
    """Everything one choice has produced so far; `apply` turns one step's tokens into a delta."""

    def __init__(self, index: int, params: SamplingParams, tokenizer: FlintTokenizer):
        self.output = CompletionOutput(index, logprobs=[] if params.logprobs is not None else None)
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.stops = StopStringChecker(params.stop, include=params.include_stop_str_in_output)
        self.stop_token_ids = set(params.stop_token_ids)
        self.unsent = 0          # tokens applied since the last published output (a stream interval holds them)
        self.published = False   # any output of this choice published yet

    def due(self, interval: int) -> bool:
        """Whether the output is to be published now (SGLang's and vLLM's --stream-interval): with an
        interval of 1 every one; else the first token at once, then every `interval` tokens, and the
        last output."""
        if interval <= 1 or self.output.finished:
            return True
        return self.unsent >= interval or (not self.published and self.unsent > 0)

    def mark_published(self) -> None:
        self.unsent, self.published = 0, True

    @property
    def stopped_by_string(self) -> bool:
        return self.stops.matched is not None

    def apply(self, step: RequestStepOutput) -> CompletionOutput:
        """Fold one step's tokens in; the returned output carries this step's delta."""
        out = self.output
        new_ids = step.new_token_ids
        # a stop token ends the text but is not part of it (it stays in token_ids), unless asked for
        text_ids = new_ids[:-1] if step.finish_reason == "stop" and not self.stops.include else new_ids
        new_text = "".join(self.detokenizer.push(t) for t in text_ids)
        if step.finish_reason is not None:
            new_text += self.detokenizer.flush()
        delta = self.stops.feed(new_text)
        if step.finish_reason is not None or self.stopped_by_string:
            delta += self.stops.flush()
        held = self.unsent > 0   # the last deltas were not published: this step's extend them
        out.delta_text = out.delta_text + delta if held else delta
        out.append_text(delta)
        out.delta_token_ids = out.delta_token_ids + list(new_ids) if held else list(new_ids)
        out.token_ids.extend(new_ids)
        if out.logprobs is not None:
            new_logprobs = list(step.logprobs or [])
            out.delta_logprobs = (out.delta_logprobs or []) + new_logprobs if held else new_logprobs
            out.logprobs.extend(new_logprobs)
        self.unsent += len(new_ids)
        if self.stopped_by_string:
            out.finish_reason, out.stop_reason = "stop", self.stops.matched
        elif step.finish_reason is not None:
            out.finish_reason = str(step.finish_reason)
            out.stop_reason = step.stop_reason
        return out

    def fail(self, reason: str = "abort") -> CompletionOutput:
        """The choice ends without its last step: the deltas a stream interval held back still go out."""
        out = self.output
        if not self.unsent:
            out.delta_text, out.delta_token_ids, out.delta_logprobs = "", [], [] if out.logprobs is not None else None
        out.finish_reason = reason
        return out
