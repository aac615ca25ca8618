"""The engine on a GPU picks the CUDA executor and serves 64 concurrent requests through it (grouped
decode steps while many run, fused ones as they finish)."""

import asyncio
import random

import pytest
import torch

from flint_sched.checkpoint.make import dummy_checkpoint
from flint_sched.engine import EngineConfig
from flint_sched.engine.builder import build_engine, build_parts
from flint_sched.executor import kernel_ops
from flint_sched.executor.cuda_executor import CudaExecutor
from flint_sched.model.reference import FlintReference
from flint_sched.sampling_params import SamplingParams
from gpu_checks import small_real_config

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def parts():
    ckpt = dummy_checkpoint(small_real_config(), "nvfp4", seed=3, device="cuda")
    return build_parts(EngineConfig(device="cuda", max_num_seqs=64, max_num_batched_tokens=2048, num_kv_blocks=8192,
                                    max_model_len=2048), progress=False, checkpoint=ckpt)


async def serve(engine, requests):
    """The last output of each (prompt, params) request, all added at once to a started engine."""
    async def last(stream):
        out = None
        async for out in stream:
            pass
        return out

    return await asyncio.gather(*(last(engine.add_request(p, sp)) for p, sp in requests))


async def test_concurrent_requests_through_the_cuda_executor(parts):
    assert isinstance(parts.executor, CudaExecutor)
    rng = random.Random(0)
    engine = build_engine(parts)
    engine.start()
    try:
        requests = []
        for n in range(64):
            params = SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randint(1, 24), ignore_eos=True,
                                    presence_penalty=rng.choice([0.0, 0.5]), seed=n)
            requests.append(([rng.randrange(4096) for _ in range(rng.randint(1, 700))], params))

        results = await serve(engine, requests)
        for (_, params), result in zip(requests, results):
            assert len(result.outputs[0].token_ids) == params.max_tokens
        allocator = engine.scheduler.kv_allocator
        assert allocator.num_used_blocks == 0 and allocator.num_used_ring_slots == 0
        variants = {key[0] for key in parts.executor.graphs.graphs}    # (variant, rows[, expert GEMMs])
        assert variants == {"fused", "grouped", "prompt"}, f"graphs run: {variants}"
    finally:
        await engine.shutdown()


async def test_persistent_decode_steps_through_the_engine_match_the_reference(parts, monkeypatch):
    """Issue 17's engine end to end: with kernel_ops.PERSISTENT, 8 greedy requests served together
    (prompt steps, then fused steps of 8 rows down to 1, each launched before the tokens of the one
    before are read back) get at every generated token the reference's log-probability of that
    token (the reference fed the engine's tokens) within bf16 noise; the persistent step ran, and
    its counters are back at zero."""
    monkeypatch.setattr(kernel_ops, "PERSISTENT", True)
    rng = random.Random(5)
    requests = [([rng.randrange(4096) for _ in range(rng.randint(1, 700))],
                 SamplingParams(temperature=0, max_tokens=rng.randint(4, 16), ignore_eos=True, logprobs=0))
                for _ in range(8)]
    engine = build_engine(parts)
    engine.start()
    try:
        results = await serve(engine, requests)
    finally:
        await engine.shutdown()
    steps = [step for step in parts.executor.ws.decode_steps.values() if step]
    assert steps and all(int(step.counters.abs().sum()) == 0 for step in steps)
    ckpt = parts.checkpoint
    ref = FlintReference(ckpt.config, ckpt.weights, dtype=torch.float32, device="cuda")
    got, want = [], []
    for (prompt, params), result in zip(requests, results, strict=True):
        out = result.outputs[0]
        assert len(out.token_ids) == len(out.logprobs) == params.max_tokens
        logp = torch.log_softmax(ref.forward(prompt + out.token_ids[:-1])[len(prompt) - 1:], dim=-1).cpu()
        want += logp[torch.arange(len(out.token_ids)), torch.tensor(out.token_ids)].tolist()
        got += [entry.logprob for entry in out.logprobs]
    got, want = torch.tensor(got), torch.tensor(want)
    # the tolerance of test_cuda_executor.py's prompt-logprob check (bf16 through 7 layers)
    assert float((got - want).norm() / want.norm()) < 2e-2, f"worst {float((got - want).abs().max()):.3f}"


async def test_the_gpu_timeline_counts_the_served_steps(parts):
    """/metrics' GPU busy and idle seconds: every step the engine collects adds its GPU time (CUDA
    events) and the gap before it; steps of a busy engine are counted, a quiet one adds nothing."""
    engine = build_engine(parts)
    timeline = engine.gpu_timeline
    assert timeline is parts.executor.timeline
    steps, busy = timeline.steps, timeline.busy_s
    engine.start()
    try:
        streams = [engine.add_request([5 + n] * 40, SamplingParams(max_tokens=12, ignore_eos=True)) for n in range(9)]
        for stream in streams:
            async for _ in stream:
                pass
        assert timeline.steps >= steps + 12 and timeline.busy_s > busy and timeline.idle_s >= 0.0
        assert 0.0 < timeline.prompt_busy_s < timeline.busy_s      # the prompts' steps, then decode-only ones
        counted = timeline.steps
        await asyncio.sleep(0.2)                                # a quiet engine
        assert timeline.steps == counted
    finally:
        await engine.shutdown()


async def test_json_schemas_hold_through_the_cuda_executor(parts):
    """Constrained rows (grammar masks on the GPU logits) beside plain ones, fused and grouped steps.
    NOTE: written without a GPU at hand (structured-output branch)."""
    import json

    import jsonschema

    from flint_sched.structured import StructuredOutputsParams
    schema = {"type": "object", "additionalProperties": False, "required": ["id", "tags"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                             "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}}}}
    constrained = SamplingParams(temperature=1.0, max_tokens=64,
                                 structured_outputs=StructuredOutputsParams(json=schema))
    plain = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
    engine = build_engine(parts)
    engine.start()
    try:
        requests = [([7 + n, 11, 13], constrained if n % 2 else plain) for n in range(40)]
        results = await serve(engine, requests)
        for (_, params), result in zip(requests, results):
            if params is constrained:
                assert result.outputs[0].finish_reason == "stop"
                jsonschema.validate(json.loads(result.outputs[0].text), schema)
    finally:
        await engine.shutdown()
