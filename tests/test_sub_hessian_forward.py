"""Specification of sub_hessian's forward-tangent route (``method="forward"``): every op the
sparse route's specs cover, and the networks below, give the dense float64 sub-Hessian, joint and
per tensor, on every device; what it cannot follow as autograd does is refused by name when
forced, and served by the other routes under ``"auto"``."""

import logging

import pytest
import torch
import torch.nn.functional as F
from dense import dense_sub_hessian
from test_sub_hessian_sparse_ops import CASES as OP_CASES
from test_sub_hessian_sparse_ops import lenet, reference, squash
from torch import nn

import pyhvp
from pyhvp import submatrix
from pyhvp.restricted import closed_forms, forward, routes

F64 = {"rtol": 1e-9, "atol": 1e-11}
EAGER = pyhvp.TorchBackend(compile=False)


def per_tensor(expected, index):
    """The diagonal blocks of a joint matrix, by name."""
    blocks, start = {}, 0
    for name, flat in index.items():
        blocks[name] = expected[start : start + len(flat), start : start + len(flat)]
        start += len(flat)
    return blocks


RUNS = {"the loss run once": 1 << 62, "run twice": 0}
"""routes.TWICE_FROM: every spec runs both ways, but those of the two runs alone (``twice``)."""


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("twice") is None:
        metafunc.parametrize("runs", RUNS.values(), ids=RUNS.keys(), indirect=True)


@pytest.fixture(autouse=True)
def runs(request, monkeypatch):
    monkeypatch.setattr(routes, "TWICE_FROM", getattr(request, "param", 0))


CONVENTIONS = {"embedding, scale_grad_by_freq (autograd's derivative, taken densely)"}
"""Op cases whose reference is autograd's convention, not the op's derivative: refused (below)."""


@pytest.mark.parametrize(
    "case", [c for c in OP_CASES if c.name not in CONVENTIONS], ids=lambda c: c.name
)
def test_each_op_equals_the_dense_sub_hessian_joint_and_per_tensor(case, device):
    loss, params, index = case.make(device)
    expected = reference(case, loss, params, index)
    joint = pyhvp.sub_hessian(loss, params, index, joint=True, method="forward")
    blocks = pyhvp.sub_hessian(loss, params, index, method="forward")
    torch.testing.assert_close(joint, expected, **F64)
    torch.testing.assert_close(blocks, per_tensor(expected, index), **F64)


class Block(nn.Module):
    """A transformer block: attention by ``scaled_dot_product_attention`` (or ``written_out``,
    softmax and products), LayerNorms, a GELU MLP, a mean over tokens and a linear head."""

    def __init__(self, d=8, heads=2, written_out=False):
        super().__init__()
        self.written_out = written_out
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if self.written_out:
            attended = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, -1) @ v
        else:
            attended = F.scaled_dot_product_attention(q, k, v)
        attended = attended.transpose(1, 2).reshape(b, n, d)
        x = self.norm1(x + self.out(attended))
        return self.head(self.norm2(x + self.mlp(x)).mean(1))


class Classifier(nn.Module):
    """An embedding, a mean over tokens, a SiLU MLP."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(20, 4)
        self.mlp = nn.Sequential(nn.Linear(4, 5), nn.SiLU(), nn.Linear(5, 3))

    def forward(self, tokens):
        return self.mlp(self.embedding(tokens).mean(1))


NETWORKS = {
    "LeNet": (lenet, lambda g: torch.rand(4, 1, 12, 12, generator=g, dtype=torch.float64)),
    "transformer block": (Block, lambda g: torch.randn(2, 5, 8, generator=g, dtype=torch.float64)),
    "torch's TransformerEncoderLayer (eval)": (
        lambda: nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
                              nn.Flatten(1), nn.Linear(40, 3)).eval(),
        lambda g: torch.randn(2, 5, 8, generator=g, dtype=torch.float64)),
    "transformer block, attention written out": (
        lambda: Block(written_out=True),
        lambda g: torch.randn(2, 5, 8, generator=g, dtype=torch.float64)),
    "embedding classifier": (Classifier, lambda g: torch.randint(0, 20, (4, 6), generator=g)),
}  # fmt: skip


def network(name, device, count=4):
    """``module_loss`` of a network, cross-entropy, with ``count`` entries of every tensor
    selected: its last, first and middle ones, that one repeated, then the first few again."""
    make, inputs = NETWORKS[name]
    generator = torch.Generator().manual_seed(5)
    model = make().double().to(device)
    data = inputs(generator).to(device)
    targets = torch.randint(0, 3, (data.shape[0],), generator=generator).to(device)
    loss, params = pyhvp.module_loss(model, nn.CrossEntropyLoss(), data, targets)
    index = {
        name: torch.tensor([p.numel() - 1, 0, p.numel() // 2, p.numel() // 2, *range(1, 10)]
                           [:count], device=device) % p.numel()
        for name, p in params.items()
    }  # fmt: skip
    return loss, params, index


@pytest.mark.parametrize("name", NETWORKS)
def test_networks_equal_the_dense_sub_hessian_joint_and_per_tensor(name, device):
    loss, params, index = network(name, device)
    expected = dense_sub_hessian(loss, params, index)
    joint = pyhvp.sub_hessian(loss, params, index, joint=True, method="forward")
    blocks = pyhvp.sub_hessian(loss, params, index, method="forward")
    torch.testing.assert_close(joint, expected, **F64)
    torch.testing.assert_close(blocks, per_tensor(expected, index), **F64)


@pytest.mark.parametrize("name", NETWORKS)
def test_streams_pushed_apart_give_the_same_matrix(name, device, monkeypatch):
    # past forward.JOIN_LIMIT tangent elements an op pushes one value's streams (a layer's
    # weight and bias, every layer behind it) each as it is instead of joining them: with no
    # limit, every op that takes several streams of one value does
    loss, params, index = network(name, device)
    expected = dense_sub_hessian(loss, params, index)
    monkeypatch.setattr(forward, "JOIN_LIMIT", 0)
    blocks = pyhvp.sub_hessian(loss, params, index, method="forward")
    torch.testing.assert_close(blocks, per_tensor(expected, index), **F64)


@pytest.mark.parametrize("name", NETWORKS)
def test_gram_matrices_made_a_few_columns_at_a_time_give_the_same_matrix(name, device,
                                                                        monkeypatch):  # fmt: skip
    # a pointwise op's weighted Gram matrix sums forward.GRAM_COLUMNS columns at a time: with 7,
    # every activation spans several chunks and ends in a partial one
    loss, params, index = network(name, device)
    expected = dense_sub_hessian(loss, params, index)
    monkeypatch.setattr(forward, "GRAM_COLUMNS", 7)
    blocks = pyhvp.sub_hessian(loss, params, index, method="forward")
    torch.testing.assert_close(blocks, per_tensor(expected, index), **F64)


def _stored(order, sizes=(5, 3, 4, 6)):
    """A ``(5, 3, 4, 6)`` tensor stored with its dims in ``order``, outermost first."""
    stored = torch.randn(*(sizes[d] for d in order), dtype=torch.float64)
    return stored.permute([order.index(d) for d in range(len(sizes))])


LAYOUTS = {  # the rows' dim (0) outermost, inside, innermost; a slice of rows; two layouts
    "rows outermost": (_stored((0, 1, 2, 3)), _stored((0, 1, 2, 3))),
    "rows inside": (_stored((1, 2, 0, 3)), _stored((1, 2, 0, 3))),
    "rows innermost": (_stored((1, 2, 3, 0)), _stored((1, 2, 3, 0))),
    "a slice of the rows, inside": (
        _stored((1, 0, 2, 3), (9, 3, 4, 6))[2:7], _stored((1, 0, 2, 3), (9, 3, 4, 6))[::2][:5]),
    "two layouts": (_stored((1, 0, 2, 3)), _stored((3, 2, 1, 0))),
}  # fmt: skip


@pytest.mark.parametrize(("a", "b"), LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_gram_matrix_of_rows_stored_in_any_layout_is_their_flattened_products(a, b,
                                                                                monkeypatch):  # fmt: skip
    # closed_forms.gram multiplies (outer, K, inner) blocks where the K rows lie inside the
    # memory order (a product's tangents): with no least block, every layout takes that path
    monkeypatch.setattr(closed_forms, "GRAM_INNER", 1)
    expected = a.reshape(len(a), -1) @ b.reshape(len(b), -1).mT
    torch.testing.assert_close(closed_forms.gram(a, b), expected, **F64)


W = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
V = torch.randn(4, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
PRODUCTS = {  # two selected tensors meeting in one op: its cross terms are second-order
    "W @ V": lambda p: squash(p["w"] @ p["v"]),
    "W * W": lambda p: squash(p["w"] * p["w"]),
    "a quotient by a selected tensor": lambda p: squash(p["w"][:, :2] / (2 + p["v"][:3])),
    "a power of a selected tensor": lambda p: squash((1 + p["w"][:, :2] ** 2) ** p["v"][:3]),
    "F.linear of a selected input": lambda p: squash(F.linear(p["v"].T, p["w"])),
    "a bias that is also the input (one object)": lambda p: squash(
        (lambda h: F.linear(h, p["w"][:, :3], h))(p["v"][:3, 0])),
    "addmm's added matrix, also a factor (one object)": lambda p: squash(
        (lambda a: torch.addmm(a, a, p["w"][:, 1:].T))(p["w"][:, :3])),
}  # fmt: skip


def assert_forward_equals_dense(loss):
    """The forward route's joint and per-tensor matrices of ``loss`` of ``W`` and ``V``, some
    entries of each selected (one twice), are the dense float64 ones."""
    params, index = {"w": W, "v": V}, {"w": torch.tensor([0, 11, 5, 0]), "v": torch.arange(8)}
    expected = dense_sub_hessian(loss, params, index)
    joint = pyhvp.sub_hessian(loss, params, index, joint=True, method="forward")
    blocks = pyhvp.sub_hessian(loss, params, index, method="forward")
    torch.testing.assert_close(joint, expected, **F64)
    torch.testing.assert_close(blocks, per_tensor(expected, index), **F64)


@pytest.mark.parametrize("loss", PRODUCTS.values(), ids=PRODUCTS.keys())
def test_ops_where_two_selected_tensors_meet_keep_their_cross_terms(loss):
    assert_forward_equals_dense(loss)


C = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
B = torch.randn(3, dtype=torch.float64, generator=torch.Generator().manual_seed(6))


MASK = torch.tensor([0.0, -torch.inf, 0.0, 0.0], dtype=torch.float64)
LABELS = torch.tensor([2, 0, 1])


def hidden(p):
    """An activation that carries tangents of both tensors, as an op's input: ``(3, 4)``."""
    return torch.tanh(p["w"] + torch.cat([p["v"].T, p["v"].T[:1]]) / 2)


