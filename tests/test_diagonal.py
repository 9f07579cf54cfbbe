"""Specification of hessian_diagonal against dense float64 per-instance Hessian diagonals."""

import re
import warnings
from dataclasses import dataclass, field

import pytest
import torch
from dense import TAYLOR_CASES, instance_hessian_diagonal
from torch import nn

import pyhvp
from pyhvp import TorchBackend, taylor
from pyhvp.backends import torch as torch_backend
from pyhvp.backends.compile_policy import function_key
from pyhvp.backends.julia import julia_available

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def tolerance(dtype):
    return {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-9, "atol": 1e-11}


# --- functions: f(x, *args) -> batch_shape + out_shape -------------------------------------


def seed_layer(device, dtype):
    """The seed's nn.Linear(3, 5), with fixed weights."""
    torch.manual_seed(3)
    return nn.Linear(3, 5).requires_grad_(False).to(device, dtype)


def f_batch_scalar(x):
    """Seed: [B, N] -> [B]."""
    return torch.sum(x * x, dim=-1)


def seed_vector(layer):
    """Seed's f_single_vector / f_batch_vector: sigmoid(layer(x)), [..., 3] -> [..., 5]."""
    return lambda x: torch.sigmoid(layer(x))


def tanh_mlp(d_out, device, dtype, d_in=4, hidden=6):
    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out))
    net = net.requires_grad_(False).to(device, dtype)
    return (lambda x: net(x).squeeze(-1)) if d_out == 1 else net


def matrix_scalar(x, w):
    """event_dims=2: each instance is a (2, 3) matrix, w (3, 3) shared; scalar out."""
    return (torch.tanh(x @ w) ** 2).sum((-2, -1))


def matrix_vector(x, w):
    """event_dims=2 with an arg, vector out: column sums of tanh(x w), out_shape (3,)."""
    return torch.tanh(x @ w).sum(-2)


def gaussian(x, mu):
    """Seed-000 layout: 3 batch dims, mu broadcast over the middle ones; scalar out."""
    return torch.exp(-((x - mu) ** 2).sum(-1))


def outer(x):
    """2-D out_shape (n, n): sin(x_i) cos(x_j)."""
    return torch.sin(x)[..., :, None] * torch.cos(x)[..., None, :]


@dataclass
class Case:
    name: str
    build: object  # (device, dtype) -> f
    x_shape: tuple
    args_shapes: tuple = ()
    event_dims: int = 1
    kwargs: dict = field(default_factory=dict)
    x_values: list | None = None

    def reference(self, x, *args, device):
        """Dense float64 diagonal, from the same function built in float64 (same weights)."""
        f64 = self.build(device, torch.float64)
        return instance_hessian_diagonal(f64, x, *args, event_dims=self.event_dims)

    def make(self, device, dtype):
        f = self.build(device, dtype)
        torch.manual_seed(5)
        x = (
            torch.tensor(self.x_values, dtype=dtype, device=device)
            if self.x_values is not None
            else torch.randn(self.x_shape, dtype=dtype, device=device)
        )
        args = tuple(torch.randn(s, dtype=dtype, device=device) for s in self.args_shapes)
        return f, x, args


