"""Exact Hessian diagonals over B = 1024 instances (seed 001): pyhvp against its baselines.

Vector-valued f: R^n -> R^m, n = m = 32 and 256: f = sigmoid(W x + b) and a 2-layer tanh MLP
W2 tanh(W1 x + b1) + b2 (hidden = n). Rows: the closed form sigma''(z) W^2 (the limit; ratios
divide by it), pyhvp exact (compile=True, and eager as a one-off call pays it) on the batched f
and on the same function written for one instance with ``pyhvp.per_instance`` (both run the
second-order Taylor engine with e_i shared by all instances, so W e_i is computed once), the full Hessian
vmap(jacfwd(jacrev)) then its diagonal, forward-over-reverse with one-hot tangents, Hutchinson
(scalar-only in pyhvp, so one estimate per output: m x samples HVPs) with its relative error,
and JAX's jit of the same forward-over-forward if JAX is installed (CPU runs only; the process
is pinned to one core, so XLA runs on one thread like torch). Rows marked "~" at n = 256
are timed on a few instances (or one output) and scaled linearly: the full runs would need
B*M*N*N numbers (68 GB) or minutes.

Then scalar f = w . tanh(W1 x + b1) + b2: the primitive ``_choose`` picks for scalars
(second-order Taylor mode) against forward-over-reverse with one-hot tangents, and Hutchinson
against Diag++ at 10 and 100 HVPs on a full-rank (hidden = n) and a rank-8 (hidden = 8) Hessian
at n = 256.
float32; the exact pyhvp results (compile=True, and both modes for the scalar choice) are checked
against the closed forms before anything is timed; estimator rows report their error.
Usage: python benchmarks/bench_diagonal.py [cuda]
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
from _timing import Report, announce, median_ms, one_core
from torch.func import hessian, jacrev, jvp, vmap

import pyhvp

one_core()  # before JAX starts: its rows run on one thread, as torch's do

B = 1024
CHUNK = 32  # basis directions per pass: bounds memory at n = 256


@dataclass
class Problem:
    """A batched f, its closed-form diagonal, and its weights (for the JAX row)."""

    name: str
    f: object
    closed: object
    weights: dict
    single: object = None  # the same f for one instance, batched with pyhvp.per_instance


def d2_sigmoid(z):
    s = torch.sigmoid(z)
    return s * (1 - s) * (1 - 2 * s)


def d2_tanh(z):
    t = torch.tanh(z)
    return -2 * t * (1 - t * t)


def sigmoid_layer(n, device):
    w, b = torch.randn(n, n, device=device) / math.sqrt(n), torch.randn(n, device=device)

    def f(x):
        return torch.sigmoid(x @ w.T + b)

    def closed(x):  # d2 f_k / dx_i^2 = sigma''(z_k) W_ki^2
        return d2_sigmoid(x @ w.T + b)[..., :, None] * (w * w)

    single = pyhvp.per_instance(lambda x: torch.sigmoid(w @ x + b))
    return Problem("sigmoid(Wx+b)", f, closed, {"w1": w, "b1": b}, single)


def tanh_mlp(n, device, m=None, hidden=None):
    """W2 tanh(W1 x + b1) + b2, m outputs (a (1, h) W2 and a squeezed output for m = 1)."""
    m, hidden = m or n, hidden or n
    w1, b1 = (
        torch.randn(hidden, n, device=device) / math.sqrt(n),
        torch.randn(hidden, device=device),
    )
    w2, b2 = (
        torch.randn(m, hidden, device=device) / math.sqrt(hidden),
        torch.randn(m, device=device),
    )

    def f(x):
        out = torch.tanh(x @ w1.T + b1) @ w2.T + b2
        return out.squeeze(-1) if m == 1 else out

    def closed(x):  # d2 f_k / dx_i^2 = sum_j W2_kj tanh''(z_j) W1_ji^2
        out = (d2_tanh(x @ w1.T + b1)[..., None, :] * w2) @ (w1 * w1)
        return out.squeeze(-2) if m == 1 else out

    name = "tanh MLP" if m > 1 else f"scalar tanh MLP, hidden {hidden}"
    single = pyhvp.per_instance(lambda x: (w2 @ torch.tanh(w1 @ x + b1) + b2).squeeze(-1))
    return Problem(name, f, closed, {"w1": w1, "b1": b1, "w2": w2, "b2": b2}, single)


# --- baselines -------------------------------------------------------------------------------


def full_hessian(f, x):
    """vmap(jacfwd(jacrev)) per instance, then the diagonal: B x M x N x N numbers."""
    return vmap(hessian(f))(x).diagonal(dim1=-2, dim2=-1)


def fwd_over_rev_one_hot(f, x):
    """For every instance and e_i: jvp(jacrev(f))(x; e_i) = H_k e_i for all k, keep entry i."""
    eye = torch.eye(x.shape[-1], device=x.device, dtype=x.dtype)

    def one(xb):
        columns = vmap(lambda u: jvp(jacrev(f), (xb,), (u,))[1])(eye)  # (N, M, N): [i, k, :]
        return columns.diagonal(dim1=0, dim2=-1)  # (M, N)

    return vmap(one)(x)


def hutchinson_per_output(f, x, samples, outputs):
    """pyhvp's Hutchinson is scalar-only: one estimate per output k (samples HVPs each)."""
    gen = torch.Generator().manual_seed(0)
    return torch.stack(
        [
            pyhvp.hessian_diagonal(
                lambda y, k=k: f(y)[..., k], x, method="hutchinson", samples=samples, generator=gen
            )
            for k in outputs
        ],
        dim=-2,
    )


