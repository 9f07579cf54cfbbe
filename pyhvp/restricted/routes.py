"""Which selected tensors take the sparse route, in which groups, and which the reverse route --
or whether the forward route takes them all: the sub-Hessian's cost model, from one survey of
the loss.

**The survey** (:func:`survey`) runs the loss once under :class:`Survey`, a ``TorchFunctionMode``
that sees every op. Per selected tensor it learns how each use enters (sparsely, densely, or
refused, by the rules of :mod:`pyhvp.restricted.mode`) and, following which activations depend
on which selected tensor, two amounts of :class:`Work` (multiply-adds of contractions, elements
of the other ops):

* ``tail``: every op downstream of the tensor -- what a direction of it costs past the op it
  enters, where its tangent is dense: the rest of the layer, every later layer, convolutions and
  attention's products at their own size;
* ``product``: what a *dense* one-hot direction pays in the ops it enters and the sparse rule does
  not -- the op's product with it and the weight gradient (twice the contraction), or for an
  embedding a gradient the size of the whole table;
* ``pairs`` and ``curved``: the elements of the ops downstream of it whose second-order term is
  a Gram matrix of the tangents -- pointwise ones (``tanh``, ``gelu``) and those written in
  closed form (:mod:`pyhvp.restricted.closed_forms`: a layer norm, a softmax, a product of two
  activations, a cross-entropy), their inputs' elements --, and the work of the others
  (``log_softmax``, a group norm), which the forward route (:mod:`pyhvp.restricted.forward`)
  pays as Gram matrices (``k^2`` per element) and as the ops' own Hessian-vector products (per
  direction).

**The model** (:func:`choose`), in nanoseconds of one CPU core, measured on LeNet-5, a
transformer block, an embedding classifier and the seed's model (``benchmarks/
bench_sub_hessian.py``): work costs :data:`MAC_NS` per multiply-add and :data:`ELEMENT_NS` per
element (a normalisation's or softmax's elements :data:`NORMALISATION` times over: their second
derivatives take many passes). Then

* a sparse *group* (one ``jacrev(grad)`` kernel, joint over its tensors) costs a forward and
  backward of the loss (:data:`FORWARD_AND_BACKWARD` forwards), :data:`SPARSE_SETUP`, and per
  direction :data:`SPARSE_DIRECTION` plus :data:`SPARSE_TAIL` times the largest tail in the
  group (every direction of a group runs down to its earliest tensor), plus each member's
  injection, its k entries' tangents (:func:`_injection_ns`: :data:`INJECTION_NS` per element,
  :data:`CROSSED_NS` where they carry the directions of another member, a later layer of the
  same group);
* the reverse route costs one forward and backward shared by all its tensors,
  :data:`REVERSE_SETUP`, per tensor :data:`REVERSE_PASS`, and per direction
  :data:`REVERSE_DIRECTION` plus :data:`REVERSE_TAIL` times the tensor's tail plus its product;
* the seed's loop (one eager backward per component of the tensors a split leaves to the
  reverse route, or of all; weighed on every ``"auto"`` call, and taken for every tensor
  without a survey eagerly at a few components per tensor) costs one
  forward and backward and per component :data:`LOOP_DIRECTION` plus the reverse route's work
  (its tail's convolutions and embedding tables at the loop's own rates): no setup.

``jacrev``'s batched passes cost more per unit of tail than autograd's (``SPARSE_TAIL >
REVERSE_TAIL``), so a tensor goes sparse where its product outweighs that: the seed's
``Linear(784, 10)`` (a product of 784 * 10 per sample against a tail of 10), embeddings, a
convolution whose output is smaller than its product; not a transformer's projections, whose
tails (attention, LayerNorm, GELU) dwarf their products. The forward route for every tensor (:func:`forward_cost`) costs a fixed
:data:`FORWARD_SETUP`, :data:`FORWARD_PER_TENSOR` per tensor and :data:`FORWARD_PASSES`
forwards, and per direction :data:`FORWARD_TAIL` times its tail and :data:`FORWARD_CURVED` times
its ``curved`` work, plus :data:`PAIR_NS` per pair of directions and element of its ``pairs``:
it replaces the split where it costs under :data:`FORWARD_MARGIN` of it. The choice minimises the sum over the
tensors: those the sparse route refuses take the reverse route; the others are split into groups
of consecutive tensors (in the order the loss first uses them) and the reverse route, by dynamic
programming over that order. With ``joint=True`` the sparse tensors form one group (cross blocks
need one pass) and the reverse route gives full rows for the others. A compiled backend
(``compile=True``) pays :data:`COMPILED_SETUP` instead of either setup, and its elements cost
:data:`COMPILED_ELEMENTS` of eager ones, but for a sparse group over a tensor viewed through a
property (``W.T``), which runs eagerly where dynamo traces the property past the mode (2.14
hands it to the mode, and so does 2.13 with the handlers of
:mod:`~pyhvp.restricted.dynamo_views`), and a group over an embedding, whose compiled injection
costs :data:`INDICATOR_NS` per token and entry and direction: it runs eagerly where that is
cheaper. A convolution's multiply-adds count :data:`CONVOLUTION` times (in a compiled sparse
kernel :data:`COMPILED_CONVOLUTION`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from pyhvp.restricted import compiles_property_views
from pyhvp.restricted import contributions as rules
from pyhvp.restricted.closed_forms import closed_form
from pyhvp.restricted.forward import linear_in, pointwise_in, refusal
from pyhvp.restricted.mode import (
    DENSE_LIMIT,
    LAYOUT,
    NotSparse,
    WritesSelected,
    followed_view,
)
from pyhvp.restricted.ops import (
    BIASES,
    CONTRACTED,
    EINSUM_FAMILY,
    PROPERTIES,
    autograd_convention,
    bind,
    call_kind,
    contracted,
    describe,
    einsum_form,
    first_input,
    kind,
    reads_memory_layout,
    writes_operand,
    writes_to,
)
from pyhvp.restricted.state import Changes, putting_back

MIN_COMPONENTS = 8
"""Fewest selected components for which ``method="auto"`` surveys the loss unless the backend
compiles from the first call or (called again) a selected tensor has over :data:`LOOP_ENTRIES`
entries: below it the reverse route's few Hessian-vector products cost less than the sparse
route's fixed setup (and the survey) on every model measured."""

LOOP_ENTRIES = 2**16
"""Most entries of a selected tensor for which ``method="auto"`` takes the seed's loop at fewer
than :data:`MIN_COMPONENTS` components without a survey (a larger one is surveyed from its
second equal call, ``pyhvp.submatrix._called_before``): each of the loop's passes writes a
gradient of the tensor's size, and the tensor's use a dense product with it. ``tanh(X @ W.T)``
at 3 entries of ``W``, 64 samples, one core, surveyed (the cost model then choosing): 1.04x
the seed's loop at 2^16 entries (it kept the loop), 0.97x at 90k, 0.82x at 2^17, 0.55x at
2^18, 0.24x at 2^20 (the sparse route), against 1.01-1.10x unsurveyed (the loop)."""

