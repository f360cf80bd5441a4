"""Test settings: GPU tests are skipped without a GPU; CPU tests never see one; each test has its own cache.

On a machine with GPUs (the device machine), every test not marked `gpu` runs as on a CPU-only machine:
torch.cuda reports no device, and the processes the tests launch get CUDA_VISIBLE_DEVICES="". So the
CPU suite checks the same behaviour everywhere, and `pytest tests/gpu -m gpu` checks the GPU paths.

The suite runs in parallel (`pytest -n 4`, pytest-xdist): processes the tests launch take their ports from
the OS (tests/_ports.py) and their own cache and temporary folders; `-n` without `--dist` keeps the tests of
one file on one worker (`--dist loadfile`), so a module fixture that launches torchrun runs once, not once a
worker.
"""

from __future__ import annotations

import pytest
import torch


def pytest_configure(config):
    explicit = any(arg == "-d" or arg.startswith("--dist") for arg in config.invocation_params.args)
    if getattr(config.option, "dist", "no") == "load" and not explicit:
        config.option.dist = "loadfile"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine: pytest tests/gpu -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cpu_only_unless_gpu_test(request, monkeypatch):
    if "gpu" in request.keywords:
        return
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(autouse=True, scope="session")
def _session_cache_dir(tmp_path_factory):
    """The cache directory of fixtures wider than a test (set up before `_private_cache_dir`): never the
    user's, and one per xdist worker."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTOPAR_CACHE_DIR", str(tmp_path_factory.mktemp("autopar-cache-session")))
        yield


@pytest.fixture(autouse=True)
def _private_cache_dir(tmp_path_factory, monkeypatch):
    """Every test (and the processes it launches) uses its own autopar cache directory: a plan cached or a
    calibration fitted by one test, or by the user, never changes what another test chooses."""
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path_factory.mktemp("autopar-cache")))


@pytest.fixture
def one_plain_process(monkeypatch):
    """No torchrun variables and no process group: what a plain `python script.py` sees."""
    from tests._training import TORCHRUN_VARS

    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    assert not torch.distributed.is_initialized()
