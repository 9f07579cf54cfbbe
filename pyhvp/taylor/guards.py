"""Guards: dynamo's per-call checks in place of the per-call record of ``f``.

Without them a call records ``f`` (one eager forward under the recorder) and looks its program
up by the record: sound whatever ``f`` does, and about as costly as ``f`` itself. Here ``f``
runs through ``torch.compile(fullgraph=True, dynamic=False)`` with a backend that computes
nothing: dynamo traces ``f`` once and from then on checks, per call, the guards its trace
depended on -- the code and closures of ``f``, the Python values it read (ints, floats, flags
such as ``module.training``, and so the branch it took), the identity of non-tensor objects,
each tensor's shape, strides, dtype, device and ``requires_grad``. Tensors (parameters,
buffers, closed-over tensors, ``args``) are read afresh at every call, so a parameter replaced
or updated in place is used with its new value. While the guards hold, dynamo hands over the
call's tensors and the program of that graph runs on them; ``f`` does not run.

The first call of each graph records ``f`` as without guards, and records the graph dynamo
traced too (node by node, on that call's tensors). The graph's program is reused only if both
records give the very same program, and its constants are the call's inputs in the same places
or scalars the graph made from Python values (which the guards fix). The route -- one per code
of ``f`` and network it captures (:func:`_route_key`) -- is declined, and ``f`` recorded at every
call as before, when:

* dynamo cannot take ``f`` whole (a graph break: data-dependent Python control flow,
  ``.item()``, printing, autograd inside ``f``), or its graph runs a transform (``torch.func``);
* ``f`` writes to a tensor, draws random values or computes a determinant (whose rule depends on
  the values): these must happen, or be judged, anew at every call;
* ``f`` reads a tensor's value into Python (``.item()``, ``float(t)``): dynamo (torch 2.13)
  traces that whole, and its guards do not check the value, so the graph's program would keep
  the first call's number;
* ``f`` hands dynamo more than its result (an intermediate kept in Python state);
* the two records differ, or the graph's record fails;
* dynamo has traced :data:`GRAPHS_PER_ROUTE` graphs for the route (a float that changes at every
  call is specialised by dynamo: after these, the record, which lifts such floats into program
  inputs, serves every value with one program).

No route is tried while a functorch transform or forward-mode AD is active, under dynamo, or
while a global module hook is registered (``register_module_forward_hook``: part of ``f``, and
guarded by dynamo in no way).
"""

from __future__ import annotations

import functools
import threading
import types
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import fx

from pyhvp._keys import Identity
from pyhvp._user_errors import quiet_tracing
from pyhvp.backends.compile_policy import HookGuards, global_module_hooks
from pyhvp.taylor.recorder import (
    DET,
    ITEM,
    Recorder,
    record,
    recording_state,
    storage_id,
)

Tensor = torch.Tensor

GRAPHS_PER_ROUTE = 6
"""Most graphs dynamo traces for one route before it is declined (and below dynamo's own
recompile limit, 8 by default, past which dynamo would run ``f``'s ops itself)."""


@dataclass
class _Graph:
    """One graph dynamo traced. Once checked: its program, and where each of the program's
    constants comes from (the position of a graph input, or a scalar the graph itself made from
    Python values, which the guards fix)."""

    module: fx.GraphModule
    program: Any = None
    sources: tuple[int | Tensor, ...] = ()


_pending = threading.local()
"""The graph and inputs of the call in progress, handed over by the backend's runner."""


TRAMPOLINE = "pyhvp_guarded_call"
"""The name of each route's copy of the trampoline, which dynamo traces."""


class _RanEagerly(Exception):
    """Dynamo ran the trampoline itself, not a graph (dynamo disabled, or left so: torch 2.5.1
    after calls from several threads): ``f`` is not called, its record runs it once."""


def _trampoline(f: Callable[..., Tensor], after: Callable[..., Tensor], after_args: tuple[object, ...],
                x: Tensor, *args: object) -> Tensor:  # fmt: skip
    if not torch.compiler.is_compiling():  # (True while dynamo traces: not in its graph)
        raise _RanEagerly  # f's writes and draws would be made twice, here and by its record
    return after(f(x, *args), *after_args)