MAC_NS = 0.05
"""Nanoseconds per multiply-add of a contraction (a GEMM or a convolution)."""

ELEMENT_NS = 0.1
"""Nanoseconds per element an elementwise op reads or writes, batched (memory-bound)."""

NORMALISATION = 4.0
"""How many times a normalisation's or softmax's elements count."""

CONVOLUTION = {"forward": 2.0, "sparse": 2.0, "reverse": 6.0, "loop": 4.0}
"""A convolution's multiply-adds in a GEMM's, by where they run: in the forward (and a dense
direction's product), in a direction's tail on the sparse route, on the reverse route (vmap's
batched ``convolution_backward``) and in the seed's loop (LeNet-5's conv1 alone: 8.3, 12.4 and
8.4 ms a direction on those three, with the same tail). LeNet-5 by the sparse route alone,
eagerly: 0.79x the seed's loop at k = 16 per tensor and 0.90x at 128, where the loop's rate
(4x) had the model send its first convolution to the loop."""

COMPILED_CONVOLUTION = {"sparse": 4.0}
"""The same in a compiled kernel, where it differs: inductor's code for a sparse group's batched
convolutions runs slower than eager ATen's (LeNet-5 by the sparse route alone at k = 128 per
tensor: 1.81x the seed's loop compiled, 0.90x eagerly), so such a group runs eagerly."""

INDICATOR_NS = 12.0
"""Nanoseconds per token, selected entry and direction of an embedding's injection in a compiled
kernel, which needs static shapes: each entry's indicator over every token, gathered and scattered
in the batched backward (the text classifier at k = 128: 0.4 s of its 0.5). Eagerly the injection
lists the matching tokens only, too few to model."""

INJECTION_NS = 2.0
"""Nanoseconds per direction, selected entry and element of its tangent where a group's pass
injects it (:attr:`Usage.injections`): every direction's tangent of the op's output gathered at
the k entries and scattered back, ``(directions, k, rows)`` elements through gathers with
materialised indices (LeNet-5's fc1 alone at k = 256: 9 ms of gather and 8 of scatter_add for
4.2 M of them; the text classifier's fc1 and the seed's weight: 1-2 ns)."""

CROSSED_NS = 20.0
"""The same where the op's other operands carry directions of another tensor of the group, so
each entry's tangent differs per direction (LeNet-5's fc2 after fc1 in one group at k = 128:
64 ms more than two groups; the text classifier's: 40 ms)."""

TABLE_NS = 10.0
"""Nanoseconds per entry of an embedding table whose dense gradient a reverse direction writes
(vmap's batched embedding backward)."""

LOOP_TABLE_NS = 2.0
"""The same in the seed's loop, one backward at a time (a table zero-filled and scattered into:
the text classifier's, 1.0 ms a component against 2.5 batched)."""

FORWARD_AND_BACKWARD = 3.0
"""A pass's forward and first backward, in forwards of the loss."""

SPARSE_SETUP = 2_000_000.0
"""Fixed nanoseconds of an eager sparse kernel (``jacrev``/``vmap`` setup)."""

REVERSE_SETUP = 500_000.0
"""Fixed nanoseconds of the reverse route (autograd's setup)."""

COMPILED_SETUP = 1_000_000.0
"""Fixed nanoseconds of a compiled kernel (the compile cache's key, dynamo's guards, the call):
a compiled sparse kernel of the seed's model at k = 2 per tensor takes 1.3 ms, nearly all of it
this."""

REVERSE_PASS = 300_000.0
"""Fixed nanoseconds of each tensor's batched second pass on the reverse route."""

SPARSE_DIRECTION = 50_000.0
REVERSE_DIRECTION = 50_000.0
"""Nanoseconds per direction beyond its work (the batched ops' per-row overhead)."""

BATCHED = 1 << 22
"""Most elements one output of a batched pass may hold over its directions (16 MB in float32):
past it a pass runs in chunks of directions, as wider batches spill the caches and run slower
than one direction at a time (LeNet-5 at k = 128: 1.2-1.8x the seed's loop unchunked)."""

SPARSE_TAIL = 4.8
REVERSE_TAIL = 3.2
"""A direction's cost in units of its tail's modelled time (a forward tangent, the backward's
tangent and their reverse), on each route. With :data:`MAC_NS`, :data:`ELEMENT_NS` and the
per-direction overheads, a least-squares fit (relative errors) of one direction's time, alone in
its pass, over the 23 tensors of the benchmark's models (``bench_sub_hessian.py``: the seed's,
LeNet-5, the text classifier, the transformer block), eagerly, one thread."""

LOOP_DIRECTION = 300_000.0
"""Nanoseconds per component of the seed's loop beyond its work (an eager backward's dispatch):
the loop has no setup, so at a few components it beats a compiled kernel's
:data:`COMPILED_SETUP` only where the work is small."""

COMPILED_ELEMENTS = 0.6
"""An element's cost in a compiled kernel, in eager ones: inductor fuses elementwise ops (the
transformer block at k = 2 per tensor: 0.63x the eager loop compiled, on either route)."""


@dataclasses.dataclass
class Work:
    """Work of some ops: multiply-adds of contractions, elements the others read and write."""

    macs: float = 0.0
    elements: float = 0.0
    table: float = 0.0
    """Entries of embedding tables written densely."""
    convolution: float = 0.0
    """Multiply-adds of convolutions (:data:`CONVOLUTION`)."""

    def add(self, other: Work) -> None:
        self.macs += other.macs
        self.elements += other.elements
        self.table += other.table
        self.convolution += other.convolution


@dataclasses.dataclass
class Usage:
    """What the survey learnt of one selected tensor."""

    order: float = math.inf
    """Rank of its first use among the selected tensors' (inf: never used)."""
    uses: list[str] = dataclasses.field(default_factory=list)
    refusal: str | None = None
    """Why the sparse route cannot take it (None: it can)."""
    product: Work = dataclasses.field(default_factory=lambda: Work())
    """What a dense direction of it pays in the ops it enters (see the module docstring)."""
    tail: Work = dataclasses.field(default_factory=lambda: Work())
    """The work downstream of it, per direction."""
    property_view: str | None = None
    """A tensor property it is viewed through (``W.T``): where dynamo traces those past the mode
    (:func:`~pyhvp.restricted.compiles_property_views` is False), a kernel over it runs
    eagerly."""
    indicator: int = 0
    """Tokens of the embeddings it enters sparsely (see :data:`INDICATOR_NS`)."""
    widest: int = 0
    """Most elements of one output downstream of it: what each direction batched in a pass
    holds at once there."""
    injections: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    """Per op it enters sparsely: the elements of one entry's tangent there, the size of the
    output dims that place it (see :func:`_injection_ns`), and a bit mask of the selected
    tensors the op's other operands depend on."""
    pairs: float = 0.0
    """Elements of the pointwise ops downstream of it with a second-order term (``tanh``,
    ``gelu``), and of the inputs of those in closed form (a layer norm, a softmax): on the
    forward route, its ``k^2`` weighted Gram matrices there."""
    held: int = 0
    """Elements of the outputs downstream of it: what the forward route holds per direction
    (every activation's tangents, at once)."""
    curved: Work = dataclasses.field(default_factory=lambda: Work())
    """The other ops downstream of it with a second-order term: on the forward route, one
    Hessian-vector product of the op per direction."""
    masked_entries: set[int] = dataclasses.field(default_factory=set)
    """Flat entries whose derivative autograd masks (an embedding's ``padding_idx`` row, read
    through the view the table is): the sparse rule gives the true derivative there, the seed's
    loop and the reverse route zero."""


