"""Replicated data parallelism starts every replica from the same values (issue 11, item 8): on 2 gloo ranks
seeded differently, a dp_replicate=2 plan holds rank 0's model on both ranks after wrap and the same model
after training; BatchNorm's per-rank statistics are warned about, with the conversion to use, and so is a buffer
the forward writes (found by the trace), with what keeps the ranks' copies equal."""

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
    # a buffer of its own that the forward writes: warned about apart, BatchNorm's not named again
    written = [w for w in r["warnings"] if "the forward writes" in w]
    assert len(written) == 1 and "(feature_mean)" in written[0] and "ReduceOp.AVG" in written[0]


def test_the_trace_names_the_buffers_the_forward_writes():
    from autopar.profile import profile_model
    from tests.distributed._replicas_worker import Net

    profile = profile_model(Net(), torch.randn(4, 8), warn=False)
    assert set(profile.buffers_written) == {"feature_mean", "norm.running_mean", "norm.running_var",
                                            "norm.num_batches_tracked"}
    assert profile_model(torch.nn.Linear(8, 2), torch.randn(4, 8), warn=False).buffers_written == ()