PUSHES = {  # ops that push tangents without jvp: linear ones as the op with constant terms zero
    "1 - h": lambda p: squash(1.0 - hidden(p)),
    "h + a constant tensor": lambda p: squash(hidden(p) + C),
    "add(c, h, alpha=2)": lambda p: squash(torch.add(C, hidden(p), alpha=2)),
    "sub(h, c)": lambda p: squash(torch.sub(hidden(p), C)),
    "c + h, a residual connection (h's tangents as they are)": lambda p: squash(C + hidden(p)),
    "c - h and c + h + h": lambda p: squash((C - hidden(p)) * (C + hidden(p) + hidden(p))),
    "h + a constant it broadcasts to": lambda p: squash(hidden(p)[:1] + C),
    "h + a float32 constant, h + 1, h - 1": lambda p: squash(
        (hidden(p) + C.float()) * (hidden(p) + 1) - (hidden(p) - 1)),
    "cat and stack with constants": lambda p: squash(
        torch.stack([C, torch.cat([hidden(p)[:, :2], C[:, 2:]], dim=1)])),
    "F.linear with a constant weight and bias": lambda p: squash(F.linear(hidden(p), C, B)),
    "addmm with a constant matrix": lambda p: squash(torch.addmm(B[:, None], hidden(p), C.T)),
    "conv1d with a constant kernel and bias": lambda p: squash(
        F.conv1d(hidden(p)[None], C.T[:, :, None], C[0], padding=1)),
    "quotient and product by constants": lambda p: squash(2 * (hidden(p) / (2 + C)) * C),
    "mean, sum, negation, average pool": lambda p: squash(
        -F.avg_pool1d(hidden(p)[None], 2).mean(0) + hidden(p).sum(1, keepdim=True)),
    "ReLUs (by their slope)": lambda p: squash(F.relu(hidden(p) - 0.2) + torch.relu(-hidden(p))),
    "add(h, alpha, mask), the deprecated order, an infinite mask": lambda p: torch.softmax(
        torch.add(hidden(p), 1, MASK), 1).pow(2).sum(),
    "a view shaped like a value carrying other tangents": lambda p: squash(
        (2 * p["w"]).reshape(-1)[:8].view_as(p["v"] ** 2).to(p["v"] * 3) * p["v"]),
}  # fmt: skip


@pytest.mark.parametrize("loss", PUSHES.values(), ids=PUSHES.keys())
def test_ops_pushed_without_jvp_equal_the_dense_sub_hessian(loss):
    assert_forward_equals_dense(loss)


def _product(a, b):
    return squash(a @ b)


CLOSED_FORMS = {  # ops whose tangents and term pyhvp.restricted.closed_forms writes out
    "layer_norm over the last dim, weight and bias": lambda p: squash(
        F.layer_norm(hidden(p), (4,), C[0], C[1])),
    "layer_norm over two dims, no weight or bias": lambda p: squash(
        F.layer_norm(hidden(p), (3, 4))),
    "layer_norm by keyword, a weight alone, eps 0.5": lambda p: squash(
        F.layer_norm(input=hidden(p), normalized_shape=[4], weight=C[0], eps=0.5)),
    "layer_norm whose weight and bias are selected": lambda p: squash(
        F.layer_norm(torch.tanh(p["v"].T), (4,), p["w"][0], p["w"][1])),
    "layer_norm of a selected tensor": lambda p: squash(F.layer_norm(p["w"], (4,)) * C),
    "softmax over each dim, three spellings": lambda p: squash(
        torch.softmax(hidden(p), 0) + F.softmax(hidden(p), dim=-1) + hidden(p).softmax(1)),
    "softmax at a masked entry": lambda p: squash(torch.softmax(hidden(p) + MASK, -1)),
    "a product of two values (attention's scores)": lambda p: _product(hidden(p), hidden(p).T),
    "bmm of two values": lambda p: squash(torch.bmm(
        torch.stack([hidden(p), 2 * hidden(p)]), torch.stack([hidden(p).T, 3 * hidden(p).T]))),
    "h @ h, one object both operands": lambda p: _product(hidden(p)[:, :3], hidden(p)[:, :3]),
    "a selected tensor times a value": lambda p: _product(p["w"], hidden(p).T),
    "attention, q = k = v one object": lambda p: (lambda a: squash(
        F.scaled_dot_product_attention(a, a, a)))(hidden(p)[None]),
    "causal attention, scale 0.5, v constant": lambda p: squash(F.scaled_dot_product_attention(
        hidden(p)[None], 2 * hidden(p)[None], C[None], is_causal=True, scale=0.5)),
    "attention, a boolean mask, k alone carrying": lambda p: squash(
        F.scaled_dot_product_attention(C[None], hidden(p)[None], C[None],
                                       attn_mask=torch.eye(3, dtype=torch.bool) | (C[:, :3] > 0))),
    "attention, an additive mask, q and v carrying": lambda p: squash(
        F.scaled_dot_product_attention(hidden(p)[None], C[None], hidden(p)[None] ** 2,
                                       torch.triu(torch.ones(3, 3, dtype=torch.float64)))),
    "attention, a query row whose every key is masked (zeros, as torch's math kernel)":
        lambda p: squash(F.scaled_dot_product_attention(hidden(p)[None], hidden(p)[None] ** 2,
            hidden(p)[None], attn_mask=torch.tensor([[True, False, True], [False] * 3,
                                                     [True] * 3]))),
    "cross_entropy, mean": lambda p: F.cross_entropy(hidden(p), LABELS),
    "cross_entropy, sum, a row ignored": lambda p: F.cross_entropy(
        hidden(p), LABELS.where(LABELS != 2, -100), reduction="sum"),
    "cross_entropy, mean, ignore_index a class": lambda p: F.cross_entropy(
        hidden(p), LABELS, ignore_index=1),
    "cross_entropy, ignore_index past the classes": lambda p: F.cross_entropy(
        hidden(p), LABELS.where(LABELS != 0, 255), ignore_index=255),
}  # fmt: skip


