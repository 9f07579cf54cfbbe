"""Specification of grad_and_hvp / hvp / per_instance against dense float64 Hessians."""

import re
import threading
import warnings
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from dense import instance_hvp
from hypothesis import given, settings
from hypothesis import strategies as st

import pyhvp
from pyhvp import TorchBackend


def gaussian(x, mu):
    """The seed-000 batched function: exp(-|x - mu|^2) per particle."""
    return torch.exp(-((x - mu) ** 2).sum(-1))


def gaussian_single(x, mu):
    return torch.exp(-((x - mu) ** 2).sum())


def coupled(x):
    """Cross terms inside an instance: x0 x1 x2 + sum sin(x)."""
    return x[..., 0] * x[..., 1] * x[..., 2] + torch.sin(x).sum(-1)


def matrix_instance(x, w):
    """event_dims=2: each instance is a (2, 3) matrix; w (3, 3) is shared."""
    return (torch.tanh(x @ w) ** 2).sum((-2, -1))


def attention(x, w):
    """event_dims=2: each instance a (3, 4) sequence through 2 heads of
    scaled_dot_product_attention, a fused kernel on the CPU (flash) with no second derivative;
    w (3, 4, 4) projects q, k, v."""
    q, k, v = ((x @ w[i]).unflatten(-1, (2, 2)).transpose(-3, -2) for i in range(3))
    return F.scaled_dot_product_attention(q, k, v).pow(2).sum((-3, -2, -1))


@dataclass
class Case:
    name: str
    f: object
    x_shape: tuple
    args_shapes: tuple = ()
    event_dims: int = 1
    kwargs: dict = field(default_factory=dict)

    def make(self, device, dtype):
        x = torch.randn(self.x_shape, device=device, dtype=dtype)
        args = tuple(torch.randn(s, device=device, dtype=dtype) for s in self.args_shapes)
        return x, args


CASES = [
    Case("seed-000 layout", gaussian, (2, 3, 4, 3), ((2, 1, 1, 3),)),
    Case(
        "per_instance(f_single)", pyhvp.per_instance(gaussian_single), (2, 3, 4, 3), ((2, 1, 1, 3),)
    ),
    Case("cross terms", coupled, (5, 3)),
    Case("unbatched", coupled, (3,)),
    Case("event_dims=2", matrix_instance, (4, 2, 3), ((3, 3),), event_dims=2),
    Case("affine: zero Hessian", lambda x: 2 * x.sum(-1) + 1, (4, 3)),
    Case("attention (a fused kernel)", attention, (4, 3, 4), ((3, 4, 4),), event_dims=2),
]
TANGENTS = {"one tangent": None, "k=3 tangents": 3, "k=5 chunked by 2": (5, 2)}
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def tolerance(dtype):
    return (
        {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-10}
    )


def tangents_for(x, spec):
    k, chunk = (spec, None) if not isinstance(spec, tuple) else spec
    v = torch.randn(x.shape if k is None else (k, *x.shape), device=x.device, dtype=x.dtype)
    return v, chunk


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("spec", TANGENTS.values(), ids=TANGENTS.keys())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_hvp_matches_dense_instance_hessian(case, spec, dtype, device):
    x, args = case.make(device, dtype)
    v, chunk = tangents_for(x, spec)
    hv = pyhvp.hvp(f := case.f, x, v, *args, event_dims=case.event_dims, chunk_size=chunk)
    expected = instance_hvp(f, x, v, *args, event_dims=case.event_dims)
    torch.testing.assert_close(hv.double(), expected, **tolerance(dtype))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gradient_is_per_instance_gradient(case, device):
    x, args = case.make(device, torch.float64)
    g, _ = pyhvp.grad_and_hvp(case.f, x, torch.ones_like(x), *args, event_dims=case.event_dims)
    expected = torch.func.grad(lambda y: case.f(y, *args).sum())(x)
    torch.testing.assert_close(g, expected)


SUMS_OVER_X = {
    "x.sum(-1)": lambda x: x.sum(-1),
    "x.sum(-1) + x[..., 0] ** 3": lambda x: x.sum(-1) + x[..., 0] ** 3,
}


