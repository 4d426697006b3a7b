"""The installed package holds every subpackage of the source tree (a non-editable install only copies
what pyproject.toml lists: a forgotten subpackage imports in the editable checkout and fails for users)."""

import tomllib
from pathlib import Path, PurePosixPath

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


def test_every_shipped_asset_is_package_data():
  """Every file under specjax/assets (model pairs, their heads, heads for GGUF short names) matches a
  package-data pattern: an unmatched file is silently missing from the wheel."""
  setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
  patterns = setup["package-data"]["specjax"]
  package = ROOT / setup["package-dir"]["specjax"]
  assets = [p for p in (package / "assets").rglob("*") if p.is_file()]
  assert assets, "the bundled pair ships under specjax/assets"
  def matches(rel: PurePosixPath, pattern: str) -> bool:  # setuptools' glob: `*` stays inside one folder
    return len(rel.parts) == len(PurePosixPath(pattern).parts) and rel.match(pattern)

  missed = [str(p.relative_to(package)) for p in assets
            if not any(matches(PurePosixPath(p.relative_to(package).as_posix()), pattern) for pattern in patterns)]
  assert not missed, f"not matched by [tool.setuptools.package-data] specjax: {missed}"
