"""What ``f`` computes, as a straight-line program of aten ops, and the guard that says when a
cached program (and its compiled jet kernels) applies to a new call.

Every call runs ``f`` once, eagerly, under the recorder (:mod:`.recorder`), which notes each aten
op and where each tensor argument comes from: ``x``, an earlier op, or a *constant* (``f`` gets a
fresh alias of ``x`` as its variable, so ``x`` reaching ``f`` again is a constant: derivatives
are partial ones).
That record is the cache key. Equal records mean the same program: same ops in the same order
with the same options, so data-dependent control flow, replaced parameters, changed Python state
or a different ``x`` layout can never reuse a stale program -- they record differently and build
a new one. Constants are inputs of the program, passed anew at every call, so a program is reused
across calls whatever tensor objects ``f`` captures (a lambda rebuilt per call, parameters
updated in place or replaced), and gradients flow to them when they require grad. Python floats
that ``f`` adds, subtracts, multiplies or divides by (or passes to ``torch.where``) are such
constants too, 0-d tensors keyed by dtype (:data:`~pyhvp.taylor.recorder.LIFTED_SCALARS`): a
time step that changes at every call reuses the program and its kernels; other scalars (a
power's exponent, clamp bounds, ints) are keyed by value, as rules branch on them. The record
costs one forward of ``f`` (8-12 us per op and 20-50 us per call of overhead, measured on a
2-core machine), paid at every call; it holds labels, not tensors, so ``f``'s intermediates are
freed as ``f`` runs.

``f`` runs with grad mode on, so that its own ``torch.no_grad()`` shows: what it computes without
grad is a constant, as for autograd (see :class:`Recorder`). Writes to ``x`` or to a constant,
directly or through a view, are refused (:class:`InPlaceInputError`); so is autograd's backward
pass inside ``f`` (``torch.func.grad`` is fine).

On a miss the record becomes an fx graph, replayed once through ``make_fx(functionalize(...))``
(on fake tensors where shapes do not depend on values) with every op that has no jet rule
decomposed where PyTorch has a decomposition for it (:func:`decompositions`), into a functional
aten program -- the graph the jet rules (:mod:`.rules`) run on.
"""

from __future__ import annotations

import functools
import math
import operator
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import fx
from torch._decomp import core_aten_decompositions, get_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from pyhvp._checks import require_output_tensor
from pyhvp._keys import Value
from pyhvp._user_errors import quiet_tracing
from pyhvp.taylor import guards
from pyhvp.taylor.custom_ops import STOP_GRADIENT, WITH_DERIVATIVES_OF
from pyhvp.taylor.kernel import (
    FX_TRACING,
    JetKernel,
    JetMode,
    basis_event,
    build_kernel,
    traceable,
)
from pyhvp.taylor.recorder import (
    BY_CONDITIONING,
    KEEP,
    STOP,
    InPlaceInputError,
    Recorder,
    X,
    argument_kinds,
    record,
    storage_id,
)
from pyhvp.taylor.registry import RULES, ZERO_DERIVATIVE, rules_generation

aten = torch.ops.aten
Tensor = torch.Tensor

PROGRAMS_CACHED = 64
"""Programs remembered (least recently used dropped first)."""


EXTRA_DECOMPOSITIONS = (
    aten.native_layer_norm.default,
    aten.native_group_norm.default,
    aten.native_batch_norm.default,
    aten._native_batch_norm_legit_no_training.default,
    aten._native_batch_norm_legit_functional.default,
    aten._batch_norm_with_update_functional.default,
    aten.embedding.default,
    aten.max_pool2d_with_indices.default,
    aten.max_pool3d_with_indices.default,
    aten.grid_sampler_2d.default,
    aten.repeat.default,
    aten.upsample_bilinear2d.vec,
    aten.upsample_nearest2d.vec,
    aten.dist.default,
)
"""Decompositions outside the core ATen table whose ops all have rules."""


