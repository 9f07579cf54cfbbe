"""When the torch backend compiles, and what a compiled kernel is cached under.

**The rule for** ``compile="auto"`` **is ski rental.** Compiling is an investment of unknown
return: a signature (kernel, function, options, input shapes / dtypes / devices) runs eagerly
until the eager time spent on it reaches the expected cost of compiling it, then compiles. Whatever
the number of calls, the total then stays within about twice the better of "always eager" and
"always compiled" (the classic ski-rental bound; exactly 2 when the compile cost is known), so a
script of ten calls never stalls on a compile and a loop of thousands still runs compiled.

* Expected compile cost: the median of the compiles measured in this process (first compiled
  call minus an eager call's time) once there is one; before that a documented default,
  :data:`COLD_COMPILE_SECONDS` when inductor's on-disk graph cache is empty (a fresh environment)
  and :data:`WARM_COMPILE_SECONDS` when it holds graphs from earlier runs.
* Eager time is wall time on the CPU; on CUDA it is read from CUDA events once they complete,
  so timing never synchronises the device.
* Compiling is not always faster (e.g. a graph inductor fuses worse than autograd runs it): the
  first :data:`TRIAL_CALLS` compiled calls are timed too -- up to :data:`LONGEST_TRIAL` while
  they look slower, so one stalled call does not decide -- and a signature whose compiled
  median is then slower than its eager median goes back to eager for good.
* Compiling is not always right (compilers have bugs, e.g. pytorch#183986): the first result
  of every compiled kernel (``compile=True`` too) is checked against an eager run from the same
  random state (:func:`disagreement`); a kernel that disagrees never serves, its signature runs
  eagerly from then on, with a warning. This costs one eager call per compile. A kernel autograd
  differentiates (a training step) has a compiled backward too, compiled at its first backward:
  its first gradients are checked against the eager kernel's the same way.
* A compile takes seconds (20 s in a fresh environment here), and under ``"auto"`` it comes in
  the middle of a loop: the first one in a process is announced (:func:`announce`) on the
  ``pyhvp.compile`` logger at WARNING, with what compiles, how long it is expected to take and
  how to choose instead; later ones at INFO. It runs on the calling thread, not in the
  background: ``torch.compile`` is not thread-safe (dynamo and inductor keep global state,
  pytorch#118260, #136833, #168042), and the calling thread keeps using dynamo meanwhile (the
  Taylor engine's guards); from torch 2.12 dynamo's config is per thread (pytorch#186537), so a
  background compile would not even see the caller's settings.

**Keys.** Functions are keyed by what they compute, not by object identity: a function rebuilt on
every call from the same code over the same captured objects (a lambda in a training loop, a
``module_loss`` per step) has the key of the first one and reuses its compiled kernel. The key of
a Python function is its code object, its globals (by identity) and the keys of its defaults and
captured objects (cells);
of a bound method, its function and the identity of its ``self``; of a ``functools.partial``, its
function, arguments and keywords; of a frozen dataclass (pyhvp's own wrappers), its type and the
keys of its attributes; of a pytree spec (a batch's structure), the spec; of an immutable scalar
(int, float, str, dtype, ...), its type and exact value; anything else -- tensors, modules, lists,
mutable dataclasses -- is keyed by identity, held weakly (a key never keeps captured data alive;
a cached kernel keeps the function it was compiled for, in at most ``CACHE_SIZE`` entries).
Python numbers among the inputs are keyed by value too: each value is a signature of its own,
rather than a recompile of one. A compiled kernel runs the function it was compiled for; before
it serves an equal-keyed other function, that function's key is computed again, so state changed
since (a rebound ``nonlocal``) recompiles instead of running stale code.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import statistics
import time
import types
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import TypeVar

import torch
from torch.utils import _pytree as pytree

from pyhvp._keys import Identity, value_key
from pyhvp._torch_warnings import torchs_own_deprecations_ignored

COLD_COMPILE_SECONDS = 20.0
"""Expected first compile in a fresh environment: the seed-000 per-instance example's first compiled call took
19.5 s with an empty inductor cache on the 2-core CI machine (7.9-16 s on others)."""

WARM_COMPILE_SECONDS = 4.0
"""Expected first compile when inductor's graph cache holds earlier runs' graphs (measured 2.9 s
and 3.7 s for that example)."""

CACHE_SIZE = 64
"""Signatures remembered (least recently used dropped first)."""


clock = time.perf_counter
"""The clock eager and compile times are read from (tests substitute a fake one)."""

log = logging.getLogger("pyhvp.compile")
"""Where compiles under ``"auto"`` are announced; silence it with
``logging.getLogger("pyhvp").setLevel(logging.ERROR)``."""


class HookGuards:
    """Dynamo guards modules' hooks too (its default skips them): a forward hook registered
    after a first call changes ``f``, so the graph traced before must not serve (until
    2026-12-07 the compiled HVP kernels ignored such a hook: an HVP a third of the hooked one).
    Held around every call of a compiled function of ``f`` (a retrace comes at a call). Set and
    reset by hand, about 7 us a call (2-3% of a compiled sub-Hessian of the seed's model):
    ``torch._dynamo.config.patch`` cost 17 us."""

    def __enter__(self) -> None:
        self.skipped = torch._dynamo.config.skip_nnmodule_hook_guards
        if self.skipped:
            torch._dynamo.config.skip_nnmodule_hook_guards = False

    def __exit__(self, *_: object) -> None:
        if self.skipped:
            torch._dynamo.config.skip_nnmodule_hook_guards = True


def denormals_kept() -> bool:
    """Whether this thread's float arithmetic keeps subnormal numbers (neither flushes a result
    below the smallest normal to zero nor reads such an operand as zero); about 2 us."""
    return bool((torch.tensor([2.0**-130]) * 1.0).item() != 0)


class KeepingDenormals:
    """Held around a compile: puts back the arithmetic of subnormal numbers where the compile
    turned it off. Torch 2.5's inductor links its CPU kernels with gcc's ``-ffast-math``, whose
    startup code (gcc < 13) sets flush-to-zero in the thread that loads a kernel: from pyhvp's
    first compile on, every float32 result below 1e-38 in the process was 0, the user's own too
    (in pyhvp, the Laplacian of a norm at 1e19 was 0; torch 2.13's inductor no longer does it).
    Where the thread flushed them before, it is left so (``torch.set_flush_denormal(True)`` is
    the user's choice). ``last_seen``: the state before the last compile, for a compile found
    only after it ran (a retrace)."""

    last_seen = True

    def __enter__(self) -> None:
        self.kept = KeepingDenormals.last_seen = denormals_kept()

    def __exit__(self, *_: object) -> None:
        restore_denormals(self.kept)


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """Held around every call that may compile (a kernel's first call and first backward, a
    Taylor graph's first run): torch's deprecations of its own internals ignored
    (:mod:`pyhvp._torch_warnings`) and the arithmetic of subnormal numbers kept
    (:class:`KeepingDenormals`)."""
    with torchs_own_deprecations_ignored(), KeepingDenormals():
        yield


def restore_denormals(kept: bool) -> None:
    """Keep subnormal numbers again if they were (``kept``) and a compile since turned that off."""
    if kept and not denormals_kept():
        torch.set_flush_denormal(False)


def global_module_hooks() -> tuple[int, ...]:
    """The handle id of each forward (pre-)hook registered for every module
    (``torch.nn.modules.module.register_module_forward_hook``, ``..._pre_hook``), which every
    module's call runs and dynamo's guards do not see: a function that may run one is not
    compiled (empty, false: none)."""
    modules = torch.nn.modules.module  # (where torch keeps them)
    return (*modules._global_forward_pre_hooks, *modules._global_forward_hooks)


def function_key(f: object, _seen: frozenset[int] = frozenset()) -> Hashable:
    """What ``f`` computes, as a hashable key (see the module docstring)."""
    value = value_key(f)  # first: most leaves are names and numbers
    if value is not None:
        return value
    if id(f) in _seen:  # a closure that captures itself
        return Identity(f)
    seen = _seen | {id(f)}
    if isinstance(f, types.FunctionType):
        cells = tuple(_cell_key(cell, seen) for cell in f.__closure__ or ())
        defaults = tuple(function_key(d, seen) for d in f.__defaults__ or ())
        kwdefaults = tuple((k, function_key(d, seen)) for k, d in (f.__kwdefaults__ or {}).items())
        # its globals too: code objects compare by value, and two functions of one source in two
        # namespaces (exec'd twice, a script run as __main__ and imported) read other globals
        # (until 2026-12-07 the second got the first's compiled kernel: an HVP 0.4 of its own)
        return ("function", f.__code__, Identity(f.__globals__), cells, defaults, kwdefaults)
    if isinstance(f, types.MethodType):
        return ("method", function_key(f.__func__, seen), Identity(f.__self__))
    if isinstance(f, functools.partial):
        arguments = tuple(function_key(a, seen) for a in f.args)
        keywords = tuple((k, function_key(v, seen)) for k, v in f.keywords.items())
        return ("partial", function_key(f.func, seen), arguments, keywords)
    if isinstance(f, pytree.TreeSpec):  # a batch's structure: structural equality
        return ("value", pytree.TreeSpec, _hashable_spec(f))
    # typeshed's DataclassInstance declares __dataclass_fields__ only; every dataclass has params
    if is_dataclass(f) and not isinstance(f, type) and f.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        state = (
            vars(f) if hasattr(f, "__dict__") else {x.name: getattr(f, x.name) for x in fields(f)}
        )
        return ("dataclass", type(f), tuple((k, function_key(v, seen)) for k, v in state.items()))
    if isinstance(f, tuple):
        return ("tuple", tuple(function_key(item, seen) for item in f))
    return Identity(f)


def _hashable_spec(spec: pytree.TreeSpec) -> Hashable:
    """``spec`` where it hashes; else (torch 2.5, whose specs hold lists: every call with a
    batch ran eagerly and surveyed anew) its structure as nested tuples."""
    try:
        hash(spec)
        return spec
    except TypeError:
        context = tuple(spec.context) if isinstance(spec.context, list) else spec.context
        return (spec.type, context, tuple(_hashable_spec(c) for c in spec.children_specs))


def _cell_key(cell: types.CellType, seen: frozenset[int]) -> Hashable:
    try:
        return function_key(cell.cell_contents, seen)
    except ValueError:  # a cell not assigned yet
        return ("empty cell",)


Signature = tuple[str, Hashable, tuple[Hashable, ...], tuple[Hashable, ...]]
"""A call's cache key: kernel name, :func:`function_key` of ``f``, options, inputs' metadata
(shape, dtype, device, and whether autograd differentiates the kernel in it)."""


def signature(
    kernel: str, f: object, static: tuple[Hashable, ...], inputs: Sequence[object]
) -> Signature:
    """The cache key of one call: kernel, function key, options, and each input's metadata."""

    grad_mode = torch.is_grad_enabled()

    def describe(value: object) -> Hashable:
        if isinstance(value, torch.Tensor):
            needs_grad = grad_mode and value.requires_grad  # a compiled backward, or none
            return ("tensor", tuple(value.shape), value.dtype, value.device, needs_grad)
        return function_key(value)

    return (kernel, function_key(f), static, tuple(describe(t) for t in inputs))


AGREEMENT = {torch.float64: 1e-9, torch.float32: 1e-3, torch.float16: 5e-2, torch.bfloat16: 5e-2}
"""How far a compiled kernel's first result may lie from the eager kernel's, relative to the
largest finite eager value (plus one): rounding and a reordered sum stay far inside, a
miscompiled kernel (pytorch#183986 summed every row's writes) lies far outside."""


def _agreement(t: torch.Tensor) -> float:
    """:data:`AGREEMENT` for ``t``'s dtype, or under autocast on its device for the lower
    precision the kernels' ops ran in (bfloat16 intermediates of a float32 result)."""
    tolerance = AGREEMENT.get(t.dtype, 0.0)
    if t.is_floating_point() and torch.is_autocast_enabled(t.device.type):
        lower = torch.get_autocast_dtype(t.device.type)
        tolerance = max(tolerance, AGREEMENT.get(lower, 0.0))
    return tolerance


def disagreement(got: object, expected: object) -> str | None:
    """Where a compiled kernel's result and the eager kernel's differ beyond :data:`AGREEMENT`
    (NaN and infinities in the same places), or None."""
    for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(expected), strict=True):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            continue
        a, b = a.detach(), b.detach()
        if a.shape != b.shape:
            return f"shape {tuple(a.shape)} against {tuple(b.shape)}"
        if b.dtype == torch.bool:  # (no abs: a flag f sets, compared as the state it leaves)
            a, b = a.to(torch.uint8), b.to(torch.uint8)
        finite = b[torch.isfinite(b)] if b.is_floating_point() else b
        scale = 1.0 + (finite.abs().max().item() if finite.numel() else 0.0)
        tolerance = _agreement(b) * scale
        try:
            torch.testing.assert_close(a, b, rtol=0.0, atol=tolerance, equal_nan=True)
        except AssertionError:
            difference = (a.double() - b.double()).abs().nan_to_num(nan=float("inf")).max()
            return f"max difference {difference.item():.3g}, tolerance {tolerance:.3g}"
    return None


TRIAL_CALLS = 3
"""Compiled calls timed after the compile before they are judged: a compiled median no slower
than the eager median keeps the kernel."""

LONGEST_TRIAL = 9
"""A kernel whose trial median is slower than eager's is timed on further calls, up to this many,
before the signature runs eagerly for good (compiling is not always faster): a call that stalls
on a shared CPU must not decide alone (a PINN step settled on eager, 0.65x the idiom's time,
where compiled took 0.47x, after three trial calls)."""


@dataclass
class Account:
    """Time spent on one way of running a signature: a total, and the last calls for a median."""

    seconds: float = 0.0
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=16))
    pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)

    def timed(self, run: Callable[[], object], device: torch.device) -> object:
        """``run()``, its time added to this account (CUDA: read from events once complete)."""
        if device.type != "cuda":
            begin = clock()
            out = run()
            self._add(clock() - begin)
            return out
        # torch.cuda.Event's methods carry no annotations (torch 2.13): untyped calls below
        while self.pending and self.pending[0][1].query():  # type: ignore[no-untyped-call]
            start, end = self.pending.pop(0)
            self._add(start.elapsed_time(end) / 1e3)
        stream = torch.cuda.current_stream(device)
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record(stream)
        out = run()
        end.record(stream)
        self.pending.append((start, end))
        return out

    def add_to_last(self, seconds: float) -> None:
        """More time for the last call (a training step's backward, timed once it ran)."""
        self.seconds += seconds
        if self.recent:
            self.recent[-1] += seconds

    def median(self) -> float:
        return statistics.median(self.recent) if self.recent else 0.0

    def _add(self, seconds: float) -> None:
        self.seconds += seconds
        self.recent.append(seconds)


