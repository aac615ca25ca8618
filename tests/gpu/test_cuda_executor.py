"""CudaExecutor against the reference: the logits of every sampled row (fused and grouped decode
steps, prompt steps), BF16 and NVFP4, graphs on and off, contexts past the 513 window, batches from
1 to past the fused path's 8, mixed lengths in one batch."""

import dataclasses
import importlib

import pytest
import torch

from flint_sched.checkpoint.make import dummy_checkpoint
from flint_sched.config import flint_layer_types, preset
from flint_sched.core.scheduler import Scheduler
from flint_sched.core.scheduler_config import SchedulerConfig
from flint_sched.executor import dense_copies, kernel_ops, moe_gemms
from flint_sched.executor.cuda_executor import CudaExecutor
from flint_sched.executor.dense_copies import copies_bytes
from flint_sched.executor.kv_cache import KVCache
from flint_sched.kernels import grouped_moe
from flint_sched.kernels.grouped import CUBLAS_MIN_ROWS_NVFP4
from flint_sched.model.reference import FlintReference
from flint_sched.sampling_params import SamplingParams
from executor_checks import assert_same_bits, check_against_reference, ckpt, run  # noqa: F401 - ckpt: the fixture
from gpu_checks import MAX_MODEL_LEN

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("cluster_router,fold_norms,persistent,split", [
    (True, False, False, False), (False, False, False, False), (True, True, False, False), (True, False, True, False),
    (True, False, False, True)], ids=["cluster-router", "ticket-router", "folded-norms", "persistent", "moe-split"])
def test_decode_logits_match_the_reference(ckpt, cluster_router, fold_norms, persistent, split, monkeypatch):
    """Fused decode steps (both routers of kernels/moe.py: CLUSTER_ROUTER; the norms before q/k/v and
    the LM head folded into their GEMVs: kernel_ops.FOLD_NORMS; the layers as one persistent launch
    a graph: kernel_ops.PERSISTENT; the MoE's gate/up and down in one launch at every fused batch:
    kernel_ops.MOE_SPLIT_MAX_ROWS, where its shapes fit) against the reference."""
    moe_kernels = importlib.import_module("flint_sched.kernels.moe")   # the package exports a function `moe`
    monkeypatch.setattr(moe_kernels, "CLUSTER_ROUTER", cluster_router)
    monkeypatch.setattr(kernel_ops, "FOLD_NORMS", fold_norms)
    monkeypatch.setattr(kernel_ops, "PERSISTENT", persistent)
    monkeypatch.setattr(kernel_ops, "MOE_SPLIT_MAX_ROWS", 8 if split else 0)
    splits = []
    moe_split = kernel_ops.moe_split
    monkeypatch.setattr(kernel_ops, "moe_split", lambda *a, **kw: splits.append(1) or moe_split(*a, **kw))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (5, 600, 37)]
    decode_logits, outputs, _ = run(ckpt, prompts, max_tokens=6)
    assert len(decode_logits) == 3 * 6
    c = ckpt.config
    fits = moe_kernels.moe_split_fits(ckpt.weight_format, c.hidden_size, c.moe_intermediate_size, 3)
    assert bool(splits) == (split and fits)
    check_against_reference(ckpt, prompts, decode_logits, outputs)


def test_grouped_decode_batches_match_the_reference(ckpt):
    """40 requests decoding together (the grouped path, padded to a graph of 48), then fewer as
    they finish (down through the fused sizes); prompts on both sides of the 513 window."""
    gen = torch.Generator().manual_seed(3)
    lengths = [int(n) for n in torch.randint(1, 700, (40,), generator=gen)]
    prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in lengths]
    limits = [int(n) for n in torch.randint(2, 14, (40,), generator=gen)]
    decode_logits, outputs, _ = run(ckpt, prompts, limits, seqs=40, num_blocks=2048, budget=4096)
    assert {"grouped", "fused", "prompt"} <= run.paths
    assert len(decode_logits) == sum(limits)
    check_against_reference(ckpt, prompts, decode_logits, outputs)