def logcumsumexp_by_prefixes(input: Tensor, dim: int) -> Tensor:
    """``torch.logcumsumexp`` as a ``logsumexp`` over each position's prefix, the later entries
    masked to ``-inf`` (``n x n`` per row of ``n`` entries along ``dim``): torch's own
    derivatives of ``logcumsumexp`` past the first are NaN (its backward takes the log of the
    cotangent), so the gradient of a Laplacian through it was NaN."""
    if input.ndim == 0:
        return input.clone()
    rows = input.movedim(dim, -1)
    n = rows.shape[-1]
    prefix = torch.ones(n, n, dtype=torch.bool, device=input.device).tril()
    spread = rows.unsqueeze(-2).expand(*rows.shape[:-1], n, n)
    masked = torch.where(prefix, spread, torch.full((), -math.inf, dtype=input.dtype,
                                                    device=input.device))  # fmt: skip
    return torch.logsumexp(masked, -1).movedim(-1, dim)


def log_sigmoid_by_softplus(input: Tensor) -> tuple[Tensor, Tensor]:
    """``aten.log_sigmoid_forward`` as ``-softplus(-x)``, smooth at 0: torch's decomposition,
    ``min(0, x) - log1p(exp(-|x|))``, has two kinks at 0 whose sum is smooth, each
    differentiated by a zero convention there (the second derivative at 0 was 0 for -1/4)."""
    return -F.softplus(-input), input.new_empty(0)


def _reduced(loss: Tensor, reduction: int) -> Tensor:
    """``loss`` by an aten reduction code: 0 none, 1 mean, 2 sum."""
    return loss if reduction == 0 else loss.mean() if reduction == 1 else loss.sum()


def huber_by_squares(input: Tensor, target: Tensor, reduction: int = 1, delta: float = 1.0
                     ) -> Tensor:  # fmt: skip
    """``aten.huber_loss`` with its quadratic zone as ``d * d``, not torch's ``|d| ** 2``,
    whose second derivative at a residual of 0 took abs's zero convention (0 for 1); at
    ``|d| = delta`` the quadratic zone's, as ``torch.func.hessian`` has it (autograd's double
    backward takes the linear zone's 0 there, torch 2.5-2.14)."""
    d = input - target
    quadratic = 0.5 * d * d
    return _reduced(torch.where(d.abs() <= delta, quadratic, delta * (d.abs() - 0.5 * delta)),
                    reduction)  # fmt: skip


def smooth_l1_by_squares(input: Tensor, target: Tensor, reduction: int = 1, beta: float = 1.0
                         ) -> Tensor:  # fmt: skip
    """``aten.smooth_l1_loss`` with its quadratic zone as ``d * d / beta``, as
    :func:`huber_by_squares` (at a residual of 0 the second derivative was 0 for ``1 / beta``);
    at ``|d| = beta`` the linear zone's, as autograd has it."""
    d = input - target
    if beta == 0:
        return _reduced(d.abs(), reduction)
    return _reduced(torch.where(d.abs() < beta, 0.5 * d * d / beta, d.abs() - 0.5 * beta),
                    reduction)  # fmt: skip


OWN_DECOMPOSITIONS: dict[torch._ops.OpOverload, Callable[..., object]] = {
    aten.logcumsumexp.default: logcumsumexp_by_prefixes,
    aten.log_sigmoid_forward.default: log_sigmoid_by_softplus,
    aten.huber_loss.default: huber_by_squares,
    aten.smooth_l1_loss.default: smooth_l1_by_squares,
}
"""pyhvp's decompositions of ops whose derivatives torch gets wrong, into ops with rules."""


def decompositions() -> dict[torch._ops.OpOverload, Callable[..., object]]:
    """PyTorch's core ATen decompositions (``torch._decomp``, plus :data:`EXTRA_DECOMPOSITIONS`)
    of every op without a jet rule, applied while the program is replayed: composite ops
    (``mse_loss`` and the other losses, ``addr``, norms, attention's math path,
    ...) become ops that have rules before any fallback is needed. Elementwise ops keep
    autograd's own elementwise derivatives (:func:`~pyhvp.taylor.fallbacks.pointwise_fallback`);
    random ops and ops with zero derivatives are left alone."""
    return {op: fn for op, fn in _candidate_decompositions().items() if op not in RULES}


