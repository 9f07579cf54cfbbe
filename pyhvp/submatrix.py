"""Sub-Hessians: the Hessian of a scalar loss restricted to selected parameter components.

Three routes: two taken per selected tensor by a cost model, the third for every tensor at once:

* **sparse** (:mod:`pyhvp.restricted`): the loss as a function of the k selected entries only,
  whose one-hot directions enter each op that consumes a selected tensor linearly -- ``F.linear``,
  ``matmul``/``mm``/``bmm``/``@``, ``einsum``, convolutions and their transposes, embeddings, and
  views of the tensor (``W.T``) -- as what they add to its output (a gathered input column, a
  shifted slice, the tokens an embedding row reaches), never as dense tangents of the tensor; the
  ``(K, K)`` Hessian of a group of tensors by ``jacrev(grad)`` over their K-vector. A direction
  costs the network downstream of the op its entry enters, never that op's dense products.
* **reverse**: the selected components become one-hot tangents of the backend's multi-leaf
  primitive (``grad_and_block_hvps``): one forward and one first backward shared by every tensor
  of the route, then per tensor a batched second pass that differentiates towards that tensor
  only, of whose columns ``H e_j`` only the selected rows are kept. Cost: one full Hessian-vector
  product per selected component; ``joint=True`` pushes all selected tensors as one vector.
* **forward** (:mod:`pyhvp.restricted.forward`): every selected entry's tangent pushed forward
  through the loss (entering a contraction by its sparse rule), every activation's adjoint by
  one reverse pass, and per nonlinear op its second-order term between the tangents -- a
  weighted Gram matrix at ``tanh`` or ``gelu``. A direction costs a forward push, never a
  reverse pass; the pairwise terms cost ``k^2`` per op. It runs eagerly and takes every
  component of a tensor at once, per tensor in passes of tensors whose tangents fit
  ``routes.FORWARD_TANGENTS``. A pass of few tangents holds every activation's (``k`` times the
  activations) to its reverse pass at the end; one of ``routes.TWICE_FROM`` or more runs the loss
  twice, the reverse pass first, adding each term at its op's call and dropping each value's
  tangents after their last use (``k`` times the activations alive at once).

Cost model (``method="auto"``, :mod:`pyhvp.restricted.routes`): one survey of the loss (cached
per call signature) learns how each selected tensor enters each op, the work downstream of it
and the products a dense direction of it pays; modelled times then split the tensors between
sparse groups and the reverse route. Tensors the sparse route refuses (an op without a sparse
rule on a tensor over ``restricted.DENSE_LIMIT`` entries, a write, an embedding's padding row, a
use its mode does not see, found by the survey; all, under ``"auto"`` inside a ``torch.func``
transform, where the survey cannot look for those) take the reverse route; below
``routes.MIN_COMPONENTS`` in all, of tensors of at most ``routes.LOOP_ENTRIES`` entries (of a
larger one, at its first call), every tensor does without a survey (unless the backend compiles
from the first call), by the seed's loop. The reverse route runs as the seed's loop itself
(one backward per component: no batched tangents, no batching setup) at most
``FEW_TANGENTS`` (4) components per tensor unless the backend compiles from the first call,
and where the cost model prices it cheaper. With
``joint=True`` the reverse route's rows fill the cross blocks of its tensors. An equal call made
again (no ``data``; ``compile`` False or True) measures: the model's routes against the seed's
loop and, unless compiling, the sparse and the reverse route alone, and the forward route
(in passes within ``routes.FORWARD_TANGENTS``), up to two timed runs each, then the fastest
(:mod:`pyhvp.restricted.trial`). The choice is logged on the ``pyhvp.sub_hessian`` logger at
DEBUG level. Both routes' kernels compile under the torch backend's compile policy.

With ``data``, the loss is summed over batches: one such pass per batch (and per chunk), the rows
accumulated, so memory is bounded by one batch; the routes chosen on the first batch hold until a
batch uses a tensor differently or has another structure, which is surveyed anew. With
``group``, each rank sums its own batches, and one ``all_reduce`` adds the ranks' sums and
symmetrises after (:mod:`pyhvp.distributed`). Memory: ``c * P`` for the tangents and columns of
a reverse pass (P: entries of the selected tensors, c = ``chunk_size``, default all k) plus that
pass's intermediates; a sparse group holds c copies of the intermediates downstream of its
first tensor, and per op it enters at most ``K * out`` for its directions' tangents.
"""

from __future__ import annotations

import dataclasses
import dis
import inspect
import logging
import os
import threading
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from itertools import accumulate
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, cast, overload

import torch
from torch.autograd.variable import Variable
from torch.func import functional_call
from torch.utils import _pytree as pytree

from pyhvp import _random_state as random_states
from pyhvp import restricted
from pyhvp._attention import math_attention
from pyhvp._checks import (
    check_chunk_size,
    check_output,
    fmt_shape,
    refuse_arrays,
    require_dense,
    require_floating,
    require_like,
    require_tensor,
)
from pyhvp._differentiated_twice import differentiated_twice
from pyhvp._embeddings import TwiceDifferentiable, twice_differentiable_embeddings
from pyhvp._keys import wrapped
from pyhvp._progress import progress_bar
from pyhvp._public import public_operator
from pyhvp._user_errors import PACKAGE, stacklevel_outside_pyhvp
from pyhvp.backends import Backend, compile_policy, nested, require_primitive, resolve_backend
from pyhvp.backends.torch import (
    TorchBackend,
    _normal,
    check_twice_differentiable,
    unsettled_calls,
)
from pyhvp.distributed import Fingerprint, check_group, sum_over_ranks
from pyhvp.restricted import NotSparse, WritesSelected, routes
from pyhvp.restricted.forward import forward_hessian
from pyhvp.restricted.mode import PADDING_ROW
from pyhvp.restricted.state import Held, recorded
from pyhvp.restricted.trial import CONFIRM_AFTER, MODEL, Trial

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

Params = dict[str, torch.Tensor]
METHODS = ("auto", "sparse", "reverse", "forward")
FORCED = ("sparse", "forward")
"""Methods that raise ``ValueError`` with the reason where they do not apply."""
FORWARD = "the forward-tangent route"
MODEL_INSTEAD = "the split the cost model's forward route replaced"
_log = logging.getLogger("pyhvp.sub_hessian")


@overload
def sub_hessian(
    loss: Callable[..., torch.Tensor],
    params: torch.Tensor,
    index: torch.Tensor,
    *,
    data: Iterable[Any] | None = None,
    group: ProcessGroup | None = None,
    joint: bool = False,
    chunk_size: int | None = None,
    backend: str | Backend = "torch",
    progress: bool = False,
    method: Literal["auto", "sparse", "reverse", "forward"] = "auto",
) -> torch.Tensor: ...


@overload
def sub_hessian(
    loss: Callable[..., torch.Tensor],
    params: Mapping[str, torch.Tensor],
    index: Mapping[str, torch.Tensor],
    *,
    data: Iterable[Any] | None = None,
    group: ProcessGroup | None = None,
    joint: Literal[False] = False,
    chunk_size: int | None = None,
    backend: str | Backend = "torch",
    progress: bool = False,
    method: Literal["auto", "sparse", "reverse", "forward"] = "auto",
) -> Params: ...


@overload
def sub_hessian(
    loss: Callable[..., torch.Tensor],
    params: Mapping[str, torch.Tensor],
    index: Mapping[str, torch.Tensor],
    *,
    data: Iterable[Any] | None = None,
    group: ProcessGroup | None = None,
    joint: Literal[True],
    chunk_size: int | None = None,
    backend: str | Backend = "torch",
    progress: bool = False,
    method: Literal["auto", "sparse", "reverse", "forward"] = "auto",
) -> torch.Tensor: ...


@public_operator
def sub_hessian(
    loss: Callable[..., torch.Tensor],
    params: torch.Tensor | Mapping[str, torch.Tensor],
    index: torch.Tensor | Mapping[str, torch.Tensor],
    *,
    data: Iterable[Any] | None = None,
    group: ProcessGroup | None = None,
    joint: bool = False,
    chunk_size: int | None = None,
    backend: str | Backend = "torch",
    progress: bool = False,
    method: Literal["auto", "sparse", "reverse", "forward"] = "auto",
) -> torch.Tensor | Params:
    """Hessian of the scalar ``loss(params)`` over the components ``index`` selects.

    Shapes: a tensor ``params`` with a 1-D integer ``index`` of k flat indices gives ``(k, k)``; a
    dict of tensors with a dict of such indices gives ``{name: (k_i, k_i)}`` (one block per name in
    ``index``), or with ``joint=True`` one ``(K, K)`` matrix, ``K = sum k_i``, blocks in ``index``'s
    order, cross blocks included. Indices are flat (row-major) positions in ``[0, numel)``, kept in
    the given order; negative ones are rejected, repeated ones repeat their row and column. Tensors
    of ``params`` not named in ``index`` are held constant. With ``data`` (an iterable of batches,
    e.g. a ``DataLoader``), ``loss(params, batch)`` is called per batch and the result is the
    sub-Hessian of the SUM over every batch (one batch in memory at a time; divide by the data set
    size for a mean). With ``group`` (a ``torch.distributed`` process group), every rank passes its
    own shard of batches and gets the same result: the sub-Hessian of the sum over all batches of
    all ranks, combined by one ``all_reduce``; a rank that raises, or ranks that disagree on
    params' shapes, ``index`` or ``joint``, make every rank raise instead of hang
    (:mod:`pyhvp.distributed` says how, and what can still hang). The result is symmetrised,
    ``(S + S.T) / 2``, so it is exactly symmetric; it carries no autograd graph and ``params`` is
    not modified. ``chunk_size`` bounds how many components of each tensor are pushed per pass.
    ``joint=True`` pushes all selected tensors as one vector, whose tensors must then share one
    dtype and device. ``method`` picks the route: ``"auto"`` (default: the cost model in the
    module docstring), ``"sparse"`` or ``"forward"`` (each raises ``ValueError`` with the reason
    where it does not apply) or ``"reverse"``; all give the same matrix. ``progress=True`` shows a tqdm bar over ``data``'s batches on stderr
    (batches done, rate, and time left when ``data`` has a length); with several
    ``torch.distributed`` ranks only rank 0 draws it.

    >>> loss = lambda p: p[0] ** 2 * p[1] + p[2] ** 3       # H: [[2 p1, 2 p0, 0], [2 p0, 0, 0], [0, 0, 6 p2]]
    >>> H = sub_hessian(loss, torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2, 0, 1]))
    >>> torch.equal(H, torch.tensor([[18.0, 0.0, 0.0], [0.0, 4.0, 2.0], [0.0, 2.0, 0.0]]))
    True
    """
    _refuse_differentiating_transforms()
    group = check_group(group)
    options = (joint, chunk_size, backend, progress, method, group)
    local = partial(_local_sums, loss, params, index, data, *options)

    def one_thread_at_a_time() -> tuple[list[torch.Tensor], Fingerprint]:
        # (the collective outside: ranks that are threads of one process wait for each other)
        with _ONE_CALL_AT_A_TIME:
            return local()

    sums = (one_thread_at_a_time()[0] if group is None
            else sum_over_ranks(one_thread_at_a_time, group, "sub_hessian"))  # fmt: skip
    blocks = [(s + s.mT) / 2 for s in sums]
    if isinstance(params, torch.Tensor) or joint:
        return blocks[0]
    return dict(zip(index, blocks, strict=True))


