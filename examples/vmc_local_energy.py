"""
Variational Monte Carlo: local energies
=======================================

The local energy of a Jastrow wavefunction for many walkers.

N electrons in a 3-D harmonic trap (frequency omega) repel each other with a Gaussian pair
potential. The trial wavefunction is a Gaussian orbital times a Gaussian-pair Jastrow factor::

    log psi(R) = -alpha sum_i |r_i|^2 + b sum_{i<j} exp(-|r_i - r_j|^2 / c),

written for ONE walker R (N x 3) and batched with ``pyhvp.per_instance`` (event_dims=2). The
local energy needs, per walker, the gradient and the Laplacian of log psi::

    E_L = -1/2 (lap log psi + |grad log psi|^2) + V(R),

and ``pyhvp.grad_and_laplacian`` returns value, gradient and Laplacian from one forward
Laplacian pass (collapsed Taylor mode): about 3N + 2 evaluations of log psi, not ~9N.

Walkers are drawn from ``|psi|^2`` by a short Metropolis chain. Checks (the script exits non-zero if
one fails): the Laplacian and gradient equal the dense per-walker Hessian trace and Jacobian
(torch.func, float64) on a subset of walkers, and without the Jastrow factor and with
alpha = omega / 2 the wavefunction is the exact ground state of the trap, so E_L = 3 N omega / 2
for every walker (zero variance). The figure follows one electron along a line through the
trap, the others fixed: the trial local energy varies, the ground state's is flat.

Usage: python examples/vmc_local_energy.py [walkers]   (default 4096)
"""

import sys

import matplotlib.pyplot as plt
import torch
from torch.func import hessian, jacrev, vmap

import pyhvp

N_ELECTRONS, OMEGA, REPULSION = 4, 1.0, 2.0


def log_psi_single(r: torch.Tensor, alpha: float, b: float, c: float) -> torch.Tensor:
    """One walker: r (N, 3) -> log psi (a scalar)."""
    distances2 = ((r[:, None, :] - r[None, :, :]) ** 2).sum(-1)
    pairs = torch.triu(torch.exp(-distances2 / c), diagonal=1).sum()
    return -alpha * (r**2).sum() + b * pairs


def potential(r: torch.Tensor) -> torch.Tensor:
    """Batched: (..., N, 3) -> (...): harmonic trap plus Gaussian pair repulsion."""
    distances2 = ((r[..., :, None, :] - r[..., None, :, :]) ** 2).sum(-1)
    pairs = torch.triu(torch.exp(-distances2), diagonal=1).sum((-2, -1))
    return 0.5 * OMEGA**2 * (r**2).sum((-2, -1)) + REPULSION * pairs


def local_energy(log_psi: pyhvp.PerInstance, walkers: torch.Tensor) -> torch.Tensor:
    _, grad, lap = pyhvp.grad_and_laplacian(log_psi, walkers, event_dims=2)
    kinetic = -0.5 * (lap + (grad**2).sum((-2, -1)))
    return kinetic + potential(walkers)


def metropolis(log_psi: pyhvp.PerInstance, walkers: torch.Tensor, steps: int, step: float):
    """Samples of |psi|^2: propose a Gaussian move of every electron, accept with min(1, ratio)."""
    current = log_psi(walkers)
    for _ in range(steps):
        proposal = walkers + step * torch.randn_like(walkers)
        proposed = log_psi(proposal)
        accept = torch.rand_like(current).log() < 2 * (proposed - current)
        walkers = torch.where(accept[:, None, None], proposal, walkers)
        current = torch.where(accept, proposed, current)
    return walkers


def main() -> None:
    torch.manual_seed(0)
    n_walkers = int(float(sys.argv[1])) if len(sys.argv) > 1 else 4096
    alpha, b, c = 0.45, 0.6, 1.5
    log_psi = pyhvp.per_instance(lambda r: log_psi_single(r, alpha, b, c), event_dims=2)
    walkers = metropolis(log_psi, torch.randn(n_walkers, N_ELECTRONS, 3), steps=50, step=0.5)

    energy = local_energy(log_psi, walkers)
    mean, error = energy.mean().item(), energy.std().item() / n_walkers**0.5
    print(f"{n_walkers} walkers, {N_ELECTRONS} electrons: <E_L> = {mean:.4f} +- {error:.4f}")

    # 1. grad and Laplacian against the dense per-walker Jacobian and Hessian trace (float64)
    subset = walkers[:64].double()
    _, grad, lap = pyhvp.grad_and_laplacian(log_psi, subset, event_dims=2)
    single = lambda r: log_psi_single(r, alpha, b, c)  # noqa: E731
    dense_lap = vmap(hessian(single))(subset).reshape(64, 12, 12).diagonal(dim1=-2, dim2=-1).sum(-1)
    torch.testing.assert_close(lap, dense_lap)
    torch.testing.assert_close(grad, vmap(jacrev(single))(subset))
    print("gradient and Laplacian == dense torch.func Jacobian and Hessian trace (64 walkers)")

    # 2. the exact ground state of the bare trap has the same local energy everywhere
    ground = pyhvp.per_instance(lambda r: log_psi_single(r, OMEGA / 2, 0.0, c), event_dims=2)
    _, grad, lap = pyhvp.grad_and_laplacian(ground, walkers, event_dims=2)
    bare = -0.5 * (lap + (grad**2).sum((-2, -1))) + 0.5 * OMEGA**2 * (walkers**2).sum((-2, -1))
    torch.testing.assert_close(bare, torch.full_like(bare, 1.5 * N_ELECTRONS * OMEGA))
    print(
        f"bare trap, ground state: E_L = 3 N omega / 2 = {1.5 * N_ELECTRONS * OMEGA} for every walker"
    )

    # 3. along a line: electron 0 moves along x through the trap, the others stay where they are
    t = torch.linspace(-3, 3, 241)
    line = walkers[0].repeat(len(t), 1, 1)
    line[:, 0] = torch.stack([t, torch.zeros_like(t), torch.zeros_like(t)], -1)
    trial = local_energy(log_psi, line)
    _, grad, lap = pyhvp.grad_and_laplacian(ground, line, event_dims=2)
    exact = -0.5 * (lap + (grad**2).sum((-2, -1))) + 0.5 * OMEGA**2 * (line**2).sum((-2, -1))
    torch.testing.assert_close(exact, torch.full_like(exact, 1.5 * N_ELECTRONS * OMEGA))
    _, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    ax.plot(t, trial, label=f"trial: Jastrow, alpha = {alpha}, repulsive pairs")
    ax.plot(t, exact, label="ground state of the bare trap (no repulsion)")
    ax.axhline(mean, color="grey", ls=":", label="trial <E_L> over the walkers")
    ax.set(xlabel="x of electron 0 (others fixed)", ylabel="local energy E_L",
           title=f"Local energy along a line, {N_ELECTRONS} electrons")  # fmt: skip
    ax.legend()
    plt.show()


if __name__ == "__main__":
    main()
