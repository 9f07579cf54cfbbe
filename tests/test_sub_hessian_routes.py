"""Specification of sub_hessian's two routes (sparse injection and reverse HVPs) and of the cost
model that splits the selected tensors between them: every split equals dense float64 references,
and the choice is observable on the ``pyhvp.sub_hessian`` logger (never inferred from timing).
The injections op by op are ``test_sub_hessian_sparse_ops``'s."""

import contextlib
import copy
import itertools
import logging
import warnings
from dataclasses import dataclass
from itertools import accumulate

import pytest
import torch
import torch.nn.functional as F
from dense import dense_sub_hessian, loop_sub_hessians
from torch import nn
from torch.overrides import _get_current_function_mode_stack

import pyhvp
from pyhvp import submatrix
from pyhvp.restricted.routes import Routes
from pyhvp.restricted.trial import CONFIRM_AFTER, LOOP_FALLBACK, TIMED_RUNS, Trial

ROUTES = ("sparse", "reverse", "auto")
F64 = {"rtol": 1e-9, "atol": 1e-11}


def mlp():
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def deep_mlp():
    return nn.Sequential(
        nn.Flatten(), nn.Linear(6, 5), nn.Softplus(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)
    )


@dataclass
class Case:
    name: str
    model: object
    input_shape: tuple
    index: dict
    chunk_size: int | None = None

    def make(self):
        torch.manual_seed(3)
        model = self.model().double()
        inputs = torch.rand(self.input_shape, dtype=torch.float64)
        targets = torch.randint(0, 3, self.input_shape[:1])
        index = {name: torch.tensor(i) for name, i in self.index.items()}
        loss, params = pyhvp.module_loss(model, nn.CrossEntropyLoss(), inputs, targets)
        return loss, params, index


CASES = [
    Case(
        "MLP, every tensor",
        mlp,
        (8, 5),
        {"0.weight": [3, 0, 19], "0.bias": [1], "2.weight": [11, 2], "2.bias": [0, 2]},
    ),
    Case(
        "MLP, unsorted with repeats",
        mlp,
        (8, 5),
        {"0.weight": [7, 7, 2, 19, 0], "2.weight": [11, 0, 11]},
    ),
    Case(
        "MLP, weights only, chunked by 2",
        mlp,
        (8, 5),
        {"2.weight": [0, 5, 6, 11], "0.weight": [1, 4]},
        chunk_size=2,
    ),
    Case(
        "3 linear layers, every tensor",
        deep_mlp,
        (7, 2, 3),
        {
            "1.weight": [29, 0, 13],
            "1.bias": [4],
            "3.weight": [0, 19, 7],
            "3.bias": [3, 1],
            "5.weight": [11, 5],
            "5.bias": [2],
        },
    ),
]


def routes_taken(caplog):
    """Per logged batch: "sparse" (every tensor), "reverse" (every tensor) or "mixed"."""
    taken = []
    for record in caplog.records:
        if record.name != "pyhvp.sub_hessian" or hasattr(record, "settled"):
            continue
        sparse, reverse = getattr(record, "sparse", []), getattr(record, "reverse", ["all"])
        if getattr(record, "forward", None):
            taken.append("forward")
            continue
        taken.append("mixed" if sparse and reverse else "sparse" if sparse else "reverse")
    return taken


