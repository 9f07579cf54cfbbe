"""Matrix products: ``mm``, ``bmm``, ``addmm``, ``mv``, ``dot``."""

from __future__ import annotations

import math
import operator
from typing import cast

import torch

from pyhvp.taylor.jets import (
    Context,
    FactoredCoefficient,
    Jet,
    coefficient_of,
    expanded,
    leibniz,
    lifted,
    plus,
    strong,
    times_or_none,
    value_of,
)
from pyhvp.taylor.registry import apply, rule

aten = torch.ops.aten
Tensor = torch.Tensor


def matmul_jet(ctx: Context, out: Tensor, a: Jet | Tensor, b: Jet | Tensor) -> Jet:
    """``a @ b`` for a (..., p, q), b (..., q, r): coefficients keep their broadcast dims except
    the contracted one, so a first layer applied to shared directions runs once."""
    nd = out.ndim
    q_a = value_of(a).ndim - 1  # a's contracted dim (value dims)
    q_b = value_of(b).ndim - 2

    def contracted(arg: Jet | Tensor, order: int, dim: int) -> Tensor | None:
        t = coefficient_of(arg, value_of(arg).ndim, order)
        # lifted to the result's dims: an operand with fewer batch dims broadcasts (solve)
        return None if t is None else lifted(expanded(t, value_of(arg).shape, [dim]), nd)

    factored = _factored_matmul(a, b)  # one operand is a jet: then no cross terms
    orders = range(1, ctx.order + 1)
    ca = [None if k == 1 and factored is not None else contracted(a, k, q_a) for k in orders]
    cb = [None if k == 1 and factored is not None else contracted(b, k, q_b) for k in orders]
    coefficients = leibniz(ctx, operator.matmul, value_of(a), value_of(b), ca, cb)
    if factored is not None:
        coefficients[0] = factored
    return Jet(out, tuple(None if c is None else lifted(c, nd) for c in coefficients))


def _factored_matmul(a: Jet | Tensor, b: Jet | Tensor) -> Tensor | None:
    """The first-order coefficient of ``a @ b`` when one operand is a jet with a :class:`FactoredCoefficient`
    coefficient whose shared part is shared along every dim but the contracted one, and the other a
    matrix: ``(s * v_k) @ W = s @ (v_k W)`` for all k in ONE wide product -- 2.2x faster on this
    CPU than K skinny ones (a (1024, 64) @ (64, 1024) against (16384, 64) @ (64, 64)), and the
    K-fold product ``s * v_k`` is never formed. None otherwise."""
    if isinstance(a, Jet) == isinstance(b, Jet):
        return None
    left = isinstance(a, Jet)
    jet, weight = (a, value_of(b)) if left else (b, value_of(a))
    jet = cast(Jet, jet)  # exactly one of a and b is a jet
    c = jet.coefficient
    if not isinstance(c, FactoredCoefficient) or weight.ndim != 2 or strong():
        return None  # under strong zeros: a matrix product would multiply zeros by the factor
    shape = jet.value.shape
    contracted = len(shape) - 1 if left else len(shape) - 2
    shared = lifted(c.shared, len(shape))
    if any(shared.shape[d + 1] != 1 for d in range(len(shape)) if d != contracted):
        return None
    k, q = shared.shape[0], shape[contracted]
    rows = math.prod(shape) // q if q else 0  # the factor's rows (or columns): p * batch
    if weight.shape[1 if left else 0] * FACTORED_ROWS_PER_OUTPUT > rows:
        return None  # the K stacked weights would outweigh the K-fold coefficient
    vectors = expanded(shared, shape, [contracted]).reshape(k, q)  # v_k
    factor = c.factor.expand(shape)
    if left:  # factor (..., p, q) @ [v_k W] (q, K r) -> (..., p, K, r)
        r = weight.shape[1]
        stacked = (vectors[:, :, None] * weight).permute(1, 0, 2).reshape(q, k * r)
        # K-major again (one copy): later products fold (K * ..., r) into one matrix product
        return (factor @ stacked).reshape(*shape[:-1], k, r).movedim(-2, 0).contiguous()
    p = weight.shape[0]  # [W v_k] (K p, q) @ factor (..., q, r) -> (..., K, p, r)
    stacked = (weight * vectors[:, None, :]).reshape(k * p, q)
    return (stacked @ factor).reshape(*shape[:-2], k, p, shape[-1]).movedim(-3, 0).contiguous()


FACTORED_ROWS_PER_OUTPUT = 4
"""The wide product of :func:`_factored_matmul` stacks K copies of the weight (``K q r``
numbers) to avoid the K-fold coefficient (``K rows q``): taken when the factor has at least this
many rows per output column. The paper MLP of issue 25 (32 rows, 768 columns) ran 5x slower
through the stack than multiplied out; 1024 rows of width 64 ran 2.2x faster."""


@rule(aten.mm.default, aten.bmm.default)
def _mm(ctx: Context, out: Tensor, a: Jet | Tensor, b: Jet | Tensor) -> Jet:
    return matmul_jet(ctx, out, a, b)


@rule(aten.addmm.default, aten.baddbmm.default)
def _addmm(
    ctx: Context,
    out: Tensor,
    bias: Jet | Tensor,
    a: Jet | Tensor,
    b: Jet | Tensor,
    beta: float = 1,
    alpha: float = 1,
) -> Jet:
    product = matmul_jet(ctx, out, a, b) if isinstance(a, Jet) or isinstance(b, Jet) else None
    bias_part = bias if isinstance(bias, Jet) and beta != 0 else None
    nd = out.ndim
    orders = []
    for order in range(1, ctx.order + 1):
        p = None if product is None else product.dense(order)
        orders.append(plus(times_or_none(p, alpha) if alpha != 1 else p,
                           times_or_none(coefficient_of(bias_part, nd, order), beta)))  # fmt: skip
    return Jet(out, tuple(orders))  # an input is a jet: the first is not None


@rule(aten.mv.default)
def _mv(ctx: Context, out: Tensor, a: Jet | Tensor, v: Jet | Tensor) -> Jet:
    column = apply(ctx, aten.unsqueeze.default, v, -1)
    return cast(Jet, apply(ctx, aten.squeeze.dim, apply(ctx, aten.mm.default, a, column), -1))


@rule(aten.dot.default)
def _dot(ctx: Context, out: Tensor, a: Jet | Tensor, b: Jet | Tensor) -> Jet:
    return cast(Jet, apply(ctx, aten.sum.default, apply(ctx, aten.mul.Tensor, a, b)))
