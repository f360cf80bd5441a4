"""A fused projection under tensor parallelism is saved and loaded under any plan: GPT-2's c_attn (q, k and v in one
layer, strided-sharded so that each rank holds its heads of each) could not be saved at all (DCP: "has overlapping
chunks"; found by a helper). Loaded under tp=2 and under FSDP, the weights equal the saved ones and one more step
gives the loss of the run that was saved (the optimizer state came back too)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed._launch import torchrun

pytestmark = pytest.mark.slow


def test_a_fused_qkv_layer_saved_under_tensor_parallelism_loads_under_any_plan(tmp_path):
    torchrun("tests/distributed/_fused_ckpt_worker.py", 2, [str(tmp_path / "ckpt"), str(tmp_path / "out.pt")],
             cache_dir=tmp_path / "cache")
    out = torch.load(tmp_path / "out.pt", weights_only=False)  # our own worker's output
    assert any("c_attn" in name for name in out["saved"])
    for plan in ("tp", "fsdp"):
        assert out[plan].keys() == out["saved"].keys()
        for name, tensor in out["saved"].items():
            torch.testing.assert_close(out[plan][name], tensor, rtol=0, atol=0, msg=f"{plan}: {name}")
        assert out[f"{plan}_next"] == pytest.approx(out["saved_next"], rel=1e-5), plan


def test_fused_layers_split_by_tensor_parallelism_and_fsdp_together_gather_and_checkpoint_whole(tmp_path):
    """tp=2 x dp_shard=2 on 4 ranks: a fused q/k/v and a fused gate/up nn.Linear are split twice along one dim;
    torch gathered them in the wrong rows (full_state_dict, and the checkpoint's whole tensors). Their full weights
    equal the model's own after wrap, and a checkpoint loads equal under the same plan and under dp_shard=4."""
    torchrun("tests/distributed/_fused_2d_worker.py", 4, [str(tmp_path / "ckpt"), str(tmp_path / "out.pt")],
             cache_dir=tmp_path / "cache")
    out = torch.load(tmp_path / "out.pt", weights_only=False)  # our own worker's output
    assert all("_StridedShard" in p for p in out["placements"].values())  # the two splits the test is about
    assert out["after_wrap"].keys() == out["own"].keys()
    for name, tensor in out["own"].items():
        torch.testing.assert_close(out["after_wrap"][name], tensor, rtol=0, atol=0, msg=name)
    assert any(not torch.equal(out["saved"][n], out["own"][n]) for n in out["own"])  # it trained
    for plan in ("two_d", "fsdp"):
        for name, tensor in out["saved"].items():
            torch.testing.assert_close(out[plan][name], tensor, rtol=0, atol=0, msg=f"{plan}: {name}")
