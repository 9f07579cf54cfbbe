"""Sub-Hessians by forward tangents: every selected entry's one-hot direction pushed forward
through the loss, one reverse pass for the adjoint of every activation, and the Hessian as the
sum, over the ops the tangents reach, of each op's second-order term between them.

For ``L = loss(params)``, an op ``y = f(x_1, ..., x_n)`` of it, ``t_i(x)`` the tangent of ``x``
along the ``i``-th selected entry's direction and ``d(y) = dL/dy`` the adjoint of ``y``::

    H_ij = sum over ops f of  d(y) . f''(x)[t_i(x), t_j(x)]

exactly (the chain rule's second-order terms; the first-order ones cancel into the adjoints). An
op linear in the inputs that carry tangents (a view, a sum, a convolution with a constant input,
``F.linear`` with a constant weight, a ReLU or a max-pool, piecewise) has no term; a pointwise one
(``tanh``, ``gelu``) has ``sum_x t_i w t_j`` with ``w = d f''(x)``, one weighted Gram matrix; a
layer norm, a softmax, a product of two activations and a cross-entropy theirs in closed form
(:mod:`pyhvp.restricted.closed_forms`); any other op the Hessian-vector products of ``d . f``
alone along its tangents (autograd's batched double backward). A selected tensor, or a view of it (``W.T``), entering a contraction gives
its entries' tangents by the sparse route's rule (:mod:`pyhvp.restricted.contributions`: a
shifted input slice, an input column), never a product with a one-hot tensor. A direction thus
costs its tangent's forward push, never a reverse pass through the network: LeNet-5 at k = 16
per tensor, 0.3x the seed's loop (``benchmarks/bench_sub_hessian.py``). The price is the
pairwise terms, ``k^2`` per op, which outgrow the push at many components, and memory: ``k``
times the activations.

Where its tangents are few, the loss runs once under the mode, which keeps each op's term for
one reverse pass at the end, every value's tangents held to it. Where they are many
(:data:`~pyhvp.restricted.routes.TWICE_FROM`), it runs twice: the first run
(:class:`FirstRun`) records its torch calls, the call that uses each value last, and by one
reverse pass every value's adjoint; the second pushes the tangents, adds each op's term at its
call and drops each value's tangents after their last use, holding only those of the values
alive at once. Held to the end, a transformer block's at k = 16 per tensor came to 209 MB,
which glibc faulted in again on every call (229 ms a call, 199 with the two runs); on a small
loss the extra run costs more than it saves (LeNet-5 at k = 2: 0.75x the seed's loop against
0.60x). In the second run a pointwise op at its input's last use pushes into that input's tangents,
where nothing else holds them (:meth:`Tangents._spent`): its GELU no longer makes a 48 MB
buffer, which glibc maps afresh on every call (199 ms to 187). A second run that calls other
torch functions, gives another loss, or other values where the terms meet the first run's
adjoints (a batch reordered by NumPy's generator, which no run puts back), is refused.

Tangents travel in *streams*: the rows of the groups (selected tensors, or with ``joint=True``
one group over all) that reach a value, stacked, so an op pushes every group that enters it the
same way in one ``vmap(jvp)`` call (a pointwise op: each stream times ``f'(x)``, computed once).
Only a tensor's own block is needed apart from ``joint``, so groups never meet in a pairwise
term: a stream's Gram keeps only its groups' diagonal blocks. A layer's weight and bias entries'
tangents of its output (``F.linear``, a convolution, a layer norm over its last dim) are each
nonzero at one feature or channel: their stream travels :class:`Placed`, each row's values and
index, through pointwise ops (their pushes and Grams over one feature's elements) and into the
next ``F.linear``, which pushes each row as one weight column times its values, an outer product;
any other op takes it dense. On the transformer block at k = 16 per tensor this took 317 ms to
270, on LeNet-5 91 to 76 (``benchmarks/bench_sub_hessian.py``'s models, side by side).

:class:`Tangents` sees every torch function the loss calls, as autograd does: a use under
``no_grad`` or of ``W.detach()`` carries no tangent. Refused (:class:`NotForward`) before they
run: an op that writes to a value carrying tangents, a random op on one (``vmap``'s
``randomness="error"``), a batch norm updating its running statistics, a gradient hook, a
complex result, an op whose forward derivative torch gets wrong, and an argument without
tangents that autograd's graph shows depends on a selected tensor -- made by an op the mode did
not see (a custom ``autograd.Function``, TorchScript). Last, the loss's tangents are checked
against autograd's gradient at the selected entries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from itertools import accumulate, combinations, pairwise
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.linalg import vector_norm as _norm
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from pyhvp._attention import math_attention
from pyhvp._batched_backward import batched_grad
from pyhvp._differentiated_twice import differentiated_twice
from pyhvp._norms import batched_double_backward
from pyhvp._sinc import written_out_in_mode
from pyhvp._torch_warnings import forward_mode_decompositions_loaded
from pyhvp.restricted import contributions as rules
from pyhvp.restricted import selected_entries
from pyhvp.restricted.closed_forms import (
    LAYER_NORMS,
    ClosedForm,
    closed_form,
    layer_norm_affine,
)
from pyhvp.restricted.mode import contribution_of, permuted_dims, ravel, view_positions
from pyhvp.restricted.ops import (
    BIASES,
    CONTRACTED,
    EINSUM_FAMILY,
    HOOKS,
    argument,
    autograd_convention,
    bind,
    call_kind,
    contracted,
    describe,
    first_input,
    functions,
    writes_operand,
    writes_to,
)

Tensor = torch.Tensor


class NotForward(Exception):
    """The forward-tangent route cannot run this loss (the reason is the message); the other
    routes (or the seed's loop) serve it."""


HOMOGENEOUS = functions(
    (torch, Tensor), ("sum", "mean", "neg", "negative", "__neg__", "__pos__")
) | functions(
    (F,),
    ("avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
     "adaptive_avg_pool3d", "dropout"),
)  # fmt: skip
"""Functions linear in their one tensor argument with no constant term (a dropout outside
training, the identity): a tangent's push is the op itself."""

SUMS = functions(
    (torch, Tensor), ("add", "sub", "subtract", "__add__", "__radd__", "__sub__", "__rsub__")
)
"""Functions adding their first two arguments (``alpha`` times the second): a tangent's push is
the op with the other operand zero."""

_ADDS = functions((torch, Tensor), ("add", "__add__", "__radd__"))
"""Of :data:`SUMS`, those adding both arguments themselves (the second ``alpha`` times)."""

_PLUS_FIRST = _ADDS | functions((torch, Tensor), ("sub", "subtract", "__sub__"))
"""Of :data:`SUMS`, those adding their first argument itself."""

JOINS = functions((torch,), ("cat", "concat", "concatenate", "stack"))
"""Functions joining the tensors of their first argument: a tangent's push is the op with the
other tensors zero."""

ADDITIVE = HOMOGENEOUS | SUMS | JOINS | functions(
    (F,),
    ("max_pool1d", "max_pool2d", "max_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d",
     "adaptive_max_pool3d", "relu", "pad"),
) | functions((torch, Tensor), ("relu",))  # fmt: skip
"""Functions linear in all their tensor arguments together (sums, concatenations, averages; a
ReLU and a max-pool piecewise, with no second derivative, as autograd has it; a dropout outside
training, the identity): no second-order term."""

PRODUCTS = functions((torch, Tensor), ("mul", "multiply", "__mul__", "__rmul__"))
"""Functions linear in each tensor argument alone: a term only where two of them carry tangents."""

QUOTIENTS = functions((torch, Tensor), ("div", "divide", "true_divide", "__truediv__"))
"""Functions linear in their first argument alone: a term unless only it carries tangents."""

POINTWISE = functions(
    (torch, Tensor),
    ("tanh", "sigmoid", "exp", "expm1", "log", "log1p", "sin", "cos", "sqrt", "rsqrt", "square",
     "reciprocal", "erf", "__pow__", "pow", "relu"),
) | functions(
    (F,), ("tanh", "sigmoid", "gelu", "silu", "mish", "softplus", "elu", "selu", "celu",
           "logsigmoid", "leaky_relu", "hardtanh", "relu"),
)  # fmt: skip
"""Elementwise functions of one tensor (where it is their only tensor argument and the output has
its shape): a tangent's push is ``f'(x)`` times it, and their second-order term one Gram matrix
of the tangents weighted by ``d f''(x)`` (a ReLU's none: :data:`ADDITIVE`)."""

_STATEFUL = functions((F,), ("batch_norm", "instance_norm"))

_TIE_SIDE = "takes another side of a tie than autograd's"

_WRONG_FORWARD_DERIVATIVES = functions((torch, Tensor), ("scatter_reduce",))
"""Ops whose forward derivative torch computes wrongly in some mode (``reduce="prod"``), or
takes another side of a tie than autograd's backward (``"amax"``, ``"amin"``: a max-aggregation
of a zero-initialised layer's messages at the zeros they land on, blocks 18.8 off)."""

_WRONG_REDUCTIONS = {"prod": "is wrong", "amax": _TIE_SIDE, "amin": _TIE_SIDE}

_TIES = functions((torch, Tensor), ("prelu", "clamp", "clip", "clamp_min", "clamp_max"))
_PAIRS = functions((torch, Tensor), ("fmax", "fmin"))
"""Ops whose forward derivative torch takes at a tie -- ``prelu``'s input at 0, ``clamp``'s at a
tensor bound, ``fmax``'s two inputs equal -- from another side than autograd's backward (whose
own Hessian there mixes both sides: ``prelu``'s is its forward slope times its backward one),
so no forward push matches autograd there: the route refuses a tie (a zero-initialised
layer's PReLU gave blocks 4x autograd's)."""


def _at_a_tie(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether this call of a :data:`_TIES` or :data:`_PAIRS` op has an input at its tie."""
    if func not in _TIES and func not in _PAIRS:
        return False
    input = first_input(args, kwargs)
    if not isinstance(input, Tensor):
        return False
    name = getattr(func, "__name__", "")
    if func in _PAIRS:
        ties = [argument(args, kwargs, "other", 1, None)]
    elif name == "prelu":  # its kink
        ties = [input.new_zeros(())]
    elif name == "clamp_max":
        ties = [argument(args, kwargs, "max", 1, None)]
    else:  # a scalar bound's derivative is autograd's either way
        ties = [argument(args, kwargs, bound, i, None) for i, bound in ((1, "min"), (2, "max"))]
        low, high = ties  # min == max: forward, min's tangent passes; backward, none does
        bounded = any(isinstance(t, Tensor) for t in ties) and all(t is not None for t in ties)
        if bounded and bool(torch.eq(torch.as_tensor(low), torch.as_tensor(high)).any()):
            return True
    return any(isinstance(tie, Tensor) and bool((input == tie).any()) for tie in ties)


_WRITES = functions((torch, Tensor), ("index_put", "index_copy", "scatter", "put")) | functions(
    (F,), ("max_unpool1d", "max_unpool2d", "max_unpool3d")
)
"""Ops writing values into positions: where two write to one position, torch's forward
derivative follows the last write, autograd's backward sends the gradient to every writer
(``index_put`` of a zero-initialised layer's outputs, blocks 36 off; ``put`` at a zero-residual
fit, 1.17 off)."""


def _writes_twice(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether this call of a :data:`_WRITES` op writes to one position twice."""
    if func not in _WRITES:
        return False
    name = getattr(func, "__name__", "")
    input = first_input(args, kwargs)
    if name.startswith("max_unpool"):
        indices = argument(args, kwargs, "indices", 1, None)
        if not isinstance(indices, Tensor) or indices.numel() < 2:
            return False
        spatial = int(name[-2])  # max_unpool2d: the last 2 dims index one plane
        ordered = indices.flatten(max(indices.ndim - spatial, 0)).sort(-1).values
        return bool((ordered[..., 1:] == ordered[..., :-1]).any())
    if not isinstance(input, Tensor):
        return False
    if name == "put":  # flat positions, negative ones from the end
        index = argument(args, kwargs, "index", 1, None)
        if argument(args, kwargs, "accumulate", 3, False) or not isinstance(index, Tensor):
            return False
        flat = index.reshape(-1) % max(input.numel(), 1)
        return bool(flat.numel() > 1 and flat.sort().values.diff().eq(0).any())
    if name == "index_put":
        indices = argument(args, kwargs, "indices", 1, ())
        if argument(args, kwargs, "accumulate", 3, False):
            return False
        counts = torch.zeros(input.shape, dtype=torch.int64, device=input.device)
        one = torch.ones((), dtype=torch.int64, device=input.device)
        written = counts.index_put_(tuple(cast(Sequence[Tensor], indices)), one, accumulate=True)
        return bool((written > 1).any())
    dim, index = argument(args, kwargs, "dim", 1, 0), argument(args, kwargs, "index", 2, None)
    if not isinstance(index, Tensor):
        return False
    if name == "index_copy":
        return bool(index.sort().values.diff().eq(0).any()) if index.numel() > 1 else False
    if argument(args, kwargs, "reduce", 4, None) is not None:  # scatter with reduce=
        return False
    counts = torch.zeros(input.shape, dtype=torch.int64, device=input.device)
    return bool((counts.scatter_add_(cast(int, dim), index, torch.ones_like(index)) > 1).any())


_DROPOUTS = functions(
    (F,), ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
           "feature_alpha_dropout"),
)  # fmt: skip

_DERIVATIVES = frozenset({torch.autograd.grad, torch.autograd.backward, Tensor.backward})
"""A gradient penalty's ``torch.autograd.grad`` (``create_graph=True``) of a value carrying
tangents: pushed as an op, its ``vmap(jvp)`` failed with autograd's "element 0 of tensors does
not require grad"."""

_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3}
"""How far the loss's tangents may stray from autograd's gradient (relative to the gradient's
largest entry) before the route refuses: rounding, not a missed use (bfloat16 and half: 0.1)."""


