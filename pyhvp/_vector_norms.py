"""Vector norms and distances differentiated twice: :func:`zero_safe_norm` and
:func:`vector_norm_backward` and :func:`cdist_backward`.

Autograd's backward of a vector norm divides by the norm: its second derivatives at a zero
vector are NaN. ``cdist`` has no second derivative at all. A pair potential summed over every
pair meets both at its zero self-distances (``(x[:, None] - x[None]).norm(dim=-1)``,
``torch.cdist(x, x)``), whose terms are constant: its HVPs and sub-Hessians were NaN or raised
on the autograd routes (until 2026-12-08; the Taylor operators and the calls inside transforms,
which run the norms written out, had them right). :func:`zero_safe_norm` is a norm written out
in elementary ops, 0 with zero derivatives of every order at a zero vector (autograd's
convention for its gradient), which the transforms' written-out ops use;
the hooks of :func:`vector_norm_backward` and :func:`cdist_backward`, which the graph walk
(:func:`~pyhvp.backends.torch.check_twice_differentiable`) puts on autograd's own nodes of
``linalg.vector_norm`` (which ``Tensor.norm``, ``torch.norm``, ``torch.linalg.norm`` of a vector
and ``F.normalize`` run) and of ``cdist``, have them differentiate by their slope written out,
however the norm was called: exact where
a zero vector does not move (a self-pair ``x_i - x_i``), NaN as autograd's where one does
(``|x - c| ** 2`` at ``x = c``: its second derivative is a limit of two terms that reverse mode
cannot take, and a zero there would be a plausible wrong value).

>>> x = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
>>> zero_safe_norm(x, 2, (-1,), False, None)  # 0 and 5, and finite derivatives at 0
tensor([0., 5.])
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch

from pyhvp.taylor.rules.elementwise import at_least_float32


def zero_safe_norm(input: object, ord: float, dims: tuple[int, ...] | None, keepdim: bool,
                   dtype: torch.dtype | None) -> torch.Tensor | None:  # fmt: skip
    """``(sum |input|^ord) ** (1 / ord)`` over ``dims`` (None: all), accumulated in float32 at
    least, and 0 with zero derivatives of every order where the vector is 0: the root is taken of
    1 there, so that nested reverse mode multiplies no ``inf`` by 0 (torch's own second and
    higher derivatives of a norm at a zero vector are NaN: the zero self-distances of a pair
    potential made every entry of ``grad`` of its Laplacian NaN). The entries are divided by the
    largest first (a constant: the norm is homogeneous) where their plain sum of powers is out
    of the range its derivatives need: until 2026-12-07 ``|x| ** 3`` of a float32 ``x`` of 1e-9
    underflowed, and the derivatives of ``x.norm(p=3) ** 3`` were -inf there. None outside
    ``1 < ord < inf`` and for complex or integer input."""
    if not (isinstance(input, torch.Tensor) and input.is_floating_point()):
        return None
    if not 1 < ord < math.inf:
        return None
    x = input if dtype is None else input.to(dtype)
    wide = at_least_float32(x)
    dims = tuple(range(x.ndim)) if dims is None else dims
    magnitude = wide.detach().abs()
    largest = magnitude.amax(dims, keepdim=True)
    zero_vector = largest == 0
    # scaled only where the plain sum is out of range for its derivatives: scaling a vector
    # whose entries span more than float32's range made the smallest subnormal (an HVP of
    # |x|_1.5 ** 3 over [1e-30, 1e10] was inf)
    finfo = torch.finfo(wide.dtype)
    plain = magnitude.pow(ord).sum(dims, keepdim=True)
    in_range = (plain >= finfo.max**-0.125) & (plain <= finfo.max**0.5)
    scale = torch.where(zero_vector | largest.isinf() | in_range, 1.0, largest)
    base = torch.where(zero_vector, 1.0, wide / scale)  # (|0| ** ord: its derivatives too)
    total = (base if ord == 2 else base.abs()).pow(ord).sum(dims, keepdim=True)
    root = total.pow(1 / ord) * scale
    norm = torch.where(zero_vector, 0.0, root)
    return (norm if keepdim else norm.squeeze(dims)).to(x.dtype)


class _PulledBack(torch.autograd.Function):
    """A norm's gradient written out, ``g * s`` for ``g`` its incoming gradient (its reduced
    ``dims`` kept) and ``s = d |x|_ord / dx = sign(x) (|x| / norm) ** (ord - 1)``, ``norm`` the
    norm the forward computed (``sign(x)`` for ``ord = 1``; 0 at a zero vector); its
    derivatives in closed form, ``w . s`` for ``g`` and ``g (ord - 1) / norm (|u| ** (ord - 2) w
    - s (s . w))`` for ``x`` (``u = x / norm``). At a zero vector the latter is 0 where the vector
    does not move (the cotangent ``w`` is 0 there: a pair potential's self-pair ``x_i - x_i``,
    whose second backward's cotangent is ``v_i - v_i``) and NaN where it does (``|x - c| ** 2``
    at ``x = c``, two particles at one place), whatever ``g`` is: there the second derivative
    is a limit of two terms (``g'(N) / N``, with ``g = 0``) that reverse mode cannot take, and a
    zero would be a plausible wrong value (-2 v read as 0, 2026-12-08). Its own derivatives are
    not taken (where results carry derivatives, the norms run written out instead)."""

    @staticmethod
    def forward(g: torch.Tensor, x: torch.Tensor, norm: torch.Tensor, ord: float,
                dims: tuple[int, ...]) -> Any:  # fmt: skip
        return g * _slope(x, torch.where(norm == 0, 1.0, norm), ord)[1]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        g, x, norm, ctx.ord, ctx.dims = inputs
        ctx.save_for_backward(g, x, norm)

    @staticmethod
    def backward(ctx: Any, w: torch.Tensor) -> tuple[Any, ...]:
        g, x, norm = ctx.saved_tensors
        ord, dims = ctx.ord, ctx.dims
        zero = norm == 0
        safe = torch.where(zero, 1.0, norm)
        u, slope = _slope(x, safe, ord)
        along = (slope * w).sum(dims, keepdim=True)
        moving = zero & (w != 0).any(dims, keepdim=True)
        if ord == 1:  # (sign's derivative: 0 off the kinks)
            return along, torch.zeros_like(w).masked_fill(moving, math.nan), None, None, None
        curvature = w if ord == 2 else u.abs().pow(ord - 2) * w
        derivative = (curvature - slope * along) * (g * (ord - 1) / safe)
        if ord != 2:  # (at a zero vector, 0 ** (ord - 2) times w: 0 for 0, where ord < 2 NaN)
            derivative = derivative.masked_fill(zero, 0.0)
        # (ord = 2: g w there, 0 where the vector does not move)
        return along, derivative.masked_fill(moving, math.nan), None, None, None


def _slope(x: torch.Tensor, safe: torch.Tensor, ord: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``u = x / safe`` (``safe``: the norm, 1 at a zero vector) and the slope ``sign(u) |u| **
    (ord - 1)``, 0 at a zero vector as it comes (0, its sign or a power of it)."""
    u = x / safe
    return u, u.sign() if ord == 1 else u if ord == 2 else u.sign() * u.abs().pow(ord - 1)


def pulled_back(g: torch.Tensor, x: torch.Tensor, norm: torch.Tensor, ord: float,
                dims: tuple[int, ...]) -> torch.Tensor:  # fmt: skip
    """:class:`_PulledBack` of ``g`` and ``x`` (x's shape), in float32 at least, from ``norm``
    (the forward's, its reduced dims kept, as ``g``'s)."""
    work = torch.promote_types(torch.promote_types(x.dtype, norm.dtype), torch.float32)
    pulled = _PulledBack.apply(  # type: ignore[no-untyped-call]
        g.to(work), x.to(work), norm.detach().to(work), ord, dims
    )
    return cast(torch.Tensor, pulled)


Hook = Callable[[tuple[Any, ...], tuple[Any, ...]], tuple[Any, ...]]
"""Autograd's node hook: ``(grad_inputs, grad_outputs) -> grad_inputs``."""


def vector_norm_backward(node: Any) -> Hook | None:
    """For autograd's node of a vector norm (``LinalgVectorNormBackward0``: ``Tensor.norm``,
    ``torch.norm``, ``linalg.norm`` of a vector, ``F.normalize``; ``1 < ord < inf``, floating),
    a hook that returns, in a pass that is differentiated again, the incoming gradient times
    the slope written out (:class:`_PulledBack`); None for other orders and complex input,
    which keep torch's. Raises ``RuntimeError`` where a backward freed the node's saved
    tensors."""
    x, ord = node._saved_self, node._saved_ord
    if not (x.is_floating_point() and x.numel() and 1 < ord < math.inf):
        return None
    dims = _signed_dims(node._saved_dim, x.ndim)
    keepdim, result = node._saved_keepdim, node._saved_result.detach()  # (not the node itself:
    # a hook holding it, or its output, was a reference cycle through the graph)

    def backward(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> tuple[Any, ...]:
        (g,) = grad_outputs
        if g is None or grad_inputs[0] is None or not torch.is_grad_enabled():
            return grad_inputs  # (a pass not differentiated again: torch's first derivative)
        norm = result
        if not keepdim:
            for dim in sorted(dims):
                g, norm = g.unsqueeze(dim), norm.unsqueeze(dim)
        return (pulled_back(g, x, norm, ord, dims).to(x.dtype),)

    return backward


def cdist_backward(node: Any) -> Hook | None:
    """For autograd's node of a ``cdist`` (``CdistBackward0``; ``p`` 0, or ``1 <= p < inf``),
    a hook that returns its gradients written out as :func:`vector_norm_backward`'s, from the
    differences (constant for ``p = 0``); None for other ``p``, which keep torch's (no second
    derivative). Raises ``RuntimeError`` where a backward freed the node's saved tensors."""
    x1, x2, p = node._saved_x1, node._saved_x2, node._saved_p
    if not (x1.is_floating_point() and (p == 0 or 1 <= p < math.inf)):
        return None

    def backward(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> tuple[Any, ...]:
        (g,) = grad_outputs
        if g is None:
            return grad_inputs
        if p == 0:  # a count of differing entries: constant
            return tuple(None if d is None else torch.zeros_like(d) for d in grad_inputs)
        if not torch.is_grad_enabled():  # a pass not differentiated again
            return grad_inputs
        differences = x1.unsqueeze(-2) - x2.unsqueeze(-3)
        # from the differences, not cdist's result: for p = 2 past 25 points it takes a matrix
        # product, whose self-distances are a rounding's square root, not 0
        norm = torch.linalg.vector_norm(differences.detach(), p, -1, keepdim=True)
        pulled = pulled_back(g.unsqueeze(-1), differences, norm, p, (-1,))
        written = ((pulled.sum(-2), x1), (-pulled.sum(-3), x2))
        return tuple(None if d is None else w.sum_to_size(x.shape).to(x.dtype)
                     for d, (w, x) in zip(grad_inputs, written, strict=True))  # fmt: skip

    return backward


def _signed_dims(saved: tuple[int, ...] | None, ndim: int) -> tuple[int, ...]:
    """A node's saved reduction dims, in ``[0, ndim)``: every dim for None or ``()``; autograd
    reads negative ones back as unsigned 64-bit integers."""
    if not saved:
        return tuple(range(ndim))
    return tuple((d - 2**64 if d >= 2**63 else d) % max(ndim, 1) for d in saved)