def scaled_ms(run, full_size, subset_size, device, once):
    """Time ``run`` on a subset and scale linearly to the full size (work is linear in it)."""
    reps = {"warmup": 0, "repeats": 1} if once else {}
    return median_ms(run, device, **reps) * full_size / subset_size


def relative_error(estimate, exact):
    return float((estimate - exact).norm() / exact.norm())


def jax_fwd_over_fwd(problem, x, warmup=2, repeats=5):
    """JAX's jit of the same algorithm: forward-over-forward along each e_i, all instances."""
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return None
    w = {k: jnp.asarray(v.cpu().numpy()) for k, v in problem.weights.items()}
    xj = jnp.asarray(x.cpu().numpy())

    def f(y):
        z = y @ w["w1"].T + w["b1"]
        if "w2" not in w:
            return jax.nn.sigmoid(z)
        return jnp.tanh(z) @ w["w2"].T + w["b2"]

    def diagonal(y):  # e_i in every instance, forward-over-forward, vmapped over i
        def along(u):
            return jax.jvp(lambda z: jax.jvp(f, (z,), (u,))[1], (y,), (u,))[1]

        n = y.shape[-1]
        return jax.vmap(along)(jnp.broadcast_to(jnp.eye(n)[:, None, :], (n, *y.shape)))

    step = jax.jit(diagonal)
    return median_ms(lambda: jax.block_until_ready(step(xj)), warmup=warmup, repeats=repeats)


# --- the tables ------------------------------------------------------------------------------


