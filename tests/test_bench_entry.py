"""`python -m bench`, the benchmarks' one entry point (bench/__main__.py): it lists every runnable module of bench/
as a suite, refuses an unknown suite in one line, hands a suite its own flags (its --help, its arguments, its
exit code) and prints the run's stamp (bench._common.stamp) first."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

from bench.__main__ import SUITES
from bench._common import stamp

ROOT = Path(__file__).resolve().parents[1]


def _bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _runnable_modules() -> set[str]:
    """bench/*.py with a command line (`if __name__ == "__main__":`), bench/__main__.py itself left out."""
    found = set()
    for path in (ROOT / "bench").glob("*.py"):
        if path.name == "__main__.py":
            continue
        tree = ast.parse(path.read_text())
        if any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body):
            found.add(f"bench.{path.stem}")
    return found


def test_list_names_every_runnable_module_of_bench_as_a_suite_and_exits_0():
    assert set(SUITES.values()) == _runnable_modules()
    done = _bench("--list")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines] == list(SUITES)
    for line, (name, module) in zip(lines, SUITES.items()):
        assert line.split()[1] == module
        assert len(line.split(None, 2)[2]) > 10  # the module's docstring, not a placeholder
        assert "(no docstring)" not in line and "(module not found)" not in line


def test_unknown_suite_exits_2_with_one_line_naming_the_choices():
    done = _bench("nosuchsuite")
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "'nosuchsuite'" in lines[0]
    named = re.split(r",\s*", lines[0].split("choose one of:")[1].strip())
    assert named == list(SUITES)


def test_suite_help_is_the_suites_own_help():
    done = _bench("zoo", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m bench.zoo_h200 ")  # zoo_h200's own parser
    assert "--time-budget-s" in done.stdout and "--resume" in done.stdout
    assert "# bench stamp" not in done.stderr  # help is not a run


def test_a_run_prints_the_stamp_first_then_the_suite_runs_with_its_arguments_and_exit_code():
    # exact_vs_analytic prints its header (with the arguments it was given), then fails on the unknown plan
    done = _bench("exact", "no-such-plan")
    assert done.returncode == 1
    first = done.stderr.splitlines()[0]
    assert first.startswith("# bench stamp ")
    line = json.loads(first[len("# bench stamp "):])
    assert line["command"] == "python -m bench exact no-such-plan"
    assert line["suite"] == "exact (bench.exact_vs_analytic)"
    assert re.fullmatch(r"[0-9a-f]{40}", line["commit"])
    assert done.stdout.splitlines()[1] == "# python -m bench.exact_vs_analytic no-such-plan"
    assert "KeyError: 'no-such-plan'" in done.stderr


def test_stamp_has_date_device_torch_transformers_command_and_commit(tmp_path):
    import torch

    def head() -> str:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    before = head()
    got = stamp(command="python -m bench zoo --size tiny")
    after = head()  # others may commit meanwhile
    assert set(got) == {"date", "device", "torch", "transformers", "command", "commit", "source"}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", got["date"])
    assert got["device"].startswith("cpu (")  # the tests see no GPU (tests/conftest.py)
    assert got["torch"] == torch.__version__
    assert got["command"] == "python -m bench zoo --size tiny"
    assert got["commit"] in (before, after) and re.fullmatch(r"[0-9a-f]{40}", got["commit"])
    assert stamp(root=tmp_path)["commit"] == "unknown"  # outside a checkout
    # the code's digest: the same for the same files, another for any change, where the commit cannot tell
    assert re.fullmatch(r"[0-9a-f]{16}", got["source"]) and stamp(root=tmp_path)["source"] == "unknown"
    copy = tmp_path / "copy"
    for folder in ("autopar", "bench"):
        for f in (ROOT / folder).rglob("*.py"):
            (copy / f.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
            (copy / f.relative_to(ROOT)).write_bytes(f.read_bytes())
    assert stamp(root=copy)["source"] == got["source"]
    (copy / "bench" / "_common.py").write_text((copy / "bench" / "_common.py").read_text() + "\n")
    assert stamp(root=copy)["source"] != got["source"]
