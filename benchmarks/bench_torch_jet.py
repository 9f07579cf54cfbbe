"""Exact Laplacians: pyhvp against torch-jet (PyPI ``jet-for-pytorch``, the reference code of
"Collapsing Taylor Mode Automatic Differentiation", Dangel et al., NeurIPS 2025), on torch-jet's
own benchmark shapes (issue 25) and on every problem of ``bench_laplacian.py``.

torch-jet's best path, as its own benchmark builds it (``exp01_benchmark_laplacian``):
``jet.laplacian(net, (x0,), collapsed=True)``, captured with ``jet.capture_graph``, simplified by
``jet.common_subexpression_elimination``, ``torch.func.vmap``-ed over instances -- eagerly, and
``torch.compile``-d. pyhvp: ``pyhvp.laplacian(f, X)`` with ``TorchBackend(compile=False)`` and
``TorchBackend(compile=True)`` (timed after its compile and its trial of compiled against eager
calls, as torch-jet's compiled rows are timed after their compile). One thread, the process pinned to one
core, float32, medians of interleaved calls; every method is checked against every other and
against a float64 dense Hessian trace (on 4 instances) before it is timed. A last table gives
the peak memory of one call at the paper's shape (B = 256): the most bytes held at once by
tensors allocated during the call (torch's profiler).

On the tanh MLPs a further row, "GEMM floor", times only the matrix products that any exact
Taylor-mode Laplacian of the network makes, interleaved with the others: per hidden layer after
the first, its weight times (D + 2) B rows (the values, D first-order coefficients, one collapsed
second-order coefficient), the first layer's values (its first-order coefficients are its weight),
and the head's values and second order; into preallocated outputs, with no elementwise work and
no allocation. Both libraries make these products (torch-jet its first layer's too). Where this
row alone exceeds 0.8x torch-jet's compiled time, the issue's target "compiled <= 0.8x" is out of
reach of any float32 implementation that makes them.

Where ``import jet`` fails (it declares Python >= 3.12; ``../shared/tools/install-torch-jet
VENV`` installs it on 3.10/3.11), its rows print the reason and are skipped.
Usage: python benchmarks/bench_torch_jet.py [--quick]
"""

from __future__ import annotations

import copy
import math
import sys
from dataclasses import dataclass

import torch
from _timing import Report, announce, interleaved_ms, one_core, peak_bytes
from bench_laplacian import PROBLEMS
from torch import nn

import pyhvp

one_core()
torch.set_num_threads(1)

EAGER, COMPILED = pyhvp.TorchBackend(compile=False), pyhvp.TorchBackend(compile=True)
# torch-jet's compiled path is a torch.compile of functorch's vmap wrapper, one per problem, and
# dynamo counts recompiles per code object: past its default limit of 8 (the grid's ninth
# problem) the compiled rows silently ran eagerly
torch._dynamo.config.recompile_limit = 64


@dataclass
class Case:
    """A single-instance function (for torch-jet and the dense reference), its batched self
    (for pyhvp), the instances, and pyhvp's event_dims."""

    name: str
    single: object
    batched: object
    x: torch.Tensor
    f64: object  # batched, in float64: the dense reference's
    event_dims: int = 1
    widths: tuple[int, ...] | None = None  # a tanh MLP's hidden widths: its GEMM floor is timed


def tanh_mlp(d: int, b: int, widths: tuple[int, ...]) -> Case:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for w_in, w_out in zip((d, *widths), widths, strict=False):
        layers += [nn.Linear(w_in, w_out), nn.Tanh()]
    net = nn.Sequential(*layers, nn.Linear(widths[-1], 1)).eval()
    for p in net.parameters():
        p.requires_grad_(False)
    x = torch.randn(b, d)
    net64 = copy.deepcopy(net).double()
    return Case(f"D={d}, B={b}, tanh {'-'.join(map(str, widths))}", net,
                lambda y: net(y)[..., 0], x, lambda y: net64(y)[..., 0], widths=widths)  # fmt: skip


