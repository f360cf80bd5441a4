"""Checkpointing "alternate" (every other GEMM's output kept, autopar.strategies.checkpointing) in the profile and the
cost model: the trace's tally of what it keeps and recomputes against the block's own GEMMs run for real; the
predicted memory and recomputation between selective's and full's; the search offers it."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar.cost import Calibration, predict_profile
from autopar.models.gpt import GPT, GPTConfig, lm_loss
from autopar.profile import profile_model
from autopar.profile.flops import gemm_ops

CFG = GPTConfig(vocab_size=256, seq_len=32, num_layers=2, hidden_dim=64, num_heads=4)


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def _sample() -> torch.Tensor:
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


@functools.lru_cache(maxsize=1)
def _profile():
    return profile_model(_model(), _sample(), loss_fn=lm_loss, warn=False)


class _Gemms(TorchDispatchMode):
    """The GEMMs of a forward run for real, in order: (output bytes, FLOPs = 2 x output elements x depth)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[int, float]] = []
        self.gemms = gemm_ops()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in self.gemms:
            b = args[-1] if func in (torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default) else args[1]
            self.seen.append((out.untyped_storage().nbytes(), 2.0 * out.numel() * b.shape[-2]))
        return out


def first_block_gemms() -> list[tuple[int, float]]:
    """The GEMMs of the first block's forward run for real on the sample, in order (_Gemms.seen)."""
    model, x = _model(), _sample()
    hidden = model.tok_emb(x) + model.pos_emb(torch.arange(x.shape[1]))  # what the first block reads
    with _Gemms() as gemms:
        model.blocks[0](hidden)
    return gemms.seen


def test_the_trace_tallies_every_other_gemm_of_a_block_as_its_real_forward_runs_them():
    seen = first_block_gemms()
    kept = sum(n for i, (n, _) in enumerate(seen) if i % 2 == 0)
    recomputed_bytes = sum(n for i, (n, _) in enumerate(seen) if i % 2 == 1)
    recomputed_flops = sum(f for i, (_, f) in enumerate(seen) if i % 2 == 1)
    assert len(seen) >= 4 and kept > 0
    b = _profile().blocks[0]
    assert b.selective_saved_bytes - b.alternate_saved_bytes == recomputed_bytes
    assert b.alternate_recompute_flops == pytest.approx(recomputed_flops, rel=1e-9)
    assert 0 < b.alternate_recompute_flops < b.forward_flops


@pytest.mark.parametrize("plan", [dict(micro_batch_size=2), dict(micro_batch_size=2, dp_shard=4)])
def test_alternate_lies_between_selective_and_full_in_memory_and_recomputation(plan):
    topo = autopar.Topology.cpu(plan.get("dp_shard", 1))
    preds = {ac: predict_profile(_profile(), autopar.Plan(checkpointing=ac, **plan), topo, Calibration())
             for ac in ("none", "selective", "alternate", "full")}
    act = {ac: p.memory.parts()["activations_bytes"] for ac, p in preds.items()}
    assert act["none"] > act["selective"] > act["alternate"] > act["full"]
    again = {ac: p.time.recompute_s for ac, p in preds.items()}
    assert again["none"] == 0 < again["selective"] < again["alternate"] < again["full"]


def test_the_search_offers_alternate_checkpointing():
    ranked = autopar.candidates(_profile(), topology=autopar.Topology.cpu(1), global_batch_size=2)
    assert "alternate" in {c.plan.checkpointing for c in ranked}


def test_a_profile_written_before_the_tally_is_priced_as_no_less_than_selective_memory_and_full_recompute():
    import dataclasses

    profile = _profile()
    old = dataclasses.replace(profile, blocks=tuple(dataclasses.replace(b, alternate_saved_bytes=0,
                                                                         alternate_recompute_flops=0.0)
                                                    for b in profile.blocks))
    topo, plan = autopar.Topology.cpu(1), dict(micro_batch_size=2)
    pred = {(name, ac): predict_profile(p, autopar.Plan(checkpointing=ac, **plan), topo, Calibration())
            for name, p in (("new", profile), ("old", old)) for ac in ("selective", "alternate", "full")}
    act = {k: p.memory.parts()["activations_bytes"] for k, p in pred.items()}
    assert act["old", "alternate"] == act["new", "selective"] > act["new", "alternate"]
    assert pred["old", "alternate"].time.recompute_s == pytest.approx(pred["new", "full"].time.recompute_s)
