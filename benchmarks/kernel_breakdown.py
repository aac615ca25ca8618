"""Where a decode step's GPU time goes: the kernels of a few steps, traced by torch's profiler
(CUPTI sees kernels launched through cuda-python and inside CUDA graphs alike), summed by name:
their durations (`kernel_breakdown`), how far each moves the step's end (`critical_path`), or one
layer's kernels on a time line (`layer_timeline`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch


def kernel_breakdown(step: Callable[[], object], num_steps: int = 5) -> list[tuple[str, float, float]]:
    """(kernel name, µs per step, launches per step), longest first."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in _traced(step, num_steps).events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals[event.name]
            entry[0] += event.device_time
            entry[1] += 1
    return _per_step(totals, num_steps)


def _traced(step: Callable[[], object], num_steps: int) -> torch.profiler.profile:
    """The CUDA trace of `num_steps` steps (after one untraced), each waited for."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            step()
            torch.cuda.synchronize()
    return prof


def _per_step(totals: dict[str, list[float]], num_steps: int) -> list[tuple[str, float, float]]:
    rows = [(name, us / num_steps, count / num_steps) for name, (us, count) in totals.items()]
    return sorted(rows, key=lambda row: -row[1])


def format_breakdown(rows: list[tuple[str, float, float]], step_ms: float, top: int = 22) -> str:
    busy_us = sum(us for _, us, _ in rows)
    lines = [(f"  GPU busy {busy_us / 1e3:.3f} ms of a {step_ms:.3f} ms step "
             f"({100 * busy_us / 1e3 / step_ms:.0f} %), {sum(n for *_, n in rows):.0f} kernels per step")]
    for name, us, count in rows[:top]:
        lines.append(f"  {us:9.1f} µs  {count:5.0f}x  {name[:90]}")
    return "\n".join(lines)


def critical_path(step: Callable[[], object], num_steps: int = 5) -> list[tuple[str, float, float]]:
    """(kernel name, µs per step it moves the step's end, launches per step), largest first.

    With programmatic dependent launch a kernel starts while its predecessor runs, so its duration
    includes waiting. Here the kernels of each traced step are taken in start order and each is
    charged with how far it pushes the latest end seen so far: the charges of a step sum to its GPU
    time from the first kernel's start to the last one's end, and a kernel that finishes in the
    shadow of an earlier one costs nothing.
    """
    kernels = _kernels(_traced(step, num_steps))
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    frontier = None
    for start, end, name in kernels:
        if frontier is None or start > frontier:     # a new step (or an idle gap): charge from its start
            frontier = start
        entry = totals[name]
        entry[0] += max(0, end - frontier) / 1e3
        entry[1] += 1
        frontier = max(frontier, end)
    return _per_step(totals, num_steps)


def _kernels(prof: torch.profiler.profile) -> list[tuple[int, int, str]]:
    """(start ns, end ns, name) of every traced kernel, in start order."""
    return sorted((e.start_ns(), e.end_ns(), e.name()) for e in prof.profiler.kineto_results.events()
                  if e.device_type() == torch.autograd.DeviceType.CUDA
                  and not e.name().startswith(("Memcpy", "Memset")))


def layer_timeline(step: Callable[[], object], marker: str, layer: int, num_steps: int = 3) -> str:
    """The kernels of the last traced step from the `layer`-th launch whose name contains `marker`
    to the next one: each one's start and end in µs from the marker's start, its duration and its
    start against the previous kernel's end (negative: it overlapped, as programmatic dependent
    launch allows)."""
    kernels = _kernels(_traced(step, num_steps))
    marks = [i for i, (_, _, name) in enumerate(kernels) if marker in name]
    per_step = len(marks) // num_steps
    if layer + 1 >= per_step:
        raise ValueError(f"{per_step} launches of {marker!r} a step: no layer {layer} with one after it")
    first, last = marks[(num_steps - 1) * per_step + layer], marks[(num_steps - 1) * per_step + layer + 1]
    t0, prev_end = kernels[first][0], None
    lines = [f"  {'start':>8} {'end':>8} {'µs':>7} {'gap':>7}  kernel (µs from {marker} of layer {layer})"]
    for start, end, name in kernels[first:last + 1]:
        gap = "" if prev_end is None else f"{(start - prev_end) / 1e3:7.2f}"
        lines.append(f"  {(start - t0) / 1e3:8.2f} {(end - t0) / 1e3:8.2f} {(end - start) / 1e3:7.2f} {gap:>7}  "
                     f"{name[:70]}")
        prev_end = end if prev_end is None else max(prev_end, end)
    return "\n".join(lines)