@pytest.mark.parametrize("router_gemv", [16, 0], ids=["gemv-router", "cublas-router"])
def test_grouped_decode_of_9_to_16_requests(ckpt, router_gemv, monkeypatch):
    """16 requests decoding in the graph of 16, then fewer (9-15 real rows), the router's logits on
    the GEMV (grouped_moe.ROUTER_GEMV_MAX_ROWS; off by default: slower in the full model at 16
    requests, session 15) or on cuBLAS."""
    monkeypatch.setattr(grouped_moe, "ROUTER_GEMV_MAX_ROWS", router_gemv)
    gen = torch.Generator().manual_seed(6)
    lengths = [int(n) for n in torch.randint(1, 300, (16,), generator=gen)]
    prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in lengths]
    limits = [2 + n % 3 for n in range(16)]
    decode_logits, outputs, _ = run(ckpt, prompts, limits, seqs=16, num_blocks=1024, budget=4096)
    assert "grouped" in run.paths
    check_against_reference(ckpt, prompts, decode_logits, outputs)


@pytest.mark.parametrize("num_blocks", [512, 24], ids=["roomy", "preempting"])
def test_block_tables_follow_rows_changes_torch_steps_and_preemption(ckpt, num_blocks):
    """Requests finish at different times (rows change owner), more than 8 decode at times (those
    steps run on the grouped path while the fused one's block tables go stale), decodes cross
    several block boundaries, and with 24 blocks requests are preempted and recomputed."""
    gen = torch.Generator().manual_seed(1)
    lengths = [3, 40, 17, 90, 1, 60, 33, 8, 70, 25, 50]
    prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in lengths]
    limits = [40, 5, 37, 12, 45, 20, 3, 41, 30, 9, 35]
    decode_logits, outputs, preemptions = run(ckpt, prompts, limits, seqs=10, num_blocks=num_blocks)
    assert all(len(outputs[f"r{n}"]) == limit for n, limit in enumerate(limits))
    assert (preemptions > 0) == (num_blocks == 24)
    # 24 blocks never hold 9 requests (NVFP4 steps of 7-8 run grouped too: FUSED_PATH_MAX_BATCH)
    assert "grouped" in run.paths or num_blocks == 24
    check_against_reference(ckpt, prompts, decode_logits, outputs)


def test_prompt_logprobs_match_the_reference(ckpt):
    """Prompt logprobs from the prompt path's extra LM-head rows, over three prefill chunks.
    NOTE: written without a GPU at hand (structured-output branch); the bound follows the logits
    check below (bf16: relative error near 1e-2)."""
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 4096, (300,), generator=gen).tolist()
    config = ckpt.config
    kv = KVCache(config, 512, 16, 2, torch.bfloat16, "cuda")
    ex = CudaExecutor(config, ckpt.weights, kv, (), MAX_MODEL_LEN, "cuda")
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=128, num_blocks=512,
                                      max_model_len=MAX_MODEL_LEN, block_size=16, sliding_window=config.sliding_window,
                                      fused_max_seqs=ex.limits.fused_max_batch))
    sched.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1, ignore_eos=True))
    got = {}
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        result = ex.execute(plan)
        for chunk in (result.prompt_logprobs or {}).values():
            got.update({chunk.first_position + i: entry.logprob for i, entry in enumerate(chunk.entries)})
        sched.update(plan, result)
    assert sorted(got) == list(range(1, len(prompt)))
    ref = FlintReference(config, ckpt.weights, dtype=torch.float32, device="cuda")
    want = torch.log_softmax(ref.forward(prompt), dim=-1)
    expected = want[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].cpu()
    actual = torch.tensor([got[p] for p in range(1, len(prompt))])
    assert float((actual - expected).norm() / expected.norm()) < 2e-2


@pytest.fixture(scope="module", params=["bf16", "nvfp4"])
def full_size_layers(request):
    """Flint's own layers (hidden 2048, 32/4 heads, 256 experts of 512), the first four of them
    (two dense, a sliding and a full-attention MoE layer), with a small vocabulary."""
    config = dataclasses.replace(preset("flint"), num_hidden_layers=4, layer_types=tuple(flint_layer_types(4)),
                                 vocab_size=4096, max_position_embeddings=MAX_MODEL_LEN)
    return dummy_checkpoint(config, request.param, seed=6, device="cuda")


@pytest.mark.parametrize("persistent", [False, True], ids=["launches", "persistent"])
def test_every_layers_output_matches_the_reference(ckpt, persistent, monkeypatch):
    """Each layer's output, from the launches or from the persistent step (kernel_ops.PERSISTENT: a
    launch a layer, so that each output can be read)."""
    monkeypatch.setattr(kernel_ops, "PERSISTENT", persistent)
    check_layer_outputs(ckpt)


