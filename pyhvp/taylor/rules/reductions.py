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
    NotAtThisOrder,
    axes,
    axis,
    broadcast_dims,
    broadcast_times,
    chain,
    coefficient_of,
    coefficients_of,
    dense_coefficients,
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
    higher = [None if t is None else fn(t) for t in dense_coefficients(u)[1:]]
    jet = Jet(out, (fn(u.first) if first is None else first, *higher))
    if dtype is None:
        return jet
    return linear(out, jet, lambda t: t.to(dtype))


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
    return (Jet(values, picked.coefficients), indices, *out[2:])


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
        count = max(math.prod(u.value.shape[d] for d in dims) - correction, 0)
        if root:  # the norm's rule: at an instance of equal entries, its one-sided jet (the
            # root of the variance's jet was NaN there, and std ** 2 NaN for var's 2)
            norm = apply(ctx, aten.linalg_vector_norm.default, centred, 2, dims, keepdim)
            spread = apply(ctx, aten.div.Tensor, norm, math.sqrt(count))
        else:
            squares = apply(ctx, aten.mul.Tensor, centred, centred)
            spread = apply(ctx, aten.div.Tensor, apply(ctx, aten.sum.dim_IntList, squares, dims,
                                                       keepdim), count)  # fmt: skip
        if not isinstance(out, tuple):
            return Jet(out, spread.coefficients)
        if not keepdim:
            mean = apply(ctx, aten.squeeze.dims, mean, dims)
        return Jet(out[0], spread.coefficients), Jet(out[1], mean.coefficients)

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


def _lse(ctx: Context, u: Jet, dims: list[int], keepdim: bool, value: Tensor,
         p: Tensor) -> Jet:  # fmt: skip
    """log sum exp over ``dims`` of ``u`` (value ``value``), with ``p = softmax(u)`` over them.
    Second order in closed form: first ``sum p t``, second ``sum p s + sum p t^2 - (sum p
    t)^2``; any order by :func:`_softmax_series`."""
    if ctx.order > 2:
        lse, _ = _softmax_series(ctx, u, dims, p, probabilities=False)
        reduced = [d + 1 for d in dims]
        return Jet(value, tuple(c if c is None or keepdim else c.squeeze(reduced) for c in lse))
    shifted = [d + 1 for d in dims]
    first = broadcast_times(u.first, p).sum(shifted, keepdim=keepdim)
    if ctx.order == 1:
        return Jet(value, (first,))
    spread = broadcast_times(ctx.square(u.first), p).sum(shifted, keepdim=keepdim)
    spread = spread - ctx.square(first)
    own = None if u.second is None else broadcast_times(u.second, p).sum(shifted, keepdim=keepdim)
    return Jet(value, (first, plus(own, spread)))


def _softmax_series(ctx: Context, u: Jet, dims: list[int], p: Tensor, probabilities: bool
                    ) -> tuple[list[Tensor | None], list[Tensor | None]]:  # fmt: skip
    """Coefficients of every order of ``L = logsumexp(u)`` (reduced dims kept) and, with
    ``probabilities``, of ``p = softmax(u)``, by the recursion of ``L' = sum p u'`` and ``p' =
    p (u' - L')`` (Leibniz on each product): ``L_k = sum_j C(k-1, j) sum p_j u_{k-j}`` and
    ``p_k = sum_j C(k-1, j) p_j (u_{k-j} - L_{k-j})``. Only ``p`` enters, never a logarithm or a
    quotient: entries masked by ``-inf`` (``p = 0``) have zero coefficients, and rows masked
    whole give zeros, not NaN."""
    nd, shifted = u.value.ndim, [d + 1 for d in dims]
    us = coefficients_of(u, nd, ctx.order)
    ps: list[Tensor | None] = [p]
    lse: list[Tensor | None] = []
    for k in range(1, ctx.order + 1):
        terms = [
            times_or_none(broadcast_times(cast(Tensor, us[k - j - 1]), pj)
                          if j == 0 else ctx.product(pj, cast(Tensor, us[k - j - 1]), k),
                          math.comb(k - 1, j))
            for j, pj in enumerate(ps[:k]) if pj is not None and us[k - j - 1] is not None
        ]  # fmt: skip
        total = plus(*terms)
        lse.append(None if total is None else total.sum(shifted, keepdim=True))
        if k == ctx.order and not probabilities:
            break
        spread = [
            None if pj is None else times_or_none(_times_difference(ctx, pj, us[k - j - 1],
                                                                    lse[k - j - 1], k, j == 0),
                                                  math.comb(k - 1, j))
            for j, pj in enumerate(ps[:k])
        ]  # fmt: skip
        ps.append(plus(*spread))
    return lse, ps[1:]