SEED_X_BATCH = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
CASES = [
    Case("seed f_batch_scalar", lambda d, t: f_batch_scalar, (3, 3), x_values=SEED_X_BATCH),
    Case(
        "seed f_single_vector: (3,) -> (5, 3)",
        lambda d, t: seed_vector(seed_layer(d, t)),
        (3,),
        x_values=[1.0, 2.0, 3.0],
    ),
    Case(
        "seed f_batch_vector: (3, 3) -> (3, 5, 3)",
        lambda d, t: seed_vector(seed_layer(d, t)),
        (3, 3),
        x_values=SEED_X_BATCH,
    ),
    Case("tanh MLP, scalar out", lambda d, t: tanh_mlp(1, d, t), (5, 4)),
    Case("tanh MLP, vector out", lambda d, t: tanh_mlp(3, d, t), (5, 4)),
    Case(
        "tanh MLP, vector out, chunked by 3",
        lambda d, t: tanh_mlp(3, d, t),
        (5, 4),
        kwargs={"chunk_size": 3},
    ),
    Case(
        "tanh MLP, scalar out, chunked by 3",
        lambda d, t: tanh_mlp(1, d, t),
        (5, 4),
        kwargs={"chunk_size": 3},
    ),
    Case("event_dims=2 + arg, scalar", lambda d, t: matrix_scalar, (4, 2, 3), ((3, 3),), 2),
    Case("event_dims=2 + arg, vector", lambda d, t: matrix_vector, (4, 2, 3), ((3, 3),), 2),
    Case(
        "3 batch dims, broadcast arg, scalar", lambda d, t: gaussian, (2, 3, 4, 3), ((2, 1, 1, 3),)
    ),
    Case("2-D out_shape", lambda d, t: outer, (4, 3)),
    Case(
        "per_instance(seed f_single_vector), batched: (3, 3) -> (3, 5, 3)",
        lambda d, t: pyhvp.per_instance(seed_vector(seed_layer(d, t))),
        (3, 3),
        x_values=SEED_X_BATCH,
    ),
    Case(
        "per_instance, event_dims=2 + shared arg, vector",
        lambda d, t: pyhvp.per_instance(matrix_vector, event_dims=2, arg_event_dims=2),
        (2, 2, 2, 3),
        ((3, 3),),
        2,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_exact_matches_dense_diagonal(case, dtype, device):
    f, x, args = case.make(device, dtype)
    d = pyhvp.hessian_diagonal(f, x, *args, event_dims=case.event_dims, **case.kwargs)
    expected = case.reference(x, *args, device=device)
    torch.testing.assert_close(d.double(), expected, **tolerance(dtype))


def test_expanded_x_gives_the_contiguous_result(device):
    """Issue 10 item 5: a stride-0 x (one instance expanded) on the vector path."""
    f = tanh_mlp(3, device, torch.float64)
    x = torch.randn(1, 4, device=device, dtype=torch.float64).expand(8, 4)
    for g in (f, pyhvp.per_instance(f)):
        torch.testing.assert_close(
            pyhvp.hessian_diagonal(g, x), pyhvp.hessian_diagonal(f, x.contiguous())
        )


def constant_vector(x):
    return torch.ones(*x.shape[:-1], 2, dtype=x.dtype, device=x.device)


@pytest.mark.parametrize("compile_mode", [False, True])
@pytest.mark.parametrize("f", [constant_vector, lambda x: 3 * x - 1], ids=["constant", "affine"])
def test_zero_hessian_gives_zeros_on_the_vector_path(f, compile_mode, device):
    x = torch.randn(5, 3, device=device)
    d = pyhvp.hessian_diagonal(f, x, backend=TorchBackend(compile=compile_mode))
    assert d.shape == (5, f(x).shape[-1], 3) and not d.any()


def test_directions_broadcast_over_instances_equal_expanded_ones(device):
    """The backend contract: a direction of size 1 in the batch dims is the same in every
    instance; a backend may exploit it (a first layer maps it once) or expand it."""
    f = tanh_mlp(3, device, torch.float64)
    x = torch.randn(6, 4, device=device, dtype=torch.float64)
    shared = torch.randn(5, 1, 4, device=device, dtype=torch.float64)
    backend = TorchBackend(compile=False)
    torch.testing.assert_close(
        backend.second_directional(f, x, shared, (), None),
        backend.second_directional(f, x, shared.expand(5, 6, 4).contiguous(), (), None),
    )


def test_seed_single_vector_has_shape_m_by_n():
    f, x, _ = CASES[1].make("cpu", torch.float32)
    assert pyhvp.hessian_diagonal(f, x).shape == (5, 3)


@pytest.mark.parametrize("case", [CASES[3], CASES[4]], ids=lambda c: c.name)
def test_result_holds_no_more_memory_than_its_entries(case):
    """The N passes' (N, *x.shape) products are not kept alive by the returned diagonal."""
    f, x, args = case.make("cpu", torch.float64)
    d = pyhvp.hessian_diagonal(f, x, *args)
    assert d.untyped_storage().nbytes() == d.numel() * d.element_size()


class GradOnlyBackend:
    """A backend with forward-over-reverse only, like backend='julia'."""

    name = "grad-only"

    def grad_and_hvp(self, *call):
        return TorchBackend(compile=False).grad_and_hvp(*call)

    def second_directional(self, *call):
        raise NotImplementedError("grad-only backend")


@pytest.mark.parametrize("case", [c for c in CASES if "scalar" in c.name], ids=lambda c: c.name)
def test_scalar_exact_needs_only_grad_and_hvp(case, device):
    f, x, args = case.make(device, torch.float64)
    d = pyhvp.hessian_diagonal(f, x, *args, event_dims=case.event_dims, backend=GradOnlyBackend())
    torch.testing.assert_close(d, case.reference(x, *args, device=device))


def mentions(key, f):
    """Is ``f`` (its function key) part of the compile-cache key ``key``?"""
    part = function_key(f)
    return key == part or (isinstance(key, tuple) and any(mentions(k, f) for k in key))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES[:5], ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_compiled_path_matches_dense_without_falling_back(case, dtype, device):
    f, x, args = case.make(device, dtype)
    if x.ndim > 1:  # a batch size no other test uses: its compile entries are fresh
        x = torch.cat([x, x[:2]])

    def fresh(y, *a):  # a new function object: only this call's signatures are cached for it
        return f(y, *a)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        d = pyhvp.hessian_diagonal(fresh, x, *args, backend=TorchBackend(compile=True))
    # vector outputs run jet kernels (keyed by the kernel, not by f), on every device
    kernels = taylor.capture(fresh, x, args).program.kernels.values()
    entries = [
        e
        for key, e in torch_backend._CACHE.entries.items()
        if mentions(key, fresh) or any(mentions(key, k) for k in kernels)
    ]
    assert entries and all(e.compiled is not None and not e.failed for e in entries), caught
    torch.testing.assert_close(d.double(), case.reference(x, device=device), **tolerance(dtype))


@pytest.mark.parametrize("case", TAYLOR_CASES, ids=lambda c: c.name)
def test_taylor_engine_differentiates_like_autograd(case, device):
    """no_grad, in-place writes, powers at 0, singular det, ... (tests/dense.py), per
    direction; dense references on the first 8 instances."""
    f, reference = case.build(device)
    x = case.point(device)
    d = pyhvp.hessian_diagonal(f, x, event_dims=case.event_dims)
    expected = instance_hessian_diagonal(reference or f, x[:8], event_dims=case.event_dims)
    torch.testing.assert_close(d[:8], expected, **tolerance(torch.float64))


@pytest.mark.parametrize("method", ["exact", "diag++"])
@pytest.mark.parametrize("captured", [False, True], ids=["x passed again", "x captured"])
def test_x_reaching_f_another_way_is_a_constant(method, captured, device):
    """The partial derivatives in x, whichever the path (Taylor or Hessian-vector products)."""
    x = torch.randn(5, 4, dtype=torch.float64, device=device)

    def f(y, z):
        return (y * y * z).sum(-1) + torch.sin(y * z).sum(-1)

    call, args = ((lambda y: f(y, x)), ()) if captured else (f, (x,))
    options = {} if method == "exact" else {"samples": 12}
    d = pyhvp.hessian_diagonal(call, x, *args, method=method, **options)
    torch.testing.assert_close(d, instance_hessian_diagonal(f, x, x.clone()))


# method -> whether captured parameters alone give the result a graph (the exact method runs the
# Taylor engine, whose kernels take them as inputs; the estimators' Hessian-vector products keep
# a graph only when x or an arg requires grad, and then reach the captured parameters too)
CAPTURED_ALONE = {"exact": True, "hutchinson": False, "diag++": False}


@pytest.mark.parametrize(("method", "alone"), CAPTURED_ALONE.items(), ids=CAPTURED_ALONE.keys())
def test_which_results_reach_captured_parameters(method, alone, device):
    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 1)).to(device, torch.float64)
    x = torch.randn(4, 3, dtype=torch.float64, device=device)
    options = {} if method == "exact" else {"samples": 6}

    def f(x, s):
        return net(x * s).squeeze(-1)

    ones = torch.ones(3, dtype=torch.float64, device=device)
    assert pyhvp.hessian_diagonal(f, x, ones, method=method, **options).requires_grad == alone
    scale = ones.clone().requires_grad_()
    d = pyhvp.hessian_diagonal(f, x, scale, method=method, **options)
    weight_grad, scale_grad = torch.autograd.grad(d.sum(), [net[0].weight, scale])
    assert weight_grad.abs().sum() > 0 and scale_grad.abs().sum() > 0


