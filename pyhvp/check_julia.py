"""``python -m pyhvp.check_julia``: does the julia backend agree with torch on this machine?

Starts Julia the way the julia backend does and runs every case of :data:`CASES` (the seed-000
Gaussian ``f(x, mu) = exp(-|x - mu|^2)`` on small batches) in float32 and float64 on the CPU
and on every CUDA device, against the torch backend in float64. Prints one row per run (max
error relative to torch's largest entry, first-call time including compilation, steady time
per call), the versions in play and a one-line verdict. Paste the whole output into a bug
report.

It never downloads (Julia starts offline) unless ``--allow-download``, and never hangs: the
checks run in a child process that is stopped, with every process it started (juliapkg runs
Julia in processes of its own), after ``--timeout`` seconds (a Julia call holds the GIL, so
nothing inside the process could stop it).

Exit codes: ``0`` every run agrees with torch; ``1`` a run disagrees or raised, or the check
crashed or timed out; ``2`` bad command-line arguments; ``3`` Julia cannot start here (it
prints a line ``Julia cannot start: <reason>``), which CI treats as a skip.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pyhvp.backends.julia import (
    INSTALL_HELP,
    JULIACALL_DEFAULTS,
    JuliaBackendError,
    _start_julia,
    call_julia,
    julia_function,
)
from pyhvp.hvp import grad_and_hvp

EXIT_OK, EXIT_FAILED, EXIT_JULIA_CANNOT_START = 0, 1, 3
"""Exit codes; argparse exits 2 on bad arguments; CI treats the last one as a skip."""

TIMEOUT_S = 1800.0
"""Default limit for the whole check: first calls compile (tens of seconds each on the CPU)."""

STEADY_CALLS = 3
"""Calls after the first one; their median is the steady time per call."""

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10}
"""Largest error allowed, relative to the largest entry of torch's float64 result."""

GAUSSIAN_JULIA = julia_function("(x, mu) -> exp(-sum(abs2, x .- mu))")


def gaussian(x: torch.Tensor, mu: torch.Tensor, event_dims: int) -> torch.Tensor:
    """The seed-000 function, batched: ``exp(-|x - mu|^2)`` over the last ``event_dims`` dims."""
    return torch.exp(-((x - mu) ** 2).flatten(-event_dims).sum(-1))


@dataclass(frozen=True)
class Case:
    """One cross-check of :func:`gaussian`: shapes of ``x`` and ``mu``, the number of tangents
    (``None``: one ``v`` of ``x``'s shape) and the event dims."""

    name: str
    x_shape: tuple[int, ...]
    mu_shape: tuple[int, ...]
    tangents: int | None
    event_dims: int = 1

    def inputs(
        self, dtype: torch.dtype, device: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x, v, mu)``, the same numbers on every dtype and device; ``|x - mu|^2`` of order 1."""
        generator = torch.Generator().manual_seed(0)
        scale = 2 * math.sqrt(math.prod(self.x_shape[-self.event_dims :]))
        k = () if self.tangents is None else (self.tangents,)
        x = torch.randn(self.x_shape, generator=generator, dtype=torch.float64) / scale
        mu = torch.randn(self.mu_shape, generator=generator, dtype=torch.float64) / scale
        v = torch.randn(k + self.x_shape, generator=generator, dtype=torch.float64)
        return x.to(device, dtype), v.to(device, dtype), mu.to(device, dtype)


CASES = (
    Case("seed000, one v per instance", (2, 3, 4, 3), (2, 1, 1, 3), None),
    Case("seed000, k=3", (2, 3, 4, 3), (2, 1, 1, 3), 3),
    Case("seed000, k=9 (8 + 1 per call)", (2, 3, 2, 3), (2, 1, 1, 3), 9),
    Case("event_dims=2, shared (2, 3) mu", (4, 2, 3), (2, 3), 3, event_dims=2),
    Case("shared (d,) mu", (5, 3), (3,), 2),
    Case("single instance, x (1, d)", (1, 3), (3,), None),
    Case("32 variables per instance", (6, 32), (6, 32), 3),
)
DTYPES = (torch.float32, torch.float64)


class Runner(Protocol):
    """What the check runs: the julia backend (:class:`JuliaRunner`), or a stand-in in tests."""

    def grad_and_hvp(
        self, x: torch.Tensor, v: torch.Tensor, mu: torch.Tensor, event_dims: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradient and HVPs of :func:`gaussian`, as :func:`pyhvp.grad_and_hvp` returns them."""
        ...

    def versions(self) -> dict[str, str]:
        """Name -> version of what the runner depends on."""
        ...


