"""Isolated trial runs: the user's own launch command, run once per plan, measured, and always ended.

Two sides share one contract of environment variables and files in a directory the tuner makes:

- **The tuner** (`run_trial`, `probe`) writes `plan.yaml` there, starts the user's command (an argv list, no
  shell) in its own session and process group with `AUTOPAR_TRIAL_*` set, watches it (its exit, an overall
  time limit, and per-rank progress files), ends the whole group on failure (SIGTERM, then SIGKILL, until
  no process of it is left), and reads back one JSON result.
- **The run** (`autopar.wrap` in the user's script) sees `AUTOPAR_TRIAL_MODE`: in "probe" mode it profiles
  the model, writes `probe.json` and ends; in "trial" mode it applies `plan.yaml` instead of choosing,
  counts optimizer steps with a global optimizer-step hook, times `steps` steps after `warmup` (device
  synchronised), records every rank's peak memory, writes `result.json` and ends the run. An exception
  escaping the script writes `error.rank{r}.json` (classified as "oom" or "crash").

Only JSON and `Plan.load` (yaml.safe_load) are read from the directory: nothing there is executed or
unpickled. A trial never writes outside its directory (the user's files are not touched).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from .._util.io import atomic_write_text
from ..errors import AutoparError
from ..plans import Plan

if TYPE_CHECKING:  # pragma: no cover
    from ..profile import ModelProfile
    from ..topology import Topology

ENV_DIR = "AUTOPAR_TRIAL_DIR"  # a directory the tuner made; wrap reads plan.yaml there and writes results there
ENV_MODE = "AUTOPAR_TRIAL_MODE"  # "trial" (apply plan.yaml, time, end) or "probe" (write the profile, end)
ENV_STEPS = "AUTOPAR_TRIAL_STEPS"  # timed optimizer steps (after warm-up)
ENV_WARMUP = "AUTOPAR_TRIAL_WARMUP"  # warm-up optimizer steps (compile, allocator)
ENV_INJECT = "AUTOPAR_TRIAL_INJECT"  # testing aid only: "oom:RANK", "crash:RANK" or "hang:RANK" (a fault on that rank)

MODES = ("trial", "probe")
STATUSES = ("ok", "oom", "crash", "exit", "timeout")
FAULTS = ("oom", "crash", "hang")

PLAN_FILE = "plan.yaml"
RESULT_FILE = "result.json"
PROBE_FILE = "probe.json"
LOG_FILE = "log.txt"
LOG_TAIL_CHARS = 4000
#: how long the launcher may take to end by itself after a rank reported an error (torchrun needs < 1 s)
ERROR_GRACE_S = 5.0
#: after SIGTERM, how long the group may take to end before SIGKILL
TERM_GRACE_S = 5.0
_POLL_S = 0.1
_PROGRESS_EVERY_S = 0.25  # a rank rewrites its progress file at most this often (and at every phase change)


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
    uses_train_step: bool | None = None  # what the script passed to wrap (None: not recorded)


class ProbeError(AutoparError):
    """The probe run did not write its profile: it failed, exited without calling autopar.wrap, or timed out."""

    def __init__(self, message: str, *, status: str, cause: str | None, returncode: int | None, log_tail: str) -> None:
        super().__init__(message)
        self.status, self.cause, self.returncode, self.log_tail = status, cause, returncode, log_tail


# ===================================================================================================
# Inside the run (called from autopar.wrap)
# ===================================================================================================
_STATE: dict[str, Any] = {}


def trial_mode() -> str | None:
    """"trial" or "probe" when this process runs under run_trial / probe, else None."""
    mode = os.environ.get(ENV_MODE)
    if not mode:
        return None
    if mode not in MODES:
        raise AutoparError(f"{ENV_MODE}={mode!r}: expected one of {', '.join(MODES)} (set by autopar's tuner).")
    if not os.environ.get(ENV_DIR) or not os.path.isdir(os.environ[ENV_DIR]):
        raise AutoparError(f"{ENV_MODE}={mode} needs {ENV_DIR}, the directory the tuner made for this run "
                           f"(got {os.environ.get(ENV_DIR)!r}).")
    return mode


def _run_dir() -> Path:
    return Path(os.environ[ENV_DIR])


def plan_path() -> Path:
    """The plan a trial applies (written by run_trial)."""
    return _run_dir() / PLAN_FILE


def _env_int(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(name)
    try:
        value = int(raw) if raw not in (None, "") else default
    except ValueError:
        raise AutoparError(f"{name}={raw!r} must be an integer (set by autopar's tuner).") from None
    if value < minimum:
        raise AutoparError(f"{name}={value} must be at least {minimum}.")
    return value


def parse_inject(spec: str | None) -> tuple[str, int] | None:
    """("oom" | "crash" | "hang", rank) from "KIND:RANK", or None."""
    if spec is None or spec == "":
        return None
    m = re.fullmatch(rf"({'|'.join(FAULTS)}):(\d+)", spec.strip())
    if not m:
        raise ValueError(f"fault injection {spec!r}: expected 'oom:RANK', 'crash:RANK' or 'hang:RANK' "
                         f"(a testing aid, {ENV_INJECT}).")
    return m.group(1), int(m.group(2))


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Atomically (a reader never sees half a file)."""
    atomic_write_text(path, json.dumps(data))


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _peaks() -> tuple[int, int]:
    import torch

    if torch.cuda.is_available():
        try:
            return int(torch.cuda.max_memory_allocated()), int(torch.cuda.max_memory_reserved())
        except Exception:
            return 0, 0
    return 0, 0


