"""Specification of degenerate and unusual inputs, the same on every operator and every path:
constant functions, inference mode, outputs that are not real floating tensors, unused
parameters, half precision, functions that compute in another dtype than x's."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from dense import (
    dense_sub_hessian,
    instance_hessian_diagonal,
    instance_hvp,
    instance_jacobian,
    instance_laplacian,
)
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


def test_an_inference_tensor_arg_enters_f_over_parameters_that_require_grad(device):
    """The Taylor engine records ``f`` with autograd on: an inference-tensor arg multiplied by a
    parameter's output raised torch's "Inference tensors cannot be saved for backward" (the
    HVP kernels clone such inputs; the record now does too)."""
    net = nn.Linear(3, 3).double().to(device)

    def f(x, a):
        return (torch.tanh(net(x)) * a).sum(-1)

    x, a = torch.randn(2, 4, 3, dtype=torch.float64, device=device)
    with torch.inference_mode():
        inside = pyhvp.hessian_diagonal(f, x.clone(), a.clone())
    torch.testing.assert_close(inside, instance_hessian_diagonal(f, x, a))


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


META_CALLS = {
    **{name: call for name, (call, _) in OPERATORS.items()},
    "laplacian": lambda f, x, backend: pyhvp.laplacian(f, x, backend=backend),
}


@pytest.mark.parametrize("call", META_CALLS.values(), ids=META_CALLS.keys())
def test_x_on_the_meta_device_is_refused_naming_it(call):
    """A meta tensor has shapes but no values: refused by name (an internal ``.item()`` error
    before)."""
    with pytest.raises(ValueError, match=r"^(x|params) must hold values.*meta device"):
        call(cubic, torch.randn(4, 3, device="meta"), "torch")


def test_a_sub_hessian_index_on_the_meta_device_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"^index must hold values.*meta device"):
        pyhvp.sub_hessian(lambda p: cubic(p).sum(), torch.randn(4, 3),
                          torch.tensor([0, 4], device="meta"))  # fmt: skip


SPARSE_CALLS = {
    **META_CALLS,
    "grad_and_hvp": lambda f, x, backend: pyhvp.hvp(f, x, x, backend=backend),
    "check_instances": lambda f, x, backend: pyhvp.check_instances(f, x),
    "KroneckerHVP": lambda f, x, backend: pyhvp.KroneckerHVP().update(x),
}
F_CALLS = [name for name in SPARSE_CALLS if name != "KroneckerHVP"]  # those that call f


@pytest.mark.parametrize("call", SPARSE_CALLS.values(), ids=SPARSE_CALLS.keys())
def test_a_sparse_x_is_refused_naming_it(call):
    """Before: an error from deep in torch, different per operator (``aten::as_strided`` has no
    sparse kernel, ``reshape is not implemented for sparse tensors``, ``aten::amax``)."""
    with pytest.raises(TypeError, match=r"^(x|params|grad) must be a dense \(strided\) tensor"):
        call(cubic, torch.randn(4, 3).to_sparse(), "torch")


@pytest.mark.parametrize("call", [SPARSE_CALLS[name] for name in F_CALLS], ids=F_CALLS)
def test_an_output_on_the_meta_device_is_refused_naming_f(call):
    """An output without values (a module left on the meta device): before, torch's "Cannot
    copy out of meta tensor" or ".item() cannot be called on meta tensors", per operator."""
    with pytest.raises(ValueError, match=r"^(f|loss) must return a tensor that holds values"):
        call(lambda x: cubic(x).to("meta"), torch.randn(4, 3), "torch")


@pytest.mark.parametrize("call", SPARSE_CALLS.values(), ids=SPARSE_CALLS.keys())
def test_a_nested_x_is_refused_naming_it(call):
    """Until 2026-12-07: torch's "Internal error: NestedTensorImpl doesn't support sizes"."""
    with warnings.catch_warnings():  # (nested tensors are a prototype: torch warns so)
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])
    with pytest.raises(TypeError, match=r"^(x|params|grad) must be a regular tensor, got a nested"):
        call(cubic, nested, "torch")


