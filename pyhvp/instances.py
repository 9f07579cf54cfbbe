"""Instance structure: batched functions built from single-instance ones.

``per_instance(f_single)`` turns a function of ONE instance into a batched function by nesting
one ``vmap`` per batch dim. The result is a :class:`PerInstance` value that keeps what it was
built from (``f_single``, ``event_dims``, ``arg_event_dims``), so operators can exploit the
structure (e.g. push basis directions inside the instance vmap, where they are the same for every
instance), and two wrappers of the same function compare equal (one compile cache entry).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar, cast

import torch
from torch.func import vmap
from torch.utils import _pytree as pytree

from pyhvp import _random_state as random_states
from pyhvp._checks import (
    as_int,
    check_args,
    check_batched_output,
    check_event_dims,
    checked_arg_event_dims,
    fmt_shape,
    pad_arg_to_batch,
    per_arg_event_dims,
    require_floating,
    require_generator,
    require_instance_variables,
)
from pyhvp._public import public_operator
from pyhvp._user_errors import note, stacklevel_outside_pyhvp
from pyhvp.backends import nested
from pyhvp.backends.torch import Watched, _normal, write_to_x_refusal
from pyhvp.restricted.state import Recording, Snapshot, without_dynamo
from pyhvp.taylor import InPlaceInputError

Out = TypeVar("Out")
"""What a per-instance function returns (a tensor or a tuple of tensors); batched alike."""


@dataclass(frozen=True)
class PerInstance:
    """A batched function made of a single-instance one: ``f(x, *args)[b] = f_single(x[b], *args[b])``.

    ``f_single`` takes one instance's variables (``event_dims`` dims) and args, and returns a
    tensor of any shape ``out_shape`` (``()`` for a scalar); the batched call returns
    ``x.shape[:-event_dims] + out_shape``. Build it with :func:`per_instance`.
    """

    f_single: Callable[..., torch.Tensor]
    event_dims: int = 1
    arg_event_dims: int | tuple[int, ...] | None = None

    @property
    def __name__(self) -> str:  # what messages and warnings print
        return f"per_instance({getattr(self.f_single, '__name__', 'f')})"

    def batch_args(self, x: torch.Tensor, args: Sequence[object]) -> tuple[object, ...]:
        """Tensor args viewed as ``batch-broadcastable dims + own dims`` (checked, no copy)."""
        batch_shape = x.shape[: x.ndim - self.event_dims]
        own_dims = per_arg_event_dims(self.arg_event_dims, self.event_dims, len(args))
        if self.arg_event_dims is None:
            self._warn_ambiguous(x, args, own_dims)
        return tuple(
            pad_arg_to_batch(f"args[{i}]", a, d, batch_shape) if isinstance(a, torch.Tensor) else a
            for i, (a, d) in enumerate(zip(args, own_dims, strict=True))
        )

    def map(self, fn_single: Callable[..., Out], x: torch.Tensor, *args: object) -> Out:
        """``fn_single(x_b, *args_b)`` for every instance ``b``, stacked over x's batch dims.

        ``fn_single`` may return a tensor or a tuple of tensors; each gets x's batch dims in
        front. This is the batched call with ``f_single`` replaced by any per-instance transform
        of it, so tensors created inside ``fn_single`` (basis directions) are not batched.
        """
        x = require_floating("x", x)
        check_event_dims(self.event_dims, x)
        batched = self.batch_args(x, args)
        try:
            return vmap_batch_dims(fn_single, x.ndim - self.event_dims)(x, *batched)
        except (RuntimeError, IndexError) as error:
            # an arg the operators refuse by name (NumPy, another device or dtype), called
            # directly: named here, where it failed (a check on every call costs each HVP)
            check_args(args, x)
            hint = self.whole_arg_hint(x, args) if _shape_error(error) else None
            if hint is None and str(error).startswith(_VMAP_REFUSALS):
                hint = VMAP_HINT
            if hint is not None:
                note(error, hint)
            raise

    def _warn_ambiguous(self, x: torch.Tensor, args: Sequence[object], own_dims: Sequence[int]
                        ) -> None:  # fmt: skip
        """Warn where x's batch dims equal its instances' leading dims (B == N) and a tensor arg
        starts with them: its shape reads both as one entry per instance and as one tensor all
        instances share, and the default ``arg_event_dims`` picks one without a word (a shared
        ``(N, N)`` matrix read as one row per instance gave a diagonal 7 off in 1.9)."""
        batch = tuple(x.shape[: x.ndim - self.event_dims])
        coincide = bool(batch) and batch == tuple(x.shape[len(batch) : 2 * len(batch)])
        if not coincide or torch.compiler.is_compiling():  # (the eager call before says it)
            return
        for i, (arg, own) in enumerate(zip(args, own_dims, strict=True)):
            if not isinstance(arg, torch.Tensor) or tuple(arg.shape[: len(batch)]) != batch:
                continue
            read = ("one entry per instance" if arg.ndim - own >= len(batch)
                    else "one tensor that every instance shares")  # fmt: skip
            warnings.warn(
                f"per_instance reads args[{i}] of shape {fmt_shape(arg.shape)} as {read} "
                f"(arg_event_dims defaults to event_dims={self.event_dims}); x of shape "
                f"{fmt_shape(x.shape)} has as many instances as each has variables, so the "
                f"arg's shape cannot tell one entry per instance from one tensor all share: "
                f"give arg_event_dims={arg.ndim - len(batch)} for one entry per instance or "
                f"{arg.ndim} for one shared tensor (per_instance(f_single, arg_event_dims=...), "
                f"an int for every arg or one per arg)",
                UserWarning,
                stacklevel=stacklevel_outside_pyhvp(),
            )

    def whole_arg_hint(self, x: torch.Tensor, args: Sequence[object]) -> str | None:
        """For an error of ``f_single``, or an output of another shape than the caller takes (a
        ``(B, B)`` where an HVP takes ``(B,)``): a tensor arg that starts with x's batch dims but
        has none under its ``arg_event_dims`` (a ``(B,)`` scale with the default 1) went whole
        to every instance, where its shape says one entry per instance."""
        batch = tuple(x.shape[: x.ndim - self.event_dims])
        own_dims = per_arg_event_dims(self.arg_event_dims, self.event_dims, len(args))
        for i, (arg, own) in enumerate(zip(args, own_dims, strict=True)):
            if not isinstance(arg, torch.Tensor) or not batch or arg.ndim - own >= len(batch):
                continue
            if tuple(arg.shape[: len(batch)]) == batch:
                return (
                    f"args[{i}] of shape {fmt_shape(arg.shape)} went whole to every instance: "
                    f"per_instance takes its last {own} dims as one instance's (arg_event_dims, "
                    f"default event_dims={self.event_dims}). If it holds one entry per instance "
                    f"(its leading dims are x's batch dims {fmt_shape(batch)}), give it "
                    f"arg_event_dims={arg.ndim - len(batch)}: per_instance(f_single, "
                    f"arg_event_dims=...), an int for every arg or one per arg"
                )
        return None

    def __call__(self, x: torch.Tensor, *args: object) -> torch.Tensor:
        def checked(*instance: object) -> torch.Tensor:
            out = self.f_single(*instance)
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"f_single must return a torch.Tensor, got {type(out).__name__}")
            return out

        return self.map(checked, x, *args)


_VMAP_REFUSALS = ("vmap: ", "Cannot access data pointer of Tensor that doesn't have storage")
"""The starts of ``vmap``'s refusals of what ``f_single`` does (``.item()``, a branch on a value, a
boolean mask; NumPy, whose array needs the memory a batched tensor does not have)."""

VMAP_HINT = (
    "per_instance runs f_single under torch.func.vmap, over every instance at once: its tensors "
    "are batched, so NumPy (.numpy()), .item(), a Python branch on a tensor's value and "
    "boolean-mask indexing cannot run in it. Write them with torch ops (torch.where, a mask "
    "multiplied in), or pass a batched f of your own instead of per_instance(f_single)"
)


def check_event_dims_of(f: object, event_dims: object, x: torch.Tensor) -> int:
    """``check_event_dims``, and for a :class:`PerInstance` ``f`` the ``event_dims`` it was
    built with: another would cut ``x`` into other instances than ``f``'s (other results,
    silently). A class for ``f`` (``nn.Tanh``, not ``nn.Tanh()``) is refused first: called on
    ``x`` it made an instance or failed in its ``__init__``, naming no argument."""
    if isinstance(f, type):
        raise TypeError(
            f"f must be a function of x, got the class {f.__name__} itself: pass an instance "
            f"({f.__name__}(...)) or a function"
        )
    event_dims = check_event_dims(event_dims, x)
    if isinstance(f, PerInstance) and f.event_dims != event_dims:
        raise ValueError(
            f"event_dims must be f's: f is per_instance(..., event_dims={f.event_dims}), got "
            f"event_dims={event_dims} (pass event_dims={f.event_dims})"
        )
    return event_dims


def per_instance(
    f_single: Callable[..., torch.Tensor],
    event_dims: int = 1,
    arg_event_dims: int | Sequence[int] | None = None,
) -> PerInstance:
    """Turn a single-instance function into a batched one (vmap over all batch dims, no copies).

    ``f_single(x_i, *args_i)`` takes one instance's variables (``event_dims`` dims) and returns a
    tensor of any shape ``out_shape``: a scalar for :func:`pyhvp.grad_and_hvp`, any shape for
    :func:`pyhvp.hessian_diagonal`. The batched ``f(x, *args)`` returns
    ``x.shape[:-event_dims] + out_shape``. Each tensor arg has ``arg_event_dims`` trailing
    per-instance dims (default: ``event_dims``; an int for all args or one per arg) and leading
    dims that broadcast against x's batch dims, so a ``mu`` of shape ``(n_g, 1, 1, d)`` is shared
    across the middle batch dims without being expanded. Any other arg -- a number, or a dict or
    list of tensors such as a module's parameters for ``functional_call`` -- is passed whole to
    every instance: per-instance tensors go as tensor args of their own, not inside a container.
    Where x has as many instances as each has variables, an arg that starts with x's batch dims
    reads both ways (one entry per instance, or one tensor all share): the default warns, and
    an ``arg_event_dims`` given says which.

    >>> f = per_instance(lambda x, mu: ((x - mu) ** 2).sum())
    >>> f(torch.ones(4, 3), torch.zeros(3))
    tensor([3., 3., 3., 3.])
    >>> per_instance(lambda x: torch.stack([x.sum(), x.prod()]))(torch.ones(4, 3)).shape
    torch.Size([4, 2])
    """
    if not callable(f_single):
        raise TypeError(f"f_single must be callable, got {type(f_single).__name__}")
    dims = as_int(event_dims)
    if dims is None or dims < 1:
        raise ValueError(f"event_dims must be a positive int, got {event_dims!r}")
    return PerInstance(f_single, dims, checked_arg_event_dims(arg_event_dims))


def vmap_batch_dims(fn_single: Callable[..., Out], n_batch: int) -> Callable[..., Out]:
    """Nest one vmap per batch dim; an arg of size 1 in that dim is shared (in_dims=None). A
    batch dim of size 0 runs ``fn_single`` on one instance of zeros, for the outputs' shapes."""
    if n_batch == 0:
        return fn_single
    inner = vmap_batch_dims(fn_single, n_batch - 1)

    def over_leading_dim(x: torch.Tensor, *args: object) -> Out:
        in_dims = [0] + [
            None if not isinstance(a, torch.Tensor) or a.shape[0] == 1 else 0 for a in args
        ]
        args = tuple(
            a[0] if isinstance(a, torch.Tensor) and d is None else a
            for a, d in zip(args, in_dims[1:], strict=True)
        )
        # each instance draws its own random numbers (dropout), as a batched network does
        mapped = vmap(inner, in_dims=tuple(in_dims), randomness="different")
        if x.shape[0] > 0:
            return mapped(x, *args)
        # no instance: vmap cannot run many ops over none (x.prod() selects instance 0); the
        # outputs of one appended instance of zeros, emptied, have the batched call's shapes
        padded = [
            _with_zero_instance(a) if isinstance(a, torch.Tensor) and d == 0 else a
            for a, d in zip((x, *args), in_dims, strict=True)
        ]
        try:
            outputs = mapped(*padded)
        except Exception as error:  # f_single undefined at 0 (a Cholesky factor, a log-det)
            note(error, EMPTY_BATCH_NOTE)
            raise
        return cast(Out, pytree.tree_map_only(torch.Tensor, lambda out: out[:0], outputs))

    return over_leading_dim