def _peak_rss_bytes() -> int:
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * (1 if sys.platform == "darwin" else 1024)
    except Exception:
        return 0


def _progress(phase: str, step: int = 0, *, force: bool = True) -> None:
    """Rewrite this rank's progress file: the tuner's sign of life, and the pids it must end on failure."""
    now = time.monotonic()
    if not force and now - _STATE.get("progress_at", 0.0) < _PROGRESS_EVERY_S:
        return
    _STATE["progress_at"] = now
    rank = _rank()
    alloc, reserved = _peaks()
    try:
        _write_json(_run_dir() / f"progress.rank{rank}.json", {
            "rank": rank, "pid": os.getpid(), "pgid": os.getpgid(0), "sid": os.getsid(0), "phase": phase,
            "step": step, "time": time.time(), "peak_allocated_bytes": alloc, "peak_reserved_bytes": reserved})
    except OSError:  # the tuner removed the directory: it has given up on this run
        pass


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return "out of memory" in str(exc).lower()


def _excepthook(exc_type: type, exc: BaseException, tb: Any) -> None:
    if _STATE.get("ended"):  # the run already wrote its result; an error in the script's cleanup after it
        # (e.g. an unguarded dist.destroy_process_group() in a `finally:`) does not undo the measurement
        stream = sys.__stderr__ or sys.stderr  # torch's own excepthook captures sys.stderr around ours
        print(f"[autopar] trial: the run had ended; ignoring {exc_type.__name__}: {exc}", file=stream, flush=True)
        os._exit(0)
    try:
        rank = _rank()
        line = f"{exc_type.__name__}: {exc}".strip().splitlines()
        _write_json(_run_dir() / f"error.rank{rank}.json", {
            "rank": rank, "pid": os.getpid(), "time": time.time(), "type": exc_type.__name__,
            "message": str(exc)[:2000], "line": (line[0] if line else exc_type.__name__)[:500],
            "oom": _is_oom(exc)})
    except Exception:
        pass
    previous = _STATE.get("previous_excepthook") or sys.__excepthook__
    previous(exc_type, exc, tb)


def start_run() -> str | None:
    """At the start of wrap: the mode, and (in a trial or probe) the error hook and a first progress file."""
    mode = trial_mode()
    if mode is None:
        return None
    if not _STATE.get("hooked"):
        _STATE["hooked"] = True
        _STATE["previous_excepthook"] = sys.excepthook
        sys.excepthook = _excepthook
    _progress("wrap")
    return mode


def end_run() -> None:
    """End this rank's run cleanly: wait for every rank, leave the process group, exit 0."""
    import torch.distributed as dist

    _STATE["ended"] = True
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()
    raise SystemExit(0)