@pytest.mark.parametrize("f", SUMS_OVER_X.values(), ids=SUMS_OVER_X.keys())
def test_a_write_to_one_instances_gradient_reaches_no_other(f, device):
    """autograd's gradient of a sum over x is one 1 expanded over x's shape (stride 0):
    ``g[0] = 0`` on grad_and_hvp's gradient zeroed every instance's, silently."""
    x = torch.randn(4, 3, device=device, dtype=torch.float64)
    g = pyhvp.grad_and_hvp(f, x, torch.ones_like(x))[0]
    expected = g[1:].clone()
    g[0] = 0.0
    torch.testing.assert_close(g[1:], expected)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_compiled_path_matches_dense(case, dtype, device):
    x, args = case.make(device, dtype)
    v = torch.randn(3, *x.shape, device=device, dtype=dtype)
    hv = pyhvp.hvp(case.f, x, v, *args, backend=TorchBackend(compile=True))
    expected = instance_hvp(case.f, x, v, *args)
    torch.testing.assert_close(hv.double(), expected, **tolerance(dtype))


@pytest.mark.slow
def test_auto_compile_kicks_in_once_eager_time_reaches_the_compile_cost(
    compiled, compile_after_eager_calls
):
    compile_after_eager_calls(2)
    x, mu = torch.randn(8, 3), torch.randn(3)
    results = [pyhvp.hvp(gaussian, x, torch.ones_like(x), mu) for _ in range(2)]
    assert compiled == []
    results += [pyhvp.hvp(gaussian, x, torch.ones_like(x), mu) for _ in range(2)]
    assert len(compiled) == 1 and all(torch.allclose(r, results[0]) for r in results)


def test_compile_failure_warns_and_runs_eagerly(compiler_fails):
    x, mu = torch.randn(6, 3), torch.randn(3)
    with pytest.warns(RuntimeWarning, match="torch.compile failed"):
        hv = pyhvp.hvp(gaussian, x, torch.ones_like(x), mu, backend=TorchBackend(compile=True))
    expected = instance_hvp(gaussian, x, torch.ones_like(x), mu)
    torch.testing.assert_close(hv.double(), expected, **tolerance(torch.float32))


def test_inputs_are_not_modified_and_requires_grad_works():
    x = torch.randn(5, 3, requires_grad=True)
    v, mu = torch.randn(5, 3), torch.randn(3)
    before = (x.detach().clone(), v.clone(), mu.clone())
    hv = pyhvp.hvp(gaussian, x, v, mu)
    torch.testing.assert_close(hv.double(), instance_hvp(gaussian, x.detach(), v, mu))
    assert all(torch.equal(a, b) for a, b in zip(before, (x.detach(), v, mu), strict=True))


def test_result_stays_differentiable_when_inputs_require_grad():
    """d/dmu of sum(H v) through the eager path equals the dense third-derivative contraction."""
    x, v = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    mu = torch.randn(3, dtype=torch.float64, requires_grad=True)
    (dmu,) = torch.autograd.grad(pyhvp.hvp(gaussian, x, v, mu).sum(), mu)
    expected = torch.func.grad(lambda m: instance_hvp(gaussian, x, v, m).sum())(mu.detach())
    torch.testing.assert_close(dmu, expected)


LINEAR_IN_X = {  # operator -> its results for f(z) = w . z per instance (all constants)
    "hvp": lambda f, x, v: (pyhvp.hvp(f, x, v),),
    "grad_and_hvp": lambda f, x, v: pyhvp.grad_and_hvp(f, x, v),
    "hessian_diagonal hutchinson": lambda f, x, v: (
        pyhvp.hessian_diagonal(f, x, method="hutchinson", samples=2),
    ),
    "laplacian, compile=False": lambda f, x, v: (
        pyhvp.laplacian(f, x, backend=pyhvp.TorchBackend(compile=False)),
    ),
    "bilaplacian, compile=False": lambda f, x, v: (
        pyhvp.bilaplacian(f, x, backend=pyhvp.TorchBackend(compile=False)),
    ),
}


