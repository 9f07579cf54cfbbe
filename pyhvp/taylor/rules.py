"""Second-order Taylor rules for aten ops: how value, first- and second-order coefficients pass
through one op.

A tensor that depends on ``x`` is a :class:`Jet`; one that does not stays a plain tensor (a
constant: no coefficients are stored or computed for it). Coefficients are *tangent-like*
tensors: a leading axis (the ``K`` directions, or size 1) followed by the value's dims, where any
dim may have size 1 while the value's is larger -- the coefficient is then the same along that dim
(**broadcast-shaped**). Directions shared by every instance enter as ``(K, 1, ..., 1, *event)``,
so ``W e_i`` of a first linear layer is computed once, not once per instance; each rule keeps a
size-1 dim where that is exact and expands it (a free view) where the op needs the full dim.

Second order comes in two modes (:class:`Context`): *per direction* (``d^2/dt^2 f(x + t u_k)`` for
every k, leading axis K: Hessian diagonals) and *collapsed* (the sum over k, leading axis 1:
Laplacians and traces). Rules are written once for both: they combine first-order coefficients
only through :meth:`Context.product` and :meth:`Context.pair`.

Rules: dedicated ones for the common families (elementwise functions by their first and second
derivatives, products by Leibniz, matrix products, views, reductions, indexing, softmax,
logsumexp, norms, cdist, det and kin); every other op falls back to rules built from
``torch.func`` on that op alone -- elementwise ops (``Tag.pointwise``) by their elementwise
derivatives, all others by ``jvp`` and ``jvp`` of ``jvp`` along each direction, or by the op's
Jacobian and Hessian in reverse mode where PyTorch's nested forward mode cannot be trusted (one
matrix at a time for batched ``torch.linalg`` ops) -- so a real op is not unsupported, only
slower. Complex intermediates are refused (:func:`apply`): their jets would need complex
coefficients, which no rule carries.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.func import grad, jacrev, jvp, vmap
from torch.utils import _pytree as pytree

aten = torch.ops.aten
Tensor = torch.Tensor


@dataclass(frozen=True)
class Scaled:
    """First-order coefficients kept as the product ``scale * base``.

    ``scale`` broadcasts to the value's shape (no leading axis: an elementwise derivative),
    ``base`` is a coefficient ``(K, *S)`` that is shared (size 1) along dims where ``scale``
    varies -- directions shared by every instance, after an elementwise function. Multiplied out
    it is K times the value's size; kept factored, its square is ``scale^2 * square(base)``, a
    following linear layer is one wide matrix product and a sum is one matrix product.
    """

    scale: Tensor
    base: Tensor

    def dense(self) -> Tensor:
        return times(lifted(self.base, self.scale.ndim), self.scale)


@dataclass(frozen=True)
class Jet:
    """A value and its Taylor coefficients along K directions.

    ``coefficient``: first order, ``(K, *S)`` with ``S`` broadcastable to ``value.shape`` (same
    number of dims), or kept factored (:class:`Scaled`); :attr:`first` multiplies it out.
    ``second``: ``(K, *S)`` per direction or ``(1, *S)`` collapsed, ``None`` when it is zero.
    """

    value: Tensor
    coefficient: Tensor | Scaled
    second: Tensor | None

    @functools.cached_property
    def first(self) -> Tensor:
        c = self.coefficient
        return c if isinstance(c, Tensor) else c.dense()


@dataclass(frozen=True)
class Context:
    """The second-order mode: per direction (``collapsed=False``) or summed over directions."""

    collapsed: bool

    def product(self, a: Tensor, b: Tensor) -> Tensor:
        """The second-order term ``a_k * b_k`` of two first-order coefficients (summed over k
        when collapsed)."""
        out = a * b
        return out.sum(0, keepdim=True) if self.collapsed else out

    def square(self, a: Tensor) -> Tensor:
        return self.product(a, a)

    def pair(self, op: Callable[[Tensor, Tensor], Tensor], a: Tensor, b: Tensor) -> Tensor:
        """``op(a_k, b_k)`` for a bilinear ``op`` that broadcasts the leading axis (summed over
        k when collapsed)."""
        out = op(a, b)
        return out.sum(0, keepdim=True) if self.collapsed else out


Rule = Callable[..., Any]
RULES: dict[torch._ops.OpOverload, Rule] = {}


def rule(*ops: torch._ops.OpOverload) -> Callable[[Rule], Rule]:
    """Register ``fn(ctx, out, *args, **kwargs)`` for ``ops``: ``out`` is the op's value, args
    hold :class:`Jet` where the op's input depends on x; it returns the output jet(s)."""

    def register(fn: Rule) -> Rule:
        for op in ops:
            RULES[op] = fn
        return fn

    return register


# --- applying an op to jets ---------------------------------------------------------------------


def value_of(arg: object) -> object:
    return arg.value if isinstance(arg, Jet) else arg


@torch.library.custom_op("pyhvp::stop_gradient", mutates_args=())
def stop_gradient(t: Tensor) -> Tensor:
    """What ``f``'s own ``detach()`` becomes in a program: functionalization emits ``detach``
    as a plain alias, so ``f``'s stop-gradients are renamed before it runs (:mod:`.program`)."""
    return t.clone()


@stop_gradient.register_fake
def _(t: Tensor) -> Tensor:
    return torch.empty_like(t)


def apply(ctx: Context, op: Callable[..., Any], *args: object, **kwargs: object) -> Any:
    """``op`` on the values, and its rule on the coefficients when an input is a jet."""
    if op is STOP_GRADIENT:  # the value, as a constant
        return value_of(args[0]).detach()
    out = op(*pytree.tree_map(value_of, args), **pytree.tree_map(value_of, kwargs))
    if not any(isinstance(a, Jet) for a in pytree.tree_leaves((args, kwargs))):
        return out
    results = [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor)]
    complex_result = next((t for t in results if t.is_complex()), None)
    if complex_result is not None:
        raise TypeError(
            f"complex intermediates are not supported by the Taylor engine (pyhvp.laplacian, "
            f"grad_and_laplacian, hessian_diagonal's exact method): f computes a "
            f"{complex_result.dtype} tensor from x ({op}), whose jets would need complex "
            f"coefficients. Write f in real arithmetic (real and imaginary parts as real "
            f"tensors), or, for one scalar per instance, use an estimator built on "
            f"Hessian-vector products: laplacian(..., method='hutch++'), "
            f"hessian_diagonal(..., method='hutchinson' or 'diag++')"
        )
    if not any(t.is_floating_point() for t in results):
        return out  # integer or boolean results do not vary smoothly with x
    if op in ZERO_DERIVATIVE:
        return out
    if op in RULES:
        return RULES[op](ctx, out, *args, **kwargs)
    if torch.Tag.pointwise in getattr(op, "tags", ()):
        return pointwise_fallback(ctx, op, out, args, kwargs)
    return general_fallback(ctx, op, out, args, kwargs)


ZERO_DERIVATIVE = {
    aten.sign.default,
    aten.sgn.default,
    aten.floor.default,
    aten.ceil.default,
    aten.round.default,
    aten.round.decimals,
    aten.trunc.default,
    aten.bernoulli.default,
    aten.bernoulli.p,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.rand_like.default,
    aten.randn_like.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_empty.default,
    aten.new_full.default,
    aten.fill.Scalar,
}
"""Ops whose floating output is locally constant in their inputs (or ignores their values)."""


# --- tangent-like tensors -------------------------------------------------------------------------


def lifted(t: Tensor, ndim: int) -> Tensor:
    """``t`` (leading axis + dims) with unit dims inserted after the leading axis up to
    ``1 + ndim`` dims: aligned for broadcasting against a value of ``ndim`` dims."""
    missing = ndim + 1 - t.ndim
    return t[(slice(None), *(None,) * missing)] if missing else t


def expanded(t: Tensor, shape: Sequence[int], dims: Sequence[int] | None = None) -> Tensor:
    """``t`` with its broadcast dims (all, or those in ``dims``) expanded to ``shape`` (a view)."""
    sizes = list(t.shape)
    for d in range(len(shape)) if dims is None else dims:
        sizes[d + 1] = shape[d]
    return t.expand(sizes)


def plus(*terms: Tensor | None) -> Tensor | None:
    """Sum of the terms that are not None (None: zero); None when all are."""
    present = [t for t in terms if t is not None]
    if not present:
        return None
    total = present[0]
    for t in present[1:]:
        total = total + t
    return total


def scaled(t: Tensor | None, c: object) -> Tensor | None:
    return None if t is None else t * c


def linear(out: Tensor, u: Jet, fn: Callable[[Tensor], Tensor]) -> Jet:
    """An op linear in its jet input: ``fn`` maps coefficients (leading axis kept)."""
    return Jet(out, fn(u.first), None if u.second is None else fn(u.second))


def rearrange(out: Tensor, u: Jet, fn: Callable[[Tensor], Tensor]) -> Jet:
    """An op that only moves, selects or repeats elements (a view, an index): ``fn`` commutes
    with elementwise products, so a :class:`Scaled` coefficient stays factored."""
    c = u.coefficient
    if isinstance(c, Scaled):
        full = c.scale.expand(u.value.shape)[None]  # the leading axis fn expects
        first: Tensor | Scaled = Scaled(fn(full)[0], fn(lifted(c.base, u.value.ndim)))
    else:
        first = fn(c)
    return Jet(out, first, None if u.second is None else fn(u.second))


