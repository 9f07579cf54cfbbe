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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from torch.profiler import ProfilerActivity, profile

try:
    import resource
except ImportError:  # (Windows: no page-fault counts)
    resource = None  # type: ignore[assignment]

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
    variables = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "THP_MEM_ALLOC_ENABLE")
    tuned = [k for k in variables if k in os.environ]
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


class Runs(NamedTuple):
    """One function's timed calls: the median milliseconds and the median of the page faults
    each call took (minor and major; 0 where the platform does not count them)."""

    ms: float
    faults: float


def _faults() -> int:
    """Page faults of this process so far (every thread's), where the platform counts them."""
    if resource is None:
        return 0
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


def interleaved_ms(
    fns: dict[str, Callable[[], object]],
    device: torch.device | str = "cpu",
    warmup: int = 3,
    rounds: int = 15,
    budget_s: float = 5.0,
) -> dict[str, float]:
    """Median wall time (ms) of each function, timed round-robin: :func:`interleaved_runs`."""
    return {name: runs.ms for name, runs in interleaved_runs(fns, device, warmup, rounds,
                                                             budget_s).items()}  # fmt: skip


def interleaved_runs(
    fns: dict[str, Callable[[], object]],
    device: torch.device | str = "cpu",
    warmup: int = 3,
    rounds: int = 15,
    budget_s: float = 5.0,
    settle: int = 0,
) -> dict[str, Runs]:
    """Median wall time (ms) and page faults of each function, timed round-robin: one call of
    each per round.

    ``warmup`` untimed calls each first; stops after ``rounds`` rounds, or once ``budget_s``
    seconds have passed and at least 3 rounds were made. Each round takes the functions in a new
    order (seeded), and garbage is collected before each timed call: otherwise a function that
    leaves reference cycles (``backward(create_graph=True)``) has them collected, and timed, in
    whichever call comes next. (The objects alive before timing are frozen out of collection:
    a full collection over them takes 150 ms with torch imported.) The page faults show what
    the allocator returned to the system between calls and a call touched afresh: on the CI
    machine's VM a fault costs about 1.6 us, and a method whose buffers another method's calls
    made glibc give back pays for every page again. ``settle``: untimed calls of a function
    right before each of its timed ones, so that it is timed as a loop of its own calls runs it
    (the allocator holding what its last call freed), not after another function's call.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    faults: dict[str, list[int]] = {name: [] for name in fns}
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
                for _ in range(settle):
                    fn()
                synchronize(device)
                gc.collect()
                f0, t0 = _faults(), time.perf_counter()
                fn()
                synchronize(device)
                times[name].append((time.perf_counter() - t0) * 1e3)
                faults[name].append(_faults() - f0)
    finally:
        gc.unfreeze()
    return {
        name: Runs(statistics.median(times[name]), statistics.median(faults[name])) for name in fns
    }


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


def format_table(
    title: str,
    rows: Sequence[tuple[str, float]],
    baseline: str,
    faults: Mapping[str, float] | None = None,
) -> str:
    """``name | ms | x baseline`` rows; ``baseline`` names the row the ratios divide by;
    ``faults``: a last column, the page faults per call (by name)."""
    base = dict(rows)[baseline]
    width = max(len(name) for name, _ in rows)
    ratio = len(baseline) + 2
    lines = [
        f"\n{title}",
        f"  {'method'.ljust(width)} | {'median ms':>10} | {'/ ' + baseline:>{ratio}}"
        + (f" | {'faults/call':>11}" if faults else ""),
    ]
    lines += [
        f"  {name.ljust(width)} | {ms:10.3f} | {ms / base:{ratio}.2f}"
        + (f" | {faults[name]:11.0f}" if faults else "")
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

    def table(
        self,
        title: str,
        rows: Sequence[tuple[str, float]],
        baseline: str,
        faults: Mapping[str, float] | None = None,
    ) -> None:
        self.text(format_table(title, rows, baseline, faults))

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