@pytest.mark.parametrize("method", CAPTURED_ALONE)
def test_every_method_is_differentiable_in_tensors_inside_a_container_arg(method, device):
    """A dict of parameters (functional_call's) is an arg like a tensor: the same gradient
    (until 2026-12-05 the estimators' results came back detached)."""
    x = torch.randn(4, 3, dtype=torch.float64, device=device)
    scale = torch.rand(3, dtype=torch.float64, device=device).add(0.5).requires_grad_()

    def f(x, s):
        return torch.tanh(x * s).pow(3).sum(-1)

    def gradient(call, arg):
        seeded = {"samples": 6, "generator": torch.Generator().manual_seed(0)}
        d = pyhvp.hessian_diagonal(call, x, arg, method=method,
                                   **({} if method == "exact" else seeded))  # fmt: skip
        return torch.autograd.grad(d.sum(), scale)[0]

    in_dict = gradient(lambda x, params: f(x, params["scale"]), {"scale": scale})
    torch.testing.assert_close(in_dict, gradient(f, scale))


@pytest.mark.parametrize("method", CAPTURED_ALONE)
def test_every_method_accepts_an_inference_x_next_to_an_arg_that_requires_grad(method):
    """The same diagonal as from a normal x (until 2026-12-05 the estimators raised: autograd
    refuses to make an inference tensor require grad)."""
    x = torch.randn(4, 3, dtype=torch.float64)
    with torch.inference_mode():
        frozen = x.clone()
    scale = torch.rand(3, dtype=torch.float64).add(0.5).requires_grad_()

    def diagonal(x):
        seeded = {"samples": 6, "generator": torch.Generator().manual_seed(0)}
        return pyhvp.hessian_diagonal(lambda x, s: torch.tanh(x * s).pow(3).sum(-1), x, scale,
                                      method=method, **({} if method == "exact" else seeded))  # fmt: skip

    torch.testing.assert_close(diagonal(frozen), diagonal(x))


