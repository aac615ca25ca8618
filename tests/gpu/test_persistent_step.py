"""The persistent decode step (kernel_ops.PERSISTENT, kernels/decode_step.py) in the CUDA executor,
against the reference and against itself, at every batch size of the fused path (1-8) and at a
100K-token context: the other checks of the fused path that run it too are test_cuda_executor.py's
(fused-decode logits, every layer's output)."""

import dataclasses

import pytest
import torch

from flint_sched.checkpoint.make import dummy_checkpoint
from flint_sched.executor import kernel_ops
from flint_sched.kernels import decode_step
from executor_checks import check_against_reference, ckpt, run  # noqa: F401 - ckpt: the fixture
from gpu_checks import small_real_config

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kv_dtype,warps", [(torch.bfloat16, 8), (torch.float8_e4m3fn, 8), (torch.bfloat16, 4)],
                         ids=["bf16-kv-8-warps", "e4m3-kv-8-warps", "bf16-kv-4-warps"])
def test_persistent_steps_match_the_reference_and_replay_exactly(ckpt, kv_dtype, warps, monkeypatch):
    """kernel_ops.PERSISTENT: 8 requests decoding together (the fused path's most rows), then 7, .., 1 as they
    finish (a step plan each), prompts on both sides of the window, against the reference (from graphs: one a step,
    though the executor's first_graph_layers asks for three, a persistent step being a few launches). The same steps
    eager give the same logits bit for bit (each tile is one CTA's, in a fixed order; the counters are back to zero
    after every launch), and so do the steps with the norms folded into their readers (decode_step.FOLD_NORMS: the
    same norm body in each), with the Q/K norms, RoPE and K/V write done by the attention tasks (FUSE_QK), and
    with the waits where the bodies call pdl_wait (EARLY_WEIGHTS)."""
    monkeypatch.setattr(kernel_ops, "PERSISTENT", True)
    monkeypatch.setattr(decode_step, "WARPS", warps)          # CTAs of 8 warps, one a SM; or of 4, two
    gen = torch.Generator().manual_seed(21)
    prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (3, 600, 37, 515, 90, 1, 260, 700)]
    limits = [2, 9, 4, 7, 3, 8, 5, 6]       # one prompt step, then 8 rows, 7, .., 1 (fused: up to 6 for NVFP4)
    decode_logits, outputs, _ = run(ckpt, prompts, limits, seqs=8, budget=4096, kv_dtype=kv_dtype)
    assert "fused" in run.paths and len(decode_logits) == sum(limits)
    steps = list(run.executor.ws.decode_steps.values())
    assert steps and all(steps), "a fused step ran on the launches: decode_step.supported said no"
    assert all(int(step.counters.abs().sum()) == 0 for step in steps)
    assert {step.rows for step in steps} == set(range(1, run.executor.limits.fused_max_batch + 1))
    assert {step.warps for step in steps} == {warps}
    fused_graphs = [g for key, g in run.executor.graphs.graphs.items() if key[0] == "fused"]
    assert fused_graphs and all(len(g) == 1 for g in fused_graphs)
    check_against_reference(ckpt, prompts, decode_logits, outputs, kv_dtype=kv_dtype,
                            **({"typical": 3e-2} if kv_dtype == torch.float8_e4m3fn else {}))
    eager, out_eager, _ = run(ckpt, prompts, limits, seqs=8, budget=4096, kv_dtype=kv_dtype, use_graphs=False,
                              pdl=False)
    monkeypatch.setattr(decode_step, "FOLD_NORMS", True)      # the tasks normalize their rows: the same bits
    folded, out_folded, _ = run(ckpt, prompts, limits, seqs=8, budget=4096, kv_dtype=kv_dtype)
    monkeypatch.setattr(decode_step, "FUSE_QK", True)         # and attention does the Q/K norms: the same bits
    fused, out_fused, _ = run(ckpt, prompts, limits, seqs=8, budget=4096, kv_dtype=kv_dtype)
    monkeypatch.setattr(decode_step, "FUSE_QK", False)        # the waits where the bodies' pdl_wait is,
    monkeypatch.setattr(decode_step, "FOLD_NORMS", False)     # in every operation but the MoE's
    monkeypatch.setattr(decode_step, "EARLY_WEIGHTS", True)
    early, out_early, _ = run(ckpt, prompts, limits, seqs=8, budget=4096, kv_dtype=kv_dtype)
    assert all(step.early_weights for step in run.executor.ws.decode_steps.values())
    assert out_eager == outputs == out_folded == out_fused == out_early
    for (r1, p1, a), (r2, p2, b), (r4, p4, d), (r5, p5, e), (r6, p6, f) in zip(eager, decode_logits, folded, fused,
                                                                              early, strict=True):
        assert (r1, p1) == (r2, p2) == (r4, p4) == (r5, p5) == (r6, p6)
        assert torch.equal(a, b) and torch.equal(a, d) and torch.equal(a, e) and torch.equal(a, f)


LONG = 100_000


@pytest.fixture(scope="module")
def long_ckpt():
    """The small real-shaped config (two of its seven layers full attention) up to 100K positions."""
    config = dataclasses.replace(small_real_config(), max_position_embeddings=LONG + 1024)
    return dummy_checkpoint(config, "nvfp4", seed=5, device="cuda")


def test_decodes_at_a_100k_context_match_the_reference(long_ckpt, monkeypatch):
    """Issue 17's long case: a 100K-token prompt beside a 700-token one (prompt steps of 16K tokens),
    then decode steps of 2 rows and of 1, from the launches and from the persistent step, against
    the reference (forwarded 1,024 tokens at a time over its KV state; one pass for both runs when
    they choose the same tokens). NVFP4 only: the attention and KV reads the length exercises are
    the same in both formats, and the reference pass over 100K tokens is the test's cost."""
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (LONG, 700)]
    cache = {}
    for persistent in (False, True):
        monkeypatch.setattr(kernel_ops, "PERSISTENT", persistent)
        decode_logits, outputs, _ = run(long_ckpt, prompts, [6, 3], seqs=2, budget=16384, num_blocks=6400,
                                        max_model_len=LONG + 1024)
        assert {"prompt", "fused"} <= run.paths and len(decode_logits) == 9
        steps = [s for s in run.executor.ws.decode_steps.values() if s]
        assert bool(steps) == persistent and all(int(s.counters.abs().sum()) == 0 for s in steps)
        check_against_reference(long_ckpt, prompts, decode_logits, outputs, chunk=1024, cache=cache)
