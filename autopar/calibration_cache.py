"""The calibration cache: the cost model's factors measured or fitted for one topology, kept on disk.

Two kinds of file, in `<root>/calibration/`, where `<root>` is `autopar._util.io.cache_dir()`
($AUTOPAR_CACHE_DIR, else $XDG_CACHE_HOME/autopar, else ~/.cache/autopar):

- `<topology fingerprint>.yaml`: the hardware-wide calibration of a topology (`save_calibration`,
  `load_calibration`): a whole `Calibration`, e.g. `measure`'s micro-benchmarks.
- `<topology fingerprint>@<model digest>.yaml`: a tuner's refit of one model on that topology
  (`save_refit`, `load_refit`): only the factors a refit changes (autopar.cost.calibration.MODEL_FACTORS),
  keyed by the model's fingerprint and its sample's size (`sample_signature`, as the plan cache keys plans),
  so another model, or this one at another size, never inherits them (issue 11).

Files are written atomically, mode 0600 in a folder made 0700, and read back with `yaml.safe_load` after the
same privacy checks as the plan cache (a symlink, another user's file or one the group or others can write is
refused: `CacheError`). Each file records the cost model's version (`CALIBRATION_VERSION`): one written for
another version is ignored with a warning, since its factors belong to terms that have changed.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import yaml

from ._util.io import atomic_write_text, cache_root, cache_subdir, read_private_bytes
from ._util.yaml_text import load_yaml
from .cost.calibration import MODEL_FACTORS, Calibration
from .errors import CacheError

#: The cost model's terms that a cached calibration's factors belong to; files of another version are ignored.
#: 2: the H200 kernel-profile defaults of 2026-11-29 (reserve following the largest tensor, misaligned GEMMs).
#: 3: the per-op time model of 2026-12-01 (op records from the trace; attention relative to GEMMs; fused bytes).
#: 4: compile's kernels as inductor launches them (reductions, casts, buffer updates: 34.5 us each), the loss priced
#: eagerly, misaligned GEMMs by load width, SDPA's math path (2026-12-01, session 3).
#: 5: compiled kernels at 24 us of host time and cuDNN's convolution calls at 40 us more (2026-12-01, session 4).
#: 6: a tuner's refits kept per model (`save_refit`), never in the topology's file: a file of version 5 may hold a
#: refit of one script that changed every model's predictions on that hardware (issue 11, item 7).
#: 7: fp32 GEMMs priced by depth and output (fp32_matmul_efficiency now before those losses), fp32 grouped GEMMs one
#: GEMM a group, fused AdamW at its own bandwidth (optimizer_memory_efficiency), network cards per node (2026-12-02).
CALIBRATION_VERSION = 8
#: Larger calibration files are refused unread (one is about 2 KiB).
MAX_FILE_BYTES = 1 << 20

_FOLDER = "calibration"
_FINGERPRINT = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")


def calibration_folder() -> Path:
    """The folder calibrations are cached in (`<root>/calibration`); nothing is created."""
    return cache_root() / _FOLDER


def calibration_path(fingerprint: str) -> Path:
    """Where the calibration of the topology with this fingerprint is (or would be) cached."""
    return calibration_folder() / f"{_checked(fingerprint)}.yaml"


def save_calibration(cal: Calibration, fingerprint: str) -> Path:
    """Cache `cal` as the calibration of this topology (replacing what was there); returns the file."""
    folder = cache_subdir(_FOLDER, create=True)
    assert folder is not None
    path = folder / f"{_checked(fingerprint)}.yaml"
    data = {"version": CALIBRATION_VERSION, **cal.replace(topology_fingerprint=fingerprint).to_dict()}
    atomic_write_text(path, yaml.safe_dump(data, sort_keys=False), mode=0o600)
    return path


def load_calibration(fingerprint: str) -> Calibration | None:
    """The cached calibration of this topology, or None. A file that is not ours or not plain YAML is refused
    (CacheError). One written for another version of the cost model (CALIBRATION_VERSION) is ignored, with a
    warning (it stays on disk until removed)."""
    path, data = _read(f"{_checked(fingerprint)}.yaml", what="calibration file")
    if data is None:
        return None
    cal = Calibration.from_dict({k: v for k, v in data.items() if k != "version"})
    if cal.topology_fingerprint not in (None, fingerprint):
        raise CacheError(f"{path} holds the calibration of topology {cal.topology_fingerprint}: remove it.")
    return cal


# ---------------------------------------------------------------------------------------------------
# A tuner's refit of one model, per topology
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CachedRefit:
    """A tuner's refit of one model on one topology, as read from (or written to) its file."""

    path: Path
    factors: Mapping[str, float]  # MODEL_FACTORS names to values, each in its factor's unit
    fitted_runs: int  # measured steps it was fitted to
    source: str

    def __post_init__(self) -> None:
        unknown = sorted(set(self.factors) - set(MODEL_FACTORS))
        if unknown:
            raise CacheError(f"{self.path} refits {', '.join(unknown)}, which a refit never changes (it changes only "
                             f"{', '.join(MODEL_FACTORS)}): remove it.")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf
                   for v in self.factors.values()):
            raise CacheError(f"{self.path}: a refit's factors are positive finite numbers: remove it.")
        if isinstance(self.fitted_runs, bool) or not isinstance(self.fitted_runs, int) or self.fitted_runs < 1:
            raise CacheError(f"{self.path}: fitted_runs must be a positive integer, got {self.fitted_runs!r}: remove it.")
        object.__setattr__(self, "factors", {k: float(v) for k, v in self.factors.items()})

    def apply(self, cal: Calibration) -> Calibration:
        """`cal` (the topology's) with this model's refitted factors, its source naming this file."""
        return cal.replace(**self.factors, fitted_runs=self.fitted_runs,
                           source=f"{cal.source}; refit of this model cached in {self.path} ({self.source})")


