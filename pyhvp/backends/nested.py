"""Taylor coefficients by nested reverse-mode derivatives: what the torch backend runs inside a
``torch.func`` transform (``grad``, ``jvp``, ``vmap``, ... around an operator, or inside ``f`` of
another operator, whose recorder then records these ops), which composes with it. The recorder
cannot run there: it sees the transform's unwrapped tensors, in which ``x`` and the tensors ``f``
captures would be constants (derivatives silently zero).

Each order is the derivative of the one below along a direction ``u``, as the gradient in a
cotangent ``w`` of ``<vjp(w), u>`` (linear in ``w``): reverse over reverse, ``2 K`` nested
reverse passes for order ``K`` -- eager, and exponential in the order. Not forward mode: torch
2.13's nested forward-mode derivatives of ``det``, ``slogdet``, ``logdet``, ``solve`` and
``cholesky_inverse`` are wrong from the second order on, and nested forward mode under the
recorder's dispatch mode segfaulted (``x ** 5`` inside ``torch.func.grad``). Four norms and
``logcumsumexp`` run written out in elementary ops (``_Elementary``): torch's third and higher
reverse-mode derivatives of ``layer_norm`` are wrong, its nested ones of ``instance_norm`` and of
``batch_norm`` in training under ``vmap`` from the second on, its batched double backward of
``group_norm`` fails, and its nested ones of ``logcumsumexp`` are NaN (the backward takes the
log of the cotangent). Attention takes its math path, as under the recorder: its fused kernels
have no second derivative. The Hessian-vector products inside a transform run ``f`` the same
way (:func:`written_out`): a ``grad`` around them makes a third derivative.
A determinant's third is wrong too: refused where it would be differentiated more than twice
-- the operator's order and the ``grad`` / ``jvp`` levels around it, or an outer operator's
record --, as an op without a derivative is (the note says to call the operator outside the
transform, whose result autograd differentiates).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch.func import grad, vjp, vmap
from torch.overrides import TorchFunctionMode

from pyhvp import taylor
from pyhvp._attention import math_attention
from pyhvp._user_errors import note
from pyhvp.taylor.program import logcumsumexp_by_prefixes


def taylor_coefficients(
    f: Callable[..., torch.Tensor], x: torch.Tensor, directions: torch.Tensor,
    args: Sequence[object], chunk_size: int | None, mode: taylor.JetMode,
    weights: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """``TorchBackend.taylor_coefficients`` by ``mode.order`` nested derivatives along each of
    ``directions`` (``(k, *x.shape)``), vmapped over them. ``x`` is copied: a stride-0 ``x``
    is refused by the transforms."""

    def value(y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with _Elementary(), math_attention:
            return (f(y, *args),)

    def derivatives(u: torch.Tensor) -> tuple[torch.Tensor, ...]:
        coefficients: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] = value
        for _ in range(mode.order):
            coefficients = _along(coefficients, u)
        return coefficients(x)

    x = x.clone(memory_format=torch.contiguous_format)  # under vmap .contiguous() may keep it
    try:
        along = vmap(derivatives, chunk_size=chunk_size)(directions.expand(-1, *x.shape))
    except (NotImplementedError, RuntimeError) as error:  # no derivative, a refusal, a vmap bug
        note(error, OUTSIDE)
        raise
    results = []
    for k in mode.outputs:
        if k == 0:
            results.append(along[0][0])
        elif mode.collapses(k):
            top = along[k] if weights is None else along[k] * weights.reshape(
                -1, *(1,) * (along[k].ndim - 1))  # fmt: skip
            results.append(top.sum(0).to(x.dtype))
        else:
            results.append(along[k].to(x.dtype))
    return tuple(results)


def _along(
    lower: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], u: torch.Tensor
) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    """``y -> (*lower(y), d/dt lower(y + t u)[-1])``: the next order along ``u``, ``J u`` as the
    gradient in the cotangent ``w`` of ``<vjp(w), u>``."""

    def through(y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pulled = vjp(lower, y)  # torch annotates it as a pair or, with has_aux, a triple
        values, pull = pulled[0], pulled[1]
        zeros = tuple(map(torch.zeros_like, values))

        def paired(w: torch.Tensor) -> torch.Tensor:
            return cast(torch.Tensor, (pull((*zeros[:-1], w))[0] * u).sum())

        return (*values, grad(paired)(zeros[-1]))

    return through


OUTSIDE = (
    "inside a torch.func transform pyhvp's operators differentiate f by nested reverse mode "
    "(torch.func.vjp, vmapped over the directions): where f runs outside the transform, call "
    "the operator outside it and differentiate its result with torch.autograd.grad"
)
"""The note on an error of ``f`` inside a transform (a refusal, an op without a derivative)."""


def written_out(f: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``f`` run under :class:`_Elementary`, attention on its math path: what the
    Hessian-vector products differentiate inside a transform, or where their results are
    differentiated."""

    def run(*inputs: object) -> torch.Tensor:
        with _Elementary(), math_attention:
            return f(*inputs)

    run.__name__ = getattr(f, "__name__", type(f).__name__)  # (what messages name)
    return run


