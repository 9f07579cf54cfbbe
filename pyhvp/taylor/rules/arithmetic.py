"""Sums, products (Leibniz), quotients and powers of jets."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, cast

import torch

from pyhvp.taylor.jets import (
    Coefficient,
    Context,
    DiagonalCoefficient,
    FactoredCoefficient,
    Jet,
    broadcast_times,
    chain,
    coefficient_of,
    coefficients_of,
    diagonal_of,
    leibniz,
    lifted,
    multiplied,
    on_event,
    plus,
    promoted,
    times,
    times_or_none,
    value_of,
)
from pyhvp.taylor.registry import apply, rule
from pyhvp.taylor.rules.elementwise import selected

aten = torch.ops.aten
Tensor = torch.Tensor


def _signed_sum(ctx: Context, out: Tensor, a: object, b: object, ca: float, cb: float) -> Jet:
    """``ca * a + cb * b``."""
    nd = out.ndim

    def combined(order: int) -> Tensor | None:
        ta, tb = coefficient_of(a, nd, order), coefficient_of(b, nd, order)
        return plus(
            times_or_none(ta, ca) if ca != 1 else ta, times_or_none(tb, cb) if cb != 1 else tb
        )

    diagonal = _diagonal_first(out, a, b, ca, cb)
    first = combined(1) if diagonal is None else diagonal
    return Jet(out, (first, *(combined(k) for k in range(2, ctx.order + 1))))


def _diagonal_first(out: Tensor, a: object, b: object, wa: Tensor | float, wb: Tensor | float,
                    both: bool = True) -> DiagonalCoefficient | None:  # fmt: skip
    """The first-order coefficient ``wa a' + wb b'`` kept diagonal, where each jet's is (on the
    same basis) and the other operand is a constant; ``both``: whether two diagonal jets may
    combine. None otherwise (the caller multiplies out)."""
    da, db = diagonal_of(a), diagonal_of(b)
    if (da is None and isinstance(a, Jet)) or (db is None and isinstance(b, Jet)):
        return None
    if da is not None and db is not None:
        if da.basis is not db.basis or not both:
            return None
        total = (multiplied(da.diagonal, promoted(wa, out.dtype))
                 + multiplied(db.diagonal, promoted(wb, out.dtype)))  # fmt: skip
        diagonal = DiagonalCoefficient(total, da.basis, da.event, out.ndim)
        return diagonal.times(1.0, out.shape, out.dtype)
    one, weight = (da, wa) if da is not None else (db, wb)
    return None if one is None else one.times(weight, out.shape, out.dtype)


@rule(aten.sub.Tensor, aten.sub.Scalar)
def _sub(ctx: Context, out: Tensor, a: object, b: object, alpha: float = 1) -> Jet:
    return _signed_sum(ctx, out, a, b, 1, -alpha)


@rule(aten.rsub.Tensor, aten.rsub.Scalar)
def _rsub(ctx: Context, out: Tensor, a: object, b: object, alpha: float = 1) -> Jet:
    return _signed_sum(ctx, out, a, b, -alpha, 1)


@rule(aten.add.Tensor, aten.add.Scalar)
def _add(ctx: Context, out: Tensor, a: object, b: object, alpha: float = 1) -> Jet:
    return _signed_sum(ctx, out, a, b, 1, alpha)


@rule(aten.neg.default)
def _neg(ctx: Context, out: Tensor, u: Jet) -> Jet:
    c = u.coefficient
    first: Coefficient
    if isinstance(c, DiagonalCoefficient):
        first = DiagonalCoefficient(-c.diagonal, c.basis, c.event, c.ndim)
    elif isinstance(c, FactoredCoefficient):
        first = FactoredCoefficient(-c.factor, c.shared)
    else:
        first = -c
    higher = cast(tuple[Tensor | None, ...], u.coefficients[1:])
    return Jet(out, (first, *(None if t is None else -t for t in higher)))


@rule(aten.mul.Tensor, aten.mul.Scalar)
def _mul(ctx: Context, out: Tensor, a: Jet | Tensor | float, b: Jet | Tensor | float) -> Jet:
    product = _diagonal_product(ctx, out, a, b)
    if product is not None:
        return product
    jet, other = (a, b) if isinstance(a, Jet) else (cast(Jet, b), a)  # one of them is a jet
    if not isinstance(other, Jet) and isinstance(
        jet.coefficient, FactoredCoefficient
    ):  # stays factored
        c = jet.coefficient
        higher = cast(tuple[Tensor | None, ...], jet.coefficients[1:])
        return Jet(out, (FactoredCoefficient(times(c.factor, other), lifted(c.shared, out.ndim)),
                         *(None if t is None else broadcast_times(lifted(t, out.ndim), other)
                           for t in higher)))  # fmt: skip
    return bilinear(ctx, out, a, b, broadcast_times)


def _diagonal_product(ctx: Context, out: Tensor, a: object, b: object) -> Jet | None:
    """``a * b`` with the first-order coefficient kept diagonal (second order: diagonal
    coefficients are kept by second-order kernels only): a diagonal jet times a constant, or two
    diagonal jets (on the same basis), collapsed: Leibniz with the cross term ``2 sum_k a_k b_k
    = 2 diag(a) diag(b)``. None otherwise."""
    nd = out.ndim
    va, vb = cast(Tensor | float, value_of(a)), cast(Tensor | float, value_of(b))
    first = _diagonal_first(out, a, b, vb, va, both=ctx.collapsed)
    if first is None:
        return None
    sa, sb = coefficient_of(a, nd, 2), coefficient_of(b, nd, 2)
    second = plus(None if sa is None else broadcast_times(sa, vb),
                  None if sb is None else broadcast_times(sb, va))  # fmt: skip
    da, db = diagonal_of(a), diagonal_of(b)
    if da is not None and db is not None:  # the cross term
        cross = 2 * multiplied(da.diagonal, db.diagonal)
        square = cross[None] if isinstance(cross, Tensor) else out.new_full((1,) * (nd + 1), cross)
        second = plus(second, lifted(square, nd))
    return Jet(out, (first, second))


def bilinear(
    ctx: Context, out: Tensor, a: object, b: object, op: Callable[[Any, Any], Tensor]
) -> Jet:
    """Leibniz for an op bilinear in (a, b) that broadcasts a leading axis:
    ``(ab)' = a'b + ab'``, ``(ab)'' = a''b + 2 a'b' + ab''``, ... (:func:`leibniz`)."""
    nd = out.ndim
    coefficients = leibniz(ctx, op, value_of(a), value_of(b), coefficients_of(a, nd, ctx.order),
                           coefficients_of(b, nd, ctx.order))  # fmt: skip
    return Jet(out, tuple(coefficients))  # a or b is a jet: the first is not None


