"""Instance structure: batched functions built from single-instance ones.

``per_instance(f_single)`` turns a function of ONE instance into a batched function by nesting
one ``vmap`` per batch dim. The result is a :class:`PerInstance` value that keeps what it was
built from (``f_single``, ``event_dims``, ``arg_event_dims``), so operators can exploit the
structure (e.g. push basis directions inside the instance vmap, where they are the same for every
instance), and two wrappers of the same function compare equal (one compile cache entry).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.func import vmap

from pyhvp._checks import (
    check_event_dims,
    pad_arg_to_batch,
    per_arg_event_dims,
    require_floating,
)


@dataclass(frozen=True)
class PerInstance:
    """A batched function made of a single-instance one: ``f(x, *args)[b] = f_single(x[b], *args[b])``.

    ``f_single`` takes one instance's variables (``event_dims`` dims) and args, and returns a
    tensor of any shape ``out_shape`` (``()`` for a scalar); the batched call returns
    ``x.shape[:-event_dims] + out_shape``. Build it with :func:`per_instance`.
    """

    f_single: Callable[..., torch.Tensor]
    event_dims: int = 1
    arg_event_dims: int | tuple[int, ...] | None = None

    @property
    def __name__(self) -> str:  # what messages and warnings print
        return f"per_instance({getattr(self.f_single, '__name__', 'f')})"

    def batch_args(self, x: torch.Tensor, args: Sequence[object]) -> tuple[object, ...]:
        """Tensor args viewed as ``batch-broadcastable dims + own dims`` (checked, no copy)."""
        batch_shape = x.shape[: x.ndim - self.event_dims]
        own_dims = per_arg_event_dims(self.arg_event_dims, self.event_dims, len(args))
        return tuple(
            pad_arg_to_batch(f"args[{i}]", a, d, batch_shape) if isinstance(a, torch.Tensor) else a
            for i, (a, d) in enumerate(zip(args, own_dims, strict=True))
        )

    def map(self, fn_single: Callable[..., object], x: torch.Tensor, *args: object) -> object:
        """``fn_single(x_b, *args_b)`` for every instance ``b``, stacked over x's batch dims.

        ``fn_single`` may return a tensor or a tuple of tensors; each gets x's batch dims in
        front. This is the batched call with ``f_single`` replaced by any per-instance transform
        of it, so tensors created inside ``fn_single`` (basis directions) are not batched.
        """
        x = require_floating("x", x)
        check_event_dims(self.event_dims, x)
        return vmap_batch_dims(fn_single, x.ndim - self.event_dims)(x, *self.batch_args(x, args))

    def __call__(self, x: torch.Tensor, *args: object) -> torch.Tensor:
        def checked(*instance: object) -> torch.Tensor:
            out = self.f_single(*instance)
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"f_single must return a torch.Tensor, got {type(out).__name__}")
            return out

        return self.map(checked, x, *args)


def per_instance(
    f_single: Callable[..., torch.Tensor],
    event_dims: int = 1,
    arg_event_dims: int | Sequence[int] | None = None,
) -> PerInstance:
    """Turn a single-instance function into a batched one (vmap over all batch dims, no copies).

    ``f_single(x_i, *args_i)`` takes one instance's variables (``event_dims`` dims) and returns a
    tensor of any shape ``out_shape``: a scalar for :func:`pyhvp.grad_and_hvp`, any shape for
    :func:`pyhvp.hessian_diagonal`. The batched ``f(x, *args)`` returns
    ``x.shape[:-event_dims] + out_shape``. Each tensor arg has ``arg_event_dims`` trailing
    per-instance dims (default: ``event_dims``; an int for all args or one per arg) and leading
    dims that broadcast against x's batch dims, so a ``mu`` of shape ``(n_g, 1, 1, d)`` is shared
    across the middle batch dims without being expanded.

    >>> f = per_instance(lambda x, mu: ((x - mu) ** 2).sum())
    >>> f(torch.ones(4, 3), torch.zeros(3))
    tensor([3., 3., 3., 3.])
    >>> per_instance(lambda x: torch.stack([x.sum(), x.prod()]))(torch.ones(4, 3)).shape
    torch.Size([4, 2])
    """
    if not callable(f_single):
        raise TypeError(f"f_single must be callable, got {type(f_single).__name__}")
    if isinstance(event_dims, bool) or not isinstance(event_dims, int) or event_dims < 1:
        raise ValueError(f"event_dims must be a positive int, got {event_dims!r}")
    if arg_event_dims is not None and not isinstance(arg_event_dims, int):
        if not isinstance(arg_event_dims, Sequence):
            raise ValueError(
                f"arg_event_dims must be None, an int >= 0 or one int >= 0 per arg, "
                f"got {arg_event_dims!r}"
            )
        arg_event_dims = tuple(arg_event_dims)
    return PerInstance(f_single, event_dims, arg_event_dims)


def vmap_batch_dims(fn_single: Callable[..., object], n_batch: int) -> Callable[..., object]:
    """Nest one vmap per batch dim; an arg of size 1 in that dim is shared (in_dims=None)."""
    if n_batch == 0:
        return fn_single
    inner = vmap_batch_dims(fn_single, n_batch - 1)

    def over_leading_dim(x: torch.Tensor, *args: object) -> object:
        in_dims = [0] + [
            None if not isinstance(a, torch.Tensor) or a.shape[0] == 1 else 0 for a in args
        ]
        args = tuple(
            a[0] if isinstance(a, torch.Tensor) and d is None else a
            for a, d in zip(args, in_dims[1:], strict=True)
        )
        return vmap(inner, in_dims=tuple(in_dims))(x, *args)

    return over_leading_dim
