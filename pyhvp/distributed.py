"""torch.distributed glue: a sum over the ranks of a process group that fails loudly, never hangs.

pyhvp runs on PyTorch's own distributed engine (gloo on the CPU, NCCL on CUDA) and starts no
process itself. Two patterns (the guide's "More than one device"):

* **Instances sharded over ranks** need no communication. Per-instance operators (``grad_and_hvp``,
  ``hvp``, ``hessian_diagonal``, ``laplacian``, ``grad_and_laplacian``) compute instance ``b``'s
  result from instance ``b``'s inputs only, so each rank calls them on its shard of the batch dims
  and the shards' results, gathered, are the full batch's. Bit for bit when every kernel of ``f`` computes an element the same way wherever it
  sits in memory: true of the seed problem (elementwise arithmetic, ``exp``, sums over the event
  dims), tested in float64 across two gloo processes. Otherwise equal to rounding (a few ulp):
  matrix products over the batch dims (BLAS picks kernels by row count and memory alignment), and
  elementwise ops whose vectorised and scalar CPU code differ (``sigmoid``, ``softplus``, ``pow``
  by a non-integer on AVX-512: the last elements of each thread's range take the scalar code, and
  a shard moves those ends; ``ATEN_CPU_CAPABILITY=default`` removes this case, not the first).
* **A loss summed over a sharded data set**: ``sub_hessian(..., data=shard, group=group)``. Each
  rank sums its own batches, then :func:`sum_over_ranks` adds the ranks' sums with ONE
  ``all_reduce``. The result equals the single-process sum over all batches up to the order of
  the floating-point additions (each rank's batches, then the ranks); every rank gets the same
  bits (gloo reduces each entry once and sends it to all).

Failure protocol of :func:`sum_over_ranks`: every rank runs its part (argument checks included)
inside ``try``; then the ranks exchange a status -- the error, or a fingerprint of what they are
about to add (shapes, dtypes, index sets, ...) -- with one ``all_gather_object``. A rank whose part
raised re-raises its own exception; every other rank raises ``RuntimeError`` naming the failed
rank(s) and their errors; ranks that disagree raise ``ValueError`` on every rank, naming what
differs and each rank's value. The ``all_reduce`` runs only when every rank succeeded and agrees,
so after any of these errors the group is still in step and usable. What can still hang: a rank
that never reaches the call (it died, is stuck, or took another code path). The others then wait
in the status exchange until the group's timeout (``init_process_group(timeout=...)``; by default
30 minutes for gloo, 10 for NCCL) and raise ``RuntimeError`` saying so; gloo notices a dead peer's
closed connection at once. With NCCL, call ``torch.cuda.set_device(local_rank)`` first (the
status exchange runs on the current CUDA device).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from pyhvp.backends import nested

Fingerprint = Mapping[str, Any]
"""What every rank must agree on, by name (e.g. ``{"index['w']": [0, 4]}``); values compare with
``==`` and are shown in error messages."""


def check_group(group: object) -> dist.ProcessGroup | None:
    """``group`` itself: ``None`` (one process, no communication) or a process group this rank is
    a member of.

    >>> check_group(None) is None
    True
    """
    if group is None:
        return None
    if not dist.is_available():
        raise TypeError(
            "group must be None: this torch build has no torch.distributed, "
            f"got {type(group).__name__}"
        )
    if group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            "group must be a process group this rank belongs to, got "
            "GroupMember.NON_GROUP_MEMBER (dist.new_group returns it on ranks outside the group)"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            "group must be None or a torch.distributed ProcessGroup (dist.group.WORLD after "
            f"dist.init_process_group, or dist.new_group(...)), got {type(group).__name__}"
        )
    if nested.inside_transform():
        raise ValueError(
            "group must be None inside a torch.func transform (vmap): torch.distributed's "
            "all_reduce has no batching rule; call the operator with group outside the transform"
        )
    return group


class _Status(NamedTuple):
    """What a rank tells the others before anything is added: its error or its fingerprint."""

    error: str | None
    fingerprint: Fingerprint | None


def sum_over_ranks(
    compute: Callable[[], tuple[Sequence[torch.Tensor], Fingerprint]],
    group: dist.ProcessGroup,
    caller: str,
) -> list[torch.Tensor]:
    """``compute()``'s tensors summed over the ranks of ``group``: the same list on every rank.

    ``compute`` returns this rank's tensors and a fingerprint every rank must agree on; the
    tensors' shapes, dtypes and device types are added to it. Errors follow the module's failure
    protocol (``caller`` names the operation in their messages). The tensors travel as one buffer
    of their promoted dtype on the first tensor's device: one ``all_reduce`` per call (float32
    sums mixed with float64 ones are added in float64 and rounded once).
    """
    ranks = dist.get_process_group_ranks(group)
    local_error: Exception | None = None
    try:
        tensors, fingerprint = compute()
        described = tuple((tuple(t.shape), str(t.dtype), t.device.type) for t in tensors)
        status = _Status(None, {**fingerprint, "result shapes, dtypes, devices": described})
    except Exception as error:  # every rank must reach the exchange, whatever failed
        local_error = error
        status = _Status(f"{type(error).__name__}: {error}", None)
    statuses: list[Any] = [None] * len(ranks)
    try:
        dist.all_gather_object(statuses, status, group=group)
    except RuntimeError as error:
        raise RuntimeError(
            f"{caller}: the status exchange between ranks {ranks} failed on rank "
            f"{dist.get_rank()}: a rank died, or did not call {caller} within the group's "
            f"timeout: {error}"
        ) from local_error
    if local_error is not None:
        raise local_error
    failed = [(rank, s.error) for rank, s in zip(ranks, statuses, strict=True) if s.error]
    if failed:
        raise RuntimeError(
            f"{caller} failed on "
            + "; ".join(f"rank {rank} of {ranks}: {error}" for rank, error in failed)
            + f" (rank {dist.get_rank()} succeeded; nothing was summed)"
        )
    _require_agreement([s.fingerprint for s in statuses], ranks, caller)
    return _all_reduce_sum(tensors, group)


def _require_agreement(fingerprints: list[Fingerprint], ranks: list[int], caller: str) -> None:
    """``ValueError`` naming the first key on which the ranks' fingerprints differ."""
    for key in {key: None for f in fingerprints for key in f}:  # keys in order, once
        values = [f.get(key) for f in fingerprints]
        if any(value != values[0] for value in values):
            by_rank = "; ".join(
                f"rank {rank}: {_show(value)}" for rank, value in zip(ranks, values, strict=True)
            )
            raise ValueError(
                f"{caller}: the ranks of the group must agree on {key}, got {by_rank} (every "
                f"rank passes the same arguments but its own data)"
            )


def _show(value: object, width: int = 100) -> str:
    text = repr(value)
    if len(text) <= width:
        return text
    size = f" ({len(value)} entries)" if isinstance(value, Sequence) else ""
    return text[: width - 3] + "..." + size


def _all_reduce_sum(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup
) -> list[torch.Tensor]:
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    device = tensors[0].device
    flat = torch.cat([t.reshape(-1).to(device=device, dtype=dtype) for t in tensors])
    dist.all_reduce(flat, group=group)
    parts = torch.split(flat, [t.numel() for t in tensors])
    return [part.reshape(t.shape).to(t) for part, t in zip(parts, tensors, strict=True)]
