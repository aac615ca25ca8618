"""The CUDA executor's host-side plumbing, on the CPU: graph batch sizes, the executor's stated
limits, the decode inputs (padding rows, block tables kept on the device across steps, placeholder
tokens fed from the previous step), and the split of a mixed step into its decode rows and its
prompt chunks."""

from types import SimpleNamespace

import pytest
import torch

from flint_sched.core.plan import PLACEHOLDER_TOKEN, ScheduledRequest, StepPlan, StepResult
from flint_sched.executor import cuda_executor
from flint_sched.executor.cuda_executor import FUSED_PATH_MAX_BATCH, ONE_FORWARD_MAX_CONTEXT, CudaExecutor
from flint_sched.executor.graphs import GROUPED_BATCH_SIZES, padded_batch
from flint_sched.config import preset
from flint_sched.executor.kv_cache import KVCache
from flint_sched.executor.limits import ExecutorLimits
from flint_sched.executor.sampled_tokens import SampledTokens
from flint_sched.executor.step_inputs import DecodeInputs
from flint_sched.executor.torch_executor import TorchExecutor
from flint_sched.sampling_params import SamplingParams


def entry(rid, tokens, start, table, slot=0, samples=True):
    return ScheduledRequest(rid, tokens, start, table, slot, samples, SamplingParams(temperature=0), [1], [], False)


def test_batches_take_the_smallest_graph_that_holds_them():
    assert [padded_batch(b, GROUPED_BATCH_SIZES) for b in (1, 9, 16, 17, 200, 256)] == [16, 16, 16, 24, 256, 256]
    assert padded_batch(257, GROUPED_BATCH_SIZES) is None


def test_limits_are_validated_and_the_torch_path_has_no_fused_path():
    assert TorchExecutor.limits.fused_max_batch == 0
    with pytest.raises(ValueError, match="ascending"):
        ExecutorLimits(8, (16, 8))
    with pytest.raises(ValueError, match=">= 0"):
        ExecutorLimits(-1)


def fields(inputs: DecodeInputs) -> list[list[int]]:
    return inputs.flat.view(-1)[:-2].view(7, inputs.max_rows).tolist()


def test_decode_inputs_pad_rows_and_keep_block_tables_across_steps():
    inputs = DecodeInputs(max_rows=4, max_model_len=64, block_size=4, device=torch.device("cpu"))
    dummy = inputs.block_tables_flat.numel() - 1
    inputs.fill([entry("a", [5], 7, [3, 9]), entry("b", [6], 0, [4], slot=2)])
    tokens, positions, lens, slots, index, value, sources = fields(inputs)
    assert tokens[:2] == [5, 6] and sources == [-1] * 4 and positions == [7, 0, -1, -1] and lens == [8, 1, 0, 0] and slots[:2] == [0, 2]
    assert index == [dummy] * 4 and int(inputs.num_rows) == 2          # new rows: copied, no scatter
    assert int(inputs.argmax) == 1                                      # the greedy choice wanted by default
    assert inputs.block_tables[0, :2].tolist() == [3, 9] and inputs.block_tables[1, 0] == 4
    # a grows by one block: one scatter entry, applied by update_block_tables (inside the graph)
    inputs.fill([entry("a", [5], 8, [3, 9, 11]), entry("b", [6], 1, [4], slot=2)], argmax=False)
    assert int(inputs.argmax) == 0 and int(inputs.num_rows) == 2
    index, value = fields(inputs)[4:6]
    assert index[0] == 0 * inputs.block_tables.shape[1] + 2 and value[0] == 11 and index[1:] == [dummy] * 3
    inputs.update_block_tables()
    assert inputs.block_tables[0, :3].tolist() == [3, 9, 11]
    # rows change owner: the new owner's table is copied whole; a finished request is forgotten
    inputs.forget(StepPlan([], 0, "grouped", [], ["a"]))
    inputs.fill([entry("b", [6], 2, [4, 12], slot=2), entry("c", [1], 0, [7])])
    assert inputs.block_tables[0, :2].tolist() == [4, 12] and inputs.block_tables[1, 0] == 7
    with pytest.raises(ValueError, match="max_model_len"):
        inputs.fill([entry("d", [1], 0, list(range(17)))])


