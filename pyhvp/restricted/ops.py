"""How the sparse route treats each torch function a selected tensor enters: the op tables, the
argument binding of the ops it injects into, and the names refusals print.

Kinds (:func:`kind`):

* ``"einsum"``, ``"conv"``, ``"conv_transpose"``, ``"embedding"``: contractions with a sparse rule
  (:mod:`pyhvp.restricted.contributions`) for the operands listed in :data:`CONTRACTED`;
* ``"view"``: a rearrangement or slice of a selected tensor (``W.T``, ``W.view(...)``, ``W[2:]``,
  ``W.chunk(3)``): its result is followed as a selected tensor of its own;
* ``"constant"``: ``detach`` and ``W.data``, and what reads a selected tensor's metadata alone (``W.shape``,
  ``W.size()``, ``W.dtype``, ``torch.zeros_like(W)``, ``W.new_ones(...)``): the result has no
  derivative, as in autograd;
* ``"cheap"``: elementwise arithmetic, reductions and normalisations, whose derivative in an
  operand costs no more than the op's own size: a selected operand enters densely
  (``W + scatter(z)``) at any size;
* ``"identity"``: ``W.requires_grad_()``, which returns ``W`` and, on a tensor that requires
  grad (a selected one does, in the seed's loop), changes nothing;
* anything else: densely for a tensor of at most ``DENSE_LIMIT`` entries, else refused.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from pyhvp.restricted import contributions as rules

Tensor = torch.Tensor

_EINSUM_FAMILY: dict[Callable[..., Any], str] = {
    F.linear: "linear",
    torch.matmul: "matmul",
    Tensor.matmul: "matmul",
    Tensor.__matmul__: "matmul",
    Tensor.__rmatmul__: "rmatmul",
    torch.mm: "matmul",
    Tensor.mm: "matmul",
    torch.bmm: "matmul",
    Tensor.bmm: "matmul",
    torch.einsum: "einsum",
    torch.addmm: "addmm",
    Tensor.addmm: "addmm",
}

_CONVS: dict[Callable[..., Any], str] = {
    F.conv1d: "conv",
    F.conv2d: "conv",
    F.conv3d: "conv",
    F.conv_transpose1d: "conv_transpose",
    F.conv_transpose2d: "conv_transpose",
    F.conv_transpose3d: "conv_transpose",
    F.embedding: "embedding",
}

_VIEW_NAMES = [
    "T",
    "mT",
    "H",
    "mH",
    "t",
    "transpose",
    "swapaxes",
    "swapdims",
    "permute",
    "movedim",
    "moveaxis",
    "view",
    "view_as",
    "reshape",
    "reshape_as",
    "flatten",
    "unflatten",
    "squeeze",
    "unsqueeze",
    "ravel",
    "contiguous",
    "clone",
    "narrow",
    "select",
    "__getitem__",
    "split",
    "chunk",
    "unbind",
    "to",
    "float",
    "double",
    "half",
    "bfloat16",
]

_CHEAP_NAMES = [
    "add",
    "sub",
    "subtract",
    "mul",
    "multiply",
    "div",
    "divide",
    "true_divide",
    "neg",
    "negative",
    "pow",
    "square",
    "sqrt",
    "rsqrt",
    "exp",
    "log",
    "log1p",
    "tanh",
    "sigmoid",
    "sin",
    "cos",
    "abs",
    "relu",
    "sum",
    "mean",
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__mul__",
    "__rmul__",
    "__truediv__",
    "__rtruediv__",
    "__neg__",
    "__pow__",
    "__rpow__",
]

_METADATA_NAMES = [
    "size",
    "dim",
    "ndimension",
    "numel",
    "nelement",
    "stride",
    "storage_offset",
    "is_contiguous",
    "element_size",
    "is_floating_point",
    "is_complex",
    "get_device",
    "__len__",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "rand_like",
    "randn_like",
    "randint_like",
    "new_zeros",
    "new_ones",
    "new_empty",
    "new_full",
]
"""Functions of a tensor's metadata alone (never of its values): kind ``"constant"``."""

