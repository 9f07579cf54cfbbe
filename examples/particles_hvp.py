"""
Per-particle gradients and Hessian-vector products
==================================================

Seed 000: per-particle gradient AND Hessian-vector product of a batched function, many times.

x[g, b, a, :] is the position of particle (a, b) in replica g, mu[g] a per-replica centre, and
``f(x; mu) = exp(-|x - mu|^2)`` one value per particle. Each particle needs its own gradient and its
own Hessian times its own vector. pyhvp computes both in one pass over the batched function. With
the default compile="auto" the calls run eagerly until their eager time reaches the expected
cost of compiling (seconds), so this short run stays eager; pass --compiled to compile from the
first call, as a long simulation loop would end up doing. The result is checked against the
closed form g = -2 f r,  Hv = f (4 r (r . v) - 2 v),  r = x - mu.

Usage: python examples/particles_hvp.py [n_particles] [--compiled]   (default 1e6 on CUDA, 1e5 on CPU)
"""

import sys
import time

import torch

import pyhvp


def f_batch(x: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    return torch.exp(-((x - mu) ** 2).sum(-1))


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = [a for a in sys.argv[1:] if not a.startswith("--")]
    n = int(float(sizes[0])) if sizes else (10**6 if device == "cuda" else 10**5)
    backend = pyhvp.TorchBackend(compile=True if "--compiled" in sys.argv else "auto")
    n_gamma, n_beta, dims = 100, 10, 3
    x = torch.randn(n_gamma, n_beta, n // (n_gamma * n_beta), dims, device=device)
    mu = torch.randn(n_gamma, 1, 1, dims, device=device)
    v = torch.randn_like(x)

    calls, timings = 30, []
    for _ in range(calls):
        start = time.perf_counter()
        g, hv = pyhvp.grad_and_hvp(f_batch, x, v, mu, backend=backend)
        if device == "cuda":
            torch.cuda.synchronize()
        timings.append(time.perf_counter() - start)

    r = x - mu
    fx = f_batch(x, mu)[..., None]
    g_exact = -2 * fx * r
    hv_exact = fx * (4 * r * (r * v).sum(-1, keepdim=True) - 2 * v)
    error = max(
        ((g - g_exact).abs().max() / g_exact.abs().max()).item(),
        ((hv - hv_exact).abs().max() / hv_exact.abs().max()).item(),
    )
    print(f"{x.shape[:-1].numel():,} particles on {device}, x {tuple(x.shape)}, float32, {backend}")
    print(f"first call                {timings[0] * 1e3:9.2f} ms")
    print(f"median of the last 20     {sorted(timings[-20:])[10] * 1e3:9.2f} ms per call")
    print(f"max error vs closed form  {error:.2e} (relative to the largest entry)")
    if error > 1e-4:
        raise SystemExit("pyhvp disagrees with the closed-form Gaussian HVP")


if __name__ == "__main__":
    main()