SHAPE_ERRORS = (
    "must match the size of tensor",
    "shapes cannot be multiplied",
    "size mismatch",
    "Dimension out of range",
    "is out of bounds for dimension",
)
"""torch's messages for a shape mismatch: the errors of f_single that an arg of the wrong
per-instance shape makes (not pyhvp's refusals, raised inside the instance vmap too)."""


def _shape_error(error: BaseException) -> bool:
    return any(fragment in str(error) for fragment in SHAPE_ERRORS)


EMPTY_BATCH_NOTE = (
    "x has an empty batch (no instance): per_instance ran f_single once on an instance of "
    "zeros to find the shape of the empty result, and f_single raised there. Skip the call "
    "when x has no instance (x.shape[0] == 0), or make f_single defined at x = 0"
)


def _with_zero_instance(t: torch.Tensor) -> torch.Tensor:
    """``t`` with one more instance of zeros along its leading dim."""
    return torch.cat([t, t.new_zeros(1, *t.shape[1:])])


class InstanceCouplingError(ValueError):
    """``f``'s value for one instance depends on another instance's variables."""


@public_operator
def check_instances(
    f: Callable[..., torch.Tensor],
    x: torch.Tensor,
    *args: object,
    event_dims: int = 1,
    generator: torch.Generator | None = None,
) -> None:
    """Raise :class:`InstanceCouplingError` if ``f(x, *args)[b]`` depends on ``x[a]``, ``a != b``.

    Every per-instance operator of pyhvp assumes instance ``b`` of ``f`` reads only ``x[b]``;
    the shape check they make cannot see a violation (``x - x.mean(0)``, a batch norm in training
    mode, ``f(x).sum().expand(B)``), which gives silently wrong per-instance results. This check
    is opt-in (call it once per function and layout), in two parts:

    * **through derivatives**, exact up to rounding: one forward and ``2 * ceil(log2 B) + 2``
      reverse passes, plus one per output beyond the first. Pass ``p`` puts random positive
      cotangents on the instances whose flat index has bit ``p`` equal to 0 (then 1); a non-zero
      gradient at an instance outside that set means a receiver reads it, and any two
      instances differ in some bit, so every dependence between two instances whose first
      derivative is not zero at this ``x`` is seen. Rounding is judged per output and per
      entry of ``x``: each output's cotangents are divided by its own gradient's size (one more
      pass per output, up to 16 outputs per instance; one for them all beyond), each gradient
      entry by that entry's own derivative, and each output's change below against its own
      value, so a stiff instance, output or entry (``1e6 * x**2`` beside a coupled output) does
      not hide another's coupling;
    * **through values that carry no derivative** (``x - x.mean(0).detach()``, a statistic taken
      under ``torch.no_grad()`` or through ``.item()``), which no derivative shows: ``f`` is run
      again, ``2 * ceil(log2 B) + 2`` forwards from the random state of the first, with the
      instances of each such set moved, and an output outside the set that changes beyond
      rounding is a coupling (or one whose first derivatives vanish at this ``x``: every
      instance at one point; the message names both causes). pyhvp's operators treat such a value as a
      constant, as autograd does, so their results are the derivatives of ``f`` with the value
      frozen at this batch.
      Skipped when ``f`` is not deterministic (two runs from one random state differ: a
      generator of its own); ``f``'s side effects (Python state it changes) happen once per run.
      Tensors ``f`` writes beyond its values (a batch norm's running statistics,
      ``spectral_norm``'s vectors in training) are put back before each run and after the
      check, which leaves them as it found them.

    Rounding is a change below 64 ulps of ``x``'s dtype, and at most 2^-10 of the largest
    gradient (through derivatives) or 2^-4 of an output's magnitude (through values): bfloat16's
    64 ulps are 50%, which would hide a coupling as strong as an instance's own dependence.

    Not seen: a coupling that neither part shows at this ``x``, whose first derivatives and
    value changes vanish there (``x[:, 0] * x.flip(0)[:, 0]`` at ``x = 0``: its second
    derivatives still couple the instances); check at a generic point, not a symmetric one.

    The message names one instance that leaked into another, verified by one more pass. ``f``
    may return any ``batch_shape + out_shape``; args are held constant. The random cotangents
    and moves are drawn from ``generator`` (the same state, the same check), or from torch's
    global generator, which the check then advances.

    >>> check_instances(lambda x: (x**2).sum(-1), torch.randn(5, 3))      # independent: passes
    >>> check_instances(lambda x: ((x - x.mean(0)) ** 2).sum(-1), torch.randn(5, 3))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    pyhvp.instances.InstanceCouplingError: f couples instances: its value for instance (1,) depends on x at instance (0,) (5 of 5 instances leak into others)...
    """
    if not callable(f):
        raise TypeError(f"f must be a Python function of torch tensors, got {type(f).__name__}")
    if nested.inside_transform():
        raise ValueError(
            "check_instances cannot run inside a torch.func transform (vmap, grad, jacrev, ...): "
            "it is a check on concrete values, with autograd's reverse passes; call it once "
            "outside the transform, on x as the transform's caller has it"
        )
    x = require_floating("x", x)
    event_dims = check_event_dims_of(f, event_dims, x)
    require_instance_variables(x, event_dims)
    check_args(args, x)
    require_generator(generator)
    batch_shape = x.shape[: x.ndim - event_dims]
    if math.prod(batch_shape) < 2:
        return
    with torch.inference_mode(False), torch.enable_grad():  # also inside inference mode
        y = x.clone()  # (a write of f's never reaches the caller's x)
        run = _Runs(f, y, _normal(args), batch_shape, generator)  # (inference tensors: cloned)
        try:
            message = _leak_through_derivatives(run)
            if message is not None:
                raise InstanceCouplingError(
                    f"{message}. pyhvp's per-instance operators assume f(x)[b] depends only on "
                    f"x[b] (the last event_dims={event_dims} dims of x are one instance): "
                    f"mean-centring over the batch, batch norm in training mode or a sum over "
                    f"instances break that"
                )
            message = _leak_through_values(run)
        finally:  # the check leaves f's buffers as it found them
            run.state.restore()
    if message is not None:  # seen in values alone: what made it cannot be told
        raise InstanceCouplingError(
            f"{message}: it changed when only other instances moved, though no first "
            f"derivative of f couples instances at this x. Either f uses a value that carries no "
            f"derivative (a detach, torch.no_grad() or .item() over the batch: "
            f"x.mean(0).detach(), say), which pyhvp's operators treat as a constant, as autograd "
            f"does (compute it from each instance alone, or pass it to f as an arg); or f "
            f"couples instances with first derivatives that vanish at this x (every instance at "
            f"one point, say) but second derivatives that need not: cross-instance Hessian "
            f"blocks, which pyhvp's per-instance results leave out"
            + (
                "; or, here, a NaN or infinite entry of x reached other instances' values, "
                "where no derivative can be read (a NaN spreads through x.mean(0), say)"
                if not bool(x.isfinite().all())
                else ""
            )
        )