OUTSIDE_THE_CLOSED_FORMS = {  # their kin the closed forms leave to vmap(jvp) and autograd
    "cross_entropy with class weights and label smoothing": lambda p: nn.CrossEntropyLoss(
        weight=C[0], label_smoothing=0.1)(hidden(p), LABELS),
    "log_softmax": lambda p: squash(torch.log_softmax(hidden(p), -1)),
    "softmax to float64 (dtype=)": lambda p: squash(torch.softmax(hidden(p), 0, torch.float64)),
}  # fmt: skip


@pytest.mark.parametrize(
    "loss",
    [*CLOSED_FORMS.values(), *OUTSIDE_THE_CLOSED_FORMS.values()],
    ids=[*CLOSED_FORMS, *OUTSIDE_THE_CLOSED_FORMS],
)
def test_ops_in_closed_form_and_their_kin_equal_the_dense_sub_hessian(loss):
    assert_forward_equals_dense(loss)


X5 = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(7))

PLACED = {  # a layer's weight and bias entries' tangents of its output, each at one feature
    "a layer's weight and bias (a view) through tanh into the next layer": lambda p: squash(
        F.linear(torch.tanh(F.linear(X5, p["w"], p["v"][:3, 0])), C.T)),
    "one input vector: a layer's output is a vector": lambda p: squash(
        F.linear(torch.sigmoid(F.linear(X5[0], p["w"], p["v"][1:, 1])), C.T)),
    "a convolution's channels through GELU into a layer over its length": lambda p: squash(
        F.linear(F.gelu(F.conv1d(X5.T[None], p["w"][:, :, None], p["v"][:3, 0])), X5.T[:2])),
    "a layer norm's weight and bias through GELU into a layer": lambda p: squash(
        F.linear(F.gelu(F.layer_norm(X5, (4,), p["w"][0], p["w"][1])), C)),
    "a layer norm's weight alone, also a layer's bias": lambda p: squash(
        F.linear(torch.tanh(F.layer_norm(X5, (4,), weight=p["v"][:, 0])), C, p["v"][:3, 0])),
    "a layer norm over two dims, its weight (tangents dense)": lambda p: squash(
        torch.tanh(F.layer_norm(X5[:3], (3, 4), p["w"]))),
    "a layer's output into two layers and a pointwise op twice": lambda p: (
        lambda h: squash(F.linear(torch.tanh(h), C.T) + F.linear(torch.tanh(h) ** 2, 2 * C.T)))(
        F.linear(X5, p["w"], p["v"][:3, 1])),
}  # fmt: skip


@pytest.mark.parametrize("loss", PLACED.values(), ids=PLACED.keys())
def test_placed_tangents_equal_the_dense_sub_hessian(loss):
    assert_forward_equals_dense(loss)


def _lstm_cell(p):
    """``nn.LSTMCell``'s op of ``X5``'s rows: ``(h, c)``, torch making ``h`` from ``c``."""
    state = (X5[:, 2:3], X5[:, 3:4])
    return torch.lstm_cell(X5[:, :2], state, p["v"], p["w"].T[:, :1], p["w"].T[:, 1])


SEVERAL_OUTPUTS = {  # ops of several outputs, one of which the op makes from another
    "lstm_cell, its h alone used": lambda p: squash(_lstm_cell(p)[0]),
    "lstm_cell, h and c": lambda p: squash(torch.cat(_lstm_cell(p), 1)),
}  # fmt: skip


@pytest.mark.parametrize("loss", SEVERAL_OUTPUTS.values(), ids=SEVERAL_OUTPUTS.keys())
def test_an_op_making_one_output_from_another_counts_each_use_once(loss):
    assert_forward_equals_dense(loss)


@pytest.fixture
def pushed(monkeypatch):
    """The rows of every placed stream a layer pushes as outer products, in call order."""
    rows = []

    def linear_push(placed, *args, push=forward._linear_push):
        rows.append(len(placed.positions))
        return push(placed, *args)

    monkeypatch.setattr(forward, "_linear_push", linear_push)
    return rows


def test_a_layers_tangents_stay_placed_through_a_pointwise_op_into_the_next_layer(pushed):
    # the transformer block's first MLP layer's (and norm1's) tangents of its output: one
    # feature per row, through GELU, then each pushed by the next layer as an outer product
    loss, params, index = network("transformer block", "cpu")
    pyhvp.sub_hessian(loss, params, index, method="forward")
    assert pushed == [8, 8]  # norm1's weight and bias into mlp.0, mlp.0's into mlp.2


IDENTITY_DROPOUTS = {
    "in eval": lambda: nn.Dropout(0.5).eval(),
    "of p = 0 in training (TransformerEncoderLayer(dropout=0.0); refused until 2026-12-06)":
        lambda: nn.Dropout(0.0).train(),
}  # fmt: skip


@pytest.mark.parametrize("dropout", IDENTITY_DROPOUTS.values(), ids=IDENTITY_DROPOUTS.keys())
def test_a_dropout_that_is_the_identity_keeps_a_layers_tangents_placed(pushed, dropout):
    # nn.Dropout between a layer's activation and the next layer (a transformer's MLP): its
    # placed tangents pass, and the next layer still pushes them as outer products
    assert_forward_equals_dense(
        lambda p: squash(F.linear(dropout()(torch.tanh(F.linear(X5, p["w"], p["v"][:3, 0]))), C.T))
    )
    assert pushed == [12]  # per tensor: w's 4 rows and v's 8, one stream


def test_a_residual_connection_keeps_a_layers_tangents_placed(pushed):
    # x + layer(x) where the selected tensors reach only the layer (a transformer block's first
    # residual, its attention's inputs constant): the sum's tangents are the layer's, as they are
    layer = lambda p: torch.tanh(F.linear(X5, p["w"], p["v"][:3, 0]))  # noqa: E731
    assert_forward_equals_dense(lambda p: squash(F.linear(X5[:, :3] + layer(p), C.T)))
    assert pushed == [12]  # per tensor: w's 4 rows and v's 8, one stream


