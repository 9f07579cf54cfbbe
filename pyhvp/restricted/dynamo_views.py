"""Tensor properties that are views (``W.T``, ``W.mT``, ``W.H``, ``W.mH``) handed to the sparse
route's mode in compiled kernels, on torch releases whose dynamo traces them past it.

Torch 2.14's dynamo traces such a property as a call of its aten op (``aten.numpy_T``,
``aten.mT``, ``aten.matrix_H``, ``aten.mH``), which a ``TorchFunctionMode`` sees; torch 2.13
reads the attribute off the tensor's proxy, past the mode, so that in a compiled sparse kernel
over ``x @ W.T`` the transposed weight was a constant, and such kernels ran eagerly (the seed's
model written by hand, k = 16: 0.54x the seed's loop where ``mm(X, W.t())`` took 0.22x).
:func:`handed_to_the_mode` lends an older dynamo 2.14's four handlers
(``TensorVariable.method_attr_T``, ...) while pyhvp's sparse kernels trace and run, and takes
them back after: dynamo traces the user's own code as it did (another thread tracing at the
same time traces those properties as torch 2.14 does). Where dynamo has the handlers, or lacks
the classes they are built from, it changes nothing;
:func:`~pyhvp.restricted.compiles_property_views` asks whether the kernel then compiles
faithfully.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from pyhvp._replacing import Replacement

VIEW_OPS = {
    "T": torch.ops.aten.numpy_T,
    "mT": torch.ops.aten.mT,
    "H": torch.ops.aten.matrix_H,
    "mH": torch.ops.aten.mH,
}
"""Each view property and the aten op its C++ getter dispatches to."""


@functools.cache
def _lent() -> Replacement | None:
    """Dynamo's ``TensorVariable`` given the handlers while any kernel (of any thread) needs
    them; None where it has them (torch >= 2.14) or lacks what they are built from."""
    try:
        from torch._dynamo.variables.tensor import TensorVariable
        from torch._dynamo.variables.torch import TorchInGraphFunctionVariable
    except ImportError:
        return None
    if any(hasattr(TensorVariable, f"method_attr_{name}") for name in VIEW_OPS):
        return None

    def handler(op: Callable[..., Any]) -> Callable[..., Any]:
        def method_attr(self: Any, tx: Any) -> Any:  # (torch 2.14's TensorVariable._view_attr)
            return TorchInGraphFunctionVariable(op).call_function(tx, [self], {})

        return method_attr

    return Replacement(
        [(TensorVariable, f"method_attr_{name}", handler(op)) for name, op in VIEW_OPS.items()]
    )


def handed_to_the_mode() -> contextlib.AbstractContextManager[None]:
    """While it is entered, dynamo traces ``W.T``, ``W.mT``, ``W.H`` and ``W.mH`` as their aten
    ops, which the sparse route's mode sees (as torch 2.14's does)."""
    lent = _lent()
    return contextlib.nullcontext() if lent is None else lent
