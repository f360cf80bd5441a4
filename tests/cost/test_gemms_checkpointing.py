"""Checkpointing "gemms" (every dense GEMM recomputed, attention's outputs kept: autopar.strategies.checkpointing) in
the profile and the cost model: the trace's tally of the GEMMs it recomputes against the block's own GEMMs run for
real; the predicted memory and recomputation between alternate's and full's; the search offers it; a profile
written before the tally is priced as alternate's memory and full's recomputation (never under-predicted)."""

from __future__ import annotations

import dataclasses
import json

import pytest

import autopar
from autopar.cost import Calibration, predict_profile
from autopar.profile import ModelProfile
from tests.cost.test_alternate_checkpointing import _profile, first_block_gemms


def test_the_trace_tallies_every_gemm_of_a_block_as_its_real_forward_runs_them():
    seen = first_block_gemms()
    assert len(seen) >= 4
    b = _profile().blocks[0]
    assert b.gemm_saved_bytes == sum(n for n, _ in seen)
    assert b.gemm_forward_flops == pytest.approx(sum(f for _, f in seen), rel=1e-9)
    assert b.alternate_recompute_flops < b.gemm_forward_flops < b.forward_flops  # attention is not a GEMM
    assert 0 < b.selective_saved_bytes - b.gemm_saved_bytes < b.alternate_saved_bytes  # attention's outputs kept


@pytest.mark.parametrize("plan", [dict(micro_batch_size=2), dict(micro_batch_size=2, dp_shard=4)])
def test_gemms_lies_between_alternate_and_full_in_memory_and_recomputation(plan):
    topo = autopar.Topology.cpu(plan.get("dp_shard", 1))
    preds = {ac: predict_profile(_profile(), autopar.Plan(checkpointing=ac, **plan), topo, Calibration())
             for ac in ("alternate", "gemms", "full")}
    act = {ac: p.memory.parts()["activations_bytes"] for ac, p in preds.items()}
    assert act["alternate"] > act["gemms"] > act["full"]
    again = {ac: p.time.recompute_s for ac, p in preds.items()}
    assert again["alternate"] < again["gemms"] < again["full"]


def test_the_search_offers_gemms_checkpointing():
    ranked = autopar.candidates(_profile(), topology=autopar.Topology.cpu(1), global_batch_size=2)
    assert "gemms" in {c.plan.checkpointing for c in ranked}


def test_a_profile_written_before_the_tally_is_priced_as_alternate_memory_and_full_recompute():
    profile = _profile()
    old = dataclasses.replace(profile, blocks=tuple(dataclasses.replace(b, gemm_saved_bytes=None,
                                                                         gemm_forward_flops=None)
                                                    for b in profile.blocks))
    again = ModelProfile.from_dict(json.loads(json.dumps(old.to_dict())))
    assert again.blocks[0].gemm_saved_bytes is None  # the JSON of a profile without the tally reads back as such
    fresh = ModelProfile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert fresh.blocks[0].gemm_forward_flops == profile.blocks[0].gemm_forward_flops > 0
    topo, plan = autopar.Topology.cpu(1), dict(micro_batch_size=2)
    pred = {(name, ac): predict_profile(p, autopar.Plan(checkpointing=ac, **plan), topo, Calibration())
            for name, p in (("new", profile), ("old", again)) for ac in ("alternate", "gemms", "full")}
    act = {k: p.memory.parts()["activations_bytes"] for k, p in pred.items()}
    assert act["old", "gemms"] == act["new", "alternate"] > act["new", "gemms"]
    assert pred["old", "gemms"].time.recompute_s == pytest.approx(pred["new", "full"].time.recompute_s)
