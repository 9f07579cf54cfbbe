"""Progress bars for calls that loop over user data (``progress=True``): tqdm, rank 0 only."""

from __future__ import annotations

from collections.abc import Iterable, Sized
from typing import TYPE_CHECKING, TypeVar

import torch.distributed as dist
from tqdm import tqdm

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

Item = TypeVar("Item")


def shows_progress(group: ProcessGroup | None) -> bool:
    """Whether this process draws the bar: rank 0 of ``group``, or of the default group when
    torch.distributed is initialised, so that several ranks do not draw over each other."""
    if group is not None:
        return dist.get_rank(group) == 0
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def progress_bar(
    items: Iterable[Item], caller: str, unit: str, group: ProcessGroup | None
) -> Iterable[Item]:
    """``items`` itself, or wrapped in a tqdm bar on stderr on the rank that shows progress: items
    done, rate and, when ``items`` has a length (a list, a ``DataLoader``), time left."""
    if not shows_progress(group):
        return items
    return tqdm(items, desc=caller, total=_length(items), unit=unit)


def _length(items: Iterable[object]) -> int | None:
    """How many ``items`` there are, or None where that is unknown: a generator, a
    ``DataLoader`` over an ``IterableDataset`` without ``__len__`` (whose ``len`` raises
    ``TypeError``)."""
    if not isinstance(items, Sized):
        return None
    try:
        return len(items)
    except TypeError:
        return None
