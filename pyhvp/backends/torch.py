"""The torch backend: the two primitives, eager and compiled.

Methods: eagerly, ``grad_and_hvp`` runs reverse-over-reverse with ``torch.autograd`` (a
batched second backward for k tangents), which has the lowest per-call overhead; compiled, it is
forward-over-reverse ``jvp(grad(sum f))`` vmapped over the tangents, which inductor fuses into a
few kernels. ``second_directional`` is forward-over-forward (``jvp`` of ``jvp``) in both modes.

Compilation rule (``TorchBackend(compile=...)``):

* ``"auto"`` (default): the first ``COMPILE_AFTER_CALLS`` calls with a given signature --
  (primitive, function, event_dims, chunk_size, shapes, dtypes, devices) -- run eagerly; later calls
  with the same signature run a ``torch.compile``-d kernel, cached for that signature. One-off
  calls never pay for compilation; loops that call thousands of times do so once.
* ``True``: compile from the first call. ``False``: always eager.
* Inputs that carry autograd history (``requires_grad`` with grad mode on) always run eagerly, so
  the results stay differentiable; otherwise results are detached on every path. Tensors that
  ``f`` captures (module parameters) are constants: pass them as args to differentiate through
  them.
* ``second_directional`` (forward-over-forward) on the CPU always runs eagerly: inductor's CPU
  code for nested forward-mode AD segfaults on torch 2.13 for common functions (pytorch#190856,
  #197067), and a segfault cannot be caught.
* If compilation or a compiled run fails while the eager run succeeds, pyhvp warns once per
  signature and runs that signature eagerly from then on; errors of ``f`` itself are raised as
  they would be eagerly, and out-of-memory errors are re-raised.
"""

from __future__ import annotations

import types
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
from torch.func import grad, jvp, vmap

from pyhvp._checks import check_output_shape

CompileMode = Literal["auto"] | bool

COMPILE_AFTER_CALLS = 2
"""With ``compile="auto"``, this many eager calls precede the first compiled one."""

CACHE_SIZE = 64
"""Signatures remembered (least recently used dropped first)."""