def _entries_of_row(tensor: torch.Tensor, view: torch.Tensor, row: int) -> list[int] | None:
    """The flat entries of ``tensor`` that row ``row`` of ``view`` (``tensor`` or a view of it)
    reads, from the view's strides; None where they cannot be read so (``tensor`` not
    contiguous, or the view of another dtype or storage)."""
    same_storage = view.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
    if not (tensor.is_contiguous() and view.dtype == tensor.dtype and same_storage):
        return None
    positions = torch.tensor(view.storage_offset() - tensor.storage_offset() + row * view.stride(0))
    for size, stride in zip(view.shape[1:], view.stride()[1:], strict=True):
        positions = positions[..., None] + torch.arange(size) * stride
    return positions.flatten().tolist()


def _memory(t: torch.Tensor) -> int | None:
    """Where ``t``'s storage starts: equal for a tensor and its views and aliases; None where it
    cannot be read (a ``vmap`` batched tensor, a sparse one)."""
    try:
        return t.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        return None


def _held(table: dict[int, tuple[torch.Tensor, int]], value: object) -> int | None:
    """The selected tensor ``table`` holds ``value`` for, if any (by ``id``, and the very
    object: an id may be reused once its tensor died)."""
    found = table.get(id(value))
    return found[1] if found is not None and found[0] is value else None