# --- estimators --------------------------------------------------------------------------------


def low_rank(x, u):
    """Per-instance Hessian U diag(.) U^T of rank u.shape[1] (= 2)."""
    return torch.log(torch.cosh(x @ u)).sum(-1)


def estimator_problem(device, n_vars=6, hidden=12):
    """A scalar tanh MLP over 8 instances, float64, and its exact diagonal."""
    f = tanh_mlp(1, device, torch.float64, d_in=n_vars, hidden=hidden)
    x = torch.randn(8, n_vars, dtype=torch.float64, device=device)
    return f, x, instance_hessian_diagonal(f, x)


def relative_error(estimate, exact):
    return float((estimate - exact).norm() / exact.norm())


def estimate(f, x, method, samples, seed, *args):
    generator = torch.Generator().manual_seed(seed)
    return pyhvp.hessian_diagonal(f, x, *args, method=method, samples=samples, generator=generator)


STOCHASTIC = ["hutchinson", "diag++"]


@pytest.mark.parametrize("method", STOCHASTIC)
def test_estimate_is_a_function_of_the_generator_state(method, device):
    f, x, _ = estimator_problem(device)
    first, again, other = (estimate(f, x, method, 9, seed) for seed in (1, 1, 2))
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_cpu_generator_gives_the_same_estimate_on_every_device(device):
    f, x, _ = estimator_problem("cpu")
    on_device = estimate(
        tanh_mlp(1, device, torch.float64, 6, 12), x.to(device), "hutchinson", 9, 1
    )
    torch.testing.assert_close(on_device.cpu(), estimate(f, x, "hutchinson", 9, 1))


# method -> (samples, relative error target): Hutchinson's error is ~ 0.014 at 30k samples here
# (~ 1 / sqrt(samples)); Diag++ with samples >= 3 N sketches all N directions, so it is exact.
CONVERGENCE = {"hutchinson": (30_000, 0.05), "diag++": (18, 1e-10)}


@pytest.mark.parametrize(("method", "budget"), CONVERGENCE.items(), ids=CONVERGENCE.keys())
def test_estimate_converges_to_exact_diagonal(method, budget, device):
    f, x, exact = estimator_problem(device)
    samples, target = budget
    assert relative_error(estimate(f, x, method, samples, seed=0), exact) < target


