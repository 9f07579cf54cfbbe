"""Specification of the sparse route's injections, one op at a time: every use of a selected
tensor the route covers (contractions with a sparse rule, views, biases, normalisations) gives the
dense float64 sub-Hessian, with repeated and unsorted indices, joint and per tensor, on every
device; the route is forced (``method="sparse"``), so a use it did not cover would raise."""

import re
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from dense import dense_sub_hessian, loop_sub_hessians
from torch import nn
from torch._dynamo.utils import counters

import pyhvp
from pyhvp._embeddings import embedding_bag_by_embedding
from pyhvp.restricted import contributions
from pyhvp.restricted.contributions import Contribution, inject, reduced
from pyhvp.restricted.ops import describe

F64 = {"rtol": 1e-9, "atol": 1e-11}


def tensors(*shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]


X, X3, IMAGES, VOLUMES = tensors((5, 6), (2, 5, 6), (2, 4, 9, 8), (2, 2, 5, 6, 4), seed=1)
TOKENS = torch.tensor([[0, 3, 3, 6], [2, 5, 0, 3], [6, 6, 1, 2]])


def squash(y):
    """A curved head: every entry's Hessian couples the selected components."""
    return (torch.tanh(y) ** 2).sum() + (y.sum() ** 2) / 10


@dataclass
class Case:
    name: str
    loss: object  # loss(params) -> scalar, params a dict of tensors
    shapes: dict
    index: dict  # name -> flat indices (repeated and unsorted on purpose)
    reference: str = (
        "dense"  # or "reverse": autograd's own derivative, where it is not the true one
    )

    def make(self, device):
        params = dict(zip(self.shapes, tensors(*self.shapes.values(), seed=2), strict=True))
        params = {name: p.to(device) for name, p in params.items()}
        index = {name: torch.tensor(i, device=device) for name, i in self.index.items()}
        return self.loss, params, index


def at(device, *values):
    return [v.to(device) for v in values]


def conv(dims, **options):
    op = (F.conv1d, F.conv2d, F.conv3d)[dims - 1]
    data = (IMAGES[:, :, :, 0], IMAGES, VOLUMES)[dims - 1]
    return lambda p: squash(op(data.to(p["w"].device), p["w"], p.get("b"), **options))


def conv_transpose(dims, **options):
    op = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[dims - 1]
    data = (IMAGES[:, :, :, 0], IMAGES, VOLUMES)[dims - 1]
    return lambda p: squash(op(data.to(p["w"].device), p["w"], p.get("b"), **options))


def on(data, f):
    """``f(data on params' device, params)`` as a loss of params."""
    return lambda p: f(data.to(next(iter(p.values())).device), p)


