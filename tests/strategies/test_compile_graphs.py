"""CUDA graphs (Plan.cuda_graphs: torch.compile's reduce-overhead mode): where they cannot run, apply_plan refuses
with one line before anything changes (a CPU model; a compile backend other than inductor); the forward's outputs
are copies, so a replay cannot overwrite what a loop kept, and gradients flow through them. (The GPU run itself:
tests/gpu/test_single_gpu.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar.cost import Calibration, predict_profile
from autopar.errors import PlanError
from autopar.models.gpt import GPT, GPTConfig, lm_loss
from autopar.planning import short_name
from autopar.profile import profile_model
from autopar.search import enumerate_plans
from autopar.strategies.compile import _outputs_copied, cuda_graphs_refusal


def test_cuda_graphs_need_compile_in_one_process_and_keep_other_plans_keys():
    for bad in ({}, {"compile": True, "dp_shard": 2}, {"compile": True, "dp_replicate": 2},
                {"compile": True, "cpu_offload": True}):
        with pytest.raises(PlanError, match="cuda_graphs=True replays torch.compile's graphs in one process"):
            autopar.Plan(precision="bf16", cuda_graphs=True, **bad)
    with pytest.raises(PlanError, match="cuda_graphs"):
        autopar.Plan(compile=True, cuda_graphs=1)
    plain = autopar.Plan(precision="bf16", compile=True, micro_batch_size=4)
    assert "cuda_graphs" not in plain.strategy() and "cuda_graphs" not in plain.to_dict()  # older keys and files
    graphs = plain.replace(cuda_graphs=True)
    assert graphs.key() != plain.key() and autopar.Plan.from_yaml(graphs.to_yaml()) == graphs
    assert short_name(graphs) == "1gpu mb4 bf16 compile+graphs" and "compile: True (CUDA graphs)" in graphs.describe()


def _gpt_profiles():
    cfg = GPTConfig(vocab_size=256, seq_len=64, num_layers=4, hidden_dim=64, num_heads=4)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    sample = torch.randint(0, 256, (8, 64))
    return (profile_model(model, sample, loss_fn=lm_loss),
            {"bf16": profile_model(model, sample, loss_fn=lm_loss, precision="bf16")})


def test_only_the_tuners_one_process_search_has_cuda_graph_twins_of_its_compiled_plans():
    profile, _ = _gpt_profiles()
    one = autopar.Topology.from_spec("1xH200")
    tuner = list(enumerate_plans(profile, one, world_size=1, global_batch_size=8, measured=True))
    compiled = [p for p in tuner if p.compile and not p.cuda_graphs]
    twins = [p for p in tuner if p.cuda_graphs]
    assert twins and sorted(p.replace(cuda_graphs=False).key() for p in twins) == sorted(p.key() for p in compiled)
    assert not any(p.cuda_graphs for p in enumerate_plans(profile, one, world_size=1, global_batch_size=8))  # wrap's
    eight = autopar.Topology.from_spec("8xH200")
    assert not any(p.cuda_graphs for p in enumerate_plans(profile, eight, world_size=8, global_batch_size=8,
                                                          measured=True))


def test_replayed_graphs_are_predicted_to_spare_the_hosts_launches_only():
    """A small model's compiled step is host-bound (24 us a kernel from inductor's wrapper against kernels of a few
    microseconds): replayed as CUDA graphs, the launches cost the GPU's own, and the step is predicted faster; the
    GPU's work is the same."""
    profile, variants = _gpt_profiles()
    one = autopar.Topology.from_spec("1xH200")
    plan = autopar.Plan(precision="bf16", compile=True, micro_batch_size=8)
    compiled, graphs = (predict_profile(profile, p, one, Calibration(), variants=variants)
                        for p in (plan, plan.replace(cuda_graphs=True)))
    assert graphs.step_s < 0.5 * compiled.step_s
    assert graphs.memory.peak_bytes == compiled.memory.peak_bytes


def test_cuda_graphs_need_a_cuda_device_and_inductor():
    assert "runs on cpu" in cuda_graphs_refusal(torch.device("cpu"), "inductor")
    why = cuda_graphs_refusal(torch.device("cuda", 0), "aot_eager")
    assert "'aot_eager'" in why and "AUTOPAR_COMPILE_BACKEND" in why
    assert cuda_graphs_refusal(torch.device("cuda", 0), "inductor") is None


def test_wrap_refuses_cuda_graphs_on_a_cpu_model_before_changing_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    forward = model.forward
    plan = autopar.Plan(micro_batch_size=4, compile=True, cuda_graphs=True)
    with pytest.raises(PlanError, match="cuda_graphs=True replays CUDA graphs, and this model runs on cpu"):
        autopar.wrap(model, sample=torch.randn(4, 8), plan=plan, verbose=False)
    assert model.forward == forward and "_autopar_forwards" not in vars(model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_the_outputs_are_copies_that_carry_the_gradient():
    pool = {"loss": torch.zeros((), requires_grad=False), "logits": torch.zeros(2, 3)}  # a replay's memory

    def forward(x):
        pool["logits"] = x * 2  # what the graph wrote
        return {"loss": pool["logits"].sum(), "logits": pool["logits"], "n": 3}

    x = torch.ones(2, 3, requires_grad=True)
    out = _outputs_copied(forward)(x)
    assert out["n"] == 3 and torch.equal(out["logits"], pool["logits"])
    assert out["logits"].untyped_storage().data_ptr() != pool["logits"].untyped_storage().data_ptr()
    out["loss"].backward()
    assert torch.equal(x.grad, torch.full((2, 3), 2.0))
    pool["logits"].fill_(7.0)  # the next replay overwrites the pool
    assert torch.equal(out["logits"], torch.full((2, 3), 2.0))


def test_wraps_choice_carries_the_replayed_step_where_graphs_could_run_and_only_there():
    """autopar.plan / wrap's choice for one GPU: the compiled plan's prediction holds the step replayed as CUDA graphs
    (`graphs_step_s`, what makes wrap race them: autopar.race.races_graphs), below the compiled step for this
    host-bound model; a plan for 8 GPUs has none."""
    cfg = GPTConfig(vocab_size=256, seq_len=64, num_layers=4, hidden_dim=64, num_heads=4)
    torch.manual_seed(0)
    model, sample = GPT(cfg), torch.randint(0, 256, (8, 64))
    one = autopar.plan(model, sample=sample, loss_fn=lm_loss, topology="1xH200")
    assert one.compile and not one.cuda_graphs
    assert one.prediction["graphs_step_s"] < 0.9 * one.prediction["step_s"]
    eight = autopar.plan(model, sample=sample, loss_fn=lm_loss, topology="8xH200")
    assert "graphs_step_s" not in eight.prediction