class Survey(TorchFunctionMode):
    """Runs the loss once, recording every selected tensor's :class:`Usage` and the forward's
    cost (see the module docstring)."""

    def __init__(self, tensors: Sequence[torch.Tensor], inputs: Sequence[object] = ()) -> None:
        super().__init__()
        self.usage = [Usage() for _ in tensors]
        self.forward = Work()
        self.forward_refusal: str | None = None
        """Why the forward route would refuse this loss, where the survey sees it (a write to
        or a random op on an activation of a selected tensor; :func:`~pyhvp.restricted.
        forward.refusal`)."""
        # id -> (tensor, which selected tensor): the selected tensors and the views of them
        self._tensors = list(tensors)
        self._sources = {id(t): (t, i) for i, t in enumerate(tensors)}
        # id -> (tensor, bit mask of the selected tensors it depends on): the activations
        self._taint: dict[int, tuple[torch.Tensor, int]] = {}
        # id -> (tensor, which selected tensor): memory aliases without its derivative
        self._aliases: dict[int, tuple[torch.Tensor, int]] = {}
        self._memories = [_memory(t) for t in tensors]
        self._first = 0
        self.changes = Changes(inputs)
        """What the run of ``loss(*inputs)`` changes beyond its values (put back once it ran)."""
        self.written: tuple[int, str] | None = None
        """The selected tensor the loss writes to where autograd guards it, and the op
        (:meth:`_refuse_writes_to_params`, which stops the run before the write)."""

    def _source(self, value: object) -> int | None:
        return _held(self._sources, value)

    @property
    def used(self) -> bool:
        """Whether the loss uses a selected tensor at all: an op this mode saw takes one, or
        (after :meth:`refuse_unseen_uses`, with ``unseen``) its derivative reaches the loss
        through one it did not."""
        return any(usage.uses for usage in self.usage)

    def _note(self, source: int, use: str, refusal: str | None = None) -> None:
        usage = self.usage[source]
        if usage.order == math.inf:
            usage.order, self._first = self._first, self._first + 1
        usage.uses.append(use)
        if refusal is not None and usage.refusal is None:
            usage.refusal = refusal

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        op = call_kind(func, args, kwargs)
        if op == "identity":  # W.requires_grad_(): W itself, a no-op on the leaves here
            return func(*args, **kwargs)
        grad = torch.is_grad_enabled()
        written = writes_to(op, func, args, kwargs)
        for value in pytree.tree_leaves(written):  # stop before the write: params stay as given
            self._refuse_writes_to_params(value, func, grad)
        self._refuse_hidden_writes(op, args, kwargs)
        values = pytree.tree_leaves((args, kwargs))  # (flattened once per call)
        leaves = [v for v in values if isinstance(v, torch.Tensor)]
        self.changes.before(func, args, kwargs, values, written)
        out = self._run(func, op, args, kwargs, leaves, grad)
        outs = [v for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor)]
        self.changes.made(leaves, outs)
        cost = _cost(func, args, kwargs, leaves, outs)
        self.forward.add(cost)
        if not grad or op == "constant" or any(self._alias(v) is not None for v in leaves):
            self._note_aliases(leaves, outs)  # no derivative: what shares a selected's memory
        if not grad:  # autograd's constants, views of a selected tensor too
            return out
        taint, direct = 0, dict[int, torch.Tensor]()
        for value in leaves:
            source = self._source(value)
            if source is not None:
                direct.setdefault(source, value)
            found = self._taint.get(id(value))
            if found is not None and found[0] is value:
                taint |= found[1]
        widest = max((v.numel() for v in outs), default=0)
        held = sum(v.numel() for v in outs)
        for source in _bits(taint):
            self.usage[source].tail.add(cost)
            self.usage[source].widest = max(self.usage[source].widest, widest)
            self.usage[source].held += held
        if taint or direct:
            self._note_forward(func, op, args, kwargs, outs, cost, written)
        if direct:
            followed = self._classify(op, func, args, kwargs, direct, out, cost, taint)
            if followed:
                return out  # views of a selected tensor: selected tensors themselves
            taint |= sum(1 << source for source in direct)
        if taint:
            for value in outs:
                self._taint[id(value)] = (value, taint)
        return out

    def _run(self, func: Callable[..., Any], op: str, args: Sequence[Any],
             kwargs: dict[str, Any], leaves: list[torch.Tensor], grad: bool) -> Any:  # fmt: skip
        """``func(*args, **kwargs)`` (whose tensors are ``leaves``) with the selected tensors
        (and the views of them followed) detached, so that their derivative reaches the loss
        only through uses this mode does not see (:meth:`refuse_unseen_uses`); a view that
        follows one runs on it (a selected tensor itself)."""
        if not grad or all(self._source(v) is None for v in leaves):
            return func(*args, **kwargs)
        detached_args, detached_kwargs = pytree.tree_map(
            lambda v: v if self._source(v) is None else v.detach(), (args, kwargs)
        )
        out = func(*detached_args, **detached_kwargs)
        if (op == "view" and args and self._source(args[0]) is not None
                and followed_view(func, args, kwargs, out)):  # fmt: skip
            return func(*args, **kwargs)
        return out

    def refuse_unseen_uses(self, loss: object) -> None:
        """Refuse the selected tensors whose derivative reaches the value ``loss``: only a use
        this mode did not see carries it (:meth:`_run`) -- a TorchScript function of one, a
        ``torch.vmap`` over one, a custom ``autograd.Function`` --, and the sparse route, which
        injects the entries where this mode sees them, would miss its terms."""
        if not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
            return
        stack, seen = [loss.grad_fn], {loss.grad_fn}
        while stack:
            node = stack.pop()
            source = self._source(getattr(node, "variable", None))  # an AccumulateGrad's leaf
            if source is not None and self.usage[source].refusal is None:
                self._note(source, "a use pyhvp's mode does not see", UNSEEN)
            for child, _ in node.next_functions:
                if child is not None and child not in seen:
                    seen.add(child)
                    stack.append(child)

    def _note_forward(
        self,
        func: Callable[..., Any],
        op: str,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        outs: Sequence[torch.Tensor],
        cost: Work,
        written: Any,
    ) -> None:
        """What the forward route (:mod:`~pyhvp.restricted.forward`) would make of this op, which
        a selected tensor reaches: per such tensor, its second-order term here
        (:attr:`Usage.pairs`, :attr:`Usage.curved`); and the first reason to refuse the loss
        (:attr:`forward_refusal`)."""
        if self.forward_refusal is None:
            if any(_held(self._taint, v) is not None for v in pytree.tree_leaves(written)):
                self.forward_refusal = (f"{describe(func)} writes in place to an activation of "
                                        "a selected tensor")  # fmt: skip
            else:
                self.forward_refusal = refusal(func, op, args, kwargs)
        leaves = pytree.tree_leaves((args, kwargs))
        reached: dict[int, list[int]] = {}
        for i, value in enumerate(leaves):
            bits = _held(self._taint, value) or 0
            source = self._source(value)
            for bit in _bits(bits | (0 if source is None else 1 << source)):
                reached.setdefault(bit, []).append(i)
        floating = [v for v in outs if v.is_floating_point()]
        for source, positions in reached.items():
            if linear_in(func, op, args, kwargs, leaves, positions):
                continue
            if pointwise_in(func, leaves, positions, floating):
                self.usage[source].pairs += sum(v.numel() for v in floating)
            elif closed_form(func, op, args, kwargs, [leaves[i] for i in positions]):
                self.usage[source].pairs += sum(leaves[i].numel() for i in positions)
            else:
                self.usage[source].curved.add(cost)

    def _alias(self, value: object) -> int | None:
        """Which selected tensor ``value`` shares memory with without carrying its derivative
        (``W.detach()``, ``W.data``, a view made under ``no_grad``), if any."""
        return _held(self._aliases, value)

    def _note_aliases(self, leaves: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:
        for value in leaves:
            source = self._source(value)
            source = self._alias(value) if source is None else source
            if source is None:
                continue
            memory = self._memories[source]
            for out in outs:
                if memory is not None and _memory(out) == memory and self._source(out) is None:
                    self._aliases[id(out)] = (out, source)

    def _refuse_writes_to_params(self, value: object, func: Callable[..., Any], grad: bool) -> None:
        """Before a write to ``value``: raise :class:`WritesSelected` where it would write to a
        selected tensor's memory that autograd does not guard (under ``no_grad``, or through an
        alias), :class:`NotSparse` where it writes to a selected tensor or a copy of one that
        the sparse route follows (the reverse route then runs what autograd runs)."""
        alias, source = self._alias(value), self._source(value)
        if source is None and alias is not None:
            raise WritesSelected(alias, f"is written by {describe(func)} through an alias "
                                 "(W.detach(), W.data, a view made under no_grad)")  # fmt: skip
        if source is None:
            return
        memory = _memory(cast(torch.Tensor, value)), self._memories[source]
        shared = None in memory or memory[0] == memory[1]  # unknown: taken as shared
        if not grad and shared:
            raise WritesSelected(source, f"is written by {describe(func)} under no_grad")
        what = "is written" if shared else "has a copy (that the sparse route follows) written"
        self._note(source, f"{describe(func)} (a write)", f"{what} by {describe(func)}")
        self.written = source, describe(func)
        raise NotSparse(f"{describe(func)} writes to a selected tensor")

    def _refuse_hidden_writes(self, op: str, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """An op that writes to a selected tensor under ``no_grad``, inside it (an embedding's
        ``max_norm``), which no route could undo: refused before it runs."""
        bound = bind(op, args, kwargs) if op == "embedding" else None
        if bound is None or not writes_operand(op, bound):
            return
        for _, value in contracted(op, bound):
            source = self._source(value)
            if source is not None:
                raise WritesSelected(
                    source, "enters torch.nn.functional.embedding with max_norm, which "
                    "renormalises the rows it reads in place")  # fmt: skip

    def _classify(
        self,
        op: str,
        func: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        direct: dict[int, torch.Tensor],
        out: Any,
        cost: Work,
        taint: int,
    ) -> bool:
        """Note how each selected tensor in ``direct`` enters ``func``; True for a view that
        follows one (its outputs are then selected tensors, not activations)."""
        name = describe(func)
        if reads_memory_layout(func, args, kwargs):
            source = self._source(first_input(args, kwargs))
            if source is not None:
                self._note(source, name, LAYOUT.format("is", name))
        if op == "view" and args and self._source(args[0]) is not None:
            source = self._source(args[0])
            assert source is not None
            if followed_view(func, args, kwargs, out):
                self._note(source, f"{name} (a view, followed)")
                if any(name == f"W.{p}" for p in PROPERTIES):
                    self.usage[source].property_view = name
                for value in pytree.tree_leaves(out):
                    if isinstance(value, torch.Tensor):
                        self._sources[id(value)] = (value, source)
                return True
        if op == "constant":
            for source in direct:
                self._note(source, f"{name} (no derivative)")
            return True
        sparse, key = None, None
        biases: tuple[Any, ...] = ()
        if op in CONTRACTED or op == "einsum":
            bound = bind(op, args, kwargs)
            sparse, key, refusal = (
                _sparse_operand(op, bound, self._source) if bound else (None, None, None)
            )
            if refusal is not None:
                for source in direct:
                    self._note(source, f"{name} (refused)", refusal)
                return False
            biases = tuple(bound[b] for b in BIASES.get(op, ()) if b in bound) if bound else ()
        for source, value in direct.items():
            usage = self.usage[source]
            usage.widest = max(usage.widest, _numel(out))
            if source == sparse:
                self._note(source, f"{name} (sparse)")
                padding = bound.get("padding_idx") if op == "embedding" and bound else None
                if padding is not None:
                    entries = _entries_of_row(self._tensors[source], value,
                                              padding % value.shape[0])  # fmt: skip
                    if entries is None:
                        self._note(source, f"{name} (refused)", "is a padding_idx table through "
                                   "a view whose entries pyhvp cannot map to its own")  # fmt: skip
                    else:
                        usage.masked_entries.update(entries)
                table = 0
                if op == "embedding" and bound:
                    table = value.numel()
                    usage.indicator += bound["input"].numel()
                usage.product.add(Work(2 * cost.macs, 0.0, table, 2 * cost.convolution))
                usage.tail.add(Work(0.0, _numel(out)))
                if bound and key is not None and op != "embedding":
                    usage.injections.append((*_entry_shape(op, bound, key, out), taint))
            elif any(value is b for b in biases):  # its tangent: a broadcast, no product
                self._note(source, f"{name} (dense: an added bias)")
                usage.tail.add(Work(0.0, _numel(out)))
            elif op == "cheap":
                self._note(source, f"{name} (dense, as cheap as the op)")
                usage.tail.add(cost)
            elif value.numel() > DENSE_LIMIT:
                self._note(
                    source,
                    f"{name} (refused)",
                    f"enters {name}, which has no sparse rule for it, with {value.numel()} "
                    f"entries (over restricted.DENSE_LIMIT, {DENSE_LIMIT})",
                )
            else:
                self._note(source, f"{name} (dense: {value.numel()} entries)")
                usage.tail.add(cost)
        return False


def _sparse_operand(
    op: str, bound: dict[str, Any], source: Callable[[object], int | None]
) -> tuple[int | None, str | int | None, str | None]:
    """Which selected tensor enters the contraction sparsely (the largest selected operand, as
    :class:`~pyhvp.restricted.mode.Injection` picks it) under which key of ``bound``, and a
    refusal of the call itself."""
    selected = [(key, t, source(t)) for key, t in contracted(op, bound) if source(t) is not None]
    if not selected:
        return None, None, None
    if autograd_convention(op, bound):
        return None, None, None
    largest = selected[0]
    for triple in selected[1:]:
        if triple[1].numel() > largest[1].numel():
            largest = triple
    if op == "einsum":
        inputs, _, _, keys = einsum_form(op, bound)
        spec = inputs[keys.index(largest[0])]
        if len(set(spec)) != len(spec):  # a diagonal: no sparse rule
            return None, None, None
    return largest[2], largest[0], None


def _entry_shape(op: str, bound: dict[str, Any], key: str | int, out: Any) -> tuple[int, int]:
    """Elements of one selected entry's tangent of the op's output (its ``values`` row in
    :mod:`~pyhvp.restricted.contributions`), and the size of the output dims that place it (a
    linear weight's output features, a kernel's output channels)."""
    if not isinstance(out, torch.Tensor) or out.numel() == 0:
        return 0, 1
    if op in EINSUM_FAMILY:
        inputs, output, _, keys = einsum_form(op, bound)
        if len(output) != out.ndim:  # not as einsum reads it: a model's estimate, never an error
            return out.numel(), 1
        own = set(inputs[keys.index(key)])
        placed = math.prod(n for letter, n in zip(output, out.shape, strict=True) if letter in own)
    else:
        batched = bound["input"].ndim == bound["weight"].ndim
        placed = out.shape[1] if batched else out.shape[0]
    return out.numel() // max(placed, 1), max(placed, 1)


def _injection_ns(elements: int, placed: int, crossed: bool) -> float:
    """Modelled nanoseconds of one direction's injection of one entry (:attr:`Usage.
    injections`), as :func:`~pyhvp.restricted.contributions.inject` makes it: by ``index_add``,
    :data:`INJECTION_NS` per element of its tangent, :data:`CROSSED_NS` where the tangent
    carries the directions of another tensor of the group; at a few placing positions
    (``DENSE_PLACED``) and a constant tangent, a matrix product with the output's elements."""
    if crossed:
        return elements * CROSSED_NS
    if placed <= rules.DENSE_PLACED:
        return elements * placed * MAC_NS
    return elements * INJECTION_NS


def _bits(mask: int) -> list[int]:
    return [i for i in range(mask.bit_length()) if mask >> i & 1]


def _ns(
    work: Work, compiled: bool = False, where: str = "forward", table_ns: float = TABLE_NS
) -> float:
    """Modelled nanoseconds of ``work`` (one direction's), eagerly or in a compiled kernel;
    ``where`` it runs prices its convolutions (:data:`CONVOLUTION`)."""
    element = ELEMENT_NS * (COMPILED_ELEMENTS if compiled else 1.0)
    convolution = COMPILED_CONVOLUTION.get(where) if compiled else None
    macs = work.macs + work.convolution * (convolution or CONVOLUTION[where])
    return macs * MAC_NS + work.elements * element + work.table * table_ns


def _numel(out: Any) -> int:
    return sum(v.numel() for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor))


_NORMALISATIONS = {
    getattr(F, name)
    for name in (
        "layer_norm",
        "group_norm",
        "batch_norm",
        "instance_norm",
        "rms_norm",
        "softmax",
        "log_softmax",
    )
    if hasattr(F, name)
} | {torch.softmax, torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax}


def _cost(
    func: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    leaves: list[torch.Tensor],
    outs: list[torch.Tensor],
) -> Work:
    """One op's work: a contraction's multiply-adds (the product of its index sizes; attention's
    two products) and the elements it reads and writes."""
    elements = float(sum(t.numel() for t in [*leaves, *outs]))
    if func in _NORMALISATIONS:
        elements *= NORMALISATION
    macs = float(_macs(func, args, kwargs, leaves, outs))
    if kind(func) in ("conv", "conv_transpose"):
        return Work(0.0, elements, convolution=macs)
    return Work(macs, elements)


def _macs(
    func: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    leaves: list[torch.Tensor],
    outs: list[torch.Tensor],
) -> int:
    op = kind(func)
    bound = bind(op, args, kwargs) if op in CONTRACTED or op == "einsum" else None
    if bound is None:
        if func is torch.nn.functional.scaled_dot_product_attention and len(leaves) >= 3:
            q, k = leaves[0], leaves[1]
            return 2 * q.numel() * k.shape[-2]
        return 0
    if op in EINSUM_FAMILY:
        inputs, output, operands, _ = einsum_form(op, bound)
        return rules.einsum_flops(inputs, output, operands)
    weight = bound["weight"]
    if op == "conv" and outs:
        return int(outs[0].numel() * weight[0].numel())
    if op == "conv_transpose":
        return int(bound["input"].numel() * weight[0].numel())
    return 0


UNSEEN = (
    "is used where pyhvp's mode does not see it (a TorchScript function, torch.vmap over it, a "
    "custom autograd.Function): the sparse route would miss that use"
)


def survey(
    loss: Callable[..., torch.Tensor],
    tensors: Sequence[torch.Tensor],
    args: Sequence[Any],
    unseen: bool = True,
) -> Survey:
    """``loss(*tensors, *args)`` run once under :class:`Survey`, with grad on as the routes
    differentiate it (a caller's ``no_grad`` would make every use a constant). With ``unseen``
    (outside ``torch.func`` transforms, which refuse it), the tensors require grad: where their
    derivative reaches the loss, a use the mode did not see carries it
    (:meth:`Survey.refuse_unseen_uses`). Call outside inference mode, with no inference
    tensors."""
    leaves = [t.detach().requires_grad_() for t in tensors] if unseen else list(tensors)
    inputs = (*tensors, *args)
    mode = Survey(leaves, inputs)
    # the loss's random draws, if any, are the kernels' to make, as is what else it changes
    # (mode.changes): the survey leaves the state as is
    with putting_back(mode.changes, inputs):
        try:
            with torch.enable_grad(), mode:
                value = loss(*leaves, *args)
        except NotSparse:  # a write to a selected tensor: the survey stops before it
            for usage in mode.usage:
                if usage.refusal is None:
                    usage.refusal = "was not surveyed: the loss writes to a selected tensor first"
        else:
            mode.refuse_unseen_uses(value)
    return mode


@dataclasses.dataclass(frozen=True)
class Routes:
    """Sparse groups (indices into the selected tensors; each group one kernel) and the tensors
    of the reverse route, with the modelled costs."""

    groups: tuple[tuple[int, ...], ...]
    reverse: tuple[int, ...]
    cost: float
    reverse_only_cost: float
    refusals: tuple[str | None, ...] = ()
    """Per selected tensor, why the sparse route refuses it (None: it does not)."""
    eager_only: frozenset[int] = frozenset()
    """Selected tensors whose sparse kernel runs eagerly when compiling: those viewed through a
    tensor property (``W.T``) where dynamo traces those past the mode, and the groups the model finds
    cheaper eagerly (an embedding's static injection, :data:`INDICATOR_NS`)."""
    masked_entries: tuple[frozenset[int], ...] = ()
    """Per selected tensor, :attr:`Usage.masked_entries` (an equal call selecting one of them
    is surveyed again)."""
    chunk: int | None = None
    """Directions per batched pass, where all of them would hold more than :data:`BATCHED`
    elements in one output (None: all at once)."""
    loop: bool = False
    """The tensors of the reverse route by the seed's loop of one eager backward per component
    (beside the sparse groups, if any)."""
    forward: bool = False
    """The groups by the forward-tangent route (:mod:`pyhvp.restricted.forward`) instead: one
    pass over all their tensors."""
    instead: Routes | None = None
    """For the cost model's forward route, the routes it chose otherwise: they serve where the
    forward route fails on this loss."""
    twice: frozenset[int] = frozenset()
    """Of the forward route's passes (by index into :attr:`groups`), those that run the loss
    twice (:data:`TWICE_FROM`)."""


def choose(
    found: Survey,
    sizes: Sequence[int],
    joint: bool,
    compiled: bool,
    reverse: bool = True,
    together: Callable[[Sequence[int]], bool] = lambda members: True,
    loop: bool = False,
    forward: bool = False,
    compiles_later: bool = False,
) -> Routes:
    """The cheapest split of the selected tensors (``sizes``: selected components of each)
    between sparse groups and the reverse route (see the module docstring). ``reverse=False``:
    the sparse route for every tensor (none may be refused); ``together(members)``: whether
    those tensors may share one sparse kernel (one dtype and device); ``loop``: whether the
    seed's loop may take the reverse route's tensors instead, where the split costs less so;
    ``forward``: whether the forward route may take every tensor instead (one dtype and device,
    in passes within :data:`FORWARD_TANGENTS`), where it costs less by :data:`FORWARD_MARGIN`;
    against the
    split compiled where the backend compiles it later (``compiles_later``: ``compile="auto"``,
    whose steady state is compiled, where the forward route runs eagerly for good)."""
    best = _split(found, sizes, joint, compiled, reverse, together)
    if loop:
        by_loop = _split(found, sizes, joint, compiled, reverse, together, loop=True)
        if by_loop.cost < best.cost:
            best = dataclasses.replace(by_loop, reverse_only_cost=best.reverse_only_cost)
    passes = forward_passes(found, sizes, joint, together) if forward else None
    if passes is not None:
        cost = forward_cost(found, sizes, joint, len(passes))
        rival = best.cost
        if compiles_later and not compiled:
            rival = min(rival, choose(found, sizes, joint, True, reverse, together, loop).cost)
        if cost < FORWARD_MARGIN * rival:
            alone = forward_alone(best, passes, found, sizes, joint)
            return dataclasses.replace(alone, cost=cost, instead=best)
    return best


def reverse_alone(
    found: Survey, sizes: Sequence[int], joint: bool, model: Routes, loop: bool
) -> Routes:
    """Every selected tensor on the reverse route, batched or (``loop``) by the seed's loop,
    with its modelled cost: the alternatives a :class:`~pyhvp.restricted.trial.Trial` measures
    against the ``model``'s routes (from one survey, whose batched cost the model holds)."""
    cost = model.reverse_only_cost
    if loop:
        fixed, per_tensor = _reverse_costs(found, sizes, joint, False, loop=True)
        cost = fixed + sum(per_tensor)
    return dataclasses.replace(every_tensor_reverse(model, len(sizes), loop), cost=cost)


FORWARD_TANGENTS = 1 << 28
"""Most elements of forward tangents one pass of the forward route may hold (per selected tensor,
its components times the elements of every output downstream of it, :attr:`Usage.held`; joint,
all components times the most any tensor holds): an upper bound for a pass that runs the loss
twice (:data:`TWICE_FROM`), which holds only the tangents of the values alive at once; a pass
that runs it once holds every activation's. Per tensor, the tensors are packed into passes
within it (:func:`forward_passes`); joint, the cross blocks need one pass. The transformer block
at k = 128 per tensor counts 4.8e8: in one pass 1.7 GB at its peak and 2.5 s, in two passes of
at most 2.7e8 1.1 GB and 2.4 s, when a pass held every activation's tangents (LeNet-5 at
k = 128, 1.2e8: 1.1 GB in one pass; a deep MLP's count grows with its depth, where the widest
output alone would not)."""


FORWARD_SETUP = 2_300_000.0
"""Fixed nanoseconds of the forward route (its mode's setup, the first-order check)."""

FORWARD_PER_TENSOR = 860_000.0
"""Nanoseconds per selected tensor on the forward route (the ops its streams add)."""

FORWARD_PASSES = 7.0
"""The forward route's forward and reverse pass, in forwards of the loss (its mode's dispatch
and the saved activations included)."""

FORWARD_TAIL = 1.4
FORWARD_CURVED = 11.0
"""A forward direction's cost in units of its tail's modelled time (its tangent pushed), and of
the modelled time of the ops downstream with a second-order term other than a pointwise one
(:attr:`Usage.curved`: their Hessian-vector products by a batched double backward)."""

PAIR_NS = 0.015
"""Nanoseconds per pair of directions and element of a pointwise op with a second-order term
(:attr:`Usage.pairs`: its weighted Gram matrix).

With :data:`FORWARD_SETUP`, :data:`FORWARD_PER_TENSOR`, :data:`FORWARD_PASSES` and the
tensors entering through a view paying their dense product per direction, a least-squares fit
(relative errors) of the forward route's time over the benchmark's models at k = 2, 16 and 128
per tensor (``bench_sub_hessian.py``, eagerly, one thread): within 15% but for the text
classifier at k = 128 (0.6x) and the seed's model at k = 128 (0.65x)."""


FORWARD_MARGIN = 0.6
"""The forward route replaces the split where it is modelled at under this fraction of the
split's cost: its time depends on the allocator more than the other routes' (it holds every
activation's tangents: LeNet-5 at k = 128 per tensor, 0.69 s with glibc's default malloc against
0.34 s with its thresholds raised) and its model errs most where its pairwise terms are small
(the transformer block at k = 16, before its layer norms, softmax and attention products were
written in closed form: modelled at 0.78x the split, measured at 1.8x eagerly; since, modelled
at 213 ms, measured at 321)."""


def forward_cost(found: Survey, sizes: Sequence[int], joint: bool, passes: int = 1) -> float:
    """Modelled nanoseconds of the forward route over every selected tensor in ``passes``
    passes (eagerly: it compiles nothing); joint, every direction reaches what the first tensor
    reaches."""
    usage = found.usage
    per_pass = FORWARD_SETUP + FORWARD_PASSES * _ns(found.forward)
    cost = passes * per_pass + FORWARD_PER_TENSOR * len(sizes)
    rows = [sum(sizes)] * len(sizes) if joint else list(sizes)
    for k, u in zip(rows, usage, strict=True):
        dense = any("(a view" in use for use in u.uses)
        per_direction = FORWARD_TAIL * _ns(u.tail) + FORWARD_CURVED * _ns(u.curved)
        cost += k * (per_direction + (_ns(u.product) if dense else 0.0)) + k * k * u.pairs * PAIR_NS
    return cost


def forward_alone(
    model: Routes,
    passes: Sequence[tuple[int, ...]],
    found: Survey,
    sizes: Sequence[int],
    joint: bool,
) -> Routes:
    """Every selected tensor by the forward-tangent route, one pass per tuple of ``passes``
    (together, the indices of every selected tensor), those of :data:`TWICE_FROM` tangents or
    more running the loss twice."""
    twice = frozenset(i for i, members in enumerate(passes)
                      if _pass_tangents(found, sizes, joint, members) >= TWICE_FROM)  # fmt: skip
    return dataclasses.replace(
        model, groups=tuple(passes), reverse=(), eager_only=frozenset(), chunk=None,
        loop=False, forward=True, instead=None, twice=twice)  # fmt: skip


TWICE_FROM = 1 << 24
"""Tangent elements of a forward pass (as :data:`FORWARD_TANGENTS` counts them) from which it
runs the loss twice, adjoints first, each op's term added at its call and each value's
tangents dropped after their last use; below, once, every value's tangents held to one reverse
pass at the end. The second run pays where glibc would fault the tangents in afresh on every
call (the transformer block at k = 16 per tensor, 6.9e7: 0.46x the seed's loop against
0.45-0.60x; at k = 128, 0.68x against 0.78x); below, the extra run costs more than it saves
(LeNet-5 at k = 2, 2.3e6: 0.75x against 0.60x; at k = 16, 1.4e7, the same either way; the text
classifier at k = 16, 3.4e5: 0.37x against 0.28x)."""


def _pass_tangents(found: Survey, sizes: Sequence[int], joint: bool, members: Sequence[int]
                   ) -> int:  # fmt: skip
    """Tangent elements a forward pass of ``members`` holds, at most (:attr:`Usage.held`)."""
    if joint:
        return sum(sizes[i] for i in members) * max((found.usage[i].held for i in members),
                                                    default=0)  # fmt: skip
    return sum(sizes[i] * found.usage[i].held for i in members)


def forward_passes(
    found: Survey,
    sizes: Sequence[int],
    joint: bool,
    together: Callable[[Sequence[int]], bool] = lambda members: True,
) -> tuple[tuple[int, ...], ...] | None:
    """The passes in which the forward-tangent route may take every selected tensor, each
    within :data:`FORWARD_TANGENTS` and of tensors that may share one pass (``together``: one
    dtype and device), or None where it may not: a tensor alone (joint, all of them, in one
    pass: the cross blocks need every direction) holds more, or the survey saw an op the route
    refuses. Per tensor, the largest first, each into the first pass it fits; each pass in the
    order of the tensors."""
    if found.forward_refusal is not None:
        return None
    if joint:
        every = range(len(sizes))
        fits = _pass_tangents(found, sizes, True, every) <= FORWARD_TANGENTS and together(every)
        return (tuple(every),) if fits else None
    counts = [_pass_tangents(found, sizes, False, [i]) for i in range(len(sizes))]
    if max(counts, default=0) > FORWARD_TANGENTS:
        return None
    passes: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: -counts[i]):
        j = next((j for j, left in enumerate(room)
                  if counts[i] <= left and together([*passes[j], i])), len(passes))  # fmt: skip
        if j == len(passes):
            passes.append([])
            room.append(FORWARD_TANGENTS)
        passes[j].append(i)
        room[j] -= counts[i]
    return tuple(tuple(sorted(members)) for members in passes)


