"""
A Langevin sampler with a Kronecker-factored HVP
================================================

Seed 002: a kinetic Langevin sampler on a 3-mode tensor variable, with KroneckerHVP as curvature.

n independent chains sample p_k(x) ∝ exp(-U_k(x)), x of shape (4, 5, 6), with the synthetic
quadratic-plus-quartic energy ``U_k(x) = a_k |x|^2 / 2 + c sum(x^4) / 4`` (stiffness a_k per chain).
Each step integrates dx = v dt, dv = -gamma v dt - grad U dt + sqrt(2 gamma) dW exactly over h
with the force frozen at x, plus the second-order term of the force along the path,
grad U(x + s v) ≈ grad U(x) + s H v, where H v comes from KroneckerHVP fed with the gradients the
sampler computes anyway (no second derivative is ever taken). Since E_p[grad U grad U^T] = E_p[H]
(integration by parts) once the chains have mixed, the gradient covariance is a curvature
estimate; the HVP term is therefore switched on after burn-in (the transient's covariance would
overstate the curvature). The script prints the proxy's mean curvature tr(R_1 ⊗ R_2 ⊗ R_3) / N
next to the exact E_p[tr H] / N, and the chains' second moment E[x^2], with and without the HVP
term, next to its value by quadrature. The figure repeats the comparison over step sizes: the
bias of E[x^2] grows with the step, much more slowly with the HVP term.
Run: ``python examples/kronecker_sampler.py`` (a few seconds on a CPU).
"""

import math

import matplotlib.pyplot as plt
import torch

import pyhvp

A = torch.tensor([1.0, 2.0, 4.0, 8.0])  # stiffness a_k of each chain
C, SHAPE, GAMMA, H, STEPS, BURN_IN = 1.0, (4, 5, 6), 2.0, 0.2, 600, 150


def grad_u(x):
    a = A.view(-1, *([1] * len(SHAPE)))
    return a * x + C * x**3


def second_moment_by_quadrature():
    """E[x_j^2] of one coordinate: the density factorises into exp(-a t^2 / 2 - c t^4 / 4)."""
    t = torch.linspace(-8, 8, 20001, dtype=torch.float64)
    w = torch.exp(-A.double()[:, None] * t**2 / 2 - C * t**4 / 4)
    return (w * t**2).sum(-1) / w.sum(-1)


def klmc_coefficients(h, gamma):
    """Exact moments of one step of the Ornstein-Uhlenbeck velocity with a force f + s g."""
    eta = math.exp(-gamma * h)
    return {
        "xv": (1 - eta) / gamma,  # x += xv * v
        "xf": (h - (1 - eta) / gamma) / gamma,  # x -= xf * grad
        "xg": h**2 / (2 * gamma) - h / gamma**2 + (1 - eta) / gamma**3,  # x -= xg * H v
        "vv": eta,
        "vf": (1 - eta) / gamma,
        "vg": h / gamma - (1 - eta) / gamma**2,
        # noise covariance of (x, v) over the step
        "sxx": 2 / gamma * (h - 2 / gamma * (1 - eta) + (1 - eta**2) / (2 * gamma)),
        "sxv": (1 - eta) ** 2 / gamma,
        "svv": 1 - eta**2,
    }


