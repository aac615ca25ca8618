"""Which weights get bf16 copies for the cuBLAS steps (executor/dense_copies.py), and their size:
the engine takes that size from the KV budget before the CUDA executor makes them."""

from flint_sched.checkpoint.make import dummy_checkpoint
from flint_sched.config import preset
from flint_sched.executor.dense_copies import copies_bytes, dense_nvfp4


def test_copies_cover_the_dense_nvfp4_weights_and_no_expert():
    config = preset("flint-tiny")
    nvfp4 = dummy_checkpoint(config, "nvfp4", seed=1, device="cpu").weights
    copied = {n for n, w in nvfp4.items() if dense_nvfp4(n, w)}
    layer = {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(config.num_hidden_layers) for p in "qkvo"}
    dense_mlp = {f"model.layers.{i}.mlp.{p}_proj.weight" for i in range(config.first_k_dense_replace)
                 for p in ("gate", "up", "down")}
    assert copied == layer | dense_mlp    # the LM head is bf16 already
    assert copies_bytes(nvfp4) == sum(2 * nvfp4[n].shape[0] * nvfp4[n].shape[1] for n in copied)
    assert copies_bytes(dummy_checkpoint(config, "bf16", seed=1, device="cpu").weights) == 0