# method -> (problem size N, hidden width, sample counts); the error should at least halve per
# step (measured: Hutchinson ~4x per 16x samples, Diag++ 1.6 -> 0.4 -> 1e-15 at N = 40).
SHRINK = {"hutchinson": (6, 12, (60, 960, 15_360)), "diag++": (40, 80, (15, 60, 120))}


@pytest.mark.parametrize(("method", "plan"), SHRINK.items(), ids=SHRINK.keys())
def test_error_shrinks_as_samples_grow(method, plan, device):
    n_vars, hidden, counts = plan
    f, x, exact = estimator_problem(device, n_vars, hidden)
    errors = [relative_error(estimate(f, x, method, s, seed=7), exact) for s in counts]
    assert errors[1] < errors[0] / 2 and errors[2] < errors[1] / 2, errors


def test_diag_plus_plus_is_exact_on_low_rank_hessians(device):
    """rank(H) = 2 <= samples / 3: the sketch spans H's range, the Hutchinson part is zero."""
    x = torch.randn(10, 7, dtype=torch.float64, device=device)
    u = torch.randn(7, 2, dtype=torch.float64, device=device)
    d = estimate(low_rank, x, "diag++", 7, 0, u)
    torch.testing.assert_close(d, instance_hessian_diagonal(low_rank, x, u))


def test_diag_plus_plus_beats_hutchinson_on_low_rank_hessians():
    x = torch.randn(10, 7, dtype=torch.float64)
    u = torch.randn(7, 2, dtype=torch.float64)
    exact = instance_hessian_diagonal(low_rank, x, u)
    plus = relative_error(estimate(low_rank, x, "diag++", 30, 0, u), exact)
    hutch = relative_error(estimate(low_rank, x, "hutchinson", 30, 0, u), exact)
    assert plus < 1e-3 * hutch, (plus, hutch)


JULIA = julia_available()