def _times_difference(ctx: Context, p: Tensor, a: Tensor | None, b: Tensor | None, order: int,
                      value: bool) -> Tensor | None:  # fmt: skip
    """``p (a - b)`` for coefficients ``a``, ``b`` (None: zero) and ``p`` a value (``value``)
    or a coefficient (then a term of an ``order`` coefficient, summed where it is collapsed)."""
    difference = plus(a, times_or_none(b, -1))
    if difference is None:
        return None
    return broadcast_times(difference, p) if value else ctx.product(p, difference, order)


def _finite_below(out: Tensor) -> Tensor:
    """A log-sum-exp's value with ``-inf`` (every term ``-inf``: a masked row) as 0: the weights
    ``e^(u - out)`` are then 0 there, as their limit along the masked terms' zero coefficients,
    not ``e^(-inf - -inf)`` (NaN, which a sum over the event spreads to every entry)."""
    return torch.where(out == -math.inf, 0.0, out)


@rule(aten.logsumexp.default)
def _logsumexp(ctx: Context, out: Tensor, u: Jet, dim: Dims, keepdim: bool = False) -> Jet:
    dims = axes(dim, u.value.ndim)
    p = torch.exp(u.value - _kept(_finite_below(out), u.value.shape, dims))
    return _lse(ctx, u, dims, keepdim, out, p)


def _logaddexp(scale: float) -> Rule:
    """``log(e^a + e^b)`` (``scale`` 1), or ``log2(2^a + 2^b)`` (``scale`` ln 2): a log-sum-exp
    of two, with weights ``p = e^(scale (a - out))`` and ``q = e^(scale (b - out))``: first
    ``p a' + q b'``, second ``p a'' + q b'' + scale p q (a' - b')^2``; any order as the
    log-sum-exp of ``scale (a, b)`` stacked (:func:`_softmax_series`), over ``scale``. The
    weights are 0 where an argument is ``-inf`` (a masked entry), and where both are
    (:func:`_finite_below`)."""

    def logaddexp_rule(ctx: Context, out: Tensor, a: Jet | Tensor, b: Jet | Tensor) -> Jet:
        nd, shift = out.ndim, _finite_below(out)
        p, q = (torch.exp(scale * (value_of(t) - shift)) for t in (a, b))
        if ctx.order > 2:
            full = [apply(ctx, aten.expand.default, t, list(out.shape)) for t in (a, b)]
            scaled = [t if scale == 1 else apply(ctx, aten.mul.Tensor, t, scale) for t in full]
            pair = apply(ctx, aten.stack.default, scaled, -1)
            weights = torch.stack([p.expand(out.shape), q.expand(out.shape)], -1)
            lse, _ = _softmax_series(ctx, pair, [nd], weights, probabilities=False)
            return Jet(out, tuple(None if c is None else c.squeeze(-1) / scale for c in lse))
        fa, fb = coefficient_of(a, nd, 1), coefficient_of(b, nd, 1)
        first = cast(Tensor, plus(None if fa is None else broadcast_times(fa, p),
                                  None if fb is None else broadcast_times(fb, q)))  # fmt: skip
        if ctx.order == 1:
            return Jet(out, (first,))
        sa, sb = coefficient_of(a, nd, 2), coefficient_of(b, nd, 2)
        apart = cast(Tensor, plus(fa, times_or_none(fb, -1)))  # a or b is a jet: not None
        second = plus(None if sa is None else broadcast_times(sa, p),
                      None if sb is None else broadcast_times(sb, q),
                      broadcast_times(ctx.square(apart), scale * p * q))  # fmt: skip
        return Jet(out, (first, second))

    return logaddexp_rule


rule(aten.logaddexp.default)(_logaddexp(1.0))
rule(aten.logaddexp2.default)(_logaddexp(math.log(2)))


