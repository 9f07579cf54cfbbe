"""Specification of laplacian and grad_and_laplacian against dense float64 per-instance Hessians."""

import math
import re
import subprocess
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from dense import (
    TAYLOR_CASES,
    instance_hessian_diagonal,
    instance_hessians,
    instance_jacobian,
    instance_laplacian,
    instance_weighted_trace,
    nested_bilaplacian,
    nested_mixed_partial,
)
from torch import nn
from torch.func import functional_call, grad, hessian, vmap

import pyhvp
from pyhvp import TorchBackend, taylor
from pyhvp import _estimators as est
from pyhvp.backends import torch as torch_backend
from pyhvp.backends.compile_policy import function_key
from pyhvp.taylor import kernel, program
from pyhvp.taylor.kernel import basis_event, identity

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def tolerance(dtype):
    return {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-9, "atol": 1e-10}


def weights(*shape, seed, device, dtype):
    """Fixed weights, drawn in float64 so the float32 function and its float64 reference agree."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(device, dtype)


# --- functions: (device, dtype) -> f(x, *args) returning batch_shape + out_shape ------------------


def tanh_mlp(d_out, d_in=4, hidden=6):
    def build(device, dtype):
        torch.manual_seed(4)
        net = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out))
        net = net.requires_grad_(False).to(device, dtype)
        return (lambda x: net(x).squeeze(-1)) if d_out == 1 else net

    return build


def sigmoid_layer(device, dtype):
    """Seed 001's f_single_vector, written for one instance (per_instance)."""
    w, b = weights(5, 3, seed=1, device=device, dtype=dtype), weights(5, seed=2, device=device,
                                                                      dtype=dtype)  # fmt: skip
    return pyhvp.per_instance(lambda x: torch.sigmoid(w @ x + b))


def per_instance_mlp(device, dtype):
    """W2 tanh(W1 x + b1) for one instance: under vmap the tangent is the right operand of W2 @."""
    w1, b1, w2 = (weights(*s, seed=10 + i, device=device, dtype=dtype) for i, s in
                  enumerate([(6, 4), (6,), (3, 6)]))  # fmt: skip
    return pyhvp.per_instance(lambda x: w2 @ torch.tanh(w1 @ x + b1))


def factored_sums(x):
    """Elementwise functions of shared directions, then sums and means (kept and dropped dims)."""
    return torch.exp(-(x**2)).mean(-1, keepdim=True) + torch.sigmoid(x).sum((-2, -1), keepdim=True)


def gaussian(x, mu):
    """Seed-000 layout: 3 batch dims, mu broadcast over the middle ones."""
    return torch.exp(-((x - mu) ** 2).sum(-1))


def matrix_scalar(x, w):
    return (torch.tanh(x @ w) ** 2).sum((-2, -1))


def matrix_vector(x, w):
    return torch.tanh(x @ w).sum(-2)


def batched_arg(x, y):
    return (torch.sin(x * y) + x**2 * y).sum(-1)


def outer(x):
    return torch.sin(x)[..., :, None] * torch.cos(x)[..., None, :]


def products(device, dtype):
    a, w, v = (weights(*s, seed=i, device=device, dtype=dtype) for i, s in
               enumerate([(4, 4), (3, 4), (3,)]))  # fmt: skip
    return lambda x: (
        torch.einsum("bi,ij,bj->b", x, a, x)
        + F.linear(torch.tanh(x), w) @ v
        + (x @ a).pow(2).sum(-1)
    )


def unary(x):
    return (
        F.silu(x) + F.gelu(x) + F.gelu(2 * x, approximate="tanh") + F.softplus(3 * x)
        + torch.sqrt(x * x + 1) + torch.abs(x) ** 3 + torch.log1p(x * x) + torch.erf(x)
        + torch.sigmoid(x) * torch.exp(-x * x) + torch.rsqrt(2 + x) + F.elu(x) + torch.atan(x)
    ).sum(-1)  # fmt: skip


def logsumexp(device, dtype):
    w = weights(4, 5, seed=6, device=device, dtype=dtype)
    return lambda x: torch.logsumexp(x @ w, -1) + torch.logsumexp(x, -1, keepdim=True)[..., 0]


def norms(device, dtype):
    w = weights(4, 3, seed=7, device=device, dtype=dtype)
    return lambda x: (
        torch.linalg.vector_norm(x, dim=-1) + torch.linalg.vector_norm(x, 3, dim=-1)
        + torch.linalg.norm(x @ w, dim=-1) + x.norm(dim=-1) ** 3 + torch.linalg.vector_norm(x, 1, -1)
    )  # fmt: skip


def reductions(x):
    return (
        x.sum(-1) ** 2 + x.mean(-1) ** 3 + x.amax(-1) * x.prod(-1) + x.var(-1) + x.std(-1)
        + torch.var_mean(x, -1)[1] ** 2 + x.cumsum(-1).pow(2).sum(-1) + x.max(-1).values ** 2
    )  # fmt: skip


def indexing(x):
    index = torch.tensor([[2, 0, 1, 1]], device=x.device).expand(x.shape[0], 4)
    return torch.stack(
        [
            (x[:, [2, 0]] * x[:, 1:2]).sum(-1),
            (x.gather(-1, index) ** 3).sum(-1),
            (x.index_select(-1, index[0, :2]) * x[:, -1:]).prod(-1),
            (x[:, None, :] * x[:, :, None])[:, 1, 2] * x[:, 0],
        ],
        -1,
    )


def where(x):
    return torch.where(x > 0, x**3, torch.sin(x)).sum(-1) + torch.where(x[:, :1] < 0.3, x, 2.0).sum(
        -1
    )


def cdist(device, dtype):
    """Points of one instance (3 x 2) against fixed ones; torch cannot differentiate cdist twice
    (no derivative of _cdist_backward), so the reference writes the distances out."""
    others = weights(4, 2, seed=8, device=device, dtype=dtype)
    return lambda x: torch.cdist(x.reshape(-1, 3, 2), others)


def cdist_reference(device, dtype):
    others = weights(4, 2, seed=8, device=device, dtype=dtype)
    return lambda x: (x.reshape(-1, 3, 1, 2) - others).pow(2).sum(-1).sqrt()


def shaping(x):
    stacked = torch.stack([x, x**2], -1).reshape(x.shape[0], -1)
    joined = torch.cat([torch.tanh(x), torch.cos(x).flip(-1)], -1)
    return stacked.sum(-1, keepdim=True) * joined.permute(1, 0).t() + x.unsqueeze(1).expand(
        -1, 2, -1
    ).sum(1).repeat(1, 2)


def normalisation(device, dtype):
    w = weights(4, 5, seed=9, device=device, dtype=dtype)
    return lambda x: (
        F.layer_norm(x @ w, (5,)) * torch.softmax(x @ w, -1)
        + F.log_softmax(x, -1).sum(-1, keepdim=True)
    )


def linear_algebra(x):
    """det, slogdet, inverse, solve (Slater determinants), eigvalsh and attention."""
    matrix = torch.stack([x[:, :2], x[:, 2:] ** 2 + 1], -2)  # (B, 2, 2)
    gram = matrix @ matrix.mT + torch.eye(2, dtype=x.dtype, device=x.device)
    ones = torch.ones(2, dtype=x.dtype, device=x.device)
    return (
        torch.linalg.det(matrix) + torch.linalg.slogdet(gram)[1] + torch.linalg.inv(gram).sum((-2, -1))
        + torch.linalg.solve(gram, ones).sum(-1) + torch.linalg.eigvalsh(gram)[:, -1]
        + F.scaled_dot_product_attention(matrix, gram, matrix).sum((-2, -1))
    )  # fmt: skip


def fallback_ops(x):
    """Ops without a dedicated rule: torch.func on the op alone (pointwise and general)."""
    return (
        torch.atan2(x, 2 + x.flip(-1)).sum(-1) + torch.cumprod(1 + x / 4, -1).sum(-1)
        + torch.special.xlogy(x * x + 1, x * x + 2).sum(-1) + torch.lgamma(3 + x).sum(-1)
        + torch.logit(torch.sigmoid(x) / 2 + 0.2).sum(-1) + torch.roll(x, 1, -1).pow(3).sum(-1)
    )  # fmt: skip


def branching(x):
    """Data-dependent control flow: each call records the branch its x takes."""
    return (x**3).sum(-1) if x.sum() > 0 else torch.sin(x).sum(-1)


def in_place(x):
    y = x * 2
    y += torch.tanh(x)
    z = torch.relu_(y - 0.1)
    out = torch.zeros(x.shape[0], 2, dtype=x.dtype, device=x.device)
    out[:, 0] = (z * x).sum(-1)
    out[:, 1] = x.pow(3).sum(-1)
    return out


def constant(x):
    return torch.ones(x.shape[0], 2, dtype=x.dtype, device=x.device)


def affine(x):
    return 3 * x - 1


