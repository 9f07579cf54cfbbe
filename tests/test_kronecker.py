"""KroneckerHVP against the corrected post (3 modes) and a dense Kronecker construction (any d).

Both references are specific to this operator, so they live here rather than in ``dense.py``:
``post_batch_hvp`` is the corrected post's ``batch_hvp_fn`` transcribed line by line (float64,
gradient passed in); ``dense_kronecker`` builds each mode's covariance from the closed-form EMA
weights over the whole gradient history, takes its root by eigh and forms the explicit
``R_1 ⊗ ... ⊗ R_d`` with ``torch.kron``.
"""

import copy
import io
import math
import pickle

import pytest
import torch

from pyhvp import KroneckerHVP

F64 = torch.float64
TOL = {torch.float64: {}, torch.float32: {"rtol": 1e-4, "atol": 1e-5}}


def post_batch_hvp(shape, beta=0.99, damping=0.0):
    """The corrected post's ``batch_hvp_fn(x, sigma, v)``, with ``grad`` given instead of computed."""
    x_mean = torch.zeros(shape, dtype=F64)
    x_kron_1 = torch.zeros([shape[0], shape[1], shape[1]], dtype=F64)
    x_kron_2 = torch.zeros([shape[0], shape[2], shape[2]], dtype=F64)
    x_kron_3 = torch.zeros([shape[0], shape[3], shape[3]], dtype=F64)
    beta_accum = torch.tensor(1.0, dtype=F64)
    beta = torch.tensor(beta, dtype=F64)
    damping = torch.tensor(damping, dtype=F64)

    def powmh(x, power, damping=0.0):
        vals, vecs = torch.linalg.eigh(x)
        vals = vals.abs().add(damping).pow(power)
        return torch.einsum("...ab,...b,...cb->...ac", vecs, vals, vecs)

    def batch_hvp_fn(grad, v):
        x_mean.mul_(beta).add_(grad, alpha=1 - beta)
        x_kron_1.mul_(beta).add_(
            torch.einsum("nabc,nzbc->naz", grad, grad),
            alpha=(1 - beta) / (grad.shape[2] * grad.shape[3]),
        )
        x_kron_2.mul_(beta).add_(
            torch.einsum("nabc,nazc->nbz", grad, grad),
            alpha=(1 - beta) / (grad.shape[1] * grad.shape[3]),
        )
        x_kron_3.mul_(beta).add_(
            torch.einsum("nabc,nabz->ncz", grad, grad),
            alpha=(1 - beta) / (grad.shape[1] * grad.shape[2]),
        )
        beta_accum.mul_(beta)
        x_mean_hat = x_mean / (1 - beta_accum)
        x_kron_1_hat = x_kron_1 / (1 - beta_accum)
        x_kron_2_hat = x_kron_2 / (1 - beta_accum)
        x_kron_3_hat = x_kron_3 / (1 - beta_accum)
        x_mean_1 = x_mean_hat.mean([2, 3])
        x_mean_2 = x_mean_hat.mean([1, 3])
        x_mean_3 = x_mean_hat.mean([1, 2])
        x_cov_1 = x_kron_1_hat - torch.einsum("na,nb->nab", x_mean_1, x_mean_1)
        x_cov_2 = x_kron_2_hat - torch.einsum("na,nb->nab", x_mean_2, x_mean_2)
        x_cov_3 = x_kron_3_hat - torch.einsum("na,nb->nab", x_mean_3, x_mean_3)
        x_cov_1_root = powmh(x_cov_1, 1 / 3, damping)
        x_cov_2_root = powmh(x_cov_2, 1 / 3, damping)
        x_cov_3_root = powmh(x_cov_3, 1 / 3, damping)
        return torch.einsum("xyabc,yad,ybe,ycf->xydef", v, x_cov_1_root, x_cov_2_root, x_cov_3_root)

    return batch_hvp_fn


def dense_kronecker(grads, beta=0.99, damping=0.0, power=None):
    """``(n, N, N)``: explicit Kronecker product of the per-mode roots after ``grads`` (a list).

    Closed form of the bias-corrected EMA: step ``s`` of ``t`` has weight
    ``(1 - beta) beta^(t - s) / (1 - beta^t)``, or with one beta per step (``beta`` a list)
    ``(1 - beta_s) prod_{r > s} beta_r / (1 - prod_r beta_r)``; the mode-i second moment of one
    gradient is the tensordot over all other modes divided by their number of entries.
    """
    history = torch.stack(grads).cpu().double()  # (t, n, *modes)
    t, n, modes = history.shape[0], history.shape[1], history.shape[2:]
    p = 1 / len(modes) if power is None else power
    betas = torch.as_tensor(beta, dtype=F64).expand(t)
    later = torch.cat([betas.flip(0).cumprod(0).flip(0)[1:], torch.ones(1, dtype=F64)])
    w = (1 - betas) * later / (1 - betas.prod())
    dense = []
    for k in range(n):
        matrix = torch.ones(1, 1, dtype=F64)
        mean = torch.einsum("s,s...->...", w, history[:, k])
        for i, m in enumerate(modes):
            others = [j for j in range(len(modes)) if j != i]
            second = sum(
                ws * torch.tensordot(g, g, dims=(others, others))
                for ws, g in zip(w, history[:, k], strict=True)
            ) / (mean.numel() / m)
            mu = mean.mean(dim=others) if others else mean
            vals, vecs = torch.linalg.eigh(second - torch.outer(mu, mu))
            matrix = torch.kron(matrix, vecs @ torch.diag((vals.abs() + damping) ** p) @ vecs.T)
        dense.append(matrix)
    return torch.stack(dense)


def dense_apply(dense, v, n_modes):
    flat = v.cpu().double().flatten(start_dim=v.ndim - n_modes)
    return torch.einsum("nij,...nj->...ni", dense, flat).reshape(v.shape)


def gradient_history(steps, shape, device, dtype=F64):
    """Random gradients with a non-zero mean, so the mean subtraction matters."""
    return [torch.randn(shape, device=device, dtype=dtype) + 0.5 for _ in range(steps)]


# --- the corrected post, 3 modes ----------------------------------------------------------------

