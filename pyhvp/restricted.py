"""Sub-Hessians by sparse injection: the loss restricted to the k selected entries, whose one-hot
directions enter each linear layer as gathered input columns instead of dense tangents.

The restricted function is ``g(z) = loss(params with entry s_p of its tensor shifted by z_p)`` at
``z = 0``, so ``hessian(g)(0) = E_S^T H E_S`` exactly (repeated entries included). It is evaluated
under a ``TorchFunctionMode`` that sees every use of a selected tensor ``W``:

* as the ``weight`` of ``F.linear`` (``nn.Linear`` and friends): ``linear(x, W, b)`` plus, for each
  selected entry ``(i, j)`` of ``W``, ``x[..., j] * z_p`` added to output column ``i`` -- a gather
  and an ``index_add``, never a product with a dense one-hot tangent of ``W``'s shape;
* any other use (a bias, ``W ** 2``, ``x @ W.t()``): ``W + scatter(z)``, correct but dense, so it
  is taken only for tensors of at most :data:`DENSE_LIMIT` entries (biases); a larger tensor used so
  raises :class:`NotSparse` at once, and the caller takes the reverse path instead;
* a write to a selected tensor (in place, ``out=``) raises :class:`NotSparse` too.

``hessian(g)`` is ``jacrev(grad(g))`` over the k-vector ``z``: one forward, one backward, then k
reverse passes of the backward batched by ``vmap``. No pass reaches a dense gradient of ``W``:
``d g / d z_p`` is a gathered column of the input times a column of the output's adjoint, so each
direction costs the part of the network downstream of the first layer that holds a selected
entry, not a full Hessian-vector product (on the seed's ``Linear(784, 10)`` a direction costs
``O(batch * classes)`` instead of ``O(batch * 784 * 10)``). Scope: any loss, with the speed-up for
selected weights of ``F.linear``; everything else is refused here, never approximated.

:func:`restricted_hessian` is a kernel of the torch backend (``TorchBackend.restricted_hessian``),
run eagerly or compiled under its compile policy. Dynamo traces it whole -- the mode, ``jacrev``
and ``vmap`` -- into one graph that inductor fuses, guarded as every compiled kernel is (the
loss's code and captured state, every tensor's metadata); the mode is written for that: it finds
a selected tensor by ``is`` rather than by ``id()`` (which dynamo would guard on) and reads an
op's name through ``torch.compiler.assume_constant_result``. A loss it refuses raises
:class:`NotSparse` compiled as eagerly. Where dynamo drops a mode entered inside the traced
function (torch 2.5: a zero Hessian; 2.6 fails inside it), :func:`compiles` says so before the
first compile, and the kernel runs eagerly.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

DENSE_LIMIT = 4096
"""Most entries a selected tensor may have and still enter densely (``W + scatter(z)``)."""


MIN_COMPONENTS = 8
"""Fewest selected components (K, all tensors together) for which ``method="auto"`` takes the
sparse route unless the backend compiles from the first call: below it the K reverse HVPs are
few, and the eager reverse route costs less than the eager sparse route's fixed
``jacrev``/``vmap`` setup (seed model, k = 2 per tensor: 1.24x the seed loop reverse, 1.53x
sparse). Compiled, the sparse kernel is the faster one at every K measured (0.65x against
0.85x there), so ``compile=True`` takes it from one component on."""


class NotSparse(BaseException):
    """The sparse path does not apply to this loss; the caller falls back to the reverse path.

    A ``BaseException``, so an ``except Exception`` inside the user's loss cannot swallow it.
    """


class _Injection(TorchFunctionMode):
    """Shifts the selected entries of ``tensors`` by ``z`` wherever the loss uses them."""

    def __init__(
        self, tensors: Sequence[torch.Tensor], entries: Sequence[torch.Tensor], z: torch.Tensor
    ) -> None:
        super().__init__()
        parts = torch.split(z, [entry.shape[1] for entry in entries])
        # found by ``is`` in a short list, not by ``id()``: dynamo traces ``is`` between tensors
        # without guarding on object ids, which change with every call's tensors
        self.selected = list(zip(tensors, entries, parts, strict=True))
        self.sparse_uses = 0

    def _entry(self, value: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        if isinstance(value, torch.Tensor):
            for entry in self.selected:
                if entry[0] is value:
                    return entry
        return None

    def _dense(self, value: object, func: Callable[..., Any]) -> object:
        entry = self._entry(value)
        if entry is None:
            return value
        tensor, entries, part = entry
        if tensor.numel() > DENSE_LIMIT:
            raise NotSparse(
                f"a selected tensor of {tensor.numel()} entries (over {DENSE_LIMIT}) is used by "
                f"{_name(func)}, not as the weight of F.linear"
            )
        return tensor.reshape(-1).index_add(0, entries[0], part).view_as(tensor)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        values = pytree.tree_leaves((args, kwargs))
        if not any(self._entry(v) is not None for v in values):
            return func(*args, **kwargs)
        if _in_place(func) or "out" in kwargs:
            raise NotSparse(f"{_name(func)} writes to a selected tensor")
        if func is F.linear:
            named = dict(zip(("input", "weight", "bias"), args, strict=False)) | kwargs
            entry = self._entry(named.get("weight"))
            if entry is not None and set(named) <= {"input", "weight", "bias"}:
                weight, entries, part = entry
                x = self._dense(named["input"], func)
                bias = self._dense(named.get("bias"), func)
                assert isinstance(x, torch.Tensor) and (
                    bias is None or isinstance(bias, torch.Tensor)
                )
                out = func(x, weight, bias)
                self.sparse_uses += 1
                _, rows, columns = entries
                return out.index_add(-1, rows, x.index_select(-1, columns) * part)
        args, kwargs = pytree.tree_map(lambda v: self._dense(v, func), (tuple(args), kwargs))
        return func(*args, **kwargs)


def _name(func: Callable[..., Any]) -> str:
    return getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))


def _named_in_place(func: Callable[..., Any]) -> bool:
    """Whether ``func``'s name says it writes to its first argument (``add_``, ``__iadd__``,
    ``__setitem__``, ``copy_``); a write into ``out=`` is the other kind a caller checks."""
    name = getattr(func, "__name__", "")
    dunder = name.startswith("__") and name.endswith("__")
    in_place = (name.endswith("_") and not dunder) or name == "__setitem__"
    return in_place or (dunder and name.startswith("__i") and name != "__index__")


# torch.compiler.assume_constant_result carries no annotations (torch 2.13)
_in_place: Callable[[Callable[..., Any]], bool] = torch.compiler.assume_constant_result(  # type: ignore[no-untyped-call]
    _named_in_place
)
""":func:`_named_in_place`, which dynamo calls at trace time (a constant of ``func``) instead of
tracing its string tests."""


def selected_entries(tensor: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """``(3, k)``: the flat indices ``flat`` of ``tensor``'s entries, and their row and column as
    a linear layer's weight (``divmod`` by the last dim). Computed once per call, outside the
    kernel: inside, a compiler recomputes such an integer division in every loop that reads it."""
    columns = tensor.shape[-1] if tensor.dim() else 1
    return torch.stack((flat, flat // columns, flat % columns))


def restricted_hessian(
    loss: Callable[..., torch.Tensor], n_tensors: int, chunk_size: int | None, *inputs: Any
) -> tuple[torch.Tensor, int]:
    """``(K, K)`` Hessian of ``loss(*tensors, *args)`` over the selected entries of ``tensors``
    (joint, ``K`` entries in all, not symmetrised), and how many ``F.linear`` calls took the
    sparse route; ``inputs`` are ``(*tensors, *entries, *args)``: ``n_tensors`` tensors, then
    each one's :func:`selected_entries`, flat as a compiled kernel takes them. Raises
    :class:`NotSparse` (before any Hessian work) where it does not apply.

    The tensors must share one dtype and device (checked by the caller).
    """
    tensors, entries = inputs[:n_tensors], inputs[n_tensors : 2 * n_tensors]
    args = inputs[2 * n_tensors :]
    z0 = tensors[0].new_zeros(sum(entry.shape[1] for entry in entries))
    uses = []

    def restricted(z: torch.Tensor) -> torch.Tensor:
        mode = _Injection(tensors, entries, z)
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
    inputs = torch.tensor([[1.0, 2.0]], dtype=torch.float64)

    def cubed(weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return (F.linear(inputs, weight, bias) ** 3).sum()

    tensors = (torch.tensor([[1.0, -1.0], [0.5, 2.0]], dtype=torch.float64), inputs[0])
    entries = [selected_entries(t, torch.arange(t.numel())) for t in tensors]
    expected, _ = restricted_hessian(cubed, 2, None, *tensors, *entries)
    probe = types.FunctionType(
        restricted_hessian.__code__.replace(), restricted_hessian.__globals__
    )
    try:
        with torch.no_grad():
            got, _ = torch.compile(probe, backend="eager", dynamic=False)(
                cubed, 2, None, *tensors, *entries
            )
    except Exception:  # any failure to trace means: do not compile
        return False
    return bool(expected.abs().sum() > 0) and torch.allclose(got, expected, rtol=1e-12, atol=0.0)