JOIN_LIMIT = 1 << 20
"""Tangent elements (4 MB of float32) from which an op taking several streams of one value
pushes each apart rather than joining them by a copy (:meth:`Tangents._large_streams`)."""


@dataclasses.dataclass(frozen=True)
class Placed:
    """Tangents each nonzero at one index of one dim of their value: row ``r`` is
    ``values[r]`` (the value's shape without ``dim``) at index ``positions[r]`` of ``dim``, as a
    layer's weight and bias entries' tangents of its output are (one feature, one channel)."""

    dim: int
    positions: Tensor
    values: Tensor
    shape: torch.Size
    """The value's."""

    def dense(self) -> Tensor:
        into = self.values.new_zeros(len(self.positions), *self.shape)
        return rules.tangents(rules.Contribution(self.dim, self.positions, self.values), into)

    def at_positions(self, values: Tensor) -> Tensor:
        """``values`` (the value's shape) at each row's index of ``dim``: ``(rows, *rest)``."""
        return values.movedim(self.dim, 0)[self.positions]

    def times(self, factor: Tensor) -> Placed:
        """These tangents times ``factor`` (the value's shape) elementwise: still placed."""
        return dataclasses.replace(self, values=self.values * self.at_positions(factor))


class Stream:
    """Tangents of one value: the rows of ``groups`` (each :attr:`Tangents.sizes` rows, in this
    order) stacked, each row the value's shape; given dense, or :class:`Placed` (made dense on
    first use of :attr:`tangents`)."""

    def __init__(self, groups: tuple[int, ...], tangents: Tensor | None = None,
                 placed: Placed | None = None) -> None:  # fmt: skip
        assert (tangents is None) != (placed is None)
        self.groups, self.placed, self.dense = groups, placed, tangents
        self.shared = False
        """Whether another stream holds its memory (a view of it, or it of another's)."""

    @property
    def tangents(self) -> Tensor:
        if self.dense is None:
            assert self.placed is not None
            self.dense = self.placed.dense()
        return self.dense

    def numel(self) -> int:
        """Elements of its dense form."""
        if self.placed is None:
            return self.tangents.numel()
        return len(self.placed.positions) * self.placed.shape.numel()


@dataclasses.dataclass
class Seed:
    """A selected tensor, or a view of one (``W.T``, ``W[1:]``): its group and the position of
    each selected entry in it (``flat``, and ``coords`` one row per dim), with its one-hot
    stream made on its first use without a sparse rule."""

    tensor: Tensor
    group: int
    rows: int
    flat: Tensor
    coords: Tensor
    offset: int = 0
    """Where its entries' rows start in its group (``joint``: after the earlier tensors')."""
    held: Tensor | None = None
    """Which entries a view holds (``W[1:]`` lacks row 0's; None: all)."""
    stream: Stream | None = None

    def one_hot(self) -> Stream:
        if self.stream is None:
            tangents = self.tensor.new_zeros(self.rows, self.tensor.numel())
            rows = torch.arange(len(self.flat), device=self.flat.device) + self.offset
            if self.held is None:
                tangents[rows, self.flat] = 1
            else:
                tangents[rows[self.held], self.flat[self.held]] = 1
            self.stream = Stream((self.group,), tangents.view(-1, *self.tensor.shape))
        return self.stream

    def dense(self, found: rules.Contribution, into: Tensor) -> None:
        """Writes a :class:`~pyhvp.restricted.contributions.Contribution` of its entries to an
        output as their tangents of it into ``into``, zeros of shape ``(rows, *out.shape)``."""
        own = rules.tangents(found, into[self.offset : self.offset + len(self.flat)])
        if self.held is not None:
            own[~self.held] = 0


@dataclasses.dataclass(frozen=True)
class _Node:
    """An op with a second-order term: the op as a function of the inputs that carry ``groups``'
    tangents, at ``primals``, with those ``tangents``, and its floating outputs; its
    :mod:`closed form <pyhvp.restricted.closed_forms>` where it has one."""

    function: Callable[..., tuple[Tensor, ...]]
    primals: tuple[Tensor, ...]
    tangents: tuple[Tensor, ...]
    groups: tuple[int, ...]
    pointwise: bool
    outputs: tuple[Tensor, ...]
    closed: ClosedForm | None = None
    placed: Placed | None = None
    """A pointwise op's tangents, placed (then ``tangents`` is empty)."""


def _floating(value: object) -> bool:
    return isinstance(value, Tensor) and value.is_floating_point()


def _alias(value: Any) -> Any:
    """A floating output of an op with several, as a view of its own: an op may make one output
    from another (``lstm_cell``'s ``h`` from its ``c``), and autograd's adjoint of that output
    itself would count that use too, which the op's own term already holds (``nn.LSTMCell``:
    0.011 off where entries reach 0.21); a view's adjoint is its consumers' alone."""
    return value.view_as(value) if _floating(value) else value


_RULES = ("linear", "matmul", "rmatmul", "einsum", "conv", "conv_transpose", "embedding")
"""Kinds whose sparse rules (:mod:`pyhvp.restricted.contributions`) give a selected tensor's
tangents of the op's output directly, with no product of a one-hot tensor."""


