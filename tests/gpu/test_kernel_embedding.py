"""The embedding lookup (cuda/embedding.cu) against torch: index_select, and a decode step's
placeholder tokens and block-table scatter as DecodeInputs does them in torch."""

import pytest
import torch

from flint_sched.core.plan import PLACEHOLDER_TOKEN, ScheduledRequest
from flint_sched.executor.sampled_tokens import SampledTokens
from flint_sched.executor.step_inputs import DecodeInputs
from flint_sched.kernels.embedding import embed_tokens
from flint_sched.sampling_params import SamplingParams
from gpu_checks import gen

pytestmark = pytest.mark.gpu


def entry(rid, tokens, start, table, slot=0):
    return ScheduledRequest(rid, tokens, start, table, slot, True, SamplingParams(temperature=0), [1], [], False)


def table(vocab=1000, hidden=2048):
    return torch.randn(vocab, hidden, device="cuda", generator=gen(vocab)).bfloat16()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_embed_tokens_is_index_select(rows, dtype):
    t = table()
    tokens = torch.randint(0, t.shape[0], (rows,), device="cuda", generator=gen(rows), dtype=dtype)
    out = torch.full((rows, t.shape[1]), float("nan"), device="cuda", dtype=torch.bfloat16)
    assert torch.equal(embed_tokens(t, tokens, out, pdl=True), t.index_select(0, tokens))


def test_a_token_outside_the_table_gives_a_zero_row():
    t = table()
    out = embed_tokens(t, torch.tensor([3, 1000, -1], device="cuda"), torch.empty(3, 2048, device="cuda",
                                                                                  dtype=torch.bfloat16))
    assert torch.equal(out[0], t[3]) and not out[1:].any()


def test_decode_inputs_placeholders_and_block_table_scatter():
    """sources / sampled and the table scatter as DecodeInputs.fed_tokens / update_block_tables."""
    dev = torch.device("cuda")
    sampled = SampledTokens(8, dev)
    sampled.record([entry("a", [5], 7, [3, 9]), entry("b", [6], 0, [4], slot=2)], torch.tensor([41, 42]))
    inputs = DecodeInputs(max_rows=4, max_model_len=64, block_size=4, device=dev, sampled=sampled.values)
    inputs.fill([entry("b", [6], 0, [4], slot=2), entry("c", [9], 3, [5])])
    second = [entry("b", [PLACEHOLDER_TOKEN], 1, [4, 13], slot=2), entry("c", [9], 4, [5])]
    inputs.fill(second, sampled.sources(second))
    expected_tables = inputs.block_tables_flat.clone()
    expected_tables[inputs.table_index.long()] = inputs.table_value
    t = table()
    out = embed_tokens(t, inputs.tokens, torch.empty(4, 2048, device=dev, dtype=torch.bfloat16),
                       sources=inputs.sources, sampled=inputs.sampled, table_scatter=inputs.table_scatter)
    assert torch.equal(out, t.index_select(0, inputs.fed_tokens(4)))
    assert torch.equal(inputs.block_tables_flat, expected_tables) and inputs.block_tables[0, 1] == 13
