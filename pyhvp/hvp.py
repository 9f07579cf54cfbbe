"""Per-instance gradients and Hessian-vector products of batched functions.

A batched function ``f(x, *args)`` returns one value per instance: the last ``event_dims`` dims of
``x`` are one instance's variables, the leading dims index instances. Instances are independent, so
the Hessian of ``f(x).sum()`` is block-diagonal and one second-order pass over the whole batch
yields every instance's own gradient and its own Hessian times its own vector.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pyhvp._checks import (
    check_args,
    check_chunk_size,
    check_tangents,
    require_floating,
    unshared,
)
from pyhvp._public import public_operator
from pyhvp.backends import Backend, resolve_backend
from pyhvp.instances import check_event_dims_of

BatchedFunction = Callable[..., torch.Tensor]


@public_operator
def grad_and_hvp(
    f: BatchedFunction,
    x: torch.Tensor,
    v: torch.Tensor,
    *args: object,
    event_dims: int = 1,
    chunk_size: int | None = None,
    backend: str | Backend = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-instance gradient and Hessian-vector product(s) from one second-order pass.

    Shapes: ``f(x, *args)`` has shape ``x.shape[:-event_dims]``; ``v`` has x's shape (one tangent
    per instance) or ``(k, *x.shape)`` (k tangents per instance); returns ``g`` of x's shape and
    ``hv`` of v's shape. ``chunk_size`` bounds how many of the k tangents are pushed at once.
    The torch backend runs reverse-over-reverse, eagerly with autograd and, once repeated calls
    pay for it, as a compiled ``vjp(grad(f))`` (see :mod:`pyhvp.backends.torch`). Inputs are
    never modified by pyhvp; an ``f`` that writes to ``x`` is refused (under ``torch.no_grad()``,
    which autograd allows, after the write). Results carry derivatives in ``x``, ``v`` and
    ``args`` alone: tensors ``f`` captures (a module's parameters) are constants of them, without
    a warning, so a loss term made of an HVP gives those parameters no gradient; pass them as
    args (``functional_call``'s dict) to differentiate through them.

    >>> x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])          # 2 instances, f = sum(x**3)
    >>> g, hv = grad_and_hvp(lambda x: (x**3).sum(-1), x, torch.ones_like(x))
    >>> torch.equal(g, 3 * x**2), torch.equal(hv, 6 * x)    # H = diag(6 x) per instance
    (True, True)
    """
    x = require_floating("x", x)
    event_dims = check_event_dims_of(f, event_dims, x)
    tangents, single = check_tangents("v", v, x)
    check_args(args, x)
    chunk_size = check_chunk_size(chunk_size)
    g, hv = resolve_backend(backend).grad_and_hvp(f, x, tangents, args, event_dims, chunk_size)
    # autograd's gradient of a sum over x is one value expanded over x's shape
    return unshared(g), (hv[0] if single else hv)


def hvp(
    f: BatchedFunction,
    x: torch.Tensor,
    v: torch.Tensor,
    *args: object,
    event_dims: int = 1,
    chunk_size: int | None = None,
    backend: str | Backend = "torch",
) -> torch.Tensor:
    """Per-instance Hessian-vector product(s): ``grad_and_hvp(...)[1]``, same shape as ``v``.

    >>> x = torch.tensor([[1.0, 2.0]])
    >>> hvp(lambda x: (x**3).sum(-1), x, torch.tensor([[1.0, 0.0]]))   # H e_1 = (6 x_1, 0)
    tensor([[6., 0.]])
    """
    return grad_and_hvp(
        f, x, v, *args, event_dims=event_dims, chunk_size=chunk_size, backend=backend
    )[1]
