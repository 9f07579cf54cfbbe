"""Sub-Hessians over k selected components of every parameter tensor (seed 003), side by side.

Models (float32, cross-entropy, random data):

* the seed's ``Linear(784, 10)`` through ``module_loss`` (100 images), and the same loss written
  by hand as a function of ``{"weight", "bias"}``: ``X @ W.T + b``, ``torch.mm(X, W.t()) + b``
  and ``torch.einsum("bi,oi->bo", X, W) + b``;
* LeNet-5: conv 1->6 5x5, tanh, max-pool, conv 6->16 5x5, tanh, max-pool, linear 256->120,
  tanh, linear 120->10 (64 images of 28x28);
* a text classifier: embedding (vocabulary 5,000, dim 64), mean over 32 tokens, linear 64->64,
  tanh, linear 64->4 (64 sentences);
* a one-block transformer encoder: d = 64, 4 heads (attention written out), LayerNorm after
  attention and after a GELU MLP (64->256->64), mean over 32 tokens, linear 64->4 (16
  sequences);
* a wide layer by hand, ``X @ W.T + b`` with ``W`` of 256 x 1024 (64 samples, 256 classes): a
  tensor of 2^18 entries, over ``routes.LOOP_ENTRIES``, so surveyed at any k.

k = 2, 16, 128 random components per tensor (all of a tensor that has fewer). Every row builds
the loss anew per call, as the seed's user writes it (``sub_hessian(*module_loss(...), index)``).
Methods: pyhvp's ``method="auto"`` (the cost model's choice), ``"sparse"`` and ``"reverse"``,
each eager (``compile=False``: what the default ``compile="auto"`` runs for its first calls) and
compiled (``compile=True``: its steady state in a loop of many calls), and ``"forward"`` (eager
always: it compiles nothing); the seed's loop (one
reverse pass per component, per tensor) and the answer the seed received (autograd's
``is_grads_batched``, one shared first backward, then one batched pass per tensor). Results are
checked against each other first. Ratios are against the seed's loop. One thread
(``torch.set_num_threads(1)``): on a shared CPU idle-waiting OpenMP threads stall when other
processes hold the cores. The allocator settings in effect are printed, and each row's page
faults per call: with glibc's defaults large buffers are given back to the system between
calls and page-faulted afresh (on the CI machine's VM about 1.6 us a 4 KB page), which slows
every method and the small compiled calls most (the seed's model at k = 16 compiled,
interleaved with the loop: 1.9 ms, 1.1 with ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` raised; the loop 7.2 and 5.1), and the forward route, which holds
every activation's tangents, most of all where another method's calls come between its own.
A run with the allocator tuned (those variables, ``THP_MEM_ALLOC_ENABLE`` or an ``LD_PRELOAD``)
writes ``bench_sub_hessian-malloc-tuned-<device>.txt`` beside the defaults' table.
Usage: python benchmarks/bench_sub_hessian.py [cuda] [model ...]
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from _timing import Report, allocator, announce, interleaved_runs
from torch import nn

import pyhvp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from sub_hessian import MnistModel, compute_sub_hessian


class LeNet5(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 6, 5), nn.Conv2d(6, 16, 5)
        self.fc1, self.fc2 = nn.Linear(256, 120), nn.Linear(120, 10)

    def forward(self, x):
        x = F.max_pool2d(torch.tanh(self.conv1(x)), 2)
        x = F.max_pool2d(torch.tanh(self.conv2(x)), 2)
        return self.fc2(torch.tanh(self.fc1(x.flatten(1))))


class TextClassifier(nn.Module):
    def __init__(self, vocabulary=5000, dim=64, classes=4):
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, dim)
        self.fc1, self.fc2 = nn.Linear(dim, dim), nn.Linear(dim, classes)

    def forward(self, tokens):
        return self.fc2(torch.tanh(self.fc1(self.embedding(tokens).mean(1))))


class EncoderBlock(nn.Module):
    """Post-norm transformer encoder block, attention written out (twice differentiable on every
    device, which ``scaled_dot_product_attention``'s fused CPU kernel is not)."""

    def __init__(self, d=64, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attention = torch.softmax(q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5, -1)
        x = self.norm1(x + self.out((attention @ v).transpose(1, 2).reshape(b, s, d)))
        return self.norm2(x + self.mlp(x))


class Encoder(nn.Module):
    def __init__(self, d=64, heads=4, classes=4):
        super().__init__()
        self.block, self.head = EncoderBlock(d, heads), nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.block(x).mean(1))


def by_hand(product):
    """The seed's loss as a function of its two tensors, the weight entering through
    ``product(X, W)`` (``X @ W.T``, ...) instead of ``F.linear``; built per call over the same
    data, as a training loop does."""
    params = {name: t.detach() for name, t in MnistModel().fc.named_parameters()}
    flat: dict[str, torch.Tensor] = {}

    def make(X, y):
        inputs = flat.setdefault("X", X.flatten(1))

        def loss(p):
            return F.cross_entropy(product(inputs, p["weight"]) + p["bias"], y)

        return loss, {name: t.to(X.device) for name, t in params.items()}

    return make


def wide_layer(inputs, outputs):
    """The seed's loss by hand over a wider layer, ``X @ W.T + b`` with ``W`` of ``outputs x
    inputs``: a tensor whose every loop pass writes a gradient of 2^18 entries."""
    torch.manual_seed(1)
    params = {"weight": torch.randn(outputs, inputs) / inputs**0.5, "bias": torch.zeros(outputs)}

    def make(X, y):
        def loss(p):
            return F.cross_entropy(X @ p["weight"].T + p["bias"], y)

        return loss, {name: t.to(X.device) for name, t in params.items()}

    return make


def module_problem(model):
    criterion = nn.CrossEntropyLoss()

    def make(X, y):
        return pyhvp.module_loss(model.to(X.device), criterion, X, y)

    return make


def seed_loop(loss, params, idxs):
    """The seed's method on any loss of a dict of tensors: a gradient that keeps its graph, then
    its ``compute_sub_hessian`` (one reverse pass per component) for every selected tensor."""
    leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
    grads = torch.autograd.grad(loss(leaves), list(leaves.values()), create_graph=True)
    named = dict(zip(leaves, grads, strict=True))
    return {
        name: compute_sub_hessian(named[name], leaves[name], i).detach() for name, i in idxs.items()
    }


def is_grads_batched(loss, params, idxs):
    """The seed's answer: one-hot cotangents through a batched second backward, per tensor."""
    leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
    grads = torch.autograd.grad(loss(leaves), list(leaves.values()), create_graph=True)
    named = dict(zip(leaves, grads, strict=True))
    result = {}
    for name, i in idxs.items():
        p = leaves[name]
        onehot = F.one_hot(torch.tensor(i, device=p.device), p.numel()).to(p.dtype)
        rows = torch.autograd.grad(
            named[name].reshape(-1), p, onehot, is_grads_batched=True, retain_graph=True
        )[0]
        result[name] = rows.reshape(len(i), -1)[:, i].detach()
    return result


def with_backend(backend, method):
    def sub_hessians(make, X, y, idxs, index):
        loss, params = make(X, y)
        return pyhvp.sub_hessian(loss, params, index, backend=backend, method=method)

    return sub_hessians


def baseline(method):
    def sub_hessians(make, X, y, idxs, index):
        return method(*make(X, y), idxs)

    return sub_hessians


EAGER, COMPILED = pyhvp.TorchBackend(compile=False), pyhvp.TorchBackend(compile=True)
METHODS = {
    "auto eager": with_backend(EAGER, "auto"),
    "auto compiled": with_backend(COMPILED, "auto"),
    "sparse eager": with_backend(EAGER, "sparse"),
    "sparse compiled": with_backend(COMPILED, "sparse"),
    "reverse eager": with_backend(EAGER, "reverse"),
    "reverse compiled": with_backend(COMPILED, "reverse"),
    "forward": with_backend(EAGER, "forward"),
    "seed loop": baseline(seed_loop),
    "is_grads_batched": baseline(is_grads_batched),
}


def problems(device):
    """name -> (make(X, y) -> (loss, params), X, y)."""
    torch.manual_seed(0)
    images, labels = torch.rand(100, 1, 28, 28), torch.randint(0, 10, (100,))
    small, small_labels = torch.rand(64, 1, 28, 28), torch.randint(0, 10, (64,))
    tokens, classes = torch.randint(0, 5000, (64, 32)), torch.randint(0, 4, (64,))
    sequences, sequence_classes = torch.randn(16, 32, 64), torch.randint(0, 4, (16,))
    wide, wide_labels = torch.randn(64, 1024), torch.randint(0, 256, (64,))
    data = {
        "seed Linear(784, 10)": (module_problem(MnistModel()), images, labels),
        "seed by hand, X @ W.T": (by_hand(lambda x, w: x @ w.T), images, labels),
        "seed by hand, mm(X, W.t())": (by_hand(lambda x, w: torch.mm(x, w.t())), images, labels),
        "seed by hand, einsum": (
            by_hand(lambda x, w: torch.einsum("bi,oi->bo", x, w)),
            images,
            labels,
        ),
        "LeNet-5": (module_problem(LeNet5()), small, small_labels),
        "text classifier": (module_problem(TextClassifier()), tokens, classes),
        "transformer encoder": (module_problem(Encoder()), sequences, sequence_classes),
        "wide layer, 1024 -> 256": (wide_layer(1024, 256), wide, wide_labels),
    }
    return {name: (make, X.to(device), y.to(device)) for name, (make, X, y) in data.items()}


class _TrialEnds(logging.Handler):
    """Counts the ends of ``"auto"``'s trials of plans: the ``pyhvp.sub_hessian`` logger's
    records that name the plan kept for good (``final``)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += getattr(record, "final", False)


def past_trials(calls: dict[str, Callable[[], object]], most: int = 64) -> None:
    """Calls each ``"auto"`` method until its trial of plans ends, at most ``most`` times (a call
    with one plan has no trial): a trial times each plan twice, after an untimed first run of a
    plan new to the process, and the plans within reach of the one kept twice more some calls
    later, so it lasts as many calls as that takes, more than the 8 warm-up calls every method
    gets where ``"auto"`` weighs five or six plans."""
    logger = logging.getLogger("pyhvp.sub_hessian")
    ends, level = _TrialEnds(), logger.level
    logger.addHandler(ends)
    logger.setLevel(logging.DEBUG)
    try:
        for name, call in calls.items():
            if name.startswith("auto"):
                before = ends.count
                for _ in range(most):
                    call()
                    if ends.count > before:
                        break
    finally:
        logger.removeHandler(ends)
        logger.setLevel(level)


def main(device: str, only: list[str]) -> None:
    # the seed's loss.backward(create_graph=True) warns about a grad <-> graph cycle; it is broken
    warnings.filterwarnings("ignore", message="Using backward\\(\\) with create_graph=True")
    if device == "cpu":
        torch.set_num_threads(1)
    tuned = allocator() != "glibc defaults"
    report = Report("bench_sub_hessian-malloc-tuned" if tuned else "bench_sub_hessian", device)
    report.text(f"malloc: {allocator()}")
    summary = []
    for model_name, (make, X, y) in problems(device).items():
        if only and not any(word in model_name for word in only):
            continue
        _, params = make(X, y)
        for k in (2, 16, 128):
            announce(f"{model_name}, k = {k} per tensor on {device}")
            torch.manual_seed(k)
            idxs = {
                name: torch.randperm(p.numel())[: min(k, p.numel())].tolist()
                for name, p in params.items()
            }
            # the selection is the user's, made once: as lists for the seed, tensors for pyhvp
            index = {name: torch.tensor(i, device=device) for name, i in idxs.items()}
            results = {name: fn(make, X, y, idxs, index) for name, fn in METHODS.items()}
            for name, blocks in results.items():
                torch.testing.assert_close(
                    blocks, results["seed loop"], rtol=1e-3, atol=1e-5, msg=name
                )
            calls = {name: partial(fn, make, X, y, idxs, index) for name, fn in METHODS.items()}
            # the steady state: past "auto"'s trial of plans and the compile policy's trial of
            # each compiled kernel (it alternates compiled and eager calls); each timed call
            # right after an untimed one of its own, as in a loop of calls: after another
            # method's, the forward route at k = 128 paid 0.65M page faults (1 s) a call
            past_trials(calls)
            runs = interleaved_runs(calls, device, warmup=8, rounds=41, budget_s=30.0, settle=1)
            times = {name: run.ms for name, run in runs.items()}
            rows = list(times.items())
            faults = {name: run.faults for name, run in runs.items()}
            report.table(f"{model_name}, k={k} per tensor, {device}", rows, "seed loop", faults)
            report.point(f"sub-Hessians, {model_name}", "k components per tensor", k, rows)
            summary.append((model_name, k, times))
    report.text(
        "\npyhvp auto, time / the seed loop's, and / the fastest of sparse, reverse (same "
        "compile setting) and forward (eager)"
    )
    report.text(
        f"  {'model':28} | {'k':>4} | {'compiled':>8} | {'eager':>8} | {'vs best, c':>10} "
        f"| {'vs best, e':>10}"
    )
    for model_name, k, t in summary:
        loop = t["seed loop"]
        best = {
            mode: min(t[f"sparse {mode}"], t[f"reverse {mode}"], t["forward"])
            for mode in ("compiled", "eager")
        }
        report.text(
            f"  {model_name:28} | {k:4d} | {t['auto compiled'] / loop:8.2f} "
            f"| {t['auto eager'] / loop:8.2f} | {t['auto compiled'] / best['compiled']:10.2f} "
            f"| {t['auto eager'] / best['eager']:10.2f}"
        )
    report.save()


if __name__ == "__main__":
    arguments = sys.argv[1:]
    target = arguments.pop(0) if arguments and arguments[0] in ("cpu", "cuda") else "cpu"
    main(target, arguments)
