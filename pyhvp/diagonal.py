"""Hessian diagonals of batched scalar- and vector-valued functions, exact or estimated.

Instances are independent (instance ``b`` of ``f`` reads only ``x[b]``), so one basis direction
``e_i`` placed in *every* instance at once yields ``d^2 f_b / dx_{b,i}^2`` for all instances in one
pass: the exact diagonal takes N passes (N = one instance's number of variables), never the
``[..., M, N, N]`` Hessian. Everything runs through the two backend primitives
(:mod:`pyhvp.backends`), so the compiled torch path and other backends serve it unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from pyhvp._checks import (
    check_args,
    check_chunk_size,
    check_event_dims,
    fmt_shape,
    require_floating,
)
from pyhvp._probes import draw_probes
from pyhvp.backends import Backend, resolve_backend

METHODS = ("exact", "hutchinson", "diag++")
STOCHASTIC = ("hutchinson", "diag++")


def hessian_diagonal(
    f: Callable[..., torch.Tensor],
    x: torch.Tensor,
    *args: object,
    event_dims: int = 1,
    method: str = "exact",
    samples: int | None = None,
    generator: torch.Generator | None = None,
    chunk_size: int | None = None,
    backend: str | Backend = "torch",
) -> torch.Tensor:
    """Diagonal of each instance's input Hessian, for every output of ``f``.

    Shapes: ``f(x, *args)`` returns ``batch_shape + out_shape`` (``batch_shape =
    x.shape[:-event_dims]``; ``out_shape`` is ``()`` for a scalar, ``(m,)`` or more for a vector);
    the result is ``batch_shape + out_shape + event_shape``, entry ``[b, k, i]`` = ``d^2 f_{b,k} /
    dx_{b,i}^2``. Unbatched ``x`` of shape ``(n,)`` gives ``out_shape + (n,)``.

    ``method="exact"`` (N = prod(event_shape) directions pushed through the whole batch; chosen by
    ``_choose``): second-order Taylor mode along ``e_i``, every output's ``d^2 f_k / dx_i^2`` from
    one pass, ``e_i`` shared by every instance; on a backend without it (julia), scalar outputs use
    forward-over-reverse with one-hot tangents, ``(H e_i)_i``.
    Cost about N evaluations of ``f`` times a small constant; memory ``O(c * x.numel())``
    for the ``c = chunk_size`` (default N) directions pushed at once, plus their intermediates.
    ``f`` (a Python callable) is evaluated once beforehand to learn ``out_shape``.

    Stochastic methods (scalar outputs only: a vector output would need one reverse pass per
    output per probe -- estimate ``lambda x: f(x)[..., k]`` per output, or use ``"exact"``):
    ``samples`` Hessian-vector products with random probes drawn from ``generator`` (same
    state, same result); memory ``O(samples * x.numel())`` for probes and products, while
    ``chunk_size`` bounds how many are pushed through ``f`` at once.
    ``"hutchinson"`` averages ``z * (H z)``: unbiased, error of entry ``i`` about
    ``sqrt(sum_{j != i} H_ij^2 / samples)``. ``"diag++"`` (Baston & Nakatsukasa 2022) spends a
    third of the products on a Gaussian sketch ``Q = orth(H G)``, up to a third on the exact
    ``diag(Q Q^T H)``, the rest on Hutchinson for ``(I - Q Q^T) H``: exact when every instance's
    Hessian has rank <= samples // 3 (so always once samples >= 3 N), far more accurate than
    Hutchinson when the spectrum decays, no better on flat spectra.

    >>> x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])        # per instance: f = (x0^3, x0 x1^2)
    >>> d = hessian_diagonal(lambda x: torch.stack([x[..., 0] ** 3, x[..., 0] * x[..., 1] ** 2], -1), x)
    >>> torch.equal(d, torch.tensor([[[6.0, 0.0], [0.0, 2.0]], [[18.0, 0.0], [0.0, 6.0]]]))  # [b, k, i]
    True
    >>> torch.equal(hessian_diagonal(lambda x: (x**3).sum(-1), x), 6 * x)    # scalar f: batch + (n,)
    True
    """
    x = require_floating("x", x)
    event_dims = check_event_dims(event_dims, x)
    check_args(args, x)
    chunk_size = check_chunk_size(chunk_size)
    _check_method(method, samples, generator)
    batch_shape = x.shape[: x.ndim - event_dims]
    n_vars = math.prod(x.shape[x.ndim - event_dims :])
    if n_vars == 0:
        raise ValueError(
            f"x must have at least one variable per instance, got x of shape {fmt_shape(x.shape)} "
            f"with event_dims={event_dims}"
        )
    out_shape = _out_shape(f, x, args, batch_shape)
    resolved = resolve_backend(backend)
    if method == "exact":
        return _exact(resolved, f, x, args, event_dims, out_shape, chunk_size)
    if out_shape != ():
        raise ValueError(
            f"method={method!r} needs f to return one scalar per instance (shape "
            f"{fmt_shape(batch_shape)}); f returns out_shape {fmt_shape(out_shape)} per instance. "
            f"Use method='exact', or estimate one output at a time: "
            f"hessian_diagonal(lambda x, *a: f(x, *a)[..., k], x, method={method!r}, ...)"
        )
    estimate = _hutchinson if method == "hutchinson" else _diag_plus_plus
    return estimate(resolved, f, x, args, event_dims, samples, generator, chunk_size)


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
    least = 3 if method == "diag++" else 1
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < least:
        raise ValueError(
            f"samples must be an int >= {least} (Hessian-vector products) for method={method!r}, "
            f"got {samples!r}"
        )


def _out_shape(
    f: Callable[..., torch.Tensor], x: torch.Tensor, args: tuple[object, ...], batch_shape: tuple
) -> tuple[int, ...]:
    """``f``'s per-instance output shape, from one evaluation without autograd.

    A ``f`` that is not a Python callable is a backend-native per-instance function (e.g.
    :func:`pyhvp.julia_function`), which returns one scalar per instance by contract.
    """
    if not callable(f):
        return ()
    with torch.no_grad():
        out = f(x, *args)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"f must return a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape[: len(batch_shape)]) != tuple(batch_shape):
        raise ValueError(
            f"f must return batch_shape + out_shape with batch_shape = x.shape[:-event_dims] = "
            f"{fmt_shape(batch_shape)}, got {fmt_shape(out.shape)}"
        )
    return tuple(out.shape[len(batch_shape) :])


def _choose(out_shape: tuple[int, ...]) -> tuple[str, ...]:
    """The primitives for exact diagonals, in order of preference (benchmarks/bench_diagonal.py).

    ``second_directional`` (second-order Taylor mode along e_i) for every output shape: it gives
    all M outputs' second derivatives from one pass, and for scalar outputs too it measured
    2.8-9x faster than forward-over-reverse with one-hot tangents on the CPU (scalar tanh MLP,
    n = 32 and 256, eager and compiled). Scalar outputs fall back to ``grad_and_hvp`` on a
    backend without ``second_directional`` (it raises NotImplementedError, as julia does).
    """
    return ("second_directional",) if out_shape != () else ("second_directional", "grad_and_hvp")


def _exact(
    backend: Backend,
    f: Callable[..., torch.Tensor],
    x: torch.Tensor,
    args: tuple[object, ...],
    event_dims: int,
    out_shape: tuple[int, ...],
    chunk_size: int | None,
) -> torch.Tensor:
    batch_shape, event_shape = x.shape[: x.ndim - event_dims], x.shape[x.ndim - event_dims :]
    n_vars = math.prod(event_shape)
    step = chunk_size or n_vars
    eye = torch.eye(n_vars, dtype=x.dtype, device=x.device)
    primitives = list(_choose(out_shape))
    parts = []  # each (count, *batch, *out): d^2 f / dx_i^2 for the chunk's i
    for start in range(0, n_vars, step):
        basis = eye[start : start + step]  # e_i for i in this chunk, the same in every instance
        count = basis.shape[0]
        directions = basis.reshape(count, *(1,) * len(batch_shape), *event_shape)
        while primitives[0] == "second_directional":
            try:  # broadcast over instances: a first linear layer maps e_i once, not per instance
                parts.append(backend.second_directional(f, x, directions, args, None))
                break
            except NotImplementedError:
                if len(primitives) == 1:
                    raise
                primitives.pop(0)
        else:
            tangents = directions.expand(count, *x.shape).contiguous()
            _, hv = backend.grad_and_hvp(f, x, tangents, args, event_dims, None)
            columns = hv.reshape(count, *batch_shape, n_vars)[..., start : start + count]
            # (H e_i)_i, copied out so that the (count, *x.shape) products can be freed
            parts.append(columns.diagonal(dim1=0, dim2=-1).movedim(-1, 0).contiguous())
    second = parts[0] if len(parts) == 1 else torch.cat(parts)
    # batch + out + event as a view: a transposing copy would cost as much as the passes.
    return second.movedim(0, -1).reshape(*batch_shape, *out_shape, *event_shape)


def _hutchinson(
    backend: Backend,
    f: Callable[..., torch.Tensor],
    x: torch.Tensor,
    args: tuple[object, ...],
    event_dims: int,
    samples: int,
    generator: torch.Generator | None,
    chunk_size: int | None,
) -> torch.Tensor:
    probes = draw_probes("rademacher", (samples, *x.shape), x, generator)
    _, hz = backend.grad_and_hvp(f, x, probes, args, event_dims, chunk_size)
    return (probes * hz).mean(0)


def _diag_plus_plus(
    backend: Backend,
    f: Callable[..., torch.Tensor],
    x: torch.Tensor,
    args: tuple[object, ...],
    event_dims: int,
    samples: int,
    generator: torch.Generator | None,
    chunk_size: int | None,
) -> torch.Tensor:
    """Diag++ (Baston & Nakatsukasa 2022, arXiv:2201.10684), per instance, in two HVP passes."""
    batch_shape = x.shape[: x.ndim - event_dims]
    n_instances, n_vars = math.prod(batch_shape), math.prod(x.shape[x.ndim - event_dims :])

    def as_columns(t: torch.Tensor) -> torch.Tensor:  # (k, *x.shape) -> (instances, N, k)
        return t.reshape(t.shape[0], n_instances, n_vars).permute(1, 2, 0)

    # A Gaussian sketch spans a rank-r range a.s. for r <= sketch_size (Rademacher may not).
    sketch_size = samples // 3
    gaussian = draw_probes("gaussian", (sketch_size, *x.shape), x, generator)
    _, sketch = backend.grad_and_hvp(f, x, gaussian, args, event_dims, chunk_size)
    q = torch.linalg.qr(as_columns(sketch)).Q  # (instances, N, r), r = min(sketch_size, N)
    rank = q.shape[-1]
    residual = samples - sketch_size - rank if rank < n_vars else 0
    residual_probes = draw_probes("rademacher", (residual, *x.shape), x, generator)
    q_tangents = q.permute(2, 0, 1).reshape(rank, *x.shape)
    _, products = backend.grad_and_hvp(
        f, x, torch.cat([q_tangents, residual_probes]), args, event_dims, chunk_size
    )
    hq, hz = as_columns(products[:rank]), as_columns(products[rank:])
    diagonal = (q * hq).sum(-1)  # diag(Q Q^T H), H symmetric
    if residual_probes.shape[0] > 0:
        z = as_columns(residual_probes)
        deflated = hz - q @ (q.mT @ hz)  # (I - Q Q^T) H z
        diagonal = diagonal + (z * deflated).mean(-1)
    return diagonal.reshape(*batch_shape, *x.shape[x.ndim - event_dims :])