def scaled_by(u: Jet, d: Tensor, ndim: int) -> Tensor | Scaled:
    """``u``'s first-order coefficient times an elementwise factor ``d`` (broadcasting to the
    ``ndim``-dim result): kept factored where the coefficient is shared along a dim where ``d``
    varies (multiplying out would make it K times the value's size)."""
    c = u.coefficient
    if isinstance(c, Scaled):
        return Scaled(c.scale * d, lifted(c.base, ndim))
    t = lifted(c, ndim)
    shape = (1,) * (ndim - d.ndim) + tuple(d.shape)
    if any(t.shape[i + 1] == 1 and n > 1 for i, n in enumerate(shape)):
        return Scaled(d.reshape(shape), t)
    return times(t, d)


def squared(ctx: Context, u: Jet, ndim: int) -> Tensor:
    """``ctx.square`` of ``u``'s first-order coefficient, lifted to ``ndim`` dims."""
    c = u.coefficient
    if isinstance(c, Scaled):
        return times(lifted(ctx.square(lifted(c.base, c.scale.ndim)), ndim), c.scale * c.scale)
    return ctx.square(lifted(c, ndim))


def times(t: Tensor, c: object) -> Tensor:
    """``t * c`` for a coefficient ``t``, expanded to the broadcast shape first: eagerly, torch
    picks a slow output layout when both operands broadcast along different dims (a
    (16, 1, 64) * (1024, 64) product took 1.37 ms, 0.07 ms once expanded)."""
    if isinstance(c, Tensor):
        t = t.expand(torch.broadcast_shapes(t.shape, c.shape))
    return t * c


def chain(ctx: Context, out: Tensor, u: Jet, d1: Tensor, d2: Tensor | None) -> Jet:
    """An elementwise ``y = g(u)`` with ``d1 = g'(u)``, ``d2 = g''(u)`` (None: zero)."""
    second = plus(
        None if u.second is None else times(lifted(u.second, d1.ndim), d1),
        None if d2 is None else times(squared(ctx, u, d2.ndim), d2),
    )
    return Jet(out, scaled_by(u, d1, d1.ndim), second)


def _dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


def _dims(dims: object, ndim: int) -> list[int]:
    """Normalised reduction dims; None or [] mean all."""
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({_dim(d, ndim) for d in dims})


def _broadcast(t: Tensor, shape: Sequence[int]) -> list[int]:
    """Value dims along which the coefficient ``t`` is broadcast (size 1, value larger)."""
    return [d for d, n in enumerate(shape) if t.shape[d + 1] == 1 and n != 1]


# --- elementwise functions: y = g(u) by g' and g'' ---------------------------------------------


def _unary(derivatives: Callable[..., tuple[Tensor, Tensor | None]]) -> Rule:
    """The rule of an elementwise op whose only tensor input is the first."""

    def unary_rule(ctx: Context, out: Tensor, u: Jet, *args: object, **kwargs: object) -> Jet:
        d1, d2 = derivatives(u.value, out, *args, **kwargs)
        return chain(ctx, out, u, d1, d2)

    return unary_rule


SQRT_2PI = math.sqrt(2 * math.pi)
UNARY: dict[torch._ops.OpOverload, Callable[..., tuple[Tensor, Tensor | None]]] = {
    aten.exp.default: lambda u, y: (y, y),
    aten.exp2.default: lambda u, y: (y * math.log(2), y * math.log(2) ** 2),
    aten.expm1.default: lambda u, y: (y + 1, y + 1),
    aten.log.default: lambda u, y: (1 / u, -1 / (u * u)),
    aten.log2.default: lambda u, y: (1 / (u * math.log(2)), -1 / (u * u * math.log(2))),
    aten.log10.default: lambda u, y: (1 / (u * math.log(10)), -1 / (u * u * math.log(10))),
    aten.log1p.default: lambda u, y: (1 / (1 + u), -1 / ((1 + u) * (1 + u))),
    aten.sqrt.default: lambda u, y: (0.5 / y, -0.25 / (y * y * y)),
    aten.rsqrt.default: lambda u, y: (-0.5 * y**3, 0.75 * y**5),
    aten.reciprocal.default: lambda u, y: (-y * y, 2 * y * y * y),
    aten.sin.default: lambda u, y: (torch.cos(u), -y),
    aten.cos.default: lambda u, y: (-torch.sin(u), -y),
    aten.tan.default: lambda u, y: (1 + y * y, 2 * y * (1 + y * y)),
    aten.tanh.default: lambda u, y: (1 - y * y, -2 * y * (1 - y * y)),
    aten.sigmoid.default: lambda u, y: (y * (1 - y), y * (1 - y) * (1 - 2 * y)),
    aten.sinh.default: lambda u, y: (torch.cosh(u), y),
    aten.cosh.default: lambda u, y: (torch.sinh(u), y),
    aten.atan.default: lambda u, y: (1 / (1 + u * u), -2 * u / (1 + u * u) ** 2),
    aten.asinh.default: lambda u, y: ((1 + u * u).rsqrt(), -u * (1 + u * u).rsqrt() ** 3),
    aten.atanh.default: lambda u, y: (1 / (1 - u * u), 2 * u / (1 - u * u) ** 2),
    aten.erf.default: lambda u, y: (
        2 / math.sqrt(math.pi) * torch.exp(-u * u),
        -4 / math.sqrt(math.pi) * u * torch.exp(-u * u),
    ),
    aten.abs.default: lambda u, y: (torch.sign(u), None),
    aten.relu.default: lambda u, y: ((u > 0).to(u.dtype), None),
    aten.silu.default: lambda u, y: _silu(u),
    aten.gelu.default: lambda u, y, approximate="none": _gelu(u, approximate),
    aten.softplus.default: lambda u, y, beta=1, threshold=20: _softplus(u, beta, threshold),
    aten.leaky_relu.default: lambda u, y, slope=0.01: (torch.where(u > 0, 1.0, slope).to(u), None),
    aten.elu.default: lambda u, y, alpha=1, scale=1, input_scale=1: _elu(
        u, alpha, scale, input_scale
    ),
    aten.hardtanh.default: lambda u, y, lo=-1, hi=1: (((u > lo) & (u < hi)).to(u.dtype), None),
    aten.clamp.default: lambda u, y, lo=None, hi=None: (_inside(u, lo, hi), None),
    aten.clamp_min.default: lambda u, y, lo: (_inside(u, lo, None), None),
    aten.clamp_max.default: lambda u, y, hi: (_inside(u, None, hi), None),
    aten.pow.Tensor_Scalar: lambda u, y, p: _power(u, p),
}


def _silu(u: Tensor) -> tuple[Tensor, Tensor]:
    s = torch.sigmoid(u)
    return s * (1 + u * (1 - s)), s * (1 - s) * (2 + u * (1 - 2 * s))


def _gelu(u: Tensor, approximate: str) -> tuple[Tensor, Tensor]:
    if approximate == "tanh":  # 0.5 u (1 + tanh(c (u + 0.044715 u^3)))
        c = math.sqrt(2 / math.pi)
        z = c * (u + 0.044715 * u**3)
        dz, ddz = c * (1 + 3 * 0.044715 * u * u), c * 6 * 0.044715 * u
        t = torch.tanh(z)
        dt = 1 - t * t
        d1 = 0.5 * (1 + t) + 0.5 * u * dt * dz
        d2 = dt * dz + 0.5 * u * (-2 * t * dt * dz * dz + dt * ddz)
        return d1, d2
    phi = torch.exp(-0.5 * u * u) / SQRT_2PI
    return 0.5 * (1 + torch.erf(u / math.sqrt(2))) + u * phi, phi * (2 - u * u)


def _softplus(u: Tensor, beta: float, threshold: float) -> tuple[Tensor, Tensor]:
    s = torch.sigmoid(beta * u)
    linear_part = beta * u > threshold  # torch returns u there
    return torch.where(linear_part, 1.0, s), torch.where(linear_part, 0.0, beta * s * (1 - s))


def _elu(u: Tensor, alpha: float, scale: float, input_scale: float) -> tuple[Tensor, Tensor]:
    negative = scale * alpha * input_scale * torch.exp(input_scale * u)
    return (
        torch.where(u > 0, scale, negative),
        torch.where(u > 0, 0.0, negative * input_scale),
    )


def _inside(u: Tensor, lo: object, hi: object) -> Tensor:
    """clamp's derivative: 1 where min <= u <= max (autograd's convention at the bounds)."""
    mask = torch.ones_like(u, dtype=torch.bool)
    if lo is not None:
        mask = mask & (u >= lo)
    if hi is not None:
        mask = mask & (u <= hi)
    return mask.to(u.dtype)


def _power(u: Tensor, p: float) -> tuple[Tensor, Tensor | None]:
    if p == 0:
        return torch.zeros_like(u), None
    if p == 1:
        return torch.ones_like(u), None
    if p == 2:
        return 2 * u, torch.full_like(u, 2)
    return p * u ** (p - 1), p * (p - 1) * u ** (p - 2)


for _op, _derivatives in UNARY.items():
    RULES[_op] = _unary(_derivatives)


