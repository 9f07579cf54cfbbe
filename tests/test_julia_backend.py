"""The julia backend: clear errors where Julia cannot start, the DLPack glue's Python side, and
cross-checks against the torch backend (these skip with the reason where Julia cannot start)."""

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dense import instance_hvp

import pyhvp
from pyhvp.backends.julia import (
    JULIACALL_DEFAULTS,
    call_julia,
    check_julia_tensor,
    check_no_autograd,
    julia_args,
    julia_available,
    julia_layout,
    julia_shape,
    lend,
    probe_julia,
)

JULIA = julia_available()
needs_julia = pytest.mark.skipif(
    not JULIA, reason=f"Julia cannot start here: {probe_julia()[1] if not JULIA else ''}"
)
gaussian_jl = pyhvp.julia_function("(x, mu) -> exp(-sum(abs2, x .- mu))")


def gaussian(x, mu, event_dims=1):
    return torch.exp(-((x - mu) ** 2).flatten(-event_dims).sum(-1))


# ------------------------------------------------------------------ where Julia cannot start

UNAVAILABLE = """
import pyhvp, torch
try:
    pyhvp.grad_and_hvp(pyhvp.julia_function("x -> sum(x)"), torch.ones(2, 3), torch.ones(2, 3),
                       backend="julia")
except pyhvp.BackendUnavailableError as e:
    print("RAISED", "pip install" in str(e) and "juliapkg.resolve()" in str(e))
"""


ENVIRONMENTS = {  # what the unavailable path is taken under (never a download)
    "offline-set": {"PYTHON_JULIAPKG_OFFLINE": "yes"},
    "offline-unset": {},
    # the availability probe is skipped: juliapkg's bare Exception came through as it was
    "auto-install, offline": {"PYHVP_JULIA_AUTOINSTALL": "yes", "PYTHON_JULIAPKG_OFFLINE": "yes"},
}


@pytest.mark.skipif(JULIA, reason="Julia can start here: the unavailable path cannot be shown")
@pytest.mark.parametrize("settings", ENVIRONMENTS.values(), ids=ENVIRONMENTS.keys())
def test_unavailable_julia_raises_with_install_help_without_hanging(settings):
    unset = ("PYTHON_JULIAPKG_OFFLINE", "PYHVP_JULIA_AUTOINSTALL")
    env = {k: v for k, v in os.environ.items() if k not in unset} | settings
    done = subprocess.run(
        [sys.executable, "-c", UNAVAILABLE], env=env, capture_output=True, text=True, timeout=120
    )
    assert "RAISED True" in done.stdout.splitlines(), done.stdout + done.stderr


HANGING_JULIA = """#!/bin/sh
echo $$ > "$(dirname "$0")/pid"
exec sleep 600
"""


def test_a_probe_that_times_out_stops_the_julia_it_started(tmp_path):
    """The probe's Python was stopped, the Julia it had started (here a script that hangs) was
    left running."""
    julia = tmp_path / "julia"
    julia.write_text(HANGING_JULIA)
    julia.chmod(0o755)
    settings = {"PYTHON_JULIAPKG_EXE": str(julia), "PYTHON_JULIAPKG_PROJECT": str(tmp_path)}
    old = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        ok, reason = probe_julia(timeout_s=8)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert not ok and "longer than" in reason, reason
    pid = int((tmp_path / "pid").read_text())
    time.sleep(0.5)
    assert not _running(pid)


