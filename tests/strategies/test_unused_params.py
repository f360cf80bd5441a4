"""Parameters some ranks' forwards use and others' do not (autopar/strategies/unused.py): task heads trained on
different ranks, two same-shaped branches the data's sign chooses, experts no token of a rank's batch reaches. FSDP2
gathers a unit when it is called and reduces only the parameters that got a gradient: gloo aborted ("Received data
size doesn't match expected size"), the sharded branches hung, and the replicated ones trained silently wrong (the
ranks 0.03 apart). wrap finds them from every rank's traced sample; 2 gloo ranks then train as one process whose
step's loss is the mean of the ranks' losses (fp32, 1e-5), including a step where no rank uses a head (its gradient
goes back to None: AdamW leaves it), and wrap says so once."""

from __future__ import annotations

import pytest
import torch

import autopar
from tests.distributed._launch import torchrun
from tests.strategies import _unused_worker as worker


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("unused")
    torchrun("tests/strategies/_unused_worker.py", 2, [str(tmp / "out.pt")], cache_dir=tmp / "cache", timeout_s=300)
    return torch.load(tmp / "out.pt", weights_only=False)


def test_the_trace_names_what_the_sample_leaves_unused():
    model = worker.MultiTask()
    batch = worker.SCENARIOS["tasks_sharded"][1]
    assert autopar.profile_model(model, batch(0, 0), warn=False).params_unused == ("head_b.weight", "head_b.bias")
    assert autopar.profile_model(model, batch(0, 1), warn=False).params_unused == ("head_a.weight", "head_a.bias")


@pytest.mark.parametrize("name", list(worker.SCENARIOS))
def test_ranks_whose_forwards_use_different_parameters_train_as_one_process(runs, name):
    got, want = runs[name], worker.reference(name)
    assert "error" not in got, got.get("traceback")
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5)
    for param, value in want["params"].items():
        torch.testing.assert_close(got["params"][param], value, rtol=1e-5, atol=1e-6, msg=param)
    assert got["no_grad"] == want["no_grad"]  # after backward: None where one process has None (no zeros there)
    said = [m for m in got["said"] if "find_unused_parameters" in m]
    assert len(said) == (0 if name == "one_task" else 1) and all("the blocks of" in m for m in said)


def test_parameters_no_rank_used_are_named_with_what_could_go_wrong(runs):
    said = [m for m in runs["one_task"]["said"] if "got no gradient in any rank's traced step" in m]
    assert len(said) == 1 and "head_b.weight" in said[0] and "requires_grad=False" in said[0]
    assert runs["one_task"]["used_on_some_ranks"] == ()
    assert not any("got no gradient" in m for m in runs["tasks_sharded"]["said"])


def test_the_containers_the_data_chooses_from_are_gathered_as_one(runs):
    """Each rank's trace called one head (top-level blocks: the whole model) or one branch (the branches only)."""
    assert set(runs["tasks_sharded"]["used_on_some_ranks"]) == {n for n, _ in worker.MultiTask().named_parameters()}
    assert {n.split(".")[0] for n in runs["branches_sharded"]["used_on_some_ranks"]} == {"branches"}