@rule(aten.pow.Scalar)
def _scalar_power(ctx: Context, out: Tensor, base: float, u: Jet) -> Jet:
    """``base ** u``: ``out log(base)`` and ``out log(base)^2``. Autograd's conventions where
    the logarithm is not finite: a zero base has zero derivatives where ``u >= 0`` (infinite
    ones where ``u < 0``), a negative base NaN ones (``log`` of a negative number)."""
    if base > 0:
        log_base = math.log(base)
        return chain(ctx, out, u, out * log_base, out * log_base**2)
    if base < 0:
        return chain(ctx, out, u, out * math.nan, out * math.nan)
    flat = u.value >= 0
    return chain(ctx, out, u, torch.where(flat, 0.0, out * -math.inf),
                 torch.where(flat, 0.0, out * math.inf))  # fmt: skip


# --- arithmetic -------------------------------------------------------------------------------------


def _coefficient_of(arg: object, ndim: int, order: int) -> Tensor | None:
    if not isinstance(arg, Jet):
        return None
    t = arg.first if order == 1 else arg.second
    return None if t is None else lifted(t, ndim)


def _signed_sum(out: Tensor, a: object, b: object, ca: float, cb: float) -> Jet:
    """``ca * a + cb * b``."""
    nd = out.ndim
    orders = []
    for order in (1, 2):
        ta, tb = _coefficient_of(a, nd, order), _coefficient_of(b, nd, order)
        orders.append(plus(scaled(ta, ca) if ca != 1 else ta, scaled(tb, cb) if cb != 1 else tb))
    return Jet(out, orders[0], orders[1])


@rule(aten.sub.Tensor, aten.sub.Scalar)
def _sub(ctx: Context, out: Tensor, a: object, b: object, alpha: float = 1) -> Jet:
    return _signed_sum(out, a, b, 1, -alpha)


@rule(aten.rsub.Tensor, aten.rsub.Scalar)
def _rsub(ctx: Context, out: Tensor, a: object, b: object, alpha: float = 1) -> Jet:
    return _signed_sum(out, a, b, -alpha, 1)


@rule(aten.add.Tensor, aten.add.Scalar)
def _add(ctx: Context, out: Tensor, a: object, b: object, alpha: float = 1) -> Jet:
    return _signed_sum(out, a, b, 1, alpha)


@rule(aten.neg.default)
def _neg(ctx: Context, out: Tensor, u: Jet) -> Jet:
    c = u.coefficient
    first = Scaled(-c.scale, c.base) if isinstance(c, Scaled) else -c
    return Jet(out, first, None if u.second is None else -u.second)


@rule(aten.mul.Tensor, aten.mul.Scalar)
def _mul(ctx: Context, out: Tensor, a: object, b: object) -> Jet:
    jet, other = (a, b) if isinstance(a, Jet) else (b, a)
    if not isinstance(other, Jet) and isinstance(jet.coefficient, Scaled):  # stays factored
        c = jet.coefficient
        second = None if jet.second is None else times(lifted(jet.second, out.ndim), other)
        return Jet(out, Scaled(c.scale * other, lifted(c.base, out.ndim)), second)
    return bilinear(ctx, out, a, b, times)


def swap(op: Callable[[Any, Any], Tensor]) -> Callable[[Any, Any], Tensor]:
    """``op`` with its arguments given the other way round (``times`` commutes)."""
    return op if op is times else lambda b, a: op(a, b)


def bilinear(
    ctx: Context, out: Tensor, a: object, b: object, op: Callable[[Any, Any], Tensor]
) -> Jet:
    """Leibniz for an op bilinear in (a, b) that broadcasts a leading axis:
    ``(ab)' = a'b + ab'``, ``(ab)'' = a''b + 2 a'b' + ab''``."""
    nd = out.ndim
    va, vb = value_of(a), value_of(b)
    fa, fb = _coefficient_of(a, nd, 1), _coefficient_of(b, nd, 1)
    sa, sb = _coefficient_of(a, nd, 2), _coefficient_of(b, nd, 2)
    # coefficients first (see times): a' b and b' a, then a'' b and b'' a
    first = plus(None if fa is None else op(fa, vb), None if fb is None else swap(op)(fb, va))
    cross = None if fa is None or fb is None else 2 * ctx.pair(op, fa, fb)
    second = plus(
        None if sa is None else op(sa, vb), None if sb is None else swap(op)(sb, va), cross
    )
    return Jet(out, first, second)


@rule(aten.div.Tensor, aten.div.Scalar)
def _div(ctx: Context, out: Tensor, a: object, b: object) -> Jet:
    if not isinstance(b, Jet):
        return bilinear(ctx, out, a, b, operator.truediv)
    return bilinear(ctx, out, a, apply(ctx, aten.reciprocal.default, b), times)


@rule(aten.pow.Tensor_Tensor)
def _tensor_power(ctx: Context, out: Tensor, base: object, exponent: object) -> Jet:
    """``base ** exponent``, masked like autograd's ``pow_backward``: a constant exponent ``b``
    gives ``b u^(b-1)`` except 0 where ``b == 0`` and ``b (b-1) u^(b-2)`` except 0 where ``b`` is
    0 or 1 (``0 * inf`` at ``u = 0`` otherwise); a constant zero base has zero derivatives where
    the exponent is >= 0."""
    if not isinstance(exponent, Jet):
        b, u = exponent, base.value
        d1 = torch.where(b == 0, 0.0, b * u ** (b - 1))
        d2 = torch.where((b == 0) | (b == 1), 0.0, b * (b - 1) * u ** (b - 2))
        return chain(ctx, out, base, d1, d2)
    if not isinstance(base, Jet):  # exponent e: out log(base), out log(base)^2
        log_base = torch.log(base)
        flat = (base == 0) & (exponent.value >= 0)
        d1 = torch.where(flat, 0.0, out * log_base)
        return chain(ctx, out, exponent, d1, torch.where(flat, 0.0, d1 * log_base))
    log_base = apply(ctx, aten.log.default, base)  # base^e = exp(e log base)
    exponent_jet = apply(ctx, aten.mul.Tensor, exponent, log_base)
    return chain(ctx, out, exponent_jet, out, out)


@rule(aten.where.self)
def _where(ctx: Context, out: Tensor, condition: Tensor, a: object, b: object) -> Jet:
    nd = out.ndim

    def select(order: int) -> Tensor | None:
        ta, tb = _coefficient_of(a, nd, order), _coefficient_of(b, nd, order)
        if ta is None and tb is None:
            return None
        zero = (ta if ta is not None else tb).new_zeros(())
        return torch.where(condition, zero if ta is None else ta, zero if tb is None else tb)

    return Jet(out, select(1), select(2))


@rule(aten.masked_fill.Scalar)
def _masked_fill(ctx: Context, out: Tensor, u: Jet, mask: Tensor, value: float) -> Jet:
    return linear(out, u, lambda t: torch.where(mask, t.new_zeros(()), t))


@rule(aten.native_dropout.default)
def _dropout(ctx: Context, out: tuple, u: Jet, p: float, train: bool | None) -> tuple:
    value, mask = out
    if not train:
        return Jet(value, u.first, u.second), mask
    scale = mask.to(value.dtype) / (1 - p)
    return linear(value, u, lambda t: t * scale), mask


# --- matrix products ----------------------------------------------------------------------------


def _matmul_jet(ctx: Context, out: Tensor, a: object, b: object) -> Jet:
    """``a @ b`` for a (..., p, q), b (..., q, r): coefficients keep their broadcast dims except
    the contracted one, so a first layer applied to shared directions runs once."""
    nd = out.ndim
    q_a = value_of(a).ndim - 1  # a's contracted dim (value dims)
    q_b = value_of(b).ndim - 2

    def contracted(arg: object, order: int, dim: int) -> Tensor | None:
        t = _coefficient_of(arg, value_of(arg).ndim, order)
        # lifted to the result's dims: an operand with fewer batch dims broadcasts (solve)
        return None if t is None else lifted(expanded(t, value_of(arg).shape, [dim]), nd)

    va, vb = value_of(a), value_of(b)
    sa, sb = contracted(a, 2, q_a), contracted(b, 2, q_b)
    first = _factored_matmul(a, b)
    cross = None
    if first is None:
        fa, fb = contracted(a, 1, q_a), contracted(b, 1, q_b)
        first = plus(None if fa is None else fa @ vb, None if fb is None else va @ fb)
        cross = None if fa is None or fb is None else 2 * ctx.pair(operator.matmul, fa, fb)
    second = plus(None if sa is None else sa @ vb, None if sb is None else va @ sb, cross)
    return Jet(out, lifted(first, nd), None if second is None else lifted(second, nd))


