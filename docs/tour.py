"""The 20-line tour of docs/getting_started.md (run by tests/test_examples.py)."""

# fmt: off
import torch
from torch import nn

import pyhvp

# per-instance gradient and Hessian-vector product: 1000 particles in 3-D
f = lambda x, mu: torch.exp(-((x - mu) ** 2).sum(-1))  # noqa: E731  (1000, 3) -> (1000,)
x, v, mu = torch.randn(1000, 3), torch.randn(1000, 3), torch.zeros(3)
g, hv = pyhvp.grad_and_hvp(f, x, v, mu)                   # both (1000, 3)
pyhvp.check_instances(f, x, mu)                           # raises if instances are coupled

# exact Hessian diagonal and Laplacian of a network, per input point
net = nn.Sequential(nn.Linear(3, 64), nn.Tanh(), nn.Linear(64, 2))
d = pyhvp.hessian_diagonal(net, x)                        # (1000, 2, 3)
lap = pyhvp.laplacian(net, x)                             # (1000, 2), differentiable in net
bil = pyhvp.bilaplacian(net, x)                           # (1000, 2): fourth-order Taylor mode
u_xxxx = pyhvp.directional_derivatives(net, x, torch.tensor([1.0, 0, 0]), order=4)[4]

# a 3 x 3 block of a loss's Hessian over selected weights
loss, params = pyhvp.module_loss(net, nn.MSELoss(), x, torch.zeros(1000, 2))
H = pyhvp.sub_hessian(loss, params, {"0.weight": torch.tensor([0, 5, 7])})["0.weight"]

# a Kronecker-factored curvature proxy from gradients alone
kron = pyhvp.KroneckerHVP(beta=0.99)
hv_proxy = kron(torch.randn(8, 4, 5), torch.randn(8, 4, 5))   # update(grad), then apply(v)
print(g.shape, hv.shape, d.shape, lap.shape, bil.shape, u_xxxx.shape, H.shape, hv_proxy.shape)
