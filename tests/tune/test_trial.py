"""Trial runs and the probe (autopar/tune/launcher.py, worker.py), in real subprocesses: torchrun, 2 ranks, gloo.

The user's script (written below) is a plain training loop of 1000 steps around `autopar.wrap`; a trial
must end it early, measure it, and, when a rank fails, hangs or the command exits, end the whole group
with the right status. Each rank of the script records its pid and torchrun's, so the tests can check
that no process of a trial is left.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import pytest

from autopar.errors import AutoparError, LaunchError
from autopar.models.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens
from autopar.plans import Plan
from autopar.profile import ModelProfile, model_fingerprint, profile_model
from autopar.tune import launcher, worker
from autopar.tune.launcher import _classify
from autopar.tune.launcher import probe, run_trial
from autopar.tune.worker import ENV_DIR, ENV_MODE, ENV_STEPS, ENV_WARMUP
from tests.tune import _faults
from tests.tune._faults import ENV_FAULT
from tests._ports import torchrun_argv

ROOT = Path(__file__).resolve().parents[2]
CFG = GPTConfig(vocab_size=128, seq_len=32, num_layers=2, hidden_dim=32, num_heads=2)
LOCAL_BATCH = 4
PLAN = Plan(dp_shard=2, micro_batch_size=LOCAL_BATCH)

SCRIPT = '''
import os, sys
from pathlib import Path

out = Path(sys.argv[1])
rank = int(os.environ.get("RANK", "0"))
(out / "pids").mkdir(parents=True, exist_ok=True)
(out / "pids" / f"rank{rank}").write_text(f"{os.getpid()} {os.getppid()}")  # this rank and its launcher
if sys.argv[2:] == ["exit3"]:
    sys.exit(3)

import torch
import autopar
from autopar.models.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens

cfg = GPTConfig(vocab_size=128, seq_len=32, num_layers=2, hidden_dim=32, num_heads=2)
torch.manual_seed(0)
model = autopar.wrap(GPT(cfg), sample=synthetic_tokens(4, cfg), loss_fn=lm_loss, verbose=rank == 0)
from tests.tune import _faults
_faults.install()  # the fault the test asks for (AUTOPAR_TEST_FAULT), at the first timed step
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
try:
    for step in range(1000):
        x = synthetic_tokens(4, cfg, step=step, seed=rank)
        loss = lm_loss(model(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        (out / f"steps.rank{rank}").write_text(str(step + 1))
    print("LOOP FINISHED", flush=True)
finally:  # unguarded, as many scripts do: the trial has already left the process group when this runs
    torch.distributed.destroy_process_group()
'''


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("user") / "train.py"
    path.write_text(SCRIPT)
    return path


def _torchrun(script: Path, out: Path) -> list[str]:
    return [*torchrun_argv(2), str(script), str(out)]


ENV = {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1",
       "CUDA_VISIBLE_DEVICES": ""}


def _alive(pid: int) -> bool:
    """True if `pid` runs (a zombie, dead but not yet reaped by its new parent, is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _assert_all_ended(out: Path, ranks: int = 2, *, torchrun: bool = True) -> None:
    files = sorted((out / "pids").glob("rank*"))
    assert len(files) == ranks, files
    pids = {int(p) for f in files for p in f.read_text().split()[:2 if torchrun else 1]}  # every rank, torchrun
    assert pids and not [p for p in pids if _alive(p)], "a process of the trial is still running"


def _trial_dir(workdir: Path) -> Path:
    (found,) = workdir.glob("autopar-trial-*")
    return found


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- in one process: the contract's names and checks --------------------------------------------
def test_contract_names_and_argument_checks(tmp_path):
    assert (ENV_DIR, ENV_MODE, ENV_STEPS, ENV_WARMUP) == tuple(
        f"AUTOPAR_TRIAL_{n}" for n in ("DIR", "MODE", "STEPS", "WARMUP"))
    assert _faults.parse("oom:1") == ("oom", 1) and _faults.parse(None) is None
    with pytest.raises(ValueError, match="oom:RANK"):
        _faults.parse("segfault:0")
    with pytest.raises(TypeError, match="no shell"):
        run_trial("torchrun train.py", PLAN)
    with pytest.raises(ValueError, match="steps"):
        run_trial(["true"], PLAN, steps=0)
    with pytest.raises(TypeError, match="inject"):  # fault injection lives in the tests (tests/tune/_faults.py)
        run_trial(["true"], PLAN, inject="oom")
    # a command that never calls wrap: exit 0 without a result is not a measurement
    r = run_trial([sys.executable, "-c", "pass"], PLAN, timeout_s=60, workdir=tmp_path)
    assert r.status == "exit" and r.returncode == 0 and "without a result" in r.cause and r.step_s is None
    assert (_trial_dir(tmp_path) / "plan.yaml").is_file()  # kept under workdir
    assert Plan.load(_trial_dir(tmp_path) / "plan.yaml") == PLAN


@pytest.mark.parametrize("argv, named", [
    (["autopar-no-such-launcher", "--nproc-per-node", "2", "train.py"],
     "'autopar-no-such-launcher' is not an executable on PATH"),
    (["./bin/torchrun", "train.py"], "'./bin/torchrun' is not an executable at "),
    ([sys.executable, "-u", "no_such_train.py", "--lr", "1e-3"], "script no_such_train.py does not exist"),
    ([*torchrun_argv(2), "missing/train.py"], "script missing/train.py does not exist"),
])
def test_a_missing_launcher_or_script_is_refused_in_one_line_before_anything_runs(tmp_path, monkeypatch, argv, named):
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "runs"
    for call in (lambda: probe(argv, workdir=runs), lambda: run_trial(argv, PLAN, workdir=runs)):
        with pytest.raises(LaunchError) as refused:
            call()
        assert named in str(refused.value) and "\n" not in str(refused.value) and "after --" in str(refused.value)
        assert not list(runs.glob("autopar-*"))  # no run was started


def test_the_tune_command_refuses_a_missing_launcher_with_exit_2_in_one_line(tmp_path, monkeypatch, capsys):
    from autopar.cli import main

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    code = main(["tune", "--study", str(tmp_path / "s.db"), "--", "autopar-no-such-launcher", "train.py"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("autopar tune: the launch command's program")
    assert not (tmp_path / "s.db").exists()  # refused before the study was opened


def test_install_from_env_only_in_a_tuners_run(tmp_path, monkeypatch):
    from autopar import hooks

    for name in (ENV_DIR, ENV_MODE, ENV_STEPS, ENV_WARMUP, worker.ENV_TOKEN):
        monkeypatch.delenv(name, raising=False)
    assert worker.install_from_env() is None and type(hooks.wrap_hook()) is hooks.WrapHook  # outside: nothing
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # restored after the test
    previous = hooks.wrap_hook()
    try:
        monkeypatch.setenv(ENV_MODE, "trial")
        monkeypatch.setenv(ENV_DIR, str(tmp_path))
        monkeypatch.setenv(worker.ENV_TOKEN, launcher._write_token(tmp_path))  # the tuner's proof
        hook = worker.install_from_env()
        assert isinstance(hook, worker.TrialHook) and hooks.wrap_hook() is hook
        assert worker.install_from_env() is hook  # once
        assert isinstance(sys.excepthook, worker.ErrorHook)
        assert hook.plan_override() == tmp_path / "plan.yaml"
        assert json.loads((tmp_path / "progress.rank0.json").read_text())["phase"] == "wrap"
        hooks.set_wrap_hook(None)
        monkeypatch.setenv(ENV_MODE, "probe")
        assert isinstance(worker.install_from_env(), worker.ProbeHook)
        monkeypatch.setenv(ENV_MODE, "nonsense")
        with pytest.raises(AutoparError, match="expected one of trial, probe"):
            worker.install_from_env()
    finally:
        hooks.set_wrap_hook(previous)


def test_classification_of_an_ended_run():
    def ended(errors=(), rc=1, timeout=None, log=""):
        return launcher._Ended(returncode=rc, wall_s=1.0, timeout_cause=timeout, errors=list(errors), log_tail=log)

    crash = {"rank": 0, "time": 1.0, "line": "RuntimeError: Connection closed by peer", "oom": False}
    oom = {"rank": 1, "time": 2.0, "line": "OutOfMemoryError: CUDA out of memory", "oom": True}
    assert _classify(ended([crash, oom]), done=False) == ("oom", "rank 1: OutOfMemoryError: CUDA out of memory")
    assert _classify(ended([crash]), done=False) == ("crash", "rank 0: RuntimeError: Connection closed by peer")
    assert _classify(ended(timeout="no progress for 5 s", rc=-15), done=False) == ("timeout", "no progress for 5 s")
    assert _classify(ended(rc=0), done=True) == ("ok", None)
    assert _classify(ended(rc=-9), done=False) == ("exit", "the command was killed by SIGKILL")
    summary = "[0]:\n  exitcode  : -9 (pid: 123)\n  error_file: <N/A>"
    assert _classify(ended(rc=1, log=summary), done=False) == (
        "exit", "the command exited with code 1 (a rank was killed by SIGKILL)")
    assert worker.is_oom(MemoryError()) and worker.is_oom(RuntimeError("CUDA error: out of memory"))
    assert not worker.is_oom(RuntimeError("injected crash"))


def test_exit_code_before_wrap_is_exit(script, tmp_path):
    out = tmp_path / "out"
    r = run_trial([sys.executable, str(script), str(out), "exit3"], PLAN, timeout_s=60, env=ENV)
    assert r.status == "exit" and r.returncode == 3, r
    assert r.cause == "the command exited with code 3"
    assert r.step_s is None and r.peak_allocated_bytes == ()
    _assert_all_ended(out, ranks=1, torchrun=False)


TWO_MODELS = '''
import sys
from pathlib import Path

import torch
import autopar
from autopar.models.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens

out = Path(sys.argv[1])
cfg = GPTConfig(vocab_size=128, seq_len=32, num_layers=2, hidden_dim=32, num_heads=2)
torch.manual_seed(0)
x = synthetic_tokens(4, cfg)
model = autopar.wrap(GPT(cfg), sample=x, loss_fn=lm_loss)
small = GPTConfig(vocab_size=128, seq_len=32, num_layers=1, hidden_dim=16, num_heads=2)
teacher = autopar.wrap(GPT(small), sample=x, loss_fn=lm_loss)  # a second model: its own plan
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
if sys.argv[2:] == ["first run"]:  # the user's own run, before tuning: its checkpoint
    autopar.save(model, opt, out / "ckpt")
    sys.exit(0)
autopar.load(model, opt, out / "ckpt")  # a script that resumes: load steps a fresh optimizer at lr 0
for step in range(1000):
    loss = lm_loss(model(x), x) + 0 * teacher(x).float().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    (out / "steps").write_text(str(step + 1))
    autopar.save(model, opt, out / "ckpt")  # each step, as scripts that resume do
'''


def test_a_script_with_two_models_that_resumes_is_timed_on_its_own_steps(tmp_path):
    """Found by a helper: a second wrap was given the trial's plan, made for the first model (every trial crashed
    with PlanMismatchError); autopar.load's lr-0 step to make the optimizer's state was counted as the loop's
    first step (one warm-up step short); and the trial's autopar.save replaced the user's checkpoint."""
    import subprocess

    script = tmp_path / "train.py"
    script.write_text(TWO_MODELS)
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run([sys.executable, str(script), str(out), "first run"], check=True, timeout=120,
                   env={**os.environ, **ENV}, capture_output=True)
    before = {f.name: _digest(f) for f in (out / "ckpt").iterdir() if f.is_file()}
    r = run_trial([sys.executable, str(script), str(out)], Plan(micro_batch_size=4), steps=2, warmup=1,
                  timeout_s=120, env=ENV, workdir=tmp_path / "trials")
    assert r.status == "ok", (r.cause, r.log_tail)
    assert (out / "steps").read_text() == "2"  # 1 warm-up + 2 timed training steps: ended in the third's hook
    assert {f.name: _digest(f) for f in (out / "ckpt").iterdir() if f.is_file()} == before  # the user's checkpoint
    assert "autopar tune's trial run: autopar.save(" in r.log_tail and "writes nothing" in r.log_tail


# ---- torchrun, 2 ranks ---------------------------------------------------------------------------
def test_ok_trial_measures_and_ends_the_loop_early(script, tmp_path):
    out, work = tmp_path / "out", tmp_path / "trials"
    before = _digest(script)
    r = run_trial(_torchrun(script, out), PLAN, steps=3, warmup=1, timeout_s=240, env=ENV, workdir=work)
    assert r.status == "ok", (r.cause, r.log_tail)
    assert r.returncode == 0 and r.cause is None and r.plan == PLAN
    assert r.step_s > 0 and r.wall_s > r.step_s
    assert r.samples_per_s == pytest.approx(PLAN.global_batch_size / r.step_s)
    assert r.tokens_per_s == pytest.approx(PLAN.global_batch_size * CFG.seq_len / r.step_s)
    assert r.peak_allocated_bytes == (0, 0) and r.peak_reserved_bytes == (0, 0)  # CPU
    # the loop of 1000 steps was ended by the trial after warm-up + timed steps (the 4th step's hook)
    assert [int((out / f"steps.rank{k}").read_text()) for k in (0, 1)] == [3, 3]
    assert "LOOP FINISHED" not in r.log_tail
    result = json.loads((_trial_dir(work) / "result.json").read_text())
    assert result["status"] == "ok" and result["world_size"] == 2 and len(result["step_s_per_rank"]) == 2
    assert result["step_s"] == max(result["step_s_per_rank"]) == r.step_s
    # the script's unguarded destroy_process_group() after the trial ended is ignored (the run exits 0)
    assert "the run had ended; ignoring AssertionError" in (_trial_dir(work) / "log.txt").read_text()
    assert _digest(script) == before  # the user's files are untouched
    _assert_all_ended(out)


def test_probe_writes_the_profile_wrap_made(script, tmp_path):
    out = tmp_path / "out"
    p = probe(_torchrun(script, out), timeout_s=240, env=ENV, workdir=tmp_path / "probes")
    model, sample = GPT(CFG), synthetic_tokens(LOCAL_BATCH, CFG)
    assert p.profile == profile_model(model, sample, loss_fn=lm_loss)  # exactly what wrap profiled
    assert isinstance(p.profile, ModelProfile) and p.profile.matmul_calls and p.profile.blocks
    assert p.model_fingerprint == model_fingerprint(model) == p.profile.fingerprint
    assert (p.world_size, p.global_batch_size) == (2, 2 * LOCAL_BATCH)
    assert p.topology.device_type == "cpu" and p.topology.world_size == 2
    assert p.variants == {}  # no bf16 traces on CPU processes
    assert p.uses_train_step is False  # the script's plain wrap(): the tuner then keeps to plain-loop plans
    assert not list(out.glob("steps.rank*"))  # the run ended in wrap: the loop never ran
    _assert_all_ended(out)


@pytest.mark.parametrize("fault, status, cause", [
    ("oom:1", "oom", "rank 1: OutOfMemoryError: injected out of memory"),
    ("crash:0", "crash", "rank 0: RuntimeError: injected crash"),
])
def test_injected_failure_ends_the_trial(script, tmp_path, fault, status, cause):
    out = tmp_path / "out"
    t0 = time.monotonic()
    r = run_trial(_torchrun(script, out), PLAN, steps=3, warmup=1, timeout_s=240, env={**ENV, ENV_FAULT: fault})
    assert r.status == status and r.cause == cause, (r.status, r.cause, r.log_tail)
    assert r.returncode != 0 and r.step_s is None and r.tokens_per_s is None and r.samples_per_s is None
    assert r.peak_allocated_bytes == (0, 0)  # from the ranks' progress files
    # the failing rank raised in the first timed step's optimizer step (its loop never saw it end)
    assert int((out / f"steps.rank{fault[-1]}").read_text()) == 1
    assert time.monotonic() - t0 < 200
    _assert_all_ended(out)


def test_injected_hang_times_out_and_ends_the_group(script, tmp_path):
    out, work = tmp_path / "out", tmp_path / "trials"
    r = run_trial(_torchrun(script, out), PLAN, steps=3, warmup=1, timeout_s=240, progress_timeout_s=10,
                  env={**ENV, ENV_FAULT: "hang:1"}, workdir=work)
    ended = time.time()
    assert r.status == "timeout" and r.cause == "no progress for 10 s", (r.status, r.cause, r.log_tail)
    assert r.step_s is None and r.returncode != 0
    run_dir = _trial_dir(work)
    assert "injecting a fault on rank 1: hang" in (run_dir / "log.txt").read_text()
    assert not list(run_dir.glob("error.rank*.json"))  # ended by the tuner: no rank's error
    # ended within the progress timeout (+ the SIGTERM grace and polling) of the last sign of life
    last = max(p.stat().st_mtime for p in run_dir.glob("progress.rank*.json"))
    assert ended - last < 10 + launcher.TERM_GRACE_S + 5
    _assert_all_ended(out)
