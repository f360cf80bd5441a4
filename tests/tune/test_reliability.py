"""The tuner's reliability (issue 32): leftover AUTOPAR_TRIAL_* variables are ignored outside a run the tuner
launched; SIGTERM and SIGINT end the trial in flight and record it as interrupted; a second tuner on a locked
study is refused at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from autopar import hooks
from autopar.errors import StudyLockedError
from autopar.plans import Plan
from autopar.tune import launcher, worker
from autopar.tune.storage import study_lock
from autopar.tune.worker import ENV_DIR, ENV_MODE, ENV_STEPS, ENV_TOKEN, ENV_WARMUP, TOKEN_FILE

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1",
       "CUDA_VISIBLE_DEVICES": ""}
TRIAL_NAMES = (ENV_DIR, ENV_MODE, ENV_STEPS, ENV_WARMUP, ENV_TOKEN)


def _alive(pid: int) -> bool:
    """True if `pid` runs (a zombie is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("AUTOPAR_TRIAL_")}


@pytest.fixture
def no_hook(monkeypatch):
    """The process's wrap hook, excepthook and worker's warn-once flag restored after the test."""
    for name in TRIAL_NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(worker, "_warned", False)
    previous = hooks.wrap_hook()
    yield
    hooks.set_wrap_hook(previous)


# ---- leftover AUTOPAR_TRIAL_* variables -------------------------------------------------------------------
NORMAL_RUN = '''
import json, sys
import torch
import autopar
from autopar.models.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens

cfg = GPTConfig(vocab_size=128, seq_len=32, num_layers=2, hidden_dim=32, num_heads=2)
torch.manual_seed(0)
sample = synthetic_tokens(4, cfg)
model = autopar.wrap(GPT(cfg), sample=sample, loss_fn=lm_loss, verbose=False)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
done = 0
for step in range(5):
    x = synthetic_tokens(4, cfg, step=step)
    lm_loss(model(x), x).backward()
    opt.step()
    opt.zero_grad()
    done += 1
normal = autopar.plan(GPT(cfg), sample=sample, loss_fn=lm_loss)
print("RESULT " + json.dumps({"steps": done, "plan": autopar.plan_of(model).key(), "normal": normal.key(),
                              "checkpointing": autopar.plan_of(model).checkpointing}), flush=True)
'''


@pytest.mark.timeout(300)
def test_leftover_trial_variables_do_not_change_a_normal_run_and_are_warned_of(tmp_path):
    """AUTOPAR_TRIAL_* left in a shell (a trial's directory with a plan.yaml of full checkpointing, 2 timed steps
    after none of warm-up): a plain run trains all its steps with its own plan, and says it ignores them."""
    leftover = tmp_path / "autopar-trial-old"
    leftover.mkdir()
    Plan(micro_batch_size=4, checkpointing="full").save(leftover / "plan.yaml")  # a plan the run could apply
    script = tmp_path / "train.py"
    script.write_text(NORMAL_RUN)
    env = {**_clean_env(), **ENV, "AUTOPAR_CACHE_DIR": str(tmp_path / "cache"), ENV_MODE: "trial",
           ENV_DIR: str(leftover), ENV_STEPS: "2", ENV_WARMUP: "0"}
    run = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    (line,) = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    result = json.loads(line[len("RESULT "):])
    assert result["steps"] == 5  # every step of its loop (the trial would have ended it after 2)
    assert result["checkpointing"] == "none" and result["plan"] == result["normal"]  # its own plan, not plan.yaml's
    warned = [ln for ln in run.stderr.splitlines() if "not launched by `autopar tune`" in ln]
    assert len(warned) == 1, run.stderr[-3000:]
    assert all(name in warned[0] for name in (ENV_MODE, ENV_DIR, ENV_STEPS, ENV_WARMUP)) and "unset them" in warned[0]
    assert sorted(p.name for p in leftover.iterdir()) == ["plan.yaml"]  # nothing was written there