def _factored_matmul(a: object, b: object) -> Tensor | None:
    """The first-order coefficient of ``a @ b`` when one operand is a jet with a :class:`Scaled`
    coefficient whose base is shared along every dim but the contracted one, and the other a
    matrix: ``(s * v_k) @ W = s @ (v_k W)`` for all k in ONE wide product -- 2.2x faster on this
    CPU than K skinny ones (a (1024, 64) @ (64, 1024) against (16384, 64) @ (64, 64)), and the
    K-fold product ``s * v_k`` is never formed. None otherwise."""
    if isinstance(a, Jet) == isinstance(b, Jet):
        return None
    left = isinstance(a, Jet)
    jet, weight = (a, value_of(b)) if left else (b, value_of(a))
    c = jet.coefficient
    if not isinstance(c, Scaled) or weight.ndim != 2:
        return None
    shape = jet.value.shape
    contracted = len(shape) - 1 if left else len(shape) - 2
    base = lifted(c.base, len(shape))
    if any(base.shape[d + 1] != 1 for d in range(len(shape)) if d != contracted):
        return None
    k, q = base.shape[0], shape[contracted]
    vectors = expanded(base, shape, [contracted]).reshape(k, q)  # v_k
    scale = c.scale.expand(shape)
    if left:  # scale (..., p, q) @ [v_k W] (q, K r) -> (..., p, K, r)
        r = weight.shape[1]
        stacked = (vectors[:, :, None] * weight).permute(1, 0, 2).reshape(q, k * r)
        # K-major again (one copy): later products fold (K * ..., r) into one matrix product
        return (scale @ stacked).reshape(*shape[:-1], k, r).movedim(-2, 0).contiguous()
    p = weight.shape[0]  # [W v_k] (K p, q) @ scale (..., q, r) -> (..., K, p, r)
    stacked = (weight * vectors[:, None, :]).reshape(k * p, q)
    return (stacked @ scale).reshape(*shape[:-2], k, p, shape[-1]).movedim(-3, 0).contiguous()


@rule(aten.mm.default, aten.bmm.default)
def _mm(ctx: Context, out: Tensor, a: object, b: object) -> Jet:
    return _matmul_jet(ctx, out, a, b)


@rule(aten.addmm.default, aten.baddbmm.default)
def _addmm(
    ctx: Context, out: Tensor, bias: object, a: object, b: object, beta: float = 1, alpha: float = 1
) -> Jet:
    product = _matmul_jet(ctx, out, a, b) if isinstance(a, Jet) or isinstance(b, Jet) else None
    bias_part = bias if isinstance(bias, Jet) and beta != 0 else None
    nd = out.ndim
    orders = []
    for order in (1, 2):
        p = None if product is None else (product.first if order == 1 else product.second)
        orders.append(plus(scaled(p, alpha) if alpha != 1 else p,
                           scaled(_coefficient_of(bias_part, nd, order), beta)))  # fmt: skip
    return Jet(out, orders[0], orders[1])


@rule(aten.mv.default)
def _mv(ctx: Context, out: Tensor, a: object, v: object) -> Jet:
    column = apply(ctx, aten.unsqueeze.default, v, -1)
    return apply(ctx, aten.squeeze.dim, apply(ctx, aten.mm.default, a, column), -1)


@rule(aten.dot.default)
def _dot(ctx: Context, out: Tensor, a: object, b: object) -> Jet:
    return apply(ctx, aten.sum.default, apply(ctx, aten.mul.Tensor, a, b))


# --- linear algebra (what Slater determinants and their kin need) ------------------------------


def _matrix_coefficients(u: Jet) -> tuple[Tensor, Tensor | None]:
    """First- and second-order coefficients of a matrix jet with full matrix dims."""
    shape, nd = u.value.shape, u.value.ndim
    dims = [nd - 2, nd - 1]
    second = None if u.second is None else expanded(u.second, shape, dims)
    return expanded(u.first, shape, dims), second


def _trace(m: Tensor) -> Tensor:
    return m.diagonal(dim1=-2, dim2=-1).sum(-1)


def _solved(a: Tensor, b: Tensor) -> Tensor:
    """``A^-1 B`` without raising (nor synchronising) on a singular A: non-finite there."""
    return torch.linalg.solve_ex(a, b)[0]


def _log_det_coefficients(ctx: Context, a: Jet) -> tuple[Tensor, Tensor]:
    """log|det A|: first ``tr(A^-1 T)``, second ``tr(A^-1 S) - tr(A^-1 T A^-1 T)`` (non-finite
    for a singular A, where log|det| is -inf, as autograd's)."""
    t, s = _matrix_coefficients(a)
    m = _solved(a.value, t)  # A^-1 T, one per direction
    second = -ctx.pair(operator.mul, m, m.mT).sum((-2, -1))
    if s is not None:
        second = second + _trace(_solved(a.value, s))
    return _trace(m), second


@rule(aten._linalg_det.default)
def _det(ctx: Context, out: tuple, a: Jet) -> tuple:
    """det' = det tr(A^-1 T); det'' = det (log det'' + log det'^2). Only for invertible
    instances: a record with a singular one runs :func:`singular_det` instead."""
    det = out[0]
    first, second = _log_det_coefficients(ctx, a)
    return (Jet(det, det * first, det * (second + ctx.square(first))), *out[1:])