class _Runs:
    """``f`` on ``y`` (with grad: its output for the derivatives pass) and on moved copies of
    ``y``, the instances numbered by their flat index, the sets of each bit pass."""

    def __init__(self, f: Callable[..., torch.Tensor], y: torch.Tensor, args: Sequence[object],
                 batch_shape: torch.Size, generator: torch.Generator | None) -> None:  # fmt: skip
        self.f, self.y, self.args, self.batch_shape = f, y, args, batch_shape
        self.generator = generator
        self.count = math.prod(batch_shape)
        self.flat_index = torch.arange(self.count, device=y.device)
        self.sides = [
            ((self.flat_index >> bit) & 1) == side
            for bit in range(max(1, (self.count - 1).bit_length()))
            for side in (0, 1)
        ]
        self.random_state = random_states.save(y.device)
        self.y.requires_grad_()
        watched = Watched(self.y)
        recording = Recording((self.y, *args))
        try:
            with without_dynamo(), recording:
                out = f(self.y, *args)
        except RuntimeError as error:
            refusal = write_to_x_refusal(error, f, y, args)
            if refusal is None:
                raise
            raise refusal from error
        if watched.written():  # under no_grad or through x.data, which autograd allows
            raise InPlaceInputError(
                "f modifies x in place under torch.no_grad() or through x.data; pyhvp's "
                "operators differentiate f w.r.t. the x they are given: write to a copy (x.clone())"
            )
        self.out = _dense(check_batched_output(out, batch_shape))
        # what f writes beyond its values (running statistics, spectral_norm's vectors), as it
        # was before: put back before each further run, every run is the first one's function
        # (each run had updated them: a spectral-norm network in training looked random, and
        # its coupling through a detached mean went unseen). Not f's own generators: two runs
        # that draw from one anew still differ
        self.state = Snapshot(recording.changes.snapshot().storages, [])
        self.own_gradient: torch.Tensor | None = None  # (B, outputs or 1): the derivatives pass's

    def x_scale(self) -> float:
        """``1 + max |x|`` over x's finite entries (a NaN or infinite entry's scale would make
        every shift NaN): the scale of the shifts in :meth:`values`."""
        x = self.y.detach()
        finite = x[x.isfinite()]
        return 1 + (float(finite.abs().amax()) if finite.numel() else 0.0)

    def random(self, shape: Sequence[int]) -> torch.Tensor:
        """Uniform draws in [0.5, 1.5) from ``generator`` (on its device), on ``y``'s."""
        device = self.generator.device if self.generator is not None else self.y.device
        draws = torch.rand(tuple(shape), generator=self.generator, dtype=self.y.dtype,
                           device=device)  # fmt: skip
        return draws.to(self.y.device) + 0.5

    def values(self, moved: torch.Tensor | None) -> torch.Tensor:
        """``f``'s outputs per instance, ``(B, -1)``, with the instances in ``moved`` shifted
        (None: none), from the random state ``f`` started from at its first run."""
        x = self.y.detach()
        if moved is not None:
            shift = self.random(x.shape) * self.x_scale() / 4
            where = moved.reshape(*self.batch_shape, *(1,) * (x.ndim - len(self.batch_shape)))
            # a moved NaN or infinite entry starts from 0: shifted, it stayed NaN, and a
            # coupling that spread it to every instance (x - x.mean(0)) changed nothing
            x = torch.where(where & ~x.isfinite(), 0, x) + shift * where
        self.state.restore()
        with random_states.replaying(self.random_state):
            out = self.f(x.requires_grad_(), *self.args)
        return _dense(check_batched_output(out, self.batch_shape)).detach().reshape(self.count, -1)