POST_CASES = {
    # name: (shape (n, a, b, c), extra dims of v, steps, beta, damping, dtype)
    "one-step": ((2, 3, 4, 5), 1, 1, 0.99, 0.0, F64),
    "several-steps": ((3, 4, 2, 3), 2, 6, 0.9, 0.0, F64),
    "damped": ((2, 3, 3, 4), 1, 4, 0.99, 0.1, F64),
    "float32": ((2, 3, 4, 5), 3, 5, 0.9, 0.05, torch.float32),
}


@pytest.mark.parametrize("case", POST_CASES.values(), ids=POST_CASES.keys())
def test_matches_corrected_post_at_every_step(case, device):
    shape, extra, steps, beta, damping, dtype = case
    post, kron = post_batch_hvp(shape, beta, damping), KroneckerHVP(beta=beta, damping=damping)
    ours, expected = [], []
    for grad in gradient_history(steps, shape, device, dtype):
        v = torch.randn(extra, *shape, device=device, dtype=dtype)
        ours.append(kron(grad, v).cpu().double())
        expected.append(post(grad.cpu().double(), v.cpu().double()))
    torch.testing.assert_close(ours, expected, **TOL[dtype])


# --- any number of modes, against the explicit Kronecker product ---------------------------------

DENSE_CASES = {
    # name: (shape (n, *modes), extra dims of v, steps, beta, damping, power, dtype)
    "1-mode": ((3, 5), (), 4, 0.9, 0.0, None, F64),
    "1-mode-extra-dims": ((2, 4), (2, 3), 3, 0.99, 0.2, None, F64),
    "2-modes": ((2, 3, 4), (), 5, 0.9, 0.0, None, F64),
    "2-modes-power": ((2, 4, 3), (2,), 3, 0.8, 0.1, 0.5, F64),
    "3-modes-float32": ((2, 2, 3, 4), (2,), 4, 0.9, 0.01, None, torch.float32),
    "4-modes": ((2, 2, 3, 2, 3), (), 3, 0.9, 0.0, None, F64),
    "4-modes-damped-float32": ((2, 3, 2, 2, 2), (3,), 5, 0.95, 0.3, 0.2, torch.float32),
}


@pytest.mark.parametrize("case", DENSE_CASES.values(), ids=DENSE_CASES.keys())
def test_equals_explicit_kronecker_product_of_roots(case, device):
    shape, extra, steps, beta, damping, power, dtype = case
    kron = KroneckerHVP(beta=beta, damping=damping, power=power)
    grads = gradient_history(steps, shape, device, dtype)
    for grad in grads:
        kron.update(grad)
    v = torch.randn(*extra, *shape, device=device, dtype=dtype)
    expected = dense_apply(dense_kronecker(grads, beta, damping, power), v, len(shape) - 1)
    torch.testing.assert_close(kron.apply(v).cpu().double(), expected, **TOL[dtype])


NEAR_SINGULAR = {
    # name: gradient history (float64, shape (n, 3, 4, 2)) whose covariances are (near) singular
    "constant-grad": lambda t: [torch.full((2, 3, 4, 2), 3.0, dtype=F64) for _ in range(t)],
    "zero-grad": lambda t: [torch.zeros(2, 3, 4, 2, dtype=F64) for _ in range(t)],
    "rank-one-modes": lambda t: [
        torch.randn(2, 1, 1, 1, dtype=F64)
        * torch.einsum("a,b,c->abc", *(torch.arange(1.0, m + 1, dtype=F64) for m in (3, 4, 2)))
        for _ in range(t)
    ],
}


