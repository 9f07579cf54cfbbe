"""Reductions: sums, means, extrema, variances, log-sum-exp and softmax, norms and distances."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from pyhvp.taylor.jets import (
    Context,
    DiagonalCoefficient,
    Dims,
    FactoredCoefficient,
    Jet,
    axes,
    axis,
    broadcast_dims,
    broadcast_times,
    chain,
    coefficient_of,
    diagonal_summed,
    expanded,
    lifted,
    linear,
    multiplied,
    plus,
    strong,
    times_or_none,
    value_of,
)
from pyhvp.taylor.registry import Rule, apply, rule

aten = torch.ops.aten
Tensor = torch.Tensor


@rule(aten.sum.dim_IntList, aten.sum.default)
def _sum(
    ctx: Context, out: Tensor, u: Jet, dim: Dims = None, keepdim: bool = False, *,
    dtype: torch.dtype | None = None,
) -> Jet:  # fmt: skip
    dims = axes(dim, u.value.ndim)

    def fn(t: Tensor) -> Tensor:
        factor = math.prod(u.value.shape[d] for d in broadcast_dims(t, u.value.shape) if d in dims)
        summed = t.sum([d + 1 for d in dims], keepdim=keepdim) if dims else t
        return summed if factor == 1 else summed * factor

    return _reduced(out, u, fn, _structured_sum(u, dims, keepdim), dtype)


def _structured_sum(u: Jet, dims: list[int], keepdim: bool
                    ) -> Tensor | DiagonalCoefficient | None:  # fmt: skip
    """A sum's first-order coefficient from a diagonal or factored one; None otherwise."""
    c = u.coefficient
    if isinstance(c, DiagonalCoefficient):
        return diagonal_summed(c, u.value.shape, dims, keepdim) if dims else None
    return _factored_sum(u, dims, keepdim)


def _reduced(out: Tensor, u: Jet, fn: Callable[[Tensor], Tensor],
             first: Tensor | DiagonalCoefficient | None, dtype: torch.dtype | None) -> Jet:  # fmt: skip
    """A reduction's jet: ``first`` when a factored coefficient gave it, else ``fn`` of it."""
    jet = Jet(out, fn(u.first) if first is None else first,
              None if u.second is None else fn(u.second))  # fmt: skip
    if dtype is None:
        return jet
    return Jet(out, jet.first.to(dtype), None if jet.second is None else jet.second.to(dtype))


def _factored_sum(u: Jet, dims: list[int], keepdim: bool) -> Tensor | None:
    """The first-order coefficient of a sum over ``dims`` when ``u``'s is :class:`FactoredCoefficient` with a
    shared part that varies only along ``dims``: ``sum_j s[.., j] v_k[j]`` for all k is one matrix
    product, instead of forming the K-fold ``s * v_k``. None otherwise."""
    c = u.coefficient
    shape, nd = u.value.shape, u.value.ndim
    if not isinstance(c, FactoredCoefficient) or not dims or strong():
        return None  # under strong zeros: a matrix product would multiply zeros by the factor
    shared = lifted(c.shared, nd)
    rest = [d for d in range(nd) if d not in dims]
    if any(shared.shape[d + 1] != 1 for d in rest):
        return None
    k, m = shared.shape[0], math.prod(shape[d] for d in dims)
    vectors = expanded(shared, shape, dims).permute(0, *(d + 1 for d in rest + dims)).reshape(k, m)
    factor = c.factor.expand(shape).permute(*rest, *dims).reshape(-1, m)
    dtype = torch.promote_types(factor.dtype, vectors.dtype)  # as their elementwise product has
    summed = (factor.to(dtype) @ vectors.T.to(dtype)).T.reshape(k, *(shape[d] for d in rest))
    for d in dims if keepdim else ():
        summed = summed.unsqueeze(d + 1)
    return summed


@rule(aten.mean.dim, aten.mean.default)
def _mean(
    ctx: Context, out: Tensor, u: Jet, dim: Dims = None, keepdim: bool = False, *,
    dtype: torch.dtype | None = None,
) -> Jet:  # fmt: skip
    dims = axes(dim, u.value.ndim)

    def fn(t: Tensor) -> Tensor:  # the mean of a broadcast (constant) dim is that constant
        return t.mean([d + 1 for d in dims], keepdim=keepdim) if dims else t

    summed = _structured_sum(u, dims, keepdim)
    count = math.prod(u.value.shape[d] for d in dims)
    if isinstance(summed, DiagonalCoefficient):
        mean: Tensor | DiagonalCoefficient | None = DiagonalCoefficient(
            multiplied(summed.diagonal, 1 / count), summed.basis, summed.event, summed.ndim
        )
    else:
        mean = None if summed is None else summed / count
    return _reduced(out, u, fn, mean, dtype)