@pytest.mark.skipif(not JULIA, reason="Julia cannot start here (see test_julia_backend.py)")
@pytest.mark.parametrize("method", ["exact", *STOCHASTIC])
def test_julia_backend_matches_torch(method):
    """Scalar Julia functions run every method through grad_and_hvp alone."""
    x, mu = torch.randn(6, 3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    jf = pyhvp.julia_function("(x, mu) -> exp(-sum(abs2, x .- mu))")

    def run(g, backend):
        if method == "exact":
            return pyhvp.hessian_diagonal(g, x, mu, backend=backend)
        gen = torch.Generator().manual_seed(0)
        return pyhvp.hessian_diagonal(
            g, x, mu, method=method, samples=9, generator=gen, backend=backend
        )

    torch.testing.assert_close(run(jf, "julia"), run(gaussian, "torch"))


# --- errors: (case, call, exception type, text the message must contain) ---------------------

X = torch.zeros(4, 3)


def vector_f(x):
    return torch.stack([x.sum(-1), x.prod(-1)], -1)


def complex_intermediate(x):
    """(4, 3) -> (4, 2): z^2 for z = x_0 + i x_1, as its real and imaginary parts."""
    return torch.view_as_real(torch.view_as_complex(x[..., :2].contiguous()) ** 2)


def calls_autograd_grad(x):
    with torch.enable_grad():
        y = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(torch.tanh(y).pow(2).sum(), y, create_graph=True)
    return g.sum(-1)


def calls_autograd_grad_of_x(x):
    """A force from autograd, as written for a leaf ``x``: failed before autograd's engine ran
    ("element 0 of tensors does not require grad"), so the refusal was never reached."""
    (g,) = torch.autograd.grad(torch.sin(x).sum(), x, create_graph=True)
    return (g**2).sum(-1)


ERRORS = [
    ("unknown method", lambda: pyhvp.hessian_diagonal(f_batch_scalar, X, method="newton"),
     ValueError, "method"),
    ("hutchinson without samples",
     lambda: pyhvp.hessian_diagonal(f_batch_scalar, X, method="hutchinson"), ValueError, "samples"),
    ("zero samples",
     lambda: pyhvp.hessian_diagonal(f_batch_scalar, X, method="hutchinson", samples=0),
     ValueError, "samples"),
    ("bool samples",
     lambda: pyhvp.hessian_diagonal(f_batch_scalar, X, method="hutchinson", samples=True),
     ValueError, "samples"),
    ("diag++ with 2 samples",
     lambda: pyhvp.hessian_diagonal(f_batch_scalar, X, method="diag++", samples=2),
     ValueError, "samples"),
    ("samples with exact", lambda: pyhvp.hessian_diagonal(f_batch_scalar, X, samples=10),
     ValueError, "samples"),
    ("generator with exact",
     lambda: pyhvp.hessian_diagonal(f_batch_scalar, X, generator=torch.Generator()),
     ValueError, "generator"),
    ("generator not a Generator",
     lambda: pyhvp.hessian_diagonal(f_batch_scalar, X, method="hutchinson", samples=3,
                                    generator=0), TypeError, "generator"),
    ("vector f with hutchinson",
     lambda: pyhvp.hessian_diagonal(vector_f, X, method="hutchinson", samples=3),
     ValueError, "out_shape (2,)"),
    ("integer x", lambda: pyhvp.hessian_diagonal(f_batch_scalar, X.long()), TypeError, "x"),
    ("x not a tensor", lambda: pyhvp.hessian_diagonal(f_batch_scalar, [1.0, 2.0]), TypeError, "x"),
    ("no variables per instance", lambda: pyhvp.hessian_diagonal(f_batch_scalar, torch.zeros(4, 0)),
     ValueError, "x"),
    ("event_dims too large", lambda: pyhvp.hessian_diagonal(f_batch_scalar, X, event_dims=3),
     ValueError, "event_dims"),
    ("chunk_size 0", lambda: pyhvp.hessian_diagonal(f_batch_scalar, X, chunk_size=0),
     ValueError, "chunk_size"),
    ("f drops the batch dim", lambda: pyhvp.hessian_diagonal(lambda x: x.sum(0), X),
     ValueError, "batch_shape"),
    ("f returns a list", lambda: pyhvp.hessian_diagonal(lambda x: [x.sum()], X), TypeError, "f"),
    ("complex intermediate, vector f", lambda: pyhvp.hessian_diagonal(complex_intermediate, X),
     TypeError, "complex intermediates are not supported by the Taylor engine"),
    ("complex intermediate, scalar f",
     lambda: pyhvp.hessian_diagonal(lambda x: complex_intermediate(x).sum(-1), X), TypeError,
     "complex intermediates are not supported by the Taylor engine"),
    ("torch.autograd.grad inside f", lambda: pyhvp.hessian_diagonal(calls_autograd_grad, X),
     RuntimeError, "Use torch.func.grad"),
    ("torch.autograd.grad of x itself inside f (x does not require grad there)",
     lambda: pyhvp.hessian_diagonal(calls_autograd_grad_of_x, X), RuntimeError,
     "Use torch.func.grad"),
    ("float64 arg with float32 x",
     lambda: pyhvp.hessian_diagonal(gaussian, X, torch.zeros(3, dtype=torch.float64)),
     ValueError, "args[0]"),
    ("unknown backend", lambda: pyhvp.hessian_diagonal(f_batch_scalar, X, backend="jax"),
     ValueError, "backend"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "call", "error", "text"), ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_input_raises_naming_the_argument(name, call, error, text):
    with pytest.raises(error, match=re.escape(text)):
        call()


def linear_in_time(x):
    """sin(x_0) x_1^2 + x_2: each instance's Hessian has rank 2 of 3."""
    return torch.sin(x[..., 0]) * x[..., 1] ** 2 + x[..., 2]


SKETCHED = {
    "diag++": lambda x, **kw: pyhvp.hessian_diagonal(linear_in_time, x, method="diag++", **kw),
    "hutch++": lambda x, **kw: pyhvp.laplacian(linear_in_time, x, method="hutch++", **kw),
}


@pytest.mark.parametrize("estimate", SKETCHED.values(), ids=SKETCHED.keys())
def test_an_exact_sketch_of_a_rank_deficient_hessian_has_the_exact_gradient(estimate):
    """With samples >= 3n the sketched estimates are exact, and so are their gradients in x
    (QR's backward divided by R's zero diagonal: NaN)."""
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    got = estimate(x, samples=9, generator=torch.Generator().manual_seed(0))
    (gradient,) = torch.autograd.grad(got.sum(), x)
    (expected,) = torch.autograd.grad(pyhvp.hessian_diagonal(linear_in_time, x).sum(), x)
    torch.testing.assert_close(gradient, expected)