def test_a_product_by_a_value_without_a_layers_tangents_keeps_them_placed(pushed):
    # a gated MLP's silu(gate(x)) * up(x) (LLaMA's), a layer scale gamma * h: each placed row
    # is times the other factor at its index, and the next layer pushes it as an outer product
    gate = torch.sigmoid(F.linear(X5, C))
    assert_forward_equals_dense(
        lambda p: squash(
            F.linear(2.0 * (F.silu(F.linear(X5, p["w"], p["v"][:3, 0])) * gate) * C[:, 0], C.T)
        )
    )
    assert pushed == [12]  # per tensor: w's 4 rows and v's 8, one stream


TAKEN = {  # a network, and the closed forms its ops take (attention's by its softmax and products)
    "transformer block, attention written out": {"LayerNorm", "Softmax", "Product", "CrossEntropy"},
    "transformer block": {"LayerNorm", "Attention", "Softmax", "Product", "CrossEntropy"},
}  # fmt: skip
"""(``nn.MultiheadAttention`` is one op to a function mode, ``multi_head_attention_forward``:
its term is autograd's double backward of it, as any other op's.)"""


@pytest.mark.parametrize("name", TAKEN)
def test_a_transformer_blocks_norms_attention_and_loss_take_their_closed_forms(name, monkeypatch):
    taken = set()
    kinds = (closed_forms.LayerNorm, closed_forms.Softmax, closed_forms.Product,
             closed_forms.CrossEntropy, closed_forms.Attention)  # fmt: skip
    for kind in kinds:

        def terms(self, *args, terms=kind.terms):
            taken.add(type(self).__name__)
            return terms(self, *args)

        monkeypatch.setattr(kind, "terms", terms)
    loss, params, index = network(name, "cpu")
    pyhvp.sub_hessian(loss, params, index, method="forward")
    assert taken == TAKEN[name]


EDGES = {  # loss, index: selections and points where a route may trip
    "one tensor without selected entries": (
        lambda p: squash(p["w"] @ p["v"]), {"w": [], "v": [1, 2, 5]}),
    "a pointwise op of an expanded view": (
        lambda p: squash(p["w"][:, None].expand(3, 2, 4).pow(3)), {"w": [0, 5, 11]}),
    "an exact minimum (a zero gradient)": (
        lambda p: F.binary_cross_entropy_with_logits(X3 @ p["w"][:, :3],
                                                     torch.sigmoid(X3 @ W[:, :3])),
        {"w": [0, 1, 4, 4]}),
}  # fmt: skip
X3 = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize(("loss", "index"), EDGES.values(), ids=EDGES.keys())
def test_edge_selections_and_points_equal_the_dense_sub_hessian(loss, index):
    params = {"w": W, "v": V}
    index = {name: torch.tensor(i, dtype=torch.long) for name, i in index.items()}
    expected = {name: dense_sub_hessian(loss, params, {name: i}) for name, i in index.items()}
    got = pyhvp.sub_hessian(loss, params, index, method="forward")
    torch.testing.assert_close(got, expected, **F64)


AT_ZERO = torch.tensor([0.0, 1.0, 2.0, 0.5], dtype=torch.float64)  # entry 0 is never selected
WITH_INF = torch.tensor([1.0, float("inf"), 2.0, 3.0], dtype=torch.float64)
FINITE = torch.isfinite(WITH_INF)
RELU_NET = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
ZERO_ROW = torch.rand(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
ZERO_ROW[1] = 0.0

DISCARDED_NAN_TANGENTS = {  # 0 * inf in a tangent that an op linear in it then discards
    "a product by inf that a where discards": lambda p: torch.sin(
        torch.where(FINITE, p["x"] * WITH_INF, 0.0)).sum(),
    "a product by inf that masked_fill discards": lambda p: torch.sin(
        (p["x"] * WITH_INF).masked_fill(~FINITE, 0.0)).sum(),
}  # fmt: skip


@pytest.mark.parametrize("loss", DISCARDED_NAN_TANGENTS.values(), ids=DISCARDED_NAN_TANGENTS.keys())
def test_a_nan_tangent_an_op_linear_in_it_discards_adds_nothing(loss):
    """``where`` and ``masked_fill`` have no second derivative: their node adds no term, so
    the NaN tangent (``0 * inf``) they discard is never contracted."""
    params, index = {"x": AT_ZERO}, {"x": torch.tensor([2, 3, 2])}
    got = pyhvp.sub_hessian(loss, params, index, method="forward")
    torch.testing.assert_close(got["x"], dense_sub_hessian(loss, params, index), **F64)


INFINITE_CURVATURE_AT_ZERO_TANGENTS = {  # f'' infinite where every tangent is 0: 0 * inf
    "x ** 1.5 at an unselected 0 (autograd: finite)": lambda p: (p["x"] ** 1.5).sum(),
    "relu(h) ** 1.5 where h < 0 (finite)": lambda p: (F.relu(RELU_NET @ p["x"][1:]) ** 1.5).sum(),
    "sqrt behind a where guard (finite)": lambda p: torch.where(
        p["x"] > 0, p["x"].clamp(min=0).sqrt(), 0.0).sum(),
    "abs(x) ** 1.5 at a selected 0 (NaN: f'' is infinite)": lambda p: (
        p["x"][1:].abs() ** 1.5).sum() + (p["x"] - 1).abs().pow(1.5).sum(),
    "a zero row's product ** 1.5 (NaN)": lambda p: ((ZERO_ROW @ p["x"]) ** 1.5).sum(),
}  # fmt: skip


@pytest.mark.parametrize(
    "loss", INFINITE_CURVATURE_AT_ZERO_TANGENTS.values(),
    ids=INFINITE_CURVATURE_AT_ZERO_TANGENTS.keys(),
)  # fmt: skip
def test_an_infinite_curvature_where_the_tangents_are_zero_is_refused_and_auto_gives_autograds(
    loss,
):
    """A zero tangent does not say whether autograd's backward masks the entry (relu's zeros:
    a finite Hessian) or multiplies it (``abs`` at 0, whose curvature is infinite: NaN), so the
    forward route refuses the ``0 * inf`` and ``"auto"`` gives autograd's value on every call
    (the reverse route's), NaN where autograd's is NaN, never a finite number in its place."""
    params, index = {"x": AT_ZERO}, {"x": torch.tensor([2, 3, 1])}
    expected = pyhvp.sub_hessian(loss, params, index, method="reverse")  # autograd's, symmetrised
    assert_not_finite_is_refused_and_auto_serves(loss, params, index, expected)


def assert_not_finite_is_refused_and_auto_serves(loss, params, index, expected):
    """``method="forward"`` refuses ``loss`` for a result that is not finite; ``"auto"`` gives
    ``expected`` on every call, NaN where it is NaN."""
    with pytest.raises(ValueError, match=r"method='forward' does not apply.*not finite"):
        pyhvp.sub_hessian(loss, params, index, method="forward")
    for _ in range(12):  # past the trial, in which the forward route is refused
        got = pyhvp.sub_hessian(loss, params, index, backend=EAGER)
        torch.testing.assert_close(got, expected, equal_nan=True, **F64)


def sine_of_a_product_by_inf_that_a_where_discards(p):
    """``sin(x * inf)`` is NaN at the infinite entry, and so is its tangent there (``0 * inf``):
    autograd's backward of the ``where`` masks the entry out, the forward route's Gram matrix
    at the sine would multiply it."""
    return torch.where(FINITE, torch.sin(p["x"] * WITH_INF), 0.0).sum()


def test_a_non_finite_second_order_term_the_reference_lacks_is_refused_and_auto_serves_it():
    params, index = {"x": AT_ZERO}, {"x": torch.tensor([2, 3])}
    loss = sine_of_a_product_by_inf_that_a_where_discards
    expected = dense_sub_hessian(loss, params, index)
    assert torch.isfinite(expected).all()
    assert_not_finite_is_refused_and_auto_serves(loss, params, index, {"x": expected})


def test_a_non_finite_first_derivative_autograd_masks_is_refused_as_such():
    """``sqrt`` at an unselected 0, weighted by 0: its tangent there is ``0 * inf``, NaN, in the
    loss's first derivatives; autograd's are finite. The refusal says so, not that a use went
    unseen."""
    weights = torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=torch.float64)

    def loss(p):
        return (p["x"].sqrt() * weights).sum()

    params, index = {"x": AT_ZERO}, {"x": torch.tensor([2, 3])}
    with pytest.raises(ValueError, match="not finite where autograd's gradient is"):
        pyhvp.sub_hessian(loss, params, index, method="forward")
    got = pyhvp.sub_hessian(loss, params, index, backend=EAGER)
    torch.testing.assert_close(got["x"], dense_sub_hessian(loss, params, index), **F64)