@dataclass
class Entry:
    """What one signature has cost each way so far, and its compiled kernel once there is one."""

    eager: Account = field(default_factory=Account)
    compiled_runs: Account = field(default_factory=Account)
    compiled: Callable[..., object] | None = None
    compiled_for: Callable[..., object] | None = None  # the function the kernel runs
    compiled_for_may_change: bool = True  # its key can change (compile_policy.may_change)
    failed: bool = False
    declined: bool = False
    judged: bool = False
    checked: bool = False  # the compiled kernel's first result agreed with eager's
    backward_checked: bool = False  # the compiled kernel's backward agreed with eager's once

    def on_trial(self) -> bool:
        """Still timing the compiled kernel: not judged yet, and fewer than :data:`TRIAL_CALLS`
        calls, or fewer than :data:`LONGEST_TRIAL` while its median is slower than eager's (the
        medians are not recomputed on every call once it is judged)."""
        if self.judged:
            return False
        calls = len(self.compiled_runs.recent)
        return calls < TRIAL_CALLS or (calls < LONGEST_TRIAL and self.compiled_is_slower())

    def compiled_is_slower(self) -> bool:
        return bool(self.eager.recent) and self.compiled_runs.median() > self.eager.median()


Kept = TypeVar("Kept")


def keep(cache: OrderedDict[Hashable, Kept], key: Hashable, value: Kept,
         size: int = CACHE_SIZE) -> Kept:  # fmt: skip
    """``cache[key] = value`` as its most recently used entry, the least recently used dropped
    past ``size`` entries; returns ``value``."""
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > size:
        cache.popitem(last=False)
    return value


