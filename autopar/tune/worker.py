"""The run's side of a tuner's trial or probe: the `WrapHook` installed in the process the tuner launched.

The tuner (autopar.tune.launcher) starts the user's command with `AUTOPAR_TRIAL_*` set; `install_from_env`,
called when autopar is imported, reads them and installs, in that process only (and only when the tuner's proof
is there: `AUTOPAR_TRIAL_TOKEN` equals the token the launcher wrote, private, into the run's own directory, and
removes when the run ends; variables left over in a shell are ignored, with one warning, and the run is normal):

- **"trial"**: a hook whose `plan_override` is the trial's `plan.yaml` and whose `applied` installs the
  step recorder, a global optimizer-step hook that times `steps` steps after `warmup` (device
  synchronised), gathers every rank's peak memory, writes `result.json` (rank 0) and ends the run from
  the loop's optimizer step, after wrap returned.
- **"probe"**: a hook whose `profiled` writes `probe.json` (rank 0: the profile, the bf16 traces where the
  hardware has bf16, the topology, the world and the global batch) and returns; wrap goes on, and the
  tuner ends the run as soon as the file is there (else it ends itself at the loop's first optimizer step).
- an error hook (chained to the previous `sys.excepthook`) that writes `error.rank{r}.json`, classified
  as out of memory or not, when an exception escapes the script.

Every rank rewrites `progress.rank{r}.json` as it goes: the tuner's sign of life, and the pid it must end.
Nothing in this module ends a process from inside `wrap`. Outside a tuner's run it does nothing.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import resource
import stat
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .._util.dist import local_device
from .._util.env import env_int
from .._util.io import atomic_write_text
from .._util.state_steps import in_state_step
from .._util.trial_run import mark_trial_run
from ..errors import AutoparError
from ..hooks import Profiled, WrapHook, set_wrap_hook, wrap_hook
from ..planning import bf16_variants
from ..plans import Plan
from ..profile import ModelProfile

ENV_DIR = "AUTOPAR_TRIAL_DIR"  # a directory the tuner made; the run reads plan.yaml there and writes its files there
ENV_MODE = "AUTOPAR_TRIAL_MODE"  # "trial" (apply plan.yaml, time, end) or "probe" (write the profile)
ENV_STEPS = "AUTOPAR_TRIAL_STEPS"  # timed optimizer steps (after warm-up)
ENV_WARMUP = "AUTOPAR_TRIAL_WARMUP"  # warm-up optimizer steps (compile, allocator)
ENV_TOKEN = "AUTOPAR_TRIAL_TOKEN"  # the launcher's proof that it started this run: equals TOKEN_FILE's content
ENV_NAMES = (ENV_DIR, ENV_MODE, ENV_STEPS, ENV_WARMUP, ENV_TOKEN)
ENV_PREFIX = "AUTOPAR_TRIAL_"

MODES = ("trial", "probe")
PLAN_FILE = "plan.yaml"
RESULT_FILE = "result.json"
PROBE_FILE = "probe.json"
TOKEN_FILE = "token"  # in the run's directory, 0600, written by the launcher before the run and removed after it
DEFAULT_STEPS = 10
DEFAULT_WARMUP = 3
_SET_BY = "autopar's tuner sets it"  # as env_int's messages say who sets a variable
PROGRESS_EVERY_S = 0.25  # a rank rewrites its progress file at most this often (and at every phase change)


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _peaks() -> tuple[int, int]:
    """This rank's peak allocated and reserved device memory (0, 0 on CPU)."""
    if torch.cuda.is_available():
        try:
            return int(torch.cuda.max_memory_allocated()), int(torch.cuda.max_memory_reserved())
        except RuntimeError:
            return 0, 0
    return 0, 0


