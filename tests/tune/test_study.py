"""The tuning study (autopar/tune/study.py), the report (report.py) and `autopar tune` / `autopar report`.

Most tests drive the study with a fake trial runner: its "measured" step is the cost model's prediction (at
the calibration a study starts from) times a factor per plan, and it can fail chosen plans with "oom". The
probe is the tiny GPT's real profile on 2 CPU processes. Two tests run real subprocesses (torchrun, 2 ranks,
gloo): a study of 6 trials, and a tuner killed with SIGKILL mid-study and started again.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import io
import math
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import types
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from autopar.calibration_cache import load_calibration, load_refit
from autopar.cost import predict_profile
from autopar.errors import AutoparError
from autopar.models.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens
from autopar.planning import calibration_for, profile_variants, short_name
from autopar.plans import Plan
from autopar.search import search
from autopar.topology import Topology
from autopar import plan_cache as cache
from autopar.tune.space import Space
from autopar.tune.study import STALE_CAUSE, Progress, autotune, measure_in_process, tune
from autopar.tune.report import STUDY_SPACE, load_report, report_from_study
from autopar.tune import TrialResult
from tests._ports import torchrun_argv

ROOT = Path(__file__).resolve().parents[2]
CFG = GPTConfig(vocab_size=128, seq_len=32, num_layers=4, hidden_dim=64, num_heads=4)
GLOBAL = 8
WORLD = 2
NO_PRUNING = math.inf


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Every test has its own cache: the calibration a study starts from is the CPU default, and the fitted
    calibration and the best plan land in tmp_path."""
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture(scope="module")
def probe_result():
    topo = Topology.cpu(WORLD)
    profile, variants = profile_variants(GPT(CFG), synthetic_tokens(GLOBAL // WORLD, CFG), topo, loss_fn=lm_loss)
    return types.SimpleNamespace(profile=profile, variants=variants, topology=topo, world_size=WORLD,
                                 global_batch_size=GLOBAL, model_fingerprint=profile.fingerprint)


def _feasible(probe_result, loop="train_step") -> list:
    ranked = search(probe_result.profile, probe_result.topology, world_size=WORLD, global_batch_size=GLOBAL,
                    variants=probe_result.variants, calibration=calibration_for(probe_result.topology),
                    loop=loop)
    return ranked


class FakeRunner:
    """Measures a plan as its predicted step (at the starting calibration, changed by `truth`) times
    `factor(plan)`; fails the plans `fail(plan)` says with "oom". Records every plan it ran."""

    def __init__(self, probe_result, factor=lambda plan: 1.4, fail=lambda plan: False, **truth):
        self.probe = probe_result
        self.base = calibration_for(probe_result.topology)  # called inside a test: the CPU defaults
        self.base = self.base.replace(**truth)  # the hardware as it really is, when `truth` changes factors
        self.factor, self.fail = factor, fail
        self.ran: list[str] = []

    def true_step(self, plan: Plan) -> float:
        p = self.probe
        step = predict_profile(p.profile, plan, p.topology, self.base, variants=p.variants).time.step_s
        return step * self.factor(plan)

    def __call__(self, argv, plan, *, steps, warmup, timeout_s, env=None, workdir=None):
        assert argv == ["python", "train.py"] and steps == 3 and warmup == 1
        self.ran.append(plan.key())
        if self.fail(plan):
            return TrialResult(status="oom", plan=plan, step_s=None, tokens_per_s=None, samples_per_s=None,
                               peak_allocated_bytes=(), peak_reserved_bytes=(), wall_s=0.01,
                               cause="torch.OutOfMemoryError: CUDA out of memory (fake)", returncode=1, log_tail="...")
        step = self.true_step(plan)
        return TrialResult(status="ok", plan=plan, step_s=step, tokens_per_s=GLOBAL * CFG.seq_len / step,
                           samples_per_s=GLOBAL / step, peak_allocated_bytes=(1 << 20, 2 << 20),
                           peak_reserved_bytes=(3 << 20, 3 << 20), wall_s=0.01, cause=None, returncode=0, log_tail="")


def _tune(probe_result, runner, study, **kw):
    kw.setdefault("steps", 3)
    kw.setdefault("warmup", 1)
    return tune(["python", "train.py"], study_path=study, runner=runner, prober=lambda argv, **_: probe_result, **kw)


def _trials(study_path: Path) -> list:
    storage = optuna.storages.RDBStorage(f"sqlite:///{study_path}")
    return optuna.load_study(study_name="autopar", storage=storage).get_trials(deepcopy=False)


def _num_trials(study_path: Path, state: str) -> int:
    """Trials in `state` ("RUNNING", "COMPLETE") now."""
    return len(_numbers(study_path, state))


def _running_numbers(study_path: Path) -> list[int]:
    return _numbers(study_path, "RUNNING")


def _numbers(study_path: Path, state: str) -> list[int]:
    """The numbers of the trials in `state` now, read straight from the study's SQLite file (milliseconds, where
    loading the study through optuna takes seconds under load: a poll that slow misses a trial of a few
    seconds, or the whole study)."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{study_path}?mode=ro", uri=True, timeout=1.0)) as db:
            return [n for (n,) in db.execute("SELECT number FROM trials WHERE state = ?", (state,))]
    except sqlite3.Error:  # not made yet, or locked by the tuner's write
        return []


def _ran(trials) -> list:
    """Trials whose plan ran: measured ok or failed (not pruned, not stale, not repeats)."""
    return [t for t in trials if t.user_attrs.get("repeat_of") is None and t.user_attrs.get("status") in
            ("ok", "oom", "crash", "exit", "timeout")]


# ---- the space, the order, failures ---------------------------------------------------------------------
def test_space_is_the_feasible_candidates_and_best_predicted_run_first(probe_result, tmp_path):
    ranked = _feasible(probe_result)
    feasible = [c.plan.key() for c in ranked if c.feasible]
    dropped = {c.plan.key() for c in ranked if not c.feasible}
    assert len(feasible) >= 8 and dropped  # dominated plans are dropped by the search
    runner = FakeRunner(probe_result)
    events: list[Progress] = []
    report = _tune(probe_result, runner, tmp_path / "s.db", trials=4, top_k_enqueue=3, prune_factor=NO_PRUNING,
                   progress=events.append)
    # the space is exactly the search's feasible candidates, in predicted order; nothing else ever runs
    trials = _trials(tmp_path / "s.db")
    study = optuna.load_study(study_name="autopar", storage=f"sqlite:///{tmp_path / 's.db'}")
    assert [e["key"] for e in study.user_attrs[STUDY_SPACE]] == feasible
    assert set(runner.ran) <= set(feasible) and not set(runner.ran) & dropped
    # the 3 best predicted first, in predicted order, marked as enqueued
    assert runner.ran[:3] == feasible[:3]
    assert [t.user_attrs["source"] for t in trials[:3]] == [f"enqueued: predicted rank {i}" for i in (1, 2, 3)]
    assert len(runner.ran) == 4 == report.trials_run and len(set(runner.ran)) == 4
    assert [e.event for e in events][0] == "start" and events[-1].event == "done"
    assert sum(e.event == "trial" for e in events) == 4 and "trial budget" in events[-1].message
    assert report.stopped.startswith("trial budget reached")


def test_failed_trials_are_recorded_and_the_study_goes_on(probe_result, tmp_path):
    runner = FakeRunner(probe_result, fail=lambda plan: plan.pp > 1)
    report = _tune(probe_result, runner, tmp_path / "s.db", trials=8, prune_factor=NO_PRUNING)
    trials = _ran(_trials(tmp_path / "s.db"))
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert len(trials) == 8 == report.trials_run and len(runner.ran) == 8 == len(set(runner.ran))
    assert failed, "the fake fails every pipeline plan; the first ones are predicted among the best"
    for t in failed:
        assert t.user_attrs["status"] == "oom" and "out of memory" in t.user_attrs["cause"]
        assert report.best.key() != t.user_attrs["key"]
    assert report.best is not None and report.best.pp == 1
    rows = {r.number: r for r in report.rows}
    assert all(rows[t.number].status == "oom" for t in failed)
    table = report.table()
    assert "CUDA out of memory (fake)" in table and f"{report.count('oom')} failed)" in table


def test_pruning_skips_plans_predicted_clearly_slower(probe_result, tmp_path):
    runner = FakeRunner(probe_result)  # the model is right up to one factor: trusted, so it prunes
    report = _tune(probe_result, runner, tmp_path / "s.db", trials=None)
    pruned = [r for r in report.rows if r.status == "pruned"]
    best = min(r.measured_step_s for r in report.measured)
    assert pruned and report.stopped == "every plan in the space was measured or pruned"
    for r in pruned:
        assert r.key not in runner.ran  # never ran
        assert runner.true_step(r.plan) > 1.5 * best * 0.99  # and really was clearly slower
        assert r.cause.startswith("pruned: predicted") and "> 1.5x" in r.cause
    assert len(runner.ran) == len(set(runner.ran)) == report.trials_run
    assert len(runner.ran) + len(pruned) == report.space_size


def test_no_pruning_while_the_model_mispredicts_this_hardware(probe_result, tmp_path):
    ranked = [c.plan.key() for c in _feasible(probe_result) if c.feasible]
    swing = {k: (0.3 if i % 2 else 3.0) for i, k in enumerate(ranked)}  # errors of 10x between plans
    runner = FakeRunner(probe_result, factor=lambda plan: swing[plan.key()])
    report = _tune(probe_result, runner, tmp_path / "s.db", trials=7)
    assert report.count("pruned") == 0 and report.trials_run == 7


def test_calibration_refit_reduces_the_error(probe_result, tmp_path):
    # The hardware's matmuls and memory-bound kernels run at 60% and 50% of the rates the defaults assume.
    base = calibration_for(probe_result.topology)
    runner = FakeRunner(probe_result, factor=lambda plan: 1.0,
                        fp32_matmul_efficiency=0.6 * base.fp32_matmul_efficiency,
                        memory_efficiency=0.5 * base.memory_efficiency)
    report = _tune(probe_result, runner, tmp_path / "s.db", trials=4, prune_factor=NO_PRUNING)
    before, after = report.mean_abs_error("before"), report.mean_abs_error("after")
    assert before > 0.2
    assert after < 0.02 and report.fit_accepted and report.fitted_runs == 4
    assert report.calibration_after["matmul_efficiency"] < report.calibration_before["matmul_efficiency"]
    for r in report.measured:
        assert abs(r.error_after) < abs(r.error_before)
    # for the next plan or study of this model on this hardware (tests/tune/test_refit.py: of this model only)
    assert load_calibration(probe_result.topology.fingerprint()) is None
    saved = load_refit(probe_result.topology.fingerprint(), model_fingerprint=probe_result.profile.fingerprint,
                       sample_signature=cache.sample_signature(probe_result.profile))
    assert saved is not None and saved.fitted_runs == 4
    assert saved.factors["matmul_efficiency"] == pytest.approx(report.calibration_after["matmul_efficiency"])
    assert "after the fit to 4 measurements" in report.table()


def test_best_plan_is_cached_and_written(probe_result, tmp_path):
    runner = FakeRunner(probe_result, factor=lambda plan: 0.5 if plan.dp_replicate == 2 else 1.0)
    out = tmp_path / "best.yaml"
    report = _tune(probe_result, runner, tmp_path / "s.db", trials=6, prune_factor=NO_PRUNING, plan_out=out,
                   cache_directory=tmp_path / "plans")
    key = cache.cache_key(probe_result.profile, probe_result.topology, global_batch_size=GLOBAL, loop="train_step")
    cached = cache.lookup(key, directory=tmp_path / "plans")
    assert cached is not None and cached.key() == report.best.key()
    best_row = report.best_row
    assert best_row.measured_throughput == max(r.measured_throughput for r in report.measured)
    assert cached.measurement["tokens_per_s"] == pytest.approx(best_row.measured_throughput)
    assert cached.measurement["step_s"] == pytest.approx(best_row.measured_step_s)
    assert Plan.load(out).key() == report.best.key() and report.plan_out == str(out)
    assert report.cached_path == str(cache.path_for(key, directory=tmp_path / "plans"))
    # wrap in the same job finds it
    plan, message = cache.cached_plan_for(probe_result.profile, probe_result.topology, world_size=WORLD,
                                          global_batch_size=GLOBAL, loop="train_step", directory=tmp_path / "plans")
    assert plan.key() == report.best.key() and "measured" in message


def test_the_space_follows_the_scripts_wrap_call_so_its_wrap_finds_the_cached_plan(probe_result, tmp_path):
    plain = types.SimpleNamespace(**vars(probe_result), uses_train_step=False)  # the script: wrap(model, sample=...)
    report = _tune(plain, FakeRunner(plain), tmp_path / "s.db", trials=3, prune_factor=NO_PRUNING,
                   cache_directory=tmp_path / "plans")
    assert report.rows and all(r.plan.dp_size == WORLD and not r.plan.needs_train_step for r in report.rows)
    # cached under the key that script's wrap (uses_train_step=False) looks up
    plan, message = cache.cached_plan_for(plain.profile, plain.topology, world_size=WORLD, global_batch_size=GLOBAL,
                                          loop="plain", directory=tmp_path / "plans")
    assert plan is not None and plan.key() == report.best.key()


# ---- resuming -------------------------------------------------------------------------------------------
def test_resume_after_a_killed_tuner_loses_and_repeats_nothing(probe_result, tmp_path):
    study_path = tmp_path / "s.db"
    runner = FakeRunner(probe_result)
    first = _tune(probe_result, runner, study_path, trials=3, prune_factor=NO_PRUNING)
    assert first.trials_run == 3
    # A tuner killed while a trial ran leaves that trial RUNNING in the database.
    # This is what the tuner does with the head of its queue before it runs it (engine.py, _next_trial).
    study = optuna.load_study(study_name="autopar", storage=f"sqlite:///{study_path}")
    space = Space.from_attrs(study.user_attrs)
    queue = study.user_attrs["autopar.queue"]
    study.enqueue_trial(space.params_of(queue[0]["key"]), user_attrs={"key": queue[0]["key"],
                                                                      "source": queue[0]["source"]})
    killed = study.ask(dict(space.distributions))  # now RUNNING, and its tuner is gone
    study.set_user_attr("autopar.queue", queue[1:])
    stale_key, stale_number = killed.user_attrs["key"], killed.number
    assert stale_key not in runner.ran
    del study

    second = _tune(probe_result, runner, study_path, trials=6, prune_factor=NO_PRUNING)
    trials = _trials(study_path)
    stale = next(t for t in trials if t.number == stale_number)
    assert stale.state == TrialState.FAIL and stale.user_attrs["status"] == "stale"
    assert stale.user_attrs["cause"] == STALE_CAUSE
    completed = [t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("repeat_of") is None]
    assert len(completed) == 6 == len({t.user_attrs["key"] for t in completed}) == second.trials_run
    assert stale_key in {t.user_attrs["key"] for t in completed}  # the stale trial's plan was tried again
    retry = next(t for t in completed if t.user_attrs["key"] == stale_key)
    assert retry.user_attrs["source"] == f"retry of stale trial {stale_number}"
    assert len(runner.ran) == 6 == len(set(runner.ran))  # no plan ran twice across the two tuners
    assert [r.status for r in second.rows].count("stale") == 1
    # a repeated proposal is answered from the trial that decided its plan, and never run
    by_number = {t.number: t for t in trials}
    for t in trials:
        if t.user_attrs.get("repeat_of") is not None:
            decided = by_number[t.user_attrs["repeat_of"]]
            assert decided.user_attrs["key"] == t.user_attrs["key"] and decided.user_attrs.get("repeat_of") is None


def test_a_study_of_another_job_or_a_second_tuner_is_refused(probe_result, tmp_path):
    study_path = tmp_path / "s.db"
    _tune(probe_result, FakeRunner(probe_result), study_path, trials=1)
    other = types.SimpleNamespace(**{**vars(probe_result), "global_batch_size": 2 * GLOBAL})
    with pytest.raises(AutoparError, match="study of another job.*global_batch_size 8 there, 16 here"):
        _tune(other, FakeRunner(probe_result), study_path, trials=2)
    with open(str(study_path) + ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(AutoparError, match="another autopar tuner is working on"):
            _tune(probe_result, FakeRunner(probe_result), study_path, trials=2)


# ---- the report and the command line --------------------------------------------------------------------
def test_report_reads_the_same_table_from_the_database(probe_result, tmp_path, capsys):
    from autopar.cli import main

    runner = FakeRunner(probe_result, fail=lambda plan: plan.tp > 1)
    report = _tune(probe_result, runner, tmp_path / "s.db", trials=6)
    again = load_report(tmp_path / "s.db")
    assert again.rows == report.rows and again.best == report.best and again.trials_run == report.trials_run
    assert again.cached_path == report.cached_path

    image = pytest.importorskip("PIL.Image")  # installed with matplotlib (the autopar[report] extra)
    code = main(["report", str(tmp_path / "s.db"), "--out", str(tmp_path / "charts")])
    out = capsys.readouterr().out
    assert code == 0
    assert report.table().splitlines()[:len(report.rows) + 2] == out.splitlines()[:len(report.rows) + 2]
    for name in ("s-throughput.png", "s-history.png"):
        path = tmp_path / "charts" / name
        assert f"wrote {path}" in out
        with image.open(path) as png:
            (width, height), text = png.size, dict(png.text)
        assert (width, height) == (640, 480) and "autopar-axes" in text


def _fake_trials(monkeypatch, runner, probe_result) -> None:
    """`autopar tune` with the fake runner and probe, and no pruning on prediction (tested above)."""
    import autopar.cli
    from autopar.tune import launcher, study

    monkeypatch.setattr(launcher, "run_trial", runner)
    monkeypatch.setattr(launcher, "probe", lambda argv, **_: probe_result)
    unpruned = functools.partial(study.tune, prune_factor=NO_PRUNING)
    monkeypatch.setattr(study, "tune", unpruned)
    monkeypatch.setattr(autopar.cli, "tune", unpruned, raising=False)  # where the CLI imported it


def test_tune_command_shows_progress_and_ends_with_the_table(probe_result, tmp_path, capsys, monkeypatch):
    from autopar.cli import main

    runner = FakeRunner(probe_result, fail=lambda plan: plan.pp > 1)
    _fake_trials(monkeypatch, runner, probe_result)
    code = main(["tune", "--study", str(tmp_path / "s.db"), "--trials", "4", "--steps", "3", "--warmup", "1",
                 "--plan-out", str(tmp_path / "best.yaml"), "--", "python", "train.py"])
    captured = capsys.readouterr()
    assert code == 0
    err = captured.err.splitlines()  # not a terminal: one line per event
    assert sum(" running " in line for line in err) == 4 == len(runner.ran)
    # the space's order is the cost model's (its best predicted first): one line per trial in that order
    assert "[autopar tune] [....................] 1/4 running fsdp2 mb4 fp32 no-reshard | best - |" in captured.err
    assert any(line.startswith("[autopar tune] [#####") and "2/4 running" in line and "| best " in line for line in err)
    assert "[autopar tune] trial 3: oom     pp2 mb4 acc2 zero_bubble/v2 fp32: torch.OutOfMemoryError" in captured.err
    assert "trial budget reached (4 of 4 measured)" in captured.err
    assert "pred tok/s" in captured.out and "best (*)" in captured.out and (tmp_path / "best.yaml").is_file()

    with pytest.raises(SystemExit) as exit_:  # no command after --
        main(["tune", "--study", str(tmp_path / "s.db")])
    assert exit_.value.code == 2 and "give your launch command after --" in capsys.readouterr().err


def _without_matplotlib(monkeypatch) -> None:
    """matplotlib made unimportable (as where the autopar[report] extra is not installed)."""
    for name in ["matplotlib"] + [m for m in sys.modules if m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)


def test_report_without_matplotlib_prints_the_table_and_how_to_get_the_charts(probe_result, tmp_path, capsys,
                                                                              monkeypatch):
    from autopar.cli import main

    report = _tune(probe_result, FakeRunner(probe_result), tmp_path / "s.db", trials=2, prune_factor=NO_PRUNING)
    _without_matplotlib(monkeypatch)
    main(["report", str(tmp_path / "s.db"), "--out", str(tmp_path / "charts")])
    captured = capsys.readouterr()
    assert report.table().splitlines()[:len(report.rows) + 2] == captured.out.splitlines()[:len(report.rows) + 2]
    hints = [line for line in (captured.out + captured.err).splitlines() if 'pip install -e ".[report]"' in line]
    assert len(hints) == 1 and "matplotlib" in hints[0]
    assert not (tmp_path / "charts").exists()  # no chart written, none half-written


def test_a_study_written_by_autopar_tune_reads_well_in_optuna(probe_result, tmp_path, capsys, monkeypatch):
    """What optuna-dashboard shows of a study: its trials' parameters are the plan's name and fields (not a
    hash), and their user attributes hold the prediction and the measurement."""
    from autopar.cli import main

    runner = FakeRunner(probe_result, fail=lambda plan: plan.pp > 1)
    _fake_trials(monkeypatch, runner, probe_result)
    code = main(["tune", "--study", str(tmp_path / "s.db"), "--trials", "4", "--steps", "3", "--warmup", "1", "--",
                 "python", "train.py"])
    assert code == 0
    capsys.readouterr()
    study = optuna.load_study(study_name="autopar", storage=f"sqlite:///{tmp_path / 's.db'}")
    space = {e["key"]: Plan.from_yaml(e["plan"]) for e in study.user_attrs[STUDY_SPACE]}
    ran = _ran(study.trials)
    assert len(ran) == 4 and {t.user_attrs["status"] for t in ran} == {"ok", "oom"}
    fields = ("pp", "dp_replicate", "dp_shard", "tp", "micro_batch_size", "grad_accum", "checkpointing", "precision",
              "compile", "cpu_offload")
    for t in ran:
        plan = space[t.user_attrs["key"]]
        assert t.params["plan"] == short_name(plan)  # e.g. "tp2 mb8 fp32 sp"
        assert {name: t.params[name] for name in fields} == {name: getattr(plan, name) for name in fields}
        assert not any(isinstance(v, str) and re.fullmatch("[0-9a-f]{16}", v) for v in t.params.values())
        for name in fields:  # categorical over the values in the space
            assert isinstance(t.distributions[name], CategoricalDistribution)
            assert set(t.distributions[name].choices) == {getattr(p, name) for p in space.values()}
        predicted, measured = t.user_attrs["predicted"], t.user_attrs["measured"]
        assert predicted["step_s"] > 0 and predicted["memory_bytes"] > 0 and predicted["tokens_per_s"] > 0
        assert measured["wall_s"] > 0
        if t.user_attrs["status"] == "ok":
            assert t.state == TrialState.COMPLETE and measured["tokens_per_s"] == pytest.approx(t.value)
            assert measured["step_s"] == pytest.approx(runner.true_step(plan))
            assert measured["peak_allocated_bytes"] == 2 << 20 and measured["peak_reserved_bytes"] == 3 << 20
        else:
            assert plan.pp > 1 and t.state == TrialState.FAIL and "out of memory" in t.user_attrs["cause"]


def test_a_study_of_the_older_format_is_refused_and_its_report_still_reads(probe_result, tmp_path):
    """Format 1 had one parameter, the plan's key: resuming such a study is refused with a sentence; the report
    reads it."""
    path = tmp_path / "s.db"
    report = _tune(probe_result, FakeRunner(probe_result), path, trials=2, prune_factor=NO_PRUNING)
    study = optuna.load_study(study_name="autopar", storage=f"sqlite:///{path}")
    old = optuna.create_study(study_name="autopar", direction="maximize")  # the same study, as format 1 wrote it
    space = [{k: v for k, v in e.items() if k != "name"} for e in study.user_attrs[STUDY_SPACE]]
    for name, value in study.user_attrs.items():
        old.set_user_attr(name, space if name == STUDY_SPACE else value)
    old.set_user_attr("autopar", {**study.user_attrs["autopar"], "format": 1})
    keys = CategoricalDistribution([e["key"] for e in space])
    for t in study.trials:
        ua = {k: v for k, v in t.user_attrs.items() if k not in ("key", "predicted")}
        old.add_trial(optuna.trial.create_trial(state=t.state, value=t.value, params={"plan": t.user_attrs["key"]},
                                                distributions={"plan": keys}, user_attrs=ua))
    assert report_from_study(old).rows == report.rows
    study.set_user_attr("autopar", {**study.user_attrs["autopar"], "format": 1})
    with pytest.raises(AutoparError, match=r"study format 1, this one writes 2\): use a new --study file"):
        _tune(probe_result, FakeRunner(probe_result), path, trials=3)


def test_progress_line_rewrites_one_line_on_a_terminal():
    from autopar.cli import _ProgressLine

    stream = io.StringIO()
    bar = _ProgressLine(stream, tty=True)
    bar(Progress("trial", measured=2, budget=6, number=4, plan="fsdp2 mb4 fp32", best=1234.0,
                 best_plan="rep2 mb4 fp32"))
    bar(Progress("result", measured=3, budget=6, number=4, plan="fsdp2 mb4 fp32", status="ok", throughput=1500.0))
    bar(Progress("trial", measured=3, budget=6, number=5, plan="tp2 mb8 fp32 sp", best=1500.0,
                 best_plan="fsdp2 mb4 fp32"))
    bar.close()
    text = stream.getvalue()
    assert text.startswith("\r\033[K[autopar tune] [#######.............] 3/6 running fsdp2 mb4 fp32 | "
                           "best 1,234 tok/s")
    assert "\r\033[K[autopar tune] trial 4: ok      fsdp2 mb4 fp32: 1,500 tok/s\n" in text
    assert "4/6 running tp2 mb8 fp32 sp | best 1,500 tok/s (fsdp2 mb4 fp32)" in text and text.endswith("\r\033[K")


# ---- autotune: in this process --------------------------------------------------------------------------
def test_autotune_in_process(tmp_path):
    small = GPTConfig(vocab_size=64, seq_len=16, num_layers=2, hidden_dim=32, num_heads=2)

    def model_fn():
        return GPT(small)

    report = autotune(model_fn, synthetic_tokens(4, small), lm_loss, trials=3, steps=1, warmup=0,
                      study_path=tmp_path / "a.db", prune_factor=NO_PRUNING, cache_directory=tmp_path / "plans")
    assert report.trials_run == 3 and report.count("ok") == 3 and report.best is not None
    assert all(r.plan.world_size == 1 and r.measured_throughput > 0 for r in report.measured)
    assert report.best.measurement["tokens_per_s"] > 0 and Path(report.cached_path).is_file()
    assert load_report(tmp_path / "a.db").rows == report.rows
    # a later, shorter study whose best measures slower keeps the faster plan cached (it replaced it, silently)
    import yaml
    from autopar.tune.engine import KeptFasterPlanWarning

    cached = Path(report.cached_path)
    doc = yaml.safe_load(cached.read_text())
    doc["measurement"]["tokens_per_s"] *= 1000  # as if measured on a quieter machine
    cached.write_text(yaml.safe_dump(doc))
    before = cached.read_text()
    with pytest.warns(KeptFasterPlanWarning, match=r"kept the plan cached at .* measured at .*/s: this study's best"):
        again = autotune(model_fn, synthetic_tokens(4, small), lm_loss, trials=1, steps=1, warmup=0,
                         study_path=tmp_path / "b.db", prune_factor=NO_PRUNING, cache_directory=tmp_path / "plans")
    assert again.cached_path == report.cached_path and cached.read_text() == before


def test_in_process_trial_out_of_memory_is_a_failed_trial():
    small = GPTConfig(vocab_size=64, seq_len=16, num_layers=2, hidden_dim=32, num_heads=2)

    def model_fn():
        raise MemoryError("no room for the model")

    r = measure_in_process(model_fn, synthetic_tokens(2, small), Plan(micro_batch_size=2), loss_fn=lm_loss,
                           topology=Topology.cpu(1), steps=1, warmup=0)
    assert r.status == "oom" and "no room for the model" in r.cause


# ---- real subprocesses: torchrun, 2 ranks, gloo ---------------------------------------------------------
SCRIPT = '''
import torch
import autopar
from autopar.models.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens

cfg = GPTConfig(vocab_size=128, seq_len=32, num_layers=2, hidden_dim=32, num_heads=2)
GLOBAL = 8
torch.manual_seed(0)
model = autopar.wrap(GPT(cfg), sample=synthetic_tokens(GLOBAL // 2, cfg), loss_fn=lm_loss, loop="train_step",
                     global_batch_size=GLOBAL, verbose=False)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
step = autopar.train_step(model, opt, lm_loss)
for i in range(1000):
    step(autopar.local_batch(model, synthetic_tokens(GLOBAL, cfg, step=i)))
'''
ENV = {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1",
       "CUDA_VISIBLE_DEVICES": ""}


def _launch(script: Path) -> list[str]:
    return [*torchrun_argv(2), str(script)]


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(entry))
    return out


def _descendants(pid: int) -> list[int]:
    tree, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        for c in tree.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def _completed(study_path: Path) -> list:
    try:
        return [t for t in _trials(study_path)
                if t.state == TrialState.COMPLETE and t.user_attrs.get("repeat_of") is None]
    except Exception:  # the study is not made yet
        return []


def _kill_mid_study(tmp: Path) -> tuple[Path, list[str], dict, Path] | None:
    """Start a study of 6 real trials in `tmp`, SIGKILL its tuner while a measured trial (the 3rd or later) runs;
    (study path, command, environment, working directory), or None when the study ended before a poll saw one."""
    tmp.mkdir()
    script = tmp / "train.py"
    script.write_text(SCRIPT)
    study_path = tmp / "s.db"
    env = dict(os.environ, **ENV, AUTOPAR_CACHE_DIR=str(tmp / "cache"))
    command = [sys.executable, "-m", "autopar.cli", "tune", "--study", str(study_path), "--trials", "6", "--steps", "3",
               "--warmup", "1", "--trial-timeout", "180",
               # none pruned: on a loaded machine the measured steps once made every other plan predicted > 1.5x the
               # best, and the study ended at 3 measured (CI, 2026-12-07)
               "--prune-factor", "0", "--", *_launch(script)]
    tuner = subprocess.Popen(command, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while _num_trials(study_path, "COMPLETE") < 2:  # poll the study until the 2nd trial completes
            assert tuner.poll() is None or _num_trials(study_path, "COMPLETE") >= 2, tuner.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the first two trials did not complete"
            time.sleep(0.02)
        # a trial is measured (still running half a second after it was seen: the plans pruned on prediction run
        # for an instant, with no launcher): the tuner is killed then (a fixed wait let a fast trial finish first)
        seen: set[int] = set()
        while not (set(running := _running_numbers(study_path)) & seen):
            seen = set(running)
            if tuner.poll() is not None:
                return None
            assert time.monotonic() < deadline, "the third trial did not start"
            time.sleep(0.5)
        doomed = _descendants(tuner.pid)
        tuner.kill()  # SIGKILL: no clean-up in the tuner
        tuner.wait()
        for pid in doomed:  # the trial's processes run in their own session: end them too (we started them)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    finally:
        if tuner.poll() is None:
            tuner.kill()
            tuner.wait()
    return study_path, command, env, tmp


@pytest.mark.timeout(480)
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the trial's processes in /proc")
def test_real_study_of_six_trials_survives_a_killed_tuner_and_caches_the_best(tmp_path):
    """The must-shows with real subprocesses (torchrun, 2 gloo ranks): a study of 6 trials completes and
    caches the best plan, after its tuner was killed (SIGKILL) mid-study and restarted: no trial lost, none
    run twice."""
    # Catching a measured trial in flight depends on timing (a loaded machine runs the whole study of a few
    # seconds a trial before a poll sees one): the kill is tried on a fresh study up to 3 times.
    for attempt in range(3):
        killed = _kill_mid_study(tmp_path / f"attempt{attempt}")
        if killed is not None:
            break
    assert killed is not None, "no attempt caught a measured trial in flight"
    study_path, command, env, cwd = killed
    before = {t.user_attrs["key"]: t.number for t in _completed(study_path)}
    assert len(before) >= 2  # measured before the kill (the 3rd trial or a later one was in flight)
    running = [t for t in _trials(study_path) if t.state == TrialState.RUNNING]
    assert len(running) == 1  # the trial in flight when the tuner died

    again = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    trials = _trials(study_path)
    completed = _completed(study_path)
    keys = [t.user_attrs["key"] for t in completed]
    assert len(keys) == 6 == len(set(keys)), again.stdout[-3000:]  # the total asked, none run twice
    assert all(before[k] == n for k, n in before.items() if k in keys) and set(before) <= set(keys)
    stale = next(t for t in trials if t.number == running[0].number)
    assert stale.state == TrialState.FAIL and stale.user_attrs["status"] == "stale"
    assert running[0].user_attrs["key"] in keys  # its plan was tried again
    assert "trial budget reached (6 of 6 measured)" in again.stderr and "best (*)" in again.stdout
    assert "stale" in again.stdout
    # The best measured plan is in the plan cache, with its measurement.
    best = max(completed, key=lambda t: t.value)
    (key, path), = cache.entries(directory=cwd / "cache")
    cached = cache.lookup(key, directory=cwd / "cache")
    assert cached.key() == best.user_attrs["key"]
    assert cached.measurement["tokens_per_s"] == pytest.approx(best.value)



def test_the_space_holds_the_eager_twin_of_each_compiled_plan_unless_compiled_only(tmp_path):
    """On a GPU where compile is searched, the tuner measures eager plans too (eager=True, the default):
    compilation can fail or lose on a model. eager=False (autopar tune --compiled-only) keeps the search's
    compiled plans only (with, in one process, their CUDA-graph twins)."""
    topo = Topology.from_spec("1xH200")
    profile, variants = profile_variants(GPT(CFG), synthetic_tokens(GLOBAL, CFG), topo, loss_fn=lm_loss)
    probe = types.SimpleNamespace(profile=profile, variants=variants, topology=topo, world_size=1,
                                  global_batch_size=GLOBAL, model_fingerprint=profile.fingerprint)
    both = _tune(probe, FakeRunner(probe), tmp_path / "both.db", trials=1, prune_factor=NO_PRUNING)
    compiled = _tune(probe, FakeRunner(probe), tmp_path / "compiled.db", trials=1, prune_factor=NO_PRUNING,
                     eager=False)
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'both.db'}")
    space = [e["plan"] for e in optuna.load_study(study_name="autopar", storage=storage).user_attrs[STUDY_SPACE]]
    plans = [Plan.from_yaml(text) for text in space]
    eager = [p for p in plans if not p.compile]
    plain = [p for p in plans if p.compile and not p.cuda_graphs]
    graphs = [p for p in plans if p.cuda_graphs]  # one process: the compiled plans' CUDA-graph twins too
    assert both.space_size == compiled.space_size + len(eager) and len(eager) == len(plain) == len(graphs) > 0
    assert {p.replace(compile=False).key() for p in plain} == {p.key() for p in eager}
    assert {p.replace(cuda_graphs=False).key() for p in graphs} == {p.key() for p in plain}
    assert both.rows[0].plan.compile and compiled.rows[0].plan.compile  # the best predicted runs first
    with pytest.raises(AutoparError, match="--compiled-only"):  # resuming with the other setting is refused
        _tune(probe, FakeRunner(probe), tmp_path / "both.db", trials=2, prune_factor=NO_PRUNING, eager=False)