@pytest.mark.parametrize("operator", LINEAR_IN_X.values(), ids=LINEAR_IN_X.keys())
@pytest.mark.parametrize("global_hook", [False, True], ids=["", "under a global module hook"])
def test_results_of_an_f_linear_in_x_are_differentiable_with_zero_derivatives(
    operator, global_hook
):
    """A constant to autograd (until 2026-12-07 it had no graph: ``.backward()`` through it
    raised torch's "does not require grad", where a Laplacian's was differentiable)."""
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    hook = (
        torch.nn.modules.module.register_module_forward_hook(lambda *_: None)
        if global_hook
        else None
    )
    try:
        results = operator(lambda z: z @ w, x, v)
    finally:
        if hook is not None:
            hook.remove()
    total = sum((r**2).sum() for r in results)
    derivatives = torch.autograd.grad(total, (x, v), allow_unused=True, materialize_grads=True)
    assert all(torch.equal(d, torch.zeros_like(d)) for d in derivatives)


# how parameters travel as one container arg (functional_call's dict), and f reading them
CONTAINERS = {
    "a dict": (lambda mu: {"mu": mu}, lambda x, params: gaussian(x, params["mu"])),
    "a list": (lambda mu: [mu], lambda x, params: gaussian(x, params[0])),
}


@pytest.mark.parametrize(("pack", "f"), CONTAINERS.values(), ids=CONTAINERS.keys())
def test_result_stays_differentiable_in_tensors_inside_a_container_arg(pack, f):
    """As for a tensor arg (until 2026-12-05 such a result came back detached)."""
    x, v = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    mu = torch.randn(3, dtype=torch.float64, requires_grad=True)
    (dmu,) = torch.autograd.grad(pyhvp.hvp(f, x, v, pack(mu)).sum(), mu)
    expected = torch.func.grad(lambda m: instance_hvp(gaussian, x, v, m).sum())(mu.detach())
    torch.testing.assert_close(dmu, expected)


@pytest.mark.slow
def test_captured_parameters_never_attach_a_graph_eager_or_compiled():
    """Tensors f captures are constants: every call (eager first, compiled from the third) returns
    results without autograd history; args are how to differentiate through parameters."""
    w = torch.randn(3, requires_grad=True)

    def weighted(x):
        return (w * x**3).sum(-1)

    x, v = torch.randn(4, 3), torch.randn(4, 3)
    results = [pyhvp.grad_and_hvp(weighted, x, v) for _ in range(4)]
    assert not any(t.requires_grad for pair in results for t in pair)


def test_args_made_from_x_are_constants_when_x_requires_grad():
    """The partial derivative in x: an arg computed from x must not couple the instances."""
    x0, v = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    x = x0.clone().requires_grad_()
    hv = pyhvp.hvp(gaussian, x, v, x.mean(0))
    torch.testing.assert_close(hv.detach(), instance_hvp(gaussian, x0, v, x0.mean(0)))


def test_inference_tensors_are_accepted():
    with torch.inference_mode():
        x, v, mu = torch.randn(4, 3), torch.randn(4, 3), torch.randn(3)
    hv = pyhvp.hvp(gaussian, x, v, mu, backend=TorchBackend(compile=False))
    torch.testing.assert_close(hv.double(), instance_hvp(gaussian, x, v, mu), **tolerance(x.dtype))


INFERENCE_INPUTS = {"x": ("x",), "v": ("v",), "x and v": ("x", "v")}


@pytest.mark.parametrize("names", INFERENCE_INPUTS.values(), ids=INFERENCE_INPUTS.keys())
def test_inference_tensors_are_accepted_next_to_an_arg_that_requires_grad(names):
    """Until 2026-12-05 autograd refused them there (requires_grad on an inference tensor, or
    an inference tensor saved for backward)."""
    inputs = {
        "x": torch.randn(4, 3, dtype=torch.float64),
        "v": torch.randn(4, 3, dtype=torch.float64),
    }
    with torch.inference_mode():
        made_inside = {name: inputs[name].clone() for name in names}
    mu = torch.randn(3, dtype=torch.float64, requires_grad=True)
    hv = pyhvp.hvp(gaussian, *{**inputs, **made_inside}.values(), mu)
    torch.testing.assert_close(hv, instance_hvp(gaussian, *inputs.values(), mu.detach()))