_METADATA_PROPERTIES = ("shape", "dtype", "device", "ndim", "layout", "is_cuda", "requires_grad")

_NORMS = ("layer_norm", "group_norm", "batch_norm", "instance_norm", "rms_norm")

DATA = Tensor.data.__get__  # type: ignore[attr-defined]
"""``x.data``: autograd takes it as a constant alias of ``x`` (a write through it changes the value
and not the derivative); ``torch.func`` differentiates through it."""

HOOKS = frozenset({Tensor.register_hook, Tensor.register_post_accumulate_grad_hook})
"""Gradient hooks: they change autograd's derivative, not the op's. The reverse route runs
autograd's own passes, which apply them (as the seed's loop does); the sparse and forward routes
refuse a loss that registers one."""

PROPERTIES = ("T", "mT", "H", "mH")
_TRACED_PROPERTIES = ("numpy_T", "mT", "matrix_H", "mH")
"""The aten ops dynamo hands a ``TorchFunctionMode`` for ``W.T``, ``W.mT``, ``W.H`` and ``W.mH``
(torch 2.14, and 2.13 with :mod:`~pyhvp.restricted.dynamo_views`' handlers)."""


def functions(owners: Sequence[object], names: Sequence[str]) -> frozenset[Callable[..., Any]]:
    """The callables ``owner.name`` that exist, of every owner and name."""
    return frozenset(
        value for owner in owners for name in names if callable(value := getattr(owner, name, None))
    )


def _table() -> dict[Callable[..., Any], str]:
    kinds: dict[Callable[..., Any], str] = {}
    for name in _VIEW_NAMES:
        if name in PROPERTIES:
            kinds[getattr(Tensor, name).__get__] = "view"
    kinds.update(dict.fromkeys(functions((Tensor, torch), _VIEW_NAMES), "view"))
    kinds.update(dict.fromkeys(functions((Tensor, torch), _CHEAP_NAMES), "cheap"))
    kinds.update(dict.fromkeys(functions((F,), _NORMS), "cheap"))
    for name in _TRACED_PROPERTIES:
        kinds[getattr(torch.ops.aten, name)] = "view"
    kinds.update(
        dict.fromkeys(functions((Tensor, torch), ("detach", *_METADATA_NAMES)), "constant")
    )
    for name in (*_METADATA_PROPERTIES, "data"):  # W.data: a detached alias, as autograd has it
        kinds[getattr(Tensor, name).__get__] = "constant"
    kinds.update(_EINSUM_FAMILY)
    kinds.update(_CONVS)
    return kinds


_KINDS = _table()


def _kind(func: Callable[..., Any]) -> str:
    """``func``'s kind (see the module docstring), ``"write"`` for one that writes to its first
    argument, or ``"other"``."""
    found = _KINDS.get(func)
    if found is not None:
        return found
    return "write" if named_in_place(func) else "other"


