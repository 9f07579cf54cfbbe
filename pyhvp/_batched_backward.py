"""Autograd's backward of a batch of cotangents at once (``is_grads_batched``), as every route
that pushes several directions through a double backward runs it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def batched_grad(
    outputs: torch.Tensor | Sequence[torch.Tensor],
    inputs: torch.Tensor | Sequence[torch.Tensor],
    grad_outputs: torch.Tensor | Sequence[torch.Tensor],
    *,
    retain_graph: bool | None = None,
    **options: Any,
) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad`` of ``outputs`` with ``grad_outputs`` batched along their first
    dim: per input, its gradients batched likewise (None where unused). One batched backward;
    one backward per row for a single row (no ``vmap`` set up for it), under
    ``torch.autograd.detect_anomaly()``, whose NaN check reads each gradient's value, which a
    batched backward cannot ("Batching rule not implemented for aten::item"), and where the
    batched backward fails: a max pool of a channels_last input ("NYI: querying is_contiguous
    inside of vmap"), sparse intermediates (torch 2.13), which one row at a time runs. (It keeps
    the graph for those rows: a failed pass may have freed part of it.)"""
    outs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    cotangents = [grad_outputs] if isinstance(grad_outputs, torch.Tensor) else list(grad_outputs)
    count = len(cotangents[0])
    if count != 1 and not (count and torch.is_anomaly_enabled()):
        try:
            return torch.autograd.grad(outs, inputs, cotangents, retain_graph=True,
                                       is_grads_batched=True, **options)  # fmt: skip
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, IndexError, NotImplementedError):
            pass  # torch cannot batch this backward: row by row (its own error if that fails)
    rows = [
        torch.autograd.grad(outs, inputs, [c[i] for c in cotangents],
                            retain_graph=True if i < count - 1 else retain_graph, **options)
        for i in range(count)
    ]  # fmt: skip
    return tuple(None if row[0] is None else torch.stack(row) for row in zip(*rows, strict=True))