@pytest.mark.parametrize("persistent", [False, True], ids=["launches", "persistent"])
def test_full_size_layers_match_the_reference(full_size_layers, persistent, monkeypatch):
    monkeypatch.setattr(kernel_ops, "PERSISTENT", persistent)
    check_layer_outputs(full_size_layers)


def check_layer_outputs(ckpt, decode_steps=6):
    """Each layer's output hidden state of the first decode steps (fused path, after a prompt step
    on the grouped GEMMs), against the fp32 reference's. A bf16 rounding now and then flips one of
    a token's routed experts among 256 near-tied scores (the bf16 reference does the same), which
    moves that token's layer output by ~0.1; so: the median over the steps tight, each one loose."""
    prompt = torch.randint(0, 4096, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    config = ckpt.config
    kv = KVCache(config, 64, 16, 1, torch.bfloat16, "cuda")
    ex = CudaExecutor(config, ckpt.weights, kv, (), MAX_MODEL_LEN, "cuda", use_graphs=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=256, num_blocks=64,
                                      max_model_len=MAX_MODEL_LEN, block_size=16,
                                      sliding_window=config.sliding_window, fused_max_seqs=8))
    sched.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=decode_steps + 1, ignore_eos=True))
    tokens, steps = [], []
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        decode = plan.path == "fused" and plan.num_tokens == 1
        ex.layer_outputs = [] if decode else None
        for out in sched.update(plan, ex.execute(plan)):
            tokens.extend(out.new_token_ids)
        if decode:
            assert len(ex.layer_outputs) == config.num_hidden_layers
            steps.append((plan.scheduled_requests[0].start_position, ex.layer_outputs))
    assert len(steps) == decode_steps
    expected = []
    FlintReference(config, ckpt.weights, dtype=torch.float32, device="cuda").forward(
        prompt + tokens[:decode_steps], hidden_out=expected)
    for i in range(config.num_hidden_layers):
        errors = sorted(float((outputs[i][0].float() - expected[i][pos]).norm() / expected[i][pos].norm())
                        for pos, outputs in steps)
        assert errors[len(errors) // 2] < 2e-2 and errors[-1] < 0.3, f"layer {i}: relative errors {errors}"


@pytest.mark.parametrize("first_graph_layers", [0, 1])
def test_graphs_with_pdl_replay_the_eager_step_exactly(ckpt, first_graph_layers):
    """One graph for the step, or graphs of 1, 4 and 2 layers (the first with the embedding, the
    last with the LM head): the same logits, bit for bit, as eager launches without PDL. (Prompt
    steps eager in both: their graphs pad the rows, which may change cuBLAS's kernels; next test.)"""
    prompts = [[1, 2, 3, 4, 5], list(range(100, 140))]
    eager, out_eager, _ = run(ckpt, prompts, 4, use_graphs=False, pdl=False)
    graphed, out_graphed, _ = run(ckpt, prompts, 4, use_graphs=True, first_graph_layers=first_graph_layers,
                                  prompt_graph_tokens=())
    assert out_eager == out_graphed
    for (r1, p1, a), (r2, p2, b) in zip(eager, graphed):
        assert (r1, p1) == (r2, p2) and torch.equal(a, b)


def test_dense_bf16_copies_change_no_logit(ckpt, monkeypatch):
    """NVFP4: the bf16 copies of the dense weights (executor/dense_copies.py) give the same logits, bit
    for bit, as dequantizing them in every step (grouped decode batches and prompt steps); BF16: none.
    (Both from the rows where the launcher dequantizes for cuBLAS: the copies serve fewer rows too.)"""
    monkeypatch.setattr(dense_copies, "COPY_MIN_ROWS", CUBLAS_MIN_ROWS_NVFP4)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 4096, (int(n),), generator=gen).tolist() for n in torch.randint(1, 300, (20,))]
    with_copies, out_with, _ = run(ckpt, prompts, 5, seqs=20, num_blocks=1024, budget=1024)
    copies = run.executor.weights.copies
    assert {"grouped", "prompt"} <= run.paths
    without, out_without, _ = run(ckpt, prompts, 5, seqs=20, num_blocks=1024, budget=1024, dense_copies=False)
    if ckpt.weight_format == "bf16":
        assert copies is None
    else:
        assert copies.nbytes == copies_bytes(ckpt.weights) > 0
        assert len(copies.qkv) == ckpt.config.num_hidden_layers
    assert_same_bits((without, out_without), (with_copies, out_with))


