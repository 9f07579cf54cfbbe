"""Kronecker-factored HVP approximation for tensor-shaped variables (seed 002, corrected post).

For each of ``n`` independent systems with a variable of shape ``modes = (m_1, ..., m_d)``, the
curvature is approximated from the gradients alone: per mode ``i``, the EMA of the mode-``i``
unfolded outer product ``G_(i) G_(i)^T`` divided by the product of the other mode sizes,
bias-corrected by ``1 - beta^t`` (``1 - prod beta`` over the updates, where ``beta`` was changed
between them), minus ``mu_i mu_i^T`` where ``mu_i`` is the bias-corrected EMA
mean averaged over the other modes. Each such covariance ``C_i`` gets the root
``R_i = V (|lambda| + damping)^power V^T`` (``C_i = V diag(lambda) V^T``) and the approximation
is ``(R_1 ⊗ ... ⊗ R_d) vec(v)`` per system, never formed: each mode of ``v`` is contracted with
its own ``R_i`` (cost ``O(N sum m_i)`` per system for ``N = prod m_i``, against ``O(N^2)`` dense).

Numerics: the statistics are kept in float64 whatever the gradients' dtype, and the covariances
eigendecomposed in float64 (roots are cast back to the gradients' dtype). Each factor is kept as
the scatter of its fibres about their mean, each update's combined with the running one as two
groups' are (Chan, Golub and LeVeque), never as a difference of second moments: that cancelled
where a gradient's mean dwarfs its spread, in float32 at a ratio of 1e4 (mean 1000, spread 0.1:
a root 100x off, until 2026-12-04) and in float64 at 1e7 (the operator 5e4 times off, until
2026-12-07). So that near-singular covariances give no NaN,
``abs`` maps the tiny negative eigenvalues of rounding to small
positive ones and a zero eigenvalue gives a zero root eigenvalue (``power > 0``); roots are
symmetrised in float64 before the cast, so the operator ``apply`` uses is exactly symmetric per
system (its computed action is, up to rounding). Gradients that are not finite, or so large
that their second moments would overflow float64 (above ``sqrt(finfo.max / N)``), are rejected
before they can poison the running statistics; a diverging sampler then stops with a ValueError
rather than NaNs or a failed eigh. An operator whose largest eigenvalue, or a root's entry,
overflows the gradients' dtype (float16 gradients of 300 have a covariance of 9e4) is refused with
a ValueError when its roots are computed, where its results were inf or NaN (a ``v`` whose
product with a representable operator overflows still gives inf, as a matmul would).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator
from typing import Any

import torch

from pyhvp._checks import (
    as_int,
    fmt_shape,
    require_dense,
    require_floating,
    require_like,
)
from pyhvp.backends.nested import inside_transform


class KroneckerHVP:
    """Kronecker-factored approximation of the HVP of ``n`` systems from their gradient history.

    Shapes: ``update(grad)`` takes ``grad`` of shape ``(n, *modes)`` (any number of modes >= 1);
    ``apply(v)`` takes ``v`` of shape ``(*extra, n, *modes)`` and returns that shape;
    ``kron(grad, v)`` is ``update(grad)`` then ``apply(v)``. ``power=None`` means
    ``1 / len(modes)``; every dim after ``n`` is a mode, size-1 ones too (``(n, 1, 5)`` has
    two). The state (EMA mean, one factor per mode, step count, the product of
    the updates' betas) is created on the first update, on grad's device, in float64; ``grad``
    and ``v`` keep the first update's dtype, which roots and results have. Roots are computed
    on the first ``apply`` after an update and cached; with ``refresh_every=k`` a cached root is
    reused until ``k`` updates have happened since it was computed (Shampoo-style amortisation;
    ``k=1`` is the post). :meth:`state_dict` saves the cached roots too, so that a run resumed
    with :meth:`load_state_dict` continues bit for bit as the uninterrupted one would.

    A gradient that never changes and is the same along every other mode (a uniform one) has
    zero covariance, so only the damping is left and the product of the ``d`` roots
    ``damping^(1/d)`` is ``damping`` (a gradient constant in time but not uniform keeps, per
    mode, its spread over the other modes: each mode subtracts its mean averaged over them):

    >>> kron = KroneckerHVP(damping=0.5)
    >>> for _ in range(3):
    ...     kron.update(torch.ones(2, 3, 4))
    >>> v = torch.randn(2, 3, 4)
    >>> torch.allclose(kron.apply(v), 0.5 * v)
    True
    """

    _roots: list[torch.Tensor] | None  # per mode, cached (see the class doc)

    def __init__(
        self,
        beta: float = 0.99,
        damping: float = 0.0,
        power: float | None = None,
        refresh_every: int = 1,
    ) -> None:
        self.reset()  # (first: the options' setters look at the cached roots)
        self.beta, self.damping, self.power = beta, damping, power
        self.refresh_every = refresh_every

    # The options may be set between calls (dampings tried on the same statistics): each is
    # checked as the constructor checks it; the cached roots are computed anew with a damping or
    # power set, a beta weighs the updates after it, and a refresh_every counts the updates
    # since the cached roots were computed.

    @property
    def beta(self) -> float:
        """The EMA's decay, in (0, 1), of later updates: the bias correction is by the weight
        the updates so far gave, ``1 - `` the product of their betas (until 2026-12-06 it was
        ``1 - beta^t`` with the beta set last, which no update used: roots of a second moment,
        not of a covariance)."""
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta = _real_option("beta", value, "a float in (0, 1)", lambda b: 0 < b < 1)

    @property
    def damping(self) -> float:
        """Added to each factor's eigenvalues, >= 0 (setting it recomputes the roots on the next
        ``apply``)."""
        return self._damping

    @damping.setter
    def damping(self, value: float) -> None:
        damping = _real_option("damping", value, "a float >= 0", lambda d: d >= 0)
        # (no modes yet: no roots either; the same value keeps a resumed run's)
        if self._scatters and damping != self.damping:
            self._roots = None
        self._damping = damping

    @property
    def power(self) -> float | None:
        """The roots' power, > 0 (None: ``1 / len(modes)``; setting it recomputes the roots on the
        next ``apply``)."""
        return self._power

    @power.setter
    def power(self, value: float | None) -> None:
        power = (
            None
            if value is None
            else _real_option("power", value, "None or a float > 0", lambda p: p > 0)
        )
        # the same power keeps the cached roots: None is 1 / modes (no modes yet: no roots)
        modes = len(self._scatters)
        if modes and _effective(power, modes) != _effective(self.power, modes):
            self._roots = None
        self._power = power

    @property
    def refresh_every(self) -> int:
        """How many updates a cached root serves, a positive int (a NumPy int too, as
        ``samples=`` and ``chunk_size=`` take; until 2026-12-07 a value set after construction
        went unchecked: ``2.5`` was taken, ``"x"`` failed at the next ``apply``)."""
        return self._refresh_every

    @refresh_every.setter
    def refresh_every(self, value: int) -> None:
        every = as_int(value)
        if every is None or every < 1:
            raise ValueError(f"refresh_every must be a positive int, got {value!r}")
        self._refresh_every = every

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "_scatters" in state:
            self.__dict__.update(state)
            return
        # pickled by an earlier pyhvp: second moments as "_factors" (before 2026-12-07), its
        # options maybe plain attributes (before 2026-12-06 for beta, damping and power,
        # 2026-12-07 for refresh_every), maybe no "_decay" (before 2026-12-06): rebuilt from its
        # options and statistics as load_state_dict takes a state of then (validated, its roots
        # computed anew); until 2026-12-07 such an instance loaded, then every use raised
        # AttributeError
        options = {name: state.get(f"_{name}", state.get(name)) for name in _OPTIONS}
        self.__init__(**{name: value for name, value in options.items()  # type: ignore[misc]
                         if value is not None or name == "power"})  # fmt: skip
        saved = {"step": state.get("_step", 0), "mean": state.get("_mean"),
                 "factors": state.get("_factors", [])}  # fmt: skip
        saved.update({key: state[f"_{key}"] for key in ("dtype", "decay") if f"_{key}" in state})
        self.load_state_dict(saved)

    def reset(self) -> None:
        """Forget all statistics; the next ``update`` starts afresh (any shape, device, dtype)."""
        self._step = 0
        self._decay = 1.0  # the EMA weight not yet given to gradients: the product of their betas
        self._dtype = torch.float64  # the gradients' (roots and results have it)
        self._mean: torch.Tensor | None = None
        self._scatters: list[torch.Tensor] = []
        self._roots = None
        self._updates_since_roots = 0

    @torch.no_grad()
    @torch.inference_mode(False)  # statistics a later call outside inference mode may update
    def update(self, grad: torch.Tensor) -> None:
        """Fold ``grad`` of shape ``(n, *modes)`` into the EMA statistics (no eigendecomposition)."""
        given = self._check_grad(grad)
        grad = given.detach().double()
        if self._mean is None:
            self._dtype = given.dtype
            self._mean = torch.zeros_like(grad)
            self._scatters = [grad.new_zeros(grad.shape[0], m, m) for m in grad.shape[1:]]
        # Each factor is the scatter of its mode's fibres about their mean (the covariance
        # times the weight the updates hold), combined with this update's as two groups' are
        # (Chan et al.): no difference of second moments, which cancelled in float64 too where
        # the mean dwarfed the spread (1e7 times: the operator 5e4 times off until 2026-12-07).
        # New tensors, never written in place: a copy (copy.copy) keeps its own statistics, and
        # a call that fails puts the old ones back (until 2026-12-07 a shallow copy's update
        # wrote the original's, whose next roots were 0.22 off).
        beta, held = self.beta, 1 - self._decay  # (the weight the updates so far hold)
        after = beta * held + (1 - beta)  # (and with this one)
        scatters = []
        for i, scatter in enumerate(self._scatters):
            fibres = _unfold(grad, i)  # (n, m_i, product of the other modes)
            fibres_mean = fibres.mean(-1, keepdim=True)
            centred = fibres - fibres_mean
            scatter = torch.baddbmm(scatter, centred, centred.mT, beta=beta,
                                    alpha=(1 - beta) / fibres.shape[-1])  # fmt: skip
            if held > 0:  # the two means' difference, weighted as the groups are
                shift = fibres_mean - _mode_mean(self._mean, i)[..., None] / held
                scatter.baddbmm_(shift, shift.mT, alpha=beta * held * (1 - beta) / after)
            scatters.append(scatter)
        self._mean = self._mean.mul(beta).add_(grad, alpha=1 - beta)
        self._scatters = scatters
        self._step += 1
        self._decay *= beta
        self._updates_since_roots += 1

    @torch.no_grad()
    def roots(self) -> list[torch.Tensor]:
        """The per-mode roots ``R_i`` of shape ``(n, m_i, m_i)``, in the gradients' dtype (copies
        of the cache; see the class doc)."""
        return [root.clone() for root in self._cached_roots()]

    def _cached_roots(self) -> list[torch.Tensor]:
        self._statistics()
        if self._roots is None or self._updates_since_roots >= self.refresh_every:
            with torch.inference_mode(False):  # roots autograd may save outside inference mode
                self._roots = self._compute_roots()
            self._updates_since_roots = 0
        return self._roots

    def apply(self, v: torch.Tensor) -> torch.Tensor:
        """``(R_1 ⊗ ... ⊗ R_d) vec(v)`` per system; ``v``: ``(*extra, n, *modes)``, same shape out."""
        roots = self._cached_roots()
        mean = self._statistics()
        v = _checked_v(v, mean.shape)
        lead = v.ndim - mean.ndim + 1  # position of the first mode dim in v
        require_like("v", v, "grad", roots[0])
        # half dtypes contract in float32: an intermediate product overflowed float16 where the
        # result fits (inf until 2026-12-07), as a matmul accumulates wider and rounds once
        wide = torch.promote_types(v.dtype, torch.float32)
        out = v.to(wide)
        for root in roots:  # cycle: the next mode to the end, contract it with its root
            out = out.movedim(lead, -1)
            shape = out.shape
            rows = math.prod(shape[lead:-1])  # (not -1: an empty extra dim has no size to infer)
            out = (out.reshape(*shape[:lead], rows, shape[-1]) @ root.to(wide)).reshape(shape)
        return out.to(v.dtype)

    def _statistics(self) -> torch.Tensor:
        """The EMA mean of the gradients (its shape is grad's); RuntimeError before any update."""
        if self._mean is None:
            raise RuntimeError(
                "KroneckerHVP has no statistics yet: call update(grad) before apply(v) or roots()"
            )
        return self._mean

    def __call__(self, grad: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``update(grad)`` then ``apply(v)``: the post's ``batch_hvp_fn`` given the gradient (a
        call that raises folds nothing in: ``v`` is checked first, and where the operator then
        overflows the gradients' dtype the statistics before the call are put back; until
        2026-12-07 that gradient stayed folded in)."""
        grad = require_floating("grad", grad)
        require_like("v", _checked_v(v, grad.shape), "grad", grad)
        before = dict(vars(self))  # (update replaces the statistics' tensors, never writes them)
        self.update(grad)
        try:
            return self.apply(v)
        except Exception:
            self.__dict__.update(before)
            raise

    def state_dict(self) -> dict[str, object]:
        """Copies of the statistics (float64), the gradients' dtype, the EMA weight not yet
        given to gradients and the cached roots:

        - ``"step"``: the number of updates ``t``; ``"mean"``: ``(n, *modes)`` or None before
          any update; ``"factors"``: one ``(n, m_i, m_i)`` per mode, the scatter of its fibres
          about their mean (the covariance times ``1 - decay``); ``"factors_centred"``: True
          (states saved before 2026-12-07 held second moments there); ``"dtype"``: the
          gradients' ``torch.dtype``; ``"decay"``: the product of the updates' betas;
        - ``"roots"``: the cached roots, one ``(n, m_i, m_i)`` per mode in the gradients' dtype,
          or None when none are cached; ``"updates_since_roots"``: the updates since they were
          computed (an int in ``[0, t]``); ``"roots_damping"`` and ``"roots_power"``: the damping
          and power (``1 / len(modes)`` for None) they were computed with, None without roots.

        The options (beta, damping, power, refresh_every) are the constructor's, not state.
        """
        roots = self._roots
        return {
            "step": self._step,
            "mean": None if self._mean is None else self._mean.clone(),
            "factors": [f.clone() for f in self._scatters],
            "factors_centred": True,
            "dtype": self._dtype,
            "decay": self._decay,
            "roots": None if roots is None else [root.clone() for root in roots],
            "updates_since_roots": self._updates_since_roots,
            "roots_damping": None if roots is None else self.damping,
            "roots_power": None if roots is None else _effective(self.power, len(roots)),
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore statistics saved by :meth:`state_dict` (copied), and its cached roots
        (copied) where this instance's damping and power are those they were computed with
        (``state["roots_damping"]``, ``state["roots_power"]``), so that the run continues as
        the saved one would have; else, or for states without roots (saved before 2026-12-07),
        the roots are recomputed on the next ``apply``.

        Everything is validated first: a refused state raises ValueError/TypeError naming the
        entry and leaves the current statistics untouched. Each root must have the shape
        ``(n, m_i, m_i)`` of ``state["mean"]``'s mode ``i``, its device, the dtype
        ``state["dtype"]``, finite and symmetric entries.
        """
        required = {"step", "mean", "factors"}  # and "dtype" (states saved before 2026-12-04:
        # statistics in the gradients' dtype, which they give), "decay" (before 2026-12-06:
        # beta ** step), the roots' entries (before 2026-12-07: recomputed) and
        # "factors_centred" (before 2026-12-07: second moments, made scatters here)
        optional = {"dtype", "decay", "factors_centred", *_ROOTS_KEYS}
        if not isinstance(state, dict) or not required <= set(state) <= required | optional:
            keys = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"state must be a dict with keys {sorted(required | optional)} "
                f"({sorted(optional)} optional), got {keys}"
            )
        step = as_int(state["step"])  # a NumPy int too, as the options take them
        if step is None or step < 0:
            raise ValueError(f"state['step'] must be an int >= 0, got {state['step']!r}")
        if step == 0:
            self._loaded_roots(state, 0, None, [])  # checks that there are none
            self.reset()
            return
        mean = require_floating("state['mean']", state["mean"])
        if mean.ndim < 2 or 0 in mean.shape:
            raise ValueError(
                f"state['mean'] must have shape (n, *modes), got {fmt_shape(mean.shape)}"
            )
        if not isinstance(state["factors"], (list, tuple)):
            raise TypeError(
                f"state['factors'] must be a list of tensors, got {type(state['factors']).__name__}"
            )
        factors = [
            require_floating(f"state['factors'][{i}]", f) for i, f in enumerate(state["factors"])
        ]
        expected = [(mean.shape[0], m, m) for m in mean.shape[1:]]
        if [tuple(f.shape) for f in factors] != expected:
            raise ValueError(
                f"state['factors'] must have shapes {[fmt_shape(s) for s in expected]} "
                f"(one (n, m_i, m_i) per mode of state['mean']), "
                f"got {[fmt_shape(f.shape) for f in factors]}"
            )
        dtype = state.get("dtype", mean.dtype)
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize > 1):
            raise ValueError(
                f"state['dtype'] must be a floating torch.dtype torch computes in (float16, "
                f"bfloat16, float32, float64), got {dtype!r}"
            )
        for name, tensor in [("state['mean']", mean)] + [
            (f"state['factors'][{i}]", f) for i, f in enumerate(factors)
        ]:
            require_like(name, tensor, "state['mean']", mean)
            _require_finite(name, tensor)
        centred = state.get("factors_centred", False)
        if not isinstance(centred, bool):
            raise TypeError(f"state['factors_centred'] must be a bool, got {centred!r}")
        for i, f in enumerate(factors):  # scatters (or second moments): symmetric (eigh reads
            # one triangle), up to the rounding of U U^T products, relative to the largest entry
            if f.numel() and float((f - f.mT).abs().max()) > 1e-5 * float(f.abs().max()):
                raise ValueError(f"state['factors'][{i}] must be symmetric, got an asymmetric one")
        grad = mean.new_empty(0, dtype=dtype)  # the saved gradients' device and dtype
        roots, since = self._loaded_roots(state, step, grad, expected)
        mean = mean.detach().to(torch.float64, copy=True)
        factors = [f.detach().to(torch.float64, copy=True) for f in factors]
        decay = _real_option("state['decay']", state.get("decay", self.beta**step),
                             "a float in [0, 1)", lambda d: 0 <= d < 1)  # fmt: skip
        moments = [f.abs().amax((-2, -1)) / (1 - decay) for f in factors]  # (their rounding)
        limit = _largest_gradient(mean[0].numel())
        if not bool(mean.abs().amax() / (1 - decay) <= limit):  # (a mean of gradients update
            # takes; the next update's square of the means' difference would overflow)
            raise ValueError(
                f"state['mean'] over 1 - decay, the gradients' mean, must have |entries| <= "
                f"{limit:.3g} (so that its square is finite in float64), as update() keeps it"
            )
        if not centred:
            factors = _about_the_mean(mean, factors, decay)
        for i, (cov, scale) in enumerate(zip(_covariances(factors, decay), moments, strict=True)):
            _check_covariance(i, cov, scale)
        self.reset()
        self._step, self._mean, self._dtype, self._scatters = step, mean, dtype, factors
        self._decay = decay
        self._roots, self._updates_since_roots = roots, since

    def _loaded_roots(
        self,
        state: dict[str, object],
        step: int,
        grad: torch.Tensor | None,
        shapes: list[tuple[int, int, int]],
    ) -> tuple[list[torch.Tensor] | None, int]:
        """The roots of a state being loaded, one per ``shapes`` with ``grad``'s device and
        dtype (the saved gradients'; None at ``step`` 0), copied where this instance's damping
        and power are those they were computed with (else None: recomputed), and the updates
        since they were computed."""
        since = as_int(state.get("updates_since_roots", 0))  # a NumPy int too, as step
        if since is None or not 0 <= since <= step:
            raise ValueError(
                f"state['updates_since_roots'] must be an int in [0, state['step']] = "
                f"[0, {step}], got {state['updates_since_roots']!r}"
            )
        given = state.get("roots")
        if given is None:
            return None, since
        if grad is None:
            raise ValueError(
                f"state['roots'] must be None at step 0 (no statistics to have roots of), "
                f"got {type(given).__name__}"
            )
        if not isinstance(given, (list, tuple)):
            raise TypeError(
                f"state['roots'] must be a list of tensors or None, got {type(given).__name__}"
            )
        missing = sorted(set(_ROOTS_KEYS) - set(state))
        if missing:
            raise ValueError(
                f"state['roots'] comes with {missing} (the updates since the roots and the "
                f"options they were computed with), missing from the state"
            )
        damping = _real_option("state['roots_damping']", state["roots_damping"],
                               "a float >= 0", lambda d: d >= 0)  # fmt: skip
        power = _real_option("state['roots_power']", state["roots_power"],
                             "a float > 0", lambda p: p > 0)  # fmt: skip
        if len(given) != len(shapes):
            raise ValueError(
                f"state['roots'] must hold one root per mode of state['mean'] ({len(shapes)}), "
                f"got {len(given)}"
            )
        roots = [require_dense(f"state['roots'][{i}]", root) for i, root in enumerate(given)]
        for i, (root, shape) in enumerate(zip(roots, shapes, strict=True)):
            name = f"state['roots'][{i}]"
            if tuple(root.shape) != shape:
                raise ValueError(
                    f"{name} must have shape {fmt_shape(shape)} ((n, m_i, m_i) of "
                    f"state['mean']), got {fmt_shape(root.shape)}"
                )
            require_like(name, root, "the saved grad", grad)
            _require_finite(name, root)
            if not torch.equal(root, root.mT):  # symmetrised exactly when computed
                raise ValueError(f"{name} must be symmetric, got an asymmetric one")
        if (damping, power) != (self.damping, _effective(self.power, len(shapes))):
            return None, since  # the loader chose other options: recomputed
        return [root.detach().clone(memory_format=torch.contiguous_format) for root in roots], since

    def _check_grad(self, grad: object) -> torch.Tensor:
        if inside_transform():
            raise ValueError(
                "KroneckerHVP.update (and calling it) cannot run inside a torch.func transform "
                "(vmap, grad, jacrev, ...): it folds concrete gradients into one running state; "
                "call it outside, on the whole grad of shape (n, *modes) (apply(v) may run "
                "inside vmap)"
            )
        grad = require_floating("grad", grad)
        if grad.ndim < 2 or 0 in grad.shape:
            raise ValueError(
                f"grad must have shape (n, *modes) with at least one mode and no empty dim, "
                f"got {fmt_shape(grad.shape)}"
            )
        if self._mean is not None:
            if grad.shape != self._mean.shape:
                raise ValueError(
                    f"grad must keep the shape of the first update {fmt_shape(self._mean.shape)} "
                    f"(call reset() to start over), got {fmt_shape(grad.shape)}"
                )
            like = self._mean.new_empty(0, dtype=self._dtype)  # the first grad's device, dtype
            require_like("grad", grad, "the first update's grad", like)
        limit = _largest_gradient(grad[0].numel())
        largest = grad.abs().amax().double()  # the limit overflows float32
        if not bool(largest <= limit):  # also rejects NaN
            raise ValueError(
                f"grad must be finite with |entries| <= {limit:.3g} (so that its second moments "
                f"fit in float64), got max |grad| = {largest.item():.3g}"
            )
        return grad

    def _compute_roots(self) -> list[torch.Tensor]:
        assert self._mean is not None
        power = _effective(self.power, len(self._scatters))
        roots, norm = [], torch.ones((), dtype=torch.float64, device=self._mean.device)
        for cov in _covariances(self._scatters, self._decay):
            vals, vecs = torch.linalg.eigh(cov)
            scaled = vals.abs().add(self.damping).pow(power)
            norm = norm * scaled.amax(-1)  # per system: the operator's largest eigenvalue
            root = (vecs * scaled[:, None, :]) @ vecs.mT
            roots.append(((root + root.mT) / 2).to(self._dtype))
        # float64 statistics of gradients fine in a half or float32 dtype can still have roots,
        # or an operator, beyond it: inf or NaN results (float16 gradients of 300)
        limit, largest = torch.finfo(self._dtype).max, float(norm.max())
        if not (largest <= limit and all(bool(root.isfinite().all()) for root in roots)):
            name = str(self._dtype).removeprefix("torch.")
            raise ValueError(
                f"KroneckerHVP's operator overflows the gradients' dtype {name}: its largest "
                f"eigenvalue is {largest:.3g} (or a root's entry is), over {name}'s largest "
                f"value {limit:.3g}; pass gradients in a wider dtype (grad.float() or "
                f"grad.double()), scaled down, or take a smaller power"
            )
        return roots