@torch.library.custom_op("pyhvp::singular_det", mutates_args=())
def singular_det(a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``aten._linalg_det`` where some instance is singular (``det == 0``, where ``A^-1`` of
    :func:`_det`'s rule does not exist). The recorder renames the op when it sees one
    (:mod:`.program`), so the program -- keyed by the record -- runs this op's rule, which holds
    there."""
    det, lu, pivots = aten._linalg_det.default(a)
    return det, lu, pivots


@singular_det.register_fake
def _(a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return aten._linalg_det.default(a)


SINGULAR_DET = torch.ops.pyhvp.singular_det.default


@rule(SINGULAR_DET)
def _singular_det(ctx: Context, out: tuple, a: Jet) -> tuple:
    """det through the SVD ``A = U diag(s) V^T``, exact for singular A too: with ``P = U^T T V``
    and ``c_i``, ``c_ij`` the products of the singular values but the i-th (and j-th), ``det(A +
    tT) = det(U) det(V) det(diag(s) + tP)`` has first derivative ``sum_i P_ii c_i`` and second
    ``sum_{i != j} (P_ii P_jj - P_ij P_ji) c_ij`` (times ``det(U) det(V)``)."""
    t, s = _matrix_coefficients(a)
    u, sigma, vh = torch.linalg.svd(a.value)
    sign = torch.linalg.det(u) * torch.linalg.det(vh)
    n = sigma.shape[-1]
    eye = torch.eye(n, dtype=torch.bool, device=sigma.device)
    c1 = torch.where(eye, 1.0, sigma[..., None, :]).prod(-1)  # (..., n)
    skip = eye[:, None, :] | eye[None, :, :]  # (i, j, k): k is i or j
    c2 = torch.where(skip, 1.0, sigma[..., None, None, :]).prod(-1)  # (..., n, n)

    def rotated(m: Tensor) -> Tensor:
        return u.mT @ m @ vh.mT

    def diagonal(m: Tensor) -> Tensor:
        return m.diagonal(dim1=-2, dim2=-1)

    def minors(m: Tensor, w: Tensor) -> Tensor:  # P_ii W_jj - P_ij W_ji, per pair (i, j)
        return diagonal(m)[..., :, None] * diagonal(w)[..., None, :] - m * w.mT

    p = rotated(t)
    first = sign * (diagonal(p) * c1).sum(-1)
    second = sign * (ctx.pair(minors, p, p) * c2).sum((-2, -1))
    if s is not None:
        second = second + sign * (diagonal(rotated(s)) * c1).sum(-1)
    return (Jet(out[0], first, second), *out[1:])


@rule(aten._linalg_slogdet.default)
def _slogdet(ctx: Context, out: tuple, a: Jet) -> tuple:
    sign, logabsdet = out[0], out[1]
    return (sign, Jet(logabsdet, *_log_det_coefficients(ctx, a)), *out[2:])


@rule(aten.linalg_inv_ex.default)
def _inverse(ctx: Context, out: tuple, a: Jet, check_errors: bool = False) -> tuple:
    """B = A^-1: B' = -B T B; B'' = 2 B T B T B - B S B."""
    b = out[0]
    t, s = _matrix_coefficients(a)
    bt = b @ t
    second = 2 * ctx.pair(operator.matmul, bt, bt) @ b
    if s is not None:
        second = second - b @ s @ b
    return Jet(b, -bt @ b, second), out[1]


@rule(aten._linalg_solve_ex.default)
def _solve(ctx: Context, out: tuple, a: object, b: object, left: bool = True,
           check_errors: bool = False) -> tuple:  # fmt: skip
    """X = A^-1 B (left) or B A^-1, as the product of the inverse's jet with B's."""
    inverse = apply(ctx, aten.linalg_inv_ex.default, a)[0]
    va, vb = value_of(a), value_of(b)
    # torch's rule (linalg_solve_is_vector_rhs): B is a (batch of) vector(s) iff it is 1-D or
    # has exactly A's shape without its last dim
    vector = vb.ndim == 1 or tuple(vb.shape) == tuple(va.shape[:-1])
    dim = -1 if left else -2  # a column, or a row for X A = B
    rhs = apply(ctx, aten.unsqueeze.default, b, dim) if vector else b
    value = out[0].unsqueeze(dim) if vector else out[0]
    x = _matmul_jet(ctx, value, *((inverse, rhs) if left else (rhs, inverse)))
    if vector:
        x = Jet(out[0], x.first.squeeze(dim), None if x.second is None else x.second.squeeze(dim))
    return (x, *out[1:])


# --- views and copies ---------------------------------------------------------------------------


def _reshape_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Consecutive dims of ``src`` and ``dst`` that a reshape maps onto each other."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) and j < len(dst):
        gs, gd, ps, pd = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while ps != pd:
            if ps < pd:
                gs.append(i)
                ps *= src[i]
                i += 1
            else:
                gd.append(j)
                pd *= dst[j]
                j += 1
        groups.append((gs, gd))
    groups += [([k], []) for k in range(i, len(src))] + [([], [k]) for k in range(j, len(dst))]
    return groups


def reshaped(t: Tensor, src: Sequence[int], dst: Sequence[int]) -> Tensor:
    """A coefficient of a value reshaped ``src -> dst``; broadcast dims stay broadcast where
    every dim they merge with is broadcast too."""
    lead = t.shape[0]
    if tuple(t.shape[1:]) == tuple(src) or 0 in src:
        return expanded(t, src).reshape(lead, *dst)
    sizes, expand_dims = [], []
    for gs, gd in _reshape_groups(src, dst):
        wide = [d for d in gs if src[d] != 1]
        shared = [d for d in wide if t.shape[d + 1] == 1]
        if wide and len(shared) == len(wide):  # constant along the whole group
            sizes += [1] * len(gd)
        else:
            expand_dims += shared
            sizes += [dst[d] for d in gd]
    return expanded(t, src, expand_dims).reshape(lead, *sizes)


@rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.view_copy.default)
def _view(ctx: Context, out: Tensor, u: Jet, size: object) -> Jet:
    return rearrange(out, u, lambda t: reshaped(t, u.value.shape, out.shape))


@rule(aten.permute.default, aten.permute_copy.default)
def _permute(ctx: Context, out: Tensor, u: Jet, dims: Sequence[int]) -> Jet:
    nd = u.value.ndim
    order = [0, *(_dim(d, nd) + 1 for d in dims)]
    return rearrange(out, u, lambda t: t.permute(order))


@rule(aten.transpose.int, aten.transpose_copy.int)
def _transpose(ctx: Context, out: Tensor, u: Jet, d0: int, d1: int) -> Jet:
    nd = u.value.ndim
    return rearrange(out, u, lambda t: t.transpose(_dim(d0, nd) + 1, _dim(d1, nd) + 1))


@rule(aten.t.default)
def _t(ctx: Context, out: Tensor, u: Jet) -> Jet:
    return rearrange(out, u, lambda t: t.transpose(1, 2) if u.value.ndim == 2 else t)


@rule(aten.expand.default, aten.expand_copy.default)
def _expand(ctx: Context, out: Tensor, u: Jet, size: object, implicit: bool = False) -> Jet:
    return rearrange(out, u, lambda t: lifted(t, out.ndim))  # new and size-1 dims stay broadcast


@rule(aten.unsqueeze.default, aten.unsqueeze_copy.default)
def _unsqueeze(ctx: Context, out: Tensor, u: Jet, dim: int) -> Jet:
    return rearrange(out, u, lambda t: t.unsqueeze(_dim(dim, out.ndim) + 1))


@rule(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze_copy.dims)
def _squeeze(ctx: Context, out: Tensor, u: Jet, dims: object = None) -> Jet:
    nd = u.value.ndim
    unit = [d for d in _dims(dims, nd) if u.value.shape[d] == 1]
    return rearrange(out, u, lambda t: t.squeeze(tuple(d + 1 for d in unit)) if unit else t)


@rule(aten.select.int, aten.select_copy.int)
def _select(ctx: Context, out: Tensor, u: Jet, dim: int, index: int) -> Jet:
    d = _dim(dim, u.value.ndim)

    def fn(t: Tensor) -> Tensor:
        return t.select(d + 1, 0 if d in _broadcast(t, u.value.shape) else index)

    return rearrange(out, u, fn)


@rule(aten.slice.Tensor, aten.slice_copy.Tensor)
def _slice(
    ctx: Context, out: Tensor, u: Jet, dim: int = 0, start: object = None, end: object = None,
    step: int = 1,
) -> Jet:  # fmt: skip
    d = _dim(dim, u.value.ndim)

    def fn(t: Tensor) -> Tensor:
        if d in _broadcast(t, u.value.shape):
            return t
        return aten.slice.Tensor(t, d + 1, start, end, step)

    return rearrange(out, u, fn)


STOP_GRADIENT = torch.ops.pyhvp.stop_gradient.default


@torch.library.custom_op("pyhvp::with_derivatives_of", mutates_args=())
def with_derivatives_of(value: Tensor, source: Tensor) -> Tensor:
    """``value``, with ``source``'s derivatives: what a tensor written in place under
    ``no_grad`` holds (:mod:`.program`)."""
    return value.clone()


@with_derivatives_of.register_fake
def _(value: Tensor, source: Tensor) -> Tensor:
    return torch.empty_like(value)


WITH_DERIVATIVES_OF = torch.ops.pyhvp.with_derivatives_of.default


@rule(WITH_DERIVATIVES_OF)
def _with_derivatives_of(ctx: Context, out: Tensor, value: object, source: object) -> Any:
    if not isinstance(source, Jet):
        return out
    return Jet(out, source.coefficient, source.second)


@rule(aten.clone.default, aten.alias.default, aten.detach.default)  # detach: an alias here
def _identity(ctx: Context, out: Tensor, u: Jet, *args: object, **kwargs: object) -> Jet:
    return Jet(out, u.coefficient, u.second)


@rule(aten._to_copy.default)
def _to_copy(ctx: Context, out: Tensor, u: Jet, **kwargs: object) -> Jet:
    return linear(out, u, lambda t: t.to(dtype=out.dtype, device=out.device))


@rule(aten.copy.default)
def _copy(ctx: Context, out: Tensor, dst: object, src: object, non_blocking: bool = False) -> Any:
    if not isinstance(src, Jet):
        return out
    return linear(out, src, lambda t: lifted(t, out.ndim).to(out.dtype))


@rule(aten.diagonal.default, aten.diagonal_copy.default)
def _diagonal(
    ctx: Context, out: Tensor, u: Jet, offset: int = 0, dim1: int = 0, dim2: int = 1
) -> Jet:
    nd = u.value.ndim
    d1, d2 = _dim(dim1, nd), _dim(dim2, nd)

    def fn(t: Tensor) -> Tensor:
        return expanded(t, u.value.shape, [d1, d2]).diagonal(offset, d1 + 1, d2 + 1)

    return rearrange(out, u, fn)


@rule(aten.constant_pad_nd.default)
def _pad(ctx: Context, out: Tensor, u: Jet, pad: Sequence[int], value: float = 0) -> Jet:
    nd = u.value.ndim
    padded = [nd - 1 - i // 2 for i in range(len(pad))]

    def fn(t: Tensor) -> Tensor:
        return aten.constant_pad_nd.default(expanded(t, u.value.shape, padded), pad, 0.0)

    return linear(out, u, fn)


@rule(aten.as_strided_scatter.default)
def _as_strided_scatter(
    ctx: Context, out: Tensor, base: object, src: object, size: Sequence[int],
    stride: Sequence[int], storage_offset: int | None = None,
) -> Jet:  # fmt: skip
    """A write through an ``as_strided`` view (functionalized): linear in ``(base, src)``. Each
    coefficient is made contiguous, ``(L, *base.shape)``, so the direction axis is one more
    stride (``base.numel()``) of the same strided write -- when ``base`` itself is contiguous
    from offset 0, as the strides then address the same elements (vmap has no batching rule)."""
    value = value_of(base)
    if not value.is_contiguous() or value.storage_offset() != 0:
        raise RuntimeError(
            f"pyhvp: f writes through an as_strided view of a tensor of shape "
            f"{tuple(value.shape)} and strides {value.stride()} (storage offset "
            f"{value.storage_offset()}); the Taylor engine supports such writes into contiguous "
            f"tensors only. Write through ordinary views (slicing, view, select) instead"
        )
    nd = value.ndim

    def scattered(order: int) -> Tensor | None:
        cb, cs = _coefficient_of(base, nd, order), _coefficient_of(src, len(size), order)
        if cb is None and cs is None:
            return None
        lead = max(c.shape[0] for c in (cb, cs) if c is not None)
        zero = value.new_zeros(())
        cb = (zero if cb is None else cb).expand(lead, *value.shape).contiguous()
        cs = (zero if cs is None else cs).expand(lead, *size)
        return aten.as_strided_scatter.default(cb, cs, (lead, *size), (value.numel(), *stride),
                                               storage_offset)  # fmt: skip

    return Jet(out, scattered(1), scattered(2))


@rule(aten.cat.default)
def _cat(ctx: Context, out: Tensor, tensors: Sequence[object], dim: int = 0) -> Jet:
    nd = out.ndim
    d = _dim(dim, nd)
    parts = [t for t in tensors if value_of(t).numel() > 0 or value_of(t).ndim == nd]

    def join(order: int) -> Tensor | None:
        coefficients = [_coefficient_of(t, nd, order) for t in parts]
        present = [c for c in coefficients if c is not None]
        if not present:
            return None
        lead = max(c.shape[0] for c in present)
        # a dim other than ``d`` stays broadcast only if it is broadcast in every part
        sizes = [
            1 if all(c is None or c.shape[i + 1] == 1 for c in coefficients) else out.shape[i]
            for i in range(nd)
        ]
        pieces = []
        for part, c in zip(parts, coefficients, strict=True):
            shape = [lead, *sizes]
            shape[d + 1] = value_of(part).shape[d]
            pieces.append(present[0].new_zeros(()).expand(shape) if c is None else c.expand(shape))
        return torch.cat(pieces, d + 1)

    return Jet(out, join(1), join(2))


@rule(aten.stack.default)
def _stack(ctx: Context, out: Tensor, tensors: Sequence[object], dim: int = 0) -> Jet:
    d = _dim(dim, out.ndim)
    columns = [apply(ctx, aten.unsqueeze.default, t, d) for t in tensors]
    return apply(ctx, aten.cat.default, columns, d)


@rule(aten.split.Tensor, aten.split_with_sizes.default)
def _split(ctx: Context, out: Sequence[Tensor], u: Jet, sizes: object, dim: int = 0) -> list:
    d = _dim(dim, u.value.ndim)
    starts = [0]
    for piece in out:
        starts.append(starts[-1] + piece.shape[d])
    return [apply(ctx, aten.slice.Tensor, u, d, a, b) for a, b in itertools.pairwise(starts)]


@rule(aten.unbind.int)
def _unbind(ctx: Context, out: Sequence[Tensor], u: Jet, dim: int = 0) -> list:
    d = _dim(dim, u.value.ndim)
    return [apply(ctx, aten.select.int, u, d, i) for i in range(len(out))]


@rule(aten.flip.default)
def _flip(ctx: Context, out: Tensor, u: Jet, dims: Sequence[int]) -> Jet:
    nd = u.value.ndim

    def fn(t: Tensor) -> Tensor:  # flipping a broadcast (constant) dim changes nothing
        flipped = [_dim(d, nd) + 1 for d in dims if _dim(d, nd) not in _broadcast(t, u.value.shape)]
        return t.flip(flipped) if flipped else t

    return rearrange(out, u, fn)


@rule(aten.index.Tensor)
def _index(ctx: Context, out: Tensor, u: Jet, indices: Sequence[Tensor | None]) -> Jet:
    indexed = [d for d, i in enumerate(indices) if i is not None]
    if any(indices[d].dtype == torch.bool for d in indexed):  # masks: let vmap place the dims
        return linear(out, u, lambda t: vmap(lambda z: aten.index.Tensor(z, list(indices)))(
            expanded(t, u.value.shape)))  # fmt: skip
    # index tensors in non-adjacent dims put their broadcast dims first (numpy's rule), which
    # for the coefficient means before its leading axis: move that axis back to the front
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1))
    index_ndim = len(torch.broadcast_shapes(*(indices[d].shape for d in indexed)))

    def fn(t: Tensor) -> Tensor:
        result = aten.index.Tensor(expanded(t, u.value.shape, indexed), [None, *indices])
        return result if adjacent else result.movedim(index_ndim, 0)

    return rearrange(out, u, fn)