def _unchanged(out: Tensor) -> Tensor:
    return out


def _parts(f: Callable[..., Tensor]) -> tuple[Callable[..., Tensor], Callable[..., Tensor],
                                                tuple[object, ...]]:  # fmt: skip
    """``f`` as ``(inner, after, after_args)``: ``f(x, *args) = after(inner(x, *args),
    *after_args)``. A wrapper made anew at every call (``pyhvp``'s output check) says so by
    ``__guarded_call__``: dynamo guards the identity of such an object on some torch versions,
    and the values of the parts it gives."""
    parts = getattr(f, "__guarded_call__", None)
    return cast(Any, parts) if parts is not None else (f, _unchanged, ())


class _Route:
    """Dynamo's cache for the callables of one code (or type): its own copy of the trampoline's
    code, so that dynamo's per-code cache and recompile limit are its own."""

    def __init__(self) -> None:
        code = _trampoline.__code__.replace()
        trampoline = types.FunctionType(code, _trampoline.__globals__, TRAMPOLINE)
        self.compiled = torch.compile(
            trampoline, backend=self._backend, fullgraph=True, dynamic=False
        )
        self.graphs = 0
        self.declined: str | None = None

    def _backend(
        self, module: fx.GraphModule, example_inputs: Sequence[object]
    ) -> Callable[..., tuple[object]]:
        self.graphs += 1
        if self.graphs >= min(GRAPHS_PER_ROUTE, _dynamo_limit() - 1):
            self.declined = f"{self.graphs} graphs"  # from the next call on
        (outputs,) = next(node.args for node in module.graph.nodes if node.op == "output")
        if len(outputs) != 1:  # dynamo would store a placeholder where f keeps an intermediate
            raise _Declined(f"the graph returns {len(outputs)} tensors, more than f's result")
        for node in module.graph.nodes:
            if node.op == "call_function" and _transform_machinery(node.target):
                raise _Declined(f"the graph runs {node.target} (a transform inside f)")
        graph = _Graph(module)

        def hand_over(*inputs: object) -> tuple[object]:
            _pending.value = (graph, inputs)
            if graph.program is None:  # ends the call before dynamo replays f's side effects:
                raise _Unchecked  # the record of f that checks the graph makes them
            return (inputs[0],)  # never read: f's result is the program's to compute

        return hand_over


def _transform_machinery(target: object) -> bool:
    """A higher-order op, or functorch's or autograd's machinery (``torch.func.grad`` inside
    ``f``, which dynamo inlines): the record of such a graph is not the record of ``f``."""
    name = f"{getattr(target, '__module__', None)}.{getattr(target, '__name__', '')}"
    return isinstance(target, torch._ops.HigherOrderOperator) or any(
        part in name for part in ("functorch", "autograd", "saved_tensors_hooks")
    )


class _Declined(Exception):
    """The backend refuses a graph: dynamo raises, and the route is declined."""


class _Unchecked(Exception):
    """A graph whose program is not known yet: the call records ``f`` instead."""


_ROUTES: dict[Hashable, _Route] = {}

ROUTES_PER_CODE = 16
"""Most routes of one code keyed by the modules its callables capture (:func:`_route_key`);
callables of that code over further modules share one route, which declines after
:data:`GRAPHS_PER_ROUTE` graphs as every route does (a module made anew at every call would
otherwise cost a new route, and a dynamo trace, per call)."""


