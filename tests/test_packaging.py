"""The installed package holds every subpackage of the source tree (a non-editable install only copies
what pyproject.toml lists: a forgotten subpackage imports in the editable checkout and fails for users)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, dirs = set(setup["packages"]), setup["package-dir"]
    found = set()
    for name, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *rel)))
    assert found, "no packages found: is package-dir right?"
    assert found <= listed, f"subpackages missing from [tool.setuptools] packages: {sorted(found - listed)}"
