"""The docs stay true (issue 34, item 6): the code blocks of README.md and of the docs listed in RUN are run, in
order, one folder per file. A block that cannot run here is skipped only by a marker on the line before it that
says why (`<!-- not run: REASON -->`); `<!-- file: NAME -->` before a block writes it to NAME for the blocks
after it to use; `<!-- with: NAME -->` before a fragment (a block that uses names a script of yours defines:
`model`, `sample`, ...) runs tests/docs_context/NAME.py first, which defines them at tiny sizes. A Python block
whose first line is `# NAME.py: COMMAND` is a script: written to NAME.py and run by COMMAND. Python blocks of one file share one namespace (as a reader runs them one after the other); a
shell block's lines run one by one: `autopar ...` in this process (autopar.cli.main, exit status 0),
`python ...` and `torchrun ...` as processes. Anything else in a block is a failure: mark it or teach the runner.

The docs not in RUN are in NOT_YET with the reason; every doc is in one of the two, so a new page picks."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from autopar.cli import main as autopar_main

ROOT = Path(__file__).resolve().parents[1]
RUN = ["README.md", "docs/first_hour.md", "docs/install.md", "docs/cli.md", "docs/plan.md", "docs/topology.md",
       "docs/strategies/checkpointing.md", "docs/strategies/precision.md"]
NOT_YET = {  # run by hand; their blocks are fragments of a larger job, or need GPUs, a cluster or minutes
    "docs/architecture.md": "no code blocks", "docs/reliability.md": "no code blocks",
    "docs/strategies.md": "no code blocks", "docs/strategies/float8.md": "no code blocks (float8 needs torchao)",
}
# Run one test each (pytest-xdist spreads them): pages whose scripts start processes, or take seconds
RUN_EACH = ["docs/checkpoints.md", "docs/cost_model.md", "docs/data.md", "docs/train_step.md", "docs/profile.md",
            "docs/strategies/README.md", "docs/strategies/compile.md", "docs/strategies/fsdp.md",
            "docs/strategies/pipeline.md", "docs/strategies/tensor_parallel.md", "docs/wrap.md",
            "docs/integrations/hf.md", "docs/integrations/lightning.md", "docs/tuning.md"]
RUNNABLE = {"python", "bash", "sh", "shell"}
FENCE = re.compile(r"^```(\w*)\s*$")
TEARDOWN_ABORT = "terminate called without an active exception"  # a gloo rank's abort at exit (_run_shell_line)
ENV_ASSIGN = re.compile(r"^[A-Z_][A-Z0-9_]*=")
# A script block: its first line names its file and the command that runs it, `# NAME.py: COMMAND   (a note)`
SCRIPT = re.compile(r"^#\s*([\w-]+\.py):\s*(.+?)\s*(\(.*\))?\s*$")
MARK = re.compile(r"^<!--\s*(not run|file|with):\s*(.+?)\s*-->$")
CONTEXT = ROOT / "tests" / "docs_context"  # `<!-- with: NAME -->`: tests/docs_context/NAME.py runs first


@dataclass
class Block:
    path: str
    line: int
    lang: str
    code: str
    mark: tuple[str, str] | None  # ("not run", reason) or ("file", name)


def blocks(path: str) -> list[Block]:
    lines = (ROOT / path).read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m and m.group(1):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            mark = MARK.match(prev)
            out.append(Block(path, i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n",
                             (mark.group(1), mark.group(2)) if mark else None))
            i = end
        i += 1
    return [b for b in out if b.lang in RUNNABLE]


def _run_shell_line(line: str, where: str, cwd: Path) -> None:
    argv = shlex.split(line, comments=True)
    assigned = {}
    while argv and ENV_ASSIGN.match(argv[0]):  # `OMP_NUM_THREADS=1 python ...`: the variables for that command
        name, value = argv.pop(0).split("=", 1)
        assigned[name] = value
    if not argv:
        return
    if argv[0] == "autopar":
        assert not assigned, f"{where}: `{line}`: variables for an autopar command are not supported here"
        with contextlib.chdir(cwd):
            try:
                code = autopar_main(argv[1:])
            except SystemExit as exc:
                code = exc.code
        assert code == 0, f"{where}: `{line}` exited {code}"
        return
    if argv[0] in ("python", "torchrun"):
        cmd = [sys.executable, *argv[1:]] if argv[0] == "python" else [sys.executable, "-m", "torch.distributed.run",
                                                                      *argv[1:]]
        env = {**os.environ, "OMP_NUM_THREADS": "1", **assigned}
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)
        if r.returncode != 0 and TEARDOWN_ABORT in r.stderr:
            # A gloo rank can abort after the script's last line, in its own teardown (issue 34: the demo works
            # around it with os._exit; a user script can still meet it): run it once more, and fail on a second
            # abort or any other failure.
            r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, f"{where}: `{line}` exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        return
    raise AssertionError(f"{where}: the doc runner does not run `{argv[0]}`: mark the block "
                         "<!-- not run: REASON --> or teach tests/test_docs.py")


def run_doc(path: str, cwd: Path) -> tuple[int, int]:
    """Run `path`'s blocks in `cwd`; (blocks run, blocks marked not run)."""
    ran = skipped = 0
    namespace: dict = {"__name__": "__doc_block__"}
    for b in blocks(path):
        where = f"{path}:{b.line}"
        if b.mark is not None and b.mark[0] == "not run":
            skipped += 1
            continue
        if b.mark is not None and b.mark[0] == "file":
            (cwd / b.mark[1]).write_text(b.code)
            ran += 1  # written, and run by the block that names it
            continue
        if b.mark is not None and b.mark[0] == "with":  # a fragment: the names it uses, defined first
            context = CONTEXT / f"{b.mark[1]}.py"
            with contextlib.chdir(cwd):
                exec(compile(context.read_text(), str(context), "exec"), namespace)
        script = SCRIPT.match(b.code.splitlines()[0]) if b.lang == "python" and b.code.strip() else None
        if script is not None:  # written to its file, then run by the command its first line gives
            (cwd / script.group(1)).write_text(b.code)
            _run_shell_line(script.group(2), where, cwd)
        elif b.lang == "python":
            with contextlib.chdir(cwd):
                exec(compile(b.code, where, "exec"), namespace)
        else:
            for line in b.code.splitlines():
                _run_shell_line(line, where, cwd)
        ran += 1
    return ran, skipped