def bench_vector(problem, n, device, report):
    x = torch.randn(B, n, device=device)
    compiled, eager = pyhvp.TorchBackend(compile=True), pyhvp.TorchBackend(compile=False)
    exact = problem.closed(x)

    def ours(backend, f=problem.f):
        return pyhvp.hessian_diagonal(f, x, chunk_size=CHUNK, backend=backend)

    torch.testing.assert_close(ours(compiled), exact, rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(ours(compiled, problem.single), exact, rtol=1e-3, atol=1e-5)
    big = n > 64  # full baselines need B*M*N*N numbers (68 GB at n = 256): time a few instances
    few, outputs = (2, range(1)) if big else (B, range(n))
    torch.testing.assert_close(full_hessian(problem.f, x[:few]), exact[:few], rtol=1e-3, atol=1e-5)
    once = {"warmup": 1, "repeats": 1} if big else {}
    mark = "~ " if big else ""
    rows = [
        ("closed form", median_ms(lambda: problem.closed(x), device, **once)),
        ("pyhvp exact, compile=True", median_ms(lambda: ours(compiled), device, **once)),
        ("pyhvp exact, eager (one-off call)", median_ms(lambda: ours(eager), device, warmup=0)),
        ("pyhvp per_instance, compile=True", median_ms(lambda: ours(compiled, problem.single),
                                                       device, **once)),
        ("pyhvp per_instance, eager", median_ms(lambda: ours(eager, problem.single), device,
                                                **once)),
    ]  # fmt: skip
    baselines = {
        "full Hessian vmap(jacfwd(jacrev))": lambda: full_hessian(problem.f, x[:few]),
        "fwd-over-rev, one-hot tangents": lambda: fwd_over_rev_one_hot(problem.f, x[:few]),
    }
    rows += [(mark + name, scaled_ms(run, B, few, device, big)) for name, run in baselines.items()]
    for samples in (10, 100):  # every output at n = 32, one of them (scaled by m) at n = 256

        def run(s=samples):
            return hutchinson_per_output(problem.f, x, s, outputs)

        err = relative_error(run(), exact[:, outputs])
        ms = scaled_ms(run, n, len(outputs), device, once=True)
        rows.append((f"{mark}hutchinson {samples}/output, eager (err {err:.2f})", ms))
    jax_ms = jax_fwd_over_fwd(problem, x, **once) if device == "cpu" else None
    rows += [("jax jit fwd-over-fwd", jax_ms)] if jax_ms is not None else []
    title = f"{problem.name}: B={B}, n=m={n}, {device}, float32, chunk_size={CHUNK}"
    report.table(title, rows, baseline="closed form")
    report.point(f"diagonal, {problem.name} (m = n)", "n inputs", n, rows)


def bench_scalar_choice(n, device, report):
    """The primitive ``_choose`` picks for scalar f (Taylor second_directional) against the one it
    falls back to on backends without it (forward-over-reverse, one-hot tangents)."""
    x = torch.randn(B, n, device=device)
    problem = tanh_mlp(n, device, m=1)
    tangents = torch.eye(n, device=device)[:, None, :].expand(n, *x.shape).contiguous()
    once = {"warmup": 1, "repeats": 1} if n > 64 else {}
    rows = [("closed form", median_ms(lambda: problem.closed(x), device))]
    for mode in ("compile=True", "eager"):
        backend = pyhvp.TorchBackend(compile=mode != "eager")

        def ours(b=backend):
            return pyhvp.hessian_diagonal(problem.f, x, backend=b)

        def other(b=backend):  # (H e_i)_i from the n Hessian-vector products
            _, hv = b.grad_and_hvp(problem.f, x, tangents, (), 1, None)
            return hv.diagonal(dim1=0, dim2=-1)

        torch.testing.assert_close(ours(), problem.closed(x), rtol=1e-3, atol=1e-5)
        torch.testing.assert_close(other(), problem.closed(x), rtol=1e-3, atol=1e-5)
        rows += [
            (f"pyhvp exact = Taylor, {mode}", median_ms(ours, device, **once)),
            (f"fwd-over-rev one-hot (fallback), {mode}", median_ms(other, device, **once)),
        ]
    title = f"scalar tanh MLP, exact: B={B}, n={n}, {device}, float32"
    report.table(title, rows, baseline="closed form")
    report.point("diagonal, scalar tanh MLP", "n inputs", n, rows)


def bench_estimators(n, device, report):
    """Hutchinson against Diag++ at equal HVP counts, on a flat and a decaying spectrum."""
    x = torch.randn(B, n, device=device)
    eager = pyhvp.TorchBackend(compile=False)
    flat, low = tanh_mlp(n, device, m=1), tanh_mlp(n, device, m=1, hidden=8)
    exact_ms = median_ms(
        lambda: pyhvp.hessian_diagonal(flat.f, x, backend=eager), device, warmup=1, repeats=1
    )
    rows = [("pyhvp exact, eager", exact_ms)]
    for problem, label in ((flat, "full rank"), (low, "rank 8")):
        exact = problem.closed(x)
        for method in ("hutchinson", "diag++"):
            for samples in (10, 100):

                def run(m=method, s=samples, p=problem):
                    gen = torch.Generator().manual_seed(0)
                    return pyhvp.hessian_diagonal(
                        p.f, x, method=m, samples=s, generator=gen, backend=eager
                    )

                err = relative_error(run(), exact)
                ms = median_ms(run, device, warmup=0, repeats=1)
                rows.append((f"{method} {samples} HVPs, {label} (err {err:.3f})", ms))
    title = f"scalar tanh MLP, estimators (eager): B={B}, n={n}, {device}, float32"
    report.table(title, rows, baseline="pyhvp exact, eager")


def main(device: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    report = Report("bench_diagonal", device)
    for n in (32, 256):
        for build in (sigmoid_layer, tanh_mlp):
            announce(f"vector f {build.__name__}, n = {n}: pyhvp against closed form, JAX, dense")
            bench_vector(build(n, device), n, device, report)
    for n in (32, 256):
        announce(f"scalar tanh MLP, n = {n}: Taylor mode against forward-over-reverse")
        bench_scalar_choice(n, device, report)
    announce("estimators, n = 256: Hutchinson against Diag++, flat and decaying spectra")
    bench_estimators(256, device, report)
    report.save()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu"))