def _peak_rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * (1 if sys.platform == "darwin" else 1024)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def is_oom(exc: BaseException) -> bool:
    """True for an out-of-memory error (host or device)."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return "out of memory" in str(exc).lower()


class RunDir:
    """The directory of one run, as this rank sees it: its files, its progress, whether it has ended."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.ended = False  # set once the run wrote its result: errors after that do not count
        self._progress_at = 0.0

    def write_json(self, name: str, data: Mapping[str, Any], *, durable: bool = True) -> None:
        atomic_write_text(self.path / name, json.dumps(data), durable=durable)

    def progress(self, phase: str, step: int = 0, *, force: bool = True) -> None:
        """Rewrite this rank's progress file: the tuner's sign of life, and the pid it must end on failure."""
        now = time.monotonic()
        if not force and now - self._progress_at < PROGRESS_EVERY_S:
            return
        self._progress_at = now
        rank = _rank()
        alloc, reserved = _peaks()
        try:
            self.write_json(f"progress.rank{rank}.json", {
                "rank": rank, "pid": os.getpid(), "phase": phase, "step": step, "time": time.time(),
                "peak_allocated_bytes": alloc, "peak_reserved_bytes": reserved},
                durable=False)  # rewritten during the timed steps: no fsync there
        except OSError:  # the tuner removed the directory: it has given up on this run
            pass

    def end(self) -> None:
        """End this rank's run cleanly, from the loop's optimizer step: wait for every rank, leave the process
        group, exit 0."""
        self.ended = True
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError, AttributeError):  # closed or replaced by the script
                stream.flush()
        if dist.is_available() and dist.is_initialized():
            if dist.get_world_size() > 1:
                dist.barrier()
            dist.destroy_process_group()
        raise SystemExit(0)