def run_chains(use_hvp, generator, h=H):
    """Second moment and, with the HVP term, exact vs proxy mean curvature after burn-in."""
    k = klmc_coefficients(h, GAMMA)
    lxx = math.sqrt(k["sxx"])
    lxv, lvv = k["sxv"] / lxx, math.sqrt(k["svv"] - k["sxv"] ** 2 / k["sxx"])
    kron = pyhvp.KroneckerHVP(beta=0.99)
    x = torch.randn(len(A), *SHAPE, generator=generator)  # wider than the targets
    v = torch.zeros_like(x)
    hv = torch.zeros_like(x)
    moments, exact_curvature, proxy_curvature = [], [], []
    for step in range(STEPS):
        g = grad_u(x)
        if use_hvp:
            kron.update(g)  # fed from the start, used once the chains have mixed: E[g g^T] = E[H]
            if step >= BURN_IN:  # holds at stationarity only, not in the transient
                hv = kron.apply(v)
        e1, e2 = torch.randn(2, *x.shape, generator=generator)
        x, v = (
            x + k["xv"] * v - k["xf"] * g - k["xg"] * hv + lxx * e1,
            k["vv"] * v - k["vf"] * g - k["vg"] * hv + lxv * e1 + lvv * e2,
        )
        if step >= BURN_IN:
            moments.append((x**2).mean(dim=(1, 2, 3)))
            exact_curvature.append(A + 3 * C * moments[-1])  # tr(H) / N at this x
            if use_hvp:  # the roots cached by this step's apply: no extra eigh
                traces = [r.diagonal(dim1=-2, dim2=-1).mean(-1) for r in kron.roots()]
                proxy_curvature.append(math.prod(traces))  # tr(R1 ⊗ R2 ⊗ R3) / N
    return {
        "x2": torch.stack(moments).mean(0),
        "exact": torch.stack(exact_curvature).mean(0),
        "proxy": torch.stack(proxy_curvature).mean(0) if use_hvp else None,
    }


def main():
    torch.set_num_threads(1)  # 120 variables per chain: extra threads only add sync overhead
    exact_x2 = second_moment_by_quadrature()
    second = run_chains(use_hvp=True, generator=torch.Generator().manual_seed(1))
    first = run_chains(use_hvp=False, generator=torch.Generator().manual_seed(1))
    print(f"{len(A)} chains, x of shape {SHAPE}, h={H}, gamma={GAMMA}, {STEPS} steps")
    print("chain | a_k | curvature E[trH]/N  Kronecker proxy | E[x^2] exact  with Hv  without")
    for i in range(len(A)):
        print(
            f"{i:5d} | {A[i]:3.0f} | {second['exact'][i]:18.3f} {second['proxy'][i]:16.3f} | "
            f"{exact_x2[i]:12.4f} {second['x2'][i]:8.4f} {first['x2'][i]:8.4f}"
        )
    gap = ((second["proxy"] - second["exact"]) / second["exact"]).abs().max().item()
    bias = [((run["x2"] - exact_x2) / exact_x2).abs().mean().item() for run in (second, first)]
    print(f"largest relative gap between the proxy and the exact mean curvature: {gap:.1%}")
    print(f"mean relative bias of E[x^2]: {bias[0]:.1%} with the Hv term, {bias[1]:.1%} without")
    if gap > 0.25:
        raise SystemExit("the Kronecker proxy does not track the curvature the chains see")
    if not bias[0] < bias[1] / 3:
        raise SystemExit("the Hv term does not reduce the sampler's bias")

    steps = [0.05, 0.1, 0.15, 0.2, 0.25]
    biases = {True: [], False: []}
    for h in steps:
        for use_hvp in (True, False):
            run = run_chains(use_hvp, torch.Generator().manual_seed(1), h)
            biases[use_hvp].append(((run["x2"] - exact_x2) / exact_x2).abs().mean().item())
    print("step size h   " + " ".join(f"{h:7.2f}" for h in steps))
    for use_hvp, label in ((True, "with Hv"), (False, "without")):
        print(f"bias {label:8} " + " ".join(f"{b:7.1%}" for b in biases[use_hvp]))
    _, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    ax.plot(steps, [100 * b for b in biases[False]], "o-", label="force frozen over the step")
    ax.plot(steps, [100 * b for b in biases[True]], "o-", label="+ Kronecker H v term")
    ax.set(xlabel="step size h", ylabel="mean relative bias of E[x^2] (%)",
           title=f"Kinetic Langevin, {len(A)} chains of shape {SHAPE}, {STEPS} steps")  # fmt: skip
    ax.legend()
    plt.show()


if __name__ == "__main__":
    main()