BATCHED_CALLS = {name: call for name, call in SPARSE_CALLS.items()
                 if name not in ("sub_hessian", "KroneckerHVP")}  # fmt: skip
"""The operators whose x is a batch of instances (a sub-Hessian's params may be one scalar)."""


@pytest.mark.parametrize("call", BATCHED_CALLS.values(), ids=BATCHED_CALLS.keys())
def test_a_0_d_x_is_refused_saying_it_needs_an_instance_dimension(call):
    """Before: "event_dims must be between 1 and x.ndim=0"."""
    with pytest.raises(ValueError, match=r"^x must have at least one dimension.*x\[None\]"):
        call(cubic, torch.tensor(2.0), "torch")


TRACES = {name: call for name, call in BATCHED_CALLS.items() if name != "grad_and_hvp"}
"""The operators that sum or compare over an instance's variables (an HVP of none is empty)."""


@pytest.mark.parametrize("call", TRACES.values(), ids=TRACES.keys())
def test_instances_without_variables_are_refused_by_name(call):
    """check_instances raised amax's "Expected reduction dim -1 to have non-zero size"."""
    with pytest.raises(ValueError, match=r"^x must have at least one variable per instance"):
        call(cubic, torch.randn(3, 0), "torch")


def frozen_first_layer():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    net[0].requires_grad_(False)
    return net


@pytest.mark.parametrize("method", ["auto", "sparse", "forward", "reverse"])
def test_an_empty_tensor_entering_a_contraction_has_an_empty_block(method, device):
    """``F.linear`` of a ``(0, 3)`` weight has an output with an empty dim: its block is
    ``(0, 0)`` and the other tensor's is its dense one, on every route (the sparse route once
    refused it with ``F.one_hot``'s "Can not infer total number of classes")."""
    x = torch.randn(5, 3, dtype=torch.float64, device=device)
    params = {"w": torch.randn(3, 3, dtype=torch.float64, device=device),
              "empty": torch.zeros(0, 3, dtype=torch.float64, device=device)}  # fmt: skip
    index = {"w": torch.tensor([4, 0], device=device),
             "empty": torch.zeros(0, dtype=torch.int64, device=device)}  # fmt: skip

    def loss(p):
        return torch.tanh(F.linear(x, p["w"])).pow(2).sum() + F.linear(x, p["empty"]).sum()

    result = pyhvp.sub_hessian(loss, params, index, joint=True, method=method)
    torch.testing.assert_close(result, dense_sub_hessian(loss, params, index))


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


@pytest.mark.parametrize("dtype", HALF, ids=[str(d) for d in HALF])
def test_half_precision_runs_the_sketching_estimators_to_its_precision(dtype):
    """Diag++ and Hutch++ orthogonalise a sketch, and torch has no QR in half precision
    (``geqrf``: they raised ``NotImplementedError``): the QR runs in float32. Exact (up to the
    dtype) at 3 n samples, where the sketch spans every direction."""
    x = torch.rand(4, 3, dtype=torch.float64) + 0.5
    diagonal = pyhvp.hessian_diagonal(cubic, x.to(dtype), method="diag++", samples=9)
    laplacian = pyhvp.laplacian(cubic, x.to(dtype), method="hutch++", samples=9)
    expected = instance_hessian_diagonal(cubic, x)
    torch.testing.assert_close(torch.stack([diagonal.double().sum(-1), laplacian.double()]),
                               torch.stack([expected.sum(-1)] * 2), rtol=HALF[dtype], atol=0)  # fmt: skip


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


# a batched function, and a per_instance one (whose vmap over no instance could not select
# instance 0 to scale x by its product until 2026-12-05)
FORMS = {
    "batched": cubic,
    "per_instance": pyhvp.per_instance(lambda x: (x**3).sum() + (x * x.prod()).sum()),
}


