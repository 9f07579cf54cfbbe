"""
Your own op in the Taylor engine
================================

Exact Hessian diagonals and Laplacians run on pyhvp's Taylor engine, which records the aten ops
``f`` calls and pushes second-order jets through each. An op of your own -- a fused kernel
written in Triton or C++, registered with ``torch.library.custom_op`` -- is a black box to it
until you say how jets pass through it (folx's ``register_function``, here
:func:`pyhvp.register_jet_rule`):

* a **rule** from the op's derivatives (``pyhvp.taylor.chain`` writes an elementwise one in a
  line; give it derivatives up to ``ctx.order``, the kernel's order, and the same rule serves
  Laplacians and fourth-order operators alike);
* ``linear=True`` for an op that is linear in its inputs that depend on ``x`` (a fixed stencil,
  a convolution with a constant kernel): each coefficient goes through the op itself, batched
  over directions, with no autograd and nothing dense.

Both are checked below against dense float64 Hessians of the same function written in plain
torch, and at fourth order against nested autograd. Run: ``python examples/custom_jet_rule.py``.
"""

import torch
import torch.nn.functional as F
from torch.func import hessian, vmap

import pyhvp
from pyhvp.taylor import chain

# %%
# A fused elementwise op, ``log(cosh(u))``, as if it were a custom kernel. Its derivatives are
# ``g' = tanh(u) = y`` and then polynomials in ``y``: each is the previous one's derivative in
# ``y`` times ``1 - y^2`` (``g'' = 1 - y^2``, the third ``-2 y (1 - y^2)``, ...).


@torch.library.custom_op("example::log_cosh", mutates_args=())
def log_cosh(u: torch.Tensor) -> torch.Tensor:
    return u + F.softplus(-2 * u) - torch.log(torch.tensor(2.0, dtype=u.dtype))


@log_cosh.register_fake
def _(u):
    return torch.empty_like(u)


def tanh_derivative_polynomials(order):
    """Coefficients (constant first) of the polynomials in y = tanh(u) that are g', g'', ...:
    y, then (1 - y^2) times the previous one's derivative in y."""
    polynomials = [[0.0, 1.0]]
    for _ in range(order - 1):
        slope = [*(i * c for i, c in enumerate(polynomials[-1]) if i), 0.0, 0.0]
        polynomials.append([a - (slope[i - 2] if i >= 2 else 0.0) for i, a in enumerate(slope)])
    return polynomials


@pyhvp.register_jet_rule(log_cosh)
def _(ctx, out, u):
    y = torch.tanh(u.value)
    derivatives = [sum(c * y**i for i, c in enumerate(p) if c)
                   for p in tanh_derivative_polynomials(ctx.order)]  # fmt: skip
    return chain(ctx, out, u, *derivatives)


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

# %%
# The same rule at fourth order: ``d^4/dt^4 energy(x + t v)`` against nested autograd.

v = torch.randn(64, 12, dtype=torch.float64)
fourth = pyhvp.directional_derivatives(energy, x, v, order=4)[4]
t = torch.zeros(64, dtype=torch.float64, requires_grad=True)
nested = plain_energy(x + t[:, None] * v)
for _ in range(4):
    (nested,) = torch.autograd.grad(nested.sum(), t, create_graph=True)
fourth_error = ((fourth - nested).abs().max() / nested.abs().max()).item()
print(f"fourth order:     relative error {fourth_error:.2e} against nested autograd")
assert fourth_error < 1e-10, "the rule disagrees at fourth order"