class FirstRun(TorchFunctionMode):
    """The loss's first run, before its tangents are pushed: each torch call it makes, the
    shapes of its floating outputs, and for each output that depends on a selected tensor the
    call that uses it last and (:meth:`reverse`) its adjoint. With them the second run, under
    :class:`Tangents`, adds each op's term at its call and drops each value's tangents after
    their last use, where holding every tangent to one reverse pass at the end holds ``k``
    times every activation (a transformer block at k = 16 per tensor: 209 MB, faulted in again
    on every call, 85 of its 229 ms)."""

    def __init__(self, selected: Sequence[Tensor]) -> None:
        super().__init__()
        self.functions: list[Callable[..., Any]] = []
        self.shapes: list[list[torch.Size]] = []
        self.last: dict[tuple[int, int], int] = {}
        """By (call, position) of each output depending on a selected tensor: the last call
        taking it (the call itself where none does)."""
        self.adjoints: dict[tuple[int, int], Tensor] = {}
        self.values: dict[tuple[int, int], Tensor] = {}
        """By the same keys: each output with an adjoint, for :meth:`Tangents._weigh`."""
        self._reached: dict[int, tuple[Tensor, tuple[int, int] | None]] = {
            id(t): (t, None) for t in selected
        }
        self._outputs: list[tuple[tuple[int, int], Tensor]] = []  # (a value may be several's)

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
        call = len(self.functions)
        carrying = False
        for leaf in pytree.tree_leaves((args, kwargs)):
            value, made = self._reached.get(id(leaf), (None, None))
            if value is leaf:
                carrying = True
                if made is not None:
                    self.last[made] = call
        carrying = carrying and call_kind(func, args, kwargs) != "constant"
        out = func(*args, **kwargs)
        outputs = [v for v in pytree.tree_leaves(out) if _floating(v)]
        carrying = carrying and torch.is_grad_enabled()
        if carrying and len(outputs) > 1:  # as Tangents views them
            out = pytree.tree_map(_alias, out)
            outputs = [v for v in pytree.tree_leaves(out) if _floating(v)]
        self.functions.append(func)
        self.shapes.append([v.shape for v in outputs])
        for position, value in enumerate(outputs if carrying else ()):
            self._reached[id(value)] = (value, (call, position))
            self._outputs.append(((call, position), value))
            self.last[call, position] = call
        return out

    def reverse(self, loss: Tensor, selected: Sequence[Tensor]) -> list[Tensor | None]:
        """Takes the adjoint of every output depending on a selected tensor, by one reverse
        pass from ``loss``; returns the gradient of each of ``selected`` (None: unused)."""
        outputs = [(at, value) for at, value in self._outputs if value.requires_grad]
        value, at = self._reached.get(id(loss), (None, None))
        if value is loss and at is not None:  # held to the end
            self.last[at] = len(self.functions)
        self._reached.clear()
        self._outputs.clear()
        adjoints, gradients = _reverse(loss, [v for _, v in outputs], selected)
        self.adjoints = {
            at: a for (at, _), a in zip(outputs, adjoints, strict=True) if a is not None
        }
        self.values = {at: v.detach() for at, v in outputs if at in self.adjoints}
        return gradients


