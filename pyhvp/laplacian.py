"""Per-instance Laplacians (Hessian traces) of batched functions, exact or estimated.

The exact Laplacian is a forward Laplacian (collapsed second-order Taylor mode, as folx's): one
forward pass carries each intermediate's value, its first derivatives along the N basis
directions ``e_i`` and ONE second-order coefficient already summed over them, so it costs about
N + 2 evaluations of ``f`` rather than the ~3N of N forward-over-forward passes, and yields every
instance's gradient on the way. The directions ``e_i`` are the same for every instance, so work
that does not depend on the instance (``W e_i`` of a first linear layer) is done once. It runs
on the backend's optional ``collapsed_jet`` primitive (:mod:`pyhvp.backends`; the torch backend's
engine is :mod:`pyhvp.taylor`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from pyhvp._checks import (
    check_args,
    check_chunk_size,
    check_event_dims,
    fmt_shape,
    require_floating,
    require_like,
)
from pyhvp._probes import draw_probes
from pyhvp.backends import Backend, require_primitive, resolve_backend

METHODS = ("exact", "hutchinson", "hutch++")
STOCHASTIC = ("hutchinson", "hutch++")


class GradAndLaplacian(NamedTuple):
    """``value``: ``batch + out``; ``grad``: ``batch + out + event`` (every output's gradient in
    the instance's variables); ``laplacian``: ``batch + out``."""

    value: torch.Tensor
    grad: torch.Tensor
    laplacian: torch.Tensor


def laplacian(
    f: Callable[..., torch.Tensor],
    x: torch.Tensor,
    *args: object,
    event_dims: int = 1,
    method: str = "exact",
    samples: int | None = None,
    generator: torch.Generator | None = None,
    factor: torch.Tensor | None = None,
    chunk_size: int | None = None,
    backend: str | Backend = "torch",
) -> torch.Tensor:
    """Laplacian of every output of ``f`` in each instance's variables: ``batch + out``.

    Shapes: ``f(x, *args)`` returns ``batch_shape + out_shape`` (``batch_shape =
    x.shape[:-event_dims]``); the result has that shape, entry ``[b, k] = sum_i d^2 f_{b,k} /
    dx_{b,i}^2``. With ``factor=S`` (shape ``event_shape + (r,)`` shared by all instances, or
    batch dims in front for one per instance) it is the weighted trace ``tr(S S^T H)``:
    ``S``'s r columns are pushed instead of the N basis vectors.

    ``method="exact"``: collapsed Taylor mode along the N basis directions (or r columns), in
    chunks of ``chunk_size`` directions; memory ``O(chunk * size of f's intermediates)``.
    ``"hutchinson"``: ``samples`` Rademacher probes per instance (``generator``: same state, same
    result), unbiased with standard deviation ``sqrt(2 sum_{i != j} H_ij^2 / samples)``, any
    output shape. ``"hutch++"`` (Meyer, Musco, Musco & Woodruff 2021; scalar outputs): a third of
    the ``samples`` Hessian-vector products sketch ``Q = orth(H G)``, a third give ``tr(Q^T H Q)``
    exactly, the rest estimate the trace of the deflated remainder -- exact when each
    instance's Hessian has rank <= samples // 3, better than Hutchinson on decaying spectra.

    >>> x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    >>> laplacian(lambda x: (x**3).sum(-1), x)          # 6 x_1 + 6 x_2 per instance
    tensor([18., 42.])
    >>> laplacian(lambda x: torch.stack([x[..., 0] ** 2, x.prod(-1)], -1), x)   # vector f
    tensor([[2., 0.],
            [2., 0.]])
    """
    x = require_floating("x", x)
    event_dims = check_event_dims(event_dims, x)
    check_args(args, x)
    chunk_size = check_chunk_size(chunk_size)
    _check_method(method, samples, generator)
    space = _Space(x, event_dims, factor)
    resolved = resolve_backend(backend)
    if method == "hutch++":
        return _hutch_plus_plus(resolved, f, x, args, space, samples, generator, chunk_size)
    collapsed_jet = require_primitive(resolved, "collapsed_jet", "pyhvp.laplacian")
    if method == "exact":
        coefficients = space.basis()
        count = space.dim
    else:
        coefficients = draw_probes("rademacher", (samples, *space.batch, space.dim), x, generator)
        count = samples
    value, _, second = collapsed_jet(f, x, space.directions(coefficients), args, chunk_size)
    _check_value(value, space.batch)
    return second if method == "exact" else second / count


def grad_and_laplacian(
    f: Callable[..., torch.Tensor],
    x: torch.Tensor,
    *args: object,
    event_dims: int = 1,
    chunk_size: int | None = None,
    backend: str | Backend = "torch",
) -> GradAndLaplacian:
    """Value, gradient and exact Laplacian of every output of ``f`` per instance, one pass.

    Shapes: ``f(x, *args)`` returns ``batch_shape + out_shape``; returns ``(value, grad,
    laplacian)`` of shapes ``batch + out``, ``batch + out + event`` and ``batch + out`` -- what a
    variational Monte Carlo local energy needs of ``log psi``. Same pass as
    ``laplacian(..., method="exact")``: the gradient is its first-order coefficients.

    >>> x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    >>> value, g, lap = grad_and_laplacian(lambda x: (x**2).sum(-1), x)
    >>> torch.equal(value, (x**2).sum(-1)), torch.equal(g, 2 * x), torch.equal(lap, 4 * torch.ones(2))
    (True, True, True)
    """
    x = require_floating("x", x)
    event_dims = check_event_dims(event_dims, x)
    check_args(args, x)
    chunk_size = check_chunk_size(chunk_size)
    space = _Space(x, event_dims, None)
    collapsed_jet = require_primitive(resolve_backend(backend), "collapsed_jet",
                                      "pyhvp.grad_and_laplacian")  # fmt: skip
    value, first, second = collapsed_jet(f, x, space.directions(space.basis()), args, chunk_size)
    _check_value(value, space.batch)
    gradient = first.movedim(0, -1).reshape(*value.shape, *space.event)
    return GradAndLaplacian(value, gradient, second)


def _check_method(method: object, samples: object, generator: object) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator or None, got {type(generator).__name__}"
        )
    if method == "exact":
        if samples is not None or generator is not None:
            raise ValueError(
                f"samples and generator apply to the stochastic methods {list(STOCHASTIC)}; "
                f"method='exact' got samples={samples!r}, generator={generator!r}"
            )
        return
    least = 3 if method == "hutch++" else 1
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < least:
        raise ValueError(
            f"samples must be an int >= {least} (probes) for method={method!r}, got {samples!r}"
        )


