"""The offline Python API: `LLM(...).generate(prompts, SamplingParams(...))` and `LLM(...).chat(messages)`,
as in vLLM."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any

from flint_sched.core.scheduler import Scheduler
from flint_sched.engine.builder import build_engine, build_parts
from flint_sched.engine.config import EngineConfig
from flint_sched.engine.outputs import RequestOutput
from flint_sched.sampling_params import SamplingParams
from flint_sched.tokenizer import default_chat_template, render_chat

Prompt = str | Sequence[int]
Conversation = Sequence[dict[str, Any]]


def run_async(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine to completion on uvloop when it is installed, else asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


class LLM:
    """Loads the model once; each `generate` call runs the engine until every prompt is done."""

    def __init__(self, model: str | None = None, progress: bool = True, **engine_args: Any):
        self.config = EngineConfig(model=model, **engine_args)
        self.parts = build_parts(self.config, progress)
        self.scheduler = Scheduler(self.parts.scheduler_config)     # its prefix cache outlives each call

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, as vLLM's LLM.reset_prefix_cache; False with caching off."""
        return self.scheduler.reset_prefix_cache()

    @property
    def tokenizer(self):
        return self.parts.checkpoint.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses without sampling params, as vLLM's: the checkpoint's
        generation_config.json sampling fields over SamplingParams' own defaults."""
        return SamplingParams(**self.parts.sampling_defaults)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in order; a prompt is text or token ids."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        return run_async(self._generate(list(prompts), params))

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """One conversation (a list of OpenAI-style messages) or a list of them, each rendered with the
        chat template (`chat_template`, else the checkpoint's, else Flint's own) and generated as
        `generate` does: a RequestOutput per conversation, its text as the model wrote it (reasoning
        and tool-call tags included; the server's parsers split them)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        template = chat_template or self.tokenizer.chat_template or default_chat_template()
        prompts = [render_chat(template, list(conversation), tools, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
                   for conversation in conversations]
        return self.generate(prompts, sampling_params)

    async def _generate(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[RequestOutput]:
        engine = build_engine(self.parts, self.scheduler)
        engine.start()
        try:
            streams = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]

            async def last(stream) -> RequestOutput:
                out = None
                async for out in stream:
                    pass
                return out

            return list(await asyncio.gather(*(last(s) for s in streams)))
        finally:
            await engine.shutdown()