def _leak_through_derivatives(run: _Runs) -> str | None:
    """Which instance leaks into which through derivatives (see :func:`check_instances`)."""
    if not run.out.requires_grad:  # constant in x: nothing leaks through derivatives
        return None
    per_instance_out = run.out.reshape(run.count, -1)

    def gradient_rows(cotangent: torch.Tensor) -> torch.Tensor:
        """``(B, n)``: the size of each entry of the gradient of ``sum(cotangent * f)``."""
        (gradient,) = torch.autograd.grad(
            per_instance_out, run.y, cotangent, retain_graph=True, allow_unused=True,
            materialize_grads=True,
        )  # fmt: skip
        return gradient.reshape(run.count, -1).abs()

    # each output's own gradient, with every instance receiving (its own derivative where f
    # does not couple): one pass per output up to _SCALED_OUTPUTS outputs, one for them all
    # beyond. Leaks are judged against these scales, so that rounding is relative to what is
    # read and a stiff part neither hides another's coupling nor leaks by rounding: an instance
    # of values of 1e17; an output, 1e6 x**2 beside a coupled one; an entry of x, 1e8 x1**2
    # beside a coupling through x0 (the last two passed until 2026-12-07)
    outputs = per_instance_out.shape[-1]
    if 0 < outputs <= _SCALED_OUTPUTS:
        draws = run.random(per_instance_out.shape)
        columns = torch.arange(outputs, device=draws.device)
        rows = [gradient_rows(torch.where(columns == m, draws, 0)) for m in range(outputs)]
    else:
        rows = [gradient_rows(run.random(per_instance_out.shape))]
    # per entry of x: its largest own derivative over the outputs
    largest_row = rows[0].clone()
    for row in rows[1:]:
        torch.maximum(largest_row, row, out=largest_row)
    entries = _positive_or_one(largest_row)

    def gradient_sizes(cotangent: torch.Tensor) -> torch.Tensor:
        """Per instance, the largest entry of the gradient of ``sum(cotangent * f)``, each
        entry relative to its own derivative."""
        return (gradient_rows(cotangent) / entries).amax(-1)

    # per output: how much it reads of its own instance's x (the values' floor), and relative to
    # the entries' own derivatives (a receiver's weights are divided by it)
    own = torch.stack([row.amax(-1) for row in rows], -1)
    run.own_gradient = torch.where(own.isfinite(), own, torch.ones_like(own))
    scale = _positive_or_one(torch.stack([(row / entries).amax(-1) for row in rows], -1))

    def leak_sizes(receivers: torch.Tensor) -> torch.Tensor:
        """Per instance, the largest gradient of sum over receivers of w_b f_b (random w > 0:
        no two receivers' dependences cancel; each divided by its receiver's scale)."""
        # (a weight that overflowed, float16 over a scale of 1e-5, is the largest finite one:
        # an infinite one made a NaN gradient of 0 * inf through a matmul's exact zeros)
        high = torch.finfo(per_instance_out.dtype).max
        weights = torch.nan_to_num(run.random(per_instance_out.shape) / scale, posinf=high)
        # zero where not received, by selection: a weight that overflowed (float16, an instance
        # whose own gradient is below 2^-16) times 0 was a NaN cotangent, a NaN gradient at an
        # instance outside the receivers, read as a leak of an independent f
        return gradient_sizes(torch.where(receivers[:, None], weights, 0))

    sizes = [leak_sizes(receivers) for receivers in run.sides]
    # an instance whose own derivative is infinite gets 0 * inf = NaN from a zero cotangent: no
    # leak, and none can be read there
    unreadable = ~gradient_sizes(torch.zeros_like(per_instance_out)).isfinite()
    # rounding scale from the finite sizes; a non-finite size outside the receivers leaks
    finite = [size[size.isfinite()] for size in sizes]
    largest = max((float(size.max()) for size in finite if size.numel()), default=0.0)
    threshold = _rounding(run.y.dtype, 2**-10) * largest
    leakers = torch.zeros(run.count, dtype=torch.bool, device=run.y.device)
    for receivers, size in zip(run.sides, sizes, strict=True):
        leakers |= ~(size <= threshold) & ~receivers & ~unreadable
    if not bool(leakers.any()):
        return None
    source = int(torch.nonzero(leakers)[0])
    flat_index = run.flat_index
    candidates = torch.nonzero(flat_index != source).flatten()  # bisect for one receiver
    while len(candidates) > 1:
        first, second = candidates.tensor_split(2)
        if not bool(leak_sizes(torch.isin(flat_index, first))[source] <= threshold):
            candidates = first
        else:
            candidates = second
    receiver = int(candidates[0])
    at = partial(_at, batch_shape=run.batch_shape)
    message = (
        f"f couples instances: its value for instance {at(receiver)} depends on x at instance "
        f"{at(source)}"
        if not bool(leak_sizes(flat_index == receiver)[source] <= threshold)
        else f"f couples instances: x at instance {at(source)} changes f's value for other "
        f"instances"
    )
    return f"{message} ({int(leakers.sum())} of {run.count} instances leak into others)"


