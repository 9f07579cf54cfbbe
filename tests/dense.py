"""Dense float64 ground truth, shared by every operator's tests.

Everything here is computed the slow, obvious way -- full ``torch.func.hessian`` in float64 -- and
is only meant for small problems.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch.func import hessian, jacrev
from torch.nn.attention import SDPBackend, sdpa_kernel


def to64(value):
    return (
        value.double() if isinstance(value, torch.Tensor) and value.is_floating_point() else value
    )


def dense_hessian(f, x, *args):
    """Full Hessian of ``f(x, *args)`` (any output shape) w.r.t. x in float64.

    Shape ``out_shape + x.shape + x.shape``. Attention on its math path: from torch 2.14 the CPU
    one runs a fused kernel (``_scaled_dot_product_flash_attention_for_cpu``) that autograd
    cannot differentiate twice. Not a reference where ``x`` enters ``layer_norm``'s weight:
    torch.func's second derivative there is wrong (see :func:`dense_sub_hessian`).
    """
    with sdpa_kernel(SDPBackend.MATH):
        return hessian(lambda y: f(y, *map(to64, args)))(x.double())


def instance_hessians(f, x, *args, event_dims=1):
    """Per-instance Hessian blocks of a batched f, from the full dense Hessian.

    ``f(x)`` has shape ``batch + out``; returns ``batch + out + (N, N)`` with ``N`` the number of
    variables of one instance (event dims flattened in row-major order).
    """
    batch = x.shape[: x.ndim - event_dims]
    n_inst, n_var = math.prod(batch), math.prod(x.shape[x.ndim - event_dims :])
    out_shape = f(x.double(), *map(to64, args)).shape[len(batch) :]
    full = dense_hessian(f, x, *args).reshape(n_inst, -1, n_inst, n_var, n_inst, n_var)
    idx = torch.arange(n_inst)
    blocks = full[idx, :, idx, :, idx, :]  # (n_inst, M, N, N)
    return blocks.reshape(*batch, *out_shape, n_var, n_var)


def instance_hvp(f, x, v, *args, event_dims=1):
    """Reference per-instance HVP of a scalar-per-instance f: H_b @ v_b for every instance b."""
    blocks = instance_hessians(f, x, *args, event_dims=event_dims)
    batch = x.shape[: x.ndim - event_dims]
    flat_v = v.double().reshape(*v.shape[: v.ndim - x.ndim], *batch, -1)
    return torch.einsum("...ij,...j->...i", blocks, flat_v).reshape(v.shape)


def dense_sub_hessian(loss, params, index):
    """Reference sub-Hessian: the full Hessian of ``loss(params)`` by autograd's double backward
    (``torch.autograd.functional.hessian``), restricted to the selected flat entries. Not
    ``torch.func.hessian``: torch.func's second derivative of ``layer_norm`` in its weight and
    its input is wrong (torch 2.5-2.14: asymmetric, 1.04 off finite differences on the attention
    block of ``test_sub_hessian_sparse_ops``), autograd's matches finite differences. Not a
    reference where a selected tensor is the bias of a norm without a weight either: autograd's
    double backward drops it there (``test_norms_differentiated_twice``).

    ``params`` a tensor and ``index`` a 1-D index tensor -> ``(k, k)``; ``params`` a dict and
    ``index`` a dict of index tensors -> the joint ``(K, K)``, blocks in ``index``'s order. Pass
    float64 params (and a float64 loss) for a float64 reference.
    """
    if isinstance(params, torch.Tensor):
        return dense_sub_hessian(lambda p: loss(p["x"]), {"x": params}, {"x": index})
    names = list(index)

    def of_selected(*values):
        return loss({**params, **dict(zip(names, values, strict=True))})

    selected = tuple(params[n] for n in names)
    # one batched backward per tensor, or one per entry through a group norm, whose batched
    # double backward torch gets wrong (or fails in); attention on its math path, as in
    # dense_hessian
    with sdpa_kernel(SDPBackend.MATH):
        with _group_norms_seen() as seen:
            try:
                pairs = torch.autograd.functional.hessian(of_selected, selected, vectorize=True)
            except RuntimeError:
                seen.append("a batched backward torch cannot run")
        if seen:
            pairs = torch.autograd.functional.hessian(of_selected, selected)
    full = {a: dict(zip(names, row, strict=True)) for a, row in zip(names, pairs, strict=True)}
    return torch.cat(
        [
            torch.cat(
                [
                    full[a][b].reshape(params[a].numel(), params[b].numel())[index[a]][:, index[b]]
                    for b in names
                ],
                dim=1,
            )
            for a in names
        ]
    )


@contextlib.contextmanager
def _group_norms_seen():
    """A list that gets an entry per ``torch.group_norm`` call (``F.group_norm`` calls it) made
    inside, without running anything twice (a loss that draws would draw anew)."""
    seen, torchs = [], torch.group_norm

    def group_norm(*args, **kwargs):
        seen.append("group_norm")
        return torchs(*args, **kwargs)

    torch.group_norm = group_norm
    try:
        yield seen
    finally:
        torch.group_norm = torchs


def loop_sub_hessian(loss, params, index):
    """The seed's method on ``loss`` of a dict of tensors, joint: one forward and a gradient that
    keeps its graph, then one reverse pass per selected entry; ``(K, K)`` over ``index``'s
    entries in its order. For tensors too large for :func:`dense_sub_hessian`."""
    leaves = {name: t.detach().requires_grad_() for name, t in params.items()}
    grads = dict(zip(leaves, torch.autograd.grad(loss(leaves), list(leaves.values()),
                                                 create_graph=True), strict=True))  # fmt: skip
    selected = [leaves[name] for name in index]
    rows = []
    for name, entries in index.items():
        for entry in entries.tolist():
            parts = torch.autograd.grad(grads[name].reshape(-1)[entry], selected,
                                        retain_graph=True, materialize_grads=True)  # fmt: skip
            rows.append(torch.cat([part.reshape(-1)[index[other]]
                                   for part, other in zip(parts, index, strict=True)]))  # fmt: skip
    return torch.stack(rows).detach()


def loop_sub_hessians(model, criterion, inputs, targets, index):
    """The seed's method, as reference: a gradient that keeps its graph, then one reverse pass
    per selected component of each named parameter; ``{name: (k, k)}`` in the model's dtype."""
    named = dict(model.named_parameters())
    loss = criterion(model(inputs), targets)
    grads = dict(
        zip(named, torch.autograd.grad(loss, list(named.values()), create_graph=True), strict=True)
    )
    blocks = {}
    for name, idxs in index.items():
        flat_grad = grads[name].reshape(-1)
        rows = [
            torch.autograd.grad(flat_grad[i], named[name], retain_graph=True)[0].reshape(-1)
            for i in idxs.tolist()
        ]
        blocks[name] = torch.stack(rows)[:, idxs].detach()
    return blocks


