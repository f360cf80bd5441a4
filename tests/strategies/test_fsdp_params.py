"""Data parallelism (FSDP2) of models whose parameters are held in unusual ways. Blocks with parameters of several
dtypes: complex spectral weights beside real Linears (a Fourier neural operator's block), a float64 Parameter beside
a float32 Linear, a float64 Linear beside a float32 one. fully_shard refuses a unit of mixed dtypes; autopar makes
the modules of the other dtype units of their own, and replicates a parameter of the other dtype held beside the
main one, so 2 gloo ranks train as one process on the global batch (fp32, 1e-5), and a bf16 plan casts only the
float32 weights. A model that reads its weights from a ParameterList and a ParameterDict (which run no forward, so
FSDP2 never gathered them as units: "mixed torch.Tensor and DTensor"): they stay with the model's own unit."""

from __future__ import annotations

import pytest
import torch

from autopar.strategies.fsdp import dtype_units
from autopar.strategies.precision import fsdp_policy
from tests.distributed._launch import torchrun
from tests.strategies import _fsdp_params_worker as worker

RTOL = 1e-5
WORKER = "tests/strategies/_fsdp_params_worker.py"
FP32 = [n for n, (_, fields, _) in worker.SCENARIOS.items() if fields.get("precision", "fp32") == "fp32"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().norm() / b.abs().norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_params")
    torchrun(WORKER, 2, [str(tmp / "ranks.pt")], cache_dir=tmp / "cache", timeout_s=600)
    return torch.load(tmp / "ranks.pt", weights_only=False)


def test_the_modules_of_another_dtype_become_units_and_a_parameter_beside_the_main_one_is_replicated():
    fourier = worker.build(worker.FourierBlock)
    extra, replicated = dtype_units(fourier, list(fourier.blocks))
    assert {i: [n for n, _ in v] for i, v in extra.items()} == {
        id(b): [f"blocks.{k}.spectral"] for k, b in enumerate(fourier.blocks)} and replicated == []
    scale = worker.build(worker.Float64Scale)
    extra, replicated = dtype_units(scale, list(scale.blocks))
    assert extra == {} and [n for n, _ in replicated] == [f"blocks.{k}.scale" for k in range(worker.BLOCKS)]
    plain = worker.build(worker.Float64Linear)
    plain.double()  # one dtype everywhere: nothing to do
    assert dtype_units(plain, list(plain.blocks)) == ({}, [])


def test_a_bf16_plan_casts_float32_units_only():
    assert fsdp_policy("bf16", root=False, dtype=torch.float32).param_dtype == torch.bfloat16
    for dtype in (torch.complex64, torch.float64):
        policy = fsdp_policy("bf16", root=False, dtype=dtype)
        assert policy.param_dtype is None and policy.reduce_dtype is None


@pytest.mark.parametrize("name", FP32)
def test_two_ranks_train_as_one_process(runs, name):
    got, want = runs[name], worker.run_reference(name)
    assert "error" not in got, got.get("traceback")
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=RTOL, atol=0)
    for key in ("params", "grads"):
        assert set(got[key]) == set(want[key])
        for param, value in want[key].items():
            assert got[key][param].dtype == value.dtype, (key, param)
            assert _rel(got[key][param], value) < RTOL, (key, param, _rel(got[key][param], value))


def test_every_parameter_keeps_its_dtype_and_is_sharded_or_replicated_as_said(runs):
    complex_ = runs["complex_sharded"]
    assert complex_["dtypes"]["blocks.0.spectral.weight"] == torch.complex64
    assert complex_["kinds"]["blocks.0.spectral.weight"] == "DTensor" == complex_["kinds"]["blocks.0.mix.weight"]
    # 5 complex elements over 2 shards: replicated (FSDP2's padding of a complex weight trained it wrong)
    assert complex_["kinds"]["blocks.0.spectral.shift"] == "Parameter"
    assert complex_["dtypes"]["blocks.0.spectral.shift"] == torch.complex64
    scale = runs["float64_param_accum"]
    assert scale["kinds"]["blocks.0.scale"] == "Parameter" and scale["dtypes"]["blocks.0.scale"] == torch.float64
    assert scale["kinds"]["blocks.0.lin.weight"] == "DTensor"