W_INDEX = [13, 0, 23, 13, 7]  # unsorted, with a repeat
CASES = [
    Case(
        "as_strided of a contiguous tensor (a view, followed)",
        on(X, lambda x, p: squash(x[:, :3] @ p["w"].as_strided((3, 4), (1, 5), 2))),
        {"w": (4, 6)},
        {"w": W_INDEX},
    ),
    Case(
        "F.linear with bias",
        on(X, lambda x, p: squash(F.linear(x, p["w"], p["b"]))),
        {"w": (4, 6), "b": (4,)},
        {"w": W_INDEX, "b": [3, 0, 3]},
    ),
    Case(
        "F.linear of one vector, with bias",
        on(X[0], lambda x, p: squash(F.linear(x, p["w"], p["b"]))),
        {"w": (4, 6), "b": (4,)},
        {"w": W_INDEX, "b": [2, 2, 1]},
    ),
    Case(
        "F.linear with a bias of one entry, broadcast",
        on(X, lambda x, p: squash(F.linear(x, p["w"], p["b"]))),
        {"w": (4, 6), "b": (1,)},
        {"w": W_INDEX, "b": [0, 0]},
    ),
    Case(
        "F.linear without bias",
        on(X, lambda x, p: squash(F.linear(x, p["w"]))),
        {"w": (4, 6)},
        {"w": W_INDEX},
    ),
    Case("x @ W.T", on(X, lambda x, p: squash(x @ p["w"].T)), {"w": (4, 6)}, {"w": W_INDEX}),
    Case(
        "mm(x, W.t())",
        on(X, lambda x, p: squash(torch.mm(x, p["w"].t()))),
        {"w": (4, 6)},
        {"w": W_INDEX},
    ),
    Case(
        "x @ W.mT, batched",
        on(X3, lambda x, p: squash(x @ p["w"].mT)),
        {"w": (2, 4, 6)},
        {"w": [47, 0, 13, 13, 30]},
    ),
    Case(
        "W @ x.T (selected on the left)",
        on(X, lambda x, p: squash(p["w"] @ x.T)),
        {"w": (4, 6)},
        {"w": W_INDEX},
    ),
    Case(
        "matmul(x, W) with broadcast batch",
        on(X3, lambda x, p: squash(torch.matmul(x, p["w"]))),
        {"w": (6, 3)},
        {"w": [17, 2, 9, 2]},
    ),
    Case(
        "bmm(x, W)",
        on(X3, lambda x, p: squash(torch.bmm(x, p["w"]))),
        {"w": (2, 6, 3)},
        {"w": [35, 0, 18, 18, 4]},
    ),
    Case(
        "vector @ W", on(X[0], lambda x, p: squash(x @ p["w"])), {"w": (6, 3)}, {"w": [17, 2, 9, 2]}
    ),
    Case(
        "W @ vector", on(X[0], lambda x, p: squash(p["w"] @ x)), {"w": (3, 6)}, {"w": [17, 2, 9, 2]}
    ),
    Case(
        "W.__rmatmul__(x)",
        on(X, lambda x, p: squash(p["w"].__rmatmul__(x))),
        {"w": (6, 3)},
        {"w": [17, 2, 9, 2]},
    ),
    Case(
        "einsum bi,oi->bo",
        on(X, lambda x, p: squash(torch.einsum("bi,oi->bo", x, p["w"]))),
        {"w": (4, 6)},
        {"w": W_INDEX},
    ),
    Case(
        "einsum with an ellipsis",
        on(X3, lambda x, p: squash(torch.einsum("...i,oi->...o", x, p["w"]))),
        {"w": (4, 6)},
        {"w": W_INDEX},
    ),
    Case(
        "einsum, implicit output",
        on(X, lambda x, p: squash(torch.einsum("bi,io", x, p["w"]))),
        {"w": (6, 4)},
        {"w": W_INDEX},
    ),
    Case(
        "einsum, two dims of the selected operand in the output",
        on(X3, lambda x, p: squash(torch.einsum("bsi,bio->bso", x, p["w"]))),
        {"w": (2, 6, 3)},
        {"w": [35, 0, 18, 18, 4]},
    ),
    Case(
        "addmm(b, x, W)",
        on(X, lambda x, p: squash(torch.addmm(p["b"], x, p["w"], alpha=0.5))),
        {"w": (6, 4), "b": (4,)},
        {"w": W_INDEX, "b": [1, 1, 0]},
    ),
    Case(
        "one tensor twice in a product: W @ W.T",
        lambda p: squash(p["w"] @ p["w"].T),
        {"w": (4, 6)},
        {"w": W_INDEX},
    ),
    Case(
        "two selected operands: A @ B",
        lambda p: squash(p["a"] @ p["b"]),
        {"a": (3, 4), "b": (4, 5)},
        {"a": [11, 0, 5], "b": [19, 3, 3, 8]},
    ),
    Case(
        "two layers, joint cross terms",
        on(X, lambda x, p: squash(torch.tanh(x @ p["w"].T) @ p["v"])),
        {"w": (4, 6), "v": (4, 3)},
        {"w": W_INDEX, "v": [11, 0, 4, 4]},
    ),
    Case("conv1d", conv(1), {"w": (3, 4, 3), "b": (3,)}, {"w": [35, 0, 17, 17], "b": [2, 0]}),
    Case(
        "conv2d, stride, padding, dilation, groups",
        conv(2, stride=2, padding=1, dilation=2, groups=2),
        {"w": (6, 2, 3, 2), "b": (6,)},
        {"w": [71, 0, 40, 40, 13], "b": [5, 1]},
    ),
    Case(
        "conv2d, padding='same', even kernel",
        conv(2, padding="same"),
        {"w": (3, 4, 2, 2)},
        {"w": [47, 0, 20, 20]},
    ),
    Case(
        "conv2d, asymmetric stride and padding",
        conv(2, stride=(2, 1), padding=(0, 2)),
        {"w": (3, 4, 3, 3)},
        {"w": [107, 0, 50, 50, 9]},
    ),
    Case(
        "conv3d, stride and groups",
        conv(3, stride=(1, 2, 1), groups=2),
        {"w": (4, 1, 2, 3, 2), "b": (4,)},
        {"w": [47, 0, 20, 20], "b": [3]},
    ),
    Case(
        "conv2d, unbatched input",
        lambda p: squash(F.conv2d(IMAGES[0].to(p["w"].device), p["w"], p["b"], 1, 1)),
        {"w": (3, 4, 3, 3), "b": (3,)},
        {"w": [107, 0, 50, 50, 9], "b": [2, 0, 2]},
    ),
    Case(
        "conv_transpose1d, stride and output padding",
        conv_transpose(1, stride=2, padding=1, output_padding=1),
        {"w": (4, 3, 3), "b": (3,)},
        {"w": [35, 0, 17, 17], "b": [2, 2]},
    ),
    Case(
        "conv_transpose2d, groups and dilation",
        conv_transpose(2, stride=2, groups=2, dilation=2),
        {"w": (4, 2, 3, 2)},
        {"w": [47, 0, 20, 20, 11]},
    ),
    Case(
        "conv_transpose3d",
        conv_transpose(3, stride=(2, 1, 1), padding=(1, 0, 1)),
        {"w": (2, 3, 2, 2, 2)},
        {"w": [47, 0, 20, 20]},
    ),
    Case(
        "embedding",
        on(TOKENS, lambda t, p: squash(F.embedding(t, p["e"]).mean(1))),
        {"e": (7, 4)},
        {"e": [12, 0, 25, 12, 27]},
    ),
    Case(
        "embedding with padding_idx, no entry in that row",
        on(TOKENS, lambda t, p: squash(F.embedding(t, p["e"], padding_idx=3).sum(1))),
        {"e": (7, 4)},
        {"e": [16, 0, 25, 16, 5]},
    ),
    Case(
        "embedding with padding_idx of a view e[1:], entries in row 3 of e but not in row 4",
        on(TOKENS, lambda t, p: squash(F.embedding(t, p["e"][1:], padding_idx=3).sum(1))),
        {"e": (8, 4)},
        {"e": [12, 0, 15, 12, 21]},
    ),
    Case(
        "embedding summed into the loss, squared (its tangents pushed to the scalar)",
        on(TOKENS, lambda t, p: F.embedding(t, p["e"]).sum(dtype=torch.float64) ** 2),
        {"e": (7, 4)},
        {"e": [12, 0, 25, 12, 27]},
    ),
    Case(
        "embedding reduced over several and negative dims, keepdim, and over all",
        on(
            TOKENS,
            lambda t, p: (
                lambda e: (
                    squash(e.sum((0, -1), keepdim=True))
                    + squash(e.mean(-2))
                    + squash(torch.mean(e, dim=[2, 0]))
                    + e.mean() ** 2
                )
            )(F.embedding(t, p["e"])),
        ),
        {"e": (7, 4)},
        {"e": [12, 0, 25, 12, 27]},
    ),
    Case(
        "embedding used by means and directly",
        on(
            TOKENS,
            lambda t, p: (lambda e: squash(e.mean(1).mean(0)) + squash(e[:, 0] * e[:, 1]))(
                F.embedding(t, p["e"])
            ),
        ),
        {"e": (7, 4)},
        {"e": [12, 0, 25, 12, 27]},
    ),
    Case(
        "embedding, scale_grad_by_freq (autograd's derivative, taken densely)",
        on(TOKENS, lambda t, p: squash(F.embedding(t, p["e"], scale_grad_by_freq=True).sum(1))),
        {"e": (7, 4)},
        {"e": [12, 13, 0, 25]},
        reference="reverse",
    ),
    Case(
        "layer_norm weight and bias",
        on(X, lambda x, p: squash(F.layer_norm(x, (6,), p["w"], p["b"]))),
        {"w": (6,), "b": (6,)},
        {"w": [5, 0, 5, 2], "b": [1, 4]},
    ),
    Case(
        "group_norm weight and bias",
        on(IMAGES, lambda x, p: squash(F.group_norm(x, 2, p["w"], p["b"]))),
        {"w": (4,), "b": (4,)},
        {"w": [3, 0, 3], "b": [1, 2]},
    ),
    Case(
        "batch_norm weight and bias (batch statistics)",
        on(IMAGES, lambda x, p: squash(F.batch_norm(x, None, None, p["w"], p["b"], True))),
        {"w": (4,), "b": (4,)},
        {"w": [3, 0, 3], "b": [1, 2]},
    ),
    Case(
        "bias adds: x + b, b + x, torch.add(alpha=)",
        on(X, lambda x, p: squash(torch.tanh(x + p["b"]) + p["b"] + torch.add(x, p["b"], alpha=2))),
        {"b": (6,)},
        {"b": [5, 0, 5, 2]},
    ),
    Case(
        "views: reshape, view, permute, transpose, flatten, unsqueeze",
        on(
            X,
            lambda x, p: squash(
                x
                @ p["w"]
                .reshape(3, 2, 4)
                .permute(1, 0, 2)
                .transpose(1, 2)
                .flatten(1)
                .view(6, 4)[None]
                .squeeze(0)
            ),
        ),
        {"w": (6, 4)},
        {"w": W_INDEX},
    ),
    Case(
        "slices: W[1:, ::2], narrow, select",
        on(
            X,
            lambda x, p: (
                squash(x[:, :3] @ p["w"][1:, ::2].T)
                + squash(x @ p["w"].narrow(0, 2, 2).T)
                + squash(p["w"].select(1, 4) * 2)
            ),
        ),
        {"w": (4, 6)},
        {"w": W_INDEX},
    ),
    Case(
        "casts: to a float dtype a view; to an integer or bool dtype a constant (no derivative)",
        on(
            X,
            lambda x, p: (
                squash(x @ p["w"].double().to(torch.float64).T)
                + squash(x @ (p["w"] * 2).to(torch.int32).to(x.dtype).T)
                + squash(x @ p["w"].to(dtype=torch.int64).to(x).T)
                + squash(x @ (p["w"].to(TOKENS).to(x) * p["w"].to(torch.bool).to(x)).T)
            ),
        ),
        {"w": (4, 6)},
        {"w": W_INDEX},
    ),
    Case(  # W[:1] is (1, 1) with W's strides (1, 1): both its dims read as W's second (a
        # permutation [1, 1]), so that W[1, 0] was taken for W[0, 0]
        "a size-1 slice of a (2, 1) weight, W[:1], and of its transpose, W.T[:, :1]",
        on(X, lambda x, p: squash(x[:, :1] @ p["w"][:1]) + squash(x[:, :1] @ p["w"].T[:, :1])),
        {"w": (2, 1)},
        {"w": [1, 0, 1]},
    ),
    Case(
        "an empty slice of a selected tensor, W[1:] of a (1, 6) W",
        on(X, lambda x, p: squash(torch.cat([x @ p["w"][1:].T, x @ p["w"][:1].T], 1))),
        {"w": (1, 6)},
        {"w": [0, 5, 2]},
    ),
    Case(
        "a view called by keywords alone, torch.transpose(input=W, dim0=0, dim1=1)",
        on(X, lambda x, p: squash(x @ torch.transpose(input=p["w"], dim0=0, dim1=1))),
        {"w": (4, 6)},
        {"w": W_INDEX},
    ),
    Case(
        "chunk, split, unbind",
        on(
            X,
            lambda x, p: (
                sum(squash(x @ w.T) for w in p["w"].chunk(2))
                + sum(squash(x[:, :4] @ w) for w in p["w"].split(2, 1))
                + squash(torch.stack(p["w"].unbind(1), 0).sum(0))
            ),
        ),
        {"w": (4, 6)},
        {"w": W_INDEX},
    ),
]


