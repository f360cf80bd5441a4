"""Every topology test starts outside torchrun: none of its variables is set."""

from __future__ import annotations

import pytest

TORCHRUN_VARS = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK")


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch):
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
