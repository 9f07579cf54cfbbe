"""What the per-instance second-order operators share (:mod:`pyhvp.diagonal`,
:mod:`pyhvp.laplacian`): their argument and output checks, the space of directions of one
instance, random probes, Hessian-vector products in that space, and the sketch that Hutch++ and
Diag++ deflate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pyhvp import _random_state as random_states
from pyhvp._checks import (
    as_int,
    check_batched_output,
    fmt_shape,
    require_floating,
    require_generator,
    require_instance_variables,
    require_like,
)
from pyhvp.backends import Backend, nested
from pyhvp.backends.torch import _normal, write_to_x_refusal
from pyhvp.restricted.state import Recording, Snapshot, putting_back, without_dynamo
from pyhvp.taylor.kernel import identity

EXACT = "exact"
HUTCHINSON = "hutchinson"


def check_method(method: object, samples: object, generator: object,
                 sketched: str | None = None) -> int:  # fmt: skip
    """``method`` is ``"exact"``, ``"hutchinson"`` or the operator's sketched estimator, if it
    has one (``"hutch++"``, ``"diag++"``); ``samples`` (Hessian-vector products or probes, >= 3
    for the sketch) and ``generator`` go with the estimators only. Returns ``samples`` (0 for
    ``"exact"``, which takes none)."""
    methods = (EXACT, HUTCHINSON) if sketched is None else (EXACT, HUTCHINSON, sketched)
    if method not in methods:
        raise ValueError(f"method must be one of {list(methods)}, got {method!r}")
    require_generator(generator)
    if method == EXACT:
        if samples is not None or generator is not None:
            raise ValueError(
                f"samples and generator apply to the stochastic methods {list(methods[1:])}; "
                f"method='exact' got samples={samples!r}, generator={generator!r}"
            )
        return 0
    least = 3 if method == sketched else 1
    count = as_int(samples)
    if count is None or count < least:
        raise ValueError(
            f"samples must be an int >= {least} (random probes per instance) for "
            f"method={method!r}, got {samples!r}"
        )
    return count


@dataclass(frozen=True)
class Checked:
    """``f``, with its output checked at every call (``check_batched_output``): in the recording of
    the Taylor engine, so a wrong shape is reported before any kernel is built, and on the
    Hessian-vector-product path, with no extra evaluation of ``f``. Frozen: calls that check the
    same ``f`` the same way share compile-cache entries."""

    f: Callable[..., torch.Tensor]
    batch: tuple[int, ...]
    scalar_hint: str | None = None

    @property
    def __name__(self) -> str:  # what warnings print
        return getattr(self.f, "__name__", type(self.f).__name__)

    @property
    def __guarded_call__(self) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor],
                                        tuple[object, ...]]:  # fmt: skip
        """This call as ``(f, check, its arguments)`` for dynamo's guards (pyhvp.taylor.guards),
        which would otherwise see a new object at every call."""
        return self.f, check_batched_output, (self.batch, self.scalar_hint)

    def __call__(self, y: torch.Tensor, *args: object) -> torch.Tensor:
        return check_batched_output(self.f(y, *args), self.batch, self.scalar_hint)


def checked(
    f: Callable[..., torch.Tensor], batch: Sequence[int], scalar_hint: str | None = None
) -> Callable[..., torch.Tensor]:
    """``f`` wrapped in :class:`Checked`; a backend-native function (not a Python callable,
    e.g. :func:`pyhvp.julia_function`, which the operators' annotations do not name) returns one
    scalar per instance by contract and is passed as it is."""
    return Checked(f, tuple(batch), scalar_hint) if callable(f) else f


def draw_probes(
    kind: str, shape: Sequence[int], like: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    """Rademacher signs (``kind="rademacher"``) or standard normals of ``shape`` in ``like``'s
    dtype, drawn on the generator's device (one stream for CPU and CUDA inputs alike), then moved
    to ``like``'s device."""
    device = generator.device if generator is not None else like.device
    shape = tuple(shape)
    if kind == "gaussian":
        draws = torch.randn(shape, generator=generator, device=device, dtype=like.dtype)
    else:
        draws = (
            2 * torch.randint(0, 2, shape, generator=generator, device=device, dtype=like.dtype) - 1
        )
    return draws.to(like.device)


class Space:
    """The d directions of one instance that an operator runs over: its N variables, or the r
    columns of a ``factor`` S (a trace is then ``tr(S^T H S)``). Coefficient vectors
    ``(k, *batch?, d)`` map to x-space directions ``(k, *batch or 1s, *event)``, and x-space
    vectors project back (by ``S^T`` with a factor)."""

    def __init__(
        self, x: torch.Tensor, event_dims: int, factor: torch.Tensor | None = None
    ) -> None:
        self.batch = tuple(x.shape[: x.ndim - event_dims])
        self.event = tuple(x.shape[x.ndim - event_dims :])
        self.like = x
        n_vars = require_instance_variables(x, event_dims)
        self.factor = None if factor is None else self._check_factor(factor, n_vars)
        self.dim = n_vars if factor is None else factor.shape[-1]

    def _check_factor(self, factor: object, n_vars: int) -> torch.Tensor:
        factor = require_floating("factor", factor)
        require_like("factor", factor, "x", self.like)
        lead = factor.shape[: factor.ndim - len(self.event) - 1]
        ok = (
            factor.ndim >= len(self.event) + 1
            and tuple(factor.shape[len(lead) : -1]) == self.event
            and factor.shape[-1] >= 1
            and len(lead) <= len(self.batch)
            and all(a in (1, b) for a, b in zip(reversed(lead), reversed(self.batch), strict=False))
        )
        if not ok:
            raise ValueError(
                f"factor must have shape event_shape + (r,) = {fmt_shape((*self.event, 'r'))}, "
                f"optionally with leading dims broadcasting against x's batch dims "
                f"{fmt_shape(self.batch)}, got {fmt_shape(factor.shape)}"
            )
        # (*batch or 1s, N, r)
        padded = (1,) * (len(self.batch) - len(lead)) + tuple(lead)
        return factor.reshape(*padded, n_vars, factor.shape[-1])

    def basis(self) -> torch.Tensor:
        """``(d, 1, ..., 1, d)``: e_j, the same in every instance (a view of the identity the
        Taylor engine shares and recognises: read only)."""
        eye = identity(self.dim, self.like.dtype, self.like.device)
        return eye.reshape(self.dim, *(1,) * len(self.batch), self.dim)

    def directions(self, coefficients: torch.Tensor) -> torch.Tensor:
        """``(k, *b, d)`` -> x-space ``(k, *b', *event)``."""
        if self.factor is not None:
            coefficients = (self.factor @ coefficients.unsqueeze(-1)).squeeze(-1)
        return coefficients.reshape(*coefficients.shape[:-1], *self.event)

    def project(self, vectors: torch.Tensor) -> torch.Tensor:
        """x-space ``(k, *batch, *event)`` -> ``(k, *batch, d)`` (``S^T v`` with a factor)."""
        lead = vectors.shape[: vectors.ndim - len(self.event)]
        flat = vectors.reshape(*lead, math.prod(self.event))  # not -1: lead may hold a 0
        if self.factor is None:
            return flat
        return (flat.unsqueeze(-2) @ self.factor).squeeze(-2)

    def probes(self, kind: str, count: int, generator: torch.Generator | None) -> torch.Tensor:
        """``count`` random coefficient vectors ``(count, *batch, d)`` (:func:`draw_probes`)."""
        return draw_probes(kind, (count, *self.batch, self.dim), self.like, generator)


Products = Callable[[torch.Tensor], torch.Tensor]


class HessianProducts:
    """``(k, *batch, d)`` coefficient vectors -> ``M`` times each, ``M = S^T H S`` (or H) per
    instance, from the backend's Hessian-vector products of a scalar-per-instance ``f``."""

    def __init__(self, backend: Backend, f: Callable[..., torch.Tensor], x: torch.Tensor,
                 args: tuple[object, ...], space: Space, chunk_size: int | None) -> None:  # fmt: skip
        self.backend, self.f, self.x, self.args = backend, f, x, args
        self.space, self.chunk_size = space, chunk_size

    def __call__(self, coefficients: torch.Tensor) -> torch.Tensor:
        tangents = self.space.directions(coefficients).expand(len(coefficients), *self.x.shape)
        _, hv = self.backend.grad_and_hvp(self.f, self.x, tangents.contiguous(), self.args,
                                          len(self.space.event), self.chunk_size)  # fmt: skip
        return self.space.project(hv)

    def state(self) -> Snapshot:
        """What ``f`` changes beyond its values (a batch norm's running statistics in training,
        ``spectral_norm``'s vectors), as it is now: found by one more run of ``f``, whose
        changes are put back, and restored before a further round of products, so that every
        round differentiates the ``f`` of one eager call and the call leaves one run's
        changes. ``f`` runs as the products run it: with grad, on an alias of ``x`` that
        requires grad (inside a ``torch.func`` transform, on ``x``: its tensors take no
        ``requires_grad_``) and with inference tensors cloned (an ``f`` that differentiates
        inside, with ``torch.autograd.grad``, failed under ``no_grad``); an ``f`` that writes to
        ``x`` is refused as the products refuse it."""
        with torch.inference_mode(False), torch.enable_grad():
            x = self.x.clone() if self.x.is_inference() else self.x
            if not nested.inside_transform():
                x = x.detach().requires_grad_()
            run = (x, *_normal(self.args))
            mode = Recording(run)
            try:
                with putting_back(mode.changes, run), without_dynamo(), mode:
                    self.f(*run)
            except RuntimeError as error:  # autograd's refusal of a write to x, said as theirs
                refusal = write_to_x_refusal(error, self.f, self.x, self.args)
                if refusal is None:
                    raise
                raise refusal from error
        return mode.changes.held().snapshot((self.x, *self.args))


class Sketch(NamedTuple):
    """Hutch++ / Diag++ after their two rounds of products, per instance: ``q`` an orthonormal
    basis ``(*batch, d, r)`` of the sketched range of M, ``mq = M q``, and the ``m`` residual
    probes ``z`` ``(*batch, d, m)`` as they were pushed (deflated first when asked), ``mz``."""

    q: torch.Tensor
    mq: torch.Tensor
    z: torch.Tensor
    mz: torch.Tensor


def sketch(
    products: HessianProducts,
    space: Space,
    samples: int,
    generator: torch.Generator | None,
    deflate_probes: bool,
) -> Sketch:
    """The range sketch that Hutch++ (Meyer, Musco, Musco & Woodruff 2021) and Diag++ (Baston &
    Nakatsukasa 2022) share: a third of the ``samples`` products go to ``M G`` for Gaussian G
    (which spans a rank-r range a.s. for r <= samples // 3; Rademacher may not), ``Q =
    orth(M G)``; then ONE round pushes Q and the remaining Rademacher probes, deflated by
    ``(I - Q Q^T)`` first if ``deflate_probes``. No residual probes once Q spans all d
    directions (the estimate is then exact)."""
    sketch_size = samples // 3
    probes = space.probes("gaussian", sketch_size, generator)
    # both rounds run f from one random state and one state of its own: f's draws (dropout)
    # and the buffers it updates (spectral_norm's vectors in training) are one function's
    state = products.state()
    start = random_states.save(space.like.device)
    range_ = products(probes).movedim(0, -1)
    # QR in float32 at least: half and bfloat16 have no QR (geqrf), on the CPU or CUDA. Q is
    # not differentiated: with Q held, the estimate is unbiased at every x, so its gradient is
    # an unbiased one; QR's backward divides by R's diagonal, which a Hessian of rank below the
    # sketch makes 0 (NaN gradients where the value was exact)
    q = torch.linalg.qr(range_.detach().to(torch.promote_types(range_.dtype, torch.float32))).Q
    q = q.to(range_.dtype)
    rank = q.shape[-1]  # min(sketch_size, d)
    residual = samples - sketch_size - rank if rank < space.dim else 0
    z = space.probes("rademacher", residual, generator).movedim(0, -1)  # (*batch, d, m)
    if deflate_probes:
        z = z - q @ (q.mT @ z)
    state.restore()
    # after it, draws go on past the probes (generator=None): fresh, not this call's again
    with random_states.replaying(start):
        pushed = products(torch.cat([q, z], -1).movedim(-1, 0)).movedim(0, -1)
    return Sketch(q, pushed[..., :rank], z, pushed[..., rank:])
