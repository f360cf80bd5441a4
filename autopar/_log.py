"""autopar's logger: INFO to stderr with an "[autopar]" prefix, on rank 0 only, unless the user configures it."""

from __future__ import annotations

import logging
import sys

_logger = logging.getLogger("autopar")


def get_logger() -> logging.Logger:
    if not _logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[autopar] %(message)s"))
        _logger.addHandler(handler)
        _logger.setLevel(logging.INFO)
        _logger.propagate = False
    return _logger