def test_a_placeholder_row_is_fed_the_previous_steps_token_on_the_device():
    sampled = SampledTokens(8, torch.device("cpu"))
    first = [entry("a", [5], 7, [3, 9]), entry("b", [6], 0, [4], slot=2)]
    sampled.record(first, torch.tensor([41, 42]))                     # what the previous step sampled
    inputs = DecodeInputs(max_rows=4, max_model_len=64, block_size=4, device=torch.device("cpu"),
                          sampled=sampled.values)
    second = [entry("b", [PLACEHOLDER_TOKEN], 1, [4], slot=2), entry("c", [9], 3, [5])]
    inputs.fill(second, sampled.sources(second))
    assert inputs.fed_tokens(4).tolist() == [42, 9, 0, 0]
    with pytest.raises(RuntimeError, match="did not sample"):
        sampled.sources([entry("z", [PLACEHOLDER_TOKEN], 1, [4])])


class SplitExecutor(CudaExecutor):
    """The dispatch of CudaExecutor without a GPU: decode and prompt parts recorded, logits faked
    (one row per sampled entry holding its request's number)."""

    def __init__(self):                                   # noqa: D107 - no GPU state
        self.grouped_batch_sizes = GROUPED_BATCH_SIZES
        self.limits = ExecutorLimits(FUSED_PATH_MAX_BATCH["nvfp4"])
        self.device = torch.device("cpu")
        self.prompt_graph_tokens = ()
        self.inputs = DecodeInputs(256, 64, 4, torch.device("cpu"))
        self.sampled = SampledTokens(512, torch.device("cpu"))
        self.timeline = None                              # no GPU: no step timing
        self.calls = []

    def _decode(self, entries, variant, rows):
        self.calls.append((variant, rows, [e.request_id for e in entries]))
        self.last_logits = torch.tensor([[float(e.request_id[1:])] for e in entries])
        return entries, None, StepResult({e.request_id: [1] for e in entries})

    def _prompt(self, entries):
        self.calls.append(("prompt", None, [e.request_id for e in entries]))
        sampling = [e for e in entries if e.samples]
        self.last_logits = torch.tensor([[float(e.request_id[1:])] for e in sampling]).reshape(len(sampling), 1)
        return sampling, None, StepResult({e.request_id: [2] for e in sampling})


def test_a_mixed_step_is_one_forward_over_its_decodes_and_prompt_chunks():
    decodes = [entry(f"r{n}", [1], 10, [0, 1, 2]) for n in range(5)]
    prompts = [entry("r100", [1, 2, 3], 0, [5]), entry("r102", [4, 5], 4, [7, 8], samples=False)]
    ex = SplitExecutor()
    result = ex.execute(StepPlan(decodes + prompts, 10, "grouped", [], []))
    assert ex.calls == [("prompt", None, [e.request_id for e in decodes + prompts])]
    assert set(result.sampled_token_ids) == {e.request_id for e in decodes} | {"r100"}