class JuliaCannotStart(RuntimeError):
    """Julia (or a package it needs) is not there, offline: the check is skipped."""


class JuliaRunner:
    """The julia backend; constructing it starts Julia as the backend does, once per process."""

    def __init__(self) -> None:
        try:
            self.main = _start_julia()
        except JuliaBackendError:
            raise  # Julia started but the bundled package did not load: a failure, not a skip
        except Exception as error:
            raise JuliaCannotStart(f"{type(error).__name__}: {error}") from error

    def grad_and_hvp(
        self, x: torch.Tensor, v: torch.Tensor, mu: torch.Tensor, event_dims: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # f's annotation (a Callable) does not name JuliaFunction, which backend="julia" takes
        return grad_and_hvp(GAUSSIAN_JULIA, x, v, mu, event_dims=event_dims, backend="julia")  # type: ignore[arg-type]

    def versions(self) -> dict[str, str]:
        pairs = call_julia("reading versions", self.main.PyHVP.versions)
        return {str(name): str(version) for name, version in pairs}


# ----------------------------------------------------------------------------- one run


@dataclass(frozen=True)
class Row:
    """One run of a case: the error (``None`` if it raised), timings and what it raised."""

    case: Case
    dtype: torch.dtype
    device: str
    error: float | None = None
    first_s: float = math.nan
    steady_s: float = math.nan
    raised: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is not None and self.error <= TOLERANCE[self.dtype]


def relative_error(got: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> float:
    """Largest ``|got - expected|`` relative to ``expected``'s largest entry, over all pairs."""
    return max(
        ((g.double().cpu() - e).abs().max() / e.abs().max().clamp_min(1e-300)).item()
        for g, e in zip(got, expected, strict=True)
    )


def timed(call: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = call()
    return result, time.perf_counter() - start


def run_case(runner: Runner, case: Case, dtype: torch.dtype, device: str) -> Row:
    """The runner against the torch backend (float64, CPU, same inputs) on one case."""
    x, v, mu = case.inputs(dtype, device)
    expected = grad_and_hvp(
        lambda y, m: gaussian(y, m, case.event_dims),
        *(t.double().cpu() for t in (x, v, mu)),
        event_dims=case.event_dims,
        backend="torch",
    )
    call = functools.partial(runner.grad_and_hvp, x, v, mu, case.event_dims)
    try:
        got, first_s = timed(call)
        steady = [timed(call)[1] for _ in range(STEADY_CALLS)]
    except Exception as error:
        return Row(case, dtype, device, raised=f"{type(error).__name__}: {error}")
    largest = relative_error(got, expected)  # not named error: the except clause's name
    return Row(case, dtype, device, largest, first_s, statistics.median(steady))


# ----------------------------------------------------------------------------- the report

COLUMNS = f"{'case':<32} {'dtype':<8} {'device':<7} {'max error':>9} {'tol':>6} "
COLUMNS += f"{'first call':>10} {'steady/call':>11}  result"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def format_row(row: Row) -> str:
    """One line of the table; ``ERROR`` rows say what was raised below the table."""
    dtype = dtype_name(row.dtype)
    error, first, steady = (
        ("-", "-", "-")
        if row.error is None
        else (f"{row.error:.1e}", f"{row.first_s:.2f}s", f"{row.steady_s * 1e3:.2f}ms")
    )
    result = "ERROR" if row.raised else ("ok" if row.ok else "MISMATCH")
    return (
        f"{row.case.name:<32} {dtype:<8} {row.device:<7} {error:>9} {TOLERANCE[row.dtype]:>6.0e} "
        f"{first:>10} {steady:>11}  {result}"
    )


def python_versions() -> dict[str, str]:
    try:
        juliacall = importlib.metadata.version("juliacall")
    except importlib.metadata.PackageNotFoundError:
        juliacall = "not installed"
    return {"juliacall": juliacall, "torch": torch.__version__}


def devices() -> list[str]:
    """The CPU and every CUDA device torch sees."""
    return ["cpu", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]


def run_checks(
    runner: Runner,
    cases: Sequence[Case] = CASES,
    on: Sequence[str] = ("cpu",),
    dtypes: Sequence[torch.dtype] = DTYPES,
    write: Callable[[str], None] = print,
) -> int:
    """Run every case on every dtype and device ``on``, writing the report line by line;
    returns :data:`EXIT_OK` when every run agrees with torch, else :data:`EXIT_FAILED`."""
    write("pyhvp check_julia: the julia backend against torch (float64) on f = exp(-|x - mu|^2)")
    write("max error: largest |julia - torch| / largest |torch|; first call includes compiling")
    write(COLUMNS)
    rows = []
    for case in cases:
        for dtype in dtypes:
            for device in on:
                rows.append(run_case(runner, case, dtype, device))
                write(format_row(rows[-1]))
    for row in rows:
        if row.raised:
            write(f"ERROR in {row.case.name}, {dtype_name(row.dtype)}, {row.device}:\n{row.raised}")
    failed = sum(not row.ok for row in rows)
    problems = [f"{failed} of {len(rows)} runs disagree with torch or raised"] if failed else []
    try:
        versions = {**runner.versions(), **python_versions()}
    except Exception as error:
        versions = {"Julia side": "unknown", **python_versions()}
        problems.append(f"reading the versions raised {type(error).__name__}: {error}")
    write("versions: " + ", ".join(f"{name} {version}" for name, version in versions.items()))
    if not problems:
        write(f"verdict: PASS -- julia agrees with torch in all {len(rows)} runs")
        return EXIT_OK
    write(
        f"verdict: FAIL -- {'; '.join(problems)}. Please paste this whole output into a pyhvp "
        "bug report."
    )
    return EXIT_FAILED


# ----------------------------------------------------------------------------- processes


def child_env(env: Mapping[str, str], allow_download: bool) -> dict[str, str]:
    """``env`` for the checking process: Julia starts offline unless downloads are allowed
    (then juliacall may install Julia and the packages, as ``PYHVP_JULIA_AUTOINSTALL=yes``)."""
    child = {**JULIACALL_DEFAULTS}  # (set before juliacall's import, as the backend sets them)
    child.update(
        (k, v)
        for k, v in env.items()
        if k not in ("PYTHON_JULIAPKG_OFFLINE", "PYHVP_JULIA_AUTOINSTALL")
    )
    child.update(
        {"PYHVP_JULIA_AUTOINSTALL": "yes"} if allow_download else {"PYTHON_JULIAPKG_OFFLINE": "yes"}
    )
    return child


def supervise(command: Sequence[str], env: Mapping[str, str], timeout_s: float) -> int:
    """Run the checking process (its output goes straight to ours) and pass on its exit code;
    a timeout, a signal or an unknown code is :data:`EXIT_FAILED`, with a line saying which.
    On a timeout (or an interrupt) the checking process is stopped with every process it
    started: juliapkg runs Julia in processes of its own (``julia --version``, the package
    resolver), which outlived the check when only the checking process was killed. So is it
    where this process is stopped by SIGTERM or SIGHUP (a CI job cancelled, a terminal closed:
    sent to our process group, which the checking process, in a session of its own, is not
    in), which then exits with 128 + the signal's number."""
    with _stopping_on_signals():
        process = subprocess.Popen(list(command), env=dict(env), start_new_session=_SESSIONS)
        return _supervised(process, timeout_s)


def _supervised(process: subprocess.Popen[bytes], timeout_s: float) -> int:
    try:
        returncode = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop(process)
        print(
            f"check_julia: stopped after {timeout_s:.0f} s (a hang, or compiling took longer: "
            "see --timeout); the rows above are the runs that finished",
            flush=True,
        )
        return EXIT_FAILED
    except BaseException:  # Ctrl-C, a SIGTERM: the checking process, in a session of its own,
        _stop(process)  # missed it
        raise
    if returncode in (EXIT_OK, EXIT_FAILED, EXIT_JULIA_CANNOT_START):
        return returncode
    if returncode < 0:
        print(
            f"check_julia: the checking process crashed ({signal.Signals(-returncode).name})",
            flush=True,
        )
    else:
        print(f"check_julia: the checking process exited with code {returncode}", flush=True)
    return EXIT_FAILED


_SESSIONS = os.name == "posix"
"""Whether the checking process runs in a session (and process group) of its own, which
:func:`_stop` kills whole."""


@contextlib.contextmanager
def _stopping_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise :class:`SystemExit` (``128 + signum``) while the check runs,
    where the checking process runs in a session of its own and this is the main thread (the
    only one that may set handlers): a group's SIGTERM stopped the checking process with
    ours until it ran in a session of its own, and must reach it through :func:`_stop` now."""
    if not _SESSIONS or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, signal.SIG_DFL if handler is None else handler)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Kill the checking process and, where it has a process group of its own, everything in
    it; then reap it."""
    if _SESSIONS:
        # every process of it exited already: gone (ESRCH), or, where the checking process is
        # not reaped yet, EPERM on macOS, whose killpg skips zombies
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    else:
        process.kill()
    process.wait()


def check_here() -> int:
    """The checking process: start Julia as the backend does, then run every case."""
    try:
        runner = JuliaRunner()
    except JuliaCannotStart as error:
        help_ = "" if INSTALL_HELP in str(error) else f"\n{INSTALL_HELP}"
        print(f"Julia cannot start: {error}{help_}", flush=True)
        return EXIT_JULIA_CANNOT_START
    except JuliaBackendError as error:
        print(f"Julia started, but the bundled PyHVP package did not load:\n{error}", flush=True)
        return EXIT_FAILED
    return run_checks(runner, on=devices(), write=functools.partial(print, flush=True))


def _seconds(text: str) -> float:
    """``--timeout``: a finite number of seconds above 0 (argparse exits with 2 otherwise)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pyhvp.check_julia",
        description="Cross-check pyhvp's julia backend against torch here; paste the output "
        "into a bug report. Exit codes: 0 all agree, 1 a mismatch, error, crash or timeout, "
        "2 bad arguments, 3 Julia cannot start (a skip).",
    )
    parser.add_argument(
        "--allow-download",
        action="store_true",
        help="let juliacall download and install Julia and the packages",
    )
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=TIMEOUT_S,
        metavar="SECONDS",
        help=f"stop the whole check after this long (default {TIMEOUT_S:.0f})",
    )
    parser.add_argument("--in-this-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.in_this_process:
        return check_here()
    command = [sys.executable, "-c", CHECKING_PROCESS]
    return supervise(command, child_env(os.environ, args.allow_download), args.timeout)


CHECKING_PROCESS = (
    "import sys, warnings\n"
    "try:\n"
    "    import juliacall  # before torch (PythonCall's FAQ: crashes otherwise)\n"
    "except Exception:  # no Julia: the import fails again, after torch's, and says why\n"
    "    warnings.filterwarnings('ignore', message='torch was imported before juliacall')\n"
    "from pyhvp.check_julia import main\n"
    "sys.exit(main(['--in-this-process']))\n"
)
"""The checking process's program: juliacall imported first, as the julia guide asks of users
(where it cannot start, :func:`check_here` says why)."""


if __name__ == "__main__":
    sys.exit(main())
