"""Shared pieces of the GPU tests: bf16 closeness checks, seeded generators, a small real-shaped config."""

import dataclasses

import torch

from flint_sched.config import flint_layer_types, preset

MAX_MODEL_LEN = 2048


def assert_close_bf16(out: torch.Tensor, ref: torch.Tensor, what: str, rtol: float = 2.0**-7,
                      abs_frac: float = 1e-3, rel_l2: float = 1e-2) -> None:
    """No NaN (unwritten), rel. L2 < rel_l2, |err| <= rtol |ref| + abs_frac max|ref|, worst named."""
    out, ref = out.float(), ref.float()
    nan = torch.isnan(out)
    assert not nan.any(), (f"{what}: {int(nan.sum())} of {nan.numel()} outputs NaN (unwritten?), "
                           f"first at {nan.nonzero()[0].tolist()}")
    rel = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
    assert rel < rel_l2, f"{what}: relative L2 error {rel:.3e}"
    bound = rtol * ref.abs() + abs_frac * float(ref.abs().max())
    excess = (out - ref).abs() - bound
    worst = int(excess.argmax())
    index = [int(i) for i in torch.unravel_index(torch.tensor(worst), out.shape)]
    assert float(excess.flatten()[worst]) <= 0, (
        f"{what}: max-abs bound exceeded at {index}: out {float(out.flatten()[worst])}, "
        f"ref {float(ref.flatten()[worst])}; {int((excess > 0).sum())} elements over")


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def poisoned(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """NaN-filled output buffer: an element the kernel does not write fails the check."""
    return torch.full(shape, float("nan"), device="cuda", dtype=dtype)


def small_real_config():
    """Real per-head shapes (head_dim 128, 8 query heads per KV head), few layers, small vocab; the
    hidden and expert sizes multiples of 512, so NVFP4 decode batches run the decode expert GEMMs
    (cuda/expert_decode.cu) as Flint's do."""
    return dataclasses.replace(
        preset("flint"), hidden_size=512, num_hidden_layers=7, layer_types=tuple(flint_layer_types(7)),
        num_attention_heads=16, num_key_value_heads=2, intermediate_size=1024, n_routed_experts=32,
        moe_intermediate_size=512, vocab_size=4096, max_position_embeddings=MAX_MODEL_LEN)
