"""Data parallelism (FSDP2) of a model whose blocks share a weight: one module object held by every block (and
by the model outside them), or one Parameter held by distinct modules of the blocks. FSDP2 cannot shard a
weight in each unit that reaches it ("Cannot concatenate overlapping meshes"): a shared module becomes an FSDP
unit of its own, sharded once; a shared Parameter is kept replicated. Either way 2 gloo ranks train as one
process on the global batch, and the weight stays one Parameter object, held by every block."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar.profile import profile_model
from tests.distributed._launch import torchrun
from tests.strategies import _fsdp_shared_worker as worker

RTOL = 1e-5
WORKER = "tests/strategies/_fsdp_shared_worker.py"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_shared")
    torchrun(WORKER, 2, [str(tmp / "ranks.pt")], cache_dir=tmp / "cache", timeout_s=600)
    ranks = torch.load(tmp / "ranks.pt", weights_only=False)
    return ranks, {n: worker.run_reference(n) for n in worker.SCENARIOS}


def test_shared_modules_finds_the_module_every_block_holds_and_the_weight_distinct_modules_hold():
    from autopar.strategies.fsdp import shared_modules

    model = worker.SCENARIOS["shared_module"][0]()
    modules, params = shared_modules(model, list(model.blocks))
    assert [(n, m) for n, m in modules] == [("blocks.0.shared", model.blocks[0].shared)] and params == []
    in_root = worker.SCENARIOS["shared_module_in_root_accum"][0]()
    assert [n for n, _ in shared_modules(in_root, list(in_root.blocks))[0]] == ["shared"]
    weight = worker.SCENARIOS["shared_weight"][0]()
    modules, params = shared_modules(weight, list(weight.blocks))
    assert modules == [] and [(n, p) for n, p in params] == [("blocks.0.mix.weight", weight.blocks[0].mix.weight)]


def test_profiling_leaves_the_shared_module_s_weights_the_model_s_own():
    model = worker.SCENARIOS["shared_module"][0]()
    before = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    x, y = worker.batch_of(0)
    profile_model(model, (x[:4], y[:4]), loss_fn=worker.loss_fn)  # traced on fake copies of the weights
    after = dict(model.named_parameters(remove_duplicate=False))
    assert all(after[n] is p for n, p in before.items())
    assert type(model.blocks[0].shared.weight) is torch.nn.Parameter
    F.cross_entropy(model(x), y).backward()  # still a real model


@pytest.mark.parametrize("name", list(worker.SCENARIOS))
def test_two_ranks_train_a_shared_weight_as_one_process(runs, name):
    ranks, reference = runs
    got, want = ranks[name], reference[name]
    assert "error" not in got, got.get("traceback")
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=RTOL, atol=0)
    if want["first_grads"] is not None and got["first_grads"] is not None:
        for param, value in want["first_grads"].items():
            assert _rel(got["first_grads"][param], value) < RTOL, ("first_grads", param)
    for key in ("params", "grads"):
        assert set(got[key]) == set(want[key])
        for param, value in want[key].items():
            assert _rel(got[key][param], value) < RTOL, (key, param, _rel(got[key][param], value))


@pytest.mark.parametrize("name", list(worker.SCENARIOS))
def test_the_shared_weight_stays_one_parameter_held_by_every_block(runs, name):
    ranks, reference = runs
    got, want = ranks[name], reference[name]
    assert "error" not in got, got.get("traceback")
    assert got["tied"] == want["tied"] and len(want["tied"]) >= 1
    assert all(len(group) >= worker.BLOCKS for group in got["tied"])
    if got["modules_tied"] is not None:
        assert got["modules_tied"]


def test_a_shared_module_is_sharded_once_and_a_shared_parameter_replicated(runs):
    ranks, _ = runs
    assert ranks["shared_module"]["kinds"]["blocks.0.shared.weight"] == "DTensor"
    assert ranks["shared_module_in_root_accum"]["kinds"]["shared.weight"] == "DTensor"
    weight = ranks["shared_weight"]["kinds"]
    assert weight["blocks.0.mix.weight"] == "Parameter" and weight["blocks.0.own.weight"] == "DTensor"
