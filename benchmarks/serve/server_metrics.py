"""The server's own prefix-cache counters, read from its Prometheus /metrics before and after a run.

flint-sched exposes `flint:prefix_cache_{queries,hits}_total`, vLLM `vllm:prefix_cache_{queries,hits}_total`
(both in tokens); either is read. The run's hit rate is hits / queries of the difference.
"""

from __future__ import annotations

import httpx

NAMES = {"queries": ("flint:prefix_cache_queries", "vllm:prefix_cache_queries"),
         "hits": ("flint:prefix_cache_hits", "vllm:prefix_cache_hits")}


def parse_prefix_cache(text: str) -> dict[str, float] | None:
    """{"queries": tokens, "hits": tokens} summed over labels, or None when the counters are absent."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{", 1)[0].removesuffix("_total")
        for key, names in NAMES.items():
            if name in names:
                found[key] = found.get(key, 0.0) + float(value)
    return found if set(found) == set(NAMES) else None


async def scrape_prefix_cache(base_url: str) -> dict[str, float] | None:
    """The counters now, or None when /metrics cannot be read or lacks them."""
    try:
        async with httpx.AsyncClient(timeout=10.0) as http:
            response = await http.get(base_url.rstrip("/") + "/metrics")
    except httpx.HTTPError:
        return None
    return parse_prefix_cache(response.text) if response.status_code == 200 else None


def hit_rate(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """{"queries", "hits", "hit_rate"} of the run (NaN rate without queries), or None when unread."""
    if before is None or after is None:
        return None
    queries, hits = after["queries"] - before["queries"], after["hits"] - before["hits"]
    return {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries > 0 else float("nan")}