def after_profile(mode: str, model: Any, sample: Any, profile: Any, topology: Any, *, world_size: int,
                  global_batch_size: int, loss_fn: Any = None, blocks: Any = None,
                  uses_train_step: bool | None = None) -> None:
    """In wrap, once every rank has profiled: a trial records progress; a probe writes its file and ends."""
    if mode == "probe":
        write_probe(model, sample, profile, topology, world_size=world_size, global_batch_size=global_batch_size,
                    loss_fn=loss_fn, blocks=blocks, uses_train_step=uses_train_step)
    _progress("profiled")


def write_probe(model: Any, sample: Any, profile: Any, topology: Any, *, world_size: int, global_batch_size: int,
                loss_fn: Any = None, blocks: Any = None, uses_train_step: bool | None = None) -> None:
    """Probe mode: rank 0 writes probe.json (the profile, the bf16 traces where the hardware has bf16, the
    topology, the world and the global batch), then every rank ends the run."""
    if _rank() == 0:
        from ..planning import bf16_variants

        variants = bf16_variants(model, sample, topology, loss_fn=loss_fn, blocks=blocks)  # as wrap's choice reads
        _write_json(_run_dir() / PROBE_FILE, {
            "profile": profile.to_dict(), "variants": {k: v.to_dict() for k, v in variants.items()},
            "topology": topology.to_dict(), "world_size": world_size, "global_batch_size": global_batch_size,
            "model_fingerprint": profile.fingerprint, "uses_train_step": uses_train_step})
    _progress("probed")
    end_run()


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _inject(kind: str) -> None:
    import torch

    print(f"[autopar] trial: injecting a fault on rank {_rank()}: {kind} ({ENV_INJECT})", file=sys.stderr, flush=True)
    if kind == "oom":
        oom = getattr(torch.cuda, "OutOfMemoryError", None) or MemoryError
        raise oom("injected out of memory")
    if kind == "crash":
        raise RuntimeError("injected crash")
    while True:  # "hang"
        time.sleep(1.0)


class _Recorder:
    """The global optimizer-step hook of a trial: counts the steps of the first optimizer that steps, times
    `steps` of them after `warmup`, then writes the result and ends the run."""

    def __init__(self, plan: Plan, profile: Any, *, warmup: int, steps: int, fault: tuple[str, int] | None) -> None:
        self.plan, self.profile, self.warmup, self.steps, self.fault = plan, profile, warmup, steps, fault
        self.optimizer_id: int | None = None
        self.count = 0
        self.t0: float | None = None
        self.handle: Any = None
        if warmup == 0:
            _sync()
            self.t0 = time.perf_counter()

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.optimizer_id is None:
            self.optimizer_id = id(optimizer)
        elif id(optimizer) != self.optimizer_id:
            return
        self.count += 1
        n = self.count
        if n == self.warmup:
            _progress("timed", n)  # before the clock starts
            _sync()
            self.t0 = time.perf_counter()
            return
        if self.fault is not None and n == self.warmup + 1 and self.fault[1] == _rank():
            _inject(self.fault[0])
        if n >= self.warmup + self.steps:
            _sync()
            self.finish((time.perf_counter() - (self.t0 or 0.0)) / self.steps)
        _progress("timed" if n > self.warmup else "warmup", n, force=False)

    def finish(self, step_s: float) -> None:
        """Every rank's figures to rank 0 (one all_gather of numbers: nothing pickled, no shared files), which
        writes result.json; then the run ends."""
        import torch
        import torch.distributed as dist

        if self.handle is not None:
            self.handle.remove()
        rank = _rank()
        alloc, reserved = _peaks()
        mine = [step_s, float(alloc), float(reserved), float(_peak_rss_bytes())]
        rows = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            from .._util.dist import local_device

            device = local_device() if dist.get_backend() == "nccl" else torch.device("cpu")
            local = torch.tensor(mine, dtype=torch.float64, device=device)  # exact for bytes below 2**53
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, local)
            rows = [p.cpu().tolist() for p in parts]
        _progress("done", self.count)
        if rank == 0:
            step = max(r[0] for r in rows)
            batch = self.plan.global_batch_size
            tokens = getattr(self.profile, "tokens_per_sample", None)
            _write_json(_run_dir() / RESULT_FILE, {
                "status": "ok", "plan_key": self.plan.key(), "world_size": len(rows), "warmup": self.warmup,
                "steps": self.steps, "step_s": step, "step_s_per_rank": [r[0] for r in rows],
                "samples_per_s": batch / step if step > 0 else None,
                "tokens_per_s": batch * tokens / step if tokens and step > 0 else None,
                "peak_allocated_bytes": [int(r[1]) for r in rows], "peak_reserved_bytes": [int(r[2]) for r in rows],
                "peak_rss_bytes": [int(r[3]) for r in rows]})
        end_run()


