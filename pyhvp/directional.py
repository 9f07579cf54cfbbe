"""Derivatives of any order along one direction per instance: Taylor mode of order K.

One jet of order K carries the value and K coefficients of every intermediate along the
direction ``v`` (Faa di Bruno's formula for elementwise functions, Leibniz's rule for products,
linear ops coefficient by coefficient), so ``u_xxxx`` is one forward pass with five streams of
numbers, not four nested backward passes. Runs on the backend's optional ``taylor_coefficients``
primitive (:mod:`pyhvp.backends`; the torch backend's engine is :mod:`pyhvp.taylor`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pyhvp import _estimators as est
from pyhvp._checks import as_int, check_args, fmt_shape, require_floating, require_like
from pyhvp._public import public_operator
from pyhvp.backends import Backend, require_primitive, resolve_backend
from pyhvp.instances import check_event_dims_of


@public_operator
def directional_derivatives(
    f: Callable[..., torch.Tensor],
    x: torch.Tensor,
    v: torch.Tensor,
    *args: object,
    order: int,
    event_dims: int = 1,
    backend: str | Backend = "torch",
) -> torch.Tensor:
    """``d^k/dt^k f(x + t v)`` at ``t = 0`` for ``k = 0..order``, stacked on a new leading
    axis: shape ``(order + 1, *batch, *out)``, in ``x``'s dtype.

    Shapes: ``f(x, *args)`` returns ``batch_shape + out_shape`` (``batch_shape =
    x.shape[:-event_dims]``); ``v`` is one direction per instance (``x``'s shape) or one shared
    by every instance (``event_shape``). Entry 0 is ``f(x)``, entry 1 the directional
    derivative, entry ``k`` the ``k``-th: with ``v = e_i``, ``d^k f / dx_i^k`` (``u_xxxx`` is
    ``v = e_0, order=4``). One Taylor jet of order ``order``: cost about ``order + 1``
    evaluations of ``f``'s linear ops, plus ``O(order^2)`` elementwise work per nonlinear op.
    Results are differentiable in ``x``, ``v``, ``args`` and the tensors ``f`` captures (the
    jet kernel's inputs), as the Laplacian's are.

    >>> x = torch.tensor([[1.0, 2.0]])
    >>> directional_derivatives(lambda x: (x**4).sum(-1), x, torch.tensor([1.0, 0.0]), order=4)
    tensor([[17.],
            [ 4.],
            [12.],
            [24.],
            [24.]])
    """
    x = require_floating("x", x)
    event_dims = check_event_dims_of(f, event_dims, x)
    check_args(args, x)
    order = check_order(order)
    space = est.Space(x, event_dims)
    direction = _direction(v, x, space)
    taylor_coefficients = require_primitive(resolve_backend(backend), "taylor_coefficients",
                                            "pyhvp.directional_derivatives")  # fmt: skip
    coefficients = taylor_coefficients(est.checked(f, space.batch), x, direction, args, None,
                                       order=order, outputs=tuple(range(order + 1)))  # fmt: skip
    # in x's dtype, as every derivative w.r.t. x (f(x) too: one tensor holds them)
    return torch.stack([coefficients[0].to(x.dtype), *(c[0] for c in coefficients[1:])])


def check_order(order: object, least: int = 1) -> int:
    """A derivative order: an int >= ``least``."""
    k = as_int(order)
    if k is None or k < least:
        raise ValueError(f"order must be an int >= {least}, got {order!r}")
    return k


def _direction(v: object, x: torch.Tensor, space: est.Space) -> torch.Tensor:
    """``v`` as one direction ``(1, *x.shape)`` per instance, or ``(1, 1, ..., 1, *event)``
    shared; any other shape is refused (never broadcast)."""
    v = require_floating("v", v)
    require_like("v", v, "x", x)
    if tuple(v.shape) == tuple(x.shape):
        return v[None]
    if tuple(v.shape) == space.event:
        return v.reshape(1, *(1,) * len(space.batch), *space.event)
    raise ValueError(
        f"v must have x's shape {fmt_shape(x.shape)} (one direction per instance) or the "
        f"event's shape {fmt_shape(space.event)} (one shared by every instance), got "
        f"{fmt_shape(v.shape)}"
    )