@rule(aten.index_select.default)
def _index_select(ctx: Context, out: Tensor, u: Jet, dim: int, index: Tensor) -> Jet:
    d = _dim(dim, u.value.ndim)
    return rearrange(out, u, lambda t: expanded(t, u.value.shape, [d]).index_select(d + 1, index))


@rule(aten.gather.default)
def _gather(
    ctx: Context, out: Tensor, u: Jet, dim: int, index: Tensor, sparse_grad: bool = False
) -> Jet:
    d = _dim(dim, u.value.ndim)

    def fn(t: Tensor) -> Tensor:
        return torch.gather(
            expanded(t, u.value.shape), d + 1, index.expand(t.shape[0], *index.shape)
        )

    return rearrange(out, u, fn)


# --- reductions -----------------------------------------------------------------------------------


@rule(aten.sum.dim_IntList, aten.sum.default)
def _sum(
    ctx: Context, out: Tensor, u: Jet, dim: object = None, keepdim: bool = False, *,
    dtype: torch.dtype | None = None,
) -> Jet:  # fmt: skip
    dims = _dims(dim, u.value.ndim)

    def fn(t: Tensor) -> Tensor:
        factor = math.prod(u.value.shape[d] for d in _broadcast(t, u.value.shape) if d in dims)
        summed = t.sum([d + 1 for d in dims], keepdim=keepdim) if dims else t
        return summed if factor == 1 else summed * factor

    return _reduced(out, u, fn, _factored_sum(u, dims, keepdim), dtype)


def _reduced(out: Tensor, u: Jet, fn: Callable[[Tensor], Tensor], first: Tensor | None,
             dtype: torch.dtype | None) -> Jet:  # fmt: skip
    """A reduction's jet: ``first`` when a factored coefficient gave it, else ``fn`` of it."""
    jet = Jet(out, fn(u.first) if first is None else first,
              None if u.second is None else fn(u.second))  # fmt: skip
    if dtype is None:
        return jet
    return Jet(out, jet.first.to(dtype), None if jet.second is None else jet.second.to(dtype))


def _factored_sum(u: Jet, dims: list[int], keepdim: bool) -> Tensor | None:
    """The first-order coefficient of a sum over ``dims`` when ``u``'s is :class:`Scaled` with a
    base that varies only along ``dims``: ``sum_j s[.., j] v_k[j]`` for all k is one matrix
    product, instead of forming the K-fold ``s * v_k``. None otherwise."""
    c = u.coefficient
    shape, nd = u.value.shape, u.value.ndim
    if not isinstance(c, Scaled) or not dims:
        return None
    base = lifted(c.base, nd)
    rest = [d for d in range(nd) if d not in dims]
    if any(base.shape[d + 1] != 1 for d in rest):
        return None
    k, m = base.shape[0], math.prod(shape[d] for d in dims)
    vectors = expanded(base, shape, dims).permute(0, *(d + 1 for d in rest + dims)).reshape(k, m)
    scale = c.scale.expand(shape).permute(*rest, *dims).reshape(-1, m)
    summed = (scale @ vectors.T).T.reshape(k, *(shape[d] for d in rest))
    for d in dims if keepdim else ():
        summed = summed.unsqueeze(d + 1)
    return summed


@rule(aten.mean.dim, aten.mean.default)
def _mean(
    ctx: Context, out: Tensor, u: Jet, dim: object = None, keepdim: bool = False, *,
    dtype: torch.dtype | None = None,
) -> Jet:  # fmt: skip
    dims = _dims(dim, u.value.ndim)

    def fn(t: Tensor) -> Tensor:  # the mean of a broadcast (constant) dim is that constant
        return t.mean([d + 1 for d in dims], keepdim=keepdim) if dims else t

    summed = _factored_sum(u, dims, keepdim)
    count = math.prod(u.value.shape[d] for d in dims)
    return _reduced(out, u, fn, None if summed is None else summed / count, dtype)


@rule(aten.cumsum.default)
def _cumsum(ctx: Context, out: Tensor, u: Jet, dim: int, *, dtype: object = None) -> Jet:
    d = _dim(dim, u.value.ndim)
    return linear(out, u, lambda t: expanded(t, u.value.shape, [d]).cumsum(d + 1).to(out.dtype))


def _kept(value: Tensor, shape: Sequence[int], dims: list[int]) -> Tensor:
    """A reduction's value with its reduced dims back as size 1."""
    return value.reshape([1 if d in dims else n for d, n in enumerate(shape)])


@rule(aten.amax.default, aten.amin.default)
def _amax(ctx: Context, out: Tensor, u: Jet, dim: object = (), keepdim: bool = False) -> Jet:
    dims = _dims(dim, u.value.ndim)
    # where the extremum is attained, split evenly between ties (autograd's convention)
    hits = (u.value == _kept(out, u.value.shape, dims)).to(out.dtype)
    weights = hits / hits.sum(dims, keepdim=True)
    return linear(out, u, lambda t: times(t, weights).sum([d + 1 for d in dims], keepdim=keepdim))


@rule(aten.max.default, aten.min.default)
def _max_all(ctx: Context, out: Tensor, u: Jet) -> Jet:
    return _amax(ctx, out, u, list(range(u.value.ndim)), False)


@rule(aten.max.dim, aten.min.dim)
def _max_dim(ctx: Context, out: tuple, u: Jet, dim: int, keepdim: bool = False) -> tuple:
    values, indices = out
    d = _dim(dim, u.value.ndim)
    picked = apply(ctx, aten.gather.default, u, d, indices if keepdim else indices.unsqueeze(d))
    if not keepdim:
        picked = apply(ctx, aten.squeeze.dim, picked, d)
    return Jet(values, picked.first, picked.second), indices


def _variance(root: bool) -> Rule:
    """var = sum((u - mean)^2) / (n - correction), std its root; ``*_mean`` also the mean."""

    def variance_rule(ctx: Context, out: Any, u: Jet, *args: object, **kwargs: object) -> Any:
        dim, correction, keepdim = _variance_options(*args, **kwargs)
        dims = _dims(dim, u.value.ndim)
        mean = apply(ctx, aten.mean.dim, u, dims, True)
        centred = apply(ctx, aten.sub.Tensor, u, mean)
        squares = apply(ctx, aten.mul.Tensor, centred, centred)
        count = math.prod(u.value.shape[d] for d in dims)
        spread = apply(ctx, aten.div.Tensor, apply(ctx, aten.sum.dim_IntList, squares, dims,
                                                   keepdim), max(count - correction, 0))  # fmt: skip
        if root:
            spread = apply(ctx, aten.sqrt.default, spread)
        if not isinstance(out, tuple):
            return Jet(out, spread.first, spread.second)
        if not keepdim:
            mean = apply(ctx, aten.squeeze.dims, mean, dims)
        return Jet(out[0], spread.first, spread.second), Jet(out[1], mean.first, mean.second)

    return variance_rule


