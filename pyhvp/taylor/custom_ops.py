"""The custom ops a program uses besides aten's: what ``f``'s ``detach`` becomes, what a tensor
written in place under ``no_grad`` holds, and ``det`` where an instance is (nearly) singular.

This module must not use ``from __future__ import annotations``: ``torch.library.custom_op``
infers each op's schema from the annotations, and string annotations defeat it on older torch.
"""

from typing import cast

import torch

aten = torch.ops.aten
Tensor = torch.Tensor


@torch.library.custom_op("pyhvp::stop_gradient", mutates_args=())
def stop_gradient(t: Tensor) -> Tensor:
    """What ``f``'s own ``detach()`` becomes in a program: functionalization emits ``detach``
    as a plain alias, so ``f``'s stop-gradients are renamed before it runs (:mod:`.program`)."""
    return t.clone()


@stop_gradient.register_fake
def _(t: Tensor) -> Tensor:
    return torch.empty_like(t)


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


@torch.library.custom_op("pyhvp::det_by_svd", mutates_args=())
def det_by_svd(a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``aten._linalg_det`` where some instance is singular or nearly so
    (:func:`det_needs_svd`): the same values, but its jet rule goes through the SVD, which stays
    exact there, where the rule through ``A^-1`` cancels catastrophically. The recorder renames
    the op when it sees such an instance (:mod:`.recorder`), so the program -- keyed by the
    record -- runs this op's rule."""
    det, lu, pivots = aten._linalg_det.default(a)
    return det, lu, pivots


@det_by_svd.register_fake
def _(a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return cast(tuple[Tensor, Tensor, Tensor], aten._linalg_det.default(a))  # aten ops are untyped


DET_BY_SVD = torch.ops.pyhvp.det_by_svd.default


def det_needs_svd(lu: Tensor) -> bool:
    """Whether some matrix of a ``_linalg_det`` call is (nearly) singular, judged from its LU
    factors: the smallest pivot below ``eps^(1/3)`` times the largest. The inverse's rule then
    loses about ``eps * cond`` relative accuracy to cancellation (NaN for an exact or an
    LAPACK-rounded zero pivot), so the SVD form is used -- whatever LAPACK returns for the
    pivot: MKL gives ``-1.9e-17``, not ``0``, for two equal rows."""
    if lu.shape[-1] == 0 or lu.numel() == 0:
        return False
    pivots = lu.diagonal(dim1=-2, dim2=-1).abs()
    tolerance = torch.finfo(lu.dtype).eps ** (1 / 3)
    small = pivots.amin(-1) <= tolerance * pivots.amax(-1)
    return bool((small | ~pivots.isfinite().all(-1)).any())


@torch.library.custom_op("pyhvp::without_third_derivatives", mutates_args=())
def without_third_derivatives(coefficient: Tensor, op: str) -> Tensor:
    """``coefficient``, whose own derivatives (a third derivative of ``f``: the gradient of a
    Laplacian or diagonal) are refused: the fallback for ``op`` cannot give them correctly."""
    return coefficient.clone()


@without_third_derivatives.register_fake
def _(coefficient: Tensor, op: str) -> Tensor:
    return torch.empty_like(coefficient)


def _refuse_third_derivatives(ctx: object, grad: Tensor) -> None:
    raise RuntimeError(
        f"pyhvp: the gradient of a Laplacian or Hessian diagonal through {ctx.op} (a third "  # type: ignore[attr-defined]
        f"derivative) is not available: autograd's derivatives of that op's own second "
        f"derivatives are not reliable. Register a jet rule for it (pyhvp.register_jet_rule)"
    )


def _keep_op(ctx: object, inputs: tuple[object, ...], output: Tensor) -> None:
    ctx.op = inputs[1]  # type: ignore[attr-defined]


without_third_derivatives.register_autograd(_refuse_third_derivatives, setup_context=_keep_op)
WITHOUT_THIRD_DERIVATIVES = torch.ops.pyhvp.without_third_derivatives.default
