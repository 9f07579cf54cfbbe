"""Linear algebra (what Slater determinants and their kin need): det, slogdet, inverse,
solve."""

from __future__ import annotations

import math
import operator
from typing import Any, cast

import torch

from pyhvp.taylor.custom_ops import DET_BY_SVD
from pyhvp.taylor.fallbacks import general_fallback
from pyhvp.taylor.jets import (
    Context,
    Jet,
    chain,
    dense_coefficients,
    expanded,
    plus,
    times_or_none,
    value_of,
)
from pyhvp.taylor.registry import apply, rule
from pyhvp.taylor.rules.matmul import matmul_jet
from pyhvp.taylor.rules.reductions import products_but

aten = torch.ops.aten
Tensor = torch.Tensor


def _matrix_coefficients(u: Jet, order: int) -> list[Tensor | None]:
    """Coefficients of orders 1..``order`` of a matrix jet, with full matrix dims."""
    shape, nd = u.value.shape, u.value.ndim
    dims = [nd - 2, nd - 1]
    return [None if c is None else expanded(c, shape, dims) for c in dense_coefficients(u)[:order]]


def _first_two(a: Jet) -> tuple[Tensor, Tensor | None]:
    """A matrix jet's first and second coefficients (the second None at first order)."""
    ts = _matrix_coefficients(a, 2)
    return cast(Tensor, ts[0]), ts[1] if len(ts) > 1 else None


def _trace(m: Tensor) -> Tensor:
    return m.diagonal(dim1=-2, dim2=-1).sum(-1)


def _solved(a: Tensor, b: Tensor) -> Tensor:
    """``A^-1 B`` without raising (nor synchronising) on a singular A: non-finite there."""
    return cast(Tensor, torch.linalg.solve_ex(a, b)[0])  # torch.linalg's results are untyped


def _inverse_series(ctx: Context, b: Tensor, ts: list[Tensor | None], order: int
                    ) -> list[Tensor | None]:  # fmt: skip
    """Coefficients 1..``order`` of ``B = A^-1`` (``b`` its value) from ``A``'s (``ts``), by
    Leibniz on ``A B = I``: ``B_k = -B sum_{j=1..k} C(k, j) A_j B_{k-j}``."""
    bs: list[Tensor | None] = [b]
    for k in range(1, order + 1):
        terms = [None if ts[k - 1] is None else cast(Tensor, ts[k - 1]) @ b]
        for j in range(1, k):
            aj, bj = ts[j - 1], bs[k - j]
            if aj is not None and bj is not None:
                terms.append(times_or_none(ctx.pair(operator.matmul, aj, bj, k), math.comb(k, j)))
        total = plus(*terms)
        bs.append(None if total is None else -(b @ total))
    return bs[1:]


def _log_det_coefficients(ctx: Context, a: Jet) -> list[Tensor | None]:
    """log|det A| (non-finite for a singular A, where log|det| is -inf, as autograd's): second
    order in closed form, first ``tr(A^-1 T)``, second ``tr(A^-1 S) - tr(A^-1 T A^-1 T)``; any
    order by Leibniz on ``L' = tr(A^-1 A')``: ``L_k = sum_j C(k-1, j) tr(B_j A_{k-j})``."""
    ts = _matrix_coefficients(a, ctx.order)
    if ctx.order > 2:
        inverse = cast(Tensor, torch.linalg.inv_ex(a.value)[0])
        bs = [inverse, *_inverse_series(ctx, inverse, ts, ctx.order - 1)]
        out: list[Tensor | None] = []
        for k in range(1, ctx.order + 1):
            terms = [
                times_or_none(_trace(bj @ cast(Tensor, ts[k - j - 1])) if j == 0 else
                              ctx.pair(lambda x, y: _trace(x @ y), bj, cast(Tensor, ts[k - j - 1]), k),
                              math.comb(k - 1, j))
                for j, bj in enumerate(bs[:k]) if bj is not None and ts[k - j - 1] is not None
            ]  # fmt: skip
            out.append(plus(*terms))
        return out
    t = cast(Tensor, ts[0])
    m = _solved(a.value, t)  # A^-1 T, one per direction
    if ctx.order == 1:
        return [_trace(m)]
    second = -ctx.pair(operator.mul, m, m.mT).sum((-2, -1))
    s = ts[1]
    if s is not None:
        second = second + _trace(_solved(a.value, s))
    return [_trace(m), second]