def _variance_options(
    dim: object = None, unbiased: object = None, keepdim: bool = False, *,
    correction: float | None = None,
) -> tuple[object, float, bool]:  # fmt: skip
    if isinstance(dim, bool):  # var.default(self, unbiased)
        dim, unbiased = None, dim
    if correction is None:
        correction = 0 if unbiased is False else 1
    return dim, correction, keepdim


for _ops, _root in (
    ((aten.var.correction, aten.var.dim, aten.var.default, aten.var_mean.correction,
      aten.var_mean.dim), False),
    ((aten.std.correction, aten.std.dim, aten.std.default, aten.std_mean.correction,
      aten.std_mean.dim), True),
):  # fmt: skip
    rule(*_ops)(_variance(_root))


def _lse(ctx: Context, u: Jet, dims: list[int], keepdim: bool, p: Tensor) -> tuple:
    """Coefficients of log sum exp over ``dims``, ``p = softmax(u)``: first ``sum p t``, second
    ``sum p s + sum p t^2 - (sum p t)^2``."""
    shifted = [d + 1 for d in dims]
    first = times(u.first, p).sum(shifted, keepdim=keepdim)
    spread = times(ctx.square(u.first), p).sum(shifted, keepdim=keepdim) - ctx.square(first)
    own = None if u.second is None else times(u.second, p).sum(shifted, keepdim=keepdim)
    return first, plus(own, spread)


@rule(aten.logsumexp.default)
def _logsumexp(ctx: Context, out: Tensor, u: Jet, dim: object, keepdim: bool = False) -> Jet:
    dims = _dims(dim, u.value.ndim)
    p = torch.exp(u.value - _kept(out, u.value.shape, dims))
    return Jet(out, *_lse(ctx, u, dims, keepdim, p))


def _log_softmax_coefficients(ctx: Context, u: Jet, d: int, p: Tensor) -> tuple:
    """``log softmax(u) = u - logsumexp(u)`` along ``d``."""
    first, second = _lse(ctx, u, [d], True, p)
    return lifted(u.first, p.ndim) - first, plus(u.second, scaled(second, -1))


@rule(aten._log_softmax.default)
def _log_softmax(ctx: Context, out: Tensor, u: Jet, dim: int, half_to_float: bool = False) -> Jet:
    return Jet(out, *_log_softmax_coefficients(ctx, u, _dim(dim, out.ndim), torch.exp(out)))


@rule(aten._softmax.default)
def _softmax(ctx: Context, out: Tensor, u: Jet, dim: int, half_to_float: bool = False) -> Jet:
    log_p = Jet(out, *_log_softmax_coefficients(ctx, u, _dim(dim, out.ndim), out))
    return chain(ctx, out, log_p, out, out)  # softmax = exp(log softmax)


@rule(aten.linalg_vector_norm.default)
def _vector_norm(
    ctx: Context, out: Tensor, u: Jet, ord: float = 2, dim: object = None, keepdim: bool = False,
    *, dtype: torch.dtype | None = None,
) -> Any:  # fmt: skip
    if dtype is not None:
        u = apply(ctx, aten._to_copy.default, u, dtype=dtype)
    dims = _dims(dim, u.value.ndim)
    if ord == 0:
        return out
    magnitude = apply(ctx, aten.abs.default, u)
    if ord == math.inf:
        return apply(ctx, aten.amax.default, magnitude, dims, keepdim)
    if ord == -math.inf:
        return apply(ctx, aten.amin.default, magnitude, dims, keepdim)
    if ord == 1:
        return apply(ctx, aten.sum.dim_IntList, magnitude, dims, keepdim)
    base = u if ord == 2 else magnitude  # |u|^2 = u^2 is smooth at 0
    total = apply(ctx, aten.sum.dim_IntList, apply(ctx, aten.pow.Tensor_Scalar, base, ord), dims,
                  keepdim)  # fmt: skip
    norm = apply(ctx, aten.pow.Tensor_Scalar, total, 1 / ord)
    # autograd's convention: a zero norm has zero derivatives (they are unbounded there)
    zero = out == 0
    return Jet(
        out,
        torch.where(zero, 0.0, norm.first),
        None if norm.second is None else torch.where(zero, 0.0, norm.second),
    )


@rule(aten._cdist_forward.default, aten._euclidean_dist.default)
def _cdist(
    ctx: Context, out: Tensor, a: object, b: object, p: float = 2, compute_mode: object = None
) -> Any:
    rows = apply(ctx, aten.unsqueeze.default, a, -2)  # (..., P, 1, M)
    columns = apply(ctx, aten.unsqueeze.default, b, -3)  # (..., 1, R, M)
    difference = apply(ctx, aten.sub.Tensor, rows, columns)
    distance = apply(ctx, aten.linalg_vector_norm.default, difference, p, [-1])
    return Jet(out, distance.first, distance.second) if isinstance(distance, Jet) else out


# --- fallbacks built from torch.func on the op alone --------------------------------------------


