"""Norms differentiated twice: :data:`twice_differentiable_norms`.

Two faults of autograd's double backward of torch's norms (torch 2.5.1 to 2.14.1), which the
context works around:

* ``layer_norm``, ``batch_norm``, ``instance_norm`` and ``group_norm`` drop the bias when the
  weight is None: the Hessian of ``tanh(F.layer_norm(h, (5,), None, b)).square().sum()`` over
  ``b`` came out all zeros, in ``pyhvp.hvp`` and every route of ``sub_hessian`` (``joint=True``
  raised "Expected a proper Tensor but got None"), where ``torch.func``'s forward-over-reverse
  gets it right. Inside the context such a call runs as the norm without weight or bias, plus the
  bias.
* ``group_norm``'s batched double backward (``is_grads_batched``: ``hvp`` of several tangents,
  the reverse and forward routes of ``sub_hessian``) is wrong where a group's channels number its
  spatial size (``GroupNorm(1, 2)`` on ``(N, 2, 2)``: HVPs 8 off in 6.5), and raises a size error
  elsewhere. Inside the context and :data:`batched_double_backward` both, ``group_norm`` runs
  written out: each group's mean and biased variance, then the affine map, in float32 for a
  reduced-precision input, as torch's kernel (its double backward one cotangent at a time is
  right, and the fused kernel 1.16x faster in an HVP of one tangent through a GroupNorm block).

The same values, and second derivatives autograd gets right.

>>> h, b = torch.tensor([[0.0, 2.0]]), torch.tensor([1.0, -1.0])
>>> with twice_differentiable_norms:
...     torch.nn.functional.layer_norm(h, (2,), None, b, eps=0.0)  # (-1, 1) + b
tensor([[0., 0.]])
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from contextlib import ContextDecorator
from typing import Any

import torch

from pyhvp._replacing import Replacement

PARAMETERS = {  # torch's functions (which F's call), their parameters in order
    "layer_norm": ("input", "normalized_shape", "weight", "bias", "eps", "cudnn_enable"),
    "batch_norm": ("input", "weight", "bias", "running_mean", "running_var", "training",
                   "momentum", "eps", "cudnn_enabled"),
    "instance_norm": ("input", "weight", "bias", "running_mean", "running_var",
                      "use_input_stats", "momentum", "eps", "cudnn_enabled"),
    "group_norm": ("input", "num_groups", "weight", "bias", "eps", "cudnn_enabled"),
}  # fmt: skip


def per_channel(
    out: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """A batch, instance or group norm's affine map, ``weight`` and ``bias`` per channel (dim 1)."""
    channels = (1, -1, *(1,) * (out.ndim - 2))
    out = out if weight is None else out * weight.reshape(channels)
    return out if bias is None else out + bias.reshape(channels)


REDUCED = (torch.float16, torch.bfloat16)
"""Input dtypes torch's norm kernels compute in float32 (and round once)."""


def _working(dtype: torch.dtype) -> torch.dtype:
    """The dtype torch's norm kernels compute an input of ``dtype`` in."""
    return torch.float32 if dtype in REDUCED else dtype


def _group_norm(
    input: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    cudnn_enabled: bool = True,
) -> torch.Tensor:
    """``torch.group_norm`` written out inside the context (torch's kernel elsewhere, and where
    the written-out form would differ: channels that the groups do not divide, which torch
    refuses; parameters of a dtype torch's kernel does not take with the input's; autocast,
    which casts torch's op as a whole)."""
    if not (
        _REPLACED.inside()
        and _BATCHED.depth
        and isinstance(input, torch.Tensor)
        and input.is_floating_point()
        and input.ndim >= 2
        and isinstance(num_groups, int)
        and num_groups > 0
        and input.shape[1] % num_groups == 0
        and all(t is None or (isinstance(t, torch.Tensor)
                              and t.dtype in (input.dtype, _working(input.dtype)))
                for t in (weight, bias))
        and not torch.is_autocast_enabled(input.device.type)
    ):  # fmt: skip
        return _GROUP_NORM_BIAS_OUTSIDE(input, num_groups, weight, bias, eps, cudnn_enabled)
    dtype, work = input.dtype, _working(input.dtype)
    groups = input.to(work).reshape(input.shape[0], num_groups, -1)
    mean = groups.mean(-1, keepdim=True)
    variance = groups.var(-1, correction=0, keepdim=True)
    out = ((groups - mean) * torch.rsqrt(variance + eps)).reshape(input.shape)
    cast = [None if t is None else t.to(work) for t in (weight, bias)]
    return per_channel(out, *cast).to(dtype)