def install_recorder(model: Any, plan: Plan, profile: Any) -> None:
    """Trial mode, after wrap applied the plan: time the loop's optimizer steps and end the run."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    if _STATE.get("recorder") is not None:
        return  # a second wrap in one script: the first model's loop is the one timed
    warmup = _env_int(ENV_WARMUP, 3, 0)
    steps = _env_int(ENV_STEPS, 10, 1)
    try:
        fault = parse_inject(os.environ.get(ENV_INJECT))
    except ValueError as exc:
        raise AutoparError(str(exc)) from None
    recorder = _Recorder(plan, profile, warmup=warmup, steps=steps, fault=fault)
    recorder.handle = register_optimizer_step_post_hook(recorder)
    _STATE["recorder"] = recorder
    _progress("applied")


# ===================================================================================================
# The tuner's side: launch, watch, end, classify
# ===================================================================================================
@dataclass
class _Proc:
    pid: int
    ppid: int
    pgid: int
    sid: int
    zombie: bool
    start: int  # start time in clock ticks since boot (tells a reused pid apart)


def _processes() -> dict[int, _Proc] | None:
    """Every process on this machine (Linux /proc), or None where /proc is not available."""
    if not os.path.isdir("/proc/self"):
        return None
    out: dict[int, _Proc] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2:].split()
        try:
            out[int(entry)] = _Proc(pid=int(entry), ppid=int(rest[1]), pgid=int(rest[2]), sid=int(rest[3]),
                                    zombie=rest[0] in ("Z", "X"), start=int(rest[19]))
        except (IndexError, ValueError):
            continue
    return out


class _Group:
    """The processes of one run: the launcher's session, and the sessions its descendants made (torchrun
    starts each worker in a session of its own). Sessions survive reparenting, so an orphan is still found."""

    def __init__(self, proc: subprocess.Popen, run_dir: Path) -> None:
        self.proc, self.run_dir = proc, run_dir
        self.sids: set[int] = {proc.pid}  # start_new_session: the launcher leads its own session and group
        self.pids: dict[int, int | None] = {}  # pid -> start time (None: unknown, from a progress file only)
        self._scanned = 0.0

    def scan(self, *, force: bool = False) -> dict[int, _Proc] | None:
        now = time.monotonic()
        if not force and now - self._scanned < 1.0:
            return None
        self._scanned = now
        procs = _processes()
        mine = os.getsid(0)
        for info in _progress_files(self.run_dir).values():  # each rank's own pid and session
            pid, sid = info.get("pid"), info.get("sid")
            if not isinstance(pid, int) or pid <= 1 or pid == os.getpid() or pid in self.pids:
                continue
            if procs is None:
                self.pids[pid] = None
            elif pid in procs and not procs[pid].zombie:  # recorded only while it is alive (no reused pids)
                self.pids[pid] = procs[pid].start
                if isinstance(sid, int) and sid == procs[pid].sid and sid > 1 and sid != mine:
                    self.sids.add(sid)
        if procs is None:
            return None
        children: dict[int, list[int]] = {}
        for p in procs.values():
            children.setdefault(p.ppid, []).append(p.pid)
        todo = [self.proc.pid]
        while todo:  # descendants of the launcher, while it is alive
            pid = todo.pop()
            for child in children.get(pid, ()):
                c = procs[child]
                self.pids[child] = c.start
                if c.sid != mine and c.sid > 1:
                    self.sids.add(c.sid)
                todo.append(child)
        return procs

    def alive(self) -> list[int]:
        """Pids of the run that still exist (zombies are dead); the launcher itself is reaped first."""
        self.proc.poll()
        procs = _processes()
        me = os.getpid()
        if procs is not None:
            out = []
            for p in procs.values():
                if p.zombie or p.pid == me:
                    continue
                known = self.pids.get(p.pid, -1)
                if p.sid in self.sids or (known != -1 and (known is None or known == p.start)):
                    out.append(p.pid)
            return out
        out = []
        for pid in [self.proc.pid, *self.pids]:
            try:
                os.kill(pid, 0)
                out.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
        return out

    def signal(self, sig: int) -> None:
        for sid in list(self.sids):  # session leaders' groups (the launcher's, each torchrun worker's)
            try:
                os.killpg(sid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in self.alive():
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def end(self) -> None:
        """SIGTERM to every process of the run, SIGKILL to what is left after TERM_GRACE_S, until none is left."""
        self.scan(force=True)
        if not self.alive():
            self.proc.wait()
            return
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE_S
        while self.alive() and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        for _ in range(50):
            if not self.alive():
                break
            self.signal(signal.SIGKILL)
            time.sleep(_POLL_S)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _progress_files(run_dir: Path) -> dict[int, dict]:
    out = {}
    for path in run_dir.glob("progress.rank*.json"):
        data = _read_json(path)
        if isinstance(data, dict) and isinstance(data.get("rank"), int):
            out[data["rank"]] = data
    return out


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


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


@dataclass
class _Ended:
    returncode: int | None
    wall_s: float
    timeout_cause: str | None  # set when the run was ended for taking too long
    errors: list[dict]  # error files written before the run ended (or before it was ended)
    log_tail: str


def _check_argv(argv: Sequence[str]) -> list[str]:
    if isinstance(argv, (str, bytes)) or not isinstance(argv, Sequence) or not argv:
        raise TypeError("argv must be the launch command as a non-empty list of strings (no shell), e.g. "
                        "['torchrun', '--nproc-per-node', '8', 'train.py'].")
    out = [os.fspath(a) for a in argv]
    if not all(isinstance(a, str) for a in out):
        raise TypeError(f"argv must hold strings only, got {argv!r}.")
    return out


def _run(argv: list[str], run_dir: Path, mode: str, extra_env: Mapping[str, str], *, env: Mapping[str, str] | None,
         timeout_s: float, progress_timeout_s: float | None) -> _Ended:
    """Start the command, watch it, end its whole group; what happened."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}.")
    if progress_timeout_s is not None and not progress_timeout_s > 0:
        raise ValueError(f"progress_timeout_s must be positive (or None: timeout_s), got {progress_timeout_s}.")
    stall_s = timeout_s if progress_timeout_s is None else progress_timeout_s
    full_env = {**os.environ, **(env or {})}
    for name in (ENV_DIR, ENV_MODE, ENV_STEPS, ENV_WARMUP, ENV_INJECT):
        full_env.pop(name, None)  # a stale setting from the caller's environment never leaks into the run
    full_env.setdefault("PYTHONUNBUFFERED", "1")  # a failing run's last lines reach the log
    full_env.update({ENV_DIR: str(run_dir), ENV_MODE: mode, **extra_env})
    log_path = run_dir / LOG_FILE
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True)
    group = _Group(proc, run_dir)
    timeout_cause: str | None = None
    errors: list[dict] = []
    last_sig: tuple = ()
    last_change: float | None = None  # the progress clock starts when a rank first reaches wrap
    error_seen_at: float | None = None
    try:
        while True:
            group.scan()
            if proc.poll() is not None:
                break
            now = time.monotonic()
            sig = _progress_signature(run_dir)
            if sig != last_sig:
                last_sig, last_change = sig, now
            if time.perf_counter() - t0 > timeout_s:
                timeout_cause = f"ran past the time limit of {timeout_s:g} s"
                break
            if last_change is not None and now - last_change > stall_s:
                timeout_cause = f"no progress for {stall_s:g} s"
                break
            if error_seen_at is None and any(run_dir.glob("error.rank*.json")):
                error_seen_at = now
            if error_seen_at is not None and now - error_seen_at > ERROR_GRACE_S:
                break  # a rank failed and the launcher did not end the job: end it here
            time.sleep(_POLL_S)
        errors = _errors(run_dir)  # before anything is signalled: errors caused by ending it do not count
    finally:
        group.end()
    if not errors and timeout_cause is None:
        errors = _errors(run_dir)
    return _Ended(returncode=proc.returncode, wall_s=time.perf_counter() - t0, timeout_cause=timeout_cause,
                  errors=errors, log_tail=_log_tail(log_path))


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