@pytest.mark.parametrize("num_decodes", [63, 64, 200])
def test_a_mixed_step_of_many_decodes_runs_them_apart_where_asked(num_decodes, monkeypatch):
    """From MIXED_SPLIT_MIN_DECODES decode rows (short ones; an option, off by default) a mixed step
    replays their decode graph, then runs its prompt chunks as a step of their own; below, one
    forward over all rows."""
    monkeypatch.setattr(cuda_executor, "MIXED_SPLIT_MIN_DECODES", 64)
    decodes = [entry(f"r{n}", [1], 10, [0, 1, 2]) for n in range(num_decodes)]
    prompts = [entry("r1000", [1, 2, 3], 0, [5]), entry("r1002", [4, 5], 4, [7, 8], samples=False)]
    ex = SplitExecutor()
    result = ex.execute(StepPlan(decodes + prompts, num_decodes + 5, "grouped", [], []))
    ids = [e.request_id for e in decodes]
    if num_decodes < 64:
        assert ex.calls == [("prompt", None, ids + ["r1000", "r1002"])]
    else:
        assert ex.calls == [("grouped", padded_batch(num_decodes, GROUPED_BATCH_SIZES), ids),
                            ("prompt", None, ["r1000", "r1002"])]
    assert set(result.sampled_token_ids) == set(ids) | {"r1000"}
    assert ex.last_logits.flatten().tolist() == [float(n) for n in range(num_decodes)] + [1000.0]


# decode rows: the decodes and r101 (NVFP4: the fused path up to 6)
@pytest.mark.parametrize("num_decodes, variant, rows", [(3, "fused", 4), (5, "fused", 6), (6, "grouped", 16),
                                                        (12, "grouped", 16)])
def test_a_mixed_step_with_a_long_decode_runs_its_decodes_from_a_graph_and_its_prompts_eagerly(num_decodes, variant,
                                                                                               rows):
    long = ONE_FORWARD_MAX_CONTEXT         # one decode this long takes the split
    decodes = [entry(f"r{n}", [1], long if n == 0 else 10, [0, 1, 2]) for n in range(num_decodes)]
    prompts = [entry("r100", [1, 2, 3], 0, [5]), entry("r101", [4], 0, [6], samples=True),
               entry("r102", [4, 5], 4, [7, 8], samples=False)]
    ex = SplitExecutor()
    # the scheduler's order: running decodes, then prompt chunks (a one-token chunk that samples
    # counts as a decode row)
    result = ex.execute(StepPlan(decodes + prompts, num_decodes + 6, "grouped", [], []))
    assert ex.calls == [(variant, rows, [e.request_id for e in decodes] + ["r101"]),
                        ("prompt", None, ["r100", "r102"])]
    assert set(result.sampled_token_ids) == {e.request_id for e in decodes} | {"r100", "r101"}
    assert ex.last_logits.flatten().tolist() == [float(n) for n in range(num_decodes)] + [100.0, 101.0]


def test_decode_only_steps_follow_the_plans_path_and_big_ones_run_eagerly():
    ex = SplitExecutor()
    ex.execute(StepPlan([entry("r1", [1], 3, [0])], 1, "fused", [], []))
    ex.execute(StepPlan([entry("r1", [1], 3, [0])], 1, "grouped", [], []))
    many = [entry(f"r{n}", [1], 3, [0]) for n in range(300)]
    ex.execute(StepPlan(many, 300, "grouped", [], []))
    assert [(v, r) for v, r, _ in ex.calls] == [("fused", 1), ("grouped", 16), ("prompt", None)]


def test_prompt_steps_reuse_one_grown_routing_workspace():
    from flint_sched.config import preset
    from flint_sched.executor.workspace import Workspaces

    ws = Workspaces(preset("flint-tiny"), max_rows=16, max_seqs=4, device=torch.device("cpu"))
    assert ws.routing_for(9) is ws.moe_routing                       # decode graphs' own
    first = ws.routing_for(100)
    assert first is not ws.moe_routing and first.max_tokens == 100
    assert ws.routing_for(40) is first                               # kept, not made again
    grown = ws.routing_for(300)
    assert grown.max_tokens == 300 and ws.routing_for(100) is grown


class WarmUpExecutor(SplitExecutor):
    """The plans of warm_up recorded (none run), over a flint-tiny KV cache in blocks of 4 on the CPU."""

    def __init__(self, max_model_len: int, num_blocks: int, prompt_graph_tokens: tuple[int, ...] = (),
                 num_slots: int = 20):
        super().__init__()
        self.device, self.max_model_len = torch.device("cpu"), max_model_len
        self.prompt_graph_tokens = prompt_graph_tokens
        self.weights = SimpleNamespace(kv=KVCache(preset("flint-tiny"), num_blocks=num_blocks, block_size=4,
                                                  num_slots=num_slots, dtype=torch.float32, device="cpu"))
        self.plans = []

    def execute(self, plan):
        self.plans.append(plan)
        return StepResult({})