class ErrorHook:
    """`sys.excepthook` in a tuner's run: writes error.rank{r}.json, then calls the hook it replaced."""

    def __init__(self, run: RunDir, previous: Callable[..., Any]) -> None:
        self.run, self.previous = run, previous

    def __call__(self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if self.run.ended:  # the run already wrote its result; an error in the script's cleanup after it
            # (e.g. an unguarded dist.destroy_process_group() in a `finally:`) does not undo the measurement
            stream = sys.__stderr__ or sys.stderr  # torch's own excepthook captures sys.stderr around ours
            print(f"[autopar] trial: the run had ended; ignoring {exc_type.__name__}: {exc}", file=stream, flush=True)
            os._exit(0)
        rank = _rank()
        line = f"{exc_type.__name__}: {exc}".strip().splitlines()
        try:
            self.run.write_json(f"error.rank{rank}.json", {
                "rank": rank, "pid": os.getpid(), "time": time.time(), "type": exc_type.__name__,
                "message": str(exc)[:2000], "line": (line[0] if line else exc_type.__name__)[:500],
                "oom": is_oom(exc)})
        except OSError:
            pass
        self.previous(exc_type, exc, tb)


class StepRecorder:
    """The global optimizer-step hook of a trial: counts the steps of the first optimizer that steps, times
    `steps` of them after `warmup`, then writes the result and ends the run."""

    def __init__(self, run: RunDir, plan: Plan, profile: ModelProfile, *, warmup: int, steps: int) -> None:
        self.run, self.plan, self.profile, self.warmup, self.steps = run, plan, profile, warmup, steps
        self.optimizer_id: int | None = None
        self.count = 0
        self.t0: float | None = None
        self.handle: Any = None
        if warmup == 0:
            _sync()
            self.t0 = time.perf_counter()

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if in_state_step():  # autopar.save / load making optimizer state: no training step
            return
        if self.optimizer_id is None:
            self.optimizer_id = id(optimizer)
        elif id(optimizer) != self.optimizer_id:
            return
        self.count += 1
        n = self.count
        if n == self.warmup:
            self.run.progress("timed", n)  # before the clock starts
            _sync()
            self.t0 = time.perf_counter()
            return
        if n >= self.warmup + self.steps:
            _sync()
            self.finish((time.perf_counter() - (self.t0 or 0.0)) / self.steps)
        self.run.progress("timed" if n > self.warmup else "warmup", n, force=False)

    def _gather(self, step_s: float) -> list[list[float]]:
        """Every rank's figures (one all_gather of numbers: nothing pickled, no shared files)."""
        alloc, reserved = _peaks()
        mine = [step_s, float(alloc), float(reserved), float(_peak_rss_bytes())]
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return [mine]
        device = local_device() if dist.get_backend() == "nccl" else torch.device("cpu")
        local = torch.tensor(mine, dtype=torch.float64, device=device)  # exact for bytes below 2**53
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        return [p.cpu().tolist() for p in parts]

    def finish(self, step_s: float) -> None:
        """Rank 0 writes result.json; then the run ends."""
        if self.handle is not None:
            self.handle.remove()
        rows = self._gather(step_s)
        self.run.progress("done", self.count)
        if _rank() == 0:
            step = max(r[0] for r in rows)
            batch = self.plan.global_batch_size
            tokens = self.profile.tokens_per_sample
            self.run.write_json(RESULT_FILE, {
                "status": "ok", "plan_key": self.plan.key(), "world_size": len(rows), "warmup": self.warmup,
                "steps": self.steps, "step_s": step, "step_s_per_rank": [r[0] for r in rows],
                "samples_per_s": batch / step if step > 0 else None,
                "tokens_per_s": batch * tokens / step if tokens and step > 0 else None,
                "peak_allocated_bytes": [int(r[1]) for r in rows], "peak_reserved_bytes": [int(r[2]) for r in rows],
                "peak_rss_bytes": [int(r[3]) for r in rows]})
        self.run.end()


class TrialHook(WrapHook):
    """A trial run: wrap applies the trial's plan; the recorder times the loop and ends the run."""

    def __init__(self, run: RunDir, *, warmup: int, steps: int) -> None:
        self.run, self.warmup, self.steps = run, warmup, steps
        self.recorder: StepRecorder | None = None

    def plan_override(self) -> Path | None:
        self.run.progress("wrap")
        if self.recorder is not None:  # a second wrap in one script (a GAN's, a teacher's): its own plan, for the
            return None  # trial's plan was made for the first model (applied to another, it was refused)
        return self.run.path / PLAN_FILE

    def profiled(self, event: Profiled) -> None:
        self.run.progress("profiled")

    def applied(self, model: nn.Module, plan: Plan, profile: ModelProfile) -> None:
        if self.recorder is not None:
            return  # a second wrap in one script: the first model's loop is the one timed
        self.recorder = StepRecorder(self.run, plan, profile, warmup=self.warmup, steps=self.steps)
        self.recorder.handle = register_optimizer_step_post_hook(self.recorder)
        self.run.progress("applied")


class ProbeHook(WrapHook):
    """A probe run: rank 0 writes what wrap profiled, and wrap goes on; the tuner ends the run once the file
    is there. Should the run reach its loop first, it ends at the first optimizer step, before it."""

    def __init__(self, run: RunDir) -> None:
        self.run = run
        self.handle: Any = None
        self.written = False

    def plan_override(self) -> None:
        self.run.progress("wrap")

    def profiled(self, event: Profiled) -> None:
        if self.written:  # a second wrap in one script: the study tunes the first model, the one trials time
            return
        self.written = True
        if _rank() == 0:
            variants = bf16_variants(event.model, event.sample, event.topology, loss_fn=event.loss_fn,
                                     blocks=event.blocks, profile=event.profile)  # as wrap's own choice reads them
            self.run.write_json(PROBE_FILE, {
                "profile": event.profile.to_dict(), "variants": {k: v.to_dict() for k, v in variants.items()},
                "topology": event.topology.to_dict(), "world_size": event.world_size,
                "global_batch_size": event.global_batch_size, "model_fingerprint": event.profile.fingerprint,
                "loop": event.loop.value, "uses_train_step": event.uses_train_step})  # the latter for older readers
        self.run.progress("probed")

    def applied(self, model: nn.Module, plan: Plan, profile: ModelProfile) -> None:
        if self.handle is None:
            self.handle = register_optimizer_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if in_state_step():  # autopar.load making optimizer state before the loop: not the loop yet
            return
        self.handle.remove()
        self.run.progress("done")
        self.run.end()


class TrialEnvIgnoredWarning(UserWarning):
    """`AUTOPAR_TRIAL_*` variables are set in a process autopar's tuner did not launch: they are ignored."""


_warned = False


def _file_token(run_dir: str) -> str | None:
    """The token in `run_dir`/TOKEN_FILE when it is a regular file of this user that no one else can read or
    write (not followed through a link); None otherwise."""
    try:
        fd = os.open(os.path.join(run_dir, TOKEN_FILE), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077 or st.st_size > 4096:
            return None
        return os.read(fd, 4096).decode("ascii", errors="replace").strip() or None
    except OSError:
        return None
    finally:
        os.close(fd)


def launched_by_tuner(environ: Mapping[str, str]) -> bool:
    """True when the tuner launched this run: the token in `AUTOPAR_TRIAL_TOKEN` is the one the launcher wrote
    into the directory `AUTOPAR_TRIAL_DIR` names (and removes when the run ends)."""
    token, run_dir = environ.get(ENV_TOKEN, ""), environ.get(ENV_DIR, "")
    if not token or not run_dir or not os.path.isdir(run_dir):
        return False
    found = _file_token(run_dir)
    return found is not None and hmac.compare_digest(found.encode(), token.encode())


def _ignore(environ: Mapping[str, str]) -> None:
    """Warn, once a process, that the AUTOPAR_TRIAL_* variables set here are ignored."""
    global _warned
    if _warned:
        return
    _warned = True
    names = sorted(n for n in environ if n.startswith(ENV_PREFIX))
    warnings.warn(f"autopar: {', '.join(names)} {'is' if len(names) == 1 else 'are'} set but this process was not "
                  "launched by `autopar tune`; ignoring them (the run is a normal one): unset them "
                  f"(unset {' '.join(names)}).", TrialEnvIgnoredWarning, stacklevel=3)


@dataclass(frozen=True)
class RunEnv:
    """What the tuner's environment says about this process's run."""

    mode: str
    path: Path

    @staticmethod
    def read(environ: Mapping[str, str]) -> RunEnv | None:
        """None outside a tuner's run, and where AUTOPAR_TRIAL_* variables are set without the tuner's proof
        (`launched_by_tuner`; a warning, once); an AutoparError when the tuner's run has a wrong mode."""
        if not any(value for name, value in environ.items() if name.startswith(ENV_PREFIX)):
            return None
        if not launched_by_tuner(environ):
            _ignore(environ)
            return None
        mode = environ.get(ENV_MODE)
        if mode not in MODES:
            raise AutoparError(f"{ENV_MODE}={mode!r}: expected one of {', '.join(MODES)} (set by autopar's tuner).")
        return RunEnv(mode=mode, path=Path(environ[ENV_DIR]))


def install_from_env() -> WrapHook | None:
    """In a run the tuner launched: install its wrap hook and error hook (once) and return the wrap hook.
    Elsewhere: do nothing and return None."""
    run_env = RunEnv.read(os.environ)
    if run_env is None:
        return None
    current = wrap_hook()
    if isinstance(current, (TrialHook, ProbeHook)):
        return current
    run = RunDir(run_env.path)
    hook: WrapHook
    if run_env.mode == "trial":
        hook = TrialHook(run, warmup=env_int(ENV_WARMUP, DEFAULT_WARMUP, minimum=0, set_by=_SET_BY),
                         steps=env_int(ENV_STEPS, DEFAULT_STEPS, minimum=1, set_by=_SET_BY))
    else:
        hook = ProbeHook(run)
    sys.excepthook = ErrorHook(run, sys.excepthook)
    set_wrap_hook(hook)
    mark_trial_run(run_env.mode)  # autopar.save writes nothing in a tuner's run
    return hook