@functools.cache
def _candidate_decompositions() -> dict[torch._ops.OpOverload, Callable[..., object]]:
    """The tables' functional, non-random, non-elementwise entries, built once (about 30 ms);
    :func:`decompositions` leaves out the ops that have rules, which users may add."""
    table = {**core_aten_decompositions(), **get_decompositions(list(EXTRA_DECOMPOSITIONS)),
             **OWN_DECOMPOSITIONS}  # fmt: skip
    return {
        op: _stopping_auxiliary_outputs(decomposition, AUXILIARY_OUTPUTS.get(op, ()))
        for op, decomposition in table.items()
        if isinstance(op, torch._ops.OpOverload)
        and op not in ZERO_DERIVATIVE
        and not op._schema.is_mutable
        and torch.Tag.pointwise not in op.tags
        and torch.Tag.nondeterministic_seeded not in op.tags
    }


AUXILIARY_OUTPUTS = {
    aten.native_layer_norm.default: (1, 2),
    aten.native_batch_norm.default: (1, 2),
    aten._native_batch_norm_legit_no_training.default: (1, 2),
    aten._native_batch_norm_legit_functional.default: (1, 2, 3, 4),
    aten._batch_norm_with_update_functional.default: (1, 2, 3, 4, 5),
}
"""Outputs that autograd does not differentiate (``output_differentiability: False``: the mean
and inverse deviation a norm saves for its backward, the running statistics it returns): their
decompositions would compute them from ``x``, so they are read through ``stop_gradient``, as
autograd has them. (``native_group_norm``'s are differentiable in autograd -- though its double
backward drops the inverse deviation's gradient unless the mean's is there too -- so they keep
their true derivatives.)"""


def _stopping_auxiliary_outputs(decomposition: Callable[..., object],
                                auxiliary: Sequence[int]) -> Callable[..., object]:  # fmt: skip
    if not auxiliary:
        return decomposition

    def decomposed(*args: object, **kwargs: object) -> object:
        outputs = list(decomposition(*args, **kwargs))  # type: ignore[call-overload]
        for i in auxiliary:
            outputs[i] = STOP_GRADIENT(outputs[i])
        return tuple(outputs)

    return decomposed


def _meta(t: Tensor) -> Hashable:
    return (tuple(t.shape), t.stride(), t.dtype, t.device)


@dataclass(eq=False)
class Program:
    """``f`` as a functional aten graph ``(x, *constants) -> f(x, *args)`` with its jet kernels."""

    graph: fx.GraphModule
    kernels: dict[Hashable, JetKernel] = field(default_factory=dict)

    def kernel(self, mode: JetMode, x: Tensor, directions: Tensor, weights: Tensor | None,
               constants: Sequence[Tensor]) -> JetKernel:  # fmt: skip
        """The jet kernel for this mode and directions layout (traced on first use); a
        collapsed second-order one along the basis of x's event keeps x's coefficient
        diagonal."""
        event = basis_event(x, directions) if _keeps_diagonal(mode) else None
        key = (mode, _meta(directions), event, None if weights is None else _meta(weights),
               rules_generation())  # a rule registered since: traced anew  # fmt: skip
        if key not in self.kernels:
            self.kernels[key] = build_kernel(self.graph, mode, x, directions, weights, constants,
                                             event)  # fmt: skip
        return self.kernels[key]


def _keeps_diagonal(mode: JetMode) -> bool:
    """Diagonal first-order coefficients are kept by collapsed, unweighted second-order
    kernels (their collapsed square is the diagonal's square)."""
    return mode.collapsed and mode.order == 2 and not mode.weighted


_PROGRAMS: OrderedDict[Hashable, Program] = OrderedDict()


@dataclass(frozen=True)
class Capture:
    """One call's program and the constants to pass it."""

    program: Program
    constants: tuple[Tensor, ...]

    def kernel(self, mode: JetMode, x: Tensor, directions: Tensor,
               weights: Tensor | None = None) -> JetKernel:  # fmt: skip
        return self.program.kernel(mode, x, directions, weights, self.constants)


