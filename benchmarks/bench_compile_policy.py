"""The compile policy on its two ends: a short script never stalls, a long loop runs compiled.

Every figure comes from a fresh Python process with an EMPTY inductor cache (its own temporary
``TORCHINDUCTOR_CACHE_DIR``), as on a new machine, one thread on the CPU:

1. Short script: 10 calls of the README example (1,000 particles, seed-000 function) with
   ``compile=False``, ``"auto"`` and ``True``; total seconds of the 10 calls (imports excluded).
   Goal: ``"auto"`` <= 2x eager.
2. Long loop: 1e6 particles, ``"auto"``, calling for up to 90 s; when does a call first run at
   compiled speed, i.e. <= 0.5x autograd double backward (timed in the same process)? Goal:
   within 60 s. Beside it, ``compile=True`` and ``compile=False`` processes give the lines of
   always-compiled and always-eager for the plot of total time against calls (the ski-rental
   picture).

3. The stall, step by step: a PINN training loop (2-D Poisson residual, tanh MLP 2-64-64-1,
   Adam) calling ``pyhvp.laplacian`` at B = 4096 under the default ``compile="auto"``, timed per
   step until 30 steps after the compile: the first step (recording, tracing), the steps over
   1 s (the compile) with what pyhvp logged before them, and the median step before and after.

Usage: python benchmarks/bench_compile_policy.py [short] [long] [stall]   (CPU; all three, saved
to results/, take about 7 minutes; named sections are printed only)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

from _timing import Report, announce

CHILD = r"""
import json, sys, time
import torch, pyhvp
torch.set_num_threads(1)
mode, n, calls, seconds = sys.argv[1], int(float(sys.argv[2])), int(sys.argv[3]), float(sys.argv[4])
backend = pyhvp.TorchBackend(compile={"eager": False, "auto": "auto", "compiled": True}[mode])
torch.manual_seed(0)
def f_batch(x, mu):
    return torch.exp(-((x - mu) ** 2).sum(-1))
