"""
A physics-informed network for a Kirchhoff plate: the biharmonic equation
=========================================================================

A simply supported square plate under the load ``q = 4 π⁴ sin(π x) sin(π y)`` bends as
``u = sin(π x) sin(π y)``: it solves ``Δ²u = q`` on the unit square with ``u = 0`` and ``Δu = 0``
on its boundary. A small MLP with sine activations, fed ``π (x, y)``, learns ``u`` (sines keep
a network's fourth derivatives on the scale of its values, where tanh networks train slowly). The residual needs the bi-Laplacian of the
network at every collocation point, differentiable in its parameters: ``pyhvp.bilaplacian(net,
points)`` gives it from fourth-order Taylor jets (four of them in 2-D: ``e_x``, ``e_y``,
``e_x ± e_y``, their fourth coefficients summed with weights as they go), where nested
``torch.autograd.grad`` would need a Hessian of a Hessian. The boundary condition ``Δu = 0`` is a
``pyhvp.laplacian`` of the same network, and the same residual is also written as a
``pyhvp.differential_operator`` (``u_xxxx + 2 u_xxyy + u_yyyy``).

Checks (the script exits non-zero if one fails): ``pyhvp.bilaplacian`` equals nested autograd's
bi-Laplacian in float64 on a few points, the differential operator equals it, and after training
the network's error against the exact deflection is below 5% of its peak, on a grid.
Run: ``python examples/pinn_plate.py [steps]`` (default 300, under a minute on a CPU).
"""

import copy
import math
import sys

import matplotlib.pyplot as plt
import torch
from torch import nn

import pyhvp

BIHARMONIC_2D = {(0, 0, 0, 0): 1.0, (0, 0, 1, 1): 2.0, (1, 1, 1, 1): 1.0}


def exact(points: torch.Tensor) -> torch.Tensor:
    return torch.sin(math.pi * points).prod(-1)


def load(points: torch.Tensor) -> torch.Tensor:
    """q = Δ²u for u = sin(π x) sin(π y): (2 π²)² u."""
    return 4 * math.pi**4 * exact(points)


class Sine(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x)


def deflection(net: nn.Module):
    """u(x, y) = net(π x, π y): (B, 2) -> (B,)."""
    return lambda points: net(math.pi * points)[..., 0]


def boundary_points(count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` points on the square's four sides."""
    t = torch.rand(count, generator=generator)
    side = torch.arange(count) % 4
    fixed = (side % 2).float()
    return torch.where((side < 2)[:, None], torch.stack([t, fixed], -1),
                       torch.stack([fixed, t], -1))  # fmt: skip


def nested_bilaplacian(u, points: torch.Tensor) -> torch.Tensor:
    """Δ²u per point by nested torch.autograd.grad (the reference: a Hessian of a Hessian)."""
    points = points.detach().requires_grad_()

    def laplacian(values):
        (g,) = torch.autograd.grad(values.sum(), points, create_graph=True)
        return sum(torch.autograd.grad(g[:, i].sum(), points, create_graph=True)[0][:, i]
                   for i in range(2))  # fmt: skip

    return laplacian(laplacian(u(points)))


def check_against_nested_autograd(net: nn.Module) -> None:
    net64 = copy.deepcopy(net).double()
    points = torch.rand(6, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    reference = nested_bilaplacian(deflection(net64), points).detach()
    torch.testing.assert_close(pyhvp.bilaplacian(deflection(net64), points), reference)
    torch.testing.assert_close(
        pyhvp.differential_operator(deflection(net64), points, BIHARMONIC_2D), reference
    )


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    torch.set_num_threads(1)
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 32), Sine(), nn.Linear(32, 32), Sine(), nn.Linear(32, 1))
    check_against_nested_autograd(net)
    print("pyhvp.bilaplacian == differential_operator == nested autograd (float64, 6 points)")

    u = deflection(net)
    optimizer = torch.optim.Adam(net.parameters(), lr=5e-3)
    for step in range(steps):
        interior = torch.rand(128, 2, generator=generator)
        edge = boundary_points(64, generator)
        pde = ((pyhvp.bilaplacian(u, interior) - load(interior)) / (4 * math.pi**4)).pow(2).mean()
        supports = (
            u(edge).pow(2).mean() + (pyhvp.laplacian(u, edge) / (2 * math.pi**2)).pow(2).mean()
        )
        loss = pde + 10 * supports
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step:4d}: loss {loss.item():.5f}")

    side = torch.linspace(0, 1, 41)
    grid = torch.cartesian_prod(side, side)
    with torch.no_grad():
        error = u(grid) - exact(grid)
    relative = error.abs().max().item() / exact(grid).abs().max().item()
    print(f"max |u_net - u| on a 41 x 41 grid: {100 * relative:.1f}% of the peak deflection")

    figure, axes = plt.subplots(1, 2, figsize=(9, 4), constrained_layout=True)
    with torch.no_grad():
        shown = (u(grid), error)
    for ax, values, title in zip(axes, shown, ("network deflection u", "u - exact"), strict=True):
        image = ax.imshow(values.reshape(41, 41).T, origin="lower", extent=(0, 1, 0, 1),
                          cmap="RdBu_r")  # fmt: skip
        ax.set(title=title, xlabel="x", ylabel="y")
        figure.colorbar(image, ax=ax, shrink=0.8)
    plt.show()

    if relative > 0.05:
        raise SystemExit(f"the trained plate is off by {100 * relative:.1f}% (over 5%)")


if __name__ == "__main__":
    main()
