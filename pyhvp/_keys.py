"""Hashable cache keys: immutable scalars by type and exact value, everything else by identity.

Shared by the compile cache (:mod:`pyhvp.backends.compile_policy`) and the Taylor engine's
program cache (:mod:`pyhvp.taylor.program`), which both key what a function computes.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import torch

VALUE_TYPES = (
    type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
    torch.memory_format,
)  # fmt: skip
"""Immutable types keyed by value (exact types: a subclass may carry behaviour of its own)."""


class Value:
    """An immutable scalar as a key: equal to another of the same type with the same exact
    value. Floats and complex numbers compare by ``repr`` (exact), so ``-0.0`` and ``0.0``
    differ and NaN equals NaN."""

    __slots__ = ("_hash", "_key", "value")

    def __init__(self, value: object) -> None:
        self.value = value
        exact = repr(value) if isinstance(value, (float, complex)) else value
        self._key = (type(value), exact)
        self._hash = hash(self._key)  # keys are hashed on every lookup of a program

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Value) and other._key == self._key

    def __hash__(self) -> int:
        return self._hash


def value_key(obj: object) -> Value | None:
    """``obj`` as a :class:`Value` if it is an immutable scalar (of exactly one of
    :data:`VALUE_TYPES`), else ``None``."""
    return Value(obj) if type(obj) in VALUE_TYPES else None


class Identity:
    """Equal only to the key of the same live object.

    The object is held weakly where it allows that, so a key never keeps a captured batch of
    data alive; a key whose object died equals nothing. Objects without weak references (lists,
    dicts) are held strongly.
    """

    __slots__ = ("_hash", "_ref")

    def __init__(self, obj: object) -> None:
        self._hash = id(obj)
        try:
            self._ref: Callable[[], object] = weakref.ref(obj)
        except TypeError:
            self._ref = lambda: obj

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Identity) or other._hash != self._hash:
            return False
        obj = self._ref()
        return obj is not None and obj is other._ref()

    def __hash__(self) -> int:
        return self._hash

    @property
    def obj(self) -> object:
        """The object (``None`` once it died)."""
        return self._ref()


Derived = TypeVar("Derived")


class TensorMemo(Generic[Derived]):
    """Values derived from a CPU tensor (and ``about`` it, hashable), kept while it is the same
    live object at the same version holding the same values: a call repeated on the same index
    tensors checks them once. The values are compared with a copy (4 us for an index tensor,
    against 60 us for :func:`~pyhvp.restricted.selected_entries`) because some writes bypass the
    version counter -- through ``t.data``, the array ``torch.from_numpy`` shares, ``apply_``,
    the untyped storage: with the version alone, a selection written so kept the old one's
    coordinates (blocks 0.05 off). Off the CPU that comparison would synchronise with the device,
    as recomputing does, so nothing is kept there; nor for tensors without a version counter of
    their own (inference tensors, ``torch.func`` wrappers). Holds no reference to the tensor
    itself. At most ``size`` entries, least recently used dropped first."""

    def __init__(self, size: int = 64) -> None:
        self._size = size
        self._entries: OrderedDict[
            tuple[int, Hashable], tuple[weakref.ref[torch.Tensor], int, torch.Tensor, Derived]
        ] = OrderedDict()

    def get(self, tensor: torch.Tensor, about: Hashable) -> Derived | None:
        key = (id(tensor), about)
        found = self._entries.get(key)
        if found is None or found[0]() is not tensor or found[1] != version_of(tensor):
            return None
        if not torch.equal(found[2], tensor):  # a write the version counter missed
            return None
        self._entries.move_to_end(key)
        return found[3]

    def keep(self, tensor: torch.Tensor, about: Hashable, value: Derived) -> Derived:
        version = version_of(tensor)
        if version is not None and tensor.device.type == "cpu":
            copy = tensor.detach().clone()
            self._entries[(id(tensor), about)] = (weakref.ref(tensor), version, copy, value)
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)
        return value


def wrapped(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that a ``torch.func`` wrapper (``vmap``'s batched tensor, ``grad``'s tracking
    tensor) wraps, through every level, or ``tensor`` itself: where a write through it lands,
    and whose version counter moves (the wrapper's own never does)."""
    while torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        tensor = torch._C._functorch.get_unwrapped(tensor)
    return tensor


def version_of(tensor: torch.Tensor) -> int | None:
    """``tensor``'s version counter, or None where it keeps none of its own (an inference
    tensor, a ``torch.func`` wrapper). A view's is its base's, which a write to another view
    of that base moves too."""
    if tensor.is_inference() or torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        return None
    try:
        return tensor._version
    except RuntimeError:
        return None