def every_tensor_reverse(
    model: Routes, count: int, loop: bool, refusal: str | None = None
) -> Routes:
    """``model`` with all ``count`` selected tensors on the reverse route, batched or
    (``loop``) by the seed's loop; its costs are ``model``'s. ``refusal``: why the sparse route
    refused the loss, the reason logged for every tensor that had none."""
    known = (*model.refusals, *(None,) * (count - len(model.refusals)))
    refusals = tuple(refusal if r is None else r for r in known)
    return dataclasses.replace(
        model,
        refusals=refusals,
        groups=(),
        reverse=tuple(range(count)),
        eager_only=frozenset(),
        chunk=None if loop else model.chunk,
        loop=loop,
        forward=False,
        instead=None,
        twice=frozenset(),
    )


def _reverse_costs(
    found: Survey, sizes: Sequence[int], joint: bool, compiled: bool, loop: bool
) -> tuple[float, list[float]]:
    """Modelled nanoseconds of the reverse route, batched or (``loop``) by the seed's loop: its
    fixed cost (one forward and backward, the setup), and each selected tensor's."""
    fixed = FORWARD_AND_BACKWARD * _ns(found.forward, compiled and not loop)
    if not loop:  # the loop has no setup
        fixed += COMPILED_SETUP if compiled else REVERSE_SETUP
    # a reverse direction's gradient is dense in its tensor; joint, in every selected tensor
    every = _products(found.usage)
    per_tensor = [
        sizes[i] * (LOOP_DIRECTION + _reverse_work(u, every, joint, compiled=False, loop=True))
        if loop
        else REVERSE_PASS
        + sizes[i] * (REVERSE_DIRECTION + _reverse_work(u, every, joint, compiled))
        for i, u in enumerate(found.usage)
    ]
    return fixed, per_tensor


