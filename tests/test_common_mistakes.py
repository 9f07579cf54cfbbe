"""Specification of the messages a first day meets: each common mistake is refused (or warned
about) with the fix in the message, as docs/guide/contract.md ("Common mistakes") lists them."""

import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pyhvp


def full_message(error: BaseException) -> str:
    """The message and its notes (a hint on an error of the user's own is added as a note)."""
    return "\n".join([str(error), *getattr(error, "__notes__", ())])


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


X, Y = torch.randn(8, 3), torch.randn(8, 1)
INDEX = {"0.weight": torch.tensor([0, 1])}


def params(model):
    return {name: p.detach() for name, p in model.named_parameters()}


def test_a_network_ending_in_one_output_gets_the_lambda_that_drops_it():
    with pytest.raises(ValueError, match=re.escape("lambda x: net(x)[..., 0]")):
        pyhvp.hvp(net(), X, torch.ones_like(X))


def test_a_module_passed_as_the_loss_of_sub_hessian_is_pointed_to_module_loss():
    model = net()
    with pytest.raises(TypeError, match=re.escape("pyhvp.module_loss(model, criterion, inputs")):
        pyhvp.sub_hessian(model, params(model), INDEX)


def test_a_module_loss_with_inputs_used_with_data_says_to_drop_the_inputs():
    loss, p = pyhvp.module_loss(net(), nn.MSELoss(), X, Y)
    with pytest.raises(TypeError, match=re.escape("call module_loss(model, criterion) without")):
        pyhvp.sub_hessian(loss, p, INDEX, data=[(X, Y)])


def test_a_module_loss_without_inputs_used_without_data_says_to_pass_data():
    loss, p = pyhvp.module_loss(net(), nn.MSELoss())
    with pytest.raises(TypeError, match=re.escape("pass them as data=[(inputs, targets)]")):
        pyhvp.sub_hessian(loss, p, INDEX)


def test_module_loss_refuses_numpy_inputs_by_name():
    with pytest.raises(TypeError, match=re.escape("inputs must be a torch.Tensor, got a numpy")):
        pyhvp.module_loss(net(), nn.MSELoss(), X.numpy(), Y)


def test_module_loss_on_inference_tensors_gives_the_normal_sub_hessian():
    """Inputs made under torch.inference_mode() (a data pipeline's): autograd refused to save
    them for the backward passes ("Inference tensors cannot be saved for backward")."""
    with torch.inference_mode():
        inputs, targets = X.clone(), Y.clone()
    model = net()
    got = pyhvp.sub_hessian(*pyhvp.module_loss(model, nn.MSELoss(), inputs, targets), INDEX)
    expected = pyhvp.sub_hessian(*pyhvp.module_loss(model, nn.MSELoss(), X, Y), INDEX)
    torch.testing.assert_close(got, expected)


def test_module_loss_with_model_and_criterion_swapped_says_the_order():
    with pytest.raises(ValueError, match=re.escape("takes the model first and the criterion")):
        pyhvp.module_loss(nn.MSELoss(), net(), X, Y)


def test_a_loss_calling_a_function_compiled_by_torch_compile_is_told_to_pass_it_uncompiled():
    """autograd cannot differentiate a compiled backward again: the reverse route's second
    pass (which allows unused inputs) would read its second derivatives as zero."""
    head = torch.compile(lambda y: torch.tanh(y).pow(3).sum(), backend="aot_eager")
    W = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"compiled by torch\.compile.*pass it uncompiled"):
        pyhvp.sub_hessian(lambda w: head(X.double() @ w), W, torch.tensor([0, 5]), method="reverse")


SURVEYED = {name: torch.arange(4) for name in ("0.weight", "0.bias", "2.weight")}
"""12 components: surveyed from the first call (INDEX's 2 take the seed's loop)."""