def reference(case, loss, params, index):
    if case.reference == "reverse":
        return pyhvp.sub_hessian(loss, params, index, joint=True, method="reverse")
    return dense_sub_hessian(loss, params, index)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_each_injection_equals_the_dense_sub_hessian(case, device):
    loss, params, index = case.make(device)
    joint = pyhvp.sub_hessian(loss, params, index, joint=True, method="sparse")
    torch.testing.assert_close(joint, reference(case, loss, params, index), **F64)


PADDED_TABLES = {
    "the table itself (padding row 3: entries 12-15)": (lambda e: e, 12),
    "a view e[1:] (its padding row 3 is row 4 of e: entries 16-19)": (lambda e: e[1:], 17),
}  # fmt: skip


def test_a_mean_of_an_embeddings_output_takes_its_tangents_apart(monkeypatch):
    """The mean of the embedding's output is taken without its tangents, and theirs moved to the
    mean's positions: the reverse passes move ``k`` copies of the mean (a text classifier's
    tokens: 32x fewer), never of the output."""
    moved = []

    def spy(contribution, shape, dims, mean):
        moved.append((tuple(shape), tuple(dims), mean))
        return reduced(contribution, shape, dims, mean)

    monkeypatch.setattr(contributions, "reduced", spy)
    loss, params, index = next(c for c in CASES if c.name == "embedding").make("cpu")
    pyhvp.sub_hessian(
        loss, params, index, method="sparse", backend=pyhvp.TorchBackend(compile=False)
    )
    assert ((*TOKENS.shape, 4), (1,), True) in moved


@torch.jit.script
def scripted_mean(x: torch.Tensor) -> torch.Tensor:
    return x.mean(1)


def looked_at_without_grad(table):
    e = F.embedding(TOKENS, table)
    with torch.no_grad():
        count = e.size(1)
    return torch.tanh(e.sum(1) / count).pow(3).sum()


def target_without_grad(table):
    with torch.no_grad():
        target = F.embedding(TOKENS.roll(1, 1), table)
    return ((F.embedding(TOKENS, table) - target) ** 2).pow(2).sum()


EMBEDDING_USES = {  # where a reduction of an embedding's output may not take its tangents apart
    "its shape read under no_grad first": looked_at_without_grad,
    "a target made under no_grad": target_without_grad,
    "a TorchScript mean": lambda w: torch.tanh(scripted_mean(F.embedding(TOKENS, w))).pow(3).sum(),
    "a vmap over it": lambda w: torch.vmap(lambda r: r.pow(3).sum())(F.embedding(TOKENS, w)).sum(),
    "a sum of its 0-dim sum": lambda w: F.embedding(TOKENS, w).sum().sum(0) ** 2,
    "a sum in half precision": lambda w: torch.tanh(
        F.embedding(TOKENS, w).sum(1, dtype=torch.float16).double()).pow(3).sum(),
}  # fmt: skip


@pytest.mark.parametrize("loss", EMBEDDING_USES.values(), ids=EMBEDDING_USES.keys())
def test_an_embeddings_output_keeps_its_tangents_wherever_it_goes(loss):
    table = tensors((7, 4), seed=2)[0]
    index = torch.tensor([12, 0, 25, 12, 27])
    got = pyhvp.sub_hessian(loss, table, index, method="sparse")
    torch.testing.assert_close(got, dense_sub_hessian(loss, table, index), rtol=1e-9, atol=1e-11)


def written_through_data(table):
    e = F.embedding(TOKENS, table)
    e.data.mul_(2)  # a write autograd does not see: the value changes, the derivatives do not
    return torch.tanh(e.mean(1)).pow(3).sum() + torch.tanh(e[:, 0]).pow(3).sum()


def read_through_data(table):
    y = torch.tanh(F.embedding(TOKENS, table).sum(1))
    return (y * y.data).pow(2).sum()  # y.data: a constant to autograd


@pytest.mark.parametrize("loss", [written_through_data, read_through_data])
def test_data_of_a_value_made_from_a_selected_tensor_is_refused_and_auto_follows_autograd(loss):
    """``torch.func``, which the sparse route runs, differentiates through ``x.data`` where
    autograd takes it as a constant."""
    table = tensors((7, 4), seed=2)[0]
    index = torch.tensor([12, 0, 25, 12, 27])
    with pytest.raises(
        ValueError, match=r"method='sparse' does not apply: Tensor\.data of a value"
    ):
        pyhvp.sub_hessian(loss, table, index, method="sparse")
    expected = dense_sub_hessian(loss, table, index)
    for _ in range(8):  # past the trial
        got = pyhvp.sub_hessian(loss, table, index, backend=pyhvp.TorchBackend(compile=False))
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11)


@torch.jit.script
def scripted_quartic(w: torch.Tensor) -> torch.Tensor:
    return (w**4).sum()