def test_an_error_of_f_is_raised_as_is_not_reported_as_a_compile_failure():
    def total(x):  # the sum, not one value per instance
        return (x**3).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(ValueError, match="one value per instance"):
            pyhvp.hvp(total, X, X, backend=TorchBackend(compile=True))


@settings(max_examples=25, deadline=None)
@given(
    batch=st.lists(st.integers(1, 3), min_size=0, max_size=3),
    event=st.lists(st.integers(1, 3), min_size=1, max_size=2),
    k=st.one_of(st.none(), st.integers(1, 3)),
)
def test_quadratic_form_hvp_is_a_times_v_for_any_shape(batch, event, k):
    """f = 1/2 x^T A x per instance has H = A: hv = A v for every batch/event/k combination."""
    n = int(torch.tensor(event).prod())
    a = torch.randn(n, n, dtype=torch.float64)
    a = a + a.T

    def quadratic(x):
        flat = x.reshape(*x.shape[: len(x.shape) - len(event)], n)
        return 0.5 * torch.einsum("...i,ij,...j->...", flat, a, flat)

    x = torch.randn(*batch, *event, dtype=torch.float64)
    v = torch.randn(*(() if k is None else (k,)), *x.shape, dtype=torch.float64)
    hv = pyhvp.hvp(quadratic, x, v, event_dims=len(event))
    expected = torch.einsum("ij,...j->...i", a, v.reshape(*v.shape[: v.ndim - len(event)], n))
    torch.testing.assert_close(hv, expected.reshape(v.shape))


# --- errors: (call, exception, message fragments) -------------------------------------------

