"""Writing files atomically: a reader (or a crash) never sees half a file."""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write_text(path: Path, text: str, *, mode: int | None = None) -> None:
    """Write `text` to a temporary file beside `path` (chmod `mode` if given), then `os.replace` it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