class StraightThrough(torch.autograd.Function):
    """Rounds forward, passes the gradient through unchanged: autograd's derivative is not the
    forward's (zero)."""

    @staticmethod
    def forward(x):
        return torch.round(x * 4) / 4

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad


class Square(torch.autograd.Function):
    """``x * x`` with its own, correct backward: autograd differentiates through it, the
    forward route's mode does not see inside it (its forward runs under ``no_grad``)."""

    @staticmethod
    def forward(x):
        return x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


def hooked(p):
    y = p["w"] @ V
    if y.requires_grad:  # (in pyhvp's survey of the loss it does not)
        y.register_hook(lambda grad: 2 * grad)
    return squash(y)


def custom_penalty_at_its_minimum(p):
    """A penalty through an op the mode does not see, at its minimum: its gradient is zero,
    so the first derivatives agree, and only autograd's graph shows the use."""
    return squash(p["w"] @ V) + Square.apply(p["w"] - W).sum()


def complex_penalty_at_its_minimum(p):
    spectrum = torch.fft.rfft(p["w"] - W)
    return squash(p["w"] @ V) + (spectrum * spectrum.conj()).real.sum()


def scatter_prod(p):
    target = torch.ones(3, 2, dtype=torch.float64)
    index = torch.tensor([[0, 0, 1, 1]] * 3)
    return squash(target.scatter_reduce(1, index, p["w"], "prod"))


def training_dropout(p):
    return squash(F.dropout(p["w"] @ V, 0.5, training=True))


def running_statistics(p):
    mean, variance = torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    return squash(F.batch_norm(p["w"] @ V, mean, variance, training=True))


def padded_embedding(p):
    tokens = torch.tensor([[0, 1], [2, 1]])
    return squash(F.embedding(tokens, p["w"], padding_idx=1).sum(1))


def scaled_embedding(p):
    tokens = torch.tensor([[0, 1], [2, 1]])
    return squash(F.embedding(tokens, p["w"], scale_grad_by_freq=True).sum(1))


def writes_an_activation(p):
    y = p["w"] @ V
    y.mul_(2)
    return squash(y)


SLOTS = torch.tensor([[0, 1, 0, 1], [1, 1, 0, 0], [0, 0, 1, 1]])  # W's rows' aggregation slots
REFUSED = {  # a loss the route cannot follow as autograd does, and what the refusal names
    "a straight-through estimator": (
        lambda p: squash(StraightThrough.apply(p["w"]) @ V), "did not see"),
    "a custom autograd.Function at its minimum": (custom_penalty_at_its_minimum, "did not see"),
    "a complex intermediate at its minimum": (complex_penalty_at_its_minimum, "complex"),
    "scatter_reduce with reduce='prod'": (scatter_prod, "forward derivative"),
    "a dropout in training": (training_dropout, "randomness"),
    "a batch norm updating its running statistics": (running_statistics, "running statistics"),
    "an entry in an embedding's padding row": (padded_embedding, "padding_idx"),
    "an embedding scaling gradients by frequency": (scaled_embedding, "scale_grad_by_freq"),
    "an in-place write to an activation": (writes_an_activation, "writes in place"),
    "PReLU at its kink (a zero-initialised layer's)": (
        lambda p: squash(F.prelu(p["w"] - W, torch.tensor([0.25], dtype=W.dtype)) @ V), "kink"),
    "clamp at a tensor bound": (lambda p: squash(torch.clamp(p["w"], max=W) @ V), "bound"),
    "clamp_min at a tensor bound": (lambda p: squash(p["w"].clamp_min(W) @ V), "bound"),
    "fmax of two equal inputs": (lambda p: squash(torch.fmax(W, p["w"]) @ V), "kink"),
    "clamp between equal tensor bounds": (lambda p: squash(torch.clamp(
        -torch.ones_like(W), min=p["w"] - W, max=p["w"] - W) @ V), "bound"),
    "a max-aggregation meeting the zeros it lands on": (lambda p: squash(torch.zeros(2, 4,
        dtype=W.dtype).scatter_reduce(0, SLOTS, p["w"] - W, "amax", include_self=False) @ V),
        "reduce='amax'"),
    "index_put writing one slot twice": (lambda p: squash(torch.zeros(4, 4, dtype=W.dtype)
        .index_put((torch.tensor([0, 2, 0]),), p["w"] - W) @ V), "one position twice"),
    "a gradient penalty (torch.autograd.grad inside the loss)": (lambda p: (lambda x: (
        lambda y: y + torch.autograd.grad(y, x, create_graph=True)[0].pow(2).sum())(
        squash(torch.tanh(p["w"] @ x))))(V.clone().requires_grad_()), "derivative inside"),
    "the loss's own vmap over its data": (lambda p: torch.func.vmap(
        lambda column: torch.tanh(p["w"] @ column).pow(2).sum())(V.T).sum(), "did not see"),
    "put writing one position twice": (lambda p: squash(torch.zeros(16, dtype=W.dtype).put(
        torch.tensor([0, 5, -16, 7, 1, 2, 3, 4, 6, 8, 9, 10]), (p["w"] - W).reshape(-1))
        .view(4, 4) @ V), "one position twice"),
}  # fmt: skip


@pytest.mark.parametrize(("loss", "named"), REFUSED.values(), ids=REFUSED.keys())
def test_what_it_cannot_follow_is_refused_by_name_and_auto_serves_it(loss, named):
    index = {"w": torch.tensor([0, 5, 11, 5, 1, 2, 3, 4])}
    with pytest.raises(ValueError, match=f"method='forward' does not apply.*{named}"):
        pyhvp.sub_hessian(loss, {"w": W}, index, method="forward")
    torch.manual_seed(0)
    expected = pyhvp.sub_hessian(loss, {"w": W}, index, method="reverse")
    for _ in range(12):  # past the trial, in which the forward route fails and leaves
        torch.manual_seed(0)
        got = pyhvp.sub_hessian(loss, {"w": W}, index, backend=EAGER)
        torch.testing.assert_close(got, expected, **F64)


def residual_then_tanh(p):
    h = hidden(p)
    return squash(torch.tanh(h + C)) + squash(h * C)  # the sum's tangents are h's, h used after


