"""Attributes replaced while any context needs them, in any thread: :class:`Replacement`.

pyhvp replaces a few torch callables for the length of a run instead of intercepting every op
with a function mode (which costs a Python call per op of the user's function): NumPy
conversions while the Taylor engine records ``f``, the embedding functions while
``sub_hessian`` differentiates a loss twice, dynamo's handlers of tensor properties while the
sparse route's kernels trace (:mod:`pyhvp.restricted.dynamo_views`). A replacement decides per call whether to act, from
whether its own thread is inside a context (:meth:`Replacement.inside`); another thread's
calls reach it too, and get the original's behaviour. :class:`Together` enters several
contexts as one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager, ContextDecorator
from typing import Any

_MISSING = object()
"""No attribute of the owner's own (an inherited one): deleted again, not set."""


class Replacement(ContextDecorator):
    """``setattr(owner, name, value)`` for each ``(owner, name, value)`` while any context of it
    is in progress (``with replacement:``, or a function it decorates), in any thread; the last
    to leave puts back what the first found (torch's callable, a user's own replacement, or
    nothing of the owner's own). Its state is its own, so one instance serves every call (3 us
    a call, where a generator's context took 8)."""

    def __init__(self, replacements: Sequence[tuple[object, str, object]]) -> None:
        self._replacements = tuple(replacements)
        self._here = threading.local()  # this thread's contexts in progress (``depth``)
        self._lock = threading.Lock()
        self._users = 0
        self._found: list[object] = []

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def inside(self) -> bool:
        """Whether this thread is inside a context (a replacement acts for its calls only)."""
        return getattr(self._here, "depth", 0) > 0

    def acquire(self) -> None:
        """Enter: the replacements are in place until the matching :meth:`release`."""
        self._here.depth = getattr(self._here, "depth", 0) + 1
        with self._lock:
            if self._users == 0:
                self._found = [vars(owner).get(name, _MISSING)
                               for owner, name, _ in self._replacements]  # fmt: skip
                for owner, name, value in self._replacements:
                    setattr(owner, name, value)
            self._users += 1

    def release(self) -> None:
        """Leave: the last to leave puts back what the first found."""
        self._here.depth -= 1
        with self._lock:
            self._users -= 1
            if self._users == 0:
                for (owner, name, _), found in zip(self._replacements, self._found, strict=True):
                    if found is _MISSING:
                        delattr(owner, name)
                    else:
                        setattr(owner, name, found)


class Together(ContextDecorator):
    """Several contexts entered as one (``with together:`` or ``@together``), in order, and left
    in reverse; where one fails to enter, those entered before are left again."""

    def __init__(self, *contexts: AbstractContextManager[object]) -> None:
        self._contexts = contexts

    def __enter__(self) -> None:
        for entered, context in enumerate(self._contexts):
            try:
                context.__enter__()
            except BaseException:
                for earlier in reversed(self._contexts[:entered]):
                    earlier.__exit__(None, None, None)
                raise

    def __exit__(self, *exc: Any) -> None:
        for context in reversed(self._contexts):
            context.__exit__(*exc)
