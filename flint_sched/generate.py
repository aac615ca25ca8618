"""Offline generation on the reference model, one prompt at a time (the engine replaces this path)."""

from __future__ import annotations

from typing import Any

import torch

from flint_sched.checkpoint.common import Checkpoint
from flint_sched.model.reference import FlintReference, KVState


def generate_greedy_or_sampled(ckpt: Checkpoint, prompt: str, max_tokens: int, temperature: float,
                               seed: int = 0) -> dict[str, Any]:
    """Prefill the prompt, then decode until an end token or `max_tokens`."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    tok = ckpt.tokenizer
    prompt_ids = tok.encode(prompt)
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    limit = ckpt.config.max_position_embeddings
    if len(prompt_ids) + max_tokens > limit:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                         f"the model's context of {limit}")
    model = FlintReference(ckpt.config, ckpt.weights)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    state = KVState()
    logits = model.forward(prompt_ids, state)[-1]
    output, finish_reason = [], "length"
    for _ in range(max_tokens):
        if temperature == 0:
            token = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=gen))
        output.append(token)
        if token in tok.eos_token_ids:
            finish_reason = "stop"
            break
        logits = model.forward([token], state)[-1]
    text = tok.decode(output[:-1] if finish_reason == "stop" else output)
    return {"prompt": prompt, "prompt_token_ids": prompt_ids, "output_token_ids": output,
            "text": text, "finish_reason": finish_reason}