def _make_dir(workdir: str | os.PathLike[str] | None, prefix: str) -> Path:
    if workdir is not None:
        Path(workdir).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=None if workdir is None else os.fspath(workdir)))


def run_trial(argv: Sequence[str], plan: Plan, *, steps: int = 10, warmup: int = 3, timeout_s: float = 600.0,
              progress_timeout_s: float | None = None, env: Mapping[str, str] | None = None,
              workdir: str | os.PathLike[str] | None = None, inject: str | None = None) -> TrialResult:
    """Run the user's launch command once with `plan` and measure it.

    `argv` is the command as a list (no shell), e.g. `["torchrun", "--nproc-per-node", "8", "train.py"]`;
    its script calls `autopar.wrap`, which applies `plan`, times `steps` optimizer steps after `warmup`,
    writes the result and ends the run. The run gets its own session and process group; on failure, a
    timeout (`timeout_s` overall, or no optimizer step for `progress_timeout_s`, default `timeout_s`) or
    success, no process of it is left when this returns. `env` adds to this process's environment.
    `workdir`: where the trial's directory is made and kept (default: a temporary one, removed after).
    `inject` ("oom:RANK", "crash:RANK", "hang:RANK") is a testing aid: that fault on that rank at the first
    timed step.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be an autopar.Plan, got {type(plan).__name__}.")
    for name, value, low in (("steps", steps, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer of at least {low}, got {value!r}.")
    parse_inject(inject)
    argv = _check_argv(argv)
    run_dir = _make_dir(workdir, "autopar-trial-")
    try:
        plan.save(run_dir / PLAN_FILE)
        extra = {ENV_STEPS: str(steps), ENV_WARMUP: str(warmup)}
        if inject:
            extra[ENV_INJECT] = inject
        ended = _run(argv, run_dir, "trial", extra, env=env, timeout_s=timeout_s,
                     progress_timeout_s=progress_timeout_s)
        result = _read_json(run_dir / RESULT_FILE)
        done = isinstance(result, dict) and result.get("status") == "ok" and \
            isinstance(result.get("step_s"), (int, float))
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
    finally:
        if workdir is None:
            shutil.rmtree(run_dir, ignore_errors=True)


def probe(argv: Sequence[str], *, timeout_s: float = 600.0, env: Mapping[str, str] | None = None,
          workdir: str | os.PathLike[str] | None = None) -> ProbeResult:
    """Run the user's launch command in probe mode: its `autopar.wrap` profiles the model (as it would to
    choose a plan), writes the profile, the bf16 traces where the hardware has bf16, the topology, the world
    size and the global batch, and ends the run before anything is applied. Raises ProbeError when the
    run fails or times out (with its cause and log tail)."""
    from ..profile import ModelProfile
    from ..topology import Topology

    argv = _check_argv(argv)
    run_dir = _make_dir(workdir, "autopar-probe-")
    try:
        ended = _run(argv, run_dir, "probe", {}, env=env, timeout_s=timeout_s, progress_timeout_s=None)
        data = _read_json(run_dir / PROBE_FILE)
        status, cause = _classify(ended, done=isinstance(data, dict))
        if status != "ok":
            raise ProbeError(f"the probe run failed ({status}: {cause}); its last output:\n{ended.log_tail[-2000:]}",
                             status=status, cause=cause, returncode=ended.returncode, log_tail=ended.log_tail)
        assert isinstance(data, dict)
        return ProbeResult(
            profile=ModelProfile.from_dict(data["profile"]),
            variants={k: ModelProfile.from_dict(v) for k, v in data.get("variants", {}).items()},
            topology=Topology.from_dict(data["topology"]), world_size=int(data["world_size"]),
            global_batch_size=int(data["global_batch_size"]), model_fingerprint=str(data["model_fingerprint"]),
            uses_train_step=data.get("uses_train_step") if isinstance(data.get("uses_train_step"), bool) else None)
    finally:
        if workdir is None:
            shutil.rmtree(run_dir, ignore_errors=True)
