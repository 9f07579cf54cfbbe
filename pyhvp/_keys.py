"""Hashable cache keys: immutable scalars by type and exact value, everything else by identity.

Shared by the compile cache (:mod:`pyhvp.backends.compile_policy`) and the Taylor engine's
program cache (:mod:`pyhvp.taylor.program`), which both key what a function computes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

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