@pytest.mark.parametrize("flag", ["FUSE_QK_ATTENTION", "ROUTER_NORMS", "LM_HEAD_ARGMAX"],
                         ids=["qk_norm_inside", "router_norms", "lm_head_argmax"])
def test_a_launch_folded_into_the_next_changes_no_logit(ckpt, monkeypatch, flag):
    """Fused decode steps whose attention kernels do the Q/K norms, RoPE and K/V write
    (kernel_ops.FUSE_QK_ATTENTION: cuda/decode_attention_qk.cu), whose router does the norm before
    the MoE (kernel_ops.ROUTER_NORMS), or whose LM head makes the greedy choice itself
    (kernel_ops.LM_HEAD_ARGMAX), give the launches' logits and tokens bit for bit, graphs and eager,
    prompts on both sides of the window, 1 to 6 rows."""
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (3, 600, 37, 515, 90, 1)]
    limits = [2, 7, 3, 6, 4, 5]
    monkeypatch.setattr(kernel_ops, flag, False)
    apart, out_apart, _ = run(ckpt, prompts, limits, seqs=6, budget=4096)
    monkeypatch.setattr(kernel_ops, flag, True)
    normalizing, lm_head = [], []
    route = kernel_ops.route
    monkeypatch.setattr(kernel_ops, "route", lambda *a, **kw: normalizing.append("norm_weight" in kw) or route(*a, **kw))
    linear, greedy = kernel_ops.linear, kernel_ops.greedy
    monkeypatch.setattr(kernel_ops, "linear", lambda *a, **kw: lm_head.append(
        3 if kw.get("argmax_out") is not None else 0) or linear(*a, **kw))
    monkeypatch.setattr(kernel_ops, "greedy", lambda *a, **kw: lm_head.append(4) or greedy(*a, **kw))
    for graphs in (True, False):
        inside, out_inside, _ = run(ckpt, prompts, limits, seqs=6, budget=4096, use_graphs=graphs)
        assert "fused" in run.paths
        if flag == "FUSE_QK_ATTENTION":
            assert run.executor.ws._q_slots is not None
        elif flag == "ROUTER_NORMS":
            assert normalizing and all(normalizing)
        else:                           # every step's LM head runs on the GEMVs here (<= 16 rows)
            assert 3 in lm_head and 4 not in lm_head
        assert_same_bits((apart, out_apart), (inside, out_inside))


def test_fused_norms_change_no_logit(ckpt, monkeypatch):
    """The RMSNorms done in the launch that writes their row (moe_finalize_norm, the residual
    epilogue after cuBLAS) give the same logits, bit for bit, as a launch of their own (grouped
    decode batches and prompt steps, graphs with several segments)."""
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 4096, (int(n),), generator=gen).tolist() for n in torch.randint(1, 300, (20,))]
    fused, out_fused, _ = run(ckpt, prompts, 5, seqs=20, num_blocks=1024, budget=1024)
    assert {"grouped", "prompt"} <= run.paths
    monkeypatch.setattr(kernel_ops, "FUSE_NORMS", False)
    apart, out_apart, _ = run(ckpt, prompts, 5, seqs=20, num_blocks=1024, budget=1024)
    assert_same_bits((apart, out_apart), (fused, out_fused))


def test_prompt_graphs_match_eager_prompt_steps(ckpt):
    """Prompt steps replayed from graphs of padded row counts (several sizes, each replayed with other
    chunks: prompts read in chunks across the window, beside running decodes) give the logits of
    eager prompt steps within bf16 rounding, and the same greedy tokens."""
    # budget 512: steps of 512, 512, 512 rows, then 2 decodes + 71 + 20 prompt rows (the 128-row graph).
    # Each step's MoE runs the same kernels eagerly and from its graph (not so for a 173-row step in
    # the 256-row graph: bf16's tiled expert GEMMs start at 256 rows, and a near-tied expert can flip).
    prompts = [list(range(3, 603)), [7] * 5, list(range(50, 1050)), list(range(9, 29))]
    eager, out_eager, _ = run(ckpt, prompts, 6, use_graphs=False, budget=512)
    graphed, out_graphed, _ = run(ckpt, prompts, 6, budget=512)
    sizes = sorted(k[1] for k in run.executor.graphs.graphs if k[0] == "prompt")
    assert len(sizes) >= 2, sizes
    assert out_eager == out_graphed
    for (r1, p1, a), (r2, p2, b) in zip(eager, graphed, strict=True):
        assert (r1, p1) == (r2, p2)
        assert float((a - b).norm() / a.norm()) < 1e-2, (r1, p1)