@pytest.mark.parametrize("index", [INDEX, SURVEYED], ids=["the loop", "surveyed"])
def test_a_loss_ignoring_params_for_the_models_own_is_warned_about(index):
    """Every block was zero with no word: a first-day review's loss closed over the model."""
    model = net()
    with pytest.warns(UserWarning, match=re.escape("ignores params: pass pyhvp.module_loss(")):
        blocks = pyhvp.sub_hessian(lambda p: (model(X) - Y).pow(2).sum(), params(model), index)
    assert all(not block.any() for block in blocks.values())


def test_a_batch_of_data_that_uses_no_selected_tensor_is_no_mistake_where_another_does():
    """A review's loss read params['b'] alone on its one-sample batch: the warning, per batch,
    told it to use module_loss."""

    def loss(p, batch):
        return torch.tanh(batch @ p["a"]).pow(2).sum() if len(batch) > 1 else batch.sum()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pyhvp.sub_hessian(loss, {"a": torch.randn(3, 3)}, {"a": torch.arange(2)}, data=[X, X[:1]])


def test_a_loss_linear_in_params_has_zero_blocks_without_a_warning():
    """Zero second derivatives of a loss that reads params are no mistake."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        block = pyhvp.sub_hessian(lambda w: (X @ w).sum(), torch.randn(3, 2), torch.arange(4))
    assert not block.any()


def test_an_index_of_row_col_pairs_is_told_how_to_flatten_them():
    with pytest.raises(ValueError, match=re.escape("row * 4 + col, as np.ravel_multi_index")):
        pyhvp.sub_hessian(lambda p: (p**4).sum(), torch.randn(3, 4), torch.tensor([[0, 1], [2, 3]]))


def test_nothing_selected_gives_an_empty_block_as_no_batches_give_zeros():
    """One rule for both: an empty selection or an empty data set is not an error."""
    loss = lambda p, batch: (p**4).sum() * batch  # noqa: E731
    w = torch.randn(3, 4)
    empty = pyhvp.sub_hessian(loss, w, torch.tensor([], dtype=torch.long), data=[1.0])
    no_batches = pyhvp.sub_hessian(loss, w, torch.tensor([0, 5]), data=[])
    assert empty.shape == (0, 0) and torch.equal(no_batches, torch.zeros(2, 2))


def test_numpy_inside_f_is_told_to_use_torch_functions():
    with pytest.raises(RuntimeError, match="Can't call numpy") as info:
        pyhvp.hvp(lambda x: torch.as_tensor(np.sin(x.numpy())).sum(-1), X, X)
    assert "write f with torch functions on x (torch.sin, not np.sin)" in full_message(info.value)


def test_an_op_whose_backward_torch_cannot_differentiate_is_told_the_way_out():
    """An embedding bag's backward has no derivative in torch (torch.cdist's had none before
    2.14): the HVPs raised torch's bare message."""
    table = torch.randn(7, 4, dtype=torch.float64)
    tokens = torch.tensor([[0, 3], [1, 2], [6, 5], [4, 4], [2, 0], [5, 1], [3, 6]])

    def f(x):
        return F.embedding_bag(tokens, x, mode="sum").tanh().pow(2).sum(-1)

    with pytest.raises(NotImplementedError, match="_embedding_bag_backward") as info:
        pyhvp.hvp(f, table, table)
    assert "use the Taylor-engine operators (hessian_diagonal" in full_message(info.value)


def test_f_returning_a_numpy_array_is_told_to_use_torch_functions():
    with pytest.raises(TypeError, match=re.escape("got ndarray: pyhvp differentiates f")):
        pyhvp.laplacian(lambda x: np.ones(len(x)), X)


CENTRE = np.linspace(-1.0, 1.0, 3, dtype=np.float32)
"""A NumPy array, as loaded from a file."""

