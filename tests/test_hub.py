"""Hugging Face Hub names, resolved offline against a cache laid out as huggingface_hub lays it out:
models--OWNER--NAME/{blobs/SHA, refs/main, snapshots/COMMIT/FILE -> ../../blobs/SHA}."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flint_sched.checkpoint import hub
from flint_sched.checkpoint.common import CheckpointError

REPO = Path(__file__).resolve().parents[1]     # python -m imports this checkout
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_repo(cache: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """A repository in hub cache layout; returns its snapshot directory."""
    root = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = root / "snapshots" / COMMIT
    for name, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hub"


@pytest.mark.parametrize("name, expected", [
    ("owner/repo", hub.HubRef("owner/repo")),
    ("owner/repo:model-Q4.gguf", hub.HubRef("owner/repo", "model-Q4.gguf")),
    ("flint-tiny", None), ("./owner/repo", None), ("/abs/path", None), ("a/b/c", None),
    ("dir/model.gguf", None), ("dir/config.json", None), (None, None),
])
def test_which_names_are_hub_names(name, expected):
    assert hub.parse_hub_name(name) == expected


def test_an_existing_local_path_wins_over_a_hub_name(tmp_path, monkeypatch):
    (tmp_path / "owner" / "repo").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub.parse_hub_name("owner/repo") is None


def test_a_gguf_repository_resolves_to_its_gguf_file(offline_cache):
    snapshot = add_repo(offline_cache, "org/flint-gguf", {"flint.gguf": b"GGUF....", "README.md": b"hi"})
    found = hub.resolve_model("org/flint-gguf", download_dir=str(offline_cache))
    assert Path(found.path) == snapshot / "flint.gguf" and Path(found.path).read_bytes() == b"GGUF...."
    assert "org/flint-gguf:flint.gguf" in found.origin and "offline" in found.origin


def test_several_gguf_files_need_one_named(offline_cache):
    snapshot = add_repo(offline_cache, "org/many", {"a.gguf": b"GGUFa", "b.gguf": b"GGUFb"})
    with pytest.raises(CheckpointError, match="several GGUF files.*org/many:a.gguf"):
        hub.resolve_model("org/many", download_dir=str(offline_cache))
    assert Path(hub.resolve_model("org/many:b.gguf", download_dir=str(offline_cache)).path) == snapshot / "b.gguf"


def test_config_and_tokenizer_names(offline_cache):
    snapshot = add_repo(offline_cache, "org/flint", {"config.json": b"{}", "tokenizer.json": b"{}",
                                                     "tokenizer_config.json": b"{}"})
    assert Path(hub.resolve_config("org/flint", download_dir=str(offline_cache)).path) == snapshot / "config.json"
    assert Path(hub.resolve_tokenizer("org/flint", download_dir=str(offline_cache)).path) == snapshot


def test_a_config_repositorys_generation_config_sets_the_sampling_defaults(offline_cache, tmp_path):
    from flint_sched.checkpoint import generation_config
    generation = {"temperature": 0.6, "top_p": 0.95, "top_k": 50, "max_new_tokens": 100, "do_sample": True,
                  "eos_token_id": [1, 2]}
    add_repo(offline_cache, "org/with-gen", {"config.json": b"{}", "generation_config.json":
                                             json.dumps(generation).encode()})
    add_repo(offline_cache, "org/no-gen", {"config.json": b"{}"})
    found = hub.resolve_config("org/with-gen", download_dir=str(offline_cache)).path
    path = generation_config.find("auto", "model.gguf", found)
    # top_k 50 is transformers' own default: a file repeating it sets nothing (as vLLM reads it)
    assert generation_config.sampling_defaults(path) == {"temperature": 0.6, "top_p": 0.95, "max_tokens": 100}
    assert generation_config.find("vllm", "model.gguf", found) is None
    bare = hub.resolve_config("org/no-gen", download_dir=str(offline_cache)).path
    assert generation_config.find("auto", "model.gguf", bare) is None
    assert generation_config.find("auto", "flint-tiny", None) is None       # a preset's name, not a path
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "generation_config.json").write_text('{"temperature": 0.2}')
    assert generation_config.sampling_defaults(generation_config.find(str(tmp_path / "mine"), None, None)) == {
        "temperature": 0.2}
    (tmp_path / "mine" / "generation_config.json").write_text('{"temperature": -1}')
    with pytest.raises(ValueError, match="generation_config.json: temperature must be >= 0"):
        generation_config.sampling_defaults(tmp_path / "mine" / "generation_config.json")
    with pytest.raises(ValueError, match="auto, vllm or a folder"):
        generation_config.find(str(tmp_path / "nowhere"), None, None)


def test_a_repository_missing_from_the_cache_is_a_clear_error(offline_cache):
    add_repo(offline_cache, "org/other", {"x.gguf": b"GGUF"})
    with pytest.raises(CheckpointError, match="not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        hub.resolve_model("org/absent", download_dir=str(offline_cache))
    with pytest.raises(CheckpointError, match="neither a .gguf file nor config.json"):
        add_repo(offline_cache, "org/empty", {"README.md": b"hi"})
        hub.resolve_model("org/empty", download_dir=str(offline_cache))


def test_generate_from_hub_names_through_hf_home(tmp_path):
    """The CLI end to end: HF_HOME's cache, HF_HUB_OFFLINE=1, model / config / tokenizer as hub names."""
    from flint_sched.checkpoint.make import make_checkpoint
    from flint_sched.config import preset
    made = make_checkpoint(preset("flint-tiny"), "hf-bf16", 0, tmp_path / "made", "cpu", progress=False)
    files = {p.name: p.read_bytes() for p in made.iterdir()}
    add_repo(tmp_path / "hf" / "hub", "flint-org/flint-tiny", files)
    add_repo(tmp_path / "hf" / "hub", "flint-org/flint-tiny-config",
             {k: v for k, v in files.items() if k.endswith(".json") and "safetensors" not in k})
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "FLINT_SCHED_CACHE": str(tmp_path)}
    argv = [sys.executable, "-m", "flint_sched.cli", "generate", "--device", "cpu", "--model", "flint-org/flint-tiny",
            "--hf-config-path", "flint-org/flint-tiny-config", "--tokenizer", "flint-org/flint-tiny-config",
            "--prompt", "Hi", "--max-tokens", "3", "--json"]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["output_token_ids"]
    missing = subprocess.run([a if a != "flint-org/flint-tiny" else "flint-org/absent" for a in argv], env=env, capture_output=True, text=True,
                             timeout=120, cwd=REPO)
    assert missing.returncode == 2 and "not in the Hugging Face cache" in missing.stderr, missing.stderr
