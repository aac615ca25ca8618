"""Greedy token choice (cuda/argmax.cu) against torch.argmax: exact, including ties and NaN; and
temperature sampling by the Gumbel-max trick against softmax(logits / temperature)."""

import pytest
import torch

from flint_sched.kernels import argmax_workspace, greedy
from flint_sched.kernels.sampling import rng_state, sample

pytestmark = pytest.mark.gpu


def logits(b: int, v: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, v, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("out_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("v", [151552, 4097, 1000, 7])
@pytest.mark.parametrize("b", [1, 3, 8])
def test_greedy_matches_torch_argmax(b, v, dtype, out_dtype):
    x = logits(b, v, dtype, seed=b * v)
    out = torch.full((b,), -1, dtype=out_dtype, device="cuda")
    greedy(x, out=out)
    assert torch.equal(out, torch.argmax(x, dim=-1).to(out_dtype)), f"B={b} V={v} {dtype}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ties_go_to_the_lowest_index(dtype):
    x = logits(4, 151552, dtype, seed=1)
    x[0] = 0.5                                        # all equal
    x[1, [70000, 5, 150000]] = 100.0                  # several maxima in different CTAs
    x[2, 151551] = 100.0                              # the very last element
    x[3, :] = float("-inf")                           # all -inf
    assert greedy(x).tolist() == [0, 5, 151551, 0]


def test_signed_zeros_tie_and_nan_wins():
    x = torch.full((2, 3000), float("-inf"), device="cuda")
    x[0, 2100], x[0, 17] = 0.0, -0.0                  # -0 == +0: the lower index
    x[1, 5], x[1, 2999], x[1, 1200] = 1.0, float("nan"), float("nan")
    assert greedy(x).tolist() == [17, 1200]


def test_strided_rows_take_the_scalar_path():
    wide = logits(3, 1003, torch.bfloat16, seed=2)
    x = wide[:, :1001]                                # row stride 1003: not 16-byte aligned
    assert torch.equal(greedy(x), torch.argmax(x, dim=-1).int())


def test_workspace_reuse_and_cuda_graph():
    b, v = 8, 151552
    x = logits(b, v, torch.bfloat16, seed=3)
    workspace = argmax_workspace(b, v, "cuda")
    out = torch.empty(b, dtype=torch.int64, device="cuda")
    greedy(x, out=out, workspace=workspace)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        greedy(x, out=out, workspace=workspace)
    for seed in (4, 5, 6):
        x.copy_(logits(b, v, torch.bfloat16, seed=seed))
        out.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.argmax(x, dim=-1)), f"graph replay with seed {seed}"
    assert workspace[-1].item() == 0, "ticket not reset"
    for batch in (1, 5):                               # a smaller batch fits the same workspace
        assert torch.equal(greedy(x[:batch], workspace=workspace), torch.argmax(x[:batch], dim=-1).int())


def test_an_inactive_flag_leaves_the_choice_out_in_a_graph():
    """`active` 0 on the device when the graph replays: out is left as it was and the ticket stays
    0 (the next active replay is right); 1: the argmax."""
    b, v = 16, 151552
    x = logits(b, v, torch.bfloat16, seed=7)
    workspace = argmax_workspace(b, v, "cuda")
    out = torch.full((b,), -1, dtype=torch.int64, device="cuda")
    active = torch.zeros(1, dtype=torch.int32, device="cuda")
    greedy(x, out=out, workspace=workspace, active=active)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        greedy(x, out=out, workspace=workspace, active=active)
    for flag in (0, 1, 0, 1):
        x.copy_(logits(b, v, torch.bfloat16, seed=8 + flag))
        out.fill_(-1)
        active.fill_(flag)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.argmax(x, dim=-1) if flag else torch.full_like(out, -1)), f"active {flag}"
        assert workspace[-1].item() == 0, "ticket not reset"
    with pytest.raises(ValueError, match="active"):
        greedy(x, out=out, active=torch.zeros(2, dtype=torch.int32, device="cuda"))


def frequencies(x: torch.Tensor, temperature: torch.Tensor, launches: int) -> torch.Tensor:
    """How often each token of x's rows (identical rows) was drawn over `launches` launches."""
    rng = rng_state("cuda")
    counts = torch.zeros(x.shape[1], device="cuda")
    for _ in range(launches):
        counts += torch.bincount(sample(x, temperature, rng), minlength=x.shape[1])
    assert int(rng[1]) == launches, "each launch advances the noise counter"
    return counts / counts.sum()


@pytest.mark.parametrize("v", [4104, 4099])      # 16-byte loads; 4099: rows not 16-byte aligned (scalar loads)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t", [0.7, 1.0, 1.6])
def test_sample_draws_softmax_of_logits_over_temperature(t, dtype, v):
    """Rows of 12 tokens at different logits (the rest -inf, never drawn): 64 rows x 300 launches,
    each token's share within 0.015 of softmax(logits / t)."""
    row = torch.full((v,), float("-inf"), device="cuda")
    hot = torch.tensor([3, 100, 2000, 2001, 4000, v - 1, 7, 8, 9, 10, 11, 12], device="cuda")
    row[hot] = torch.linspace(-1.5, 1.5, len(hot), device="cuda")
    x = row.to(dtype).repeat(64, 1)
    freq = frequencies(x, torch.full((64,), t, device="cuda"), 300)
    expected = torch.softmax(x[0].float() / t, dim=-1)
    assert (freq - expected).abs().max() < 0.015, (freq[hot], expected[hot])
    assert freq[torch.isinf(x[0].float())].sum() == 0


def test_sample_rows_keep_their_own_temperature_and_strided_rows():
    """A cold row (t = 0.01) draws its argmax, a hot one spreads; rows of a strided view (the scalar
    path) draw as well."""
    wide = logits(4, 1003, torch.bfloat16, seed=9)
    x = wide[:, :1001]
    temperature = torch.tensor([0.01, 5.0, 0.01, 5.0], device="cuda")
    rng = rng_state("cuda")
    draws = torch.stack([sample(x, temperature, rng) for _ in range(50)])
    assert (draws[:, 0] == x[0].float().argmax()).all() and (draws[:, 2] == x[2].float().argmax()).all()
    assert len(set(draws[:, 1].tolist())) > 10 and len(set(draws[:, 3].tolist())) > 10


def test_sample_in_a_cuda_graph_draws_anew_each_replay_and_a_seed_repeats():
    b, v = 8, 151552
    x = torch.zeros(b, v, device="cuda", dtype=torch.bfloat16)     # flat: every token as likely
    temperature = torch.ones(b, device="cuda")
    torch.cuda.manual_seed(5)
    rng = rng_state("cuda")
    workspace = argmax_workspace(b, v, "cuda")
    out = torch.empty(b, dtype=torch.int64, device="cuda")
    sample(x, temperature, rng, out=out, workspace=workspace)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sample(x, temperature, rng, out=out, workspace=workspace)
    draws = []
    for _ in range(20):
        graph.replay()
        draws.append(out.clone())
    draws = torch.stack(draws)
    assert len(set(draws.flatten().tolist())) > 150, "replays drew the same noise"
    assert int(rng[1]) == 21                          # one eager launch + 20 replays (capture runs nothing)
    torch.cuda.manual_seed(5)
    again = rng_state("cuda")
    assert torch.equal(again[0], rng[0])
    first = sample(x, temperature, again)
    torch.cuda.manual_seed(5)
    assert torch.equal(sample(x, temperature, rng_state("cuda")), first), "the same seed, the same draws"