@rule(aten._linalg_det.default)
def _det(ctx: Context, out: tuple[Tensor, Tensor, Tensor], a: Jet) -> tuple[Jet, Tensor, Tensor]:
    """det = sign exp(log|det|): Faa di Bruno of exp on the log-determinant's jet. Only for
    well-conditioned instances: a record with a (nearly) singular one runs
    :func:`~pyhvp.taylor.custom_ops.det_by_svd` instead."""
    det = out[0]
    log_det = Jet(det, tuple(_log_det_coefficients(ctx, a)))
    return (chain(ctx, det, log_det, *[det] * ctx.order), *out[1:])


@rule(DET_BY_SVD)
def _det_by_svd(
    ctx: Context, out: tuple[Tensor, Tensor, Tensor], a: Jet
) -> tuple[Jet, Tensor, Tensor]:
    """det through the SVD ``A = U diag(s) V^T``, exact for (nearly) singular A: with
    ``P = U^T T V`` and ``c_i``, ``c_ij`` the products of the singular values but the i-th (and
    j-th), ``det(A + tT) = det(U) det(V) det(diag(s) + tP)`` has first derivative
    ``sum_i P_ii c_i`` and second ``sum_{i != j} (P_ii P_jj - P_ij P_ji) c_ij`` (times
    ``det(U) det(V)``)."""
    ctx.require(2, "det of a (nearly) singular matrix")
    t, s = _first_two(a)
    u, sigma, vh = torch.linalg.svd(a.value)
    sign = torch.linalg.det(u) * torch.linalg.det(vh)
    c1, c2 = products_but(sigma)

    def rotated(m: Tensor) -> Tensor:
        return cast(Tensor, u.mT @ m @ vh.mT)  # torch.linalg's results are untyped

    def diagonal(m: Tensor) -> Tensor:
        return m.diagonal(dim1=-2, dim2=-1)

    def minors(m: Tensor, w: Tensor) -> Tensor:  # P_ii W_jj - P_ij W_ji, per pair (i, j)
        return diagonal(m)[..., :, None] * diagonal(w)[..., None, :] - m * w.mT

    p = rotated(t)
    first = sign * (diagonal(p) * c1).sum(-1)
    if ctx.order == 1:
        return (Jet(out[0], (first,)), *out[1:])
    second = sign * (ctx.pair(minors, p, p) * c2).sum((-2, -1))
    if s is not None:
        second = second + sign * (diagonal(rotated(s)) * c1).sum(-1)
    return (Jet(out[0], (first, second)), *out[1:])


@rule(aten._linalg_slogdet.default)
def _slogdet(
    ctx: Context, out: tuple[Tensor, Tensor, Tensor, Tensor], a: Jet
) -> tuple[Tensor, Jet, Tensor, Tensor]:
    sign, logabsdet = out[0], out[1]
    return (sign, Jet(logabsdet, tuple(_log_det_coefficients(ctx, a))), *out[2:])


@rule(aten.linalg_inv_ex.default)
def _inverse(
    ctx: Context, out: tuple[Tensor, Tensor], a: Jet, check_errors: bool = False
) -> tuple[Jet, Tensor]:
    """B = A^-1: B' = -B T B; B'' = 2 B T B T B - B S B; any order by
    :func:`_inverse_series`."""
    b = out[0]
    ts = _matrix_coefficients(a, ctx.order)
    if ctx.order != 2:
        return Jet(b, tuple(_inverse_series(ctx, b, ts, ctx.order))), out[1]
    t, s = cast(Tensor, ts[0]), ts[1]
    bt = b @ t
    second = 2 * ctx.pair(operator.matmul, bt, bt) @ b
    if s is not None:
        second = second - b @ s @ b
    return Jet(b, (-bt @ b, second)), out[1]


@rule(aten._linalg_solve_ex.default)
def _solve(ctx: Context, out: tuple[Tensor, Tensor, Tensor, Tensor], a: Jet | Tensor,
           b: Jet | Tensor, left: bool = True,
           check_errors: bool = False) -> tuple[Jet, Tensor, Tensor, Tensor]:  # fmt: skip
    """X = A^-1 B (left) or B A^-1, as the product of the inverse's jet with B's."""
    inverse = apply(ctx, aten.linalg_inv_ex.default, a)[0]
    va, vb = value_of(a), value_of(b)
    # torch's rule (linalg_solve_is_vector_rhs): B is a (batch of) vector(s) iff it is 1-D or
    # has exactly A's shape without its last dim
    vector = vb.ndim == 1 or tuple(vb.shape) == tuple(va.shape[:-1])
    dim = -1 if left else -2  # a column, or a row for X A = B
    rhs = apply(ctx, aten.unsqueeze.default, b, dim) if vector else b
    value = out[0].unsqueeze(dim) if vector else out[0]
    x = matmul_jet(ctx, value, *((inverse, rhs) if left else (rhs, inverse)))
    if vector:
        x = Jet(out[0], tuple(None if c is None else c.squeeze(dim) for c in dense_coefficients(x)))
    return (x, *out[1:])


