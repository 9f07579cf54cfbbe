"""Specification of degenerate and unusual inputs, the same on every operator and every path:
constant functions, inference mode, outputs that are not real floating tensors, unused
parameters, half precision."""

import pytest
import torch
from dense import dense_sub_hessian, instance_hessian_diagonal, instance_hvp
from torch import nn

import pyhvp
from pyhvp import TorchBackend


def cubic(x):
    return (x**3).sum(-1) + x.prod(-1)


# operator name -> (call(f, x, backend), dense reference(f, x)); f returns one value per instance
INDEX = torch.tensor([0, 4, 2])
OPERATORS = {
    "grad_and_hvp": (
        lambda f, x, backend: pyhvp.hvp(f, x, torch.ones_like(x), backend=backend),
        lambda f, x: instance_hvp(f, x, torch.ones_like(x)),
    ),
    "hessian_diagonal": (
        lambda f, x, backend: pyhvp.hessian_diagonal(f, x, backend=backend),
        instance_hessian_diagonal,
    ),
    "sub_hessian": (
        lambda f, x, backend: pyhvp.sub_hessian(lambda p: f(p).sum(), x, INDEX, backend=backend),
        lambda f, x: dense_sub_hessian(lambda p: f(p).sum(), x, INDEX),
    ),
}
CONSTANT = {
    "zeros": lambda x: torch.zeros(x.shape[:-1], dtype=x.dtype),
    "a constant made from x's shape": lambda x: torch.full(x.shape[:-1], 2.0, dtype=x.dtype),
    "x detached": lambda x: x.detach().sum(-1) ** 2,
}
PATHS = {
    "eager": lambda: TorchBackend(compile=False),
    "compiled": pytest.param(lambda: TorchBackend(compile=True), marks=pytest.mark.slow),
}


@pytest.mark.parametrize("op", OPERATORS.values(), ids=OPERATORS.keys())
@pytest.mark.parametrize("f", CONSTANT.values(), ids=CONSTANT.keys())
@pytest.mark.parametrize("path", PATHS.values(), ids=PATHS.keys())
def test_a_constant_function_has_zero_second_derivatives_on_every_path(op, f, path, device):
    call, reference = op
    x = torch.randn(4, 3, dtype=torch.float64, device=device)
    result = call(f, x, path())
    assert torch.equal(result, torch.zeros_like(result))
    assert result.shape == reference(cubic, x).shape


@pytest.mark.parametrize("op", OPERATORS.values(), ids=OPERATORS.keys())
@pytest.mark.parametrize("made_inside", [True, False], ids=["inference tensor", "normal tensor"])
def test_inference_mode_gives_the_result_of_normal_mode(op, made_inside, device):
    call, reference = op
    x = torch.randn(4, 3, dtype=torch.float64, device=device)
    with torch.inference_mode():
        inside = call(cubic, x.clone() if made_inside else x, "torch")
    torch.testing.assert_close(inside, reference(cubic, x))


OUTPUTS = {
    "int64": (lambda x: (x**3).sum(-1).long(), "torch.int64"),
    "complex64": (lambda x: (x**3).sum(-1).to(torch.complex64), "torch.complex64"),
}


@pytest.mark.parametrize("op", OPERATORS.values(), ids=OPERATORS.keys())
@pytest.mark.parametrize(("f", "dtype"), OUTPUTS.values(), ids=OUTPUTS.keys())
def test_an_output_that_is_not_real_floating_is_refused_naming_its_dtype(op, f, dtype):
    call, _ = op
    with pytest.raises(TypeError, match=rf"must return a real floating tensor, got {dtype}"):
        call(f, torch.randn(4, 3), "torch")


def frozen_first_layer():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    net[0].requires_grad_(False)
    return net


@pytest.mark.parametrize("joint", [False, True], ids=["blocks", "joint"])
def test_a_tensor_the_loss_does_not_use_has_a_zero_block(joint, device):
    """A frozen or unused tensor named in index: its rows and columns are zero."""
    params = {"used": torch.randn(3, dtype=torch.float64), "unused": torch.randn(2, 2).double()}
    params = {name: p.to(device) for name, p in params.items()}
    index = {"unused": torch.tensor([0, 3]), "used": torch.tensor([1, 2])}

    def loss(p):
        return (p["used"] ** 3).sum()

    result = pyhvp.sub_hessian(loss, params, index, joint=joint)
    expected = dense_sub_hessian(loss, params, index)
    if joint:
        torch.testing.assert_close(result, expected)
    else:
        torch.testing.assert_close(result["unused"], torch.zeros(2, 2, dtype=torch.float64))
        torch.testing.assert_close(result["used"], expected[2:, 2:])


HALF = {torch.float16: 2e-2, torch.bfloat16: 1e-1}


@pytest.mark.parametrize("op", OPERATORS.values(), ids=OPERATORS.keys())
@pytest.mark.parametrize("dtype", HALF, ids=[str(d) for d in HALF])
def test_half_precision_runs_to_its_precision(op, dtype):
    """float16 / bfloat16 compute in that dtype: results within its precision of float64."""
    call, reference = op
    x = torch.rand(4, 3, dtype=torch.float64) + 0.5
    result = call(cubic, x.to(dtype), "torch")
    assert result.dtype == dtype
    torch.testing.assert_close(result.double(), reference(cubic, x), rtol=HALF[dtype], atol=0)


ESTIMATORS = {
    "diagonal exact": (lambda f, x: pyhvp.hessian_diagonal(f, x), (0, 3)),
    "diagonal hutchinson": (
        lambda f, x: pyhvp.hessian_diagonal(f, x, method="hutchinson", samples=4),
        (0, 3),
    ),
    "diagonal diag++": (
        lambda f, x: pyhvp.hessian_diagonal(f, x, method="diag++", samples=4),
        (0, 3),
    ),
    "laplacian exact": (lambda f, x: pyhvp.laplacian(f, x), (0,)),
    "laplacian hutchinson": (
        lambda f, x: pyhvp.laplacian(f, x, method="hutchinson", samples=4),
        (0,),
    ),
    "laplacian hutch++": (lambda f, x: pyhvp.laplacian(f, x, method="hutch++", samples=4), (0,)),
}


@pytest.mark.parametrize(("call", "shape"), ESTIMATORS.values(), ids=ESTIMATORS.keys())
def test_an_empty_batch_gives_an_empty_result_on_every_method(call, shape, device):
    """Issue 16 item 4: the stochastic methods raised a reshape error on x of shape (0, 3)."""
    result = call(cubic, torch.randn(0, 3, dtype=torch.float64, device=device))
    assert result.shape == shape


@pytest.mark.parametrize("method", ["exact", "hutchinson", "diag++"])
def test_a_scalar_diagonal_of_an_expanded_x_equals_the_contiguous_one(method, device):
    """Issue 16 item 4: one (4, 3) instance expanded from (1, 3) raised 'more than one element of
    the written-to tensor refers to a single memory location' on the scalar path."""
    x = torch.randn(1, 3, dtype=torch.float64, device=device).expand(4, 3)[None]

    def f(y):
        return cubic(y).sum(-1)

    kwargs = {} if method == "exact" else {"samples": 6}
    results = []
    for layout in (x, x.contiguous()):
        torch.manual_seed(1)
        results.append(pyhvp.hessian_diagonal(f, layout, event_dims=2, method=method, **kwargs))
    torch.testing.assert_close(*results)
