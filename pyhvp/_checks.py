"""Argument validation shared by every operator.

Each check raises at the boundary with a message that names the argument and states the expected
and the actual shape / dtype / device: ``TypeError`` for a wrong kind of value (not a tensor, not a
floating dtype), ``ValueError`` for shapes, devices, dtypes that disagree and out-of-range options.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch
from torch.utils import _pytree as pytree

Shape = tuple[int, ...]


def fmt_shape(shape: Sequence[int | str]) -> str:
    """``(4, 3)`` style, ``()`` for scalars; symbolic dims such as ``"k"`` are kept."""
    dims = [str(int(d)) if not isinstance(d, str) else d for d in shape]
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


def require_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.is_meta:
        raise ValueError(
            f"{name} must hold values (on the CPU or a GPU), got a tensor on the meta device, "
            "which has shapes only"
        )
    if value.is_nested:  # (its sizes raise torch's "Internal error" at the first shape check)
        raise TypeError(
            f"{name} must be a regular tensor, got a nested tensor (instances of several "
            "shapes): pad it to one shape (torch.nested.to_padded_tensor) or call per shape"
        )
    return value


def require_generator(generator: object) -> None:
    """``generator`` is None or a ``torch.Generator`` (torch refuses to make one on the meta
    device)."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator or None, got {type(generator).__name__}"
        )


