"""Per-instance gradient + HVP on the seed-000 problem: pyhvp against its baselines.

f(x, mu) = exp(-|x - mu|^2) per particle, x: (n_g, n_b, n_a, 3), mu: (n_g, 1, 1, 3), float32.
Rows: pyhvp (eager, compiled, and julia where available), autograd double backward, eager
torch.func jvp(grad(sum f)), the hand-derived formula (eager and compiled), a plain copy of the
same bytes (the memory floor; the HVP reads x and v and writes g and hv) and JAX if installed.
Ratios are against the compiled hand-derived formula; methods are timed interleaved, one thread
on the CPU (JAX's too: the process is pinned to one core). Writes
results/bench_hvp-<device>.{txt,png}. Usage: python benchmarks/bench_hvp.py [cuda]
"""

from __future__ import annotations

import sys

import torch
from _timing import Report, announce, interleaved_ms, median_ms, one_core
from torch.func import grad, jvp

import pyhvp

one_core()  # before JAX starts: its rows run on one thread, as torch's do


def gaussian(x, mu):
    return torch.exp(-((x - mu) ** 2).sum(-1))


def formula(x, mu, v):
    """g = -2 f r, Hv = f (4 r (r.v) - 2 v) with r = x - mu."""
    r = x - mu
    f = torch.exp(-(r * r).sum(-1, keepdim=True))
    return -2 * f * r, f * (4 * r * (r * v).sum(-1, keepdim=True) - 2 * v)


def double_backward(x, mu, v):
    x = x.detach().requires_grad_()
    (g,) = torch.autograd.grad(gaussian(x, mu).sum(), x, create_graph=True)
    (hv,) = torch.autograd.grad(g, x, v)
    return g.detach(), hv


def eager_jvp_grad(x, mu, v):
    return jvp(grad(lambda y: gaussian(y, mu).sum()), (x,), (v,))


def jax_row(x, mu, v):
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return None
    xj, muj, vj = (jnp.asarray(t.cpu().numpy()) for t in (x, mu, v))

    def total(y):
        return jnp.exp(-((y - muj) ** 2).sum(-1)).sum()

    step = jax.jit(lambda y, w: jax.jvp(jax.grad(total), (y,), (w,)))
    return median_ms(lambda: jax.block_until_ready(step(xj, vj)))


def julia_row(x, mu, v):
    if "julia" not in pyhvp.available_backends():
        return None
    jf = pyhvp.julia_function("(x, mu) -> exp(-sum(abs2, x .- mu))")
    return median_ms(lambda: pyhvp.grad_and_hvp(jf, x, v, mu, backend="julia"), x.device)


def bench_size(n: int, device: str, report: Report) -> None:
    x = torch.randn(10, 10, n // 100, 3, device=device)
    mu = torch.randn(10, 1, 1, 3, device=device)
    v = torch.randn_like(x)
    src, dst = torch.randn(2, *x.shape, device=device), torch.empty(2, *x.shape, device=device)
    eager, compiled = pyhvp.TorchBackend(compile=False), pyhvp.TorchBackend(compile=True)
    compiled_formula = torch.compile(formula, dynamic=False)
    for got, want in zip(
        pyhvp.grad_and_hvp(gaussian, x, v, mu, backend=compiled), formula(x, mu, v), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)  # time only right answers
    time = {
        "pyhvp compiled": lambda: pyhvp.grad_and_hvp(gaussian, x, v, mu, backend=compiled),
        "pyhvp eager": lambda: pyhvp.grad_and_hvp(gaussian, x, v, mu, backend=eager),
        "formula compiled": lambda: compiled_formula(x, mu, v),
        "formula eager": lambda: formula(x, mu, v),
        "double backward": lambda: double_backward(x, mu, v),
        "jvp(grad) eager": lambda: eager_jvp_grad(x, mu, v),
        "copy floor": lambda: dst.copy_(src),
    }
    rows = list(interleaved_ms(time, device).items())
    optional = (("julia", julia_row(x, mu, v)), ("jax jit", jax_row(x, mu, v)))
    rows += [(name, ms) for name, ms in optional if ms is not None]
    report.table(f"N = {n:,} particles, {device}, float32", rows, baseline="formula compiled")
    report.point("seed 000: per-particle grad + HVP", "particles", n, rows)


def main(device: str) -> None:
    if device == "cpu":
        torch.set_num_threads(1)
    report = Report("bench_hvp", device)
    for n in (10_000, 100_000, 1_000_000):
        announce(f"{n:,} particles on {device}: pyhvp compiled and eager against the baselines")
        bench_size(n, device, report)
    report.save()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu"))