def test_every_doc_is_run_or_says_why_not():
    docs = {str(p.relative_to(ROOT)) for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]}
    run = set(RUN) | set(RUN_EACH)
    assert docs == run | set(NOT_YET), (sorted(docs - run - set(NOT_YET)), sorted(set(NOT_YET) - docs))
    assert not set(RUN) & set(NOT_YET) and not set(RUN_EACH) & (set(RUN) | set(NOT_YET))


def test_a_skipped_block_says_why():
    for path in RUN + RUN_EACH:
        for b in blocks(path):
            if b.mark is not None:
                assert b.mark[1].strip(), f"{path}:{b.line}: a marker needs its reason"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_runnable_blocks_run(tmp_path):
    ran = {}
    for path in RUN:
        cwd = tmp_path / path.replace("/", "_")
        cwd.mkdir()
        ran[path] = run_doc(path, cwd)
    total = sum(r for r, _ in ran.values())
    assert ran["docs/first_hour.md"] == (7, 1), ran  # every block but the install (the tests run in what it makes)
    assert total >= 20, ran


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("path", RUN_EACH)
def test_the_blocks_of_a_page_run(path, tmp_path):
    ran, skipped = run_doc(path, tmp_path)
    assert ran > 0 and ran >= 4 * skipped, (ran, skipped)  # most of the page runs


def test_a_fragment_runs_after_its_context_and_a_script_by_its_command(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- with: gpt -->\n```python\nseen = (type(model).__name__, tuple(sample.shape))\n```\n"
                    "```python\n# hello.py: OMP_NUM_THREADS=1 python hello.py   (one process)\n"
                    "open('said.txt', 'w').write('hi')\n```\n")
    ran, skipped = run_doc(str(page), tmp_path)
    assert (ran, skipped) == (2, 0) and (tmp_path / "said.txt").read_text() == "hi"


def test_the_runner_fails_an_unknown_command_and_a_failing_command(tmp_path):
    with pytest.raises(AssertionError, match="does not run `make`"):
        _run_shell_line("make all", "x.md:1", tmp_path)
    with pytest.raises(AssertionError, match="exited 2"):
        _run_shell_line("autopar plna gpt2", "x.md:1", tmp_path)
