"""Specification of the torch backend's compile policy: ski rental, and keys by what f computes."""

import functools
import gc
import logging
import subprocess
import sys
import warnings
import weakref
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import pyhvp
from pyhvp.backends import compile_policy, inductor
from pyhvp.backends import torch as torch_backend
from pyhvp.backends.compile_policy import function_key


def scaled(w):
    return lambda x: (w * x).sum()


class Model:
    def loss(self, x):
        return x.sum()


@dataclass(frozen=True)
class Wrapper:
    f: object
    option: int


@dataclass
class Mutable:
    scale: float

    def __call__(self, x):
        return (self.scale * x**3).sum(-1)


W = torch.ones(3)
SAME_KEY = {
    "lambda rebuilt over the same captured tensor": (scaled(W), scaled(W)),
    "partial rebuilt over the same function and values": (
        functools.partial(torch.mul, other=2.0),
        functools.partial(torch.mul, other=2.0),
    ),
    "bound method of one object, fetched twice": (Model().loss,) * 2,
    "dataclass wrapper rebuilt around rebuilt lambdas": (
        Wrapper(scaled(W), 1),
        Wrapper(scaled(W), 1),
    ),
    "captured numbers equal in type and value": (scaled(2.5), scaled(2.5)),
}


def in_namespace(scale: float):
    """``lambda x: (A * x).sum()`` exec'd in a namespace of its own where ``A = scale``: the same
    code object, other globals (a script run as ``__main__`` and imported, say)."""
    namespace = {"A": scale}
    exec("f = lambda x: (A * x**3).sum(-1)", namespace)
    return namespace["f"]


model = Model()
OTHER_KEY = {
    "same code in two namespaces (until 2026-12-07: one key)": (
        in_namespace(2.0),
        in_namespace(5.0),
    ),
    "lambda over an equal but distinct tensor": (scaled(W), scaled(W.clone())),
    "captured numbers of different types": (scaled(2), scaled(2.0)),
    "same code, different function": (scaled(W), lambda x: (W * x).sum()),
    "bound methods of two objects": (model.loss, Model().loss),
    "dataclass wrappers with different options": (Wrapper(scaled(W), 1), Wrapper(scaled(W), 2)),
    "captured -0.0 and 0.0": (scaled(-0.0), scaled(0.0)),
    "mutable dataclasses (keyed by identity)": (Mutable(1.0), Mutable(1.0)),
}


@pytest.mark.parametrize(("a", "b"), SAME_KEY.values(), ids=SAME_KEY.keys())
def test_functions_that_compute_the_same_thing_share_a_key(a, b):
    assert function_key(a) == function_key(b) and hash(function_key(a)) == hash(function_key(b))


@pytest.mark.parametrize(("a", "b"), OTHER_KEY.values(), ids=OTHER_KEY.keys())
def test_functions_that_may_differ_get_different_keys(a, b):
    assert function_key(a) != function_key(b)


def test_a_closure_that_captures_itself_has_a_key():
    def recursive(x, depth=0):
        return x if depth else recursive(x, depth + 1)

    assert function_key(recursive) == function_key(recursive)


@settings(max_examples=200, deadline=None)
@given(
    eager=st.floats(1e-4, 1.0),
    speedup=st.floats(0.25, 100.0),
    compile_cost=st.floats(1e-3, 30.0),
    calls=st.integers(1, 400),
)
def test_auto_total_time_is_within_twice_the_better_fixed_choice(
    eager, speedup, compile_cost, calls
):
    """Ski rental, with the compile cost known: for any number of calls, "auto" costs at most
    twice the better of always-eager and always-compiled, plus two eager calls (one past the
    compile cost, one that checks the compiled kernel's first result) and the timed trial of a
    compiled kernel that turns out slower than eager (then declined)."""
    compiled_call = eager / speedup
    now = [0.0]
    cache = compile_policy.CompileCache()
    cache.measured_compile_seconds.append(compile_cost)

    def eager_kernel(f, x):
        now[0] += eager
        return x

    def fake_compile(kernel, f, static):
        first = [True]

        def run(x):
            now[0] += compiled_call + (compile_cost if first[0] else 0.0)
            first[0] = False
            return x

        return run

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compile_policy, "clock", lambda: now[0])
        patch.setattr(torch_backend, "_CACHE", cache)
        patch.setattr(torch_backend, "_compile_bound", fake_compile)
        backend = pyhvp.TorchBackend(compile="auto")
        x = torch.zeros(1)
        for _ in range(calls):
            backend._run(eager_kernel, eager_kernel, scaled, (), (x,))
    best = min(calls * eager, compile_cost + calls * compiled_call)
    trial = (compile_policy.LONGEST_TRIAL + 1) * compiled_call
    assert now[0] <= 2 * best + 2 * eager + trial + 1e-9


def test_a_compiled_kernel_slower_than_eager_is_declined_after_its_trial(
    monkeypatch, compile_after_eager_calls
):
    compile_after_eager_calls(2)
    runs = []

    def slower_compile(kernel, f, static):
        def run(x):
            runs.append("compiled")
            compile_policy.clock()  # each clock reading advances one second: 2 s per call
            return x

        return run

    def eager_kernel(f, x):
        runs.append("eager")
        return x

    monkeypatch.setattr(torch_backend, "_compile_bound", slower_compile)
    backend = pyhvp.TorchBackend(compile="auto")
    for _ in range(15):
        backend._run(eager_kernel, eager_kernel, scaled, (), (torch.zeros(1),))
    trial = 1 + compile_policy.LONGEST_TRIAL  # the compiling call, then the timed ones
    first = ["eager", "compiled"]  # the compiling call, checked against an eager run before it
    rest = ["compiled"] * (trial - 1) + ["eager"] * (15 - 2 - trial)
    assert runs == ["eager"] * 2 + first + rest


