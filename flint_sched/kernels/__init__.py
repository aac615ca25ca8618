"""CUDA kernels for the low-latency decode path: NVRTC-compiled sources in cuda/, thin launchers here.

Importing this package needs neither a GPU nor cuda.bindings; kernels compile on first use.
"""

from flint_sched.kernels._runtime import (KernelCompileError, KernelError, KernelLaunchError,
                                          KernelRuntimeUnavailable, compile_kernel, compile_only)
from flint_sched.kernels.grouped import grouped_gate_up, grouped_linear
from flint_sched.kernels.grouped_moe import (MoeRoutingWorkspace, Routing, moe_down_sorted, moe_finalize,
                                             moe_gate_up_sorted, moe_grouped, moe_routing_workspace,
                                             route_and_sort)
from flint_sched.kernels.linear import gate_up_silu, linear
from flint_sched.kernels.moe import moe, moe_down, moe_gate_up, route, router_workspace
from flint_sched.kernels.norm import fused_add_rms_norm, rms_norm
from flint_sched.kernels.sampling import argmax_workspace, greedy

# Compile-time variants the launchers pick from, and (source, entry point) of every kernel they
# use; the CPU test compiles each variant and finds each entry point in its CUBIN.
VARIANTS = {
    "gemv.cu": tuple({"GEMV_WARPS": w, "X_BATCH": x, "GEMV_GROUPS": g} for w in (4, 8, 16) for x in (0, 1)
                     for g in (1, 2, 3, 4) if g <= 2 or w <= 8),
    "router.cu": ({"ROUTER_MAX_EXPERTS": 256}, {"ROUTER_MAX_EXPERTS": 1024}),
    "moe.cu": tuple({"MOE_GATE_UP_WARPS": w, "X_BATCH": x} for w in (4, 8) for x in (0, 1)),
    "grouped_gemm.cu": tuple({"GROUPED_CHUNK": c, "GROUPED_TILES": t} for c in (16, 64) for t in (1, 4))
    + ({"GROUPED_CHUNK": 8, "GROUPED_TILES": 4},),                                # grouped.MOE_SMALL_CHUNK = 8
    "moe_routing.cu": ({"ROUTER_MAX_EXPERTS": 256}, {"ROUTER_MAX_EXPERTS": 1024}),
    "gemv_chain.cu": tuple({"GEMV_WARPS": w, "X_BATCH": 0, "CHAIN_SLEEP_NS": s} for w in (8, 16) for s in (0, 64))
    + ({"GEMV_WARPS": 16, "X_BATCH": 0, "CHAIN_SLEEP_NS": 0, "TICKET_ACQ_REL": 1},),
    # decode_step.kernel_defines: the CTA's warps, the attention's settings by KV dtype, fused Q/K norms
    "decode_step.cu": tuple({"STEP_WARPS": w, "X_BATCH": 0, "ATTN_MIN_SPLIT_KEYS": 64, **kv, **fuse} for w in (8, 4)
                            for kv in ({}, {"KV_FP8": 1, "ATTN_STAGES": 4, "ATTN_CP_ASYNC": 1})
                            for fuse in ({}, {"STEP_FUSE_QK": 1})),
}
ENTRY_POINTS = (
    ("rmsnorm.cu", "rmsnorm_bf16"), ("rmsnorm.cu", "add_rmsnorm_f32"), ("rmsnorm.cu", "add_rmsnorm_fixed"),
    ("gemv.cu", "gemv_bf16"), ("gemv.cu", "gemv_bf16_f32"), ("gemv.cu", "gemv_nvfp4"),
    ("gemv.cu", "gemv_bf16_norm"), ("gemv.cu", "gemv_nvfp4_norm"),
    ("gemv.cu", "gate_up_bf16"), ("gemv.cu", "gate_up_nvfp4"),
    ("router.cu", "router_topk"), ("router.cu", "router_topk_cluster"),
    ("moe.cu", "moe_gate_up_bf16"), ("moe.cu", "moe_gate_up_nvfp4"),
    ("moe.cu", "moe_down_bf16"), ("moe.cu", "moe_down_nvfp4"),
    ("moe.cu", "moe_gate_up_staged_nvfp4"), ("moe_split.cu", "moe_split_nvfp4"),
    ("argmax.cu", "argmax_bf16"), ("argmax.cu", "argmax_f32"),
    ("argmax.cu", "sample_bf16"), ("argmax.cu", "sample_f32"),
    ("qk_norm_rope_kv.cu", "qk_norm_rope_kv_bf16"), ("decode_attention.cu", "decode_attention_bf16"),
    *(("grouped_gemm.cu", f"grouped_{op}_{fmt}") for op in ("linear", "gate_up", "moe_gate_up", "moe_down")
      for fmt in ("bf16", "nvfp4")),
    ("moe_routing.cu", "moe_topk"), ("moe_routing.cu", "moe_sort"), ("moe_routing.cu", "moe_route"),
    ("moe_routing.cu", "moe_finalize"), ("moe_routing.cu", "moe_finalize_norm"), ("nvfp4_dequant.cu", "nvfp4_to_bf16"),
    ("embedding.cu", "embed_tokens"), ("decode_step.cu", "decode_step_nvfp4"), ("decode_step.cu", "decode_step_bf16"),
    ("gemv_chain.cu", "gemv_chain_nvfp4"), ("gemv_chain.cu", "gemv_chain_ring_nvfp4"),   # the last: a benchmark's probes
)

__all__ = [
    "ENTRY_POINTS", "VARIANTS", "KernelCompileError", "KernelError", "KernelLaunchError", "KernelRuntimeUnavailable",
    "MoeRoutingWorkspace", "Routing",
    "argmax_workspace", "compile_kernel", "compile_only", "fused_add_rms_norm", "gate_up_silu", "greedy",
    "grouped_gate_up", "grouped_linear", "linear", "moe", "moe_down", "moe_down_sorted", "moe_finalize",
    "moe_gate_up", "moe_gate_up_sorted", "moe_grouped", "moe_routing_workspace", "rms_norm", "route",
    "route_and_sort", "router_workspace",
]