_OPTIONS = ("beta", "damping", "power", "refresh_every")
"""The constructor's options, each a property over an attribute ``_<name>``."""

_ROOTS_KEYS = ("roots", "updates_since_roots", "roots_damping", "roots_power")
"""The state's entries of the cached roots (states saved before 2026-12-07 have none)."""


def _largest_gradient(size: int) -> float:
    """The largest ``|entry|`` of a system's gradient of ``size`` entries whose second moments
    fit in float64."""
    return math.sqrt(torch.finfo(torch.float64).max / size)


def _effective(power: float | None, modes: int) -> float:
    """The roots' power of the option ``power`` for ``modes`` modes (None: ``1 / modes``)."""
    return 1 / modes if power is None else power


def _require_finite(name: str, tensor: torch.Tensor) -> None:
    if not bool(tensor.isfinite().all()):
        raise ValueError(f"{name} must be finite, got NaN or infinite entries")


def _covariances(factors: list[torch.Tensor], decay: float) -> Iterator[torch.Tensor]:
    """Each mode's bias-corrected covariance, its scatter over ``1 - decay`` (the weight the
    updates hold; ``decay``: the EMA weight not yet given to gradients, ``beta ** step`` for one
    beta): ``(n, m_i, m_i)``."""
    for factor in factors:
        yield factor / (1 - decay)