def refit_path(topology_fingerprint: str, *, model_fingerprint: str, sample_signature: str) -> Path:
    """Where the refit of this model (fingerprint and sample size) on this topology is (or would be) cached."""
    return calibration_folder() / _refit_name(topology_fingerprint, model_fingerprint, sample_signature)


def save_refit(cal: Calibration, *, topology_fingerprint: str, model_fingerprint: str, sample_signature: str) -> Path:
    """Cache the MODEL_FACTORS of `cal`, a tuner's refit, for this model on this topology only; returns the file."""
    folder = cache_subdir(_FOLDER, create=True)
    assert folder is not None
    path = folder / _refit_name(topology_fingerprint, model_fingerprint, sample_signature)
    data = {"version": CALIBRATION_VERSION, "topology_fingerprint": topology_fingerprint,
            "model_fingerprint": model_fingerprint, "sample_signature": sample_signature,
            "fitted_runs": max(1, cal.fitted_runs), "source": cal.source,
            "factors": {name: float(getattr(cal, name)) for name in MODEL_FACTORS}}
    atomic_write_text(path, yaml.safe_dump(data, sort_keys=False), mode=0o600)
    return path


def load_refit(topology_fingerprint: str, *, model_fingerprint: str, sample_signature: str) -> CachedRefit | None:
    """The cached refit of this model on this topology, or None; refused (CacheError) as `load_calibration`
    refuses, and also when the file names another model, sample or topology (copied over by hand)."""
    name = _refit_name(topology_fingerprint, model_fingerprint, sample_signature)
    path, data = _read(name, what="calibration refit file")
    if data is None:
        return None
    expected = {"topology_fingerprint": topology_fingerprint, "model_fingerprint": model_fingerprint,
                "sample_signature": sample_signature}
    wrong = [f"{k} {data.get(k)!r}" for k, v in expected.items() if data.get(k) != v]
    if wrong:
        raise CacheError(f"{path} holds the refit of another job ({', '.join(wrong)}): remove it.")
    factors, runs, source = data.get("factors"), data.get("fitted_runs"), data.get("source")
    if not isinstance(factors, Mapping) or not isinstance(source, str):
        raise CacheError(f"{path} is not an autopar calibration refit (factors, source): remove it.")
    return CachedRefit(path=path, factors=factors, fitted_runs=runs, source=source)


def _refit_name(topology_fingerprint: str, model_fingerprint: str, sample_signature: str) -> str:
    """`<topology>@<digest of model and sample>.yaml`: '@' is in no topology fingerprint, so it never names a
    topology's own file."""
    if not isinstance(model_fingerprint, str) or not model_fingerprint or not isinstance(sample_signature, str):
        raise CacheError(f"a refit is keyed by a model fingerprint and a sample signature (strings); got "
                         f"{model_fingerprint!r} and {sample_signature!r}.")
    blob = json.dumps({"model": model_fingerprint, "sample": sample_signature}, sort_keys=True).encode()
    return f"{_checked(topology_fingerprint)}@{hashlib.sha256(blob).hexdigest()[:32]}.yaml"


def _read(name: str, *, what: str) -> tuple[Path | None, Mapping | None]:
    """The file `name` in the calibration folder and its mapping, or (path, None) when it is missing or of
    another CALIBRATION_VERSION (ignored, with a warning); refused (CacheError) when not ours or not YAML."""
    folder = cache_subdir(_FOLDER, create=False)
    if folder is None:
        return None, None
    path = folder / name
    raw = read_private_bytes(path, max_bytes=MAX_FILE_BYTES, what=what)
    if raw is None:
        return path, None
    try:
        data = load_yaml(raw.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError):
        raise CacheError(f"{path} is not plain YAML: remove it (autopar will measure again).") from None
    if not isinstance(data, Mapping):
        raise CacheError(f"{path} is not a mapping of calibration factors: remove it.")
    if data.get("version") != CALIBRATION_VERSION:
        warnings.warn(f"{path} was written for another version of autopar's cost model (version "
                      f"{data.get('version')!r}, this one is {CALIBRATION_VERSION}): ignored, the defaults stand. "
                      "Remove the file: a topology's calibration is made again by measuring the GPU, a model's refit "
                      "by its next autopar tune study.", stacklevel=3)
        return path, None
    return path, data


def _checked(fingerprint: str) -> str:
    """A fingerprint names a file: letters, digits, '_', '-' and '.', never a path."""
    if not isinstance(fingerprint, str) or not _FINGERPRINT.fullmatch(fingerprint):
        raise CacheError(f"a topology fingerprint names the calibration file, so it is letters, digits, '_', '-' "
                         f"and '.'; got {fingerprint!r}.")
    return fingerprint


__all__ = ["CALIBRATION_VERSION", "CachedRefit", "calibration_folder", "calibration_path", "load_calibration",
           "load_refit", "refit_path", "save_calibration", "save_refit"]
