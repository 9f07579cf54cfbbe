"""Per-configuration HVPs of a pair potential summed over every pair, self-pairs included.

E(x) = sum_ij exp(-|x_i - x_j|) over P particles in 3-D (x: (P, 3), one instance, float32),
the pair distances by ``Tensor.norm`` or by ``torch.cdist``. At the self-pairs the distance is
0: autograd's double backward of a norm is NaN there and ``cdist`` has none, so pyhvp writes
their backwards out (``pyhvp/_vector_norms.py``). Rows: pyhvp eager on both spellings,
``torch.func``'s ``jvp(grad)`` (forward over reverse, right on the norm: the baseline), and the
cost of the written-out backward itself, pyhvp against autograd's double backward on the pairs
``i < j`` alone, where both are finite. Results are checked against a float64 dense reference
first. One thread, methods interleaved. Writes results/bench_pair_potential-<device>.txt.
Usage: python benchmarks/bench_pair_potential.py [cuda]
"""

from __future__ import annotations

import sys

import torch
from _timing import Report, announce, interleaved_ms
from torch.func import grad, jvp

import pyhvp


def by_norm(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-(x[:, None] - x[None]).norm(dim=-1)).sum()


def by_cdist(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-torch.cdist(x, x)).sum()


def distinct_pairs(i: torch.Tensor, j: torch.Tensor):
    def energy(x: torch.Tensor) -> torch.Tensor:
        return torch.exp(-(x[i] - x[j]).norm(dim=-1)).sum()

    return energy


def double_backward(f, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_()
    (g,) = torch.autograd.grad(f(x), x, create_graph=True)
    return torch.autograd.grad(g, x, v)[0]


def reference(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The HVP in float64 with the self-pairs left out (constant terms)."""
    n = len(x)
    i, j = torch.triu_indices(n, n, 1, device=x.device)
    f = distinct_pairs(i, j)
    return 2 * double_backward(f, x.double(), v.double())  # (each distinct pair twice)


def bench_size(n: int, device: str, report: Report) -> None:
    generator = torch.Generator(device).manual_seed(n)
    x = torch.randn(n, 3, device=device, generator=generator)
    v = torch.randn(n, 3, device=device, generator=generator)
    eager = pyhvp.TorchBackend(compile=False)
    i, j = torch.triu_indices(n, n, 1, device=device)
    pairs = distinct_pairs(i, j)

    def hvp(f):
        return lambda: pyhvp.hvp(f, x, v, event_dims=2, backend=eager)

    time = {
        "pyhvp, norm": hvp(by_norm),
        "pyhvp, cdist": hvp(by_cdist),
        "jvp(grad), norm": lambda: jvp(grad(by_norm), (x,), (v,))[1],
        "pyhvp, i < j": hvp(pairs),
        "double backward, i < j": lambda: double_backward(pairs, x, v),
    }
    expected = reference(x, v).float()
    # (float32 cdist past 25 points takes a matrix product, whose rounding in the distances of
    # close pairs reaches its first derivatives: 2e-4 of the largest entry at 30 points)
    scale = expected.abs().max().item()
    for name, call in time.items():  # time only right answers
        got = call() * (2 if "i < j" in name else 1)
        torch.testing.assert_close(got, expected, rtol=0.0, atol=1e-3 * scale, msg=name)
    rows = list(interleaved_ms(time, device).items())
    report.table(f"P = {n:,} particles, {device}, float32", rows, baseline="jvp(grad), norm")


def main(device: str) -> None:
    if device == "cpu":
        torch.set_num_threads(1)
    report = Report("bench_pair_potential", device)
    for n in (64, 256, 1024):
        announce(f"{n:,} particles on {device}: pyhvp against torch.func and autograd")
        bench_size(n, device, report)
    report.save()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu"))
