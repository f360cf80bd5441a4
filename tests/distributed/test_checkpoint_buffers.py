"""A checkpoint keeps one rank's copy of a buffer that is not sharded (BatchNorm's running statistics): where
the data-parallel ranks trained them on different samples, autopar.save warns once, on rank 0, naming them;
where they are equal, it says nothing (2 gloo ranks, FSDP dp_shard=2)."""

from __future__ import annotations

import torch

from tests.distributed._launch import torchrun


def test_save_warns_once_on_rank_0_of_batchnorm_statistics_that_differ_between_ranks_and_not_when_equal(tmp_path):
    torchrun("tests/distributed/_buffers_worker.py", 2, [str(tmp_path / "ckpt"), str(tmp_path / "out.pt")],
             cache_dir=tmp_path / "cache", timeout_s=300)
    ranks = torch.load(tmp_path / "out.pt", weights_only=False)
    assert ranks[0]["same"] == [] and ranks[1]["same"] == []  # equal statistics: nothing to say
    assert ranks[1]["different"] == []  # only rank 0 warns
    assert len(ranks[0]["different"]) == 1, ranks[0]["different"]  # two saves, one warning
    message = ranks[0]["different"][0]
    assert message.startswith("autopar.save: 2 buffer(s) differ between the data-parallel ranks "
                               "(body.1.running_mean, body.1.running_var): the checkpoint keeps one rank's copy")
    assert "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)" in message
    assert (tmp_path / "ckpt" / "autopar.yaml").is_file()  # and the save went through
