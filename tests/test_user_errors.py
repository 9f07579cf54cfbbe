"""Specification of what a user sees when their own function fails inside pyhvp: their error,
with their frame on top, and nothing else on stderr -- on every operator, eager and compiled."""

import logging
import threading
import traceback

import pytest
import torch

import pyhvp
from pyhvp import TorchBackend

W = torch.randn(4, 4)
MU = torch.randn(4)  # x has 3 variables per instance


def matmul_bug(x, *args):
    return (x @ W).sum(-1)  # (8, 3) @ (4, 4)


def broadcast_bug(x, mu):
    return ((x - mu) ** 2).sum(-1)  # (8, 3) - (4,)


BUGS = {
    "shape bug in f": (matmul_bug, (), "mat1 and mat2 shapes cannot be multiplied"),
    "broadcasting mismatch with an arg": (broadcast_bug, (MU,), "must match the size"),
}
INDEX = torch.tensor([0, 4])
OPERATORS = {
    "hvp": lambda f, x, args, b: pyhvp.hvp(f, x, torch.ones_like(x), *args, backend=b),
    "grad_and_hvp": lambda f, x, args, b: pyhvp.grad_and_hvp(f, x, x, *args, backend=b),
    "hessian_diagonal exact": lambda f, x, args, b: pyhvp.hessian_diagonal(f, x, *args, backend=b),
    "hessian_diagonal hutchinson": lambda f, x, args, b: pyhvp.hessian_diagonal(
        f, x, *args, method="hutchinson", samples=4, backend=b
    ),
    "laplacian exact": lambda f, x, args, b: pyhvp.laplacian(f, x, *args, backend=b),
    "laplacian hutchinson": lambda f, x, args, b: pyhvp.laplacian(
        f, x, *args, method="hutchinson", samples=4, backend=b
    ),
    "grad_and_laplacian": lambda f, x, args, b: pyhvp.grad_and_laplacian(f, x, *args, backend=b),
    "bilaplacian": lambda f, x, args, b: pyhvp.bilaplacian(f, x, *args, backend=b),
    "directional_derivatives": lambda f, x, args, b: pyhvp.directional_derivatives(
        f, x, x, *args, order=4, backend=b
    ),
    "differential_operator": lambda f, x, args, b: pyhvp.differential_operator(
        f, x, {(0, 0, 0): 1.0}, *args, backend=b
    ),
    "sub_hessian": lambda f, x, args, b: pyhvp.sub_hessian(
        lambda p: f(p, *args).sum(), x, INDEX, backend=b
    ),
    "check_instances": lambda f, x, args, b: pyhvp.check_instances(f, x, *args),
}
PATHS = {
    "eager": lambda: TorchBackend(compile=False),
    "compiled": pytest.param(lambda: TorchBackend(compile=True), marks=pytest.mark.slow),
}


@pytest.mark.parametrize("call", OPERATORS.values(), ids=OPERATORS.keys())
@pytest.mark.parametrize(("f", "args", "message"), BUGS.values(), ids=BUGS.keys())
@pytest.mark.parametrize("path", PATHS.values(), ids=PATHS.keys())
def test_a_bug_in_f_raises_the_users_error_and_prints_nothing(call, f, args, message, path, capfd):
    capfd.readouterr()
    with pytest.raises(RuntimeError, match=message) as info:
        call(f, torch.randn(8, 3), args, path())
    innermost = traceback.extract_tb(info.value.__traceback__)[-1]
    assert (innermost.filename, innermost.name) == (__file__, f.__name__)
    assert capfd.readouterr() == ("", "")


def typo_bug(x, *args):
    return torch.sin(x).prod((-1, -2))  # prod takes one dim


SHOWN_ONCE = {**BUGS, "a wrong argument to a torch function": (typo_bug, (), "prod")}


@pytest.mark.parametrize("call", OPERATORS.values(), ids=OPERATORS.keys())
@pytest.mark.parametrize(("f", "args", "message"), SHOWN_ONCE.values(), ids=SHOWN_ONCE.keys())
@pytest.mark.parametrize(
    "backend", ["torch", TorchBackend(compile=False)], ids=["default", "eager"]
)
def test_a_bug_in_f_is_the_only_error_its_traceback_shows(call, f, args, message, backend):
    """Not chained to dynamo's failure to trace ``f`` (a graph break's 30 lines above the
    user's error on a Taylor operator's first call), nor to a first failed run of it (the loss
    of ``sub_hessian``, run again by the seed's loop)."""
    with pytest.raises(Exception, match=message) as info:
        call(f, torch.randn(8, 3), args, backend)
    shown = "".join(traceback.format_exception(info.value))
    assert "During handling" not in shown and "direct cause" not in shown, shown


def test_torch_logs_that_the_user_asked_for_still_show(capfd):
    """A level set on a torch logger (TORCH_LOGS, set_logs) is the user's: its records pass.
    Dynamo starts afresh (``reset``): after the suite's earlier compiles in this process it may
    run frames eagerly, tracing and logging nothing (the operators then record ``f`` without
    it, running it once)."""
    torch._dynamo.reset()
    torch._logging.set_logs(dynamo=logging.DEBUG)
    raised: list[BaseException] = []

    def call() -> None:  # a thread of its own: dynamo's frame hook is per thread, and torch
        try:  # 2.5.1's main thread can be left running frames eagerly by specs before this one
            pyhvp.laplacian(matmul_bug, torch.randn(8, 3))
        except RuntimeError as error:
            raised.append(error)

    try:
        thread = threading.Thread(target=call)
        thread.start()
        thread.join()
    finally:
        torch._logging.set_logs()
    assert raised
    assert "torch/_dynamo" in capfd.readouterr().err