def gemm_floor(d: int, b: int, widths: tuple[int, ...]):
    """The matrix products alone of an exact collapsed Laplacian of a tanh MLP with input size
    ``d``, ``b`` instances and hidden ``widths`` (the module docstring says which), into
    preallocated outputs."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(w_out, w_in, generator=generator)
               for w_in, w_out in zip((d, *widths), (*widths, 1), strict=True)]  # fmt: skip
    rows = [b] + [(d + 2) * b] * (len(widths) - 1) + [2 * b]
    shapes = [(r, *w.shape) for r, w in zip(rows, weights, strict=True)]
    inputs = [torch.randn(r, w_in, generator=generator) for r, _, w_in in shapes]
    outputs = [torch.empty(r, w_out) for r, w_out, _ in shapes]

    def products() -> None:
        for x, w, out in zip(inputs, weights, outputs, strict=True):
            torch.mm(x, w.T, out=out)

    return products


GRID = [
    (50, 32, (768, 768, 512, 512)),  # the paper's MLP
    (50, 256, (768, 768, 512, 512)),
    (50, 32, (128, 128, 128)),
    (64, 1024, (64, 64, 64)),
    (16, 1024, (64, 64, 64)),
    (2, 4096, (64, 64, 64)),
]


def laplacian_cases(quick: bool) -> list[Case]:
    cases = [tanh_mlp(*row) for row in (GRID[2:3] if quick else GRID)]
    for key, make in PROBLEMS.items():
        if quick and key != "mlp16":
            continue
        problem = make(torch.float32)
        widths = (64, 64, 64) if key.startswith("mlp") else None  # bench_laplacian's mlp()
        cases.append(Case(problem.name, lambda y, f=problem.f: f(y.unsqueeze(0)).reshape(1),
                          problem.f, problem.x, make(torch.float64).f, problem.event_dims,
                          widths))  # fmt: skip
    return cases


def torch_jet_methods(case: Case) -> dict[str, object]:
    """torch-jet's collapsed Laplacian, captured, CSE'd and vmapped; eager and compiled."""
    import jet

    x0 = case.x[0]
    laplacian = jet.laplacian(case.single, (x0,), collapsed=True)
    module, _ = jet.capture_graph(laplacian, (x0,))
    jet.common_subexpression_elimination(module.graph)
    module.recompile()
    batched = torch.func.vmap(module)
    compiled = torch.compile(batched)
    return {
        "torch-jet eager": lambda: batched(case.x).reshape(len(case.x)),
        "torch-jet compiled": lambda: compiled(case.x).reshape(len(case.x)),
    }


def pyhvp_methods(case: Case) -> dict[str, object]:
    def run(backend):
        return lambda: pyhvp.laplacian(case.batched, case.x, event_dims=case.event_dims,
                                       backend=backend)  # fmt: skip

    return {"pyhvp eager": run(EAGER), "pyhvp compiled": run(COMPILED)}


def checked_methods(case: Case) -> dict[str, object]:
    """Every method, each result checked against the dense float64 reference on 4 instances
    and against each other; torch-jet's skipped with the reason where it does not import."""
    methods = pyhvp_methods(case)
    try:
        methods.update(torch_jet_methods(case))
    except ImportError as error:
        print(f"  torch-jet skipped: {error}")
    except NotImplementedError as error:  # an op without a jet rule in torch-jet
        print(f"  torch-jet cannot run this problem: {str(error).splitlines()[0]}")
    reference = dense_laplacian(case).float()
    results = {name: fn()[:4] for name, fn in methods.items()}
    scale = reference.abs().max().item() + 1.0
    for name, got in results.items():
        error = (got.reshape(reference.shape) - reference).abs().max().item()
        assert error <= 1e-3 * scale, f"{case.name}: {name} off by {error:.3g}"
    return methods


