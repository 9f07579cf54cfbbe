"""Strong scaling of the data-set sub-Hessian: the same data set on 1 and on 2 CPU processes.

``sub_hessian(*module_loss(model, CrossEntropyLoss(reduction="sum")), index, data=shard,
group=WORLD)`` over 2000 random images in batches of 100, k = 16 components per parameter tensor,
float64, eager torch backend (compile=False: steady figures, no compile inside the timed calls).
Rows: 1 process with 1 thread (the baseline; all batches, no group), 1 process with 2 threads
(what one process does on this machine by default), 2 gloo processes with 1 thread each and half
the batches each, and 2 processes with no batches (the status exchange and the all_reduce alone).
All rows run in the same two processes, interleaved round by round, so that load from elsewhere
falls on every row alike (in the 1-process rows the other process waits in a barrier, which
sleeps); medians over the rounds. The 2-process result is checked against the 1-process one first.

What bounds the figure: ideal is 2.0x the 1-thread baseline, because the machine has 2 cores;
anything else running (the OS, another job) takes from the same 2 cores, and so does every row;
the load average printed first tells whether something else was running. Usage: python
benchmarks/bench_distributed.py
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _timing import Report, announce
from torch import nn

import pyhvp

N_IMAGES, BATCH, K = 2000, 100, 16
EAGER = pyhvp.TorchBackend(compile=False)


def seed_model():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 10))


def two_layer_mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.Tanh(), nn.Linear(128, 10))


MODELS = {"seed Linear(784, 10)": seed_model, "MLP 784-128-10": two_layer_mlp}


def problem(model_name):
    torch.manual_seed(0)
    model = MODELS[model_name]().double()
    images = torch.rand(N_IMAGES, 1, 28, 28, dtype=torch.float64)
    labels = torch.randint(0, 10, (N_IMAGES,))
    batches = list(zip(images.split(BATCH), labels.split(BATCH), strict=True))
    index = {
        name: torch.randperm(p.numel())[: min(K, p.numel())] for name, p in model.named_parameters()
    }
    loss, params = pyhvp.module_loss(model, nn.CrossEntropyLoss(reduction="sum"))
    return loss, params, index, batches


ROUNDS = 7  # timed, after one untimed round


def rank_main(rank, world, port, model_name, out):
    """Both ranks play every row each round; rank 0 saves {row: median ms} and the results."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(minutes=5),
    )
    loss, params, index, batches = problem(model_name)

    def sub_hessian(data, group):
        return pyhvp.sub_hessian(loss, params, index, data=data, group=group, backend=EAGER)

    world_group = dist.group.WORLD
    rows = {  # name: (threads, runs on this rank, call)
        "1 process, 1 thread": (1, rank == 0, lambda: sub_hessian(batches, None)),
        "1 process, 2 threads": (2, rank == 0, lambda: sub_hessian(batches, None)),
        "2 processes (gloo), 1 thread each": (
            1,
            True,
            lambda: sub_hessian(batches[rank::world], world_group),
        ),
        "2 processes, no batches (exchange + all_reduce)": (
            1,
            True,
            lambda: sub_hessian([], world_group),
        ),
    }
    times = {name: [] for name in rows}
    results = {}
    for round_ in range(ROUNDS + 1):
        for name, (threads, runs, call) in rows.items():
            torch.set_num_threads(threads)
            dist.barrier()
            if runs:
                start = time.perf_counter()
                results[name] = call()
                if round_ > 0:
                    times[name].append((time.perf_counter() - start) * 1e3)
    if rank == 0:
        medians = {name: statistics.median(t) for name, t in times.items()}
        torch.save((medians, results), Path(out) / "rank0.pt")
    dist.barrier()
    dist.destroy_process_group()


def run(model_name):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(rank_main, args=(2, port, model_name, out), nprocs=2)
        return torch.load(Path(out) / "rank0.pt", weights_only=False)


def main():
    report = Report("bench_distributed", "cpu")
    report.text(f"{N_IMAGES} images in batches of {BATCH}, k={K} per tensor")
    report.text(f"1-minute load average before the run: {os.getloadavg()[0]:.2f}")
    summary = []
    for model_name in MODELS:
        announce(f"{model_name}: 1 process (1 and 2 threads) against 2 gloo processes")
        medians, results = run(model_name)
        single, sharded = (
            results["1 process, 1 thread"],
            results["2 processes (gloo), 1 thread each"],
        )
        torch.testing.assert_close(sharded, single, rtol=1e-10, atol=1e-12)
        rows = list(medians.items())
        report.table(f"{model_name}: sub-Hessian of the sum over the data set", rows, rows[0][0])
        baseline = rows[0][1]
        summary.append((model_name, baseline / rows[1][1], baseline / rows[2][1]))
    report.text("\nspeed-up over 1 process with 1 thread (ideal on this 2-core machine: 2.0)")
    report.text(f"  {'model':22} | {'1 process, 2 threads':>20} | {'2 processes':>11}")
    for model_name, threads_speedup, ranks_speedup in summary:
        report.text(f"  {model_name:22} | {threads_speedup:20.2f} | {ranks_speedup:11.2f}")
    report.save()


if __name__ == "__main__":
    sys.exit(main())
