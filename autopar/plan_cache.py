"""The plan cache: the best plan the tuner found, kept under a key of model, topology, batch and torch.

One YAML file per key, `<root>/plans/<digest>.yaml`, where `<root>` is `autopar._util.io.cache_dir()`
($AUTOPAR_CACHE_DIR, else $XDG_CACHE_HOME/autopar, else ~/.cache/autopar) unless a `directory=` is given.
The key (`CacheKey`) is the model's fingerprint, the topology's fingerprint, the global batch, torch's
version (major.minor.patch and any pre-release part, without the local build tag: "2.13.0+cu128" keys as
"2.13.0") and the loop that drives the step (`autopar.plans.Loop`: plans for a plain loop, a framework that
accumulates and autopar.train_step are cached apart). The file name is the key's digest, so another model,
topology, batch, torch or loop never finds the entry. Files written before the loop had three values (their
key says `allow_train_step: true/false`) are read as Loop.TRAIN_STEP / Loop.PLAIN, under the same names.

A cache file is data autopar will act on, so it is read with care: `yaml.safe_load` only (a YAML tag such as
`!!python/object` is refused, never run), and a file or directory is refused (`CacheError`, saying what to
do) when it is a symlink, belongs to another user, can be written by the group or others, holds a key other
than the one asked for (a file copied over from another model, topology, batch or torch), or holds a plan
that is not valid (the privacy checks are `autopar._util.io`'s, shared with the calibration cache). Files
are written atomically (`atomic_write_text`) with mode 0600 in a directory created 0700.

`cached_plan_for` is what `wrap` calls: it returns the cached plan and a message to log, or (None, None)
when there is none, or (None, why) when the cached plan does not fit this job (a stale entry is ignored,
never a crash). A refused (tampered) file raises `CacheError`: autopar neither uses nor silently skips it.
`write_plan_out` is what `--plan-out` does.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import yaml

from ._util.compile_backend import COMPILE_BACKEND_ENV
from ._util.io import CacheWarning, atomic_write_text, cache_root, cache_subdir, read_private_bytes
from ._util.yaml_text import load_yaml
from .errors import AutoparError, CacheError, PlanError
from .plans import SCHEMA_VERSION as PLAN_SCHEMA_VERSION
from .plans import Loop, Plan

#: Version of the cache file layout (the top-level mapping). It is part of every key's digest, so files of
#: another layout are never read under this one's names.
CACHE_SCHEMA_VERSION = 2  # 2: keys carry the sample's size (sample_signature)
#: Larger cache files are refused unread (a plan file is about 1 KiB).
MAX_FILE_BYTES = 1 << 20

_FORMAT_FIELD = "autopar_plan_cache"
_TOP_LEVEL = (_FORMAT_FIELD, "key", "plan", "measurement", "stored_at")


# ---------------------------------------------------------------------------------------------------
# The key
# ---------------------------------------------------------------------------------------------------
def current_torch_version() -> str:
    """torch's version as keyed: the public version without the local build tag ("2.13.0+cu128" ->
    "2.13.0"; a pre-release such as "2.14.0a0" keeps its suffix). CPU and CUDA builds are told apart by
    the topology fingerprint, not by the version."""
    return str(torch.__version__).split("+", 1)[0]


@dataclass(frozen=True)
class CacheKey:
    """What a cached plan is valid for. `digest()` names its file."""

    model_fingerprint: str
    topology_fingerprint: str
    global_batch_size: int
    torch_version: str
    loop: Loop
    sample_signature: str = ""  # the sample's size per sample (sample_signature); "" given only a fingerprint

    def __post_init__(self) -> None:
        if not isinstance(self.sample_signature, str):
            raise CacheError(f"CacheKey.sample_signature must be a string, got {self.sample_signature!r}.")
        for name in ("model_fingerprint", "topology_fingerprint", "torch_version"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise CacheError(f"CacheKey.{name} must be a non-empty string, got {value!r}.")
        n = self.global_batch_size
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise CacheError(f"CacheKey.global_batch_size must be a positive integer, got {n!r}.")
        if not isinstance(self.loop, Loop):
            raise CacheError(f"CacheKey.loop must be an autopar Loop ({', '.join(m.value for m in Loop)}), "
                             f"got {self.loop!r}.")

    @property
    def allow_train_step(self) -> bool:
        """Whether the key's loop is autopar.train_step (the key's field before the loop had three values)."""
        return self.loop is Loop.TRAIN_STEP

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "loop": self.loop.value}

    @classmethod
    def from_dict(cls, data: Any) -> "CacheKey":
        if not isinstance(data, Mapping):
            raise CacheError(f"a cache key must be a mapping, got {type(data).__name__}.")
        data = _upgraded(data)
        names = [f.name for f in dataclasses.fields(cls)]
        if set(map(str, data)) != set(names):  # (a key of schema 1 lacks sample_signature: not this schema's)
            raise CacheError(f"a cache key has exactly the fields {', '.join(names)}; got {', '.join(map(str, data))}.")
        try:
            loop = Loop(data["loop"])
        except ValueError:
            raise CacheError(f"a cache key's loop must be one of {', '.join(m.value for m in Loop)}, "
                             f"got {data['loop']!r}.") from None
        return cls(**{name: data[name] for name in names if name != "loop"}, loop=loop)

    def digest(self) -> str:
        """sha256 of the canonical JSON of the key (with the cache and plan schema versions), first 32 hex
        digits (128 bits): the cache file's name. Stable across runs, processes and machines. A plain or
        train_step loop is hashed as the boolean `allow_train_step` it was before the loop had three values,
        so files written then keep their names."""
        fields = self.to_dict()
        loop = Loop(fields.pop("loop"))
        if loop is Loop.ACCUMULATES:
            fields["loop"] = loop.value
        else:
            fields["allow_train_step"] = loop is Loop.TRAIN_STEP
        blob = json.dumps(
            {"cache_schema": CACHE_SCHEMA_VERSION, "plan_schema": PLAN_SCHEMA_VERSION, **fields},
            sort_keys=True, separators=(",", ":"),
        ).encode()
        return hashlib.sha256(blob).hexdigest()[:32]

    def describe(self) -> str:
        loop = {Loop.PLAIN: "plain loop", Loop.ACCUMULATES: "a framework that accumulates",
                Loop.TRAIN_STEP: "train_step allowed"}[self.loop]
        return (f"model {self.model_fingerprint}, topology {self.topology_fingerprint}, global batch "
                f"{self.global_batch_size}, torch {self.torch_version}, {loop}"
                + (f", sample {self.sample_signature}" if self.sample_signature else ""))


def _upgraded(data: Mapping[str, Any]) -> dict[str, Any]:
    """A key as written before the loop had three values (`allow_train_step: true/false`) in today's fields."""
    out = {str(k): v for k, v in data.items()}
    if "allow_train_step" in out and "loop" not in out:
        old = out.pop("allow_train_step")
        if not isinstance(old, bool):
            raise CacheError(f"a cache key's allow_train_step must be true or false, got {old!r}.")
        out["loop"] = (Loop.TRAIN_STEP if old else Loop.PLAIN).value
    return out


