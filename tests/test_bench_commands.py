"""Both bench commands end to end on flint-tiny: latency on the CPU, serve against a real server."""

import json


from api_server import shared_server
from flint_sched.cli import main


def test_bench_latency_smoke(tmp_path, capsys):
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", "flint-tiny", "--device", "cpu", "--batch-sizes", "1,3",
                 "--contexts", "16,600", "--prefill-lens", "40", "--num-steps", "2",
                 "--max-num-batched-tokens", "32", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(d["batch"], d["context"]) for d in result["decode"]] == [(1, 16), (3, 16), (1, 600), (3, 600)]
    assert all(d["step_ms"] > 0 and d["bytes_per_step"] > 0 for d in result["decode"])
    assert result["prefill_tokens_per_s"]["40"] > 0
    assert "decode B=3" in capsys.readouterr().out


def test_bench_latency_prefill_only(tmp_path):
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", "flint-tiny", "--device", "cpu", "--batch-sizes", "",
                 "--contexts", "", "--prefill-lens", "24", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["decode"] == [] and result["prefill_tokens_per_s"]["24"] > 0


def test_bench_serve_smoke_against_flint_tiny(request, tmp_path):
    server = shared_server(request, "real")
    assert main(["bench", "serve", "--base-url", server.base_url, "--dataset-name", "random",
                 "--random-input-len", "16", "--random-output-len", "4", "--num-prompts", "6",
                 "--max-concurrency", "3", "--ignore-eos", "--save-result", "--result-dir", str(tmp_path),
                 "--result-filename", "serve.json", "--no-plot", "--disable-tqdm"]) == 0
    result = json.loads((tmp_path / "serve.json").read_text())
    assert result["completed"] == 6 and result["failed"] == 0
