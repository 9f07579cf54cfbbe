"""
Your own op in the Taylor engine
================================

Exact Hessian diagonals and Laplacians run on pyhvp's Taylor engine, which records the aten ops
``f`` calls and pushes second-order jets through each. An op of your own -- a fused kernel
written in Triton or C++, registered with ``torch.library.custom_op`` -- is a black box to it
until you say how jets pass through it (folx's ``register_function``, here
:func:`pyhvp.register_jet_rule`):

* a **rule** from the op's first and second derivatives (``pyhvp.taylor.chain`` writes an
  elementwise one in a line);
* ``linear=True`` for an op that is linear in its inputs that depend on ``x`` (a fixed stencil,
  a convolution with a constant kernel): each coefficient goes through the op itself, batched
  over directions, with no autograd and nothing dense.

Both are checked below against dense float64 Hessians of the same function written in plain
torch. Run: ``python examples/custom_jet_rule.py``.
"""

import torch
import torch.nn.functional as F
from torch.func import hessian, vmap

import pyhvp
from pyhvp.taylor import chain

# %%
# A fused elementwise op, ``log(cosh(u))``, as if it were a custom kernel. Its rule needs
# ``g'(u) = tanh(u)`` and ``g''(u) = 1 - tanh(u)^2``.


@torch.library.custom_op("example::log_cosh", mutates_args=())
def log_cosh(u: torch.Tensor) -> torch.Tensor:
    return u + F.softplus(-2 * u) - torch.log(torch.tensor(2.0, dtype=u.dtype))


@log_cosh.register_fake
def _(u):
    return torch.empty_like(u)


@pyhvp.register_jet_rule(log_cosh)
def _(ctx, out, u):
    slope = torch.tanh(u.value)
    return chain(ctx, out, u, slope, 1 - slope * slope)


# %%
# A fixed finite-difference stencil (a discrete second derivative along the last dim): linear in
# its input, with the stencil held fixed.

STENCIL = torch.tensor([1.0, -2.0, 1.0], dtype=torch.float64)


@torch.library.custom_op("example::stencil", mutates_args=())
def stencil(u: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    flat = u.reshape(-1, 1, u.shape[-1])
    return F.conv1d(flat, weights.reshape(1, 1, -1)).reshape(*u.shape[:-1], -1)


@stencil.register_fake
def _(u, weights):
    return u.new_empty((*u.shape[:-1], u.shape[-1] - weights.shape[0] + 1))


pyhvp.register_jet_rule(stencil, linear=True)

# %%
# A batched energy that uses both, and the same energy in plain torch for the reference.


def energy(x):
    return log_cosh(stencil(x, STENCIL)).sum(-1) + log_cosh(x).pow(2).sum(-1)


def plain_energy(x):
    curvature = F.conv1d(x.reshape(-1, 1, x.shape[-1]), STENCIL.reshape(1, 1, -1))
    curvature = curvature.reshape(*x.shape[:-1], -1)
    return torch.log(torch.cosh(curvature)).sum(-1) + torch.log(torch.cosh(x)).pow(2).sum(-1)


torch.manual_seed(0)
x = torch.randn(64, 12, dtype=torch.float64)
dense = vmap(hessian(plain_energy))(x)  # (64, 12, 12): only for checking
diagonal = pyhvp.hessian_diagonal(energy, x)
laplacian = pyhvp.laplacian(energy, x)
diagonal_error = (diagonal - dense.diagonal(dim1=-2, dim2=-1)).abs().max().item()
laplacian_error = (laplacian - dense.diagonal(dim1=-2, dim2=-1).sum(-1)).abs().max().item()
print(f"Hessian diagonal: max error {diagonal_error:.2e} against the dense float64 Hessian")
print(f"Laplacian:        max error {laplacian_error:.2e}")
assert diagonal_error < 1e-10 and laplacian_error < 1e-10, "a registered rule disagrees"
