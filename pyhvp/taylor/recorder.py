"""The recorder: runs ``f`` once under a light ``TorchDispatchMode`` and notes each aten op, its
non-tensor arguments, the shapes of its outputs, and where each tensor argument comes from: ``x``,
an earlier op, or a *constant* (any other tensor: args, captured parameters, tensors made from
Python data -- and ``x`` itself when it reaches ``f`` through ``args`` or a closure).
A Python float that is an operand of ``+ - * /`` or the scalar of ``torch.where`` is *lifted*
into such a constant (a 0-d tensor, :data:`LIFTED_SCALARS`): the record holds its type, not its
value, so a time step that changes at every call reuses one program. Every other non-tensor
argument (ints, a power's exponent, clamp bounds, ``alpha``) is recorded by value. A random
op's draw is ``f``'s and a constant too (dropout: the product with the mask ``f`` drew), so the
kernel never draws again (:data:`DRAWN_WITHOUT_DERIVATIVES`).

``f`` runs with grad mode on, so that its own ``torch.no_grad()`` shows: what it computes without
grad is a constant, as for autograd (see :class:`Recorder`). Writes to ``x`` or to a constant,
directly or through a view, are refused (:class:`InPlaceInputError`); so is autograd's backward
pass inside ``f`` (``torch.func.grad`` is fine). The record is the program cache's key
(:mod:`.program`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, cast

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from pyhvp._attention import math_attention
from pyhvp._checks import plain_tensor
from pyhvp._keys import Identity, value_key
from pyhvp._replacing import Replacement
from pyhvp.taylor.custom_ops import DET_BY_SVD, det_needs_svd
from pyhvp.taylor.fallbacks import UnsupportedOpError
from pyhvp.taylor.jets import ENGINE, dense_only

aten = torch.ops.aten
Tensor = torch.Tensor

X = ("x",)
STOP = "stop"
"""Marks an argument read as a constant: ``(STOP, label)`` becomes ``stop_gradient(node)``."""
KEEP = "keep"
"""Notes an op that writes in place under ``no_grad``: the tensors it writes keep their
derivatives (autograd does not see the write), with the new values."""

DET, DETACH = aten._linalg_det.default, aten.detach.default
ITEM = aten._local_scalar_dense.default  # .item(), float(t), int(t), bool(t)
BY_CONDITIONING = {DET: DET_BY_SVD}
"""Ops recorded as another when an instance is (nearly) singular: the record says so, so the
program (a different op, with a rule that holds there) is keyed by it."""
_current_autograd_node = torch._C._current_autograd_node

SCALAR_TENSOR = aten.scalar_tensor.default
LIFTED_SCALARS = {
    aten.mul.Tensor: aten.mul.Tensor,
    aten.mul.Scalar: aten.mul.Tensor,
    aten.div.Tensor: aten.div.Tensor,
    aten.div.Scalar: aten.div.Tensor,
    aten.add.Tensor: aten.add.Tensor,
    aten.add.Scalar: aten.add.Tensor,
    aten.sub.Tensor: aten.sub.Tensor,
    aten.sub.Scalar: aten.sub.Tensor,
    aten.rsub.Tensor: aten.rsub.Tensor,
    aten.rsub.Scalar: aten.rsub.Tensor,
}
"""Ops whose Python float operand (``t * x``, ``x / t``, ``x - t``; ``alpha`` is not an operand)
is *lifted*: recorded as a 0-d constant tensor, an input of the program like any other constant,
so the record is keyed by the float's type alone and one program (and kernel, and compiled
kernel) serves every value of a time step or an annealed coefficient. Each is recorded as its
Tensor overload (the value). Only these: their rules use the operand as an opaque factor or
summand, while other rules and decompositions branch on a scalar's value (a power's exponent,
clamp bounds, ``alpha``, norms' ``ord``), which therefore stays in the key."""
LIFTED_DTYPES = (torch.float32, torch.float64)
"""Result dtypes a float is lifted for: a 0-d tensor of the result dtype computes exactly what
the Python float does (float16 and bfloat16 ops compute with a Python float in float32)."""