def _leak_through_values(run: _Runs) -> str | None:
    """Which instance's value changes with another's x, beyond rounding, when no derivative
    says so (see :func:`check_instances`); None also when ``f`` is not deterministic."""
    base = run.values(None)
    if base.shape[-1] == 0:  # out_shape holds no value (a dim of 0): none can change
        return None
    # rounding, per output of each receiving instance: relative to its own finite value (a
    # stiff instance's, or a stiff output's, do not hide another's change)
    finite = torch.where(base.isfinite(), base, torch.zeros_like(base))
    # (the floor, at most 1, is what a change at x's scale makes of f through its own
    # gradient: a floor of 1 hid every change of an f whose values are small, 1e-6 in float32)
    floor = 1.0 if run.own_gradient is None else (run.own_gradient * run.x_scale()).clamp(max=1)
    threshold = _rounding(base.dtype, 2**-4) * (floor + finite.abs())

    def changed(moved: torch.Tensor | None) -> torch.Tensor:
        """Per instance, whether f's value changed with the instances in ``moved`` shifted."""
        other = run.values(moved)
        # equal infinities are unchanged too (their difference is NaN)
        same = (
            (other == base) | ((other - base).abs() <= threshold) | (other.isnan() & base.isnan())
        )
        return ~same.all(-1)

    if bool(changed(None).any()):  # f draws from a generator of its own, say
        return None
    for moved in run.sides:
        receivers = changed(moved) & ~moved
        if bool(receivers.any()):
            break
    else:
        return None
    receiver = int(torch.nonzero(receivers)[0])
    candidates = torch.nonzero(moved).flatten()  # bisect for one source
    while len(candidates) > 1:
        first, second = candidates.tensor_split(2)
        candidates = first if bool(changed(torch.isin(run.flat_index, first))[receiver]) else second
    source = int(candidates[0])
    at = partial(_at, batch_shape=run.batch_shape)
    if bool(changed(run.flat_index == source)[receiver]):
        return (
            f"f couples instances: its value for instance {at(receiver)} depends on x at "
            f"instance {at(source)}"
        )
    return (
        f"f couples instances: its value for instance {at(receiver)} depends on x at other "
        f"instances"
    )