def _route_key(f: Callable[..., Tensor]) -> Hashable:
    """Callables of one code share a route (a lambda made anew at every call, a module's class):
    dynamo's guards tell them apart by their closures and attributes. Wrappers (``__wrapped__``,
    ``functools.partial``) are keyed by what they wrap. Callables of one code over different
    modules (captured, bound, or the module itself) get a route each, up to
    :data:`ROUTES_PER_CODE`: a sweep over several networks through one lambda keeps a graph per
    network (one route would trace a graph for each and decline after the sixth). The forward
    of each of those modules' classes is part of the key: dynamo does not guard it, and a class
    patched after a first call is another ``f``; a network read from a global variable counts as
    captured."""
    while True:
        inner = f.func if isinstance(f, functools.partial) else getattr(f, "__wrapped__", None)
        if inner is None:
            break
        f = inner
    func = getattr(f, "__func__", f)  # a bound method: its function
    code = cast(Hashable, getattr(func, "__code__", None) or type(f))
    captured = [getattr(f, "__self__", f), *(cell.cell_contents for cell in _cells(func)),
                *_globals_read(func)]  # fmt: skip
    networks = [m for m in captured if isinstance(m, torch.nn.Module)]
    if not networks:
        return code
    # what dynamo does not guard: the forward of each module class (patched after a first
    # call, the route is another one)
    forwards = tuple(Identity(c.forward) for network in networks for c in _classes(network))
    key = (code, tuple(map(Identity, networks)), forwards)
    if key not in _ROUTES and sum(isinstance(k, tuple) and k[0] is code for k in _ROUTES) >= (
        ROUTES_PER_CODE
    ):
        return code
    return key


_CLASSES: weakref.WeakKeyDictionary[torch.nn.Module, tuple[type, ...]] = weakref.WeakKeyDictionary()
"""The module classes of each network a route captures, found once (its modules may be many;
their classes are few, and read at every call), and again after any module registers a
submodule (:func:`_forget_classes`): one swapped in may be of a class the network did not
have."""


def _forget_classes(*_: object) -> None:
    """A module registration hook for every module (torch calls it on ``module.name = child``
    and ``sequential[i] = child``): the classes found so far may be stale."""
    _CLASSES.clear()


torch.nn.modules.module.register_module_module_registration_hook(_forget_classes)


def _classes(network: torch.nn.Module) -> tuple[type[torch.nn.Module], ...]:
    found = _CLASSES.get(network)
    if found is None:
        found = _CLASSES[network] = tuple(dict.fromkeys(type(m) for m in network.modules()))
    return found


def _globals_read(func: object) -> list[object]:
    """The global variables a Python function's code reads by name (a module-level network
    a lambda calls), as they are now."""
    code, namespace = getattr(func, "__code__", None), getattr(func, "__globals__", None)
    if code is None or not isinstance(namespace, dict):
        return []
    return [namespace[name] for name in code.co_names if name in namespace]


def _cells(func: object) -> list[types.CellType]:
    """The closure cells of a Python function that are filled (none for other callables)."""
    cells = getattr(func, "__closure__", None) or ()
    filled = []
    for cell in cells:
        try:
            cell.cell_contents  # noqa: B018 (an empty cell raises)
        except ValueError:
            continue
        filled.append(cell)
    return filled


def _plain_call() -> bool:
    return (
        torch._C._functorch.peek_interpreter_stack() is None
        and torch.autograd.forward_ad._current_level < 0
        and not torch.compiler.is_compiling()
    )


def _dynamo_limit() -> int:
    """Dynamo's graphs per code, past which it runs ``f`` eagerly (renamed in torch 2.7)."""
    config = torch._dynamo.config
    return int(getattr(config, "recompile_limit", None) or config.cache_size_limit)


Build = Callable[[Recorder, object, Tensor], tuple[Any, tuple[Tensor, ...]]]
"""A record (the recorder, ``f``'s output, the variable) to its program and constants."""