def instance_hessian_diagonal(f, x, *args, event_dims=1):
    """Diagonals of the dense per-instance Hessians: ``batch + out + event_shape``, float64."""
    blocks = instance_hessians(f, x, *args, event_dims=event_dims)
    return blocks.diagonal(dim1=-2, dim2=-1).reshape(
        *blocks.shape[:-2], *x.shape[x.ndim - event_dims :]
    )


def instance_laplacian(f, x, *args, event_dims=1):
    """Traces of the dense per-instance Hessians: ``batch + out``, float64."""
    blocks = instance_hessians(f, x, *args, event_dims=event_dims)
    return blocks.diagonal(dim1=-2, dim2=-1).sum(-1)


def instance_weighted_trace(f, x, factor, *args, event_dims=1):
    """``tr(S^T H S)`` per instance and output, ``S = factor`` of shape ``event + (r,)`` or with
    leading dims broadcasting against the batch dims: ``batch + out``, float64."""
    blocks = instance_hessians(f, x, *args, event_dims=event_dims)  # batch + out + (N, N)
    n_batch = x.ndim - event_dims
    n_out = blocks.ndim - n_batch - 2
    lead = factor.shape[: factor.ndim - event_dims - 1]
    s = factor.double().reshape(*lead, -1, factor.shape[-1])
    s = s.reshape((1,) * (n_batch - len(lead)) + tuple(lead) + (1,) * n_out + s.shape[-2:])
    return (s.mT @ blocks @ s).diagonal(dim1=-2, dim2=-1).sum(-1)


