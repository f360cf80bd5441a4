"""`autopar demo`'s arguments (issue 34, item 3): a bad number or plan file is refused with one line and exit
status 2 before any process starts or any banner is printed."""

from __future__ import annotations

import pytest

import autopar.demo as demo


@pytest.fixture
def no_run(monkeypatch):
    """The demo must not start: neither torchrun nor the in-process rank."""
    def started(*args, **kwargs):
        raise AssertionError("the demo started")

    monkeypatch.setattr(demo, "_launch", started)
    monkeypatch.setattr(demo, "_rank_main", started)
    monkeypatch.delenv("LOCAL_RANK", raising=False)


def _refused(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        demo.main(argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == "", out
    assert err.count("\n") == 1 and err.startswith("autopar demo: error: "), err
    return err


@pytest.mark.parametrize("argv, says", [
    (["--batch", "0"], "argument --batch: must be at least 1, got 0 (samples per process)"),
    (["--batch", "-3"], "argument --batch: must be at least 1, got -3"),
    (["--batch", "eight"], "argument --batch: must be a whole number, got 'eight'"),
    (["--steps", "0"], "argument --steps: must be at least 1, got 0"),
    (["--nproc", "-1"], "argument --nproc: must be at least 1, got -1; leave it out for the default"),
])
def test_numbers_below_1_are_refused_in_one_line(capsys, no_run, argv, says):
    assert says in _refused(capsys, argv)


@pytest.mark.parametrize("nproc", [["--nproc", "1"], []])
@pytest.mark.parametrize("content, says", [
    ("foo: [\n", "is not a plain YAML plan file"),
    ("", "a plan must be a mapping"),
    (None, "no plan file at"),
])
def test_a_bad_plan_file_is_one_line_before_any_process_or_banner(capsys, no_run, tmp_path, nproc, content, says):
    path = tmp_path / "plan.yaml"
    if content is not None:
        path.write_text(content)
    err = _refused(capsys, ["--steps", "1", "--plan", str(path), *nproc])
    assert f"--plan {path}: " in err and says in err


def test_a_plan_for_another_number_of_processes_is_refused_before_the_launch(capsys, no_run, tmp_path):
    from autopar.plans import Plan

    path = Plan(dp_shard=4).save(tmp_path / "four.yaml")
    err = _refused(capsys, ["--plan", str(path), "--nproc", "2"])
    assert "= 4 processes, but this job has 2" in err