def test_mixed_steps_on_the_hybrid_expert_gemms(ckpt, monkeypatch):
    """Mixed steps (decodes beside prompt chunks) of 64+ rows on the hybrid expert GEMMs
    (HYBRID_MIXED_MIN_ROWS), eager and from their own graphs, against the reference, and against the
    same steps on the GEMMs chosen by size: mostly within bf16 rounding, a position now and then
    further off where the other summation order flips a near-tied routed expert (r3's 22nd position
    moved by 0.11 on the small NVFP4 config, H200). Weights without the decode GEMMs (BF16,
    flint-tiny) keep the size's choice and need no graphs of their own."""
    prompts = [list(range(3, 603)), [7] * 5, list(range(50, 1050)), list(range(9, 29))]
    monkeypatch.setattr(moe_gemms, "HYBRID_MIXED_MIN_ROWS", 0)
    plain, _, _ = run(ckpt, prompts, 6, budget=512)
    monkeypatch.setattr(moe_gemms, "HYBRID_MIXED_MIN_ROWS", 64)
    eager, eager_out, _ = run(ckpt, prompts, 6, use_graphs=False, budget=512)
    graphed, graphed_out, _ = run(ckpt, prompts, 6, budget=512)
    hybrid_graphs = [k for k in run.executor.graphs.graphs if k[0] == "prompt" and k[-1] == "hybrid"]
    assert bool(hybrid_graphs) == run.executor._hybrid_moe
    check_against_reference(ckpt, prompts, eager, eager_out)
    check_against_reference(ckpt, prompts, graphed, graphed_out)
    for other in (eager, graphed):
        errors, diverged = [], set()
        for (r1, p1, a), (r2, p2, b) in zip(plain, other, strict=True):
            assert (r1, p1) == (r2, p2)
            if r1 not in diverged:
                errors.append(float((a - b).norm() / a.norm()))
            if int(a.argmax()) != int(b.argmax()):
                diverged.add(r1)
        errors.sort()
        assert errors[len(errors) // 2] < 1e-2 and errors[-1] < 0.4, errors


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16-kv", "e4m3-kv"])
def test_decodes_beside_prompt_chunks_attend_apart(ckpt, kv_dtype, monkeypatch):
    """A prompt step's leading decodes on the decode kernel (kernel_ops.DECODES_APART; sliding layers
    put their new key in the ring first), eager and from the prompt graphs, bf16 and e4m3 caches:
    against the reference, and the eager steps did send decodes apart (none with the option off)."""
    prompts = [list(range(3, 603)), [7] * 5, list(range(50, 1050)), list(range(9, 29))]
    seen = []
    attend = kernel_ops.KernelOps._prefill_attention

    def recording(self, i, qkv):
        seen.append(self.prefill.num_decodes)
        return attend(self, i, qkv)

    monkeypatch.setattr(kernel_ops.KernelOps, "_prefill_attention", recording)
    typical = 3e-2 if kv_dtype == torch.float8_e4m3fn else 1.5e-2
    for graphs in (False, True):
        seen.clear()
        logits, out, _ = run(ckpt, prompts, 6, use_graphs=graphs, budget=512, kv_dtype=kv_dtype)
        check_against_reference(ckpt, prompts, logits, out, kv_dtype=None if kv_dtype == torch.bfloat16 else kv_dtype,
                                typical=typical)
        assert max(seen) >= 1
    monkeypatch.setattr(kernel_ops, "DECODES_APART", False)
    seen.clear()
    run(ckpt, prompts, 2, use_graphs=False, budget=512, kv_dtype=kv_dtype)
    assert seen and max(seen) == 0


def test_an_fp8_kv_cache_matches_the_reference_reading_the_same_rounded_keys(ckpt):
    """--kv-cache-dtype fp8: prompts in chunks (full layers reading their own keys back from the
    e4m3 pool, sliding layers their ring's history) and decodes of mixed lengths on both sides of
    the window, on graphs, against the reference whose attention reads the same e4m3 keys."""
    gen = torch.Generator().manual_seed(12)
    lengths = (5, 600, 37, 1200)
    prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in lengths]
    decode_logits, outputs, _ = run(ckpt, prompts, 12, budget=512, kv_dtype=torch.float8_e4m3fn)
    assert run.executor.kv.full.dtype == torch.float8_e4m3fn
    check_against_reference(ckpt, prompts, decode_logits, outputs, kv_dtype=torch.float8_e4m3fn, typical=3e-2)