def dense_laplacian(case: Case, count: int = 4) -> torch.Tensor:
    """The trace of each of the first ``count`` instances' Hessian, float64 (``torch.func``)."""
    event = tuple(case.x.shape[case.x.ndim - case.event_dims :])
    x64 = case.x[:count].double().reshape(count, -1)

    def single(flat: torch.Tensor) -> torch.Tensor:
        return case.f64(flat.reshape(1, *event))[0]

    hessians = torch.func.vmap(torch.func.hessian(single))(x64)
    return hessians.diagonal(dim1=-2, dim2=-1).sum(-1)


def main(quick: bool = False) -> None:
    report = Report("bench_torch_jet", "cpu")
    summary = []
    for case in laplacian_cases(quick):
        announce(case.name)
        methods = settled(checked_methods(case))
        if case.widths is not None:  # not a Laplacian: not checked, a baseline
            methods["GEMM floor"] = gemm_floor(case.x.shape[1], len(case.x), case.widths)
        times = interleaved_ms(methods, warmup=3, rounds=15, budget_s=20.0)
        rows = list(times.items())
        baseline = "torch-jet eager" if "torch-jet eager" in times else "pyhvp eager"
        report.table(f"Laplacian, {case.name}, float32, 1 thread", rows, baseline)
        n = math.prod(case.x.shape[1:])
        report.point("Laplacian, time per call", "instances x variables", len(case.x) * n, rows)
        summary.append((case.name, times))
    if any("torch-jet eager" in t for _, t in summary):
        report.text(ratio_table([(n, t) for n, t in summary if "torch-jet eager" in t]))
        report.text(memory_table(tanh_mlp(*GRID[1])))
    report.save()


def ratio_table(summary: list[tuple[str, dict[str, float]]]) -> str:
    lines = [
        "\npyhvp over torch-jet (below 1: pyhvp faster); targets: best <= 0.8, compiled <= 0.8, "
        "eager <= 1.0, compiled <= pyhvp eager; last column: the GEMM floor alone over torch-jet "
        "compiled (above 0.8: the compiled target is out of reach)",
        "  problem | best | compiled | eager | pyhvp compiled / eager | GEMM floor / torch-jet compiled",
    ]
    for name, t in summary:
        best = min(t["pyhvp eager"], t["pyhvp compiled"])
        jet_best = min(t["torch-jet eager"], t["torch-jet compiled"])
        floor = t["GEMM floor"] / t["torch-jet compiled"] if "GEMM floor" in t else None
        lines.append(
            f"  {name} | {best / jet_best:.2f} | {t['pyhvp compiled'] / t['torch-jet compiled']:.2f}"
            f" | {t['pyhvp eager'] / t['torch-jet eager']:.2f}"
            f" | {t['pyhvp compiled'] / t['pyhvp eager']:.2f}"
            f" | {'-' if floor is None else f'{floor:.2f}'}"
        )
    return "\n".join(lines)


def settled(methods: dict[str, object]) -> dict[str, object]:
    """``methods`` once ``compile=True``'s trial has ended: its compiled and eager calls
    alternate for up to ``2 * LONGEST_TRIAL`` calls after its compile, which would otherwise be
    timed as compiled ones (the other compiled method compiled at its checked first call)."""
    for _ in range(2 * (pyhvp.backends.compile_policy.LONGEST_TRIAL + 1)):
        methods["pyhvp compiled"]()
    return methods


def memory_table(case: Case) -> str:
    methods = settled(checked_methods(case))
    peaks = {name: peak_bytes(fn, "cpu") for name, fn in methods.items()}
    lines = [
        f"\nPeak memory of one call, {case.name}, float32",
        "  method | peak MiB | / torch-jet eager",
    ]
    lines += [f"  {name} | {b / 2**20:.1f} | {b / peaks['torch-jet eager']:.2f}"
              for name, b in peaks.items()]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
