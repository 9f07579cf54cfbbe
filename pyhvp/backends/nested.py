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
recorder's dispatch mode segfaulted (``x ** 5`` inside ``torch.func.grad``). Four norms,
``logcumsumexp``, vector norms and ``cdist`` run written out in elementary ops
(``_Elementary``): torch's third and higher reverse-mode derivatives of ``layer_norm`` are wrong,
its nested ones of ``instance_norm`` and of ``batch_norm`` in training under ``vmap`` from the
second on, its batched double backward of ``group_norm`` fails, its nested ones of
``logcumsumexp`` are NaN (the backward takes the log of the cotangent), those of a vector norm
at a zero vector are NaN from the second on (the engine's convention there is zero
derivatives), and ``cdist`` has no second. Attention takes its math path, as under the
recorder: its fused kernels have no second derivative. The Hessian-vector products inside a transform run ``f`` the same
way (``written_out``): a ``grad`` around them makes a third derivative.
A determinant's third is wrong too: refused where it would be differentiated more than twice
-- the operator's order and the ``grad`` / ``jvp`` levels around it, or an outer operator's
record --, as an op without a derivative is (the note says to call the operator outside the
transform, whose result autograd differentiates).
"""

from __future__ import annotations

import math
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
from pyhvp._norms import PARAMETERS, per_channel
from pyhvp._sinc import torchs_sinc_input
from pyhvp._user_errors import note
from pyhvp._vector_norms import zero_safe_norm
from pyhvp.taylor.program import logcumsumexp_by_prefixes
from pyhvp.taylor.rules.elementwise import at_least_float32, sinc_written_out


def taylor_coefficients(
    f: Callable[..., torch.Tensor], x: torch.Tensor, directions: torch.Tensor,
    args: Sequence[object], chunk_size: int | None, mode: taylor.JetMode,
    weights: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """``TorchBackend.taylor_coefficients`` by ``mode.order`` nested derivatives along each of
    ``directions`` (``(k, *x.shape)``), vmapped over them, of a contiguous ``x`` of the caller's
    own (a stride-0 ``x`` is refused by the transforms)."""

    def value(y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with _Elementary(), math_attention:
            return (f(y, *args),)

    def derivatives(u: torch.Tensor) -> tuple[torch.Tensor, ...]:
        coefficients: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] = value
        for _ in range(mode.order):
            coefficients = _along(coefficients, u)
        return coefficients(x)

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


def written_out(
    f: Callable[..., torch.Tensor], cumulative: bool = True
) -> Callable[..., torch.Tensor]:
    """``f`` run under :class:`_Elementary` (``logcumsumexp`` written out too with
    ``cumulative``), attention on its math path: what the Hessian-vector products differentiate
    inside a transform, or where their results are differentiated."""

    def run(*inputs: object) -> torch.Tensor:
        with _Elementary(cumulative), math_attention:
            return f(*inputs)

    run.__name__ = getattr(f, "__name__", type(f).__name__)  # (what messages name)
    return run


class _Elementary(TorchFunctionMode):
    """``f`` with ``layer_norm``, ``group_norm``, ``instance_norm`` and ``batch_norm`` (of the
    input's own statistics), vector norms, ``F.normalize``, ``cdist``, the tanh-approximated
    ``gelu``, ``sinc`` and, with ``cumulative``, ``logcumsumexp`` written out in elementary ops (whose
    nested reverse-mode derivatives torch gets right), and a determinant refused where it is
    differentiated more than twice."""

    def __init__(self, cumulative: bool = True) -> None:
        super().__init__()
        self.cumulative = cumulative

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:  # fmt: skip
        kwargs = kwargs or {}
        if func in _NORMS:
            written = _written_norm(func, args, kwargs)
            if written is not None:
                return written
        if func in _VECTOR_NORMS and kwargs.get("out") is None:
            written = _written_vector_norm(func, args, kwargs)
            if written is not None:
                return written
        if func is F.gelu:
            written = _written_gelu_tanh(args, kwargs)
            if written is not None:
                return written
        sinc_input = torchs_sinc_input(func, args, kwargs)
        if sinc_input is not None:
            return sinc_written_out(sinc_input)
        if func in _CUMULATIVE_LOG_SUMS and self.cumulative and kwargs.get("out") is None:
            bound = dict(zip(("input", "dim"), args, strict=False)) | kwargs
            input = bound.get("input")
            if isinstance(input, torch.Tensor) and input.ndim and input.is_floating_point():
                return logcumsumexp_by_prefixes(input, bound["dim"])
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


def _written_norm(
    func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> torch.Tensor | None:
    """A layer, group, instance or batch norm of its input's own statistics in elementary ops,
    in float32 at least (as torch's kernels accumulate: a half variance overflows past 256),
    once torch's own op has checked the arguments (a group count that does not divide the
    channels, one value per channel) and updated the running statistics it is given; None for
    a norm of its running statistics (in eval), or of nothing."""
    bound = dict(zip(_NORMS[func], args, strict=False)) | kwargs
    input, weight, bias = bound["input"], bound.get("weight"), bound.get("bias")
    if func in _BATCH_NORMS and not bound.get("training", False):
        return None  # (of its running statistics: an affine map, which torch gets right)
    if func in _INSTANCE_NORMS and not bound.get("use_input_stats", True):
        return None
    if not input.numel():
        return None
    with torch.no_grad():  # torch's argument checks, and its one update of running statistics
        func(*args, **kwargs)  # (its value is not differentiated)
    wide = at_least_float32(input)
    eps = bound.get("eps", 1e-5)
    if func in _LAYER_NORMS:
        out = _normalised(wide, tuple(range(-len(bound["normalized_shape"]), 0)), eps)
        out = out if weight is None else out * weight
        out = out if bias is None else out + bias
    else:
        channels = wide.shape[1]
        groups = bound["num_groups"] if func in _GROUP_NORMS else channels
        if func in _BATCH_NORMS:  # each channel over the batch and positions
            normed = _normalised(wide, (0, *range(2, wide.ndim)), eps)
        else:  # each instance's group over its channels and positions
            grouped = wide.reshape(wide.shape[0], groups, -1)
            normed = _normalised(grouped, (-1,), eps).reshape(wide.shape)
        out = per_channel(normed, weight, bias)
    return out.to(input.dtype)


def _written_vector_norm(
    func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> torch.Tensor | None:
    """A vector ``p``-norm (``p > 1``, finite), ``cdist`` or ``F.normalize`` of tensors that
    carry derivatives, with the engine's convention at a zero vector: zero derivatives of every
    order (:func:`zero_safe_norm`). None where ``func`` computes another norm (a matrix norm,
    ``p`` of 1, 0 or infinite: torch's derivatives are finite there) or one of constants (no
    ``(P, R, M)`` differences for a ``cdist`` of data)."""
    bound = dict(zip(_VECTOR_NORMS[func], args, strict=False)) | kwargs
    if not any(_carries_derivatives(bound.get(name)) for name in ("input", "x1", "x2")):
        return None
    if func is torch.cdist:
        a, b = bound["x1"], bound["x2"]
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return None
        difference = a.unsqueeze(-2) - b.unsqueeze(-3)  # (..., P, R, M)
        p = bound.get("p", 2.0)
        written = zero_safe_norm(difference, p, (-1,), False, None)
        return written if written is not None else torch.linalg.vector_norm(difference, p, -1)
    input, dim, keepdim = bound["input"], bound.get("dim"), bound.get("keepdim", False)
    if func is F.normalize:  # input over its norm along dim, at least eps
        norm = zero_safe_norm(input, bound.get("p", 2.0), _dims(bound.get("dim", 1)), True, None)
        return None if norm is None else input / norm.clamp_min(bound.get("eps", 1e-12))
    if func is torch.linalg.norm:  # a vector norm where ord is None or dim names one dim
        ord = bound.get("ord")
        one_dim = isinstance(dim, int) or (dim is None and input.ndim == 1)
        if isinstance(dim, (tuple, list)) and not dim:
            return None  # (torch refuses it)
        if ord is not None and not (one_dim and isinstance(ord, (int, float))):
            return None
        ord = 2 if ord is None else ord
    elif func is torch.linalg.vector_norm:
        ord = bound.get("ord", 2)
    else:  # torch.norm, Tensor.norm: "fro" over at most two dims is the 2-norm
        ord = bound.get("p", "fro")
        if ord == "fro" and (dim is None or isinstance(dim, int) or len(dim) <= 2):
            ord = 2
        ord = 2 if ord is None else ord
    if not isinstance(ord, (int, float)) or isinstance(ord, bool):
        return None
    return zero_safe_norm(input, ord, _dims(dim), keepdim, bound.get("dtype"))


def _written_gelu_tanh(args: Sequence[Any], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``F.gelu``'s tanh approximation in elementary ops: torch's third and higher nested
    derivatives of it are NaN where ``|input| > 21`` (its double backward overflows; they are 0
    there to double precision). None for the exact gelu."""
    bound = dict(zip(("input", "approximate"), args, strict=False)) | kwargs
    if bound.get("approximate") != "tanh":
        return None
    input = cast(torch.Tensor, bound["input"])
    u = at_least_float32(input)
    gelu = 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))
    return gelu.to(input.dtype)