X, MU = torch.randn(4, 3), torch.randn(3)
ERRORS = {
    "x not a tensor": (
        lambda: pyhvp.hvp(gaussian, [[1.0, 2.0]], X, MU),
        TypeError,
        ["x", "torch.Tensor", "list"],
    ),
    "x integer": (
        lambda: pyhvp.hvp(gaussian, X.long(), X, MU),
        TypeError,
        ["x", "floating", "torch.int64"],
    ),
    "v wrong shape": (
        lambda: pyhvp.hvp(gaussian, X, torch.ones(4, 2), MU),
        ValueError,
        ["v", "(4, 3)", "(k, 4, 3)", "(4, 2)"],
    ),
    "v broadcastable but wrong": (
        lambda: pyhvp.hvp(gaussian, X, torch.ones(1, 3), MU),
        ValueError,
        ["v", "(4, 3)", "(1, 3)"],
    ),
    "v dtype": (
        lambda: pyhvp.hvp(gaussian, X, X.double(), MU),
        ValueError,
        ["v", "torch.float32", "torch.float64"],
    ),
    "v not floating": (lambda: pyhvp.hvp(gaussian, X, X.long(), MU), TypeError, ["v", "floating"]),
    "zero tangents": (
        lambda: pyhvp.hvp(gaussian, X, X[None][:0], MU),
        ValueError,
        ["v", "k >= 1", "(0, 4, 3)"],
    ),
    "Julia source on the torch backend": (
        lambda: pyhvp.hvp(pyhvp.julia_function("(x, mu) -> sum(x)"), X, X, MU),
        TypeError,
        ["f", "JuliaFunction", "backend='julia'"],
    ),
    "arg dtype": (
        lambda: pyhvp.hvp(gaussian, X, X, MU.double()),
        ValueError,
        ["args[0]", "torch.float32", "torch.float64"],
    ),
    "arg dtype inside a dict": (
        lambda: pyhvp.hvp(lambda x, p: gaussian(x, p["mu"]), X, X, {"mu": MU.double()}),
        ValueError,
        ["args[0]['mu']", "torch.float32", "torch.float64"],
    ),
    "f returns the sum": (
        lambda: pyhvp.hvp(lambda x, mu: gaussian(x, mu).sum(), X, X, MU),
        ValueError,
        ["f", "(4,)", "()"],
    ),
    "f returns per coordinate": (
        lambda: pyhvp.hvp(lambda x, mu: (x - mu) ** 2, X, X, MU),
        ValueError,
        ["f", "(4,)", "(4, 3)"],
    ),
    "f returns no tensor": (
        lambda: pyhvp.hvp(lambda x, mu: 1.0, X, X, MU),
        TypeError,
        ["f", "float"],
    ),
    "event_dims too large": (
        lambda: pyhvp.hvp(gaussian, X, X, MU, event_dims=3),
        ValueError,
        ["event_dims", "x.ndim=2", "3"],
    ),
    "event_dims zero": (
        lambda: pyhvp.hvp(gaussian, X, X, MU, event_dims=0),
        ValueError,
        ["event_dims", "0"],
    ),
    "chunk_size": (
        lambda: pyhvp.hvp(gaussian, X, X[None], MU, chunk_size=0),
        ValueError,
        ["chunk_size", "0"],
    ),
    "unknown backend": (
        lambda: pyhvp.hvp(gaussian, X, X, MU, backend="jax"),
        ValueError,
        ["backend", "'jax'", "torch"],
    ),
    "bad compile option": (
        lambda: TorchBackend(compile="sometimes"),
        ValueError,
        ["compile", "'sometimes'"],
    ),
    "per_instance arg does not broadcast": (
        lambda: pyhvp.per_instance(gaussian_single)(torch.randn(2, 4, 3), torch.randn(3, 1, 3)),
        ValueError,
        ["args[0]", "(3, 1)", "(2, 4)"],
    ),
    "per_instance arg_event_dims negative": (
        lambda: pyhvp.per_instance(gaussian_single, arg_event_dims=-1),
        ValueError,
        ["arg_event_dims", "-1"],
    ),
    "per_instance arg_event_dims a bool, refused when built": (
        lambda: pyhvp.per_instance(gaussian_single, arg_event_dims=True),
        ValueError,
        ["arg_event_dims", "True"],
    ),
    "per_instance arg_event_dims a string, refused when built": (
        lambda: pyhvp.per_instance(gaussian_single, arg_event_dims="ab"),
        ValueError,
        ["arg_event_dims", "'ab'"],
    ),
    "per_instance arg_event_dims not an int": (
        lambda: pyhvp.per_instance(gaussian_single, arg_event_dims=1.5)(X, MU),
        ValueError,
        ["arg_event_dims", "1.5"],
    ),
    "per_instance f_single not scalar, for an HVP": (
        lambda: pyhvp.hvp(pyhvp.per_instance(lambda x: x * 2), X, X),
        ValueError,
        ["f", "(4,)", "(4, 3)"],
    ),
    "per_instance called directly with a NumPy arg": (
        lambda: pyhvp.per_instance(gaussian_single)(X, MU.numpy()),
        TypeError,
        ["args[0]", "numpy.ndarray"],
    ),
    "per_instance called directly with an arg on another device": (
        lambda: pyhvp.per_instance(gaussian_single)(X, MU.to("meta")),
        ValueError,
        ["args[0]", "cpu", "meta"],
    ),
    "per_instance f_single returns no tensor": (
        lambda: pyhvp.per_instance(lambda x: 1.0)(X),
        TypeError,
        ["f_single", "float"],
    ),
}
if torch.cuda.is_available():
    ERRORS["v on another device"] = (
        lambda: pyhvp.hvp(gaussian, X, X.cuda(), MU),
        ValueError,
        ["v", "cpu", "cuda"],
    )
    ERRORS["arg on another device"] = (
        lambda: pyhvp.hvp(gaussian, X, X, MU.cuda()),
        ValueError,
        ["args[0]", "cpu", "cuda"],
    )
    ERRORS["arg inside a list on another device"] = (
        lambda: pyhvp.hvp(lambda x, p: gaussian(x, p[0]), X, X, [MU.cuda()]),
        ValueError,
        ["args[0][0]", "cpu", "cuda"],
    )


