"""Generated checkpoints in both formats: what is written is what is loaded, and bad files fail clearly."""

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import fp32_weights
from flint_sched.checkpoint.common import CheckpointError
from flint_sched.checkpoint.gguf_io import read_gguf
from flint_sched.checkpoint.hf_io import read_hf
from flint_sched.checkpoint.loader import load_checkpoint
from flint_sched.checkpoint.make import dummy_checkpoint, make_checkpoint
from flint_sched.model.reference import FlintReference
from flint_sched.quant.nvfp4 import NVFP4Tensor

SEED = 7


@pytest.fixture(scope="module")
def written(tmp_path_factory, tiny_config):
    root = tmp_path_factory.mktemp("ckpt")
    gguf_path = make_checkpoint(tiny_config, "gguf-nvfp4", SEED, root / "tiny.gguf", "cpu", progress=False)
    hf_dir = make_checkpoint(tiny_config, "hf-bf16", SEED, root / "tiny-hf", "cpu", progress=False)
    return gguf_path, hf_dir


def _logits(ckpt, ids):
    return FlintReference(ckpt.config, ckpt.weights).forward(ids)


def _prompt(ckpt):
    return ckpt.tokenizer.encode("Flint reads only the chosen experts. 你好, world! " * 3)


def test_both_formats_agree_within_quantization_error(written, tiny_config):
    nvfp4, bf16 = read_gguf(written[0], progress=False), read_hf(written[1], progress=False)
    assert nvfp4.config == bf16.config == tiny_config
    ids = _prompt(nvfp4)
    assert ids == _prompt(bf16)
    exact = FlintReference(tiny_config, fp32_weights(tiny_config, SEED)).forward(ids)
    a, b = _logits(nvfp4, ids), _logits(bf16, ids)
    rel = lambda x: float((x - exact).norm() / exact.norm())  # noqa: E731
    # Per weight, bf16 rounds by ~0.2 % RMS and NVFP4 by ~9.5 % (test_nvfp4); through 7 layers,
    # with router choices flipping, the logits move by ~3 % and ~16 % on this seed.
    assert rel(b) < 0.06
    assert 0.05 < rel(a) < 3 * 0.095
    assert torch.nn.functional.cosine_similarity(a.flatten(), exact.flatten(), dim=0) > 0.95


def test_nvfp4_logits_equal_its_own_dequantized_weights(written):
    ckpt = read_gguf(written[0], progress=False)
    dense = {k: v.dequantize() if isinstance(v, NVFP4Tensor) else v.float() for k, v in ckpt.weights.items()}
    ids = _prompt(ckpt)
    torch.testing.assert_close(_logits(ckpt, ids), FlintReference(ckpt.config, dense).forward(ids),
                               rtol=0, atol=0)


def test_gguf_holds_exactly_the_quantized_random_weights(written, tiny_config):
    ckpt = read_gguf(written[0], progress=False)
    dummy = dummy_checkpoint(tiny_config, "nvfp4", SEED, "cpu", tokenizer=ckpt.tokenizer)
    for name, w in dummy.weights.items():
        got = ckpt.weights[name]
        if isinstance(w, NVFP4Tensor):
            assert torch.equal(got.codes, w.codes) and torch.equal(got.block_scales, w.block_scales), name
            assert torch.equal(got.tensor_scale, w.tensor_scale), name
        else:
            assert got.dtype == w.dtype and torch.equal(got, w), name
    assert ckpt.weights["model.layers.2.mlp.gate.e_score_correction_bias"].abs().min() > 0
    assert ckpt.weights["model.layers.0.self_attn.sinks"].abs().min() > 0


def test_hf_holds_the_bf16_random_weights(written, tiny_config):
    ckpt = read_hf(written[1], progress=False)
    for name, w in fp32_weights(tiny_config, SEED).items():
        expected = w if name.endswith("e_score_correction_bias") else w.to(torch.bfloat16)
        assert torch.equal(ckpt.weights[name], expected), name


def test_tokenizer_and_template_travel_in_both_formats(written):
    a, b = read_gguf(written[0], progress=False), read_hf(written[1], progress=False)
    text = "<|user|>héllo\n<tool_call>f<arg_key>x</arg_key><arg_value>1</arg_value></tool_call>"
    assert a.tokenizer.encode(text) == b.tokenizer.encode(text)
    assert a.tokenizer.eos_token_ids == b.tokenizer.eos_token_ids and a.tokenizer.eos_token_ids
    assert a.tokenizer.chat_template and a.tokenizer.chat_template == b.tokenizer.chat_template


