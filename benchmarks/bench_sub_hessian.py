"""Sub-Hessians over k selected components of every parameter tensor (seed 003), side by side.

Models: the seed's Linear(784, 10) and a 2-layer tanh MLP (784 -> 128 -> 10), CrossEntropy over
100 random images, float32; k = 2, 16, 128 random components per tensor (all of a tensor that has
fewer). Every row builds the loss anew per call from the model and data, as the seed's user
writes it (``sub_hessian(*module_loss(...), index)``): pyhvp's ``method="auto"`` (the cost
model's choice) eager (``compile=False``: what the default ``compile="auto"`` runs for its first
calls) and compiled (``compile=True``: its steady state in a loop of many calls; the compile
cache is shared, so a default backend here would run what the compiled rows compiled); the
sparse route (``method="sparse"``: the restricted loss with one-hot directions entering each
linear layer as gathered columns, :mod:`pyhvp.restricted`) and the reverse route
(``method="reverse"``: one batched HVP per component), each eager (``compile=False``) and
compiled; the seed's loop (one reverse pass per component) and the answer the seed received
(``torch.autograd.grad(..., is_grads_batched=True)``, one shared first backward, then one batched
pass per tensor). Results are checked against each other first. Ratios are against the seed's
loop. One thread (``torch.set_num_threads(1)``): on a shared CPU idle-waiting OpenMP threads
stall when other processes hold the cores. Usage: python benchmarks/bench_sub_hessian.py [cuda]
"""

from __future__ import annotations

import sys
import warnings
from functools import partial
from pathlib import Path

import torch
from _timing import Report, announce, interleaved_ms
from torch import nn

import pyhvp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from sub_hessian import MnistModel, seed_sub_hessians


def is_grads_batched(model, criterion, X, y, idxs):
    """The seed's answer: one-hot cotangents through a batched second backward, per tensor."""
    named = dict(model.named_parameters())
    loss = criterion(model(X), y)
    grads = torch.autograd.grad(loss, list(named.values()), create_graph=True)
    result = {}
    for (name, param), grad in zip(named.items(), grads, strict=True):
        onehot = nn.functional.one_hot(torch.tensor(idxs[name], device=X.device), param.numel())
        rows = torch.autograd.grad(
            grad.reshape(-1),
            param,
            grad_outputs=onehot.to(grad.dtype),
            is_grads_batched=True,
            retain_graph=True,
        )[0]
        result[name] = rows.reshape(len(idxs[name]), -1)[:, idxs[name]].detach()
    return result


def two_layer_mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.Tanh(), nn.Linear(128, 10))


def with_backend(backend, method):
    def sub_hessians(model, criterion, X, y, idxs):
        index = {name: torch.tensor(i, device=X.device) for name, i in idxs.items()}
        loss, params = pyhvp.module_loss(model, criterion, X, y)
        return pyhvp.sub_hessian(loss, params, index, backend=backend, method=method)

    return sub_hessians


EAGER, COMPILED = pyhvp.TorchBackend(compile=False), pyhvp.TorchBackend(compile=True)
METHODS = {
    "auto eager": with_backend(EAGER, "auto"),
    "auto compiled": with_backend(COMPILED, "auto"),
    "sparse eager": with_backend(EAGER, "sparse"),
    "sparse compiled": with_backend(COMPILED, "sparse"),
    "reverse eager": with_backend(EAGER, "reverse"),
    "reverse compiled": with_backend(COMPILED, "reverse"),
    "seed loop": seed_sub_hessians,
    "is_grads_batched": is_grads_batched,
}


def main(device: str) -> None:
    # the seed's loss.backward(create_graph=True) warns about a grad <-> graph cycle; it is broken
    warnings.filterwarnings("ignore", message="Using backward\\(\\) with create_graph=True")
    if device == "cpu":
        torch.set_num_threads(1)
    report = Report("bench_sub_hessian", device)
    torch.manual_seed(0)
    X = torch.rand(100, 1, 28, 28, device=device)
    y = torch.randint(0, 10, size=(100,), device=device)
    criterion = nn.CrossEntropyLoss()
    summary = []
    for model_name, make in {
        "seed Linear(784, 10)": MnistModel,
        "MLP 784-128-10": two_layer_mlp,
    }.items():
        model = make().to(device)
        for k in (2, 16, 64, 128) if model_name.startswith("MLP") else (2, 16, 128):
            announce(f"{model_name}, k = {k} per tensor on {device}")
            idxs = {
                name: torch.randperm(p.numel())[: min(k, p.numel())].tolist()
                for name, p in model.named_parameters()
            }
            results = {name: fn(model, criterion, X, y, idxs) for name, fn in METHODS.items()}
            for name, blocks in results.items():
                torch.testing.assert_close(blocks, results["seed loop"], msg=name)
            calls = {
                name: partial(fn, model, criterion, X, y, idxs) for name, fn in METHODS.items()
            }
            times = interleaved_ms(calls, device, rounds=21)
            rows = list(times.items())
            report.table(f"{model_name}, k={k} per tensor, {device}", rows, "seed loop")
            report.point(f"sub-Hessians, {model_name}", "k components per tensor", k, rows)
            summary.append((model_name, k, times))
    report.text("\npyhvp auto compiled (the cost model's choice, steady state), time / other's")
    report.text(
        f"  {'model':22} | {'k':>4} | {'/ seed loop':>11} | {'/ is_grads_batched':>18} "
        f"| {'/ reverse compiled':>18}"
    )
    for model_name, k, times in summary:
        auto = times["auto compiled"]
        report.text(
            f"  {model_name:22} | {k:4d} | {auto / times['seed loop']:11.2f} "
            f"| {auto / times['is_grads_batched']:18.2f} | {auto / times['reverse compiled']:18.2f}"
        )
    report.save()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cpu")