def test_graph_sampler_keeps_each_rows_filters_and_greedy_rows():
    """The CUDA-graph sampler over a batch of mixed rows: every token in the set its row's own
    top-k / top-p / min-p allow (filter_logits), greedy rows the argmax, and a two-token row drawn
    in proportion to its probabilities."""
    from flint_sched.core.plan import ScheduledRequest
    from flint_sched.executor.graph_sampler import GraphSampler
    from flint_sched.executor.sampler import filter_logits

    gen = torch.Generator(device="cuda").manual_seed(0)
    torch.cuda.manual_seed(0)                                 # the sampler's noise
    logits = (3 * torch.randn(8, 1000, device="cuda", generator=gen)).bfloat16()
    greedy = logits.float().argmax(-1)
    params = [SamplingParams(temperature=0.8, top_k=5), SamplingParams(temperature=0), SamplingParams(top_p=0.6),
              SamplingParams(min_p=0.2, temperature=1.5), SamplingParams(temperature=0.7, top_k=2),
              SamplingParams(top_k=50, top_p=0.9, min_p=0.05), SamplingParams(), SamplingParams(temperature=0)]
    entries = [ScheduledRequest(f"r{n}", [0], 0, [], n, True, p, [0], [], False) for n, p in enumerate(params)]
    allowed = [{int(greedy[r])} if p.is_greedy else
               set(torch.isfinite(filter_logits(logits[r: r + 1].float(), [p])[0]).nonzero().flatten().tolist())
               for r, p in enumerate(params)]
    sampler = GraphSampler(logits, greedy)
    counts = [dict() for _ in params]
    for _ in range(400):
        for r, token in enumerate(sampler(entries).tolist()):
            assert token in allowed[r], f"row {r}: token {token} outside {sorted(allowed[r])[:10]}"
            counts[r][token] = counts[r].get(token, 0) + 1
    assert counts[1] == {int(greedy[1]): 400} and counts[7] == {int(greedy[7]): 400}
    assert set(counts[0]) == allowed[0] and len(allowed[0]) >= 5          # bf16 ties at the 5th are kept
    kept = sorted(allowed[4])
    expected = torch.softmax(logits[4, kept].float() / 0.7, -1)
    drawn = torch.tensor([counts[4].get(t, 0) / 400 for t in kept])
    assert (drawn - expected.cpu()).abs().max() < 0.08, (drawn, expected)
    assert sampler(entries[6:7]).numel() == 1 and len(sampler.graphs) == 2      # a graph per (batch, masks in use)