def call_kind(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    """:func:`kind` of this call of ``func``: a view as a dtype (``W.view(torch.float64)``), and
    a cast to a dtype neither floating nor complex (``W.to(torch.int32)``), which autograd does
    not differentiate, are ``"constant"``; ``requires_grad_(True)`` is ``"identity"``."""
    if func is Tensor.requires_grad_:
        return "identity" if argument(args, kwargs, "requires_grad", 1, True) else "write"
    found = kind(func)
    if found != "view" or func.__name__ not in ("view", "to"):
        return found
    given = (*args[1:], *kwargs.values())
    if func.__name__ == "view":
        return "constant" if any(isinstance(a, torch.dtype) for a in given) else found
    # W.to(dtype), W.to(device, dtype), W.to(other): the dtype it casts to
    dtypes = [a.dtype if isinstance(a, torch.Tensor) else a for a in given
              if isinstance(a, (torch.dtype, torch.Tensor))]  # fmt: skip
    differentiable = all(d.is_floating_point or d.is_complex for d in dtypes)
    return found if differentiable else "constant"


_MAY_RETURN_INPUT_NAMES = (
    "flatten", "cpu", "cuda", "to", "type", "type_as", "contiguous", "conj", "resolve_conj",
    "resolve_neg", "positive", "__pos__", "atleast_1d", "atleast_2d", "atleast_3d", "sum_to_size",
    "double", "float", "half", "bfloat16", "cfloat", "cdouble", "coalesce", "to_dense", "real",
    "conj_physical", "dequantize", "dropout", "alpha_dropout", "feature_alpha_dropout",
    "dropout1d", "dropout2d", "dropout3d", "feature_dropout", "as_tensor", "asarray",
    "cartesian_prod",
)  # fmt: skip


MAY_RETURN_INPUT = functions((Tensor, torch, F), _MAY_RETURN_INPUT_NAMES) | {
    Tensor.real.__get__  # type: ignore[attr-defined]
}
"""Torch functions that eager torch makes return their first argument itself for some
arguments (``W.flatten(1, 1)``, ``W.cpu()`` of a CPU tensor, ``+W``, a dropout in eval,
``torch.as_tensor(W)``): the only ones :func:`returns_its_input` runs again (a batch norm would
write twice), on a forked random state (a dropout in training would draw twice)."""

_MASKS_BY_LAYOUT: dict[Callable[..., Any], tuple[str, bool]] = {
    F.dropout: ("training", True),
    F.alpha_dropout: ("training", False),
    torch.dropout: ("train", False),
    torch.dropout_: ("train", False),
    torch.alpha_dropout: ("train", False),
    torch.alpha_dropout_: ("train", False),
}
"""Dropouts whose mask is drawn entry by entry in the input's memory order (``empty_like``):
their training argument's name and default (``torch.dropout`` requires it)."""


def draws_mask_by_layout(func: Callable[..., Any], args: Sequence[Any],
                         kwargs: dict[str, Any]) -> bool:  # fmt: skip
    """Whether ``func`` is a dropout in training that draws a mask for a non-contiguous input:
    under ``torch.func`` torch draws it in the logical order instead of the memory order, so
    the same random state gives another mask (a transposed activation's)."""
    known = _MASKS_BY_LAYOUT.get(func)
    if known is None:
        return False
    input = first_input(args, kwargs)
    p = argument(args, kwargs, "p", 1, 0.5)
    training = argument(args, kwargs, known[0], 2, known[1])
    return (isinstance(input, torch.Tensor) and bool(training) and isinstance(p, (int, float))
            and 0 < p < 1 and input.numel() > 1 and not input.is_contiguous())  # fmt: skip


RETURNS_INPUTS_IN_A_TUPLE = frozenset({torch.broadcast_tensors})
"""Torch functions that eager torch makes return some of their arguments themselves among
others (``torch.broadcast_tensors(W, c)`` of equal shapes)."""


FIRST_ARGUMENT_NAMES = ("input", "data", "obj", "self")
"""What torch functions name their first argument (``torch.as_tensor(data=W)``,
``torch.asarray(obj=W)``, ``torch.flatten(input=W)``)."""


def first_input(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """A call's first argument, given by position or by keyword in any order
    (``torch.flatten(start_dim=1, input=W)``)."""
    if args:
        return args[0]
    return next((kwargs[name] for name in FIRST_ARGUMENT_NAMES if name in kwargs), None)


_STRIDED = functions((Tensor, torch), ("as_strided", "as_strided_copy"))


def reads_memory_layout(
    func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> bool:
    """Whether ``func`` reads its first argument's memory -- its strides and storage offset --
    rather than its entries in order: ``as_strided`` of a tensor that is not contiguous from the
    start of its storage (``W.T``, ``W[1:]``). The sparse route's stand-ins for a selected
    tensor (``W`` shifted by ``z``, an index tensor) are, so they would read other entries."""
    tensor = first_input(args, kwargs)
    return (
        func in _STRIDED
        and isinstance(tensor, Tensor)
        and not (tensor.is_contiguous() and tensor.storage_offset() == 0)
    )


def returns_its_input(
    func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> bool:
    """Whether eager torch returns its first argument (:func:`first_input`) itself from this
    call (``W.flatten(1, 1)``, ``W.cpu()`` of a CPU tensor, ``W.to(W.dtype)``, ``+W``,
    ``W.type_as(W)``), which autograd then differentiates even under ``no_grad``. Asked of an
    empty tensor with its metadata in its place: of a ``torch.func`` transform's wrapper torch
    returns a new alias."""
    tensor = first_input(args, kwargs)
    if (
        func not in MAY_RETURN_INPUT
        or not isinstance(tensor, Tensor)
        or torch.compiler.is_compiling()
    ):
        return False
    proxy = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                device=tensor.device)  # fmt: skip
    swapped_args, swapped_kwargs = pytree.tree_map(
        lambda v: proxy if v is tensor else v, (tuple(args), kwargs)
    )
    devices = [tensor.device] if tensor.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            return func(*swapped_args, **swapped_kwargs) is proxy
    except Exception:  # (the call itself then raises as the loss makes it)
        return False


_RUNNING_STATISTICS = {
    F.batch_norm: ("training", 5, False, 1),
    F.instance_norm: ("use_input_stats", 5, True, 1),
    torch.batch_norm: ("training", 5, False, 3),
    torch.instance_norm: ("use_input_stats", 5, True, 3),
}
"""The norms that update the running statistics they are given (arguments 1 and 2) in place,
and the flag (name, position, default) under which they do."""


def hidden_writes(
    func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    """The tensors a call writes inside the op, not as its output nor in place on its first
    argument: a batch norm's running statistics in training."""
    found = _RUNNING_STATISTICS.get(func)
    if found is None:
        return []
    flag, position, default, first = found
    if not argument(args, kwargs, flag, position, default):
        return []
    statistics = [argument(args, kwargs, name, i, None)
                  for i, name in enumerate(("running_mean", "running_var"), start=first)]  # fmt: skip
    return [t for t in statistics if isinstance(t, torch.Tensor)]


def writes_to(
    op: str, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    """What a call of ``func`` (of kind ``op``) writes to: its first argument for an in-place
    method (``add_``) or a functional called with ``inplace=True`` (``F.relu(W, inplace=True)``),
    and ``out=``; None where it writes nothing."""
    if op == "write" or _inplace(func, args, kwargs):
        return args[0] if args else kwargs.get("input")
    return kwargs.get("out")


def _inplace(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether ``func`` has an ``inplace`` parameter (``torch.nn.functional``'s activations and
    dropouts) and this call sets it, for a dropout in training (outside it, it writes nothing)."""
    inplace_at, training_at, training_default = inplace_parameters(func)
    if inplace_at == _ABSENT or not argument(args, kwargs, "inplace", inplace_at, False):
        return False
    return training_at == _ABSENT or bool(
        argument(args, kwargs, "training", training_at, bool(training_default))
    )


def argument(
    args: Sequence[Any], kwargs: dict[str, Any], name: str, position: int, default: object
) -> object:
    if name in kwargs:
        return kwargs[name]
    return args[position] if 0 <= position < len(args) else default


_ABSENT, _KEYWORD_ONLY = -1, -2
_INPLACE_PARAMETERS: dict[Callable[..., Any], tuple[int, int, int]] = {}


def _inplace_parameters(func: Callable[..., Any]) -> tuple[int, int, int]:
    """The position of ``func``'s ``inplace`` parameter, of a dropout's ``training`` one, and
    that one's default (0 or 1): :data:`_ABSENT` for one it lacks, :data:`_KEYWORD_ONLY` for one
    passed by keyword alone. Read once per hashable ``func``."""
    try:
        known = _INPLACE_PARAMETERS.get(func)
    except TypeError:  # unhashable: read every time
        known = None
    if known is not None:
        return known
    found = (_ABSENT, _ABSENT, 0)
    with contextlib.suppress(TypeError, ValueError):  # a builtin without a signature
        parameters = list(inspect.signature(func).parameters.values())
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)

        def position(name: str) -> int:
            for i, p in enumerate(parameters):
                if p.name == name:
                    return i if p.kind in positional else _KEYWORD_ONLY
            return _ABSENT

        names = {p.name: p for p in parameters}
        if "inplace" in names:
            dropout = "dropout" in getattr(func, "__name__", "") and "training" in names
            training = position("training") if dropout else _ABSENT
            default = int(bool(names["training"].default)) if dropout else 0
            found = (position("inplace"), training, default)
    with contextlib.suppress(TypeError):
        _INPLACE_PARAMETERS[func] = found
    return found


def named_in_place(func: Callable[..., Any]) -> bool:
    """Whether ``func``'s name says it writes to its first argument (``add_``, ``__iadd__``,
    ``__setitem__``, ``copy_``); a write into ``out=`` is the other kind a caller checks."""
    name = getattr(func, "__name__", "")
    dunder = name.startswith("__") and name.endswith("__")
    in_place = (name.endswith("_") and not dunder) or name == "__setitem__"
    return in_place or (dunder and name.startswith("__i") and name != "__index__")


# torch.compiler.assume_constant_result carries no annotations (torch 2.13)
kind: Callable[[Callable[..., Any]], str] = torch.compiler.assume_constant_result(_kind)  # type: ignore[no-untyped-call]
""":func:`_kind`, which dynamo calls at trace time (a constant of ``func``) instead of tracing
its table lookups and string tests."""

inplace_parameters: Callable[[Callable[..., Any]], tuple[int, int, int]] = (
    torch.compiler.assume_constant_result(_inplace_parameters)  # type: ignore[no-untyped-call]
)
""":func:`_inplace_parameters`, a constant of ``func`` for dynamo as :func:`kind`."""


# --- arguments of the ops with a sparse rule -----------------------------------------------

_PARAMETERS: dict[str, tuple[str, ...]] = {
    "linear": ("input", "weight", "bias"),
    "matmul": ("input", "other"),
    "rmatmul": ("other", "input"),  # x.__rmatmul__(y) is y @ x
    "addmm": ("input", "mat1", "mat2"),
    "conv": ("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
    "conv_transpose": (
        "input",
        "weight",
        "bias",
        "stride",
        "padding",
        "output_padding",
        "groups",
        "dilation",
    ),
    "embedding": (
        "input",
        "weight",
        "padding_idx",
        "max_norm",
        "norm_type",
        "scale_grad_by_freq",
        "sparse",
    ),
}

CONTRACTED: dict[str, tuple[str, ...]] = {
    "linear": ("input", "weight"),
    "matmul": ("input", "other"),
    "rmatmul": ("input", "other"),
    "addmm": ("mat1", "mat2"),
    "conv": ("weight",),
    "conv_transpose": ("weight",),
    "embedding": ("weight",),
}
"""The arguments of each kind that a sparse rule takes as the selected operand (einsum: all)."""

BIASES: dict[str, tuple[str, ...]] = {
    "linear": ("bias",),
    "addmm": ("input",),
    "conv": ("bias",),
    "conv_transpose": ("bias",),
}
"""Arguments added to the output: a selected one enters densely at any size."""


EINSUM_FAMILY = ("einsum", "linear", "matmul", "rmatmul", "addmm")


def einsum_form(
    op: str, bound: dict[str, Any]
) -> tuple[list[str], str, list[Any], list[str | int]]:
    """A call of the einsum family as einsum: the operands' and the output's subscripts, the
    operands, and each one's key in ``bound`` (its name, or its position among einsum's)."""
    if op == "einsum":
        operands = list(bound["operands"])
        inputs, output = rules.parse_einsum(bound["equation"], [t.ndim for t in operands])
        return inputs, output, operands, list(range(len(operands)))
    first, second = CONTRACTED[op]
    a, b = bound[first], bound[second]
    subscripts = rules.linear_subscripts if op == "linear" else rules.matmul_subscripts
    inputs, output = subscripts(a.ndim, b.ndim)
    return inputs, output, [a, b], [first, second]


def contracted(op: str, bound: dict[str, Any]) -> list[tuple[str | int, Any]]:
    """The operands a sparse rule of kind ``op`` may take, by key (name, or einsum position)."""
    if op == "einsum":
        return list(enumerate(bound["operands"]))
    return [(name, bound.get(name)) for name in CONTRACTED[op]]


def autograd_convention(op: str, bound: dict[str, Any]) -> bool:
    """Whether autograd's derivative of this call is a convention rather than the op's own
    (an embedding that scales gradients by frequency): then a selected operand enters densely,
    as autograd differentiates it. (``sparse=True`` changes the gradient's layout, not its
    values: the sparse rule takes it.)"""
    return op == "embedding" and bool(bound.get("scale_grad_by_freq"))


def writes_operand(op: str, bound: dict[str, Any]) -> bool:
    """Whether this call writes to its contracted operand (an embedding's ``max_norm``
    renormalises the rows it reads in place)."""
    return op == "embedding" and bound.get("max_norm") is not None


def bind(op: str, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The arguments of a call of kind ``op`` by name (einsum: ``equation`` and ``operands``), or
    None for a call this binder does not read (unknown keywords)."""
    if op == "einsum":
        if kwargs or not args or not isinstance(args[0], str):
            return None  # the sublist form, or keywords
        operands = args[1:]
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = operands[0]
        return {"equation": args[0], "operands": list(operands)}
    names = _PARAMETERS[op]
    if len(args) > len(names) or not set(kwargs) <= set(names) | {"beta", "alpha"}:
        return None
    bound = dict(zip(names, args, strict=False))
    if set(bound) & set(kwargs):
        return None
    return bound | kwargs


# --- names as the user wrote them ----------------------------------------------------------

_OPERATORS = {
    "__matmul__": "@",
    "__rmatmul__": "@",
    "__add__": "+",
    "__radd__": "+",
    "__sub__": "-",
    "__rsub__": "-",
    "__mul__": "*",
    "__rmul__": "*",
    "__truediv__": "/",
    "__rtruediv__": "/",
    "__pow__": "**",
    "__rpow__": "**",
    "__getitem__": "indexing W[...]",
    "__setitem__": "an assignment W[...] = ...",
}


@functools.cache
def _names() -> dict[Callable[..., Any], str]:
    names: dict[Callable[..., Any], str] = {}
    namespaces = (
        (torch.nn.functional, "torch.nn.functional."),
        (torch.linalg, "torch.linalg."),
        (torch.special, "torch.special."),
        (torch.fft, "torch.fft."),
        (torch, "torch."),
    )
    for namespace, prefix in namespaces:
        for name in dir(namespace):
            value = getattr(namespace, name, None)
            if callable(value) and not isinstance(value, type) and not name.startswith("_"):
                with contextlib.suppress(TypeError):  # unhashable
                    names.setdefault(value, prefix + name)
    for name in dir(Tensor):
        value = getattr(Tensor, name, None)
        if value is not None and type(value).__name__ == "getset_descriptor":
            names[value.__get__] = f"W.{name}"
        elif callable(value):
            label = f"{_OPERATORS[name]} ({name})" if name in _OPERATORS else f"Tensor.{name}"
            with contextlib.suppress(TypeError):
                names.setdefault(value, label)
    return names


def describe(func: Callable[..., Any]) -> str:
    """``func`` as the user wrote it: ``torch.einsum``, ``torch.nn.functional.conv2d``,
    ``Tensor.mm``, ``W.T``, ``@ (__matmul__)`` -- never ``getset_descriptor.__get__``."""
    found: str | None = None
    with contextlib.suppress(TypeError):  # an unhashable callable
        found = _names().get(func)
    if found is not None:
        return found
    owner = getattr(func, "__self__", None)
    if type(owner).__name__ == "getset_descriptor":  # a property's getter
        return f"W.{getattr(owner, '__name__', '?')}"
    module = getattr(func, "__module__", None) or ""
    name = str(getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func)))
    return f"{module}.{name}" if module and not module.startswith("torch._C") else name