_ONE_CALL_AT_A_TIME = threading.RLock()
"""Calls of :func:`sub_hessian` from several threads run one after another: a
:func:`module_loss` swaps the module's parameters for the call's (``functional_call``), and the
routes' trials, the state put back and the module hooks that note it are the process's. Two
threads at once on one module gave blocks 0.06 off."""


def _refuse_differentiating_transforms() -> None:
    """A sub-Hessian carries no graph: inside ``torch.func.grad`` (or ``jvp``, ``jacrev``,
    ``hessian``, ...) its derivative would be silently zero. ``vmap`` is fine."""
    if nested.differentiation_levels():
        raise ValueError(
            "sub_hessian cannot be differentiated: its result carries no graph, so a torch.func "
            "transform around it (grad, jvp, jacrev, jacfwd, hessian) would see zeros; call it "
            "outside the transform (vmap around it is fine)"
        )


def _local_sums(
    loss: Callable[..., torch.Tensor],
    params: torch.Tensor | Mapping[str, torch.Tensor],
    index: torch.Tensor | Mapping[str, torch.Tensor],
    data: Iterable[Any] | None,
    joint: bool,
    chunk_size: int | None,
    backend: str | Backend,
    progress: bool,
    method: str,
    group: ProcessGroup | None,
) -> tuple[list[torch.Tensor], Fingerprint]:
    """This process's part of :func:`sub_hessian`: its arguments checked, the unsymmetrised
    block(s) summed over its batches (with a progress bar on the group's rank 0 if asked), and
    what every rank of a group must agree on."""
    for name, flag in (("joint", joint), ("progress", progress)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
    chunk_size = check_chunk_size(chunk_size)
    resolved = resolve_backend(backend)
    batches = _check_data(data)
    if progress and batches is not None:
        batches = progress_bar(batches, "sub_hessian", "batch", group)
    _check_loss(loss, batches is not None)
    averaging = _averaging_criterion(loss)
    if batches is not None and averaging is not None:
        batches = _warn_on_uneven_batches(batches, averaging)
    batch = None
    if batches is None and isinstance(loss, _ModuleLoss):
        loss, batch = loss.on_batch()
    if isinstance(params, torch.Tensor):
        tensor = require_floating("params", params).detach()
        flat = _check_index("index", index, tensor.shape, "params")
        selection = _Selection(loss, (), ())
        fingerprint = _compared(group, lambda: {
            "params' shape, dtype": (tuple(tensor.shape), str(tensor.dtype)),
            "index": flat.tolist(),
        })  # fmt: skip
        # its one block is the whole matrix: summed as a block of its own, not placed in a
        # matrix over every tensor's entries (which cost 50 us of a 390 us call)
        plan = _Plan(selection, [tensor], [flat], [], selection, [tensor], [flat],
                     one_block=False, batch=batch)  # fmt: skip
        return _reach_noted(plan, batches, chunk_size, resolved, method), fingerprint
    module = loss.module if isinstance(loss, _NamedByModule) else None
    fixed, flats = _check_named(params, index, joint, module)
    fingerprint = _compared(group, lambda: {
        "joint": joint,
        "params' names": list(fixed),
        "index's names, in order": list(flats),  # the blocks travel in this order
        **{f"params[{n!r}] shape, dtype": (tuple(p.shape), str(p.dtype))
           for n, p in fixed.items()},
        **{f"index[{name!r}]": flat.tolist() for name, flat in flats.items()},
    })  # fmt: skip
    names = list(flats)
    others = [p for name, p in fixed.items() if name not in flats]
    tensors = [fixed[name] for name in names]
    selection = _Selection(loss, tuple(fixed), tuple(names))
    if not joint:
        plan = _Plan(
            selection,
            tensors,
            list(flats.values()),
            others,
            selection,
            tensors,
            list(flats.values()),
            one_block=False,
            batch=batch,
        )
        return _reach_noted(plan, batches, chunk_size, resolved, method), fingerprint
    layouts = tuple(_Layout.of(fixed[name]) for name in names)
    reverse = _Selection(loss, tuple(fixed), tuple(names), joint_layouts=layouts)
    vector = torch.cat([t.reshape(-1) for t in tensors])
    offsets = accumulate([0, *(t.numel() for t in tensors)])
    joint_index = torch.cat([flats[name] + o for name, o in zip(names, offsets, strict=False)])
    plan = _Plan(
        selection,
        tensors,
        list(flats.values()),
        others,
        reverse,
        [vector],
        [joint_index],
        one_block=True,
        batch=batch,
    )
    return _reach_noted(plan, batches, chunk_size, resolved, method), fingerprint


def module_loss(
    module: torch.nn.Module,
    criterion: Callable[[Any, Any], torch.Tensor],
    inputs: Any = None,
    targets: Any = None,
) -> tuple[Callable[..., torch.Tensor], Params]:
    """``(loss, params)`` of an ``nn.Module``, ready for ``sub_hessian(loss, params, index)``.

    ``params`` is ``{name: tensor}`` over ``module.named_parameters()``, detached (sharing storage
    with the module, never written); ``loss(params)`` is ``criterion(module(inputs), targets)``
    run with ``params`` through ``torch.func.functional_call`` (a tuple ``inputs`` is passed as
    several positional arguments). Without ``inputs`` and ``targets``, the loss takes the batch
    instead -- ``loss(params, (inputs, targets))`` -- for ``sub_hessian(..., data=loader)``.
    Buffers come from the module; use ``module.eval()`` for layers that update buffers in
    training mode (batch norm). Params passed to ``sub_hessian`` in place of these must have the
    module's shapes (dtype and device may differ: float64 params and inputs for a float32 module).

    >>> net = torch.nn.Linear(2, 1, bias=False)              # loss = |X w|^2, H = 2 X^T X
    >>> loss, params = module_loss(net, lambda out, t: ((out - t) ** 2).sum(), torch.eye(2), torch.zeros(2, 1))
    >>> torch.equal(sub_hessian(loss, params, {"weight": torch.tensor([0, 1])})["weight"], 2 * torch.eye(2))
    True
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            "module must be the model itself, not its DistributedDataParallel wrapper, whose "
            "forward communicates with the other ranks (it broadcasts buffers: a batch norm's "
            "statistics), while sub_hessian runs the loss as often per batch as each rank's "
            "routes need: the ranks' broadcasts no longer pair up. Pass ddp_model.module (and "
            "group= to sum over the ranks)"
        )
    if not callable(criterion):
        raise TypeError(
            f"criterion must be callable as criterion(outputs, targets), got {type(criterion).__name__}"
        )
    params = {name: p.detach() for name, p in module.named_parameters()}
    if not params:
        swapped = isinstance(module, torch.nn.modules.loss._Loss) or (
            isinstance(criterion, torch.nn.Module) and any(criterion.parameters())
        )
        raise ValueError(
            f"module must have parameters, got a {type(module).__name__} with none"
            + (
                f" (and a {type(criterion).__name__} as criterion): module_loss takes the model "
                f"first and the criterion second, module_loss(model, criterion, inputs, targets)"
                if swapped
                else ""
            )
        )
    if inputs is None and targets is None:
        return _ModuleBatchLoss(module, criterion), params
    refuse_arrays("inputs", inputs)
    refuse_arrays("targets", targets)
    with torch.inference_mode(False):  # inference tensors: autograd cannot save them
        inputs, targets = _normal((inputs, targets))
    return _ModuleLoss(module, criterion, inputs, targets), params


class _NamedByModule:
    module: torch.nn.Module

    @property
    def __name__(self) -> str:
        """How messages name the loss: ``module_loss(LeNet5)``."""
        return f"module_loss({type(self.module).__name__})"


@dataclasses.dataclass(frozen=True, eq=False)
class _ModuleLoss(_NamedByModule):
    """``loss(params)`` of a module on its inputs and targets: :func:`module_loss` with data."""

    module: torch.nn.Module
    criterion: Callable[[Any, Any], torch.Tensor]
    inputs: Any
    targets: Any

    def __call__(self, params: Params) -> torch.Tensor:
        return _ModuleOnBatch(self.module, self.criterion)(params, (self.inputs, self.targets))

    def on_batch(self) -> tuple[_ModuleOnBatch, tuple[Any, Any]]:
        """This loss as a function of ``params`` and its batch, and the batch."""
        return _ModuleOnBatch(self.module, self.criterion), (self.inputs, self.targets)


@dataclasses.dataclass(frozen=True)
class _ModuleOnBatch(_NamedByModule):
    """A :class:`_ModuleLoss` with its inputs and targets passed as a batch, as ``sub_hessian``'s
    kernels run it: equal for every batch of a training loop (one compiled kernel, one routes'
    trial for all batches of a shape), where the loss itself is keyed by its batch's identity
    (``compile=True`` compiled anew for every batch, 1.2 s a call for a 2-layer MLP)."""

    module: torch.nn.Module
    criterion: Callable[[Any, Any], torch.Tensor]

    def __call__(self, params: Params, batch: tuple[Any, Any]) -> torch.Tensor:
        inputs, targets = batch
        return self.criterion(functional_call(self.module, params, inputs), targets)


@dataclasses.dataclass(frozen=True)
class _ModuleBatchLoss(_NamedByModule):
    """``loss(params, (inputs, targets))`` of a module: the data-set form of :func:`module_loss`."""

    module: torch.nn.Module
    criterion: Callable[[Any, Any], torch.Tensor]

    def __call__(self, params: Params, batch: tuple[Any, Any]) -> torch.Tensor:
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise TypeError(
                f"each batch of data must be a pair (inputs, targets) for a module_loss made "
                f"without inputs, got {type(batch).__name__}"
                + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
            )
        inputs, targets = batch
        if isinstance(inputs, list):  # a DataLoader collates a tuple of inputs into a list
            inputs = tuple(inputs)
        return _ModuleOnBatch(self.module, self.criterion)(params, (inputs, targets))


def _check_index(name: str, index: object, shape: torch.Size, of: str) -> torch.Tensor:
    """A 1-D integer tensor of flat indices into a tensor of ``shape``, as int64 (no entries:
    a ``(0, 0)`` block, as no batches give zeros -- nothing selected is not an error)."""
    index = require_dense(name, index)
    if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
        raise TypeError(
            f"{name} must have an integer dtype (flat indices, e.g. torch.long), got {index.dtype}"
        )
    if index.ndim != 1:
        raise ValueError(
            f"{name} must be a 1-D tensor of flat indices, got shape {fmt_shape(index.shape)}"
            + _flat_index_hint(index, shape, of)
        )
    numel = shape.numel()
    checked = index if index.dtype == torch.long else index.long()
    if checked.numel() == 0:
        return checked
    if checked.is_cpu and checked.numel() <= _FEW_INDICES and not nested.inside_transform():
        # from a list: a fourth of aminmax's time at a few indices (100-200x it at 1e5-2e6: a
        # Python int per entry); under vmap, aminmax's .item() names what a batched index does
        entries = checked.tolist()
        low, high = min(entries), max(entries)
    else:
        low, high = map(int, torch.aminmax(checked))  # (a sync)
    if low < 0 or high >= numel:
        raise ValueError(
            f"{name} must hold flat indices in [0, {numel}) ({of} has {numel} entries; negative "
            f"indices are not accepted), got {low if low < 0 else high}"
        )
    return checked


_FEW_INDICES = 64
"""Up to how many entries :func:`_check_index` reads a CPU index's bounds from a list (at
1000, 43 us where ``aminmax`` took 1.7)."""


def _flat_index_hint(index: torch.Tensor, shape: torch.Size, of: str) -> str:
    """How to flatten multi-indices (``(row, col)`` pairs) into the flat ones ``index`` takes."""
    if index.ndim != 2 or len(shape) < 2:
        return ""
    if len(shape) == 2:
        return (
            f": to select (row, col) entries of {of} (shape {fmt_shape(shape)}), pass flat "
            f"indices row * {shape[1]} + col, as np.ravel_multi_index((rows, cols), "
            f"{tuple(shape)}) computes them"
        )
    return (
        f": to select entries of {of} (shape {fmt_shape(shape)}) by their multi-indices, pass "
        f"flat (row-major) indices, as np.ravel_multi_index(multi_indices, {tuple(shape)}) "
        f"computes them"
    )


def _compared(group: ProcessGroup | None, fingerprint: Callable[[], Fingerprint]) -> Fingerprint:
    """What the ranks of ``group`` compare; nothing without one (reading the indices back to
    the host costs a sync: only then)."""
    return {} if group is None else fingerprint()


def _check_named(
    params: object, index: object, joint: bool, module: torch.nn.Module | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Detached ``params`` and the checked flat indices per selected name, in ``index``'s order
    (``module``: :func:`module_loss`'s, whose tied parameters its params hold once)."""
    if not isinstance(params, Mapping):
        raise TypeError(
            f"params must be a torch.Tensor or a dict[str, Tensor], got {type(params).__name__}"
        )
    if not isinstance(index, Mapping):
        raise TypeError(
            f"index must be a dict[str, LongTensor] like params, got {type(index).__name__}"
        )
    if not index:
        raise ValueError(
            "index must name at least one tensor of params, got an empty dict (a tensor may "
            "have no selected entries: its block is then (0, 0))"
        )
    fixed = {name: require_tensor(f"params[{name!r}]", p).detach() for name, p in params.items()}
    if module is not None:
        _check_module_shapes(fixed, module)
    first = next(iter(index))
    flats = {}
    for name in index:
        if name not in fixed:
            raise ValueError(
                f"index names {name!r}, which is not a key of params (keys: {list(fixed)})"
                + _tied_to(module, name)
            )
        tensor = require_floating(f"params[{name!r}]", fixed[name])
        if joint:  # one concatenated vector: one dtype, one device
            require_like(f"params[{name!r}]", tensor, f"params[{first!r}]", fixed[first])
        flats[name] = _check_index(
            f"index[{name!r}]", index[name], tensor.shape, f"params[{name!r}]"
        )
    return fixed, flats