def _substitute(
    op: Callable[..., Any], args: tuple, kwargs: dict
) -> tuple[Callable[..., Any], tuple[Tensor, ...], list[Jet]]:
    """``op`` as a function of its jet inputs' values (everything else fixed)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Jet)]
    jets = [leaves[i] for i in positions]
    fixed = [value_of(leaf) for leaf in leaves]

    def fn(*values: Tensor) -> Any:
        current = list(fixed)
        for i, v in zip(positions, values, strict=True):
            current[i] = v
        a, k = pytree.tree_unflatten(current, spec)
        return op(*a, **k)

    return fn, tuple(j.value for j in jets), jets


def _elementwise_derivatives(
    fn: Callable[..., Tensor], primals: tuple[Tensor, ...], shape: Sequence[int]
) -> tuple[list[Tensor], dict[tuple[int, int], Tensor]]:
    """An elementwise ``fn``'s partial derivatives ``g_i`` and ``h_ij`` (i <= j), each of the
    output's shape: reverse over reverse, or forward over forward where a double backward is
    missing (each output element depends on one element of each input)."""
    spread = tuple(p.expand(shape) for p in primals)
    every = tuple(range(len(primals)))

    def total(*p: Tensor) -> Tensor:
        return fn(*p).sum()

    try:
        gradient = list(grad(total, argnums=every)(*spread))
        hessian = {}
        for i in every:
            row = grad(lambda *p, i=i: grad(total, argnums=i)(*p).sum(), argnums=every[i:])(*spread)
            hessian.update({(i, j): h for j, h in zip(every[i:], row, strict=True)})
        return gradient, hessian
    except NotImplementedError:
        pass
    units = [tuple(torch.ones_like(p) if j == i else torch.zeros_like(p) for j, p in
                   enumerate(spread)) for i in every]  # fmt: skip

    def along(i: int) -> Callable[..., Tensor]:
        return lambda *p: jvp(fn, p, units[i])[1]

    gradient = [along(i)(*spread) for i in every]
    hessian = {(i, j): jvp(along(i), spread, units[j])[1] for i in every for j in every[i:]}
    return gradient, hessian


def pointwise_fallback(ctx: Context, op: Callable[..., Any], out: Tensor, args: tuple,
                       kwargs: dict) -> Jet:  # fmt: skip
    """An elementwise op of one or more jet inputs, by the chain rule with its elementwise
    gradient and Hessian (from ``torch.func`` on the op alone)."""
    fn, primals, jets = _substitute(op, args, kwargs)
    gradient, hessian = _elementwise_derivatives(fn, primals, out.shape)
    nd = out.ndim
    firsts = [lifted(j.first, nd) for j in jets]
    first = plus(*(times(f, g) for g, f in zip(gradient, firsts, strict=True)))
    second = plus(
        *(
            times(lifted(j.second, nd), g)
            for g, j in zip(gradient, jets, strict=True)
            if j.second is not None
        )
    )
    for (i, j), h in hessian.items():
        term = times(ctx.product(firsts[i], firsts[j]), h)
        second = plus(second, term if i == j else 2 * term)
    return Jet(out, first, second)


def general_fallback(ctx: Context, op: Callable[..., Any], out: Any, args: tuple,
                     kwargs: dict) -> Any:  # fmt: skip
    """Any op: first order ``jvp`` along each direction, second order ``jvp`` of ``jvp`` along
    each direction (the op's curvature) plus ``jvp`` of the inputs' second-order coefficients;
    where forward-mode AD is missing for the op or cannot be trusted, its Jacobian and Hessian
    by reverse mode -- one matrix at a time for batched matrix ops."""
    fn, primals, jets = _substitute(op, args, kwargs)
    outputs, spec = pytree.tree_flatten(out)
    smooth = [i for i, o in enumerate(outputs) if isinstance(o, Tensor) and o.is_floating_point()]

    def smooth_fn(*values: Tensor) -> tuple[Tensor, ...]:
        flat = pytree.tree_leaves(fn(*values))
        return tuple(flat[i] for i in smooth)

    firsts = [expanded(lifted(j.first, j.value.ndim), j.value.shape) for j in jets]
    seconds = None
    if any(j.second is not None for j in jets):
        lead = next(j.second.shape[0] for j in jets if j.second is not None)
        seconds = [
            j.value.new_zeros(()).expand(lead, *j.value.shape)
            if j.second is None
            else expanded(lifted(j.second, j.value.ndim), j.value.shape)
            for j in jets
        ]
    coefficients = None
    if _nests_in_forward_mode(fn, primals, smooth):
        with contextlib.suppress(NotImplementedError):  # no forward-mode formula for the op
            coefficients = _forward_coefficients(ctx, smooth_fn, primals, firsts, seconds)
    if coefficients is None:
        batch = _matrix_batch(op, args, kwargs, [outputs[i] for i in smooth])
        if batch:
            coefficients = _reverse_per_instance(ctx, op, args, kwargs, smooth, batch, firsts,
                                                 seconds)  # fmt: skip
        else:
            coefficients = _reverse_coefficients(ctx, smooth_fn, primals, firsts, seconds)
    first, second = coefficients
    result = list(outputs)
    for i, f1, f2 in zip(smooth, first, second, strict=True):
        result[i] = Jet(outputs[i], f1, f2)
    return pytree.tree_unflatten(result, spec)


def _nests_in_forward_mode(fn: Callable[..., Any], primals: tuple, smooth: list[int]) -> bool:
    """Whether ``jvp`` of ``jvp`` of the op can be trusted: not when one of its floating outputs
    is non-differentiable (e.g. ``_linalg_det``'s LU), since its forward-mode formula may use that
    output, whose tangent the outer ``jvp`` then misses (torch 2.13 gets det's Hessian wrong)."""
    with torch.enable_grad():
        outputs = pytree.tree_leaves(fn(*(p.detach().requires_grad_() for p in primals)))
    return all(outputs[i].requires_grad for i in smooth)


def _forward_coefficients(ctx: Context, fn: Callable[..., tuple], primals: tuple,
                          firsts: list, seconds: list | None) -> tuple:  # fmt: skip
    def along(*tangents: Tensor) -> tuple[Tensor, ...]:
        return jvp(fn, primals, tangents)[1]

    def curvature(*tangents: Tensor) -> tuple[Tensor, ...]:
        return jvp(lambda *p: jvp(fn, p, tangents)[1], primals, tangents)[1]

    first = vmap(along)(*firsts)
    second = vmap(curvature)(*firsts)
    if ctx.collapsed:
        second = tuple(s.sum(0, keepdim=True) for s in second)
    if seconds is not None:
        second = tuple(s + t for s, t in zip(second, vmap(along)(*seconds), strict=True))
    return first, second


REVERSE_FALLBACK_LIMIT = 2**26
"""Most numbers the reverse-mode fallback may hold in one op's dense Hessian (of one instance,
for the batched matrix ops of :data:`MATRIX_OPS`)."""

MATRIX_OPS = frozenset(
    {
        "linalg_lu", "linalg_lu_factor_ex", "linalg_lu_solve", "lu_unpack", "linalg_qr",
        "_linalg_svd", "linalg_eig", "_linalg_eigh", "linalg_eigvals", "linalg_cholesky_ex",
        "linalg_inv_ex", "linalg_matrix_exp", "linalg_solve_triangular", "triangular_solve",
        "cholesky_solve", "cholesky_inverse", "linalg_householder_product",
        "linalg_ldl_factor_ex", "linalg_ldl_solve", "_linalg_det", "_linalg_slogdet",
        "_linalg_solve_ex", "linalg_matrix_power", "geqrf", "linalg_pinv",
    }
)  # fmt: skip
"""Ops on ``(*, m, n)`` matrices whose leading dims ``*`` are batch dims: each matrix is
computed alone (PyTorch's documented convention for torch.linalg)."""


def _matrix_batch(op: Callable[..., Any], args: tuple, kwargs: dict,
                  outputs: list[Tensor]) -> tuple[int, ...]:  # fmt: skip
    """The batch dims over which the reverse-mode fallback may run one matrix at a time: the
    leading dims of the op's first tensor argument but its last two, when ``op`` is one of
    :data:`MATRIX_OPS` and every tensor argument and output starts
    with them (no broadcasting); ``()`` otherwise."""
    schema = getattr(op, "_schema", None)
    name = schema.name.partition("::")[2] if schema is not None else None
    if name not in MATRIX_OPS:
        return ()
    tensors = [value_of(t) for t in pytree.tree_leaves((args, kwargs))]
    tensors = [t for t in tensors if isinstance(t, Tensor)]
    batch = tuple(tensors[0].shape[:-2])
    if all(tuple(t.shape[: len(batch)]) == batch for t in tensors + outputs):
        return batch
    return ()


def _reverse_per_instance(ctx: Context, op: Callable[..., Any], args: tuple, kwargs: dict,
                          smooth: list[int], batch: tuple[int, ...], firsts: list,
                          seconds: list | None) -> tuple:  # fmt: skip
    """:func:`_reverse_coefficients` vmapped over the batch dims of a batched matrix op: one
    matrix's Jacobian and Hessian at a time, not the whole batch's (which is block-diagonal,
    and (batch size)^2 times larger)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors = [i for i, leaf in enumerate(leaves) if isinstance(value_of(leaf), Tensor)]
    jets = [i for i in tensors if isinstance(leaves[i], Jet)]
    count, nb = math.prod(batch), len(batch)

    def instances(t: Tensor, lead: int) -> Tensor:  # batch dims (after ``lead`` dims) as one
        return t.reshape(*t.shape[:lead], count, *t.shape[lead + nb :])

    def one(values: list[Tensor], t1: list[Tensor], t2: list[Tensor] | None) -> tuple:
        fixed = [value_of(leaf) for leaf in leaves]
        for i, v in zip(tensors, values, strict=True):
            fixed[i] = v

        def fn(*primals: Tensor) -> tuple[Tensor, ...]:
            current = list(fixed)
            for i, v in zip(jets, primals, strict=True):
                current[i] = v
            a, k = pytree.tree_unflatten(current, spec)
            flat = pytree.tree_leaves(op(*a, **k))
            return tuple(flat[i] for i in smooth)

        primals = tuple(fixed[i] for i in jets)
        first, second = _reverse_coefficients(ctx, fn, primals, t1, t2)
        return tuple(first), tuple(second)

    values = [instances(value_of(leaves[i]), 0) for i in tensors]
    t1 = [instances(t, 1) for t in firsts]
    if seconds is None:
        first, second = vmap(lambda v, a: one(v, a, None), in_dims=(0, 1), out_dims=1)(values, t1)
    else:
        t2 = [instances(t, 1) for t in seconds]
        first, second = vmap(one, in_dims=(0, 1, 1), out_dims=1)(values, t1, t2)
    return (
        [f.reshape(f.shape[0], *batch, *f.shape[2:]) for f in first],
        [s.reshape(s.shape[0], *batch, *s.shape[2:]) for s in second],
    )


def _reverse_coefficients(ctx: Context, fn: Callable[..., tuple], primals: tuple,
                          firsts: list, seconds: list | None) -> tuple:  # fmt: skip
    """From the op's dense Jacobian and Hessian (reverse over reverse), inputs flattened."""
    outputs = fn(*primals)
    sizes = [p.numel() for p in primals]
    needed = sum(o.numel() for o in outputs) * sum(sizes) ** 2
    if needed > REVERSE_FALLBACK_LIMIT:
        raise RuntimeError(
            f"pyhvp: an op of f has no jet rule and PyTorch's forward-mode derivative of it cannot "
            f"be nested; the reverse-mode fallback would hold its dense Hessian ({needed} numbers, "
            f"over the limit {REVERSE_FALLBACK_LIMIT}): its inputs are treated as one block "
            f"unless it is a batched torch.linalg op, whose matrices are taken one at a time. "
            f"Please report the op"
        )
    every = tuple(range(len(primals)))
    jacobian = jacrev(fn, argnums=every)(*primals)  # [output][input]: out + in
    hessian = jacrev(jacrev(fn, argnums=every), argnums=every)(*primals)  # [o][i][j]
    first, second = [], []
    for o, value in enumerate(outputs):
        size = value.numel()
        f = s = 0
        for i, t in enumerate(firsts):
            j_oi = jacobian[o][i].reshape(size, sizes[i]).T
            f = f + t.reshape(t.shape[0], sizes[i]) @ j_oi
            if seconds is not None:
                s = s + seconds[i].reshape(seconds[i].shape[0], sizes[i]) @ j_oi
            for j, u in enumerate(firsts):
                h = hessian[o][i][j].reshape(size, sizes[i], sizes[j])
                quad = torch.einsum("ka,oab,kb->ko", t.reshape(t.shape[0], sizes[i]), h,
                                    u.reshape(u.shape[0], sizes[j]))  # fmt: skip
                s = s + (quad.sum(0, keepdim=True) if ctx.collapsed else quad)
        first.append(f.reshape(-1, *value.shape))
        second.append(s.reshape(-1, *value.shape))
    return first, second