def test_a_bf16_plan_computes_float32_weights_in_bf16_and_float64_ones_as_they_are(runs):
    got = runs["float64_module_bf16"]
    assert "error" not in got, got.get("traceback")
    assert got["gathered"]["blocks.0.lin"] == torch.bfloat16 and got["gathered"]["blocks.0.precise"] == torch.float64
    assert got["kinds"]["blocks.0.precise.weight"] == "DTensor" and got["dtypes"]["blocks.0.precise.weight"] == torch.float64
    want = worker.run_reference("float64_module_bf16", autocast=True)  # the same casts, in one process
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=2e-2, atol=0)


def test_parameter_containers_are_no_units_and_their_weights_stay_with_the_model():
    from autopar.profile.blocks import find_blocks

    _, units, repeated = find_blocks(worker.build(worker.ListedParams))
    assert [n for n, _ in units] == ["head"] and not repeated


def test_a_model_in_one_process_has_a_no_sync_that_holds_nothing_back(monkeypatch):
    """A loop written for DDP calls model.no_sync(): on one process (no FSDP) it is a context that does nothing."""
    import autopar

    monkeypatch.setenv("AUTOPAR_NO_WRAP_CACHE", "1")
    model = autopar.wrap(worker.build(worker.Float64Linear), sample=worker.batch_of(0), loss_fn=worker.loss_fn,
                         verbose=False)
    x, y = worker.batch_of(0)
    with model.no_sync():
        worker.loss_fn(model(x), (x, y)).backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", ["ddp_loop_no_sync_sharded", "ddp_loop_no_sync_replicated"])
def test_no_sync_holds_fsdps_reduction_back_until_its_exit(runs, name):
    """The DDP loop trains as one process (test_two_ranks_train_as_one_process), and its no_sync() switched FSDP2's
    gradient synchronisation off for the first half and on again, every step."""
    assert runs[name]["sync_calls"] == [False, True] * worker.STEPS


def test_a_foreach_optimizer_steps_the_replicated_weights_beside_the_sharded_ones_saying_so(runs):
    """torch's foreach kernels refuse a group mixing the replicated complex weight with the sharded ones ("got mixed
    torch.Tensor and DTensor"): that group steps tensor by tensor, said once (the parity test checks the result)."""
    said = [m for m in runs["complex_sharded_foreach"]["said"] if "tensor by tensor" in m]
    assert len(said) == 1 and "AdamW" in said[0]
    assert not any("tensor by tensor" in m for m in runs["complex_sharded"]["said"])  # foreach=False: nothing to say


def test_a_users_own_loop_clips_with_autopar_clip_grad_norm_as_torch_clips_one_process(runs):
    """torch's clip_grad_norm_ refuses the replicated complex weight beside the sharded ones; autopar.clip_grad_norm_
    returns the norm one process computes on the global batch at every step (the parity test checks the weights)."""
    got, want = runs["complex_sharded_user_clipped"], worker.run_reference("complex_sharded_user_clipped")
    assert "error" not in got, got.get("traceback")
    assert len(got["norms"]) == worker.STEPS and min(got["norms"]) > worker.CLIP  # it clipped every step
    said = [m for m in got["said"] if "clip_grad_norm_" in m]  # at wrap, naming the replicated weight
    assert len(said) == 1 and "blocks.0.spectral.shift" in said[0] and "autopar.clip_grad_norm_(model" in said[0]
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(want["norms"]), rtol=RTOL, atol=0)


def test_channels_last_weights_are_made_contiguous_for_fsdp2_and_train_as_one_process(runs):
    """(The parity test checks the training.) The plan's notes name the weights made contiguous."""
    assert worker.build(worker.ChannelsLast).convs[0].weight.is_contiguous() is False
    notes = [n for n in runs["channels_last_sharded"]["notes"] if "made contiguous" in n]
    assert len(notes) == 1 and notes[0].startswith("data parallel: 2 weight(s)") and "convs.0.weight" in notes[0]