def _check_value(value: torch.Tensor, batch: tuple[int, ...]) -> None:
    if not value.is_floating_point():
        raise TypeError(f"f must return a real floating tensor, got {value.dtype}")
    if tuple(value.shape[: len(batch)]) != batch:
        raise ValueError(
            f"f must return batch_shape + out_shape with batch_shape = x.shape[:-event_dims] = "
            f"{fmt_shape(batch)}, got {fmt_shape(value.shape)}"
        )


class _Space:
    """The d directions a trace runs over, per instance: the N variables, or the r columns of a
    ``factor`` S (then ``tr(S^T H S)``). Coefficient vectors ``(k, *batch?, d)`` map to x-space
    directions ``(k, *batch or 1s, *event)``, and x-space vectors project back by ``S^T``."""

    def __init__(self, x: torch.Tensor, event_dims: int, factor: torch.Tensor | None) -> None:
        self.batch = tuple(x.shape[: x.ndim - event_dims])
        self.event = tuple(x.shape[x.ndim - event_dims :])
        self.like = x
        n_vars = math.prod(self.event)
        if n_vars == 0:
            raise ValueError(
                f"x must have at least one variable per instance, got x of shape "
                f"{fmt_shape(x.shape)} with event_dims={event_dims}"
            )
        self.factor = None if factor is None else self._check_factor(factor, n_vars)
        self.dim = n_vars if factor is None else factor.shape[-1]

    def _check_factor(self, factor: object, n_vars: int) -> torch.Tensor:
        factor = require_floating("factor", factor)
        require_like("factor", factor, "x", self.like)
        lead = factor.shape[: factor.ndim - len(self.event) - 1]
        ok = (
            factor.ndim >= len(self.event) + 1
            and tuple(factor.shape[len(lead) : -1]) == self.event
            and factor.shape[-1] >= 1
            and len(lead) <= len(self.batch)
            and all(a in (1, b) for a, b in zip(reversed(lead), reversed(self.batch), strict=False))
        )
        if not ok:
            raise ValueError(
                f"factor must have shape event_shape + (r,) = {fmt_shape((*self.event, 'r'))}, "
                f"optionally with leading dims broadcasting against x's batch dims "
                f"{fmt_shape(self.batch)}, got {fmt_shape(factor.shape)}"
            )
        # (*batch or 1s, N, r)
        padded = (1,) * (len(self.batch) - len(lead)) + tuple(lead)
        return factor.reshape(*padded, n_vars, factor.shape[-1])

    def basis(self) -> torch.Tensor:
        """``(d, 1, ..., 1, d)``: e_j, the same in every instance."""
        eye = torch.eye(self.dim, dtype=self.like.dtype, device=self.like.device)
        return eye.reshape(self.dim, *(1,) * len(self.batch), self.dim)

    def directions(self, coefficients: torch.Tensor) -> torch.Tensor:
        """``(k, *b, d)`` -> x-space ``(k, *b', *event)``."""
        if self.factor is not None:
            coefficients = (self.factor @ coefficients.unsqueeze(-1)).squeeze(-1)
        return coefficients.reshape(*coefficients.shape[:-1], *self.event)

    def project(self, vectors: torch.Tensor) -> torch.Tensor:
        """x-space ``(k, *batch, *event)`` -> ``(k, *batch, d)`` (``S^T v`` with a factor)."""
        flat = vectors.reshape(*vectors.shape[: vectors.ndim - len(self.event)], -1)
        if self.factor is None:
            return flat
        return (flat.unsqueeze(-2) @ self.factor).squeeze(-2)