class Cubed(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x**3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * grad


def attended(w):
    h = (X @ w)[None, None]
    return torch.tanh(F.scaled_dot_product_attention(h, h, h)).pow(2).sum()


UNSEEN_USES = {
    "a TorchScript function of W": lambda w: squash(X @ w) + scripted_quartic(w),
    "torch.vmap over W's columns": lambda w: torch.vmap(lambda c: squash(X @ c), 1)(w).sum(),
    "a custom autograd.Function of W": lambda w: squash(X @ w) + Cubed.apply(w).sum(),
    "a TorchScript function of a view, W.T": lambda w: squash(X @ w) + scripted_quartic(w.T[1:]),
    "a TorchScript function beside fused attention": lambda w: attended(w) + scripted_quartic(w),
}
"""Uses of a selected tensor that pyhvp's mode does not see (its ops never reach a
``TorchFunctionMode``, or reach it with a wrapper of the tensor): the sparse route would miss
their terms (it gave 96.2 and 9.9 off, the default ``"auto"`` 0.2 off on a seed-like model)."""


@pytest.mark.parametrize("loss", UNSEEN_USES.values(), ids=UNSEEN_USES.keys())
def test_a_use_the_mode_does_not_see_is_refused_and_auto_follows_autograd(loss):
    weight = tensors((6, 5), seed=2)[0]
    index = torch.tensor([0, 7, 29, 3, 12, 7, 21, 8])
    with pytest.raises(ValueError, match=r"params is used where pyhvp's mode does not see it"):
        pyhvp.sub_hessian(loss, weight, index, method="sparse")
    expected = dense_sub_hessian(loss, weight, index)
    for _ in range(8):  # past the trial
        got = pyhvp.sub_hessian(loss, weight, index, backend=pyhvp.TorchBackend(compile=False))
        torch.testing.assert_close(got, expected, **F64)


def test_a_use_the_mode_does_not_see_is_refused_whichever_entries_are_selected():
    """The routes are remembered per call signature, which holds how many entries are selected,
    not which: a scripted penalty on row 0 of the seed's weight refuses the tensor even where
    the entries first selected lie outside it (a check of those entries' values passed, and
    the next call's entries, from row 0 on, were 38 off)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(10, 784, generator=generator) * 0.05
    images, labels = torch.rand(100, 784, generator=generator), torch.randint(0, 10, (100,))

    def loss(w):
        return F.cross_entropy(images @ w.T, labels) + 1e3 * scripted_quartic(w[0, :100])

    pyhvp.sub_hessian(loss, weight, torch.arange(1000, 7840, 331))  # rows 1-9
    index = torch.arange(0, 7840, 331)[:21]  # from row 0 on, as many
    expected = pyhvp.sub_hessian(loss, weight, index, method="reverse")  # autograd's
    for _ in range(3):  # (the default backend keeps the cost model's routes: no trial)
        torch.testing.assert_close(pyhvp.sub_hessian(loss, weight, index), expected, rtol=1e-5,
                                   atol=1e-5)  # fmt: skip


def test_inside_vmap_auto_takes_the_reverse_route_where_the_mode_may_not_see_a_use():
    """Inside a ``torch.func`` transform the check of unseen uses cannot read its verdict, so
    ``"auto"`` takes the reverse route: on the seed's model with a TorchScript penalty the sparse
    route it took was 48.0 off (the largest entry: 48.0)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(10, 784, generator=generator)
    images = torch.rand(2, 100, 784, generator=generator)
    labels = torch.randint(0, 10, (100,), generator=generator)
    index = torch.arange(0, 7840, 331)

    def loss_of(x):
        return lambda w: F.cross_entropy(x @ w.T, labels) + scripted_quartic(w)

    got = torch.vmap(lambda x: pyhvp.sub_hessian(loss_of(x), weight, index))(images)
    # autograd's, per image (a dense Hessian of 7840 entries takes seconds)
    expected = [pyhvp.sub_hessian(loss_of(x), weight, index, method="reverse") for x in images]
    torch.testing.assert_close(got, torch.stack(expected), rtol=1e-5, atol=1e-5)


MOVES_ITS_MODEL = """
import sys
import torch, pyhvp
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1)).double()
model.eval()
x = torch.randn(5, 3, dtype=torch.float64)
def loss(w):
    model.to(w.device)
    return torch.func.functional_call(model, {"0.weight": w}, (x,)).square().sum()
w, index = model[0].weight.detach().clone(), torch.tensor([0, 5, 7])
backend = pyhvp.TorchBackend(compile=sys.argv[1] == "compiled")
expected = pyhvp.sub_hessian(loss, w, index, method="reverse")
for _ in range(2):
    got = pyhvp.sub_hessian(loss, w, index, method="sparse", backend=backend)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11)
model(x)
print("done")
"""


@pytest.mark.parametrize("kernel", ["eager", "compiled"])
def test_a_loss_that_moves_its_model_to_its_device_leaves_the_model_usable(kernel):
    """``model.to(w.device)`` in the loss, a no-op move: under the ``torch.func`` transforms of
    the sparse route torch returns a wrapper of each parameter and buffer, which ``Module.to``
    kept in the model, so its next use segfaulted (torch 2.5.1 to 2.14.1, pytorch#184876) --
    checked in a subprocess, as a segfault cannot be caught."""
    done = subprocess.run([sys.executable, "-c", MOVES_ITS_MODEL, kernel], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert (done.returncode, done.stdout.strip()) == (0, "done"), done.stderr[-2000:]


def written_after_a_mean(p):
    """An embedding's output reduced, then written in place, then used again: the reduction
    sees it before the write, the later uses after."""
    e = F.embedding(TOKENS.to(p["e"].device), p["e"])
    before = squash(e.mean(1))
    e.mul_(2)
    return before + squash(e.mean(1)) + squash(e[:, 0])


def test_a_write_in_place_after_a_reduction_is_seen_by_the_later_uses_only(device):
    params = {"e": tensors((7, 4), seed=2)[0].to(device)}
    index = {"e": torch.tensor([12, 0, 25, 12, 27], device=device)}
    expected = dense_sub_hessian(written_after_a_mean, params, index)
    got = pyhvp.sub_hessian(written_after_a_mean, params, index, method="sparse")
    torch.testing.assert_close(got["e"], expected, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("table", PADDED_TABLES.values(), ids=PADDED_TABLES.keys())
def test_entries_in_an_embeddings_padding_row_take_the_reverse_route(table):
    """Autograd's derivative in a ``padding_idx`` row is zero (the seed's loop's convention), the
    sparse rule's would be the true one: such a selection is refused there, and ``"auto"``
    takes the reverse route for it. Through a view, the row is the view's (it was e's own:
    the sparse route then served e[1:]'s padding row, wrongly)."""
    view, padded_entry = table
    loss = on(TOKENS, lambda t, p: squash(F.embedding(t, view(p["e"]), padding_idx=3).sum(1)))
    params = {"e": torch.randn(8, 4, dtype=torch.float64)}
    with pytest.raises(ValueError, match="padding_idx row"):
        pyhvp.sub_hessian(loss, params, {"e": torch.tensor([padded_entry, 0])}, method="sparse")
    index = {"e": torch.tensor([padded_entry, 0, 13, 5, 25, 1, 2, 3])}
    auto = pyhvp.sub_hessian(loss, params, index)
    torch.testing.assert_close(auto, pyhvp.sub_hessian(loss, params, index, method="reverse"),
                               **F64)  # fmt: skip


@pytest.mark.parametrize("case", CASES[:20:3], ids=lambda c: c.name)
def test_blocks_and_chunks_of_an_injection_equal_the_dense_blocks(case, device):
    loss, params, index = case.make(device)
    blocks = pyhvp.sub_hessian(loss, params, index, method="sparse", chunk_size=2)
    expected = {name: dense_sub_hessian(loss, params, {name: flat}) for name, flat in index.items()}
    torch.testing.assert_close(blocks, expected, **F64)


def lenet():
    """LeNet-5's layers, small: 12x12 -> conv 3x3 -> 10x10 -> max-pool -> 5x5 -> conv 3x3
    (padded) -> 5x5 -> average-pool -> 2x2."""
    return nn.Sequential(
        nn.Conv2d(1, 3, 3),
        nn.Tanh(),
        nn.MaxPool2d(2),
        nn.Conv2d(3, 4, 3, padding=1),
        nn.Tanh(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(16, 5),
        nn.Tanh(),
        nn.Linear(5, 3),
    )


class Text(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding, self.fc = nn.Embedding(9, 4, padding_idx=0), nn.Linear(4, 3)

    def forward(self, tokens):
        return self.fc(torch.tanh(self.embedding(tokens).mean(1)))


class Attention(nn.Module):
    def __init__(self, d=4, heads=2):
        super().__init__()
        self.heads, self.qkv, self.norm = heads, nn.Linear(d, 3 * d), nn.LayerNorm(d)
        self.mlp, self.head = (
            nn.Sequential(nn.Linear(d, 8), nn.GELU(), nn.Linear(8, d)),
            nn.Linear(d, 3),
        )

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5, -1)
        x = self.norm(x + (att @ v).transpose(1, 2).reshape(b, s, d))
        return self.head((x + self.mlp(x)).mean(1))


@dataclass
class ModelCase:
    name: str
    model: object
    inputs: object
    low: int = 0  # the smallest flat index selected (above an embedding's padding row)


MODELS = [
    ModelCase("small LeNet", lenet, lambda: torch.rand(6, 1, 12, 12, dtype=torch.float64)),
    ModelCase("embedding classifier", Text, lambda: torch.randint(0, 9, (6, 5)), low=4),
    ModelCase("attention block", Attention, lambda: torch.randn(3, 5, 4, dtype=torch.float64)),
]


@pytest.mark.parametrize("method", ["sparse", "auto"])
@pytest.mark.parametrize("case", MODELS, ids=lambda c: c.name)
def test_models_match_the_seed_loop_on_every_tensor(case, method, device):
    torch.manual_seed(4)
    model = case.model().double().to(device)
    inputs = case.inputs().to(device)
    targets = torch.randint(0, 3, (inputs.shape[0],), device=device)
    index = {
        name: torch.randint(min(case.low, p.numel() - 1), p.numel(), (5,), device=device)
        for name, p in model.named_parameters()
    }
    loss, params = pyhvp.module_loss(model, nn.CrossEntropyLoss(), inputs, targets)
    blocks = pyhvp.sub_hessian(loss, params, index, method=method)
    expected = loop_sub_hessians(model, nn.CrossEntropyLoss(), inputs, targets, index)
    torch.testing.assert_close(blocks, expected, **F64)


@pytest.mark.parametrize("case", MODELS, ids=lambda c: c.name)
def test_models_joint_over_batches_equal_the_dense_sub_hessian(case, device):
    torch.manual_seed(5)
    model = case.model().double().to(device)
    batches = [
        (case.inputs().to(device), torch.randint(0, 3, (6,), device=device)[:n]) for n in (3, 2)
    ]
    batches = [(x[: len(t)], t) for x, t in batches]
    index = {
        name: torch.randint(min(case.low, p.numel() - 1), p.numel(), (3,), device=device)
        for name, p in model.named_parameters()
    }
    loss, params = pyhvp.module_loss(model, nn.CrossEntropyLoss(reduction="sum"))
    got = pyhvp.sub_hessian(
        loss, params, index, data=batches, joint=True, method="sparse", progress=True
    )
    expected = sum(dense_sub_hessian(lambda p, b=b: loss(p, b), params, index) for b in batches)
    torch.testing.assert_close(got, expected, **F64)


# --- refusals ------------------------------------------------------------------------------

BIG = torch.randn(70, 70, dtype=torch.float64)  # 4900 entries: over DENSE_LIMIT
X70 = torch.randn(3, 70, dtype=torch.float64)


@pytest.mark.parametrize(
    ("loss", "named"),
    [
        (lambda p: torch.cdist(X70, p["w"]).sum(), "torch.cdist"),
        (lambda p: torch.cdist(X70, p["w"].T).sum(), "torch.cdist"),
        (lambda p: torch.linalg.matrix_norm(p["w"]), "torch.linalg.matrix_norm"),
        (lambda p: (p["w"].exp_() * 1).sum(), "Tensor.exp_"),
    ],
    ids=["cdist", "cdist of W.T", "linalg", "an in-place write"],
)
def test_a_forced_sparse_route_it_does_not_cover_names_the_op_and_the_route_taken(loss, named):
    with pytest.raises(ValueError, match=rf"params\['w'\].*{named}.*reverse route") as error:
        pyhvp.sub_hessian(loss, {"w": BIG.clone()}, {"w": torch.tensor([0, 5])}, method="sparse")
    assert "getset_descriptor" not in str(error.value)


STORAGE = torch.randn(40, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
NOT_FROM_THE_STORAGES_START = {
    "transposed": STORAGE[:24].view(6, 4).T,
    "at an offset": STORAGE[3:27].view(4, 6),
}
STRIDED_READ = (3, 4), (1, 5)  # as_strided's size and strides, from the tensor's own offset


@pytest.mark.parametrize(
    "w", NOT_FROM_THE_STORAGES_START.values(), ids=NOT_FROM_THE_STORAGES_START.keys()
)
def test_as_strided_of_a_tensor_not_contiguous_from_its_storages_start_follows_autograd(w):
    """``as_strided`` reads memory: the sparse route's stand-ins for ``w`` (contiguous, offset
    0) would read other entries. The sparse route refuses it; ``"auto"`` is autograd's."""

    def loss(p):
        return squash(X[:, :3] @ p["w"].as_strided(*STRIDED_READ))

    params, index = {"w": w}, {"w": torch.tensor([0, 5, 11, 2, 7, 13])}
    with pytest.raises(ValueError, match=r"params\['w'\] is read by Tensor.as_strided"):
        pyhvp.sub_hessian(loss, params, index, method="sparse")
    H = pyhvp.sub_hessian(loss, params, index)
    torch.testing.assert_close(H["w"], dense_sub_hessian(loss, params, index), **F64)


AS_STRIDED_READS = {  # the selected tensor (its own storage), and the loss's read of it
    "of a transposed tensor": (
        STORAGE[:24].view(6, 4).clone().T,
        lambda w: w.as_strided((3, 4), (1, 5)),
    ),
    "at offset 2 of a contiguous tensor's storage": (
        STORAGE[:24].view(4, 6).clone(),
        lambda w: w.as_strided((3, 4), (1, 5), 2),
    ),
}


@pytest.mark.parametrize("method", ["auto", "reverse", "forward"])
@pytest.mark.parametrize(("w", "read"), AS_STRIDED_READS.values(), ids=AS_STRIDED_READS.keys())
def test_joint_blocks_of_a_loss_reading_memory_are_of_the_tensors_own_layout(w, read, method):
    """Joint, the reverse route passes the loss its tensors from ONE vector: each is laid out
    as the tensor it stands for, not a view at its offset in the vector (whose memory holds the
    tensors before it)."""
    params = {"a": STORAGE[:3].clone(), "w": w}

    def loss(p):
        return squash(p["a"] * (X[:, :3] @ read(p["w"])).sum(-1, keepdim=True))

    index = {"a": torch.tensor([2, 0]), "w": torch.tensor([0, 5, 11, 2, 7, 13])}
    H = pyhvp.sub_hessian(loss, params, index, joint=True, method=method)
    torch.testing.assert_close(H, dense_sub_hessian(loss, params, index), **F64)


def test_a_nan_adjoint_elsewhere_is_refused_by_the_sparse_route_and_auto_gives_autograds():
    """``where(h > 0, sqrt(h), 0)`` has NaN adjoints at the masked entries; a dense contraction
    of the directions (a layer of at most 16 outputs) reached them all: a block all NaN, where
    autograd's rows of the other entries are finite."""
    x = torch.linspace(0.5, 1.5, 6, dtype=torch.float64)[None]
    w = torch.ones(3, 6, dtype=torch.float64) * torch.tensor([[1.0], [-1.0], [1.0]])  # h[1] < 0

    def loss(p):
        h = F.linear(x, p["w"])
        return (torch.where(h > 0, h.sqrt(), 0.0) ** 3).sum()

    params, index = {"w": w}, {"w": torch.tensor([*range(6), *range(12, 18)])}  # rows 0, 2
    eager = pyhvp.TorchBackend(compile=False)
    with pytest.raises(ValueError, match="not finite"):
        pyhvp.sub_hessian(loss, params, index, method="sparse", backend=eager)
    expected = dense_sub_hessian(loss, params, index)
    assert bool(expected.isfinite().all())
    for _ in range(12):  # past the trial
        got = pyhvp.sub_hessian(loss, params, index, backend=eager)["w"]
        torch.testing.assert_close(got, expected, **F64)


MAX_NORM_CALLS = {
    "sparse": ("sparse", torch.arange(2), True),
    "auto, surveyed (12 components)": ("auto", torch.arange(12), True),
    "auto, 2 components (not surveyed)": ("auto", torch.arange(2), False),
    "reverse": ("reverse", torch.arange(12), False),
}  # fmt: skip
"""An embedding's ``max_norm`` renormalises the selected table under ``no_grad``, which
autograd allows (every route ran it, and params changed silently): refused on every route,
before the write where the loss is surveyed."""


SPARSE_GRADIENT_CALLS = {
    "sparse": ("sparse", [12, 0, 25, 12, 27]),
    "auto, surveyed": ("auto", [12, 0, 25, 12, 27, 5, 6, 1, 2]),
    "auto, 2 components (the seed's loop)": ("auto", [25, 12]),
    "reverse": ("reverse", [12, 0, 25, 12, 27]),
}  # fmt: skip
"""``embedding(sparse=True)`` makes autograd's gradient of the table a sparse tensor, with the
values of ``sparse=False``: the sparse rule, the reverse route and the seed's loop (which
``torch.func`` cannot run it through) give the same matrix."""


SPARSE_EMBEDDINGS = {
    "F.embedding (as nn.Embedding calls it)": lambda t, e, sparse: F.embedding(t, e, sparse=sparse),
    "torch.embedding, positional": lambda t, e, sparse: torch.embedding(e, t, -1, False, sparse),
}  # fmt: skip
"""``torch.embedding`` has no sparse rule (``method="sparse"`` refuses it, as any op without
one): the other routes take it."""


@pytest.mark.parametrize(
    ("call", "embedding"),
    [(call, SPARSE_EMBEDDINGS[form]) for call in SPARSE_GRADIENT_CALLS.values()
     for form in SPARSE_EMBEDDINGS if call[0] != "sparse" or form.startswith("F.")],
    ids=[f"{name}, {form}" for name, call in SPARSE_GRADIENT_CALLS.items()
         for form in SPARSE_EMBEDDINGS if call[0] != "sparse" or form.startswith("F.")],
)  # fmt: skip
def test_an_embedding_with_sparse_gradients_has_the_sub_hessian_of_a_dense_one(call, embedding):
    method, entries = call

    def loss(sparse):
        return on(TOKENS, lambda t, p: squash(embedding(t, p["e"], sparse).mean(1)))

    (table,) = tensors((7, 4), seed=2)
    index = {"e": torch.tensor(entries)}
    got = pyhvp.sub_hessian(loss(True), {"e": table}, index, joint=True, method=method)
    torch.testing.assert_close(got, dense_sub_hessian(loss(False), {"e": table}, index), **F64)


@pytest.mark.parametrize(
    ("method", "entries"),
    [("sparse", [0, 7, 35, 7]), ("reverse", [0, 7, 35, 7]), ("auto", [3, 20])],
    ids=["sparse", "reverse", "auto, 2 components (the seed's loop)"],
)
def test_a_loss_through_fused_attention_has_its_dense_sub_hessian(method, entries):
    """``scaled_dot_product_attention`` runs a fused kernel on the CPU (flash), which has no
    second derivative: every route takes its math path, the same values."""

    def heads(t):
        return t.unflatten(-1, (2, 3)).transpose(-3, -2)

    loss = on(X3, lambda x, p: F.scaled_dot_product_attention(
        heads(x @ p["q"]), heads(x @ p["k"]), heads(x)).pow(2).sum())  # fmt: skip
    params = dict(zip("qk", tensors((6, 6), (6, 6), seed=2), strict=True))
    index = {"q": torch.tensor(entries), "k": torch.tensor(entries[::-1])}
    got = pyhvp.sub_hessian(loss, params, index, joint=True, method=method)
    torch.testing.assert_close(got, dense_sub_hessian(loss, params, index), **F64)


BAG_TOKENS = torch.tensor([3, 0, 6, 6, 2, 5, 1, 2, 4])
BAG_STARTS = [0, 3, 3, 7]  # a repeated token, an empty bag
BAG_WEIGHTS = torch.rand(9, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
EMBEDDING_BAGS = {
    "mean": ({"mode": "mean"}, lambda rows: rows.mean(0)),
    "sum with per-sample weights": ({"mode": "sum", "per_sample_weights": BAG_WEIGHTS},
                                    lambda rows: rows.sum(0)),
    "max": ({"mode": "max"}, lambda rows: rows.amax(0)),
    "mean without padding tokens": ({"mode": "mean", "padding_idx": 6}, lambda rows: rows.mean(0)),
}  # fmt: skip
"""``F.embedding_bag`` options, and each bag's pooling of its tokens' rows written by hand (the
rows already weighted, padding tokens dropped; an empty bag is zeros), with ``sparse=True``
too but for ``"max"``, which torch refuses so."""
BAGS = [(bag, sparse) for name, bag in EMBEDDING_BAGS.items()
        for sparse in ([False] if name == "max" else [False, True])]  # fmt: skip
BAG_IDS = [f"{name}{', sparse gradients' if sparse else ''}" for name in EMBEDDING_BAGS
           for sparse in ([False] if name == "max" else [False, True])]  # fmt: skip


def bags_by_hand(table, sparse, options, pool):
    """``F.embedding_bag(BAG_TOKENS, table, BAG_STARTS, sparse=sparse, **options)`` as a loop
    over bags, in which autograd can differentiate twice."""
    weights = options.get("per_sample_weights", torch.ones(len(BAG_TOKENS), dtype=table.dtype))
    pooled = []
    for start, end in zip(BAG_STARTS, [*BAG_STARTS[1:], len(BAG_TOKENS)], strict=True):
        kept = [i for i in range(start, end) if BAG_TOKENS[i] != options.get("padding_idx")]
        rows = table[BAG_TOKENS[kept]] * weights[kept].reshape(-1, 1)
        pooled.append(pool(rows) if kept else table.new_zeros(table.shape[1]))
    return torch.stack(pooled)


@pytest.mark.parametrize("call", SPARSE_GRADIENT_CALLS.values(), ids=SPARSE_GRADIENT_CALLS.keys())
@pytest.mark.parametrize(("bag", "sparse"), BAGS, ids=BAG_IDS)
def test_an_embedding_bag_has_the_sub_hessian_of_its_bags_pooled_by_hand(bag, sparse, call):
    """``embedding_bag``'s backward has no derivative in autograd: the seed's loop runs it as an
    embedding and a pooling per bag; the sparse route (a forced one raises) leaves it to the
    loop."""
    method, entries = call
    options, pool = bag
    (table,) = tensors((7, 4), seed=2)
    index = {"e": torch.tensor(entries)}

    def bags(p):
        starts = torch.tensor(BAG_STARTS)
        return squash(F.embedding_bag(BAG_TOKENS, p["e"], starts, sparse=sparse, **options))

    if method == "sparse":
        with pytest.raises(ValueError, match=r"method='sparse' does not apply: its kernels"):
            pyhvp.sub_hessian(bags, {"e": table}, index, method=method)
        return
    expected = dense_sub_hessian(lambda p: squash(bags_by_hand(p["e"], sparse, options, pool)),
                                 {"e": table}, index)  # fmt: skip
    got = pyhvp.sub_hessian(bags, {"e": table}, index, joint=True, method=method)
    torch.testing.assert_close(got, expected, **F64)


BAG_LAYOUTS = {
    "offsets": (BAG_TOKENS, {"offsets": torch.tensor(BAG_STARTS)}),
    "offsets with the last one closing": (
        BAG_TOKENS, {"offsets": torch.tensor([*BAG_STARTS, 9]), "include_last_offset": True},
    ),
    "int32 offsets": (BAG_TOKENS, {"offsets": torch.tensor(BAG_STARTS, dtype=torch.int32)}),
    "one bag per row": (BAG_TOKENS[:8].reshape(2, 4), {}),
    "no tokens (its double backward crashed)": (BAG_TOKENS[:0], {"offsets": torch.tensor([0, 0])}),
    "no rows": (BAG_TOKENS[:0].reshape(0, 4), {}),
}  # fmt: skip


BAGS_OUTSIDE_TORCHS_CONTRACT = {
    "offsets not from 0": (BAG_TOKENS, {"offsets": torch.tensor([1, 3])}, "start at 0, got 1"),
    "unsorted offsets": (BAG_TOKENS, {"offsets": torch.tensor([0, 5, 2])}, "must be sorted"),
    "the last offset short of the input": (
        BAG_TOKENS, {"offsets": torch.tensor([0, 2, 6]), "include_last_offset": True},
        "must end at the input's length 9, got 6"),
    "2-D offsets": (BAG_TOKENS, {"offsets": torch.tensor([[0, 2]])}, "must be 1-D"),
    "rows of no tokens": (BAG_TOKENS[:0].reshape(3, 0), {}, "bags of no tokens"),
    "no rows of no tokens": (BAG_TOKENS[:0].reshape(0, 0), {}, "bags of no tokens"),
    "offsets past the input": (
        BAG_TOKENS[:4], {"offsets": torch.tensor([0, 2, 6])}, "must not pass the input's length 4"),
    "no offsets for tokens": (
        BAG_TOKENS, {"offsets": torch.tensor([], dtype=torch.long)}, "offsets are empty"),
}  # fmt: skip
"""Bags whose values torch's kernels make up (or refuse), with the rewrite's refusal: it
differentiated another function silently (the last offset short: 0.37 off)."""


@pytest.mark.parametrize("case", BAGS_OUTSIDE_TORCHS_CONTRACT.values(),
                         ids=BAGS_OUTSIDE_TORCHS_CONTRACT.keys())  # fmt: skip
def test_the_loops_embedding_bag_refuses_bags_outside_torchs_contract(case):
    tokens, where, message = case
    (table,) = tensors((7, 4), seed=2)
    with pytest.raises(ValueError, match=re.escape(message)):
        embedding_bag_by_embedding(tokens, table, **where)


def test_an_embedding_bag_bound_before_the_call_is_told_to_go_through_the_module():
    """sub_hessian replaces torch.nn.functional.embedding_bag while the loss runs (a function
    mode cost every op), so a name bound before is torch's own: its backward has no
    derivative, said with the way out."""
    bound = F.embedding_bag
    (table,) = tensors((7, 4), seed=2)

    def loss(weight):
        return bound(BAG_TOKENS, weight, torch.tensor([0, 4])).tanh().pow(2).sum()

    with pytest.raises(NotImplementedError) as info:
        pyhvp.sub_hessian(loss, table, torch.arange(3), backend=pyhvp.TorchBackend(compile=False))
    assert "call it through the module" in str(info.value) + "".join(
        getattr(info.value, "__notes__", ())
    )


BAGS_TORCH_REFUSES = {
    "per-sample weights with a mean": (BAG_TOKENS, {
        "offsets": torch.tensor([0, 4]), "mode": "mean", "per_sample_weights": torch.ones(9)},
        NotImplementedError),
    "mode 'prod'": (BAG_TOKENS, {"offsets": torch.tensor([0, 4]), "mode": "prod"}, ValueError),
    "offsets with a 2-D input": (
        BAG_TOKENS.reshape(3, 3), {"offsets": torch.tensor([0, 1])}, ValueError),
}  # fmt: skip
"""Calls of ``F.embedding_bag`` torch refuses (tokens, keyword arguments, the error's type)."""


@pytest.mark.parametrize("case", BAGS_TORCH_REFUSES.values(), ids=BAGS_TORCH_REFUSES.keys())
@pytest.mark.parametrize("method", ["auto", "reverse"])
def test_a_call_of_embedding_bag_torch_refuses_is_refused_by_every_route(method, case):
    """The seed's loop and the batched reverse kernel run embedding bags rewritten as an
    embedding and a pooling, which computed values for calls torch refuses (a 'prod' mode as a
    sum): torch's own op checks the arguments first."""
    tokens, where, error = case
    (table,) = tensors((7, 4), seed=2)

    def loss(weight):
        return F.embedding_bag(tokens, weight, **where).tanh().pow(2).sum()

    with pytest.raises(error):
        pyhvp.sub_hessian(loss, table, torch.arange(5), method=method,
                          backend=pyhvp.TorchBackend(compile=False))  # fmt: skip


@pytest.mark.parametrize(
    "options",
    [{"mode": m} for m in ("sum", "mean", "max")]
    + [{"padding_idx": -1}, {"per_sample_weights": True, "mode": "sum"}],
    ids=["sum", "mean", "max", "negative padding_idx", "per-sample weights"],
)
@pytest.mark.parametrize("layout", BAG_LAYOUTS.values(), ids=BAG_LAYOUTS.keys())
def test_the_loops_embedding_bag_has_torchs_values_and_gradient(layout, options):
    tokens, where = layout
    options = dict(options)
    if options.get("per_sample_weights"):
        options["per_sample_weights"] = torch.rand(tokens.shape, dtype=torch.float64)
    (table,) = tensors((7, 4), seed=2)
    table.requires_grad_()
    got = embedding_bag_by_embedding(tokens, table, **where, **options)
    expected = F.embedding_bag(tokens, table, **where, **options)
    gradients = [torch.autograd.grad(y.sin().sum(), table)[0] for y in (got, expected)]
    torch.testing.assert_close((got, gradients[0]), (expected, gradients[1]), **F64)


TIED_TABLE = torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 2.0]], dtype=torch.float64)
"""A zero-initialised table's rows (a bag's maximum at 0.0) and a tie between rows 0 and 1."""


def test_the_loops_embedding_bag_max_reaches_the_first_token_at_a_tie_as_torchs():
    """A pooling that split a tie between rows (and with its base of zeros) had half the
    gradient and a quarter of the Hessian at a maximum of 0.0."""
    tokens, starts = torch.tensor([0, 1, 2, 1, 3]), torch.tensor([0, 2, 3])
    table = TIED_TABLE.clone().requires_grad_()
    weights = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.float64)
    gradients = [torch.autograd.grad((pool(tokens, table, starts, mode="max") * weights).sum(),
                                     table)[0]
                 for pool in (embedding_bag_by_embedding, F.embedding_bag)]  # fmt: skip
    torch.testing.assert_close(gradients[0], gradients[1], **F64)


def test_an_embedding_bag_with_scale_grad_by_freq_is_refused_by_name():
    loss = on(TOKENS, lambda t, p: squash(F.embedding_bag(t, p["e"], scale_grad_by_freq=True)))
    (table,) = tensors((7, 4), seed=2)
    with pytest.raises(ValueError, match="embedding_bag with scale_grad_by_freq=True"):
        pyhvp.sub_hessian(loss, {"e": table}, {"e": torch.tensor([0, 5])})


@pytest.mark.parametrize("call", MAX_NORM_CALLS.values(), ids=MAX_NORM_CALLS.keys())
def test_embedding_with_max_norm_is_refused_as_a_write_to_params(call):
    method, index, before_the_write = call
    loss = on(TOKENS, lambda t, p: torch.tanh(F.embedding(t, p["e"], max_norm=1.0)).pow(2).sum())
    table = 3 * torch.randn(7, 4, dtype=torch.float64)
    given = table.clone()
    with pytest.raises(ValueError, match=r"params\['e'\] .*(max_norm|under no_grad)"):
        pyhvp.sub_hessian(loss, {"e": table}, {"e": index}, method=method)
    assert torch.equal(table, given) == before_the_write


@pytest.mark.parametrize(
    ("func", "name"),
    [
        (torch.Tensor.T.__get__, "W.T"),
        (torch.Tensor.mT.__get__, "W.mT"),
        (torch.einsum, "torch.einsum"),
        (F.conv2d, "torch.nn.functional.conv2d"),
        (torch.Tensor.mm, "Tensor.mm"),
        (torch.Tensor.__matmul__, "@ (__matmul__)"),
    ],
)
def test_ops_are_named_as_the_user_wrote_them(func, name):
    assert describe(func) == name


# --- compiled --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        c
        for c in CASES
        if c.name
        in (
            "x @ W.T",
            "einsum bi,oi->bo",
            "conv1d",
            "embedding",
            "layer_norm weight and bias",
            "mm(x, W.t())",
        )
    ],
    ids=lambda c: c.name,
)
def test_the_compiled_injection_equals_the_dense_sub_hessian(case, device, recwarn):
    """Compiled from the first call, twice; no warning (a compiled kernel that disagreed with
    eager's first result would warn). ``W.T`` is a tensor property, which dynamo traces past the
    mode on torch 2.13: its kernel runs eagerly there, still without a warning."""
    if not pyhvp.restricted.compiles():
        pytest.skip("this torch's dynamo drops the mode")
    loss, params, index = case.make(device)
    backend = pyhvp.TorchBackend(compile=True)
    calls = [
        pyhvp.sub_hessian(loss, params, index, joint=True, method="sparse", backend=backend)
        for _ in range(2)
    ]
    for got in calls:
        torch.testing.assert_close(got, dense_sub_hessian(loss, params, index), **F64)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


