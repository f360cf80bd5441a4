"""Test settings: GPU tests are skipped without a GPU; CPU tests never see one."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine: pytest tests/gpu -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
