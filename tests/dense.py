"""Dense float64 ground truth, shared by every operator's tests.

Everything here is computed the slow, obvious way -- full ``torch.func.hessian`` in float64 -- and
is only meant for small problems.
"""

from __future__ import annotations

import math

import torch
from torch.func import hessian, jacrev


def to64(value):
    return (
        value.double() if isinstance(value, torch.Tensor) and value.is_floating_point() else value
    )


def dense_hessian(f, x, *args):
    """Full Hessian of ``f(x, *args)`` (any output shape) w.r.t. x in float64.

    Shape ``out_shape + x.shape + x.shape``.
    """
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
    """Reference sub-Hessian: the full Hessian of ``loss(params)`` from ``torch.func.hessian``,
    restricted to the selected flat entries.

    ``params`` a tensor and ``index`` a 1-D index tensor -> ``(k, k)``; ``params`` a dict and
    ``index`` a dict of index tensors -> the joint ``(K, K)``, blocks in ``index``'s order. Pass
    float64 params (and a float64 loss) for a float64 reference.
    """
    if isinstance(params, torch.Tensor):
        return dense_sub_hessian(lambda p: loss(p["x"]), {"x": params}, {"x": index})
    names = list(index)
    full = hessian(lambda selected: loss({**params, **selected}))({n: params[n] for n in names})
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
