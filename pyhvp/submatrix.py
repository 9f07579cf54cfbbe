"""Sub-Hessians: the Hessian of a scalar loss restricted to selected parameter components.

One routine does the work: the chosen tensors are concatenated into one vector x, their k
selected components become k one-hot tangents of ONE batched Hessian-vector-product pass of the
backend (``grad_and_hvp``, vmapped and chunked over the tangents), and of the columns ``H e_j`` it
returns only the selected rows are kept. ``joint=True`` runs it once over all selected tensors
(cross blocks included); per-tensor blocks run it once per tensor, the others held constant, so
no tangent pays for the cross blocks nobody asked for (measured once while choosing: on a
784-128-10 MLP with k=128 per tensor, compiled, 77 ms against 261 ms for cutting the blocks out
of the joint pass), and memory ``sum k_i * numel_i`` instead of ``K * sum numel_i``.

Cost: one HVP (a few gradients' worth of work) per selected component, batched, so no per-row
Python round trip; memory ``c * P`` for the tangents and the columns of a pass (P: entries of
its tensors, c = ``chunk_size``, default all k) plus that chunk's intermediates.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Literal, overload

import torch
from torch.func import functional_call

from pyhvp._checks import (
    check_chunk_size,
    check_output_shape,
    fmt_shape,
    require_floating,
    require_like,
    require_tensor,
)
from pyhvp.backends import Backend, resolve_backend

Params = dict[str, torch.Tensor]


@overload
def sub_hessian(
    loss: Callable[[torch.Tensor], torch.Tensor],
    params: torch.Tensor,
    index: torch.Tensor,
    *,
    joint: bool = False,
    chunk_size: int | None = None,
    backend: str | Backend = "torch",
) -> torch.Tensor: ...


@overload
def sub_hessian(
    loss: Callable[[Params], torch.Tensor],
    params: Mapping[str, torch.Tensor],
    index: Mapping[str, torch.Tensor],
    *,
    joint: Literal[False] = False,
    chunk_size: int | None = None,
    backend: str | Backend = "torch",
) -> Params: ...


@overload
def sub_hessian(
    loss: Callable[[Params], torch.Tensor],
    params: Mapping[str, torch.Tensor],
    index: Mapping[str, torch.Tensor],
    *,
    joint: Literal[True],
    chunk_size: int | None = None,
    backend: str | Backend = "torch",
) -> torch.Tensor: ...


def sub_hessian(
    loss: Callable[[Any], torch.Tensor],
    params: torch.Tensor | Mapping[str, torch.Tensor],
    index: torch.Tensor | Mapping[str, torch.Tensor],
    *,
    joint: bool = False,
    chunk_size: int | None = None,
    backend: str | Backend = "torch",
) -> torch.Tensor | Params:
    """Hessian of the scalar ``loss(params)`` over the components ``index`` selects.

    Shapes: a tensor ``params`` with a 1-D integer ``index`` of k flat indices gives ``(k, k)``; a
    dict of tensors with a dict of such indices gives ``{name: (k_i, k_i)}`` (one block per name in
    ``index``), or with ``joint=True`` one ``(K, K)`` matrix, ``K = sum k_i``, blocks in ``index``'s
    order, cross blocks included. Indices are flat (row-major) positions in ``[0, numel)``, kept in
    the given order; negative ones are rejected, repeated ones repeat their row and column. Tensors
    of ``params`` not named in ``index`` are held constant. The result is symmetrised,
    ``(S + S.T) / 2``, so it is exactly symmetric; it carries no autograd graph and ``params`` is
    not modified. ``chunk_size`` bounds how many tangents (selected components) are pushed at
    once. Blocks cost one batched pass per tensor, ``joint=True`` one pass over all
    (whose tensors must then share one dtype and device).

    >>> loss = lambda p: p[0] ** 2 * p[1] + p[2] ** 3       # H: [[2 p1, 2 p0, 0], [2 p0, 0, 0], [0, 0, 6 p2]]
    >>> H = sub_hessian(loss, torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2, 0, 1]))
    >>> torch.equal(H, torch.tensor([[18.0, 0.0, 0.0], [0.0, 4.0, 2.0], [0.0, 2.0, 0.0]]))
    True
    """
    if not isinstance(joint, bool):
        raise ValueError(f"joint must be True or False, got {joint!r}")
    chunk_size = check_chunk_size(chunk_size)
    resolved = resolve_backend(backend)
    if isinstance(params, torch.Tensor):
        tensor = require_floating("params", params).detach()
        flat = _check_index("index", index, tensor.numel(), "params")
        flat_loss = _FlatLoss(loss, (), None, tensor.shape)
        return _selected_hessian(flat_loss, [tensor], [flat], (), chunk_size, resolved)
    if not isinstance(params, Mapping):
        raise TypeError(
            f"params must be a torch.Tensor or a dict[str, Tensor], got {type(params).__name__}"
        )
    if not isinstance(index, Mapping):
        raise TypeError(
            f"index must be a dict[str, LongTensor] like params, got {type(index).__name__}"
        )
    if not index:
        raise ValueError("index must name at least one tensor of params, got an empty dict")
    fixed = {name: require_tensor(f"params[{name!r}]", p).detach() for name, p in params.items()}
    names = list(index)
    for name in names:
        if name not in fixed:
            raise ValueError(
                f"index names {name!r}, which is not a key of params (keys: {list(fixed)})"
            )
        require_floating(f"params[{name!r}]", fixed[name])
        if joint:  # one concatenated vector: one dtype, one device
            require_like(f"params[{name!r}]", fixed[name], f"params[{names[0]!r}]", fixed[names[0]])
    flats = {
        name: _check_index(
            f"index[{name!r}]", index[name], fixed[name].numel(), f"params[{name!r}]"
        )
        for name in names
    }

    def selected_hessian(selected: list[str]) -> torch.Tensor:
        return _selected_hessian(
            _FlatLoss(loss, tuple(fixed), tuple(selected)),
            [fixed[name] for name in selected],
            [flats[name] for name in selected],
            tuple(fixed.values()),
            chunk_size,
            resolved,
        )

    if joint:
        return selected_hessian(names)
    return {name: selected_hessian([name]) for name in names}


def module_loss(
    module: torch.nn.Module,
    criterion: Callable[[Any, Any], torch.Tensor],
    inputs: Any,
    targets: Any,
) -> tuple[Callable[[Params], torch.Tensor], Params]:
    """``(loss, params)`` of an ``nn.Module``, ready for ``sub_hessian(loss, params, index)``.

    ``params`` is ``{name: tensor}`` over ``module.named_parameters()``, detached (sharing storage
    with the module, never written); ``loss(params)`` is ``criterion(module(inputs), targets)``
    run with ``params`` through ``torch.func.functional_call`` (a tuple ``inputs`` is passed as
    several positional arguments). Buffers come from the module; use ``module.eval()`` for layers
    that update buffers in training mode (batch norm).

    >>> net = torch.nn.Linear(2, 1, bias=False)              # loss = |X w|^2, H = 2 X^T X
    >>> loss, params = module_loss(net, lambda out, t: ((out - t) ** 2).sum(), torch.eye(2), torch.zeros(2, 1))
    >>> torch.equal(sub_hessian(loss, params, {"weight": torch.tensor([0, 1])})["weight"], 2 * torch.eye(2))
    True
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not callable(criterion):
        raise TypeError(
            f"criterion must be callable as criterion(outputs, targets), got {type(criterion).__name__}"
        )
    params = {name: p.detach() for name, p in module.named_parameters()}
    if not params:
        raise ValueError(f"module must have parameters, got a {type(module).__name__} with none")

    def loss(p: Params) -> torch.Tensor:
        return criterion(functional_call(module, p, inputs), targets)

    return loss, params


