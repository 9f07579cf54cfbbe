"""Timing and table printing shared by the benchmarks (not a test: nothing here asserts speed)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_ms(
    fn: Callable[[], object],
    device: torch.device | str = "cpu",
    warmup: int = 3,
    repeats: int = 10,
    budget_s: float = 5.0,
) -> float:
    """Median wall time of ``fn()`` in milliseconds, after ``warmup`` untimed calls.

    Stops early once ``budget_s`` seconds of timed calls have passed (at least 3 timed calls).
    """
    for _ in range(warmup):
        fn()
    synchronize(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeats and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def print_table(title: str, rows: Sequence[tuple[str, float]], baseline: str) -> None:
    """Print ``name | ms | x baseline`` rows; ``baseline`` names the row the ratios divide by."""
    base = dict(rows)[baseline]
    width = max(len(name) for name, _ in rows)
    print(f"\n{title}")
    print(f"  {'method'.ljust(width)} | {'median ms':>10} | {'/ ' + baseline:>{len(baseline) + 2}}")
    for name, ms in rows:
        print(f"  {name.ljust(width)} | {ms:10.3f} | {ms / base:{len(baseline) + 2}.2f}")
