"""Dense float64 ground truth, shared by every operator's tests.

Everything here is computed the slow, obvious way -- full ``torch.func.hessian`` in float64 -- and
is only meant for small problems.
"""

from __future__ import annotations

import math

import torch
from torch.func import hessian


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