@pytest.mark.parametrize("call, error, fragments", ERRORS.values(), ids=ERRORS.keys())
def test_bad_input_raises_a_clear_error(call, error, fragments):
    with pytest.raises(error) as info:
        call()
    missing = [frag for frag in fragments if frag not in str(info.value)]
    assert not missing, f"message {str(info.value)!r} lacks {missing}"


def test_available_backends_always_lists_torch():
    assert pyhvp.available_backends()[0] == "torch"


def test_attention_switches_are_the_users_again_after_calls_from_several_threads():
    """pyhvp puts scaled_dot_product_attention on its math path (global switches) while it
    differentiates: concurrent calls restored each other's saved switches, and the user's
    choice (here: flash only) was lost."""
    x, v = torch.randn(4, 3), torch.randn(4, 3)
    before = torch.backends.cuda.math_sdp_enabled()
    torch.backends.cuda.enable_math_sdp(False)
    try:
        threads = [threading.Thread(target=lambda: [pyhvp.hvp(coupled, x, v) for _ in range(100)])
                   for _ in range(4)]  # fmt: skip
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not torch.backends.cuda.math_sdp_enabled()
    finally:
        torch.backends.cuda.enable_math_sdp(before)


def test_float32_result_keeps_dtype_and_device(device):
    x = torch.randn(3, 3, device=device)
    g, hv = pyhvp.grad_and_hvp(coupled, x, torch.ones_like(x))
    assert (g.dtype, hv.dtype, g.device, hv.device) == (torch.float32,) * 2 + (x.device,) * 2


def test_per_instance_wrappers_of_one_function_are_equal():
    """Equal wrappers share one compile-cache entry when rebuilt in a loop."""
    assert pyhvp.per_instance(gaussian_single) == pyhvp.per_instance(gaussian_single)
    assert pyhvp.per_instance(gaussian_single) != pyhvp.per_instance(gaussian_single, 2)


def test_per_instance_takes_numpy_ints_for_arg_event_dims_as_for_event_dims():
    # (a NumPy int was refused there, where event_dims took it)
    import numpy as np

    for numpy_dims, dims in ((np.int64(1), 1), ([np.int64(1)], [1])):
        made = pyhvp.per_instance(gaussian_single, arg_event_dims=numpy_dims)
        assert made == pyhvp.per_instance(gaussian_single, arg_event_dims=dims)


MATRIX_INSTANCES = pyhvp.per_instance(lambda m: torch.tanh(m @ m.T).sum(), event_dims=2)
"""One instance is a matrix: x of shape (4, 2, 3) holds 4 of them."""
OPERATORS_TAKING_EVENT_DIMS = {
    "hvp": lambda f, x: pyhvp.hvp(f, x, x),
    "grad_and_hvp": lambda f, x: pyhvp.grad_and_hvp(f, x, x),
    "hessian_diagonal": pyhvp.hessian_diagonal,
    "laplacian": pyhvp.laplacian,
    "grad_and_laplacian": pyhvp.grad_and_laplacian,
    "bilaplacian": pyhvp.bilaplacian,
    "directional_derivatives": lambda f, x: pyhvp.directional_derivatives(f, x, x, order=2),
    "differential_operator": lambda f, x: pyhvp.differential_operator(f, x, {(0, 0): 1.0}),
    "check_instances": pyhvp.check_instances,
}


@pytest.mark.parametrize("call", OPERATORS_TAKING_EVENT_DIMS.values(),
                         ids=OPERATORS_TAKING_EVENT_DIMS.keys())  # fmt: skip
def test_a_per_instance_function_refuses_an_operators_other_event_dims(call):
    """Left at its default 1, event_dims would cut x into rows, not f's matrices: until
    2026-12-05 hessian_diagonal and others returned the rows' results silently."""
    with pytest.raises(ValueError, match=re.escape("event_dims=2), got event_dims=1")):
        call(MATRIX_INSTANCES, torch.randn(4, 2, 3))