DRAWN_WITHOUT_DERIVATIVES = frozenset({
    "bernoulli", "bernoulli_", "cauchy", "cauchy_", "exponential", "exponential_", "geometric",
    "geometric_", "log_normal", "log_normal_", "multinomial", "normal", "normal_", "poisson",
    "rand", "rand_like", "randint", "randint_like", "randn", "randn_like", "randperm", "uniform",
    "uniform_",
})  # fmt: skip
"""Random ops (by name) whose draws do not vary smoothly with their tensor inputs (which give
only shapes, dtypes or probabilities; ``normal``'s mean and std too, as autograd has it: zero
derivatives, not a reparametrisation): their outputs are recorded as constants, the values ``f``
drew, so the kernel uses those very draws -- it must not draw again (another sample, a
generator advanced twice)."""
DROPOUTS = {aten.native_dropout.default, aten._fused_dropout.default}
"""Random ops that scale their input by a drawn mask: recorded as the product with the mask
``f`` drew (a constant), so derivatives flow through the input and the draw is ``f``'s."""
RRELU = aten.rrelu_with_noise.default
"""RReLU: in training ``x * slopes`` with the slopes ``f`` drew (which the op writes into its
``noise`` argument); in evaluation ``leaky_relu`` with the mean slope, as ATen computes it."""


BACKWARD = {
    torch.autograd.grad: "torch.autograd.grad",
    torch.autograd.backward: "torch.autograd.backward",
    Tensor.backward: "Tensor.backward",
}


def _lifted_dtype(other: object) -> torch.dtype | None:
    """The dtype of a lifted float operand beside the tensor ``other``: the op's result dtype,
    as type promotion with a Python float gives it (``other``'s floating dtype, else the default
    dtype); None where no float is lifted (complex, or a result dtype outside
    :data:`LIFTED_DTYPES`). A 0-d tensor of this dtype promotes with ``other`` as the float does:
    to ``other``'s dtype when it is floating, to this dtype when it is integral or boolean."""
    if not isinstance(other, Tensor) or other.is_complex():
        return None
    dtype = other.dtype if other.is_floating_point() else torch.get_default_dtype()
    return dtype if dtype in LIFTED_DTYPES else None


def storage_id(t: Tensor) -> int:
    """Where ``t``'s elements live (0: nowhere to write, or a tensor without plain storage)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def _overlaps(a: Tensor, b: Tensor) -> bool:
    """Whether two views of one storage share an element (an ``x`` and a state kept beside it
    in one buffer do not); views of different element sizes are taken to."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.element_size() != b.element_size():
        return True
    spans = [(t.storage_offset(),
              t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)))
             for t in (a, b)]  # fmt: skip
    if max(low for low, _ in spans) > min(high for _, high in spans):
        return False
    start = int(min(low for low, _ in spans))
    elements = torch.arange(start, int(max(high for _, high in spans)) + 1)  # (their span only)
    where = [torch.as_strided(elements, t.shape, t.stride(), t.storage_offset() - start).flatten()
             for t in (a, b)]  # fmt: skip
    return bool(torch.isin(where[0], where[1]).any())


class InPlaceInputError(ValueError):
    """``f`` wrote in place to ``x`` (or to a tensor it reads, where that changes what is
    differentiated), which every operator refuses: write to a copy, ``x.clone()``. A
    ``ValueError``."""


def _grad_disabled_by_f() -> bool:
    """Whether the op being dispatched runs under ``torch.no_grad()`` / ``inference_mode()``
    that ``f`` entered (recording runs with grad enabled). An ``autograd.Function``'s forward also
    runs without grad but, unlike ``no_grad``, without forward-mode AD too: its ops are
    differentiated like any others."""
    if torch.is_grad_enabled():
        return False
    return torch._C._is_fwd_grad_enabled() or torch.is_inference_mode_enabled()


