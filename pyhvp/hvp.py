"""Per-instance gradients and Hessian-vector products of batched functions.

A batched function ``f(x, *args)`` returns one value per instance: the last ``event_dims`` dims of
``x`` are one instance's variables, the leading dims index instances. Instances are independent, so
the Hessian of ``f(x).sum()`` is block-diagonal and one second-order pass over the whole batch
yields every instance's own gradient and its own Hessian times its own vector.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.func import vmap

from pyhvp._checks import (
    check_args,
    check_chunk_size,
    check_event_dims,
    check_output_shape,
    check_tangents,
    pad_arg_to_batch,
    per_arg_event_dims,
    require_floating,
)
from pyhvp.backends import Backend, resolve_backend

BatchedFunction = Callable[..., torch.Tensor]


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
    The torch backend runs reverse-over-reverse autograd eagerly and a compiled
    forward-over-reverse kernel for repeated calls (see :mod:`pyhvp.backends.torch`). Inputs are never modified.

    >>> x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])          # 2 instances, f = sum(x**3)
    >>> g, hv = grad_and_hvp(lambda x: (x**3).sum(-1), x, torch.ones_like(x))
    >>> torch.equal(g, 3 * x**2), torch.equal(hv, 6 * x)    # H = diag(6 x) per instance
    (True, True)
    """
    x = require_floating("x", x)
    event_dims = check_event_dims(event_dims, x)
    tangents, single = check_tangents("v", v, x)
    check_args(args, x)
    chunk_size = check_chunk_size(chunk_size)
    g, hv = resolve_backend(backend).grad_and_hvp(f, x, tangents, args, event_dims, chunk_size)
    return g, (hv[0] if single else hv)


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


def per_instance(
    f_single: Callable[..., torch.Tensor],
    event_dims: int = 1,
    arg_event_dims: int | Sequence[int] | None = None,
) -> BatchedFunction:
    """Turn a single-instance function into a batched one (vmap over all batch dims, no copies).

    ``f_single(x_i, *args_i)`` takes one instance's variables (``event_dims`` dims) and returns a
    scalar. The batched ``f(x, *args)`` returns ``x.shape[:-event_dims]``. Each tensor arg has
    ``arg_event_dims`` trailing per-instance dims (default: ``event_dims``; an int for all args or
    one per arg) and leading dims that broadcast against x's batch dims, so a ``mu`` of shape
    ``(n_g, 1, 1, d)`` is shared across the middle batch dims without being expanded.

    >>> f = per_instance(lambda x, mu: ((x - mu) ** 2).sum())
    >>> f(torch.ones(4, 3), torch.zeros(3))
    tensor([3., 3., 3., 3.])
    """
    if isinstance(event_dims, bool) or not isinstance(event_dims, int) or event_dims < 1:
        raise ValueError(f"event_dims must be a positive int, got {event_dims!r}")

    def batched(x: torch.Tensor, *args: object) -> torch.Tensor:
        x = require_floating("x", x)
        check_event_dims(event_dims, x)
        batch_shape = x.shape[: x.ndim - event_dims]
        own_dims = per_arg_event_dims(arg_event_dims, event_dims, len(args))
        args = tuple(
            pad_arg_to_batch(f"args[{i}]", a, d, batch_shape) if isinstance(a, torch.Tensor) else a
            for i, (a, d) in enumerate(zip(args, own_dims, strict=True))
        )
        out = _vmap_batch_dims(f_single, len(batch_shape))(x, *args)
        check_output_shape(
            "f_single", out, batch_shape, "a scalar per instance, batched over x's batch dims"
        )
        return out

    batched.__name__ = f"per_instance({getattr(f_single, '__name__', 'f')})"
    batched.__doc__ = f_single.__doc__
    return batched


def _vmap_batch_dims(f_single: Callable[..., torch.Tensor], n_batch: int) -> BatchedFunction:
    """Nest one vmap per batch dim; an arg of size 1 in that dim is shared (in_dims=None)."""
    if n_batch == 0:
        return f_single
    inner = _vmap_batch_dims(f_single, n_batch - 1)

    def over_leading_dim(x: torch.Tensor, *args: object) -> torch.Tensor:
        in_dims = [0] + [
            None if not isinstance(a, torch.Tensor) or a.shape[0] == 1 else 0 for a in args
        ]
        args = tuple(
            a[0] if isinstance(a, torch.Tensor) and d is None else a
            for a, d in zip(args, in_dims[1:], strict=True)
        )
        return vmap(inner, in_dims=tuple(in_dims))(x, *args)

    return over_leading_dim