def _bias_outside(name: str, norm: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``norm`` (torch's ``name``), with a bias and no weight run as the norm plus the bias
    inside the context: per channel (dim 1), or over the normalised dims of a layer norm."""
    parameters = PARAMETERS[name]
    at = parameters.index("bias")

    @functools.wraps(norm)
    def written(*args: Any, **kwargs: Any) -> torch.Tensor:
        bound = dict(zip(parameters, args, strict=False)) | kwargs
        input, weight, bias = bound.get("input"), bound.get("weight"), bound.get("bias")
        if not (
            _REPLACED.inside()  # (another thread's calls keep torch's behaviour)
            and weight is None
            and isinstance(bias, torch.Tensor)
            and isinstance(input, torch.Tensor)
            and bias.is_floating_point()
            and input.is_floating_point()
            and (
                bias.dtype == input.dtype
                or (
                    torch.promote_types(input.dtype, bias.dtype) == bias.dtype
                    and not torch.is_autocast_enabled(input.device.type)
                )
            )
        ):
            return norm(*args, **kwargs)
        dtype = None  # torch's mixed kernels (a bfloat16 input, a float32 bias) give the input's
        if bias.dtype != input.dtype:  # dtype: normalised in the bias's, rounded once
            dtype = input.dtype
            widened = input.to(bias.dtype)
            if args:
                args = (widened, *args[1:])
            else:
                kwargs = kwargs | {"input": widened}
        if at < len(args):
            args = (*args[:at], None, *args[at + 1 :])
        else:
            kwargs = kwargs | {"bias": None}
        out = norm(*args, **kwargs)
        out = out + bias if name == "layer_norm" else per_channel(out, None, bias)
        return out if dtype is None else out.to(dtype)

    return written


_TORCH = {name: getattr(torch, name) for name in PARAMETERS}
"""Torch's own norms, as imported (what the replacements call outside the context)."""

_GROUP_NORM_BIAS_OUTSIDE = _bias_outside("group_norm", _TORCH["group_norm"])

_REPLACED = Replacement(
    [
        (torch, name, _bias_outside(name, _TORCH[name]))
        for name in PARAMETERS
        if name != "group_norm"
    ]
    + [(torch, "group_norm", functools.wraps(_TORCH["group_norm"])(_group_norm))]
)


twice_differentiable_norms = _REPLACED
"""``with twice_differentiable_norms:`` or ``@twice_differentiable_norms``: inside, in this
thread, a norm with a bias and no weight runs as the norm without either plus the bias, and a
group norm written out under :data:`batched_double_backward` too (module docstring;
``F.layer_norm`` and the others call torch's functions, replaced meanwhile); a call bound to
torch's own function before is torch's."""


class _Batched(threading.local):
    depth = 0


_BATCHED = _Batched()


class _BatchedDoubleBackward(ContextDecorator):
    """Inside (in this thread), the double backward of what runs takes several cotangents at
    once: group norms run written out where :data:`twice_differentiable_norms` is on too."""

    def __enter__(self) -> None:
        _BATCHED.depth += 1

    def __exit__(self, *exc: object) -> None:
        _BATCHED.depth -= 1


batched_double_backward = _BatchedDoubleBackward()
"""``with batched_double_backward:`` or ``@batched_double_backward`` around the run of ``f``
whose gradient's backward takes several cotangents at once (``is_grads_batched``)."""