class Tangents(TorchFunctionMode):
    """Pushes the streams of every value the loss computes from the :class:`Seed` s (by ``id``,
    the very object), adding the term of each op with one (:class:`_Node`) at its call, with
    the :class:`FirstRun`'s adjoints, or keeping it for one reverse pass at the end."""

    def __init__(self, seeds: Sequence[Seed], sizes: Sequence[int], first: FirstRun | None,
                 hessian: Tensor) -> None:  # fmt: skip
        super().__init__()
        self.seeds = {id(seed.tensor): seed for seed in seeds}
        self._reaches: dict[object, bool] = {}  # autograd nodes: whether a seed lies behind
        self.streams: dict[int, tuple[Tensor, list[Stream]]] = {}
        self.sizes = list(sizes)
        self.starts = list(accumulate(sizes, initial=0))
        self.first = first
        """The loss's first run, where it runs twice; else (None) the terms wait for one
        reverse pass at the end (:attr:`deferred`), every value's tangents held to it."""
        self.hessian = hessian
        """The terms added so far (:meth:`_add_term`, :meth:`add_deferred`)."""
        self.deferred: list[_Node] = []
        self.calls = 0
        self._dead: dict[int, list[tuple[int, list[Stream]]]] = {}  # by the call last using them
        self._last: dict[int, int] = {}  # by a value's id: the call last using its streams
        self.weighed: dict[tuple[int, int], tuple[Tensor, Tensor, Tensor]] = {}
        """By (call, position), each output a term meets weighed by its adjoint (:func:`_weighed`)
        in this run and the first, and the bound its rounding scales with: compared once, at
        the end (:meth:`strayed`)."""

    def span(self, group: int) -> slice:
        """The rows (and columns) of ``group``'s entries in the ``(K, K)`` result."""
        return slice(self.starts[group], self.starts[group + 1])

    def _seed(self, value: object) -> Seed | None:
        seed = self.seeds.get(id(value))
        return seed if seed is not None and seed.tensor is value else None

    def of(self, value: object) -> list[Stream]:
        seed = self._seed(value)
        if seed is not None:
            return [seed.one_hot()]
        found = self.streams.get(id(value))
        return found[1] if found is not None and found[0] is value else []

    def _carries(self, value: object) -> bool:
        return self._seed(value) is not None or bool(self.of(value))

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        sinc = written_out_in_mode(self, func, args, kwargs)  # as the first run does
        if sinc is not None:
            return sinc
        call = self._next_call(func)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        carrying = [i for i, v in enumerate(leaves) if self._carries(v)]
        op = call_kind(func, args, kwargs)
        written = [v for v in pytree.tree_leaves(writes_to(op, func, args, kwargs))
                   if isinstance(v, Tensor)]  # fmt: skip
        if carrying and written:
            raise NotForward(f"{describe(func)} writes in place to or from a value that "
                             "depends on a selected tensor")  # fmt: skip
        if carrying:
            reason = refusal(func, op, args, kwargs)
            if reason is not None:
                raise NotForward(reason)
            self._refuse_padding_rows(op, args, kwargs)
        out = func(*args, **kwargs)
        if op == "constant" or not torch.is_grad_enabled():
            return out  # no derivative, as autograd has it
        self._refuse_unseen(func, leaves, carrying)
        if not carrying or (op == "view" and self._follow_view(func, args, kwargs, out)):
            return out
        if any(isinstance(v, Tensor) and v.is_complex() for v in pytree.tree_leaves(out)):
            raise NotForward(f"{describe(func)} makes a complex value of one that depends on a "
                             "selected tensor (the route pushes real tangents only)")  # fmt: skip
        outputs = [v for v in pytree.tree_leaves(out) if _floating(v)]
        if not outputs:
            return out
        if len(outputs) > 1:
            out = pytree.tree_map(_alias, out)
            outputs = [v for v in pytree.tree_leaves(out) if _floating(v)]
        self._check_outputs(func, call, outputs)
        pushed: list[list[Stream]] = [[] for _ in outputs]
        made: dict[tuple[int, ...], _Node] = {}  # the op as a function of each argument set
        curvatures: dict[int, Tensor | None] = {}  # d f''(x) of a pointwise op, per primals
        pointwise = pointwise_in(func, leaves, carrying, outputs)
        identity = _identity(func, args, kwargs, leaves, carrying, outputs)
        slope = None  # a pointwise op's derivative, f'(x)
        by_rule: list[tuple[tuple[int, ...], Seed, rules.Contribution]] = []
        handed: list[Tensor] = []  # input tangents a pointwise push overwrote
        apart = (pointwise or identity or self._large_streams(leaves, carrying)
                 or self._placed_into(func, op, leaves, carrying))  # fmt: skip
        for groups, positions in self._buckets(leaves, carrying, apart).items():
            found = self._by_rule(func, op, args, kwargs, leaves, positions, outputs)
            if found is not None:  # linear in the one selected tensor: no term
                by_rule.append((groups, *found))
                continue
            placed = self._placed(leaves, positions, groups)
            if placed is not None and pointwise:  # f'(x) at each row's index: still placed
                if positions not in made:
                    made[positions] = _node(func, leaves, spec, positions, tuple(outputs),
                                            pointwise)  # fmt: skip
                if slope is None:
                    slope = _slope(made[positions])
                pushed[0].append(Stream(groups, placed=placed.times(slope)))
                if not linear_in(func, op, args, kwargs, leaves, positions):
                    self._add_term(call, dataclasses.replace(made[positions], groups=groups,
                                                             placed=placed), curvatures)  # fmt: skip
                continue
            if identity:  # the tangents as they are, placed or not: no term, no copy
                (position,) = positions
                pushed[0].append(Stream(groups, placed=placed) if placed is not None
                                 else Stream(groups, self._rows(leaves[position], groups)))  # fmt: skip
                continue
            factor = None if placed is None else _placed_factor(func, args, kwargs, leaves,
                                                                positions, outputs)  # fmt: skip
            if factor is not None:  # times a value without these tangents: no term, still placed
                assert placed is not None
                pushed[0].append(Stream(groups, placed=placed.times(factor)))
                continue
            weight = None if placed is None else _placed_weight(op, args, kwargs, leaves,
                                                                positions, placed)  # fmt: skip
            if weight is not None:  # an outer product per row
                assert placed is not None
                pushed[0].append(Stream(groups, _linear_push(placed, weight)))
                continue
            rows = tuple(self._rows(leaves[i], groups) for i in positions)
            closed = closed_form(func, op, args, kwargs, [leaves[i] for i in positions])
            if closed is not None:  # its term needs no primals (none copied, as _node's may be)
                function = _as_function(func, leaves, spec, positions)
                self._add_term(call, _Node(function, (), rows, groups, False, tuple(outputs),
                                           closed), curvatures)  # fmt: skip
                with torch.no_grad():
                    pushed[0].append(Stream(groups, closed.push(*rows)))
                continue
            zeroed = None if pointwise else _constant_terms(func, op, args, kwargs, leaves,
                                                                positions)  # fmt: skip
            tangents: tuple[Tensor, ...]
            if zeroed is not None:  # linear with no constant term once those are zero: no term
                with torch.no_grad():
                    push = _as_function(func, leaves, spec, positions, zeroed)
                    tangents = torch.func.vmap(push)(*rows)
            else:
                if positions not in made:
                    made[positions] = _node(func, leaves, spec, positions, tuple(outputs),
                                            pointwise)  # fmt: skip
                node = made[positions]
                if not linear_in(func, op, args, kwargs, leaves, positions):  # (before the push
                    # may overwrite the tangents it takes)
                    self._add_term(call, dataclasses.replace(node, tangents=rows, groups=groups),
                                   curvatures)  # fmt: skip
                if pointwise:
                    if slope is None:
                        slope = _slope(node)
                    spent = self._spent(leaves[positions[0]], groups, call)
                    if spent is None or spent.dtype != slope.dtype:
                        tangents = (rows[0] * slope,)
                    else:
                        tangents = (spent.mul_(slope),)
                        handed.append(spent)
                else:
                    with torch.no_grad():
                        tangents = torch.func.vmap(
                            lambda *r, n=node: torch.func.jvp(n.function, n.primals, r)[1]
                        )(*rows)
            for streams, tangent in zip(pushed, tangents, strict=True):
                streams.append(Stream(groups, tangent))
        if by_rule:
            pushed[0].append(_one_stream(by_rule, outputs[0]))
        for value, streams in zip(outputs, pushed, strict=True):
            self.streams[id(value)] = (value, streams)
        if self.first is not None:  # the values' last uses known: pushes may overwrite
            self._mark_shared(leaves, carrying, pushed, handed)
            for position, (value, streams) in enumerate(zip(outputs, pushed, strict=True)):
                last = self.first.last.get((call, position), call)
                self._last[id(value)] = last
                self._dead.setdefault(last, []).append((id(value), streams))
        return out

    def _mark_shared(
        self,
        leaves: Sequence[Any],
        carrying: Sequence[int],
        pushed: Sequence[list[Stream]],
        handed: Sequence[Tensor],
    ) -> None:
        """Marks the streams just pushed that hold the memory of an input's (a view's push,
        an identity's), and those inputs' streams: neither may be overwritten. Not those
        ``handed`` on, pushed into in place (:meth:`_spent`): their input reads them no more,
        and the next pointwise op may push into them again (a chain of them, each in place,
        where marked every other one made a buffer)."""
        held: list[Stream | None] = []
        for i in carrying:
            seed = self._seed(leaves[i])  # (asking of() for its stream would make its one-hot)
            held += self.of(leaves[i]) if seed is None else [seed.stream]
        memory: dict[int, Stream] = {}
        for stream in held:
            if stream is None or stream.dense is None or any(stream.dense is t for t in handed):
                continue
            where = _memory(stream.dense)
            if where is None:
                stream.shared = True
            else:
                memory[where] = stream
        for stream in (s for streams in pushed for s in streams if s.dense is not None):
            assert stream.dense is not None
            where = _memory(stream.dense)
            lent = None if where is None else memory.get(where)
            if where is None:
                stream.shared = True
            elif lent is not None:
                stream.shared = lent.shared = True

    def _spent(self, value: Any, groups: tuple[int, ...], call: int) -> Tensor | None:
        """``value``'s tangents of ``groups``, where this call may overwrite them: their
        stream's own memory (of no other stream), the value used last here (a GELU's push
        into its input layer's 48 MB of tangents at k = 16 per tensor, where a new buffer of
        that size faulted in afresh on every call: 21 ms of a transformer block's 199)."""
        if self._last.get(id(value)) != call:
            return None
        stream = next((s for s in self.of(value) if s.groups == groups), None)
        if stream is None or stream.shared or stream.placed is not None:
            return None
        tangents = stream.tangents
        return tangents if tangents.is_contiguous() and not tangents.requires_grad else None

    def _next_call(self, func: Callable[..., Any]) -> int:
        """This call's number, checked against the first run's; first dropping the streams of
        the values the call before used last (the route's memory: a transformer block's at
        k = 16 per tensor, 209 MB held to the end before, at most 104 live now)."""
        call = self.calls
        self.calls += 1
        if self.first is None:
            return call
        for key, streams in self._dead.pop(call - 1, ()):
            if self.streams.get(key, (None, None))[1] is streams:  # (not a later value's)
                del self.streams[key], self._last[key]
        if call:
            for position in range(len(self.first.shapes[call - 1])):
                self.first.adjoints.pop((call - 1, position), None)
                self.first.values.pop((call - 1, position), None)
        functions = self.first.functions
        if call >= len(functions) or functions[call] != func:
            raise NotForward(f"the loss called {describe(func)} where its first run called "
                             f"{_called(functions, call)}: the route runs the loss twice, and "
                             "needs the same torch calls each time")  # fmt: skip
        return call

    def _check_outputs(self, func: Callable[..., Any], call: int, outputs: Sequence[Tensor]
                       ) -> None:  # fmt: skip
        if self.first is not None and [v.shape for v in outputs] != self.first.shapes[call]:
            raise NotForward(f"{describe(func)} made values of other shapes than in the loss's "
                             "first run: the route runs the loss twice, and needs the same "
                             "values each time")  # fmt: skip

    def _weigh(self, run: FirstRun, call: int, outputs: Sequence[Tensor]) -> None:
        """Weighs each output of a term's op by its adjoint in this run and the ``run`` before,
        for :meth:`strayed` (the outputs of an op without a term need not agree)."""
        with torch.no_grad():
            for position, value in enumerate(outputs):
                adjoint = run.adjoints.get((call, position))
                first = run.values.get((call, position))
                if adjoint is None or first is None or (call, position) in self.weighed:
                    continue
                scale = _norm(adjoint) * _norm(first)
                self.weighed[call, position] = (_weighed(adjoint, value),
                                                _weighed(adjoint, first), scale)  # fmt: skip

    def strayed(self) -> bool:
        """Whether an output weighed by its adjoint differs from the first run's beyond
        rounding: compared once per dtype, not per call (a CUDA sync each)."""
        by_dtype: dict[torch.dtype, list[tuple[Tensor, Tensor, Tensor]]] = {}
        for got, expected, scale in self.weighed.values():
            by_dtype.setdefault(got.dtype, []).append((got, expected, scale))
        for rows in by_dtype.values():
            got, expected, scale = (torch.stack(column) for column in zip(*rows, strict=True))
            if not _within_rounding(got, expected, scale):
                return True
        return False

    def _add_term(self, call: int, node: _Node, curvatures: dict[int, Tensor | None]) -> None:
        """Adds ``node``'s term to :attr:`hessian`, its outputs' adjoints the first run's; or,
        where the loss runs once, keeps it for :meth:`add_deferred`."""
        if self.first is None:
            self.deferred.append(node)
            return
        adjoints = [self.first.adjoints.get((call, j)) for j in range(len(node.outputs))]
        if any(a is not None for a in adjoints):  # (else no output reaches the loss)
            self._weigh(self.first, call, node.outputs)
            with _apart_from_the_loss(self.hessian.device):
                self._add(node, adjoints, curvatures)

    def add_deferred(self, adjoints: Mapping[int, Tensor]) -> None:
        """Adds the terms kept for the end, ``adjoints`` of their outputs by ``id``."""
        curvatures: dict[int, Tensor | None] = {}  # (every node alive: their ids unique)
        for node in self.deferred:
            found = [adjoints.get(id(o)) for o in node.outputs]
            if any(a is not None for a in found):
                self._add(node, found, curvatures)

    def _add(
        self, node: _Node, adjoints: Sequence[Tensor | None], curvatures: dict[int, Tensor | None]
    ) -> None:
        terms = _second_order(node, adjoints, self.sizes, curvatures)
        if terms is None:  # the op has no second derivative
            return
        for group, block in zip(node.groups, terms, strict=True):
            self.hessian[self.span(group), self.span(group)] += block

    def _refuse_unseen(
        self, func: Callable[..., Any], leaves: Sequence[Any], carrying: Sequence[int]
    ) -> None:
        """Raise :class:`NotForward` where an argument without tangents depends on a selected
        tensor in autograd's graph: it came from an op the mode did not see (a custom
        ``autograd.Function``, TorchScript, a complex intermediate), whose derivatives the
        route would miss. (The check of the first derivatives cannot see such a use where its
        gradient is zero, at a minimum.)"""
        for i, value in enumerate(leaves):
            if i in carrying or not isinstance(value, Tensor) or value.grad_fn is None:
                continue
            if value.numel() and self.reaches_a_seed(value.grad_fn):  # (empty: no entry)
                raise NotForward(f"{describe(func)} takes a value that depends on a selected "
                                 "tensor through an op pyhvp's mode did not see (a custom "
                                 "autograd.Function, TorchScript, a complex value)")  # fmt: skip

    def reaches_a_seed(self, node: Any) -> bool:
        """Whether autograd's graph behind ``node`` holds a selected tensor (memoised)."""
        stack, order = [node], []
        while stack:
            current = stack.pop()
            if current is None or current in self._reaches:
                continue
            self._reaches[current] = False  # provisional: a graph has no cycles
            order.append(current)
            stack.extend(n for n, _ in current.next_functions)
        for current in reversed(order):  # every node after the ones behind it
            variable = getattr(current, "variable", None)
            self._reaches[current] = (variable is not None and id(variable) in self.seeds) or any(
                n is not None and self._reaches.get(n, False) for n, _ in current.next_functions
            )
        return self._reaches[node]

    def _follow_view(
        self, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], out: Any
    ) -> bool:
        """Whether ``out`` is a view of a :class:`Seed` (``W.T``, ``W[1:]``, ``W.chunk(2)``),
        now followed as seeds of their own; else its tangents are pushed as any op's."""
        seed = self._seed(args[0]) if args else None
        order = None if seed is None else permuted_dims(seed.tensor, out)
        if seed is not None and order is not None:  # W.T: its entries' indices permuted
            flat = ravel(seed.coords[order], out.shape)
            self.seeds[id(out)] = Seed(out, seed.group, seed.rows, flat,
                                       selected_entries(out, flat), seed.offset, seed.held)  # fmt: skip
            return True
        positions = None if seed is None else view_positions(func, args, kwargs, out)
        if seed is None or positions is None:
            return False
        outs = out if isinstance(out, (tuple, list)) else [out]
        for result, where in zip(outs, positions, strict=True):
            if where is None:
                continue
            inverse = seed.flat.new_full((seed.tensor.numel(),), -1)
            inverse[where.reshape(-1)] = torch.arange(where.numel(), device=where.device)
            position = inverse[seed.flat]
            held = position >= 0 if seed.held is None else (position >= 0) & seed.held
            flat = position.clamp(min=0)
            self.seeds[id(result)] = Seed(result, seed.group, seed.rows, flat,
                                          selected_entries(result, flat), seed.offset, held)  # fmt: skip
        return True

    def _refuse_padding_rows(self, op: str, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Raise :class:`NotForward` where a table that carries tangents enters an embedding with
        them in its ``padding_idx`` row, whose derivative autograd takes as zero."""
        bound = bind(op, args, kwargs) if op == "embedding" else None
        if bound is None or bound.get("padding_idx") is None:
            return
        table = bound["weight"]
        row = bound["padding_idx"] % table.shape[0]
        seed = self._seed(table)
        if seed is not None:  # (of a view's entries, only those it holds)
            reached = seed.coords[0] == row
            hit = bool((reached if seed.held is None else reached & seed.held).any())
        else:
            hit = any(bool(s.tangents[:, row].any()) for s in self.of(table))
        if hit:
            raise NotForward("a selected entry reaches an embedding's padding_idx row, where "
                             "autograd's derivative is zero, not the true one")  # fmt: skip

    def _buckets(
        self, leaves: Sequence[Any], carrying: Sequence[int], apart: bool
    ) -> dict[tuple[int, ...], tuple[int, ...]]:
        """The groups reaching this op, bucketed by which arguments carry them; ``apart``: and
        by stream (a pointwise op pushes each as it is, with no copy to join them)."""
        where: dict[int, list[int]] = {}
        for i in carrying:
            seed = self._seed(leaves[i])
            groups = (seed.group,) if seed is not None else (
                g for stream in self.of(leaves[i]) for g in stream.groups)  # fmt: skip
            for group in groups:
                where.setdefault(group, []).append(i)
        buckets: dict[tuple[tuple[int, ...], int], list[int]] = {}
        for group in sorted(where):
            positions = tuple(where[group])
            first = leaves[positions[0]]  # (a selected tensor's one stream is made per use)
            alone = self._stream_index(first, group) if apart and not self._seed(first) else -1
            buckets.setdefault((positions, alone), []).append(group)
        return {tuple(groups): key[0] for key, groups in buckets.items()}

    def _large_streams(self, leaves: Sequence[Any], carrying: Sequence[int]) -> bool:
        """Whether the values carrying tangents into this op but the selected tensors' own (a
        layer's weight and bias) carry them in several streams of :data:`JOIN_LIMIT` elements
        or more together, every two streams of different values of equal or disjoint groups:
        each is then pushed as it is, as a pointwise op's are, where joining them would copy
        them all (LeNet-5's second max-pool at k = 16 per tensor: 14 MB, against a max-pool of
        one image batch per stream; a transformer's second MLP layer, 67 MB; its residual adds
        take 29 ms to 16)."""
        values = {id(leaves[i]): leaves[i] for i in carrying if self._seed(leaves[i]) is None}
        streams = [self.of(value) for value in values.values()]
        if not any(len(mine) > 1 for mine in streams):
            return False
        if sum(s.numel() for mine in streams for s in mine) < JOIN_LIMIT:
            return False
        groups = [{s.groups for s in mine} for mine in streams]
        return all(
            a == b or not set(a) & set(b)
            for mine, theirs in combinations(groups, 2)
            for a in mine
            for b in theirs
        )

    def _placed_into(
        self, func: Callable[..., Any], op: str, leaves: Sequence[Any], carrying: Sequence[int]
    ) -> bool:
        """Whether placed tangents enter this ``F.linear`` or product: its streams then push
        apart, so that the placed ones push as outer products (:func:`_linear_push`) or stay
        placed (:func:`_placed_factor`)."""
        return (op == "linear" or func in PRODUCTS) and any(
            s.placed is not None
            for i in carrying
            if self._seed(leaves[i]) is None  # (whose one-hot stream asking would make)
            for s in self.of(leaves[i])
        )

    def _stream_index(self, value: object, group: int) -> int:
        """Which of ``value``'s streams carries ``group``."""
        return next(i for i, s in enumerate(self.of(value)) if group in s.groups)

    def _by_rule(
        self,
        func: Callable[..., Any],
        op: str,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        leaves: Sequence[Any],
        positions: Sequence[int],
        outputs: Sequence[Tensor],
    ) -> tuple[Seed, rules.Contribution] | None:
        """A selected tensor and its entries' contribution to this contraction's (or layer
        norm's) output by its sparse rule, where it alone carries its group's tangents into it;
        else None."""
        seed = self._seed(leaves[positions[0]]) if len(positions) == 1 else None
        if seed is None or len(outputs) != 1:
            return None
        if func in LAYER_NORMS:
            placed = layer_norm_affine(args, kwargs, seed.tensor, seed.flat)
            return None if placed is None else (seed, placed)
        if op not in _RULES:
            return None
        bound = bind(op, args, kwargs)
        if bound is None or autograd_convention(op, bound):
            return None
        key = next((k for k, v in contracted(op, bound) if v is seed.tensor), None)
        if key is None:
            bias = _bias_contribution(op, bound, seed, outputs[0])
            return None if bias is None else (seed, bias)
        found = contribution_of(op, bound, key, seed.coords)
        return None if isinstance(found, str) else (seed, found)

    def _placed(
        self, leaves: Sequence[Any], positions: Sequence[int], groups: tuple[int, ...]
    ) -> Placed | None:
        """The placed tangents of ``groups``, where one argument carries them in one stream."""
        if len(positions) != 1 or self._seed(leaves[positions[0]]) is not None:
            return None
        stream = next((s for s in self.of(leaves[positions[0]]) if s.groups == groups), None)
        return None if stream is None else stream.placed

    def _rows(self, value: Any, groups: tuple[int, ...]) -> Tensor:
        """``value``'s tangents of ``groups``, stacked in that order."""
        streams = self.of(value)
        for stream in streams:
            if stream.groups == groups:
                return stream.tangents
        parts = []
        for group in groups:
            for stream in streams:
                if group in stream.groups:
                    start = sum(self.sizes[g] for g in stream.groups[: stream.groups.index(group)])
                    parts.append(stream.tangents[start : start + self.sizes[group]])
        return torch.cat(parts)


@contextmanager
def _apart_from_the_loss(device: torch.device) -> Iterator[None]:
    """The loss's own contexts set aside for a term, which is taken inside the loss's run (once
    after it): an autocast region's precision (bfloat16's Gram matrices, 0.15 off where the
    entries reach 42, against 1.5e-5 outside it) and its saved-tensor hooks (a checkpoint's,
    which the term's own reverse passes tripped)."""
    with ExitStack() as stack:
        if torch.amp.is_autocast_available(device.type):
            stack.enter_context(torch.autocast(device.type, enabled=False))
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_itself, _itself))
        yield


