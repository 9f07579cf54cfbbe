"""``python -m pyhvp.check_julia``: its answer where Julia cannot start (run for real), and its
report and exit codes fed stand-in runners (the julia runner needs a Julia)."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from pyhvp.backends.julia import (
    INSTALL_HELP,
    JULIACALL_DEFAULTS,
    JuliaBackendError,
    julia_available,
)
from pyhvp.check_julia import (
    CASES,
    EXIT_FAILED,
    EXIT_JULIA_CANNOT_START,
    EXIT_OK,
    Case,
    Row,
    child_env,
    format_row,
    gaussian,
    main,
    run_checks,
    supervise,
)
from pyhvp.hvp import grad_and_hvp


@pytest.mark.skipif(julia_available(), reason="Julia can start here: the check runs for real")
def test_without_julia_the_check_says_why_and_exits_with_the_skip_code():
    done = subprocess.run(
        [sys.executable, "-m", "pyhvp.check_julia"], capture_output=True, text=True, timeout=120
    )
    said = [line for line in done.stdout.splitlines() if line.startswith("Julia cannot start: ")]
    assert (done.returncode, len(said)) == (EXIT_JULIA_CANNOT_START, 1), done.stdout + done.stderr


@pytest.mark.skipif(julia_available(), reason="Julia can start here: the check runs for real")
def test_without_julia_the_check_says_how_to_install_once_and_warns_of_nothing():
    """It printed the install paragraph twice, and juliacall's warning that torch was imported
    before it (the check's own order, which the julia guide tells users to avoid)."""
    done = subprocess.run(
        [sys.executable, "-m", "pyhvp.check_julia"], capture_output=True, text=True, timeout=120
    )
    output = done.stdout + done.stderr
    assert (output.count(INSTALL_HELP), "Warning" in output) == (1, False), output


@pytest.mark.slow
@pytest.mark.skipif(not julia_available(), reason="Julia cannot start here")
def test_where_julia_starts_every_run_agrees_with_torch():
    done = subprocess.run(
        [sys.executable, "-m", "pyhvp.check_julia"], capture_output=True, text=True, timeout=3600
    )
    assert done.returncode == EXIT_OK, done.stdout + done.stderr


# ------------------------------------------------------------------ stand-in runners


class TorchRunner:
    """Agrees: the torch backend in the runs' own dtype and device."""

    def grad_and_hvp(self, x, v, mu, event_dims):
        return grad_and_hvp(
            lambda y, m: gaussian(y, m, event_dims), x, v, mu, event_dims=event_dims
        )

    def versions(self):
        return {"Julia": "0.0-stand-in"}


class OffRunner(TorchRunner):
    """Disagrees: every HVP off by 1% of its largest entry."""

    def grad_and_hvp(self, x, v, mu, event_dims):
        g, hv = super().grad_and_hvp(x, v, mu, event_dims)
        return g, hv + 0.01 * hv.abs().max()


class RaisingRunner(TorchRunner):
    """Raises as a failing Julia call does."""

    def grad_and_hvp(self, x, v, mu, event_dims):
        raise JuliaBackendError("julia backend: grad_and_hvp failed in Julia:\nMethodError: boom")


class NoVersionsRunner(TorchRunner):
    def versions(self):
        raise JuliaBackendError("julia backend: reading versions failed in Julia")


RUNNERS = [  # name: (runner, exit code, verdict)
    ("agrees", TorchRunner(), EXIT_OK, "verdict: PASS -- julia agrees with torch in all 14 runs"),
    (
        "disagrees",
        OffRunner(),
        EXIT_FAILED,
        "verdict: FAIL -- 14 of 14 runs disagree with torch or raised. Please paste this whole "
        "output into a pyhvp bug report.",
    ),
    (
        "raises",
        RaisingRunner(),
        EXIT_FAILED,
        "verdict: FAIL -- 14 of 14 runs disagree with torch or raised. Please paste this whole "
        "output into a pyhvp bug report.",
    ),
    (
        "cannot-read-versions",
        NoVersionsRunner(),
        EXIT_FAILED,
        "verdict: FAIL -- reading the versions raised JuliaBackendError: julia backend: reading "
        "versions failed in Julia. Please paste this whole output into a pyhvp bug report.",
    ),
]


def report(runner, cases=CASES):
    lines = []
    code = run_checks(runner, cases, on=["cpu"], write=lambda text: lines.extend(text.split("\n")))
    return code, lines


@pytest.mark.parametrize(
    ("name", "runner", "code", "verdict"), RUNNERS, ids=[r[0] for r in RUNNERS]
)
def test_exit_code_and_verdict_of_every_cpu_run_of_every_case(name, runner, code, verdict):
    got, lines = report(runner)
    assert (got, lines[-1]) == (code, verdict)


def test_the_table_has_one_row_per_case_and_dtype_then_the_versions():
    _, lines = report(TorchRunner())
    rows = [line for line in lines[3:] if line.endswith("  ok")]
    versions = lines[3 + len(rows)]
    assert [row[:32].rstrip() for row in rows] == [c.name for c in CASES for _ in range(2)] and (
        versions.startswith("versions: Julia 0.0-stand-in, juliacall ")
        and versions.endswith(f", torch {torch.__version__}")
    )


def test_a_raising_run_is_an_error_row_and_its_message_follows_the_table():
    _, lines = report(RaisingRunner(), CASES[:1])
    assert lines[3].endswith("  ERROR") and lines[5:8] == [
        f"ERROR in {CASES[0].name}, float32, cpu:",
        "JuliaBackendError: julia backend: grad_and_hvp failed in Julia:",
        "MethodError: boom",
    ]


ROWS = [  # name: (row, its line)
    (
        "ok",
        Row(Case("seed000", (1, 3), (3,), None), torch.float32, "cuda:0", 3.2e-7, 41.234, 0.00052),
        "seed000                          float32  cuda:0    3.2e-07  1e-04     41.23s      0.52ms  ok",
    ),
    (
        "mismatch",
        Row(Case("seed000", (1, 3), (3,), None), torch.float64, "cpu", 2e-3, 1.5, 0.001),
        "seed000                          float64  cpu       2.0e-03  1e-10      1.50s      1.00ms  MISMATCH",
    ),
    (
        "error",
        Row(Case("seed000", (1, 3), (3,), None), torch.float64, "cpu", raised="TypeError: x"),
        "seed000                          float64  cpu             -  1e-10          -           -  ERROR",
    ),
]


@pytest.mark.parametrize(("name", "row", "line"), ROWS, ids=[r[0] for r in ROWS])
def test_row_format(name, row, line):
    assert format_row(row) == line


# ------------------------------------------------------------------ never downloads, never hangs

ENVIRONMENTS = [  # name: (environment, allow_download, what the checking process gets)
    ("offline-by-default", {}, False, {"PYTHON_JULIAPKG_OFFLINE": "yes"}),
    (
        "autoinstall-overridden",
        {"PYHVP_JULIA_AUTOINSTALL": "yes"},
        False,
        {"PYTHON_JULIAPKG_OFFLINE": "yes"},
    ),
    ("allowed", {"PYTHON_JULIAPKG_OFFLINE": "yes"}, True, {"PYHVP_JULIA_AUTOINSTALL": "yes"}),
]


@pytest.mark.parametrize(
    ("name", "env", "allow", "child"), ENVIRONMENTS, ids=[e[0] for e in ENVIRONMENTS]
)
def test_julia_starts_offline_unless_downloads_are_allowed(name, env, allow, child):
    expected = {**JULIACALL_DEFAULTS, "HOME": "/home/u", **child}
    assert child_env({"HOME": "/home/u", **env}, allow) == expected


PROCESSES = [  # name: (Python code of the checking process, exit code, last line printed)
    ("passes-on-skip", "raise SystemExit(3)", EXIT_JULIA_CANNOT_START, None),
    ("hangs", "import time; time.sleep(60)", EXIT_FAILED, "check_julia: stopped after 2 s"),
    (
        "crashes",
        "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
        EXIT_FAILED,
        "check_julia: the checking process crashed (SIGKILL)",
    ),
    (
        "odd-exit-code",
        "raise SystemExit(7)",
        EXIT_FAILED,
        "check_julia: the checking process exited with code 7",
    ),
]


@pytest.mark.parametrize(
    ("name", "code", "exit_code", "says"), PROCESSES, ids=[p[0] for p in PROCESSES]
)
def test_supervise_passes_on_the_checks_codes_and_stops_what_hangs(
    name, code, exit_code, says, capsys
):
    got = supervise([sys.executable, "-c", code], {}, timeout_s=2)
    printed = capsys.readouterr().out.strip()
    assert (got, printed.startswith(says) if says else printed == "") == (exit_code, True)


def running(pid):
    """Whether process ``pid`` still runs (an exited one is gone, or a zombie its new parent
    has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def stops(pid, within_s=10.0):
    """Whether process ``pid`` is gone within ``within_s`` seconds: a SIGKILL is delivered
    when the process next runs, which on a loaded machine is not at once."""
    deadline = time.monotonic() + within_s
    while running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def hanging_check(pid_file):
    """A check's code that starts a hanging "Julia" (its pid written to ``pid_file``), then
    hangs itself."""
    return (
        "import subprocess, sys, time\n"
        "julia = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(julia.pid))\n"
        "time.sleep(60)\n"
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_hanging_check_is_stopped_with_the_processes_it_started(tmp_path, capsys):
    """juliapkg runs Julia in processes of its own (``julia --version`` hung with a broken
    Julia): until 2026-12-06 they outlived the timeout that stopped the checking process."""
    pid_file = tmp_path / "pid"
    code = hanging_check(pid_file)
    assert supervise([sys.executable, "-c", code], {}, timeout_s=5) == EXIT_FAILED
    assert stops(int(pid_file.read_text()))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_check_stopped_by_its_process_groups_sigterm_stops_the_processes_it_started(tmp_path):
    """A cancelled CI job or a closed terminal signals the check's process group, which the
    checking process left for a session of its own (for its timeout to kill whole): until
    2026-12-06 the checking process and the Julia it started outlived such a SIGTERM, with no
    timeout left to stop them."""
    pid_file = tmp_path / "pid"
    code = hanging_check(pid_file)
    check = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pyhvp.check_julia import supervise; "
         "sys.exit(supervise([sys.executable, '-c', sys.argv[1]], {}, 60))", code],
        start_new_session=True,  # (a group of its own, as a job's)
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(check.pid, signal.SIGTERM)
    assert check.wait(timeout=30) == 128 + signal.SIGTERM
    julia = int(pid_file.read_text())
    try:
        assert stops(julia)
    finally:
        if running(julia):
            os.kill(julia, signal.SIGKILL)


@pytest.mark.parametrize("timeout", ["-5", "0", "nan", "soon"])
def test_a_timeout_that_is_no_number_of_seconds_is_a_bad_argument(timeout, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--timeout", timeout])
    assert exited.value.code == 2 and "--timeout" in capsys.readouterr().err
