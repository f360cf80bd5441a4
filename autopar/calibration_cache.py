"""The calibration cache: the cost model's factors measured or fitted for one topology, kept on disk.

One YAML file per topology fingerprint, `<root>/calibration/<fingerprint>.yaml`, where `<root>` is
`autopar._util.io.cache_dir()` ($AUTOPAR_CACHE_DIR, else $XDG_CACHE_HOME/autopar, else ~/.cache/autopar).
`save_calibration` writes a `Calibration` (autopar.cost.calibration) atomically, mode 0600 in a folder
made 0700; `load_calibration` reads it back with `yaml.safe_load`, after the same privacy checks as the
plan cache (a symlink, another user's file or one the group or others can write is refused: `CacheError`).
Each file records the cost model's version (`CALIBRATION_VERSION`): one written for another version is
ignored with a warning, since its factors belong to terms that have changed.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Mapping

import yaml

from ._util.io import atomic_write_text, cache_dir, cache_root, cache_subdir, read_private_bytes
from ._util.yaml_text import load_yaml
from .cost.calibration import Calibration
from .errors import CacheError

#: The cost model's terms that a cached calibration's factors belong to; files of another version are ignored.
#: 2: the H200 kernel-profile defaults of 2026-11-29 (reserve following the largest tensor, misaligned GEMMs).
#: 3: the per-op time model of 2026-12-01 (op records from the trace; attention relative to GEMMs; fused bytes).
#: 4: compile's kernels as inductor launches them (reductions, casts, buffer updates: 34.5 us each), the loss priced
#: eagerly, misaligned GEMMs by load width, SDPA's math path (2026-12-01, session 3).
#: 5: compiled kernels at 24 us of host time and cuDNN's convolution calls at 40 us more (2026-12-01, session 4).
CALIBRATION_VERSION = 5
#: Larger calibration files are refused unread (one is about 2 KiB).
MAX_FILE_BYTES = 1 << 20

_FOLDER = "calibration"
_FINGERPRINT = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")


def calibration_folder() -> Path:
    """The folder calibrations are cached in (`<root>/calibration`); nothing is created."""
    return cache_root() / _FOLDER


def calibration_path(fingerprint: str) -> Path:
    """Where the calibration of the topology with this fingerprint is (or would be) cached."""
    return cache_dir() / _FOLDER / f"{_checked(fingerprint)}.yaml"


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
    warning (it stays on disk; the next tuning study overwrites it)."""
    folder = cache_subdir(_FOLDER, create=False)
    if folder is None:
        return None
    path = folder / f"{_checked(fingerprint)}.yaml"
    raw = read_private_bytes(path, max_bytes=MAX_FILE_BYTES, what="calibration file")
    if raw is None:
        return None
    try:
        data = load_yaml(raw.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError):
        raise CacheError(f"{path} is not plain YAML: remove it (autopar will measure again).") from None
    if isinstance(data, Mapping) and data.get("version") != CALIBRATION_VERSION:
        warnings.warn(f"{path} was written for another version of autopar's cost model (version "
                      f"{data.get('version')!r}, this one is {CALIBRATION_VERSION}): ignored, the defaults stand. "
                      "Run autopar tune again to refit, or remove the file.", stacklevel=2)
        return None
    cal = Calibration.from_dict({k: v for k, v in data.items() if k != "version"} if isinstance(data, Mapping) else data)
    if cal.topology_fingerprint not in (None, fingerprint):
        raise CacheError(f"{path} holds the calibration of topology {cal.topology_fingerprint}: remove it.")
    return cal


def _checked(fingerprint: str) -> str:
    """A fingerprint names a file: letters, digits, '_', '-' and '.', never a path."""
    if not isinstance(fingerprint, str) or not _FINGERPRINT.fullmatch(fingerprint):
        raise CacheError(f"a topology fingerprint names the calibration file, so it is letters, digits, '_', '-' "
                         f"and '.'; got {fingerprint!r}.")
    return fingerprint


__all__ = ["CALIBRATION_VERSION", "calibration_folder", "calibration_path", "load_calibration", "save_calibration"]
