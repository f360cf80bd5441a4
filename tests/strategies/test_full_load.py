"""`model.load_state_dict(full_state_dict)` after wrap, as a pretrained checkpoint or a file saved from the plain model
loads: FSDP2's and tensor parallelism's DTensor parameters raised "aten.copy_.default got mixed torch.Tensor and
DTensor" on every rank (2 gloo ranks, dp_shard=2 and dp_replicate=2). Each rank now takes its shards of the full
tensors (autopar/strategies/full_load.py): the gathered state after the load is the state dict loaded, and the
model computes the loss the plain model with those weights computes, under FSDP, replicas, TP and FSDP x TP. And out:
`autopar.full_state_dict(model)` gives the plain model's state on every rank, which Hugging Face's save_pretrained
writes (given FSDP's shards it raised "Attempted to access the data pointer on an invalid python storage") and
from_pretrained reads back bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests._training import make_model
from tests.distributed import _full_load_worker as worker
from tests.distributed._launch import torchrun


@pytest.mark.parametrize("name, ranks", [("fsdp", 2), ("replicas", 2), ("tp", 2), ("fsdp-tp", 4)])
def test_a_full_state_dict_loads_into_the_shards(tmp_path, name, ranks):
    torchrun("tests/distributed/_full_load_worker.py", ranks, [str(tmp_path / "out.pt"), name],
             cache_dir=tmp_path / "cache", timeout_s=600)
    got = torch.load(tmp_path / "out.pt", weights_only=False)
    want = make_model("llama", seed=2)
    assert got["result"] == "<All keys matched successfully>"
    for key, value in want.state_dict().items():
        if key in got["state"]:
            torch.testing.assert_close(got["state"][key], value, rtol=0, atol=0, msg=key)
    assert set(got["state"]) >= {k for k, _ in want.named_parameters()}
    with torch.no_grad():
        assert got["loss"] == pytest.approx(want(**worker.batch()).loss.item(), rel=1e-5)
    # autopar.full_state_dict: plain tensors on the CPU, the plain model's keys; save_pretrained of it reloads
    assert got["full"].keys() == want.state_dict().keys()
    for key, value in want.state_dict().items():
        assert type(got["full"][key]) is torch.Tensor and got["full"][key].device.type == "cpu"
        torch.testing.assert_close(got["full"][key], value, rtol=0, atol=0, msg=key)
        torch.testing.assert_close(got["reloaded"][key], value, rtol=0, atol=0, msg=key)


def test_full_state_dict_of_a_model_in_one_process_is_its_state_dict_on_the_cpu():
    import autopar

    model = make_model("llama", seed=3)
    full = autopar.full_state_dict(model)
    assert full.keys() == model.state_dict().keys()
    assert all(torch.equal(full[k], v) for k, v in model.state_dict().items())