def _fingerprint_of(value: Any, what: str) -> str:
    if isinstance(value, str):
        return value
    fp = getattr(value, "fingerprint", None)
    if callable(fp):
        fp = fp()
    if not isinstance(fp, str) or not fp:
        raise CacheError(f"cache_key needs a {what} or its fingerprint (a string), got {type(value).__name__}.")
    return fp


def cache_key(
    profile_or_fingerprint: Any,
    topology: Any,
    *,
    global_batch_size: int,
    loop: Loop | str,
    torch_version: str | None = None,
    profile: Any = None,
) -> CacheKey:
    """The key of a plan for this model (a ModelProfile or its fingerprint), topology (a Topology or its
    fingerprint), global batch, loop (`autopar.plans.Loop`) and sample size (`sample_signature` of the
    ModelProfile given, or of `profile` beside a fingerprint), under this torch (or `torch_version`)."""
    traced = profile if profile is not None else profile_or_fingerprint
    return CacheKey(
        model_fingerprint=_fingerprint_of(profile_or_fingerprint, "ModelProfile"),
        topology_fingerprint=_fingerprint_of(topology, "Topology"),
        global_batch_size=global_batch_size,
        torch_version=torch_version if torch_version is not None else current_torch_version(),
        loop=Loop.parse(loop),
        sample_signature=sample_signature(traced) if not isinstance(traced, str) else "",
    )