x = torch.randn(10, 10, n // 100, 3); mu = torch.randn(10, 1, 1, 3); v = torch.randn_like(x)
def double_backward():
    y = x.detach().requires_grad_()
    (g,) = torch.autograd.grad(f_batch(y, mu).sum(), y, create_graph=True)
    return torch.autograd.grad(g, y, v)
stamps, begin = [], time.perf_counter()
while len(stamps) < calls and time.perf_counter() - begin < seconds:
    t0 = time.perf_counter()
    pyhvp.grad_and_hvp(f_batch, x, v, mu, backend=backend)
    stamps.append((t0 - begin, time.perf_counter() - t0))
reference = []
for _ in range(7):
    t0 = time.perf_counter(); double_backward(); reference.append(time.perf_counter() - t0)
print(json.dumps({"stamps": stamps, "double_backward": sorted(reference)[3]}))
"""


PINN_CHILD = r"""
import json, logging, sys, time
import torch, pyhvp
torch.set_num_threads(1)
seconds, B = float(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(2, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                          torch.nn.Tanh(), torch.nn.Linear(64, 1))
optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
x = torch.rand(B, 2)
source = -2 * torch.pi**2 * torch.sin(torch.pi * x[:, 0]) * torch.sin(torch.pi * x[:, 1])
logged, begin = [], time.perf_counter()
class Noted(logging.Handler):  # what pyhvp logs, and when (it prints to stderr as well)
    def emit(self, record):
        logged.append((time.perf_counter() - begin, record.levelname, record.getMessage()))
        print(record.getMessage(), file=sys.stderr)
logging.getLogger("pyhvp").addHandler(Noted())
stamps, after_stall = [], None
while time.perf_counter() - begin < seconds and (after_stall is None or after_stall < 30):
    t0 = time.perf_counter()
    optimizer.zero_grad()
    loss = ((pyhvp.laplacian(lambda y: net(y)[..., 0], x) - source) ** 2).mean()
    loss.backward()
    optimizer.step()
    took = time.perf_counter() - t0
    stamps.append((t0 - begin, took))
    if len(stamps) > 1 and took > 1.0:
        after_stall = 0
    elif after_stall is not None:
        after_stall += 1
print(json.dumps({"stamps": stamps, "logged": logged}))
"""


def run_child(mode: str, n: float, calls: int, seconds: float) -> dict:
    return run_fresh(CHILD, [mode, str(n), str(calls), str(seconds)], seconds + 300)


def run_fresh(child: str, arguments: list[str], timeout: float) -> dict:
    """``child``'s JSON (its last line of output), run in a fresh process with an empty
    inductor cache and one thread."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(
            [sys.executable, "-c", child, *arguments],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            check=True,
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def short_script(report: Report) -> None:
    announce("10 calls of the README example, fresh processes: eager, auto, compiled")
    totals = {
        mode: sum(t for _, t in run_child(mode, 1e3, 10, 600)["stamps"])
        for mode in ("eager", "auto", "compiled")
    }
    rows = [(f"compile={mode}, 10 calls", seconds * 1e3) for mode, seconds in totals.items()]
    report.table(
        "README example (1,000 particles), fresh process, empty inductor cache: total of 10 calls",
        rows,
        baseline="compile=eager, 10 calls",
    )


def long_loop(report: Report) -> None:
    announce(
        "1e6 particles: compile='auto' for 90 s, then always eager and always compiled, 45 s each"
    )
    auto = run_child("auto", 1e6, 10**6, 90)
    limit = 0.5 * auto["double_backward"]
    fast = [start for start, took in auto["stamps"] if took <= limit]
    reached = f"{fast[0]:.1f} s" if fast else "not within 90 s"
    report.text(
        f"\n1e6 particles, compile='auto', fresh process, empty inductor cache: "
        f"{len(auto['stamps'])} calls in 90 s; double backward {auto['double_backward'] * 1e3:.1f}"
        f" ms; first call at <= 0.5x double backward after {reached} (goal: 60 s)"
    )
    lines = {"pyhvp auto": auto["stamps"]}
    for mode in ("eager", "compiled"):
        lines[f"always {mode}"] = run_child(mode, 1e6, 10**6, 45)["stamps"]
    for name, stamps in lines.items():
        total = 0.0
        for calls, (_, took) in enumerate(stamps, start=1):
            total += took
            if calls in (1, 10, 100, 1000) or calls == len(stamps):
                report.point("1e6 particles: total time of the first N calls", "calls N",
                             calls, [(name, total * 1e3)], "ms in all")  # fmt: skip
        report.text(f"  {name}: {len(stamps)} calls, {total:.1f} s in all")


def stall_timeline(report: Report) -> None:
    announce(
        "PINN loop, laplacian at B = 4096, compile='auto', fresh process: steps around the compile"
    )
    run = run_fresh(PINN_CHILD, ["600", "4096"], 900)
    stamps = run["stamps"]
    stalls = [(i, start, took) for i, (start, took) in enumerate(stamps) if i and took > 1.0]
    report.text(
        f"\nPINN loop (2-D Poisson, MLP 2-64-64-1, B = 4096), compile='auto', fresh process, "
        f"empty inductor cache: {len(stamps)} steps; first step {stamps[0][1]:.2f} s (recording, "
        f"tracing)"
    )
    for i, start, took in stalls:
        said = [f"{t:.1f} s: {level} {message[:100]}..." for t, level, message in run["logged"]
                if t <= start + 0.5]  # fmt: skip
        report.text(
            f"  step {i} at {start:.1f} s took {took:.1f} s; logged before it: "
            + ("; ".join(said) if said else "nothing")
        )
    if stalls:
        first = stalls[0][0]
        before = statistics.median(took for _, took in stamps[1:first])
        after = statistics.median(took for _, took in stamps[stalls[-1][0] + 1 :])
        report.text(
            f"  median step before the compile {before * 1e3:.1f} ms, after {after * 1e3:.1f} ms"
        )


def main() -> None:
    import torch

    torch.set_num_threads(1)  # as in the child processes, so the report's header says so
    report = Report("bench_compile_policy", "cpu")
    chosen = sys.argv[1:] or list(SECTIONS)
    for name in chosen:
        SECTIONS[name](report)
    if chosen == list(SECTIONS):  # results/ holds whole runs only
        report.save()


SECTIONS = {"short": short_script, "long": long_loop, "stall": stall_timeline}


if __name__ == "__main__":
    main()