@pytest.mark.parametrize("make_grads", NEAR_SINGULAR.values(), ids=NEAR_SINGULAR.keys())
def test_near_singular_covariance_gives_the_reference(make_grads, device):
    grads = [g.to(device) for g in make_grads(5)]
    kron = KroneckerHVP(beta=0.9)
    for grad in grads:
        kron.update(grad)
    v = torch.randn(2, 3, 4, 2, device=device, dtype=F64)
    expected = dense_apply(dense_kronecker(grads, beta=0.9), v, 3)
    # a cube root turns rounding-sized eigenvalues (1e-16) into 1e-5-sized ones: compare at that
    torch.testing.assert_close(kron.apply(v).cpu(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("make_grads", NEAR_SINGULAR.values(), ids=NEAR_SINGULAR.keys())
def test_near_singular_covariance_of_float32_statistics_gives_no_nan(make_grads, device):
    kron = KroneckerHVP(beta=0.9)
    for grad in make_grads(5):
        kron.update(grad.float().to(device))
    assert torch.isfinite(kron.apply(torch.randn(2, 3, 4, 2, device=device))).all()


SYMMETRY_CASES = {
    # name: (shape (n, *modes), dtype, gradient offset: a large one makes covariances ill-conditioned)
    "float64": ((2, 3, 2, 4), F64, 0.5),
    "float32": ((3, 4, 3), torch.float32, 0.5),
    "float32-ill-conditioned": ((2, 3, 2, 4), torch.float32, 1e3),
}


@pytest.mark.parametrize("case", SYMMETRY_CASES.values(), ids=SYMMETRY_CASES.keys())
def test_operator_is_symmetric_per_system(case, device):
    shape, dtype, offset = case
    kron = KroneckerHVP(beta=0.9)
    for _ in range(4):
        kron.update(torch.randn(shape, device=device, dtype=dtype) + offset)
    size = math.prod(shape[1:])
    basis = torch.eye(size, device=device, dtype=dtype).reshape(size, 1, *shape[1:])
    columns = kron.apply(basis.expand(size, *shape).clone())  # (N, n, *modes): K e_j per system
    matrix = columns.flatten(start_dim=2).transpose(0, 1)  # (n, N, N), row j = K e_j
    torch.testing.assert_close(matrix, matrix.mT)


# --- caching, state, reset -----------------------------------------------------------------------

REFRESH_CASES = {
    # name: (refresh_every, the step whose statistics each apply (one after every update) sees)
    "every-update": (1, [1, 2, 3, 4, 5]),
    "every-second-update": (2, [1, 1, 3, 3, 5]),
    "every-third-update": (3, [1, 1, 1, 4, 4]),
}


@pytest.mark.parametrize("case", REFRESH_CASES.values(), ids=REFRESH_CASES.keys())
def test_refresh_every_reuses_roots_until_k_updates_have_passed(case, device):
    refresh_every, seen_steps = case
    kron = KroneckerHVP(beta=0.9, refresh_every=refresh_every)
    grads = gradient_history(len(seen_steps), (2, 3, 4), device)
    v = torch.randn(2, 3, 4, device=device, dtype=F64)
    ours = [kron(grad, v).cpu() for grad in grads]
    expected = [dense_apply(dense_kronecker(grads[:s], beta=0.9), v, 2) for s in seen_steps]
    torch.testing.assert_close(ours, expected)


def test_roots_are_computed_once_per_update_not_per_apply(device, monkeypatch):
    calls = []
    eigh = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda a: calls.append(a.shape) or eigh(a))
    kron = KroneckerHVP()
    v = torch.randn(2, 3, 4, 5, device=device)
    for _ in range(2):
        kron.update(torch.randn(2, 3, 4, 5, device=device))
        for _ in range(3):
            kron.apply(v)
    assert len(calls) == 2 * 3  # two updates x three modes, whatever the number of applies


def test_state_round_trip_continues_identically(device):
    grads = gradient_history(6, (2, 3, 4, 2), device, torch.float32)
    v = torch.randn(2, 3, 4, 2, device=device)
    original, restored = KroneckerHVP(beta=0.9), KroneckerHVP(beta=0.9)
    for grad in grads[:3]:
        original.update(grad)
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    buffer.seek(0)
    restored.load_state_dict(torch.load(buffer))
    ours = [original(grad, v) for grad in grads[3:]]
    assert all(map(torch.equal, ours, [restored(grad, v) for grad in grads[3:]]))


RESUME_CASES = {
    # name: (refresh_every, updates (each followed by an apply) before the save, dtype); the
    # run goes on to 9 updates, across a refresh of the roots
    "refresh-every-3-stale-roots": (3, 5, F64),
    "refresh-every-3-fresh-roots-float32": (3, 4, torch.float32),
    "refresh-every-4-due-at-the-next-apply": (4, 4, F64),
}


@pytest.mark.parametrize("case", RESUME_CASES.values(), ids=RESUME_CASES.keys())
def test_a_resumed_run_continues_bit_for_bit_with_the_cached_roots(case, device):
    """A run saved and resumed with refresh_every > 1 recomputed its roots at the first apply
    after loading, where the uninterrupted run reused its cached ones (until 2026-12-07 the
    state had no roots): a checkpointed run gave other numbers than an uninterrupted one."""
    refresh_every, saved_after, dtype = case
    grads = gradient_history(9, (2, 3, 4), device, dtype)
    v = torch.randn(2, 2, 3, 4, device=device, dtype=dtype)
    original = KroneckerHVP(beta=0.9, damping=0.01, refresh_every=refresh_every)
    for grad in grads[:saved_after]:
        original(grad, v)
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    buffer.seek(0)
    restored = KroneckerHVP(beta=0.9, damping=0.01, refresh_every=refresh_every)
    restored.load_state_dict(torch.load(buffer))
    ours = [original(grad, v) for grad in grads[saved_after:]]
    assert all(map(torch.equal, ours, [restored(grad, v) for grad in grads[saved_after:]]))


@pytest.mark.parametrize("option, value", [("damping", 0.5), ("power", 1.0)])
def test_a_state_loaded_with_another_damping_or_power_recomputes_its_roots(option, value, device):
    """The saved roots are those of the saved damping and power: an instance that chose others
    computes its own, as the original does when that option is set on it."""
    original = KroneckerHVP(beta=0.9, refresh_every=3)
    v = torch.randn(2, 3, 4, device=device, dtype=F64)
    for grad in gradient_history(3, (2, 3, 4), device):
        original(grad, v)  # roots of the first update, stale at the last
    restored = KroneckerHVP(beta=0.9, refresh_every=3, **{option: value})
    restored.load_state_dict(original.state_dict())
    setattr(original, option, value)
    assert torch.equal(restored.apply(v), original.apply(v))


def test_a_state_saved_before_any_update_loads_as_a_reset(device):
    kron = fitted(device)
    kron.load_state_dict(KroneckerHVP().state_dict())
    assert same_state(kron.state_dict(), KroneckerHVP().state_dict())


def test_statistics_are_float64_on_the_first_grads_device_roots_in_its_dtype(device):
    kron = KroneckerHVP()
    kron.update(torch.randn(2, 3, 4, device=device, dtype=torch.float32))
    state = kron.state_dict()
    assert state["dtype"] == torch.float32
    statistics = {(t.device.type, t.dtype) for t in [state["mean"], *state["factors"]]}
    assert statistics == {(device.type, torch.float64)}
    assert {(r.device.type, r.dtype) for r in kron.roots()} == {(device.type, torch.float32)}


@pytest.mark.parametrize("mean", [123.456, 1000.0])
def test_float32_gradients_whose_mean_dwarfs_their_spread_keep_their_covariance(mean, device):
    """Second moments in float32 cancelled (covariance = E[g g^T] - mu mu^T): a constant
    gradient of 123.456 gave 22x the damping, mean 1000 with spread 0.1 a root 100x off."""
    generator = torch.Generator().manual_seed(0)
    grads = [mean + 0.1 * torch.randn(1, 4, 3, generator=generator) for _ in range(50)]
    ours, exact = KroneckerHVP(beta=0.9, damping=1e-3), KroneckerHVP(beta=0.9, damping=1e-3)
    for grad in grads:
        ours.update(grad.to(device))
        exact.update(grad.double().to(device))
    for root, expected in zip(ours.roots(), exact.roots(), strict=True):
        torch.testing.assert_close(root.double(), expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("offset", [1e5, 1e7])
def test_float64_gradients_whose_mean_dwarfs_their_spread_keep_their_covariance(offset, device):
    """A covariance does not change with a constant added to every gradient. As a difference of
    second moments it cancelled in float64 too: spread 1e-3 under a mean of 1e5 gave the
    operator 8.4 times off, under 1e7 5e4 times (until 2026-12-07)."""
    generator = torch.Generator().manual_seed(0)
    grads = [1e-3 * torch.randn(2, 4, 3, generator=generator, dtype=F64) for _ in range(20)]
    shifted, centred = KroneckerHVP(beta=0.9), KroneckerHVP(beta=0.9)
    for grad in grads:
        shifted.update((grad + offset).to(device))
        centred.update(grad.to(device))
    v = torch.randn(2, 4, 3, dtype=F64, device=device)
    torch.testing.assert_close(shifted.apply(v), centred.apply(v), rtol=1e-5, atol=0.0)


def test_roots_are_copies_of_the_cache(device):
    kron = fitted(device)
    kron.roots()[0].zero_()
    assert bool(kron.roots()[0].abs().sum() > 0)


def as_second_moments(state):
    """A state's factors as states saved before 2026-12-07 held them: the EMA of each mode's
    outer products over the other modes' size, ``F_i = S_i + c mu_i mu_i^T`` for the scatters
    ``S_i``, ``c = 1 - decay``, ``mu_i`` the corrected mean over the other modes."""
    mean, held = state["mean"], 1 - state["decay"]
    factors = []
    for i, scatter in enumerate(state["factors"]):
        mu = mean.movedim(1 + i, 1).reshape(mean.shape[0], mean.shape[1 + i], -1).mean(-1) / held
        factors.append(scatter + held * mu[:, :, None] * mu[:, None, :])
    return {k: v for k, v in state.items() if k != "factors_centred"} | {"factors": factors}


def test_a_state_saved_with_statistics_in_the_gradients_dtype_still_loads(device):
    """States saved before 2026-12-04: no ``dtype``, statistics (second moments) in the
    gradients' dtype."""
    state = fitted(device).state_dict()
    moments = as_second_moments(state)
    old = {"step": state["step"], "mean": state["mean"].float(),
           "factors": [f.float() for f in moments["factors"]]}  # fmt: skip
    kron = KroneckerHVP()
    kron.load_state_dict(old)
    v = torch.randn(2, 3, 4, device=device)  # up to the float32 statistics' rounding (one update,
    # no damping: square roots of small eigenvalues)
    torch.testing.assert_close(kron.apply(v), fitted_like(state).apply(v), rtol=1e-2, atol=1e-3)


def test_a_state_saved_without_its_roots_still_loads_and_recomputes_them(device):
    """States saved before 2026-12-07: no ``roots``, ``updates_since_roots``, ``roots_damping``
    or ``roots_power``; the roots are those of the loaded statistics, not the saved run's stale
    ones."""
    grads = gradient_history(2, (2, 3, 4), device)
    v = torch.randn(2, 3, 4, device=device, dtype=F64)
    original = KroneckerHVP(beta=0.9, refresh_every=3)
    for grad in grads:
        original(grad, v)  # roots of the first update, reused at the second
    new_keys = {"roots", "updates_since_roots", "roots_damping", "roots_power"}
    old = {k: value for k, value in original.state_dict().items() if k not in new_keys}
    kron = KroneckerHVP(beta=0.9, refresh_every=3)
    kron.load_state_dict(old)
    expected = dense_apply(dense_kronecker(grads, beta=0.9), v, 2)
    torch.testing.assert_close(kron.apply(v).cpu(), expected)


def test_a_loaded_state_is_copied_not_shared(device):
    """Float64 statistics were taken as they were: the next update wrote into the caller's."""
    state = fitted(device).state_dict()
    before = state["mean"].clone()
    kron = fitted_like(state)
    kron.update(torch.randn(2, 3, 4, device=device))
    assert torch.equal(state["mean"], before)


def fitted_like(state):
    kron = KroneckerHVP()
    kron.load_state_dict(state)
    return kron


def test_reset_starts_over_with_any_shape(device):
    kron, fresh = KroneckerHVP(), KroneckerHVP()
    kron.update(torch.randn(2, 3, 4, device=device))
    kron.reset()
    grad, v = (
        torch.randn(3, 5, device=device, dtype=F64),
        torch.randn(3, 5, device=device, dtype=F64),
    )
    assert torch.equal(kron(grad, v), fresh(grad, v))


def test_numpy_scalars_are_options_as_python_numbers_are():
    """As ``samples=`` and ``chunk_size=`` of the other operators take them (a NumPy int from a
    config file or an array's size)."""
    numpy = pytest.importorskip("numpy")
    kron = KroneckerHVP(beta=numpy.float64(0.9), damping=numpy.float32(0.5),
                        refresh_every=numpy.int64(2))  # fmt: skip
    assert (kron.beta, kron.damping, kron.refresh_every) == (0.9, 0.5, 2)


def test_a_state_whose_counts_are_numpy_ints_loads_as_with_python_ints(device):
    # a state that went through NumPy (a checkpoint's metadata): refused before 2026-12-07
    numpy = pytest.importorskip("numpy")
    state, v = state_with(device), torch.randn(5, 2, 3, 4, device=device)
    as_numpy, as_python = KroneckerHVP(), KroneckerHVP()
    counts = {key: numpy.int64(state[key]) for key in ("step", "updates_since_roots")}
    as_numpy.load_state_dict({**state, **counts})
    as_python.load_state_dict(state)
    assert torch.equal(as_numpy.apply(v), as_python.apply(v))


def test_an_empty_extra_dim_of_v_gives_an_empty_result(device):
    v = torch.randn(0, 2, 3, 4, device=device)
    assert fitted(device).apply(v).shape == (0, 2, 3, 4)


def test_a_loaded_state_that_requires_grad_gives_results_without_a_graph(device):
    state = state_with(device)
    kron = KroneckerHVP()
    kron.load_state_dict({**state, "mean": state["mean"].clone().requires_grad_()})
    assert kron.apply(torch.randn(2, 3, 4, device=device)).grad_fn is None


# --- errors: type, and a message that names the argument -----------------------------------------


def fitted(device):
    """One update of float32 gradients, its roots cached (so that its state has them)."""
    kron = KroneckerHVP()
    kron.update(torch.randn(2, 3, 4, device=device))
    kron.roots()
    return kron


def state_with(device, **changes):
    return {**fitted(device).state_dict(), **changes}


def with_factor(device, i, value):
    factors = state_with(device)["factors"]
    factors[i] = factors[i].clone().fill_(value)
    return state_with(device, factors=factors)


def with_factors(device, change):
    state = state_with(device)
    return {**state, "factors": [change(f) for f in state["factors"]]}


def asymmetric_factors(device):
    factors = state_with(device)["factors"]
    return state_with(device, factors=[f + torch.triu(torch.ones_like(f), 1) for f in factors])


def with_roots(device, change):
    """A state with its cached roots (float32, shapes (2, 3, 3) and (2, 4, 4)) changed."""
    state = state_with(device)
    return {**state, "roots": change(state["roots"])}


BAD_STATES = {
    # name: (state built on a device, exception type, what the message must name)
    "factor-not-finite": (lambda d: with_factor(d, 1, math.nan), ValueError, r"factors'\]\[1\]"),
    "factor-infinite": (lambda d: with_factor(d, 0, math.inf), ValueError, r"factors'\]\[0\]"),
    "mean-not-finite": (
        lambda d: state_with(d, mean=torch.full((2, 3, 4), math.nan, device=d)),
        ValueError,
        "mean",
    ),
    "missing-key": (
        lambda d: {k: v for k, v in state_with(d).items() if k != "factors"},
        ValueError,
        "factors",
    ),
    "factors-not-a-list": (lambda d: state_with(d, factors=None), TypeError, "factors"),
    "factor-sparse": (
        lambda d: with_factors(d, lambda f: f.to_sparse()),
        TypeError,
        r"factors'\]\[0\] must be a dense \(strided\) tensor",
    ),
    "decay-one (no weight given to any gradient)": (
        lambda d: state_with(d, decay=1.0),
        ValueError,
        "decay",
    ),
    "mean-wrong-shape": (
        lambda d: state_with(d, mean=torch.ones(2, 4, 3, device=d)),
        ValueError,
        "factors",
    ),
    "factors-negated (their roots, of |eigenvalues|, looked plausible)": (
        lambda d: with_factors(d, lambda f: -f),
        ValueError,
        r"factors'\]\[0\].*semi-definite",
    ),
    "second moments (saved before 2026-12-07) zero under a nonzero mean": (
        lambda d: (
            as_second_moments(with_factors(d, torch.zeros_like))
            | {"factors": [torch.zeros_like(f) for f in state_with(d)["factors"]]}
        ),
        ValueError,
        "semi-definite",
    ),
    "mean-whose-square-overflows": (
        lambda d: {**(s := state_with(d)), "mean": s["mean"] * 1e200},
        ValueError,
        r"state\['mean'\] over 1 - decay, the gradients' mean, must have",
    ),
    "root-wrong-shape": (
        lambda d: with_roots(d, lambda r: [r[0], r[0]]),
        ValueError,
        r"roots'\]\[1\] must have shape \(2, 4, 4\).*got \(2, 3, 3\)",
    ),
    "root-wrong-dtype": (
        lambda d: with_roots(d, lambda r: [r[0], r[1].double()]),
        ValueError,
        r"roots'\]\[1\] must have .*float32, got torch.float64",
    ),
    "roots-one-too-few": (
        lambda d: with_roots(d, lambda r: r[:1]),
        ValueError,
        r"roots'\] must hold one root per mode .*\(2\), got 1",
    ),
    "roots-not-a-list": (lambda d: with_roots(d, lambda r: r[0]), TypeError, r"roots'\]"),
    "root-not-finite": (
        lambda d: with_roots(d, lambda r: [r[0], torch.full_like(r[1], math.nan)]),
        ValueError,
        r"roots'\]\[1\] must be finite",
    ),
    "root-asymmetric": (
        lambda d: with_roots(d, lambda r: [r[0] + torch.triu(torch.ones_like(r[0]), 1), r[1]]),
        ValueError,
        r"roots'\]\[0\] must be symmetric",
    ),
    "roots-at-step-0 (no statistics to have roots of)": (
        lambda d: state_with(d, step=0),
        ValueError,
        r"roots'\] must be None at step 0",
    ),
    "roots-without-the-options-they-were-computed-with": (
        lambda d: {k: v for k, v in state_with(d).items() if k != "roots_damping"},
        ValueError,
        "roots_damping",
    ),
    "updates-since-roots-negative": (
        lambda d: state_with(d, updates_since_roots=-1),
        ValueError,
        "updates_since_roots",
    ),
    "updates-since-roots-beyond-step": (
        lambda d: state_with(d, updates_since_roots=2),
        ValueError,
        "updates_since_roots",
    ),
}


@pytest.mark.parametrize("bad", [b for b, *_ in BAD_STATES.values()], ids=BAD_STATES.keys())
def test_a_refused_state_leaves_the_statistics_untouched(bad, device):
    kron = fitted(device)
    before = kron.state_dict()
    with pytest.raises((ValueError, TypeError)):
        kron.load_state_dict(bad(device))
    assert same_state(kron.state_dict(), before)  # the cached roots too


def same_state(a, b):
    """The same entries, tensors (in lists too) equal bit for bit."""

    def same(x, y):
        if isinstance(x, list):
            return isinstance(y, list) and len(x) == len(y) and all(map(same, x, y))
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and torch.equal(x, y)
        return x == y

    return a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)


ERROR_CASES = {
    # name: (action taking the device, exception type, what the message must name)
    "beta-zero": (lambda d: KroneckerHVP(beta=0.0), ValueError, "beta"),
    "beta-one": (lambda d: KroneckerHVP(beta=1.0), ValueError, "beta"),
    "beta-string": (lambda d: KroneckerHVP(beta="0.9"), ValueError, "beta"),
    "damping-negative": (lambda d: KroneckerHVP(damping=-0.1), ValueError, "damping"),
    "damping-nan": (lambda d: KroneckerHVP(damping=math.nan), ValueError, "damping"),
    "power-zero": (lambda d: KroneckerHVP(power=0.0), ValueError, "power"),
    "refresh-every-zero": (lambda d: KroneckerHVP(refresh_every=0), ValueError, "refresh_every"),
    "grad-not-tensor": (lambda d: KroneckerHVP().update([[1.0]]), TypeError, "grad"),
    "grad-integer": (
        lambda d: KroneckerHVP().update(torch.ones(2, 3, dtype=torch.int64, device=d)),
        TypeError,
        "grad",
    ),
    "grad-no-mode": (lambda d: KroneckerHVP().update(torch.ones(4, device=d)), ValueError, "grad"),
    "grad-empty-mode": (
        lambda d: KroneckerHVP().update(torch.ones(2, 0, device=d)),
        ValueError,
        "grad",
    ),
    "grad-shape-changes": (
        lambda d: fitted(d).update(torch.ones(2, 4, 3, device=d)),
        ValueError,
        "grad",
    ),
    "grad-dtype-changes": (
        lambda d: fitted(d).update(torch.ones(2, 3, 4, dtype=F64, device=d)),
        ValueError,
        "grad",
    ),
    "grad-not-finite": (
        lambda d: fitted(d).update(torch.full((2, 3, 4), math.inf, device=d)),
        ValueError,
        "grad",
    ),
    "grad-second-moments-overflow": (
        lambda d: KroneckerHVP().update(torch.full((2, 3, 4), 1e160, dtype=F64, device=d)),
        ValueError,
        "grad",
    ),
    "apply-before-update": (
        lambda d: KroneckerHVP().apply(torch.ones(2, 3, 4, device=d)),
        RuntimeError,
        "update",
    ),
    "v-trailing-dims": (lambda d: fitted(d).apply(torch.ones(2, 4, 3, device=d)), ValueError, "v"),
    "v-too-few-dims": (lambda d: fitted(d).apply(torch.ones(3, 4, device=d)), ValueError, "v"),
    "v-dtype": (
        lambda d: fitted(d).apply(torch.ones(2, 3, 4, dtype=F64, device=d)),
        ValueError,
        "v",
    ),
    "v-integer": (
        lambda d: fitted(d).apply(torch.ones(2, 3, 4, dtype=torch.int64, device=d)),
        TypeError,
        "v",
    ),
    "state-step-negative": (
        lambda d: KroneckerHVP().load_state_dict(state_with(d, step=-1)),
        ValueError,
        "step",
    ),
    "state-mean-not-tensor": (
        lambda d: KroneckerHVP().load_state_dict(state_with(d, mean=[1.0])),
        TypeError,
        "mean",
    ),
    "state-factors-missing-mode": (
        lambda d: KroneckerHVP().load_state_dict(
            state_with(d, factors=state_with(d)["factors"][:1])
        ),
        ValueError,
        "factors",
    ),
    "state-factor-dtype": (
        lambda d: KroneckerHVP().load_state_dict(
            state_with(d, factors=[f.float() for f in state_with(d)["factors"]])
        ),
        ValueError,
        "factors",
    ),
    "state-factor-asymmetric": (
        lambda d: KroneckerHVP().load_state_dict(asymmetric_factors(d)),
        ValueError,
        "symmetric",
    ),
    "state-dtype-not-floating": (
        lambda d: KroneckerHVP().load_state_dict(state_with(d, dtype=torch.int64)),
        ValueError,
        "dtype",
    ),
    "state-dtype-float8 (until 2026-12-07: loaded, then apply raised 'isfinite not implemented')": (
        lambda d: KroneckerHVP().load_state_dict(state_with(d, dtype=torch.float8_e4m3fn)),
        ValueError,
        "state\\['dtype'\\] must be a floating torch.dtype torch computes in",
    ),
    "grad-float8 (until 2026-12-07: 'max_values_cpu not implemented')": (
        lambda d: KroneckerHVP().update(torch.ones(2, 3, 4, device=d).to(torch.float8_e5m2)),
        TypeError,
        "grad must have a dtype torch computes and differentiates in",
    ),
    **{
        f"state-{name}": (lambda d, bad=bad: KroneckerHVP().load_state_dict(bad(d)), *raised)
        for name, (bad, *raised) in BAD_STATES.items()
    },
}


@pytest.mark.parametrize("case", ERROR_CASES.values(), ids=ERROR_CASES.keys())
def test_bad_input_raises_naming_the_argument(case, device):
    action, error, name = case
    with pytest.raises(error, match=name):
        action(device)


def test_statistics_begun_in_inference_mode_serve_calls_outside_it():
    """A sampler's warm-up under inference_mode, then updates and a differentiable apply
    outside it (the statistics and roots were inference tensors: 'Inplace update to inference
    tensor outside InferenceMode')."""
    kron = KroneckerHVP(damping=1e-3)
    grads = torch.randn(3, 2, 3, 4, dtype=torch.float64)
    with torch.inference_mode():
        kron.update(grads[0])
        kron.apply(grads[0])
    kron.update(grads[1])
    v = grads[2].clone().requires_grad_()
    (gradient,) = torch.autograd.grad(kron.apply(v).sum(), v)
    expected = KroneckerHVP(damping=1e-3)
    for g in grads[:2]:
        expected.update(g)
    torch.testing.assert_close(gradient, expected.apply(torch.ones_like(v)))


def test_a_state_whose_factors_are_symmetric_to_rounding_loads():
    """Near-zero off-diagonal moments (orthonormal gradient rows) are symmetric only to
    rounding: its own state_dict loads (an exact comparison refused it)."""
    torch.manual_seed(0)
    kron = KroneckerHVP(beta=0.9)
    for _ in range(3):
        rows = torch.linalg.qr(torch.randn(300, 64, dtype=torch.float64)).Q
        kron.update(rows.T.reshape(1, 64, 300))
    loaded = KroneckerHVP(beta=0.9)
    loaded.load_state_dict(kron.state_dict())
    v = torch.randn(1, 64, 300, dtype=torch.float64)
    torch.testing.assert_close(loaded.apply(v), kron.apply(v))


BAD_V = {  # grad is (2, 3, 4) float64 on the CPU
    "shape": (lambda: torch.randn(2, 4, 3, dtype=torch.float64), "v must have shape"),
    "dtype": (lambda: torch.randn(2, 3, 4), "v must have grad's dtype"),
}
if torch.cuda.is_available():
    BAD_V["device"] = (
        lambda: torch.randn(2, 3, 4, dtype=torch.float64, device="cuda"),
        "v must be on grad's device",
    )


@pytest.mark.parametrize(("make_v", "message"), BAD_V.values(), ids=BAD_V.keys())
def test_a_call_refused_for_its_v_folds_nothing_in(make_v, message):
    """Until 2026-12-05 a v of another dtype or device was refused after grad was folded in."""
    kron = KroneckerHVP(beta=0.9)
    grad = torch.randn(2, 3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=message):
        kron(grad, make_v())
    assert kron.state_dict()["step"] == 0


@pytest.mark.parametrize("option, value", [("damping", 10.0), ("power", 1.0), ("beta", 0.5)])
def test_an_option_set_after_the_roots_were_cached_gives_its_own_roots(option, value):
    """The roots are cached until refresh_every updates; an option set since (a damping tried
    on the same statistics) was applied with the old one's roots (21.8 off for damping 0.1 ->
    10), until the roots remembered the options they were computed with."""
    torch.manual_seed(0)
    kron = KroneckerHVP(damping=0.1, refresh_every=3)
    for _ in range(4):
        kron.update(torch.randn(2, 3, 4, dtype=F64))
    v = torch.randn(2, 3, 4, dtype=F64)
    kron.apply(v)
    setattr(kron, option, value)
    fresh = KroneckerHVP(**{"damping": 0.1, option: value})
    fresh.load_state_dict(kron.state_dict())
    torch.testing.assert_close(kron.apply(v), fresh.apply(v), rtol=1e-12, atol=1e-12)


def test_a_beta_set_between_updates_weighs_later_updates_and_the_bias_correction_follows():
    """The correction is 1 minus the product of the betas the updates used (the post's
    beta_accum); until 2026-12-06 it was 1 - beta^t with the beta set last, which no update used
    (a warm-up from 0.9 to 0.99 corrected by 1 - 0.99^t: roots of a second moment)."""
    torch.manual_seed(0)
    grads = gradient_history(6, (2, 3, 4), torch.device("cpu"))
    betas = [0.9, 0.9, 0.9, 0.99, 0.99, 0.99]
    kron = KroneckerHVP(beta=betas[0])
    for beta, grad in zip(betas, grads, strict=True):
        kron.beta = beta
        kron.update(grad)
    v = torch.randn(2, 3, 4, dtype=F64)
    expected = dense_apply(dense_kronecker(grads, betas), v, 2)
    torch.testing.assert_close(kron.apply(v), expected, rtol=1e-10, atol=1e-12)
    restored = KroneckerHVP(beta=0.5)  # the state's decay, not the options' beta ** step
    restored.load_state_dict(kron.state_dict())
    torch.testing.assert_close(restored.apply(v), expected, rtol=1e-10, atol=1e-12)


def test_an_instance_pickled_before_refresh_every_was_a_property_loads_with_it():
    """Pickled before 2026-12-07, refresh_every was a plain attribute: reading it after
    loading raised AttributeError (a review of the property)."""
    kron = KroneckerHVP(refresh_every=3)
    kron.update(torch.randn(2, 3, 4, dtype=F64))
    state = dict(vars(kron)) | {"_factors": as_second_moments(kron.state_dict())["factors"]}
    del state["_scatters"]  # (second moments then)
    state["refresh_every"] = state.pop("_refresh_every")  # the old pickle's
    old = KroneckerHVP.__new__(KroneckerHVP)
    old.__setstate__(state)
    v = torch.randn(2, 3, 4, dtype=F64)
    assert old.refresh_every == 3
    torch.testing.assert_close(old.apply(v), kron.apply(v))  # (the moments' rounding)


@pytest.mark.parametrize(
    "option, value",
    [("damping", -1.0), ("power", 0.0), ("beta", 1.0), ("refresh_every", 0),
     ("refresh_every", 2.5), ("refresh_every", "x")],
)  # fmt: skip
def test_an_option_set_after_construction_is_checked_as_the_constructor_checks_it(option, value):
    with pytest.raises(ValueError, match=f"{option} must be"):
        setattr(KroneckerHVP(), option, value)


TRANSFORMS_AROUND_UPDATE = {
    "vmap": lambda kron, grads: torch.func.vmap(lambda g: kron(g, g))(grads),
    "grad": lambda kron, grads: torch.func.grad(lambda g: kron(g, g).sum())(grads[0]),
}


@pytest.mark.parametrize("around", TRANSFORMS_AROUND_UPDATE.values(),
                         ids=TRANSFORMS_AROUND_UPDATE.keys())  # fmt: skip
def test_an_update_inside_a_transform_is_refused_and_folds_nothing_in(around, device):
    """Until 2026-12-07 vmap failed inside the finiteness check with torch's "data-dependent
    control flow" error; grad would have kept wrapped tensors as the running state."""
    kron = KroneckerHVP()
    with pytest.raises(ValueError, match=r"cannot run inside a torch\.func transform"):
        around(kron, torch.randn(2, 3, 4, 5, device=device))
    assert kron.state_dict()["step"] == 0


def test_apply_inside_vmap_gives_apply_of_the_whole_batch(device):
    kron = fitted(device)
    v = torch.randn(5, 2, 3, 4, device=device)
    assert torch.allclose(torch.func.vmap(kron.apply)(v), kron.apply(v))


OVERFLOWING = {
    "float16 grads of 300, one mode (a root is the covariance, 9e4)": (
        lambda: torch.randn(4, 3, dtype=torch.float16) * 300,
        {},
    ),
    "float32 grads of 1e20, power 1": (lambda: torch.randn(2, 3, 4) * 1e20, {"power": 1.0}),
    "float32 grads of 1e30 (roots of 1e30 fit, their product does not)": (
        lambda: torch.randn(2, 3, 4) * 1e30,
        {},
    ),
}


@pytest.mark.parametrize(("make_grad", "options"), OVERFLOWING.values(), ids=OVERFLOWING.keys())
def test_an_operator_that_overflows_the_gradients_dtype_is_refused(make_grad, options):
    """Until 2026-12-07 such grads passed the float64 check and apply gave inf or NaN."""
    torch.manual_seed(0)
    kron = KroneckerHVP(**options)
    grad = make_grad()
    kron.update(grad)
    kron.update(-grad)
    with pytest.raises(ValueError, match="overflows the gradients' dtype"):
        kron.apply(torch.ones_like(grad))


@pytest.mark.parametrize("option", ["damping", "power"])
def test_an_option_set_to_its_own_value_keeps_the_cached_roots(option, monkeypatch):
    """A config applied again after load_state_dict recomputed the roots: with refresh_every > 1
    the resumed run then left the uninterrupted one's (until 2026-12-07)."""
    kron = fitted(torch.device("cpu"))
    calls = []
    eigh = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda a: calls.append(a.shape) or eigh(a))
    setattr(kron, option, getattr(kron, option))
    kron.apply(torch.ones(2, 3, 4))
    assert calls == []