def _about_the_mean(mean: torch.Tensor, factors: list[torch.Tensor], decay: float
                    ) -> list[torch.Tensor]:  # fmt: skip
    """The scatters of a state saved before 2026-12-07, whose ``factors`` were second moments
    (the EMA of ``G_(i) G_(i)^T`` over the other modes' size): ``F_i - c mu_i mu_i^T``,
    ``c = 1 - decay``, ``mu_i`` the corrected mean over the other modes (their rounding, once)."""
    held = 1 - decay
    scatters = []
    for i, factor in enumerate(factors):
        mu = _mode_mean(mean, i) / held  # (n, m_i)
        scatters.append(factor - held * mu[:, :, None] * mu[:, None, :])
    return scatters


def _mode_mean(tensor: torch.Tensor, mode: int) -> torch.Tensor:
    """``(n, m_mode)``: the mean of ``(n, *modes)`` over every mode but ``mode``."""
    return _unfold(tensor, mode).mean(-1)


def _check_covariance(i: int, cov: torch.Tensor, moments: torch.Tensor) -> None:
    """A loaded state's mode-``i`` covariance must be finite and positive semi-definite up to
    the rounding of its factor's ``moments`` (per system, the largest entry over ``1 - decay``:
    a state saved as second moments gives a constant gradient's covariance 0 by cancellation)
    -- as every state :meth:`KroneckerHVP.update` makes is, a sum of outer products: else a
    negated factor's root, taken of ``|eigenvalues|``, looked plausible."""
    if not bool(cov.isfinite().all()):
        raise ValueError(
            f"state['factors'][{i}] and state['mean'] give a covariance that is not finite "
            f"(beyond float64's range): not a state update() makes"
        )
    values = torch.linalg.eigvalsh(cov)
    if bool((values.amin(-1) < -1e-5 * moments).any()):
        raise ValueError(
            f"state['factors'][{i}] with state['mean'] must give a positive semi-definite "
            f"covariance (a sum of outer products), got a negative eigenvalue "
            f"{float(values.amin()):.3g}: not a state update() makes"
        )


def _unfold(tensor: torch.Tensor, mode: int) -> torch.Tensor:
    """Mode-``mode`` unfolding of ``(n, *modes)``: ``(n, m_mode, product of the other modes)``."""
    return tensor.movedim(1 + mode, 1).reshape(tensor.shape[0], tensor.shape[1 + mode], -1)


def _real_option(name: str, value: object, expected: str, ok: Callable[[float], bool]) -> float:
    """``value`` as a finite float accepted by ``ok`` (a NumPy scalar too), else ValueError
    naming ``name``."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (real and math.isfinite(float(value)) and ok(float(value))):  # type: ignore[arg-type]
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _checked_v(v: object, shape: torch.Size) -> torch.Tensor:
    """``v`` of shape ``(*extra, *shape)`` (``shape``: grad's), else ValueError naming both."""
    v = require_floating("v", v)
    if v.ndim < len(shape) or v.shape[v.ndim - len(shape) :] != shape:
        raise ValueError(
            f"v must have shape {fmt_shape(('*extra', *shape))} (its trailing dims are grad's "
            f"shape), got {fmt_shape(v.shape)}"
        )
    return v