def plain_tensor(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain ``torch.Tensor`` aliasing it (its autograd history kept) where it is of a
    subclass that only tags it (``class Tagged(torch.Tensor): pass``: its ops are torch's, their
    results re-wrapped as new objects, which the Taylor engine's recorder cannot follow: until
    2026-12-07 a Hessian diagonal of zeros). A subclass with a ``__torch_function__`` or
    ``__torch_dispatch__`` of its own, whose ops the engine cannot see, raises ``TypeError``;
    one that disables ``__torch_function__`` (``nn.Parameter``) is kept."""
    cls = type(t)
    if cls is torch.Tensor or cls.__torch_function__ is torch._C._disabled_torch_function_impl:
        return t
    require_tensor(name, t)  # (a jagged nested tensor is a subclass: said as nested)
    if (
        getattr(cls.__torch_function__, "__func__", None) is not _TENSOR_FUNCTION
        or cls.__torch_dispatch__ is not torch._C._disabled_torch_dispatch_impl
    ):
        raise TypeError(
            f"{name} is a {cls.__name__}, a tensor subclass with its own __torch_function__ or "
            "__torch_dispatch__, whose operations the Taylor engine cannot follow: pass plain "
            "tensors (t.as_subclass(torch.Tensor))"
        )
    return t.as_subclass(torch.Tensor)


_TENSOR_FUNCTION = getattr(torch.Tensor.__torch_function__, "__func__", None)


def require_dense(name: str, value: object) -> torch.Tensor:
    """A tensor of the strided layout: what an operator differentiates or indexes by (a sparse
    one, held constant in ``args`` or an unselected parameter, is the function's business)."""
    tensor = require_tensor(name, value)
    if tensor.layout != torch.strided:
        layout = str(tensor.layout).removeprefix("torch.")
        raise TypeError(
            f"{name} must be a dense (strided) tensor, got a {layout} one; convert it with "
            ".to_dense()"
        )
    return tensor


def require_floating(name: str, value: object) -> torch.Tensor:
    tensor = require_dense(name, value)
    if not tensor.is_floating_point():
        raise TypeError(
            f"{name} must have a floating dtype (float32/float64/...), got {tensor.dtype}"
        )
    if tensor.dtype.itemsize < 2:  # float8 (and packed float4): storage formats, not for math
        raise TypeError(
            f"{name} must have a dtype torch computes and differentiates in (float16, bfloat16, "
            f"float32, float64), got {tensor.dtype}: cast it first (.float())"
        )
    return tensor


def require_like(name: str, tensor: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """``tensor`` must live on ``ref``'s device and have its dtype."""
    if tensor.device != ref.device:
        raise ValueError(
            f"{name} must be on {ref_name}'s device {ref.device}, got {name} on {tensor.device}"
        )
    if tensor.dtype != ref.dtype:
        raise ValueError(f"{name} must have {ref_name}'s dtype {ref.dtype}, got {tensor.dtype}")


def as_int(value: object) -> int | None:
    """``value`` as a Python int where it is an integer -- a Python or NumPy int, not a bool --
    else None.

    >>> import numpy as np
    >>> as_int(np.int64(2)), as_int(True), as_int(2.0)
    (2, None, None)
    """
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def require_instance_variables(x: torch.Tensor, event_dims: int) -> int:
    """The number of variables per instance (the product of ``x``'s last ``event_dims`` dims),
    which must be at least one."""
    n_vars = math.prod(x.shape[x.ndim - event_dims :])
    if n_vars == 0:
        raise ValueError(
            f"x must have at least one variable per instance, got x of shape "
            f"{fmt_shape(x.shape)} with event_dims={event_dims}"
        )
    return n_vars


def check_event_dims(event_dims: object, x: torch.Tensor) -> int:
    dims = as_int(event_dims)
    if dims is None:
        raise TypeError(f"event_dims must be an int, got {type(event_dims).__name__}")
    if x.ndim == 0:
        raise ValueError(
            f"x must have at least one dimension (the last event_dims={dims} are one instance), "
            "got a 0-d tensor: pass x[None] for a single scalar input"
        )
    if not 1 <= dims <= x.ndim:
        raise ValueError(
            f"event_dims must be between 1 and x.ndim={x.ndim} (x has shape {fmt_shape(x.shape)}), "
            f"got {dims}"
        )
    return dims


def check_args(args: Sequence[object], x: torch.Tensor) -> None:
    """Extra tensor arguments, and the tensors inside container arguments (a dict of
    parameters), live on x's device; floating ones share x's dtype. Each is named by its path:
    ``args[0]``, ``args[1]['weight']``."""
    refuse_arrays("args", tuple(args), ", dtype=x.dtype, device=x.device")
    leaves, _ = pytree.tree_flatten_with_path(tuple(args))
    for path, arg in leaves:
        name = "args" + pytree.keystr(path)
        if not isinstance(arg, torch.Tensor):
            continue
        if arg.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {name} on {arg.device}")
        if arg.is_floating_point() and arg.dtype != x.dtype:
            raise ValueError(
                f"{name} must have x's dtype {x.dtype} (floating args are not promoted), "
                f"got {arg.dtype}"
            )


def refuse_arrays(name: str, value: object, options: str = "") -> None:
    """No NumPy array (nor another array that is not a tensor) in ``value``, a pytree named
    ``name``: with tensors, NumPy computes the result, which carries no derivative. Scalars
    (``np.float32(2.0)``, 0-d) are numbers to torch, and fine."""
    leaves, _ = pytree.tree_flatten_with_path(value)
    for path, leaf in leaves:
        ndim: object = getattr(leaf, "ndim", None)
        if not isinstance(leaf, torch.Tensor) and isinstance(ndim, int) and ndim > 0:
            where = name + pytree.keystr(path)
            raise TypeError(
                f"{where} must be a torch.Tensor, got a {type(leaf).__module__}."
                f"{type(leaf).__qualname__}: pass torch.as_tensor({where}{options}). With "
                f"tensors, an array makes NumPy compute the result, which carries no derivative"
            )


def check_tangents(name: str, v: object, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Return ``(tangents of shape (k, *x.shape), single)``; single when v has x's shape."""
    v = require_floating(name, v)
    if v.shape == x.shape:
        tangents, single = v.unsqueeze(0), True
    elif v.ndim == x.ndim + 1 and v.shape[1:] == x.shape:
        if v.shape[0] == 0:
            raise ValueError(
                f"{name} must hold k >= 1 tangents per instance when shaped "
                f"{fmt_shape(('k', *x.shape))}, got k = 0 ({name} of shape {fmt_shape(v.shape)})"
            )
        tangents, single = v, False
    else:
        raise ValueError(
            f"{name} must have x's shape {fmt_shape(x.shape)} (one tangent per instance) or "
            f"{fmt_shape(('k', *x.shape))} (k tangents per instance), got {fmt_shape(v.shape)}"
        )
    require_like(name, tangents, "x", x)
    return tangents, single


def unshared(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, copied where an expanded dim (stride 0) makes its entries share memory: a
    result one row of which is every instance's (the gradient of an ``f`` linear in ``x``), so
    that a write to one instance's (``g[0] = 0``) reaches no other."""
    dims = zip(tensor.stride(), tensor.shape, strict=True)
    return tensor.contiguous() if any(s == 0 and n > 1 for s, n in dims) else tensor


NOT_A_TENSOR_HINTS = {
    "ndarray": "pyhvp differentiates f through torch operations: write it with torch functions "
    "on x (torch.sin, not np.sin); NumPy cannot be differentiated",
}
"""What to do instead, by the type name of a function's output that is not a tensor."""


def require_output_tensor(what: str, out: object) -> torch.Tensor:
    """``out`` must be a real floating tensor; ``what`` names the function (``f``, ``loss``)."""
    if not isinstance(out, torch.Tensor):
        name = type(out).__name__
        hint = NOT_A_TENSOR_HINTS.get(name)
        raise TypeError(
            f"{what} must return a torch.Tensor, got {name}" + (f": {hint}" if hint else "")
        )
    if not out.is_floating_point():
        raise TypeError(f"{what} must return a real floating tensor, got {out.dtype}")
    if out.is_meta:  # (no values: an operator read zeros or failed inside torch)
        raise ValueError(
            f"{what} must return a tensor that holds values, got one on the meta device: "
            f"a module made there (lazily) needs .to_empty(device=...) and its weights loaded"
        )
    return out


def trailing_one_hint(what: str, got: Sequence[int], expected: Sequence[int]) -> str:
    """How to drop a trailing dim of size 1 (a network ending in ``Linear(..., 1)``) when
    ``got`` is ``expected`` with one more such dim, else ``""``."""
    if tuple(got) != (*expected, 1):
        return ""
    if what == "f":
        return (
            "; f keeps a trailing dim of size 1 (an nn.Module ending in Linear(..., 1)?): pass "
            "lambda x: net(x)[..., 0] or lambda x: net(x).squeeze(-1)"
        )
    return f"; {what} keeps a trailing dim of size 1: return its [..., 0] or .squeeze(-1)"


def event_dims_hint(what: str, got: Sequence[int], batch: Sequence[int]) -> str:
    """How to make the instances bigger when ``f`` returns one value per leading part of the
    batch dims (a walker's ``(N, 3)`` positions summed, with the default ``event_dims=1``), else
    ``""``."""
    if what != "f" or not 1 <= len(got) < len(batch) or tuple(got) != tuple(batch[: len(got)]):
        return ""
    more = len(batch) - len(got)
    return (
        f"; f returns one value per x.shape[:{len(got)}]: if one instance is more of x's "
        f"trailing dims (a walker's (N, 3) positions), raise event_dims by {more} "
        f"(event_dims={1 + more} from the default 1)"
    )


def check_output(what: str, out: object, expected: Sequence[int], hint: str) -> None:
    """``out`` must be a real floating tensor of shape ``expected``; ``hint`` says what the
    shape means."""
    out = require_output_tensor(what, out)
    if tuple(out.shape) != tuple(expected):
        raise ValueError(
            f"{what} must return shape {fmt_shape(expected)} ({hint}), got "
            f"{fmt_shape(out.shape)}{trailing_one_hint(what, out.shape, expected)}"
            + event_dims_hint(what, out.shape, expected)
        )


def check_batched_output(
    out: object, batch: Sequence[int], scalar_hint: str | None = None
) -> torch.Tensor:
    """``f``'s output: a real floating tensor of shape ``batch + out_shape``; with
    ``scalar_hint`` (why, and what to do instead), ``out_shape`` must be ``()``."""
    out = require_output_tensor("f", out)
    batch = tuple(batch)
    if tuple(out.shape[: len(batch)]) != batch:
        raise ValueError(
            f"f must return batch_shape + out_shape with batch_shape = {fmt_shape(batch)} "
            f"(x.shape[:-event_dims]), got {fmt_shape(out.shape)}"
            + event_dims_hint("f", out.shape, batch)
        )
    if scalar_hint is not None and out.ndim != len(batch):
        raise ValueError(
            f"{scalar_hint}: f must return one scalar per instance (shape {fmt_shape(batch)}); "
            f"f returns out_shape {fmt_shape(out.shape[len(batch) :])} per instance"
            + trailing_one_hint("f", out.shape, batch)
        )
    return out


def check_chunk_size(chunk_size: object) -> int | None:
    if chunk_size is None:
        return None
    size = as_int(chunk_size)
    if size is None or size < 1:
        raise ValueError(f"chunk_size must be None or a positive int, got {chunk_size!r}")
    return size


def per_arg_event_dims(
    arg_event_dims: int | Sequence[int] | None, event_dims: int, n_args: int
) -> tuple[int, ...]:
    """Each arg's number of trailing per-instance dims (default: x's ``event_dims``)."""
    if arg_event_dims is None:
        return (event_dims,) * n_args
    one = as_int(arg_event_dims)  # (a NumPy int too, as event_dims takes)
    given = (one,) * n_args if one is not None else arg_event_dims
    dims = [as_int(d) for d in given] if isinstance(given, Sequence) else [None]
    checked = [d for d in dims if d is not None and d >= 0]
    if len(checked) != len(dims):
        raise ValueError(
            f"arg_event_dims must be None, an int >= 0 or one int >= 0 per arg, got {arg_event_dims!r}"
        )
    if len(checked) != n_args:
        raise ValueError(
            f"arg_event_dims must give one entry per arg ({n_args} args), got {len(dims)} entries"
        )
    return tuple(checked)


def checked_arg_event_dims(
    arg_event_dims: int | Sequence[int] | None,
) -> int | tuple[int, ...] | None:
    """``arg_event_dims`` as a function of args takes it (:func:`pyhvp.per_instance`,
    :func:`pyhvp.julia_function`), checked when the function is made, not at its first call:
    None, an int >= 0, or one such int per arg (a tuple)."""
    if isinstance(arg_event_dims, Sequence) and not isinstance(arg_event_dims, str):
        return per_arg_event_dims(tuple(arg_event_dims), 0, len(arg_event_dims))
    if arg_event_dims is not None:
        per_arg_event_dims(arg_event_dims, 0, 1)
    return arg_event_dims


def pad_arg_to_batch(
    name: str, arg: torch.Tensor, own_dims: int, batch_shape: torch.Size
) -> torch.Tensor:
    """View ``arg`` as ``batch-broadcastable dims + own dims``, checking it broadcasts."""
    if arg.ndim < own_dims:
        raise ValueError(
            f"{name} must have at least {own_dims} per-instance dims (arg_event_dims), got shape "
            f"{fmt_shape(arg.shape)}"
        )
    lead = arg.shape[: arg.ndim - own_dims]
    if len(lead) > len(batch_shape) or any(
        a not in (1, b) for a, b in zip(reversed(lead), reversed(batch_shape), strict=False)
    ):
        raise ValueError(
            f"{name}'s leading dims {fmt_shape(lead)} must broadcast against x's batch dims "
            f"{fmt_shape(batch_shape)} (its last {own_dims} dims are per-instance); for one "
            f"tensor that every instance shares, give it arg_event_dims={arg.ndim}"
        )
    return arg.reshape((1,) * (len(batch_shape) - len(lead)) + tuple(arg.shape))