def reverse_tensors(caplog):
    """Per logged batch, the tensors the reverse route took, as the log names them."""
    return [set(record.reverse) for record in caplog.records if hasattr(record, "reverse")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("method", ROUTES)
def test_joint_and_blocks_equal_the_dense_sub_hessian(case, method, caplog):
    loss, params, index = case.make()
    expected = dense_sub_hessian(loss, params, index)
    with caplog.at_level(logging.DEBUG, "pyhvp.sub_hessian"):
        joint = pyhvp.sub_hessian(
            loss, params, index, joint=True, method=method, chunk_size=case.chunk_size
        )
        blocks = pyhvp.sub_hessian(loss, params, index, method=method, chunk_size=case.chunk_size)
    torch.testing.assert_close(joint, expected, **F64)
    start = 0
    for name, flat in index.items():
        part = expected[start : start + len(flat), start : start + len(flat)]
        torch.testing.assert_close(blocks[name], part, **F64)
        start += len(flat)
    few = sum(len(flat) for flat in index.values()) < pyhvp.restricted.routes.MIN_COMPONENTS
    if method != "auto" or few:  # else the cost model's choice
        route = "reverse" if method == "reverse" or (method == "auto" and few) else "sparse"
        assert routes_taken(caplog) == [route] * 2


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_compiled_sparse_kernel_equals_the_dense_sub_hessian(case, compiled):
    """Compiled from the first call; its first result is checked against eager's, so a
    warning-free call returned the compiled kernel's own result, as do later calls."""
    if not pyhvp.restricted.compiles():  # (its probe compiles before the count starts)
        pytest.skip("this torch's dynamo drops the mode; tested by the next spec")
    compiled.clear()
    loss, params, index = case.make()
    backend = pyhvp.TorchBackend(compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        calls = [pyhvp.sub_hessian(loss, params, index, joint=True, method="sparse",
                                   chunk_size=case.chunk_size, backend=backend)
                 for _ in range(2)]  # fmt: skip
    assert len(compiled) == 1
    for got in calls:
        torch.testing.assert_close(got, dense_sub_hessian(loss, params, index), **F64)


@pytest.mark.slow
def test_the_compiled_reverse_route_leaves_one_forwards_running_statistics():
    """Compiled, the reverse route runs the loss once per selected tensor (eagerly, once for
    all), and torch.func lets ``instance_norm``'s write of its running statistics through: over
    6 tensors the running mean moved 6 times, with blocks equal to eager's. Such a kernel is
    not kept, and the call leaves one forward's changes, as the seed's loop does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3),
                          nn.InstanceNorm2d(3, affine=True, track_running_stats=True),
                          nn.Tanh(), nn.Flatten(), nn.Linear(12, 3)).double()  # fmt: skip
    inputs, targets = torch.randn(3, 2, 4, 4, dtype=torch.float64), torch.tensor([0, 2, 1])
    once = copy.deepcopy(model)
    with torch.no_grad():
        once(inputs)
    loss, params = pyhvp.module_loss(model, nn.CrossEntropyLoss(), inputs, targets)
    index = {name: torch.tensor([0, 1]) for name in params}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the kernel's refusal)
        pyhvp.sub_hessian(loss, params, index, method="reverse",
                          backend=pyhvp.TorchBackend(compile=True))  # fmt: skip
    torch.testing.assert_close(dict(model.named_buffers()), dict(once.named_buffers()))


def test_where_dynamo_cannot_trace_the_mode_the_sparse_kernel_runs_eagerly(monkeypatch, compiled):
    """Torch 2.5's dynamo traces the loss without the mode (a zero Hessian), 2.6's fails inside
    it: there the kernel is never compiled, and no warning says a compiler failed."""
    monkeypatch.setattr(pyhvp.restricted, "compiles", lambda: False)
    loss, params, index = CASES[0].make()
    backend = pyhvp.TorchBackend(compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = pyhvp.sub_hessian(loss, params, index, joint=True, method="sparse", backend=backend)
    assert compiled == []
    torch.testing.assert_close(got, dense_sub_hessian(loss, params, index), **F64)


@pytest.mark.slow
def test_a_loss_the_sparse_route_refuses_takes_the_reverse_route_when_compiled(caplog):
    backend = pyhvp.TorchBackend(compile=True)
    index = torch.tensor([0, 9, 63, 9, 1, 2, 3, 17])
    with caplog.at_level(logging.DEBUG, "pyhvp.sub_hessian"):
        calls = [pyhvp.sub_hessian(big_cumsum, BIG, index, backend=backend) for _ in range(2)]
    assert routes_taken(caplog) == ["reverse"] * 2
    for got in calls:
        torch.testing.assert_close(got, dense_sub_hessian(big_cumsum, BIG, index), **F64)


def seed_model():
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))


def test_seed_model_by_the_sparse_route_equals_the_seed_loop_in_float64(caplog):
    torch.manual_seed(0)
    model = seed_model().double()
    inputs = torch.rand(100, 1, 28, 28, dtype=torch.float64)
    targets = torch.randint(0, 10, (100,))
    index = {"1.weight": torch.tensor([7839, 5, 784, 0, 5, 3000]), "1.bias": torch.tensor([9, 2])}
    loss, params = pyhvp.module_loss(model, nn.CrossEntropyLoss(), inputs, targets)
    with caplog.at_level(logging.DEBUG, "pyhvp.sub_hessian"):
        blocks = pyhvp.sub_hessian(loss, params, index, method="sparse")
    assert routes_taken(caplog) == ["sparse"]
    expected = loop_sub_hessians(model, nn.CrossEntropyLoss(), inputs, targets, index)
    torch.testing.assert_close(blocks, expected, **F64)


def test_seed_model_sparse_entries_equal_a_dense_hessian_of_the_linear_layer():
    """The seed's Linear(784, 10) at a smaller input size, against the full dense Hessian."""
    torch.manual_seed(1)
    weight, bias = torch.randn(10, 40, dtype=torch.float64), torch.randn(10, dtype=torch.float64)
    inputs, targets = torch.rand(100, 40, dtype=torch.float64), torch.randint(0, 10, (100,))

    def loss(p):
        return F.cross_entropy(F.linear(inputs, p["w"], p["b"]), targets)

    params = {"w": weight, "b": bias}
    index = {"w": torch.randperm(400)[:16], "b": torch.tensor([3, 3, 0])}
    got = pyhvp.sub_hessian(loss, params, index, joint=True, method="sparse")
    torch.testing.assert_close(got, dense_sub_hessian(loss, params, index), **F64)


def batch_loss(p, batch):
    inputs, targets = batch
    hidden = torch.tanh(F.linear(inputs, p["w1"], p["b1"]))
    return F.cross_entropy(F.linear(hidden, p["w2"]), targets, reduction="sum")


def data_set():
    torch.manual_seed(2)
    params = {
        "w1": torch.randn(4, 6, dtype=torch.float64),
        "b1": torch.randn(4, dtype=torch.float64),
        "w2": torch.randn(3, 4, dtype=torch.float64),
    }
    batches = [
        (torch.rand(n, 6, dtype=torch.float64), torch.randint(0, 3, (n,))) for n in (5, 3, 4)
    ]
    index = {"w1": torch.tensor([23, 0, 7]), "b1": torch.tensor([2]), "w2": torch.tensor([1, 11])}
    return params, batches, index


def summed_dense(params, batches, index):
    return sum(dense_sub_hessian(lambda p, b=b: batch_loss(p, b), params, index) for b in batches)


@pytest.mark.parametrize("method", ROUTES)
def test_data_batches_sum_on_every_route(method):
    params, batches, index = data_set()
    got = pyhvp.sub_hessian(batch_loss, params, index, data=batches, joint=True, method=method)
    torch.testing.assert_close(got, summed_dense(params, batches, index), **F64)


BIG = torch.randn(65, 64, dtype=torch.float64)  # 4160 entries: over DENSE_LIMIT
SMALL = torch.randn(8, 8, dtype=torch.float64)
X = torch.rand(5, 64, dtype=torch.float64)
WIDE = torch.rand(400, 60, dtype=torch.float64)
MEDIUM = torch.randn(40, 60, dtype=torch.float64)
MANY = torch.tensor([0, 9, 63, 9, 1, 2, 3, 17, *range(100, 2400, 100)])


def weight_decay(p):
    """A small tensor used twice: as a linear weight and densely; the sparse route still applies."""
    return (torch.tanh(F.linear(X[:, :8], p)) ** 2).sum() + 0.1 * (p**4).sum()


def big_cumsum(p):
    """A big tensor in an op without a sparse rule: refused there."""
    return (torch.tanh(torch.cumsum(p, 0) @ X.T) ** 2).sum()


def seed_like(p):
    """The seed's case: a linear weight whose product (400 x 60 x 40 per direction) dwarfs its
    tail (400 x 40 logits)."""
    return torch.logsumexp(WIDE @ p.T, -1).sum()


def writes_selected(p):
    q = p.clone()
    out = torch.tanh(F.linear(X[:, :8], q)).sum() ** 2
    p.mul_(1.0)  # pragma: no cover -- a write to params: neither route may run it unnoticed
    return out


def relu_in_place(p):
    return torch.tanh(F.linear(X[:, :8], F.relu(p, inplace=True))).sum() ** 2


def hardtanh_in_place_positionally(p):
    return torch.tanh(F.linear(X[:, :8], F.hardtanh(p, -0.5, 0.5, True))).sum() ** 2


WRITERS = {  # a loss writing to its selected tensor with grad on, and what the refusal names
    "an in-place method": (writes_selected, r"Tensor\.mul_"),
    "a functional with inplace=True": (relu_in_place, r"torch\.nn\.functional\.relu"),
    "a functional's inplace flag by position": (
        hardtanh_in_place_positionally,
        r"torch\.nn\.functional\.hardtanh",
    ),
}


@dataclass
class ChoiceCase:
    name: str
    loss: object
    params: torch.Tensor
    route: str


CALLERS_GRAD_MODES = {
    "grad on": contextlib.nullcontext,
    "under no_grad": torch.no_grad,
    "under inference_mode": torch.inference_mode,
}


@pytest.mark.parametrize("grad_mode", CALLERS_GRAD_MODES.values(), ids=CALLERS_GRAD_MODES.keys())
def test_a_big_tensor_in_an_op_without_a_sparse_rule_takes_the_reverse_route(grad_mode, caplog):
    """In any grad mode of the caller: the survey runs the loss with grad on, as the routes
    differentiate it (under no_grad it saw no use at all and chose the sparse route)."""
    index = torch.tensor([0, 9, 63, 9, 1, 2, 3, 17, 4159])
    with caplog.at_level(logging.DEBUG, "pyhvp.sub_hessian"), grad_mode():
        got = pyhvp.sub_hessian(big_cumsum, BIG, index)
    (message,) = [r.getMessage() for r in caplog.records if r.name == "pyhvp.sub_hessian"]
    assert "reverse route for params (enters torch.cumsum, which has no sparse rule" in message
    expected = pyhvp.sub_hessian(big_cumsum, BIG, index, method="reverse")
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_big_product_with_a_small_tail_takes_the_sparse_route(caplog):
    with caplog.at_level(logging.DEBUG, "pyhvp.sub_hessian"):
        got = pyhvp.sub_hessian(seed_like, MEDIUM, MANY)
    assert routes_taken(caplog) == ["sparse"]
    torch.testing.assert_close(got, dense_sub_hessian(seed_like, MEDIUM, MANY), **F64)


def mixed_loss(p):
    """``w`` in an op without a sparse rule, ``v`` the sparse route's case."""
    return big_cumsum(p["w"]) + seed_like(p["v"])


@pytest.mark.parametrize("joint", [False, True])
def test_a_mixed_model_splits_by_tensor(joint, caplog):
    params = {"w": BIG, "v": MEDIUM}
    index = {"w": torch.tensor([0, 9, 4159, 9]), "v": MANY}
    with caplog.at_level(logging.DEBUG, "pyhvp.sub_hessian"):
        got = pyhvp.sub_hessian(mixed_loss, params, index, joint=joint)
    assert reverse_tensors(caplog) == [{"params['w']"}]
    expected = pyhvp.sub_hessian(mixed_loss, params, index, joint=joint, method="reverse")
    torch.testing.assert_close(got, expected, **F64)


def switching_loss(p, batch):
    """``w`` the sparse route's case for a batch whose flag is False; in torch.cumsum (refused)
    where it is True."""
    inputs, dense = batch
    out = torch.logsumexp(F.linear(inputs, p["w"], p["b"]), -1).sum()
    return out + (torch.cumsum(p["w"], 0) ** 2).sum() if dense else out


def test_batches_after_one_the_sparse_route_refuses_take_the_reverse_route(caplog):
    params = {
        "w": torch.randn(70, 60, dtype=torch.float64),
        "b": torch.randn(70, dtype=torch.float64),
    }
    index = {"w": MANY, "b": torch.tensor([3, 0])}
    batches = [(WIDE, False), (WIDE[:300], True), (WIDE[100:], False)]
    with caplog.at_level(logging.DEBUG, "pyhvp.sub_hessian"):
        joint = pyhvp.sub_hessian(switching_loss, params, index, data=batches, joint=True)
        blocks = pyhvp.sub_hessian(switching_loss, params, index, data=batches)
    sparse = [{name for group in r.sparse for name in group}
              for r in caplog.records if hasattr(r, "sparse")]  # fmt: skip
    # per call: the first batch's routes, then the second batch's, surveyed anew, for the rest
    # (the reverse route for w, or the forward route for both)
    assert len(sparse) == 6 and all("params['w']" not in t for t in sparse[1:3] + sparse[4:6])
    assert "params['w']" in sparse[0] & sparse[3]
    expected = pyhvp.sub_hessian(
        switching_loss, params, index, data=batches, joint=True, method="reverse"
    )
    torch.testing.assert_close(joint, expected, **F64)
    k = len(MANY)
    torch.testing.assert_close(blocks["w"], expected[:k, :k], **F64)
    torch.testing.assert_close(blocks["b"], expected[k:, k:], **F64)


def test_forcing_the_sparse_route_where_it_does_not_apply_raises_the_reason():
    with pytest.raises(ValueError, match=r"method='sparse' does not apply.*torch\.cumsum"):
        pyhvp.sub_hessian(big_cumsum, BIG, torch.tensor([0, 1]), method="sparse")


@pytest.mark.parametrize(("loss", "writer"), WRITERS.values(), ids=WRITERS.keys())
def test_a_write_to_a_selected_tensor_is_never_run_by_the_sparse_route(loss, writer, caplog):
    params = SMALL - 0.5  # negative entries: relu and hardtanh would change them
    before = params.clone()
    with pytest.raises(ValueError, match=f"is written by {writer}"):
        pyhvp.sub_hessian(loss, params, torch.tensor([0]), method="sparse")
    assert torch.equal(params, before)  # the survey stopped before the write
    with (
        caplog.at_level(logging.DEBUG, "pyhvp.sub_hessian"),
        pytest.raises(ValueError, match=f"^params is written in place by {writer}"),
    ):  # reverse: autograd refuses the write to its leaf, the survey names it
        pyhvp.sub_hessian(loss, params, torch.arange(20))
    assert set(routes_taken(caplog)) == {"reverse"}  # and the seed's loop, which fails as well
    assert torch.equal(params, before)


@pytest.mark.parametrize("method", ["auto", "reverse", "forward"])
@pytest.mark.parametrize("components", [2, 6], ids=["the loop", "batched"])
def test_a_write_to_a_selected_tensor_with_grad_on_is_refused_naming_it(method, components):
    """autograd refuses the write to the leaf the routes differentiate; its error, "a leaf
    Variable that requires grad is being used in an in-place operation", named no tensor."""
    params = {"a": torch.randn(6, 6, dtype=torch.float64), "b": torch.randn(6, dtype=torch.float64)}
    before = {name: t.clone() for name, t in params.items()}

    def loss(p):
        return p["a"][0:2].mul_(2).pow(3).sum() + p["b"].pow(4).sum()  # a view of params['a']

    index = {"a": torch.arange(components), "b": torch.tensor([0, 1])}
    with pytest.raises(ValueError, match=r"^params\['a'\] is written in place by Tensor\.mul_"):
        pyhvp.sub_hessian(loss, params, index, method=method)
    assert all(torch.equal(params[name], before[name]) for name in params)


@pytest.mark.parametrize("method", ["auto", "reverse"])
@pytest.mark.parametrize("joint", [False, True], ids=["per tensor", "joint"])
def test_a_write_to_a_selected_tensor_under_no_grad_is_refused_naming_it(joint, method):
    """Jointly, the loss gets a copy of each selected tensor: the check of params' versions did
    not see the write, and the Hessian came back at the written values (a clamp: 1.03 off)."""
    params = {"w": torch.linspace(-3, 3, 6, dtype=torch.float64), "b": torch.ones(1).double()}

    def loss(p):
        with torch.no_grad():
            p["w"].clamp_(-1, 1)
        return torch.tanh(WIDE[:4, :6] @ p["w"]).pow(2).sum() + p["b"].pow(2).sum()

    index = {"w": torch.arange(6), "b": torch.tensor([0])}
    with pytest.raises(ValueError, match=r"^params\['w'\] (was|is) written in place by the loss"):
        pyhvp.sub_hessian(loss, params, index, joint=joint, method=method)


@pytest.mark.parametrize("joint", [False, True], ids=["one tensor", "joint"])
def test_a_write_to_params_under_no_grad_inside_vmap_is_refused(joint):
    """Under vmap each tensor is a wrapper, whose own version counter never moves: until
    2026-12-07 a write to a tensor params went unseen and its block was at the written values
    (twice the true one here). Jointly, the loss's copies are views, which were watched."""

    def loss(p):
        w = p["w"] if joint else p
        with torch.no_grad():
            w.mul_(2)
        return w.pow(3).sum() + (p["b"].pow(2).sum() if joint else 0)

    stacked = {"w": torch.randn(3, 4, dtype=torch.float64), "b": torch.ones(3, 1).double()}
    if joint:
        index = {"w": torch.tensor([0, 2]), "b": torch.tensor([0])}
        call = lambda w, b: pyhvp.sub_hessian(loss, {"w": w, "b": b}, index, joint=True)  # noqa: E731
    else:
        call = lambda w, b: pyhvp.sub_hessian(loss, w, torch.tensor([0, 2]))  # noqa: E731
    with pytest.raises(ValueError, match=r"(params|params\['w'\]) (was|is) written in place"):
        torch.func.vmap(call)(stacked["w"], stacked["b"])


def reads_metadata(p):
    shape_read = p.new_ones(p.shape[0]) * p.size(1) / p.numel() + torch.zeros_like(p).sum()
    return (torch.tanh(F.linear(WIDE, p.view(p.dtype))) ** 2).sum() * shape_read.sum()


def test_reading_a_selected_tensors_metadata_keeps_the_sparse_route(caplog):
    """``W.shape``, ``W.size()``, ``W.numel()``, ``W.new_ones``, ``zeros_like(W)`` and a view as
    a dtype (not differentiated, as autograd does not) use no value of ``W`` that is
    differentiated: a tensor over ``DENSE_LIMIT`` stays sparse."""
    params = torch.randn(70, 60, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.DEBUG, "pyhvp.sub_hessian"):
        got = pyhvp.sub_hessian(reads_metadata, params, MANY, method="sparse")
    assert routes_taken(caplog) == ["sparse"]
    expected = pyhvp.sub_hessian(reads_metadata, params, MANY, method="reverse")
    torch.testing.assert_close(got, expected, **F64)


def pulled_to_its_own_mean(p):
    """A penalty towards ``p``'s current mean, held constant through ``p.data``."""
    return (torch.tanh(F.linear(WIDE, p)) ** 2).sum() + 0.5 * ((p - p.data.mean()) ** 2).sum()


def test_a_selected_tensors_data_is_a_constant_as_autograd_has_it():
    """``W.data`` has no derivative (autograd's, the seed's loop's): the sparse route once
    shifted it with ``W``, adding the penalty's ``-1 / numel`` coupling to every entry."""
    params = torch.randn(70, 60, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    got = pyhvp.sub_hessian(pulled_to_its_own_mean, params, MANY, method="sparse")
    expected = pyhvp.sub_hessian(pulled_to_its_own_mean, params, MANY, method="reverse")
    torch.testing.assert_close(got, expected, **F64)


MADE_UNDER_NO_GRAD = {  # what a loss makes of its selected tensor under no_grad
    # autograd differentiates nothing made there: W * s is linear in W (the sparse route
    # followed these as W itself: 7.3 off)
    "a clone": lambda p: p.clone(),
    "a view": lambda p: p.view(p.shape),
    "a transpose of a transpose": lambda p: p.T.T,
    "a slice": lambda p: p[:, :],
    # eager torch returns p itself, which autograd differentiates (once taken for a constant)
    "p.to(p.dtype), p itself": lambda p: p.to(p.dtype),
    "p.double() of a float64 p, p itself": lambda p: p.double(),
    "p.contiguous() of a contiguous p, p itself": lambda p: p.contiguous(),
    # p itself too, where a torch.func transform's wrapper gets a new alias (taken for a
    # constant: the sparse route's block was zero, also under "auto")
    "p.flatten(1, 1), p itself": lambda p: p.flatten(1, 1),
    "p.cpu() of a CPU p, p itself": lambda p: p.cpu(),
    "+p, p itself": lambda p: +p,
    "p.conj() of a real p, p itself": lambda p: p.conj(),
    "p.real of a real p, p itself": lambda p: p.real,
    "atleast_2d of a matrix, p itself": torch.atleast_2d,
    "p.type_as(p), p itself": lambda p: p.type_as(p),
    "p.sum_to_size(p.shape), p itself": lambda p: p.sum_to_size(p.shape),
    "p.requires_grad_(), p itself and no write": lambda p: p.requires_grad_(),
    "a dropout in eval, p itself": lambda p: F.dropout(p, 0.5, training=False),
    "torch.real of a real p, p itself": torch.real,
    "p.conj_physical() of a real p, p itself": lambda p: p.conj_physical(),
    # p itself, missing from the ops asked (6.2 off)
    "torch.as_tensor(p), p itself": torch.as_tensor,
    # p itself, given by keyword (13.5 off)
    "torch.as_tensor(data=p), p itself": lambda p: torch.as_tensor(data=p),
    "torch.flatten(input=p, ...) of one dim, p itself": lambda p: torch.flatten(
        input=p, start_dim=1, end_dim=1
    ),
    "torch.flatten(..., input=p) of one dim, p itself": lambda p: torch.flatten(
        start_dim=1, end_dim=1, input=p
    ),
    "torch.feature_dropout in eval, p itself": lambda p: torch.feature_dropout(p, 0.5, False),
}


@pytest.mark.parametrize("made", MADE_UNDER_NO_GRAD.values(), ids=MADE_UNDER_NO_GRAD.keys())
def test_what_the_loss_makes_under_no_grad_is_differentiated_as_autograd_does(made):
    def scaled_by_itself(p):
        with torch.no_grad():
            s = made(p)
        return (torch.tanh(F.linear(WIDE, p * s)) ** 2).sum()

    params = torch.randn(70, 60, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    got = pyhvp.sub_hessian(scaled_by_itself, params, MANY, method="sparse")
    expected = pyhvp.sub_hessian(scaled_by_itself, params, MANY, method="reverse")
    torch.testing.assert_close(got, expected, **F64)


def test_broadcast_tensors_under_no_grad_is_refused_by_the_sparse_route_and_auto_is_autograds():
    """``torch.broadcast_tensors(p, c)[0]`` is p itself, among other tensors (1.5 to 40 off):
    the sparse route refuses it by name, and ``"auto"`` takes autograd's route."""

    def scaled_by_itself(p):
        with torch.no_grad():
            s = torch.broadcast_tensors(p, torch.ones_like(p))[0]
        return (torch.tanh(F.linear(WIDE, p * s)) ** 2).sum()

    params = torch.randn(70, 60, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="broadcast_tensors under no_grad may return a selected"):
        pyhvp.sub_hessian(scaled_by_itself, params, MANY, method="sparse")
    got = pyhvp.sub_hessian(scaled_by_itself, params, MANY)
    expected = pyhvp.sub_hessian(scaled_by_itself, params, MANY, method="reverse")
    torch.testing.assert_close(got, expected, **F64)


TALL = torch.rand(3000, 60, dtype=torch.float64)


def linear_to_the_survey_a_distance_to_the_kernel(p):
    """``F.linear`` where pyhvp's survey runs it, ``cdist`` (no sparse rule) in the sparse
    kernel: the kernel refuses a plan that a fresh survey chooses again."""
    modes = [type(mode).__name__ for mode in _get_current_function_mode_stack()]
    if "Injection" in modes:
        return torch.cdist(TALL, p).pow(2).sum()
    return torch.cdist(TALL, p.detach()).pow(2).sum() + torch.tanh(F.linear(TALL, p)).pow(2).sum()


def test_a_sparse_kernel_refusing_the_surveys_plan_twice_takes_the_reverse_route():
    """Refused once, the batch is surveyed anew; refused again, it took pyhvp's internal
    ``NotSparse`` (a ``BaseException``) out to the caller. Now the reverse route serves it, in
    this call and equal ones, as autograd runs the loss."""
    params = torch.randn(70, 60, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    index = torch.arange(0, 4200, 30)
    for _ in range(2):
        got = pyhvp.sub_hessian(linear_to_the_survey_a_distance_to_the_kernel, params, index,
                                chunk_size=70, backend=EAGER)  # fmt: skip
    expected = pyhvp.sub_hessian(linear_to_the_survey_a_distance_to_the_kernel, params, index,
                                 method="reverse")  # fmt: skip
    torch.testing.assert_close(got, expected, **F64)


def dropped_under_no_grad(p):
    """A mask drawn from ``p`` under no_grad: a constant, drawn once."""
    with torch.no_grad():
        scale = F.dropout(p, 0.5, training=True)
    return torch.tanh(F.linear(WIDE[:6, :5], p * scale)).pow(2).sum()


@pytest.mark.parametrize("method", ["sparse", "auto"])
def test_an_op_under_no_grad_that_draws_is_run_once(method):
    """Whether an op returns its input was asked by running it again on a stand-in: a dropout
    drew twice (another mask: 5.4 off, and the generator a draw ahead)."""
    params = torch.randn(4, 5, dtype=torch.float64)
    torch.manual_seed(1)
    expected = dense_sub_hessian(dropped_under_no_grad, params, torch.arange(12))
    next_draw = torch.rand(1)
    torch.manual_seed(1)
    got = pyhvp.sub_hessian(dropped_under_no_grad, params, torch.arange(12), method=method)
    torch.testing.assert_close((got, torch.rand(1)), (expected, next_draw), **F64)


def test_vmap_over_params_of_a_loss_reading_them_under_no_grad():
    """The survey's alias check reads no storage of vmap's batched tensors (it raised
    'Cannot access storage of BatchedTensorImpl')."""

    def normalised(w):
        with torch.no_grad():
            scale = w.abs().mean() + torch.zeros_like(w).sum()
        return (torch.tanh(F.linear(X[:, :8], w / scale)) ** 2).sum()

    stacked = torch.randn(3, 8, 8, dtype=torch.float64)
    index = torch.arange(12)
    got = torch.func.vmap(lambda w: pyhvp.sub_hessian(normalised, w, index))(stacked)
    expected = torch.stack([pyhvp.sub_hessian(normalised, w, index, method="reverse")
                            for w in stacked])  # fmt: skip
    torch.testing.assert_close(got, expected, **F64)


def pruned(p):
    """A magnitude mask from a copy of ``p``, written in place under no_grad (pruning)."""
    with torch.no_grad():
        mask = p.clone()
        mask[mask.abs() < 0.5] = 0
        mask[mask != 0] = 1
    return (torch.tanh(F.linear(WIDE, p * mask)) ** 2).sum()


def test_a_write_under_no_grad_to_a_copy_of_params_is_no_write_to_params():
    """``mask = W.clone()`` then written under no_grad leaves params as they are: not refused
    as a write to them (it raised 'params is written by ...')."""
    params = torch.randn(70, 60, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    before = params.clone()
    got = pyhvp.sub_hessian(pruned, params, MANY)
    expected = pyhvp.sub_hessian(pruned, params, MANY, method="reverse")
    torch.testing.assert_close(got, expected, **F64)
    assert torch.equal(params, before)


ALIAS_WRITERS = {
    "through W.data": lambda p: p.data.mul_(1.5),
    "through W.detach()": lambda p: p.detach().mul_(1.5),
    "through a row of W.data": lambda p: p.data[0].mul_(1.5),
    "through a transpose of W.detach()": lambda p: p.detach().T.mul_(1.5),
}


@pytest.mark.parametrize("write", ALIAS_WRITERS.values(), ids=ALIAS_WRITERS.keys())
def test_a_write_to_params_through_an_alias_is_refused_before_it_runs(write):
    """A write to params' memory that autograd does not see is refused by the survey before it
    runs, params unchanged (the survey and the kernel each ran it: params came back scaled by
    2.25)."""

    def scaling(p):
        write(p)
        return (torch.tanh(F.linear(X[:, :8], p)) ** 2).sum()

    params = SMALL.clone()
    with pytest.raises(ValueError, match=r"is written by Tensor\.mul_ through an alias"):
        pyhvp.sub_hessian(scaling, params, torch.arange(20))  # enough to survey the loss
    assert torch.equal(params, SMALL)


def dropout_outside_training_in_place(p):
    kept = F.dropout(p, 0.5, training=False, inplace=True)  # writes nothing
    return (torch.tanh(F.linear(X[:, :8], kept)) ** 2).sum()


def test_a_dropout_outside_training_with_inplace_set_is_no_write():
    """Outside training a dropout returns its input unwritten, ``inplace=True`` or not: not
    refused as a write to params, under ``no_grad`` either."""
    index = torch.tensor([0, 9, 63, 9])
    expected = pyhvp.sub_hessian(dropout_outside_training_in_place, SMALL, index, method="reverse")
    with torch.no_grad():
        got = pyhvp.sub_hessian(dropout_outside_training_in_place, SMALL, index, method="sparse")
    torch.testing.assert_close(got, expected, **F64)


def test_fewer_than_min_components_take_the_reverse_route_under_auto(caplog):
    index = torch.tensor([0, 9, 63])
    with caplog.at_level(logging.DEBUG, "pyhvp.sub_hessian"):
        auto = pyhvp.sub_hessian(weight_decay, SMALL, index)
        forced = pyhvp.sub_hessian(weight_decay, SMALL, index, method="sparse")
    assert routes_taken(caplog) == ["reverse", "sparse"]
    torch.testing.assert_close(auto, forced, **F64)


@pytest.mark.slow
def test_fewer_than_min_components_are_the_cost_models_when_compiled_from_the_first_call(caplog):
    """Not the eager rule's reverse route: here the seed's loop, cheaper than a compiled kernel's
    setup (``test_compiled_at_a_few_components_the_cost_model_weighs_the_seed_loop``)."""
    if not pyhvp.restricted.compiles():
        pytest.skip("this torch's dynamo drops the mode: the sparse kernel would run eagerly")
    index = torch.tensor([0, 9, 63])
    backend = pyhvp.TorchBackend(compile=True)
    with caplog.at_level(logging.DEBUG, "pyhvp.sub_hessian"):
        got = pyhvp.sub_hessian(weight_decay, SMALL, index, backend=backend)
    (message,) = [r.getMessage() for r in caplog.records if r.name == "pyhvp.sub_hessian"]
    assert "reverse route by the seed's loop" in message and "(modelled" in message
    torch.testing.assert_close(got, dense_sub_hessian(weight_decay, SMALL, index), **F64)


@pytest.mark.parametrize("method", ["sparse", "forward"])
def test_tensors_of_two_dtypes_never_share_a_pass(method, caplog):
    # per tensor no block spans two tensors: each dtype's tensors take passes of their own
    params = {"w": torch.randn(3, 4, dtype=torch.float64), "v": torch.randn(2, 3)}
    index = {"w": torch.tensor([0, 5, 11, 2, 3, 4, 6]), "v": torch.tensor([1, 4, 4])}

    def loss(p):
        hidden = torch.tanh(F.linear(torch.ones(5, 4, dtype=torch.float64), p["w"]))
        return (torch.tanh(F.linear(hidden.float(), p["v"])) ** 2).sum()

    with caplog.at_level(logging.DEBUG, "pyhvp.sub_hessian"):
        blocks = pyhvp.sub_hessian(loss, params, index, method=method)
    (record,) = [r for r in caplog.records if hasattr(r, method)]
    assert sorted(getattr(record, method)) == [["params['v']"], ["params['w']"]]
    assert blocks["w"].dtype == torch.float64 and blocks["v"].dtype == torch.float32
    expected = pyhvp.sub_hessian(loss, params, index, method="reverse")
    torch.testing.assert_close(blocks, expected, rtol=1e-5, atol=1e-6)  # (through float32)


def test_method_must_be_a_route_name():
    with pytest.raises(ValueError, match="method must be one of"):
        pyhvp.sub_hessian(big_cumsum, BIG, torch.tensor([0]), method="backward")


EAGER = pyhvp.TorchBackend(compile=False)


def affine_and_unused(p):
    """``b`` enters linearly (a zero block) and ``unused`` not at all (a zero block)."""
    return (torch.tanh(F.linear(X[:, :8], p["w"])) ** 2).sum() + p["b"].sum()


@dataclass
class LoopCase:
    """A call with at most ``FEW_TANGENTS`` components per tensor, and its dense reference."""

    name: str
    call: object  # (backend) -> result
    expected: object  # () -> dense float64 result


PARAMS, BATCHES, DATA_INDEX = data_set()
FEW = {"w": SMALL[:3], "b": torch.randn(3, dtype=torch.float64), "unused": torch.ones(2).double()}
FEW_INDEX = {
    "w": torch.tensor([0, 9, 9, 23]),
    "b": torch.tensor([2, 0]),
    "unused": torch.tensor([1]),
}


def per_block(joint, index):
    starts = list(accumulate([0, *map(len, index.values())]))
    return {name: joint[a:b, a:b] for name, a, b in zip(index, starts, starts[1:], strict=False)}


LOOP_CASES = [
    LoopCase(
        "one tensor",
        lambda backend: pyhvp.sub_hessian(
            weight_decay, SMALL, torch.tensor([0, 9, 63]), backend=backend
        ),
        lambda: dense_sub_hessian(weight_decay, SMALL, torch.tensor([0, 9, 63])),
    ),
    LoopCase(
        "blocks, affine and unused tensors with zero blocks",
        lambda backend: pyhvp.sub_hessian(affine_and_unused, FEW, FEW_INDEX, backend=backend),
        lambda: per_block(dense_sub_hessian(affine_and_unused, FEW, FEW_INDEX), FEW_INDEX),
    ),
    LoopCase(
        "joint, over a data set",
        lambda backend: pyhvp.sub_hessian(
            batch_loss, PARAMS, DATA_INDEX, data=BATCHES, joint=True, backend=backend
        ),
        lambda: summed_dense(PARAMS, BATCHES, DATA_INDEX),
    ),
    LoopCase(
        "blocks over a data set, chunked by 1, in inference mode",
        lambda backend: torch.inference_mode()(pyhvp.sub_hessian)(
            batch_loss, PARAMS, DATA_INDEX, data=BATCHES, chunk_size=1, backend=backend
        ),
        lambda: per_block(summed_dense(PARAMS, BATCHES, DATA_INDEX), DATA_INDEX),
    ),
]


@pytest.mark.parametrize("case", LOOP_CASES, ids=lambda c: c.name)
def test_a_few_components_per_tensor_take_the_seed_loop_eagerly(case, caplog):
    with caplog.at_level(logging.DEBUG, "pyhvp.sub_hessian"):
        got = case.call(EAGER)
    messages = [record.getMessage() for record in caplog.records]
    assert messages and all("seed's loop" in message for message in messages)
    torch.testing.assert_close(got, case.expected(), **F64)


WIDE_SOFTMAX_INPUTS = torch.rand(20000, 8, dtype=torch.float64)


def wide_softmax(p):
    """Elementwise work over 20000 x 8 activations, which a compiled kernel fuses."""
    return (torch.softmax(WIDE_SOFTMAX_INPUTS @ p, -1) ** 2).sum()


@dataclass
class LoopChoice:
    name: str
    loss: object
    params: torch.Tensor
    loop: bool


LOOP_CHOICES = [
    LoopChoice(
        "a small loss: a compiled kernel's setup outweighs its work", weight_decay, SMALL, True
    ),
    LoopChoice(
        "a wide softmax: the compiled kernel's fused work costs less", wide_softmax, SMALL, False
    ),
]


@pytest.mark.parametrize("case", LOOP_CHOICES, ids=lambda c: c.name)
def test_compiled_at_a_few_components_the_cost_model_weighs_the_seed_loop(case):
    found = pyhvp.restricted.routes.survey(case.loss, [case.params], [])
    chosen = pyhvp.restricted.routes.choose(found, [2], joint=False, compiled=True, loop=True)
    assert chosen.loop == case.loop


TOKENS = torch.randint(0, 2000, (16, 32), generator=torch.Generator().manual_seed(3))
TABLE = torch.randn(2000, 8, dtype=torch.float64)


def embedded(p):
    return (torch.tanh(F.embedding(TOKENS, p).mean(1)) ** 2).sum()


@pytest.mark.parametrize(
    ("entries", "eagerly"), [(2, False), (40, True)], ids=["2 entries", "40 entries"]
)
def test_compiled_an_embeddings_group_runs_eagerly_where_its_static_injection_costs_more(
    entries, eagerly
):
    """A compiled injection marks every token per entry and direction (static shapes), an eager
    one lists the matching tokens: at many entries the group's kernel runs eagerly."""
    found = pyhvp.restricted.routes.survey(embedded, [TABLE], [])
    chosen = pyhvp.restricted.routes.choose(found, [entries], joint=False, compiled=True)
    assert chosen.groups == ((0,),)
    assert (0 in chosen.eager_only) == eagerly


BIG_TABLE = torch.randn(20000, 16, dtype=torch.float64)


def padded(p):
    return (torch.tanh(F.embedding(TOKENS, p, padding_idx=0).mean(1)) ** 2).sum()


def test_where_every_batched_pass_costs_more_auto_takes_the_seed_loop(caplog):
    """Entries in an embedding's ``padding_idx`` row leave the sparse route; a batched reverse
    pass writes a table-sized gradient per direction, the loop one per backward, cheaper."""
    index = torch.arange(0, 16)  # row 0, the padding row
    with caplog.at_level(logging.DEBUG, "pyhvp.sub_hessian"):
        got = pyhvp.sub_hessian(padded, BIG_TABLE, index, backend=EAGER)
    (message,) = [r.getMessage() for r in caplog.records if r.name == "pyhvp.sub_hessian"]
    assert "reverse route by the seed's loop" in message and "(modelled" in message
    expected = pyhvp.sub_hessian(padded, BIG_TABLE, index, method="reverse")
    torch.testing.assert_close(got, expected, **F64)


def padded_on_flagged_batches(p, batch):
    """The table through a one-hot product, or, on a flagged batch, an embedding whose
    ``padding_idx`` row holds selected entries."""
    tokens, padding = batch
    if padding:
        return (torch.tanh(F.embedding(tokens, p, padding_idx=0)) ** 3).sum()
    return (torch.tanh(F.one_hot(tokens, len(p)).to(p.dtype) @ p) ** 3).sum()


# 0 and 5: row 0, the padding row
PADDED_INDEX = torch.tensor([0, 5, 17, 900, 1200, 1800, 2400, 3000, 3600, 4200, 4799])
SHORT_TOKENS = TOKENS % 600  # 600 x 8: a table over DENSE_LIMIT


@pytest.mark.parametrize("method", ["auto", "sparse"])
def test_padding_rows_a_later_batch_reaches_are_refused_by_the_sparse_kernel(method):
    """The first batch's survey sees no ``padding_idx``; the second reaches it with selected
    entries in its row: autograd's derivative there (zero) holds, or ``"sparse"`` refuses."""
    table = TABLE[:600]
    batches = [(SHORT_TOKENS, False), (SHORT_TOKENS, True)]
    if method == "sparse":
        with pytest.raises(ValueError, match="padding_idx row"):
            pyhvp.sub_hessian(padded_on_flagged_batches, table, PADDED_INDEX, data=batches,
                              method="sparse", backend=EAGER)  # fmt: skip
        return
    got = pyhvp.sub_hessian(padded_on_flagged_batches, table, PADDED_INDEX, data=batches,
                            backend=EAGER)  # fmt: skip
    expected = pyhvp.sub_hessian(padded_on_flagged_batches, table, PADDED_INDEX, data=batches,
                                 method="reverse")  # fmt: skip
    torch.testing.assert_close(got, expected, **F64)


def test_a_padding_idx_set_after_a_first_call_is_seen_by_the_cached_routes():
    """The routes of an equal call are kept; a loss whose captured ``padding_idx`` changed since
    reaches the sparse kernel, which refuses the padding row's entries."""
    table, config = TABLE[:600], {"padding_idx": None}

    def loss(p):
        embedded = F.embedding(SHORT_TOKENS, p, padding_idx=config["padding_idx"])
        return (torch.tanh(embedded) ** 3).sum()

    pyhvp.sub_hessian(loss, table, PADDED_INDEX, backend=EAGER)
    config["padding_idx"] = 0
    for _ in range(3):  # past "auto"'s trial of each plan
        got = pyhvp.sub_hessian(loss, table, PADDED_INDEX, backend=EAGER)
        expected = pyhvp.sub_hessian(loss, table, PADDED_INDEX, method="reverse")
        torch.testing.assert_close(got, expected, **F64)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["sparse", "auto"])
def test_a_compiled_graph_traced_anew_for_a_changed_loss_is_checked_first(method):
    """A captured flag switches ``W.t()`` to ``W.T`` after the first calls: dynamo traces a new
    graph (torch 2.13 traces ``W.T`` past the mode: a zero Hessian there), checked against the
    eager kernel before it serves, as a first graph is."""
    weight, x = torch.randn(4, 5, dtype=torch.float64), torch.randn(6, 5, dtype=torch.float64)
    index = torch.randperm(20, generator=torch.Generator().manual_seed(0))[:12]
    config = {"property": False}

    def loss(w):
        transposed = w.T if config["property"] else w.t()
        return ((x @ transposed).tanh() ** 3).sum()

    expected = dense_sub_hessian(loss, weight, index)
    compiled = pyhvp.TorchBackend(compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the check may drop the new graph
        for flag in (False, False, True, True, True):
            config["property"] = flag
            got = pyhvp.sub_hessian(loss, weight, index, method=method, backend=compiled)
            torch.testing.assert_close(got, expected, **F64)


def test_the_seed_loop_takes_the_reverse_routes_tensors_beside_a_sparse_group(caplog):
    """A split, not all or nothing: ``v`` goes sparse, the padded table ``e`` (refused by the
    sparse route, a table-sized gradient per batched direction) goes by the loop."""
    params = {"e": BIG_TABLE, "v": MEDIUM}
    index = {"e": torch.arange(0, 16), "v": MANY}

    def loss(p):
        return padded(p["e"]) + seed_like(p["v"])

    with caplog.at_level(logging.DEBUG, "pyhvp.sub_hessian"):
        got = pyhvp.sub_hessian(loss, params, index, backend=EAGER)
    assert reverse_tensors(caplog) == [{"params['e']"}]
    (message,) = [r.getMessage() for r in caplog.records if r.name == "pyhvp.sub_hessian"]
    assert "sparse route for [params['v']]" in message and "by the seed's loop" in message
    expected = pyhvp.sub_hessian(loss, params, index, method="reverse")
    torch.testing.assert_close(got, expected, **F64)


WIDE_INPUTS = torch.rand(64, 800, dtype=torch.float64)
FIRST, SECOND = torch.randn(60, 800, dtype=torch.float64), torch.randn(4, 60, dtype=torch.float64)


def two_layers(first, second):
    return (torch.tanh(F.linear(torch.tanh(F.linear(WIDE_INPUTS, first)), second)) ** 2).sum()


@pytest.mark.parametrize(
    ("components", "groups"), [(16, ((0, 1),)), (64, ((0,),))], ids=["16 each", "64 each"]
)
def test_a_layer_whose_input_carries_an_earlier_groups_directions_leaves_it_at_many(
    components, groups
):
    """In one group, the second layer's entries' tangents (its input's columns) carry the first
    layer's directions: ``(directions, k, rows)`` of them per pass, priced as such, so at many
    components the second layer leaves the group (here for the reverse route)."""
    found = pyhvp.restricted.routes.survey(two_layers, [FIRST, SECOND], [])
    assert [u.injections for u in found.usage] == [[(64, 60, 0)], [(64, 4, 0b01)]]
    chosen = pyhvp.restricted.routes.choose(found, [components] * 2, joint=False, compiled=False)
    assert chosen.groups == groups


# --- the trial against the seed's loop ----------------------------------------------------


def test_a_trial_warms_the_models_routes_up_then_times_each_plan_in_turn_and_keeps_the_fastest():
    model, loop = Routes((), (0,), 1.0, 1.0), Routes((), (0,), 2.0, 1.0, loop=True)
    sparse = Routes(((0,),), (), 1.5, 1.0)
    trial = Trial((("model", model), ("loop", loop), ("sparse", sparse)))
    assert trial.next() == ("model", model, False)  # the warm-up
    timings = [("loop", 0.3), ("loop", 0.32), ("sparse", 0.25), ("sparse", 0.3), ("model", 0.35)]
    for name, seconds in timings:
        assert trial.next() == (name, dict(trial.plans)[name], True)
        assert not trial.record(name, seconds)
    assert trial.next() == ("model", model, True)
    assert trial.record("model", 0.26)  # the fastest of each plan's runs: 0.3, 0.25, 0.26
    assert trial.next() == ("sparse", sparse, False)


def test_plans_within_reach_of_the_one_kept_get_a_second_round_that_decides_for_good():
    """A first round another process disturbed (the sparse route's runs slow) keeps a slower
    plan; the plans still within DROP of it run again some calls later, and the least of both
    rounds decides. Before, the first round's choice was final: the seed's model kept the
    sparse route at 1.6x the forward route's time."""
    model, sparse = Routes((), (0,), 1.0, 1.0), Routes(((0,),), (), 1.5, 1.0)
    trial = Trial((("model", model), ("sparse", sparse)))
    trial.next()
    for name, seconds in [("sparse", 1.3), ("sparse", 1.4), ("model", 1.0), ("model", 1.0)]:
        assert trial.next()[0] == name
        trial.record(name, seconds)
    assert trial.settled == "model" and not trial.final
    assert [trial.next()[:3:2] for _ in range(CONFIRM_AFTER)] == [("model", False)] * CONFIRM_AFTER
    for name, seconds in [("sparse", 0.8), ("sparse", 0.75), ("model", 1.0), ("model", 1.0)]:
        assert trial.next()[::2] == (name, True)
        trial.record(name, seconds)
    assert trial.settled == "sparse" and trial.final
    assert [trial.next()[0] for _ in range(2 * CONFIRM_AFTER)] == ["sparse"] * 2 * CONFIRM_AFTER


def test_a_plan_kept_where_every_other_was_dropped_is_kept_for_good():
    model, loop = Routes((), (0,), 1.0, 1.0), Routes((), (0,), 2.0, 1.0, loop=True)
    trial = Trial((("model", model), ("loop", loop)))
    trial.next()
    for name, seconds in [("loop", 2.0), ("model", 1.0), ("model", 1.0)]:
        trial.next()
        trial.record(name, seconds)
    assert trial.settled == "model" and trial.final
    assert [trial.next()[0] for _ in range(2 * CONFIRM_AFTER)] == ["model"] * 2 * CONFIRM_AFTER


def test_a_plans_first_run_in_the_process_is_an_untimed_warm_up():
    """The forward route's first run in a process imports torch's forward-mode decompositions
    (160 ms on LeNet-5's 27 ms route): timed, it would leave the trial for a one-time cost."""
    model, forward = Routes((), (0,), 1.0, 1.0), Routes(((0,),), (), 1.0, 1.0, forward=True)
    first = Trial((("model", model), ("forward", forward)), run_before=set())
    handed = [first.next() for _ in range(3)]
    assert [timed for _, _, timed in handed] == [False, False, True]
    assert [name for name, _, _ in handed] == ["model", "forward", "forward"]
    later = Trial((("model", model), ("forward", forward)), run_before=first.run_before)
    assert [later.next()[2] for _ in range(2)] == [False, True]  # only the model's warm-up


def test_a_plan_much_slower_than_the_fastest_run_is_not_run_again():
    plans = tuple((name, Routes((), (0,), 1.0, 1.0, loop=name == "loop")) for name in "ab")
    trial = Trial((("model", Routes(((0,),), (), 1.0, 1.0)), *plans))
    trial.next()
    for name, seconds in [("a", 1.0), ("a", 1.1), ("b", 0.5)]:  # a: over DROP x 0.5 by now
        assert trial.next()[0] == name
        trial.record(name, seconds)
    assert trial.dropped == {"a"}
    assert trial.next()[0] == "b" and not trial.record("b", 0.5)
    assert trial.next()[0] == "model" and not trial.record("model", 0.6)
    assert trial.next()[0] == "model" and trial.record("model", 0.4)
    assert trial.settled == "model"


def test_the_models_routes_get_their_second_run_after_a_slow_first():
    model, loop = Routes(((0,),), (), 1.0, 1.0), Routes((), (0,), 2.0, 1.0, loop=True)
    trial = Trial((("model", model), ("loop", loop)))
    trial.next()
    for name, seconds in [("loop", 1.2), ("loop", 1.2), ("model", 1.9), ("model", 0.9)]:
        assert trial.next()[0] == name
        trial.record(name, seconds)
    assert trial.settled == "model"


def test_a_run_outside_the_compile_policys_steady_state_is_not_timed(monkeypatch):
    """A run in which a kernel compiled, was checked against eager or ran its eager turn
    (``unsettled_calls`` moved) is not its plan's steady state: no run is timed while every
    call is such a run, and the trial settles once calls are steady; every call's matrix is
    the dense one meanwhile."""
    expected = dense_sub_hessian(seed_like, MEDIUM, MANY)
    count = itertools.count()
    monkeypatch.setattr(submatrix, "unsettled_calls", lambda: next(count))
    for _ in range(3 + 5 * TIMED_RUNS):
        got = pyhvp.sub_hessian(seed_like, MEDIUM, MANY, backend=EAGER)
        torch.testing.assert_close(got, expected, **F64)
    (trial,) = submatrix._ROUTES.values()
    assert len(trial.plans) > 1 and trial.seconds == {} and trial.settled is None
    monkeypatch.setattr(submatrix, "unsettled_calls", lambda: 0)
    for _ in range(3 + 5 * TIMED_RUNS):
        pyhvp.sub_hessian(seed_like, MEDIUM, MANY, backend=EAGER)
    assert trial.settled is not None


def test_a_single_plan_is_not_on_trial():
    model = Routes((), (0,), 1.0, 1.0, loop=True)
    assert [Trial((("model", model),)).next() for _ in range(3)] == [("model", model, False)] * 3


def test_a_plan_that_fails_leaves_the_trial_and_the_models_failure_ends_it():
    model, loop = Routes((), (0,), 1.0, 1.0), Routes((), (0,), 2.0, 1.0, loop=True)
    sparse = Routes(((0,),), (), 1.5, 1.0)
    trial = Trial((("model", model), ("loop", loop), ("sparse", sparse)))
    trial.next()
    trial.drop("sparse", loop)
    for name in ("loop", "model"):
        for _ in range(TIMED_RUNS):
            assert trial.next()[0] == name
            trial.record(name, 1.0 if name == "model" else 1.2)
    assert trial.settled == "model"
    trial.drop("model", loop)  # the model's routes failed: the loop for good
    assert [trial.next() for _ in range(2)] == [(LOOP_FALLBACK, loop, False)] * 2


class OldStyleSquare(torch.autograd.Function):
    """An ``autograd.Function`` without ``setup_context``: autograd runs it, ``torch.func``
    (the sparse kernels' vmap and jvp) refuses it -- from torch 2.14 on in C++, so the refusal is
    raised in the loss's own frame, like an error of the loss's own."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


def old_style_function(p, square=OldStyleSquare.apply):
    return square(torch.tanh(F.linear(X[:, :8], p))).sum()


def group_norm_of_a_convolution(p):
    """``group_norm``'s double backward cannot take batched gradients (torch 2.13): the reverse
    route's batched pass fails where one backward per component works."""
    images = X[:4, :48].reshape(4, 3, 4, 4)
    return torch.tanh(F.group_norm(F.conv2d(images, p), 2)).pow(2).sum()


KERNEL_FAILURES = {
    "an old-style autograd.Function (sparse kernels)": (
        old_style_function, lambda p: old_style_function(p, torch.square), (5, 8)),
    "group_norm (the batched reverse pass)": (
        group_norm_of_a_convolution, group_norm_of_a_convolution, (4, 3, 2, 2)),
}  # fmt: skip
"""Losses, the same written for torch.func (the dense reference), and the selected shape."""


@pytest.mark.parametrize("case", KERNEL_FAILURES.values(), ids=KERNEL_FAILURES.keys())
@pytest.mark.parametrize("backend", [EAGER, "torch"], ids=["eager", "default"])
def test_a_loss_the_kernels_cannot_run_is_served_by_the_seeds_loop_on_every_call(case, backend):
    """Every call (a trial's included, whose plans run other kernels) equals the dense matrix:
    a failing plan leaves the trial and the batch runs again by the seed's loop; before, the
    call raised, on every later call too."""
    loss, same_for_torch_func, shape = case
    p = torch.randn(shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    index = torch.arange(0, p.numel(), 3)[:12]
    expected = dense_sub_hessian(same_for_torch_func, p, index)
    for _ in range(2 + 3 * TIMED_RUNS):
        got = pyhvp.sub_hessian(loss, p, index, backend=backend)
        torch.testing.assert_close(got, expected, **F64)


def test_a_later_batch_the_kernels_cannot_run_is_served_by_the_seeds_loop():
    """Over ``data``, the batch a plan fails on runs again by the seed's loop, whichever batch it
    is: nothing of a failed batch was added (the reverse rows and sparse blocks are added once
    all are computed)."""
    p = torch.randn(5, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    index = torch.arange(0, 40, 3)
    batches = [torch.tensor(0), torch.tensor(1)]  # batch 1 goes through the old-style Function

    def loss(q, which):
        return old_style_function(q) if which else old_style_function(q, torch.square)

    expected = 2 * dense_sub_hessian(lambda q: old_style_function(q, torch.square), p, index)
    for _ in range(3):
        got = pyhvp.sub_hessian(loss, p, index, data=batches, backend=EAGER)
        torch.testing.assert_close(got, expected, **F64)


def test_the_losss_own_error_is_raised_not_retried_by_the_loop():
    """An exception the loss raises itself (by a raise statement of its own) is raised as it
    is, every time, even where a rerun would not raise it."""
    calls = []

    def flaky(p):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the loss's own error")
        return seed_like(p)

    with pytest.raises(RuntimeError, match="the loss's own error"):
        for _ in range(3):
            pyhvp.sub_hessian(flaky, MEDIUM, MANY, backend=EAGER)


@pytest.mark.parametrize("method", ["sparse", "auto"])
def test_a_torch_error_of_the_losss_own_bug_is_raised_as_it_is(method):
    """A shape bug raised by torch in the loss's frame looks like the kernels' refusal (which
    torch 2.14 raises there too): the seed's loop runs the loss, and its error is raised, not
    "method='sparse' does not apply"."""

    def loss(w):
        return (w @ torch.ones(4, 7, dtype=w.dtype)).sum()

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        pyhvp.sub_hessian(loss, torch.randn(5, 3, dtype=torch.float64), torch.tensor([0, 4]),
                          method=method)  # fmt: skip


@pytest.mark.parametrize("method", ["sparse", "auto"])
def test_a_failing_autograd_call_of_the_losss_own_is_raised_as_it_is(method):
    """The loss's own ``torch.autograd.grad`` fails (a tensor that does not require grad): its
    error, not "method='sparse' does not apply", though it is raised by autograd's backward
    as what the seed's loop cannot differentiate is."""
    data = torch.randn(3, dtype=torch.float64)

    def loss(w):
        (g,) = torch.autograd.grad((w * data).sum(), data)
        return (g * w).sum()

    with pytest.raises(RuntimeError, match="does not require grad"):
        pyhvp.sub_hessian(loss, torch.randn(3, dtype=torch.float64), torch.tensor([0, 2]),
                          method=method)  # fmt: skip


def test_a_write_to_a_tensor_of_params_that_is_not_selected_is_refused_naming_it():
    """The loss renormalises ``params['e']`` (an embedding's ``max_norm``) while ``w`` alone is
    selected: refused after the run (nothing else surveys ``e``), naming ``e``."""
    tokens = torch.tensor([[0, 1, 2], [3, 4, 0]])
    params = {
        "e": 3 * torch.randn(5, 8, dtype=torch.float64),
        "w": torch.randn(8, 8, dtype=torch.float64),
    }

    def loss(p):
        return torch.tanh(F.embedding(tokens, p["e"], max_norm=1.0) @ p["w"]).pow(2).sum()

    with pytest.raises(ValueError, match=r"params\['e'\] was written in place by the loss"):
        pyhvp.sub_hessian(loss, params, {"w": torch.arange(12)})


def test_a_sub_hessian_inside_a_differentiating_transform_is_refused_and_vmap_runs():
    """The result carries no graph: ``torch.func.grad`` of it gave zeros silently."""
    p = torch.randn(5, dtype=torch.float64)

    def sub(q):
        return pyhvp.sub_hessian(lambda r: (r**4).sum(), q, torch.tensor([0, 1]))

    with pytest.raises(ValueError, match="sub_hessian cannot be differentiated"):
        torch.func.grad(lambda q: sub(q).sum())(p)
    torch.testing.assert_close(torch.func.vmap(sub)(p[None])[0], torch.diag(12 * p[:2] ** 2))


def tanh_squared_of_a_layer(inputs):
    """``sum(tanh(inputs @ W.T) ** 2)`` as a function of ``W``, and its sub-Hessian in closed
    form: ``H[(o, i), (o', i')] = [o == o'] sum_b f''(u_bo) x_bi x_bi'``, ``f = tanh^2``,
    ``f'' = 2 (1 - t^2)(1 - 3 t^2)``."""

    def loss(weight):
        return torch.tanh(inputs @ weight.T).pow(2).sum()

    def closed_form(weight, index):
        rows, columns = index // weight.shape[1], index % weight.shape[1]
        t = torch.tanh(inputs @ weight.T)[:, rows]  # (batch, k)
        curvature = 2 * (1 - t**2) * (1 - 3 * t**2)
        x = inputs[:, columns]
        same_row = rows[:, None] == rows[None, :]
        return same_row * torch.einsum("bp,bp,bq->pq", curvature, x, x)

    return loss, closed_form


@pytest.mark.parametrize("backend", [EAGER, "torch"], ids=["eager", "default"])
def test_a_large_tensor_at_few_components_is_surveyed_from_its_second_call(
    backend, caplog, monkeypatch
):
    """Below ``MIN_COMPONENTS`` the seed's loop runs unsurveyed only over tensors of at most
    ``LOOP_ENTRIES`` entries, and at a larger tensor's first call; each of its passes writes a
    gradient of the tensor's size, and an equal call again takes the sparse route (3 entries
    of a 512 x 2048 weight: 0.24x the loop's time). Dynamo is not probed for ``W.T`` (1.6 s of
    a first call), where the default backend's compiled routes are not weighed."""
    monkeypatch.setattr(pyhvp.restricted.routes, "compiles_property_views", None)  # (uncalled)
    weight = torch.randn(4 * pyhvp.restricted.routes.LOOP_ENTRIES // 64, 64, dtype=torch.float64)
    loss, closed_form = tanh_squared_of_a_layer(torch.randn(64, 64, dtype=torch.float64))
    index = torch.tensor([0, 70, weight.numel() - 1])
    with caplog.at_level(logging.DEBUG, "pyhvp.sub_hessian"):
        calls = [pyhvp.sub_hessian(loss, weight, index, backend=backend) for _ in range(3)]
    assert routes_taken(caplog)[:2] == ["reverse", "sparse"]  # (then, eagerly, a trial)
    for got in calls:
        torch.testing.assert_close(got, closed_form(weight, index), **F64)


def test_a_large_tensors_loss_rebuilt_over_each_steps_batch_is_not_surveyed(caplog):
    """A closure over a new batch per call never repeats its key: surveyed every call, where
    the cost model kept the loop, it took up to 3x the seed's loop (a 30-layer net at k = 1)."""
    weight = torch.randn(4 * pyhvp.restricted.routes.LOOP_ENTRIES // 64, 64, dtype=torch.float64)
    index = torch.tensor([0, 70])
    with caplog.at_level(logging.DEBUG, "pyhvp.sub_hessian"):
        for _ in range(3):
            loss, closed_form = tanh_squared_of_a_layer(torch.randn(64, 64, dtype=torch.float64))
            got = pyhvp.sub_hessian(loss, weight, index, backend=EAGER)
            torch.testing.assert_close(got, closed_form(weight, index), **F64)
    assert routes_taken(caplog) == ["reverse"] * 3


@pytest.mark.parametrize("backend", [EAGER, "torch"], ids=["eager", "default"])
def test_few_components_of_a_small_tensor_take_the_seeds_loop_on_the_default_backend(
    backend, caplog
):
    """``compile="auto"`` (the default) as ``compile=False``: the seed's loop, where its eager
    batched pass took 1.2-1.9x the loop's time at 3 components of one tensor."""
    weight = torch.randn(8, 16, dtype=torch.float64)
    loss, closed_form = tanh_squared_of_a_layer(torch.randn(4, 16, dtype=torch.float64))
    index = torch.tensor([3, 17, 18])
    with caplog.at_level(logging.DEBUG, "pyhvp.sub_hessian"):
        got = pyhvp.sub_hessian(loss, weight, index, backend=backend)
    assert [r.getMessage() for r in caplog.records if submatrix.BY_LOOP in r.getMessage()]
    torch.testing.assert_close(got, closed_form(weight, index), **F64)


@pytest.mark.parametrize(
    "view", [lambda w: w.T, lambda w: w.mT, lambda w: w.permute(1, 0), lambda w: w.t()],
    ids=["W.T", "W.mT", "W.permute", "W.t()"],
)  # fmt: skip
@pytest.mark.parametrize("method", ["sparse", "forward"])
def test_the_sparse_routes_find_the_entries_of_a_permuted_view_from_its_strides(view, method):
    """No op of the call makes an index of the weight's size: applying the view to every
    position of ``W`` took 400 ms a call at 4096 x 4096 (an index the size of ``W``, and its
    inverse), where the product itself took 12."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and not t.is_floating_point():
                    self.most = max(self.most, t.numel())
            return out

    weight, inputs = (
        torch.randn(64, 32, dtype=torch.float64),
        torch.randn(4, 32, dtype=torch.float64),
    )
    _, closed_form = tanh_squared_of_a_layer(inputs)
    index = torch.tensor([0, 40, 2047])

    def loss(w):
        return torch.tanh(inputs @ view(w)).pow(2).sum()

    with Largest() as largest:
        got = pyhvp.sub_hessian(loss, weight, index, method=method, backend=EAGER)
    assert largest.most < weight.numel()
    torch.testing.assert_close(got, closed_form(weight, index), **F64)


@pytest.mark.parametrize("method", ["sparse", "forward"])
def test_a_forced_route_that_cannot_run_the_loss_is_refused_by_name_at_every_call(method):
    """Not once: an equal call after a refusal took the seed's loop silently."""
    p = torch.randn(5, 8, dtype=torch.float64)
    for _ in range(3):
        with pytest.raises(ValueError, match=rf"method='{method}' does not apply: its kernels"):
            pyhvp.sub_hessian(old_style_function, p, torch.arange(12), method=method,
                              backend=EAGER)  # fmt: skip


def slow(function, clock, seconds):
    """``function``, advancing the fake ``clock`` by ``seconds`` per call."""

    def timed(*args, **kwargs):
        clock[0] += seconds
        return function(*args, **kwargs)

    return timed


@pytest.mark.parametrize(
    ("seconds", "kept"),
    [
        ({"_loop_rows": 3, "_sparse_pass": 1, "_batched_rows": 2, "_forward_pass": 4},
         "the cost model's routes"),
        ({"_loop_rows": 1, "_sparse_pass": 2, "_batched_rows": 3, "_forward_pass": 4},
         "the seed's loop"),
        ({"_loop_rows": 3, "_sparse_pass": 2, "_batched_rows": 1, "_forward_pass": 4},
         "the reverse route alone"),
        ({"_loop_rows": 3, "_sparse_pass": 2, "_batched_rows": 4, "_forward_pass": 1},
         "the forward-tangent route"),
    ],
    ids=["model", "loop", "reverse", "forward"],
)  # fmt: skip
def test_repeated_calls_keep_whichever_plan_ran_fastest(seconds, kept, monkeypatch, caplog):
    """The cost model sends ``seed_like`` to the sparse route; on a fake clock where the seed's
    loop, a sparse pass, a batched reverse pass and a forward-tangent
    pass take the given seconds, the trial keeps the fastest plan, and every call's matrix is
    the dense one."""
    clock = [0.0]
    monkeypatch.setattr(pyhvp.backends.compile_policy, "clock", lambda: clock[0])
    for name, spent in seconds.items():
        monkeypatch.setattr(submatrix, name, slow(getattr(submatrix, name), clock, spent))
    expected = dense_sub_hessian(seed_like, MEDIUM, MANY)
    with caplog.at_level(logging.DEBUG, "pyhvp.sub_hessian"):
        for _ in range(2 + 4 * TIMED_RUNS):  # a warm-up, four plans' timed runs, one kept
            got = pyhvp.sub_hessian(seed_like, MEDIUM, MANY, backend=EAGER)
            torch.testing.assert_close(got, expected, **F64)
    (settled,) = [r.settled for r in caplog.records if hasattr(r, "settled")]
    assert settled == kept


@pytest.mark.parametrize("joint", [False, True])
def test_every_plan_of_a_trial_gives_the_dense_sub_hessian(joint, caplog):
    """Repeated calls run the trial's plans in turn (the model's routes, the loop, each route
    alone): every call, blocks or joint, equals the dense float64 matrix."""
    params, index = {"v": MEDIUM, "s": SMALL}, {"v": MANY, "s": torch.tensor([0, 9, 63, 9])}

    def loss(p):
        return seed_like(p["v"]) + weight_decay(p["s"])

    if joint:
        expected = dense_sub_hessian(loss, params, index)
    else:
        expected = {name: dense_sub_hessian(loss, params, {name: i}) for name, i in index.items()}
    with caplog.at_level(logging.DEBUG, "pyhvp.sub_hessian"):
        for _ in range(2 + 5 * TIMED_RUNS):
            got = pyhvp.sub_hessian(loss, params, index, joint=joint, backend=EAGER)
            torch.testing.assert_close(got, expected, **F64)
    ran = {r.getMessage().split(" (modelled")[0] for r in caplog.records if hasattr(r, "reverse")}
    assert len(ran) >= 4  # the model's routes, the loop, the reverse and forward routes alone


@pytest.mark.parametrize(("bound", "tried"), [(10**9, True), (0, False)], ids=["within", "over"])
def test_a_trial_tries_the_reverse_route_alone_only_within_its_memory_bound(
    bound, tried, monkeypatch
):
    """The reverse route alone holds a one-hot tangent of its tensor per component: it is
    tried only where those the model's routes do not hold already fit ``TRIAL_TANGENTS``."""
    monkeypatch.setattr(submatrix, "TRIAL_TANGENTS", bound)
    pyhvp.sub_hessian(seed_like, MEDIUM, MANY, backend=EAGER)
    (trial,) = submatrix._ROUTES.values()
    assert ("the reverse route alone" in dict(trial.plans)) == tried


def test_under_the_default_compile_policy_the_models_routes_are_not_on_trial():
    """``compile="auto"`` compiles the routes' kernels once their eager time pays for it; a trial
    on eager times could keep the loop for good where the compiled routes beat it later."""
    pyhvp.sub_hessian(seed_like, MEDIUM, MANY)
    (trial,) = submatrix._ROUTES.values()
    assert [name for name, _ in trial.plans] == ["the cost model's routes"]