def test_overrides_of_config_and_tokenizer(written, tiny_config, tmp_path):
    gguf_path, hf_dir = written
    ckpt = load_checkpoint(gguf_path, hf_config_path=hf_dir / "config.json", tokenizer=hf_dir, device="cpu",
                           progress=False)
    assert ckpt.config == tiny_config and ckpt.weight_format == "nvfp4"
    wrong = dataclasses.replace(tiny_config, moe_intermediate_size=128)
    (tmp_path / "config.json").write_text(json.dumps(wrong.to_hf_dict()))
    with pytest.raises(CheckpointError, match=r"blk.2.ffn_gate_exps|experts.gate_proj.*shape"):
        load_checkpoint(gguf_path, hf_config_path=tmp_path, device="cpu", progress=False)


def test_truncated_gguf_names_the_tensor_and_file(written, tmp_path):
    bad = tmp_path / "truncated.gguf"
    data = written[0].read_bytes()
    bad.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(CheckpointError, match=r"truncated\.gguf.*tensor blk\.\d+\.\w+\.\w+ runs past the end"):
        read_gguf(bad, progress=False)


def test_corrupt_gguf_names_the_file(written, tmp_path):
    bad = tmp_path / "corrupt.gguf"
    data = bytearray(written[0].read_bytes())
    data[:4] = b"XXXX"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt.gguf"):
        read_gguf(bad, progress=False)
    with pytest.raises(CheckpointError, match="no such file"):
        read_gguf(tmp_path / "absent.gguf", progress=False)


def test_gguf_missing_tensor_is_named(written, tiny_config, tmp_path):
    deeper = dataclasses.replace(tiny_config, num_hidden_layers=8,
                                 layer_types=tiny_config.layer_types + ("sliding_attention",))
    (tmp_path / "config.json").write_text(json.dumps(deeper.to_hf_dict()))
    with pytest.raises(CheckpointError, match=r"tiny.gguf: tensor blk.7.attn_norm.weight is missing"):
        read_gguf(written[0], hf_config_path=tmp_path, progress=False)


def _copy_hf(src, dst):
    shutil.copytree(src, dst)
    shard = next(dst.glob("model-*.safetensors"))
    return shard, load_file(shard)


def test_hf_missing_and_misshaped_tensors_are_named(written, tmp_path):
    shard, tensors = _copy_hf(written[1], tmp_path / "missing")
    del tensors["model.layers.3.mlp.experts.5.up_proj.weight"]
    save_file(tensors, shard)
    with pytest.raises(CheckpointError, match=r"tensor model.layers.3.mlp.experts.5.up_proj.weight"):
        read_hf(tmp_path / "missing", progress=False)

    shard, tensors = _copy_hf(written[1], tmp_path / "shape")
    tensors["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(3, 3, dtype=torch.bfloat16)
    save_file(tensors, shard)
    with pytest.raises(CheckpointError, match=r"model-00001-of-00001.safetensors: tensor "
                                              r"model.layers.1.self_attn.q_proj.weight has shape \(3, 3\)"):
        read_hf(tmp_path / "shape", progress=False)


def test_hf_corrupt_and_truncated_shards_name_the_file(written, tmp_path):
    shard, _ = _copy_hf(written[1], tmp_path / "trunc")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model-00001-of-00001.safetensors"):
        read_hf(tmp_path / "trunc", progress=False)
    shard, _ = _copy_hf(written[1], tmp_path / "garbage")
    shard.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=r"model-00001-of-00001.safetensors"):
        read_hf(tmp_path / "garbage", progress=False)


def test_nan_weights_are_refused(written, tmp_path):
    shard, tensors = _copy_hf(written[1], tmp_path / "nan")
    tensors["model.norm.weight"][3] = float("nan")
    save_file(tensors, shard)
    with pytest.raises(CheckpointError, match=r"tensor model.norm.weight holds NaN"):
        read_hf(tmp_path / "nan", progress=False)


def test_shards_split_and_index(tiny_config, tmp_path):
    from flint_sched.checkpoint.hf_io import write_hf
    from flint_sched.checkpoint.random_init import random_tensor
    from flint_sched.tokenizer import build_tokenizer
    tok = build_tokenizer(tiny_config.vocab_size, 0)
    write_hf(tmp_path, tiny_config, tok, lambda s: random_tensor(s, tiny_config, 0), progress=False,
             shard_bytes=200_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    ckpt = read_hf(tmp_path, progress=False)
    assert torch.equal(ckpt.weights["lm_head.weight"],
                       fp32_weights(tiny_config, 0)["lm_head.weight"].to(torch.bfloat16))
