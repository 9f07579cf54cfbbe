"""``sinc`` differentiated twice: :data:`twice_differentiable_sinc`, :func:`sinc_backward` and
:func:`written_out_in_mode`.

Autograd's derivatives of ``torch.sinc`` divide by ``x`` where it is not 0: its second is NaN at
0 and loses its digits near it (torch 2.13, float32: ``+5.96`` at ``x = 1e-4`` where ``-pi^2 / 3
= -3.29``; float64: 0 at ``1e-9``). Inside the context ``torch.sinc`` and
``torch.special.sinc`` run as :func:`~pyhvp.taylor.rules.elementwise.sinc_written_out`, whose
nested derivatives are right at and near 0, with the same values (in float32 at least, as torch
computes a half one). ``Tensor.sinc`` is not replaced: setting an attribute of ``torch.Tensor``
empties Python's cache of every tensor method's lookup, which cost each HVP call 5-8 us (4% of
a small one). Where it ran, autograd's graph has its node, which
:func:`~pyhvp.backends.torch.check_twice_differentiable` makes differentiate by the written-out
slope (:func:`sinc_backward`'s hook); the sub-Hessian routes that run the loss under a
``TorchFunctionMode`` see it and run it written out (:func:`written_out_in_mode`).

>>> with twice_differentiable_sinc:
...     torch.sinc(torch.tensor([0.0, 0.5]))  # 1, sin(pi / 2) / (pi / 2)
tensor([1.0000, 0.6366])
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from pyhvp._replacing import Replacement
from pyhvp.taylor.rules.elementwise import sinc_slope_written_out, sinc_written_out

_OWNERS = ((torch, "sinc"), (torch.special, "sinc"))
"""Where torch's ``sinc`` functions are found."""


def _written_out(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(original)
    def sinc(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``original`` where this thread is outside the context, or for what the rewrite does
        not take (an ``out=``, a tensor that is not floating)."""
        plain = args or kwargs or not _REPLACED.inside()
        if plain or not (isinstance(input, torch.Tensor) and input.is_floating_point()):
            return original(input, *args, **kwargs)
        return sinc_written_out(input)

    return sinc


_REPLACED = Replacement(
    [(owner, name, _written_out(getattr(owner, name))) for owner, name in _OWNERS]
)

twice_differentiable_sinc = _REPLACED
"""``with twice_differentiable_sinc:`` or ``@twice_differentiable_sinc``: see the module
docstring. Another thread's calls, and a call bound to torch's function before, are torch's."""


def sinc_backward(node: Any) -> Callable[[tuple[Any, ...], tuple[Any, ...]], tuple[Any, ...]]:
    """For autograd's node of torch's own ``sinc`` (``SincBackward0``: ``x.sinc()``, or a
    function bound before the context), a hook that returns the incoming gradient times
    :func:`~pyhvp.taylor.rules.elementwise.sinc_slope_written_out` of its input, whose own
    derivatives a second backward then takes: torch's formula's are NaN at 0 and wrong near it
    (float32 sub-Hessians of ``(X @ w).sinc()`` at ``w = 1e-5``: 0 for -19 until 2026-12-07).
    Raises ``RuntimeError`` where a backward freed the node's saved input."""
    x = node._saved_self

    def backward(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> tuple[Any, ...]:
        (g,) = grad_outputs
        return (None if g is None else g * sinc_slope_written_out(x),)

    return backward


def written_out_in_mode(
    mode: TorchFunctionMode, func: Callable[..., Any], args: Any, kwargs: dict[str, Any]
) -> torch.Tensor | None:
    """A call of torch's own ``sinc`` seen by ``mode`` (:func:`torchs_sinc_input`): run written
    out, ``mode`` seeing its elementary ops; None for any other call."""
    input = torchs_sinc_input(func, args, kwargs)
    if input is None:
        return None
    with mode:
        return sinc_written_out(input)


def torchs_sinc_input(
    func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> torch.Tensor | None:
    """The floating input of a call of torch's own ``sinc`` that a ``TorchFunctionMode`` sees
    (``x.sinc()``, or a function bound before the context; not one with ``out=``); None for any
    other call."""
    if func not in _TORCHS or kwargs.get("out") is not None:
        return None
    input = args[0] if args else kwargs.get("input")
    return input if isinstance(input, torch.Tensor) and input.is_floating_point() else None


_TORCHS = (torch.Tensor.sinc, *(getattr(owner, name) for owner, name in _OWNERS))
"""Torch's own ``sinc`` method and functions (this module is imported outside the context)."""