def compiled_calls(monkeypatch, compiled_cost):
    """Calls of a ``compile=True`` backend on a fake clock: a compiled call takes
    ``compiled_cost`` seconds, an eager one 1; each notes its kind in the returned list."""
    now = [0.0]
    monkeypatch.setattr(compile_policy, "clock", lambda: now[0])
    runs = []

    def fake_compile(kernel, f, static):
        def run(x):
            runs.append("compiled")
            now[0] += compiled_cost
            return x

        return run

    def eager_kernel(f, x):
        runs.append("eager")
        now[0] += 1.0
        return x

    monkeypatch.setattr(torch_backend, "_compile_bound", fake_compile)
    backend = pyhvp.TorchBackend(compile=True)
    return runs, lambda: backend._run(eager_kernel, eager_kernel, scaled, (), (torch.zeros(1),))


@pytest.mark.parametrize("compiled_cost", [2.0, 0.5], ids=["slower: declined", "faster: kept"])
def test_compile_true_is_never_slower_than_eager(monkeypatch, compile_cache, compiled_cost):
    """Issue 25: compile=True compiles at the first call, then times its compiled and eager
    calls alternately (each serving the call) and runs eagerly for good where inductor's kernel
    is slower than eager ATen."""
    runs, call = compiled_calls(monkeypatch, compiled_cost)
    for _ in range(30):
        call()
    settled = "eager" if compiled_cost > 1.0 else "compiled"
    assert runs[-5:] == [settled] * 5


def test_calls_outside_the_steady_state_are_counted_as_unsettled(monkeypatch, compile_cache):
    """``compile=True``: the compiling call (checked against an eager run) and the eager calls
    of the compiled kernel's trial move ``unsettled_calls``; its compiled calls do not, nor does
    any call after the trial (``sub_hessian``'s trial of routes times only calls that did not)."""
    runs, call = compiled_calls(monkeypatch, compiled_cost=0.5)
    calls = []
    for _ in range(12):
        before = torch_backend.unsettled_calls()
        call()
        calls.append((runs[-1], torch_backend.unsettled_calls() != before))
    assert calls[0] == ("compiled", True)  # the compiling call, after its eager check
    assert all(moved == (ran == "eager") for ran, moved in calls[1:])
    assert calls[-4:] == [("compiled", False)] * 4


def test_a_faster_kernel_whose_first_trial_calls_stall_is_kept(monkeypatch, compile_cache):
    """Two of the first three compiled calls stall (another process held the core): the trial
    goes on while the kernel looks slower, and keeps it once its median is faster."""
    now = [0.0]
    monkeypatch.setattr(compile_policy, "clock", lambda: now[0])
    compile_cache.measured_compile_seconds[:] = [2.0]  # compile after two eager calls of 1 s
    compiled_costs = iter([0.5, 5.0, 5.0] + [0.5] * 20)  # the compiling call, then the trial
    runs = []

    def eager_kernel(f, x):
        runs.append("eager")
        now[0] += 1.0
        return x

    def fake_compile(kernel, f, static):
        def run(x):
            runs.append("compiled")
            now[0] += next(compiled_costs)
            return x

        return run

    monkeypatch.setattr(torch_backend, "_compile_bound", fake_compile)
    backend = pyhvp.TorchBackend(compile="auto")
    for _ in range(20):
        backend._run(eager_kernel, eager_kernel, scaled, (), (torch.zeros(1),))
    assert runs == ["eager"] * 2 + ["eager", "compiled"] + ["compiled"] * 17  # eager: the check


