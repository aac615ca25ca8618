import json
import re
import subprocess
import sys

import pytest

from flint_sched.cli import main


def test_make_checkpoint_then_generate_json(tmp_path, capsys):
    out = tmp_path / "tiny.gguf"
    assert main(["make-checkpoint", "--preset", "flint-tiny", "--format", "gguf-nvfp4", "--seed", "3",
                 "--device", "cpu", "--no-progress", str(out)]) == 0
    assert out.stat().st_size > 0
    capsys.readouterr()
    assert main(["generate", "--model", str(out), "--device", "cpu", "--prompt", "Hello", "--prompt", "Bye",
                 "--max-tokens", "5", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 2
    for r in lines:
        assert r["prompt_token_ids"] and 1 <= len(r["output_token_ids"]) <= 5
        assert r["finish_reason"] in ("stop", "length") and isinstance(r["text"], str)


def test_default_model_is_made_once_in_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLINT_SCHED_CACHE", str(tmp_path))
    assert main(["generate", "--device", "cpu", "--prompt", "Hi", "--max-tokens", "3", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    made = sorted(p.name for p in tmp_path.iterdir() if p.name != "tokenizers")   # tokenizers: bpe.cached_backend
    assert len(made) == 1 and re.fullmatch(r"flint-tiny-[0-9a-f]{8}-seed0-hf-bf16", made[0]), made
    assert main(["generate", "--device", "cpu", "--prompt", "Hi", "--max-tokens", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == first          # greedy, same checkpoint


@pytest.mark.parametrize("argv, message", [
    (["generate", "--device", "cpu", "--model", "/nonexistent/model.gguf", "--prompt", "x"], "no such file"),
    (["generate", "--device", "cpu", "--prompt", "x", "--max-tokens", "0"], "max_tokens"),
])
def test_bad_input_is_a_clear_message(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLINT_SCHED_CACHE", str(tmp_path))
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_console_entry_point_runs():
    result = subprocess.run([sys.executable, "-m", "flint_sched.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "make-checkpoint" in result.stdout