@pytest.mark.parametrize("f", FORMS.values(), ids=FORMS.keys())
@pytest.mark.parametrize(("call", "shape"), ESTIMATORS.values(), ids=ESTIMATORS.keys())
def test_an_empty_batch_gives_an_empty_result_on_every_method(call, shape, f, device):
    """Issue 16 item 4: the stochastic methods raised a reshape error on x of shape (0, 3)."""
    result = call(f, torch.randn(0, 3, dtype=torch.float64, device=device))
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


# --- result dtypes: a derivative with respect to x has x's dtype (issue 29) ----------------------

CASTS = {".float()": torch.float32, ".double()": torch.float64, ".half()": torch.float16,
         ".bfloat16()": torch.bfloat16}  # fmt: skip
PRECISION = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 1e-1}


def cubes(y):
    """A diagonal Hessian (6 y): every estimator is exact on it."""
    return (y**3).sum(-1)


# operator -> (the derivatives in x of a scalar-per-instance f, their dense references)
DERIVATIVES = {
    "hvp": (lambda f, x: (pyhvp.hvp(f, x, torch.ones_like(x)),),
            lambda f, x: (instance_hvp(f, x, torch.ones_like(x)),)),
    "grad_and_hvp": (lambda f, x: pyhvp.grad_and_hvp(f, x, torch.ones_like(x)),
                     lambda f, x: (instance_jacobian(f, x), instance_hvp(f, x, torch.ones_like(x)))),
    "hessian_diagonal exact": (lambda f, x: (pyhvp.hessian_diagonal(f, x),),
                               lambda f, x: (instance_hessian_diagonal(f, x),)),
    "hessian_diagonal hutchinson": (
        lambda f, x: (pyhvp.hessian_diagonal(f, x, method="hutchinson", samples=2),),
        lambda f, x: (instance_hessian_diagonal(f, x),)),
    "hessian_diagonal diag++": (
        lambda f, x: (pyhvp.hessian_diagonal(f, x, method="diag++", samples=9),),
        lambda f, x: (instance_hessian_diagonal(f, x),)),
    "hessian_diagonal of per_instance": (
        lambda f, x: (pyhvp.hessian_diagonal(pyhvp.per_instance(f), x),),
        lambda f, x: (instance_hessian_diagonal(f, x),)),
    "laplacian exact": (lambda f, x: (pyhvp.laplacian(f, x),),
                        lambda f, x: (instance_laplacian(f, x),)),
    "laplacian hutchinson": (lambda f, x: (pyhvp.laplacian(f, x, method="hutchinson", samples=2),),
                             lambda f, x: (instance_laplacian(f, x),)),
    "laplacian hutch++": (lambda f, x: (pyhvp.laplacian(f, x, method="hutch++", samples=9),),
                          lambda f, x: (instance_laplacian(f, x),)),
    "grad_and_laplacian": (lambda f, x: pyhvp.grad_and_laplacian(f, x)[1:],
                           lambda f, x: (instance_jacobian(f, x), instance_laplacian(f, x))),
    "sub_hessian": (lambda f, x: (pyhvp.sub_hessian(lambda p: f(p).sum(), x, INDEX),),
                    lambda f, x: (dense_sub_hessian(lambda p: f(p).sum(), x, INDEX),)),
    "sub_hessian of dict params": (
        lambda f, x: tuple(pyhvp.sub_hessian(lambda p: f(p["w"]).sum(), {"w": x},
                                             {"w": INDEX}).values()),
        lambda f, x: (dense_sub_hessian(lambda p: f(p).sum(), x, INDEX),)),
}  # fmt: skip