def sample_signature(profile: Any) -> str:
    """What the sample's size changes of a plan's cost, per sample: its tokens, its blocks' input shape and its
    traced FLOPs (a plan tuned at 16 tokens a sample is no plan for 2048: issue 11)."""
    shape = tuple(profile.block_input_shape[1:]) if profile.block_input_shape else ()
    flops = profile.flops / max(profile.sample_batch_size, 1)
    return f"tokens={profile.tokens_per_sample};block_input={'x'.join(map(str, shape))};flops={flops:.6g}"


# ---------------------------------------------------------------------------------------------------
# The folder
# ---------------------------------------------------------------------------------------------------
def _plans_dir(directory: str | os.PathLike[str] | None, *, create: bool) -> Path | None:
    """`<root>/plans`, checked private (autopar._util.io.cache_subdir); None when it does not exist and
    `create` is False."""
    return cache_subdir("plans", directory=directory, create=create)


# ---------------------------------------------------------------------------------------------------
# Reading one file
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheEntry:
    """One cache file, read and checked."""

    path: Path
    key: CacheKey
    plan: Plan
    measurement: Mapping[str, float | str] | None
    stored_at: str | None


def _measurement(value: Any, where: str) -> dict[str, float | str] | None:
    """A measurement: names to numbers (or short strings, such as a device name)."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, (int, float, str)) and not isinstance(v, bool) for k, v in value.items()
    ):
        raise CacheError(f"{where}: a measurement must map names to numbers or strings, got {value!r}.")
    return {k: v if isinstance(v, str) else float(v) for k, v in value.items()}


def _read_entry(path: Path, *, expected: CacheKey | None) -> CacheEntry | None:
    raw = read_private_bytes(path, max_bytes=MAX_FILE_BYTES, what="plan cache file")
    if raw is None:
        return None
    remedy = "Delete it; autopar tunes again and rewrites it."
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CacheError(f"{path} is not a text file, so not a plan cache file. {remedy}") from None
    try:
        data = load_yaml(text)
    except yaml.constructor.ConstructorError as exc:
        raise CacheError(
            f"{path} holds a YAML tag autopar does not read ({str(exc.problem or exc).strip()}): cache files hold "
            f"plain values only, never objects or code, so it was not loaded. Someone or something wrote it "
            f"by hand. {remedy}"
        ) from None
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        raise CacheError(f"{path} is not plain YAML ({first}). {remedy}") from None
    if not isinstance(data, Mapping) or data.get(_FORMAT_FIELD) is None:
        raise CacheError(f"{path} is not an autopar plan cache file (no '{_FORMAT_FIELD}' field). {remedy}")
    version = data[_FORMAT_FIELD]
    if version != CACHE_SCHEMA_VERSION or isinstance(version, bool):
        raise CacheError(
            f"{path} says it is cache layout {version!r}, but files of layout {CACHE_SCHEMA_VERSION} are named "
            f"by their key's digest and this one is not. {remedy}"
        )
    unknown = sorted(set(map(str, data)) - set(_TOP_LEVEL))
    if unknown:
        raise CacheError(f"{path} has unknown field(s) {', '.join(unknown)}. {remedy}")
    try:
        key = CacheKey.from_dict(data.get("key"))
    except CacheError as exc:
        raise CacheError(f"{path} has no valid key ({exc}). {remedy}") from None
    if expected is not None and key != expected:
        labels = {"model_fingerprint": "model", "topology_fingerprint": "topology",
                  "global_batch_size": "global batch", "torch_version": "torch", "loop": "loop"}
        diffs = [f"{labels[name]} {getattr(key, name)}, not {getattr(expected, name)}"
                 for name in labels if getattr(key, name) != getattr(expected, name)]
        raise CacheError(
            f"this cache file was written for {'; '.join(diffs)}: {path} holds another key's plan (copied or "
            f"renamed over this key's file), and autopar never applies a plan made for something else. {remedy}"
        )
    if path.stem != key.digest():
        raise CacheError(
            f"{path} holds the plan of key {key.digest()} ({key.describe()}) under another name: it was copied "
            f"or renamed. {remedy}"
        )
    measurement = _measurement(data.get("measurement"), str(path))
    stored_at = data.get("stored_at")
    if stored_at is not None and not isinstance(stored_at, str):
        raise CacheError(f"{path}: stored_at must be a date string, got {stored_at!r}. {remedy}")
    try:
        plan = Plan.from_dict(data.get("plan"))
    except (PlanError, TypeError, ValueError) as exc:
        if isinstance(exc, PlanError) and str(exc).startswith(f"{COMPILE_BACKEND_ENV}="):
            raise  # the environment's compile backend is wrong, not the file: deleting it would not help
        raise CacheError(f"{path} holds an invalid plan: {exc} {remedy}") from None
    for name, label in (("model_fingerprint", "model"), ("topology_fingerprint", "topology")):
        have = getattr(plan, name)
        if have is not None and have != getattr(key, name):
            raise CacheError(
                f"{path} holds a plan made for {label} {have} under a key for {label} {getattr(key, name)}. {remedy}"
            )
    if measurement is not None:
        plan = plan.replace(measurement=measurement)
    return CacheEntry(path=path, key=key, plan=plan, measurement=measurement, stored_at=stored_at)


# ---------------------------------------------------------------------------------------------------
# The API
# ---------------------------------------------------------------------------------------------------
def plans_folder(directory: str | os.PathLike[str] | None = None) -> Path:
    """The folder plans are cached in (`<root>/plans`), for `directory` or the default root; nothing is created."""
    return (cache_root() if directory is None else Path(directory)) / "plans"


def path_for(key: CacheKey, *, directory: str | os.PathLike[str] | None = None) -> Path:
    """Where `key`'s plan is (or would be) cached. Creates nothing."""
    return plans_folder(directory) / f"{key.digest()}.yaml"