def _itself(value: Any) -> Any:
    return value


def _memory(tensor: Tensor) -> int | None:
    """Where ``tensor``'s memory starts; None where torch hides it (a tangent of a value inside
    the loss's own ``vmap``: "Cannot access storage of BatchedTensorImpl", where the route
    refused such a loss by name before)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        return None


def _called(functions: Sequence[Callable[..., Any]], call: int) -> str:
    return describe(functions[call]) if call < len(functions) else "nothing more"


def _bias_contribution(
    op: str, bound: dict[str, Any], seed: Seed, out: Tensor
) -> rules.Contribution | None:
    """A selected 1-D bias of ``F.linear`` or a convolution: entry ``j``'s tangent of the output
    is 1 at its feature (channel) ``j``, everywhere else 0 -- written in place, where the op as a
    function of the bias, pushed by ``jvp``, ran the whole convolution again. None for any
    other use."""
    if op not in ("linear", "conv", "conv_transpose") or bound.get("bias") is not seed.tensor:
        return None
    # the feature dim: the last of F.linear's output; a convolution's channels, after the batch
    # dim where the input has one (the weight has the spatial dims and two more)
    dim = out.ndim - 1 if op == "linear" else out.ndim - bound["weight"].ndim + 1
    if seed.tensor.ndim != 1 or not 0 <= dim < out.ndim or len(seed.tensor) != out.shape[dim]:
        return None
    rest = [size for d, size in enumerate(out.shape) if d != dim]
    return rules.Contribution(dim, seed.flat, out.new_ones(()).expand(len(seed.flat), *rest))


def _one_stream(
    by_rule: Sequence[tuple[tuple[int, ...], Seed, rules.Contribution]], out: Tensor
) -> Stream:
    """The tangents of ``out`` of the selected tensors entering it by their sparse rules (a
    layer's weight and bias), their groups' rows stacked in group order in ONE stream: a stream
    per tensor would be joined by a copy of them all at the next op that takes both (LeNet-5's
    first max-pool: 20 MB). Placed where every rule places its entries along one dim (a layer's
    output feature or channel), else written dense."""
    parts = sorted(by_rule, key=lambda part: part[0])
    groups = tuple(group for groups, _, _ in parts for group in groups)
    rows = sum(seed.rows for _, seed, _ in parts)
    dims = {found.dim if found.entries is None else None for _, _, found in parts}
    dim = dims.pop() if len(dims) == 1 else None
    if dim is not None and out.shape[dim] > 0:  # (rows of no entry are at index 0, zero)
        rest = [size for d, size in enumerate(out.shape) if d != dim]
        positions = torch.zeros(rows, dtype=torch.int64, device=out.device)
        values = out.new_zeros(rows, *rest)
        start = 0
        for _, seed, found in parts:
            assert found.positions is not None
            mine = slice(start + seed.offset, start + seed.offset + len(seed.flat))
            positions[mine] = found.positions
            values[mine] = found.values.detach()
            if seed.held is not None:
                values[mine][~seed.held] = 0
            start += seed.rows
        return Stream(groups, placed=Placed(dim, positions, values, out.shape))
    dense = out.new_zeros(rows, *out.shape)
    start = 0
    for _, seed, found in parts:
        seed.dense(found, dense[start : start + seed.rows])
        start += seed.rows
    return Stream(groups, dense)


def _identity(
    func: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    leaves: Sequence[Any],
    carrying: Sequence[int],
    outputs: Sequence[Tensor],
) -> bool:
    """Whether this call's tangents are its one carrying argument's as they are: a dropout
    outside training or of ``p = 0`` (:func:`refusal` refuses any other), as ``nn.Dropout``
    between a layer's activation and the next layer calls it, whose placed tangents then stay
    placed (made dense, the next layer's push was a matrix product: an MLP's forward route 3x);
    or a sum of it and a constant of its shape and dtype, a residual connection one of whose
    branches the selected tensors do not reach (pushed, it added zeros to every tangent: a
    transformer block's at k = 16 per tensor, 12 ms a call)."""
    if len(carrying) != 1 or len(outputs) != 1:
        return False
    value = leaves[carrying[0]]
    if outputs[0].shape != value.shape:
        return False
    if func in _DROPOUTS:
        return True
    if outputs[0].dtype != value.dtype:
        return False
    if len(args) > 0 and args[0] is value:
        return func in _PLUS_FIRST
    return len(args) > 1 and args[1] is value and func in _ADDS and (
        argument(args, kwargs, "alpha", 2, 1) == 1)  # fmt: skip


def _placed_factor(
    func: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    leaves: Sequence[Any],
    positions: Sequence[int],
    outputs: Sequence[Tensor],
) -> Tensor | None:
    """The other factor of this product ``a * b``, of the carrying one's shape, where only one
    carries these tangents and the product has its shape and dtype (a gated MLP's
    ``silu(gate(x)) * up(x)``, a layer scale ``gamma * h``): each placed row's push is then its
    values times the factor at its index; None for any other call."""
    if func not in PRODUCTS or kwargs or len(args) != 2 or len(positions) != 1:
        return None
    (i,) = positions
    if i not in (0, 1) or len(outputs) != 1 or args[i] is not leaves[i]:
        return None
    value, other = args[i], args[1 - i]
    if not isinstance(value, Tensor) or outputs[0].shape != value.shape:
        return None
    if outputs[0].dtype != value.dtype:
        return None
    if isinstance(other, Tensor):
        return other.detach().to(value.dtype).broadcast_to(value.shape)  # (a 0-dim float64)
    if isinstance(other, (int, float)) and not isinstance(other, bool):
        return value.new_full((), other).broadcast_to(value.shape)
    return None


def _slope(node: _Node) -> Tensor:
    """A pointwise op's derivative ``f'(x)``, elementwise."""
    with torch.no_grad():
        ones = (torch.ones_like(node.primals[0]),)
        return cast(Tensor, torch.func.jvp(node.function, node.primals, ones)[1][0])


def _placed_weight(
    op: str,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    leaves: Sequence[Any],
    positions: Sequence[int],
    placed: Placed,
) -> Tensor | None:
    """The weight of this ``F.linear`` where its input's tangents are placed along its last dim
    (the features it contracts) and the weight carries none of them: each row's push is then
    one weight column times its values (:func:`_linear_push`), not a matrix product."""
    bound = bind(op, args, kwargs) if op == "linear" else None
    if bound is None:
        return None
    input, weight = bound["input"], bound["weight"]
    pushes = (
        leaves[positions[0]] is input
        and isinstance(weight, Tensor)
        and weight.ndim == 2
        and input.ndim >= 1
        and placed.dim == input.ndim - 1
    )
    return weight if pushes else None


def _linear_push(placed: Placed, weight: Tensor) -> Tensor:
    """``F.linear``'s push of placed input tangents by ``weight``: row ``r`` is ``values[r]``
    times column ``positions[r]`` of it, ``(rows, *input[:-1], out)``."""
    columns = weight.detach().t()[placed.positions]  # (rows, out)
    values = placed.values
    return values.unsqueeze(-1) * columns.view(len(columns), *[1] * (values.ndim - 1), -1)


def _node(
    func: Callable[..., Any],
    leaves: Sequence[Any],
    spec: pytree.TreeSpec,
    positions: tuple[int, ...],
    outputs: tuple[Tensor, ...],
    pointwise: bool,
) -> _Node:
    """``func`` as a function of its arguments at ``positions`` (the others as called), at the
    values called with (its tangents and groups to be filled in)."""
    function = _as_function(func, leaves, spec, positions)
    # a primal whose entries share memory (expanded) cannot be made dual: its copy can
    primals = tuple(_dualisable(leaves[i].detach()) for i in positions)
    return _Node(function, primals, (), (), pointwise, outputs)


def _as_function(
    func: Callable[..., Any],
    leaves: Sequence[Any],
    spec: pytree.TreeSpec,
    positions: tuple[int, ...],
    replaced: Mapping[int, Any] | None = None,
) -> Callable[..., tuple[Tensor, ...]]:
    """``func`` as a function of its arguments at ``positions``, the others as called except
    those ``replaced`` names (by position, with what stands in for them); returning its
    floating outputs."""
    fixed = list(leaves)
    for i, value in (replaced or {}).items():
        fixed[i] = value

    def function(*values: Tensor) -> tuple[Tensor, ...]:
        given = list(fixed)
        for i, value in zip(positions, values, strict=True):
            given[i] = value
        args, kwargs = pytree.tree_unflatten(given, spec)
        return tuple(v for v in pytree.tree_leaves(func(*args, **kwargs)) if _floating(v))

    return function


def _constant_terms(
    func: Callable[..., Any],
    op: str,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    leaves: Sequence[Any],
    positions: Sequence[int],
) -> dict[int, Any] | None:
    """Where ``func`` is linear in the arguments at ``positions`` with a constant term that
    only other arguments add (a bias, the other operand of a sum), the leaves holding those, by
    position, each with what stands in for it as zero: with them so, the op itself pushes
    tangents, as ``vmap`` of it (a tenth of ``vmap(jvp)``'s cost on a small layer); None where
    it is not known to be (``jvp`` pushes them). A layer's bias stands in as None, no bias, not
    zeros added to every pushed tangent (a transformer's MLP at k = 16 per tensor: the op time
    of its pushes' additions, 19 ms, halved)."""
    first = tuple(positions) == (0,) and bool(args) and args[0] is leaves[0]
    if op == "view" or func in HOMOGENEOUS:  # others' arguments: shapes, dtypes (x.view_as(y))
        return {} if first else None
    if func in PRODUCTS and len(positions) == 1:
        return {}
    if func in QUOTIENTS and first:
        return {} if argument(args, kwargs, "rounding_mode", 2, None) is None else None
    if func in SUMS and len(args) == 2 and set(positions) <= {0, 1}:  # not add(x, alpha, y)
        return {i: _zero(leaves[i]) for i in (0, 1) if i not in positions}
    if func in JOINS and args and isinstance(args[0], (list, tuple)):  # leaves 0..n-1
        n = len(args[0])
        if max(positions) >= n:
            return None
        return {i: _zero(leaves[i]) for i in range(n) if i not in positions}
    if op in _CONTRACTIONS and linear_in(func, op, args, kwargs, leaves, positions):
        bound = bind(op, args, kwargs)
        assert bound is not None  # linear_in bound it
        biases = [bound[b] for b in BIASES.get(op, ()) if bound.get(b) is not None]
        at = [i for i, v in enumerate(leaves) if any(v is b for b in biases)]
        if len(at) != len(biases) or set(at) & set(positions):
            return None  # a bias that is also a factor, or that carries tangents
        return {i: None if op in _OPTIONAL_BIASES else _zero(leaves[i]) for i in at}
    return None


def _zero(value: Any) -> Any:
    return torch.zeros_like(value) if isinstance(value, Tensor) else type(value)(0)


_OPTIONAL_BIASES = ("linear", "conv", "conv_transpose")
"""Ops whose bias may be None (no bias); ``addmm``'s ``input`` may not."""

_CONTRACTIONS = (*EINSUM_FAMILY, "conv", "conv_transpose", "embedding")


def _dualisable(tensor: Tensor) -> Tensor:
    """``tensor``, copied where entries share memory (a stride 0: ``expand``), which forward
    AD cannot make dual."""
    shared = tensor.numel() > 1 and any(
        stride == 0 and size > 1 for stride, size in zip(tensor.stride(), tensor.shape, strict=True)
    )
    return tensor.clone() if shared else tensor


def refusal(func: Callable[..., Any], op: str, args: Sequence[Any], kwargs: dict[str, Any]
            ) -> str | None:  # fmt: skip
    """Why the route cannot follow autograd through this call of an op that takes tangents,
    known before it runs (None: it can): running statistics updated (the route would run the op
    twice), a random op, a gradient hook, an op whose forward derivative torch gets wrong, an
    embedding whose derivative autograd scales by frequency or that writes to its table. (The
    survey asks too, so that the cost model does not choose the route for such a loss.)"""
    if func in _STATEFUL and _updates_statistics(func, args, kwargs):
        return f"{describe(func)} updates its running statistics in training"
    if (
        func in _DROPOUTS
        and argument(args, kwargs, "training", 2, True)
        and argument(args, kwargs, "p", 1, 0.5) != 0
    ):  # (p = 0: the identity, no draw)
        return f"{describe(func)} in training draws a random mask (randomness)"
    if func in _DERIVATIVES:
        return (f"{describe(func)} takes a derivative inside the loss: autograd's engine runs "
                "its ops, which the route's mode does not see")  # fmt: skip
    if func in HOOKS:
        return (f"{describe(func)}: a gradient hook on a value that depends on a selected "
                "tensor changes autograd's derivative, not the op's")  # fmt: skip
    reduce = argument(args, kwargs, "reduce", 4, None)
    if func in _WRONG_FORWARD_DERIVATIVES and reduce in _WRONG_REDUCTIONS:
        return (f"{describe(func)} with reduce={reduce!r}: torch's forward derivative of it "
                f"{_WRONG_REDUCTIONS[reduce]}")  # fmt: skip
    if _writes_twice(func, args, kwargs):
        return (f"{describe(func)} writes to one position twice: torch's forward derivative "
                "follows the last write, autograd's backward every writer")  # fmt: skip
    if _at_a_tie(func, args, kwargs):
        return (f"{describe(func)} has an input at its kink or on its tensor bound, where "
                "torch's forward derivative is not autograd's")  # fmt: skip
    bound = bind(op, args, kwargs) if op == "embedding" else None
    if bound is not None and (autograd_convention(op, bound) or writes_operand(op, bound)):
        return (f"{describe(func)} with scale_grad_by_freq or max_norm: autograd's derivative "
                "there is not the op's own")  # fmt: skip
    return None


def _updates_statistics(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
                        ) -> bool:  # fmt: skip
    """Whether this ``F.batch_norm`` / ``F.instance_norm`` call writes running statistics."""
    names = ("running_mean", "running_var")
    statistics = [*args[1:3], *(kwargs.get(n) for n in names)]
    if func is F.batch_norm:
        training = args[5] if len(args) > 5 else kwargs.get("training", False)
    else:
        training = args[5] if len(args) > 5 else kwargs.get("use_input_stats", True)
    return bool(training) and any(t is not None for t in statistics)


def linear_in(
    func: Callable[..., Any],
    op: str,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    leaves: Sequence[Any],
    positions: Sequence[int],
) -> bool:
    """Whether ``func`` is linear in the arguments at ``positions`` together (no term)."""
    if op == "view" or func in ADDITIVE:
        return True
    if func in LAYER_NORMS:  # affine in its weight and bias together
        return not any(leaves[i] is first_input(args, kwargs) for i in positions)
    if func in PRODUCTS:
        return len(positions) == 1
    if func in QUOTIENTS:
        return tuple(positions) == (0,)
    if op in CONTRACTED or op in EINSUM_FAMILY or op in ("conv", "conv_transpose", "embedding"):
        bound = bind(op, args, kwargs)
        if bound is None:
            return False
        if len({id(leaves[i]) for i in positions}) < len(positions):
            return False  # one tensor in two arguments (F.linear(h, W, h)): a factor, maybe
        biases = [bound[b] for b in BIASES.get(op, ()) if b in bound]
        factors = [i for i in positions if not any(leaves[i] is b for b in biases)]
        return len(factors) <= 1
    return False


def pointwise_in(
    func: Callable[..., Any],
    leaves: Sequence[Any],
    positions: Sequence[int],
    outputs: Sequence[Tensor],
) -> bool:
    """Whether ``func`` acts elementwise on its one tensor argument here."""
    tensors = [v for v in leaves if isinstance(v, Tensor)]
    return (
        func in POINTWISE
        and len(tensors) == 1
        and len(positions) == 1
        and len(outputs) == 1
        and outputs[0].shape == leaves[positions[0]].shape
    )


@math_attention  # fused attention kernels have no forward derivative
@differentiated_twice  # norms, weight norms, sinc: torch's double backwards are wrong
@batched_double_backward  # (its Hessian products are)
def forward_hessian(
    loss: Callable[..., Tensor],
    tensors: Sequence[Tensor],
    flats: Sequence[Tensor],
    joint: bool,
    *args: Any,
    twice: bool = False,
    again: Callable[[], None] = lambda: None,
) -> Tensor:
    """``(K, K)`` Hessian of ``loss(*tensors, *args)`` over the entries ``flats`` of ``tensors``
    (``K`` in all, unsymmetrised): joint, or (``joint=False``) its diagonal blocks, one per
    tensor, and zeros between them. Raises :class:`NotForward` where the route does not apply.
    The tensors share one dtype and device. ``twice``: the loss runs twice (:class:`FirstRun`),
    ``again()`` between the runs, which puts back the random state and whatever else the first
    run changed; else once, holding every value's tangents to one reverse pass at the end."""
    sizes = [len(flat) for flat in flats]
    total = sum(sizes)
    dtype = tensors[0].dtype
    if any(t.dtype != dtype or t.device != tensors[0].device for t in tensors):
        raise NotForward("the selected tensors differ in dtype or device")
    forward_mode_decompositions_loaded()  # (torch.func.jvp pushes the pointwise ops' tangents)
    leaves = [t.detach().requires_grad_() for t in tensors]
    seeds, offset = [], 0
    for i, (leaf, flat) in enumerate(zip(leaves, flats, strict=True)):
        flat = flat.to(leaf.device)
        coords = selected_entries(leaf, flat)
        if joint:
            seeds.append(Seed(leaf, 0, total, flat, coords, offset))
        elif sizes[i]:  # a tensor without selected entries carries no tangents
            seeds.append(Seed(leaf, i, sizes[i], flat, coords))
        offset += sizes[i]
    hessian = leaves[0].new_zeros(total, total).detach()
    with torch.enable_grad():
        first = FirstRun(leaves) if twice else None
        if first is not None:
            with first:
                expected = loss(*leaves, *args)
            if not expected.requires_grad:  # no selected tensor reaches the loss
                return hessian
            gradients = first.reverse(expected, leaves)
            again()
        mode = Tangents(seeds, [total] if joint else sizes, first, hessian)
        with mode:
            value = loss(*leaves, *args)
        if first is None:
            if not value.requires_grad:
                return hessian
            gradients = _take_deferred(mode, value, leaves)
    if first is not None:
        _compare_runs(mode, first, value, expected)
    if not mode.of(value) and value.grad_fn is not None and mode.reaches_a_seed(value.grad_fn):
        raise NotForward("the loss is made by an op pyhvp's mode did not see (a custom "
                         "autograd.Function, TorchScript) from a selected tensor")  # fmt: skip
    _check_first_order(mode, value, gradients, leaves, flats)
    # 0 * inf, an infinite curvature where the tangents are zero, is NaN in the Gram matrices
    # (x ** 1.5 at 0); autograd's backward gives a finite value where it masks the entry (relu's
    # zeros) and NaN where it multiplies (abs at 0, whose true curvature is infinite): which one
    # a zero tangent means, only autograd's route knows
    if not bool(torch.isfinite(hessian).all()):
        raise NotForward("its second-order terms are not finite (an op's infinite second "
                         "derivative, or a NaN tangent, at an entry the tangents reach as "
                         "zero): the reverse route gives autograd's value there")  # fmt: skip
    return hessian


def _weighed(adjoint: Tensor, value: Tensor) -> Tensor:
    """``value`` summed weighed by its adjoint: the two runs' must agree where a term of the
    second meets the first's adjoints, and the loss alone may not tell (a batch shuffled by
    NumPy's generator, which no run puts back: the same loss, each row's adjoint meeting
    another row's activations, 20 off)."""
    return adjoint.reshape(-1) @ value.detach().reshape(-1)


def _take_deferred(mode: Tangents, value: Tensor, leaves: Sequence[Tensor]
                   ) -> list[Tensor | None]:  # fmt: skip
    """Adds the terms of a loss run once, by one reverse pass for their outputs' adjoints;
    returns the gradient of each of ``leaves`` (None: unused)."""
    unique = {id(o): o for node in mode.deferred for o in node.outputs if o.requires_grad}
    outputs = list(unique.values())
    adjoints, gradients = _reverse(value, outputs, leaves)
    mode.add_deferred({id(o): a for o, a in zip(outputs, adjoints, strict=True) if a is not None})
    return gradients


def _reverse(loss: Tensor, outputs: Sequence[Tensor], leaves: Sequence[Tensor]
             ) -> tuple[list[Tensor | None], list[Tensor | None]]:  # fmt: skip
    """One reverse pass from ``loss``: the adjoint of each of ``outputs`` and the gradient of
    each of ``leaves`` (None: unused)."""
    found = torch.autograd.grad(loss, [*outputs, *leaves], allow_unused=True)
    return list(found[: len(outputs)]), list(found[len(outputs) :])


def _compare_runs(mode: Tangents, first: FirstRun, value: Tensor, expected: Tensor) -> None:
    """Raise :class:`NotForward` where the loss's second run differs from its first."""
    if mode.calls != len(first.functions):
        raise NotForward(f"the loss made {mode.calls} torch calls where its first run made "
                         f"{len(first.functions)}: the route runs the loss twice, and needs "
                         "the same torch calls each time")  # fmt: skip
    if mode.strayed():
        raise NotForward("the loss computed other values on its second run (a draw it cannot "
                         "repeat, as NumPy's), whose terms would meet the first run's "
                         "adjoints: the route runs the loss twice, and "
                         "needs the same values each time")  # fmt: skip
    if not _same_value(value.detach(), expected.detach()):
        raise NotForward("the loss gave another value on its second run: the route runs the "
                         "loss twice, and needs the same value each time")  # fmt: skip


def _same_value(value: Tensor, expected: Tensor) -> bool:
    """Whether the loss's second run gave its first run's value, up to rounding (a CUDA
    kernel's atomic sums, in another order; near a zero loss, a few hundred ulps of 1)."""
    if value.shape != expected.shape:
        return False
    floor = 1e2 * torch.finfo(expected.dtype).eps
    return _within_rounding(value, expected, expected.abs(), floor)


def _within_rounding(got: Tensor, expected: Tensor, scale: Tensor, floor: float = 0.0) -> bool:
    """Whether ``got`` is the first run's ``expected`` up to rounding: a hundredth of
    :data:`_TOLERANCE` relative to ``scale``, plus ``floor`` (equal infinities, and NaN against
    NaN, too)."""
    tolerance = _TOLERANCE.get(expected.dtype, 0.1) * 1e-2
    close = (got - expected).abs() <= tolerance * scale + floor
    return bool((close | (got == expected) | (got.isnan() & expected.isnan())).all())


def _second_order(
    node: _Node,
    adjoints: Sequence[Tensor | None],
    sizes: Sequence[int],
    curvatures: dict[int, Tensor | None],
) -> list[Tensor] | None:
    """The node's term between the tangents of each of its groups (``sizes``: rows per group):
    one ``(rows, rows)`` block per group; None where the op has no second derivative.
    ``curvatures``: ``d f''(x)`` of the pointwise ops met so far, by their primals' ``id``."""
    weights = [
        (torch.zeros_like(o) if w is None else w.detach())
        for o, w in zip(node.outputs, adjoints, strict=True)
    ]

    def weighted(*values: Tensor) -> Tensor:
        outputs = node.function(*values)
        return torch.stack([(w * o).sum() for w, o in zip(weights, outputs, strict=True)]).sum()

    if node.closed is not None:
        return [node.closed.terms(weights[0], *own)
                for own in _per_group(node.tangents, node.groups, sizes)]  # fmt: skip
    if node.pointwise:  # d f''(x), elementwise: weighted Gram matrices
        (primal,) = node.primals
        if id(node.primals) not in curvatures:
            ones = torch.ones_like(primal)[None]
            products = _hessian_products(weighted, (primal,), (ones,))
            curvatures[id(node.primals)] = None if products is None else products[0][0]
        curvature = curvatures[id(node.primals)]
        if curvature is None:
            return None
        if node.placed is not None:  # rows at one index each: pairs at the same index only
            placed = node.placed
            by_group = _per_group(
                (placed.positions, placed.values, placed.at_positions(curvature)),
                node.groups,
                sizes,
            )
            blocks = []
            for positions, values, weight in by_group:
                rows = values.reshape(len(values), -1)
                gram = (values * weight).reshape(len(values), -1) @ rows.mT
                blocks.append(gram * (positions[:, None] == positions[None, :]))
            return blocks
        (tangents,) = node.tangents
        flat, weight = tangents.reshape(len(tangents), -1), curvature.reshape(-1)
        return [_weighted_gram(own, weight) for (own,) in _per_group((flat,), node.groups, sizes)]
    # jvp(grad(d . f)) along every tangent: the op's own Hessian-vector products
    found = _hessian_products(weighted, node.primals, node.tangents)
    if found is None:
        return None
    by_group = _per_group([u.reshape(len(u), -1) for u in found], node.groups, sizes)
    factors = _per_group([t.reshape(len(t), -1) for t in node.tangents], node.groups, sizes)
    blocks = []
    for us, ts in zip(by_group, factors, strict=True):
        pairs = [u @ t.mT for u, t in zip(us, ts, strict=True)]
        blocks.append(torch.stack(pairs).sum(0) if len(pairs) > 1 else pairs[0])
    return blocks


GRAM_COLUMNS = 1 << 15
"""Columns of the weighted rows :func:`_weighted_gram` makes at a time."""


def _weighted_gram(rows: Tensor, weight: Tensor) -> Tensor:
    """``(rows * weight) @ rows.mT`` of ``(K, n)`` rows and ``(n,)`` weights, the weighted rows
    made :data:`GRAM_COLUMNS` columns at a time: they stay in cache, and no ``(K, n)`` buffer is
    allocated (a transformer's GELU at k = 16 per tensor, 2.3 ms a group against 3.3)."""
    if rows.shape[1] <= GRAM_COLUMNS:
        return (rows * weight) @ rows.mT
    gram = rows.new_zeros(len(rows), len(rows))
    for start in range(0, rows.shape[1], GRAM_COLUMNS):
        columns = rows[:, start : start + GRAM_COLUMNS]
        gram.addmm_(columns * weight[start : start + GRAM_COLUMNS], columns.mT)
    return gram


def _per_group(
    rows: Sequence[Tensor], groups: Sequence[int], sizes: Sequence[int]
) -> list[tuple[Tensor, ...]]:
    """Each group's rows of every tensor in ``rows`` (stacked in ``groups``' order)."""
    starts = list(accumulate((sizes[g] for g in groups), initial=0))
    return [tuple(r[start:end] for r in rows) for start, end in pairwise(starts)]


def _hessian_products(
    weighted: Callable[..., Tensor], primals: Sequence[Tensor], tangents: Sequence[Tensor]
) -> list[Tensor] | None:
    """``weighted``'s Hessian at ``primals`` times each row of ``tangents`` (per primal, its
    rows): autograd's double backward, batched over the rows, as the seed's loop and the
    reverse route differentiate (``torch.func``'s ``jvp(grad)`` took 1.2-4x longer here).
    None where autograd finds no second derivative (an op linear in every input, as ``where``
    and ``clamp`` are: a NaN tangent they discard adds nothing)."""
    with torch.enable_grad():
        inputs = [p.detach().requires_grad_() for p in primals]
        value = weighted(*inputs)
        if not value.requires_grad:  # autograd does not differentiate the op (torch.round)
            return None
        gradients = torch.autograd.grad(value, inputs, create_graph=True, allow_unused=True)
        curved = [(g, t) for g, t in zip(gradients, tangents, strict=True)
                  if g is not None and g.requires_grad]  # fmt: skip
        if not curved:  # linear in every input: no second derivative
            return None
        products = batched_grad([g for g, _ in curved], inputs, [t for _, t in curved],
                                allow_unused=True)  # fmt: skip
    return [torch.zeros_like(t) if u is None else u.detach()
            for u, t in zip(products, tangents, strict=True)]  # fmt: skip


def _check_first_order(
    mode: Tangents,
    loss: Tensor,
    gradients: Sequence[Tensor | None],
    leaves: Sequence[Tensor],
    flats: Sequence[Tensor],
) -> None:
    """Raise :class:`NotForward` where the loss's tangents (its first derivatives along the
    selected entries, pushed forward) differ from autograd's gradient there: a use of a selected
    tensor the mode did not see."""
    expected = torch.cat([
        (torch.zeros_like(leaf) if g is None else g).reshape(-1)[flat.to(leaf.device)]
        for g, leaf, flat in zip(gradients, leaves, flats, strict=True)
    ]).detach()  # fmt: skip
    got = torch.zeros_like(expected)
    for stream in mode.of(loss):
        rows = 0
        for group in stream.groups:
            size = mode.sizes[group]
            got[mode.span(group)] += stream.tangents[rows : rows + size].reshape(size)
            rows += size
    if not len(expected):
        return
    tolerance = _TOLERANCE.get(expected.dtype, 0.1)
    scale = max(expected.abs().max().item(), got.abs().max().item())
    floor = 1e3 * torch.finfo(expected.dtype).eps * max(1.0, abs(loss.item()))  # at a minimum
    if not (got - expected).abs().max().item() <= max(tolerance * scale, floor):  # NaN too
        why = (
            "are not finite where autograd's gradient is (an op's infinite derivative, 0 * inf, "
            "at an entry that autograd's backward masks out)"
            if bool(torch.isfinite(expected).all()) and not bool(torch.isfinite(got).all())
            else "differ from autograd's gradient: a use of a selected tensor pyhvp's mode does "
            "not see"
        )
        raise NotForward(f"the loss's first derivatives along the selected entries, pushed "
                         f"forward, {why}")  # fmt: skip
