"""KroneckerHVP cost against mode sizes, next to the post's einsum and the dense Kronecker product.

Per size (n, m, m, m), float32: ``update`` (EMA of mean and per-mode second moments), ``update +
roots`` (adds the float64 eigh of each mode), ``apply`` with cached roots (the baseline of the
ratios), the full call ``kron(grad, v)`` with roots refreshed every update and every 10 updates,
the post's one-line einsum apply, the raw float32 / float64 eigh of the three covariances (what
computing the roots in float64 costs), and, where ``n N^2`` floats fit in memory, forming the
dense ``R_1 ⊗ R_2 ⊗ R_3`` and a dense batched matvec with it.
Methods are timed interleaved, one thread on the CPU. Writes results/bench_kronecker-<device>.{txt,png}.
Usage: python benchmarks/bench_kronecker.py [cuda]
"""

from __future__ import annotations

import sys

import torch
from _timing import Report, announce, interleaved_ms, median_ms

import pyhvp

DENSE_LIMIT_BYTES = 2**30


def filled(shape, device, refresh_every=1, updates=5):
    kron = pyhvp.KroneckerHVP(refresh_every=refresh_every)
    for _ in range(updates):
        kron.update(torch.randn(shape, device=device))
    return kron


def dense_kronecker(roots):
    """(n, N, N): the explicit Kronecker product of the per-mode roots, one system at a time."""
    dense = roots[0]
    for root in roots[1:]:
        dense = torch.stack([torch.kron(a, b) for a, b in zip(dense, root, strict=True)])
    return dense


def bench_size(shape, device, report):
    grad, v = torch.randn(shape, device=device), torch.randn(shape, device=device)
    kron, amortised = filled(shape, device), filled(shape, device, refresh_every=10)
    roots = kron.roots()
    covariances = [r @ r @ r for r in roots]  # any symmetric (n, m, m) stack of the same size
    r1, r2, r3 = roots

    def update_and_roots():
        kron.update(grad)
        return kron.roots()

    def ten_amortised_calls():
        for _ in range(10):
            amortised(grad, v)

    rows = {
        "update": lambda: kron.update(grad),
        "update + roots": update_and_roots,
        "apply (cached roots)": lambda: kron.apply(v),
        "call, refresh every update": lambda: kron(grad, v),
        "post's einsum apply": lambda: torch.einsum("yabc,yad,ybe,ycf->ydef", v, r1, r2, r3),
        "eigh float32 x3": lambda: [torch.linalg.eigh(c) for c in covariances],
        "eigh float64 x3": lambda: [torch.linalg.eigh(c.double()) for c in covariances],
    }
    timings = interleaved_ms(rows, device)
    timings["call, refresh every 10"] = median_ms(ten_amortised_calls, device) / 10
    n, size = shape[0], torch.Size(shape[1:]).numel()
    if n * size**2 * 4 <= DENSE_LIMIT_BYTES:
        dense = dense_kronecker(kron.roots())
        flat = v.reshape(n, size, 1)
        torch.testing.assert_close(  # time only a right answer
            (dense @ flat).reshape(shape), kron.apply(v), rtol=1e-4, atol=1e-4
        )
        timings["dense: form R1 ⊗ R2 ⊗ R3"] = median_ms(
            lambda: dense_kronecker(kron.roots()), device, warmup=1, repeats=3
        )
        timings["dense: matvec"] = median_ms(lambda: dense @ flat, device)
    else:
        report.text(f"\n(dense rows skipped for {shape}: {n * size**2 * 4 / 2**30:.0f} GiB)")
    rows = list(timings.items())
    report.table(
        f"KroneckerHVP, grad/v {tuple(shape)} float32 on {device}",
        rows,
        baseline="apply (cached roots)",
    )
    report.point("KroneckerHVP, n = 8 systems", "mode size m (variable m x m x m)", shape[1], rows)


def main() -> None:
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)
    report = Report("bench_kronecker", device)
    for shape in [(8, 8, 8, 8), (8, 16, 16, 16), (8, 64, 64, 64)]:
        announce(f"{shape[0]} systems of modes {shape[1:]} on {device}")
        bench_size(shape, device, report)
    report.save()


if __name__ == "__main__":
    main()