def store(
    plan: Plan,
    key: CacheKey,
    *,
    measurement: Mapping[str, float] | None = None,
    directory: str | os.PathLike[str] | None = None,
) -> Path:
    """Cache `plan` under `key` (replacing what was there), with its measurement (`measurement`, else the
    plan's own); returns the file. The plan must fit the key: its global batch, its fingerprints if set, and
    nothing the key's loop cannot run. Written atomically, mode 0600, in a folder made 0700."""
    if not isinstance(plan, Plan):
        raise CacheError(f"store takes a Plan, got {type(plan).__name__}.")
    if not isinstance(key, CacheKey):
        raise CacheError(f"store takes a CacheKey (see cache_key), got {type(key).__name__}.")
    if plan.global_batch_size != key.global_batch_size:
        raise CacheError(
            f"the plan's global batch is {plan.global_batch_size}, the key's {key.global_batch_size}: a plan is "
            "cached under the batch it runs."
        )
    refusal = key.loop.refusal(plan)
    if refusal is not None:
        raise CacheError(f"this plan cannot be cached under a key for loop={key.loop.value!r}: {refusal}")
    changes: dict[str, Any] = {}
    for name in ("model_fingerprint", "topology_fingerprint"):
        have = getattr(plan, name)
        if have is None:
            changes[name] = getattr(key, name)
        elif have != getattr(key, name):
            raise CacheError(
                f"the plan's {name} is {have}, the key's {getattr(key, name)}: cache it under its own key.")
    merged = dict(plan.measurement or {})
    merged.update(measurement or {})
    numbers = _measurement(merged or None, "store")
    plan = plan.replace(measurement=None, **changes)

    plans = _plans_dir(directory, create=True)
    assert plans is not None
    path = plans / f"{key.digest()}.yaml"
    doc: dict[str, Any] = {
        _FORMAT_FIELD: CACHE_SCHEMA_VERSION,
        "key": key.to_dict(),
        "stored_at": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if numbers:
        doc["measurement"] = numbers
    doc["plan"] = plan.to_dict()
    header = f"# autopar plan cache entry: {key.describe()}. Written by autopar; delete to forget it.\n"
    text = header + yaml.safe_dump(doc, sort_keys=False)

    atomic_write_text(path, text, mode=0o600)
    return path


def lookup_entry(key: CacheKey, *, directory: str | os.PathLike[str] | None = None) -> CacheEntry | None:
    """`key`'s cache entry (plan, measurement, date, path), None when absent; CacheError when refused."""
    plans = _plans_dir(directory, create=False)
    if plans is None:
        return None
    return _read_entry(plans / f"{key.digest()}.yaml", expected=key)


def lookup(key: CacheKey, *, directory: str | os.PathLike[str] | None = None) -> Plan | None:
    """The plan cached under `key` (carrying its measurement), None when there is none. Raises CacheError
    when a file is there but refused (see the module docstring): delete it, or fix the permissions."""
    entry = lookup_entry(key, directory=directory)
    return None if entry is None else entry.plan


def entries(directory: str | os.PathLike[str] | None = None) -> list[tuple[CacheKey, Path]]:
    """Every cached plan's key and file, sorted by path; a refused file (or folder) is skipped with a
    `CacheWarning` saying why."""
    try:
        plans = _plans_dir(directory, create=False)
    except CacheError as exc:
        warnings.warn(f"skipping the plan cache: {exc}", CacheWarning, stacklevel=2)
        return []
    if plans is None:
        return []
    out = []
    for path in sorted(plans.glob("*.yaml")):
        if path.name.startswith("."):
            continue
        try:
            entry = _read_entry(path, expected=None)
        except CacheError as exc:
            warnings.warn(f"skipping a plan cache file: {exc}", CacheWarning, stacklevel=2)
            continue
        if entry is not None:
            out.append((entry.key, path))
    return out


#: Where a cached plan came from, kept in its measurement as "source" and said wherever the entry is shown
#: (issue 34, item 7: a plan an ordinary Hugging Face run cached was reported as "tuned").
SOURCE_TUNER = "a tuner study"
SOURCE_RUN = "a measured run"


def entry_source(entry: CacheEntry) -> str:
    """Where `entry`'s plan came from: its recorded source; an older file's tuner study if it names one."""
    m = entry.measurement or {}
    if isinstance(m.get("source"), str):
        return m["source"]
    return SOURCE_TUNER if "study" in m else "an earlier autopar that did not record its source"


def measured_throughput(measurement: Mapping[str, Any] | None) -> float | None:
    """Tokens (else samples) per second of a cached plan's measurement, or None: what decides whether a new
    measurement replaces it (the tuner's best, a Trainer run's feedback)."""
    value = (measurement or {}).get("tokens_per_s", (measurement or {}).get("samples_per_s"))
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def _measured(entry: CacheEntry) -> str:
    m = {k: v for k, v in (entry.measurement or {}).items() if isinstance(v, float)}
    parts = []
    if "tokens_per_s" in m:
        parts.append(f"{m['tokens_per_s']:,.0f} tokens/s")
    elif "samples_per_s" in m:
        parts.append(f"{m['samples_per_s']:,.1f} samples/s")
    elif "step_s" in m:
        parts.append(f"{m['step_s'] * 1e3:,.1f} ms/step")
    when = f" on {entry.stored_at[:10]}" if entry.stored_at else ""
    return f"measured {parts[0]}{when}" if parts else f"stored{when or ' earlier'}, not measured"


def cached_plan_for(
    profile: Any,
    topology: Any,
    *,
    world_size: int,
    global_batch_size: int,
    loop: Loop | str,
    directory: str | os.PathLike[str] | None = None,
) -> tuple[Plan | None, str | None]:
    """What `wrap` asks before planning: (plan, "using the plan cached at PATH (from a tuner study, measured ...)") on a
    hit; (None, None) when nothing is cached for this model, topology, batch, torch and loop kind; (None,
    why) when the cached plan does not fit this job (world size, batch, loop): the caller logs `why`
    as a warning and plans afresh. A refused (tampered) file raises CacheError, with the remedy."""
    loop = Loop.parse(loop)
    key = cache_key(profile, topology, global_batch_size=global_batch_size, loop=loop)
    entry = lookup_entry(key, directory=directory)
    if entry is None:
        return None, _cached_for_another_loop(profile, topology, global_batch_size, loop, directory)
    plan = entry.plan
    why = None
    try:
        plan.check_world(world_size)
    except PlanError:
        why = f"it was made for {plan.world_size} processes and this job has {world_size}"
    if why is None:
        try:
            plan.check_batch(global_batch_size)
        except PlanError:
            why = f"its global batch is {plan.global_batch_size}, this job's {global_batch_size}"
    refusal = loop.refusal(plan)
    if why is None and refusal is not None:
        why = f"this job's loop ({loop.value}) cannot run it ({refusal})"
    if why is not None:
        return None, (
            f"ignoring the plan cached at {entry.path}: {why}. autopar plans afresh; delete the file to stop "
            "this message (tuning again replaces it)."
        )
    return plan, f"using the plan cached at {entry.path} (from {entry_source(entry)}, {_measured(entry)})"


def _cached_for_another_loop(profile: Any, topology: Any, global_batch_size: int, loop: Loop,
                             directory: str | os.PathLike[str] | None) -> str | None:
    """A note where nothing is cached for this job's loop but a plan is for another loop of the same job (autotune
    tunes loop="train_step" by default, and a plain wrap() then found nothing, without a word), else None."""
    for other in Loop:
        if other is loop:
            continue
        try:
            found = lookup_entry(cache_key(profile, topology, global_batch_size=global_batch_size, loop=other),
                                 directory=directory)
        except CacheError:  # another loop's file refused: this job's lookup is what counts
            continue
        if found is not None:
            return (f"no plan is cached for this job's loop ({loop.value}), but one is for loop={other.value!r} at "
                    f"{found.path}: wrap(..., loop={other.value!r}) uses it (and drives the step as that loop "
                    "does), or tune this loop. autopar plans afresh.")
    return None


# ---------------------------------------------------------------------------------------------------
# --plan-out
# ---------------------------------------------------------------------------------------------------
def _is_plan_yaml(text: str) -> bool:
    try:
        data = load_yaml(text)
    except yaml.YAMLError:
        return False
    known = {f.name for f in dataclasses.fields(Plan)}
    return isinstance(data, Mapping) and "schema_version" in data and set(map(str, data)) <= known


def write_plan_out(plan: Plan, path: str | os.PathLike[str], *, option: str = "--plan-out") -> Path:
    """What `--plan-out PATH` (autopar tune) and `--out PATH` (autopar plan) do: save `plan` as a plan YAML
    (Plan.save, atomic) at `path`, creating its folders. An existing file is replaced only when it is empty or
    is itself a plan file (a mapping of Plan fields with a schema_version); anything else (a folder, a path
    ending in a separator, another YAML, a script) is refused so that a typo never destroys a file. `option`:
    the command-line option the errors name. Returns the path."""
    if not isinstance(plan, Plan):
        raise AutoparError(f"write_plan_out takes a Plan, got {type(plan).__name__}.")
    return plan.save(check_plan_out(path, option=option))


def check_plan_out(path: str | os.PathLike[str], *, option: str = "--plan-out") -> Path:
    """The refusals of `write_plan_out`, made before anything is written (the tuner makes them before its first
    trial): `path` is a folder, or a file that is neither empty nor a plan. Returns it as a Path."""
    named = os.fspath(path)
    path = Path(path)
    if path.is_dir() or named.endswith(("/", os.sep)):
        raise AutoparError(f"{option} {named} is a folder: give a file path, such as {path / 'plan.yaml'}.")
    if path.exists():
        try:
            size = path.stat().st_size
            text = path.read_text(encoding="utf-8") if 0 < size <= MAX_FILE_BYTES else ""
        except (OSError, UnicodeDecodeError):
            size, text = -1, ""
        if size != 0 and not _is_plan_yaml(text):
            raise AutoparError(
                f"{option} {path} exists and is not an autopar plan file: autopar will not overwrite it. "
                "Choose another path, or remove the file first."
            )
    return path


__all__ = [
    "CACHE_SCHEMA_VERSION", "CacheEntry", "CacheError", "CacheKey", "CacheWarning", "cache_key", "cached_plan_for",
    "check_plan_out", "current_torch_version", "entries", "lookup", "lookup_entry", "path_for", "plans_folder",
    "sample_signature", "store", "write_plan_out",
]
