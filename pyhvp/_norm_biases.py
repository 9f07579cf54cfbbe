"""Norms with a bias and no weight, differentiated twice: :func:`biases_outside_norms`.

Autograd's double backward of ``layer_norm``, ``batch_norm``, ``instance_norm`` and
``group_norm`` drops the bias when the weight is None (torch 2.5.1 to 2.14.1): the Hessian of
``tanh(F.layer_norm(h, (5,), None, b)).square().sum()`` over ``b`` came out all zeros, in
``pyhvp.hvp`` and every route of ``sub_hessian`` (``joint=True`` raised "Expected a proper
Tensor but got None"), where ``torch.func``'s forward-over-reverse gets it right. Inside the
context such a call runs as the norm without weight or bias, plus the bias: the same values, and
second derivatives autograd gets right.

>>> h, b = torch.tensor([[0.0, 2.0]]), torch.tensor([1.0, -1.0])
>>> with biases_outside_norms:
...     torch.nn.functional.layer_norm(h, (2,), None, b, eps=0.0)  # (-1, 1) + b
tensor([[0., 0.]])
"""

from __future__ import annotations

import functools
from collections.abc import Callable
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


_REPLACED = Replacement(
    [(torch, name, _bias_outside(name, getattr(torch, name))) for name in PARAMETERS]
)


biases_outside_norms = _REPLACED
"""``with biases_outside_norms:`` or ``@biases_outside_norms``: inside, in this thread, a layer,
batch, instance or group norm with a bias and no weight runs as the norm without either plus
the bias (``F.layer_norm`` and the others call torch's functions, replaced meanwhile); a call
bound to torch's own function before is torch's."""
