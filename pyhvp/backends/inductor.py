"""The inductor backend the torch backend compiles with: ``backend="inductor"`` with a pass that
gives indexed writes into an expanded tensor a fresh destination.

Inductor's reinplace pass turns a functional indexed write (``index_put``, which ``index_add``,
``index_copy`` and advanced-index assignment lower to; ``slice_scatter``, ``select_scatter``...)
into an in-place one when it judges the mutation unobservable. When the destination is an
intermediate with internal overlap -- ``zeros(n).expand(k, n)``, which ``vmap`` makes of an
unbatched destination -- the rows then share one storage, and every row gets the sum of all
rows' writes: a silently wrong result (pytorch#183986; seen on torch 2.5.1 and 2.13, fixed in
2.14). pyhvp's compiled Hessian-vector products hit it for any ``f`` using ``index_select`` or
``index_add`` (the batched backward of ``index_select`` is an ``index_add`` into expanded
zeros), and its jet kernels for ``index_add``. :func:`fresh_destinations`, run after inductor's
own post-grad passes and before reinplacing, clones such a destination into a dense tensor
first (a copy only where the destination overlaps itself; no other graph change). What the pass
does not catch, the first-call check of every compiled kernel does
(:func:`pyhvp.backends.compile_policy.disagreement`): on torch 2.5.1 the compiled HVP of an
index assignment is still wrong with the pass, and runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import fx

aten = torch.ops.aten

INDEXED_WRITES = frozenset(
    {
        aten.index_put.default,
        aten._unsafe_index_put.default,
        aten.index_add.default,
        aten.index_copy.default,
        aten.slice_scatter.default,
        aten.select_scatter.default,
        aten.diagonal_scatter.default,
        aten.as_strided_scatter.default,
        aten.scatter.src,
        aten.scatter.value,
        aten.scatter_add.default,
        aten.scatter_reduce.two,
    }
)
"""Functional writes whose first argument is the destination."""


def overlaps_itself(value: object) -> bool:
    """A tensor whose elements share storage (a dim of size > 1 with stride 0), or whose layout
    torch cannot prove free of overlap: ``_debug_has_internal_overlap`` answers YES or TOO_HARD."""
    return isinstance(value, torch.Tensor) and bool(torch._debug_has_internal_overlap(value))


def fresh_destinations(graph: fx.Graph) -> None:
    """Clone (contiguous) the destination of every indexed write that overlaps itself."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in INDEXED_WRITES or not node.args:
            continue
        destination = node.args[0]
        if not isinstance(destination, fx.Node):
            continue
        value = destination.meta.get("val")
        if not overlaps_itself(value):
            continue
        with graph.inserting_before(node):
            fresh = graph.call_function(
                aten.clone.default, (destination,), {"memory_format": torch.contiguous_format}
            )
        assert isinstance(value, torch.Tensor)
        fresh.meta["val"] = value.clone(memory_format=torch.contiguous_format)
        node.update_arg(0, fresh)


try:  # torch 2.6 and later: the FX graph cache keys a custom pass by its uuid, else bypasses
    from torch._inductor.custom_graph_pass import CustomGraphPass as _PassBase
    from torch._inductor.custom_graph_pass import get_hash_for_files
except ImportError:  # torch 2.5 pickles the pass into the cache key: a module-level class
    _PassBase = object  # type: ignore[misc, assignment]


class FreshDestinations(_PassBase):
    """:func:`fresh_destinations` as inductor's FX graph cache wants a custom pass."""

    def __call__(self, graph: fx.Graph) -> None:
        fresh_destinations(graph)

    def uuid(self) -> bytes:
        return bytes(get_hash_for_files((__file__,)))


def backend() -> Callable[..., object]:
    """A ``torch.compile`` backend: what ``backend="inductor"`` makes, with this pass, and with
    ``fallback_random``: random ops (a dropout in training) draw from torch's generator as eagerly,
    the numbers the eager kernel draws, where inductor's own CUDA generator draws others (each
    compiled kernel's first result is checked against eager's, and a kernel whose draws differ
    would run eagerly). (``options=`` would not take the pass on torch 2.5, which checks an
    option's type against its default, ``None``.)"""
    wrapper = torch._TorchCompileInductorWrapper(None, None, False)  # type: ignore[no-untyped-call]
    wrapper.config["post_grad_custom_post_pass"] = FreshDestinations()
    wrapper.config["fallback_random"] = True
    return cast(Callable[..., object], wrapper)