@rule(aten._log_softmax.default)
def _log_softmax(ctx: Context, out: Tensor, u: Jet, dim: int, half_to_float: bool = False) -> Jet:
    """``log softmax(u) = u - logsumexp(u)`` along ``dim``."""
    lse = _lse(ctx, u, [axis(dim, out.ndim)], True, u.value - out, torch.exp(out))
    return Jet(out, apply(ctx, aten.sub.Tensor, u, lse).coefficients)


@rule(aten._softmax.default)
def _softmax(ctx: Context, out: Tensor, u: Jet, dim: int, half_to_float: bool = False) -> Jet:
    """softmax = exp(log softmax) at second order; any order by :func:`_softmax_series`."""
    d = axis(dim, out.ndim)
    if ctx.order > 2:
        return Jet(out, tuple(_softmax_series(ctx, u, [d], out, probabilities=True)[1]))
    lse = _lse(ctx, u, [d], True, out, out)  # (its value is not read)
    log_p = apply(ctx, aten.sub.Tensor, u, lse)
    return chain(ctx, out, log_p, *[out] * ctx.order)


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
    if ord == -math.inf:
        return apply(ctx, aten.amin.default, magnitude, dims, keepdim)
    # (zero where every entry is: torch's own norm of 1e-20s is 0 in float32)
    largest = magnitude.value.detach().amax(dims, keepdim=True)
    vector_zero = largest == 0
    zero = vector_zero if keepdim else vector_zero.squeeze(dims)
    if ord in (1, math.inf):  # abs' zero convention, one-sided at a zero vector (below)
        reduce = aten.sum.dim_IntList if ord == 1 else aten.amax.default
        return _one_sided_at_zero(ctx, out, apply(ctx, reduce, magnitude, dims, keepdim), u,
                                  ord, dims, keepdim, zero)  # fmt: skip
    # autograd's convention: a zero norm has zero derivatives (they are unbounded there); the
    # root, and the power of |u| (not u^2: smooth at 0), are taken of entries that are 1 there,
    # so that no inf * 0 reaches the kernel's own derivatives (gradients through the Laplacian)
    # through the unselected branch of a where (|u| ** 1.5 at a zero vector made them NaN)
    scale = _norm_scale(ctx, u, largest, ord, dims)
    scaled = apply(ctx, aten.div.Tensor, u if ord == 2 else magnitude, scale)
    base = scaled if ord == 2 else _where_not(vector_zero, scaled)
    total = apply(ctx, aten.sum.dim_IntList, apply(ctx, aten.pow.Tensor_Scalar, base, ord), dims,
                  keepdim)  # fmt: skip
    norm = apply(ctx, aten.mul.Tensor,
                 apply(ctx, aten.pow.Tensor_Scalar, _where_not(zero, total), 1 / ord),
                 scale if keepdim else scale.squeeze(dims))  # fmt: skip
    return _one_sided_at_zero(ctx, out, norm, u, ord, dims, keepdim, zero)


def _one_sided_at_zero(ctx: Context, out: Tensor, norm: Jet, u: Jet, ord: float, dims: list[int],
                       keepdim: bool, zero: Tensor) -> Jet:  # fmt: skip
    """``norm``'s jet (``|u|_ord``, ``ord > 0``), with zero derivatives at a zero vector
    (``zero``), but where ``u`` is affine there (``x``, ``x_i - x_j``): ``|u(eps)| = eps |u_1|``
    exactly for ``eps >= 0``, the one-sided jet along each direction, which ``|u| ** 2`` squares
    back into its smooth curvature (the Laplacian of ``exp(-|x| ** 2)`` at 0 was 0 for -6;
    for ``ord`` 1 and inf, 0 until 2026-12-08). Where ``u_1`` is zero too (a self-pair), all
    stay 0."""
    coefficients = [None if c is None else torch.where(zero, 0.0, c)
                    for c in dense_coefficients(norm)]  # fmt: skip
    if ord > 0 and not ctx.collapses(1) and all(c is None for c in u.coefficients[1:]):
        first = u.first.expand(u.first.shape[0], *u.value.shape)
        along = _norm_or_zero(first, ord, [d + 1 for d in dims], keepdim)
        coefficients[0] = torch.where(zero, along, cast(Tensor, coefficients[0]))
    return Jet(out, tuple(coefficients))


