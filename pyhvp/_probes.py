"""Random probe vectors shared by the stochastic estimators (diagonals, Laplacians)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def draw_probes(
    kind: str, shape: Sequence[int], like: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    """Rademacher signs (``kind="rademacher"``) or standard normals of ``shape`` in ``like``'s
    dtype, drawn on the generator's device (one stream for CPU and CUDA inputs alike), then moved
    to ``like``'s device."""
    device = generator.device if generator is not None else like.device
    shape = tuple(shape)
    if kind == "gaussian":
        draws = torch.randn(shape, generator=generator, device=device, dtype=like.dtype)
    else:
        draws = (
            2 * torch.randint(0, 2, shape, generator=generator, device=device, dtype=like.dtype) - 1
        )
    return draws.to(like.device)