def recall(cache: OrderedDict[Hashable, Kept], key: Hashable) -> Kept | None:
    """``cache[key]``, now its most recently used entry, or ``None``: one lookup, then one move
    (a key is a deep tuple, compared anew by each dict operation)."""
    value = cache.get(key)
    if value is not None:
        cache.move_to_end(key)
    return value


def may_change(key: Hashable) -> bool:
    """Whether a :func:`function_key` can change while its object lives: where it holds a
    Python function's (whose closure cells and defaults can be reassigned). Frozen dataclasses,
    partials, methods and tuples cannot change what they hold; identities stay equal."""
    if not isinstance(key, tuple):
        return False
    return (bool(key) and key[0] == "function") or any(map(may_change, key))


class CompileCache:
    """Signatures -> :class:`Entry`, least recently used dropped first, and the compile costs
    measured in this process."""

    def __init__(self, size: int = CACHE_SIZE) -> None:
        self.size = size
        self.entries: OrderedDict[Hashable, Entry] = OrderedDict()
        self.measured_compile_seconds: list[float] = []
        self.announced = False

    def entry(self, key: Hashable) -> Entry:
        found = recall(self.entries, key)
        return found if found is not None else keep(self.entries, key, Entry(), self.size)

    def expected_compile_seconds(self) -> float:
        if self.measured_compile_seconds:
            return statistics.median(self.measured_compile_seconds)
        return WARM_COMPILE_SECONDS if _inductor_cache_is_warm() else COLD_COMPILE_SECONDS

    def should_compile(self, entry: Entry) -> bool:
        """Ski rental: compile once the eager time spent reaches the expected compile cost.

        Below both defaults the answer is no without looking at inductor's cache: finding its
        directory imports inductor (seconds), which a short script must not pay."""
        spent = entry.eager.seconds
        if not self.measured_compile_seconds and spent < WARM_COMPILE_SECONDS:
            return False
        return spent >= self.expected_compile_seconds()

    def record_compile(self, entry: Entry, first_call_seconds: float) -> Callable[[float], None]:
        """Note a compile's cost; returns what adds the time of that call's backward (which
        compiles the backward of a training step) once it ran."""
        self.measured_compile_seconds.append(max(first_call_seconds - entry.eager.median(), 0.0))
        index = len(self.measured_compile_seconds) - 1

        def add(seconds: float) -> None:
            if index < len(self.measured_compile_seconds):
                self.measured_compile_seconds[index] += seconds

        return add

    def announce(self, entry: Entry, what: str) -> None:
        """Say that ``what`` compiles now under ``"auto"``, and what to expect: the first time
        in this process on :data:`log` at WARNING (a loop that stalls for seconds with nothing
        printed looks hung), with how to choose instead; later ones at INFO."""
        first = not self.announced
        self.announced = True
        level = logging.WARNING if first else logging.INFO
        if not log.isEnabledFor(level):
            return
        expected = self.expected_compile_seconds()
        if self.measured_compile_seconds:
            basis = "the median of this process's compiles"
        else:
            basis = "a first compile" + (
                " with inductor's cache warm" if expected == WARM_COMPILE_SECONDS else " here"
            )
        message = (
            f"pyhvp: compile='auto' compiles {what} now with torch.compile: its eager calls "
            f"have taken {entry.eager.seconds:.1f} s, what compiling is expected to cost, so "
            f"this call takes about {expected:.0f} s longer ({basis}); later calls run compiled "
            f"if that is faster"
        )
        if first:
            message += (
                ". To choose: backend=pyhvp.TorchBackend(compile=False) never compiles, "
                "TorchBackend(compile=True) compiles at the first call. Said once per process "
                "(later compiles at INFO); silence it with "
                "logging.getLogger('pyhvp').setLevel(logging.ERROR)"
            )
        log.log(level, message)

    @staticmethod
    def judge(entry: Entry) -> None:
        """After the trial calls (at the next call, when a trial call's backward has run too):
        decline the compiled kernel if it is slower than eager."""
        if not entry.on_trial():
            entry.judged = True
            entry.declined = entry.compiled_is_slower()


@functools.cache
def _inductor_cache_is_warm() -> bool:
    """Does inductor's on-disk FX graph cache hold anything yet (read once per process)?"""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # pragma: no cover - layout of older torch releases
        return False
    graphs = Path(cache_dir()) / "fxgraph"
    return graphs.is_dir() and any(graphs.iterdir())