def _products(usage: Sequence[Usage]) -> Work:
    """Every selected tensor's product: what a joint dense direction pays."""
    every = Work()
    for u in usage:
        every.add(u.product)
    return every


def _reverse_work(
    usage: Usage, every: Work, joint: bool, compiled: bool, loop: bool = False
) -> float:
    """Modelled nanoseconds of one reverse direction of a tensor (on the reverse route or the
    seed's loop, ``loop``): its tail's tangents and reverse, and its gradient's product, dense
    in the tensor (``joint``: in every selected tensor, ``every``)."""
    tail = _ns(usage.tail, compiled, "loop" if loop else "reverse")
    product = every if joint else usage.product
    return REVERSE_TAIL * tail + _ns(
        product, compiled, table_ns=LOOP_TABLE_NS if loop else TABLE_NS
    )


def _split(
    found: Survey,
    sizes: Sequence[int],
    joint: bool,
    compiled: bool,
    reverse: bool,
    together: Callable[[Sequence[int]], bool],
    loop: bool = False,
) -> Routes:
    """:func:`choose` between sparse groups and the reverse route, by batched passes or
    (``loop``) by the seed's loop."""
    usage = found.usage
    refusals = tuple(u.refusal for u in usage)
    widest = max((u.widest for u in usage), default=0)
    chunk = max(1, BATCHED // widest) if widest else None
    if chunk is not None and chunk >= (sum(sizes) if joint else max(sizes, default=0)):
        chunk = None
    viewed = frozenset(i for i, u in enumerate(usage) if u.property_view is not None)
    eager_only = viewed if viewed and compiled and not compiles_property_views() else frozenset()
    masked_entries = tuple(frozenset(u.masked_entries) for u in usage)
    reverse_fixed, per_reverse = _reverse_costs(found, sizes, joint, compiled, loop)
    refused = tuple(i for i, u in enumerate(usage) if u.refusal is not None)
    eligible = sorted(
        (i for i, u in enumerate(usage) if u.refusal is None), key=lambda i: (usage[i].order, i)
    )
    reverse_only = reverse_fixed + sum(per_reverse)

    def group_cost(members: Sequence[int], traced: bool) -> float:
        reach = max(_ns(usage[i].tail, traced, "sparse") for i in members)
        directions = sum(sizes[i] for i in members)
        setup = COMPILED_SETUP if traced else SPARSE_SETUP
        forward = FORWARD_AND_BACKWARD * _ns(found.forward, traced)
        indicators = sum(sizes[i] * usage[i].indicator for i in members) if traced else 0
        mask = sum(1 << i for i in members)
        injected = (COMPILED_ELEMENTS if traced else 1.0) * sum(
            sizes[i] * _injection_ns(elements, placed, bool(crossed & mask))
            for i in members
            for elements, placed, crossed in usage[i].injections
        )
        per_direction = (
            SPARSE_DIRECTION + SPARSE_TAIL * reach + INDICATOR_NS * indicators + injected
        )
        return forward + setup + directions * per_direction

    def group(members: Sequence[int]) -> float:
        """A group's kernel, compiled where it may (no tensor viewed through a property) and
        that costs less than eagerly (an embedding's static injection costs more)."""
        if not together(members):
            return math.inf
        eager = group_cost(members, False)
        if not compiled or eager_only.intersection(members):
            return eager
        return min(eager, group_cost(members, True))

    def with_eager(groups: Sequence[Sequence[int]]) -> frozenset[int]:
        """:attr:`Routes.eager_only`: the property views and the groups cheaper eagerly."""
        cheaper = (g for g in groups if group_cost(g, False) < group_cost(g, True))
        return eager_only.union(*cheaper) if compiled else eager_only

    def reverse_cost(members: Sequence[int]) -> float:
        return reverse_fixed + sum(per_reverse[i] for i in members) if members else 0.0

    if joint:  # the sparse tensors: one group, the last ones in the loss's order
        best = Routes(
            (),
            tuple(range(len(usage))),
            reverse_only,
            reverse_only,
            refusals,
            eager_only,
            masked_entries,
            chunk,
            loop,
        )
        for start in range(len(eligible) if reverse else 1):
            members, rest = tuple(eligible[start:]), (*refused, *eligible[:start])
            cost = group(members) + reverse_cost(rest)
            if cost < best.cost or not reverse:
                best = Routes(
                    (members,),
                    tuple(sorted(rest)),
                    cost,
                    reverse_only,
                    refusals,
                    with_eager([members]),
                    masked_entries,
                    chunk,
                    loop,
                )
        return best
    # blocks: dynamic programming over the loss's order; state: has the reverse route a member
    Option = tuple[float, tuple[tuple[int, ...], ...], tuple[int, ...]]
    n = len(eligible)
    table: dict[tuple[int, bool], Option] = {(n, True): (0.0, (), ()), (n, False): (0.0, (), ())}
    for start in range(n - 1, -1, -1):
        for has_reverse in (True, False):
            options: list[Option] = []
            if reverse:
                cost, groups, rest = table[start + 1, True]
                extra = per_reverse[eligible[start]] + (0.0 if has_reverse else reverse_fixed)
                options.append((cost + extra, groups, (eligible[start], *rest)))
            for end in range(start + 1, n + 1):
                cost, groups, rest = table[end, has_reverse]
                members = tuple(eligible[start:end])
                options.append((cost + group(members), (members, *groups), rest))
            table[start, has_reverse] = min(options, key=lambda option: option[0])
    cost, groups, rest = table[0, bool(refused)]
    return Routes(
        groups,
        tuple(sorted((*refused, *rest))),
        cost + reverse_cost(refused),
        reverse_only,
        refusals,
        with_eager(groups),
        masked_entries,
        chunk,
        loop,
    )
