"""autopar's logger: INFO to stderr with an "[autopar]" prefix, on rank 0 only, unless the user configures it."""

from __future__ import annotations

import logging
import sys

_logger = logging.getLogger("autopar")


def get_logger() -> logging.Logger:
    """The "autopar" logger. Unless the user configured it (a handler, or a level), autopar's INFO messages go
    to stderr once; `logging.getLogger("autopar").setLevel(logging.WARNING)` silences them."""
    if not _logger.handlers and not getattr(_logger, "_autopar_configured", False):
        _logger._autopar_configured = True  # type: ignore[attr-defined]
        handler = logging.StreamHandler(sys.stderr)
        handler._autopar_own = True  # type: ignore[attr-defined]  # autopar._util.progress may draw on its stream
        handler.setFormatter(logging.Formatter("[autopar] %(message)s"))
        _logger.addHandler(handler)
        if _logger.level == logging.NOTSET:
            _logger.setLevel(logging.INFO)
        _logger.propagate = False
    return _logger