def _check_module_shapes(params: Mapping[str, torch.Tensor], module: torch.nn.Module) -> None:
    """Each of ``params``' tensors has the shape of the module's parameter it stands in for:
    ``functional_call`` takes any tensor, and one that broadcasts (a bias of one entry for two)
    ran a different model, whose Hessian came back without a word. Dtype and device may differ
    (a float64 sub-Hessian of a float32 module, with float64 inputs, is a use)."""
    own = dict(module.named_parameters(remove_duplicate=False))
    for name, tensor in params.items():
        expected = own.get(name)
        if expected is not None and tensor.shape != expected.shape:
            raise ValueError(
                f"params[{name!r}] must have the shape of the module's parameter {name!r}, "
                f"{fmt_shape(expected.shape)}, got {fmt_shape(tensor.shape)}: module_loss's "
                f"loss runs {type(module).__name__} with it"
            )


def _tied_to(module: torch.nn.Module | None, name: str) -> str:
    """Where ``name`` is a parameter of ``module`` tied to another (one tensor under two names,
    which ``named_parameters`` gives once): which name ``module_loss``'s params hold it under."""
    if module is None:
        return ""
    kept = {id(p): kept_name for kept_name, p in module.named_parameters()}
    for alias, p in module.named_parameters(remove_duplicate=False):
        if alias == name and id(p) in kept:
            return (
                f": {name!r} is tied to {kept[id(p)]!r} (one tensor, which module_loss's params "
                f"hold once, under its first name); select it as {kept[id(p)]!r}"
            )
    return ""


def _check_data(data: object) -> Iterable[Any] | None:
    if data is None:
        return None
    if isinstance(data, (str, bytes, torch.Tensor)) or not isinstance(data, Iterable):
        raise TypeError(
            f"data must be None or an iterable of batches (a list, a DataLoader), got "
            f"{type(data).__name__}; pass a single batch as data=[batch]"
        )
    return data


def _check_loss(loss: object, with_batch: bool) -> None:
    """``loss`` is callable as ``loss(params)``, or ``loss(params, batch)`` with ``data``; each
    refusal says how to build such a loss."""
    call = "loss(params, batch) (data is given)" if with_batch else "loss(params)"
    if isinstance(loss, torch.nn.Module):
        raise TypeError(
            f"loss must be a function of the parameters, callable as {call}, got the module "
            f"{type(loss).__name__} itself: build the loss and its params with "
            + (
                "loss, params = pyhvp.module_loss(model, criterion) (no inputs: each batch of "
                "data is an (inputs, targets) pair)"
                if with_batch
                else "loss, params = pyhvp.module_loss(model, criterion, inputs, targets)"
            )
        )
    if isinstance(loss, _ModuleLoss) and with_batch:
        raise TypeError(
            f"loss must be callable as {call}, got module_loss(model, criterion, inputs, "
            f"targets), which holds its inputs already: with data=, call module_loss(model, "
            f"criterion) without inputs and targets (each batch is an (inputs, targets) pair)"
        )
    if isinstance(loss, _ModuleBatchLoss) and not with_batch:
        raise TypeError(
            f"loss must be callable as {call}, got module_loss(model, criterion) without inputs, "
            f"which takes (inputs, targets) batches: pass them as data=[(inputs, targets)] (or "
            f"a DataLoader), or call module_loss(model, criterion, inputs, targets)"
        )
    if isinstance(loss, (_ModuleLoss, _ModuleBatchLoss)):
        return
    if not callable(loss):
        raise TypeError(f"loss must be callable as {call}, got {type(loss).__name__}")
    if _accepts(loss, 2 if with_batch else 1) is False:
        raise TypeError(f"loss must be callable as {call}, got loss{inspect.signature(loss)}")


AVERAGING = ("mean", "batchmean")
"""Reductions of torch's loss modules that divide by the batch size."""


def _averaging_criterion(loss: object) -> str | None:
    """``"MSELoss(reduction='mean')"`` when ``loss`` is a ``module_loss`` whose criterion
    averages over each batch, else None."""
    if not isinstance(loss, _ModuleBatchLoss):
        return None
    reduction = getattr(loss.criterion, "reduction", None)
    if reduction not in AVERAGING:
        return None
    return f"{type(loss.criterion).__name__}(reduction={reduction!r})"