def _running(pid):
    """Whether ``pid`` runs (a zombie, killed and waiting for a reaper, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(JULIA, reason="Julia can start here")
def test_available_backends_lists_torch_only_without_julia():
    assert pyhvp.available_backends() == ["torch"]


# ------------------------------------------------------------------ argument checks


def test_julia_function_rejects_non_str_source():
    with pytest.raises(TypeError, match="source"):
        pyhvp.julia_function(lambda x: x)


def test_julia_function_rejects_empty_source():
    with pytest.raises(ValueError, match="source"):
        pyhvp.julia_function("  ")


@pytest.mark.parametrize("dims", [-1, 1.5, "a", (1, -2)], ids=repr)
def test_julia_function_rejects_bad_arg_event_dims_when_made(dims):
    """As per_instance does: before, a bad value was only refused at the first call."""
    with pytest.raises(ValueError, match="arg_event_dims must be None, an int >= 0"):
        pyhvp.julia_function("(x, a) -> sum(x)", dims)


@needs_julia
def test_python_function_with_julia_backend_names_f():
    x = torch.ones(2, 3)
    with pytest.raises(TypeError, match=r"f must be a pyhvp\.julia_function"):
        pyhvp.grad_and_hvp(lambda x: x.sum(-1), x, x, backend="julia")


BAD_TENSORS = [
    ("float16", torch.ones(2, 3, dtype=torch.float16), "float32 or float64"),
    ("meta-device", torch.ones(2, 3, device="meta"), "on cpu or cuda"),
]


@pytest.mark.parametrize(
    ("case", "tensor", "message"), BAD_TENSORS, ids=[c[0] for c in BAD_TENSORS]
)
def test_check_julia_tensor_names_the_argument(case, tensor, message):
    with pytest.raises(ValueError, match=f"x must be {message}"):
        check_julia_tensor("x", tensor)


@pytest.mark.parametrize("position", [0, 1, 2], ids=["x", "v", "args[0]"])
def test_inputs_that_need_a_graph_are_refused_naming_them(position):
    named = [("x", torch.ones(2, 3)), ("v", torch.ones(2, 3)), ("args[0]", torch.ones(3))]
    name, tensor = named[position]
    named[position] = (name, tensor.requires_grad_())
    with pytest.raises(ValueError, match=re.escape(f"{name} requires grad")):
        check_no_autograd(named)
    with torch.no_grad():
        check_no_autograd(named)  # nothing to differentiate: accepted


def test_non_number_arg_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match=r"args\[0\]"):
        julia_args(["mu"], None, 1, torch.Size([4]))


def test_arg_that_does_not_broadcast_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"args\[0\]"):
        julia_args([torch.ones(3, 2)], None, 1, torch.Size([4]))


# ------------------------------------------------------------------ the DLPack glue (pure torch)


def test_julia_layout_is_contiguous_and_flattens_the_event(device):
    x = torch.randn(5, 3, 2, device=device).transpose(0, 1)  # (3, 5, 2), not contiguous
    out = julia_layout(x, x.shape[:1], 2)
    assert out.is_contiguous() and torch.equal(out, x.reshape(3, 10))


def test_julia_layout_does_not_copy_contiguous_input(device):
    x = torch.randn(4, 3, device=device)
    assert julia_layout(x, x.shape[:1], 1).data_ptr() == x.data_ptr()


def test_julia_layout_detaches():
    x = torch.randn(4, 3, requires_grad=True)
    assert not julia_layout(x, x.shape[:1], 1).requires_grad


def test_julia_shape_reverses_dims():
    assert julia_shape(torch.Size([2, 3, 4])) == (4, 3, 2)


LENT_SHAPES = [(4, 3), (1, 3), (2, 1, 1, 3), (3,)]  # (1, ..., 1, d): torch 2.4-2.8's stride 1


@pytest.mark.parametrize("shape", LENT_SHAPES, ids=str)
def test_lend_gives_a_capsule_of_the_same_memory_and_the_reversed_shape(device, shape):
    tensor = torch.randn(shape, device=device)
    capsule, julia_dims = lend(tensor)
    back = torch.utils.dlpack.from_dlpack(capsule)
    assert (back.data_ptr(), back.shape, julia_dims) == (
        tensor.data_ptr(),
        tensor.shape,
        shape[::-1],
    )


SHAPE_CASES = [  # name: (x shape, mu shape, Julia shape of x, Julia shape of mu)
    ("shared-mu-of-shape-d", (4, 3), (3,), (3, 4), (3, 1)),
    ("one-instance", (1, 3), (3,), (3, 1), (3, 1)),
    ("seed000", (2, 3, 4, 3), (2, 1, 1, 3), (3, 4, 3, 2), (3, 1, 1, 2)),
]


@pytest.mark.parametrize(
    ("case", "x_shape", "mu_shape", "x_julia", "mu_julia"),
    SHAPE_CASES,
    ids=[c[0] for c in SHAPE_CASES],
)
def test_julia_is_told_the_shape_of_every_tensor(case, x_shape, mu_shape, x_julia, mu_julia):
    x, mu = torch.randn(x_shape), torch.randn(mu_shape)
    batch = x.shape[:-1]
    (mu_laid_out,), _ = julia_args([mu], None, 1, batch)
    assert (lend(julia_layout(x, batch, 1))[1], lend(mu_laid_out)[1]) == (x_julia, mu_julia)


def test_julia_args_pad_shared_dims_and_reverse_own_shape(device):
    mu = torch.randn(2, 1, 1, 3, device=device)
    values, shapes = julia_args([mu, 2], None, 1, torch.Size([2, 5, 4]))
    assert (values[0].shape, shapes, values[1]) == ((2, 1, 1, 3), ((3,), ()), 2.0)


# ------------------------------------------------------------------ calling Julia

RAISED_IN_JULIA = [  # what PythonCall may raise out of a Julia call (see call_julia)
    TypeError("MethodError: no method matching f(::Int64)"),
    BufferError("Can't export tensors on a different CUDA device index"),
    RuntimeError("a JuliaError stands in here: it needs a running Julia"),
]


@pytest.mark.parametrize("error", RAISED_IN_JULIA, ids=lambda e: type(e).__name__)
def test_every_exception_from_a_julia_call_becomes_a_julia_backend_error(error):
    def fails():
        raise error

    with pytest.raises(pyhvp.JuliaBackendError, match="grad_and_hvp failed") as info:
        call_julia("grad_and_hvp", fails)
    assert info.value.__cause__ is error and type(error).__name__ in str(info.value)


def test_an_interrupt_during_a_julia_call_is_not_wrapped():
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        call_julia("grad_and_hvp", interrupted)


@pytest.mark.skipif(importlib.util.find_spec("juliacall") is None, reason="juliacall missing")
def test_every_juliacall_option_pyhvp_sets_is_one_juliacall_reads():
    source = Path(importlib.util.find_spec("juliacall").origin).read_text()
    read = {
        "PYTHON_JULIACALL_" + name.upper()
        for name in re.findall(r"(?:option|choice)\('(\w+)'", source)
    }
    assert set(JULIACALL_DEFAULTS) <= read


# ------------------------------------------------------------------ cross-checks vs torch

CASES = [  # name: (x shape, mu shape, k tangents or None for v of x's shape, event dims)
    ("seed000-single-tangent", (2, 3, 4, 3), (2, 1, 1, 3), None, 1),
    ("seed000-k3", (2, 3, 4, 3), (2, 1, 1, 3), 3, 1),
    ("seed000-k11-chunked", (2, 3, 2, 3), (2, 1, 1, 3), 11, 1),
    ("shared-mu-of-shape-d", (4, 3), (3,), 2, 1),
    ("one-instance-x-of-shape-1-d", (1, 3), (3,), None, 1),
    # matrix instances: Enzyme.jl#2071 (open) reports wrong forward-over-reverse HVPs for
    # matrix inputs on Julia 1.11
    ("event-dims-2-shared-mu", (4, 2, 3), (2, 3), 3, 2),
    ("event-dims-2-per-instance-mu", (2, 2, 3), (2, 2, 3), None, 2),
]


def julia_and_dense_hvp(x_shape, mu_shape, k, dtype=torch.float64, device="cpu", event_dims=1):
    x = torch.randn(x_shape, dtype=dtype, device=device) / 2
    mu = torch.randn(mu_shape, dtype=dtype, device=device) / 2
    v = torch.randn(((k,) if k else ()) + x_shape, dtype=dtype, device=device)
    _, hv = pyhvp.grad_and_hvp(gaussian_jl, x, v, mu, event_dims=event_dims, backend="julia")
    expected = instance_hvp(
        lambda y, m: gaussian(y, m, event_dims), x, v, mu, event_dims=event_dims
    )
    return hv.double(), expected


@needs_julia
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(
    ("case", "x_shape", "mu_shape", "k", "event_dims"), CASES, ids=[c[0] for c in CASES]
)
def test_julia_matches_dense_reference(device, dtype, case, x_shape, mu_shape, k, event_dims):
    hv, expected = julia_and_dense_hvp(x_shape, mu_shape, k, dtype, device, event_dims)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(hv, expected, rtol=tol, atol=tol)


@needs_julia
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_julia_runs_on_a_cuda_device_that_is_not_current():
    with torch.cuda.device(0):
        hv, expected = julia_and_dense_hvp((2, 3, 4, 3), (2, 1, 1, 3), 3, device="cuda:1")
    torch.testing.assert_close(hv, expected, rtol=1e-10, atol=1e-10)


@needs_julia
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_julia_gradient_matches_torch_backend(device, dtype):
    x = torch.randn(2, 3, 4, 3, dtype=dtype, device=device) / 2
    mu = torch.randn(2, 1, 1, 3, dtype=dtype, device=device) / 2
    g_jl, _ = pyhvp.grad_and_hvp(gaussian_jl, x, x, mu, backend="julia")
    g_torch, _ = pyhvp.grad_and_hvp(pyhvp.per_instance(gaussian), x, x, mu, backend="torch")
    torch.testing.assert_close(g_jl, g_torch)


def storage_references(tensor):
    """How many tensors share ``tensor``'s memory (torch's count; each lent view is one)."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


@needs_julia
def test_julia_hands_back_every_tensor_it_borrowed(device):
    x = torch.randn(2, 3, 4, 3, dtype=torch.float64, device=device)
    v = torch.randn(3, *x.shape, dtype=x.dtype, device=device)
    mu = torch.randn(2, 1, 1, 3, dtype=x.dtype, device=device)
    pyhvp.grad_and_hvp(gaussian_jl, x, v, mu, backend="julia")  # compiles; allocates once
    references = [storage_references(t) for t in (x, v, mu)]
    allocated = torch.cuda.memory_allocated(device) if x.is_cuda else 0
    for _ in range(200):
        pyhvp.grad_and_hvp(gaussian_jl, x, v, mu, backend="julia")
    assert [storage_references(t) for t in (x, v, mu)] == references
    assert (torch.cuda.memory_allocated(device) if x.is_cuda else 0) == allocated


@needs_julia
def test_julia_error_is_wrapped_with_julia_message():
    x = torch.ones(2, 3)
    with pytest.raises(pyhvp.JuliaBackendError, match="undefined_thing"):
        pyhvp.grad_and_hvp(pyhvp.julia_function("x -> undefined_thing(x)"), x, x, backend="julia")