@pytest.mark.parametrize(("call", "reference"), DERIVATIVES.values(), ids=DERIVATIVES.keys())
@pytest.mark.parametrize("cast", CASTS.values(), ids=CASTS.keys())
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64 x", "float32 x"])
def test_a_derivative_in_x_has_x_s_dtype_whatever_f_computes_in(call, reference, cast, dtype,
                                                                   device):  # fmt: skip
    """As autograd's gradients do: f computing in float32, float16 or bfloat16 gives results to
    that precision, in x's dtype (the Taylor engine returned f's dtype)."""
    x = (torch.rand(4, 3, dtype=torch.float64, device=device) + 0.5).to(dtype)
    results = call(lambda y: cubes(y.to(cast)), x)
    expected = reference(cubes, x.double())
    precision = max(PRECISION[cast], PRECISION[dtype])
    assert [r.dtype for r in results] == [dtype] * len(expected)
    for got, want in zip(results, expected, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=precision, atol=precision)


@pytest.mark.parametrize("cast", CASTS.values(), ids=CASTS.keys())
def test_grad_and_laplacian_s_value_has_f_s_dtype(cast, device):
    """The value is f's, not a derivative: in the dtype f returns."""
    x = torch.rand(4, 3, dtype=torch.float64, device=device) + 0.5
    value, gradient, laplacian = pyhvp.grad_and_laplacian(lambda y: cubes(y.to(cast)), x)
    assert (value.dtype, gradient.dtype, laplacian.dtype) == (cast, x.dtype, x.dtype)


@pytest.mark.parametrize("dtype", CASTS.values(), ids=[str(d) for d in CASTS.values()])
def test_kronecker_hvp_applies_in_v_s_dtype(dtype, device):
    """No f to cast: apply's result has v's dtype, grad's (a v of another dtype is refused)."""
    kron = pyhvp.KroneckerHVP()
    kron.update(torch.randn(2, 3, 4, device=device).to(dtype))
    assert kron.apply(torch.randn(2, 3, 4, device=device).to(dtype)).dtype == dtype


EMPTY_BATCH_MATRIX_OPS = {
    "cholesky": lambda y: (
        torch.linalg.cholesky(y @ y.mT + torch.eye(2, dtype=y.dtype))
        .diagonal(dim1=-2, dim2=-1)
        .log()
        .sum(-1)
    ),
    "eigvalsh": lambda y: (
        torch.linalg.eigvalsh(y @ y.mT + torch.eye(2, dtype=y.dtype)).log().sum(-1)
    ),
    "svdvals": lambda y: torch.linalg.svdvals(y).sum(-1),
}


@pytest.mark.parametrize("f", EMPTY_BATCH_MATRIX_OPS.values(), ids=EMPTY_BATCH_MATRIX_OPS.keys())
@pytest.mark.parametrize("operator", ["laplacian", "hessian_diagonal"])
def test_an_empty_batch_through_the_dense_second_order_fallback_gives_an_empty_result(f, operator):
    """A matrix op without a jet rule over no instances: the fallback's vmap over 0 matrices
    failed ("cannot reshape tensor of 0 elements into shape [0, -1]"), refused as an op autograd
    cannot differentiate, where B = 2 works."""
    x = torch.randn(0, 2, 2, dtype=torch.float64)
    result = getattr(pyhvp, operator)(f, x, event_dims=2)
    assert result.shape == ((0,) if operator == "laplacian" else (0, 2, 2))


def test_a_per_instance_function_undefined_at_zero_says_why_it_ran_over_an_empty_batch():
    """Over no instance, per_instance runs f_single on an instance of zeros for the result's
    shape: a Cholesky there raised "Batch element 0 ... not positive-definite" for an x with no
    batch element, and nothing said where that element came from."""
    f = pyhvp.per_instance(lambda y: torch.linalg.cholesky(y @ y.T).diagonal().log().sum(),
                           event_dims=2)  # fmt: skip
    x = torch.randn(0, 2, 2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="positive-definite") as raised:
        pyhvp.laplacian(f, x, event_dims=2)
    assert any("empty batch" in n and "instance of zeros" in n
               for n in getattr(raised.value, "__notes__", []))  # fmt: skip
