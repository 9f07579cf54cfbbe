"""The custom ops a program uses besides aten's: what ``f``'s ``detach`` becomes, what a tensor
written in place under ``no_grad`` holds, and ``det`` where an instance is singular.

This module must not use ``from __future__ import annotations``: ``torch.library.custom_op``
infers each op's schema from the annotations, and string annotations defeat it on older torch.
"""

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
