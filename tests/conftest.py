"""Shared fixtures: every test that takes ``device`` runs on each device this machine has."""

import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def compiled(monkeypatch) -> list:
    """Every function handed to torch.compile during the test, in order (still compiled)."""
    calls = []
    real_compile = torch.compile

    def recording_compile(fn, **kwargs):
        calls.append(fn)
        return real_compile(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", recording_compile)
    return calls
