"""What wraps every public operator of pyhvp: :func:`public_operator`."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, cast

import torch

from pyhvp._user_errors import user_errors

P = ParamSpec("P")
R = TypeVar("R")


def public_operator(operator: Callable[P, R]) -> Callable[P, R]:
    """``operator`` as users call it: an error of their function re-raised as their own
    (:func:`~pyhvp._user_errors.user_errors`), and opaque to dynamo. Called inside a user's
    ``torch.compile`` (a compiled PINN training step), it is a graph break that runs eagerly, with
    the gradients eager code gives: pyhvp's recorder, modes and value-dependent checks are eager
    code, and its backend compiles kernels of its own (``TorchBackend(compile=...)``). Traced by
    dynamo instead, the operator crashed at a second call (a guard on a tensor's version)."""
    compiler: Any = torch.compiler  # its disable() is untyped on some torch versions
    return cast(Callable[P, R], compiler.disable(user_errors(_counted(operator))))


_ACTIVE = threading.local()
"""How many public operators this thread is inside (``depth``)."""


def operator_depth() -> int:
    """How many public operators are running on this thread: 2 or more inside ``f`` of another
    (a Hessian-vector product of a function that calls ``pyhvp.hvp``)."""
    return cast(int, getattr(_ACTIVE, "depth", 0))


def _counted(operator: Callable[P, R]) -> Callable[P, R]:
    @functools.wraps(operator)
    def counting(*args: P.args, **kwargs: P.kwargs) -> R:
        _ACTIVE.depth = operator_depth() + 1
        try:
            return operator(*args, **kwargs)
        finally:
            _ACTIVE.depth -= 1

    return counting