def instance_jacobian(f, x, *args, event_dims=1):
    """Every output's gradient in its own instance's variables: ``batch + out + event``."""
    batch = x.shape[: x.ndim - event_dims]
    n_inst, n_var = math.prod(batch), math.prod(x.shape[x.ndim - event_dims :])
    out_shape = f(x.double(), *map(to64, args)).shape[len(batch) :]
    full = jacrev(lambda y: f(y, *map(to64, args)))(x.double())
    idx = torch.arange(n_inst)
    blocks = full.reshape(n_inst, -1, n_inst, n_var)[idx, :, idx, :]
    return blocks.reshape(*batch, *out_shape, *x.shape[x.ndim - event_dims :])


# --- what the Taylor engine must differentiate like autograd (shared by the Laplacian and
# diagonal specs): f, the point, and a mathematically equal f that torch.func differentiates ---


def nested_mixed_partial(f, x, alpha, *args, event_dims=1, create_graph=False):
    """``d^alpha f`` per instance and output by nested ``torch.autograd.grad`` (the PINN
    libraries' idiom) in float64: ``alpha`` lists the flat event indices differentiated, with
    repeats; ``batch + out``. Instances are independent, so each grad of a sum over instances
    is every instance's own. ``x`` keeps its own dtype when it requires grad (then the result is
    differentiable in ``x``, ``args`` and what ``f`` captures, with ``create_graph``)."""
    y = x if x.requires_grad else x.detach().double().requires_grad_()
    n_batch = x.ndim - event_dims
    out = f(y, *(args if x.requires_grad else map(to64, args)))
    flat_out = out.reshape(*out.shape[:n_batch], -1)
    results = []
    for k in range(flat_out.shape[-1]):
        h = flat_out[..., k]
        for i in alpha:
            (g,) = torch.autograd.grad(h.sum(), y, create_graph=True, allow_unused=True,
                                       materialize_grads=True)  # fmt: skip
            h = g.reshape(*g.shape[:n_batch], -1)[..., i]
        results.append(h if create_graph else h.detach())
    return torch.stack(results, -1).reshape(out.shape)


def nested_directional_derivatives(f, x, v, order, *args, event_dims=1):
    """``d^k/dt^k f(x + t v)`` for ``k = 0..order`` per instance by nested ``torch.autograd.grad``
    in a per-instance ``t`` (float64): ``(order + 1, *batch, *out)``. ``v``: x's shape or the
    event's."""
    n_batch = x.ndim - event_dims
    t = torch.zeros(x.shape[:n_batch], dtype=torch.float64, requires_grad=True)
    out = f(x.double() + t.reshape(*t.shape, *(1,) * event_dims) * v.double(), *map(to64, args))
    flat_out = out.reshape(*out.shape[:n_batch], -1)
    columns = []
    for k in range(flat_out.shape[-1]):
        h, orders = flat_out[..., k], [flat_out[..., k].detach()]
        for _ in range(order):
            (h,) = torch.autograd.grad(h.sum(), t, create_graph=True, allow_unused=True,
                                       materialize_grads=True)  # fmt: skip
            orders.append(h.detach())
        columns.append(torch.stack(orders))
    return torch.stack(columns, -1).reshape(order + 1, *out.shape)


def nested_bilaplacian(f, x, *args, event_dims=1, create_graph=False):
    """``sum_{i,j} d^4 f / dx_i^2 dx_j^2`` per instance and output by nested autograd."""
    n = math.prod(x.shape[x.ndim - event_dims :])
    return sum(nested_mixed_partial(f, x, (i, i, j, j), *args, event_dims=event_dims,
                                    create_graph=create_graph)
               for i in range(n) for j in range(n))  # fmt: skip


def _at(device, values=None, shape=(4, 4), seed=3):
    """A float64 point: ``values``, or standard normals of ``shape``."""
    if values is not None:
        return torch.tensor(values, dtype=torch.float64, device=device)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(device)


