"""The built wheel ships pyhvp/juliapkg.json and the bundled Julia package the julia backend
``include``s, every file of it."""

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pyhvp.backends.julia import BUNDLED_PACKAGE

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = ROOT / "pyhvp"


def bundled_sources() -> list[str]:
    """The wheel paths of the bundled package's main file and of every file it includes."""
    main = BUNDLED_PACKAGE.relative_to(PACKAGE_DIR.resolve())
    included = re.findall(r'^include\("([^"]+)"\)', BUNDLED_PACKAGE.read_text(), re.MULTILINE)
    return [f"pyhvp/{main.parent / name}" for name in [main.name, *included]]


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
        return set(zf.namelist())


@pytest.mark.slow
@pytest.mark.parametrize("member", ["pyhvp/juliapkg.json", "pyhvp/julia/Project.toml"])
def test_wheel_contains(wheel_names, member):
    assert member in wheel_names


@pytest.mark.slow
def test_wheel_ships_every_file_of_the_bundled_package(wheel_names):
    assert [path for path in bundled_sources() if path not in wheel_names] == []


def test_source_tree_has_the_bundled_package_for_editable_installs():
    """pyhvp/julia is a link to the top-level julia/, so the backend finds it without a wheel."""
    assert len(bundled_sources()) > 1
    assert [p for p in bundled_sources() if not (ROOT / p).is_file()] == []
