"""``scaled_dot_product_attention`` on its math path while pyhvp differentiates ``f`` twice or
more: its fused kernels (flash, memory-efficient and cuDNN on CUDA; flash on the CPU) have no
second derivative and no decomposition, so an HVP, a sub-Hessian or a jet through them would
raise ("derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward is not
implemented"). The math path computes the same values."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import ContextDecorator

import torch

_SWITCHES: tuple[tuple[Callable[[], bool], Callable[[bool], None], bool], ...] = tuple(
    (getattr(torch.backends.cuda, f"{name}_sdp_enabled"),
     getattr(torch.backends.cuda, f"enable_{name}_sdp"), name == "math")
    for name in ("flash", "mem_efficient", "cudnn", "math")
    if hasattr(torch.backends.cuda, f"enable_{name}_sdp")
)  # fmt: skip
"""``scaled_dot_product_attention``'s switches (global, the CPU's flash kernel too): whether
one is on, to turn it on or off, and whether it is on on the math path (math alone)."""


_LOCK = threading.Lock()
_held = 0  # calls inside, over all threads
_saved: list[tuple[bool, Callable[[bool], None]]] = []  # the switches before the first


class _MathAttention(ContextDecorator):
    """Inside (a ``with`` block, or a function it decorates), ``scaled_dot_product_attention``
    takes its math path, as ``sdpa_kernel([SDPBackend.MATH])`` has it on the CPU and CUDA,
    through the switches alone (2 us a call with the lock, against ``sdpa_kernel``'s 10). The
    switches are global, as ``sdpa_kernel``'s are: the first call to enter (over all threads)
    saves them, the last to leave restores them, and other threads' attention takes the math
    path meanwhile. Its state is the module's, so one instance serves every call."""

    def __enter__(self) -> None:
        global _held, _saved
        with _LOCK:
            if _held == 0:
                _saved = [(enabled(), enable) for enabled, enable, _ in _SWITCHES]
                for _, enable, on in _SWITCHES:
                    enable(on)
            _held += 1

    def __exit__(self, *exc: object) -> None:
        global _held
        with _LOCK:
            _held -= 1
            if _held == 0:
                for state, enable in _saved:
                    enable(state)


math_attention = _MathAttention()
"""``with math_attention:`` or ``@math_attention``: see :class:`_MathAttention`."""
