"""The sampler, one transformation at a time, on logits small enough to reason about; then whole
batches of mixed requests against the same requests sampled one at a time."""

import math

import pytest
import torch

from flint_sched.core.plan import ScheduledRequest
from flint_sched.executor.sampler import edit_logits, filter_logits, sample_batch, sample_one
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


def test_allowed_token_ids_and_bad_words():
    """allowed_token_ids masks every other token (a hard mask: the bans after it yield when they
    would leave nothing, as a grammar's does); a bad word's last token is banned where the output
    ends in the tokens before it, a one-token word always. Logprobs read the unmasked logits."""
    from flint_sched.executor.graph_sampler import plain
    logits = torch.tensor([0.0, 9.0, 1.0, 8.0, 2.0])
    allowed = SamplingParams(temperature=0, allowed_token_ids=(2, 4), logprobs=0)
    token, lp = sample_one(logits, entry(allowed), (), None)
    assert token == 4 and lp.logprob == pytest.approx(float(torch.log_softmax(logits, 0)[4]))
    hot = SamplingParams(temperature=5.0, allowed_token_ids=(2, 4))
    assert all(sample_one(logits, entry(hot), (), None)[0] in (2, 4) for _ in range(20))   # never another
    only_eos = SamplingParams(temperature=0, allowed_token_ids=(3,), min_tokens=2)     # 3 is eos and allowed alone
    assert sample_one(logits, entry(only_eos), {3}, None)[0] == 3
    words = SamplingParams(temperature=0, bad_words_token_ids=((1,), (0, 2, 3)))
    assert sample_one(logits, entry(words, output=[4]), (), None)[0] == 3          # 1 always banned
    assert sample_one(logits, entry(words, output=[4, 0, 2]), (), None)[0] == 4    # ...0 2 -> 3 banned too
    assert sample_one(logits, entry(words, output=[0, 2, 4]), (), None)[0] == 3
    assert not plain(entry(SamplingParams(allowed_token_ids=(2,)))) and not plain(entry(words))
    assert plain(entry(SamplingParams()))


def test_penalties_by_hand():
    logits = torch.tensor([2.0, -2.0, 1.0, 1.0])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = logits.clone().view(1, -1)
    edit_logits(out, [entry(p, prompt=[0], output=[1, 1, 2])], ())
    out = out[0]
    # token 0: in prompt -> 2/2; token 1: -2*2 - 0.5*2 - 0.25; token 2: 1/2 - 0.5 - 0.25; token 3 untouched
    assert out.tolist() == pytest.approx([1.0, -5.25, -0.25, 1.0])


def test_top_k_top_p_min_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = lambda p: torch.isfinite(filter_logits(logits.view(1, -1), [p])[0]).tolist()  # noqa: E731
    assert kept(SamplingParams(top_k=2)) == [True, True, False, False]
    assert kept(SamplingParams(top_p=0.7)) == [True, True, False, False]     # 0.5 < 0.7, 0.8 crosses
    assert kept(SamplingParams(top_p=0.5)) == [True, False, False, False]
    assert kept(SamplingParams(min_p=0.5)) == [True, True, False, False]     # >= 0.25
    assert filter_logits(logits.view(1, -1), [SamplingParams(temperature=2.0)])[0, 0] == pytest.approx(math.log(0.5) / 2)


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


def test_each_row_keeps_its_own_filters_in_a_batch():
    """Rows with different top-k / top-p / min-p / temperature in one batch: each sampled token lies
    in the set its own parameters allow (computed row by row), and every row gets its full share."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 40, generator=gen) * 3
    params = [SamplingParams(top_k=3), SamplingParams(top_p=0.5), SamplingParams(min_p=0.3),
              SamplingParams(temperature=0.5, top_k=5, top_p=0.9), SamplingParams(), SamplingParams(top_k=1)]
    allowed = [set(torch.isfinite(filter_logits(logits[r: r + 1], [p])[0]).nonzero().flatten().tolist())
               for r, p in enumerate(params)]
    batched = torch.isfinite(filter_logits(logits, params))
    assert [set(row.nonzero().flatten().tolist()) for row in batched] == allowed
    seen = [set() for _ in params]
    for _ in range(300):
        for r, (token, _) in enumerate(sample_batch(logits, [entry(p) for p in params], (), gen)):
            assert token in allowed[r]
            seen[r].add(token)
    assert seen[0] == allowed[0] and seen[5] == allowed[5] == {int(logits[5].argmax())}


def test_a_mixed_batch_gives_each_request_what_it_gets_alone():
    """Greedy with edits, seeded sampling and logprobs in one batch: the same tokens and logprobs as
    each request sampled on its own (seeded rows do not depend on the rest of the batch)."""
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(4))
    entries = [entry(SamplingParams(temperature=0, logit_bias={7: 100.0})),
               entry(SamplingParams(seed=11, top_p=0.8, logprobs=3), output=[1, 2]),
               entry(SamplingParams(temperature=0, repetition_penalty=1.5, logprobs=0), prompt=[4, 5]),
               entry(SamplingParams(seed=12, top_k=4)),
               entry(SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(9,)), output=[1])]
    batch = sample_batch(logits, entries, eos_token_ids={int(logits[4].argmax())}, generator=None)
    alone = [sample_one(logits[r], e, {int(logits[4].argmax())}, None) for r, e in enumerate(entries)]
    assert [t for t, _ in batch] == [t for t, _ in alone]
    assert batch[0][0] == 7 and batch[4][0] != int(logits[4].argmax())
    for (_, a), (_, b) in zip(batch, alone, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert len(batch[1][1].top) == 3 and batch[2][1].top == []
