"""Jet kernels: the rules run over a program, traced once into a flat graph of plain aten ops.

:func:`run_jets` interprets a :class:`~pyhvp.taylor.program.Program` node by node with
:func:`~pyhvp.taylor.registry.apply`; :func:`build_kernel` runs it once under ``make_fx`` and
keeps the resulting graph (dead code removed: a kernel keeps only what its outputs need). That
graph is the kernel, eager or ``torch.compile``-d: no rule logic, vmap or forward-mode AD is
left in it, only the ops the rules emitted. :class:`JetMode` says what a kernel computes.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from pyhvp.taylor import rules  # noqa: F401 (registers the dedicated rules)
from pyhvp.taylor.jets import Context, DiagonalCoefficient, Jet, strong_zeros
from pyhvp.taylor.registry import apply

Tensor = torch.Tensor


def basis_event(x: Tensor, directions: Tensor) -> tuple[int, ...] | None:
    """The event when ``directions`` are its basis ``e_k`` shared by every instance --
    ``(N, 1, ..., 1, *event)``, the identity over x's last dims (the fewest whose size is N) --
    else None. Checked by value -- by memory where they are :func:`identity`'s, else by an N x N
    comparison -- since a kernel traced for the basis keeps x's coefficient diagonal
    (:class:`~pyhvp.taylor.jets.DiagonalCoefficient`) and reads the directions only where a rule
    multiplies it out."""
    n = directions.shape[0] if directions.ndim else 0
    if n == 0 or directions.ndim != x.ndim + 1 or directions.requires_grad:
        return None
    size, count = 1, 0
    while size < n and count < x.ndim:
        count += 1
        size *= directions.shape[-count]
    event = tuple(directions.shape[directions.ndim - count :])
    shared = all(d == 1 for d in directions.shape[1 : directions.ndim - count])
    if size != n or count == 0 or not shared:
        return None
    if event != tuple(x.shape[x.ndim - count :]) or directions.dtype != x.dtype:
        return None
    eye = identity(n, directions.dtype, directions.device)
    ours = _same_memory(directions, eye) and directions.is_contiguous()
    return event if ours or torch.equal(directions.reshape(n, n), eye) else None


def _same_memory(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` starts where ``b`` does; False for a tensor without storage (a functorch
    transform's wrapper: an operator nested in ``torch.func.grad``)."""
    try:
        return a.data_ptr() == b.data_ptr()
    except RuntimeError:
        return False


IDENTITIES_CACHED = 8
"""Identities kept by :func:`identity` (least recently used dropped first)."""

_IDENTITIES: OrderedDict[tuple[int, torch.dtype, torch.device], Tensor] = OrderedDict()


