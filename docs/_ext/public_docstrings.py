"""Every public name has a docstring and a page: a Sphinx extension that warns otherwise.

Public names are ``pyhvp.__all__``; a public class's public methods and properties count too.
Under ``-W`` (``make docs``) each warning fails the build. After reading the sources, every name
must also be documented in the API reference (an entry in the Python domain).
"""

from __future__ import annotations

import inspect

from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.util import logging

import pyhvp

logger = logging.getLogger(__name__)


def missing_docstrings() -> list[str]:
    """Qualified names among pyhvp's public names (and their classes' public members) with no
    docstring of their own."""
    missing = []
    for name in pyhvp.__all__:
        obj = getattr(pyhvp, name)
        if not (inspect.getdoc(obj) or "").strip():
            missing.append(f"pyhvp.{name}")
        if inspect.isclass(obj):
            for member, value in vars(obj).items():
                public = not member.startswith("_")
                if not public or not (callable(value) or isinstance(value, property)):
                    continue
                if not (getattr(value, "__doc__", None) or "").strip():
                    missing.append(f"pyhvp.{name}.{member}")
    return missing


def check_docstrings(app: Sphinx) -> None:
    for name in missing_docstrings():
        logger.warning("public name without a docstring: %s", name)


def check_reference(app: Sphinx, env: BuildEnvironment) -> None:
    documented = env.get_domain("py").objects  # type: ignore[attr-defined]
    for name in pyhvp.__all__:
        if f"pyhvp.{name}" not in documented:
            logger.warning("public name missing from the API reference: pyhvp.%s", name)


def setup(app: Sphinx) -> dict[str, object]:
    app.connect("builder-inited", check_docstrings)
    app.connect("env-check-consistency", check_reference)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
