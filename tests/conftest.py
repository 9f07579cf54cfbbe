"""Shared fixtures: every test that takes ``device`` runs on each device this machine has."""

import itertools
import os

import pytest
import torch

from pyhvp import submatrix
from pyhvp.backends import compile_policy
from pyhvp.backends import torch as torch_backend
from pyhvp.restricted import trial
from pyhvp.taylor import guards

WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    # pytest-xdist workers share the cores: torch's default (a thread per core in every worker)
    # oversubscribes them, and OpenMP's barriers then made single specs up to 3x slower (the
    # sixth-order fallback spec: 206 s on two 2-thread workers, 69 s on one thread). The
    # environment variable reaches the processes the specs start.
    THREADS = str(max(1, (os.cpu_count() or 1) // WORKERS))
    os.environ["OMP_NUM_THREADS"] = THREADS
    torch.set_num_threads(int(THREADS))

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def compile_cache(monkeypatch) -> compile_policy.CompileCache:
    """A fresh, empty compile cache for every test: nothing compiled, timed or measured before
    it, so what "auto" does never depends on which tests ran first."""
    cache = compile_policy.CompileCache()
    monkeypatch.setattr(torch_backend, "_CACHE", cache)
    return cache


@pytest.fixture(autouse=True)
def _subnormals_kept():
    """Every test starts with IEEE arithmetic of subnormal numbers: under torch 2.5 a test's own
    ``torch.compile`` turns flush-to-zero on for the process (a float32 norm's Laplacian at 1e18
    was then 2.4e-4 off in whichever test ran next in that worker, CI of 2026-12-07)."""
    torch.set_flush_denormal(False)


@pytest.fixture
def compile_after_eager_calls(monkeypatch, compile_cache):
    """``set(n)``: every eager call counts one second and a compile is expected to cost n
    seconds, so "auto" runs a signature eagerly n times and compiles on call n + 1."""

    def set_calls(n):
        ticks = itertools.count()
        monkeypatch.setattr(compile_policy, "clock", lambda: float(next(ticks)))
        compile_cache.measured_compile_seconds[:] = [float(n)]

    return set_calls


@pytest.fixture
def compiler_fails(monkeypatch) -> None:
    """torch.compile returns kernels that raise when run, as a compiler that fails does."""

    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("backend compiler exploded\n\ndebug context: ...")

        return run

    monkeypatch.setattr(torch, "compile", broken_compile)


@pytest.fixture
def compiled(monkeypatch, compile_cache) -> list:
    """Every kernel handed to a compiler during the test, in order (still compiled): to
    torch.compile (not the guards' calls of f, which dynamo traces without compiling), or, a jet
    kernel's graph, to inductor directly; the compile cache starts empty."""
    calls = []
    real_compile = torch.compile

    def recording_compile(fn, **kwargs):
        if getattr(fn, "__name__", None) != guards.TRAMPOLINE:
            calls.append(fn)
        return real_compile(fn, **kwargs)

    class RecordingGraph(torch_backend._InductorGraph):
        def __init__(self, graph):
            calls.append(graph)
            super().__init__(graph)

    monkeypatch.setattr(torch, "compile", recording_compile)
    monkeypatch.setattr(torch_backend, "_InductorGraph", RecordingGraph)
    return calls


class _EveryPlan(set):
    """Holds every plan's name: each plan has run in this process before."""

    def __contains__(self, name: object) -> bool:
        return True


@pytest.fixture(autouse=True)
def _sub_hessian_routes(monkeypatch):
    """Every test surveys its sub-Hessian losses afresh: routes another test chose never serve;
    and its trials hand out the same runs whichever tests ran first (a plan's first run in a
    process, untimed, has its own spec in ``test_sub_hessian_routes``)."""
    monkeypatch.setattr(submatrix, "_ROUTES", type(submatrix._ROUTES)())
    monkeypatch.setattr(trial, "RUN_IN_THIS_PROCESS", _EveryPlan())


@pytest.fixture(autouse=True)
def _routes(monkeypatch):
    """No dynamo route (:mod:`pyhvp.taylor.guards`) outlives a test: a program a test counts is
    never served by a graph another test traced."""
    monkeypatch.setattr(guards, "_ROUTES", {})