def capture(f: Callable[..., Tensor], variable: Tensor, args: Sequence[object], build: Build
            ) -> tuple[Any, tuple[Tensor, ...]] | None:  # fmt: skip
    """``f``'s program and constants for this call through dynamo's guards, or ``None``: the
    caller records ``f``. Dynamo runs none of ``f``'s tensor ops, only its Python side effects
    (appending to a list, counting calls), as it replays them; a call that records ``f`` (the
    first of each graph) ends dynamo's before it replays any, so ``f`` runs once per call.
    Where dynamo raises, ``f`` is recorded here: an error of ``f``'s own is raised by the
    record, as eager code raises it, and declines nothing; any other declines the route."""
    if not _plain_call() or global_module_hooks():  # dynamo guards none: record f
        return None
    parts = _parts(f)
    key = _route_key(parts[0])
    route = _ROUTES.get(key)
    if route is None:
        route = _ROUTES[key] = _Route()
    if route.declined is not None:
        return None
    _pending.value = None
    returned: object = None
    failed: Exception | None = None
    try:
        with recording_state(), quiet_tracing(), HookGuards():  # f's errors: its record's
            returned = route.compiled(*parts, variable, *args)
    except _Unchecked:
        pass
    except Exception as error:  # dynamo cannot take f whole, ran it eagerly, or f raised
        failed = error
    if failed is not None:  # recorded outside the handler: f's own error is not chained to
        # dynamo's (a traceback of dynamo's graph break printed above the user's)
        recorder, out = record(f, variable, args)  # raises f's own error as eager code would
        route.declined = ("dynamo ran f eagerly" if isinstance(failed, _RanEagerly)
                          else f"dynamo: {type(failed).__name__}: {failed}")  # fmt: skip
        return build(recorder, out, variable)  # f ran fine: not its error
    pending, _pending.value = _pending.value, None
    if pending is None:  # no graph: f made no tensor op, and dynamo made its Python side
        # effects (they are made once: f itself is not run again). Its result is x itself or a
        # tensor it holds (any tensor op, even a view, is in a graph)
        route.declined = route.declined or "f makes no tensor op"

        def made(x: Tensor, *_: object) -> Tensor:
            return x if returned is variable else cast(Tensor, returned)

        return build(*record(made, variable, ()), variable)
    graph, inputs = pending
    if graph.program is not None:
        return graph.program, tuple(inputs[s] if isinstance(s, int) else s for s in graph.sources)
    recorder, out = record(f, variable, args)
    program, constants = build(recorder, out, variable)
    refusal = _refusal(graph, variable, inputs, build, recorder, program, constants)
    if refusal is not None:
        route.declined = refusal
    return program, constants


def _refusal(graph: _Graph, variable: Tensor, inputs: Sequence[object], build: Build,
             recorder: Recorder, program: object, constants: Sequence[Tensor]
             ) -> str | None:  # fmt: skip
    """Why the graph's calls may not reuse ``program`` (``f``'s, recorded on this call by
    ``recorder``), or ``None``: then they do (``graph.program``). Nothing in ``f`` may have to
    happen or be judged anew at every call; the graph's own record -- the graph dynamo traced,
    run on this call's inputs -- must give the very program ``f``'s record gave; and its
    constants must be this call's inputs or scalars it made (which the guards fix)."""
    if recorder.drew:
        return "f draws random values"
    if recorder.wrote or any(func is DET for func, *_ in recorder.events):
        return "f writes to a tensor or computes a determinant"
    if any(func is ITEM for func, *_ in recorder.events):  # dynamo 2.13 traces .item() whole
        return "f reads a tensor's value into Python (.item(), float(t)), which no guard checks"
    if not all(isinstance(t, Tensor) for t in inputs):
        return "a graph input is not a tensor"
    tensors = cast(Sequence[Tensor], inputs)

    def replay(x: Tensor) -> Tensor:  # node by node: the graph's generated code may differ
        # (torch.fx prints (-2.0) ** x as -2.0 ** x)
        (out,) = fx.Interpreter(graph.module).run(*(x if t is variable else t for t in tensors))
        return cast(Tensor, out)

    try:
        traced, fixed = build(*record(replay, variable, ()), variable)
    except Exception as error:
        return f"the record of dynamo's graph failed: {type(error).__name__}: {error}"
    if traced is not program:
        return "dynamo's graph records as another program than f"
    index = {id(t): i for i, t in enumerate(tensors)}
    storages = {storage_id(t) for t in tensors} - {0}
    for ours, made in zip(constants, fixed, strict=True):
        if id(made) in index:
            if ours is not made:
                return "a constant of f is not the graph input in its place"
        elif made.dim() or storage_id(made) in storages or not torch.equal(ours, made):
            return "a constant of f is neither a graph input nor a scalar the graph made"
    graph.sources = tuple(index.get(id(c), c) for c in fixed)
    graph.program = program
    return None