@rule(aten.cumsum.default)
def _cumsum(ctx: Context, out: Tensor, u: Jet, dim: int, *, dtype: object = None) -> Jet:
    d = axis(dim, u.value.ndim)
    return linear(out, u, lambda t: expanded(t, u.value.shape, [d]).cumsum(d + 1).to(out.dtype))


def _kept(value: Tensor, shape: Sequence[int], dims: list[int]) -> Tensor:
    """A reduction's value with its reduced dims back as size 1."""
    return value.reshape([1 if d in dims else n for d, n in enumerate(shape)])


@rule(aten.amax.default, aten.amin.default)
def _amax(ctx: Context, out: Tensor, u: Jet, dim: Dims = (), keepdim: bool = False) -> Jet:
    dims = axes(dim, u.value.ndim)
    # where the extremum is attained, split evenly between ties (autograd's convention)
    hits = (u.value == _kept(out, u.value.shape, dims)).to(out.dtype)
    weights = hits / hits.sum(dims, keepdim=True)
    return linear(
        out, u, lambda t: broadcast_times(t, weights).sum([d + 1 for d in dims], keepdim=keepdim)
    )


@rule(aten.max.default, aten.min.default)
def _max_all(ctx: Context, out: Tensor, u: Jet) -> Jet:
    return _amax(ctx, out, u, list(range(u.value.ndim)), False)


def _picked(ctx: Context, out: tuple[Tensor, ...], u: Jet, dim: int) -> tuple[Any, ...]:
    """``(values, indices)`` where ``values`` are ``u``'s elements at ``indices`` along ``dim``
    (selections: extrema, sorts, order statistics): locally a gather, so its jet is the gather
    of ``u``'s."""
    values, indices = out[0], out[1]
    d = axis(dim, u.value.ndim)
    reduced = indices.ndim < u.value.ndim
    picked = apply(ctx, aten.gather.default, u, d, indices.unsqueeze(d) if reduced else indices)
    if reduced:
        picked = apply(ctx, aten.squeeze.dim, picked, d)
    return (Jet(values, picked.first, picked.second), indices, *out[2:])


@rule(aten.max.dim, aten.min.dim, aten.median.dim, aten.nanmedian.dim)
def _extremum_along(
    ctx: Context, out: tuple[Tensor, ...], u: Jet, dim: int, keepdim: bool = False
) -> tuple[Any, ...]:
    return _picked(ctx, out, u, dim)


@rule(aten.mode.default, aten.cummax.default, aten.cummin.default)
def _selection_along(ctx: Context, out: tuple[Tensor, ...], u: Jet, dim: int = -1,
                     keepdim: bool = False) -> tuple[Any, ...]:  # fmt: skip
    return _picked(ctx, out, u, dim)


@rule(aten.sort.default)
def _sort(
    ctx: Context, out: tuple[Tensor, ...], u: Jet, dim: int = -1, descending: bool = False
) -> tuple[Any, ...]:
    return _picked(ctx, out, u, dim)


@rule(aten.sort.stable)
def _stable_sort(ctx: Context, out: tuple[Tensor, ...], u: Jet, *, stable: bool | None = None, dim: int = -1,
                 descending: bool = False) -> tuple[Any, ...]:  # fmt: skip
    return _picked(ctx, out, u, dim)


@rule(aten.topk.default, aten.kthvalue.default)
def _order_statistics(ctx: Context, out: tuple[Tensor, ...], u: Jet, k: int, dim: int = -1,
                      *options: bool) -> tuple[Any, ...]:  # fmt: skip
    return _picked(ctx, out, u, dim)


def _variance(root: bool) -> Rule:
    """var = sum((u - mean)^2) / (n - correction), std its root; ``*_mean`` also the mean."""

    def variance_rule(ctx: Context, out: Any, u: Jet, *args: Any, **kwargs: Any) -> Any:
        dim, correction, keepdim = _variance_options(*args, **kwargs)
        dims = axes(dim, u.value.ndim)
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
    dim: Dims = None, unbiased: bool | None = None, keepdim: bool = False, *,
    correction: float | None = None,
) -> tuple[Dims, float, bool]:  # fmt: skip
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


