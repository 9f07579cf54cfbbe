"""Embeddings that autograd can differentiate twice: :data:`twice_differentiable_embeddings`.

Autograd's first backward of ``embedding(..., sparse=True)`` is a sparse tensor, which a second
backward cannot take ("reshape is not implemented for sparse tensors"); ``embedding_bag`` has no
second derivative at all ("the derivative for '_embedding_bag_backward' is not implemented"),
sparse or not. Inside the context both run as ops that have one, with the same values.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from pyhvp._replacing import Replacement

_EMBEDDING, _EMBEDDING_BAG = torch.embedding, F.embedding_bag
"""torch's own functions, which the context replaces (``F.embedding`` calls the first)."""


@functools.wraps(_EMBEDDING)
def _embedding(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch.embedding`` (which ``F.embedding`` calls) with ``sparse=False`` inside the
    context (its 5th argument)."""
    if _REPLACED.inside():  # (another thread's calls keep torch's functions)
        if len(args) > 4:
            args = (*args[:4], False, *args[5:])
        else:
            kwargs["sparse"] = False
    return _EMBEDDING(*args, **kwargs)


@functools.wraps(_EMBEDDING_BAG)
def _embedding_bag(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``F.embedding_bag`` as :func:`embedding_bag_by_embedding` inside the context, after
    torch's own op ran without grad for its argument checks (the rewrite would compute values
    for calls torch refuses: a ``mode="prod"``, weights with a mean); ``scale_grad_by_freq``,
    whose convention the rewrite does not share, is refused."""
    if not _REPLACED.inside():
        return _EMBEDDING_BAG(*args, **kwargs)
    with torch.no_grad():
        _EMBEDDING_BAG(*args, **kwargs)
    if kwargs.get("scale_grad_by_freq", len(args) > 5 and args[5]):
        raise ValueError(
            "embedding_bag with scale_grad_by_freq=True: torch cannot differentiate its "
            "backward, and pyhvp's rewrite as an embedding would scale the gradient by "
            "another convention than torch's; pass scale_grad_by_freq=False"
        )
    return embedding_bag_by_embedding(*args, **kwargs)


_REPLACED = Replacement([(torch, "embedding", _embedding), (F, "embedding_bag", _embedding_bag)])


twice_differentiable_embeddings = _REPLACED
"""``with twice_differentiable_embeddings:`` or ``@twice_differentiable_embeddings``: inside,
``F.embedding(..., sparse=True)`` runs as ``sparse=False`` and ``F.embedding_bag`` (as
``nn.EmbeddingBag`` calls it) as :func:`embedding_bag_by_embedding`: the same values, and
derivatives autograd can differentiate again. ``torch.embedding`` and ``F.embedding_bag`` are
replaced while any such context is in progress (:class:`~pyhvp._replacing.Replacement`: a
function mode cost every op of the loss, 34% of a forward of 60 ops); a call bound to torch's
own function before, or another thread's, is torch's."""


@dataclasses.dataclass(frozen=True)
class TwiceDifferentiable:
    """``f`` run inside :data:`twice_differentiable_embeddings`: the same values, and
    derivatives autograd can differentiate again."""

    f: Callable[..., Any]

    @property
    def __name__(self) -> str:
        """``f``'s, as messages name it."""
        return getattr(self.f, "__name__", type(self.f).__name__)

    def __call__(self, *args: Any) -> Any:
        with twice_differentiable_embeddings:
            return self.f(*args)


def embedding_bag_by_embedding(
    input: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    mode: str = "mean",
    sparse: bool = False,
    per_sample_weights: torch.Tensor | None = None,
    include_last_offset: bool = False,
    padding_idx: int | None = None,
) -> torch.Tensor:
    """``F.embedding_bag`` with these arguments (``(bags, dim)``), as a dense ``F.embedding`` of
    every token and a sum, mean or max per bag: twice differentiable. An empty bag, or one of
    padding tokens alone, is zeros, as in ``F.embedding_bag``; ``sparse`` changes no value.

    >>> table = torch.arange(6.0).reshape(3, 2)
    >>> embedding_bag_by_embedding(torch.tensor([0, 2, 1]), table, torch.tensor([0, 2]))
    tensor([[2., 3.],
            [2., 3.]])
    """
    if input.dim() == 2:  # fixed-length bags, one per row
        if input.shape[1] == 0:
            raise ValueError("embedding_bag's 2-D input has bags of no tokens, which torch "
                             f"refuses: got input of shape {tuple(input.shape)}")  # fmt: skip
        bag = torch.arange(input.shape[0], device=input.device).repeat_interleave(input.shape[1])
        bags, tokens = input.shape[0], input.reshape(-1)
    elif offsets is None:  # (torch's own check, for a loss run under the mode first)
        raise ValueError("offsets has to be a 1D Tensor but got None")
    else:
        _check_offsets(offsets, len(input), include_last_offset)
        starts = (offsets[:-1] if include_last_offset else offsets).to(torch.int64)
        tokens, bags = input, len(starts)
        positions = torch.arange(len(input), device=input.device)
        bag = torch.searchsorted(starts, positions, right=True) - 1
    if not tokens.numel():  # no rows (F.embedding's double backward fails on no tokens)
        return weight[:0].sum(0).expand(bags, -1)  # (zeros, differentiable like torch's)
    rows = F.embedding(tokens, weight, None, max_norm, norm_type, scale_grad_by_freq)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.reshape(-1, 1)
    kept = bag >= 0  # (tokens before the first offset belong to no bag)
    if include_last_offset and offsets is not None:
        kept = kept & (torch.arange(len(input), device=input.device) < offsets[-1])
    if padding_idx is not None:
        kept = kept & (tokens != padding_idx % weight.shape[0])
    bag, rows = bag[kept], rows[kept]
    if mode == "max":
        return _first_maximum(rows, bag, bags)
    out = rows.new_zeros(bags, weight.shape[1]).index_add(0, bag, rows)
    if mode == "mean":
        counts = torch.bincount(bag, minlength=bags).clamp(min=1)
        out = out / counts.reshape(-1, 1).to(out.dtype)
    return out


def _check_offsets(offsets: torch.Tensor, tokens: int, include_last_offset: bool) -> None:
    """Refuse offsets outside ``F.embedding_bag``'s contract, where torch's kernels give values
    of their own (the rewrite would differentiate another function): 1-D, from 0, sorted, and
    with ``include_last_offset`` ending at the input's length."""
    if offsets.dim() != 1:
        raise ValueError(f"embedding_bag's offsets must be 1-D, got shape {tuple(offsets.shape)}")
    if not len(offsets):
        if include_last_offset or tokens:  # (torch indexes past the end, or crashes)
            raise ValueError(f"embedding_bag's offsets are empty for an input of {tokens} "
                             f"tokens{' with include_last_offset=True' * include_last_offset}")  # fmt: skip
        return
    values = offsets.tolist()
    if values[-1] > tokens:
        raise ValueError(f"embedding_bag's offsets must not pass the input's length {tokens}, "
                         f"got {values[-1]}")  # fmt: skip
    if values[0] != 0:
        raise ValueError(f"embedding_bag's offsets must start at 0, got {values[0]}")
    if any(later < earlier for earlier, later in itertools.pairwise(values)):
        raise ValueError(f"embedding_bag's offsets must be sorted, got {values}")
    if include_last_offset and values[-1] != tokens:
        raise ValueError(
            "embedding_bag's offsets with include_last_offset=True must end at the input's "
            f"length {tokens}, got {values[-1]}"
        )


def _first_maximum(rows: torch.Tensor, bag: torch.Tensor, bags: int) -> torch.Tensor:
    """``(bags, dim)``: per bag and feature, the row of its first token at the bag's maximum
    (``embedding_bag``'s ``argmax``: its derivative reaches that row alone, also at a tie), zeros
    for an empty bag."""
    dim, count = rows.shape[1], rows.shape[0]
    if count == 0:
        return rows.new_zeros(bags, dim)
    with torch.no_grad():
        where = bag.reshape(-1, 1).expand_as(rows)
        most = rows.new_full((bags, dim), -math.inf).scatter_reduce(0, where, rows, "amax")
        at_most = (rows == most[bag]) | (rows.isnan() & most[bag].isnan())
        position = torch.arange(count, device=rows.device).reshape(-1, 1).expand_as(rows)
        first = torch.full_like(most, count, dtype=torch.int64).scatter_reduce(
            0, where, torch.where(at_most, position, count), "amin"
        )
    chosen = rows.gather(0, first.clamp(max=count - 1))
    return torch.where(first < count, chosen, torch.zeros_like(chosen))