@functools.cache
def _traits(func: torch._ops.OpOverload) -> tuple[bool, bool]:
    """``(draws randomly, writes an argument)``: read off the op's tags and schema once per op
    (each costs a C++ call and a list scan on every recorded op otherwise)."""
    return torch.Tag.nondeterministic_seeded in func.tags, func._schema.is_mutable


UNDECLARED_WRITES = frozenset({
    aten.native_batch_norm.default, aten.cudnn_batch_norm.default, aten.miopen_batch_norm.default,
})  # fmt: skip
"""Ops that write arguments their schema does not mark as written: in training, the running
statistics (``F.batch_norm(x, mean, var, training=True)`` on the CPU and with cuDNN)."""


def _writes_running_statistics(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    """Whether this call of an :data:`UNDECLARED_WRITES` op writes its running statistics."""
    if func not in UNDECLARED_WRITES:
        return False
    training = args[5] if len(args) > 5 else kwargs.get("training", False)
    statistics = [*args[3:5], kwargs.get("running_mean"), kwargs.get("running_var")]
    return bool(training) and any(t is not None for t in statistics)


@functools.cache
def argument_kinds(func: torch._ops.OpOverload) -> tuple[tuple[str, ...], dict[str, str]]:
    """Per schema argument: ``"write"`` (mutated), ``"alias"`` (a view's base) or ``"read"``."""

    def kind(argument: torch._C.Argument) -> str:
        info = argument.alias_info
        return "read" if info is None else ("write" if info.is_write else "alias")

    kinds = tuple(kind(a) for a in func._schema.arguments)
    return kinds, {a.name: k for a, k in zip(func._schema.arguments, kinds, strict=True)}


class Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's __init_subclass__ is unannotated
    """Records the aten ops ``f`` runs: the cache key and, on a miss, the program.

    Tensors are told apart by ``id``; an op's output is held weakly and its label dropped when it
    dies (its id may then be reused), so intermediates are freed as ``f`` runs.

    What ``f`` computes without grad follows autograd. An op run under ``torch.no_grad()`` reads
    every tensor through ``stop_gradient`` (its results are constants); a tensor it writes in
    place keeps the derivatives it had, with the new value (``KEEP`` notes such ops; PyTorch's
    own cosine_similarity clamps a norm so). Views made without grad, by ``detach`` or of such
    views are *stopped*: every later op that neither views nor writes them reads them through
    ``stop_gradient`` -- the view itself stays a view, so writes through it or its base remain
    visible in the replay.
    """

    def __init__(self, x: Tensor, watch_backward: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # unannotated in torch
        self.watch_backward = watch_backward
        self.saw_backward = False
        # id -> (label, weak reference to the tensor, or None for x and the constants, which
        # stay alive): an id whose tensor died may be reused by an unrelated tensor
        self.labels: dict[int, tuple[Hashable, weakref.ref[Tensor] | None]] = {id(x): (X, None)}
        self.constants: list[Tensor] = []
        self.inputs = {storage_id(x)} - {0}  # storages of x and of the constants
        self.x_storage = storage_id(x)
        self.x = x
        self.stopped: set[Hashable] = set()  # labels of views made without grad
        self.written_constants: set[int] = set()  # copied before their first write
        # (op, its args' and kwargs' descriptions, its outputs' description, note)
        self.events: list[
            tuple[torch._ops.OpOverload, Hashable, Hashable, Hashable, str | bool | None]
        ] = []
        self._stops_outputs = False
        self.drew = False  # f drew random values: constants of this record alone
        self.wrote = False  # f ran an op that writes to one of its arguments

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self.watch_backward and _current_autograd_node() is not None:
            self.saw_backward = True  # (in case f swallows the exception)
            raise BackwardInside
        draws, mutable = _traits(func)
        self.wrote |= mutable or _writes_running_statistics(func, args, kwargs)
        if draws:
            return self._drawn(func, types, args, kwargs, mutable)
        if func is SCALAR_TENSOR and type(args[0]) is float:  # where(c, y, 0.5): lifted
            out = func(*args, **kwargs)
            self._describe(out)
            return out
        recorded, recorded_args = self._lift_scalars(func, args)
        if mutable:
            self._refuse_input_writes(func, args, kwargs)
        items = tuple(sorted(kwargs.items())) if kwargs else ()
        no_grad = not torch.is_grad_enabled() and _grad_disabled_by_f()
        note: str | bool | None = KEEP if no_grad and mutable else None
        described: tuple[Hashable, Hashable]
        if no_grad or self.stopped:
            positional, named = argument_kinds(func)
            self._stops_outputs = func is DETACH
            described = (  # as self._describe((args, items)) would, with stops
                (False, tuple(self._describe(a, (k, no_grad))
                              for a, k in zip(recorded_args, positional, strict=False))),
                (False, tuple((False, (value_key(n), self._describe(v, (named[n], no_grad))))
                              for n, v in items)),
            )  # fmt: skip
            stops_outputs = self._stops_outputs
        else:
            described = (self._describe(recorded_args), self._describe(items))
            stops_outputs = func is DETACH
        out = func(*args, **kwargs)
        label = ("op", len(self.events))
        if func is DET:  # which rule holds depends on the values
            note = det_needs_svd(out[1])
        self.events.append((recorded, *described, self._outputs(out, label, stops_outputs), note))
        return out

    def _drawn(self, func: torch._ops.OpOverload, types: Sequence[type], args: tuple[Any, ...],
               kwargs: dict[str, Any], mutable: bool) -> Any:  # fmt: skip
        """A random op: its draw is ``f``'s and stays a constant of the program (see
        :data:`DRAWN_WITHOUT_DERIVATIVES`, :data:`DROPOUTS`, :data:`RRELU`).
        Any other whose value varies with a tensor ``f`` computed (``_standard_gamma``, as in
        ``Gamma(x).rsample()``) is refused: its kernel would draw another sample."""
        if mutable:
            self._refuse_input_writes(func, args, kwargs)
        out = func(*args, **kwargs)
        self.drew = True
        if func in DROPOUTS:
            source, p = args[0], float(args[1])
            train = (args[2] if len(args) > 2 else kwargs.get("train")) is not False
            mask = out[1]
            scale = (0.0 if p >= 1 else 1 / (1 - p)) if train else 1.0
            kept = (mask * scale).to(source.dtype)
            self._as_constant(kept)  # the mask f drew, scaled
            return (self.__torch_dispatch__(aten.mul.Tensor, types, (source, kept)), mask)
        if func is RRELU:
            return self._rrelu(types, args, kwargs)
        varying = [
            t
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, Tensor) and t.is_floating_point() and not self._is_constant(t)
        ]
        if varying and func._opname not in DRAWN_WITHOUT_DERIVATIVES:
            raise UnsupportedOpError(
                f"{func} draws a random value that varies with a tensor computed in f; "
                f"{ENGINE} would draw it again, not use f's draw. Draw the noise alone "
                "(torch.rand_like, torch.randn_like) and combine it with f's tensors"
            )
        for t in pytree.tree_leaves(out):
            if isinstance(t, Tensor):  # an in-place draw relabels its tensor
                self._as_constant(t)
        return out

    @staticmethod
    def _lift_scalars(
        func: torch._ops.OpOverload, args: tuple[Any, ...]
    ) -> tuple[torch._ops.OpOverload, tuple[Any, ...]]:
        """The op and arguments to record: a float operand of an op in :data:`LIFTED_SCALARS`
        as a fresh 0-d tensor (a constant of the program, whatever its value), the op as its
        Tensor overload. ``f`` itself runs on its own arguments."""
        recorded = LIFTED_SCALARS.get(func)
        if recorded is None or len(args) < 2:
            return func, args
        for i in (0, 1):
            if type(args[i]) is float:
                other = args[1 - i]
                dtype = _lifted_dtype(other)
                if dtype is None:
                    return func, args
                lifted = torch.scalar_tensor(args[i], dtype=dtype, device=other.device)
                return recorded, (lifted, *args[1:]) if i == 0 else (args[0], lifted, *args[2:])
        return func, args

    def _describe(self, value: object, kind: tuple[str, bool] | None = None) -> Hashable:
        """A tensor's label, a container's items, a scalar's value, or an object's identity.
        With ``kind = (role, no_grad)`` (its schema role in the op being recorded), a tensor the
        op reads as a constant is ``(STOP, label)``; a stopped one it views (or views and reads
        without grad), or writes, makes the op's outputs stopped."""
        if isinstance(value, Tensor):
            label = self._label(value)
            if label is None:
                # (refused as UnsupportedOpError, not as a TypeError: an operator such as *
                # takes that for "not mine", and says "unsupported operand type(s)")
                if value.layout != torch.strided:
                    raise dense_only(f"f uses a {value.layout} tensor", UnsupportedOpError)
                try:
                    constant = plain_tensor("a tensor f captures", value)
                except TypeError as error:
                    raise UnsupportedOpError(str(error)) from None
                label = ("constant", len(self.constants))
                self.labels[id(value)] = (label, None)
                self.constants.append(constant)
                self.inputs.add(storage_id(value))
                self.inputs.discard(0)
            if kind is None:
                return label
            role, no_grad = kind
            stopped = label in self.stopped
            if role == "read" and (no_grad or stopped):
                return (STOP, label)
            if stopped or (no_grad and role == "alias"):
                self._stops_outputs = True
            return label
        if isinstance(value, (list, tuple)):
            return (type(value) is list, tuple([self._describe(v, kind) for v in value]))
        return value_key(value) or ("object", Identity(value))

    def _outputs(self, out: object, label: tuple[Hashable, ...], stopped: bool) -> Hashable:
        """Labels output tensors (an in-place op's result replaces its input's label)."""
        if isinstance(out, Tensor):
            self.labels[id(out)] = (label, weakref.ref(out))
            if stopped:
                self.stopped.add(label)
            return ("tensor", tuple(out.shape), out.dtype)
        if isinstance(out, (list, tuple)):
            return (
                type(out) is list,
                tuple(self._outputs(o, (*label, i), stopped) for i, o in enumerate(out)),
            )
        return value_key(out) or ("object",)

    def _rrelu(self, types: Sequence[type], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Tensor:  # fmt: skip
        named = dict(zip(("self", "noise", "lower", "upper", "training"), args, strict=False))
        named = {"lower": 0.125, "upper": 1 / 3, "training": False, **named, **kwargs}
        if not named["training"]:
            slope = (named["lower"] + named["upper"]) / 2
            return cast(Tensor, self.__torch_dispatch__(aten.leaky_relu.default, types,
                                                        (named["self"], slope)))  # fmt: skip
        self._as_constant(named["noise"])  # the slopes f drew
        return cast(Tensor, self.__torch_dispatch__(aten.mul.Tensor, types,
                                                    (named["self"], named["noise"])))  # fmt: skip

    def _as_constant(self, t: Tensor) -> None:
        """``t`` from now on a constant of the program (its value now), whatever it was."""
        self.labels.pop(id(t), None)
        self._describe(t)

    def stop(self, t: Tensor) -> None:
        """``t`` was detached in place (``Tensor.detach_``, which autograd handles without an
        aten op this mode would see): from here on the program reads it as a constant."""
        label = self._label(t)
        if label is not None:
            self.stopped.add(label)

    def _is_constant(self, t: Tensor) -> bool:
        """``t`` is (or becomes, if not seen yet) a constant of the program."""
        label = self._label(t)
        return label is None or (isinstance(label, tuple) and label[0] == "constant")

    def _label(self, t: Tensor) -> Hashable | None:
        """``t``'s label; None for a tensor not seen yet (possibly reusing a dead one's id)."""
        entry = self.labels.get(id(t))
        if entry is None or (entry[1] is not None and entry[1]() is not t):
            return None
        return entry[0]

    def _refuse_input_writes(
        self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Writes to ``x`` (directly or through a view) are refused. A constant written, directly
        or through a view (a norm's running statistics in training mode), is allowed: the
        program gets a copy taken before the first write and replays the write functionally, so
        the record's own write happens once, as in one call of ``f``. Tensors ``f`` made are
        free to write."""
        positional, named = argument_kinds(func)
        written = [a for a, k in zip(args, positional, strict=False) if k == "write"]
        written += [v for n, v in kwargs.items() if named.get(n) == "write"]
        for value in pytree.tree_leaves(written):
            if not isinstance(value, Tensor):
                continue
            label = self._label(value)
            storage = storage_id(value)
            if label == X:
                what = "x"
            elif storage != 0 and storage == self.x_storage and _overlaps(value, self.x):
                what = "x (through a view of it)"
            else:
                if label is None:
                    self._describe(value)  # a constant from now on
                if storage in self.inputs:  # a constant, or a view of one
                    self._keep_before_writes(storage)
                continue
            raise InPlaceInputError(
                f"f modifies {what} in place ({func}); the Taylor engine needs x to stay "
                f"unchanged (write to a copy: x.clone())"
            )

    def _keep_before_writes(self, storage: int) -> None:
        """The program's constants in ``storage`` (written by ``f``, directly or through a
        view): copies taken before the first write."""
        for index, constant in enumerate(self.constants):
            if (
                index not in self.written_constants
                and storage != 0
                and storage_id(constant) == storage
            ):
                self.written_constants.add(index)
                self.constants[index] = constant.clone()


class _NoAutogradInside(TorchFunctionMode):
    """Refuses ``torch.autograd.grad`` / ``.backward()`` inside ``f``: autograd's backward pass
    detaches the tensors it saved, which the program would read as constants (silently wrong
    derivatives). ``torch.func.grad`` runs as ordinary ops and is allowed."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func in BACKWARD and torch._C._functorch.peek_interpreter_stack() is None:
            raise RuntimeError(
                f"f calls {BACKWARD[func]}: autograd inside f is not "
                f"supported by {ENGINE}, whose program cannot follow derivatives "
                f"through autograd's backward pass (torch.func.vjp's pullback runs it too). Use "
                f"torch.func.grad (or torch.func.jacrev, jacfwd) inside f instead"
            )
        return func(*args, **(kwargs or {}))


class BackwardInside(BaseException):
    """Autograd's engine ran inside ``f``: ``torch.func.grad`` (fine) or ``torch.autograd.grad``
    (refused). Only a ``TorchFunctionMode`` tells them apart, and it costs every torch call, so
    ``f`` is recorded without it and, when this is raised, recorded again with it."""


@contextlib.contextmanager
def recording_state() -> Iterator[None]:
    """The state ``f`` runs in while it is recorded: grad mode on (so that ``f``'s own
    ``no_grad`` shows), the fused multi-head-attention inference path off (it has no
    derivatives), and ``scaled_dot_product_attention`` on its math path: the fused kernels
    (flash, efficient, cuDNN on CUDA; flash on the CPU) have no decomposition and no second
    derivatives."""
    mha = getattr(torch.backends, "mha", None)
    fastpath = mha.get_fastpath_enabled() if mha is not None else None
    try:
        if mha is not None:
            mha.set_fastpath_enabled(False)
        # a tensor subclass's own wrapping of results (a captured Parameter of a tagging
        # subclass) would give them new objects the recorder cannot follow
        with torch.enable_grad(), math_attention, torch._C.DisableTorchFunctionSubclass():
            yield
    finally:
        if mha is not None:
            mha.set_fastpath_enabled(fastpath)


def record(f: Callable[..., Tensor], variable: Tensor, args: Sequence[object]
           ) -> tuple[Recorder, object]:  # fmt: skip
    """``f(variable, *args)`` under the recorder, in :func:`recording_state`; recorded again
    under :class:`_NoAutogradInside` when autograd's engine ran inside (:class:`BackwardInside`),
    or when ``f`` failed as ``torch.autograd.grad`` of ``variable`` (which does not require grad)
    fails, before the engine runs: then its refusal says what to do instead."""
    try:
        return _record(f, variable, args, tell_backward_apart=False)
    except BackwardInside:
        return _record(f, variable, args, tell_backward_apart=True)
    except RuntimeError as error:
        if "does not require grad" not in str(error):
            raise
        _record(f, variable, args, tell_backward_apart=True)  # raises the refusal, if autograd
        raise


def _record(f: Callable[..., Tensor], variable: Tensor, args: Sequence[object],
            tell_backward_apart: bool) -> tuple[Recorder, object]:  # fmt: skip
    recorder = Recorder(variable, watch_backward=not tell_backward_apart)
    guard = _NoAutogradInside() if tell_backward_apart else contextlib.nullcontext()
    recorders = _recorders()
    recorders.append(recorder)
    try:
        with recording_state(), guard, recorder, _WATCHED_METHODS:
            out = f(variable, *args)
    finally:
        recorders.pop()
    if recorder.saw_backward:
        raise BackwardInside
    return recorder, out


_RECORDING = threading.local()
"""The records of ``f`` in progress on this thread, innermost last (an operator called inside
``f`` of another is nested in it)."""


def _recorders() -> list[Recorder]:
    if not hasattr(_RECORDING, "recorders"):
        _RECORDING.recorders = []
    return cast(list[Recorder], _RECORDING.recorders)


TO_NUMPY = ("__array__", "numpy")
"""The methods by which a tensor becomes a NumPy array: ``np.sin(x)``, ``x - array`` (NumPy
computes, and its result comes back as a tensor torch never saw made), ``x.numpy()``."""


def _refusing(name: str) -> Callable[..., Any]:
    original = getattr(Tensor, name)

    def convert(self: Tensor, *args: Any, **kwargs: Any) -> Any:
        if any(not recorder._is_constant(self) for recorder in _recorders()):  # (nested too)
            raise TypeError(
                f"f converts a tensor that depends on x to NumPy (Tensor.{name}: np.sin(x), "
                f"x - a NumPy array, x.numpy()); {ENGINE} differentiates torch operations only, "
                f"and NumPy's results would be constants (zero derivatives). Write f with torch "
                f"functions and pass arrays as tensors (torch.as_tensor)"
            )
        return original(self, *args, **kwargs)

    return convert


def _detach_in_place(self: Tensor) -> Tensor:
    out = _DETACH_IN_PLACE(self)
    for recorder in _recorders():  # (nested too)
        recorder.stop(self)
    return out


_DETACH_IN_PLACE = Tensor.detach_


_WATCHED_METHODS = Replacement(
    [*((Tensor, name, _refusing(name)) for name in TO_NUMPY),
     (Tensor, "detach_", _detach_in_place), (torch, "detach_", _detach_in_place)]
)  # fmt: skip
"""While ``f`` is recorded, a tensor that depends on ``x`` refuses to become a NumPy array: the
recorder sees no op of NumPy's, so its results were constants (a Laplacian of zeros); and a
tensor ``f`` detaches in place (``t.detach_()``, ``torch.detach_(t)``) is a constant from then
on, as for autograd (it has no aten op: until 2026-12-07 the Taylor operators differentiated
through it, the Hessian diagonal of ``(z.clone().detach_() * z**2).sum()`` read 6z for
autograd's 2z). The methods are replaced on ``torch.Tensor`` (and ``torch``) while any record
is in progress (a function mode would cost every op of every record); tensors of no record keep
their behaviour."""


def recording_depth() -> int:
    return len(_recorders())


def recording() -> bool:
    """Whether this thread is recording ``f`` for a Taylor-engine operator: a pyhvp operator
    called now is nested inside that ``f``, and must compute its result with ops the recorder
    sees and differentiates (its kernel, run eagerly on ``f``'s own tensors), never behind
    ``no_grad``, a ``detach`` or a compiled graph -- the outer operator would read a constant."""
    return recording_depth() > 0


@contextlib.contextmanager
def outside_recording() -> Iterator[None]:
    """The recorders (and any other dispatch modes) in progress suspended: what a nested
    operator runs to record its own ``f`` and trace its kernel, which are not part of the outer
    program (only the kernel's run is). The depth is kept: the nested record counts it."""
    with _disable_current_modes():
        yield