def _hutch_plus_plus(
    backend: Backend,
    f: Callable[..., torch.Tensor],
    x: torch.Tensor,
    args: tuple[object, ...],
    space: _Space,
    samples: int,
    generator: torch.Generator | None,
    chunk_size: int | None,
) -> torch.Tensor:
    """Hutch++ per instance on ``M = S^T H S`` (or H), from Hessian-vector products alone."""
    with torch.no_grad():
        out = f(x, *args)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"f must return a torch.Tensor, got {type(out).__name__}")
    _check_value(out, space.batch)
    if tuple(out.shape) != space.batch:
        raise ValueError(
            f"method='hutch++' needs f to return one scalar per instance (shape "
            f"{fmt_shape(space.batch)}), got {fmt_shape(out.shape)}. Use method='exact' or "
            f"'hutchinson' for vector outputs"
        )
    event_dims = len(space.event)

    def products(coefficients: torch.Tensor) -> torch.Tensor:  # (k, *batch, d) -> M @ each
        tangents = space.directions(coefficients).expand(len(coefficients), *x.shape)
        _, hv = backend.grad_and_hvp(f, x, tangents.contiguous(), args, event_dims, chunk_size)
        return space.project(hv)

    sketch_size = samples // 3
    gaussian = draw_probes("gaussian", (sketch_size, *space.batch, space.dim), x, generator)
    q = torch.linalg.qr(products(gaussian).movedim(0, -1)).Q  # (*batch, d, s), s <= d
    rank = q.shape[-1]
    q_columns = q.movedim(-1, 0)
    exact_part = (q_columns * products(q_columns)).sum((0, -1))  # tr(Q^T M Q)
    residual = samples - sketch_size - rank if rank < space.dim else 0
    if residual == 0:
        return exact_part
    z = draw_probes("rademacher", (residual, *space.batch, space.dim), x, generator)
    deflated = z - (q @ (q.mT @ z.movedim(0, -1))).movedim(-1, 0)  # (I - Q Q^T) z
    return exact_part + (deflated * products(deflated)).sum(-1).mean(0)