OPERATORS_ON_F = {
    "hvp": lambda f, *args: pyhvp.hvp(f, X, torch.ones_like(X), *args),
    "laplacian": lambda f, *args: pyhvp.laplacian(f, X, *args),
    "hessian_diagonal": lambda f, *args: pyhvp.hessian_diagonal(f, X, *args),
    "bilaplacian": lambda f, *args: pyhvp.bilaplacian(f, X, *args),
    "directional_derivatives": lambda f, *args: pyhvp.directional_derivatives(
        f, X, torch.ones(3), *args, order=2),
    "differential_operator": lambda f, *args: pyhvp.differential_operator(
        f, X, {(0, 0): 1.0}, *args),
}  # fmt: skip


def test_the_backend_class_itself_is_told_to_pass_an_instance():
    """``backend=pyhvp.TorchBackend`` passed the protocol check (the class has the methods),
    failed on a missing argument, and was then accepted as any class."""
    with pytest.raises(TypeError, match=re.escape("pass an instance, TorchBackend()")):
        pyhvp.hvp(lambda x: (x**3).sum(-1), X, torch.ones_like(X), backend=pyhvp.TorchBackend)


def test_numpy_integers_count_as_ints():
    """``order=np.int64(2)`` (from an array of settings) was refused: "order must be an int >= 1,
    got np.int64(2)"; so were samples, event_dims and chunk_size."""

    def cube(x):
        return (x**3).sum(-1)

    ones, two = torch.ones(3), np.int64(2)
    got = (
        pyhvp.directional_derivatives(cube, X, ones, order=two)[2],
        pyhvp.hvp(cube, X, torch.ones_like(X), event_dims=np.int64(1), chunk_size=two),
        pyhvp.laplacian(cube, X, method="hutchinson", samples=np.int32(3)).shape,
    )
    expected = (pyhvp.directional_derivatives(cube, X, ones, order=2)[2], 6 * X, (8,))
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("call", OPERATORS_ON_F.values(), ids=OPERATORS_ON_F.keys())
def test_a_numpy_array_among_the_args_is_refused_by_name(call):
    """``x - centre`` with a NumPy centre is NumPy's subtraction, whose result torch never saw
    made: the Taylor operators returned zeros, and hvp blamed f for calling NumPy."""
    with pytest.raises(TypeError, match=re.escape("args[0] must be a torch.Tensor, got a numpy")):
        call(lambda x, centre: ((x - centre) ** 4).sum(-1), CENTRE)


TO_NUMPY_IN_F = {
    "x - a captured array": lambda x: ((x - CENTRE) ** 4).sum(-1),
    "np.sin(x)": lambda x: torch.as_tensor(np.sin(x)).pow(4).sum(-1),
    "x.numpy()": lambda x: torch.as_tensor(x.numpy() ** 4).sum(-1),
}


@pytest.mark.parametrize("f", TO_NUMPY_IN_F.values(), ids=TO_NUMPY_IN_F.keys())
@pytest.mark.parametrize("operator", list(OPERATORS_ON_F)[1:])
def test_f_converting_x_to_numpy_is_refused_by_the_taylor_operators(operator, f):
    """NumPy computes on x's values, and the recorder saw no op of it: the Laplacian of
    ``((x - centre) ** 4).sum(-1)`` was zeros."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (NumPy 2's on torch's __array_wrap__)
        with pytest.raises(TypeError, match="f converts a tensor that depends on x to NumPy"):
            OPERATORS_ON_F[operator](f)


def test_numpy_of_an_outer_operators_x_inside_a_nested_one_is_refused():
    """To the inner record, the outer record's x looks like a constant: zeros (12 expected)."""

    def outer(y):
        return pyhvp.laplacian(lambda z: (z**2 * torch.as_tensor(np.square(y))).sum(-1), y)

    with pytest.raises(TypeError, match="f converts a tensor that depends on x to NumPy"):
        pyhvp.laplacian(outer, X)