WIDE_X = tensors((3, 1300), seed=3)[0]
"""Inputs for a weight of 5 x 1300 entries, over :data:`~pyhvp.restricted.DENSE_LIMIT`: a use
without a sparse rule would be refused, not entered densely."""

PROPERTY_VIEWS = {
    "x @ W.T": lambda p: squash(WIDE_X @ p["w"].T),
    "x @ W.mT": lambda p: squash(WIDE_X @ p["w"].mT),
    "x @ W.T[1:] (a view of the property)": lambda p: squash(WIDE_X[:, 1:] @ p["w"].T[1:]),
}


@pytest.mark.parametrize("loss", PROPERTY_VIEWS.values(), ids=PROPERTY_VIEWS.keys())
def test_a_wide_tensor_viewed_through_a_property_takes_the_sparse_route_compiled(loss):
    """``compile=True``, forced sparse: compiled where dynamo hands the property to the mode
    (torch 2.14, as ``aten.numpy_T``, ``aten.mT``; 2.13 with the handlers pyhvp lends it),
    eagerly where it would trace it past the mode; both give the dense sub-Hessian."""
    (w,) = tensors((5, 1300), seed=4)
    index = {"w": torch.tensor([4, 1300, 2, 4, 6499])}
    got = pyhvp.sub_hessian(loss, {"w": w}, index, method="sparse", joint=True,
                            backend=pyhvp.TorchBackend(compile=True))  # fmt: skip
    torch.testing.assert_close(got, dense_sub_hessian(loss, {"w": w}, index), **F64)


