"""Timing, tables and plots shared by the benchmarks (not a test: nothing here asserts speed).

Figures are medians. Methods compared side by side are timed *interleaved* (one call of each per
round), so a load that comes and goes on a shared machine hits every method alike and the ratios
hold even when absolute times drift. A :class:`Report` prints each table, keeps it, and on
``save()`` writes ``benchmarks/results/<name>-<device>.txt`` (the tables) and, when matplotlib is
installed (the ``bench`` extra), ``<name>-<device>.png``: time per call against problem size,
log-log, one panel per problem, every method beside the baselines.
"""

from __future__ import annotations

import gc
import os
import platform
import random
import re
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

RESULTS = Path(__file__).resolve().parent / "results"


def one_core() -> None:
    """One core for torch and XLA alike, so that a JAX row is timed as torch's are: the process
    is pinned to one CPU (XLA's CPU runtime ignores its single-thread flags, and its thread pool,
    squeezed onto one pinned core, runs several times slower) and XLA is told to use one thread.
    Call before JAX is imported."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    os.environ.setdefault(
        "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    )


def allocator() -> str:
    """The CPU allocator's settings in effect, for a report's header: with glibc's defaults large
    buffers are mmap'd and page-faulted afresh on every call, which on the 2-core CI machine can
    cost as much as the arithmetic."""
    tuned = [k for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_") if k in os.environ]
    preload = os.environ.get("LD_PRELOAD", "")
    if tuned or preload:
        return f"tuned ({', '.join(tuned + ([preload] if preload else []))})"
    return "glibc defaults"


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def announce(case: str) -> None:
    """One line, with the clock time, before a case is checked and timed: a long run (minutes per
    file) says what it is doing."""
    print(f"[{time.strftime('%H:%M:%S')}] {case} ...", flush=True)


def median_ms(
    fn: Callable[[], object],
    device: torch.device | str = "cpu",
    warmup: int = 3,
    repeats: int = 10,
    budget_s: float = 5.0,
) -> float:
    """Median wall time of ``fn()`` in milliseconds, after ``warmup`` untimed calls.

    Stops after ``repeats`` timed calls, or once ``budget_s`` seconds have passed and at least
    3 were made.
    """
    return interleaved_ms({"fn": fn}, device, warmup, repeats, budget_s)["fn"]


def interleaved_ms(
    fns: dict[str, Callable[[], object]],
    device: torch.device | str = "cpu",
    warmup: int = 3,
    rounds: int = 15,
    budget_s: float = 5.0,
) -> dict[str, float]:
    """Median wall time (ms) of each function, timed round-robin: one call of each per round.

    ``warmup`` untimed calls each first; stops after ``rounds`` rounds, or once ``budget_s``
    seconds have passed and at least 3 rounds were made. Each round takes the functions in a new
    order (seeded), and garbage is collected before each timed call: otherwise a function that
    leaves reference cycles (``backward(create_graph=True)``) has them collected, and timed, in
    whichever call comes next. (The objects alive before timing are frozen out of collection:
    a full collection over them takes 150 ms with torch imported.)
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    shuffle = random.Random(0).shuffle
    gc.collect()
    gc.freeze()
    try:
        start = time.perf_counter()
        for done in range(rounds):
            if done >= 3 and time.perf_counter() - start > budget_s:
                break
            shuffle(order)
            for name, fn in order:
                gc.collect()
                t0 = time.perf_counter()
                fn()
                synchronize(device)
                times[name].append((time.perf_counter() - t0) * 1e3)
    finally:
        gc.unfreeze()
    return {name: statistics.median(ts) for name, ts in times.items()}


def peak_bytes(fn: Callable[[], object], device: str) -> int:
    """The most bytes held at once by tensors allocated while ``fn()`` runs."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    held = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        held += event.nbytes()
        peak = max(peak, held)
    return peak


def format_table(title: str, rows: Sequence[tuple[str, float]], baseline: str) -> str:
    """``name | ms | x baseline`` rows; ``baseline`` names the row the ratios divide by."""
    base = dict(rows)[baseline]
    width = max(len(name) for name, _ in rows)
    lines = [
        f"\n{title}",
        f"  {'method'.ljust(width)} | {'median ms':>10} | {'/ ' + baseline:>{len(baseline) + 2}}",
    ]
    lines += [
        f"  {name.ljust(width)} | {ms:10.3f} | {ms / base:{len(baseline) + 2}.2f}"
        for name, ms in rows
    ]
    return "\n".join(lines)


class Report:
    """Tables and scaling points of one benchmark run; ``save()`` writes them to ``results/``."""

    def __init__(self, name: str, device: torch.device | str) -> None:
        self.name, self.device = name, str(device)
        self.texts: list[str] = [
            f"{name}: torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
            f"{self.device}, {platform.processor() or platform.machine()}"
        ]
        # panel title -> (x label, y label, {method: [(x, ms), ...]})
        self.panels: dict[str, tuple[str, str, dict[str, list[tuple[float, float]]]]] = {}
        print(self.texts[0])

    def text(self, line: str) -> None:
        print(line)
        self.texts.append(line)

    def table(self, title: str, rows: Sequence[tuple[str, float]], baseline: str) -> None:
        self.text(format_table(title, rows, baseline))

    def point(
        self,
        panel: str,
        x_label: str,
        x: float,
        rows: Sequence[tuple[str, float]],
        y_label: str = "ms per call (median)",
    ) -> None:
        """Add ``(x, ms)`` for every method of ``rows`` to the scaling plot ``panel``."""
        *_, series = self.panels.setdefault(panel, (x_label, y_label, {}))
        for method, ms in rows:
            series.setdefault(method, []).append((x, ms))

    def save(self) -> None:
        RESULTS.mkdir(exist_ok=True)
        stem = RESULTS / f"{self.name}-{self.device}"
        stem.with_suffix(".txt").write_text("\n".join(self.texts) + "\n")
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print(f"\n(wrote {stem}.txt; install the bench extra for plots)")
            return
        if not self.panels:
            return
        columns = min(3, len(self.panels))
        rows = -(-len(self.panels) // columns)
        fig, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 4.2 * rows), squeeze=False)
        for ax in axes.flat[len(self.panels) :]:
            ax.set_visible(False)
        for ax, (panel, (x_label, y_label, series)) in zip(
            axes.flat, self.panels.items(), strict=False
        ):
            lines: dict[str, list[tuple[float, float]]] = {}
            for method, points in series.items():  # "hutchinson (err 0.31)" -> "hutchinson"
                lines.setdefault(re.sub(r"\s*\([^()]*\)$", "", method), []).extend(points)
            for method, points in lines.items():
                xs, ms = zip(*sorted(points), strict=True)
                style = "-o" if method.startswith("pyhvp") else "--."
                ax.loglog(xs, ms, style, label=method, linewidth=2 if "pyhvp" in method else 1)
            ax.set(title=panel, xlabel=x_label, ylabel=y_label)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(self.texts[0], fontsize=8)
        fig.tight_layout()
        fig.savefig(stem.with_suffix(".png"), dpi=110)
        plt.close(fig)
        print(f"\n(wrote {stem}.txt and {stem}.png)")