def capture(f: Callable[..., Tensor], x: Tensor, args: Sequence[object], guarded: bool = False
            ) -> Capture:  # fmt: skip
    """Run ``f(x, *args)`` once under the recorder; return its (cached or new) program. With
    ``guarded``, a call whose dynamo guards hold reuses its graph's program unrecorded
    (:mod:`.guards`).

    ``f`` gets a fresh alias of ``x`` as its variable: the tensor ``x`` itself, passed again in
    ``args`` or captured by ``f``, is a constant there (partial derivatives, as on the
    Hessian-vector-product path).
    """
    variable = x.detach()
    if guarded:
        found = guards.capture(f, variable, args, _program)
        if found is not None:
            return Capture(*found)
    return Capture(*_program(*record(f, variable, args), variable))


def _program(recorder: Recorder, out: object, x: Tensor) -> tuple[Program, tuple[Tensor, ...]]:
    """The (cached or new) program of a record, and the constants to pass it."""
    out = require_output_tensor("f", out)  # integers do not vary smoothly; no complex
    output = recorder._describe(out, ("read", False))  # a view made without grad: constant
    key = (
        _meta(x),
        tuple(recorder.events),
        tuple(_meta(c) for c in recorder.constants),
        output,
    )
    program = _PROGRAMS.pop(key, None)
    if program is None:
        program = Program(_functional_graph(recorder, output, x))
    _PROGRAMS[key] = program
    while len(_PROGRAMS) > PROGRAMS_CACHED:
        _PROGRAMS.popitem(last=False)
    return program, tuple(recorder.constants)


def _functional_graph(recorder: Recorder, output: Hashable, x: Tensor) -> fx.GraphModule:
    """The record as an fx graph, replayed through functionalization and decompositions."""
    graph = fx.Graph()
    nodes: dict[Hashable, fx.Node] = {X: graph.placeholder("x")}
    for i in range(len(recorder.constants)):
        nodes[("constant", i)] = graph.placeholder(f"constant_{i}")
    for k, (func, args, kwargs, outputs, note) in enumerate(recorder.events):
        target = BY_CONDITIONING[func] if note is True else func
        positional = _rebuild(args, nodes, graph)
        named = dict(_rebuild(kwargs, nodes, graph))
        if note == KEEP:
            node = _write_keeping_derivatives(graph, func, positional, named)
        else:
            node = graph.call_function(target, positional, named)
        _name_outputs(graph, node, outputs, ("op", k), nodes)
    graph.output(_rebuild(output, nodes, graph))
    graph.eliminate_dead_code()
    raw = fx.GraphModule(torch.nn.Module(), graph)
    inputs = [traceable(t) for t in (x, *recorder.constants)]

    def replay(tracing_mode: Literal["real", "fake"]) -> fx.GraphModule:
        # forward, not the module's __call__: the user's global module hooks are in the record
        # (a lambda: make_fx counts a bound method's self among the inputs)
        functional = torch.func.functionalize(lambda *inputs: raw.forward(*inputs))
        # on real values, a copy of the inputs: the replay runs the record's ops, and
        # functionalization ends with copy_ of the new values into the inputs f wrote -- into
        # f's own tensors, a second time (running statistics updated twice, a captured tensor
        # written twice, dropout's scaled mask scaled again)
        replayed = inputs if tracing_mode == "fake" else _copies(inputs)
        with torch.no_grad(), FX_TRACING:
            return make_fx(functional, decomposition_table=decompositions(),
                           tracing_mode=tracing_mode)(*replayed)  # fmt: skip

    with quiet_tracing():  # a fake replay that fails logs the failure: an expected one
        try:  # on fake tensors: shapes are all it needs, and f's intermediates are not held
            functional = replay("fake")
        except Exception:  # data-dependent shapes (masks, nonzero): on real values
            functional = replay("real")
    _drop_input_writes(functional.graph)
    functional.graph.eliminate_dead_code()
    functional.recompile()
    return functional


