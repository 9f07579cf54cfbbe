"""What wraps every public operator of pyhvp: :func:`public_operator`."""

from __future__ import annotations

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
    return cast(Callable[P, R], compiler.disable(user_errors(operator)))