SPENT_TANGENTS = {  # a pointwise op at its input's last use may push into its input's tangents
    "a chain of tanh (each push into the one before)": lambda p: squash(
        torch.tanh(torch.tanh(torch.tanh(hidden(p))))),
    "tanh of a view of a value used after": lambda p: (lambda h: squash(
        torch.tanh(h.view(2, 6)).view(3, 4) * h))(hidden(p)),
    "tanh of a value used after": lambda p: (lambda h: squash(torch.tanh(h) * h))(hidden(p)),
    "tanh of a residual sum, whose tangents are the value's, used after": residual_then_tanh,
    "tanh of a selected tensor made contiguous (itself), used after": lambda p: squash(
        torch.tanh(p["w"].contiguous()) @ V) + squash(torch.sin(p["w"]) @ V),
    "tanh of a value made contiguous (itself), used after": lambda p: (lambda h: squash(
        torch.tanh(h.contiguous()) * h))(hidden(p)),
    "an op returning its input itself (a dropout in eval), after a tanh": lambda p: squash(
        F.dropout(torch.tanh(F.dropout(hidden(p), 0.5, training=False)), 0.5, training=False)),
}  # fmt: skip


@pytest.mark.twice
@pytest.mark.parametrize("loss", SPENT_TANGENTS.values(), ids=SPENT_TANGENTS.keys())
def test_tangents_a_push_overwrites_are_read_by_nothing_after(loss):
    assert_forward_equals_dense(loss)


def checkpointed(p):
    """A region torch.utils.checkpoint runs again in the reverse pass, its saved-tensor hooks
    active inside it."""
    region = lambda h: torch.tanh(torch.sin(h) * h)  # noqa: E731
    return squash(torch.utils.checkpoint.checkpoint(region, hidden(p), use_reentrant=False))


@pytest.mark.skipif(torch.__version__ < "2.13", reason="torch 2.5's checkpoint reads its input's "
                    "grad_fn under the mode, which the route refuses by name there (as it did "
                    "before its terms were taken inside the loss's run)")  # fmt: skip
def test_a_term_taken_inside_a_checkpointed_region_is_its_own():
    assert_forward_equals_dense(checkpointed)


SAMPLES = torch.randn(64, 3, generator=torch.Generator().manual_seed(9))