@dataclass
class Case:
    name: str
    build: object  # (device, dtype) -> f
    x_shape: tuple
    args_shapes: tuple = ()
    event_dims: int = 1
    kwargs: dict = field(default_factory=dict)
    reference: object = (
        None  # (device, dtype) -> a mathematically equal f torch.func can differentiate
    )

    def make(self, device, dtype, seed=5, batch=None):
        torch.manual_seed(seed)
        shape = self.x_shape if batch is None else (batch, *self.x_shape[1:])
        x = torch.randn(shape, dtype=dtype, device=device)
        args = tuple(torch.randn(s, dtype=dtype, device=device) for s in self.args_shapes)
        return self.build(device, dtype), x, args

    def reference_f(self, device):
        return (self.reference or self.build)(device, torch.float64)


def plain(f):
    return lambda device, dtype: f


CASES = [
    Case("tanh MLP, scalar out", tanh_mlp(1), (5, 4)),
    Case("tanh MLP, vector out", tanh_mlp(3), (5, 4)),
    Case("tanh MLP, chunked by 3", tanh_mlp(3), (5, 4), kwargs={"chunk_size": 3}),
    Case("event_dims=2 + shared arg, scalar", plain(matrix_scalar), (4, 2, 3), ((3, 3),), 2),
    Case("event_dims=2 + batched arg, vector", plain(matrix_vector), (4, 2, 3), ((4, 3, 3),), 2),
    Case("3 batch dims, broadcast arg (seed 000)", plain(gaussian), (2, 3, 4, 3), ((2, 1, 1, 3),)),
    Case("batched arg of x's shape", plain(batched_arg), (5, 4), ((5, 4),)),
    Case("per_instance, vector (seed 001)", sigmoid_layer, (6, 3)),
    Case(
        "per_instance, event_dims=2 + shared arg",
        lambda d, t: pyhvp.per_instance(matrix_vector, event_dims=2, arg_event_dims=2),
        (2, 2, 2, 3),
        ((3, 3),),
        2,
    ),
    Case("per_instance MLP, W2 @ tanh(W1 x + b1)", per_instance_mlp, (5, 4)),
    Case("factored sums and means", plain(factored_sums), (2, 3, 4), event_dims=2),
    Case("unbatched x", tanh_mlp(1), (4,)),
    Case("2-D out_shape", plain(outer), (4, 3)),
    Case("matmul, linear, einsum", products, (5, 4)),
    Case("sqrt, abs, softplus, SiLU, GELU, ...", plain(unary), (5, 4)),
    Case("logsumexp", logsumexp, (5, 4)),
    Case("norms", norms, (5, 4)),
    Case("reductions: sum, mean, amax, prod, var, std, cumsum, max", plain(reductions), (5, 4)),
    Case("indexing and gathering", plain(indexing), (5, 4)),
    Case("torch.where", plain(where), (5, 4)),
    Case("cdist", cdist, (5, 6), reference=cdist_reference),
    Case("cat, stack, reshape, permute, flip, expand", plain(shaping), (5, 4)),
    Case("layer_norm, softmax, log_softmax", normalisation, (5, 4)),
    Case("det, slogdet, inv, solve, eigvalsh, attention", plain(linear_algebra), (5, 4)),
    Case("ops without a dedicated rule", plain(fallback_ops), (5, 4)),
    Case("in-place ops inside f", plain(in_place), (5, 4)),
    Case("constant f", plain(constant), (5, 4)),
    Case("affine f", plain(affine), (5, 4)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_exact_laplacian_matches_dense_trace(case, dtype, device):
    f, x, args = case.make(device, dtype)
    lap = pyhvp.laplacian(f, x, *args, event_dims=case.event_dims, **case.kwargs)
    expected = instance_laplacian(case.reference_f(device), x, *args, event_dims=case.event_dims)
    assert lap.dtype == dtype
    torch.testing.assert_close(lap.double(), expected, **tolerance(dtype))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_grad_and_laplacian_are_value_gradient_and_trace(case, device):
    f, x, args = case.make(device, torch.float64)
    value, g, lap = pyhvp.grad_and_laplacian(f, x, *args, event_dims=case.event_dims, **case.kwargs)
    reference = case.reference_f(device)
    torch.testing.assert_close(value, f(x, *args))
    torch.testing.assert_close(
        g, instance_jacobian(reference, x, *args, event_dims=case.event_dims)
    )
    expected = instance_laplacian(reference, x, *args, event_dims=case.event_dims)
    torch.testing.assert_close(lap, expected, **tolerance(torch.float64))


def test_data_dependent_control_flow_follows_each_call(device):
    up, down = torch.ones(3, 2, device=device), -torch.ones(3, 2, device=device)
    for x in (up, down, up):  # each branch is its own program; neither is reused for the other
        lap = pyhvp.laplacian(branching, x.double())
        torch.testing.assert_close(lap, instance_laplacian(branching, x.double()))


def test_replaced_or_updated_captured_tensors_are_never_stale(device):
    w = torch.ones(3, device=device, dtype=torch.float64)
    box = {"w": w}

    def f(x):
        return (torch.sin(x) * box["w"]).sum(-1)

    x = torch.randn(4, 3, device=device, dtype=torch.float64)
    first = pyhvp.laplacian(f, x)
    w.mul_(2)  # updated in place
    torch.testing.assert_close(pyhvp.laplacian(f, x), 2 * first)
    box["w"] = torch.full((3,), -1.0, device=device, dtype=torch.float64)  # replaced
    torch.testing.assert_close(pyhvp.laplacian(f, x), -first)


def test_a_function_rebuilt_per_call_reuses_its_program():
    x, w = torch.randn(4, 3), torch.randn(3, 3)
    programs = {taylor.capture(lambda y: torch.tanh(y @ w), x, ()).program for _ in range(3)}
    assert len(programs) == 1


@pytest.mark.parametrize("made_inside", [True, False], ids=["inference tensor", "normal tensor"])
def test_inference_mode_gives_the_result_of_normal_mode(made_inside, device):
    f = tanh_mlp(3)(device, torch.float64)
    x = torch.randn(6, 4, device=device, dtype=torch.float64)
    with torch.inference_mode():
        inside = pyhvp.grad_and_laplacian(f, x.clone() if made_inside else x)
    for got, expected in zip(inside, pyhvp.grad_and_laplacian(f, x), strict=True):
        torch.testing.assert_close(got, expected)


def test_expanded_x_equals_contiguous_x(device):
    f = tanh_mlp(3)(device, torch.float64)
    x = torch.randn(1, 4, device=device, dtype=torch.float64).expand(6, 4)
    torch.testing.assert_close(pyhvp.laplacian(f, x), pyhvp.laplacian(f, x.contiguous()))


LINEAR_IN_X = {
    "x @ w": lambda x: x @ torch.tensor([1.0, 2.0, 3.0], dtype=x.dtype, device=x.device),
    "x[..., 0]": lambda x: x[..., 0],
    "vector output": lambda x: x @ torch.arange(6.0, dtype=x.dtype, device=x.device).view(3, 2),
}


@pytest.mark.parametrize("f", LINEAR_IN_X.values(), ids=LINEAR_IN_X.keys())
def test_a_write_to_one_instances_gradient_reaches_no_other(f, device):
    """For f linear in x, grad_and_laplacian's gradient was one row expanded over the instances
    (stride 0): ``g[0] = 0`` zeroed every instance's gradient, silently."""
    x = torch.randn(4, 3, device=device, dtype=torch.float64)
    g = pyhvp.grad_and_laplacian(f, x)[1]
    expected = g[1:].clone()
    g[0] = 0.0
    torch.testing.assert_close(g[1:], expected)


# --- what the Taylor engine differentiates like autograd ------------------------------------------


# the LU case takes half a minute here: test_diagonal checks its rule in the fast tier
LAPLACIAN_TAYLOR_CASES = [
    pytest.param(c, marks=pytest.mark.slow, id=c.name) if c.name.startswith("many 3x3 LU") else c
    for c in TAYLOR_CASES
]


@pytest.mark.parametrize("case", LAPLACIAN_TAYLOR_CASES, ids=lambda c: c.name)
def test_taylor_engine_differentiates_like_autograd(case, device):
    """no_grad, in-place writes, powers at 0, singular det, solve's right-hand sides, attention
    in eval mode, ... (tests/dense.py); dense references on the first 8 instances."""
    f, reference = case.build(device)
    x = case.point(device)
    lap = pyhvp.laplacian(f, x, event_dims=case.event_dims)
    value, g, lap_too = pyhvp.grad_and_laplacian(f, x, event_dims=case.event_dims)
    few = x[:8]
    expected = instance_laplacian(reference or f, few, event_dims=case.event_dims)
    torch.testing.assert_close(lap[:8], expected, **tolerance(torch.float64))
    torch.testing.assert_close(lap_too, lap)
    torch.testing.assert_close(value, f(x))
    jacobian = instance_jacobian(reference or f, few, event_dims=case.event_dims)
    torch.testing.assert_close(g[:8], jacobian, **tolerance(torch.float64))


def x_again(x):
    """f(y, z) with z = x passed again: partial derivatives in y hold z fixed."""
    return (lambda y, z: (y * y * z).sum(-1) + torch.sin(y * z).sum(-1)), (x,)


def x_captured(x):
    return (lambda y: (y * y * x).sum(-1) + torch.sin(y * x).sum(-1)), ()


SELF_REFERENCES = {"x passed again as an arg": x_again, "x captured by f": x_captured}


@pytest.mark.parametrize("build", SELF_REFERENCES.values(), ids=SELF_REFERENCES.keys())
def test_x_reaching_f_another_way_is_a_constant(build, device):
    """The partial derivatives in x, on the Taylor and the Hessian-vector-product paths alike."""
    x = torch.randn(5, 4, dtype=torch.float64, device=device)
    f, args = build(x)
    fixed, fixed_args = build(x.clone())  # the other occurrence, another tensor
    expected = instance_laplacian(fixed, x, *fixed_args)
    torch.testing.assert_close(pyhvp.laplacian(f, x, *args), expected)
    torch.testing.assert_close(pyhvp.grad_and_laplacian(f, x, *args).laplacian, expected)
    torch.testing.assert_close(pyhvp.laplacian(f, x, *args, method="hutch++", samples=12),
                               expected)  # fmt: skip


def test_power_of_a_negative_base_is_nan_like_autograd(device):
    x = torch.randn(3, 4, dtype=torch.float64, device=device)

    def f(x):
        return ((-2.0) ** x).sum(-1) + (x**2).sum(-1)

    lap = pyhvp.laplacian(f, x)
    assert lap.isnan().all()
    torch.testing.assert_close(lap, instance_laplacian(f, x), equal_nan=True)


def test_slogdet_of_a_singular_instance_is_not_finite_there_and_exact_elsewhere(device):
    """log|det| is -inf at a singular matrix (autograd's derivatives there are infinite too)."""
    x = torch.randn(4, 4, dtype=torch.float64, device=device)

    def f(x, singular=True):
        second = torch.cat([x[:1, :2] if singular else x[:1, 2:] + 3, x[1:, 2:] + 3], 0)
        return torch.linalg.slogdet(torch.stack([x[:, :2], second], -2))[1]  # instance 0: rank 1

    lap = pyhvp.laplacian(f, x)
    assert not lap[0].isfinite()
    torch.testing.assert_close(lap[1:], instance_laplacian(f, x, False)[1:])


def test_the_recorder_frees_intermediates_as_f_runs(device):
    """Only labels are kept: an intermediate f drops is freed during the record."""
    freed = []

    def f(x):
        y = torch.sin(x) * 2
        alive = weakref.ref(y)
        z = torch.exp(y)
        del y
        freed.append(alive() is None)
        return z.sum(-1)

    x = torch.randn(3, 4, dtype=torch.float64, device=device)
    lap = pyhvp.laplacian(f, x)
    assert freed == [True]
    torch.testing.assert_close(lap, instance_laplacian(f, x))


@pytest.mark.parametrize("chunk_size", [None, 1])
def test_f_is_evaluated_once_per_call(chunk_size, device):
    """One record serves every chunk of directions; nothing else runs f."""
    calls = []
    net = tanh_mlp(3)(device, torch.float64)

    def f(x):
        calls.append(1)
        return net(x)

    x = torch.randn(5, 4, dtype=torch.float64, device=device)
    for operator in (pyhvp.laplacian, pyhvp.grad_and_laplacian, pyhvp.hessian_diagonal):
        calls.clear()
        operator(f, x, chunk_size=chunk_size)
        assert len(calls) == 1, operator.__name__


def test_a_misshaped_output_is_refused_before_any_kernel_is_built(monkeypatch):
    def build_kernel(*args):
        raise AssertionError("a kernel was built")

    monkeypatch.setattr(program, "build_kernel", build_kernel)
    for operator in (pyhvp.laplacian, pyhvp.grad_and_laplacian, pyhvp.hessian_diagonal):
        with pytest.raises(ValueError, match="batch_shape"):
            operator(lambda x: x.sum(), torch.randn(4, 3))


def test_a_refused_write_leaves_x_unchanged(device):
    x = torch.randn(4, 3, device=device)
    before = x.clone()
    with pytest.raises(taylor.InPlaceInputError):
        pyhvp.laplacian(writes_through_a_view_of_x, x)
    assert torch.equal(x, before)


# --- weighted traces tr(S S^T H) (factor=S) -------------------------------------------------------

FACTORS = [
    ("shared S, r=2", (5, 4), (4, 2), 1),
    ("per-instance S, r=5", (5, 4), (5, 4, 5), 1),
    ("event_dims=2, shared S", (3, 2, 2), (2, 2, 3), 2),
]


@pytest.mark.parametrize(("name", "x_shape", "s_shape", "event_dims"), FACTORS,
                         ids=[c[0] for c in FACTORS])  # fmt: skip
def test_weighted_trace_pushes_the_columns_of_the_factor(
    name, x_shape, s_shape, event_dims, device
):
    f = tanh_mlp(3, d_in=4)(device, torch.float64)
    g = (lambda x: f(x.reshape(*x.shape[:-2], 4))) if event_dims == 2 else f
    x = torch.randn(x_shape, device=device, dtype=torch.float64)
    s = torch.randn(s_shape, device=device, dtype=torch.float64)
    lap = pyhvp.laplacian(g, x, factor=s, event_dims=event_dims)
    torch.testing.assert_close(lap, instance_weighted_trace(g, x, s, event_dims=event_dims))


def test_weighted_hutchinson_estimates_the_weighted_trace(device):
    f = tanh_mlp(1)(device, torch.float64)
    x, s = (torch.randn(shape, device=device, dtype=torch.float64) for shape in ((5, 4), (4, 3)))
    exact = instance_weighted_trace(f, x, s)
    for method, samples in (("hutchinson", 20_000), ("hutch++", 9)):  # rank(S^T H S) <= 3
        estimate = pyhvp.laplacian(f, x, factor=s, method=method, samples=samples,
                                   generator=torch.Generator().manual_seed(0))  # fmt: skip
        assert relative_error(estimate, exact) < 0.05, method


# --- estimators -----------------------------------------------------------------------------------


def relative_error(estimate, exact):
    return float((estimate - exact).norm() / exact.norm())


def estimate(f, x, method, samples, seed):
    generator = torch.Generator().manual_seed(seed)
    return pyhvp.laplacian(f, x, method=method, samples=samples, generator=generator)


def estimator_problem(device, n_vars=6, hidden=12, d_out=1):
    f = tanh_mlp(d_out, d_in=n_vars, hidden=hidden)(device, torch.float64)
    x = torch.randn(8, n_vars, dtype=torch.float64, device=device)
    return f, x, instance_laplacian(f, x)


STOCHASTIC = ["hutchinson", "hutch++"]


@pytest.mark.parametrize("method", STOCHASTIC)
def test_estimate_is_a_function_of_the_generator_state(method, device):
    f, x, _ = estimator_problem(device)
    first, again, other = (estimate(f, x, method, 9, seed) for seed in (1, 1, 2))
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_hutchinson_is_exact_for_separable_functions(device):
    """Rademacher probes have z_i^2 = 1: a diagonal Hessian's trace comes out exactly."""
    x = torch.randn(5, 4, dtype=torch.float64, device=device)
    lap = estimate(lambda x: torch.sin(x).sum(-1), x, "hutchinson", 1, 0)
    torch.testing.assert_close(lap, -torch.sin(x).sum(-1))


def test_hutchinson_is_unbiased_for_every_output(device):
    """The mean of many one-probe estimates converges to the exact Laplacian, for each of the
    vector outputs at once."""
    f, x, exact = estimator_problem(device, d_out=3)
    mean = torch.stack([estimate(f, x, "hutchinson", 1, seed) for seed in range(4000)]).mean(0)
    assert relative_error(mean, exact) < 0.05


# method -> (sample counts): the error should at least halve per step (measured: Hutchinson ~4x
# per 16x samples, i.e. 1 / sqrt(samples); Hutch++ is exact once samples // 3 >= N = 6).
SHRINK = {"hutchinson": (16, 256, 4096), "hutch++": (3, 9, 18)}


@pytest.mark.parametrize(("method", "counts"), SHRINK.items(), ids=SHRINK.keys())
def test_error_shrinks_as_samples_grow(method, counts, device):
    f, x, exact = estimator_problem(device)
    errors = [
        sum(relative_error(estimate(f, x, method, s, seed), exact) for seed in range(4))
        for s in counts
    ]
    assert errors[1] < errors[0] / 2 and errors[2] < errors[1] / 2, errors


def test_hutch_plus_plus_is_exact_on_low_rank_hessians(device):
    x = torch.randn(10, 7, dtype=torch.float64, device=device)
    u = torch.randn(7, 2, dtype=torch.float64, device=device)

    def low_rank(x):
        return torch.log(torch.cosh(x @ u)).sum(-1)

    torch.testing.assert_close(
        estimate(low_rank, x, "hutch++", 6, 0), instance_laplacian(low_rank, x)
    )


@pytest.mark.parametrize(("operator", "method"), [("laplacian", "hutch++"),
                                                  ("hessian_diagonal", "diag++")])  # fmt: skip
def test_the_sketch_rounds_of_a_random_f_see_one_function(operator, method, device):
    """Both rounds of Hutch++ / Diag++ run ``f`` from one random state: with ``samples >= 3n``
    (exact) the estimate of an ``f`` with dropout in training mode is the exact operator's at
    the same mask (the rounds drew two masks: zeros where either dropped)."""
    x = torch.randn(6, 3, dtype=torch.float64, device=device)
    dropout = nn.Dropout(0.5)

    def f(y):
        return dropout(torch.sin(y)).pow(2).sum(-1)

    results = []
    for options in ({}, {"method": method, "samples": 9}):
        torch.manual_seed(1)
        generator = torch.Generator(device).manual_seed(0)
        extra = {"generator": generator} if options else {}
        results.append(getattr(pyhvp, operator)(f, x, **options, **extra))
    torch.testing.assert_close(results[1], results[0])


@pytest.mark.parametrize(("operator", "method"), [("laplacian", "hutch++"),
                                                  ("hessian_diagonal", "diag++")])  # fmt: skip
def test_the_sketch_rounds_of_an_f_with_state_see_one_function(operator, method):
    """Both rounds of Hutch++ / Diag++ run ``f`` from one state of its own: with ``samples >=
    3n`` (exact) the estimate of a ``spectral_norm`` layer in training mode, whose every run
    updates its power iteration's vectors, is the exact operator's (until 2026-12-06 the second
    round saw the vectors the first had updated: 2% off in float64)."""
    x = torch.randn(5, 4, dtype=torch.float64)
    results = []
    for options in ({}, {"method": method, "samples": 12, "generator": torch.Generator()}):
        torch.manual_seed(0)
        net = nn.Sequential(
            nn.utils.parametrizations.spectral_norm(nn.Linear(4, 6)), nn.Tanh(), nn.Linear(6, 1)
        ).double()
        results.append(getattr(pyhvp, operator)(lambda y, net=net: net(y)[..., 0], x, **options))
    torch.testing.assert_close(results[1], results[0])


@pytest.mark.parametrize(("operator", "method"), [("laplacian", "hutch++"),
                                                  ("hessian_diagonal", "diag++")])  # fmt: skip
def test_the_sketch_of_an_f_that_differentiates_inside_notes_its_state_with_grad(operator, method):
    """The run that notes what ``f`` changes beyond its values runs ``f`` as the products do:
    with grad. An ``f`` calling ``torch.autograd.grad`` (``sum(y^3)`` as ``y`` times the gradient
    of ``sum(y^3) / 3``) raised ``element 0 of tensors does not require grad`` there until
    2026-12-06, under ``no_grad``."""

    def f(y):
        (gradient,) = torch.autograd.grad((y**3).sum() / 3, y, create_graph=True)
        return (gradient * y).sum(-1)

    x = torch.randn(5, 3, dtype=torch.float64)
    got = getattr(pyhvp, operator)(f, x, method=method, samples=9, generator=torch.Generator())
    diagonal = 6 * x  # of sum(y^3)
    torch.testing.assert_close(got, diagonal.sum(-1) if operator == "laplacian" else diagonal)


@pytest.mark.parametrize(("operator", "method"), [("laplacian", "hutch++"),
                                                  ("hessian_diagonal", "diag++")])  # fmt: skip
def test_the_sketch_of_a_function_compiled_by_torch_compile_warns_nothing(operator, method):
    """The sketch notes what f writes under a mode of pyhvp's, which dynamo would trace into a
    compiled f (``Dynamo does not know how to trace the builtin ...``)."""
    compiled = torch.compile(lambda y: y.sin().pow(2).sum(-1), backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        getattr(pyhvp, operator)(compiled, torch.randn(4, 3), method=method, samples=9)
    assert [str(warning.message) for warning in caught] == []


def test_the_sketch_never_rewinds_the_global_random_state_to_draw_its_probes_again(monkeypatch):
    """With ``generator=None`` the probes come from torch's global generator: a call's
    second-round rewind (for ``f``'s draws) must not make the next call draw from where this
    one's Rademacher probes came from (correlated estimates)."""
    states = []
    probes = est.Space.probes

    def logged(self, kind, count, generator):
        states.append(torch.get_rng_state())
        return probes(self, kind, count, generator)

    monkeypatch.setattr(est.Space, "probes", logged)
    x = torch.randn(4, 6, dtype=torch.float64)
    torch.manual_seed(0)
    for _ in range(2):
        pyhvp.laplacian(lambda y: y.sin().pow(2).sum(-1), x, method="hutch++", samples=9)
    assert len(states) == 4  # per call: Gaussian, then Rademacher probes
    assert len({bytes(s.numpy()) for s in states}) == 4


# --- gradients through the Laplacian ----------------------------------------------------------


def pinn_net(device):
    torch.manual_seed(11)
    return nn.Sequential(
        nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 8), nn.SiLU(), nn.Linear(8, 1)
    ).to(device, torch.float64)


def reference_parameter_gradients(net, x):
    """torch.func: d/dparams of sum(laplacian^2), the Laplacian from the dense Hessian."""

    def loss(params):
        def single(xi):
            return functional_call(net, params, (xi,)).squeeze(-1)

        return (vmap(hessian(single))(x).diagonal(dim1=-2, dim2=-1).sum(-1) ** 2).sum()

    return grad(loss)({k: v.detach() for k, v in net.named_parameters()})


@pytest.mark.parametrize(
    "compile_mode", [False, pytest.param(True, marks=pytest.mark.slow), "auto"]
)
def test_pinn_spelling_gives_a_laplacian_differentiable_in_the_parameters(compile_mode, device):
    net = pinn_net(device)  # parameters require grad, grad mode is on
    x = torch.randn(6, 3, dtype=torch.float64, device=device)
    lap = pyhvp.laplacian(net, x, backend=TorchBackend(compile=compile_mode))
    assert lap.shape == (6, 1) and lap.requires_grad
    names, params = zip(*net.named_parameters(), strict=True)
    grads = torch.autograd.grad((lap**2).sum(), params, materialize_grads=True)
    expected = reference_parameter_gradients(net, x)
    for name, g in zip(names, grads, strict=True):
        torch.testing.assert_close(g, expected[name], msg=name)


def test_parameters_passed_as_args_get_gradients_too(device):
    w = torch.randn(3, 4, dtype=torch.float64, device=device, requires_grad=True)
    x = torch.randn(5, 3, dtype=torch.float64, device=device)

    def f(x, w):
        return torch.tanh(x @ w).pow(2).sum(-1)

    (g,) = torch.autograd.grad(pyhvp.laplacian(f, x, w).sum(), w)
    expected = grad(lambda w: instance_laplacian(lambda y: f(y, w), x).sum())(w.detach())
    torch.testing.assert_close(g, expected)


def test_gradient_in_x_is_the_third_derivative(device):
    net = pinn_net(device).requires_grad_(False)
    x = torch.randn(4, 3, dtype=torch.float64, device=device, requires_grad=True)
    _, g, lap = pyhvp.grad_and_laplacian(net, x)
    (dx,) = torch.autograd.grad(lap.sum() + g.pow(2).sum(), x)
    expected = grad(
        lambda y: instance_laplacian(net, y).sum() + instance_jacobian(net, y).pow(2).sum()
    )(x.detach())
    torch.testing.assert_close(dx, expected)


@pytest.mark.parametrize(
    "operator",
    [pyhvp.laplacian, lambda f, x: pyhvp.hessian_diagonal(f, x).sum(-1)],
    ids=["laplacian", "hessian_diagonal"],
)
def test_a_hessian_around_the_operator_leaves_later_transforms_working(operator, monkeypatch):
    """Until 2026-12-07 torch.func.hessian around it cached the identity it made inside the
    transform, a wrapper of that level: every later transform around either operator, in any
    process-wide call, failed with functorch's "level <= current_level INTERNAL ASSERT"."""
    monkeypatch.setattr(kernel, "_IDENTITIES", type(kernel._IDENTITIES)())  # none made yet
    x = torch.tensor([[0.5, -1.0], [0.2, 0.7]], dtype=torch.float64)

    def f(z):
        return (torch.sin(z) * z).sum(-1)

    total = lambda z: operator(f, z).sum()  # noqa: E731
    expected = lambda z: instance_laplacian(f, z).sum()  # noqa: E731
    torch.testing.assert_close(hessian(total)(x), hessian(expected)(x))
    torch.testing.assert_close(grad(total)(x), grad(expected)(x))


def _detached_factors(x, w):
    return torch.sin(x).sum(-1) * x.detach().pow(2).sum(-1) * w.sum() / w.norm().detach()


def _factors_made_under_no_grad(x, w):
    with torch.no_grad():
        scale = w.norm() * x.pow(2).sum(-1)
    return torch.sin(x).sum(-1) * scale * w.sum()


def _factors_detached_in_place(x, w):
    """``detach_`` has no aten op: until 2026-12-07 the Taylor engine differentiated through it."""
    return torch.sin(x).sum(-1) * x.clone().detach_().pow(2).sum(-1) * w.sum() / w.norm().detach_()


def _factors_detached_by_torch_detach_(x, w):
    return torch.sin(x).sum(-1) * torch.detach_(x.clone()).pow(2).sum(-1) * w.sum()


STOPS = {
    "detach()": _detached_factors,
    "detach_()": _factors_detached_in_place,
    "torch.detach_()": _factors_detached_by_torch_detach_,
    "torch.no_grad()": _factors_made_under_no_grad,
}


def _nested_laplacian(f, x, *args):
    n = x.shape[-1]
    return sum(nested_mixed_partial(f, x, (i, i), *args, create_graph=True) for i in range(n))


STOPPING_OPERATORS = {  # name -> (pyhvp's, its reference by nested autograd)
    "laplacian": (pyhvp.laplacian, _nested_laplacian),
    "hessian_diagonal": (lambda f, x, w, backend: pyhvp.hessian_diagonal(
        f, x, w, backend=backend).sum(-1), _nested_laplacian),
    "bilaplacian": (pyhvp.bilaplacian,
                    lambda f, x, w: nested_bilaplacian(f, x, w, create_graph=True)),
}  # fmt: skip


@pytest.mark.parametrize("compile_mode", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize(("operator", "reference"), STOPPING_OPERATORS.values(),
                         ids=STOPPING_OPERATORS.keys())  # fmt: skip
@pytest.mark.parametrize("f", STOPS.values(), ids=STOPS.keys())
def test_a_stop_gradient_in_f_is_a_constant_to_the_gradients_of_the_result(
    f, operator, reference, compile_mode, device
):
    """A PINN's loss differentiates the operator's result: what ``f`` detaches, or computes
    under ``no_grad``, stays a constant there, as in autograd (``spectral_norm``'s power
    iteration)."""
    x = torch.tensor([[0.5, -1.0], [0.2, 0.7]], dtype=torch.float64, device=device)
    w = torch.tensor([1.0, 2.0], dtype=torch.float64, device=device)
    x, w = x.requires_grad_(), w.requires_grad_()
    backend = TorchBackend(compile=compile_mode)
    got = torch.autograd.grad(operator(f, x, w, backend=backend).sum(), (x, w))
    expected = torch.autograd.grad(reference(f, x, w).sum(), (x, w))
    torch.testing.assert_close(got, expected)


def test_results_are_detached_when_nothing_needs_a_graph(device):
    net = pinn_net(device)
    x = torch.randn(4, 3, dtype=torch.float64, device=device)
    with torch.no_grad():
        assert not pyhvp.laplacian(net, x).requires_grad
    assert not pyhvp.laplacian(net.requires_grad_(False), x).requires_grad


# method -> whether captured parameters alone give the result a graph: the methods that run the
# Taylor engine pass them to its kernels as inputs; hutch++'s Hessian-vector products keep a graph
# only when x or an arg requires grad (and then reach the captured parameters too).
CAPTURED_ALONE = {"exact": True, "hutchinson": True, "hutch++": False}


@pytest.mark.parametrize(("method", "alone"), CAPTURED_ALONE.items(), ids=CAPTURED_ALONE.keys())
def test_which_results_reach_captured_parameters(method, alone, device):
    net = pinn_net(device)
    weight = net[0].weight  # the Laplacian depends on it (not on the last layer's bias)
    x = torch.randn(4, 3, dtype=torch.float64, device=device)
    options = {} if method == "exact" else {"samples": 6}

    def f(x, s):
        return net(x * s).squeeze(-1)

    ones = torch.ones(3, dtype=torch.float64, device=device)
    assert pyhvp.laplacian(f, x, ones, method=method, **options).requires_grad == alone
    scale = ones.clone().requires_grad_()
    lap = pyhvp.laplacian(f, x, scale, method=method, **options)
    weight_grad, scale_grad = torch.autograd.grad(lap.sum(), [weight, scale])
    assert weight_grad.abs().sum() > 0 and scale_grad.abs().sum() > 0


# --- the compiled kernels ---------------------------------------------------------------------------


def compiled_entries(kernels):
    """The compile-cache entries of these jet kernels."""
    keys = [function_key(k) for k in kernels]
    return [
        e for key, e in torch_backend._CACHE.entries.items() if any(mentions(key, k) for k in keys)
    ]


def mentions(key, part):
    return key == part or (isinstance(key, tuple) and any(mentions(k, part) for k in key))


@pytest.mark.slow
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[7], CASES[13]], ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_compiled_kernels_match_dense_without_falling_back(case, dtype, device):
    f, x, args = case.make(device, dtype, batch=7)  # a program no other test records
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lap = pyhvp.laplacian(f, x, *args, event_dims=case.event_dims,
                              backend=TorchBackend(compile=True))  # fmt: skip
    assert not [w for w in caught if "torch.compile failed" in str(w.message)]
    entries = compiled_entries(taylor.capture(f, x, args).program.kernels.values())
    assert entries and all(e.compiled is not None and not e.failed for e in entries)
    expected = instance_laplacian(case.reference_f(device), x, *args, event_dims=case.event_dims)
    torch.testing.assert_close(lap.double(), expected, **tolerance(dtype))


@pytest.mark.slow
def test_compiled_jet_kernels_do_not_crash_the_process_on_cpu():
    """Inductor segfaults on compiled nested forward-mode AD on the CPU (pytorch#190856); jet
    kernels are plain aten ops and compile safely -- checked in a subprocess, as a segfault
    cannot be caught."""
    program = (
        "import torch, pyhvp\n"
        "torch.manual_seed(0)\n"
        "w = torch.randn(3, 3)\n"
        "compiled, eager = pyhvp.TorchBackend(compile=True), pyhvp.TorchBackend(compile=False)\n"
        "for _ in range(3):\n"
        "    x = torch.randn(4, 3)\n"
        "    for op in (pyhvp.hessian_diagonal, pyhvp.laplacian):\n"
        "        out = op(lambda x: torch.tanh(x @ w) * x, x, backend=compiled)\n"
        "        expected = op(lambda x: torch.tanh(x @ w) * x, x, backend=eager)\n"
        # float32, fused by inductor: rounding apart (an entry near 0 failed allclose's 1e-8)
        "        assert torch.allclose(out, expected, rtol=1e-4, atol=1e-5)\n"
        "print('done')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=600
    )
    assert (done.returncode, done.stdout.strip()) == (0, "done"), done.stderr[-2000:]


# --- errors: (case, call, exception type, text the message must contain) ---------------------

X = torch.zeros(4, 3)


def scalar_f(x):
    return (x**2).sum(-1)


class GradOnlyBackend:
    """A backend without the optional collapsed_jet primitive, like backend='julia'."""

    name = "grad-only"

    def grad_and_hvp(self, *call):
        return TorchBackend(compile=False).grad_and_hvp(*call)

    def second_directional(self, *call):
        raise AssertionError("not called")


def modifies_x(x):
    x.mul_(2)
    return x.sum(-1)


def writes_through_a_view_of_x(x):
    x[..., 0].mul_(1.0)  # the same values, still a write to the caller's x
    return (x**3).sum(-1)


def calls_autograd_grad(x):
    with torch.enable_grad():
        y = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(torch.tanh(y).sum(), y, create_graph=True)
    return g.sum(-1)


def calls_backward(x):
    w = torch.ones(3, requires_grad=True)
    with torch.enable_grad():
        (w * 2).sum().backward()
    return (x * w.grad).sum(-1)


def complex_intermediate(x):
    return torch.fft.fft(x).abs().pow(2).sum(-1)


ERRORS = [
    ("unknown method", lambda: pyhvp.laplacian(scalar_f, X, method="trace"), ValueError, "method"),
    ("hutchinson without samples", lambda: pyhvp.laplacian(scalar_f, X, method="hutchinson"),
     ValueError, "samples"),
    ("bool samples", lambda: pyhvp.laplacian(scalar_f, X, method="hutchinson", samples=True),
     ValueError, "samples"),
    ("hutch++ with 2 samples", lambda: pyhvp.laplacian(scalar_f, X, method="hutch++", samples=2),
     ValueError, "samples"),
    ("samples with exact", lambda: pyhvp.laplacian(scalar_f, X, samples=4), ValueError, "samples"),
    ("generator not a Generator",
     lambda: pyhvp.laplacian(scalar_f, X, method="hutchinson", samples=3, generator=1),
     TypeError, "generator"),
    ("vector f with hutch++",
     lambda: pyhvp.laplacian(lambda x: x * x, X, method="hutch++", samples=3), ValueError,
     "one scalar per instance"),
    ("integer x", lambda: pyhvp.laplacian(scalar_f, X.long()), TypeError, "x"),
    ("x not a tensor", lambda: pyhvp.laplacian(scalar_f, [1.0, 2.0]), TypeError, "x"),
    ("no variables per instance", lambda: pyhvp.laplacian(scalar_f, torch.zeros(4, 0)),
     ValueError, "at least one variable"),
    ("event_dims too large", lambda: pyhvp.laplacian(scalar_f, X, event_dims=3), ValueError,
     "event_dims"),
    ("chunk_size 0", lambda: pyhvp.laplacian(scalar_f, X, chunk_size=0), ValueError, "chunk_size"),
    ("f drops the batch dim", lambda: pyhvp.laplacian(lambda x: x.sum(), X), ValueError,
     "batch_shape"),
    ("f returns a list", lambda: pyhvp.laplacian(lambda x: [x.sum(-1)], X), TypeError, "f"),
    ("f returns integers", lambda: pyhvp.laplacian(lambda x: x.long().sum(-1), X), TypeError,
     "f must return a real floating tensor, got torch.int64"),
    ("f modifies x in place", lambda: pyhvp.laplacian(modifies_x, X.clone()), ValueError,
     "modifies x in place"),
    ("f writes through a view of x", lambda: pyhvp.laplacian(writes_through_a_view_of_x, X.clone()),
     ValueError, "f modifies x (through a view of it) in place"),
    ("complex intermediate", lambda: pyhvp.laplacian(complex_intermediate, X), TypeError,
     "complex intermediates are not supported by the Taylor engine"),
    ("torch.autograd.grad inside f", lambda: pyhvp.grad_and_laplacian(calls_autograd_grad, X),
     RuntimeError, "f calls torch.autograd.grad: autograd inside f is not supported"),
    ("backward() inside f", lambda: pyhvp.laplacian(calls_backward, X), RuntimeError,
     "f calls Tensor.backward"),
    ("factor of the wrong shape", lambda: pyhvp.laplacian(scalar_f, X, factor=torch.ones(4, 2)),
     ValueError, "factor must have shape event_shape + (r,) = (3, r)"),
    ("factor of another dtype",
     lambda: pyhvp.laplacian(scalar_f, X, factor=torch.ones(3, 2, dtype=torch.float64)),
     ValueError, "factor must have x's dtype"),
    ("backend without collapsed_jet", lambda: pyhvp.laplacian(scalar_f, X, backend=GradOnlyBackend()),
     ValueError, "use backend='torch'"),
    ("grad_and_laplacian on it",
     lambda: pyhvp.grad_and_laplacian(scalar_f, X, backend=GradOnlyBackend()), ValueError,
     "pyhvp.grad_and_laplacian needs the collapsed_jet primitive"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "call", "error", "text"), ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_input_raises_naming_the_argument(name, call, error, text):
    with pytest.raises(error, match=re.escape(text)):
        call()


def test_hutch_plus_plus_needs_only_grad_and_hvp():
    f, x, exact = estimator_problem("cpu")
    generator = torch.Generator().manual_seed(0)
    lap = pyhvp.laplacian(f, x, method="hutch++", samples=18, generator=generator,
                          backend=GradOnlyBackend())  # fmt: skip
    torch.testing.assert_close(lap, exact)


# --- diagonal first-order coefficients: functions elementwise in x before they mix ---------------
# Along the basis of x's event, x's first-order coefficient is the identity; elementwise ops keep
# it diagonal (the diagonal alone is stored), a sum over the event moves the diagonal onto the
# direction axis, and any other rule multiplies it out. Functions take their parameters as args.


def gaussians_of(x, mu):
    return torch.exp(-((x - mu) ** 2)).sum(-1)


def products_of_jets(x, s):
    return (torch.sin(x) * torch.cos(x * s) / (2 + x * x) - x / 3).mean(-1)


def elementwise_then_matmul(x, s, w):
    return torch.tanh(torch.sin(x * s) @ w).sum(-1)


def diagonal_times_dense(x, s, w):
    return (torch.exp(x * s) * torch.tanh(x @ w)).sum(-1) + (x * x).sum(-1)


def constants_broadcast_over_the_event(x, c):
    """``c`` (3, 1, N) broadcasts over the instances: the diagonal grows a leading dim, summed
    away with the event, then summed first and the event after; or the value grows it and the
    diagonal does not (a sum along it scales the diagonal)."""
    bumps = torch.exp(-((x - c) ** 2)) * c
    shifted = torch.sin(x) + c
    return bumps.sum((0, -1)) + torch.sinh(bumps.mean(0)).sum(-1) + shifted.sum((0, -1))


def particles(r, c):
    """event_dims=2: a full-event sum, and a sum over the last event dim only (multiplied out)."""
    return torch.cos(r * c).sum((-2, -1)) + torch.exp(-(r**2).sum(-1)).sum(-1)


def elementwise_vector_out(x, s):
    return torch.sin(x) * s + x / s  # the output's coefficient is still diagonal


def summed_x_cubed(x, s):
    return (x.sum(-1) * s.sum()) ** 3  # a sum of x itself


DIAGONAL_CASES = {
    "elementwise then sum": (gaussians_of, (6, 5), [(5,)], 1),
    "products, quotients, mean": (products_of_jets, (6, 5), [(5,)], 1),
    "elementwise then matmul": (elementwise_then_matmul, (6, 5), [(5,), (5, 3)], 1),
    "diagonal jet times dense jet": (diagonal_times_dense, (6, 5), [(5,), (5, 5)], 1),
    "constants broadcast over the event": (constants_broadcast_over_the_event, (6, 5), [(3, 1, 5)], 1),
    "event_dims=2": (particles, (4, 3, 2), [(3, 2)], 2),
    "per-instance batch dims": (gaussians_of, (2, 3, 4), [(2, 1, 4)], 1),
    "vector output": (elementwise_vector_out, (6, 5), [(5,)], 1),
    "sum of x itself": (summed_x_cubed, (6, 5), [(5,)], 1),
}  # fmt: skip


@pytest.mark.parametrize("case", DIAGONAL_CASES.values(), ids=DIAGONAL_CASES.keys())
def test_diagonal_coefficients_give_value_gradient_laplacian_and_its_parameter_gradients(
    case, device
):
    f, x_shape, arg_shapes, event_dims = case
    x = torch.randn(x_shape, dtype=torch.float64, device=device)
    params = [torch.randn(s, dtype=torch.float64, device=device, requires_grad=True)
              for s in arg_shapes]  # fmt: skip
    value, g, lap = pyhvp.grad_and_laplacian(f, x, *params, event_dims=event_dims,
                                             backend=TorchBackend(compile=False))  # fmt: skip
    kernels = taylor.capture(f, x, params).program.kernels
    assert [key[2] for key in kernels] == [x_shape[len(x_shape) - event_dims :]]  # the event
    fixed = [p.detach() for p in params]
    torch.testing.assert_close(value, f(x, *fixed))
    torch.testing.assert_close(g, instance_jacobian(f, x, *fixed, event_dims=event_dims))
    torch.testing.assert_close(lap, instance_laplacian(f, x, *fixed, event_dims=event_dims))
    torch.testing.assert_close(pyhvp.laplacian(f, x, *params, event_dims=event_dims), lap)
    grads = torch.autograd.grad(lap.sum(), params)
    expected = grad(
        lambda ps: instance_laplacian(lambda y: f(y, *ps), x, event_dims=event_dims).sum()
    )(fixed)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)


def particles_summed_then_mlp(r, w):
    return torch.tanh(torch.sin(r).sum(-2) @ w).sum(-1)


def particles_summed_then_product(r, w):
    return (torch.sin(r * w[:, 0]).mean(-2) ** 2).prod(-1)


ONE_PARTICLE_CASES = {
    "summed over particles, then an MLP layer": particles_summed_then_mlp,
    "averaged over particles, then a product": particles_summed_then_product,
}


@pytest.mark.parametrize("f", ONE_PARTICLE_CASES.values(), ids=ONE_PARTICLE_CASES.keys())
def test_an_event_with_a_leading_size_1_dim_sums_over_it_like_any_other(f, device):
    """x (B, 1, N), event_dims=2 (one particle in N dims): the basis reads as the last dim's, the
    size-1 particle dim as shared, and a sum over it keeps the coefficient diagonal with one dim
    fewer, its basis too (which kept it before 2026-12-06: the next multiplied-out rule failed)."""
    x = torch.randn(4, 1, 3, dtype=torch.float64, device=device)
    w = torch.randn(3, 5, dtype=torch.float64, device=device, requires_grad=True)
    value, g, lap = pyhvp.grad_and_laplacian(f, x, w, event_dims=2)
    fixed = w.detach()
    torch.testing.assert_close(value, f(x, fixed))
    torch.testing.assert_close(g, instance_jacobian(f, x, fixed, event_dims=2))
    torch.testing.assert_close(lap, instance_laplacian(f, x, fixed, event_dims=2))
    (got,) = torch.autograd.grad(lap.sum(), w)
    want = grad(lambda p: instance_laplacian(lambda y: f(y, p), x, event_dims=2).sum())(fixed)
    torch.testing.assert_close(got, want)


def kernel_tensors(f, x, *args):
    """The jet kernel's placeholders and every tensor its ops make (their sizes)."""
    (kernel,) = taylor.capture(f, x, args).program.kernels.values()
    nodes = list(kernel.graph.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    made = [n.meta["val"] for n in nodes if n.op == "call_function"
            and isinstance(n.meta.get("val"), torch.Tensor)]  # fmt: skip
    return placeholders, made


def test_elementwise_functions_of_x_never_multiply_out_the_basis():
    """sum_i exp(-(x_i - mu_i)^2) and sum_i sin(x_i) cos(x_i): no op of the kernel reads the
    directions or makes an N x B x N tensor (the dense coefficients, or their products)."""
    b, n = 64, 8
    x, mu = torch.randn(b, n), torch.randn(n)
    for f in (lambda x: gaussians_of(x, mu), lambda x: (torch.sin(x) * torch.cos(x)).sum(-1)):
        pyhvp.laplacian(f, x, backend=TorchBackend(compile=False))
        (_, directions, *_), made = kernel_tensors(f, x)
        assert not directions.users
        assert max(t.numel() for t in made) == b * n


@pytest.mark.parametrize(
    "directions",
    [
        lambda n: torch.eye(n)[:, None, :] * 2,  # not the identity
        lambda n: torch.eye(n).flip(0)[:, None, :],  # a permutation of the basis
        lambda n: torch.eye(n)[:-1, None, :],  # a chunk of it
    ],
    ids=["scaled basis", "permuted basis", "part of the basis"],
)
def test_only_the_basis_gets_diagonal_coefficients(directions):
    x, n = torch.randn(5, 4, dtype=torch.float64), 4
    u = directions(n).double()
    backend = TorchBackend(compile=False)
    _, first, second = backend.collapsed_jet(products_of_jets, x, u, (torch.ones(n),), None)
    kernels = taylor.capture(products_of_jets, x, (torch.ones(n),)).program.kernels
    assert all(key[2] is None for key in kernels)  # no event: dense coefficients
    along = [torch.func.jvp(lambda y: products_of_jets(y, torch.ones(n)), (x,), (d.expand_as(x),))
             for d in u]  # fmt: skip
    torch.testing.assert_close(first, torch.stack([t for _, t in along]))
    hessians = instance_hessians(lambda y: products_of_jets(y, torch.ones(n)), x)
    flat = u.reshape(len(u), n)
    torch.testing.assert_close(second, torch.einsum("kj,bjl,kl->b", flat, hessians, flat))


def test_the_shared_identity_is_the_basis_by_memory_and_made_anew_once_written():
    """The exact Laplacian's directions view the identity the engine shares, recognised
    without an N x N comparison; another identity is recognised by value; one written in place
    is not the basis, and the next call gets a fresh identity."""
    x = torch.randn(5, 4, dtype=torch.float64)
    eye = identity(4, x.dtype, x.device)
    assert basis_event(x, eye[:, None, :]) == (4,)
    assert basis_event(x, torch.eye(4, dtype=x.dtype)[:, None, :]) == (4,)
    eye[0, 0] = 2.0
    assert basis_event(x, eye[:, None, :]) is None
    assert torch.equal(identity(4, x.dtype, x.device), torch.eye(4, dtype=x.dtype))
    lap = pyhvp.laplacian(lambda y: (y**3).sum(-1), x, backend=TorchBackend(compile=False))
    torch.testing.assert_close(lap, 6 * x.sum(-1))


def test_laplacian_kernels_compute_neither_the_value_nor_the_first_derivatives_of_f():
    """laplacian() runs the torch backend's collapsed_second: the output's value and first-order
    coefficients (the last layer applied to K coefficients) are dead code in its kernel."""
    net = tanh_mlp(1)(torch.device("cpu"), torch.float64)
    x = torch.randn(11, 4, dtype=torch.float64)  # a program no other test records
    backend = TorchBackend(compile=False)
    lap = pyhvp.laplacian(net, x, backend=backend)
    _, _, expected = pyhvp.grad_and_laplacian(net, x, backend=backend)
    torch.testing.assert_close(lap, expected)
    kernels = taylor.capture(net, x, ()).program.kernels
    second_only = next(k for key, k in kernels.items() if key[0].outputs == (2,))
    full = next(k for key, k in kernels.items() if key[0].outputs == (0, 1, 2))
    (out,) = [n for n in second_only.graph.graph.nodes if n.op == "output"]
    (returned,) = out.args[0]  # the Laplacian alone
    assert returned.meta["val"].shape == (11,)

    def products(kernel):
        return sum("mm" in str(n.target) for n in kernel.graph.graph.nodes)

    assert products(second_only) < products(full)


def test_backend_objects_of_a_conforming_class_skip_the_protocol_check():
    """resolve_backend remembers classes that have the protocol's members themselves (the check
    costs tens of microseconds a call); objects that are not backends are still refused."""
    from pyhvp import backends

    members = {n for n, v in vars(backends.Backend).items() if callable(v) and n[0] != "_"}
    assert set(backends._MEMBERS) == members | set(backends.Backend.__annotations__)
    backend = GradOnlyBackend()
    assert backends.resolve_backend(backend) is backend
    assert GradOnlyBackend in backends._CONFORMING

    class Named:  # the name only on instances: checked every time, not remembered
        grad_and_hvp = second_directional = GradOnlyBackend.grad_and_hvp

        def __init__(self):
            self.name = "named"

    assert backends.resolve_backend(Named()).name == "named"
    assert Named not in backends._CONFORMING
    with pytest.raises(TypeError, match="backend must be a name"):
        backends.resolve_backend(object())


# --- compiled kernels under autograd: the PINN training step ----------------------------------


def pinn_step_gradients(net, x, source, backend):
    """Parameter gradients of the PINN loss ``mean((laplacian - source)^2)``."""
    net.zero_grad(set_to_none=True)
    lap = pyhvp.laplacian(lambda y: net(y).squeeze(-1), x, backend=backend)
    ((lap - source) ** 2).mean().backward()
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in net.parameters()]


def idiom_step_gradients(net, x, source):
    """The PINN libraries' step: a gradient with its graph, one more backward per input dim."""
    net.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(net(x).sum(), x, create_graph=True)
    lap = sum(torch.autograd.grad(g[:, i].sum(), x, create_graph=True)[0][:, i]
              for i in range(x.shape[1]))  # fmt: skip
    ((lap - source) ** 2).mean().backward()
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in net.parameters()]


def kernel_entries(needs_grad):
    """Compiled jet-kernel entries of the compile cache whose key says autograd differentiates
    the kernel (``needs_grad``) or not."""
    return [
        e
        for key, e in torch_backend._CACHE.entries.items()
        if key[0] == "_jet_kernel" and any(d[-1] for d in key[3]) == needs_grad and e.compiled
    ]


# (input dims, width, batch): tanh MLPs of the PINN benchmark, small
PINN_STEPS = {"2-D, width 16": (2, 16, 9), "3-D, width 8": (3, 8, 5)}


@pytest.mark.slow
@pytest.mark.parametrize(("dims", "width", "batch"), PINN_STEPS.values(), ids=PINN_STEPS.keys())
def test_compiled_pinn_step_gives_the_idioms_parameter_gradients(dims, width, batch, device):
    torch.manual_seed(5)
    net = nn.Sequential(nn.Linear(dims, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                        nn.Linear(width, 1)).to(device, torch.float64)  # fmt: skip
    x = torch.randn(batch, dims, dtype=torch.float64, device=device)
    source = torch.randn(batch, dtype=torch.float64, device=device)
    before = len(kernel_entries(needs_grad=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to eager
        got = pinn_step_gradients(net, x, source, TorchBackend(compile=True))
    # the compiled path was taken: a compiled kernel whose key says autograd differentiates it
    assert len(kernel_entries(needs_grad=True)) == before + 1
    expected = idiom_step_gradients(net, x, source)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("way", ["create_graph", "retain_graph"])
def test_compiled_kernel_backward_that_keeps_its_graph_is_exact(way, device):
    """A compiled backward is not differentiable and refuses retain_graph (AOTAutograd): such
    backwards differentiate an eager rerun instead -- gradients of gradients are exact."""
    net = pinn_net(device)
    x = torch.randn(5, 3, dtype=torch.float64, device=device)
    params = list(net.parameters())

    def second_order(backend):
        lap = pyhvp.laplacian(net, x, backend=backend)
        loss = (lap**2).sum()
        if way == "retain_graph":
            first = torch.autograd.grad(loss, params, retain_graph=True, materialize_grads=True)
            again = torch.autograd.grad(loss, params, materialize_grads=True)
            return [*first, *again]
        grads = torch.autograd.grad(loss, params, create_graph=True, materialize_grads=True)
        return torch.autograd.grad(sum((g**2).sum() for g in grads), params[0])

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = second_order(TorchBackend(compile=True))
    for g, e in zip(got, second_order(TorchBackend(compile=False)), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("way", ["create_graph", "retain_graph", "plain"])
def test_compiled_gradients_reach_a_captured_tensor_once_when_x_is_made_from_it(way, device):
    """``x`` made from a parameter ``f`` also captures: the parameter's gradient is its own part
    plus ``x``'s, each once (a rerun on the saved inputs themselves added ``x``'s part twice under
    ``create_graph``: -56.55 where -37.70 is right)."""
    weight = torch.randn(3, 5, dtype=torch.float64, device=device, requires_grad=True)

    def f(y):
        return (y**3).sum(-1) * weight.sum()

    def gradient(backend):
        x = weight.t().clone()
        lap = pyhvp.laplacian(f, x, backend=backend)
        options = {"plain": {}, "retain_graph": {"retain_graph": True},
                   "create_graph": {"create_graph": True}}[way]  # fmt: skip
        return torch.autograd.grad(lap.sum(), weight, **options)[0]

    x = weight.detach().t()  # nested autograd: the Laplacian in x, then d/d weight through x too
    expected = 6 * x.sum(-1).sum() + 6 * weight.detach().sum() * torch.ones_like(weight)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a first backward's check may warn
        for _ in range(3):  # the compiled kernel's first call (checked), then its served ones
            torch.testing.assert_close(gradient(TorchBackend(compile=True)), expected)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_compiled_calls_without_grad_stay_detached_and_compile_no_backward(mode, device):
    net = pinn_net(device)  # parameters require grad
    x = torch.randn(7, 3, dtype=torch.float64, device=device)
    before = len(kernel_entries(needs_grad=False))
    with getattr(torch, mode)():
        lap = pyhvp.laplacian(net, x, backend=TorchBackend(compile=True))
    assert not lap.requires_grad
    assert len(kernel_entries(needs_grad=False)) == before + 1
    torch.testing.assert_close(lap.squeeze(-1), instance_laplacian(net, x).squeeze(-1))


@pytest.mark.slow
def test_compiled_results_are_differentiable_in_x_args_factor_and_captured_tensors(device):
    """What the laplacian docstring promises, through a compiled kernel: gradients in ``x``,
    ``args``, ``factor`` and captured tensors equal the eager kernel's."""
    net = pinn_net(device)
    x = torch.randn(4, 3, dtype=torch.float64, device=device, requires_grad=True)
    scale = torch.rand(3, dtype=torch.float64, device=device, requires_grad=True)
    factor = torch.randn(3, 2, dtype=torch.float64, device=device, requires_grad=True)
    sources = [x, scale, factor, net[0].weight]

    def gradients(backend):
        lap = pyhvp.laplacian(lambda y, s: net(y * s).squeeze(-1), x, scale, factor=factor,
                              backend=backend)  # fmt: skip
        return torch.autograd.grad(lap.pow(2).sum(), sources)

    before = len(kernel_entries(needs_grad=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = gradients(TorchBackend(compile=True))
    assert len(kernel_entries(needs_grad=True)) == before + 1
    for g, e in zip(got, gradients(TorchBackend(compile=False)), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("operator", [pyhvp.laplacian, pyhvp.hessian_diagonal])
def test_first_calls_from_several_threads_each_give_their_own_result(operator):
    """Each thread's first call traces its kernel with make_fx, whose patching is global: two at
    once raised "CURRENT_PATCHER is None in finally block" in 2-3 of 4 threads, eager too."""
    W = torch.randn(4, 4, dtype=torch.float64)
    functions = [lambda x: (torch.tanh(x @ W) ** 2).sum(-1), lambda x: (x**3).sum(-1) * x[..., 0]]
    x = torch.randn(3, 4, dtype=torch.float64)
    results, errors = {}, []

    def call(i):
        try:
            for _ in range(3):
                results[i] = operator(functions[i % 2], x, backend=TorchBackend(compile=False))
        except Exception as error:  # (a thread's exception would not fail the test)
            errors.append(error)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    [t.start() for t in threads], [t.join() for t in threads]
    assert not errors, errors
    for i, result in results.items():
        torch.testing.assert_close(result, operator(functions[i % 2], x))


ORDS = [1, 2, 3, math.inf]
DISTANCES_TO_C = {  # |x - c|_p of an instance of 3, as f spells it
    "vector_norm": lambda y, c, p: torch.linalg.vector_norm(y - c, ord=p, dim=-1),
    "torch.dist, per instance": lambda y, c, p: pyhvp.per_instance(
        lambda z: torch.dist(z, c, p=p))(y),
    "torch.dist of the one instance": lambda y, c, p: torch.dist(y[0], c, p=p)[None],
}  # fmt: skip


@pytest.mark.parametrize("operator", ["laplacian", "hessian_diagonal"])
@pytest.mark.parametrize("distance", DISTANCES_TO_C.values(), ids=DISTANCES_TO_C.keys())
@pytest.mark.parametrize("p", ORDS, ids=[f"p={p}" for p in ORDS])
def test_every_order_of_norm_takes_its_one_sided_jet_at_a_zero_vector(p, distance, operator):
    """``exp(-|x - c|_p ** 2)`` is ``exp(-t ** 2)`` along each axis through ``c``: every
    ``d^2 / dx_i^2`` there is -2, for any p. Norms of order 1 and inf took abs' zero convention
    (Laplacian 0), and ``torch.dist``, which no rule took, autograd's NaN (p = 2) or 0 (p = 3),
    until 2026-12-08."""
    c = torch.tensor([0.3, -0.2, 0.5], dtype=torch.float64)
    got = getattr(pyhvp, operator)(lambda y: torch.exp(-(distance(y, c, p) ** 2)), c[None].clone())
    expected = torch.full((1,) if operator == "laplacian" else (1, 3), -6.0 if operator ==
                          "laplacian" else -2.0, dtype=torch.float64)  # fmt: skip
    torch.testing.assert_close(got, expected)


NORMS_AT_ZERO_VECTORS = {  # a function through a norm, and the same written by sums of squares
    "exp(-|x|^2), by x.norm": (
        lambda x: torch.exp(-(x.norm(dim=-1) ** 2)),
        lambda x: torch.exp(-(x * x).sum(-1)),
    ),
    "|x|^2, by vector_norm": (
        lambda x: torch.linalg.vector_norm(x, dim=-1) ** 2,
        lambda x: (x * x).sum(-1),
    ),
    "pairwise_distance^2 of coincident particles": (
        lambda x: F.pairwise_distance(x[..., :3], x[..., 3:], eps=0.0) ** 2,
        lambda x: ((x[..., :3] - x[..., 3:]) ** 2).sum(-1),
    ),
    "std^2 of an instance of equal entries (its centred vector is zero)": (
        lambda x: x.std(-1) ** 2,
        lambda x: x.var(-1),
    ),
    "std_mean's std^2, correction 0": (
        lambda x: torch.std_mean(x, -1, correction=0)[0] ** 2,
        lambda x: x.var(-1, correction=0),
    ),
    "cdist^2 summed over pairs, self-pairs included": (
        lambda x: torch.cdist(x.view(-1, 2, 3), x.view(-1, 2, 3)).pow(2).sum((-1, -2)),
        lambda x: 2 * ((x[..., :3] - x[..., 3:]) ** 2).sum(-1),
    ),
}


@pytest.mark.parametrize("operator", ["laplacian", "hessian_diagonal"])
@pytest.mark.parametrize("case", NORMS_AT_ZERO_VECTORS.values(), ids=NORMS_AT_ZERO_VECTORS.keys())
def test_a_norm_of_a_zero_vector_keeps_the_curvature_of_its_square(case, operator, device):
    """At a zero vector ``|x + eps v| = eps |v|`` (eps >= 0): the one-sided jet, which the
    square makes smooth again. The engine took every derivative of the norm there as 0: the
    Laplacian of exp(-|x|^2) at 0 was 0 for -6 (autograd's Hessian is NaN there)."""
    by_norm, by_squares = case
    x = torch.tensor([[0.0] * 6, [0.3, -0.1, 0.2, 0.3, -0.1, 0.2], [0.1, 0.2, -0.3, 0.4, 0.0, 0.5]],
                     dtype=torch.float64, device=device)  # fmt: skip
    reference = instance_laplacian if operator == "laplacian" else instance_hessian_diagonal
    got = getattr(pyhvp, operator)(by_norm, x)
    torch.testing.assert_close(got, reference(by_squares, x))