def test_prefix_cache_hits_match_the_reference(ckpt):
    """An agent's turns, one after another: each prompt is the last one, its output and new tokens
    (700 tokens first: past the 513 window, ending mid-block). Later turns restore the rings from the
    last turn's snapshot and share its blocks, and their logits match the reference as a cold run's do."""
    config, block_size, num_blocks, seqs, snapshots = ckpt.config, 16, 512, 2, 2
    kv = KVCache(config, num_blocks, block_size, seqs + snapshots, torch.bfloat16, "cuda")
    ex = CudaExecutor(config, ckpt.weights, kv, (), MAX_MODEL_LEN, "cuda")
    sched = Scheduler(SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=256, num_blocks=num_blocks,
                                      max_model_len=MAX_MODEL_LEN, block_size=block_size,
                                      sliding_window=config.sliding_window, fused_max_seqs=ex.limits.fused_max_batch,
                                      enable_prefix_caching=True, num_ring_snapshots=snapshots))
    gen = torch.Generator().manual_seed(7)
    prompts, decode_logits, outputs = [], [], {}
    for n, new_tokens in enumerate((700, 40, 300)):
        last = prompts[-1] + outputs[f"r{n - 1}"] if prompts else []
        prompts.append(last + torch.randint(config.vocab_size, (new_tokens,), generator=gen).tolist())
        sched.add_request(f"r{n}", prompts[-1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        outputs[f"r{n}"] = []
        while sched.has_unfinished_requests():
            plan = sched.schedule()
            result = ex.execute(plan)
            sampling = [e for e in plan.scheduled_requests if e.samples]
            for e, row in zip(sampling, ex.last_logits, strict=True):
                decode_logits.append((e.request_id, e.end_position - 1, row.float().clone()))
            for out in sched.update(plan, result):
                outputs[out.request_id].extend(out.new_token_ids)
    # hits at the previous prompts' last block boundaries: 688 (of 700) and 736 (of 746)
    assert sched.prefix_cache.num_hit_tokens == 688 + 736
    check_against_reference(ckpt, prompts, decode_logits, outputs)


def test_a_sampled_eager_prompt_step_draws_on_the_device(ckpt):
    """A prompt step run eagerly (no prompt graph fits) whose requests sample (temperature > 0, the
    OpenAI default) draws on the device from the workspace's logits: the launch leaves its tokens in
    flight (a timed done event, no host result), and a row that can only take its argmax (top_k 1)
    gets the greedy token."""
    config, block_size, num_blocks, seqs = ckpt.config, 16, 256, 4
    kv = KVCache(config, num_blocks, block_size, seqs, torch.bfloat16, "cuda")
    ex = CudaExecutor(config, ckpt.weights, kv, (), MAX_MODEL_LEN, "cuda", prompt_graph_tokens=())
    sched = Scheduler(SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=512, num_blocks=num_blocks,
                                      max_model_len=MAX_MODEL_LEN, block_size=block_size,
                                      sliding_window=config.sliding_window, fused_max_seqs=ex.limits.fused_max_batch))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(config.vocab_size, (n,), generator=gen).tolist() for n in (37, 90, 5)]
    params = [SamplingParams(temperature=0.9, top_k=1), SamplingParams(temperature=1.0), SamplingParams(temperature=0)]
    for n, (prompt, p) in enumerate(zip(prompts, params)):
        sched.add_request(f"r{n}", prompt, dataclasses.replace(p, max_tokens=2, ignore_eos=True))
    plan = sched.schedule()
    assert not plan.is_decode_only and all(e.samples for e in plan.scheduled_requests)
    launched = ex.launch(plan)
    assert launched.result is None and launched.done is not None      # tokens on the device, not on the host
    tokens = ex.collect(launched).sampled_token_ids
    greedy = ex.last_logits.float().argmax(-1).tolist()
    assert tokens["r0"] == [greedy[0]] and tokens["r2"] == [greedy[2]]
    assert 0 <= tokens["r1"][0] < config.vocab_size


@pytest.mark.parametrize("gumbel", [False, True], ids=["softmax-race", "gumbel-max"])
def test_graph_sampler_calls_ahead_of_the_gpu_keep_their_own_parameters(gumbel, monkeypatch):
    """Host calls that run ahead of a busy GPU (a mixed step samples twice, and the next step is
    launched while it runs): each call's parameters reach the GPU as they were, not overwritten by a
    later call's through a reused pinned buffer. Greedy rows must keep the argmax even when the calls
    after them sample at temperature 2 from nearly flat logits."""
    from flint_sched.core.plan import ScheduledRequest
    from flint_sched.executor.graph_sampler import GraphSampler

    from flint_sched.executor import graph_sampler
    monkeypatch.setattr(graph_sampler, "GUMBEL_MAX", gumbel)    # temperature alone: kernels/sampling.py sample
    logits = torch.zeros(8, 1000, device="cuda", dtype=torch.bfloat16)
    logits[:, 7] = 0.5                                          # the argmax; a hot draw takes it ~0.2 % of the time
    greedy = logits.float().argmax(-1)
    sampler = GraphSampler(logits, greedy)

    def batch(params):
        return [ScheduledRequest(f"r{n}", [0], 0, [], n, True, params, [0], [], False) for n in range(8)]

    cold, hot = batch(SamplingParams(temperature=0)), batch(SamplingParams(temperature=2.0))
    sampler(cold), sampler(hot)                                 # capture both graphs first
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)                              # ~0.1 s: the host runs ahead of the GPU
    drawn = [sampler(params).clone() for params in (cold, hot, hot, hot, hot, hot, cold, hot)]
    assert drawn[0].tolist() == [7] * 8 and drawn[6].tolist() == [7] * 8
    assert any(t != 7 for t in drawn[1].tolist() + drawn[2].tolist())   # the hot calls did draw
