"""Sums, products (Leibniz), quotients and powers of jets."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, cast

import torch

from pyhvp.taylor.jets import (
    Context,
    DiagonalCoefficient,
    FactoredCoefficient,
    Jet,
    broadcast_times,
    chain,
    coefficient_of,
    diagonal_of,
    lifted,
    multiplied,
    on_event,
    plus,
    times,
    times_or_none,
    value_of,
)
from pyhvp.taylor.registry import apply, rule

aten = torch.ops.aten
Tensor = torch.Tensor


def _signed_sum(out: Tensor, a: object, b: object, ca: float, cb: float) -> Jet:
    """``ca * a + cb * b``."""
    nd = out.ndim

    def combined(order: int) -> Tensor | None:
        ta, tb = coefficient_of(a, nd, order), coefficient_of(b, nd, order)
        return plus(
            times_or_none(ta, ca) if ca != 1 else ta, times_or_none(tb, cb) if cb != 1 else tb
        )

    diagonal = _diagonal_first(out, a, b, ca, cb)
    first = combined(1) if diagonal is None else diagonal
    return Jet(out, cast(Tensor | DiagonalCoefficient, first), combined(2))  # a or b: a jet


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
        total = multiplied(da.diagonal, wa) + multiplied(db.diagonal, wb)
        return DiagonalCoefficient(total, da.basis, da.event, out.ndim).times(1.0, out.shape)
    one, weight = (da, wa) if da is not None else (db, wb)
    return None if one is None else one.times(weight, out.shape)


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
    first: Tensor | FactoredCoefficient | DiagonalCoefficient
    if isinstance(c, DiagonalCoefficient):
        first = DiagonalCoefficient(-c.diagonal, c.basis, c.event, c.ndim)
    elif isinstance(c, FactoredCoefficient):
        first = FactoredCoefficient(-c.factor, c.shared)
    else:
        first = -c
    return Jet(out, first, None if u.second is None else -u.second)


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
        second = (
            None if jet.second is None else broadcast_times(lifted(jet.second, out.ndim), other)
        )
        return Jet(
            out, FactoredCoefficient(times(c.factor, other), lifted(c.shared, out.ndim)), second
        )
    return bilinear(ctx, out, a, b, broadcast_times)


def _diagonal_product(ctx: Context, out: Tensor, a: object, b: object) -> Jet | None:
    """``a * b`` with the first-order coefficient kept diagonal: a diagonal jet times a constant,
    or two diagonal jets (on the same basis), collapsed: Leibniz with the cross term
    ``2 sum_k a_k b_k = 2 diag(a) diag(b)``. None otherwise."""
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
    return Jet(out, first, second)


def swap(op: Callable[[Any, Any], Tensor]) -> Callable[[Any, Any], Tensor]:
    """``op`` with its arguments given the other way round (``broadcast_times`` commutes)."""
    return op if op is broadcast_times else lambda b, a: op(a, b)


def bilinear(
    ctx: Context, out: Tensor, a: object, b: object, op: Callable[[Any, Any], Tensor]
) -> Jet:
    """Leibniz for an op bilinear in (a, b) that broadcasts a leading axis:
    ``(ab)' = a'b + ab'``, ``(ab)'' = a''b + 2 a'b' + ab''``."""
    nd = out.ndim
    va, vb = value_of(a), value_of(b)
    fa, fb = coefficient_of(a, nd, 1), coefficient_of(b, nd, 1)
    sa, sb = coefficient_of(a, nd, 2), coefficient_of(b, nd, 2)
    # coefficients first (see broadcast_times): a' b and b' a, then a'' b and b'' a
    first = plus(None if fa is None else op(fa, vb), None if fb is None else swap(op)(fb, va))
    cross = None if fa is None or fb is None else 2 * ctx.pair(op, fa, fb)
    second = plus(
        None if sa is None else op(sa, vb), None if sb is None else swap(op)(sb, va), cross
    )
    return Jet(out, cast(Tensor, first), second)  # a or b is a jet: not None


@rule(aten.div.Tensor, aten.div.Scalar)
def _div(ctx: Context, out: Tensor, a: object, b: object) -> Jet:
    if not isinstance(b, Jet):
        c, divisor = diagonal_of(a), cast(Tensor | float, b)
        if c is not None and on_event(c.event, out.shape):  # stays diagonal
            second = cast(Jet, a).second
            first = DiagonalCoefficient(c.diagonal / divisor, c.basis, c.event, out.ndim)
            return Jet(out, first, None if second is None else lifted(second, out.ndim) / divisor)
        return bilinear(ctx, out, a, b, operator.truediv)
    return bilinear(ctx, out, a, apply(ctx, aten.reciprocal.default, b), broadcast_times)


@rule(aten.pow.Tensor_Tensor)
def _tensor_power(ctx: Context, out: Tensor, base: Jet | Tensor, exponent: Jet | Tensor) -> Jet:
    """``base ** exponent``, masked like autograd's ``pow_backward``: a constant exponent ``b``
    gives ``b u^(b-1)`` except 0 where ``b == 0`` and ``b (b-1) u^(b-2)`` except 0 where ``b`` is
    0 or 1 (``0 * inf`` at ``u = 0`` otherwise); a constant zero base has zero derivatives where
    the exponent is >= 0. The masked powers and logarithms are taken of safe values (1, or
    exponents 1 and 2), so that no ``0 * inf`` is left in the kernel's backward either."""
    if not isinstance(exponent, Jet):
        base = cast(Jet, base)  # one of base and exponent is a jet
        b, u = exponent, base.value
        constant, linear, one = b == 0, (b == 0) | (b == 1), torch.ones_like(b)  # b's dtype
        d1 = torch.where(constant, 0.0, b * u ** torch.where(constant, one, b - 1))
        d2 = torch.where(linear, 0.0, b * (b - 1) * u ** torch.where(linear, 2 * one, b - 2))
        return chain(ctx, out, base, d1, d2)
    if not isinstance(base, Jet):  # exponent e: out log(base), out log(base)^2
        flat = (base == 0) & (exponent.value >= 0)
        log_base = torch.log(torch.where(flat, 1.0, base))  # 0 where flat
        d1 = out * log_base
        return chain(ctx, out, exponent, d1, d1 * log_base)
    log_base = apply(ctx, aten.log.default, base)  # base^e = exp(e log base)
    exponent_jet = apply(ctx, aten.mul.Tensor, exponent, log_base)
    return chain(ctx, out, exponent_jet, out, out)