def _forged(tmp_path: Path, case: str) -> dict[str, str]:
    """A trial's environment without the tuner's proof, in one of several ways."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {ENV_MODE: "probe" if case == "probe" else "trial", ENV_DIR: str(run_dir)}
    if case == "wrong token":
        (run_dir / TOKEN_FILE).write_text("a" * 32)
        os.chmod(run_dir / TOKEN_FILE, 0o600)
        env[ENV_TOKEN] = "b" * 32
    elif case == "token file others can read":
        (run_dir / TOKEN_FILE).write_text("a" * 32)
        os.chmod(run_dir / TOKEN_FILE, 0o644)
        env[ENV_TOKEN] = "a" * 32
    elif case == "token file is a link":
        (tmp_path / "elsewhere").write_text("a" * 32)
        os.chmod(tmp_path / "elsewhere", 0o600)
        os.symlink(tmp_path / "elsewhere", run_dir / TOKEN_FILE)
        env[ENV_TOKEN] = "a" * 32
    elif case == "steps only":
        env = {ENV_STEPS: "2"}
    return env


@pytest.mark.parametrize("case", ["probe", "trial", "wrong token", "token file others can read",
                                  "token file is a link", "steps only"])
def test_trial_variables_without_the_tuners_token_install_no_hook_and_warn_once(tmp_path, monkeypatch, no_hook, case):
    for name, value in _forged(tmp_path, case).items():
        monkeypatch.setenv(name, value)
    before = hooks.wrap_hook()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert worker.install_from_env() is None
        assert worker.install_from_env() is None  # a second import-time call: no second warning
    assert hooks.wrap_hook() is before and not isinstance(sys.excepthook, worker.ErrorHook)
    assert [type(w.message) for w in caught] == [worker.TrialEnvIgnoredWarning]
    assert "not launched by `autopar tune`" in str(caught[0].message) and "\n" not in str(caught[0].message)
    assert not list((tmp_path / "run").glob("progress.*")) if (tmp_path / "run").exists() else True


def test_the_tuners_token_installs_the_trial_hook(tmp_path, monkeypatch, no_hook):
    token = launcher._write_token(tmp_path)
    assert (tmp_path / TOKEN_FILE).stat().st_mode & 0o777 == 0o600
    monkeypatch.setenv(ENV_MODE, "trial")
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    monkeypatch.setenv(ENV_TOKEN, token)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning in a tuner's run
        hook = worker.install_from_env()
    assert isinstance(hook, worker.TrialHook) and hooks.wrap_hook() is hook


def test_a_launched_run_gets_a_fresh_token_that_matches_its_file_and_is_removed_after(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_TOKEN, "stale-token-from-the-shell")
    out = tmp_path / "seen.json"
    check = ("import json, os, sys; d = os.environ['AUTOPAR_TRIAL_DIR']; "
             "json.dump({'env': os.environ['AUTOPAR_TRIAL_TOKEN'], 'file': open(os.path.join(d, 'token')).read(), "
             "'mode': oct(os.stat(os.path.join(d, 'token')).st_mode & 0o777)}, open(sys.argv[1], 'w'))")
    r = launcher.run_trial([sys.executable, "-c", check, str(out)], Plan(), timeout_s=60, workdir=tmp_path / "w")
    assert r.status == "exit" and r.returncode == 0  # no wrap in it: no result, as expected
    seen = json.loads(out.read_text())
    assert seen["env"] == seen["file"] != "stale-token-from-the-shell" and len(seen["env"]) == 32
    assert seen["mode"] == "0o600"
    (run_dir,) = (tmp_path / "w").glob("autopar-trial-*")
    assert not (run_dir / TOKEN_FILE).exists()  # spent: the same variables prove nothing after the run


# ---- SIGTERM and SIGINT end the trial in flight ----------------------------------------------------------
SLEEPER = '''
import os, sys, time
from pathlib import Path
Path(sys.argv[1], f"{os.getpid()}.pid").write_text(os.environ.get("AUTOPAR_TRIAL_MODE", ""))
time.sleep(600)
'''

DRIVER = '''
import sys, types
from autopar.models.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens
from autopar.planning import profile_variants
from autopar.plans import Loop
from autopar.topology import Topology
from autopar.tune import launcher

cfg = GPTConfig(vocab_size=128, seq_len=32, num_layers=2, hidden_dim=32, num_heads=2)
topo = Topology.cpu(1)
profile, variants = profile_variants(GPT(cfg), synthetic_tokens(4, cfg), topo, loss_fn=lm_loss)
probed = types.SimpleNamespace(profile=profile, variants=variants, topology=topo, world_size=1, global_batch_size=4,
                               model_fingerprint=profile.fingerprint, loop=Loop.TRAIN_STEP)
launcher.probe = lambda argv, **_: probed  # the probe of a script that calls wrap; the trials run for real
from autopar.cli import main
sys.exit(main(["tune", "--study", sys.argv[1], "--trials", "3", "--top-k", "1", "--", sys.executable, sys.argv[2],
               sys.argv[3]]))
'''


@pytest.mark.timeout(300)
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the trial's state in /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_tuner_ends_its_trial_and_records_it_interrupted(tmp_path, signum):
    (tmp_path / "driver.py").write_text(DRIVER)
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    pids, study = tmp_path / "pids", tmp_path / "s.db"
    pids.mkdir()
    env = {**_clean_env(), **ENV, "AUTOPAR_CACHE_DIR": str(tmp_path / "cache")}
    tuner = subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), str(study), str(tmp_path / "sleeper.py"),
                              str(pids)], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a terminal's
    try:
        deadline = time.monotonic() + 240
        while not list(pids.glob("*.pid")):
            assert tuner.poll() is None, tuner.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no trial started"
            time.sleep(0.1)
        (pid_file,) = pids.glob("*.pid")
        trial_pid = int(pid_file.stem)
        assert pid_file.read_text() == "trial" and _alive(trial_pid)
        tuner.send_signal(signum)
        out, err = tuner.communicate(timeout=10)  # the tuner ended within seconds
    finally:
        if tuner.poll() is None:
            tuner.kill()
            tuner.wait()
    assert tuner.returncode == 128 + signum, err[-3000:]
    assert f"interrupted ({signal.Signals(signum).name})" in err
    assert not _alive(trial_pid)  # its trial ended with it
    trials = optuna.load_study(study_name="autopar", storage=f"sqlite:///{study}").get_trials(deepcopy=False)
    (trial,) = trials  # the one in flight
    assert trial.state == TrialState.FAIL and trial.user_attrs["interrupted"] is True
    assert trial.user_attrs["status"] == "interrupted" and signal.Signals(signum).name in trial.user_attrs["cause"]
    assert not [t for t in trials if t.state == TrialState.RUNNING]


# ---- a locked study ------------------------------------------------------------------------------------
def test_a_second_tune_on_a_locked_study_is_refused_at_once_naming_the_holder(tmp_path, monkeypatch, capsys):
    from autopar.cli import main

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    probed = []
    monkeypatch.setattr(launcher, "probe", lambda argv, **_: probed.append(argv) or pytest.fail("probed"))
    (tmp_path / "train.py").write_text("")
    study = tmp_path / "s.db"
    with study_lock(study):  # the first tuner: this process
        t0 = time.monotonic()
        code = main(["tune", "--study", str(study), "--", sys.executable, str(tmp_path / "train.py")])
        elapsed = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"pid {os.getpid()}" in err and f"{study}.lock" in err and "another --study file" in err
    assert not probed and elapsed < 10  # before the probe


def test_autotune_on_a_locked_study_is_refused_before_the_model_is_built(tmp_path, monkeypatch):
    import torch

    from autopar import autotune

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    built = []
    study = tmp_path / "s.db"
    with study_lock(study), pytest.raises(StudyLockedError, match=f"pid {os.getpid()}") as refused:
        autotune(lambda: built.append(1) or pytest.fail("built"), sample=torch.zeros(2, 4), study_path=study)
    assert not built and refused.value.path == f"{study}.lock"
