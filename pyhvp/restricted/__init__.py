"""Sub-Hessians by sparse injection: the loss restricted to the k selected entries, whose one-hot
directions enter each op that consumes a selected tensor linearly as what they add to its output
-- a gathered input column, a shifted slice of a convolution's input, the tokens an embedding row
reaches -- instead of dense tangents of the tensor's shape.

The restricted function is ``g(z) = loss(params with entry s_p of its tensor shifted by z_p)`` at
``z = 0``, so ``hessian(g)(0) = E_S^T H E_S`` exactly (repeated entries included). It is evaluated
under :class:`~pyhvp.restricted.mode.Injection`, a ``TorchFunctionMode`` that sees every use of a
selected tensor and of its views (``W.T``, ``W.view``, ``W[2:]``): ``F.linear``, ``matmul`` /
``mm`` / ``bmm`` / ``@``, ``einsum``, ``conv{1,2,3}d`` and their transposes and ``embedding``
take it sparsely (:mod:`pyhvp.restricted.contributions`); biases, elementwise ops and
normalisations densely (``W + scatter(z)``, as cheap there as the op itself); other ops densely
up to :data:`DENSE_LIMIT` entries, and refuse a larger tensor (:class:`NotSparse`), as they refuse
a write to one.

``hessian(g)`` is ``jacrev(grad(g))`` over the K-vector ``z``: one forward, one backward, then K
reverse passes of the backward batched by ``vmap``. A direction costs the network downstream of
the op its entry enters (every later op, with a dense tangent), never that op's dense product
with a one-hot tensor of the weight's shape nor its dense weight gradient: on the seed's
``Linear(784, 10)`` ``O(batch * classes)`` instead of ``O(batch * 784 * 10)``. Which tensors take
this route, and grouped how, is :mod:`pyhvp.restricted.routes`' cost model.

:func:`restricted_hessian` is a kernel of the torch backend (``TorchBackend.restricted_hessian``),
run eagerly or compiled under its compile policy. Dynamo traces it whole -- the mode, ``jacrev``
and ``vmap`` -- into one graph that inductor fuses, guarded as every compiled kernel is (the
loss's code and captured state, every tensor's metadata). A loss it refuses raises
:class:`NotSparse` compiled as eagerly. Where dynamo drops a mode entered inside the traced
function (torch 2.5: a zero Hessian; 2.6 fails inside it), :func:`compiles` says so before the
first compile, and the kernel runs eagerly.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from pyhvp._keys import TensorMemo
from pyhvp.restricted.dynamo_views import handed_to_the_mode
from pyhvp.restricted.mode import DENSE_LIMIT, Injection, NotSparse, WritesSelected

__all__ = [
    "DENSE_LIMIT",
    "NotSparse",
    "WritesSelected",
    "compiles",
    "compiles_property_views",
    "handed_to_the_mode",
    "restricted_hessian",
    "selected_entries",
]


def selected_entries(tensor: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """``(tensor.ndim, k)``: the index in ``tensor`` of each of its flat entries ``flat``.
    Computed outside the kernel (inside, a compiler recomputes such an integer division in every
    loop that reads it), and once for a ``flat`` that calls pass again unchanged (a training
    loop's selection): 17 us a tensor, 4% of a compiled sub-Hessian of the seed's model. By
    ``%`` and ``//`` per dim: ``torch.unravel_index``'s checks took 50 us a tensor."""
    shape = tuple(tensor.shape)
    known = _ENTRIES.get(flat, shape)
    if known is not None:
        return known
    if tensor.ndim == 0:
        return _ENTRIES.keep(flat, shape, flat.new_zeros(0, flat.shape[0]))
    coords, rest = [], flat
    for n in reversed(tensor.shape[1:]):
        coords.append(rest % n)
        rest = rest // n
    return _ENTRIES.keep(flat, shape, torch.stack([rest, *reversed(coords)]))


_ENTRIES: TensorMemo[torch.Tensor] = TensorMemo()
""":func:`selected_entries` of flat index tensors, by the tensor's shape."""


def restricted_hessian(
    loss: Callable[..., torch.Tensor], n_tensors: int, chunk_size: int | None, *inputs: Any
) -> tuple[torch.Tensor, int]:
    """``(K, K)`` Hessian of ``loss(*tensors, *args)`` over the selected entries of ``tensors``
    (joint, ``K`` entries in all, not symmetrised), and how many uses took a sparse rule;
    ``inputs`` are ``(*tensors, *coords, *args)``: ``n_tensors`` tensors, then each one's
    :func:`selected_entries`, flat as a compiled kernel takes them. Raises :class:`NotSparse`
    (before any Hessian work) where it does not apply.

    The tensors must share one dtype and device (checked by the caller).
    """
    tensors, coords = inputs[:n_tensors], inputs[n_tensors : 2 * n_tensors]
    args = inputs[2 * n_tensors :]
    size = sum(c.shape[1] for c in coords)
    z0 = tensors[0].new_zeros(size)
    uses = []

    def restricted(z: torch.Tensor) -> torch.Tensor:
        mode = Injection(tensors, coords, z, min(chunk_size or size, size))
        with mode:
            out = loss(*tensors, *args)
        uses.append(mode.sparse_uses)
        return out

    hessian = torch.func.jacrev(torch.func.grad(restricted), chunk_size=chunk_size)(z0)
    return hessian.detach(), uses[0]


@functools.cache
def compiles() -> bool:
    """Whether dynamo traces :func:`restricted_hessian` as it runs eagerly on this torch: asked
    once per process, before its first compile, on ``sum(F.linear(x, W, b) ** 3)`` with ``W`` and
    ``b`` selected (both injection paths), traced by dynamo alone (no inductor; 0.7 s here, 2.6 s
    as a process's first dynamo trace). Torch 2.5 traces the loss without the mode it enters (a
    zero Hessian), 2.6 fails on ``F.linear`` inside it; 2.13 and 2.14 trace it."""
    return _traces_as_eager(lambda x, weight, bias: F.linear(x, weight, bias))


@functools.cache
def compiles_property_views() -> bool:
    """Whether dynamo traces :func:`restricted_hessian` as it runs eagerly on a selected tensor
    viewed through a tensor property, ``x @ W.T``, with the handlers
    :func:`~pyhvp.restricted.dynamo_views.handed_to_the_mode` lends it: asked once per process,
    where a compiled kernel would take one. Torch 2.14 hands the mode ``W.T`` as
    ``aten.numpy_T``, and so does 2.13 with the lent handlers; where it still does not, a kernel
    over it runs eagerly (compiled, its ``W.T`` would be a constant)."""
    with handed_to_the_mode():
        return compiles() and _traces_as_eager(lambda x, weight, bias: x @ weight.T + bias)


def _traces_as_eager(layer: Callable[..., torch.Tensor]) -> bool:
    """Whether the compiled kernel's Hessian of ``sum(layer(x, W, b) ** 3)`` over every entry of
    ``W`` and ``b`` equals the eager one (and is not zero)."""
    inputs = torch.tensor([[1.0, 2.0]], dtype=torch.float64)

    def cubed(weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return (layer(inputs, weight, bias) ** 3).sum()

    tensors = (torch.tensor([[1.0, -1.0], [0.5, 2.0]], dtype=torch.float64), inputs[0])
    coords = [selected_entries(t, torch.arange(t.numel())) for t in tensors]
    expected, _ = restricted_hessian(cubed, 2, None, *tensors, *coords)
    probe = types.FunctionType(
        restricted_hessian.__code__.replace(), restricted_hessian.__globals__
    )
    try:
        with torch.no_grad():
            got, _ = torch.compile(probe, backend="eager", dynamic=False)(
                cubed, 2, None, *tensors, *coords
            )
    except Exception:  # any failure to trace means: do not compile
        return False
    return bool(expected.abs().sum() > 0) and torch.allclose(got, expected, rtol=1e-12, atol=0.0)