def test_a_property_views_kernel_compiles_whole_exactly_where_dynamo_hands_it_to_the_mode(
    compiled,
):
    """Compiled in one graph where dynamo hands ``W.T`` to the mode as ``aten.numpy_T`` (torch
    2.14, and 2.13 with the handlers pyhvp lends it; a graph break there ran the loss eagerly:
    4.3 ms a call where whole takes 0.6); never compiled where dynamo would trace it past the
    mode (``W.T`` would be a constant): :func:`pyhvp.restricted.compiles_property_views`."""
    expected = pyhvp.restricted.compiles_property_views()  # its probe compiles before the count
    compiled.clear()
    counters.clear()
    (w,) = tensors((5, 1300), seed=4)
    pyhvp.sub_hessian(PROPERTY_VIEWS["x @ W.T"], {"w": w}, {"w": torch.arange(8)},
                      method="sparse", backend=pyhvp.TorchBackend(compile=True))  # fmt: skip
    assert (len(compiled) == 1 and not counters["graph_break"]) == expected


def test_a_property_view_compiles_on_every_torch_that_compiles_the_sparse_kernel():
    """Torch 2.13's dynamo traces ``W.T`` past the mode; the handlers pyhvp lends it while its
    kernels trace make it hand ``W.T`` to the mode as 2.14 does, so ``x @ W.T`` compiles
    wherever ``F.linear`` does (on 2.13 it ran eagerly: the seed's model written with ``W.T``,
    k = 16, took 0.54x the seed's loop where ``mm(X, W.t())`` took 0.22x)."""
    assert pyhvp.restricted.compiles_property_views() == pyhvp.restricted.compiles()