class _Elementary(TorchFunctionMode):
    """``f`` with ``layer_norm``, ``group_norm``, ``instance_norm`` and ``batch_norm`` (of the
    input's own statistics) and ``logcumsumexp`` written out in elementary ops (whose nested
    reverse-mode derivatives torch gets right), and a determinant refused where it is
    differentiated more than twice."""

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:  # fmt: skip
        kwargs = kwargs or {}
        if func in _LAYER_NORMS:
            return _layer_norm(*args, **kwargs)
        if func in _GROUP_NORMS:
            return _group_norm(*args, **kwargs)
        if func in _INSTANCE_NORMS:
            bound = dict(zip(_INSTANCE_NORMS[func], args, strict=False)) | kwargs
            if bound.get("use_input_stats", True) and bound.get("running_mean") is None:
                input = bound["input"]
                return _group_norm(input, input.shape[1], bound.get("weight"),
                                   bound.get("bias"), bound.get("eps", 1e-5))  # fmt: skip
        if func in _BATCH_NORMS:  # (with running statistics: torch updates them, or refuses)
            bound = dict(zip(_BATCH_NORMS[func], args, strict=False)) | kwargs
            if bound.get("training", False) and bound.get("running_mean") is None:
                input = bound["input"]
                dims = (0, *range(2, input.ndim))
                out = _normalised(input, dims, bound.get("eps", 1e-5))
                return _per_channel(out, bound.get("weight"), bound.get("bias"))
        if func in _CUMULATIVE_LOG_SUMS and kwargs.get("out") is None and args[0].ndim:
            return _logcumsumexp(*args, **kwargs)
        if func in _DETERMINANTS and (differentiation_levels() > 2 or taylor.recording()):
            raise NotImplementedError(
                "torch's reverse-mode derivatives of a determinant above the second are wrong "
                "(torch 2.5.1 to 2.14.1): pyhvp refuses a determinant differentiated more than "
                "twice here (its operator's order and the transforms or the operator around it)"
            )
        return func(*args, **kwargs)


def inside_transform() -> bool:
    """Whether a functorch transform (``torch.func.grad``, ``vmap``, ...) is active."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def differentiation_levels() -> int:
    """How many ``torch.func`` levels that differentiate (``grad``, ``vjp``, ``jvp``; not
    ``vmap``) are active: here the nested orders of :func:`taylor_coefficients` and the
    transforms around the operator."""
    differentiating = (TransformType.Grad, TransformType.Jvp)
    return sum(i.key() in differentiating for i in retrieve_all_functorch_interpreters())


def _layer_norm(
    input: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None, eps: float = 1e-5, *_: object, **__: object,
) -> torch.Tensor:  # fmt: skip
    """``F.layer_norm`` in elementary ops (``torch.layer_norm``'s trailing flag ignored)."""
    out = _normalised(input, tuple(range(-len(normalized_shape), 0)), eps)
    out = out if weight is None else out * weight
    return out if bias is None else out + bias


def _normalised(input: torch.Tensor, dims: tuple[int, ...], eps: float) -> torch.Tensor:
    """``input`` less its mean over ``dims``, over its standard deviation there (biased)."""
    centred = input - input.mean(dims, keepdim=True)
    return centred * torch.rsqrt((centred * centred).mean(dims, keepdim=True) + eps)


def _per_channel(
    out: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """A norm's affine map, ``weight`` and ``bias`` per channel (dim 1)."""
    channels = (1, -1, *(1,) * (out.ndim - 2))
    out = out if weight is None else out * weight.reshape(channels)
    return out if bias is None else out + bias.reshape(channels)


def _logcumsumexp(input: torch.Tensor, dim: int, **_: object) -> torch.Tensor:
    """``torch.logcumsumexp`` in elementary ops (its ``out=None``, if given, dropped)."""
    return logcumsumexp_by_prefixes(input, dim)


def _group_norm(
    input: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None, eps: float = 1e-5, *_: object, **__: object,
) -> torch.Tensor:  # fmt: skip
    """``F.group_norm`` in elementary ops: a layer norm over each group's channels and
    positions, then the per-channel affine map."""
    grouped = input.reshape(input.shape[0], num_groups, -1)
    return _per_channel(_normalised(grouped, (-1,), eps).reshape(input.shape), weight, bias)


_LAYER_NORMS = (F.layer_norm, torch.layer_norm)
_GROUP_NORMS = (F.group_norm, torch.group_norm)
_INSTANCE_NORMS = {  # their arguments' names, in order
    F.instance_norm: ("input", "running_mean", "running_var", "weight", "bias", "use_input_stats",
                      "momentum", "eps"),
    torch.instance_norm: ("input", "weight", "bias", "running_mean", "running_var",
                          "use_input_stats", "momentum", "eps", "cudnn_enabled"),
}  # fmt: skip
_BATCH_NORMS = {  # their arguments' names, in order
    F.batch_norm: ("input", "running_mean", "running_var", "weight", "bias", "training",
                   "momentum", "eps"),
    torch.batch_norm: ("input", "weight", "bias", "running_mean", "running_var", "training",
                       "momentum", "eps", "cudnn_enabled"),
}  # fmt: skip
_CUMULATIVE_LOG_SUMS = (torch.logcumsumexp, torch.Tensor.logcumsumexp)
_DETERMINANTS = (torch.linalg.det, torch.det, torch.Tensor.det)