def _copies(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Copies of ``tensors`` that alias one another as they do: one copy of each storage, each
    tensor a view of its storage's copy with its own size, strides and offset (so a write
    through one is seen through the others, as in ``f``)."""
    storages: dict[int, torch.UntypedStorage] = {}
    copies = []
    for t in tensors:
        key = storage_id(t)
        if key == 0:  # no elements to share: a copy of its own
            copies.append(t.clone())
            continue
        if key not in storages:
            storages[key] = t.untyped_storage().clone()  # type: ignore[no-untyped-call]
        copy = t.new_empty(0)
        copy.set_(storages[key], t.storage_offset(), t.shape, t.stride())
        copies.append(copy)
    return copies


def _drop_input_writes(graph: fx.Graph) -> None:
    """Functionalization ends the program with ``copy_`` of new values into the inputs ``f``
    wrote (constants: running statistics): the record has made those writes already, and the
    program's values do not depend on them, so they go. A write into ``x`` that the recorder
    could not see (an op whose schema does not declare it) is refused."""
    for node in list(graph.nodes):
        if node.target is not aten.copy_.default or node.args[0].op != "placeholder":
            continue
        if node.args[0].target == "x":
            raise InPlaceInputError(f"f modifies x in place ({node.args[1]}); write to a copy")
        node.replace_all_uses_with(node.args[1])
        graph.erase_node(node)


def _write_keeping_derivatives(graph: fx.Graph, func: torch._ops.OpOverload, args: Sequence[Any],
                               kwargs: dict[str, Any]) -> fx.Node:  # fmt: skip
    """An in-place op ``f`` ran under ``no_grad``: it writes a constant copy of each tensor it
    writes (what it reads is already constant), and each written tensor then takes the new value
    with its old derivatives -- what autograd, which does not see the write, differentiates.
    Returns the node of the op's result (the first written tensor's new value when the op
    returns one tensor, as in-place ops do)."""
    positional, named = argument_kinds(func)
    written: list[tuple[fx.Node, fx.Node]]
    args, written = list(args), []
    for i, kind in enumerate(positional[: len(args)]):
        if kind == "write" and isinstance(args[i], fx.Node):
            copy = graph.call_function(STOP_GRADIENT, (args[i],))
            written.append((args[i], copy))
            args[i] = copy
    for name, value in kwargs.items():
        if named.get(name) == "write" and isinstance(value, fx.Node):
            copy = graph.call_function(STOP_GRADIENT, (value,))
            written.append((value, copy))
            kwargs[name] = copy
    result = graph.call_function(func, tuple(args), kwargs)
    updated = [
        graph.call_function(aten.copy_.default, (node, graph.call_function(WITH_DERIVATIVES_OF,
                                                                           (copy, node))))
        for node, copy in written
    ]  # fmt: skip
    returns = func._schema.returns
    return updated[0] if updated and len(returns) == 1 and returns[0].alias_info else result


def _rebuild(described: Any, nodes: dict[Hashable, fx.Node], graph: fx.Graph) -> Any:
    # described: the recorder's description of an argument tree (tagged tuples); the result
    # the argument tree again, with fx nodes for its tensors
    if isinstance(described, Value):
        return described.value
    if described in nodes:
        return nodes[described]
    kind = described[0]
    if kind == "object":
        return described[1].obj
    if kind == STOP:  # read as a constant: functionalization keeps no alias of it
        return graph.call_function(STOP_GRADIENT, (nodes[described[1]],))
    items = [_rebuild(item, nodes, graph) for item in described[1]]
    return items if kind is True else tuple(items)


def _name_outputs(graph: fx.Graph, node: fx.Node, outputs: Any, label: tuple[Hashable, ...],
                  nodes: dict[Hashable, fx.Node]) -> None:  # fmt: skip
    if isinstance(outputs, Value):  # a non-tensor result: nothing to name
        return
    if outputs[0] == "tensor":
        nodes[label] = node
    elif outputs[0] in (True, False):
        for i, item in enumerate(outputs[1]):
            _name_outputs(graph, graph.call_function(operator.getitem, (node, i)), item,
                          (*label, i), nodes)  # fmt: skip
