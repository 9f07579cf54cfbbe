"""
More than one device
====================

The two patterns of the guide, on torch.distributed (gloo on the CPU).

1. More instances than one device holds: every rank computes its shard of the particles (seed
   000) with grad_and_hvp; nothing is communicated until the shards are gathered, and the
   gathered result is the single-process one, bit for bit in float64.
2. A loss over a data set larger than one batch or one machine: every rank passes its shard of
   batches to sub_hessian(..., data=loader, group=...) and gets the sub-Hessian of the mean loss
   over the whole data set (reduction="sum", divided by the data set size).

Every rank checks its results (closed form, single-process full-data result, the other ranks)
and exits non-zero when one disagrees.
Run: ``torchrun --nproc-per-node 2 examples/more_than_one_device.py``, or plain
``python examples/more_than_one_device.py``, which starts 2 gloo ranks on this machine itself.
(The documentation build shows this script without running it: its ranks are processes of their
own. ``make test`` runs it.)
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

import pyhvp


def gaussian_bump(x, mu):  # x: (n_g, n_b, n_a, 3), mu: (n_g, 1, 1, 3) -> one value per particle
    return torch.exp(-((x - mu) ** 2).sum(-1))


def sharded_particles(rank, world):
    torch.manual_seed(0)  # every rank draws the same full problem, then keeps its own shard
    n_g, n_b, n_a = 4, 64 * world, 8
    x = torch.randn(n_g, n_b, n_a, 3, dtype=torch.float64)
    v = torch.randn_like(x)
    mu = torch.randn(n_g, 1, 1, 3, dtype=torch.float64)
    x_shard, v_shard = x.tensor_split(world, dim=1)[rank], v.tensor_split(world, dim=1)[rank]

    g, hv = pyhvp.grad_and_hvp(gaussian_bump, x_shard, v_shard, mu)  # this rank's particles only

    r = x_shard - mu  # closed form: g = -2 r f, H v = f (4 r (r . v) - 2 v)
    f = gaussian_bump(x_shard, mu)[..., None]
    torch.testing.assert_close(g, -2 * r * f)
    torch.testing.assert_close(hv, f * (4 * r * (r * v_shard).sum(-1, keepdim=True) - 2 * v_shard))

    gathered = []
    for shard in (g, hv):
        pieces = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(pieces, shard.contiguous())
        gathered.append(torch.cat(pieces, dim=1))
    single_process = pyhvp.grad_and_hvp(gaussian_bump, x, v, mu)
    assert all(map(torch.equal, gathered, single_process)), "shards differ from the full batch"
    return f"{x.shape[:3].numel()} particles, {x_shard.shape[:3].numel()} on this rank"


class MnistModel(nn.Module):  # the seed's model (examples/sub_hessian.py)
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(28 * 28, 10)

    def forward(self, x):
        return self.fc(x.reshape(-1, 28 * 28))


def data_set_sub_hessian(rank, world):
    torch.manual_seed(0)  # same model and data set on every rank
    model = MnistModel()
    images, labels = torch.rand(1000, 1, 28, 28), torch.randint(0, 10, (1000,))
    data_set = TensorDataset(images, labels)
    # Every world-th sample: each sample on exactly one rank. (DistributedSampler pads a data set
    # that does not divide evenly by repeating samples, which a sum would count twice.)
    shard = Subset(data_set, range(rank, len(data_set), world))
    loader = DataLoader(shard, batch_size=100)
    index = {"fc.weight": torch.tensor([0, 4, 1000]), "fc.bias": torch.tensor([0, 4])}

    loss, params = pyhvp.module_loss(model, nn.CrossEntropyLoss(reduction="sum"))
    summed = pyhvp.sub_hessian(loss, params, index, data=loader, group=dist.group.WORLD, joint=True)
    mean = summed / len(data_set)  # the Hessian of the mean loss over the whole data set

    whole = pyhvp.module_loss(model, nn.CrossEntropyLoss(), images, labels)  # fits in one process
    torch.testing.assert_close(mean, pyhvp.sub_hessian(*whole, index, joint=True))
    every_rank = [None] * world
    dist.all_gather_object(every_rank, mean)
    assert all(torch.equal(other, mean) for other in every_rank), "ranks got different results"
    return f"{len(shard)} of {len(data_set)} images on this rank, (5, 5) mean-loss sub-Hessian"


def main():
    dist.init_process_group("gloo")  # env://: torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    particles = sharded_particles(rank, world)
    print(f"rank {rank}/{world}, pattern 1: {particles}: gathered == one process, bitwise")
    data = data_set_sub_hessian(rank, world)
    print(f"rank {rank}/{world}, pattern 2: {data}: == one process, same on every rank")
    dist.barrier()  # every rank's collectives done before the group goes
    if torch.__version__ < "2.6":
        # torch 2.5's gloo deadlocks when a group is torn down while its worker thread still
        # frees the last collective's tensors (the worker waits for the GIL, which the tearing
        # thread holds while it joins the worker): on 2.5 each rank leaves without tearing down
        sys.stdout.flush()
        os._exit(0)
    dist.destroy_process_group()


def spawned_rank(rank, world, port):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    main()


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        main()
    else:  # plain python: start 2 gloo ranks on the loopback address
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(spawned_rank, args=(2, port), nprocs=2)