_SCALED_OUTPUTS = 16
"""Up to how many outputs per instance the check through derivatives scales each output by
its own gradient (one reverse pass each, whose gradient it keeps: memory of that many ``x``);
beyond, one scale per instance for them all."""


def _positive_or_one(sizes: torch.Tensor) -> torch.Tensor:
    """``sizes`` where they are finite and positive, 1 elsewhere: a scale to divide by."""
    return torch.where(sizes.isfinite() & (sizes > 0), sizes, torch.ones_like(sizes))


def _rounding(dtype: torch.dtype, cap: float) -> float:
    """The relative change taken for rounding: 64 ulps, at most ``cap``. float16's 64 ulps are
    6% and bfloat16's 50%, which hid couplings as strong as an instance's own dependence.
    Through derivatives the cap is 2^-10: an independent ``f`` leaks nothing there (a zero
    cotangent gives exact zeros). Through values it is 2^-4: a batch statistic added and taken
    away again changes them by a few ulps."""
    return min(64 * torch.finfo(dtype).eps, cap)


def _dense(out: torch.Tensor) -> torch.Tensor:
    """``f``'s output as a strided tensor: a sparse one (which the HVPs take, autograd's sum
    differentiating it) is read as its dense values, which the passes reshape."""
    return out if out.layout == torch.strided else out.to_dense()


def _at(flat: int, batch_shape: torch.Size) -> tuple[int, ...]:
    """The batch index of flat instance ``flat``."""
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(batch_shape)))
