"""Install lines that work from a clone (issue 34, item 2): the name `autopar` on PyPI is not ours, so no doc
or message tells a user to `pip install autopar`; each extra an install line names exists in pyproject.toml;
the distribution's name is written there only."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _texts() -> dict[str, str]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "autopar").rglob("*.py"))]
    return {str(p.relative_to(ROOT)): p.read_text() for p in files}


def test_no_install_line_names_a_registry_package_called_autopar():
    registry = re.compile(r"""pip install\s+(-U\s+|--upgrade\s+)?["']?autopar\b""")
    found = [f"{path}: {m.group(0)}" for path, text in _texts().items() for m in registry.finditer(text)]
    assert not found, found


def test_every_extra_in_an_install_line_exists():
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    named = {(path, m.group(1)) for path, text in _texts().items()
             for m in re.finditer(r"""pip install -e ["']?\.\[(\w+)\]""", text)}
    assert {extra for _, extra in named} >= {"hf", "lightning", "report"}
    assert all(extra in extras for _, extra in named), sorted(named)


def test_the_distribution_name_is_written_in_pyproject_only():
    name = PYPROJECT["project"]["name"]
    assert re.search(rf'^name = "{name}"$', (ROOT / "pyproject.toml").read_text(), re.M)
    # nothing reads the distribution by its name: the version is found through the import package
    spelt = [path for path, text in _texts().items() if re.search(r"""metadata\.(version|distribution)\(["']""", text)]
    assert not spelt, spelt


def test_the_readme_set_up_commands_pin_torch_first():
    readme = (ROOT / "README.md").read_text()
    lines = [line for line in readme.splitlines() if line.startswith("pip install")]
    assert lines and all(line.startswith("pip install torch==2.13.0 && pip install -e ") for line in lines), lines
    install = (ROOT / "docs" / "install.md").read_text()
    assert all(line.startswith("pip install torch==2.13.0 && pip install -e ")
               for line in install.splitlines() if line.startswith("pip install torch"))