def test_an_ordinary_float16_run_is_not_refused():
    """A 256 x 256 system of gradients of spread 20: its largest eigenvalue (about 640) times
    sqrt(N) passed float16's 65504, which the first bound of 2026-12-07 refused; the operator
    fits (its product with ones is about 1800)."""
    torch.manual_seed(0)
    kron = KroneckerHVP()
    for _ in range(20):
        kron.update((20 * torch.randn(1, 256, 256)).half())
    assert bool(kron.apply(torch.ones(1, 256, 256, dtype=torch.float16)).isfinite().all())


def test_power_none_and_its_value_one_over_the_modes_are_one_power(monkeypatch):
    """Setting ``power=1/2`` on two modes, where it was None, kept nothing until 2026-12-07: a
    resumed run with ``refresh_every > 1`` then left the uninterrupted one."""
    kron = fitted(torch.device("cpu"))  # two modes, power None
    calls = []
    eigh = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda a: calls.append(a.shape) or eigh(a))
    kron.power = 0.5
    kron.apply(torch.ones(2, 3, 4))
    kron.power = None
    kron.apply(torch.ones(2, 3, 4))
    assert calls == []
    kron.power = 1.0  # another power: its own roots
    kron.apply(torch.ones(2, 3, 4))
    assert len(calls) == 2