def test_f_converting_a_captured_tensor_to_numpy_is_differentiated():
    """A constant's NumPy value is a constant: no refusal."""
    weight = torch.tensor([1.0, 2.0, 3.0])
    got = pyhvp.laplacian(lambda x: (x**2).sum(-1) * float(np.abs(weight.numpy()).sum()), X)
    torch.testing.assert_close(got, torch.full((8,), 36.0))


def uneven(reduction):
    loss, p = pyhvp.module_loss(net(), nn.MSELoss(reduction=reduction))
    return loss, p, [(X[:5], Y[:5]), (X[5:], Y[5:])]


def test_a_mean_loss_over_batches_of_different_sizes_is_warned_once():
    loss, p, data = uneven("mean")
    with pytest.warns(UserWarning, match=re.escape("Use reduction='sum'")) as record:
        pyhvp.sub_hessian(loss, p, INDEX, data=data + data)
    assert len(record) == 1
    assert record[0].filename == __file__  # the user's call, not torch's compiler.disable wrapper


@pytest.mark.parametrize("reduction", ["sum", "mean"], ids=["sum, uneven", "mean, even"])
def test_a_sum_loss_or_batches_of_one_size_are_not_warned(reduction):
    loss, p, data = uneven(reduction)
    if reduction == "mean":
        data = [data[0], data[0]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pyhvp.sub_hessian(loss, p, INDEX, data=data)


def test_f_writing_to_x_is_told_to_write_to_a_copy_by_every_operator():
    """The Taylor engine and the HVP kernels refuse alike (the HVPs with autograd's "leaf
    Variable" message until 2026-12-04, about an x that did not require grad)."""

    def f(x):
        x.mul_(2.0)
        return torch.sin(x).pow(3).sum(-1)

    x = torch.randn(4, 3)
    for call in (lambda: pyhvp.laplacian(f, x), lambda: pyhvp.hvp(f, x, x),
                 lambda: pyhvp.laplacian(f, x, method="hutch++", samples=3)):  # fmt: skip
        with pytest.raises(pyhvp.InPlaceInputError, match=r"x\.clone\(\)"):
            call()


def writes_to_x(x):
    x.mul_(2.0)
    return x.pow(3).sum(-1)


X_THAT_REQUIRE_GRAD = {
    "a leaf": lambda: torch.randn(4, 3, requires_grad=True),
    "computed from a leaf": lambda: torch.randn(4, 3, requires_grad=True) * 1.0,
}
OPERATORS_ON_HVPS = {
    "hvp": lambda f, x: pyhvp.hvp(f, x, torch.ones(4, 3)),
    "grad_and_hvp": lambda f, x: pyhvp.grad_and_hvp(f, x, torch.ones(4, 3)),
    "hessian_diagonal hutchinson": lambda f, x: pyhvp.hessian_diagonal(
        f, x, method="hutchinson", samples=2
    ),
    "hessian_diagonal diag++": lambda f, x: pyhvp.hessian_diagonal(
        f, x, method="diag++", samples=3
    ),
    "laplacian hutch++": lambda f, x: pyhvp.laplacian(f, x, method="hutch++", samples=3),
}


@pytest.mark.parametrize("make_x", X_THAT_REQUIRE_GRAD.values(), ids=X_THAT_REQUIRE_GRAD.keys())
@pytest.mark.parametrize("call", OPERATORS_ON_HVPS.values(), ids=OPERATORS_ON_HVPS.keys())
def test_f_writing_to_an_x_that_requires_grad_is_refused_and_x_left_unchanged(make_x, call):
    """As for an x that does not require grad (until 2026-12-05 an x computed from a leaf was
    written to, and its HVPs were those of the written value: a quarter of the true ones)."""
    x = make_x()
    before = x.detach().clone()
    with pytest.raises(pyhvp.InPlaceInputError, match=r"x\.clone\(\)"):
        call(writes_to_x, x)
    assert torch.equal(x.detach(), before)


@pytest.mark.parametrize("call", OPERATORS_ON_HVPS.values(), ids=OPERATORS_ON_HVPS.keys())
def test_weights_made_in_inference_mode_and_captured_by_f_are_named_with_the_fix(call):
    """torch's "Inference tensors cannot be saved for backward" said nothing of f."""
    with torch.inference_mode():
        weight = torch.randn(2, 3)
    with pytest.raises(RuntimeError, match="Inference tensors") as raised:
        call(lambda z: torch.tanh(z @ weight.T).pow(2).sum(-1), torch.randn(4, 3))
    said = [str(raised.value), *getattr(raised.value, "__notes__", ())]  # (3.10: in the message)
    assert any("clone it outside inference mode" in text for text in said)


def writes_to_x_without_grad(x):
    with torch.no_grad():
        x.mul_(2.0)  # a projection step, say: autograd allows it
    return x.pow(3).sum(-1)


def writes_to_x_data(x):
    x.data.mul_(2.0)  # a projection step through .data, which moves no version counter
    return x.pow(3).sum(-1)


WRITES_AUTOGRAD_ALLOWS = {
    "under no_grad": writes_to_x_without_grad,
    "through x.data (until 2026-12-06: HVPs at the written x, no error)": writes_to_x_data,
}
X_OF_EVERY_KIND = {
    "x": lambda: torch.randn(4, 3),
    "x that requires grad": lambda: torch.randn(4, 3, requires_grad=True),
    "a transposed view": lambda: torch.randn(3, 4).t(),
    "a slice of a larger tensor": lambda: torch.randn(4, 6)[:, :3],
}


@pytest.mark.parametrize("make_x", X_OF_EVERY_KIND.values(), ids=X_OF_EVERY_KIND.keys())
@pytest.mark.parametrize("call", OPERATORS_ON_HVPS.values(), ids=OPERATORS_ON_HVPS.keys())
@pytest.mark.parametrize("f", WRITES_AUTOGRAD_ALLOWS.values(), ids=WRITES_AUTOGRAD_ALLOWS.keys())
def test_f_writing_to_x_where_autograd_allows_it_is_refused_by_the_hvps(f, call, make_x):
    """Autograd allows the write, so it was the caller's x that doubled on every call, and the
    HVPs were those of the written value (or torch's error about an unbind view, for an x that
    requires grad; for a view, until 2026-12-06, with no error at all). The write cannot be
    refused before it happens there: the message says that x holds the written values."""
    with pytest.raises(pyhvp.InPlaceInputError, match="x now holds the written values"):
        call(f, make_x())


@pytest.mark.parametrize("call", OPERATORS_ON_HVPS.values(), ids=OPERATORS_ON_HVPS.keys())
@pytest.mark.parametrize("f", WRITES_AUTOGRAD_ALLOWS.values(), ids=WRITES_AUTOGRAD_ALLOWS.keys())
def test_f_writing_to_an_inference_tensor_x_is_refused_by_the_hvps(f, call):
    """The kernels run on a copy of an inference tensor (autograd cannot save one), which f
    wrote unwatched until 2026-12-06: the HVPs of the written x, twice the true ones here, and
    Diag++'s rounds each on a further write, with no error."""
    with torch.inference_mode():
        x = torch.randn(4, 3)
        with pytest.raises(pyhvp.InPlaceInputError, match="x now holds the written values"):
            call(f, x)


OPERATORS_ON_X = {
    "hvp": lambda f, x: pyhvp.hvp(f, x, torch.ones_like(x)),
    "grad_and_hvp": lambda f, x: pyhvp.grad_and_hvp(f, x, torch.ones_like(x)),
    "laplacian": lambda f, x: pyhvp.laplacian(f, x),
    "hessian_diagonal": lambda f, x: pyhvp.hessian_diagonal(f, x),
    "bilaplacian": lambda f, x: pyhvp.bilaplacian(f, x),
    "directional_derivatives": lambda f, x: pyhvp.directional_derivatives(
        f, x, torch.ones(3), order=2),
    "differential_operator": lambda f, x: pyhvp.differential_operator(f, x, {(0, 0): 1.0}),
}  # fmt: skip


@pytest.mark.parametrize("call", OPERATORS_ON_X.values(), ids=OPERATORS_ON_X.keys())
def test_f_writing_to_x_under_no_grad_inside_vmap_is_refused(call):
    """Under vmap x is a wrapper, whose own version counter never moves: until 2026-12-07 the
    write went unseen, and every result was that of the written x (the Laplacian twice the
    true one here)."""
    with pytest.raises(pyhvp.InPlaceInputError, match="f modifies x in place"):
        torch.func.vmap(lambda x: call(writes_to_x_without_grad, x))(torch.randn(2, 4, 3))


def test_a_write_to_another_view_of_xs_base_is_no_write_to_x():
    """Views share their base's version counter: a write to another row of the base refused
    an f that never wrote x."""
    base = torch.randn(2, 4, 3)
    x = base[0]

    def f(y):
        with torch.no_grad():
            base[1].mul_(2.0)
        return y.pow(3).sum(-1)

    torch.testing.assert_close(pyhvp.hvp(f, x, torch.ones_like(x)), 6 * x)


BESIDE_X = {  # columns of a (4, 6) buffer that f writes, x being its first 3: whether x's
    "a state beside x": (slice(3, 6), False),
    "columns across x's last one": (slice(2, 5), True),
}


@pytest.mark.parametrize("columns, hits_x", BESIDE_X.values(), ids=BESIDE_X.keys())
def test_the_taylor_engine_refuses_a_write_to_xs_buffer_where_it_hits_x_only(columns, hits_x):
    """x and a state kept beside it in one buffer: a write to the state was refused as one to
    "x (through a view of it)" (any write to x's storage was), where the HVPs computed f."""
    buffer = torch.randn(4, 6, dtype=torch.float64)
    x = buffer[:, :3]

    def f(y):
        buffer[:, columns].mul_(1.0)
        return (y**3).sum(-1)

    if hits_x:
        with pytest.raises(pyhvp.InPlaceInputError, match="through a view of it"):
            pyhvp.hessian_diagonal(f, x)
    else:
        torch.testing.assert_close(pyhvp.hessian_diagonal(f, x), 6 * x)


@pytest.mark.parametrize(
    "f",
    [writes_to_x, writes_to_x_without_grad, writes_to_x_data],
    ids=["f", "f, no_grad", "f, x.data"],
)
def test_check_instances_refuses_f_writing_to_x_and_leaves_x_unchanged(f):
    """It said autograd's 'a leaf Variable that requires grad' about an x that did not require
    grad, and under no_grad it wrote the caller's x three times; through x.data (no version
    counter moves), until 2026-12-06, its runs each doubled x and it named a coupling."""
    x = torch.randn(4, 3)
    before = x.clone()
    with pytest.raises(pyhvp.InPlaceInputError, match=r"x\.clone\(\)"):
        pyhvp.check_instances(f, x)
    assert torch.equal(x, before)


def test_f_writing_to_a_parameter_gets_autograds_own_error_not_told_to_copy_x():
    weight = torch.ones(3, requires_grad=True)

    def f(x):
        weight.mul_(2.0)
        return (x * weight).sin().sum(-1)

    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad") as raised:
        pyhvp.hvp(f, torch.randn(4, 3), torch.randn(4, 3))
    assert not isinstance(raised.value, pyhvp.InPlaceInputError)


@pytest.mark.parametrize(
    "call, option",
    [
        (lambda f, x: pyhvp.hessian_diagonal(f, x, "hutchinson"), "method='hutchinson'"),
        (lambda f, x: pyhvp.laplacian(f, x, "hutch++"), "method='hutch++'"),
        (lambda f, x: pyhvp.hvp(f, x, x, "julia"), "backend='julia'"),
    ],
)
def test_an_option_passed_positionally_is_named_in_fs_error(call, option):
    """hessian_diagonal(f, x, "hutchinson") put the string into *args, and f's own TypeError
    ("takes 1 positional argument but 2 were given") did not say why."""
    x = torch.randn(4, 3)
    with pytest.raises(TypeError, match="positional argument") as raised:
        call(lambda y: (y**3).sum(-1), x)
    assert any(option in n and "keyword-only" in n for n in getattr(raised.value, "__notes__", []))


PER_INSTANCE_CALLS = {
    "hvp": lambda f, x, *args: pyhvp.hvp(f, x, torch.ones_like(x), *args),
    "laplacian": lambda f, x, *args: pyhvp.laplacian(f, x, *args),
    "hessian_diagonal": lambda f, x, *args: pyhvp.hessian_diagonal(f, x, *args),
    "check_instances": lambda f, x, *args: pyhvp.check_instances(f, x, *args),
}


@pytest.mark.parametrize("call", PER_INSTANCE_CALLS.values(), ids=PER_INSTANCE_CALLS.keys())
def test_a_per_instance_scale_of_shape_batch_is_told_arg_event_dims_0(call, device):
    """A scale of shape (B,) for a per_instance f went whole to every instance (its last
    event_dims=1 dims are one instance's), and f_single's shape error from ``scale * y`` said
    nothing of arg_event_dims."""
    f = pyhvp.per_instance(lambda y, scale: torch.sin(scale * y).prod())
    x, scale = torch.randn(4, 3, device=device), torch.randn(4, device=device)
    with pytest.raises(RuntimeError, match="must match the size") as raised:
        call(f, x, scale)
    assert "give it arg_event_dims=0" in full_message(raised.value)


@pytest.mark.parametrize("grad", [False, True], ids=["hvp", "grad_and_hvp"])
def test_a_per_instance_scale_that_broadcasts_into_each_output_is_told_arg_event_dims_0(grad):
    """``scale * (y**2).sum()`` with a (B,) scale ran without error inside f_single, each
    instance returning B values: the HVP's "f must return shape (4,) ..., got (4, 4)" said
    nothing of the scale (a first-day review)."""
    f = pyhvp.per_instance(lambda y, scale: scale * (y**2).sum())
    x, scale = torch.randn(4, 3), torch.randn(4)
    op = pyhvp.grad_and_hvp if grad else pyhvp.hvp
    with pytest.raises(ValueError, match=re.escape("got (4, 4)")) as raised:
        op(f, x, torch.ones_like(x), scale)
    assert "args[0] of shape (4,) went whole to every instance" in full_message(raised.value)


AMBIGUOUS_ARGS = {  # B == N: each arg's shape reads both ways; (f_single, arg, read as)
    "a per-instance scale (B,), read as shared": (
        lambda y, scale: (scale * y**3).sum(), torch.tensor([1.0, 2.0, 3.0]), "shared"),
    "a shared matrix (N, N), read per instance": (
        lambda y, m: torch.tanh(y @ m).pow(2).sum(), torch.eye(3) + 0.5, "per instance"),
}  # fmt: skip


@pytest.mark.parametrize("call", PER_INSTANCE_CALLS.values(), ids=PER_INSTANCE_CALLS.keys())
@pytest.mark.parametrize("case", AMBIGUOUS_ARGS.values(), ids=AMBIGUOUS_ARGS.keys())
def test_an_arg_whose_shape_reads_both_ways_when_b_equals_n_is_warned_of(case, call):
    """With as many instances as variables each, nothing breaks either way: until 2026-12-07
    the default arg_event_dims chose without a word (a shared matrix read as one row per
    instance gave a diagonal 7 off in 1.9). The warning says which reading was taken and
    names both values of arg_event_dims."""
    f_single, arg, read = case
    with pytest.warns(UserWarning, match="cannot tell one entry per instance") as caught:
        call(pyhvp.per_instance(f_single), torch.randn(3, 3), arg)
    said = str(caught[0].message)
    assert ("as one entry per instance" in said) == (read == "per instance")


@pytest.mark.parametrize("arg_event_dims", [0, 1, 2])
def test_an_arg_event_dims_given_silences_the_ambiguity_warning(arg_event_dims):
    """Either reading, asked for by name, is the user's choice: nothing to warn of."""
    f = pyhvp.per_instance(lambda y, m: (m * y).sum(), arg_event_dims=arg_event_dims)
    arg = torch.ones((3,) * max(arg_event_dims, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pyhvp.hvp(f, torch.randn(3, 3), torch.ones(3, 3), arg)


def test_a_shared_matrix_refused_for_its_leading_dims_is_told_arg_event_dims():
    """B != N: the refusal said the leading dims must broadcast, not how to share the arg."""
    f = pyhvp.per_instance(lambda y, m: torch.tanh(y @ m).pow(2).sum())
    with pytest.raises(ValueError, match="for one tensor that every instance shares, give it "
                       "arg_event_dims=2"):  # fmt: skip
        pyhvp.hvp(f, torch.randn(4, 3), torch.ones(4, 3), torch.randn(3, 3))


WHAT_VMAP_CANNOT_RUN = {
    "NumPy": lambda y: torch.tensor(np.sum(y.numpy() ** 2)),
    ".item()": lambda y: (y**2).sum() * y.max().item(),
    "a branch on a value": lambda y: (y**2).sum() if y.sum() > 0 else y.sum(),
    "a boolean mask": lambda y: (y[y > 0] ** 2).sum(),
}


@pytest.mark.parametrize("call", PER_INSTANCE_CALLS.values(), ids=PER_INSTANCE_CALLS.keys())
@pytest.mark.parametrize("f_single", WHAT_VMAP_CANNOT_RUN.values(),
                         ids=WHAT_VMAP_CANNOT_RUN.keys())  # fmt: skip
def test_what_vmap_cannot_run_in_f_single_is_said_with_per_instance(f_single, call):
    """vmap's own refusal named vmap, which the user never called (NumPy's: "Cannot access
    data pointer of Tensor that doesn't have storage"), and nothing of per_instance."""
    with pytest.raises(RuntimeError) as raised:
        call(pyhvp.per_instance(f_single), torch.randn(3, 4, dtype=torch.float64))
    assert "per_instance runs f_single under torch.func.vmap" in full_message(raised.value)


@pytest.mark.parametrize("call", PER_INSTANCE_CALLS.values(), ids=PER_INSTANCE_CALLS.keys())
def test_a_module_class_for_f_is_told_to_pass_an_instance(call):
    """``nn.Tanh`` for ``nn.Tanh()``: "Tanh.__init__() takes 1 positional argument but 2 were
    given", naming no argument (a first-day review)."""
    with pytest.raises(TypeError, match=re.escape("got the class Tanh itself: pass an instance")):
        call(nn.Tanh, torch.randn(4, 3))


@pytest.mark.parametrize("call", PER_INSTANCE_CALLS.values(), ids=PER_INSTANCE_CALLS.keys())
def test_walkers_with_the_default_event_dims_are_told_to_raise_it(call, device):
    """A log-psi of walkers (W, N, 3) summed over (N, 3), called without event_dims=2, was
    refused with 'f must return ... batch_shape = (5, 4) ..., got (5,)', which did not say that
    the instances were too small."""
    walkers = torch.randn(5, 4, 3, device=device)
    with pytest.raises(ValueError, match=re.escape("raise event_dims by 1 (event_dims=2")):
        call(lambda x: -(x**2).sum((-1, -2)), walkers)