def autocast_region(p):
    """Pointwise ops inside a bfloat16 autocast region, which runs them in float32 as they are;
    their terms' products it would run in bfloat16."""
    h = SAMPLES.to(p["w"].dtype) @ p["w"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        g = torch.tanh(h) * torch.sigmoid(h)
    return squash(g @ p["v"])


def test_a_term_taken_inside_an_autocast_region_keeps_the_ops_precision():
    params, index = {"w": W.float(), "v": V.float()}, {"w": torch.arange(12), "v": torch.arange(8)}
    expected = dense_sub_hessian(autocast_region, {"w": W, "v": V}, index)
    got = pyhvp.sub_hessian(autocast_region, params, index, joint=True, method="forward")
    assert (got.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.twice
def test_a_chain_of_pointwise_ops_pushes_each_into_the_tangents_before(monkeypatch):
    """Four tanh in a row make no more buffers than one: each pushes into its input's
    tangents, which the push before made in place (marked as another's, every other one made
    a buffer)."""
    copies, spent = [], forward.Tangents._spent

    def counting(self, value, groups, call):
        found = spent(self, value, groups, call)
        copies.append(found is None)
        return found

    monkeypatch.setattr(forward.Tangents, "_spent", counting)

    def chain(length):
        def loss(p):
            h = hidden(p)
            for _ in range(length):
                h = torch.tanh(h)
            return squash(h)

        return loss

    index, made = {"w": torch.tensor([0, 11, 5]), "v": torch.arange(8)}, []
    for length in (1, 4):
        copies.clear()
        pyhvp.sub_hessian(chain(length), {"w": W, "v": V}, index, method="forward")
        made.append(sum(copies))
    assert made[1] == made[0], made


@pytest.mark.twice
def test_the_route_holds_a_values_tangents_only_until_their_last_use(monkeypatch):
    """Of a 30-layer tanh MLP, a few values' streams at a time, not every layer's."""
    held, next_call = [], forward.Tangents._next_call

    def counting(self, func):
        held.append(len(self.streams))
        return next_call(self, func)

    monkeypatch.setattr(forward.Tangents, "_next_call", counting)
    layers = [torch.randn(4, 4, dtype=torch.float64) / 2 for _ in range(30)]

    def deep(p):
        h = p["w"] @ V
        for layer in layers:
            h = torch.tanh(layer[:3, :3] @ h)
        return squash(h)

    index = {"w": torch.tensor([0, 11, 5])}
    got = pyhvp.sub_hessian(deep, {"w": W}, index, method="forward")
    expected = per_tensor(dense_sub_hessian(deep, {"w": W}, index), index)
    torch.testing.assert_close(got, expected, **F64)
    assert max(held) <= 3, held


@pytest.mark.twice
def test_a_pass_of_many_tangents_runs_the_loss_twice_and_one_of_few_once(monkeypatch):
    """routes.TWICE_FROM tangent elements, as the survey counts them, decide."""
    index, runs = {"w": torch.tensor([0, 11, 5, 0])}, {}
    for bound in (1 << 62, 0):
        calls = []

        def counted(p, calls=calls):  # (a loss of its own: the plan is kept per loss)
            calls.append(None)
            return squash(torch.tanh(p["w"] @ V))

        monkeypatch.setattr(routes, "TWICE_FROM", bound)
        pyhvp.sub_hessian(counted, {"w": W}, index, method="forward")
        runs[bound] = len(calls)
    assert runs[0] == runs[1 << 62] + 1, runs


def noisy_inputs(p):
    """Data augmented inside the loss: a draw the selected tensors never reach."""
    return squash(torch.tanh(p["w"] @ (V + 0.1 * torch.randn_like(V))))


@pytest.mark.twice
def test_a_loss_drawing_random_numbers_draws_the_same_in_both_its_runs():
    """The route runs the loss twice (the first for every value's adjoint): the second draws
    what the first did, as the seed's one run would."""
    index = {"w": torch.tensor([0, 11, 5, 0])}
    torch.manual_seed(0)
    expected = pyhvp.sub_hessian(noisy_inputs, {"w": W}, index, method="reverse")
    torch.manual_seed(0)
    got = pyhvp.sub_hessian(noisy_inputs, {"w": W}, index, method="forward")
    torch.testing.assert_close(got, expected, **F64)


def changing(effect):
    """A loss that changes between its calls (a counter in the closure)."""
    calls = []

    def loss(p):
        calls.append(None)
        return effect(len(calls) % 2, p["w"] @ V)

    return loss


DIFFERING_RUNS = {  # losses whose second run differs from the first; what the refusal names
    "other ops": (changing(lambda odd, h: squash(torch.tanh(h) if odd else torch.sin(h))),
                  "the same torch calls"),
    "another value": (changing(lambda odd, h: squash(torch.tanh(h)) * (1 + odd)), "same value"),
    "more ops": (changing(lambda odd, h: squash(torch.tanh(h) if odd else h)),
                 "the same torch calls"),
    "the same value of other values (rows reordered, as by NumPy's generator)": (changing(
        lambda odd, h: squash(torch.tanh(h[torch.tensor([2, 0, 1] if odd else [0, 1, 2])]))),
        "other values"),
}  # fmt: skip


@pytest.mark.twice
def test_a_loss_near_zero_differing_by_rounding_between_its_runs_is_served():
    """(Relative to the loss alone, a zero loss's rounding was another value: refused.)"""
    h = lambda p: squash(torch.tanh(p["w"] @ V))  # noqa: E731
    zero = changing(lambda odd, _: 1e-16 * odd)  # the first run's loss 1e-16, the second's 0

    def near_zero(p):
        value = h(p)
        return value - value.detach() + zero(p)

    index = {"w": torch.tensor([0, 11, 5, 0])}
    got = pyhvp.sub_hessian(near_zero, {"w": W}, index, method="forward")
    expected = per_tensor(dense_sub_hessian(h, {"w": W}, index), index)
    torch.testing.assert_close(got, expected, **F64)


@pytest.mark.twice
@pytest.mark.parametrize(("loss", "named"), DIFFERING_RUNS.values(), ids=DIFFERING_RUNS.keys())
def test_a_loss_differing_between_its_two_runs_is_refused(loss, named):
    index = {"w": torch.tensor([0, 11, 5, 0])}
    with pytest.raises(ValueError, match=f"method='forward' does not apply.*{named}"):
        pyhvp.sub_hessian(loss, {"w": W}, index, method="forward")


CALLERS_MODES = {"under no_grad": torch.no_grad, "under inference_mode": torch.inference_mode}


@pytest.mark.parametrize("grad_mode", CALLERS_MODES.values(), ids=CALLERS_MODES.keys())
def test_a_callers_grad_mode_leaves_the_route_as_it_is(grad_mode):
    """Its reverse pass is autograd's: under the caller's inference_mode it saw no graph and
    gave zeros, also where "auto" chose it (an MLP of tanh layers)."""
    index = {"w": torch.tensor([0, 5, 11, 5, 1, 2, 3, 4])}
    expected = dense_sub_hessian(lambda p: squash(torch.tanh(p["w"] @ V)), {"w": W}, index)
    with grad_mode():
        got = pyhvp.sub_hessian(lambda p: squash(torch.tanh(p["w"] @ V)), {"w": W}, index,
                                joint=True, method="forward")  # fmt: skip
    torch.testing.assert_close(got, expected, **F64)


def test_entries_a_view_of_the_table_does_not_hold_are_not_in_its_padding_row():
    """The padding row of ``embedding(tokens, e[2:], padding_idx=0)`` is ``e``'s row 2; a
    selected entry of row 1, outside the view, does not reach it (it was refused as if it did)."""
    table, mixing = torch.randn(10, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    tokens = torch.tensor([[1, 3, 3, 0], [2, 7, 1, 1]])

    def loss(e):
        return torch.tanh(F.embedding(tokens, e[2:], padding_idx=0) @ mixing).pow(2).sum()

    index = torch.tensor([4, 5, 13, 38])  # rows 1 (outside the view), 3 and 9
    got = pyhvp.sub_hessian(loss, table, index, method="forward")
    torch.testing.assert_close(got, dense_sub_hessian(loss, table, index), **F64)


@pytest.mark.parametrize("method", ["forward", "sparse"])
def test_a_gradient_hook_is_refused_by_name(method):
    """A hook that changes a gradient makes autograd's derivative differ from the op's: the
    routes that do not run autograd's passes refuse it."""
    with pytest.raises(ValueError, match=f"method='{method}' does not apply.*a gradient hook"):
        pyhvp.sub_hessian(hooked, {"w": W}, {"w": torch.arange(12)}, method=method)


def test_auto_follows_autograd_through_a_gradient_hook_as_the_seed_loop_does():
    """Where the cost model takes the sparse route (a wide layer, 16 entries), a hook still
    gives the seed's loop's (autograd's) matrix, call after call."""
    inputs = torch.randn(20, 50, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    weight = torch.randn(10, 50, dtype=torch.float64, generator=torch.Generator().manual_seed(8))

    def loss(p):
        y = inputs @ p["w"].T
        if y.requires_grad:
            y.register_hook(lambda grad: 2 * grad)
        return squash(y)

    index = {"w": torch.arange(0, 500, 31)}
    expected = pyhvp.sub_hessian(loss, {"w": weight}, index, method="reverse")
    for _ in range(8):  # past the trial
        got = pyhvp.sub_hessian(loss, {"w": weight}, index, backend=EAGER)
        torch.testing.assert_close(got, expected, **F64)


def test_a_wrong_forward_derivative_pyhvp_does_not_know_fails_the_first_order_check(monkeypatch):
    """torch's forward derivative of ``scatter_reduce(reduce="prod")`` is wrong (2.13): with
    pyhvp's table of such ops emptied, the loss's tangents differ from autograd's gradient."""
    monkeypatch.setattr(forward, "_WRONG_FORWARD_DERIVATIVES", frozenset())
    with pytest.raises(ValueError, match="differ from autograd's gradient"):
        pyhvp.sub_hessian(scatter_prod, {"w": W}, {"w": torch.arange(12)}, method="forward")


def test_chunk_size_and_an_enclosing_vmap_are_refused_by_name():
    loss = PRODUCTS["W @ V"]
    params, index = {"w": W, "v": V}, {"w": torch.tensor([0, 11]), "v": torch.arange(3)}
    with pytest.raises(ValueError, match="does not apply: it takes every component at once"):
        pyhvp.sub_hessian(loss, params, index, method="forward", chunk_size=1)
    with pytest.raises(ValueError, match="does not apply: it takes every component at once"):
        torch.func.vmap(lambda w: pyhvp.sub_hessian(
            loss, {"w": w, "v": V}, index, method="forward")["w"])(W.expand(2, 3, 4))  # fmt: skip


def test_data_batches_sum():
    batches = [torch.rand(3, 1, 12, 12, dtype=torch.float64) for _ in range(2)]
    targets = [torch.tensor([0, 2, 1]), torch.tensor([1, 1, 0])]
    model, criterion = lenet().double(), nn.CrossEntropyLoss(reduction="sum")
    params = {name: p.detach() for name, p in model.named_parameters()}
    index = {"0.weight": torch.tensor([0, 26, 3]), "9.bias": torch.tensor([2, 0])}

    def loss(p, batch):
        return criterion(torch.func.functional_call(model, p, (batch[0],)), batch[1])

    data = list(zip(batches, targets, strict=True))
    expected = sum(dense_sub_hessian(lambda p, b=b: loss(p, b), params, index) for b in data)
    got = pyhvp.sub_hessian(loss, params, index, data=data, joint=True, method="forward")
    torch.testing.assert_close(got, expected, **F64)


@pytest.mark.parametrize(("bound", "tried"), [(10**9, True), (0, False)], ids=["within", "over"])
def test_a_trial_tries_the_forward_route_only_within_its_memory_bound(bound, tried, monkeypatch):
    """It holds every activation's tangents at once: tried under ``"auto"`` only where they fit
    ``FORWARD_TANGENTS``, and then logged when it runs."""
    monkeypatch.setattr(routes, "FORWARD_TANGENTS", bound)
    loss, params, index = network("LeNet", "cpu", count=8)
    pyhvp.sub_hessian(loss, params, index, backend=EAGER)
    (trial,) = submatrix._ROUTES.values()
    assert (submatrix.FORWARD in dict(trial.plans)) == tried


def forward_counts(loss, params, index):
    """Per selected tensor, the tangent elements the forward route holds for it."""
    names = list(index)
    found = routes.survey(
        lambda *ts: loss({**params, **dict(zip(names, ts, strict=True))}),
        [params[name] for name in names],
        [],
    )
    return [len(index[name]) * usage.held for name, usage in zip(names, found.usage, strict=True)]


def test_per_tensor_the_forward_route_runs_in_passes_within_its_bound(monkeypatch, caplog):
    """Per tensor, the tensors are packed into passes each within ``FORWARD_TANGENTS`` (the
    largest first): the blocks are the dense ones, and no pass holds more than the bound."""
    loss, params, index = network("LeNet", "cpu", count=8)
    counts = dict(zip(index, forward_counts(loss, params, index), strict=True))
    bound = max(counts.values())
    monkeypatch.setattr(routes, "FORWARD_TANGENTS", bound)
    with caplog.at_level(logging.DEBUG, "pyhvp.sub_hessian"):
        blocks = pyhvp.sub_hessian(loss, params, index, method="forward")
    (passes,) = [r.forward for r in caplog.records if hasattr(r, "forward")]
    by_pass = [[label.removeprefix("params[").strip("]'") for label in p] for p in passes]
    assert sorted(n for p in by_pass for n in p) == sorted(index)
    assert len(by_pass) > 1 and all(sum(counts[n] for n in p) <= bound for p in by_pass)
    torch.testing.assert_close(blocks, per_tensor(dense_sub_hessian(loss, params, index), index),
                               **F64)  # fmt: skip


def test_joint_the_forward_route_is_one_pass_and_tried_only_within_its_bound(monkeypatch):
    # the cross blocks need every direction in one pass: no packing into several
    loss, params, index = network("LeNet", "cpu", count=8)
    monkeypatch.setattr(routes, "FORWARD_TANGENTS", max(forward_counts(loss, params, index)))
    pyhvp.sub_hessian(loss, params, index, joint=True, backend=EAGER)
    (trial,) = submatrix._ROUTES.values()
    assert submatrix.FORWARD not in dict(trial.plans)


def test_the_route_is_logged(caplog):
    loss, params, index = network("LeNet", "cpu")
    with caplog.at_level(logging.DEBUG, "pyhvp.sub_hessian"):
        pyhvp.sub_hessian(loss, params, index, method="forward")
    (record,) = [r for r in caplog.records if hasattr(r, "forward")]
    assert record.forward == [[f"params[{name!r}]" for name in index]]


def tanh_stack(p):
    """Four tanh layers over 128 samples: long tails of cheap pointwise ops, the forward route's
    case (a direction's tail pushed once, where the sparse route's jacrev takes 4.8 tails)."""
    x = WIDE_INPUT
    for weight in p.values():
        x = torch.tanh(F.linear(x, weight))
    return (x**2).sum()


WIDE_INPUT = torch.rand(128, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
STACK = {f"w{i}": torch.randn(32, 32, dtype=torch.float64) / 6 for i in range(4)}
STACK_INDEX = {name: torch.arange(0, 1024, 17) for name in STACK}


def test_the_cost_model_takes_the_forward_route_where_it_models_it_cheaper(caplog):
    """Under the default compile policy (no trial), the survey's model alone decides; the
    forward route then serves the call, equal to the reverse route's (both checked against
    dense float64 Hessians above)."""
    with caplog.at_level(logging.DEBUG, "pyhvp.sub_hessian"):
        got = pyhvp.sub_hessian(tanh_stack, STACK, STACK_INDEX)
    assert [r.forward for r in caplog.records if hasattr(r, "forward")] == [
        [[f"params[{name!r}]" for name in STACK]]
    ]
    expected = pyhvp.sub_hessian(tanh_stack, STACK, STACK_INDEX, method="reverse")
    torch.testing.assert_close(got, expected, **F64)


def curved_work(loss):
    """The work the survey prices as Hessian-vector products of ops, per selected tensor."""
    found = routes.survey(lambda w, v: loss({"w": w, "v": v}), [W, V], [])
    return [u.curved.macs + u.curved.elements for u in found.usage]


@pytest.mark.parametrize("loss", CLOSED_FORMS.values(), ids=CLOSED_FORMS.keys())
def test_the_survey_prices_an_op_in_closed_form_as_gram_matrices_not_hessian_products(loss):
    # its term is a few passes over the tangents, as a pointwise op's: no batched double
    # backward, which the model prices per direction at 11x the op's work
    assert curved_work(loss) == [0.0, 0.0]


@pytest.mark.parametrize(
    "loss", OUTSIDE_THE_CLOSED_FORMS.values(), ids=OUTSIDE_THE_CLOSED_FORMS.keys()
)
def test_the_survey_prices_their_kin_as_hessian_products(loss):
    assert all(work > 0 for work in curved_work(loss))


def straight_through_stack(p):
    return tanh_stack({**p, "w0": StraightThrough.apply(p["w0"])})


def test_where_the_models_forward_route_fails_the_routes_it_chose_otherwise_serve(caplog):
    """The model's forward route refuses a straight-through estimator (its first derivatives
    differ from autograd's): the seed's loop serves that call, and the model's other routes
    every equal call after it, not the loop for good."""
    with caplog.at_level(logging.DEBUG, "pyhvp.sub_hessian"):
        for _ in range(3):
            got = pyhvp.sub_hessian(straight_through_stack, STACK, STACK_INDEX)
    messages = [r.getMessage() for r in caplog.records if r.name == "pyhvp.sub_hessian"]
    assert len(messages) == 3 and "the cost model's routes failed (NotForward" in messages[0]
    assert all("(modelled" in m and "seed's loop" not in m for m in messages[1:])
    expected = pyhvp.sub_hessian(straight_through_stack, STACK, STACK_INDEX, method="reverse")
    torch.testing.assert_close(got, expected, **F64)


def test_a_trial_measures_the_models_forward_route_against_the_split_it_replaced(caplog):
    """Where the model takes the forward route, the split it would have taken otherwise is on
    trial too (compiled, the trial has no other route alone to find it); every plan's matrix
    is the reverse route's."""
    expected = pyhvp.sub_hessian(tanh_stack, STACK, STACK_INDEX, method="reverse")
    for _ in range(12):
        got = pyhvp.sub_hessian(tanh_stack, STACK, STACK_INDEX, backend=EAGER)
        torch.testing.assert_close(got, expected, **F64)
    (trial,) = submatrix._ROUTES.values()
    model, others = trial.plans[0][1], [plan for _, plan in trial.plans[1:]]
    assert model.forward and any(submatrix._same(model.instead, plan) for plan in others)
    assert set(trial.seconds) == {name for name, _ in trial.plans}  # every plan ran, timed


def test_compiled_the_split_the_forward_route_replaced_is_on_trial():
    """Compiled, a trial tries no route alone, so the replaced split is a plan of its own (the
    first call runs the forward route eagerly: nothing compiles here)."""
    if not pyhvp.restricted.compiles():
        pytest.skip("this torch's dynamo cannot trace the sparse kernel: a compiled backend's "
                    "routes run eagerly, and its trial tries each route alone")  # fmt: skip
    pyhvp.sub_hessian(tanh_stack, STACK, STACK_INDEX, backend=pyhvp.TorchBackend(compile=True))
    (trial,) = submatrix._ROUTES.values()
    assert [name for name, _ in trial.plans] == [
        "the cost model's routes", "the seed's loop", submatrix.MODEL_INSTEAD
    ]  # fmt: skip


def rectified_in_place_stack(p):
    """``tanh_stack`` with a ReLU in place on each layer's pre-activation: autograd allows the
    write (``F.linear`` saves no output), the forward route refuses it."""
    x = WIDE_INPUT
    for weight in p.values():
        x = torch.tanh(F.relu(F.linear(x, weight), inplace=True))
    return (x**2).sum()


def test_a_loss_the_survey_sees_the_forward_route_refuse_never_takes_it(caplog):
    """The survey asks the forward route's refusals of every op an activation enters: such a
    loss is neither given the forward route by the model nor tried, so no call pays for a
    failed attempt."""
    with caplog.at_level(logging.DEBUG, "pyhvp.sub_hessian"):
        for _ in range(8):
            got = pyhvp.sub_hessian(rectified_in_place_stack, STACK, STACK_INDEX, backend=EAGER)
    (trial,) = submatrix._ROUTES.values()
    assert submatrix.FORWARD not in dict(trial.plans) and not trial.model.forward
    assert not any(hasattr(r, "forward") or "failed" in r.getMessage() for r in caplog.records)
    expected = pyhvp.sub_hessian(rectified_in_place_stack, STACK, STACK_INDEX, method="reverse")
    torch.testing.assert_close(got, expected, **F64)