def _norm_scale(ctx: Context, u: Jet, largest: Tensor, ord: float, dims: list[int]) -> Tensor:
    """A power of two each vector of ``u`` is divided by before its norm (which is homogeneous),
    so that no intermediate of the rule leaves the dtype's normal range.

    With ``A`` the largest entry (``largest``, over ``dims`` kept), ``C`` the largest
    first-order coefficient and the scale ``A ** a * C ** (1 - a)``, the order-``K`` rule's
    extremes are the scaled coefficients to the ``K``-th power, ``(C / A) ** (a K)``, and the
    root's derivative, ``(A / C) ** ((1 - a) (1 - K ord))``; ``a`` balances the two. In float32
    the Laplacian of ``|x|`` was -inf at ``|x|`` of 1e-15 to 1e-18 and 9% off at 1e18 unscaled
    (until 2026-12-07); scaled by ``A`` alone its squared coefficients were 1e-38 at
    ``|x| = 1e19``, flushed to zero where denormals are (torch 2.5's compiled kernels turn that
    on for the process), and the Laplacian was 0."""
    # in powers of two: a zero or infinite A (a zero vector) takes 1, a zero or infinite C
    # takes A (A alone: u constant, or nothing better to know)
    log_largest = largest.log2()
    log_largest = torch.where(log_largest.isfinite(), log_largest, 0.0)
    log_steepest = _largest_first(u, dims).detach().to(largest.dtype).log2()
    log_steepest = torch.where(log_steepest.isfinite(), log_steepest, log_largest)
    order = ctx.order * ord - 1
    return torch.exp2(torch.lerp(log_steepest, log_largest, order / (order + ctx.order)).round())


def _largest_first(u: Jet, dims: list[int]) -> Tensor:
    """An upper bound of ``|u|``'s first-order coefficients over the directions and ``dims``
    (kept as size 1), without multiplying out a factored or diagonal coefficient."""
    c, ndim = u.coefficient, u.value.ndim
    if isinstance(c, DiagonalCoefficient):  # its basis entries are 0 and 1
        diagonal = c.diagonal
        if not isinstance(diagonal, Tensor):
            return u.value.new_tensor(abs(diagonal))
        return _right_aligned(diagonal.abs(), ndim).amax(dims, keepdim=True)
    if isinstance(c, FactoredCoefficient):
        return _right_aligned(c.factor.abs(), ndim).amax(dims, keepdim=True) * c.shared.abs().max()
    # over the directions first, then the value's dims: one reduction over both (the inner
    # dims strided) took 0.39 ms of a 1.5 ms Laplacian of |mlp(x)| (256 x 16), this 0.02
    return lifted(c, ndim).abs().amax(0).amax(dims, keepdim=True)


def _right_aligned(t: Tensor, ndim: int) -> Tensor:
    """``t`` with leading unit dims up to ``ndim`` (as it broadcasts against a value)."""
    return t.reshape((1,) * (ndim - t.ndim) + tuple(t.shape))


def _norm_or_zero(t: Tensor, ord: float, dims: list[int], keepdim: bool) -> Tensor:
    """``torch.linalg.vector_norm(t, ord, dims, keepdim)`` (``ord > 0``), 0 with zero
    derivatives of every order where the vector is zero (no ``inf * 0`` in a gradient through
    it)."""
    if ord == math.inf:
        return t.abs().amax(dims, keepdim)
    entry_zero = t == 0
    powered = t * t if ord == 2 else torch.where(
        entry_zero, 0.0, torch.where(entry_zero, 1.0, t.abs()) ** ord)  # fmt: skip
    total = powered.sum(dims, keepdim)
    vector_zero = total == 0
    return torch.where(vector_zero, 0.0, torch.where(vector_zero, 1.0, total) ** (1 / ord))


def _where_not(mask: Tensor, jet: Jet) -> Jet:
    """``jet`` where ``mask`` is False; the constant 1 (no derivatives) where it is True."""
    return Jet(torch.where(mask, 1.0, jet.value),
               tuple(None if c is None else torch.where(mask, 0.0, c)
                     for c in dense_coefficients(jet)))  # fmt: skip


