"""wrap's cache on 2 gloo ranks: the second wrap of the same model takes rank 0's cached plan on every rank (rank 1's
own cache folder is empty: rank 0 decides, as for every plan), and the model trains exactly as the first time."""

from __future__ import annotations

import torch

from autopar import Plan
from tests.distributed._launch import torchrun


def test_the_second_wrap_on_two_ranks_takes_rank_0s_cached_plan_and_trains_the_same(tmp_path):
    torchrun("tests/distributed/_wrap_cache_worker.py", 2, [str(tmp_path / "out.pt"), str(tmp_path / "rank1-cache")],
             cache_dir=tmp_path / "cache", timeout_s=300)
    ranks = torch.load(tmp_path / "out.pt", weights_only=False)
    for runs in ranks:
        first, second = runs
        assert not first["cached"] and second["cached"]
        assert Plan.from_yaml(first["plan"]) == Plan.from_yaml(second["plan"])
        assert second["losses"] == first["losses"]
    assert ranks[0][1]["plan"] == ranks[1][1]["plan"]
    assert not (tmp_path / "rank1-cache" / "wrapped").exists()  # only rank 0 reads and writes it