def test_per_instance_handles_an_empty_batch_with_a_shared_arg():
    f = pyhvp.per_instance(gaussian_single)
    assert f(torch.zeros(0, 3), torch.zeros(1, 3)).shape == (0,)


W_35 = torch.randn(3, 5)
EMPTY_BATCHES = [(0, 3), (0, 4, 3), (4, 0, 3)]


@pytest.mark.parametrize("shape", EMPTY_BATCHES, ids=str)
def test_a_per_instance_function_over_an_empty_batch_has_the_batched_functions_shape(shape):
    """Until 2026-12-05 vmap failed over no instance where f selects one (x.prod(): 'select():
    index 0 out of range')."""
    x = torch.randn(shape)
    f = pyhvp.per_instance(lambda x: torch.sigmoid(x @ W_35) * x.prod())
    assert f(x).shape == (torch.sigmoid(x @ W_35) * x.prod(-1, keepdim=True)).shape


def test_a_per_instance_function_with_dropout_in_training_is_differentiated_at_its_draw():
    """Each instance draws its own mask (vmap's randomness="different", as a batched network
    draws one per row), and the gradient and HVP are autograd's at f's own draw (vmap's
    default refused any random op: 'randomness error mode')."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1)
    ).double()
    f = pyhvp.per_instance(lambda x: net(x)[0])
    x, v = torch.randn(2, 4, 3, dtype=torch.float64)
    torch.manual_seed(5)
    gradient, product = pyhvp.grad_and_hvp(f, x, v, backend=TorchBackend(compile=False))
    torch.manual_seed(5)
    y = x.clone().requires_grad_()
    (expected_gradient,) = torch.autograd.grad(f(y).sum(), y, create_graph=True)
    (expected_product,) = torch.autograd.grad((expected_gradient * v).sum(), y)
    torch.testing.assert_close((gradient, product), (expected_gradient, expected_product))


REFUSED_BY_TORCHS_NORMS = {
    "groups that do not divide the channels": lambda z: F.group_norm(
        z.reshape(-1, 3, 2), 2).sum((1, 2)),
    "one value per channel in training": lambda z: F.batch_norm(
        z[:1], None, None, training=True).sum() + z.sum(-1),
    "a normalized_shape that is not the input's": lambda z: F.layer_norm(z, (3,)).sum(-1),
    "a weight of another shape": lambda z: F.layer_norm(z, (6,), torch.ones(1)).sum(-1),
}  # fmt: skip
"""Norms torch refuses: where an hvp's result carries derivatives, f's norms run written out,
which skipped torch's checks and returned numbers (a group norm of 3 channels in 2 groups)."""


@pytest.mark.parametrize("f", REFUSED_BY_TORCHS_NORMS.values(), ids=REFUSED_BY_TORCHS_NORMS.keys())
def test_an_hvp_that_carries_derivatives_refuses_what_torchs_norms_refuse(f):
    x = torch.randn(4, 6, requires_grad=True)
    with pytest.raises((RuntimeError, ValueError)):
        pyhvp.hvp(f, x, torch.ones(4, 6))