def _weights(*shape, device, seed=11):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(device)


def _powers(x):
    """``x ** p`` for a tensor of exponents 0..3, at points where x is 0 (autograd masks
    ``p x^(p-1)`` where p = 0 and ``p (p-1) x^(p-2)`` where p is 0 or 1)."""
    p = torch.arange(4, dtype=x.dtype, device=x.device)
    return (x[..., None] ** p).sum((-2, -1))


def _zero_base(x):
    """A zero base: ``0 ** x`` (as a Python number and as a tensor) has zero derivatives where
    x >= 0; and ``2 ** x``."""
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    return (0.0 ** x.abs() + zero ** x.abs() + 2.0**x).sum(-1)


def _variable_powers(x):
    """``x_0 ** (2 + x_2 ** 2)`` and ``x_1 ** (2 + x_3 ** 2)``, base and exponent both from x, at
    zero bases: every coefficient was NaN there (``exp(e log 0)``), the gradient included."""
    return (x[..., :2] ** (2 + x[..., 2:] ** 2)).sum(-1)


def _solves(device):
    """Constant batched A (2, 3, 3) against each instance's 1-D right-hand side (a vector per
    batch of A) and against a (3, 3) one (matrices: A.ndim - 1 dims but not A.shape[:-1])."""
    a = _weights(2, 3, 3, device=device) + 3 * torch.eye(3, dtype=torch.float64, device=device)

    def f(x):
        rows = []
        for xi in x:  # one instance at a time: each solve broadcasts its own right-hand side
            vector = torch.linalg.solve(a, xi[:3]).pow(2).sum()
            matrix = torch.linalg.solve(a, xi[:3, None] * xi[None, 1:]).pow(2).sum()
            rows.append(vector + matrix)
        return torch.stack(rows)

    return f


def _singular_det(x):
    """det of a matrix with two equal rows in instance 0 (det = 0 there), others invertible."""
    second = torch.cat([x[:1, :2], x[1:, 2:] + 3], 0)
    return torch.linalg.det(torch.stack([x[:, :2], second], -2)) + x.pow(3).sum(-1)


def _no_grad_inside(x):
    with torch.no_grad():
        scale = x.pow(2).sum(-1, keepdim=True)  # a constant, as autograd has it
        detached_view = x[..., :1]
    return (x.pow(3) * scale).sum(-1) + (detached_view * x).sum(-1)


def _no_grad_reference(x):
    scale = x.pow(2).sum(-1, keepdim=True).detach()
    return (x.pow(3) * scale).sum(-1) + (x[..., :1].detach() * x).sum(-1)


def _in_place_without_grad(x):
    """An in-place write under no_grad keeps the tensor's derivatives (autograd does not see
    it): PyTorch's cosine_similarity clamps its norms so."""
    norm = x.norm(dim=-1, keepdim=True)
    with torch.no_grad():
        norm.clamp_min_(0.5)
    return (x / norm).pow(3).sum(-1) + torch.nn.functional.cosine_similarity(x, x.flip(-1) + 1)


def _in_place_reference(x):
    norm = x.norm(dim=-1, keepdim=True)
    norm = norm + (norm.clamp_min(0.5) - norm).detach()
    eps = 1e-8
    y = x.flip(-1) + 1
    n1, n2 = x.norm(dim=-1), y.norm(dim=-1)
    n1 = n1 + (n1.clamp_min(eps) - n1).detach()
    n2 = n2 + (n2.clamp_min(eps) - n2).detach()
    return (x / norm).pow(3).sum(-1) + ((x / n1[..., None]) * (y / n2[..., None])).sum(-1)


def _churn(x):
    """Temporaries die every step, so Python reuses their ids; ``acc.data`` makes new objects
    (constants) that may take such an id -- they must not inherit the dead tensor's label."""
    acc = x
    for _ in range(12):
        t = torch.sin(acc) * 0.5
        acc = acc + t * t
        del t
        acc = acc + 0.1 * torch.cos(acc.data)
    return acc.pow(2).sum(-1)