def _lse(
    ctx: Context, u: Jet, dims: list[int], keepdim: bool, p: Tensor
) -> tuple[Tensor, Tensor | None]:
    """Coefficients of log sum exp over ``dims``, ``p = softmax(u)``: first ``sum p t``, second
    ``sum p s + sum p t^2 - (sum p t)^2``."""
    shifted = [d + 1 for d in dims]
    first = broadcast_times(u.first, p).sum(shifted, keepdim=keepdim)
    spread = broadcast_times(ctx.square(u.first), p).sum(shifted, keepdim=keepdim) - ctx.square(
        first
    )
    own = None if u.second is None else broadcast_times(u.second, p).sum(shifted, keepdim=keepdim)
    return first, plus(own, spread)


def _finite_below(out: Tensor) -> Tensor:
    """A log-sum-exp's value with ``-inf`` (every term ``-inf``: a masked row) as 0: the weights
    ``e^(u - out)`` are then 0 there, as their limit along the masked terms' zero coefficients,
    not ``e^(-inf - -inf)`` (NaN, which a sum over the event spreads to every entry)."""
    return torch.where(out == -math.inf, 0.0, out)


@rule(aten.logsumexp.default)
def _logsumexp(ctx: Context, out: Tensor, u: Jet, dim: Dims, keepdim: bool = False) -> Jet:
    dims = axes(dim, u.value.ndim)
    p = torch.exp(u.value - _kept(_finite_below(out), u.value.shape, dims))
    return Jet(out, *_lse(ctx, u, dims, keepdim, p))


def _logaddexp(scale: float) -> Rule:
    """``log(e^a + e^b)`` (``scale`` 1), or ``log2(2^a + 2^b)`` (``scale`` ln 2): a log-sum-exp
    of two, with weights ``p = e^(scale (a - out))`` and ``q = e^(scale (b - out))``: first
    ``p a' + q b'``, second ``p a'' + q b'' + scale p q (a' - b')^2``. The weights are 0 where an
    argument is ``-inf`` (a masked entry), and where both are (:func:`_finite_below`)."""

    def logaddexp_rule(ctx: Context, out: Tensor, a: Jet | Tensor, b: Jet | Tensor) -> Jet:
        nd, shift = out.ndim, _finite_below(out)
        p, q = (torch.exp(scale * (value_of(t) - shift)) for t in (a, b))
        fa, fb = coefficient_of(a, nd, 1), coefficient_of(b, nd, 1)
        sa, sb = coefficient_of(a, nd, 2), coefficient_of(b, nd, 2)
        first = plus(None if fa is None else broadcast_times(fa, p),
                     None if fb is None else broadcast_times(fb, q))  # fmt: skip
        apart = cast(Tensor, plus(fa, times_or_none(fb, -1)))  # a or b is a jet: not None
        second = plus(None if sa is None else broadcast_times(sa, p),
                      None if sb is None else broadcast_times(sb, q),
                      broadcast_times(ctx.square(apart), scale * p * q))  # fmt: skip
        return Jet(out, cast(Tensor, first), second)

    return logaddexp_rule


rule(aten.logaddexp.default)(_logaddexp(1.0))
rule(aten.logaddexp2.default)(_logaddexp(math.log(2)))


def _log_softmax_coefficients(
    ctx: Context, u: Jet, d: int, p: Tensor
) -> tuple[Tensor, Tensor | None]:
    """``log softmax(u) = u - logsumexp(u)`` along ``d``."""
    first, second = _lse(ctx, u, [d], True, p)
    return lifted(u.first, p.ndim) - first, plus(u.second, times_or_none(second, -1))


@rule(aten._log_softmax.default)
def _log_softmax(ctx: Context, out: Tensor, u: Jet, dim: int, half_to_float: bool = False) -> Jet:
    return Jet(out, *_log_softmax_coefficients(ctx, u, axis(dim, out.ndim), torch.exp(out)))


@rule(aten._softmax.default)
def _softmax(ctx: Context, out: Tensor, u: Jet, dim: int, half_to_float: bool = False) -> Jet:
    log_p = Jet(out, *_log_softmax_coefficients(ctx, u, axis(dim, out.ndim), out))
    return chain(ctx, out, log_p, out, out)  # softmax = exp(log softmax)