def _check_index(name: str, index: object, numel: int, of: str) -> torch.Tensor:
    """A 1-D, non-empty integer tensor of flat indices in ``[0, numel)``, as int64."""
    index = require_tensor(name, index)
    if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
        raise TypeError(
            f"{name} must have an integer dtype (flat indices, e.g. torch.long), got {index.dtype}"
        )
    if index.ndim != 1 or index.numel() == 0:
        raise ValueError(
            f"{name} must be a non-empty 1-D tensor of flat indices, got shape {fmt_shape(index.shape)}"
        )
    low, high = int(index.min()), int(index.max())
    if low < 0 or high >= numel:
        raise ValueError(
            f"{name} must hold flat indices in [0, {numel}) ({of} has {numel} entries; negative "
            f"indices are not accepted), got {low if low < 0 else high}"
        )
    return index.long()


@dataclass(frozen=True)
class _FlatLoss:
    """``loss`` as a function of ONE vector (the selected tensors, concatenated) and the params.

    ``selected`` names the tensors the vector holds (``None``: params is that single tensor, of
    shape ``shape``). The params come as arguments, so a compiled kernel takes them as inputs; being a frozen
    dataclass, equal for the same ``loss`` and names, it keeps the backend's compile cache warm
    across calls.
    """

    loss: Callable[..., torch.Tensor]
    names: tuple[str, ...]
    selected: tuple[str, ...] | None
    shape: torch.Size | None = None

    def __call__(self, y: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        if self.selected is None:
            out = self.loss(y.view(self.shape))
        else:
            given = dict(zip(self.names, params, strict=True))
            sizes = [given[name].numel() for name in self.selected]
            parts = dict(zip(self.selected, y.split(sizes), strict=True))
            out = self.loss(
                {n: parts[n].view(p.shape) if n in parts else p for n, p in given.items()}
            )
        check_output_shape("loss", out, (), "a scalar loss")
        return out


def _selected_hessian(
    flat_loss: _FlatLoss,
    tensors: list[torch.Tensor],
    flats: list[torch.Tensor],
    params: tuple[torch.Tensor, ...],
    chunk_size: int | None,
    backend: Backend,
) -> torch.Tensor:
    """Symmetrised ``(K, K)`` Hessian over the selected entries of the concatenated tensors."""
    sizes = [t.numel() for t in tensors]
    x = torch.cat([t.reshape(-1) for t in tensors])
    offsets = [0, *accumulate(sizes)]
    selected = torch.cat(
        [f.to(x.device) + offset for f, offset in zip(flats, offsets, strict=False)]
    )
    rows = []  # one chunk of one-hot tangents at a time: memory O(chunk_size * P), not O(K * P)
    for chunk in selected.split(chunk_size or selected.numel()):
        tangents = torch.zeros(chunk.numel(), x.numel(), dtype=x.dtype, device=x.device)
        tangents[torch.arange(chunk.numel(), device=x.device), chunk] = 1
        _, columns = backend.grad_and_hvp(flat_loss, x, tangents, params, 1, None)
        rows.append(columns[:, selected])
    block = torch.cat(rows)
    return (block + block.mT) / 2
