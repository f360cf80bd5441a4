"""An average of the weights (EMA) kept by the user's own loop, as docs/train_step.md shows: made of the wrapped
model's parameters (FSDP's shards: DTensors), updated with lerp_ after each optimizer step. On 2 gloo ranks, sharded
and replicated, it equals the same loop's in one plain process on the whole batch (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed._launch import torchrun
from tests.strategies import _ema_worker as worker


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ema")
    torchrun("tests/strategies/_ema_worker.py", 2, [str(tmp / "out.pt")], cache_dir=tmp / "cache", timeout_s=300)
    return torch.load(tmp / "out.pt", weights_only=False)


@pytest.mark.parametrize("name", list(worker.PLANS))
def test_the_average_of_the_shards_is_one_processs_average(runs, name):
    got, want = runs[name], worker.reference()
    assert "error" not in got, got.get("traceback")
    for key in ("ema", "params"):
        for a, b in zip(got[key], want[key]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert all(kind == "DTensor" for kind in got["kinds"])  # the average is sharded as the weights are
    assert any((e - p).abs().max() > 1e-3 for e, p in zip(got["ema"], got["params"]))  # (an average, not a copy)
