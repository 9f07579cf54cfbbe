"""Hessian diagonals of batched scalar- and vector-valued functions, exact or estimated.

Instances are independent (instance ``b`` of ``f`` reads only ``x[b]``), so one basis direction
``e_i`` placed in *every* instance at once yields ``d^2 f_b / dx_{b,i}^2`` for all instances in one
pass: the exact diagonal takes N passes (N = one instance's number of variables), never the
``[..., M, N, N]`` Hessian. Everything runs through the two backend primitives
(:mod:`pyhvp.backends`), so the compiled torch path and other backends serve it unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pyhvp import _estimators as est
from pyhvp._checks import check_args, check_chunk_size, require_floating
from pyhvp._public import public_operator
from pyhvp.backends import Backend, resolve_backend
from pyhvp.instances import check_event_dims_of

SKETCHED = "diag++"


@public_operator
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

    ``method="exact"`` (N = prod(event_shape) directions pushed through the whole batch, see
    ``_exact``): second-order Taylor mode along ``e_i``, every output's ``d^2 f_k / dx_i^2`` from
    one pass, ``e_i`` shared by every instance, ``f`` recorded once; on a backend without it
    (julia), scalar outputs use forward-over-reverse with one-hot tangents, ``(H e_i)_i``.
    Cost about N evaluations of ``f`` times a small constant; memory ``O(c * x.numel())``
    for the ``c = chunk_size`` (default N) directions pushed at once, plus their intermediates.
    Derivatives are partial ones in ``x``: a tensor that is ``x`` but reaches ``f`` through
    ``args`` or a closure is a constant.

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

    Gradients (grad mode on): every method's result is differentiable in ``x`` and ``args``. The
    exact method on the Taylor engine (``backend="torch"``) is also differentiable in the tensors
    ``f`` captures (parameters), like a Laplacian: they are inputs of its kernels. The estimators
    (and the forward-over-reverse fallback) run on Hessian-vector products, which keep a graph
    only when ``x`` or an arg requires grad (and then reach captured tensors too): captured
    parameters alone give a detached result -- pass them as ``args``.

    >>> x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])        # per instance: f = (x0^3, x0 x1^2)
    >>> d = hessian_diagonal(lambda x: torch.stack([x[..., 0] ** 3, x[..., 0] * x[..., 1] ** 2], -1), x)
    >>> torch.equal(d, torch.tensor([[[6.0, 0.0], [0.0, 2.0]], [[18.0, 0.0], [0.0, 6.0]]]))  # [b, k, i]
    True
    >>> torch.equal(hessian_diagonal(lambda x: (x**3).sum(-1), x), 6 * x)    # scalar f: batch + (n,)
    True
    """
    x = require_floating("x", x)
    event_dims = check_event_dims_of(f, event_dims, x)
    check_args(args, x)
    chunk_size = check_chunk_size(chunk_size)
    samples = est.check_method(method, samples, generator, SKETCHED)
    space = est.Space(x, event_dims)
    resolved = resolve_backend(backend)
    if method == est.EXACT:
        return _exact(resolved, f, x, args, space, chunk_size)
    hint = (
        f"method={method!r} (use method='exact', or estimate one output at a time: "
        f"hessian_diagonal(lambda x, *a: f(x, *a)[..., k], x, method={method!r}, ...))"
    )
    products = est.HessianProducts(resolved, est.checked(f, space.batch, hint), x, args, space,
                                    chunk_size)  # fmt: skip
    if method == est.HUTCHINSON:
        probes = space.probes("rademacher", samples, generator)
        diagonal = (probes * products(probes)).mean(0)
    else:
        diagonal = _diag_plus_plus(products, space, samples, generator)
    return diagonal.reshape(*space.batch, *space.event)


def _exact(
    backend: Backend,
    f: Callable[..., torch.Tensor],
    x: torch.Tensor,
    args: tuple[object, ...],
    space: est.Space,
    chunk_size: int | None,
) -> torch.Tensor:
    """``d^2 f / dx_i^2`` along the N basis directions ``e_i``, shared by every instance (a
    first linear layer maps ``e_i`` once, not once per instance).

    The primitive is chosen once: ``second_directional`` (second-order Taylor mode), every
    output's second derivatives from one pass, f recorded once for all chunks of
    ``chunk_size`` directions -- for scalar outputs too, where it measured 2.8-9x faster than
    forward-over-reverse with one-hot tangents on the CPU (scalar tanh MLP, n = 32 and 256,
    eager and compiled; benchmarks/bench_diagonal.py). A backend without it (it raises
    NotImplementedError, as julia does) runs scalar outputs by ``grad_and_hvp``: ``(H e_i)_i``.
    """
    directions = space.directions(space.basis())  # (N, 1, ..., 1, *event)
    try:
        second = backend.second_directional(
            est.checked(f, space.batch), x, directions, args, chunk_size
        )
    except NotImplementedError as missing:
        hint = f"method='exact' on backend={backend.name!r} ({missing})"
        products = est.HessianProducts(backend, est.checked(f, space.batch, hint), x, args,
                                        space, None)  # fmt: skip
        second = _one_hot_diagonal(products, space, chunk_size)
    out_shape = second.shape[1 + len(space.batch) :]
    # batch + out + event as a view: a transposing copy would cost as much as the passes
    return second.movedim(0, -1).reshape(*space.batch, *out_shape, *space.event)


def _one_hot_diagonal(products: est.Products, space: est.Space,
                      chunk_size: int | None) -> torch.Tensor:  # fmt: skip
    """``(H e_i)_i`` for every i, ``(N, *batch)``, ``chunk_size`` products at a time."""
    step = chunk_size or space.dim
    parts = []
    for start in range(0, space.dim, step):
        chunk = space.basis()[start : start + step]  # e_i for i in this chunk, in every instance
        columns = products(chunk)[..., start : start + len(chunk)]  # (count, *batch, count)
        # the diagonal, copied out so that the (count, *x.shape) products can be freed
        parts.append(columns.diagonal(dim1=0, dim2=-1).movedim(-1, 0).contiguous())
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _diag_plus_plus(
    products: est.HessianProducts,
    space: est.Space,
    samples: int,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Diag++ (Baston & Nakatsukasa 2022, arXiv:2201.10684) per instance: ``diag(Q Q^T H)``
    exactly, plus Hutchinson's mean of ``z * (I - Q Q^T) H z`` for the rest."""
    s = est.sketch(products, space, samples, generator, deflate_probes=False)
    diagonal = (s.q * s.mq).sum(-1)  # diag(Q Q^T H), H symmetric
    if s.z.shape[-1] > 0:
        deflated = s.mz - s.q @ (s.q.mT @ s.mz)  # (I - Q Q^T) H z
        diagonal = diagonal + (s.z * deflated).mean(-1)
    return diagonal
