"""The architecture holds: the layers of docs/architecture.md (the import-linter contract in pyproject.toml),
no module over 600 lines, and autopar's own modules imported at the top of files only.

The contract is checked by `lint-imports` as .ci/run runs it, on the package and on a copy with one
deliberate back-edge, to show that it would catch one; and .ci/run runs it (the README's test command).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "autopar"
MAX_LINES = 600
# In-function imports of autopar's own modules that are allowed, as (file under autopar/, module imported):
# none today. An entry needs a one-line reason (an import that would make a circle is not one: move the
# code to its layer instead).
IN_FUNCTION_IMPORTS_ALLOWED: set[tuple[str, str]] = set()
# `lint-imports`, run by the interpreter that runs the tests (the console script may not be on PATH)
LINT_IMPORTS = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                "sys.exit(lint_imports_command())", "--no-cache", "--no-logo"]


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    """lint-imports on the package in `cwd`, with the contract of `cwd`/pyproject.toml."""
    return subprocess.run([*LINT_IMPORTS, "pyproject.toml"], cwd=cwd, capture_output=True, text=True, timeout=300)


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_layers_contract_holds():
    proc = _lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "Contracts: 1 kept, 0 broken." in proc.stdout


def test_the_layers_contract_fails_on_a_back_edge(tmp_path):
    """A copy of the package where plans.py (layer 1) imports api (layer 4): lint-imports fails and names it."""
    shutil.copytree(PACKAGE, tmp_path / "autopar", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    low = tmp_path / "autopar" / "plans.py"
    lines = low.read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith("from __future__")) + 1
    lines.insert(at, "from autopar import api  # a deliberate back-edge\n")
    low.write_text("".join(lines))
    proc = _lint_imports(tmp_path)
    assert proc.returncode != 0
    assert "BROKEN" in proc.stdout and "autopar.plans -> autopar.api" in proc.stdout, proc.stdout[-6000:]


def test_no_module_is_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def _own_module(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The autopar modules an import statement names (relative imports are always autopar's own)."""
    if isinstance(node, ast.ImportFrom):
        if node.level or (node.module or "").split(".")[0] == "autopar":
            return ["." * node.level + (node.module or "")]
        return []
    return [alias.name for alias in node.names if alias.name.split(".")[0] == "autopar"]


def _in_function_imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for fn in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    found += [(node.lineno, name) for name in _own_module(node)]
    return sorted(set(found))


def test_autopar_modules_are_imported_at_the_top_of_files_only():
    found = [f"{p.relative_to(ROOT)}:{line} imports {name}" for p in _modules()
             for line, name in _in_function_imports(p)
             if (str(p.relative_to(PACKAGE)), name) not in IN_FUNCTION_IMPORTS_ALLOWED]
    assert not found, "imports of autopar's own modules inside functions:\n" + "\n".join(found)


def test_the_import_check_sees_in_function_imports(tmp_path):
    """The AST walk above finds relative and absolute in-function imports, and not top-level or third-party ones."""
    path = tmp_path / "m.py"
    path.write_text("from . import plans\nimport torch\n\ndef f():\n    from .cost import time\n    import autopar.api\n"
                    "    import yaml\n\nclass C:\n    def g(self):\n        from autopar import errors\n")
    assert _in_function_imports(path) == [(5, ".cost"), (6, "autopar.api"), (11, "autopar")]


def test_ci_runs_the_readme_test_command_with_the_contract_first():
    readme = (ROOT / "README.md").read_text().splitlines()
    command = next(line for line in readme if line.startswith("pip install") and "pytest" in line)
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == command
    assert command.index("lint-imports") < command.index("pytest")