def test_warm_up_runs_a_prompt_step_then_a_fused_and_a_grouped_decode_on_free_kv_greedy_and_sampled():
    ex = WarmUpExecutor(max_model_len=64, num_blocks=40)
    ex.warm_up(8192)
    assert len(ex.plans) == 6
    for plans, temperature in ((ex.plans[:3], 0.0), (ex.plans[3:], 1.0)):   # greedy, then the OpenAI default
        prompt, fused, grouped = plans
        [p] = prompt.scheduled_requests
        assert p.num_tokens == 62 and p.start_position == 0                # max_model_len - 2
        assert [e.start_position for e in fused.scheduled_requests] == [62] and fused.path == "fused"
        assert len(grouped.scheduled_requests) == 16 and {e.ring_slot for e in grouped.scheduled_requests} == set(range(16))
        assert {e.sampling_params.temperature for plan in plans for e in plan.scheduled_requests} == {temperature}
    assert all(len(e.block_table) * 4 > e.end_position - 1 for plan in ex.plans for e in plan.scheduled_requests)


def test_warm_up_captures_every_grouped_decode_size_the_ring_slots_hold():
    """With 60 slots the decode graphs of 24, 32 and 48 rows (not 64) come after the six steps above,
    greedy then sampled each, one request per slot."""
    ex = WarmUpExecutor(max_model_len=64, num_blocks=40, num_slots=60)
    ex.warm_up(8192)
    extra = ex.plans[6:]
    assert [len(p.scheduled_requests) for p in extra] == [24, 24, 32, 32, 48, 48]
    assert [p.path for p in extra] == ["grouped"] * 6 and all(p.num_tokens == len(p.scheduled_requests) for p in extra)
    assert [p.scheduled_requests[0].sampling_params.temperature for p in extra] == [0.0, 1.0] * 3
    for p in extra:
        assert [e.ring_slot for e in p.scheduled_requests] == list(range(len(p.scheduled_requests)))
        assert {e.start_position for e in p.scheduled_requests} == {62} and all(e.num_tokens == 1 for e in p.scheduled_requests)
    capped = WarmUpExecutor(max_model_len=64, num_blocks=40, num_slots=60)
    capped.warm_up(8192, max_num_seqs=20)               # a batch of 20 replays the 24-row graph: none above it
    assert [len(p.scheduled_requests) for p in capped.plans[6:]] == [24, 24]


def test_warm_up_first_takes_a_prompt_step_of_each_graphed_size_the_prompts_reach():
    ex = WarmUpExecutor(max_model_len=200, num_blocks=80, prompt_graph_tokens=(16, 64, 128, 512))
    ex.warm_up(100)
    graphed = [p.scheduled_requests[0] for p in ex.plans[:3]]
    assert [e.num_tokens for e in graphed] == [16, 64, 100]       # 128 holds the 100-token prompt; 512 none
    assert all(e.start_position == 0 and e.sampling_params.is_greedy for e in graphed)
    assert len(ex.plans) == 3 + 6 and ex.plans[3].scheduled_requests[0].num_tokens == 100


