"""The tuner's side of a trial or probe: start the user's command, watch it, end its whole process tree, read
back one result.

`run_trial` and `probe` write `plan.yaml` into a directory they make, start the user's command (an argv
list, no shell) in its own session with `AUTOPAR_TRIAL_*` set (autopar.tune.worker reads them in that
run), and watch it: its exit, an overall time limit, the per-rank progress files, the ranks' error files
and, for a probe, `probe.json`. When it is over they end every process of it (psutil: the command's
descendants and the ranks the progress files name; SIGTERM, then SIGKILL, until none is left) and classify
how it ended: ok, oom, crash, exit or timeout.

Only JSON and `Plan.load` (yaml.safe_load) are read from the directory: nothing there is executed or
unpickled. A trial never writes outside its directory (the user's files are not touched).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from ..errors import LaunchError, ProbeError
from ..plans import Loop, Plan
from ..profile import ModelProfile
from ..topology import Topology
from .interrupt import held
from .worker import (
    ENV_DIR,
    ENV_MODE,
    ENV_PREFIX,
    ENV_STEPS,
    ENV_TOKEN,
    ENV_WARMUP,
    PLAN_FILE,
    PROBE_FILE,
    RESULT_FILE,
    TOKEN_FILE,
)

STATUSES = ("ok", "oom", "crash", "exit", "timeout")
LOG_FILE = "log.txt"
LOG_TAIL_CHARS = 4000
#: how long the launcher may take to end by itself after a rank reported an error (torchrun needs < 1 s)
ERROR_GRACE_S = 5.0
#: after SIGTERM, how long the run's processes may take to end before SIGKILL
TERM_GRACE_S = 5.0
_POLL_S = 0.1
_SCAN_EVERY_S = 0.5  # how often the run's process tree is read while it runs


# ===================================================================================================
# Results
# ===================================================================================================
@dataclass(frozen=True)
class TrialResult:
    """One trial run of one plan: its status, what it measured, and how it ended."""

    status: str  # "ok", "oom", "crash", "exit", "timeout"  ("exit": non-zero exit without a recognised cause)
    plan: Plan  # the plan that ran
    step_s: float | None  # mean seconds per timed optimizer step (max over ranks), None unless ok
    tokens_per_s: float | None
    samples_per_s: float | None
    peak_allocated_bytes: tuple[int, ...]  # per rank (empty if unknown); torch.cuda.max_memory_allocated, on CPU: 0
    peak_reserved_bytes: tuple[int, ...]
    wall_s: float  # the whole trial, launch to end
    cause: str | None  # for failures: the exception line / signal / "no progress for N s"
    returncode: int | None
    log_tail: str  # last ~4000 chars of the group's stdout+stderr

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class ProbeResult:
    """What the user's script's `wrap` saw in a probe run (rank 0's view)."""

    profile: ModelProfile  # the fp32 profile the user's script's wrap() made (rank 0)
    variants: dict[str, ModelProfile]  # the bf16 traces ("bf16", "bf16-pure") where the hardware has bf16, else empty
    topology: Topology  # what that run detected
    world_size: int
    global_batch_size: int
    model_fingerprint: str
    loop: Loop | None = None  # what drives the script's step, as its wrap(loop=...) said (None: not recorded)

    @property
    def uses_train_step(self) -> bool | None:
        """Whether the script's loop is autopar.train_step (None: not recorded)."""
        return None if self.loop is None else self.loop is Loop.TRAIN_STEP


# ===================================================================================================
# The run's processes
# ===================================================================================================
def _running(p: psutil.Process) -> bool:
    """True while `p` (the very process, not a reused pid) runs; a zombie is dead."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class _ProcessTree:
    """Every process of one run: the command, its descendants (read while they are its descendants, so an
    orphan is still known), and the ranks the progress files name (torchrun starts each in its own session)."""

    def __init__(self, proc: subprocess.Popen, run_dir: Path) -> None:
        self.proc, self.run_dir = proc, run_dir
        self.root = psutil.Process(proc.pid)
        self.known: dict[int, psutil.Process] = {}  # pid -> the process (psutil tells a reused pid apart)
        self._scanned = 0.0

    def _add(self, procs: Sequence[psutil.Process]) -> None:
        for p in procs:
            if p.pid != self.proc.pid and p.pid not in self.known and _running(p):
                self.known[p.pid] = p

    def _descendants(self, p: psutil.Process) -> list[psutil.Process]:
        try:
            return p.children(recursive=True)
        except psutil.Error:
            return []

    def scan(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._scanned < _SCAN_EVERY_S:
            return
        self._scanned = now
        if self.proc.poll() is None:
            self._add(self._descendants(self.root))
        for info in _progress_files(self.run_dir).values():  # each rank's own pid, while it is alive
            pid = info.get("pid")
            if isinstance(pid, int) and pid > 1 and pid != os.getpid() and pid not in self.known:
                try:
                    p = psutil.Process(pid)
                    if p.create_time() <= float(info.get("time", 0.0)) + 1.0:  # started before it wrote the file
                        self._add([p])
                except (psutil.Error, TypeError, ValueError):
                    continue
        for p in self.alive():  # what the ranks started (and what the command no longer parents)
            self._add(self._descendants(p))

    def alive(self) -> list[psutil.Process]:
        """The run's processes that still run, the command itself excluded (it is reaped through Popen)."""
        return [p for p in self.known.values() if _running(p)]

    def _signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)  # the command's own group (start_new_session: its pid)
            except (ProcessLookupError, PermissionError):
                pass
        for p in self.alive():
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass

    def _wait(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until no process of the run is left; True if none is."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.scan(force=True)
            procs = self.alive()
            if not procs and self.proc.poll() is not None:
                return True
            if time.monotonic() >= deadline:
                return False
            if procs:
                psutil.wait_procs(procs, timeout=_POLL_S)
            else:
                time.sleep(_POLL_S)

    def end(self) -> None:
        """SIGTERM to every process of the run, SIGKILL to what is left after TERM_GRACE_S, until none is left."""
        if self._wait(0.0):
            return
        self._signal(signal.SIGTERM)
        if self._wait(TERM_GRACE_S):
            return
        for _ in range(50):
            self._signal(signal.SIGKILL)
            if self._wait(_POLL_S):
                break
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


# ===================================================================================================
# The run's files
# ===================================================================================================
def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _progress_files(run_dir: Path) -> dict[int, dict]:
    out = {}
    for path in run_dir.glob("progress.rank*.json"):
        data = _read_json(path)
        if isinstance(data, dict) and isinstance(data.get("rank"), int):
            out[data["rank"]] = data
    return out


def _progress_signature(run_dir: Path) -> tuple:
    sig = []
    for path in sorted(run_dir.glob("progress.rank*.json")):
        try:
            st = path.stat()
        except OSError:
            continue
        sig.append((path.name, st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(sig)


def _errors(run_dir: Path) -> list[dict]:
    out = [e for e in (_read_json(p) for p in run_dir.glob("error.rank*.json")) if isinstance(e, dict)]
    return sorted(out, key=lambda e: e.get("time", 0.0))


def _log_tail(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 4 * chars))
            return f.read().decode(errors="replace")[-chars:]
    except OSError:
        return ""


# ===================================================================================================
# How a run ended
# ===================================================================================================
def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _exit_cause(returncode: int | None, log: str) -> str:
    if returncode is None:
        return "the command did not end"
    if returncode < 0:
        return f"the command was killed by {_signal_name(-returncode)}"
    cause = f"the command exited with code {returncode}"
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", log)]  # torchrun's failure summary
    if codes:
        code = codes[0]
        cause += f" (a rank was killed by {_signal_name(-code)})" if code < 0 else f" (a rank exited with code {code})"
    return cause


@dataclass(frozen=True)
class _Ended:
    returncode: int | None
    wall_s: float
    timeout_cause: str | None  # set when the run was ended for taking too long
    errors: list[dict]  # error files written before the run ended (or before it was ended)
    log_tail: str


def _classify(ended: _Ended, *, done: bool) -> tuple[str, str | None]:
    """(status, cause) of an ended run; `done`: it wrote its result."""
    if ended.errors:
        ooms = [e for e in ended.errors if e.get("oom")]
        first = (ooms or ended.errors)[0]
        return ("oom" if ooms else "crash"), f"rank {first.get('rank')}: {first.get('line')}"
    if ended.timeout_cause is not None:
        return "timeout", ended.timeout_cause
    if ended.returncode == 0 and done:
        return "ok", None
    if ended.returncode == 0:
        return "exit", ("the command exited with code 0 without a result: it did not call autopar.wrap, or its loop "
                        "ended before the warm-up and timed optimizer steps were done")
    return "exit", _exit_cause(ended.returncode, ended.log_tail)


# ===================================================================================================
# Launch and watch
# ===================================================================================================
def _check_argv(argv: Sequence[str]) -> list[str]:
    if isinstance(argv, (str, bytes)) or not isinstance(argv, Sequence) or not argv:
        raise TypeError("argv must be the launch command as a non-empty list of strings (no shell), e.g. "
                        "['torchrun', '--nproc-per-node', '8', 'train.py'].")
    out = [os.fspath(a) for a in argv]
    if not all(isinstance(a, str) for a in out):
        raise TypeError(f"argv must hold strings only, got {argv!r}.")
    return out


def check_launchable(argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
    """Refuse, before anything runs, a command whose program is not on PATH (PATH from `env` over this process's
    environment) or not executable, or whose training script (`_script_of`) does not exist. Relative paths are
    this process's working directory's, as the run's are. Raises LaunchError, in one line."""
    program = argv[0]
    search_path = {**os.environ, **(env or {})}.get("PATH", os.defpath)
    found = shutil.which(program, path=search_path)
    if found is None:
        where = f"at {os.path.abspath(program)}" if os.sep in program else "on PATH"
        raise LaunchError(f"the launch command's program {program!r} is not an executable {where}: install it, or "
                          f"give its full path after -- (for torchrun: autopar tune -- {sys.executable} -m "
                          "torch.distributed.run ...).")
    script = _script_of(argv)
    if script is not None and not os.path.isfile(script):
        raise LaunchError(f"the launch command's script {script} does not exist (in {os.getcwd()}): give the path of "
                          "your training script after --.")


def _script_of(argv: Sequence[str]) -> str | None:
    """The training script a command names: its first argument ending in ".py" that is not an option, unless a
    module (-m, --module) or a code string (-c) comes first; `python -m torch.distributed.run` is torchrun."""
    args = list(argv[1:])
    while args:
        arg = args.pop(0)
        if arg == "-m" and args[:1] == ["torch.distributed.run"]:
            args.pop(0)
        elif arg in ("-m", "-c", "--module"):
            return None
        elif arg.endswith(".py") and not arg.startswith("-"):
            return arg
    return None


def _write_token(run_dir: Path) -> str:
    """A new random token, written (0600, a new file) into the run's directory: the run obeys AUTOPAR_TRIAL_* only
    when its AUTOPAR_TRIAL_TOKEN equals it (autopar.tune.worker.launched_by_tuner). Removed when the run ends."""
    token = secrets.token_hex(16)
    fd = os.open(run_dir / TOKEN_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    return token


def _run_env(run_dir: Path, mode: str, extra: Mapping[str, str], env: Mapping[str, str] | None,
             token: str) -> dict[str, str]:
    full = {**os.environ, **(env or {})}
    for name in [n for n in full if n.startswith(ENV_PREFIX)]:
        full.pop(name, None)  # a stale setting from the caller's environment never leaks into the run
    full.setdefault("PYTHONUNBUFFERED", "1")  # a failing run's last lines reach the log
    return {**full, ENV_DIR: str(run_dir), ENV_MODE: mode, ENV_TOKEN: token, **extra}


class _Watch:
    """The watch over one running command: why it should be ended now, if it should."""

    def __init__(self, run_dir: Path, *, timeout_s: float, stall_s: float, done_file: str | None) -> None:
        self.run_dir, self.timeout_s, self.stall_s, self.done_file = run_dir, timeout_s, stall_s, done_file
        self.t0 = time.monotonic()
        self.last_sig: tuple = ()
        self.last_change: float | None = None  # the progress clock starts when a rank first reaches wrap
        self.error_seen_at: float | None = None
        self.timeout_cause: str | None = None

    def over(self) -> bool:
        """True when the run should be ended (its result is in, it ran too long, or a rank failed)."""
        now = time.monotonic()
        if self.done_file is not None and (self.run_dir / self.done_file).exists():
            return True
        sig = _progress_signature(self.run_dir)
        if sig != self.last_sig:
            self.last_sig, self.last_change = sig, now
        if now - self.t0 > self.timeout_s:
            self.timeout_cause = f"ran past the time limit of {self.timeout_s:g} s"
            return True
        if self.last_change is not None and now - self.last_change > self.stall_s:
            self.timeout_cause = f"no progress for {self.stall_s:g} s"
            return True
        if self.error_seen_at is None and any(self.run_dir.glob("error.rank*.json")):
            self.error_seen_at = now
        # a rank failed and the launcher did not end the job: end it here
        return self.error_seen_at is not None and now - self.error_seen_at > ERROR_GRACE_S


def _run(argv: list[str], run_dir: Path, mode: str, extra_env: Mapping[str, str], *, env: Mapping[str, str] | None,
         timeout_s: float, progress_timeout_s: float | None, done_file: str | None = None) -> _Ended:
    """Start the command, watch it, end every process of it; what happened. `done_file`: end the run as soon
    as that file is in the run's directory."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}.")
    if progress_timeout_s is not None and not progress_timeout_s > 0:
        raise ValueError(f"progress_timeout_s must be positive (or None: timeout_s), got {progress_timeout_s}.")
    watch = _Watch(run_dir, timeout_s=timeout_s, done_file=done_file,
                   stall_s=timeout_s if progress_timeout_s is None else progress_timeout_s)
    log_path = run_dir / LOG_FILE
    t0 = time.perf_counter()
    token = _write_token(run_dir)
    proc: subprocess.Popen | None = None
    tree: _ProcessTree | None = None
    errors: list[dict] = []
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=_run_env(run_dir, mode, extra_env, env, token), start_new_session=True)
        tree = _ProcessTree(proc, run_dir)
        while True:
            tree.scan()
            if proc.poll() is not None or watch.over():
                break
            time.sleep(_POLL_S)
        errors = _errors(run_dir)  # before anything is signalled: errors caused by ending it do not count
    finally:
        with held():  # a second SIGTERM or Ctrl-C does not stop the ending of the run half-way
            if tree is None and proc is not None:  # interrupted as it started
                tree = _ProcessTree(proc, run_dir)
            if tree is not None:
                tree.end()
            (run_dir / TOKEN_FILE).unlink(missing_ok=True)  # the proof is spent: the variables prove nothing now
    if not errors and watch.timeout_cause is None:
        errors = _errors(run_dir)
    assert proc is not None
    return _Ended(returncode=proc.returncode, wall_s=time.perf_counter() - t0, timeout_cause=watch.timeout_cause,
                  errors=errors, log_tail=_log_tail(log_path))


def _make_dir(workdir: str | os.PathLike[str] | None, prefix: str) -> Path:
    if workdir is not None:
        Path(workdir).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=None if workdir is None else os.fspath(workdir)))


# ===================================================================================================
# The public calls
# ===================================================================================================
def _trial_result(plan: Plan, ended: _Ended, result: Any, run_dir: Path) -> TrialResult:
    done = isinstance(result, dict) and result.get("status") == "ok" and isinstance(result.get("step_s"), (int, float))
    status, cause = _classify(ended, done=done)
    if status == "ok":
        assert isinstance(result, dict)
        return TrialResult(
            status="ok", plan=plan, step_s=float(result["step_s"]), tokens_per_s=result.get("tokens_per_s"),
            samples_per_s=result.get("samples_per_s"),
            peak_allocated_bytes=tuple(int(b) for b in result.get("peak_allocated_bytes", ())),
            peak_reserved_bytes=tuple(int(b) for b in result.get("peak_reserved_bytes", ())),
            wall_s=ended.wall_s, cause=None, returncode=ended.returncode, log_tail=ended.log_tail)
    progress = _progress_files(run_dir)  # the peaks each rank had reached, when every rank reported
    ranks = sorted(progress)
    known = ranks == list(range(plan.world_size))
    return TrialResult(
        status=status, plan=plan, step_s=None, tokens_per_s=None, samples_per_s=None,
        peak_allocated_bytes=tuple(int(progress[r].get("peak_allocated_bytes", 0)) for r in ranks) if known else (),
        peak_reserved_bytes=tuple(int(progress[r].get("peak_reserved_bytes", 0)) for r in ranks) if known else (),
        wall_s=ended.wall_s, cause=cause, returncode=ended.returncode, log_tail=ended.log_tail)


def run_trial(argv: Sequence[str], plan: Plan, *, steps: int = 10, warmup: int = 3, timeout_s: float = 600.0,
              progress_timeout_s: float | None = None, env: Mapping[str, str] | None = None,
              workdir: str | os.PathLike[str] | None = None) -> TrialResult:
    """Run the user's launch command once with `plan` and measure it.

    `argv` is the command as a list (no shell), e.g. `["torchrun", "--nproc-per-node", "8", "train.py"]`;
    its script calls `autopar.wrap`, which applies `plan`; the loop's optimizer steps are timed (`steps`
    after `warmup`), the result is written and the run ends. The run gets its own session; on failure, a
    timeout (`timeout_s` overall, or no optimizer step for `progress_timeout_s`, default `timeout_s`) or
    success, no process of it is left when this returns. `env` adds to this process's environment.
    `workdir`: where the trial's directory is made and kept (default: a temporary one, removed after).
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be an autopar.Plan, got {type(plan).__name__}.")
    for name, value, low in (("steps", steps, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer of at least {low}, got {value!r}.")
    argv = _check_argv(argv)
    check_launchable(argv, env)
    run_dir = _make_dir(workdir, "autopar-trial-")
    try:
        plan.save(run_dir / PLAN_FILE)
        ended = _run(argv, run_dir, "trial", {ENV_STEPS: str(steps), ENV_WARMUP: str(warmup)}, env=env,
                     timeout_s=timeout_s, progress_timeout_s=progress_timeout_s)
        return _trial_result(plan, ended, _read_json(run_dir / RESULT_FILE), run_dir)
    finally:
        if workdir is None:
            shutil.rmtree(run_dir, ignore_errors=True)


def _probe_result(data: dict) -> ProbeResult:
    return ProbeResult(
        profile=ModelProfile.from_dict(data["profile"]),
        variants={k: ModelProfile.from_dict(v) for k, v in data.get("variants", {}).items()},
        topology=Topology.from_dict(data["topology"]), world_size=int(data["world_size"]),
        global_batch_size=int(data["global_batch_size"]), model_fingerprint=str(data["model_fingerprint"]),
        loop=_probe_loop(data))


def _probe_loop(data: Mapping[str, Any]) -> Loop | None:
    """The script's loop from probe.json: `loop`, or from a probe written before the loop had three values,
    `uses_train_step` (True: TRAIN_STEP, False: PLAIN); None when neither was recorded."""
    loop = data.get("loop")
    if isinstance(loop, str) and loop in {m.value for m in Loop}:
        return Loop(loop)
    old = data.get("uses_train_step")
    return (Loop.TRAIN_STEP if old else Loop.PLAIN) if isinstance(old, bool) else None


def probe(argv: Sequence[str], *, timeout_s: float = 600.0, env: Mapping[str, str] | None = None,
          workdir: str | os.PathLike[str] | None = None) -> ProbeResult:
    """Run the user's launch command in probe mode: its `autopar.wrap` profiles the model (as it would to
    choose a plan) and writes the profile, the bf16 traces where the hardware has bf16, the topology, the
    world size and the global batch; the run is ended as soon as that file is there (a run that wrote it is
    a successful probe, whatever happens after). Raises ProbeError when the run fails or times out before
    (with its cause and log tail)."""
    argv = _check_argv(argv)
    check_launchable(argv, env)
    run_dir = _make_dir(workdir, "autopar-probe-")
    try:
        ended = _run(argv, run_dir, "probe", {}, env=env, timeout_s=timeout_s, progress_timeout_s=None,
                     done_file=PROBE_FILE)
        data = _read_json(run_dir / PROBE_FILE)
        if isinstance(data, dict):
            return _probe_result(data)
        status, cause = _classify(ended, done=False)
        raise ProbeError(f"the probe run failed ({status}: {cause}); its last output:\n{ended.log_tail[-2000:]}",
                         status=status, cause=cause, returncode=ended.returncode, log_tail=ended.log_tail)
    finally:
        if workdir is None:
            shutil.rmtree(run_dir, ignore_errors=True)