@rule(aten._linalg_eigh.default)
def _eigenvalues(
    ctx: Context, out: tuple[Tensor, Tensor], a: Jet, uplo: str = "L", compute_v: bool = True
) -> Any:
    """Eigenvalues of a symmetric matrix (``eigvalsh``: ``compute_v=False``), by perturbation
    theory in autograd's convention (the whole coefficient ``T`` perturbs ``A``): with
    ``M = V^T T V``, ``l_i' = M_ii`` and ``l_i'' = (V^T S V)_ii + sum_{j != i} M_ji (M_ij + M_ji) /
    (l_i - l_j)``. Eigenvectors, when computed, go to the fallback."""
    if compute_v or ctx.order > 2:
        return general_fallback(ctx, aten._linalg_eigh.default, out, (a, uplo, compute_v), {})
    t, s = _first_two(a)
    eigenvalues, vectors = torch.linalg.eigh(a.value, UPLO=uplo)
    n = eigenvalues.shape[-1]
    off = ~torch.eye(n, dtype=torch.bool, device=eigenvalues.device)
    gaps = eigenvalues[..., :, None] - eigenvalues[..., None, :]  # l_i - l_j
    inverse_gaps = torch.where(off, 1 / torch.where(off, gaps, 1.0), 0.0)

    def rotated(m: Tensor) -> Tensor:
        return cast(Tensor, vectors.mT @ m @ vectors)  # torch.linalg's results are untyped

    def curvature(m: Tensor, w: Tensor) -> Tensor:  # sum_j M_ji (W_ij + W_ji) / (l_i - l_j)
        return (m.mT * (w + w.mT) * inverse_gaps).sum(-1)

    m = rotated(t)
    first = m.diagonal(dim1=-2, dim2=-1)
    if ctx.order == 1:
        return Jet(out[0], (first,)), out[1]
    second = ctx.pair(curvature, m, m)
    if s is not None:
        second = second + rotated(s).diagonal(dim1=-2, dim2=-1)
    return Jet(out[0], (first, second)), out[1]


@rule(aten.linalg_matrix_exp.default)
def _matrix_exp(ctx: Context, out: Tensor, a: Jet) -> Jet:
    """``exp(A(t))``'s coefficients of every order from one matrix exponential of the block
    upper-triangular Toeplitz matrix with blocks ``A, A_1, A_2 / 2!, ...`` (Mathias 1996): its
    first block row holds ``exp(A(t))``'s Taylor coefficients ``E_k / k!``. The dense fallback
    nested ``jacrev`` of autograd's formula (itself a matrix exponential of twice the size), which
    asked for over 8 GB for a 2x2 matrix at fourth order. A collapsed top coefficient enters
    linearly, by the Frechet derivative ``exp([[A, A_K], [0, A]])``'s upper right block."""
    order, value = ctx.order, a.value
    n, batch = value.shape[-1], value.shape[:-2]
    ts = _matrix_coefficients(a, order)
    top_collapsed = ctx.collapses()
    per = [None if k == order and top_collapsed else t for k, t in enumerate(ts, 1)]
    lead = max((t.shape[0] for t in per if t is not None), default=1)  # K, or 1 where summed
    size = (order + 1) * n
    m = value.new_zeros((lead, *batch, size, size))
    for i in range(order + 1):
        for d in range(order + 1 - i):
            block = value if d == 0 else per[d - 1]
            if block is None:
                continue
            scaled = block if d == 0 else block / math.factorial(d)
            m[..., i * n : (i + 1) * n, (i + d) * n : (i + d + 1) * n] = scaled
    e = torch.linalg.matrix_exp(m)
    coefficients: list[Tensor | None] = [
        math.factorial(d) * e[..., :n, d * n : (d + 1) * n] for d in range(1, order + 1)
    ]
    if top_collapsed:
        top = ctx.summed(cast(Tensor, coefficients[-1]))
        if ts[-1] is not None:
            c = ts[-1]
            pair = value.new_zeros((c.shape[0], *batch, 2 * n, 2 * n))
            pair[..., :n, :n] = value
            pair[..., n:, n:] = value
            pair[..., :n, n:] = c
            top = top + torch.linalg.matrix_exp(pair)[..., :n, n:]
        coefficients[-1] = top
    return Jet(out, tuple(coefficients))
