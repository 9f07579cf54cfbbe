"""Per-instance bi-Laplacians ``Delta^2 f = sum_{i,j} d^4 f / dx_i^2 dx_j^2``, exact or
estimated, by collapsed fourth-order Taylor mode.

The exact bi-Laplacian pushes ``N^2`` fourth-order jets along ``e_i`` and ``e_i +- e_j``
(:func:`pyhvp.interpolation.biharmonic`) and sums their fourth coefficients with weights as it
goes (collapsed Taylor mode: the lower three orders per direction, the fourth one summed), so
its cost is about ``3 N^2 + 1`` times ``f``'s linear ops. The estimator pushes Gaussian probes:
``E[D^4_v f] = 3 Delta^2 f`` for ``v ~ N(0, I)``. Runs on the backend's optional
``taylor_coefficients`` primitive.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pyhvp import _estimators as est
from pyhvp._checks import check_args, check_chunk_size, require_floating
from pyhvp._public import public_operator
from pyhvp.backends import Backend, require_primitive, resolve_backend
from pyhvp.instances import check_event_dims_of
from pyhvp.interpolation import biharmonic


@public_operator
def bilaplacian(
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
    """Bi-Laplacian ``Delta^2`` of every output of ``f`` in each instance's variables: ``batch +
    out``.

    Shapes: ``f(x, *args)`` returns ``batch_shape + out_shape``; the result has that shape, entry
    ``[b, k] = sum_{i,j} d^4 f_{b,k} / dx_{b,i}^2 dx_{b,j}^2``.

    ``method="exact"``: ``N^2`` fourth-order Taylor jets (``N`` variables per instance), along
    ``e_i`` (weight ``1 - (N - 1)/3``) and ``e_i +- e_j`` for ``i < j`` (weight ``1/6``), their
    fourth coefficients summed with the weights as they go; ``chunk_size`` bounds the jets pushed
    at once. ``"hutchinson"``: ``samples`` Gaussian probes ``v`` per instance, the mean of
    ``D^4_v f / 3`` -- unbiased (``E[D^4_v f] = 3 Delta^2 f``), with standard deviation
    ``sqrt((8 |grad^2 Delta f|_F^2 + 8/3 |grad^4 f|_F^2) / samples)`` per instance and output
    (Isserlis' theorem); the same generator state gives the same result.

    Results are differentiable in ``x``, ``args`` and the tensors ``f`` captures (a network's
    parameters: a plate PINN's loss).

    >>> x = torch.tensor([[1.0, 2.0]])
    >>> bilaplacian(lambda x: (x**2).sum(-1) ** 2, x)    # |x|^4 in 2-D: Delta^2 = 64
    tensor([64.])
    """
    x = require_floating("x", x)
    event_dims = check_event_dims_of(f, event_dims, x)
    check_args(args, x)
    chunk_size = check_chunk_size(chunk_size)
    samples = est.check_method(method, samples, generator)
    space = est.Space(x, event_dims)
    taylor_coefficients = require_primitive(resolve_backend(backend), "taylor_coefficients",
                                            "pyhvp.bilaplacian")  # fmt: skip
    checked = est.checked(f, space.batch)
    if method == est.EXACT:
        scheme = biharmonic(space.dim)
        table = torch.tensor(list(scheme), dtype=x.dtype, device=x.device)
        directions = space.directions(table.reshape(len(scheme), *(1,) * len(space.batch), -1))
        weights = torch.tensor([float(w) for w in scheme.values()], dtype=x.dtype,
                               device=x.device)  # fmt: skip
        (fourth,) = taylor_coefficients(checked, x, directions, args, chunk_size, order=4,
                                        outputs=(4,), collapsed=True, weights=weights)  # fmt: skip
        return fourth
    probes = space.directions(space.probes("gaussian", samples, generator))
    (fourth,) = taylor_coefficients(checked, x, probes, args, chunk_size, order=4, outputs=(4,),
                                    collapsed=True)  # fmt: skip
    return fourth / (3 * samples)
