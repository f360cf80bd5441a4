"""Replicated data parallelism starts every replica from the same values (issue 11, item 8): on 2 gloo ranks
seeded differently, a dp_replicate=2 plan holds rank 0's model on both ranks after wrap and the same model
after training; BatchNorm's per-rank statistics are warned about, with the conversion to use."""

from __future__ import annotations

import torch

from tests.distributed._launch import torchrun


def test_replicas_start_and_stay_equal_and_batchnorm_is_warned_about(tmp_path):
    torchrun("tests/distributed/_replicas_worker.py", 2, [str(tmp_path / "out.pt")], cache_dir=tmp_path / "cache",
             timeout_s=600)
    r = torch.load(tmp_path / "out.pt", weights_only=False)
    assert not torch.equal(r["initials"][0], r["initials"][1])  # the ranks built different models
    assert torch.equal(r["at_wrap"][0], r["at_wrap"][1]) and torch.equal(r["at_wrap"][0], r["initials"][0])
    assert torch.equal(r["after"][0], r["after"][1]) and not torch.equal(r["after"][0], r["at_wrap"][0])
    assert any("BatchNorm" in w and "SyncBatchNorm.convert_sync_batchnorm" in w for w in r["warnings"])
