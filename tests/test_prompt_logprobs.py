"""Prompt logprobs (vLLM's `prompt_logprobs`) through the engine on the CPU: equal to a log-softmax of
the reference's logits at every prompt position, across prefill chunks, for the requests that ask."""

import random

import pytest
import torch

from conftest import final_outputs
from flint_sched.checkpoint.make import dummy_checkpoint
from flint_sched.engine import EngineConfig
from flint_sched.engine.builder import build_parts
from flint_sched.executor.prompt_logprobs import prompt_spans
from flint_sched.executor.torch_executor import dense_weights
from flint_sched.model.reference import FlintReference
from flint_sched.sampling_params import SamplingParams


run = final_outputs


@pytest.mark.slow
def test_prompt_logprobs_equal_the_reference_across_chunks(tiny_short_window):
    ckpt = dummy_checkpoint(tiny_short_window, "bf16", seed=3, device="cpu")
    # a 13-token budget splits the prompts into odd chunks, shared with other requests' steps
    parts = build_parts(EngineConfig(device="cpu", max_num_seqs=4, max_num_batched_tokens=13, block_size=4,
                                     num_kv_blocks=200), progress=False, checkpoint=ckpt)
    rng = random.Random(7)
    prompts = [[rng.randrange(4000) for _ in range(n)] for n in (41, 2, 17)]
    requests = [(prompts[0], SamplingParams(max_tokens=3, prompt_logprobs=4, n=2)),
                (prompts[1], SamplingParams(max_tokens=2, prompt_logprobs=0)),
                (prompts[2], SamplingParams(max_tokens=5, temperature=0.0))]
    outputs = run(parts, requests)
    reference = FlintReference(ckpt.config, dense_weights(ckpt.weights, torch.float32, torch.device("cpu")))
    for (ids, params), out in zip(requests[:2], outputs[:2], strict=True):
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        want = torch.log_softmax(reference.forward(ids), dim=-1)          # row p: the token after p
        for position in range(1, len(ids)):
            got = out.prompt_logprobs[position]
            row = want[position - 1]
            assert got.token_id == ids[position]
            torch.testing.assert_close(torch.tensor(got.logprob), row[ids[position]], atol=1e-4, rtol=0)
            assert got.rank == int((row > row[ids[position]]).sum()) + 1
            top_values, top_ids = torch.topk(row, params.prompt_logprobs)
            assert [t for t, _ in got.top] == top_ids.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in got.top]), top_values, atol=1e-4, rtol=0)
    assert outputs[2].prompt_logprobs is None
    # the request without prompt logprobs gets the same greedy tokens as when it runs alone
    alone = run(parts, [requests[2]])[0]
    assert alone.outputs[0].token_ids == outputs[2].outputs[0].token_ids


def test_only_the_chunks_that_ask_get_logit_rows():
    from flint_sched.core.plan import ScheduledRequest
    ask, no = SamplingParams(prompt_logprobs=1), SamplingParams()
    prompt = list(range(10))
    entries = [ScheduledRequest("a", prompt[0:4], 0, [], 0, False, ask, prompt, [], False),   # rows 0..3: tokens 1..4
               ScheduledRequest("b", prompt[0:6], 0, [], 1, False, no, prompt, [], False),
               ScheduledRequest("c", prompt[6:10], 6, [], 2, True, ask, prompt, [], False),   # rows 6..8: tokens 7..9
               ScheduledRequest("d", [5], 10, [], 3, True, ask, prompt, [9], False)]          # a decode: none
    assert prompt_spans(entries) == [(0, 0, 4), (2, 10, 3)]


async def test_a_cached_prefix_still_gets_its_prompt_logprobs(tiny_short_window):
    """A prompt seen before is in the prefix cache; asking for its prompt logprobs computes every
    position anyway (as vLLM does), instead of leaving the cached ones None."""
    from flint_sched.engine.builder import build_engine

    ckpt = dummy_checkpoint(tiny_short_window, "bf16", seed=3, device="cpu")
    parts = build_parts(EngineConfig(device="cpu", max_num_seqs=4, max_num_batched_tokens=64, block_size=4,
                                     num_kv_blocks=200, enable_prefix_caching=True), progress=False, checkpoint=ckpt)
    prompt = list(range(100, 130))
    engine = build_engine(parts)
    engine.start()
    try:
        finals = []
        for params in (SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, prompt_logprobs=1),
                       SamplingParams(max_tokens=2, prompt_logprobs=1)):
            async for out in engine.add_request(prompt, params):
                pass
            finals.append(out)
        assert finals[0].num_cached_tokens == 0 and finals[2].num_cached_tokens == 0
        first, second = finals[1].prompt_logprobs, finals[2].prompt_logprobs
        assert first[0] is None and all(p is not None for p in first[1:])
        assert [p and (p.token_id, round(p.logprob, 4)) for p in second] == \
            [p and (p.token_id, round(p.logprob, 4)) for p in first]
        # a request without them still reads the cache
        async for out in engine.add_request(prompt, SamplingParams(max_tokens=2)):
            pass
        assert out.num_cached_tokens > 0
    finally:
        await engine.shutdown()