def _churn_reference(x):
    acc = x
    for _ in range(12):
        t = torch.sin(acc) * 0.5
        acc = acc + t * t
        acc = acc + 0.1 * torch.cos(acc.detach())
    return acc.pow(2).sum(-1)


def _strided_write(x):
    y = x.clone()
    y.view(x.shape[0], 2, 2).add_(1.0)
    y.as_strided((x.shape[0], 2), (4, 2)).mul_(3)
    return (y**3).sum(-1)


def _strided_reference(x):
    y = x + 1.0
    y = torch.stack([y[:, 0] * 3, y[:, 1], y[:, 2] * 3, y[:, 3]], -1)
    return (y**3).sum(-1)


def _func_grad_inside(device):
    w = _weights(4, 4, device=device)

    def energy(xi):
        return torch.tanh(xi @ w).pow(2).sum()

    return lambda x: torch.vmap(torch.func.grad(energy))(x).pow(2).sum(-1)


class _Exp2(torch.autograd.Function):
    """2 exp(a), with a backward of its own (its forward runs without grad, like no_grad)."""

    @staticmethod
    def forward(ctx, a):
        out = 2 * torch.exp(a)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * out


def _transformer(device, attention):
    """An evaluation-mode encoder layer (or attention alone): PyTorch would take its fused
    inference path, which has no derivatives."""
    torch.manual_seed(0)
    if attention:
        layer = torch.nn.MultiheadAttention(4, 2, batch_first=True)
    else:
        layer = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0,
                                                 batch_first=True)  # fmt: skip
    layer = layer.eval().requires_grad_(False).to(device, torch.float64)

    def f(x):
        out = layer(x, x, x, need_weights=False)[0] if attention else layer(x)
        return out.pow(2).sum((-2, -1))

    def reference(x):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.MATH]):
            return f(x)

    return f, reference


def _mse_of_weights(device):
    """BackPACK's DiagHessian case (issue 16: a segfault): F.mse_loss of a small network, as a
    function of its first layer's weights, one instance (a weight matrix) at a time."""
    inputs, targets, second = (_weights(*shape, device=device, seed=seed)
                               for shape, seed in (((8, 3), 5), ((8, 2), 6), ((2, 3), 7)))  # fmt: skip

    def f(x):
        losses = []
        for w in x.reshape(-1, 3, 3):
            hidden = torch.sigmoid(torch.nn.functional.linear(inputs, w))
            losses.append(torch.nn.functional.mse_loss(hidden @ second.T, targets))
        return torch.stack(losses)

    return f