def test_an_update_of_a_shallow_copy_leaves_the_original_as_it_was():
    """``update`` wrote the statistics in place, which ``copy.copy`` shares: one update of the
    copy folded a gradient into the original's moments, not its step count (until 2026-12-07
    its next roots were 0.22 off)."""
    torch.manual_seed(0)
    original = KroneckerHVP(beta=0.9, damping=1e-3)
    for _ in range(3):
        original.update(torch.randn(2, 3, 4, dtype=F64))
    untouched = copy.deepcopy(original)
    copy.copy(original).update(torch.randn(2, 3, 4, dtype=F64))
    v = torch.randn(2, 3, 4, dtype=F64)
    torch.testing.assert_close(original.apply(v), untouched.apply(v), rtol=0, atol=0)


def test_a_call_whose_operator_overflows_folds_nothing_in():
    """The overflow is found once the roots are computed, after ``update``: until 2026-12-07 the
    gradient stayed folded in, and the next calls with ordinary gradients raised too."""
    sign = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=torch.float16)
    kron, v = KroneckerHVP(beta=0.9), torch.ones(2, 3, 4, dtype=torch.float16)
    kron(torch.ones(2, 3, 4, dtype=torch.float16) * sign, v)
    before = kron.state_dict()
    with pytest.raises(ValueError, match="overflows the gradients' dtype"):
        kron(torch.full((2, 3, 4), 300.0, dtype=torch.float16) * sign, v)
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
               for a, b in zip(_flat(kron.state_dict()), _flat(before), strict=True))  # fmt: skip