def test_dynamo_traces_the_users_own_code_as_before_once_a_kernel_over_w_t_ran():
    """The handlers are lent only while pyhvp's sparse kernels run: dynamo's ``TensorVariable``
    has them after a compiled ``x @ W.T`` sub-Hessian exactly where it had them before."""
    from torch._dynamo.variables.tensor import TensorVariable

    before = {name: hasattr(TensorVariable, f"method_attr_{name}") for name in ("T", "mT", "H")}
    (w,) = tensors((5, 1300), seed=4)
    pyhvp.sub_hessian(PROPERTY_VIEWS["x @ W.T"], {"w": w}, {"w": torch.arange(8)},
                      method="sparse", backend=pyhvp.TorchBackend(compile=True))  # fmt: skip
    assert {name: hasattr(TensorVariable, f"method_attr_{name}") for name in before} == before


# --- how a placed tangent enters ----------------------------------------------------------


def test_placed_tangents_that_carry_the_passes_directions_enter_by_index_add():
    """Each entry's tangent placed at one of a few positions (a linear layer's 3 outputs):
    constant in the pass, as one dense ``(k, *out)`` matrix (a product per direction); where it
    depends on ``z`` (an input carrying another tensor's directions), by ``index_add``, which
    does not build that matrix per direction. Both add the same."""
    out = torch.zeros(5, 3, dtype=torch.float64)
    z = torch.tensor([2.0, -1.0], dtype=torch.float64, requires_grad=True)
    values = torch.randn(2, 5, dtype=torch.float64)  # entries (o=0, .) and (o=2, .) over 5 rows
    placed = Contribution(1, torch.tensor([0, 2]), values)
    constant = inject(out, z, placed, batch=8)
    scale = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)  # stands for a direction
    carried = inject(out, z, placed._replace(values=values * scale), batch=8)
    assert constant.grad_fn.name() == "AddBackward0"
    assert carried.grad_fn.name() == "IndexAddBackward0"
    expected = torch.zeros(5, 3, dtype=torch.float64)
    expected[:, 0], expected[:, 2] = 2 * values[0], -values[1]
    torch.testing.assert_close(constant, expected, **F64)
    torch.testing.assert_close(carried, 2 * expected, **F64)
