"""The built wheel ships the bundled Julia package where pyhvp/juliapkg.json says it is."""

import json
import posixpath
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=600,
    )
    (wheel,) = out.glob("pyhvp-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist()), json.loads(zf.read("pyhvp/juliapkg.json"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "member",
    ["pyhvp/juliapkg.json", "pyhvp/julia/Project.toml", "pyhvp/julia/src/PyHVP.jl"],
)
def test_wheel_contains(wheel_names, member):
    names, _ = wheel_names
    assert member in names


@pytest.mark.slow
def test_juliapkg_path_points_at_the_shipped_package(wheel_names):
    names, spec = wheel_names
    bundled = spec["packages"]["PyHVP"]
    project = posixpath.normpath(posixpath.join("pyhvp", bundled["path"], "Project.toml"))
    assert project in names


def test_source_tree_resolves_the_bundled_package_for_editable_installs():
    """pyhvp/julia is a link to the top-level julia/, so juliapkg finds it without a wheel."""
    spec = json.loads((ROOT / "pyhvp" / "juliapkg.json").read_text())
    bundled = spec["packages"]["PyHVP"]
    project = (ROOT / "pyhvp" / bundled["path"] / "Project.toml").read_text()
    assert f'uuid = "{bundled["uuid"]}"' in project
