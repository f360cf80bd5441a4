"""autopar's error types. Every message says what was wrong and what to change."""

from __future__ import annotations


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose."""


class PlanError(AutoparError, ValueError):
    """A Plan that is inconsistent in itself, or with the world, batch or model it is applied to."""


class PlanMismatchError(PlanError):
    """A plan (file) made for another model, world size or topology. Pass `force=True` to apply it anyway."""


class ProfileError(AutoparError, ValueError):
    """The model or sample cannot be profiled as given (no parameters, blocks not found, bad sample)."""


class TopologyError(AutoparError, ValueError):
    """A topology spec that cannot be parsed, or hardware that cannot run the plan."""


class InfeasiblePlanError(AutoparError):
    """No plan fits the hardware (memory), or a requested plan cannot fit."""


class TraceError(ProfileError):
    """The model could not run one training step on fake tensors; the structure (blocks, parameters) may still
    be read, so a given plan can be applied. The original exception is the `__cause__`."""


class UntracedWarning(UserWarning):
    """`autopar.plan` could not trace the model's step on fake tensors and returns a safe plan from the model's
    structure, without a prediction; the message says why and what to change."""


class CacheError(AutoparError):
    """A cache file or folder (plan cache, calibration cache) that autopar refuses: tampered, not ours,
    writable by others, not plain YAML, another key's entry. The message names the path and says what to do."""


class ModelSpecError(AutoparError, ValueError):
    """A MODEL argument that names no built-in spec, no readable Hugging Face config and no importable factory."""


class ExactCheckUnavailable(AutoparError):
    """The torch here lacks what the exact check needs (MemTracker, the fake process group)."""


class ProbeError(AutoparError):
    """The probe run did not write its profile: it failed, exited without calling autopar.wrap, or timed out.
    `status`, `cause`, `returncode` and `log_tail` say how the run ended (as a trial's result does)."""

    def __init__(self, message: str, *, status: str, cause: str | None, returncode: int | None, log_tail: str) -> None:
        super().__init__(message)
        self.status, self.cause, self.returncode, self.log_tail = status, cause, returncode, log_tail


class MaterializeError(AutoparError):
    """A meta-device model whose initialisation left tensors without values (they would train on whatever
    bytes the memory held)."""


class StaleOptimizerError(AutoparError):
    """An optimizer steps parameters that autopar.wrap replaced (built before wrap): it would train nothing."""


class TuneError(AutoparError, ValueError):
    """A tuning study asked for with options it cannot run (a count or a time budget out of range)."""


class StorageError(AutoparError):
    """A place autopar must write (a cache folder, the study file or its folder, --plan-out) that it cannot
    write, or a study file it cannot read (not SQLite, or damaged). `path` is the file or folder; the message
    names it and what to change (AUTOPAR_CACHE_DIR, --study, --plan-out)."""

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


class ResultNotSavedError(StorageError):
    """A study measured its plans but a place its result goes (the plan cache, --plan-out) could not be
    written. `report` is the study's TuneReport (its best plan included): nothing measured is lost, and the
    study file still holds every trial. The message says where the best plan is and how to cache it."""

    def __init__(self, message: str, *, path: str, report: object) -> None:
        super().__init__(message, path=path)
        self.report = report


class StudyLockedError(StorageError):
    """Another tuner holds the study's lock (`path`, STUDY.lock): refused at once, before any probe or trial."""


class TuneInterrupted(KeyboardInterrupt):
    """The tuner got SIGTERM or SIGINT (`signum`): the run in flight was ended and its trial recorded as
    interrupted. A KeyboardInterrupt, so that nothing catching Exception stops it; `autopar tune` exits 128+signum."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class LaunchError(TuneError):
    """The tuner's launch command cannot start: its program is not on PATH (or not executable), or the
    training script it names does not exist. Raised before any run."""


class EnvironmentVariableError(AutoparError, ValueError):
    """An environment variable autopar reads (torchrun's WORLD_SIZE, RANK, MASTER_ADDR..., the tuner's) is
    missing or not a valid value; the message names it, its value and who sets it."""


class SampleError(ProfileError):
    """A `sample=` that does not fit the model's forward (a keyword it does not take, an argument it needs that
    the sample lacks). Raised before any trace: the sample is wrong, not the model."""


class LossError(AutoparError, ValueError):
    """autopar.train_step without `loss_fn` on a model whose output carries no loss (no `.loss`, not a scalar), or a
    `compute_loss` that returns something other than a one-element tensor."""


class PeerBatchError(PlanError):
    """The ranks of one tensor- or pipeline-parallel group were given different batches (they must read the
    same samples: autopar.dataloader / autopar.data_shard shard by data-parallel rank only)."""
