"""Test settings: GPU tests are skipped without a GPU; CPU tests never see one; each test has its own cache.

On a machine with GPUs (the device machine), every test not marked `gpu` runs as on a CPU-only machine:
torch.cuda reports no device, and the processes the tests launch get CUDA_VISIBLE_DEVICES="". So the
CPU suite checks the same behaviour everywhere, and `pytest tests/gpu -m gpu` checks the GPU paths.

The suite runs in parallel (`pytest -n 4`, pytest-xdist): processes the tests launch take their ports from
the OS (tests/_ports.py) and their own cache and temporary folders. `-n` without `--dist` sends each test to
whichever worker is free, except the tests that use a fixture wider than a test (module, class or package
scope, such as one torchrun launch whose results many tests check): those of one file go to one worker
together (`--dist loadgroup`, grouped by file), so such a fixture runs once, not once a worker. A long file
of independent tests (the docs' pages) is thus spread over the workers instead of holding one of them.
"""

from __future__ import annotations

import os

import pytest
import torch

if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    # Workers side by side share the cores: one thread each, and the same for the processes they start (an
    # OpenMP team whose threads wait on each other's descheduled threads spins the cores for nothing).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))


_SHARED_SCOPES = ("module", "class", "package")


def _default_distribution(config) -> bool:
    """Whether this run is `-n N` without a `--dist` of its own (the controller and every worker see the same
    command line)."""
    explicit = any(arg == "-d" or arg.startswith("--dist") for arg in config.invocation_params.args)
    return not explicit and any(arg.startswith(("-n", "--numprocesses")) for arg in config.invocation_params.args)


def pytest_configure(config):
    if not _default_distribution(config):
        return
    if hasattr(config, "workerinput"):  # a worker: tag the tests that share a fixture (see below)
        config.option.loadgroup = True
    elif getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadgroup"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the marks into scheduling groups
def pytest_collection_modifyitems(config, items):
    if getattr(config.option, "loadgroup", False) and _default_distribution(config):
        for item in items:
            info = getattr(item, "_fixtureinfo", None)
            defs = info.name2fixturedefs.values() if info is not None else ()
            if any(d.scope in _SHARED_SCOPES for chain in defs for d in chain):
                item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    _skip_gpu_tests_without_a_gpu(items)


def _skip_gpu_tests_without_a_gpu(items):
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
