"""Per-instance Laplacians (Hessian traces) of batched functions, exact or estimated.

The exact Laplacian is a forward Laplacian (collapsed second-order Taylor mode, as folx's): one
forward pass carries each intermediate's value, its first derivatives along the N basis
directions ``e_i`` and ONE second-order coefficient already summed over them, so it costs about
N + 2 evaluations of ``f`` rather than the ~3N of N forward-over-forward passes, and yields every
instance's gradient on the way. The directions ``e_i`` are the same for every instance, so work
that does not depend on the instance (``W e_i`` of a first linear layer) is done once, and a
function elementwise in x keeps its first derivatives diagonal (O(N), not O(N^2), per
instance). It runs on the backend's optional ``collapsed_jet`` primitive (:mod:`pyhvp.backends`;
the torch backend's engine is :mod:`pyhvp.taylor`); :func:`laplacian` on its ``collapsed_second``
where the backend has it, which never computes the output's first derivatives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from pyhvp import _estimators as est
from pyhvp._checks import check_args, check_chunk_size, require_floating, unshared
from pyhvp._public import public_operator
from pyhvp.backends import Backend, require_primitive, resolve_backend
from pyhvp.instances import check_event_dims_of

SKETCHED = "hutch++"


class GradAndLaplacian(NamedTuple):
    """``value``: ``batch + out``; ``grad``: ``batch + out + event`` (every output's gradient in
    the instance's variables); ``laplacian``: ``batch + out``."""

    value: torch.Tensor
    grad: torch.Tensor
    laplacian: torch.Tensor


@public_operator
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
    ``S``'s r columns are pushed instead of the N basis vectors. Derivatives are partial ones in
    ``x``: a tensor that is ``x`` but reaches ``f`` through ``args`` or a closure is a constant.

    ``method="exact"``: collapsed Taylor mode along the N basis directions (or r columns), in
    chunks of ``chunk_size`` directions; memory ``O(chunk * size of f's intermediates)``.
    ``"hutchinson"``: ``samples`` Rademacher probes per instance pushed the same way
    (``generator``: same state, same result), unbiased with standard deviation ``sqrt(2 sum_{i
    != j} H_ij^2 / samples)``, any output shape. ``"hutch++"`` (Meyer, Musco, Musco & Woodruff
    2021; scalar outputs; Hessian-vector products, so it runs on every backend): a third of the
    ``samples`` products sketch ``Q = orth(H G)``, the rest give ``tr(Q^T H Q)`` exactly and
    estimate the trace of the deflated remainder -- exact when each instance's Hessian has rank
    <= samples // 3, better than Hutchinson on decaying spectra.

    Gradients (grad mode on): ``"exact"`` and ``"hutchinson"`` results are differentiable in
    ``x``, ``args``, ``factor`` and the tensors ``f`` captures (a network's parameters: the PINN
    loss), which are all inputs of the jet kernels. ``"hutch++"`` runs on Hessian-vector
    products, which keep a graph only when ``x``, an arg or ``factor`` requires grad (and then
    reach captured tensors too): captured parameters alone give a detached result -- pass them
    as ``args``. Otherwise results are detached.

    >>> x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    >>> laplacian(lambda x: (x**3).sum(-1), x)          # 6 x_1 + 6 x_2 per instance
    tensor([18., 42.])
    >>> laplacian(lambda x: torch.stack([x[..., 0] ** 2, x.prod(-1)], -1), x)   # vector f
    tensor([[2., 0.],
            [2., 0.]])
    """
    x = require_floating("x", x)
    event_dims = check_event_dims_of(f, event_dims, x)
    check_args(args, x)
    chunk_size = check_chunk_size(chunk_size)
    samples = est.check_method(method, samples, generator, SKETCHED)
    space = est.Space(x, event_dims, factor)
    resolved = resolve_backend(backend)
    if method == SKETCHED:
        hint = f"method={method!r} (use method='exact' or 'hutchinson' for vector outputs)"
        products = est.HessianProducts(resolved, est.checked(f, space.batch, hint), x, args,
                                        space, chunk_size)  # fmt: skip
        return _hutch_plus_plus(products, space, samples, generator)
    collapsed_jet = require_primitive(resolved, "collapsed_jet", "pyhvp.laplacian")
    if method == est.EXACT:
        coefficients, count = space.basis(), 1
    else:
        coefficients, count = space.probes("rademacher", samples, generator), samples
    checked, directions = est.checked(f, space.batch), space.directions(coefficients)
    second_only = getattr(resolved, "collapsed_second", None)  # optional: the second alone
    second: torch.Tensor
    if second_only is None:
        _, _, second = collapsed_jet(checked, x, directions, args, chunk_size)
    else:
        second = second_only(checked, x, directions, args, chunk_size)
    return second if count == 1 else second / count


@public_operator
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
    ``laplacian(..., method="exact")``: the gradient is its first-order coefficients; all three
    are differentiable like its result.

    >>> x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    >>> value, g, lap = grad_and_laplacian(lambda x: (x**2).sum(-1), x)
    >>> torch.equal(value, (x**2).sum(-1)), torch.equal(g, 2 * x), torch.equal(lap, 4 * torch.ones(2))
    (True, True, True)
    """
    x = require_floating("x", x)
    event_dims = check_event_dims_of(f, event_dims, x)
    check_args(args, x)
    chunk_size = check_chunk_size(chunk_size)
    space = est.Space(x, event_dims)
    collapsed_jet = require_primitive(resolve_backend(backend), "collapsed_jet",
                                      "pyhvp.grad_and_laplacian")  # fmt: skip
    value, first, second = collapsed_jet(est.checked(f, space.batch), x,
                                         space.directions(space.basis()), args, chunk_size)  # fmt: skip
    gradient = first.movedim(0, -1).reshape(*value.shape, *space.event)
    # f linear in x: the jet's gradient is one row expanded over the instances
    return GradAndLaplacian(value, unshared(gradient), second)


def _hutch_plus_plus(
    products: est.HessianProducts,
    space: est.Space,
    samples: int,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Hutch++ per instance on ``M = S^T H S`` (or H): ``tr(Q^T M Q)`` plus the mean of
    ``z^T M z`` over the deflated probes ``z = (I - Q Q^T) g``."""
    s = est.sketch(products, space, samples, generator, deflate_probes=True)
    exact_part = (s.q * s.mq).sum((-2, -1))
    if s.z.shape[-1] == 0:
        return exact_part
    return exact_part + (s.z * s.mz).sum(-2).mean(-1)