def costing(now, forward_s, backward_s):
    """``x -> 2 x`` whose forward and backward advance the fake clock ``now``."""

    class Costs(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            now[0] += forward_s
            return 2 * x

        @staticmethod
        def backward(ctx, g):
            now[0] += backward_s
            return 2 * g

    return Costs.apply


# (compiled forward s, compiled backward s) against eager's 1 s + 1 s -> what "auto" settles on
TRAINING_TRIALS = {
    "faster forward, slower backward: declined": ((0.5, 3.0), "eager"),
    "slower forward, faster backward: kept": ((1.5, 0.1), "compiled"),
}


@pytest.mark.parametrize(("costs", "settles_on"), TRAINING_TRIALS.values(),
                         ids=TRAINING_TRIALS.keys())  # fmt: skip
def test_training_steps_are_judged_on_forward_and_backward(
    monkeypatch, compile_cache, costs, settles_on
):
    """Under autograd the compiled trial and the eager calls are timed with their kernel's
    backward, so "auto" keeps what makes the whole step faster."""
    now = [0.0]
    monkeypatch.setattr(compile_policy, "clock", lambda: now[0])
    compile_cache.measured_compile_seconds[:] = [2.0]  # compile after one eager step (2 s)
    runs = []

    def fake_compile(kernel, f, static):
        def run(x, w):
            runs.append("compiled")
            return costing(now, *costs)(x * w)

        return run

    def eager_kernel(f, x, w):
        runs.append("eager")
        return costing(now, 1.0, 1.0)(x * w)

    monkeypatch.setattr(torch_backend, "_compile_bound", fake_compile)
    backend = pyhvp.TorchBackend(compile="auto")
    x, w = torch.ones(2), torch.ones(2, requires_grad=True)
    for _ in range(15):
        w.grad = None
        backend._run(eager_kernel, eager_kernel, scaled, (), (x, w), True).sum().backward()
        assert torch.equal(w.grad, 2 * x)
    # the compiling call, then the timed ones (the longest trial for a kernel that is slower)
    trial = 1 + (
        compile_policy.LONGEST_TRIAL if settles_on == "eager" else compile_policy.TRIAL_CALLS
    )
    # the compiling call, checked against an eager run before it, then its backward against eager's
    first = ["eager", "compiled", "eager"]
    rest = ["compiled"] * (trial - 1) + [settles_on] * (15 - 1 - trial)
    assert runs == ["eager", *first, *rest]


def test_expected_compile_cost_is_the_median_of_measured_compiles():
    cache = compile_policy.CompileCache()
    assert cache.expected_compile_seconds() in (
        compile_policy.COLD_COMPILE_SECONDS,
        compile_policy.WARM_COMPILE_SECONDS,
    )
    cache.measured_compile_seconds[:] = [1.0, 9.0, 3.0]
    assert cache.expected_compile_seconds() == 3.0


@pytest.mark.slow  # a spawned interpreter
def test_a_short_script_under_auto_never_loads_the_compiler():
    """Ten quick calls stay eager and never import inductor's compiler (importing it alone takes
    seconds; some torch releases import the package torch._inductor itself with torch)."""
    program = (
        "import sys, torch, pyhvp\n"
        "x = torch.randn(10, 3)\n"
        "for _ in range(10):\n"
        "    pyhvp.grad_and_hvp(lambda x: (x**3).sum(-1), x, x)\n"
        "print('torch._inductor.compile_fx' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120
    )
    assert done.stdout.strip() == "False", done.stderr[-2000:]


UNDER_WARNINGS_AS_ERRORS = (  # a fresh interpreter: torch warns when a module first loads
    "import torch, pyhvp\n"
    "x, m = torch.randn(4, 3), torch.nn.Linear(3, 2)\n"
    "f = lambda y: (y.sin() ** 2).sum(-1)\n"
    "compiled = pyhvp.TorchBackend(compile=True)\n"
    "pyhvp.hvp(f, x, x, backend=compiled)\n"
    "pyhvp.laplacian(f, x, backend=compiled)\n"
    "loss, params = pyhvp.module_loss(m, torch.nn.MSELoss(), x, torch.randn(4, 2))\n"
    "pyhvp.sub_hessian(loss, params, {'weight': torch.tensor([0, 3])}, method='forward')\n"
)


@pytest.mark.slow  # a spawned interpreter, two compiles
def test_warnings_as_errors_fail_neither_a_compile_nor_the_forward_route():
    """Torch 2.13 deprecates ``torch.jit.script`` and calls it itself, in inductor and in
    forward-mode autograd's first use: under ``-W error`` every compile failed and pyhvp's
    warning that it ran eagerly raised, and ``method="forward"`` was refused (until
    2026-12-07)."""
    done = subprocess.run([sys.executable, "-W", "error", "-c", UNDER_WARNINGS_AS_ERRORS],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


def rebindable(scale):
    """A function and a setter of the number it captures (a nonlocal rebinding)."""

    def f(x):
        return (scale * x**3).sum(-1)

    def set_scale(value):
        nonlocal scale
        scale = value

    return f, set_scale


@pytest.mark.slow
def test_a_kernel_never_serves_the_same_code_reading_other_globals(compiled):
    """Until 2026-12-07 the second function got the first's kernel: an HVP 2/5 of its own."""
    x = torch.randn(4, 3, dtype=torch.float64)
    backend = pyhvp.TorchBackend(compile=True)
    pyhvp.hvp(in_namespace(2.0), x, x, backend=backend)
    torch.testing.assert_close(pyhvp.hvp(in_namespace(5.0), x, x, backend=backend), 30 * x * x)


HOOKS = {  # registers a hook that triples the hidden layer's output; returns its handle
    "forward hook": lambda net: net[1].register_forward_hook(lambda m, i, o: 3 * o),
    "forward pre-hook": lambda net: net[2].register_forward_pre_hook(lambda m, i: (3 * i[0],)),
    "global forward hook": lambda net: nn.modules.module.register_module_forward_hook(
        lambda m, i, o: 3 * o if m is net[1] else None
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("register", HOOKS.values(), ids=HOOKS.keys())
def test_a_hook_registered_after_the_kernel_compiled_takes_effect(register, compiled):
    """Until 2026-12-07 dynamo's default (no guards on hooks) let the kernel compiled before
    serve: an HVP a third of the hooked one. A global hook, which dynamo guards nowhere, runs
    the call eagerly."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    x, v = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    f = lambda z: net(z)[..., 0]  # noqa: E731
    pyhvp.hvp(f, x, v, backend=pyhvp.TorchBackend(compile=True))
    handle = register(net)
    try:
        got = pyhvp.hvp(f, x, v, backend=pyhvp.TorchBackend(compile=True))
        expected = pyhvp.hvp(f, x, v, backend=pyhvp.TorchBackend(compile=False))
    finally:
        handle.remove()
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("compile_option", [True, "auto"])
def test_compile_true_under_a_global_module_hook_says_it_runs_eagerly(compile_option):
    """Dynamo guards no global hook, so such calls run eagerly; asked for by name, compile=True
    says so at the user's call (until 2026-12-07 without a word), and "auto", which chooses for
    itself, is silent."""
    x, v = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    handle = nn.modules.module.register_module_forward_hook(lambda *_: None)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pyhvp.hvp(lambda z: (z**3).sum(-1), x, v, backend=pyhvp.TorchBackend(compile_option))
    finally:
        handle.remove()
    said_at = [w.filename for w in caught if "while a global module hook" in str(w.message)]
    assert said_at == ([__file__] if compile_option is True else [])  # at the user's call


@pytest.mark.slow
def test_a_kernel_never_serves_an_equal_keyed_function_whose_first_one_changed(compiled):
    """f1 compiles, then its captured number is rebound; f2 has f1's old key and must not run
    f1's kernel, which now computes with the new number."""
    x = torch.randn(4, 3, dtype=torch.float64)
    backend = pyhvp.TorchBackend(compile=True)
    f1, set_scale = rebindable(1.0)
    pyhvp.hvp(f1, x, x, backend=backend)
    set_scale(5.0)
    f2, _ = rebindable(1.0)
    torch.testing.assert_close(pyhvp.hvp(f2, x, x, backend=backend), 6 * x * x)
    assert len(compiled) == 2


def test_a_cache_key_does_not_keep_captured_data_alive():
    """A loss rebuilt per step over a new batch: once the step is over, its batch is freed."""
    freed = []
    for _ in range(3):
        batch = torch.randn(64, 3)
        weakref.finalize(batch, freed.append, True)
        pyhvp.hvp(lambda x, b=batch: (b[:4] * x**3).sum(-1), torch.randn(4, 3), torch.ones(4, 3))
    del batch
    gc.collect()
    assert freed == [True] * 3


@pytest.mark.slow
def test_python_numbers_are_signatures_of_their_own(compiled):
    """Each value of a number arg compiles its own kernel (no recompiles of one kernel until
    dynamo's limit), and each gives its own answer."""
    x = torch.randn(4, 3, dtype=torch.float64)
    backend = pyhvp.TorchBackend(compile=True)
    for scale in (1.0, 2.0, 1.0):
        hv = pyhvp.hvp(lambda x, c: (c * x**3).sum(-1), x, x, scale, backend=backend)
        torch.testing.assert_close(hv, 6 * scale * x * x)
    assert len(compiled) == 2


@pytest.mark.parametrize("mode", [0, 1, 0.0, "yes", None])
def test_compile_accepts_only_auto_true_false(mode):
    with pytest.raises(ValueError, match="compile must be 'auto', True or False"):
        pyhvp.TorchBackend(compile=mode)


def off_by_one_compiles(monkeypatch, first_raises=None):
    """Compiled kernels that return ``x + 1`` (raising ``first_raises`` at their first run) and
    an eager kernel that returns ``x``; both log their runs in the list returned with it."""
    runs = []

    def miscompile(kernel, f, static):
        def run(x):
            runs.append("compiled")
            if first_raises is not None and runs.count("compiled") == 1:
                raise first_raises
            return x + 1

        return run

    def eager_kernel(f, x):
        runs.append("eager")
        return x

    monkeypatch.setattr(torch_backend, "_compile_bound", miscompile)
    return runs, eager_kernel


def test_a_compiled_kernel_that_disagrees_with_eager_never_serves(monkeypatch, compile_cache):
    """Its first result is checked against an eager run: the call returns that run's result
    (not a third run's: f's Python state is not put back), warns, and every later call of the
    signature runs eagerly."""
    runs, eager_kernel = off_by_one_compiles(monkeypatch)
    backend = pyhvp.TorchBackend(compile=True)
    with pytest.warns(RuntimeWarning, match="disagrees with the eager one on its first call"):
        first = backend._run(eager_kernel, eager_kernel, scaled, (), (torch.zeros(3),))
    later = [backend._run(eager_kernel, eager_kernel, scaled, (), (torch.zeros(3),))
             for _ in range(2)]  # fmt: skip
    assert all(torch.equal(out, torch.zeros(3)) for out in (first, *later))
    assert runs == ["eager", "compiled", "eager", "eager"]


class Counting:
    """An f whose value depends on Python state it changes: a counter of its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.sin(y).pow(2).sum(-1) * self.calls


@pytest.mark.slow
def test_a_compiled_first_call_that_falls_back_returns_the_checks_one_eager_call(compile_cache):
    """The check of a compiled kernel's first call runs f eagerly, the compiled kernel runs it
    again (dynamo replays its Python side effects); where the compiled result cannot serve, the
    call returns the check's, a whole eager call (a third run gave 3x the HVP)."""
    x = torch.randn(5, 4, dtype=torch.float64)
    v = torch.randn_like(x)
    expected = pyhvp.hvp(Counting(), x, v, backend=pyhvp.TorchBackend(compile=False))
    with pytest.warns(RuntimeWarning, match="disagrees with the eager one on its first call"):
        got = pyhvp.hvp(Counting(), x, v, backend=pyhvp.TorchBackend(compile=True))
    torch.testing.assert_close(got, expected)


NORMED = torch.randn(6, 4, 3, generator=torch.Generator().manual_seed(0))
KERNEL_STATE = {
    "a running statistic": (lambda: torch.zeros(2), lambda buffer: buffer.add_(1)),
    "its own generator": (torch.Generator, lambda noise: torch.rand(1, generator=noise)),
    "torch.batch_norm's running mean": (lambda: torch.zeros(4), lambda mean: torch.batch_norm(
        NORMED, None, None, mean, torch.ones(4), True, 0.1, 1e-5, False)),
    "torch.instance_norm's running mean": (lambda: torch.zeros(4), lambda mean: (
        torch.instance_norm(NORMED, None, None, mean, torch.ones(4), True, 0.1, 1e-5, False))),
    # (a bool tensor has no abs: comparing its state after the compiled run raised
    # NotImplementedError from the call until 2026-12-06)
    "a flag it sets": (lambda: torch.tensor(False), lambda flag: flag.fill_(True)),
}  # fmt: skip
"""What a kernel's function may change beyond its values (made, changed once by the kernel)."""


@pytest.mark.parametrize("compiled_disagrees", [False, True], ids=["agrees", "disagrees"])
@pytest.mark.parametrize(("make", "change"), KERNEL_STATE.values(), ids=KERNEL_STATE.keys())
def test_a_compiled_kernel_checked_against_eager_changes_fs_state_once(
    monkeypatch, make, change, compiled_disagrees
):
    """The first compiled call runs the kernel twice or three times (the eager check, and eager
    again where the compiled result disagrees): each run changed the state, so a batch norm's
    statistics moved twice and a function's own generator drew twice, and a compiled
    sub-Hessian of a spectral_norm model was taken at another normalisation (1e-2 off)."""
    state, expected = make(), make()
    change(expected)

    def fake_compile(kernel, f, static):
        return lambda x: kernel(f, x) + int(compiled_disagrees)

    def kernel(f, x):
        change(state)
        return x

    monkeypatch.setattr(torch_backend, "_compile_bound", fake_compile)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the disagreement's)
        pyhvp.TorchBackend(compile=True)._run(kernel, kernel, scaled, (), (torch.zeros(1),))
    if isinstance(state, torch.Generator):
        state, expected = state.get_state(), expected.get_state()
    assert torch.equal(state, expected)


@pytest.mark.parametrize(("make", "change"), list(KERNEL_STATE.values())[::3],
                         ids=list(KERNEL_STATE)[::3])  # fmt: skip
def test_a_compiled_kernel_that_changes_fs_state_more_often_than_eager_is_not_kept(
    monkeypatch, compile_cache, make, change
):
    """The compiled reverse route runs f once per selected tensor (eagerly: once for all), and
    an op whose write torch.func lets through (instance_norm's running statistics) made each
    run's change: a compiled sub-Hessian over 6 tensors of a model with
    ``InstanceNorm2d(track_running_stats=True)`` in training moved its running mean 6 times, with
    blocks equal to eager's. The state the compiled run leaves is checked against the eager
    run's with its result: where they differ the call serves eager's one run."""
    state, expected = make(), make()
    change(expected)

    def fake_compile(kernel, f, static):
        return lambda x: (kernel(f, x), kernel(f, x))[0]  # f run twice, the same value

    def kernel(f, x):
        change(state)
        return x

    monkeypatch.setattr(torch_backend, "_compile_bound", fake_compile)
    with pytest.warns(RuntimeWarning, match="this compiled kernel changes otherwise"):
        pyhvp.TorchBackend(compile=True)._run(kernel, kernel, scaled, (), (torch.zeros(1),))
    assert torch.equal(state, expected)


def test_a_compiled_kernel_whose_result_differs_by_the_state_it_changes_names_that_cause(
    monkeypatch,
):
    """``spectral_norm`` in training reads the vectors each run updates: the compiled reverse
    route, which runs f once per selected tensor, got other blocks as well as other vectors, and
    until 2026-12-06 the warning asked for a report of a compiler bug (the state was compared
    only where the results agreed)."""
    state = torch.zeros(1)

    def fake_compile(kernel, f, static):
        return lambda x: (kernel(f, x), kernel(f, x))[1]  # f run twice, reading its state

    def kernel(f, x):
        state.add_(1)
        return x + state

    monkeypatch.setattr(torch_backend, "_compile_bound", fake_compile)
    with pytest.warns(RuntimeWarning, match="disagrees") as caught:
        got = pyhvp.TorchBackend(compile=True)._run(kernel, kernel, scaled, (),
                                                     (torch.zeros(1),))  # fmt: skip
    (message,) = [str(w.message) for w in caught if "disagrees" in str(w.message)]
    assert "this compiled kernel changes otherwise" in message and "please report" not in message
    assert torch.equal(got, torch.ones(1)) and torch.equal(state, torch.ones(1))


NORMS = (
    lambda mean: lambda z: F.batch_norm(z, mean, torch.ones_like(mean), training=True),
    lambda mean: lambda z: torch.batch_norm(z, None, None, mean, torch.ones_like(mean), True,
                                            0.1, 1e-5, False),
)  # fmt: skip
"""Two batch norms in training over a running mean of their own, as different code."""
NORM = NORMS[0](torch.zeros(4, dtype=torch.float64))
"""The norm a kernel's function reads as a global: rebinding it makes dynamo trace anew."""


def normed_cubed(z):
    return (NORM(z) ** 3).sum((1, 2))


@pytest.mark.slow
def test_a_graph_traced_anew_over_new_state_changes_it_once():
    """The check of a graph traced anew put back the state noted at the first call (the first
    norm's statistic) and ran eagerly from the new statistic the compiled run had updated:
    twice."""
    global NORM
    x, v = NORMED.double(), torch.ones(6, 4, 3, dtype=torch.float64)
    backend = pyhvp.TorchBackend(compile=True)
    got, expected = [], []
    for norming in NORMS:
        expected.append(torch.zeros(4, dtype=torch.float64))
        norming(expected[-1])(x)
        got.append(torch.zeros(4, dtype=torch.float64))
        NORM = norming(got[-1])
        pyhvp.hvp(normed_cubed, x, v, event_dims=2, backend=backend)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("compiled_disagrees", [False, True], ids=["agrees", "disagrees"])
def test_a_graph_traced_anew_that_starts_drawing_is_checked_from_one_state(
    monkeypatch, compile_cache, compiled_disagrees
):
    """A function that draws from its own generator only once a flag flips: dynamo traces a
    graph anew, whose check ran eager from the state the compiled run had left (another draw),
    so a compiled kernel that agrees was taken to disagree, and the eager fallback served that
    other draw (a sub-Hessian 37.8 off, the generator two draws on). The check runs both from
    one state; a kernel that disagrees is said to serve f's state one run on."""
    noise, drawing, traced = torch.Generator().manual_seed(3), [False], [0]

    def kernel(f, x):
        return x + torch.rand(1, generator=noise) if drawing[0] else x

    def fake_compile(kernel_, f, static):
        def run(x):
            traced[0] += drawing[0]  # the flag's first call traces anew
            return kernel(f, x) + int(compiled_disagrees and drawing[0])

        return run

    monkeypatch.setattr(torch_backend, "_compile_bound", fake_compile)
    monkeypatch.setattr(torch_backend, "_graphs_traced", lambda: traced[0])
    backend, x = pyhvp.TorchBackend(compile=True), torch.zeros(1)
    backend._run(kernel, kernel, scaled, (), (x,))
    drawing[0], before = True, noise.get_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = backend._run(kernel, kernel, scaled, (), (x,))
    once = torch.Generator().set_state(before)  # one eager run's draw
    expected = torch.rand(1, generator=once)
    warned = [str(w.message) for w in caught]
    if compiled_disagrees:
        assert len(warned) == 1 and "one run on" in warned[0]
    else:
        assert not warned
        torch.testing.assert_close((got, noise.get_state()), (expected, once.get_state()))


def test_under_autocast_kernels_agree_within_the_autocast_dtypes_rounding():
    """A float32 result of bfloat16 intermediates: eager and compiled kernels round them
    differently (1e-2 apart), which is no miscompile -- outside autocast it would be one."""
    expected = torch.tensor([1.0, -2.0, 3.0])
    got = expected * (1 + 1e-2)
    assert compile_policy.disagreement(got, expected) is not None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compile_policy.disagreement(got, expected) is None
        assert compile_policy.disagreement(expected * 1.5, expected) is not None


class Interrupt(BaseException):
    """Not an Exception: the compile policy neither falls back on it nor swallows it."""


def test_a_compiled_kernel_is_checked_at_its_first_run_that_returns(monkeypatch, compile_cache):
    """A first compiled run that raises past the policy (the sparse route's NotSparse, an
    interrupt) returns nothing to check: the check waits for the first run that returns."""
    runs, eager_kernel = off_by_one_compiles(monkeypatch, first_raises=Interrupt())
    backend = pyhvp.TorchBackend(compile=True)
    with pytest.raises(Interrupt):
        backend._run(eager_kernel, eager_kernel, scaled, (), (torch.zeros(3),))
    with pytest.warns(RuntimeWarning, match="disagrees with the eager one on its first call"):
        second = backend._run(eager_kernel, eager_kernel, scaled, (), (torch.zeros(3),))
    assert torch.equal(second, torch.zeros(3))
    assert runs == ["eager", "compiled", "eager", "compiled"]  # each first one checked


class WrongBackward(torch.autograd.Function):
    """``2 x`` with the gradient of ``3 x``: a kernel whose compiled backward is miscompiled."""

    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, g):
        return 3 * g


def test_a_compiled_kernel_whose_backward_disagrees_never_serves_gradients(monkeypatch,
                                                                         compile_cache):  # fmt: skip
    """The compiled backward is a graph of its own: its first gradients are checked against the
    eager kernel's as its first result is. One that disagrees gives eager's gradients and a
    warning, and every later call of the signature runs eagerly."""
    runs = []

    def miscompile(kernel, f, static):
        def run(x, w):
            runs.append("compiled")
            return WrongBackward.apply(x * w)

        return run

    def eager_kernel(f, x, w):
        runs.append("eager")
        return 2 * (x * w)

    monkeypatch.setattr(torch_backend, "_compile_bound", miscompile)
    backend = pyhvp.TorchBackend(compile=True)
    x, w = torch.arange(3.0), torch.ones(3, requires_grad=True)
    for step in range(3):
        w.grad = None
        out = backend._run(eager_kernel, eager_kernel, scaled, (), (x, w), True)
        if step == 0:
            with pytest.warns(RuntimeWarning, match="disagrees.*in its first compiled backward"):
                out.sum().backward()
        else:
            out.sum().backward()
        assert torch.equal(w.grad, 2 * x)
    assert runs == ["eager", "compiled", "eager", "eager", "eager"]


AGREEING = {
    "rounding (float32)": (torch.tensor([1.0, 2.0]), torch.tensor([1.0 + 1e-6, 2.0])),
    "NaN and inf in the same places": (
        torch.tensor([float("nan"), float("inf"), 1.0]),
        torch.tensor([float("nan"), float("inf"), 1.0]),
    ),
    "inside a tuple": ((torch.ones(2), torch.zeros(1)), (torch.ones(2), torch.zeros(1))),
}
DISAGREEING = {
    "summed rows (pytorch#183986)": (torch.tensor([3.0, 3.0]), torch.tensor([1.0, 2.0])),
    "NaN where eager is finite": (torch.tensor([float("nan")]), torch.tensor([1.0])),
    "float64 beyond rounding": (torch.tensor([1.0 + 1e-6]).double(), torch.tensor([1.0]).double()),
}


@pytest.mark.parametrize(("got", "expected"), AGREEING.values(), ids=AGREEING.keys())
def test_results_equal_up_to_rounding_agree(got, expected):
    assert compile_policy.disagreement(got, expected) is None


@pytest.mark.parametrize(("got", "expected"), DISAGREEING.values(), ids=DISAGREEING.keys())
def test_results_beyond_rounding_disagree(got, expected):
    assert "max difference" in compile_policy.disagreement(got, expected)


@pytest.mark.skipif(torch.__version__ >= "2.14", reason="pytorch#183986 is fixed in torch 2.14")
def test_the_check_catches_inductors_overlap_bug_without_pyhvps_pass(monkeypatch):
    """With plain inductor (no pass of pyhvp.backends.inductor), the compiled HVP of
    index_select is wrong on this torch; the first-call check returns eager's result instead."""
    monkeypatch.setattr(inductor, "backend", lambda: "inductor")
    pick = torch.tensor([3, 0, 5, 3])
    f = lambda x: (x.index_select(-1, pick) ** 3).sum(-1)  # noqa: E731
    x = torch.randn(5, 6, dtype=torch.float64)
    v = torch.randn(3, 5, 6, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="disagrees"):
        _, hv = pyhvp.grad_and_hvp(f, x, v, backend=pyhvp.TorchBackend(compile=True))
    _, eager = pyhvp.grad_and_hvp(f, x, v, backend=pyhvp.TorchBackend(compile=False))
    torch.testing.assert_close(hv, eager)


def test_a_compiled_kernel_drawing_otherwise_than_eager_says_f_draws_not_a_compiler_bug():
    """The compiled reverse route runs a loss's forward once per selected tensor where the eager
    kernel runs it once, so a dropout in training draws other masks there: the check returns
    eager's blocks (the seed's loop's), and its warning says why, where it asked for a report
    of a compiler bug."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(0.5),
                                torch.nn.Linear(16, 3)).train()  # fmt: skip
    X, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    index = {"0.weight": torch.arange(20), "3.bias": torch.arange(3)}

    def blocks(backend):
        torch.manual_seed(5)
        loss, params = pyhvp.module_loss(model, torch.nn.CrossEntropyLoss(), X, y)
        return pyhvp.sub_hessian(loss, params, index, method="reverse", backend=backend)

    with pytest.warns(RuntimeWarning, match="disagrees") as caught:
        got = blocks(pyhvp.TorchBackend(compile=True))
    (message,) = [str(w.message) for w in caught if "disagrees" in str(w.message)]
    assert "f draws random numbers" in message and "please report" not in message
    torch.testing.assert_close(got, blocks(pyhvp.TorchBackend(compile=False)))


def exact_compiles(monkeypatch):
    """Compiled kernels that run the traced kernel eagerly (no torch.compile: instant)."""
    monkeypatch.setattr(
        torch_backend,
        "_compile_bound",
        lambda kernel, f, static: functools.partial(kernel, f, *static),
    )


def test_the_first_compile_under_auto_is_announced_once_with_how_to_choose(
    monkeypatch, compile_after_eager_calls, caplog
):
    """A compile mid-loop stalls for seconds: the first one says what compiles, for how long,
    and how to choose instead (WARNING on the pyhvp logger); later ones say it at INFO."""
    exact_compiles(monkeypatch)
    compile_after_eager_calls(2)
    caplog.set_level(logging.INFO, logger="pyhvp")
    x = torch.randn(4, 3)
    for f in (lambda x: (x**3).sum(-1), lambda x: (x**4).sum(-1)):
        for _ in range(3):
            pyhvp.hvp(f, x, x)
    (first, second) = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert first[0] == "WARNING" and second[0] == "INFO"
    for text in ("Hessian-vector products of <lambda>", "(4, 3) float32 input", "about 2 s",
                 "TorchBackend(compile=False) never compiles",
                 "TorchBackend(compile=True) compiles at the first call"):  # fmt: skip
        assert text in first[1]


def test_compile_true_compiles_without_an_announcement(monkeypatch, caplog):
    exact_compiles(monkeypatch)
    caplog.set_level(logging.INFO, logger="pyhvp")
    x = torch.randn(4, 3)
    pyhvp.hvp(lambda x: (x**3).sum(-1), x, x, backend=pyhvp.TorchBackend(compile=True))
    assert caplog.records == []


def tanh_network():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1), torch.nn.Flatten(0)
    ).double()


def dense_laplacian_loss(net, x):
    """``mean(laplacian(net)(x) ** 2)`` as a function of net's parameters, by dense Hessians."""
    names = [name for name, _ in net.named_parameters()]

    def loss(*values):
        def single(y):
            return torch.func.functional_call(
                net, dict(zip(names, values, strict=True)), (y[None],)
            )[0]

        traces = torch.func.vmap(torch.func.hessian(single))(x).diagonal(0, -2, -1).sum(-1)
        return (traces**2).mean()

    return loss


OPERATORS_IN_A_COMPILED_STEP = {
    "laplacian": lambda net, x, backend: pyhvp.laplacian(net, x, backend=backend),
    "hessian_diagonal": lambda net, x, backend: pyhvp.hessian_diagonal(net, x, backend=backend).sum(
        -1
    ),
}


@pytest.mark.parametrize("compile_setting", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("operator", OPERATORS_IN_A_COMPILED_STEP.values(),
                         ids=OPERATORS_IN_A_COMPILED_STEP.keys())  # fmt: skip
def test_an_operator_inside_the_users_torch_compile_is_a_graph_break(operator, compile_setting):
    """A PINN step compiled by its user (``torch.compile`` around the loss) runs the operator
    eagerly, its own kernels as ``TorchBackend(compile=...)`` says, and its parameter gradients
    are the dense ones at every step, the parameters updated in place between steps: dynamo
    traced the operator before, and its second step crashed."""
    net, x = tanh_network(), torch.rand(6, 2, dtype=torch.float64)
    backend = pyhvp.TorchBackend(compile=compile_setting)
    step = torch.compile(lambda x: operator(net, x, backend).pow(2).mean())
    for _ in range(3):
        params = list(net.parameters())
        got = torch.autograd.grad(step(x), params, allow_unused=True, materialize_grads=True)
        expected = torch.func.grad(dense_laplacian_loss(net, x), tuple(range(len(params))))(
            *(p.detach() for p in params)
        )
        torch.testing.assert_close(got, expected)
        with torch.no_grad():
            for p in params:
                p.mul_(0.9)


class FlushingBackward(torch.autograd.Function):
    """``2 x`` whose backward turns on flush-to-zero where ``loads``, as loading a compiled
    backward does."""

    @staticmethod
    def forward(ctx, x, loads):
        ctx.loads = loads
        return 2 * x

    @staticmethod
    def backward(ctx, g):
        if ctx.loads:
            torch.set_flush_denormal(True)
        return 2 * g, None


def doubled(f, x, w):
    return 2 * (x * w)


def loading(calls, at_call):
    """Whether the compiled run numbered ``len(calls)`` loads a kernel: at ``at_call``."""
    if len(calls) == at_call == 2:  # a graph traced anew, as dynamo counts them
        torch._dynamo.utils.counters["stats"]["unique_graphs"] += 1
    return len(calls) == at_call


FLUSHING_KERNELS = {  # torch 2.5's inductor kernels turn flush-to-zero on when they load
    "at its first call": lambda x, w, calls: (
        torch.set_flush_denormal(True) if loading(calls, 1) else None, 2 * (x * w))[1],
    "in its first backward": lambda x, w, calls: FlushingBackward.apply(x * w, len(calls) == 1),
    "at a retrace": lambda x, w, calls: (
        torch.set_flush_denormal(True) if loading(calls, 2) else None, 2 * (x * w))[1],
}  # fmt: skip


@pytest.mark.parametrize("user_flushes", [False, True], ids=["kept", "flushed by the user"])
@pytest.mark.parametrize("kernel", FLUSHING_KERNELS.values(), ids=FLUSHING_KERNELS.keys())
def test_a_compile_leaves_the_arithmetic_of_subnormals_as_it_found_it(
    monkeypatch, compile_cache, kernel, user_flushes
):
    """Torch 2.5's compiled CPU kernels turn on flush-to-zero for the process when they load
    (gcc's ``-ffast-math`` startup code): from pyhvp's first compile on, every float32 result
    below 1e-38 was 0, the user's own too, and the Laplacian of a norm at 1e19 (until
    2026-12-07). What the user chose with ``torch.set_flush_denormal`` stays."""
    torch.set_flush_denormal(user_flushes)
    calls = []

    def compile_flushing(traced_kernel, f, static):
        def run(x, w):
            calls.append("compiled")
            return kernel(x, w, calls)

        return run

    monkeypatch.setattr(torch_backend, "_compile_bound", compile_flushing)
    backend = pyhvp.TorchBackend(compile=True)
    x, w = torch.arange(3.0), torch.ones(3, requires_grad=True)
    for _ in range(2):
        backend._run(doubled, doubled, scaled, (), (x, w), True).sum().backward()
    assert compile_policy.denormals_kept() is not user_flushes


def test_a_real_compile_keeps_subnormals():
    """The same with torch.compile itself: torch 2.5.1's first compiled HVP turned flush-to-zero
    on (until 2026-12-07); later torches' do not."""
    x = torch.randn(4, 3)
    pyhvp.hvp(lambda y: (y.sin() ** 2).sum(-1), x, torch.ones(4, 3),
              backend=pyhvp.TorchBackend(compile=True))  # fmt: skip
    assert compile_policy.denormals_kept()