@rule(aten.div.Tensor, aten.div.Scalar)
def _div(ctx: Context, out: Tensor, a: object, b: object) -> Jet:
    if not isinstance(b, Jet):
        c, divisor = diagonal_of(a), cast(Tensor | float, b)
        if c is not None and on_event(c.event, out.shape):  # stays diagonal
            second = cast(Jet, a).second
            quotient = c.diagonal / promoted(divisor, out.dtype)
            first = DiagonalCoefficient(quotient, c.basis, c.event, out.ndim)
            return Jet(out, (first, None if second is None else lifted(second, out.ndim) / divisor))
        return bilinear(ctx, out, a, b, operator.truediv)
    return bilinear(ctx, out, a, apply(ctx, aten.reciprocal.default, b), broadcast_times)


@rule(aten.pow.Tensor_Tensor)
def _tensor_power(ctx: Context, out: Tensor, base: Jet | Tensor, exponent: Jet | Tensor) -> Jet:
    """``base ** exponent``, masked like autograd's ``pow_backward``: a constant exponent ``b``
    gives ``(b)_j u^(b-j)`` (``(b)_j = b (b-1) ... (b-j+1)``), 0 where ``(b)_j`` is (``0 * inf``
    at ``u = 0`` otherwise); a constant zero base has zero derivatives where the exponent is
    >= 0. The masked powers and logarithms are taken of safe values (exponent j, or 1), so that
    no ``0 * inf`` is left in the kernel's backward either."""
    if not isinstance(exponent, Jet):
        base = cast(Jet, base)  # one of base and exponent is a jet
        b, u = exponent, base.value
        one = torch.ones_like(b)  # b's dtype
        derivatives = []
        falling, zero = b, b == 0
        for j in range(1, ctx.order + 1):
            if j > 1:
                falling, zero = falling * (b - (j - 1)), zero | (b == j - 1)
            safe = torch.where(zero, one if j == 1 else j * one, b - j)
            derivatives.append(torch.where(zero, 0.0, falling * u**safe))
        return chain(ctx, out, base, *derivatives)
    if not isinstance(base, Jet):  # exponent e: out log(base)^j
        flat = (base == 0) & (exponent.value >= 0)
        log_base = torch.log(torch.where(flat, 1.0, base))  # 0 where flat
        derivatives, d = [], out
        for _ in range(ctx.order):
            d = d * log_base
            derivatives.append(d)
        return chain(ctx, out, exponent, *derivatives)
    # base^e = exp(e log base) where the base is not 0. Where it is, log base is -inf and every
    # coefficient was NaN (the gradient of x0 ** (2 + x1) at x0 = 0 too, where autograd's is
    # 0): there autograd's masks, each input's own terms and no mixed one -- the rule of a
    # constant exponent in the base plus that of a zero base in the exponent. Each branch runs
    # on safe values where it is not taken (no inf or NaN there, nor in the kernel's backward).
    zero = base.value == 0
    safe_base = Jet(torch.where(zero, 1.0, base.value), base.coefficients)
    log_base = apply(ctx, aten.log.default, safe_base)
    general = chain(ctx, out, apply(ctx, aten.mul.Tensor, exponent, log_base), *[out] * ctx.order)
    e = exponent.value
    in_base = _tensor_power(ctx, out, Jet(torch.zeros_like(base.value), base.coefficients),
                            torch.where(zero, e, float(ctx.order + 1)))  # fmt: skip
    infinite = out.new_full((), torch.inf)
    pole = zero & (e < 0)  # 0 ** e = inf: out log(0)^j = (-1)^j inf
    in_exponent = chain(ctx, out, exponent, *(torch.where(pole, -infinite if j % 2 else infinite,
                                                          0.0) for j in range(1, ctx.order + 1)))  # fmt: skip
    nd, orders = out.ndim, range(1, ctx.order + 1)
    at_zero = Jet(out, tuple(plus(coefficient_of(in_base, nd, k), coefficient_of(in_exponent, nd, k))
                             for k in orders))  # fmt: skip
    return selected(out, zero, at_zero, general, ctx.order)
