"""Exact per-instance Laplacians (issue 12): pyhvp against torch.func compositions and folx.

B = 1024 instances, CPU, one thread (torch.set_num_threads(1), and the process pinned to one
core, so XLA runs on one too), float32 and float64. Problems: a 3-hidden-layer tanh MLP (width 64) with n = 16 and 64 inputs;
sum_i exp(-(x_i - mu_i)^2) with n = 16 and 64; sum_{i<j} exp(-|r_i - r_j|^2) over 8 particles
in 3-D (event_dims = 2, n = 24).

Rows: the torch.func compositions -- vmap(hessian) then the trace; forward-over-forward (jvp of
jvp along each e_i, in every instance at once); forward-over-reverse with one-hot tangents
(jvp(grad) along each e_i, keep entry i) -- eagerly and torch.compile-d (compiled in a child
process, since inductor segfaults on some of them on the CPU: a crash is reported as such);
Hutchinson with 16 Rademacher probes (torch.func forward-over-reverse, and pyhvp's), with its
relative error; pyhvp exact, eager (compile=False) and compiled (compile=True); folx's
forward_laplacian under jax.jit when JAX and folx are installed. Every exact row is checked
against pyhvp eager, and pyhvp against a float64 dense Hessian trace, before anything is timed;
the rows of this process are then timed interleaved (one call of each per round), so a load
that comes and goes hits them alike: the eager torch.func rows together, pyhvp's exact rows
together with folx's (calls of like size: a 100 ms composition between two 0.3 ms calls evicts
their caches). Ratios divide by the best torch.func composition; a last table compares pyhvp
with folx.

Eager PyTorch on the CPU allocates every intermediate with malloc; with glibc's defaults large
buffers are mmap'd and page-faulted afresh on each call, which on the 2-core CI machine costs
more than the arithmetic (JAX keeps its own pool). The allocator settings in effect are printed;
set MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ (or preload jemalloc/tcmalloc) to compare.
A last section (alone with ``--per-call``, written to ``bench_laplacian_per_call-cpu.txt``)
times a Gaussian whose width t is a new Python float at every call against the same t (issue
17: the float is a program input, so neither the program nor a compiled kernel is rebuilt), and
the parts of one cached call: f alone, its record, the jet kernel alone, the whole call.
Usage: python benchmarks/bench_laplacian.py [--no-compiled-baselines | --per-call]
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass
from functools import partial

import torch
from _timing import Report, allocator, announce, interleaved_ms, median_ms, one_core
from torch.func import grad, hessian, jvp, vmap

import pyhvp
from pyhvp import taylor
from pyhvp._estimators import Space, checked

one_core()  # before JAX starts: its rows run on one thread, as torch's do

B = 1024
PROBES = 16
DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass
class Problem:
    """A batched f (batch + event -> batch), its event_dims, input and JAX twin (same weights)."""

    name: str
    f: object
    event_dims: int
    x: torch.Tensor
    jax_f: object  # one instance -> scalar, built lazily (JAX is optional)


def mlp(n, dtype):
    g = torch.Generator().manual_seed(0)
    shapes = [(64, n), (64, 64), (64, 64), (1, 64)]
    weights = [(torch.randn(s, generator=g) / math.sqrt(s[1])).to(dtype) for s in shapes]
    biases = [torch.randn(s[0], generator=g).to(dtype) for s in shapes]

    def f(x):
        h = x
        for w, b in zip(weights[:-1], biases[:-1], strict=True):
            h = torch.tanh(h @ w.T + b)
        return (h @ weights[-1].T + biases[-1]).squeeze(-1)

    def jax_f():
        import jax.numpy as jnp

        ws, bs = [jnp.asarray(w.numpy()) for w in weights], [jnp.asarray(b.numpy()) for b in biases]

        def single(x):
            h = x
            for w, b in zip(ws[:-1], bs[:-1], strict=True):
                h = jnp.tanh(h @ w.T + b)
            return (h @ ws[-1].T + bs[-1])[0]

        return single

    return Problem(f"tanh MLP 3x64, n={n}", f, 1, torch.randn(B, n, generator=g).to(dtype), jax_f)


def gaussians(n, dtype):
    g = torch.Generator().manual_seed(1)
    mu = torch.randn(n, generator=g).to(dtype)

    def f(x):
        return torch.exp(-((x - mu) ** 2)).sum(-1)

    def jax_f():
        import jax.numpy as jnp

        m = jnp.asarray(mu.numpy())
        return lambda x: jnp.exp(-((x - m) ** 2)).sum()

    x = torch.randn(B, n, generator=g).to(dtype)
    return Problem(f"sum_i exp(-(x_i-mu_i)^2), n={n}", f, 1, x, jax_f)


def pairs(dtype):
    g = torch.Generator().manual_seed(2)

    def f(r):  # (..., 8, 3) -> (...)
        d = r[..., :, None, :] - r[..., None, :, :]
        return torch.triu(torch.exp(-(d**2).sum(-1)), 1).sum((-2, -1))

    def jax_f():
        import jax.numpy as jnp

        def single(r):
            d = r[:, None, :] - r[None, :, :]
            return jnp.triu(jnp.exp(-(d**2).sum(-1)), 1).sum()

        return single

    x = torch.randn(B, 8, 3, generator=g).to(dtype)
    return Problem("sum_{i<j} exp(-|r_i-r_j|^2), 8 x 3-D", f, 2, x, jax_f)


PROBLEMS = {
    "mlp16": lambda t: mlp(16, t),
    "mlp64": lambda t: mlp(64, t),
    "gauss16": lambda t: gaussians(16, t),
    "gauss64": lambda t: gaussians(64, t),
    "pairs": pairs,
}


# --- torch.func compositions (over flattened events: x as (B, n)) ------------------------------


def flat(problem):
    """f over (B, n) and x as (B, n)."""
    event = problem.x.shape[1:]
    return (lambda y: problem.f(y.reshape(-1, *event))), problem.x.reshape(B, -1)


def basis(x):
    n = x.shape[-1]
    return torch.eye(n, dtype=x.dtype)[:, None, :].expand(n, *x.shape)


def vmap_hessian(f, x):
    return vmap(hessian(lambda xi: f(xi[None])[0]))(x).diagonal(dim1=-2, dim2=-1).sum(-1)


def fwd_over_fwd(f, x):
    def along(u):
        return jvp(lambda y: jvp(f, (y,), (u,))[1], (x,), (u,))[1]

    return vmap(along)(basis(x)).sum(0)


def fwd_over_rev(f, x):
    g = grad(lambda y: f(y).sum())
    products = vmap(lambda u: jvp(g, (x,), (u,))[1])(basis(x))  # (n, B, n): H e_i
    return products.diagonal(dim1=0, dim2=-1).sum(-1)


def hutchinson(f, x, seed=0):
    z = 2.0 * torch.randint(0, 2, (PROBES, *x.shape), generator=torch.Generator().manual_seed(seed))
    z = (z - 1).to(x.dtype)
    g = grad(lambda y: f(y).sum())
    hz = vmap(lambda u: jvp(g, (x,), (u,))[1])(z)
    return (z * hz).sum(-1).mean(0)


FOLX = "folx forward_laplacian (jax.jit)"
COMPOSITIONS = {
    "vmap(hessian)": vmap_hessian,
    "fwd-fwd": fwd_over_fwd,
    "fwd-rev one-hot": fwd_over_rev,
}


def tolerance(dtype):
    return {"rtol": 1e-3, "atol": 1e-3} if dtype == torch.float32 else {"rtol": 1e-8, "atol": 1e-8}


def relative_error(estimate, exact):
    return float((estimate - exact).norm() / exact.norm())


def pyhvp_exact(problem, compile_mode):
    backend = pyhvp.TorchBackend(compile=compile_mode)
    return lambda: pyhvp.laplacian(
        problem.f, problem.x, event_dims=problem.event_dims, backend=backend
    )


def compiled_baselines(key, dtype_name, names):
    """In a child process: each named composition compiled, checked and timed; prints one JSON
    line when it starts and one with its time or error, so a crash names the one that crashed."""
    problem = PROBLEMS[key](DTYPES[dtype_name])
    f, x = flat(problem)
    exact = pyhvp_exact(problem, False)()
    for name in names:
        print(json.dumps({"start": name}), flush=True)
        compiled = torch.compile(lambda m=COMPOSITIONS[name]: m(f, x), dynamic=False)
        try:
            torch.testing.assert_close(compiled(), exact, **tolerance(x.dtype))
            print(json.dumps({"name": name, "ms": median_ms(compiled)}), flush=True)
        except Exception as error:  # a compile error is a result, not a benchmark failure
            print(json.dumps({"name": name, "error": type(error).__name__}), flush=True)


def run_compiled_baselines(key, dtype_name):
    """``{composition: ms or why not}``, re-running the child past a composition that crashes it."""
    results, remaining = {}, list(COMPOSITIONS)
    while remaining:
        done = subprocess.run(
            [sys.executable, __file__, "--compiled-baselines", key, dtype_name, *remaining],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        started = None
        for line in done.stdout.splitlines():
            record = json.loads(line)
            started = record.get("start")
            if "name" in record:
                results[record["name"]] = record.get("ms", record.get("error"))
        if done.returncode != 0 and started is not None:
            results[started] = "segfault" if done.returncode == -11 else f"exit {done.returncode}"
        remaining = [name for name in remaining if name not in results]
    return results


def folx_laplacian(problem):
    """folx's forward Laplacian under ``jax.jit`` (a call that waits for the result) and its
    value as a torch tensor, or ``(None, None)`` where JAX or folx is missing."""
    try:
        import folx
        import jax
        import jax.numpy as jnp
    except ImportError:
        return None, None
    jax.config.update("jax_enable_x64", True)
    single = problem.jax_f()
    laplacian = jax.jit(jax.vmap(lambda xi: folx.forward_laplacian(single)(xi).laplacian))
    xj = jnp.asarray(problem.x.numpy())
    value = torch.from_numpy(jax.device_get(laplacian(xj)).copy())
    return (lambda: jax.block_until_ready(laplacian(xj))), value


def bench(key, dtype_name, with_compiled, report):
    """One problem's table. The rows that run in this process are checked, then timed
    interleaved in two sets of like-sized calls -- the eager torch.func compositions with both
    Hutchinson estimators; pyhvp's exact rows with folx's -- so that their ratios hold on a
    shared machine; the compiled compositions run in a child process of their own
    (:func:`run_compiled_baselines`)."""
    dtype = DTYPES[dtype_name]
    problem = PROBLEMS[key](dtype)
    f, x = flat(problem)
    exact = pyhvp_exact(problem, False)()
    f64, x64 = flat(PROBLEMS[key](torch.float64))  # same weights and points, in float64
    torch.testing.assert_close(exact.double(), vmap_hessian(f64, x64), **tolerance(dtype))
    methods = {f"torch.func {name}": partial(m, f, x) for name, m in COMPOSITIONS.items()}
    for method in methods.values():
        torch.testing.assert_close(method(), exact, **tolerance(dtype))
    generator = torch.Generator()

    def ours_hutchinson():
        return pyhvp.laplacian(problem.f, problem.x, event_dims=problem.event_dims,
                               method="hutchinson", samples=PROBES,
                               generator=generator.manual_seed(0))  # fmt: skip

    for name, estimator in (("torch.func", partial(hutchinson, f, x)), ("pyhvp", ours_hutchinson)):
        error = relative_error(estimator(), exact)
        methods[f"{name} hutchinson {PROBES} (err {error:.2f})"] = estimator
    exact_rows = {f"pyhvp exact, {label}": pyhvp_exact(problem, mode)
                  for label, mode in (("eager", False), ("compiled", True))}  # fmt: skip
    for run in exact_rows.values():
        torch.testing.assert_close(run(), exact, **tolerance(dtype))
    folx_run, folx_value = folx_laplacian(problem)
    if folx_run is not None:
        torch.testing.assert_close(folx_value.to(dtype), exact, **tolerance(dtype))
        exact_rows[FOLX] = folx_run
    # calls of like size interleaved: a 100 ms composition between two 0.3 ms calls evicts
    # their caches and has glibc hand their buffers back (on the 16-input Gaussians that doubled
    # pyhvp's time, not folx's, whose JAX keeps its own pool)
    times = interleaved_ms(methods) | interleaved_ms(exact_rows)
    rows = list(times.items())
    if with_compiled:
        for name, result in run_compiled_baselines(key, dtype_name).items():
            if isinstance(result, float):
                rows.append((f"torch.func {name}, compiled", result))
            else:
                report.text(f"  torch.func {name}, compiled: not timed ({result})")
    best = min((row for row in rows if row[0].startswith("torch.func") and "hutchinson" not in
                row[0]), key=lambda row: row[1])  # fmt: skip
    title = f"{problem.name}: B={B}, cpu, {dtype_name}, 1 thread (ratios: / best torch.func)"
    report.table(title, rows, baseline=best[0])
    family, _, _ = problem.name.partition(", n=")
    n_vars = problem.x[0].numel()
    report.point(f"Laplacian, {family}, {dtype_name}", "n variables per instance", n_vars, rows)
    return {
        "pyhvp": min(ms for name, ms in times.items() if name.startswith("pyhvp exact")),
        "torch.func": best[1],
        "folx": times.get(FOLX),
    }


# --- per call: a float that changes at every call, and what a cached call costs beyond its kernel


def per_call(report):
    """Issue 17: ``exp(-t |x - mu|^2)`` with a width ``t`` that is a new Python float at every
    call (a time step, an annealed coefficient) against the same float every call, eager and
    compiled; then the parts of one cached call of the n = 16 Gaussians: f alone, the record
    (f under the recorder, and the cache key), the jet kernel alone, the whole call."""
    g = torch.Generator().manual_seed(1)
    n = 16
    mu, x = torch.randn(n, generator=g), torch.randn(B, n, generator=g)

    def width(t):
        return lambda y: torch.exp(-t * ((y - mu) ** 2).sum(-1))

    def width_of_the_step(t):  # another call site (dynamo's guards are per code): the float
        # that changes at every call leaves the guards to the record after a few graphs
        return lambda y: torch.exp(-t * ((y - mu) ** 2).sum(-1))

    def closed_form(t):  # the Laplacian of exp(-t r^2): f (4 t^2 r^2 - 2 t n)
        r2 = ((x.double() - mu.double()) ** 2).sum(-1)
        return torch.exp(-t * r2) * (4 * t * t * r2 - 2 * t * n)

    steps = iter(range(10**9))
    backends = {"eager": pyhvp.TorchBackend(compile=False),
                "compiled": pyhvp.TorchBackend(compile=True)}  # fmt: skip
    for backend in backends.values():  # checked (and compiled) before anything is timed
        for t in (0.3, 0.7, 1.1):
            lap = pyhvp.laplacian(width(t), x, backend=backend)
            torch.testing.assert_close(lap.double(), closed_form(t), rtol=1e-4, atol=1e-4)
    programs = len({taylor.capture(width(t), x, ()).program for t in (0.3, 0.7, 1.1, 1.5)})
    report.text(f"\nprograms recorded for 4 different floats: {programs}")

    def call(backend, changing):
        if changing:
            return lambda: pyhvp.laplacian(width_of_the_step(0.5 + next(steps) * 1e-7), x,
                                           backend=backend)  # fmt: skip
        return lambda: pyhvp.laplacian(width(0.5), x, backend=backend)

    fns = {f"pyhvp exact, {label}, {what}": (lambda b=backend, c=changing: call(b, c)())
           for label, backend in backends.items()
           for what, changing in (("same float", False), ("float changing every call", True))}  # fmt: skip
    times = interleaved_ms(fns, rounds=100, budget_s=30.0)
    report.table(f"exp(-t |x - mu|^2), n={n}: B={B}, cpu, float32, 1 thread, a new t every call "
                 f"or the same t", list(times.items()),
                 baseline="pyhvp exact, eager, same float")  # fmt: skip

    problem = gaussians(n, torch.float32)
    space = Space(problem.x, 1, None)
    f = checked(problem.f, space.batch)
    directions = space.directions(space.basis())
    capture = taylor.capture(f, problem.x, ())
    kernel = capture.kernel(taylor.JetMode(2, True, (0, 1, 2)), problem.x, directions)
    compiled_kernel = torch.compile(kernel, dynamic=False)
    inputs = (problem.x, directions, *capture.constants)
    exact = pyhvp.laplacian(problem.f, problem.x, backend=backends["eager"])
    torch.testing.assert_close(kernel(*inputs)[2], exact)
    torch.testing.assert_close(compiled_kernel(*inputs)[2], exact)
    torch.testing.assert_close(pyhvp.laplacian(problem.f, problem.x, backend=backends["compiled"]),
                               exact, **tolerance(torch.float32))  # fmt: skip
    parts = {
        "f alone": lambda: f(problem.x),
        "record (f under the recorder, key)": lambda: taylor.capture(f, problem.x, ()),
        "jet kernel alone, eager": lambda: kernel(*inputs),
        "jet kernel alone, compiled": lambda: compiled_kernel(*inputs),
        **{f"pyhvp.laplacian, {label}{route}": partial(pyhvp.laplacian, problem.f, problem.x,
                                                       backend=pyhvp.TorchBackend(mode, guards))
           for label, mode in (("eager", False), ("compiled", True))
           for route, guards in (("", True), (", recorded (guards=False)", False))},
    }  # fmt: skip
    times = interleaved_ms(parts, rounds=400, budget_s=30.0)
    report.table(f"{problem.name}: B={B}, cpu, float32, 1 thread: the parts of a cached call",
                 list(times.items()), baseline="jet kernel alone, eager")  # fmt: skip
    for label in ("eager", "compiled"):
        kernel_ms = times[f"jet kernel alone, {label}"]
        guarded = times[f"pyhvp.laplacian, {label}"] - kernel_ms
        recorded = times[f"pyhvp.laplacian, {label}, recorded (guards=False)"] - kernel_ms
        report.text(f"  beyond the {label} kernel: {guarded * 1e3:.0f} us per call with guards, "
                    f"{recorded * 1e3:.0f} us recording f at every call (the record "
                    f"{times['record (f under the recorder, key)'] * 1e3:.0f} us of which "
                    f"f alone {times['f alone'] * 1e3:.0f} us)")  # fmt: skip


def main(with_compiled):
    torch.set_num_threads(1)
    report = Report("bench_laplacian", "cpu")
    report.text(f"malloc: {allocator()}")
    summary = []
    for dtype_name in DTYPES:
        for key in PROBLEMS:
            announce(f"{key}, {dtype_name}: pyhvp against torch.func compositions and folx")
            times = bench(key, dtype_name, with_compiled, report)
            summary.append((key, dtype_name, times))
    report.text("\nSummary (ms; pyhvp = the faster of its eager and compiled rows)")
    report.text(f"  {'problem':8} {'dtype':8} | {'pyhvp':>8} | {'best torch.func':>15} | {'folx':>8} | "
                f"{'torch.func / pyhvp':>18} | {'pyhvp / folx':>12}")  # fmt: skip
    for key, dtype_name, t in summary:
        folx_cell = f"{t['folx']:8.3f}" if t["folx"] is not None else f"{'-':>8}"
        versus = f"{t['pyhvp'] / t['folx']:12.2f}" if t["folx"] is not None else f"{'-':>12}"
        report.text(f"  {key:8} {dtype_name:8} | {t['pyhvp']:8.3f} | {t['torch.func']:15.3f} | "
                    f"{folx_cell} | {t['torch.func'] / t['pyhvp']:18.2f} | {versus}")  # fmt: skip
    announce("per call: a float changing every call; the parts of a cached call")
    per_call(report)
    report.save()


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "--compiled-baselines":
        torch.set_num_threads(1)
        compiled_baselines(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif "--per-call" in sys.argv:  # that section alone, in a file of its own
        torch.set_num_threads(1)
        per_call_report = Report("bench_laplacian_per_call", "cpu")
        per_call(per_call_report)
        per_call_report.save()
    else:
        main(with_compiled="--no-compiled-baselines" not in sys.argv)