def test_warm_up_also_takes_a_mixed_step_of_each_size_the_hybrid_gemms_serve(monkeypatch):
    """With weights that fit the hybrid expert GEMMs, each graphed size from HYBRID_MIXED_MIN_ROWS on
    also gets a mixed step (a chunk and a decode of another request: the mixed steps' own graph)."""
    from flint_sched.executor import moe_gemms

    monkeypatch.setattr(moe_gemms, "HYBRID_MIXED_MIN_ROWS", 64)
    ex = WarmUpExecutor(max_model_len=200, num_blocks=80, prompt_graph_tokens=(16, 64, 128, 512))
    ex._hybrid_moe = True
    ex.warm_up(100)
    steps = [[(e.num_tokens, e.start_position, e.ring_slot) for e in p.scheduled_requests] for p in ex.plans[:5]]
    assert steps == [[(16, 0, 0)], [(64, 0, 0)], [(63, 0, 0), (1, 100, 1)], [(100, 0, 0)], [(99, 0, 0), (1, 100, 1)]]
    assert moe_gemms.mixed_moe_gemms(ex.plans[2].scheduled_requests, 64, True) == "hybrid"
    assert len(ex.plans) == 5 + 6



def test_mixed_steps_choose_the_hybrid_expert_gemms(monkeypatch):
    """A prompt-variant step takes the hybrid expert GEMMs only with a prompt chunk beside a decode,
    from HYBRID_MIXED_MIN_ROWS rows on, and only where the weights fit them."""
    from flint_sched.executor import moe_gemms
    from flint_sched.executor.moe_gemms import hybrid_available, mixed_moe_gemms
    from flint_sched.checkpoint.make import dummy_checkpoint

    monkeypatch.setattr(moe_gemms, "HYBRID_MIXED_MIN_ROWS", 512)
    decode, prompt = entry("d", [1], 40, [0]), entry("p", list(range(600)), 0, [0, 1])
    partial = entry("q", list(range(600)), 0, [0, 1], samples=False)
    assert mixed_moe_gemms([decode, prompt], 601, True) == "hybrid"
    assert mixed_moe_gemms([decode, partial], 601, True) == "hybrid"
    assert mixed_moe_gemms([decode, prompt], 511, True) is None          # below the rows
    assert mixed_moe_gemms([prompt], 600, True) is None                  # a prompt alone
    assert mixed_moe_gemms([decode] * 600, 600, True) is None            # decodes alone
    assert mixed_moe_gemms([decode, prompt], 601, False) is None         # weights without both GEMMs
    monkeypatch.setattr(moe_gemms, "HYBRID_MIXED_MIN_ROWS", 0)
    assert mixed_moe_gemms([decode, prompt], 4096, True) is None         # off
    config = preset("flint-tiny")
    for fmt in ("bf16", "nvfp4"):
        weights = dummy_checkpoint(config, fmt, seed=0).weights
        expected = fmt == "nvfp4" and config.hidden_size % 512 == 0 and config.moe_intermediate_size % 512 == 0
        assert hybrid_available(config, weights) == expected


def test_clearing_the_graphs_takes_the_fused_limit_again(monkeypatch):
    """benchmarks/ab_decode.py's variants of FUSED_PATH_MAX_BATCH: clear_graphs re-takes the limits
    (the fused path up to the new bound, a graph for each batch size up to it)."""
    ex = object.__new__(CudaExecutor)
    ex.config, ex.device = preset("flint-tiny"), torch.device("cpu")
    moe = next(i for i in range(ex.config.num_hidden_layers) if ex.config.is_moe(i))
    ex.w = {f"model.layers.{moe}.mlp.experts.gate_proj.weight": torch.zeros(2, 8, 8, dtype=torch.bfloat16)}
    ex.grouped_batch_sizes = (16, 32)
    ex.graphs = SimpleNamespace(pool=None, clear=lambda: None)
    ex.sampler = SimpleNamespace(graphs={}, pool=None)
    monkeypatch.setitem(cuda_executor.FUSED_PATH_MAX_BATCH, "bf16", 3)
    ex.clear_graphs()
    assert ex.limits == ExecutorLimits(3, (1, 2, 3, 16, 32))
    monkeypatch.setitem(cuda_executor.FUSED_PATH_MAX_BATCH, "bf16", 8)
    ex.clear_graphs()
    assert ex.limits.fused_max_batch == 8 and ex.limits.graph_batch_sizes[:8] == tuple(range(1, 9))
