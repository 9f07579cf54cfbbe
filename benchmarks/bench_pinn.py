"""PINN training steps (issue 17, item 1): pyhvp.laplacian against the PINN libraries' idiom.

A 2-D or 3-D Poisson residual on a tanh MLP (in -> width -> width -> width -> 1) at B collocation
points. The idiom (DeepXDE, PINA): ``torch.autograd.grad(u.sum(), x, create_graph=True)``, then
one more backward per input dim for the diagonal of the Hessian, summed. Two tables per problem:
the Laplacian alone, and a whole training step -- forward, Laplacian, the residual loss
``((lap - source) ** 2).mean()`` and its backward to the parameters -- with its peak memory.
pyhvp runs three ways: eager (``compile=False``), compiled from the first call (``compile=True``:
the jet kernel compiled forward and backward by AOTAutograd) and ``compile="auto"`` in its steady
state (called until its ski rental has compiled the kernel and judged it on its trial calls; it
then runs the same compiled kernel as ``compile=True``, or eager if it declined it). Every method
is checked against the idiom (values and parameter gradients) before anything is timed; then they
are timed interleaved, one thread, medians. Peak memory of a step: the most bytes held at once by
tensors allocated during the step (the profiler's allocation events; on CUDA the allocator's
peak). Ratios divide by the idiom (below 1: pyhvp is faster / smaller).

Usage: python benchmarks/bench_pinn.py [cpu|cuda] [B ...]   (default B: 1024 4096 16384)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
from _timing import Report, announce, interleaved_ms, peak_bytes

import pyhvp
from pyhvp.backends import torch as torch_backend

Laplacian = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
AUTO_WAIT_S = 300.0  # the longest "auto" is called while it has not compiled

SIZES = (1024, 4096, 16384)
PROBLEMS = [(dims, width) for dims in (2, 3) for width in (64, 128)]


def mlp(dims: int, width: int, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(dims, width), torch.nn.Tanh()]
    layers += [torch.nn.Linear(width, width), torch.nn.Tanh()] * 2
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1)).to(device)


def idiom_laplacian(net: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The PINN libraries' way: a gradient with its graph, then one backward per input dim."""
    x = x.requires_grad_() if not x.requires_grad else x
    u = net(x).squeeze(-1)
    (g,) = torch.autograd.grad(u.sum(), x, create_graph=True)
    return sum(
        torch.autograd.grad(g[:, i].sum(), x, create_graph=True)[0][:, i] for i in range(x.shape[1])
    )


def with_backend(compile: pyhvp.backends.torch.CompileMode) -> Laplacian:
    backend = pyhvp.TorchBackend(compile=compile)

    def pyhvp_laplacian(net: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return pyhvp.laplacian(lambda y: net(y).squeeze(-1), x, backend=backend)

    return pyhvp_laplacian


METHODS: dict[str, Laplacian] = {
    "idiom": idiom_laplacian,
    "pyhvp eager": with_backend(False),
    "pyhvp compiled": with_backend(True),
    'pyhvp "auto"': with_backend("auto"),
}


def step(net: torch.nn.Module, laplacian: Laplacian, x: torch.Tensor, source: torch.Tensor) -> None:
    """One training step's derivative work: residual loss, backward to the parameters."""
    net.zero_grad(set_to_none=True)
    loss = ((laplacian(net, x.detach().clone()) - source) ** 2).mean()
    loss.backward()


def check(net: torch.nn.Module, x: torch.Tensor, source: torch.Tensor) -> None:
    """Every method's Laplacian and parameter gradients against the idiom's."""
    expected = idiom_laplacian(net, x.clone()).detach()
    grads = {}
    for name, laplacian in METHODS.items():
        torch.testing.assert_close(laplacian(net, x.clone()).detach(), expected, rtol=1e-4,
                                   atol=1e-4)  # fmt: skip
        step(net, laplacian, x, source)
        # the last bias has no Laplacian: no gradient
        grads[name] = [torch.zeros_like(p) if p.grad is None else p.grad.clone()
                       for p in net.parameters()]  # fmt: skip
    for name, got in grads.items():
        for a, b in zip(got, grads["idiom"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4, msg=name)


def settle_auto(net: torch.nn.Module, x: torch.Tensor, source: torch.Tensor) -> float:
    """Steps with compile="auto" until it has compiled this kernel and ended its trial (or
    declined it): its steady state. Returns the seconds that took."""
    start = time.perf_counter()
    while time.perf_counter() - start < AUTO_WAIT_S:
        step(net, METHODS['pyhvp "auto"'], x, source)
        entry = next(reversed(torch_backend._CACHE.entries.values()))  # this call's
        if entry.failed or entry.declined or (entry.compiled and not entry.on_trial()):
            break
    return time.perf_counter() - start


def timed(
    net: torch.nn.Module, x: torch.Tensor, source: torch.Tensor, device: str
) -> tuple[dict[str, float], dict[str, float], dict[str, int]]:
    """Median ms of the Laplacian alone and of a training step, each method interleaved, and
    the peak bytes of a step."""
    alone = interleaved_ms(
        {name: (lambda lap=lap: lap(net, x.clone())) for name, lap in METHODS.items()}, device
    )
    steps = interleaved_ms(
        {name: (lambda lap=lap: step(net, lap, x, source)) for name, lap in METHODS.items()},
        device,
    )
    memory = {
        name: peak_bytes(lambda lap=lap: step(net, lap, x, source), device)
        for name, lap in METHODS.items()
    }
    return alone, steps, memory


def memory_table(title: str, memory: dict[str, int]) -> str:
    width = max(map(len, memory))
    lines = [f"\n{title}", f"  {'method'.ljust(width)} |   peak MiB | / idiom"]
    lines += [
        f"  {name.ljust(width)} | {b / 2**20:10.2f} | {b / memory['idiom']:7.2f}"
        for name, b in memory.items()
    ]
    return "\n".join(lines)


def main(device: str, sizes: tuple[int, ...]) -> None:
    if device == "cpu":
        torch.set_num_threads(1)
    report = Report("bench_pinn", device)
    for dims, width in PROBLEMS:
        net = mlp(dims, width, device)
        for batch in sizes:
            name = f"{dims}-D Poisson, width {width}, B = {batch}"
            announce(name)
            generator = torch.Generator().manual_seed(1)
            x = torch.rand(batch, dims, generator=generator).to(device)
            source = torch.ones(batch, device=device)
            waited = settle_auto(net, x, source)  # first: "auto" compiles, compile=True reuses
            check(net, x, source)
            alone, steps, memory = timed(net, x, source, device)
            report.table(f"{name}: Laplacian", list(alone.items()), "idiom")
            report.table(f"{name}: training step", list(steps.items()), "idiom")
            report.text(memory_table(f"{name}: training step, peak memory", memory))
            report.text(f"  ('auto' compiled after {waited:.1f} s of steps)")
            panel = f"{dims}-D, width {width}: training step"
            report.point(panel, "collocation points B", batch, list(steps.items()))
    report.save()


if __name__ == "__main__":
    main(
        sys.argv[1] if len(sys.argv) > 1 else "cpu",
        tuple(int(b) for b in sys.argv[2:]) or SIZES,
    )