@rule(aten._safe_softmax.default)
def _safe_softmax(ctx: Context, out: Tensor, u: Jet, dim: int, dtype: object = None) -> Jet:
    """softmax, 0 along rows that are all -inf (masked attention): the softmax rule with
    ``p = out`` gives zero coefficients there."""
    if dtype is not None:
        u = apply(ctx, aten._to_copy.default, u, dtype=dtype)
    return _softmax(ctx, out, u, dim)


@rule(aten.linalg_vector_norm.default)
def _vector_norm(
    ctx: Context, out: Tensor, u: Jet, ord: float = 2, dim: Dims = None, keepdim: bool = False,
    *, dtype: torch.dtype | None = None,
) -> Any:  # fmt: skip
    if dtype is not None:
        u = apply(ctx, aten._to_copy.default, u, dtype=dtype)
    dims = axes(dim, u.value.ndim)
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
    # autograd's convention: a zero norm has zero derivatives (they are unbounded there); the
    # root is taken of a total that is 1 there, so that no inf * 0 reaches the kernel's own
    # derivatives (gradients through the Laplacian) through the unselected branch of a where
    zero = out == 0
    safe = Jet(
        torch.where(zero, 1.0, total.value),
        torch.where(zero, 0.0, total.first),
        None if total.second is None else torch.where(zero, 0.0, total.second),
    )
    norm = apply(ctx, aten.pow.Tensor_Scalar, safe, 1 / ord)
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


def products_but(values: Tensor) -> tuple[Tensor, Tensor]:
    """``c_i = prod_{k != i} v_k`` and ``c_ij = prod_{k != i, j} v_k`` (0 on the diagonal) over
    the last dim of ``values``, from prefix, suffix and between-products: no division (exact at
    zeros), ``O(n^2)`` per row."""
    n = values.shape[-1]
    ones = values.new_ones((*values.shape[:-1], 1))
    before = torch.cat([ones, values[..., :-1]], -1).cumprod(-1)  # prod_{k < i}
    after = torch.cat([values[..., 1:], ones], -1).flip(-1).cumprod(-1).flip(-1)  # prod_{k > i}
    index = torch.arange(n, device=values.device)
    later = index[None, :] > index[:, None]  # (i, k): k > i
    between = torch.where(later, values[..., None, :], 1.0).cumprod(-1)  # prod_{i < k <= j}
    between = torch.cat([values.new_ones((*values.shape, 1)), between[..., :-1]], -1)  # k < j
    pairs = torch.where(later, before[..., :, None] * between * after[..., None, :], 0.0)
    return before * after, pairs + pairs.mT


@rule(aten.prod.dim_int, aten.prod.default)
def _prod(
    ctx: Context, out: Tensor, u: Jet, dim: int | None = None, keepdim: bool = False, *,
    dtype: torch.dtype | None = None,
) -> Jet:  # fmt: skip
    """``y = prod_i u_i``: first ``sum_i t_i c_i``, second ``sum_i s_i c_i + sum_{i != j} t_i t_j
    c_ij`` with the products-but-one and -two of :func:`products_but` (exact where factors are
    zero, unlike ``y / u_i``)."""
    if dtype is not None:
        u = apply(ctx, aten._to_copy.default, u, dtype=dtype)
    if dim is None:
        u, d = apply(ctx, aten.view.default, u, [-1]), 0
    else:
        d = axis(dim, u.value.ndim)
    order = [*(k for k in range(u.value.ndim) if k != d), d]
    u = apply(ctx, aten.permute.default, u, order)  # the reduced dim last
    c1, c2 = products_but(u.value)
    t = expanded(lifted(u.first, u.value.ndim), u.value.shape, [u.value.ndim - 1])
    first = (t * c1).sum(-1)

    def quadratic(a: Tensor, b: Tensor) -> Tensor:  # sum_ij a_i c_ij b_j
        return (a.unsqueeze(-2) @ (c2 @ b.unsqueeze(-1)))[..., 0, 0]

    second = ctx.pair(quadratic, t, t)
    if u.second is not None:
        second = second + (lifted(u.second, u.value.ndim) * c1).sum(-1)
    if keepdim and dim is not None:
        first, second = first.unsqueeze(d + 1), second.unsqueeze(d + 1)
    return Jet(out, first, second)