def _warn_on_uneven_batches(batches: Iterable[Any], criterion: str) -> Iterator[Any]:
    """``batches``, with one warning when their sizes (the first dim of each batch's first
    tensor) differ: a sum of per-batch means then weighs the samples of small batches more."""
    first: int | None = None
    warned = False
    for batch in batches:
        if not warned:
            tensors = [t for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
            size = tensors[0].shape[0] if tensors and tensors[0].ndim else None
            if first is None:
                first = size
            elif size is not None and size != first:
                warned = True
                warnings.warn(
                    f"sub_hessian: the criterion {criterion} averages over each batch and data= "
                    f"holds batches of different sizes ({first}, then {size}): the sum over "
                    f"batches weighs the samples of smaller batches more, so it is neither the "
                    f"data set's total nor its mean. Use reduction='sum' (and divide by the data "
                    f"set's size for a mean), or batches of one size (DataLoader(..., "
                    f"drop_last=True))",
                    UserWarning,
                    stacklevel=stacklevel_outside_pyhvp(),
                )
        yield batch


class _Reach(threading.local):
    """This thread's calls in progress (nested: a loss may call ``sub_hessian``), each with how
    many of its batches were found to use a selected tensor and how many to use none."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []


_REACH = _Reach()


def _note_reach(reached: bool) -> None:
    """Note whether a batch's loss uses a selected tensor, where the seed's loop (its first
    backward reaches a selected leaf) or the survey (an op takes one) finds it."""
    if _REACH.calls:
        _REACH.calls[-1][0 if reached else 1] += 1


def _reach_noted(plan: _Plan, batches: Iterable[Any] | None, chunk_size: int | None,
                 backend: Backend, method: str) -> list[torch.Tensor]:  # fmt: skip
    """:func:`_sums`, with a warning where the loss uses no selected tensor on any batch found
    (the batched kernels' zeros do not show it): a loss that closes over a model and ignores
    ``params`` gave zero blocks with no word, a first-day review's trap. Not where one batch of
    ``data`` uses a tensor and another does not."""
    _REACH.calls.append([0, 0])
    try:
        sums = _sums(plan, batches, chunk_size, backend, method)
    finally:
        reached, unreached = _REACH.calls.pop()
    if unreached and not reached:
        warnings.warn(
            "sub_hessian: the loss uses none of the selected tensors of params (its value "
            "carries no derivative from them), so their blocks are zero. A loss that computes "
            "with a module's own parameters rather than those it is given (a closure over the "
            "model) ignores params: pass pyhvp.module_loss(model, criterion, X, y), or compute "
            "with torch.func.functional_call(model, params, (X,))",
            UserWarning,
            stacklevel=stacklevel_outside_pyhvp(),
        )
    return sums


_ACCEPTS: dict[tuple[object, ...], bool] = {}
""":func:`_accepts` of plain functions by what their signature depends on: a loss rebuilt at every
call (``module_loss`` in a loop) reads it once, where ``inspect.signature`` costs 10-50 us a call
(a tenth of a compiled sparse sub-Hessian of the seed model)."""


def _accepts(loss: Callable[..., Any], n_args: int) -> bool | None:
    """Whether ``loss`` takes ``n_args`` positional arguments (None: no signature to read)."""
    key = None
    if (
        isinstance(loss, types.FunctionType)
        and not {"__wrapped__", "__signature__"} & vars(loss).keys()
    ):
        # a plain function's signature is its code's, with which parameters have defaults
        key = (
            loss.__code__,
            len(loss.__defaults__ or ()),
            tuple(loss.__kwdefaults__ or ()),
            n_args,
        )
        if key in _ACCEPTS:
            return _ACCEPTS[key]
    try:
        signature = inspect.signature(loss)
    except (TypeError, ValueError):  # builtins and C functions: nothing to check up front
        return None
    try:
        signature.bind(*(None,) * n_args)
    except TypeError:
        accepts = False
    else:
        accepts = True
    if key is not None:
        if len(_ACCEPTS) >= 1024:  # a process that makes code objects: start over
            _ACCEPTS.clear()
        _ACCEPTS[key] = accepts
    return accepts


class _Layout(NamedTuple):
    """A selected tensor's shape and the order of its dims in memory, largest stride first."""

    shape: torch.Size
    order: tuple[int, ...]

    @staticmethod
    def of(tensor: torch.Tensor) -> _Layout:
        strides = tensor.stride()
        order = sorted(range(tensor.ndim), key=lambda dim: -strides[dim])
        return _Layout(tensor.shape, tuple(order))

    def holding(self, values: torch.Tensor) -> torch.Tensor:
        """The flat row-major ``values`` as a tensor of this shape in storage of its own, laid
        out in memory as the tensor (its strides, offset 0): a loss that reads memory
        (``as_strided``) reads there what it reads of the tensor, not of the joint vector (a
        view of it at the tensor's offset in it: other tensors' entries)."""
        inverse = sorted(range(len(self.order)), key=self.order.__getitem__)
        moved = values.view(self.shape).permute(self.order)
        return moved.clone(memory_format=torch.contiguous_format).permute(inverse)


@dataclasses.dataclass(frozen=True)
class _Selection:
    """``loss`` as a function of the leaves, then the other params, then the batch's tensors.

    The leaves are the selected tensors, or with ``joint_layouts`` ONE vector holding them
    concatenated (each then passed to the loss laid out as the tensor it stands for: see
    :class:`_Layout`); ``names`` are all params' names in their order (``()``: params is a single
    tensor); ``batch_spec`` is the structure of the batch passed flat (``None``: no data). Equal
    for equal inputs, so the backend's compile cache serves repeated calls.
    """

    loss: Callable[..., torch.Tensor]
    names: tuple[str, ...]
    selected: tuple[str, ...]
    joint_layouts: tuple[_Layout, ...] | None = None
    batch_spec: pytree.TreeSpec | None = None

    @property
    def __name__(self) -> str:
        """The loss, as messages name it."""
        return getattr(self.loss, "__name__", type(self.loss).__name__)

    def taking_batch(self, spec: Any) -> _Selection:
        """This loss taking a batch of the structure ``spec`` flat (``None``: none)."""
        return self if spec is self.batch_spec else dataclasses.replace(self, batch_spec=spec)

    def __call__(self, *values: Any) -> torch.Tensor:
        n_leaves = 1 if not self.names or self.joint_layouts is not None else len(self.selected)
        n_params = n_leaves + len(self.names) - len(self.selected)
        leaves, others, batch = values[:n_leaves], values[n_leaves:n_params], values[n_params:]
        versions = None  # the versions of the tensors made for the loss here (joint)
        if not self.names:
            params: Any = leaves[0]
        else:
            if self.joint_layouts is not None:
                parts = leaves[0].split([layout.shape.numel() for layout in self.joint_layouts])
                leaves = tuple(
                    layout.holding(part)
                    for part, layout in zip(parts, self.joint_layouts, strict=True)
                )
                if not torch.compiler.is_compiling():
                    versions = [_version(leaf) for leaf in leaves]
            others_names = [name for name in self.names if name not in self.selected]
            given = dict(zip(self.selected, leaves, strict=True))
            given.update(zip(others_names, others, strict=True))
            params = {name: given[name] for name in self.names}
        if self.batch_spec is None:
            out = self.loss(params)
        else:
            out = self.loss(params, pytree.tree_unflatten(list(batch), self.batch_spec))
        for name, leaf, version in zip(self.selected, leaves, versions or (), strict=False):
            if _version(leaf) != version:  # a copy of the tensor's own, which no check of
                # params' versions sees (joint): where autograd allows it, under no_grad
                raise ValueError(_written(f"params[{name!r}]", "is written in place by the loss"))
        check_output("loss", out, (), "a scalar loss")
        return out


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Both routes to one call's blocks. The sparse route runs ``sparse`` (a per-tensor
    :class:`_Selection`) over ``tensors`` themselves, whose identity it tracks, and gives the joint
    ``(K, K)``; the reverse route runs ``reverse`` over ``leaves`` (the tensors, or with ``joint``
    one concatenated vector) with ``leaf_flats``. ``one_block``: the result is one matrix over
    several tensors (``joint=True``), else one diagonal block per tensor (a tensor ``params``:
    its one block)."""

    sparse: _Selection
    tensors: list[torch.Tensor]
    flats: list[torch.Tensor]
    others: list[torch.Tensor]
    reverse: _Selection
    leaves: list[torch.Tensor]
    leaf_flats: list[torch.Tensor]
    one_block: bool
    batch: Any = None
    """Without ``data``, the batch a :func:`module_loss` closes over, which the kernels take as
    an input (its loss then takes it as ``data``'s batches are taken); ``None``: none."""


def _static_refusal(plan: _Plan, backend: Backend, method: str) -> str | None:
    """Why the sparse route cannot (or, under ``"auto"``, surely should not) run this call, or
    ``None``; the cost model decides the rest."""
    if not isinstance(backend, TorchBackend):
        return f"backend {backend.name!r} is not the torch backend"
    if method != "auto" or (backend.compile is True and restricted.compiles()):
        return None
    total = sum(len(flat) for flat in plan.flats)
    if total >= routes.MIN_COMPONENTS:
        return None
    large = max((t.numel() for t in plan.tensors), default=0) > routes.LOOP_ENTRIES
    if large and _called_before(plan):
        return None
    return (
        f"{total} components, fewer than {routes.MIN_COMPONENTS}"
        f"{', a first call' if large else ''}: the reverse route costs less"
    )


def _called_before(plan: _Plan) -> bool:
    """Whether an equal call came before (the loss's key, the params' metadata, the selection's
    sizes; not the batch's): a tensor over ``routes.LOOP_ENTRIES`` entries at a few components is
    surveyed from its second call on, and later calls reuse the survey. A loss rebuilt per call
    over new tensors (a closure over each step's batch) never repeats its key: surveyed at every
    call, where the cost model then kept the loop, it took up to 3x the seed's loop."""
    try:
        sizes = tuple(len(flat) for flat in plan.flats)
        key = compile_policy.signature("sub_hessian, few components", plan.sparse, sizes,
                                       (*plan.tensors, *plan.others))  # fmt: skip
        hash(key)
    except TypeError:  # an unhashable loss: as a first call
        return False
    seen = compile_policy.recall(_FEW_CALLS, key) is not None
    compile_policy.keep(_FEW_CALLS, key, True)
    return seen


_FEW_CALLS: OrderedDict[Hashable, bool] = OrderedDict()
""":func:`_called_before`'s calls seen, most recent last."""


def _written(label: str, what: str) -> str:
    """Why a loss that writes to the params tensor ``label`` is refused, and what to do."""
    return (
        f"{label} {what}: sub_hessian never modifies params, and its derivatives "
        "would be at values other than those given. Make the write before the call (an "
        "embedding's rows renormalised once: torch.embedding_renorm_(weight, indices, "
        "max_norm, 2.0) under torch.no_grad()) and give the loss tensors it does not write to "
        "(max_norm=None)"
    )


def _label(plan: _Plan, i: int) -> str:
    """How the user names selected tensor ``i``."""
    return f"params[{plan.sparse.selected[i]!r}]" if plan.sparse.names else "params"


def _params_label(plan: _Plan, position: int) -> str:
    """How the user names tensor ``position`` of params, the selected tensors first, then the
    others (``plan.others``)."""
    if position < len(plan.tensors):
        return _label(plan, position)
    return f"params[{_unselected(plan)[position - len(plan.tensors)]!r}]"


def _unselected(plan: _Plan) -> list[str]:
    """The names of params' tensors held constant, in params' order (those of ``plan.others``)."""
    return [name for name in plan.sparse.names if name not in plan.sparse.selected]


def _by_name(plan: _Plan) -> dict[str, torch.Tensor]:
    """Every params tensor by name (selected and held constant)."""
    return dict(zip(plan.sparse.selected, plan.tensors, strict=True)) | dict(
        zip(_unselected(plan), plan.others, strict=True)
    )


FEW_TANGENTS = 4
"""Most tangents per tensor that the reverse route pushes by one backward each rather than one
batched backward (``is_grads_batched``), whose setup costs more at so few; eagerly, by the seed's
loop itself (:func:`_loop_rows`). Such calls are still surveyed: the forward route runs LeNet-5 at
k = 2 per tensor in 0.75x the loop's time."""

BY_LOOP = "by the seed's loop of one backward per component"


def _loops(plan: _Plan, chosen: routes.Routes, backend: Backend) -> bool:
    """Whether the reverse route of ``chosen`` runs the seed's loop (the cost model's choice, or
    :func:`_by_loop`): never inside a ``torch.func`` transform, where autograd's loop cannot run
    (a cached choice may have been made outside one)."""
    if not chosen.reverse or nested.inside_transform():
        return False
    return chosen.loop or _by_loop(plan, chosen.reverse, backend)


def _by_loop(plan: _Plan, members: Iterable[int], backend: Backend) -> bool:
    """Whether the reverse route runs the seed's loop for the selected tensors ``members``:
    at most :data:`FEW_TANGENTS` components of each, unless the backend compiles from the first
    call (``compile=True``), outside ``torch.func`` transforms (``vmap`` around the call:
    autograd's loop cannot run inside). The default ``compile="auto"`` included: its eager
    batched pass took 1.2-1.9x the seed's loop at 3 components of one tensor (16k to 1M
    entries), and compiled at so few it saves nothing (the benchmark's reverse route at k = 2,
    compiled: 0.91-1.08x the loop)."""
    eager = isinstance(backend, TorchBackend) and backend.compile is not True
    few = max((len(plan.flats[i]) for i in members), default=0) <= FEW_TANGENTS
    return eager and few and not nested.inside_transform()


_ROUTES: OrderedDict[Hashable, Trial] = OrderedDict()
"""Routes chosen, by what the survey's result depends on (the loss's key, the tensors' and the
batch's metadata, the selection's sizes, the options), with their trial against the other plans
(:mod:`pyhvp.restricted.trial`): a loss called again is not surveyed again. A stale entry costs
speed where the sparse kernel sees the change (a use it refuses raises, and the caller surveys
anew); a use neither mode sees (TorchScript) that an earlier call or batch did not reach (behind
a branch on the data) goes unnoticed, as the survey's verdict on unseen uses holds for the
code the survey ran."""


def _choose_routes(
    plan: _Plan,
    backend: TorchBackend,
    batch_values: list[Any],
    spec: Any,
    method: str,
    forward: bool,
    fresh: bool = False,
) -> Trial:
    """The cost model's split of the selected tensors between sparse groups and the reverse
    route, or the forward route for all (``forward``: where it may run this call), from a survey
    of the loss on this batch (:mod:`pyhvp.restricted.routes`), or as chosen before for an equal
    call (``fresh``: survey anew); under ``"auto"``, on trial against the other plans
    (:func:`_alternatives`)."""
    loss = plan.sparse.taking_batch(spec)
    compiled = backend.compile is True and restricted.compiles()
    joint = plan.one_block and bool(plan.sparse.names)
    sizes = tuple(len(flat) for flat in plan.flats)
    inputs = (*plan.tensors, *plan.others, *batch_values)
    try:
        key: Hashable = compile_policy.signature(
            "sub_hessian routes", loss, (sizes, joint, method, compiled, forward), inputs
        )
        hash(key)
    except TypeError:  # an unhashable loss: survey every call
        key = None
    cached = compile_policy.recall(_ROUTES, key) if key is not None and not fresh else None
    if (
        cached is not None
        and cached.state.holds()
        and not any(
            _masked(plan, i, entries) for i, entries in enumerate(cached.model.masked_entries)
        )
    ):
        return cached
    checked = not nested.inside_transform()  # (where the survey may differentiate the loss)
    try:
        with torch.inference_mode(False):  # (the survey differentiates, normal tensors)
            normal = _normal(inputs)
            found = routes.survey(loss, cast(list[torch.Tensor], normal[: len(plan.tensors)]),
                                  normal[len(plan.tensors) :], unseen=checked)  # fmt: skip
    except WritesSelected as error:
        raise ValueError(_written(_label(plan, error.source), error.what)) from None
    if checked:  # (where it runs with unseen: a use it did not see counts)
        _note_reach(found.used)
    if method == "auto" and not checked:
        for usage in found.usage:
            usage.refusal = usage.refusal or UNCHECKED
    for i, usage in enumerate(found.usage):
        if usage.refusal is None and _masked(plan, i, usage.masked_entries):
            usage.refusal = PADDING_ROW  # the forward route would refuse it too
            found.forward_refusal = found.forward_refusal or f"an entry {PADDING_ROW}"
    refusals = [
        f"{_label(plan, i)} {usage.refusal}" for i, usage in enumerate(found.usage) if usage.refusal
    ]
    if method == "sparse" and refusals:
        raise ValueError(
            f"method='sparse' does not apply: {'; '.join(refusals)}; method='auto' takes the "
            f"reverse route for {'it' if len(refusals) == 1 else 'them'}"
        )

    def together(members: Sequence[int]) -> bool:
        first = plan.tensors[members[0]]
        return all(
            plan.tensors[i].dtype == first.dtype and plan.tensors[i].device == first.device
            for i in members
        )

    auto = method == "auto"
    # compiled once its eager time pays for that; not weighed at a few components (a large
    # tensor's), where weighing it probed dynamo on W.T first, 1.6 s of a first call
    later = backend.compile == "auto" and sum(sizes) >= routes.MIN_COMPONENTS
    chosen = routes.choose(
        found, sizes, joint, compiled, method != "sparse", together, auto, auto and forward, later
    )
    plans = [(MODEL, chosen)]
    if method == "forward":  # in passes within the bound where it fits, else in one
        passes = routes.forward_passes(found, sizes, joint, together)
        passes = passes or (tuple(range(len(sizes))),)
        plans = [(FORWARD, routes.forward_alone(chosen, passes, found, sizes, joint))]
    # compile="auto" compiles a plan's kernels once its eager time pays for that: a trial settled
    # on eager times would keep the loop where the compiled routes would beat it later
    if auto and backend.compile != "auto":
        numels = [t.numel() for t in plan.tensors]
        plans += _alternatives(found, sizes, numels, joint, compiled, together, chosen, forward)
    trial = Trial(tuple(plans), state=found.changes.held())
    if key is not None:
        compile_policy.keep(_ROUTES, key, trial)
    return trial


UNCHECKED = (
    "may be used where pyhvp's mode does not see it: inside a torch.func transform the survey "
    "cannot tell (its check differentiates the loss)"
)

TRIAL_TANGENTS = 1 << 25
"""Most elements of one-hot tangents (components times entries of their tensors) the reverse
route alone may hold beyond the model's routes' to be tried: a trial must not run out of memory
where the model's routes do not (a large embedding table's reverse route holds a table-sized
tangent per component)."""


def _alternatives(
    found: routes.Survey,
    sizes: Sequence[int],
    numels: Sequence[int],
    joint: bool,
    compiled: bool,
    together: Callable[[Sequence[int]], bool],
    model: routes.Routes,
    forward: bool,
) -> list[tuple[str, routes.Routes]]:
    """The plans a trial measures against the ``model``'s routes (:mod:`pyhvp.restricted.
    trial`): the seed's loop, unless compiling the sparse route alone (where it refuses no
    tensor) and the reverse route alone (within :data:`TRIAL_TANGENTS`), the forward route
    (``forward``: where it may run this call, in the passes of
    :func:`~pyhvp.restricted.routes.forward_passes`),
    and the split the model's forward route replaced; each once, none equal to the model's.
    ``numels``: entries of each selected tensor."""
    # joint, a reverse pass's tangents span every selected tensor
    tangents = sum(
        k * (sum(numels) if joint else numels[i])
        for i, k in enumerate(sizes)
        if i not in model.reverse
    )
    plans = [("the seed's loop", routes.reverse_alone(found, sizes, joint, model, loop=True))]
    if not compiled and not any(model.refusals):
        plans.append(("the sparse route alone", routes.choose(
            found, sizes, joint, False, reverse=False, together=together)))  # fmt: skip
    if not compiled and tangents <= TRIAL_TANGENTS:
        plans.append(("the reverse route alone",
                      routes.reverse_alone(found, sizes, joint, model, loop=False)))  # fmt: skip
    passes = routes.forward_passes(found, sizes, joint, together) if forward else None
    if passes is not None:
        plans.append((FORWARD, routes.forward_alone(model, passes, found, sizes, joint)))
    if model.instead is not None:  # the model's forward route, against what it replaced
        plans.append((MODEL_INSTEAD, model.instead))
    kept = [(MODEL, model)]
    for name, plan in plans:
        if not any(_same(plan, other) for _, other in kept):
            kept.append((name, plan))
    return kept[1:]


def _same(a: routes.Routes, b: routes.Routes) -> bool:
    """Whether two plans run the same kernels."""
    return (a.groups, a.reverse, a.loop, a.forward) == (b.groups, b.reverse, b.loop, b.forward)


def _masked(plan: _Plan, i: int, entries: Iterable[int]) -> bool:
    """Whether selected tensor ``i`` has selected entries among its flat ``entries``."""
    entries = list(entries)
    if not entries:
        return False
    selected = plan.flats[i]
    return bool(torch.isin(selected, torch.tensor(entries, device=selected.device)).any())


def _log_routes(plan: _Plan, chosen: routes.Routes, backend: Backend) -> None:
    """The routes of this batch, on the ``pyhvp.sub_hessian`` logger (DEBUG)."""
    if not _log.isEnabledFor(logging.DEBUG):
        return
    if chosen.forward:
        groups = [[_label(plan, i) for i in group] for group in chosen.groups]
        _log.debug("sub_hessian: %s for %s (eagerly)", FORWARD,
                   " and ".join(f"[{', '.join(g)}] (one pass)" for g in groups),
                   extra={"sparse": [], "reverse": [], "forward": groups})  # fmt: skip
        return
    by_loop = f" {BY_LOOP}" if _loops(plan, chosen, backend) else ""
    compiling = isinstance(backend, TorchBackend) and backend.compile is not False
    groups = [[_label(plan, i) for i in group] for group in chosen.groups]
    passes = [
        "(one pass, eagerly)" if compiling and chosen.eager_only & set(group) else "(one pass)"
        for group in chosen.groups
    ]
    why = {
        _label(plan, i): chosen.refusals[i] or "cheaper by the cost model" for i in chosen.reverse
    }
    _log.debug(
        "sub_hessian: sparse route for %s; reverse route%s for %s (modelled %.3g ms, reverse "
        "route alone %.3g ms)",
        " and ".join(f"[{', '.join(g)}] {how}" for g, how in zip(groups, passes, strict=True))
        or "none",
        by_loop,
        "; ".join(f"{name} ({reason})" for name, reason in why.items()) or "none",
        chosen.cost / 1e6,
        chosen.reverse_only_cost / 1e6,
        extra={"sparse": groups, "reverse": list(why)},
    )


def _sums(
    plan: _Plan,
    batches: Iterable[Any] | None,
    chunk_size: int | None,
    backend: Backend,
    method: str,
) -> list[torch.Tensor]:
    """The call's blocks (unsymmetrised), summed over the batches. The routes are chosen on the
    first batch and kept while they apply: a batch the sparse route refuses (a loss that uses a
    tensor differently there), or of another structure (a dict with other keys), is surveyed
    again, and the new routes kept from it on. A plan whose kernels fail on a batch (an op that
    ``torch.func`` or a batched backward cannot run: an ``autograd.Function`` without
    ``setup_context``, a batch norm in training mode, ``group_norm``'s batched double backward)
    leaves the trial, and the batch runs again by the seed's loop -- for good, where the model's
    routes failed -- unless ``method="sparse"`` (refused by name); an error of the loss's own
    code is raised as it is."""
    refusal = "method='reverse'" if method == "reverse" else _static_refusal(plan, backend, method)
    forward = _forward_applies(chunk_size)
    if method == "forward" and refusal is None and not forward:
        refusal = (
            "it takes every component at once (no chunk_size: its pairwise terms need "
            "them all) and autograd's reverse pass (not inside a torch.func transform)"
        )
    if method in FORCED and refusal is not None:
        raise ValueError(f"method={method!r} does not apply: {refusal}")
    if not any(len(flat) for flat in plan.flats):  # nothing selected: (0, 0) blocks
        batches = []
    sizes = [len(flat) for flat in plan.flats]
    offsets = list(accumulate([0, *sizes]))
    # the sparse kernel's view of the selection (the same for every batch), made when needed
    coords: list[torch.Tensor | None] = [None] * len(plan.tensors)
    total = plan.tensors[0].new_zeros(offsets[-1], offsets[-1]) if plan.one_block else None
    blocks: list[torch.Tensor | None] = [None] * len(sizes)  # None: no batch added yet
    trial: Trial | None = None
    surveyed_spec: Any = None  # the structure of the batch whose survey holds trial's state
    device = plan.tensors[0].device if plan.tensors else torch.device("cpu")
    watched = [*plan.tensors, *plan.others]  # every tensor of params
    versions = [_version(t) for t in watched]
    every = tuple(range(len(plan.tensors)))
    for batch in [plan.batch] if batches is None else batches:
        if batches is not None:  # (as module_loss's inputs and the operators' args are)
            refuse_arrays("each batch of data", batch)
        batch_values, spec = (
            ([], None) if batches is None and plan.batch is None else pytree.tree_flatten(batch)
        )
        # the result carries no graph: batch tensors are data, never differentiated through
        batch_values = [v.detach() if isinstance(v, torch.Tensor) else v for v in batch_values]
        timed, name, start, loop, unsettled = False, MODEL, 0.0, False, 0
        unsurveyed: _Unsurveyed | None = None
        # every kernel of the batch draws what its first drew, as the seed's one forward does
        draws = random_states.Repeated(device)
        failed: Exception | None = None
        inputs = (*plan.tensors, *plan.others, *batch_values)  # (the loss's, in order)
        held: Held | None = None  # what the call's runs put back, where they may be several
        try:
            if refusal is None:
                assert isinstance(backend, TorchBackend)  # _static_refusal's condition
                if trial is None or spec != surveyed_spec:  # (the state it puts back is
                    # held by each input's position: a batch of another structure has others)
                    trial = _choose_routes(plan, backend, batch_values, spec, method, forward)
                    surveyed_spec = spec
                held = trial.state
                draws.hold(held.snapshot(inputs).restore)
                # a trial compares calls of one batch; a data set's batches may differ in size
                name, chosen, timed = (
                    trial.next() if batches is None else (MODEL, trial.model, False)
                )
                start = _clock(device) if timed else 0.0
                unsettled = unsettled_calls()
                try:
                    parts = _sparse_parts(
                        plan, chosen, coords, batch_values, spec, chunk_size, backend, draws
                    )
                except NotSparse as error:  # this batch uses a tensor differently
                    if method == "sparse":
                        raise ValueError(f"method='sparse' does not apply: {error}") from None
                    draws.begin()  # the state before the kernel's run, for the survey
                    trial = _choose_routes(plan, backend, batch_values, spec, method, forward, True)
                    held = trial.state
                    draws.hold(held.snapshot(inputs).restore)
                    name, chosen, timed = MODEL, trial.model, False
                    try:
                        parts = _sparse_parts(
                            plan, chosen, coords, batch_values, spec, chunk_size, backend, draws
                        )
                    except NotSparse as not_sparse:  # the survey saw what the kernel
                        # refuses: autograd's route for every tensor, in this call and equal ones
                        chosen = routes.every_tensor_reverse(trial.model, len(every), False,
                                                             str(not_sparse))  # fmt: skip
                        trial.drop(MODEL, chosen)
                        parts = []
                reverse, inner = chosen.reverse, None if chunk_size else chosen.chunk
                loop = _loops(plan, chosen, backend)
                _log_routes(plan, chosen, backend)
            else:
                parts, reverse, inner = [], every, None
                loop = _by_loop(plan, reverse, backend)
                if not loop:  # every pass, and the seed's loop where one fails, from the state
                    # before the call (the loop runs the loss once)
                    held, unsurveyed = _unsurveyed_state(plan, spec, inputs, chunk_size)
                    draws.hold(held.snapshot(inputs).restore)
                    loop = (unsurveyed is not None and unsurveyed.fails
                            and not nested.inside_transform())  # fmt: skip
                _log.debug("sub_hessian: reverse route%s (%s)", f" {BY_LOOP}" if loop else "",
                           refusal)  # fmt: skip
            # the reverse route adds its rows once all are computed, the sparse groups after it:
            # a failure adds nothing of this batch
            if reverse:
                total = _reverse_blocks(plan, reverse, batch_values, spec, chunk_size, backend,
                                        total, blocks, inner, loop, draws)  # fmt: skip
            for group, block in parts:
                total = _add_group(group, block, offsets, total, blocks)
        except (ValueError, torch.cuda.OutOfMemoryError):
            raise
        except Exception as error:
            _refuse_leaf_write(plan, spec, inputs, error)
            if (
                not _kernel_failure(error)
                or loop
                or not isinstance(backend, TorchBackend)
                or nested.inside_transform()  # where the seed's loop cannot run
            ):
                raise  # the loss's own error, or the seed's loop's: as autograd raises it
            failed = error
        if failed is not None:  # the seed's loop serves the batch, outside the handler: an
            # error of the loss's own is its alone, not chained to the kernel's failure of it
            if unsurveyed is not None:  # equal calls take the loop at once
                unsurveyed.fails = True
            if trial is not None and method not in FORCED:  # (a forced one raises every call)
                trial.drop(name, routes.every_tensor_reverse(trial.model, len(every), loop=True))
            _log.debug("sub_hessian: %s failed (%s: %s); the seed's loop serves the batch",
                       name if refusal is None else "the reverse route", type(failed).__name__,
                       failed)  # fmt: skip
            timed = False
            _refuse_unheld_writes(plan, spec, inputs, held, failed, trial, unsurveyed)
            # a loss that fails by itself (a torch error in its own frame) raises it here
            refused = (f"method={method!r} does not apply: its kernels cannot run this loss "
                       f"({type(failed).__name__}: {failed})")  # fmt: skip
            try:
                total = _reverse_blocks(plan, every, batch_values, spec, chunk_size, backend,
                                        total, blocks, None, True, draws)  # fmt: skip
            except Exception as loop_error:
                # the loop's forward raises the loss's bugs as they are; its backward, what
                # autograd cannot differentiate (an op whose backward has no derivative), is
                # refused by name
                _refuse_leaf_write(plan, spec, inputs, loop_error)
                if not (method in FORCED and _in_loop_backward(loop_error)
                        and _kernel_failure(loop_error)):  # fmt: skip
                    raise
                raise ValueError(f"{refused}, nor can the seed's loop "
                                 f"({type(loop_error).__name__}: {loop_error})") from loop_error  # fmt: skip
            if method in FORCED:
                raise ValueError(f"{refused}; method='auto' takes the seed's loop") from failed
        for position, (t, version) in enumerate(zip(watched, versions, strict=True)):
            if _version(t) != version:  # where autograd allows it (under no_grad, or to a tensor
                # held constant): found after it
                what = "was written in place by the loss (it now holds the written values)"
                raise ValueError(_written(_params_label(plan, position), what))
        # a run that compiled a kernel, checked one or ran its eager turn is not the plan's
        # steady state: the plan runs again, timed then
        if timed and unsettled_calls() == unsettled:
            assert trial is not None
            if trial.record(name, _clock(device) - start):
                _log_trial(trial)
    if total is not None:
        return [total]
    return [
        t.new_zeros(k, k) if block is None else block
        for block, t, k in zip(blocks, plan.tensors, sizes, strict=True)
    ]


TORCH_PACKAGE = os.path.dirname(torch.__file__) + os.sep
_RAISES = frozenset({"RAISE_VARARGS", "RERAISE"})  # the opcodes of a raise statement


_LEAF_WRITES = (
    "a leaf Variable that requires grad is being used in an in-place operation",
    "a view of a leaf Variable that requires grad is being used in an in-place operation",
)
"""autograd's refusals of a write to a tensor that requires grad (a selected tensor, as the
routes differentiate it), or to a view of one."""


def _refuse_leaf_write(plan: _Plan, spec: Any, inputs: tuple[Any, ...], error: Exception
                       ) -> None:  # fmt: skip
    """Where autograd refused ``error``, the loss's write to a leaf, and the survey's mode finds
    it writes a selected tensor (it stops before the write): raise that tensor's refusal, as a
    write under ``no_grad`` is refused. Until 2026-12-07 autograd's own error was raised, which
    names no tensor; it still is where the leaf is another (the loss's own)."""
    if not (isinstance(error, RuntimeError) and any(m in str(error) for m in _LEAF_WRITES)):
        return
    with torch.inference_mode(False):
        normal = _normal(inputs)
        try:
            found = routes.survey(plan.sparse.taking_batch(spec),
                                  cast(list[torch.Tensor], normal[: len(plan.tensors)]),
                                  normal[len(plan.tensors) :], unseen=False)  # fmt: skip
        except WritesSelected as write:
            raise ValueError(_written(_label(plan, write.source), write.what)) from None
        except Exception:  # the survey cannot tell: autograd's error is raised
            return
    if found.written is not None:
        source, op = found.written
        raise ValueError(_written(_label(plan, source), f"is written in place by {op}")) from None


_CAPTURED_WRITE = "that would mutate a captured Tensor"
"""``torch.func``'s refusal, before it runs, of an in-place op on a tensor the transformed
function captured."""


def _refuse_unheld_writes(plan: _Plan, spec: Any, inputs: tuple[Any, ...], held: Held | None,
                          failed: Exception, trial: Trial | None,
                          unsurveyed: _Unsurveyed | None) -> None:  # fmt: skip
    """Before the seed's loop runs the loss again where a kernel ``failed`` after its run: raise
    ``ValueError`` where the loss writes state that ``held`` (what the call puts back before
    each run, found on an earlier equal call) does not hold -- a loss that first writes it on a
    later call. The failed run wrote it, so the loop would run from the changed state (until
    2026-12-07 a silently wrong block, 100% off, and a buffer scaled twice). One run under a mode
    that notes the changes finds it (a forward's cost, on a failing call alone: equal calls then
    take the loop, which runs the loss once), and the routes chosen and the state found for this
    call are forgotten: the next call finds the state anew and puts it back. Not where the
    failure is ``torch.func``'s refusal of a write to a tensor its function captured, which it
    raises before the first such write: that run wrote none."""
    if _CAPTURED_WRITE in str(failed):
        return
    with torch.inference_mode(False):
        writes = recorded(plan.sparse.taking_batch(spec), _normal(inputs))
    # (writes to params are refused apart)
    unheld = writes.unheld_by(held, inputs, len(plan.tensors) + len(plan.others))
    if not unheld:
        return
    for cache, entry in ((_ROUTES, trial), (_STATES, unsurveyed)):
        for key in [key for key, value in cache.items() if value is entry]:
            del cache[key]
    raise ValueError(
        f"the loss wrote {unheld} in this call, which the state pyhvp puts back between the "
        f"loss's runs did not hold (an equal call before did not write it), and a kernel failed "
        f"after its run ({type(failed).__name__}): the seed's loop would run the loss from the "
        "changed state, so no sub-Hessian at the state before the call can be given. The state "
        "now holds one run's writes, as after one forward; an equal call from now on finds "
        "what the loss writes and puts it back"
    ) from None


def _kernel_failure(error: Exception) -> bool:
    """Whether ``error`` came from torch or pyhvp (a transform or a batched backward refusing
    what the loss runs), which the seed's loop may serve: raised in torch's or pyhvp's code, or a
    ``RuntimeError`` of a torch call in the loss (an op implemented in C++ raises in the loss's
    own frame). A ``raise`` statement of the loss's own code is its own error, raised as it is."""
    traceback = error.__traceback__
    if traceback is None:
        return False
    while traceback.tb_next is not None:
        traceback = traceback.tb_next
    code = traceback.tb_frame.f_code
    if code.co_filename.startswith((TORCH_PACKAGE, PACKAGE)):
        return True
    return isinstance(error, RuntimeError) and not any(
        instruction.offset == traceback.tb_lasti and instruction.opname in _RAISES
        for instruction in dis.get_instructions(code)
    )


def _in_loop_backward(error: Exception) -> bool:
    """Whether ``error`` was raised inside a backward pass that :func:`_rows_by_loop` itself
    ran (:func:`_backward`), not by the loss (whose own ``torch.autograd.grad`` may fail)."""
    traceback = error.__traceback__
    while traceback is not None and traceback.tb_next is not None:
        if (traceback.tb_frame.f_code is _rows_by_loop.__code__
                and traceback.tb_next.tb_frame.f_code is _backward.__code__):  # fmt: skip
            return True
        traceback = traceback.tb_next
    return False


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (None for an inference tensor, which keeps none); under ``vmap``
    that of the tensor it wraps (a batched tensor's own never moves: until 2026-12-07 a write
    to params under ``no_grad`` went unseen there, and the blocks were at the written values)."""
    t = wrapped(t)
    return None if t.is_inference() else t._version


def _clock(device: torch.device) -> float:
    """Seconds on the compile policy's clock, once ``device``'s queued work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return compile_policy.clock()


def _log_trial(trial: Trial) -> None:
    """The end of a trial, on the ``pyhvp.sub_hessian`` logger (DEBUG)."""
    _log.debug(
        "sub_hessian: measured %s (the fastest of up to %d runs each); keeping %s%s",
        ", ".join(f"{name} at {trial.fastest(name) * 1e3:.3g} ms" for name in trial.seconds),
        trial.runs,
        trial.settled,
        "" if trial.final else f", and {CONFIRM_AFTER} calls later a second round",
        extra={"settled": trial.settled, "final": trial.final},
    )


def _add_group(group: Sequence[int], block: torch.Tensor, offsets: Sequence[int],
               total: torch.Tensor | None, blocks: list[torch.Tensor | None]
               ) -> torch.Tensor | None:  # fmt: skip
    """A sparse group's joint block added to ``blocks`` (its members' diagonal blocks), or
    ``total`` (one matrix whose tensor ``i`` spans ``offsets[i]:offsets[i + 1]``) with it added
    (out of place: under ``vmap`` the block is batched, ``total`` not)."""
    if total is None:
        starts = list(accumulate([0, *(offsets[i + 1] - offsets[i] for i in group)]))
        for a, i in enumerate(group):
            _add(blocks, i, block[starts[a] : starts[a + 1], starts[a] : starts[a + 1]])
        return None
    where = _positions(offsets, group, total.device)
    return _accumulated(total, (where[:, None], where[None, :]), block)


def _accumulated(total: torch.Tensor, index: tuple[torch.Tensor, ...], values: torch.Tensor
                 ) -> torch.Tensor:  # fmt: skip
    """``total`` with ``values`` added at ``index``: in place, but out of place inside a
    ``torch.func`` transform (under ``vmap`` the values are batched, ``total`` is not)."""
    if nested.inside_transform():
        return total.index_put(index, values, accumulate=True)
    return total.index_put_(index, values, accumulate=True)


def _positions(offsets: Sequence[int], members: Iterable[int], device: torch.device
               ) -> torch.Tensor:  # fmt: skip
    """The rows of one matrix over every selected tensor (tensor ``i`` spans ``offsets[i]:
    offsets[i + 1]``) that the tensors ``members`` hold, in their order."""
    ranges = [torch.arange(offsets[i], offsets[i + 1], device=device) for i in members]
    return torch.cat(ranges) if ranges else torch.zeros(0, dtype=torch.long, device=device)


def _add(blocks: list[torch.Tensor | None], i: int, value: torch.Tensor) -> None:
    """``blocks[i] += value``, the first one taken as it is (no zeros to add it to)."""
    block = blocks[i]
    blocks[i] = value if block is None else block + value


def _sparse_parts(
    plan: _Plan,
    chosen: routes.Routes,
    coords: list[torch.Tensor | None],
    batch_values: list[Any],
    spec: Any,
    chunk_size: int | None,
    backend: TorchBackend,
    draws: random_states.Repeated,
) -> list[tuple[Sequence[int], torch.Tensor]]:
    """Each sparse group of ``chosen`` with its block from :func:`_sparse_pass`, each kernel
    one run of ``draws``."""
    parts: list[tuple[Sequence[int], torch.Tensor]] = []
    if chosen.forward:
        for i, group in enumerate(chosen.groups):
            draws.begin()
            twice = i in chosen.twice
            parts.append((group, _forward_pass(plan, group, batch_values, spec, draws, twice)))
        return parts
    for group in chosen.groups:
        draws.begin()
        parts.append((group, _sparse_pass(plan, group, coords, batch_values, spec,
                                          chunk_size or chosen.chunk, backend, chosen.eager_only)))  # fmt: skip
    return parts


def _forward_pass(
    plan: _Plan,
    group: Sequence[int],
    batch_values: list[Any],
    spec: Any,
    draws: random_states.Repeated,
    twice: bool,
) -> torch.Tensor:
    """One batch's ``(K_g, K_g)`` over the selected entries of the tensors of ``group``, by the
    forward-tangent route (joint where the result is one matrix; else its diagonal blocks;
    ``twice``: running the loss twice), outside inference mode (its reverse pass is autograd's:
    inside, it saw no graph and gave zeros)."""
    loss, others = _group_loss(plan, group, spec)
    flats = [plan.flats[i] for i in group]
    joint = plan.one_block and len(group) > 1
    with torch.inference_mode(False):
        tensors = [cast(torch.Tensor, t) for t in _normal(tuple(plan.tensors[i] for i in group))]
        return forward_hessian(loss, tensors, flats, joint, *_normal((*others, *batch_values)),
                               twice=twice, again=draws.begin)  # fmt: skip


def _group_loss(
    plan: _Plan, group: Sequence[int], spec: Any
) -> tuple[_Selection, list[torch.Tensor]]:
    """The loss as a function of the selected tensors ``group`` (then the other params, then
    the batch), and those other params, held constant."""
    loss = plan.sparse.taking_batch(spec)
    if not plan.sparse.names:
        return loss, []
    names = tuple(plan.sparse.selected[i] for i in group)
    if names == loss.selected:  # every selected tensor
        return loss, plan.others
    by_name = _by_name(plan)
    others = [by_name[name] for name in plan.sparse.names if name not in names]
    return dataclasses.replace(loss, selected=names), others


def _forward_applies(chunk_size: int | None) -> bool:
    """Whether the forward-tangent route may run this call: all components at once (no
    ``chunk_size``), outside ``torch.func`` transforms (its reverse pass is autograd's)."""
    return chunk_size is None and not nested.inside_transform()


def _sparse_pass(
    plan: _Plan,
    group: Sequence[int],
    coords: list[torch.Tensor | None],
    batch_values: list[Any],
    spec: Any,
    chunk_size: int | None,
    backend: TorchBackend,
    eager_only: frozenset[int],
) -> torch.Tensor:
    """One batch's joint ``(K_g, K_g)`` over the selected entries of the tensors of ``group``,
    by the sparse kernel (the other params held constant; eagerly for a group with a tensor in
    ``eager_only``)."""
    if eager_only & set(group) and backend.compile is not False:
        backend = TorchBackend(compile=False, guards=backend.guards)
    for i in group:
        if coords[i] is None:
            coords[i] = restricted.selected_entries(
                plan.tensors[i], plan.flats[i].to(plan.tensors[i].device)
            )
    tensors = [plan.tensors[i] for i in group]
    loss, others = _group_loss(plan, group, spec)
    block, _ = backend.restricted_hessian(
        loss,
        tensors,
        [c for i in group if (c := coords[i]) is not None],
        (*others, *batch_values),
        chunk_size,
    )
    if not nested.inside_transform() and not bool(block.isfinite().all()):  # (vmap: unread)
        raise NotSparse(NOT_FINITE)
    return block


NOT_FINITE = (
    "its Hessian is not finite: a NaN or infinite adjoint (a where() over sqrt or log at the "
    "masked entries) reaches every direction of a dense contraction, where autograd's backward "
    "reads the adjoint at the entry's own positions; the reverse route gives autograd's value"
)
"""Why a sparse block that is not finite is refused (the reverse route then serves the batch):
a loss finite in the selected entries whose other adjoints are NaN gave a sparse block all NaN
where autograd's is finite."""


def _passes(plan: _Plan, chunk_size: int | None) -> int:
    """How many times the reverse route's batched passes run the loss on one batch: once per
    ``chunk_size`` rows of the tensor with the most (of every tensor, for one block)."""
    sizes = [len(flat) for flat in plan.flats]
    rows = sum(sizes) if plan.one_block else max(sizes, default=0)
    return -(-rows // chunk_size) if chunk_size else 1


@dataclasses.dataclass
class _Unsurveyed:
    """What :data:`_STATES` keeps of an unsurveyed single pass: the state the loss changes, and
    whether the batched kernel failed on it (then the seed's loop serves, running it once)."""

    held: Held
    fails: bool = False


_STATES: OrderedDict[Hashable, _Unsurveyed] = OrderedDict()
"""By the loss's key and its inputs' metadata, for single batched passes no survey runs
before (see :func:`_unsurveyed_state`)."""


def _unsurveyed_state(plan: _Plan, spec: Any, inputs: tuple[Any, ...], chunk_size: int | None
                      ) -> tuple[Held, _Unsurveyed | None]:  # fmt: skip
    """The state the loss changes beyond its values, as it is before the call's first run, for
    the reverse route's batched passes where no survey ran (:func:`~pyhvp.restricted.state.
    recorded`: one run under a mode that notes the changes, put back), and for a single pass
    what is kept of it. Several passes find it on every call (a later call may change other
    state: a flag flipped, a generator rebound). A single pass needs it only where its kernel
    fails and the seed's loop runs the loss again: it is found on the first equal call (or
    where it no longer holds), and an equal call after a failure takes the loop at once,
    which runs the loss once (one recording run cost 1.8-2.6x a forward: +30-55% of a small
    call). State a later call first changes is seen there only where the kernel first fails
    on that call, and refused where it fails after the loss's run
    (:func:`_refuse_unheld_writes`)."""
    loss = plan.sparse.taking_batch(spec)
    key: Hashable = None
    kept = None
    if _passes(plan, chunk_size) == 1:
        try:
            key = compile_policy.signature("sub_hessian state", loss, (), inputs)
            kept = _STATES.get(key)
        except TypeError:  # an unhashable loss: found every call
            key = None
    if kept is None or not kept.held.holds():
        with torch.inference_mode(False):  # (as the survey runs it)
            kept = _Unsurveyed(recorded(loss, _normal(inputs)))
    return kept.held, None if key is None else compile_policy.keep(_STATES, key, kept)


def _reverse_blocks(
    plan: _Plan,
    members: Sequence[int],
    batch_values: list[Any],
    spec: Any,
    chunk_size: int | None,
    backend: Backend,
    total: torch.Tensor | None,
    blocks: list[torch.Tensor | None],
    inner: int | None,
    loop: bool,
    draws: random_states.Repeated,
) -> torch.Tensor | None:
    """One batch by the reverse route for the selected tensors ``members``, added to ``blocks``
    (their diagonal blocks); or ``total`` (one matrix) with it added, out of place, to its rows of
    those tensors' entries and, mirrored, to the same columns of the other rows (the sparse
    route's); ``inner``: how many tangents each batched second pass takes (None: all);
    ``loop``: by the seed's loop; each forward a run of ``draws``."""
    if total is None:  # per tensor, the others held constant
        loss, others = _group_loss(plan, members, spec)
        leaves = [plan.tensors[i] for i in members]
        flats = [plan.flats[i] for i in members]
        rows = _reverse_rows(loss, leaves, flats, flats, others, batch_values, chunk_size,
                             backend, inner, loop, draws)  # fmt: skip
        for i, row in zip(members, rows, strict=True):
            _add(blocks, i, row)
        return None
    # one vector of every selected tensor (or params itself): rows of the members' entries
    sizes = [len(flat) for flat in plan.flats]
    offsets = list(accumulate([0, *sizes]))
    mine = _positions(offsets, members, torch.device("cpu"))
    index = plan.leaf_flats[0]
    loss = dataclasses.replace(plan.reverse, batch_spec=spec)
    (row_block,) = _reverse_rows(
        loss,
        plan.leaves,
        [index[mine.to(index.device)]],
        [index],
        plan.others,
        batch_values,
        chunk_size,
        backend,
        inner,
        loop,
        draws,
    )
    mine = mine.to(total.device)
    total = _accumulated(total, (mine,), row_block)
    elsewhere = _positions(offsets, (i for i in range(len(sizes)) if i not in members),
                           total.device)  # fmt: skip
    return _accumulated(total, (elsewhere[:, None], mine[None, :]), row_block[:, elsewhere].mT)


def _reverse_rows(
    loss: _Selection,
    leaves: list[torch.Tensor],
    row_flats: list[torch.Tensor],
    column_flats: list[torch.Tensor],
    others: list[torch.Tensor],
    batch_values: list[Any],
    chunk_size: int | None,
    backend: Backend,
    inner: int | None,
    loop: bool,
    draws: random_states.Repeated,
) -> list[torch.Tensor]:
    """Per leaf, ``(len(row_flats[i]), len(column_flats[i]))``: the rows ``H e_j`` of the
    Hessian in that leaf for its entries ``row_flats[i]``, at its entries ``column_flats[i]``
    (not yet symmetrised); every pass (``chunk_size`` tangents per leaf) is one call of the
    multi-leaf primitive, whose batched second passes take ``inner`` tangents at a time; with
    ``loop``, the seed's loop (:func:`_loop_rows`) instead. Each pass's forward is a run of
    ``draws``: every one draws what the first drew."""
    args = (*others, *batch_values)
    if loop:
        return _loop_rows(loss, leaves, row_flats, column_flats, args, draws)
    return _batched_rows(loss, leaves, row_flats, column_flats, args, chunk_size, backend, inner,
                         draws)  # fmt: skip


def _batched_rows(
    loss: _Selection,
    leaves: list[torch.Tensor],
    row_flats: list[torch.Tensor],
    column_flats: list[torch.Tensor],
    args: tuple[Any, ...],
    chunk_size: int | None,
    backend: Backend,
    inner: int | None,
    draws: random_states.Repeated,
) -> list[torch.Tensor]:
    """:func:`_reverse_rows` by the backend's multi-leaf primitive, with one-hot tangents."""
    primitive = require_primitive(backend, "grad_and_block_hvps", "sub_hessian")
    eager = isinstance(backend, TorchBackend) and backend.compile is False
    run = TwiceDifferentiable(loss) if eager and not nested.inside_transform() else loss
    row_flats = [flat.to(t.device) for flat, t in zip(row_flats, leaves, strict=True)]
    column_flats = [flat.to(t.device) for flat, t in zip(column_flats, leaves, strict=True)]
    # each leaf's rows, chunk after chunk (joined at the end: under vmap they are batched)
    pieces: list[list[torch.Tensor]] = [[t.new_zeros(0, len(c))]
                                        for t, c in zip(leaves, column_flats, strict=True)]  # fmt: skip
    most = max(len(flat) for flat in row_flats)
    step = chunk_size or most
    for start in range(0, most, step):
        draws.begin()
        # one chunk of one-hot tangents per leaf: memory O(chunk_size * P), not O(k * P)
        chunks = [flat[start : start + step] for flat in row_flats]
        tangents = [_one_hot(chunk, t) for chunk, t in zip(chunks, leaves, strict=True)]
        # a few tangents: one plain backward each (vmap's setup costs more than it batches)
        one_by_one = 1 if max(len(chunk) for chunk in chunks) <= FEW_TANGENTS else inner
        _, products = primitive(run, leaves, tangents, args, one_by_one)
        for rows, chunk, columns, product in zip(
            pieces, chunks, column_flats, products, strict=True
        ):
            if len(chunk):  # a leaf with fewer components than this chunk's start has none
                rows.append(product.reshape(len(chunk), -1)[:, columns])
    return [torch.cat(rows) for rows in pieces]


def _loop_rows(
    loss: _Selection,
    leaves: list[torch.Tensor],
    row_flats: list[torch.Tensor],
    column_flats: list[torch.Tensor],
    args: tuple[Any, ...],
    draws: random_states.Repeated,
) -> list[torch.Tensor]:
    """:func:`_reverse_rows` by the seed's loop, eagerly: one forward (a run of ``draws``) and
    first backward that keeps its graph, then one backward of the gradient per selected entry
    (its one-hot cotangent), its row read at the columns. At a few components per tensor this
    costs less than any batched pass (no ``vmap`` nor compile-cache lookup): on the benchmark's models
    at k = 2 per tensor the reverse route's fixed cost made it 1.05-1.3x this loop. Attention
    takes its math path throughout (fused kernels have no second derivative), and embeddings
    with sparse gradients and embedding bags run as ops autograd can differentiate twice
    (:data:`~pyhvp._embeddings.twice_differentiable_embeddings`), so the loss runs once. Before,
    such a loss ran a second time, from the state its first run had changed."""
    with torch.inference_mode(False), torch.enable_grad(), math_attention:
        ys = [cast(torch.Tensor, t).detach().requires_grad_() for t in _normal(tuple(leaves))]
        args = _normal(args)
        draws.begin(last=True)  # (the loop is a batch's last run: sparse parts run before it)
        with twice_differentiable_embeddings, differentiated_twice:
            total = loss(*ys, *args)
        check_twice_differentiable(total)
        return _rows_by_loop(total, ys, row_flats, column_flats)


def _rows_by_loop(
    total: torch.Tensor,
    ys: list[torch.Tensor],
    row_flats: list[torch.Tensor],
    column_flats: list[torch.Tensor],
) -> list[torch.Tensor]:
    """:func:`_loop_rows`' backward passes, of the loss ``total`` of the leaves ``ys``."""
    # (a constant loss has no graph)
    grads = _backward(total, ys, create_graph=True) if total.requires_grad else (None,) * len(ys)
    _note_reach(any(g is not None for g in grads))
    blocks = []
    for y, g, rows, columns in zip(ys, grads, row_flats, column_flats, strict=True):
        if g is None or not (g.requires_grad and len(rows)):  # unused, f affine in y, no rows
            blocks.append(y.new_zeros(len(rows), len(columns)))
            continue
        # one-hot cotangents of the whole gradient: selecting its entry (``g.reshape(-1)[j]``,
        # the seed's) adds a select and its backward to every pass, 0.03 of its 0.18 ms. A few
        # small rows are read at the columns at once, larger ones each as it comes (full rows
        # stacked first copied each: a 4096 x 4096 weight, 90 of a call's 380 ms at k = 3)
        columns, read = columns.to(y.device), []
        at_once = len(rows) * g.numel() <= _FEW_ENTRIES  # (not through a generator: 2% of a call)
        # a loop, not a comprehension: _in_loop_backward reads frames
        for cotangent in _one_hot(rows, g) if at_once else _one_hots(rows, g):
            (row,) = _backward(g, [y], cotangent=cotangent)
            row = torch.zeros_like(y) if row is None else row  # g reaches y through no op
            read.append(row.reshape(-1) if at_once else row.reshape(-1).index_select(0, columns))
        block = torch.stack(read)
        blocks.append(block.index_select(1, columns) if at_once else block)
    return blocks


_FEW_ENTRIES = 2**15
"""Most entries of the one-hot rows of one tensor that :func:`_rows_by_loop` makes at once, by
one ``scatter_``, and reads at once (128 KB of float32, under glibc's first threshold for fresh
memory): the seed's two rows of 7840 made and read so took 2% less of a 1 ms call than one at
a time."""


def _one_hots(entries: torch.Tensor, like: torch.Tensor) -> Iterator[torch.Tensor]:
    """Each entry's one-hot tensor of ``like``'s shape, in turn, each used before the next (more
    than :data:`_FEW_ENTRIES` in all). On the CPU one buffer, its entry set and then cleared: the
    seed's loop fills a tensor of the gradient's size per pass, and ``k`` rows made at once were
    new memory each call (a 256 x 1024 weight at k = 3: 1.13x the seed's time, with twice its
    page faults). Elsewhere :func:`_one_hot`'s rows, :data:`_LOOP_ENTRIES` entries at a time (a
    pass may still read a buffer that the next write would change, on another stream)."""
    if like.device.type == "cpu":
        buffer = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
        flat = buffer.view(-1)
        for entry in entries.tolist():
            one = flat[entry]  # (a view, written twice: 3 us where two writes by index took 4)
            one.fill_(1)
            yield buffer
            one.fill_(0)
        return
    step = max(1, _LOOP_ENTRIES // max(1, like.numel()))
    for part in (entries,) if len(entries) <= step else torch.split(entries, step):
        yield from _one_hot(part, like)


_LOOP_ENTRIES = 2**22
"""How many entries of one-hot cotangents :func:`_one_hots` holds at once where it makes them
(16 MB of float32), or one row of a larger tensor."""


_ENGINE = Variable._execution_engine


def _backward(
    output: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    create_graph: bool = False,
    cotangent: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(output, inputs, cotangent, retain_graph=True,
    create_graph=create_graph, allow_unused=True)`` (a scalar ``output``'s cotangent: one; None
    for an input ``output`` does not reach): by autograd's engine itself, as ``autograd.grad``
    calls it, without its checks of arguments pyhvp made (they cost the seed's loop at k = 2 per
    tensor 0.2 of its 1.4 ms). A tensor subclass's ``output`` goes through ``autograd.grad``,
    which dispatches its ``__torch_function__``."""
    if cotangent is None:
        cotangent = torch.ones_like(output)
    if type(output) is not torch.Tensor:
        return tuple(torch.autograd.grad(output, inputs, cotangent, retain_graph=True,
                                         create_graph=create_graph, allow_unused=True))  # fmt: skip
    return tuple(_ENGINE.run_backward((output,), (cotangent,), True, create_graph, tuple(inputs),
                                      True, False))  # fmt: skip


def _one_hot(entries: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``(len(entries), *tensor.shape)``: row j is 1 at flat position ``entries[j]``, else 0."""
    rows = torch.zeros(len(entries), tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    rows.scatter_(1, entries.to(tensor.device)[:, None], 1)
    return rows.reshape(len(entries), *tensor.shape)
