"""Presenting a run: the flat result dict (the JSON file's content, also what the table prints), the end-of-run
table, a one-row-per-point table for sweeps, and PNG plots (latency CDFs; throughput and TPOT against the swept
concurrency or rate). Plots need matplotlib (the `bench` extra) and are skipped with a note without it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from flint_sched.benchmarks.serve.metrics import LATENCY_METRICS, BenchmarkMetrics

METRIC_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                 "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
WIDTH = 52


def build_result(config: dict[str, Any], metrics: BenchmarkMetrics) -> dict[str, Any]:
    """The run's settings, totals, `{stat}_{metric}_ms` summaries and per-request lists, as one flat dict."""
    result = dict(config) | {
        "duration": metrics.duration_s, "completed": metrics.completed, "failed": metrics.failed,
        "errors": metrics.errors, "total_input_tokens": metrics.total_input_tokens,
        "total_output_tokens": metrics.total_output_tokens, "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput, "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
    }
    for name, summary in metrics.summaries.items():
        result |= {f"{stat}_{name}_ms": value for stat, value in summary.items()}
    if metrics.ttft_later_turns is not None:
        result["median_ttft_by_turn_ms"] = {str(t): s["median"] for t, s in metrics.ttft_by_turn.items()}
        result["num_requests_by_turn"] = {str(t): s["count"] for t, s in metrics.ttft_by_turn.items()}
        result |= {f"{stat}_ttft_later_turns_ms": value for stat, value in metrics.ttft_later_turns.items()}
    result["total_cached_tokens"] = metrics.cached_tokens
    return result | {"input_lens": metrics.input_lens, "output_lens": metrics.output_lens,
                     "ttfts": metrics.ttfts_s, "tpots": metrics.tpots_s, "itls": metrics.itls_s,
                     "e2els": metrics.e2els_s}


def _line(label: str, value: Any) -> str:
    if isinstance(value, float):
        value = "n/a" if math.isnan(value) else f"{value:.2f}"
    return f"{label + ':':<40}{value:>{WIDTH - 40}}"


def format_table(result: dict[str, Any], metrics_shown: tuple[str, ...] = LATENCY_METRICS) -> str:
    lines = [" Serving Benchmark Result ".center(WIDTH, "="),
             _line("Successful requests", result["completed"]),
             _line("Failed requests", result["failed"])]
    if result.get("max_concurrency"):
        lines.append(_line("Maximum request concurrency", result["max_concurrency"]))
    lines += [_line("Request rate (req/s)", str(result["request_rate"])),
              _line("Benchmark duration (s)", result["duration"]),
              _line("Total input tokens", result["total_input_tokens"]),
              _line("Total generated tokens", result["total_output_tokens"]),
              _line("Request throughput (req/s)", result["request_throughput"])]
    if result.get("request_goodput") is not None:
        lines.append(_line("Request goodput (req/s)", result["request_goodput"]))
    lines += [_line("Output token throughput (tok/s)", result["output_throughput"]),
              _line("Total token throughput (tok/s)", result["total_token_throughput"])]
    for name in metrics_shown:
        lines.append(f" {METRIC_TITLES[name]} ".center(WIDTH, "-"))
        stats = [key[: -len(f"_{name}_ms")] for key in result if key.endswith(f"_{name}_ms")]
        lines += [_line(f"{stat.capitalize() if stat[0] != 'p' else stat.upper()} {name.upper()} (ms)",
                        result[f"{stat}_{name}_ms"]) for stat in stats]
    lines += _cache_lines(result)
    if result.get("client_cpu_percent") is not None:     # not for runs under 0.1 s
        lines.append(_line("Client CPU (% of one core)", result["client_cpu_percent"]))
    if result["errors"]:
        lines.append(" Failures ".center(WIDTH, "-"))
        lines += [f"{count:>6} x {reason}" for reason, count in sorted(result["errors"].items(), key=lambda x: -x[1])]
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def _cache_lines(result: dict[str, Any]) -> list[str]:
    """TTFT by agent turn, and the prefix cache (usage's cached tokens, the server's hit rate)."""
    lines = []
    if "median_ttft_by_turn_ms" in result:
        lines.append(" Time to First Token by Turn ".center(WIDTH, "-"))
        lines += [_line(f"Median TTFT turn {t} (ms), {result['num_requests_by_turn'][t]} req", value)
                  for t, value in result["median_ttft_by_turn_ms"].items()]
        lines.append(_line("Median TTFT from turn 1 on (ms)", result["median_ttft_later_turns_ms"]))
    if result.get("total_cached_tokens") is not None or result.get("prefix_cache_hit_rate") is not None:
        lines.append(" Prefix Cache ".center(WIDTH, "-"))
        if result.get("total_cached_tokens") is not None:
            lines.append(_line("Cached prompt tokens (usage)", result["total_cached_tokens"]))
        if result.get("prefix_cache_hit_rate") is not None:
            lines += [_line("Queried tokens (/metrics)", int(result["prefix_cache_queries"])),
                      _line("Hit tokens (/metrics)", int(result["prefix_cache_hits"])),
                      _line("Hit rate (/metrics, %)", 100 * result["prefix_cache_hit_rate"])]
    return lines


def format_sweep_table(results: list[dict[str, Any]], param: str) -> str:
    header = (f"{param:>16} {'req/s':>8} {'out tok/s':>10} {'TTFT p50':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
              f"{'E2EL p50':>9} {'failed':>6}")
    rows = [f"{str(r[param]):>16} {r['request_throughput']:>8.2f} {r['output_throughput']:>10.1f} "
            f"{r['median_ttft_ms']:>9.1f} {r['median_tpot_ms']:>9.2f} {r.get('p99_tpot_ms', math.nan):>9.2f} "
            f"{r['median_e2el_ms']:>9.1f} {r['failed']:>6}" for r in results]
    return "\n".join([header, *rows])


def _finite(value: Any) -> Any:
    """NaN and infinity are not JSON: NaN becomes null, infinity the string "inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(result), indent=2) + "\n", encoding="utf-8")


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_latency_cdfs(path: Path, runs: list[tuple[str, dict[str, Any]]]) -> bool:
    """One panel per latency metric, one CDF curve per run (label, result). False without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for ax, (name, key) in zip(axes, [("ttft", "ttfts"), ("tpot", "tpots"), ("itl", "itls"), ("e2el", "e2els")]):
        for label, result in runs:
            values = sorted(v * 1000 for v in result[key])
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=label)
        ax.set(title=METRIC_TITLES[name], xlabel=f"{name.upper()} (ms)", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    if len(runs) > 1:
        axes[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_sweep(path: Path, results: list[dict[str, Any]], param: str) -> bool:
    """Output throughput and TPOT (median, p99 when measured) against the swept concurrency or request rate."""
    plt = _pyplot()
    if plt is None:
        return False
    results = [r for r in results if math.isfinite(float(r[param]))]
    xs = [r[param] for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(xs, [r["output_throughput"] for r in results], marker="o")
    left.set(title="Output token throughput", xlabel=param, ylabel="tokens/s")
    right.plot(xs, [r["median_tpot_ms"] for r in results], marker="o", label="median")
    if all("p99_tpot_ms" in r for r in results):
        right.plot(xs, [r["p99_tpot_ms"] for r in results], marker="s", label="p99")
    right.set(title="Time per output token", xlabel=param, ylabel="ms")
    right.legend()
    for ax in (left, right):
        ax.grid(alpha=0.3)
        if xs and min(xs) > 0 and max(xs) / min(xs) >= 8:
            ax.set_xscale("log", base=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
