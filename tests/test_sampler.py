"""The sampler, one transformation at a time, on logits small enough to reason about."""

import math

import pytest
import torch

from flint_sched.core.plan import ScheduledRequest
from flint_sched.executor.sampler import apply_penalties, filter_logits, sample_one
from flint_sched.sampling_params import SamplingParams


def entry(params, prompt=(0,), output=()):
    return ScheduledRequest("r", [0], 0, [], 0, True, params, list(prompt), list(output), False)


def test_greedy_and_logit_bias():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    assert sample_one(logits, entry(SamplingParams(temperature=0)), (), None)[0] == 1
    biased = SamplingParams(temperature=0, logit_bias={2: 5.0})
    assert sample_one(logits, entry(biased), (), None)[0] == 2


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([0.0, 9.0, 1.0, 8.0])
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(3,))
    assert sample_one(logits, entry(p, output=[2]), eos_token_ids={1}, generator=None)[0] == 2
    assert sample_one(logits, entry(p, output=[2, 2]), eos_token_ids={1}, generator=None)[0] == 1


def test_penalties_by_hand():
    logits = torch.tensor([2.0, -2.0, 1.0, 1.0])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits.clone(), p, prompt_ids=[0], output_ids=[1, 1, 2])
    # token 0: in prompt -> 2/2; token 1: -2*2 - 0.5*2 - 0.25; token 2: 1/2 - 0.5 - 0.25; token 3 untouched
    assert out.tolist() == pytest.approx([1.0, -5.25, -0.25, 1.0])


def test_top_k_top_p_min_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = lambda p: torch.isfinite(filter_logits(logits, p)).tolist()  # noqa: E731
    assert kept(SamplingParams(top_k=2)) == [True, True, False, False]
    assert kept(SamplingParams(top_p=0.7)) == [True, True, False, False]     # 0.5 < 0.7, 0.8 crosses
    assert kept(SamplingParams(top_p=0.5)) == [True, False, False, False]
    assert kept(SamplingParams(min_p=0.5)) == [True, True, False, False]     # >= 0.25
    assert filter_logits(logits, SamplingParams(temperature=2.0))[0] == pytest.approx(math.log(0.5) / 2)


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample_one(logits, entry(SamplingParams()), (), gen)[0]] += 1
    assert torch.allclose(counts / 3000, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_seed_gives_the_same_tokens_whatever_the_shared_generator():
    logits = torch.randn(50)
    p = SamplingParams(seed=1234)
    a = [sample_one(logits, entry(p, output=[0] * i), (), torch.Generator().manual_seed(1))[0] for i in range(20)]
    b = [sample_one(logits, entry(p, output=[0] * i), (), torch.Generator().manual_seed(99))[0] for i in range(20)]
    assert a == b and len(set(a)) > 1


def test_logprobs_come_from_the_raw_logits():
    logits = torch.tensor([1.0, 2.0, 3.0])
    p = SamplingParams(temperature=0, logprobs=2, logit_bias={0: 50.0})
    token, lp = sample_one(logits, entry(p), (), None)
    raw = torch.log_softmax(logits, -1)
    assert token == 0 and lp.token_id == 0 and lp.logprob == pytest.approx(float(raw[0]))
    assert [t for t, _ in lp.top] == [2, 1] and lp.top[0][1] == pytest.approx(float(raw[2]))
