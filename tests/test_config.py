import dataclasses
import json

import pytest

from flint_sched.config import ConfigError, FlintConfig, flint_layer_types, load_hf_config, preset


def test_flint_preset_matches_flint_md():
    c = preset("flint")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        2048, 49, 32, 4, 128)
    assert c.full_layers == (3, 6, 10, 13, 17, 20, 24, 27, 31, 34, 38, 41, 45, 48)
    assert len(c.sliding_layers) == 35 and c.sliding_window == 513
    total, active = c.parameter_counts()
    assert round(total / 1e9, 2) == 39.69 and round(active / 1e9, 2) == 2.42
    # 28 KiB of full-attention KV per token
    assert len(c.full_layers) * c.kv_size * 2 * 2 == 28 * 1024


def test_tiny_keeps_every_feature():
    c = preset("flint-tiny")
    assert c.full_layers and c.sliding_layers and c.first_k_dense_replace == 2
    assert c.num_hidden_layers > c.first_k_dense_replace and c.n_shared_experts == 1
    assert c.num_queries_per_kv > 1 and c.num_experts_per_tok > 1 and c.scoring_func == "sigmoid"


def test_hf_round_trip(tmp_path):
    c = preset("flint-tiny")
    (tmp_path / "config.json").write_text(json.dumps({**c.to_hf_dict(), "torch_dtype": "bfloat16"}))
    loaded = load_hf_config(tmp_path)
    assert loaded == c and loaded.extra["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("change, field", [
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(layer_types=("sliding_attention",) * 6 + ("dense",)), "layer_types[6]"),
    (dict(layer_types=("full_attention",) * 3), "layer_types"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(num_experts_per_tok=17), "num_experts_per_tok"),
    (dict(hidden_size=-4), "hidden_size"),
    (dict(head_dim=15), "head_dim"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings"),
    (dict(first_k_dense_replace=9), "first_k_dense_replace"),
])
def test_inconsistent_config_names_the_field(change, field):
    with pytest.raises(ConfigError, match=field.replace("[", r"\[")):
        dataclasses.replace(preset("flint-tiny"), **change)


def test_missing_and_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="no such config"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ConfigError, match="missing field"):
        load_hf_config(tmp_path)
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("flint-huge")


def test_layer_pattern():
    assert flint_layer_types(7) == ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 2 + [
        "full_attention"]
    assert FlintConfig.from_hf_dict(preset("flint").to_hf_dict()) == preset("flint")
