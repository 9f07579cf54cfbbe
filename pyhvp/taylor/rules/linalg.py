"""Linear algebra (what Slater determinants and their kin need): det, slogdet, inverse,
solve."""

from __future__ import annotations

import operator

import torch

from pyhvp.taylor.custom_ops import SINGULAR_DET
from pyhvp.taylor.jets import (
    Context,
    Jet,
    expanded,
    value_of,
)
from pyhvp.taylor.registry import apply, rule
from pyhvp.taylor.rules.matmul import matmul_jet

aten = torch.ops.aten
Tensor = torch.Tensor


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
    x = matmul_jet(ctx, value, *((inverse, rhs) if left else (rhs, inverse)))
    if vector:
        x = Jet(out[0], x.first.squeeze(dim), None if x.second is None else x.second.squeeze(dim))
    return (x, *out[1:])
