"""
A physics-informed network for a 2-D Poisson problem
====================================================

A small tanh MLP ``u(x, y)`` learns the solution of ``-Δu = f`` on the unit square with ``u = 0``
on its boundary, for ``f = 2 π² sin(π x) sin(π y)`` (exact solution ``sin(π x) sin(π y)``). The
residual loss needs the Laplacian of the network at every collocation point, differentiable in
the network's parameters: ``pyhvp.laplacian(net, points)`` gives it from one forward-Laplacian
pass, and ``loss.backward()`` reaches the parameters through it.

Checks (the script exits non-zero if one fails): ``pyhvp.laplacian`` equals the trace of the
dense float64 Hessian from ``torch.func`` on a few points, and training reduces the residual's
root mean square on a grid by a factor of 10 or more.
Run: ``python examples/pinn_poisson.py [steps]`` (default 200, a few seconds on a CPU).
"""

import copy
import math
import sys

import matplotlib.pyplot as plt
import torch
from torch import nn
from torch.func import hessian, vmap

import pyhvp


def source(points: torch.Tensor) -> torch.Tensor:
    """f(x, y) = 2 π² sin(π x) sin(π y), so that -Δu = f for u = sin(π x) sin(π y)."""
    return 2 * math.pi**2 * torch.sin(math.pi * points).prod(-1)


def residual(net: nn.Module, points: torch.Tensor) -> torch.Tensor:
    """-Δu - f at every point: (B, 2) -> (B,); differentiable in the network's parameters."""
    return -pyhvp.laplacian(net, points)[:, 0] - source(points)


def boundary_points(count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` points on the square's four sides."""
    t = torch.rand(count, generator=generator)
    side = torch.arange(count) % 4
    fixed = (side % 2).float()  # 0 or 1: which of the two parallel sides
    along_x = torch.stack([t, fixed], -1)
    along_y = torch.stack([fixed, t], -1)
    return torch.where((side < 2)[:, None], along_x, along_y)


def check_against_dense(net: nn.Module) -> None:
    """pyhvp's Laplacian == the trace of the dense float64 Hessian of each point, on 5 points."""
    net64 = copy.deepcopy(net).double()
    points = torch.rand(5, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    dense = vmap(hessian(lambda p: net64(p)[0]))(points).diagonal(dim1=-2, dim2=-1).sum(-1)
    torch.testing.assert_close(pyhvp.laplacian(net64, points)[:, 0], dense)


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    torch.set_num_threads(1)  # small tensors: more threads only add synchronisation
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    check_against_dense(net)
    print("pyhvp.laplacian == trace of the dense float64 Hessian (torch.func) on 5 points")

    side = torch.linspace(0, 1, 41)
    grid = torch.cartesian_prod(side, side)  # where the residual is shown and measured
    with torch.no_grad():
        before = residual(net, grid)

    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    for step in range(steps):
        interior = torch.rand(256, 2, generator=generator)
        edge = boundary_points(64, generator)
        loss = residual(net, interior).pow(2).mean() + 100 * net(edge).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:4d}: loss {loss.item():10.4f}")

    with torch.no_grad():
        after = residual(net, grid)
    rms_before, rms_after = before.pow(2).mean().sqrt().item(), after.pow(2).mean().sqrt().item()
    print(f"residual -Δu - f on a 41 x 41 grid, root mean square: {rms_before:.3f} before "
          f"training, {rms_after:.3f} after {steps} steps ({rms_before / rms_after:.0f}x smaller)")  # fmt: skip

    figure, axes = plt.subplots(1, 2, figsize=(9, 4), constrained_layout=True)
    scale = before.abs().max().item()
    for ax, values, title in ((axes[0], before, "before training"), (axes[1], after, "after")):
        image = ax.imshow(values.reshape(41, 41).T, origin="lower", extent=(0, 1, 0, 1),
                          cmap="RdBu_r", vmin=-scale, vmax=scale)  # fmt: skip
        ax.set(title=f"residual -Δu - f, {title}", xlabel="x", ylabel="y")
    figure.colorbar(image, ax=axes, shrink=0.8)
    plt.show()

    if rms_after > rms_before / 10:
        raise SystemExit("training did not reduce the residual by a factor of 10")


if __name__ == "__main__":
    main()