@rule(aten._cdist_forward.default, aten._euclidean_dist.default)
def _cdist(
    ctx: Context, out: Tensor, a: object, b: object, p: float = 2, compute_mode: object = None
) -> Any:
    rows = apply(ctx, aten.unsqueeze.default, a, -2)  # (..., P, 1, M)
    columns = apply(ctx, aten.unsqueeze.default, b, -3)  # (..., 1, R, M)
    difference = apply(ctx, aten.sub.Tensor, rows, columns)
    distance = apply(ctx, aten.linalg_vector_norm.default, difference, p, [-1])
    return Jet(out, distance.coefficients) if isinstance(distance, Jet) else out


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
    if ctx.order > 2:  # the reduced dim, last and of size 1, back in its place or dropped
        product = apply(ctx, aten.squeeze.dim, _product_tree(ctx, u), -1)
        if keepdim and dim is not None:
            product = apply(ctx, aten.unsqueeze.default, product, d)
        return Jet(out, product.coefficients)
    c1, c2 = products_but(u.value)
    t = expanded(lifted(u.first, u.value.ndim), u.value.shape, [u.value.ndim - 1])
    first = (t * c1).sum(-1)
    if ctx.order == 1:
        return Jet(out, (first.unsqueeze(d + 1) if keepdim and dim is not None else first,))

    def quadratic(a: Tensor, b: Tensor) -> Tensor:  # sum_ij a_i c_ij b_j
        return (a.unsqueeze(-2) @ (c2 @ b.unsqueeze(-1)))[..., 0, 0]

    second = ctx.pair(quadratic, t, t)
    if u.second is not None:
        second = second + (lifted(u.second, u.value.ndim) * c1).sum(-1)
    if keepdim and dim is not None:
        first, second = first.unsqueeze(d + 1), second.unsqueeze(d + 1)
    return Jet(out, (first, second))


def _product_tree(ctx: Context, u: Jet) -> Jet:
    """The product over ``u``'s last dim, kept as size 1, by pairwise products (Leibniz at each
    level; exact where factors are zero): ``log2(n)`` levels of one product each."""
    while u.value.shape[-1] > 1:
        n = u.value.shape[-1]
        pairs = apply(ctx, aten.mul.Tensor, apply(ctx, aten.slice.Tensor, u, -1, 0, n - n % 2, 2),
                      apply(ctx, aten.slice.Tensor, u, -1, 1, n, 2))  # fmt: skip
        if n % 2:
            pairs = apply(ctx, aten.cat.default, [pairs, apply(ctx, aten.slice.Tensor, u, -1,
                                                               n - 1, n)], -1)  # fmt: skip
        u = pairs
    if u.value.shape[-1] == 0:  # the empty product: 1, a constant
        raise NotAtThisOrder("the product of no elements")
    return u


@rule(aten.cumprod.default)
def _cumprod(ctx: Context, out: Tensor, u: Jet, dim: int, *,
             dtype: torch.dtype | None = None) -> Any:  # fmt: skip
    """``y_i = prod_{k <= i} u_k`` along ``dim`` by a Hillis-Steele scan: at shift ``s`` =
    1, 2, 4, ... each entry from ``s`` on is multiplied by the one ``s`` before it, ``ceil(log2
    n)`` levels of one product each (Leibniz, any order; exact where factors are zero, no
    division). Without it ``cumprod`` took the dense reverse-mode fallback over the whole tensor
    (its batch is no instance of the op's), refused past about 90 elements at second order and
    12 at fourth: an operator of order 3 or more, or a Laplacian nested in a Laplacian, over an
    ``f`` with a product was refused at any batch size, since the second-order ``prod`` rule's
    kernel (:func:`products_but`) holds ``cumprod``."""
    if dtype is not None:
        u = apply(ctx, aten._to_copy.default, u, dtype=dtype)
    if u.value.ndim == 0:  # one element: the product is the element
        return Jet(out, u.coefficients)
    d = axis(dim, u.value.ndim)
    n = u.value.shape[d]
    scanned: Any = u
    shift = 1
    while shift < n:
        head = apply(ctx, aten.slice.Tensor, scanned, d, 0, shift)
        tail = apply(ctx, aten.mul.Tensor, apply(ctx, aten.slice.Tensor, scanned, d, shift, n),
                     apply(ctx, aten.slice.Tensor, scanned, d, 0, n - shift))  # fmt: skip
        scanned = apply(ctx, aten.cat.default, [head, tail], d)
        shift *= 2
    return Jet(out, scanned.coefficients) if isinstance(scanned, Jet) else out