def _flat(state):
    return [leaf for value in state.values()
            for leaf in (value if isinstance(value, list) else [value])]  # fmt: skip


def test_float16_products_whose_intermediate_overflows_but_whose_result_fits_are_finite():
    """``apply`` contracts one mode at a time: an intermediate of float16 overflowed (inf) where
    the result, 50304, fits float16's 65504 (until 2026-12-07); half dtypes contract in float32
    now, as a matmul accumulates."""
    first = torch.zeros(2000)
    first[0] = 500**0.5
    second = torch.tensor([1.0, -1.0])
    kron = KroneckerHVP(beta=0.9)  # a rank-1 covariance of zero mean over the second mode
    kron.update((first[:, None] * second)[None].half())
    v = (4500 * first[:, None].sign() * second / 2**0.5)[None].half()
    roots = [root.double() for root in kron.roots()]
    exact = torch.einsum("nij,nkl,njl->nik", *roots, v.double())
    torch.testing.assert_close(kron.apply(v).double(), exact, rtol=1e-3, atol=0.0)


def test_an_instance_pickled_before_its_options_were_properties_loads_and_runs():
    """Pickled before 2026-12-06, beta, damping and power were plain attributes and there was
    no ``_decay``: the instance loaded, then every use raised AttributeError ('_beta')."""
    torch.manual_seed(0)
    grads = [torch.randn(2, 3, 4, dtype=F64) for _ in range(3)]
    kron = KroneckerHVP(beta=0.9, damping=1e-3, refresh_every=2)
    for grad in grads:
        kron.update(grad)
    old = {name: value for name, value in vars(kron).items() if name not in ("_decay", "_scatters")}
    old["_factors"] = as_second_moments(kron.state_dict())["factors"]  # (second moments then)
    for option in ("beta", "damping", "power", "refresh_every"):
        old[option] = old.pop(f"_{option}")  # that pickle's own attributes
    loaded = pickle.loads(pickle.dumps(kron))
    loaded.__dict__.clear()
    loaded.__setstate__(old)
    v = torch.randn(2, 3, 4, dtype=F64)
    torch.testing.assert_close(loaded.apply(v), kron.apply(v))  # (the moments' rounding)
