"""The julia backend (Enzyme.jl + CUDA.jl through juliacall). The only module that talks to Julia."""

from __future__ import annotations

from pyhvp.backends import BackendUnavailableError


def julia_available() -> bool:
    return False


class JuliaBackend:
    name = "julia"

    def __init__(self) -> None:
        raise BackendUnavailableError("the julia backend is not built yet")