@pytest.mark.parametrize("requires_grad", [False, True], ids=["detached", "carrying derivatives"])
def test_an_hvp_of_a_half_precision_layer_norm_is_torchs_within_half_rounding(requires_grad):
    """Written out in half precision, the variance overflowed past 256: the HVP was zero."""
    x = 10 * torch.randn(1, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x[0, 0] = 300.0
    v = torch.randn(1, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def f(z):
        normed = F.layer_norm(z, (16,))
        return (normed.sin() * normed).sum(-1)

    expected = instance_hvp(f, x, v)
    got = pyhvp.hvp(f, x.half().requires_grad_(requires_grad), v.half())
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-2 * scale)


def test_the_gradient_of_an_hvp_through_a_batch_norm_with_running_statistics_is_the_formulas():
    """``nn.BatchNorm1d()`` in training (running statistics given) was left to torch's third
    derivative (0.5 off): it is written out too, torch's op updating the statistics once."""
    torch.manual_seed(0)
    norm = torch.nn.BatchNorm1d(5).double().train()
    x = torch.randn(8, 5, dtype=torch.float64, requires_grad=True)
    v = torch.randn(8, 5, dtype=torch.float64)

    def f(z, normalise):
        return normalise(z).pow(3).sum(-1)

    def by_formula(z):
        centred = z - z.mean(0)
        return centred / ((centred * centred).mean(0) + norm.eps).sqrt()

    (expected,) = torch.autograd.grad(pyhvp.hvp(f, x, v, by_formula).pow(2).sum(), x)
    (got,) = torch.autograd.grad(pyhvp.hvp(f, x, v, norm).pow(2).sum(), x)
    torch.testing.assert_close((got, int(norm.num_batches_tracked)), (expected, 1))


UNDER_ANOMALY_DETECTION = {
    "hvp, 3 tangents": lambda x: pyhvp.hvp(coupled, x, torch.ones(3, *x.shape, dtype=x.dtype)),
    "hessian_diagonal, hutchinson": lambda x: pyhvp.hessian_diagonal(
        coupled, x, method="hutchinson", samples=4
    ),
    "laplacian, hutch++": lambda x: pyhvp.laplacian(coupled, x, method="hutch++", samples=6),
    "sub_hessian, forward route": lambda x: pyhvp.sub_hessian(
        lambda p: coupled(p).sum(), x, torch.tensor([0, 5, 2]), method="forward"
    ),
}


@pytest.mark.parametrize("call", UNDER_ANOMALY_DETECTION.values(), ids=UNDER_ANOMALY_DETECTION)
def test_anomaly_detection_gives_the_results_without_it(call):
    """Its NaN check reads every gradient's value, which autograd's batched backward
    (is_grads_batched) cannot: "Batching rule not implemented for aten::item" before."""
    x = torch.randn(2, 4, dtype=torch.float64)
    torch.manual_seed(1)
    expected = call(x)
    torch.manual_seed(1)
    with warnings.catch_warnings(), torch.autograd.detect_anomaly():
        warnings.simplefilter("ignore")  # (torch says the mode is slow)
        torch.testing.assert_close(call(x), expected)


CHANNELS_LAST_POOLS = {
    "max_pool2d": lambda h: F.max_pool2d(h, 2),
    "adaptive_max_pool2d": lambda h: F.adaptive_max_pool2d(h, 2),
}


@pytest.mark.parametrize("pool", CHANNELS_LAST_POOLS.values(), ids=CHANNELS_LAST_POOLS.keys())
def test_tangents_through_a_channels_last_max_pool_give_the_dense_hvps(pool):
    """Torch cannot batch this double backward ("NYI: querying is_contiguous inside of vmap"):
    several tangents raised it, where one tangent at a time is right; they now run so. The
    reference: autograd's double backward, one tangent at a time."""
    generator = torch.Generator().manual_seed(7)
    kernel = torch.randn(3, 2, 3, 3, dtype=torch.float64, generator=generator)

    def f(x):
        h = x.view(-1, 2, 6, 6).contiguous(memory_format=torch.channels_last)
        return pool(torch.tanh(F.conv2d(h, kernel))).pow(2).sum((1, 2, 3))

    x = torch.randn(2, 72, dtype=torch.float64, generator=generator)
    tangents = torch.randn(3, 2, 72, dtype=torch.float64, generator=generator)
    y = x.clone().requires_grad_()  # (torch.func's reference cannot run channels_last either)
    (gradient,) = torch.autograd.grad(f(y).sum(), y, create_graph=True)
    expected = torch.stack([torch.autograd.grad(gradient, y, v, retain_graph=True)[0]
                            for v in tangents])  # fmt: skip
    torch.testing.assert_close(pyhvp.hvp(f, x, tangents), expected, rtol=1e-9, atol=1e-10)
