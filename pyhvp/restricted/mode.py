"""The injection: a ``TorchFunctionMode`` that shifts the selected entries of the selected tensors
by ``z`` wherever the loss uses them, sparsely where the op has a rule.

Per use of a selected tensor (or of a view of one, followed as a selected tensor of its own):

* a contraction with a sparse rule (:mod:`pyhvp.restricted.ops`): the op runs on the tensor
  itself and each entry's tangent (:mod:`pyhvp.restricted.contributions`) is added, times its
  ``z``; when several operands of one contraction are selected, the largest enters so and the
  others densely first, so their cross terms are exact (an embedding's output's sum or mean,
  eagerly, is the sum or mean of the output's value plus its tangents moved there:
  :class:`Injected`, so that the reverse passes move ``k`` copies of the pooled value, not of
  every token's);
* a view (``W.T``, ``W.view``, ``W[2:]``, ``W.chunk``): applied to the tensor, and the entries'
  positions in the result read off its strides where it permutes the tensor's dims
  (:func:`permuted_dims`), else found by applying it to every flat index;
* a bias of a contraction, or an elementwise, reduction or normalisation op: ``W + scatter(z)``;
* a write to a selected tensor: :class:`NotSparse`;
* anything else: ``W + scatter(z)`` for a tensor of at most :data:`DENSE_LIMIT` entries, else
  :class:`NotSparse` (a dense product per direction is what the reverse route costs).

Dynamo traces the mode (the compiled kernel): selected tensors are found by ``is`` in a list (no
guard on object ids) and an op's kind is read through ``torch.compiler.assume_constant_result``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from pyhvp._sinc import written_out_in_mode
from pyhvp.restricted import contributions as rules
from pyhvp.restricted.ops import (
    _PARAMETERS,
    BIASES,
    CONTRACTED,
    DATA,
    EINSUM_FAMILY,
    HOOKS,
    MAY_RETURN_INPUT,
    RETURNS_INPUTS_IN_A_TUPLE,
    autograd_convention,
    bind,
    call_kind,
    contracted,
    describe,
    draws_mask_by_layout,
    einsum_form,
    first_input,
    reads_memory_layout,
    returns_its_input,
    writes_operand,
    writes_to,
)

DENSE_LIMIT = 4096
"""Most entries a selected tensor may have and still enter an op without a sparse rule densely
(``W + scatter(z)``): a bias, a small table; larger ones are refused there."""


LAYOUT = (
    "{} read by {} through its memory (it is not contiguous from the start of its storage), "
    "which the sparse route's stand-in for it lays out otherwise"
)
"""Why the sparse route refuses a use that reads a selected tensor's memory layout
(:func:`~pyhvp.restricted.ops.reads_memory_layout`)."""


class NotSparse(BaseException):
    """The sparse route does not apply to this use of a selected tensor; the caller takes the
    reverse route for it. A ``BaseException``, so an ``except Exception`` inside the user's loss
    cannot swallow it."""


class WritesSelected(BaseException):
    """The loss would write to selected tensor ``source`` where autograd lets it (``what``:
    under ``no_grad``, as an embedding's ``max_norm`` renormalises its table): raised before
    the write, since ``sub_hessian`` never modifies ``params``."""

    def __init__(self, source: int, what: str) -> None:
        super().__init__(what)
        self.source, self.what = source, what


class Selected(NamedTuple):
    """A selected tensor, or a view of one, with its selected entries."""

    tensor: torch.Tensor
    coords: torch.Tensor
    """``(tensor.ndim, k)``: each entry's index in ``tensor``."""
    part: torch.Tensor
    """``(k,)``: the entries' shifts, a slice of ``z``."""
    mask: torch.Tensor | None
    """``(k,)``, 1 for the entries this view holds, 0 for the others (a slice); None: all."""


def ravel(coords: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Flat row-major positions of ``coords`` (``(len(shape), k)``)."""
    flat = torch.zeros_like(coords[0]) if len(shape) else coords.new_zeros(coords.shape[1])
    for i, n in enumerate(shape):
        flat = flat * n + coords[i]
    return flat


_CASTS = ("to", "float", "double", "half", "bfloat16", "type")


def _basic_index(index: object) -> bool:
    """Whether ``W[index]`` is basic indexing (ints, slices, None, ...): a view, no repeats."""
    items = index if isinstance(index, tuple) else (index,)
    return all(item is None or item is Ellipsis or isinstance(item, (int, slice)) for item in items)


def view_positions(
    func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], out: object
) -> list[torch.Tensor | None] | None:
    """Per output of the view ``out = func(tensor, *args[1:], **kwargs)``, the flat position in
    ``tensor`` of each of its entries (the view applied to ``arange(numel)``), or None for an
    output that is not a tensor or holds no entry (an empty view: a constant); None for a call
    that is not such a view (advanced indexing, which may repeat entries, or a dtype view that
    reinterprets them)."""
    tensor = args[0]
    name = getattr(func, "__name__", "")
    if name == "__getitem__" and not _basic_index(args[1]):
        return None
    index = torch.arange(tensor.numel(), device=tensor.device).view(tensor.shape)
    if name in _CASTS:
        same = isinstance(out, torch.Tensor) and out.shape == tensor.shape
        return [index] if same else None
    mapped = func(index, *args[1:], **kwargs)
    outs = out if isinstance(out, (tuple, list)) else [out]
    results = mapped if isinstance(mapped, (tuple, list)) else [mapped]
    if len(outs) != len(results):
        return None
    positions: list[torch.Tensor | None] = []
    for result, given in zip(results, outs, strict=True):
        if not isinstance(given, torch.Tensor) or not given.numel():
            positions.append(None)
        elif not isinstance(result, torch.Tensor) or result.shape != given.shape:
            return None
        else:
            positions.append(result)
    return positions


_LEAVES = (int, float, bool, str, type(None), torch.dtype, torch.device)
"""Types of the arguments that pytree takes as leaves, besides tensors (a torch call's usual
arguments): a call with no others needs no flattening."""


def _flat(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether every argument of a call is a leaf to pytree (a tensor, a number, ...): then its
    leaves are its arguments (``pytree.tree_leaves`` took 13 us a call)."""
    return all(isinstance(v, torch.Tensor) or type(v) in _LEAVES for v in args) and all(
        isinstance(v, torch.Tensor) or type(v) in _LEAVES for v in kwargs.values()
    )


def permuted_dims(tensor: torch.Tensor, out: object) -> list[int] | None:
    """Which dim of ``tensor`` each dim of the view ``out`` is, where ``out`` reads ``tensor``'s
    memory with its dims permuted (``W.T``, ``W.mT``, ``W.permute(...)``, ``W.view(W.shape)``:
    the same storage and offset, each dim's size and stride that of exactly one dim of ``tensor``,
    whose strides tell its dims apart, each of them once); None for any other view, and while
    tracing. Read off the strides in 4 us, where applying the view to every position of a
    4096 x 4096 ``W`` took 400 ms a call."""
    if not isinstance(out, torch.Tensor) or out.ndim != tensor.ndim:
        return None
    memory, viewed = _plain(tensor), _plain(out)
    if (
        memory is None
        or viewed is None
        or viewed.storage_offset() != memory.storage_offset()
        or viewed.untyped_storage().data_ptr() != memory.untyped_storage().data_ptr()
    ):
        return None
    dims = {
        (n, stride): d
        for d, (n, stride) in enumerate(zip(memory.shape, memory.stride(), strict=True))
    }
    if len(dims) != memory.ndim or any(n > 1 and stride == 0 for n, stride in dims):
        return None  # two dims alike, or a broadcast one: the order is not determined
    order = [dims.get(pair) for pair in zip(viewed.shape, viewed.stride(), strict=True)]
    if None in order or len(set(order)) != len(order):
        return None  # a dim of the view matches none, or two match one: a size-1 slice of a
        # (2, 1) W, W[:1], read as (1, 1) with W's strides: its dims both matched W's second
    return cast(list[int], order)


def followed_view(
    func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], out: object
) -> bool:
    """Whether the view ``out = func(args[0], ...)`` of a selected tensor is followed as one: a
    permutation of its dims, or any view :func:`view_positions` maps."""
    return permuted_dims(args[0], out) is not None or (
        view_positions(func, args, kwargs, out) is not None
    )


def _plain(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor whose memory ``t`` is: itself, or what the ``torch.func.grad`` levels the
    sparse kernel runs under wrap (the same sizes and strides); None while tracing and under
    ``vmap``, whose batched tensors' memory holds another layout."""
    if torch.compiler.is_compiling():
        return None
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        if not torch._C._functorch.is_gradtrackingtensor(t):
            return None
        t = torch._C._functorch.get_unwrapped(t)
    return t


class Injected(NamedTuple):
    """An embedding's output with its selected entries' tangents added (``total``, what the
    loss receives) and those tangents, a list of nonzeros times ``part`` (their slice of
    ``z``); ``version``: ``total``'s when made (an in-place write to it, or to a view of it,
    changes that)."""

    total: torch.Tensor
    version: int
    contribution: rules.Contribution
    part: torch.Tensor


REDUCTIONS = {torch.sum: False, torch.Tensor.sum: False, torch.mean: True, torch.Tensor.mean: True}
"""Reductions of an embedding's output that take its tangents apart (:meth:`Injection._reduce`),
and whether each averages."""


def _reduced_dims(args: Sequence[Any], kwargs: dict[str, Any], ndim: int) -> tuple[int, ...] | None:
    """The dims a call ``sum`` / ``mean(input, dim=None, keepdim=False)`` of an ``ndim``-dim input
    reduces (non-negative), or None for a call this does not read (a ``dtype``, which would
    take the tangents in another precision; a 0-dim input)."""
    if len(args) > 3 or set(kwargs) - {"dim", "keepdim"} or not ndim:
        return None
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if dim is None:
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else dim
    if not isinstance(dims, (tuple, list)) or not dims or not all(isinstance(d, int) for d in dims):
        return None
    return tuple(sorted({d % ndim for d in dims}))


def returns_outside_tensor(
    func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> bool:
    """Whether eager torch returns this call's first argument itself (``W.to(W.device)``, as
    ``Module.to`` calls it on each parameter and buffer) and that argument comes from outside the
    ``torch.func`` transforms the sparse route runs the loss under. Under them torch returns a
    new wrapper of it, which ``Module.to`` keeps in the module (as a parameter's ``.data``, as a
    buffer): a wrapper of a transform level that ends with the transform, so that the module's
    next use after it segfaults (torch 2.5.1 to 2.14.1; pytorch#184876)."""
    if func not in MAY_RETURN_INPUT or torch.compiler.is_compiling():
        return False
    tensor = first_input(args, kwargs)
    return (
        isinstance(tensor, torch.Tensor)
        and not torch._C._functorch.is_functorch_wrapped_tensor(tensor)
        and returns_its_input(func, args, kwargs)
    )


class Injection(TorchFunctionMode):
    """Shifts the selected entries of ``tensors`` by ``z`` wherever the loss uses them;
    ``batch``: how many directions a Hessian pass pushes at once (chooses how tangents enter)."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        coords: Sequence[torch.Tensor],
        z: torch.Tensor,
        batch: int,
    ) -> None:
        super().__init__()
        parts = z.split_with_sizes([c.shape[1] for c in coords])
        # found by ``is`` in a short list, not by ``id()``: dynamo traces ``is`` between tensors
        # without guarding on object ids, which change with every call's tensors
        self.selected = [
            Selected(t, c, p, None) for t, c, p in zip(tensors, coords, parts, strict=True)
        ]
        self.batch = batch
        self.sparse_uses = 0
        self.injected: dict[int, Injected] = {}  # by ``id`` of ``total``

    def _find(self, value: object) -> Selected | None:
        if isinstance(value, torch.Tensor):
            for entry in self.selected:
                if entry.tensor is value:
                    return entry
        return None

    def _dense(self, value: object, func: Callable[..., Any], cheap: bool) -> object:
        """``value``, shifted densely by its entries' ``z`` where it is selected."""
        entry = self._find(value)
        if entry is None:
            return value
        tensor = entry.tensor
        if not cheap and tensor.numel() > DENSE_LIMIT:
            raise NotSparse(
                f"a selected tensor of {tensor.numel()} entries (over {DENSE_LIMIT}) enters "
                f"{describe(func)}, which has no sparse rule"
            )
        part = entry.part if entry.mask is None else entry.part * entry.mask
        flat = ravel(entry.coords, tensor.shape)
        return tensor.reshape(-1).index_add(0, flat, part.to(tensor.dtype)).view_as(tensor)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        sinc = written_out_in_mode(self, func, args, kwargs)  # torch's own sinc
        if sinc is not None:
            return sinc
        if func == DATA and args and args[0].requires_grad and self._find(args[0]) is None:
            raise NotSparse("Tensor.data of a value computed from a selected tensor: torch.func, "
                            "which the sparse route runs, differentiates it unlike autograd")  # fmt: skip
        if draws_mask_by_layout(func, args, kwargs):
            raise NotSparse(f"{describe(func)} in training of a non-contiguous tensor: under "
                            "torch.func, which the sparse route runs, torch draws its mask in "
                            "another order than the loss's own forward")  # fmt: skip
        if func in HOOKS:  # on a value computed from the selected entries' z
            raise NotSparse(f"{describe(func)}: a gradient hook changes autograd's derivative, "
                            "which the sparse route does not follow")  # fmt: skip
        if self.injected:
            reduced = self._reduce(func, args, kwargs)
            if reduced is not None:
                return reduced
        flat = _flat(args, kwargs)
        values = [*args, *kwargs.values()] if flat else pytree.tree_leaves((args, kwargs))
        if not any(self._find(v) is not None for v in values):
            if returns_outside_tensor(func, args, kwargs):
                return first_input(args, kwargs)  # itself, as eager torch returns it
            return func(*args, **kwargs)
        op = call_kind(func, args, kwargs)
        written = writes_to(op, func, args, kwargs)
        if any(self._find(v) is not None for v in pytree.tree_leaves(written)):
            raise NotSparse(f"{describe(func)} writes to a selected tensor")
        if reads_memory_layout(func, args, kwargs) and self._find(first_input(args, kwargs)):
            raise NotSparse(LAYOUT.format("a selected tensor is", describe(func)))
        if func in RETURNS_INPUTS_IN_A_TUPLE and not torch.is_grad_enabled():
            raise NotSparse(f"{describe(func)} under no_grad may return a selected tensor itself "
                            "(which autograd differentiates) among other tensors")  # fmt: skip
        if op == "identity" or (
            written is None
            and not torch.is_grad_enabled()
            and self._find(first_input(args, kwargs)) is not None
            and returns_its_input(func, args, kwargs)
        ):
            return first_input(args, kwargs)  # W itself: autograd differentiates it
        if op == "view":
            if not torch.is_grad_enabled():  # autograd's constant
                return func(*args, **kwargs)
            out = self._view(func, args, kwargs)
            if out is not None:
                return out
        elif op == "constant":
            return func(*args, **kwargs)
        elif op in CONTRACTED or op == "einsum":
            out = self._contract(op, func, args, kwargs)
            if out is not None:
                return out
        cheap = op == "cheap"
        if flat:
            dense = [self._dense(v, func, cheap) for v in args]
            return func(*dense, **{key: self._dense(v, func, cheap) for key, v in kwargs.items()})
        args, kwargs = pytree.tree_map(lambda v: self._dense(v, func, cheap), (tuple(args), kwargs))
        return func(*args, **kwargs)

    def _reduce(
        self, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
    ) -> torch.Tensor | None:
        """A sum or mean of an embedding's output (:class:`Injected`, unwritten since), as that of
        its value, detached, plus its tangents moved there (their nonzeros to the reduced
        positions): the same value and derivatives, but the reverse passes reach the tangents
        without passing through every token's features; None where it is not one."""
        found = self.injected.get(id(args[0])) if func in REDUCTIONS and args else None
        if found is None or found.total is not args[0] or not torch.is_grad_enabled():
            return None
        if found.total._version != found.version:
            return None
        total = found.total
        dims = _reduced_dims(args, kwargs, total.ndim)
        if dims is None or any(v is total for v in pytree.tree_leaves((args[1:], kwargs))):
            return None
        value = func(total.detach(), *args[1:], **kwargs)
        moved = rules.reduced(found.contribution, total.shape, dims, REDUCTIONS[func])
        return self._inject(value, found.part, moved)

    def _inject(
        self, raw: torch.Tensor, part: torch.Tensor, contribution: rules.Contribution
    ) -> torch.Tensor:
        """``raw`` with the tangents ``contribution`` times ``part`` added; an embedding's (a
        list of nonzeros) kept apart too, for :meth:`_reduce`."""
        total = rules.inject(raw, part, contribution, self.batch)
        if contribution.entries is not None and torch.is_grad_enabled():
            self.injected[id(total)] = Injected(total, total._version, contribution, part)
        return total

    def _view(
        self, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
    ) -> object | None:
        """The view of a selected tensor, its outputs followed as selected tensors; None where
        it is not a view of ``args[0]`` (then the caller enters it densely)."""
        entry = self._find(args[0]) if args else None
        if entry is None:
            return None
        out: object = func(*args, **kwargs)
        order = permuted_dims(entry.tensor, out)
        if order is not None:  # W.T, W.mT, W.permute(...): its entries' indices permuted
            coords = entry.coords if order == sorted(order) else entry.coords[order]
            self.selected.append(Selected(cast(torch.Tensor, out), coords, entry.part, entry.mask))
            return out
        positions = view_positions(func, args, kwargs, out)
        if positions is None:
            return None
        outs = out if isinstance(out, (tuple, list)) else [out]
        flat = ravel(entry.coords, entry.tensor.shape)
        for result, where in zip(outs, positions, strict=True):
            if where is None:
                continue
            inverse = flat.new_full((entry.tensor.numel(),), -1)
            inverse[where.reshape(-1)] = torch.arange(where.numel(), device=where.device)
            position = inverse[flat]
            held = (position >= 0).to(entry.part.dtype)
            mask = held if entry.mask is None else entry.mask * held
            if result.ndim == 0:
                coords = flat.new_zeros(0, flat.shape[0])
            else:
                coords = torch.stack(torch.unravel_index(position.clamp(min=0), result.shape))
            self.selected.append(Selected(result, coords, entry.part, mask))
        return out

    def _contract(
        self, op: str, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
    ) -> object | None:
        """The contraction with one selected operand entering sparsely; None where no rule
        applies (the caller then enters every selected operand densely)."""
        bound = bind(op, args, kwargs)
        if bound is None:
            return None
        found = [(key, self._find(value)) for key, value in contracted(op, bound)]
        candidates = [(key, entry) for key, entry in found if entry is not None]
        if writes_operand(op, bound) and candidates:
            raise NotSparse(
                "torch.nn.functional.embedding with max_norm writes to a selected tensor"
            )
        if autograd_convention(op, bound):
            return None
        chosen = None  # the largest (a loop: dynamo does not trace max with a key)
        for pair in candidates:
            if chosen is None or pair[1].tensor.numel() > chosen[1].tensor.numel():
                chosen = pair
        # every other selected operand enters densely: a bias cheaply, a factor as a product
        if op == "einsum":
            bound["operands"] = [
                t if chosen is not None and i == chosen[0] else self._dense(t, func, False)
                for i, t in enumerate(bound["operands"])
            ]
        else:
            for name in _PARAMETERS[op]:
                if name in bound and (chosen is None or name != chosen[0]):
                    bound[name] = self._dense(bound[name], func, name in BIASES.get(op, ()))
        if chosen is None:
            result: object = _call(op, func, bound)
            return result
        entry = chosen[1]
        _refuse_padding_rows(op, bound, entry)
        contribution = contribution_of(op, bound, chosen[0], entry.coords)
        if isinstance(contribution, str):
            return None
        out: torch.Tensor = _call(op, func, bound)
        part = entry.part if entry.mask is None else entry.part * entry.mask
        if op == "addmm" and bound.get("alpha", 1) != 1:
            part = part * bound["alpha"]
        self.sparse_uses += 1
        return self._inject(out, part, contribution)


PADDING_ROW = (
    "has selected entries in a padding_idx row of torch.nn.functional.embedding, where "
    "autograd's derivative (the seed's loop's) is zero, not the true one"
)


def _refuse_padding_rows(op: str, bound: dict[str, Any], entry: Selected) -> None:
    """Raise :class:`NotSparse` where an embedding with ``padding_idx`` has selected entries in
    that row, whether or not this batch's tokens reach it (the survey routes them to the reverse
    route; a later batch, or a loss whose captured state changed since, may meet them anew).
    Eagerly: a compiled kernel's graph depends on ``padding_idx``, and a graph traced anew is
    checked against the eager kernel."""
    padding = bound.get("padding_idx") if op == "embedding" else None
    if padding is None or torch.compiler.is_compiling():
        return
    hit = entry.coords[0] == padding % bound["weight"].shape[0]
    if entry.mask is not None:
        hit = hit & (entry.mask > 0)
    if bool(hit.any()):
        raise NotSparse(f"a selected tensor {PADDING_ROW}")


def _call(op: str, func: Callable[..., Any], bound: dict[str, Any]) -> Any:
    """``func`` called with ``bound`` (as :func:`bind` read it)."""
    if op == "einsum":
        return func(bound["equation"], *bound["operands"])
    names = _PARAMETERS[op]
    args = []
    for name in names:
        if name not in bound:
            break
        args.append(bound[name])
    rest = {name: value for name, value in bound.items() if name not in names[: len(args)]}
    return func(*args, **rest)


def contribution_of(
    op: str, bound: dict[str, Any], chosen: str | int, coords: torch.Tensor
) -> rules.Contribution | str:
    """The chosen operand's entries' tangents of the op's output, or why there are none."""
    if op in EINSUM_FAMILY:
        inputs, output, operands, keys = einsum_form(op, bound)
        return rules.einsum_contribution(inputs, output, operands, keys.index(chosen), coords)
    x, weight = bound["input"], bound["weight"]
    if op == "embedding":
        return rules.embedding_contribution(x, weight, coords)
    options = {name: bound[name] for name in _PARAMETERS[op][3:] if name in bound}
    if op == "conv":
        return rules.conv_contribution(x, weight, coords, **options)
    return rules.conv_transpose_contribution(x, weight, coords, **options)