def _instance_sum(
    f: Callable[..., torch.Tensor], event_dims: int, args: Sequence[object]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``y -> f(y, *args).sum()``, checking that f returns one value per instance."""

    def total(y: torch.Tensor) -> torch.Tensor:
        out = f(y, *args)
        batch_shape = y.shape[: y.ndim - event_dims]
        check_output_shape("f", out, batch_shape, "one value per instance: x.shape[:-event_dims]")
        return out.sum()

    return total


def _grad_and_hvp_traced(
    f: Callable[..., torch.Tensor],
    event_dims: int,
    chunk_size: int | None,
    x: torch.Tensor,
    tangents: torch.Tensor,
    *args: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward-over-reverse, ``jvp(grad(sum f))`` vmapped over tangents: what gets compiled.

    The gradient is the primal output of the same jvp that yields the HVPs.
    """
    gradient = grad(_instance_sum(f, event_dims, args))

    def forward_over_reverse(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return jvp(gradient, (x,), (v,))

    if tangents.shape[0] == 1:
        g, hv = forward_over_reverse(tangents[0])
        return g, hv.unsqueeze(0)
    # vmap cannot chunk an unbatched (out_dims=None) output, so chunks are split by hand.
    chunks = [
        vmap(forward_over_reverse, out_dims=(None, 0))(part)
        for part in tangents.split(chunk_size or tangents.shape[0])
    ]
    return chunks[0][0], torch.cat([hv for _, hv in chunks])


def _grad_and_hvp_eager(
    f: Callable[..., torch.Tensor],
    event_dims: int,
    chunk_size: int | None,
    x: torch.Tensor,
    tangents: torch.Tensor,
    *args: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reverse-over-reverse with torch.autograd: one forward, one backward that keeps its graph,
    one (batched) backward per chunk of tangents. Eagerly this has the least per-call overhead,
    and results stay differentiable when the inputs carry autograd history."""
    keep_graph = _needs_autograd((x, tangents, *args))
    with torch.enable_grad():
        # an alias, not x itself: the partial derivative in x, never through args made from x
        y = x.view_as(x) if x.requires_grad else x.detach().requires_grad_()
        total = _instance_sum(f, event_dims, args)(y)
        (g,) = torch.autograd.grad(total, y, create_graph=True, materialize_grads=True)
        if not g.requires_grad:  # f is affine in x: the Hessian is zero
            return g.detach(), torch.zeros_like(tangents)
        parts = tangents.split(chunk_size or tangents.shape[0])
        hv = [
            torch.autograd.grad(
                g,
                y,
                part if len(part) > 1 else part[0],
                retain_graph=keep_graph or i < len(parts) - 1,
                create_graph=keep_graph,
                is_grads_batched=len(part) > 1,
                materialize_grads=True,
            )[0].reshape(part.shape)
            for i, part in enumerate(parts)
        ]
    return (g if keep_graph else g.detach()), (hv[0] if len(hv) == 1 else torch.cat(hv))


def _second_directional(
    f: Callable[..., torch.Tensor],
    chunk_size: int | None,
    x: torch.Tensor,
    directions: torch.Tensor,
    *args: object,
) -> torch.Tensor:
    def along(u: torch.Tensor) -> torch.Tensor:
        def first(y: torch.Tensor) -> torch.Tensor:
            return jvp(lambda z: f(z, *args), (y,), (u,))[1]

        return jvp(first, (x,), (u,))[1]

    return vmap(along, chunk_size=chunk_size)(directions)


@dataclass
class _Entry:
    calls: int = 0
    compiled: Callable[..., object] | None = None
    failed: bool = False


_CACHE: OrderedDict[Hashable, _Entry] = OrderedDict()


def _compile_bound(
    kernel: Callable[..., object], f: Callable[..., object], static: tuple[Hashable, ...]
) -> Callable[..., object]:
    """``torch.compile`` of ``kernel(f, *static, *inputs)`` as a function of the inputs alone.

    Dynamo keeps its compiled graphs (and its recompile limit, 8) per code object, so each cached
    signature gets a function with a code object of its own: many functions or shapes in one
    process then never evict each other or fall back to eager.
    """

    def bound(*inputs: object) -> object:
        return kernel(f, *static, *inputs)

    code = bound.__code__.replace()
    fresh = types.FunctionType(code, bound.__globals__, bound.__name__, None, bound.__closure__)
    return torch.compile(fresh, dynamic=False)


def _signature(
    primitive: str,
    f: Callable[..., object],
    static: tuple[Hashable, ...],
    tensors: Sequence[object],
) -> Hashable:
    def describe(value: object) -> Hashable:
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), value.dtype, value.device)
        return ("value", type(value).__name__)

    return (primitive, f, static, tuple(describe(t) for t in tensors))


def _needs_autograd(values: Sequence[object]) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(v, torch.Tensor) and v.requires_grad for v in values
    )


class TorchBackend:
    """torch.func primitives; ``compile`` is ``"auto"`` (default), ``True`` or ``False``."""

    name = "torch"

    def __init__(self, compile: CompileMode = "auto") -> None:
        if compile not in ("auto", True, False):
            raise ValueError(f"compile must be 'auto', True or False, got {compile!r}")
        self.compile = compile

    def __repr__(self) -> str:
        return f"TorchBackend(compile={self.compile!r})"

    def grad_and_hvp(
        self,
        f: Callable[..., torch.Tensor],
        x: torch.Tensor,
        tangents: torch.Tensor,
        args: Sequence[object],
        event_dims: int,
        chunk_size: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._run(
            _grad_and_hvp_eager,
            _grad_and_hvp_traced,
            f,
            (event_dims, chunk_size),
            (x, tangents, *args),
        )

    def second_directional(
        self,
        f: Callable[..., torch.Tensor],
        x: torch.Tensor,
        directions: torch.Tensor,
        args: Sequence[object],
        chunk_size: int | None,
    ) -> torch.Tensor:
        # Inductor's CPU code for nested forward-mode AD segfaults on common functions (a matmul
        # or product with a captured tensor; pytorch#190856, #197067): a crash no fallback can
        # catch, so on the CPU this primitive always runs eagerly.
        return self._run(
            _second_directional,
            _second_directional,
            f,
            (chunk_size,),
            (x, directions, *args),
            compilable=x.device.type != "cpu",
        )

    def _run(
        self,
        eager_kernel: Callable[..., object],
        traced_kernel: Callable[..., object],
        f: Callable[..., object],
        static: tuple[Hashable, ...],
        inputs: tuple[object, ...],
        compilable: bool = True,
    ) -> object:
        """Results carry autograd history exactly when grad mode is on and an input requires
        grad (eager then, graph kept); otherwise they are detached on every path, whatever f
        captures, and inference tensors are accepted."""
        eager = partial(eager_kernel, f, *static)
        if _needs_autograd(inputs):
            return eager(*inputs)
        inputs = tuple(
            t.clone() if isinstance(t, torch.Tensor) and t.is_inference() else t for t in inputs
        )
        with torch.inference_mode(False):
            out = self._dispatch(eager, traced_kernel, f, static, inputs, compilable)
        return tuple(t.detach() for t in out) if isinstance(out, tuple) else out.detach()

    def _dispatch(
        self,
        eager: Callable[..., object],
        traced_kernel: Callable[..., object],
        f: Callable[..., object],
        static: tuple[Hashable, ...],
        inputs: tuple[object, ...],
        compilable: bool,
    ) -> object:
        if self.compile is False or not compilable:
            return eager(*inputs)
        try:
            key = _signature(traced_kernel.__name__, f, static, inputs)
            hash(key)
        except TypeError:  # an unhashable function: nothing to cache it under
            return eager(*inputs)
        entry = _CACHE.pop(key, None) or _Entry()
        _CACHE[key] = entry
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
        entry.calls += 1
        threshold = 1 if self.compile is True else COMPILE_AFTER_CALLS + 1
        if entry.failed or entry.calls < threshold:
            return eager(*inputs)
        if entry.compiled is None:
            entry.compiled = _compile_bound(traced_kernel, f, static)
        try:
            return entry.compiled(*inputs)
        except torch.cuda.OutOfMemoryError:  # torch.OutOfMemoryError only exists from 2.5
            raise
        except Exception as error:  # compile is an optimisation: fall back, say so once
            result = eager(*inputs)  # an error of f's own is raised here, as eagerly
            entry.failed = True
            warnings.warn(
                f"pyhvp: torch.compile failed for {getattr(f, '__name__', f)!s} "
                f"({type(error).__name__}: {error}); running this signature eagerly",
                RuntimeWarning,
                stacklevel=5,
            )
            return result
