"""Jet kernels: the rules run over a program, traced once into a flat graph of plain aten ops.

:func:`run_jets` interprets a :class:`~pyhvp.taylor.program.Program` node by node with
:func:`~pyhvp.taylor.rules.apply`; :func:`build_kernel` runs it once under ``make_fx`` and keeps
the resulting graph (dead code removed: per-direction kernels keep only what the second-order
output needs). That graph is the kernel, eager or ``torch.compile``-d: no rule logic, vmap or
forward-mode AD is left in it, only the ops the rules emitted.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from pyhvp.taylor import rules  # noqa: F401 (registers the dedicated rules)
from pyhvp.taylor.jets import Context, DiagonalCoefficient, Jet, strong_zeros
from pyhvp.taylor.registry import apply

Tensor = torch.Tensor


def basis_event(x: Tensor, directions: Tensor) -> tuple[int, ...] | None:
    """The event when ``directions`` are its basis ``e_k`` shared by every instance --
    ``(N, 1, ..., 1, *event)``, the identity over x's last dims (the fewest whose size is N) --
    else None. Checked by value (an N x N comparison), since a kernel traced for the basis keeps
    x's coefficient diagonal (:class:`~pyhvp.taylor.jets.DiagonalCoefficient`) and reads the
    directions only where a rule multiplies it out."""
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
    eye = _identity(n, directions.dtype, directions.device)
    return event if torch.equal(directions.reshape(n, n), eye) else None


@functools.lru_cache(maxsize=8)
def _identity(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The N x N identity :func:`basis_event` compares with, made once (read only)."""
    return torch.eye(n, dtype=dtype, device=device)


def run_jets(
    graph: fx.GraphModule, ctx: Context, x: Tensor, directions: Tensor, constants: Sequence[Tensor],
    event: tuple[int, ...] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(value, first, second)`` of the program's output: ``value`` its value, ``first`` the
    first-order coefficients ``(K, *out)`` along ``directions``, ``second`` the second-order ones
    ``(K, *out)`` per direction or ``out`` summed (collapsed). ``event``: the directions are that
    event's basis (:func:`basis_event`), and x's coefficient is kept diagonal."""
    coefficient = directions if event is None else DiagonalCoefficient(1.0, directions, event,
                                                                       x.ndim)  # fmt: skip
    inputs = iter([Jet(x, coefficient, None), *constants])
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
    return _output_coefficients(ctx, result, directions.shape[0], x.dtype)


def _output_coefficients(ctx: Context, out: Jet | Tensor, k: int, dtype: torch.dtype
                         ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The output's value (in f's dtype) and its coefficients in ``dtype``, x's: a derivative
    with respect to x has x's dtype, whatever dtype f computes in, as autograd's gradients do
    (docs/guide/contract.md)."""
    if not isinstance(out, Jet):  # f does not depend on x: every derivative is zero
        zeros = out.new_zeros((k, *out.shape), dtype=dtype)
        return out, zeros, zeros[0] if ctx.collapsed else zeros
    first = out.first.expand(k, *out.value.shape).to(dtype)
    lead = 1 if ctx.collapsed else k
    if out.second is None:
        second = out.value.new_zeros((lead, *out.value.shape), dtype=dtype)
    else:
        second = out.second.expand(lead, *out.value.shape).to(dtype)
    return out.value, first, second[0] if ctx.collapsed else second


def traceable(t: Tensor) -> Tensor:
    """``t`` as an input ``make_fx`` accepts: detached, and an ordinary tensor if it was made in
    inference mode."""
    return t.clone() if t.is_inference() else t.detach()


class JetKernel:
    """A flat aten graph ``(x, directions, *constants) -> coefficients``; callable."""

    def __init__(self, graph: fx.GraphModule, collapsed: bool, strong: bool = False) -> None:
        self.graph = graph
        self.collapsed = collapsed
        self.strong = strong

    @property
    def __name__(self) -> str:  # what compile warnings print
        name = "collapsed jet kernel" if self.collapsed else "second-directional jet kernel"
        return f"strong-zero {name}" if self.strong else name

    def __call__(self, *inputs: Tensor) -> object:
        return self.graph(*inputs)


def build_kernel(
    program: fx.GraphModule,
    collapsed: bool,
    x: Tensor,
    directions: Tensor,
    constants: Sequence[Tensor],
    event: tuple[int, ...] | None = None,
    second_only: bool = False,
    strong: bool = False,
) -> JetKernel:
    """Trace :func:`run_jets` for this program and directions layout into a flat graph.

    Collapsed kernels return ``(value, first, second)``, or ``second`` alone with
    ``second_only``; per-direction kernels return ``second`` alone. A kernel that returns
    ``second`` alone never computes the output's value nor its first-order coefficients (dead
    code: an MLP's last layer applied to K coefficients, say).
    ``event``: the directions are that event's basis (:func:`basis_event`; the kernel then holds
    for those directions only). ``strong``: the rules run under
    :func:`~pyhvp.taylor.jets.strong_zeros` (what a call whose plain result is not finite runs).
    """
    ctx = Context(collapsed)

    def jets(x: Tensor, directions: Tensor, *constants: Tensor) -> object:
        value, first, second = run_jets(program, ctx, x, directions, constants, event)
        return (value, first, second) if collapsed and not second_only else second

    with torch.no_grad(), strong_zeros() if strong else contextlib.nullcontext():
        graph = make_fx(jets)(*map(traceable, (x, directions, *constants)))
    _drop_identical_views(graph.graph)
    graph.graph.eliminate_dead_code()
    graph.recompile()
    return JetKernel(graph, collapsed, strong)


def _drop_identical_views(graph: fx.Graph) -> None:
    """Views that give their input back unchanged (an ``expand`` or ``view`` to the same shape
    and strides, which rules emit where a coefficient already has the full shape) are replaced
    by their input: eagerly each still costs an op call (several percent of a small kernel).
    Exact for this kernel's inputs, whose shapes and strides are part of its key."""
    for node in list(graph.nodes):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
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