def _small_cnn(device):
    """conv2d (stride, padding, bias), max and average pooling on instances of (2, 5, 5)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.Tanh(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(3, 2, 2, stride=1, groups=1), torch.nn.Softplus(),
        torch.nn.AvgPool2d(1), torch.nn.Flatten(),
    ).double().to(device)  # fmt: skip

    def f(x):
        return net(x).pow(2).sum(-1)

    return f


def _writes_and_scatters(x):
    """A functionalized setitem (slice_scatter), index_put, scatter_add, roll and tril."""
    y = torch.zeros(*x.shape[:-1], 8, dtype=x.dtype, device=x.device)
    y[..., ::2] = x**2
    index = torch.tensor([0, 1, 0, 2], device=x.device).expand(*x.shape[:-1], 4)
    scattered = torch.zeros(*x.shape[:-1], 3, dtype=x.dtype, device=x.device)
    scattered = scattered.scatter_add(-1, index, torch.sin(x))
    square = torch.tril(torch.roll(x, 1, -1)[..., None] * x[..., None, :])
    put = torch.zeros(*x.shape[:-1], 5, dtype=x.dtype, device=x.device)
    put[..., torch.tensor([4, 0], device=x.device)] = x[..., :2] ** 3  # index_put
    return torch.exp(y).sum(-1) + scattered.pow(3).sum(-1) + square.sum((-2, -1)) + put.sum(-1)


SENDERS, RECEIVERS = [0, 1, 2, 3, 3, 1], [1, 2, 3, 0, 1, 1]


def message_passing(x):
    """A graph network's step: a message per edge (gathers of both ends), summed into each
    receiver by ``index_add``."""
    senders, receivers = (torch.tensor(i, device=x.device) for i in (SENDERS, RECEIVERS))
    messages = torch.tanh(x[..., senders] - 2 * x[..., receivers])
    return torch.zeros_like(x).index_add(-1, receivers, messages).pow(2).sum(-1)


def _selections(x):
    """sort, topk, cumprod and prod -- with zeros in the product (instance 0 of ZEROS)."""
    weights = torch.arange(1.0, 5.0, dtype=x.dtype, device=x.device)
    return ((x.sort(-1).values * weights).pow(3).sum(-1) + x.topk(2, -1).values.exp().sum(-1)
            + x.cumprod(-1).sum(-1) + x.prod(-1) + (x * x).prod(-1))  # fmt: skip


def _eigenvalues(x):
    """eigvalsh of a symmetric matrix built from x (distinct eigenvalues)."""
    a = x.reshape(*x.shape[:-1], 2, 2)
    a = a + a.mT + torch.diag(torch.tensor([0.0, 3.0], dtype=x.dtype, device=x.device))
    return (torch.linalg.eigvalsh(a) * torch.tensor([1.0, -2.0], dtype=x.dtype,
                                                     device=x.device)).sum(-1)  # fmt: skip


# masked entries enter as -inf (or 0) where derivatives are not finite: issue 29 --------------
KEPT = [True, False, True, False]  # masks of an instance's 4 entries, both ways: every pairing
OTHER_KEPT = [True, True, False, False]


def _masked_logaddexp(x):
    """``torch.masked.logaddexp`` of x and a function of x: masked entries enter as -inf, and
    where both are masked the value is -inf (NaN partials, which spread to the whole instance)."""
    kept, other_kept = (torch.tensor(m, device=x.device) for m in (KEPT, OTHER_KEPT))
    weights = torch.arange(1.0, 5.0, dtype=x.dtype, device=x.device)
    out = torch.masked.logaddexp(x, x.flip(-1) ** 2, input_mask=kept, other_mask=other_kept)
    return (weights * out).sum(-1)


def _masked_attention(x):
    """Causal self-attention of 2 tokens (-inf above the diagonal, through softmax), and a
    logsumexp over keys hiding every key of the first query (its row is all -inf)."""
    q = x.reshape(*x.shape[:-1], 2, 2)
    scores = q @ q.mT
    causal = torch.ones(2, 2, dtype=torch.bool, device=x.device).tril()
    attended = torch.softmax(scores.masked_fill(~causal, -torch.inf), -1) @ q
    hidden = torch.tensor([[True, True], [False, True]], device=x.device)
    pooled = torch.logsumexp(scores.masked_fill(hidden, -torch.inf), -1).exp()
    return attended.pow(2).sum((-2, -1)) + pooled.sum(-1)


def _where_infinite_branch(x):
    """``torch.where`` whose unselected branch is infinite or NaN (log and 1/x at 0, log of a
    negative number)."""
    return (torch.where(x > 0, torch.log(x), x**3) + torch.where(x != 0, 1 / x, x)).sum(-1)


def _where_infinite_branch_reference(x):  # the safe idiom: autograd's gradient is NaN at x = 0
    positive, nonzero = torch.where(x > 0, x, 1.0), torch.where(x != 0, x, 1.0)
    return (torch.where(x > 0, torch.log(positive), x**3)
            + torch.where(x != 0, 1 / nonzero, x)).sum(-1)  # fmt: skip


def _masked_zeros(x):
    """Zeros of relu, masked_fill and clamp through derivatives infinite at 0: sqrt, x ** 1.5,
    xlogy, entr, log1p of sqrt; then sums and a linear layer."""
    r = torch.relu(x)
    filled = x.masked_fill(x < 0.3, 0.0)
    clamped = x.clamp(min=-0.2) + 0.2
    weight = torch.arange(1.0, 13.0, dtype=x.dtype, device=x.device).reshape(4, 3)
    return ((r.sqrt() + filled**1.5 + torch.xlogy(r, r) + torch.special.entr(clamped)).sum(-1)
            + (torch.log1p(r.sqrt()) @ weight).sum(-1))  # fmt: skip


def _masked_logcumsumexp(x):
    """logcumsumexp (the reverse-mode fallback's) of -inf-masked entries."""
    return torch.logcumsumexp(torch.where(x > 0, x, -torch.inf), -1).exp().sum(-1)


@dataclass
class TaylorCase:
    """``build(device) -> (f, reference)``: f and a mathematically equal f for torch.func (None:
    f itself); ``point(device) -> x``."""

    name: str
    build: object
    point: object = _at
    event_dims: int = 1


def _same(f, reference=None):
    return lambda device: (f, reference)


ZEROS = [[0.0, 1.0, -2.0, 0.0], [0.5, 0.0, 3.0, -1.0]]
TAYLOR_CASES = [
    TaylorCase("x ** tensor, at x = 0", _same(_powers), lambda d: _at(d, ZEROS)),
    TaylorCase("0 ** x, 2 ** x, at x = 0", _same(_zero_base), lambda d: _at(d, ZEROS)),
    TaylorCase("x ** f(x), at x = 0", _same(_variable_powers), lambda d: _at(d, ZEROS)),
    TaylorCase("solve: vector and matrix right-hand sides against a batch of A",
               lambda d: (_solves(d), None)),
    TaylorCase("det with a singular instance", _same(_singular_det)),
    TaylorCase("torch.no_grad() inside f", _same(_no_grad_inside, _no_grad_reference)),
    TaylorCase("in-place write under no_grad, cosine_similarity",
               _same(_in_place_without_grad, _in_place_reference)),
    TaylorCase("temporaries dying, ids reused", _same(_churn, _churn_reference)),
    TaylorCase("write through an as_strided view", _same(_strided_write, _strided_reference)),
    TaylorCase("torch.func.grad inside f", lambda d: (_func_grad_inside(d), None)),
    TaylorCase("autograd.Function inside f", _same(lambda x: _Exp2.apply(x.sin()).sum(-1),
                                                    lambda x: (2 * torch.exp(x.sin())).sum(-1))),
    TaylorCase("many 3x3 LU factorizations (per-matrix reverse-mode rule)",
               _same(lambda x: torch.linalg.lu(x.reshape(-1, 3, 3)).U.pow(2).sum((-2, -1))),
               lambda d: _at(d, shape=(64, 9))),
    TaylorCase("TransformerEncoderLayer, eval mode", lambda d: _transformer(d, False),
               lambda d: _at(d, shape=(2, 3, 4)), event_dims=2),
    TaylorCase("MultiheadAttention, eval mode", lambda d: _transformer(d, True),
               lambda d: _at(d, shape=(2, 3, 4)), event_dims=2),
    TaylorCase("F.mse_loss of a network's weights (a segfault before)",
               lambda d: (_mse_of_weights(d), None),
               lambda d: _at(d, shape=(2, 9))),
    TaylorCase("conv2d, max and average pooling", lambda d: (_small_cnn(d), None),
               lambda d: _at(d, shape=(2, 2, 5, 5)), event_dims=3),
    TaylorCase("setitem, index_put, scatter_add, roll, tril", _same(_writes_and_scatters)),
    TaylorCase("message passing: gathers and index_add", _same(message_passing)),
    TaylorCase("sort, topk, cumprod, prod with zeros", _same(_selections),
               lambda d: _at(d, ZEROS)),
    TaylorCase("eigvalsh", _same(_eigenvalues)),
    TaylorCase("masked logaddexp: -inf where masked, both masked in places",
               _same(_masked_logaddexp)),
    TaylorCase("attention with -inf masks: softmax, logsumexp of a masked row",
               _same(_masked_attention)),
    TaylorCase("where with an infinite unselected branch",
               _same(_where_infinite_branch, _where_infinite_branch_reference),
               lambda d: _at(d, ZEROS)),
    TaylorCase("masked zeros into sqrt, powers, xlogy, entr, a linear layer",
               _same(_masked_zeros)),
    TaylorCase("logcumsumexp of -inf-masked entries", _same(_masked_logcumsumexp)),
]  # fmt: skip
"""What :mod:`pyhvp.taylor` must differentiate as autograd does (dense references need at most
the first 8 instances: instances are independent)."""