def identity(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The N x N identity, made once per size, dtype and device and shared: the exact
    Laplacian's directions (``Space.basis``), which :func:`basis_event` then recognises by
    their memory instead of comparing N x N values (with two ``eye`` per call, 20-60 us of a
    0.5-3 ms call). Read only: one written in place (through any view: its version counter
    says so) is made anew. Made outside inference mode and without grad, so that it serves
    every call. Inside a ``torch.func`` transform ``torch.eye`` gives a wrapper of the
    transform's level, which is made anew and never kept: kept, it failed every later call
    inside a transform ("level <= current_level INTERNAL ASSERT FAILED", found by review)."""
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return torch.eye(n, dtype=dtype, device=device)
    key = (n, dtype, device)
    eye = _IDENTITIES.pop(key, None)
    if eye is None or eye._version:
        with torch.inference_mode(False), torch.no_grad():
            eye = torch.eye(n, dtype=dtype, device=device)
    _IDENTITIES[key] = eye
    while len(_IDENTITIES) > IDENTITIES_CACHED:
        _IDENTITIES.popitem(last=False)
    return eye


@dataclass(frozen=True)
class JetMode:
    """What a jet kernel computes: coefficients up to ``order``; the top order summed over the
    directions (``collapsed``), each weighted by a kernel input (``weighted``); which orders it
    returns (``outputs``; 0 is the value); and whether its rules run under
    :func:`~pyhvp.taylor.jets.strong_zeros` (``strong``: what a call whose plain result is not
    finite runs)."""

    order: int = 2
    collapsed: bool = False
    outputs: tuple[int, ...] = (2,)
    weighted: bool = False
    strong: bool = False

    def __post_init__(self) -> None:
        if self.order < 1 or any(not 0 <= k <= self.order for k in self.outputs):
            raise ValueError(f"a jet kernel of order {self.order} cannot return {self.outputs}")

    def collapses(self, k: int) -> bool:
        """Whether the order-``k`` output is summed over directions (no leading axis)."""
        return self.collapsed and k == self.order

    @property
    def __name__(self) -> str:  # what compile warnings print
        kind = "collapsed" if self.collapsed else "per-direction"
        return f"{'strong-zero ' if self.strong else ''}{kind} order-{self.order} jet kernel"


def run_jets(
    graph: fx.GraphModule, mode: JetMode, x: Tensor, directions: Tensor,
    weights: Tensor | None, constants: Sequence[Tensor], event: tuple[int, ...] | None = None,
) -> tuple[Tensor, ...]:  # fmt: skip
    """The program's output's coefficients of the orders ``mode.outputs``: order 0 its value,
    order k ``(K, *out)`` along ``directions``, or ``out`` for a collapsed top order (summed over
    the directions, times ``weights`` when given). ``event``: the directions are that event's
    basis (:func:`basis_event`), and x's first-order coefficient is kept diagonal."""
    ctx = Context(mode.collapsed, mode.order, weights)
    coefficient: Tensor | DiagonalCoefficient = directions
    if event is not None:
        coefficient = DiagonalCoefficient(1.0, directions, event, x.ndim)
    elif ctx.collapses(1):  # first order is the top: the (weighted) sum of the directions
        coefficient = ctx.summed(directions)
    inputs = iter([Jet(x, (coefficient, *(None,) * (mode.order - 1))), *constants])
    last_use = {}
    for i, node in enumerate(graph.graph.nodes):
        for used in node.all_input_nodes:
            last_use[used] = i
    env: dict[fx.Node, Any] = {}  # each node's value: a jet, a tensor, or a tree of them
    result: Any = None
    for i, node in enumerate(graph.graph.nodes):
        if node.op == "placeholder":
            env[node] = next(inputs)
        elif node.op == "get_attr":
            env[node] = getattr(graph, node.target)
        elif node.op == "call_function":
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
            if node.target is operator.getitem:
                env[node] = args[0][args[1]]
            else:
                env[node] = apply(ctx, node.target, *args, **kwargs)
        elif node.op == "output":
            result = fx.node.map_arg(node.args[0], env.__getitem__)
        for used in node.all_input_nodes:
            if last_use[used] == i:
                del env[used]
    return tuple(_output_coefficient(mode, result, k, directions.shape[0], x.dtype)
                 for k in mode.outputs)  # fmt: skip


def _output_coefficient(mode: JetMode, out: Jet | Tensor, k: int, count: int,
                        dtype: torch.dtype) -> Tensor:  # fmt: skip
    """The order-``k`` output of ``out`` (a constant: zeros), expanded to its full shape: order
    0 is the value, in f's dtype; a coefficient is a derivative with respect to x and has x's
    ``dtype``, whatever dtype f computes in, as autograd's gradients do
    (docs/guide/contract.md)."""
    value = out.value if isinstance(out, Jet) else out
    if k == 0:
        return value
    lead = 1 if mode.collapses(k) else count
    c = out.dense(k) if isinstance(out, Jet) else None
    full = (value.new_zeros((lead, *value.shape), dtype=dtype) if c is None
            else c.expand(lead, *value.shape).to(dtype))  # fmt: skip
    return full[0] if mode.collapses(k) else full


def traceable(t: Tensor) -> Tensor:
    """``t`` as an input ``make_fx`` accepts: detached, and an ordinary tensor if it was made in
    inference mode."""
    return t.clone() if t.is_inference() else t.detach()


class JetKernel:
    """A flat aten graph ``(x, directions, [weights,] *constants) -> coefficients``; callable."""

    def __init__(self, graph: fx.GraphModule, mode: JetMode) -> None:
        self.graph = graph
        self.mode = mode

    @property
    def __name__(self) -> str:  # what compile warnings print
        return self.mode.__name__

    def __call__(self, *inputs: Tensor) -> object:
        # forward, not the module's __call__: a global module hook of the user's
        # (register_module_forward_hook) is no business of pyhvp's own graph
        return self.graph.forward(*inputs)


FX_TRACING = threading.RLock()
"""Held while ``make_fx`` traces (a kernel here, a program's replay in :mod:`.program`): fx's
tracer patches module-level state (``_symbolic_trace``'s patcher), so two threads tracing at
once failed ("CURRENT_PATCHER is None in finally block": the first calls of laplacian from
four threads, eager too)."""


def build_kernel(
    program: fx.GraphModule,
    mode: JetMode,
    x: Tensor,
    directions: Tensor,
    weights: Tensor | None,
    constants: Sequence[Tensor],
    event: tuple[int, ...] | None = None,
) -> JetKernel:
    """Trace :func:`run_jets` for this program, mode and directions layout into a flat graph,
    which returns the tuple of ``mode.outputs`` (nothing else is computed: an output's value or
    lower coefficients that are not returned are dead code, an MLP's last layer applied to K
    coefficients, say). ``event``: the directions are that event's basis (:func:`basis_event`;
    the kernel then holds for those directions only)."""

    def jets(x: Tensor, directions: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        w, constants = (rest[0], rest[1:]) if mode.weighted else (None, rest)
        return run_jets(program, mode, x, directions, w, constants, event)

    inputs = (x, directions, *([] if weights is None else [weights]), *constants)
    with (
        torch.no_grad(),
        strong_zeros() if mode.strong else contextlib.nullcontext(),
        _one_fake_mode(),
        FX_TRACING,
    ):
        # an explicit table, even empty: without one, torch 2.14's make_fx traces detach as
        # alias, which autograd differentiates through (f's detach() and no_grad lost)
        graph = make_fx(jets, decomposition_table={})(*map(traceable, inputs))
    _drop_identical_views(graph.graph)
    graph.graph.eliminate_dead_code()
    graph.recompile()
    return JetKernel(graph, mode)


def _one_fake_mode() -> contextlib.AbstractContextManager[object]:
    """One fake-tensor mode for a whole trace: ``make_fx`` notes each node's shape in a fake
    tensor, and without a mode in context it builds a new one per node (which captures a Python
    stack: about 5 ms, most of a trace's time; a sixth-order fallback traces thousands of
    nodes)."""
    return torch._guards.tracing(
        torch._guards.TracingContext(FakeTensorMode(allow_fallback_kernels=True))
    )


def _drop_identical_views(graph: fx.Graph) -> None:
    """Views that give their input back unchanged (an ``expand`` or ``view`` to the same shape
    and strides, which rules emit where a coefficient already has the full shape) are replaced
    by their input: eagerly each still costs an op call (several percent of a small kernel).
    Exact for this kernel's inputs, whose shapes and strides are part of its key. Not a
    ``detach``: the same view, but a constant to autograd where a kernel's result is
    differentiated (``f``'s ``detach()`` and ``no_grad``; dropped, a PINN's gradients went
    through them)."""
    for node in list(graph.nodes):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target.overloadpacket is torch.ops.aten.detach:
            continue
        returns = target._schema.returns
        alias = returns[0].alias_info if len(returns) == 1 else None
        source = node.args[0] if node.args else None
        if alias is None or alias.is_write or not isinstance(source, fx.Node):
            continue
        out, src = node.meta.get("val"), source.meta.get("val")
        if isinstance(out, Tensor) and isinstance(src, Tensor) and _same_view(out, src):
            node.replace_all_uses_with(source)
            graph.erase_node(node)


def _same_view(a: Tensor, b: Tensor) -> bool:
    return (a.shape, a.stride(), a.storage_offset(), a.dtype) == (
        b.shape, b.stride(), b.storage_offset(), b.dtype
    )  # fmt: skip