def _carries_derivatives(value: object) -> bool:
    """Whether ``value`` is a tensor autograd or the innermost ``torch.func`` level
    differentiates (a view of captured data there is wrapped too, but does not require grad)."""
    return isinstance(value, torch.Tensor) and value.requires_grad


def _dims(dim: object) -> tuple[int, ...] | None:
    """A reduction's ``dim`` as a tuple; None for every dim (``None``, and torch's ``()``)."""
    if dim is None:
        return None
    dims = (dim,) if isinstance(dim, int) else tuple(cast(Sequence[int], dim))
    return dims or None


def _normalised(input: torch.Tensor, dims: tuple[int, ...], eps: float) -> torch.Tensor:
    """``input`` less its mean over ``dims``, over its standard deviation there (biased)."""
    centred = input - input.mean(dims, keepdim=True)
    return centred * torch.rsqrt((centred * centred).mean(dims, keepdim=True) + eps)


Names = tuple[str, ...]
_LAYER_NORMS: dict[Callable[..., Any], Names] = {  # their arguments' names, in order
    F.layer_norm: ("input", "normalized_shape", "weight", "bias", "eps"),
    torch.layer_norm: PARAMETERS["layer_norm"],
}
_GROUP_NORMS: dict[Callable[..., Any], Names] = {
    F.group_norm: ("input", "num_groups", "weight", "bias", "eps"),
    torch.group_norm: PARAMETERS["group_norm"],
}
_INSTANCE_NORMS: dict[Callable[..., Any], Names] = {
    F.instance_norm: ("input", "running_mean", "running_var", "weight", "bias", "use_input_stats",
                      "momentum", "eps"),
    torch.instance_norm: PARAMETERS["instance_norm"],
}  # fmt: skip
_BATCH_NORMS: dict[Callable[..., Any], Names] = {
    F.batch_norm: ("input", "running_mean", "running_var", "weight", "bias", "training",
                   "momentum", "eps"),
    torch.batch_norm: PARAMETERS["batch_norm"],
}  # fmt: skip
_NORMS = {**_LAYER_NORMS, **_GROUP_NORMS, **_INSTANCE_NORMS, **_BATCH_NORMS}
_VECTOR_NORMS: dict[Callable[..., Any], Names] = {
    torch.linalg.vector_norm: ("input", "ord", "dim", "keepdim"),
    torch.linalg.norm: ("input", "ord", "dim", "keepdim"),
    torch.norm: ("input", "p", "dim", "keepdim", "out", "dtype"),
    torch.Tensor.norm: ("input", "p", "dim", "keepdim", "dtype"),
    torch.cdist: ("x1", "x2", "p", "compute_mode"),
    F.normalize: ("input", "p", "dim", "eps", "out"),
}
_CUMULATIVE_LOG_SUMS = (torch.logcumsumexp, torch.Tensor.logcumsumexp)
_DETERMINANTS = (torch.linalg.det, torch.det, torch.Tensor.det)
