"""Tests of autopar's public API in one process (no torch.distributed): plan(), wrap(), applied(), plan_of(),
data_shard(); the refusals a user meets and their messages; the rule's choices for specs of GPU clusters
(HSDP across nodes, full checkpointing when memory is short, InfeasiblePlanError when nothing fits)."""

from __future__ import annotations

import dataclasses
import functools
import logging

import os
import re

import pytest
import torch

import autopar
from autopar._util import dist as _dist
from autopar import api as api_mod
from autopar._util.log import get_logger
from autopar.errors import InfeasiblePlanError, PlanError, PlanMismatchError
from autopar.models.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens
from autopar.plans import Plan
from autopar.profile import model_fingerprint
from autopar.topology import Topology
from tests._training import CFG, GLOBAL_BATCH, batch, make_model, make_optimizer, reference

STEPS = 3


pytestmark = pytest.mark.usefixtures("one_plain_process")


@pytest.fixture(scope="module")
def ref():
    return reference("fp32", steps=STEPS)


def _train(model, steps=STEPS):
    opt = make_optimizer(model)
    losses = []
    for step in range(steps):
        x = batch(step)
        loss = lm_loss(model(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _unchanged(model, before):
    return (all(torch.equal(p, before[n]) for n, p in model.named_parameters())
            and all(p.grad is None for p in model.parameters())
            and "forward" not in vars(model) and getattr(model, "_autopar_applied", None) is None)


def _other_model():
    return GPT(GPTConfig(vocab_size=128, seq_len=32, num_layers=2, hidden_dim=64, num_heads=4))


def _fake_world(monkeypatch, size):
    """Make wrap() believe it runs as rank 0 of `size` processes (nothing is initialised)."""
    monkeypatch.setattr(_dist, "ensure_process_group",
                        lambda: _dist.World(size=size, rank=0, local_rank=0, local_size=size))


# ---- plan() -----------------------------------------------------------------------------------------
def test_plan_leaves_the_model_untouched_and_plans_one_cpu_process():
    model = make_model()
    before = _snapshot(model)
    p = autopar.plan(model, sample=batch(0), loss_fn=lm_loss)
    assert isinstance(p, Plan)
    assert _unchanged(model, before)
    assert (p.pp, p.dp_replicate, p.dp_shard, p.tp, p.dp_size, p.world_size) == (1, 1, 1, 1, 1, 1)
    assert p.micro_batch_size == GLOBAL_BATCH and p.grad_accum == 1
    assert (p.precision, p.compile, p.cpu_offload) == ("fp32", False, False)
    assert p.model_fingerprint == model_fingerprint(model)
    assert p.topology_fingerprint == Topology.detect().fingerprint()
    assert p.prediction["memory_bytes"] > 0 and p.prediction["step_s"] > 0


def _strategy(plan: Plan) -> dict:
    return {k: v for k, v in plan.to_dict().items() if k not in ("prediction",)}


def test_plan_is_the_search_first_candidate_for_two_nodes_of_h100():
    model = make_model()
    x = batch(0)[:4]
    p = autopar.plan(model, sample=x, topology="2x8xH100-SXM")
    ranked = autopar.candidates(model, sample=x, topology="2x8xH100-SXM", loop="plain")
    plain = [c for c in ranked if c.feasible and c.plan.dp_size == 16]
    assert _strategy(p) == _strategy(plain[0].plan)
    assert p.dp_size == 16 and p.world_size == 16 and (p.tp, p.pp, p.grad_accum) == (1, 1, 1)
    assert p.precision == "bf16"  # bf16 dominates on H100s (planned, not detected)
    twin = next(c for c in plain if c.plan.key() == p.replace(compile=not p.compile).key())
    assert twin.prediction.step_s >= p.prediction["step_s"]  # compile where it is predicted to pay, else eager
    assert p.global_batch_size == 4 * 16 and p.micro_batch_size == 4
    assert p.topology_fingerprint == Topology.from_spec("2x8xH100-SXM").fingerprint()
    # The ranking is by predicted step time among the plans that fit.
    times = [c.prediction.step_s for c in ranked if c.feasible]
    assert times == sorted(times)


def test_plan_with_a_global_batch_for_a_gpu_spec():
    p = autopar.plan(make_model(), sample=batch(0)[:2], topology="8xH100-SXM", global_batch_size=64)
    assert (p.dp_size, p.micro_batch_size, p.global_batch_size) == (8, 8, 64)


def test_plan_for_cpu_processes_on_two_nodes_keeps_every_process_reading_its_own_batch():
    p = autopar.plan(make_model(), sample=batch(0)[:2], topology=Topology.cpu(4, num_nodes=2))
    assert (p.dp_size, p.micro_batch_size, p.global_batch_size) == (4, 2, 8)
    assert (p.precision, p.compile, p.cpu_offload) == ("fp32", False, False)


def test_loop_train_step_opens_tensor_parallel_and_accumulation_plans():
    model, x = _meta_gpt(GPTConfig(vocab_size=32000, seq_len=2048, num_layers=4, hidden_dim=4096, num_heads=32), 1)
    plain = autopar.plan(model, sample=x, topology="4xH100-SXM")
    assert plain.dp_size == 4 and plain.grad_accum == 1
    ranked = autopar.candidates(model, sample=x, topology="4xH100-SXM")
    assert any(c.plan.tp > 1 for c in ranked) and any(c.plan.grad_accum > 1 for c in ranked)
    free = autopar.plan(model, sample=x, topology="4xH100-SXM", loop="train_step")
    assert _strategy(free) == _strategy([c for c in ranked if c.feasible][0].plan)
    assert free.prediction["step_s"] <= plain.prediction["step_s"]


def test_plan_refuses_a_global_batch_that_does_not_split():
    with pytest.raises(PlanError, match="global batch of 12 samples does not split over 8 data-parallel ranks"):
        autopar.plan(make_model(), sample=batch(0)[:2], topology="8xH100-SXM", global_batch_size=12)
    with pytest.raises(PlanError, match="global_batch_size must be a positive integer"):
        autopar.plan(make_model(), sample=batch(0), global_batch_size=0)
    with pytest.raises(PlanError, match="global_batch_size must be a positive integer"):
        autopar.plan(make_model(), sample=batch(0), global_batch_size=True)


def test_plan_refuses_a_world_size_that_differs_from_the_gpu_spec():
    with pytest.raises(PlanError, match="topology has 8 GPUs but the job has 4 processes"):
        autopar.plan(make_model(), sample=batch(0), topology="8xH100-SXM", world_size=4)


def test_plan_refuses_a_bad_topology_argument():
    with pytest.raises(TypeError, match="topology must be a Topology"):
        autopar.plan(make_model(), sample=batch(0), topology=8)


BIG = GPTConfig(vocab_size=32000, seq_len=2048, num_layers=32, hidden_dim=4096, num_heads=32)
BIG_SHALLOW = GPTConfig(vocab_size=32000, seq_len=4096, num_layers=16, hidden_dim=4096, num_heads=32)


@pytest.fixture
def spy_profile(monkeypatch):
    """Record the profiles autopar.plan makes (so a test checks the rule without profiling twice)."""
    import autopar.planning as planning_mod

    seen = []
    real = api_mod.profile_model

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(api_mod, "profile_model", spy)
    monkeypatch.setattr(planning_mod, "profile_model", spy)
    return seen


def _meta_gpt(cfg, batch_size):
    with torch.device("meta"):
        model = GPT(cfg)
    return model, torch.empty(batch_size, cfg.seq_len, dtype=torch.long, device="meta")


def test_search_turns_on_checkpointing_when_activations_do_not_fit(spy_profile):
    model, x = _meta_gpt(BIG_SHALLOW, 16)
    topo = Topology.from_spec("8xH100-SXM")
    p = autopar.plan(model, sample=x, topology=topo)
    assert all(q.is_meta for q in model.parameters())
    assert (p.dp_size, p.micro_batch_size, p.global_batch_size, p.precision) == (8, 16, 128, "bf16")
    assert p.checkpointing != "none" and not p.cpu_offload
    assert p.prediction["memory_bytes"] <= 0.95 * topo.device.memory_bytes
    # The same plan without checkpointing would not fit: the reason to checkpoint.
    profile, variants = spy_profile[0], {q.profile_precision: q for q in spy_profile[1:]}
    unchecked = autopar.predict(profile, p.replace(checkpointing="none"), topology=topo, variants=variants)
    assert unchecked.memory_bytes > 0.95 * topo.device.memory_bytes


def test_search_raises_when_nothing_fits():
    cfg = GPTConfig(vocab_size=32000, seq_len=2048, num_layers=2, hidden_dim=1024, num_heads=16)
    model, x = _meta_gpt(cfg, 1024)  # the logits alone are 1024 x 2048 x 32000 bf16 values: 134 GB
    with pytest.raises(InfeasiblePlanError) as info:
        autopar.plan(model, sample=x, topology="8xH100-SXM")
    msg = str(info.value)
    assert re.search(r"no plan for GPT with a global batch of 8192 fits in \d+ GiB per device \(.+\)", msg), msg
    assert "use more devices, a smaller batch" in msg and "loop='train_step'" in msg
    # the logits are one tensor larger than a GPU: the refusal names the op and where the step makes it
    assert re.search(r"One tensor of the step alone is [\d.]+ GiB at micro-batch \d+ \(aten\.\w+ in the "
                     r"((forward|backward) of |loss's )", msg), msg


def test_a_refusal_names_the_largest_tensor_only_where_it_takes_a_quarter_of_a_gpu():
    from autopar.search import largest_tensor_hint
    from autopar.profile import profile_model
    from autopar.topology import Topology

    topo = Topology.from_spec("1xL4")
    profile = profile_model(make_model(), batch(0), loss_fn=lm_loss)
    plan = autopar.Plan(micro_batch_size=profile.sample_batch_size)
    gpu = topo.device.memory_bytes
    small = dataclasses.replace(profile, largest_transient_bytes=gpu // 8)
    large = dataclasses.replace(profile, largest_transient_bytes=gpu // 2)
    assert largest_tensor_hint(small, plan, topo) == ""
    said = largest_tensor_hint(large, plan, topo)
    assert f"alone is {gpu / 2 / 2**30:.1f} GiB at micro-batch {plan.micro_batch_size}" in said
    assert f"(aten.{profile.largest_transient_op} in {profile.largest_transient_where})" in said


def test_search_offloads_to_cpu_only_when_one_gpu_cannot_hold_the_model_state():
    cfg = GPTConfig(vocab_size=32000, seq_len=128, num_layers=6, hidden_dim=8192, num_heads=64)
    model, x = _meta_gpt(cfg, 1)  # 4.9 B parameters: 78 GB of model state on one 80 GB GPU
    p = autopar.plan(model, sample=x, topology="1xH100-SXM")
    assert p.cpu_offload and p.world_size == 1
    # on two GPUs the sharded state fits
    p = autopar.plan(model, sample=x, topology="2xH100-SXM")
    assert p.dp_size == 2 and not p.cpu_offload


# ---- wrap() ----------------------------------------------------------------------------------------
def test_wrap_without_a_plan_trains_exactly_like_plain_pytorch(ref):
    ref_losses, ref_params = ref
    model = make_model()
    wrapped = autopar.wrap(model, sample=batch(0), loss_fn=lm_loss, verbose=False)
    assert wrapped is model and type(model) is GPT
    p = autopar.plan_of(model)
    assert (p.world_size, p.precision, p.compile, p.checkpointing, p.micro_batch_size) == (1, "fp32", False, "none", 8)
    assert _train(model) == ref_losses
    assert set(dict(model.named_parameters(remove_duplicate=False))) == set(ref_params)
    for n, q in model.named_parameters():
        assert torch.equal(q.detach(), ref_params[n]), n


def test_wrap_with_a_plan_object_and_checkpointing_trains_like_plain_pytorch(ref):
    ref_losses, ref_params = ref
    plan = Plan(micro_batch_size=GLOBAL_BATCH, checkpointing="full", checkpoint_every=2)
    model = autopar.wrap(make_model(), sample=batch(0), plan=plan, verbose=False)
    a = autopar.applied(model)
    assert a.plan == plan and a.checkpointed == ("blocks.0", "blocks.2") and a.compiled == ()
    assert a.mesh is None and a.device == torch.device("cpu")
    losses = _train(model)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=0)
    for n, q in model.named_parameters():
        torch.testing.assert_close(q.detach(), ref_params[n], rtol=1e-5, atol=1e-7)


def test_wrap_with_a_yaml_path(tmp_path, ref):
    model = make_model()
    plan = Plan(micro_batch_size=GLOBAL_BATCH, checkpointing="selective", model_fingerprint=model_fingerprint(model))
    path = plan.save(tmp_path / "plan.yaml")
    autopar.wrap(model, sample=batch(0), plan=str(path), verbose=False)
    assert autopar.plan_of(model) == plan
    assert len(autopar.applied(model).checkpointed) == CFG.num_layers
    torch.testing.assert_close(torch.tensor(_train(model)), torch.tensor(ref[0]), rtol=1e-6, atol=0)
    other = make_model()
    autopar.wrap(other, sample=batch(0), plan=path, verbose=False)  # a Path works too
    assert autopar.plan_of(other) == plan


def test_wrap_with_a_bf16_plan_on_cpu_returns_fp32_outputs():
    model = make_model()
    x = batch(0)
    fp32_out = model(x).detach()
    autopar.wrap(model, sample=x, plan=Plan(micro_batch_size=GLOBAL_BATCH, precision="bf16"), verbose=False)
    out = model(x)
    assert out.dtype == torch.float32
    assert not torch.equal(out, fp32_out)
    torch.testing.assert_close(out, fp32_out, rtol=0.05, atol=0.05)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    lm_loss(out, x).backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_wrap_with_compile_compiles_the_whole_model(monkeypatch):
    # compile itself is tested in tests/strategies/test_compile.py; here: wrap asks for it, once, whole-model,
    # and bf16's autocast wraps the compiled forward from outside (as `with autocast: compiled(x)` does)
    monkeypatch.setenv("AUTOPAR_COMPILE_BACKEND", "aot_eager")
    seen = []
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or real_compile(fn, **kw))
    model = autopar.wrap(make_model(), sample=batch(0), verbose=False,
                         plan=Plan(micro_batch_size=GLOBAL_BATCH, compile=True, precision="bf16"))
    assert autopar.applied(model).compiled == ("<model>",) and type(model) is GPT
    assert seen == [{"backend": "aot_eager"}]
    outer = vars(model)["forward"]  # the autocast wrapper, around the compiled forward
    assert type(outer).__name__ == "AutocastForward" and hasattr(outer.__wrapped__, "_torchdynamo_orig_callable")


def test_wrap_materialises_a_meta_model():
    with torch.device("meta"):
        model = GPT(CFG)
    autopar.wrap(model, sample=batch(0), verbose=False)
    assert not any(p.is_meta for p in model.parameters())
    assert 0.01 < model.tok_emb.weight.std().item() < 0.03  # reset_parameters ran: GPT-2's normal(0, 0.02)
    assert torch.all(model.blocks[0].ln_1.weight == 1)
    losses = _train(model, steps=2)
    assert all(torch.isfinite(torch.tensor(losses)))


def test_wrap_keeps_tied_weights_of_a_meta_model():
    with torch.device("meta"):
        model = GPT(CFG)
    autopar.wrap(model, sample=batch(0), verbose=False)
    assert sum(p.numel() for p in model.parameters()) == CFG.num_params
    assert model.lm_head.weight is model.tok_emb.weight


def test_wrap_twice_is_refused():
    model = autopar.wrap(make_model(), sample=batch(0), verbose=False)
    with pytest.raises(PlanError, match="already wrapped by autopar: wrap the original model once"):
        autopar.wrap(model, sample=batch(0), verbose=False)


def test_wrap_refuses_a_yaml_plan_for_another_world_size(tmp_path):
    path = Plan(dp_shard=2, micro_batch_size=4).save(tmp_path / "p.yaml")
    model = make_model()
    before = _snapshot(model)
    with pytest.raises(PlanMismatchError) as info:
        autopar.wrap(model, sample=batch(0), plan=path, verbose=False)
    msg = str(info.value)
    assert "= 2 processes, but this job has 1" in msg and "launch 2 processes" in msg
    assert _unchanged(model, before)
    # force cannot make a 2-process plan run on one process
    with pytest.raises(PlanMismatchError, match="this job has 1"):
        autopar.wrap(model, sample=batch(0), plan=path, force=True, verbose=False)


def test_wrap_refuses_a_plan_object_for_another_world_size():
    with pytest.raises(PlanMismatchError, match="= 2 processes, but this job has 1"):
        autopar.wrap(make_model(), sample=batch(0), plan=Plan(dp_shard=2, micro_batch_size=4), verbose=False)


def test_wrap_reports_the_world_mismatch_first_for_a_plan_object():
    x = batch(0)[:4]  # the sample each of 2 ranks fed when the plan was made
    with pytest.raises(PlanMismatchError, match="2 processes, but this job has 1"):
        autopar.wrap(make_model(), sample=x, plan=Plan(dp_shard=2, micro_batch_size=4), verbose=False)


def test_wrap_refuses_a_plan_for_another_model_unless_forced(tmp_path):
    other = _other_model()
    foreign = autopar.plan(other, sample=batch(0))
    assert foreign.model_fingerprint == model_fingerprint(other)
    model = make_model()
    with pytest.raises(PlanMismatchError) as info:
        autopar.wrap(model, sample=batch(0), plan=foreign, verbose=False)
    msg = str(info.value)
    assert foreign.model_fingerprint in msg and model_fingerprint(model) in msg and "force=True" in msg
    path = foreign.save(tmp_path / "foreign.yaml")
    with pytest.raises(PlanMismatchError, match="another model"):
        autopar.wrap(make_model(), sample=batch(0), plan=path, verbose=False)
    autopar.wrap(model, sample=batch(0), plan=foreign, force=True, verbose=False)
    assert autopar.plan_of(model) == foreign
    forced = autopar.wrap(make_model(), sample=batch(0), plan=path, force=True, verbose=False)
    assert autopar.plan_of(forced) == foreign


def test_wrap_refuses_a_global_batch_the_plan_does_not_make():
    plan = Plan(micro_batch_size=4)
    with pytest.raises(PlanError, match="= 4 samples per step, but the global batch is 6"):
        autopar.wrap(make_model(), sample=batch(0)[:4], plan=plan, global_batch_size=6, verbose=False)
    with pytest.raises(PlanError, match="= 4 samples per step, but the global batch is 8"):
        autopar.wrap(make_model(), sample=batch(0), plan=plan, verbose=False)  # sample of 8 on one process
    model = autopar.wrap(make_model(), sample=batch(0), plan=plan, global_batch_size=4, verbose=False)
    assert autopar.plan_of(model) == plan


def test_force_does_not_skip_the_global_batch_check():
    with pytest.raises(PlanError, match="global batch is 8"):
        autopar.wrap(make_model(), sample=batch(0), plan=Plan(micro_batch_size=4), force=True, verbose=False)


def test_wrap_refuses_cpu_offload_without_a_gpu():
    model = make_model()
    before = _snapshot(model)
    with pytest.raises(PlanError, match="cpu_offload moves parameters from GPU memory.*no GPU.*cpu_offload=False"):
        autopar.wrap(model, sample=batch(0), plan=Plan(micro_batch_size=8, cpu_offload=True), verbose=False)
    assert _unchanged(model, before)


@pytest.mark.parametrize("plan, message", [
    (Plan(tp=3, micro_batch_size=8), "tp=3 does not divide the 4 attention heads (num_heads)"),
    (Plan(pp=3, pp_schedule="1f1b", micro_batch_size=4, grad_accum=2),
     "the 1f1b schedule needs at least as many micro-batches as pipeline ranks: grad_accum=2 < pp=3"),
], ids=["tp-heads", "pp-micro-batches"])
def test_wrap_refuses_tp_and_pp_the_model_cannot_take(monkeypatch, plan, message):
    _fake_world(monkeypatch, 3)  # the plans need three processes; the refusal comes before any collective
    model = make_model()
    before = _snapshot(model)
    with pytest.raises(PlanError) as info:
        autopar.wrap(model, sample=batch(0)[:4], global_batch_size=plan.global_batch_size, plan=plan,
                     topology=Topology.cpu(3), verbose=False)
    assert message in str(info.value)
    assert _unchanged(model, before)


def test_check_plan_refusals_directly():
    from autopar.profile import profile_model
    from autopar.strategies.apply import check_plan

    model = make_model()
    profile = profile_model(model, batch(0))
    cpu = Topology.cpu(4)
    check_plan(Plan(dp_shard=4, micro_batch_size=2), profile, cpu, world_size=4)
    check_plan(Plan(tp=4), profile, cpu, world_size=4, model=model)  # 4 heads split 4 ways
    with pytest.raises(PlanError, match="tp=8 does not divide the 4 attention heads"):
        check_plan(Plan(tp=8), profile, Topology.cpu(8), world_size=8, model=model)
    with pytest.raises(PlanError, match="tp=4 spans more than one node"):
        check_plan(Plan(tp=4), profile, Topology.cpu(4, num_nodes=2), world_size=4, model=model)
    with pytest.raises(PlanError, match="8 pipeline stages but GPT has 4 blocks"):
        check_plan(Plan(pp=4, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2, grad_accum=4), profile, cpu,
                   world_size=4)
    with pytest.raises(PlanError, match="needs at least as many micro-batches as pipeline ranks: grad_accum=2 < pp=4"):
        check_plan(Plan(pp=4, pp_schedule="1f1b", grad_accum=2), profile, cpu, world_size=4)
    check_plan(Plan(pp=4, pp_schedule="gpipe", grad_accum=2), profile, cpu, world_size=4)  # GPipe takes any number
    with pytest.raises(PlanMismatchError):
        check_plan(Plan(dp_shard=2), profile, cpu, world_size=4)
    # a GPU without bf16 (a V100-like device: compute capability 7.0)
    a100 = Topology.from_spec("4xA100-80GB")
    v100 = dataclasses.replace(a100, device=dataclasses.replace(a100.device, name="V100-like",
                                                                compute_capability=(7, 0)))
    check_plan(Plan(dp_shard=4, precision="fp32"), profile, v100, world_size=4)
    with pytest.raises(PlanError, match="precision='bf16' is not supported by V100-like: use precision='fp32'"):
        check_plan(Plan(dp_shard=4, precision="bf16"), profile, v100, world_size=4)
    check_plan(Plan(dp_shard=4, precision="bf16"), profile, a100, world_size=4)
    assert autopar.plan(make_model(), sample=batch(0)[:2], topology=v100).precision == "fp32"
    assert autopar.plan(make_model(), sample=batch(0)[:2], topology=a100).precision == "bf16"


@pytest.mark.filterwarnings("ignore:autopar. no repeated blocks")
def test_wrap_refuses_checkpointing_a_model_without_blocks():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(PlanError, match="checkpointing='full' needs blocks to checkpoint, and Linear has none"):
        autopar.wrap(model, sample=torch.randn(2, 4), plan=Plan(micro_batch_size=2, checkpointing="full"),
                     verbose=False)
    autopar.wrap(model, sample=torch.randn(2, 4), verbose=False)  # without checkpointing it is fine
    assert autopar.applied(model).profile.num_blocks == 0


def test_wrap_refuses_bad_plan_arguments():
    with pytest.raises(TypeError, match="plan must be an autopar.Plan, a path"):
        autopar.wrap(make_model(), sample=batch(0), plan=42, verbose=False)
    with pytest.raises(PlanError, match="no plan file at"):
        autopar.wrap(make_model(), sample=batch(0), plan="/nonexistent/plan.yaml", verbose=False)


# ---- applied / plan_of / data_shard -----------------------------------------------------------------
def test_applied_plan_of_data_shard():
    model = make_model()
    for fn in (autopar.applied, autopar.plan_of, autopar.data_shard):
        with pytest.raises(PlanError, match="not wrapped by autopar.wrap"):
            fn(model)
    autopar.wrap(model, sample=batch(0), verbose=False)
    a = autopar.applied(model)
    assert autopar.plan_of(model) is a.plan
    assert tuple(autopar.data_shard(model)) == (0, 1)
    assert autopar.data_shard(model).rank == 0 and autopar.data_shard(model).size == 1
    assert a.profile.fingerprint == model_fingerprint(model) and a.profile.num_params == CFG.num_params
    assert a.topology.device_type == "cpu"
    # the state dict is the user's: no autopar entries, same keys as a fresh model
    assert list(model.state_dict()) == list(make_model().state_dict())


# ---- logging -----------------------------------------------------------------------------------------
def test_wrap_logs_the_profile_and_the_plan(caplog):
    logger = get_logger()
    logger.addHandler(caplog.handler)
    try:
        model = autopar.wrap(make_model(), sample=batch(0), verbose=True)
        quiet = autopar.wrap(make_model(), sample=batch(0), verbose=False)
    finally:
        logger.removeHandler(caplog.handler)
    p = autopar.plan_of(model)
    mesh_line = p.describe().splitlines()[1]
    assert "mesh" in mesh_line and "dp_shard=1" in mesh_line
    # (a phase that runs past 2 s on a loaded machine also says so: autopar._util.progress, checked apart)
    records = [r for r in caplog.records if r.name == "autopar" and not r.pathname.endswith("progress.py")]
    assert len(records) == 1, "verbose=False must log nothing"
    text = records[0].getMessage()
    assert mesh_line in text
    assert f"autopar plan {p.key()}" in text and "(chosen by the cost model)" in text
    assert "model GPT" in text and "4 x Block at blocks" in text
    assert records[0].levelno == logging.INFO
    assert quiet is not model



def test_a_profile_note_is_said_once_in_the_summary_or_once_as_a_warning(caplog, monkeypatch):
    """A model without repeated blocks: verbose, its note is in the summary wrap logs and no UserWarning repeats it;
    quiet, the warning says it (nothing is logged). Each wrap plans afresh (wrap's cache off)."""
    import warnings

    monkeypatch.setenv("AUTOPAR_NO_WRAP_CACHE", "1")

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    logger = get_logger()
    logger.addHandler(caplog.handler)
    try:
        with warnings.catch_warnings(record=True) as loud_warnings:
            warnings.simplefilter("always")
            autopar.wrap(mlp(), sample=torch.randn(4, 8), verbose=True)
        said = [r.getMessage() for r in caplog.records if r.name == "autopar"]
        caplog.clear()
        with warnings.catch_warnings(record=True) as quiet_warnings:
            warnings.simplefilter("always")
            autopar.wrap(mlp(), sample=torch.randn(4, 8), verbose=False)
    finally:
        logger.removeHandler(caplog.handler)
    assert sum("note          no repeated blocks" in m for m in said) == 1
    assert not [w for w in loud_warnings if "no repeated blocks" in str(w.message)]
    assert len([w for w in quiet_warnings if "no repeated blocks" in str(w.message)]) == 1

def test_logger_prefix_and_level():
    logger = get_logger()
    assert logger.name == "autopar" and logger.level == logging.INFO
    assert any(getattr(h, "formatter", None) and h.formatter._fmt.startswith("[autopar]") for h in logger.handlers)


def test_wrap_logs_that_a_split_step_needs_train_step(caplog, monkeypatch):
    logger = get_logger()
    logger.addHandler(caplog.handler)
    try:
        autopar.wrap(make_model(), sample=batch(0), plan=Plan(micro_batch_size=4, grad_accum=2))
    finally:
        logger.removeHandler(caplog.handler)
    assert any("autopar.train_step" in r.getMessage() for r in caplog.records)
    assert any("(given)" in r.getMessage() for r in caplog.records)


def test_public_names():
    for name in ("Plan", "ModelProfile", "profile_model", "Topology", "wrap", "plan", "applied", "plan_of",
                 "data_shard", "PlanError", "PlanMismatchError", "ProfileError", "InfeasiblePlanError"):
        assert getattr(autopar, name) is not None
    with pytest.raises(AttributeError):
        autopar.no_such_name  # noqa: B018
    assert issubclass(autopar.PlanMismatchError, autopar.PlanError)
    assert issubclass(autopar.InfeasiblePlanError, autopar.AutoparError)


def test_sample_may_be_meta_for_a_real_model():
    model = make_model()
    before = _snapshot(model)
    x = torch.empty(GLOBAL_BATCH, CFG.seq_len, dtype=torch.long, device="meta")
    autopar.wrap(model, sample=x, verbose=False)
    assert autopar.plan_of(model).micro_batch_size == GLOBAL_BATCH
    assert all(torch.equal(p, before[n]) and not p.is_meta for n, p in model.named_parameters())
    assert torch.equal(model(batch(0)), make_model()(batch(0)))


def test_synthetic_tokens_are_what_the_tests_assume():
    # the reference run and wrap() see the same data: the comparison above is meaningful
    assert torch.equal(batch(1), synthetic_tokens(GLOBAL_BATCH, CFG, step=1, seed=1))
    assert not torch.equal(batch(0), batch(1))


def test_wrap_hugging_face_llama_with_selective_checkpointing():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    sample = {"input_ids": ids, "labels": ids}

    def run(plan):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
        if plan is not None:
            autopar.wrap(model, sample=sample, plan=plan, verbose=False)
        out = model(**sample)  # the default call: Hugging Face's cache would be on
        out.loss.backward()
        return model, out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    _, ref_loss, ref_grads = run(None)
    model, loss, grads = run(Plan(micro_batch_size=2, checkpointing="selective"))
    assert autopar.applied(model).checkpointed == ("model.layers.0", "model.layers.1")
    assert model.config.use_cache is True and out_cache(model, sample) is None  # off in training forwards only
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-6, msg=n)


def out_cache(model, sample):
    return model(**sample).past_key_values


# ---- the plan cache in wrap ---------------------------------------------------------------------------
def test_wrap_uses_a_plan_cached_for_this_model_and_says_so(caplog):
    from autopar.plan_cache import cache_key, store

    model = make_model()
    x = batch(0)
    profile = autopar.profile_model(make_model(), x, warn=False)
    topo = Topology.detect()
    tuned = Plan(micro_batch_size=GLOBAL_BATCH, checkpointing="full")  # not what the cost model would pick
    assert autopar.plan(make_model(), sample=x).checkpointing != "full"
    path = store(tuned, cache_key(profile, topo, global_batch_size=GLOBAL_BATCH, loop="plain"),
                 measurement={"tokens_per_s": 1234.0})
    logger = get_logger()
    logger.addHandler(caplog.handler)
    try:
        autopar.wrap(model, sample=x)
    finally:
        logger.removeHandler(caplog.handler)
    assert autopar.plan_of(model).checkpointing == "full"
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "autopar")
    assert f"using the plan cached at {path}" in text and "(from the plan cache)" in text


def test_wrap_refuses_a_tampered_plan_cache():
    from autopar.plan_cache import CacheError, cache_key, store

    x = batch(0)
    profile = autopar.profile_model(make_model(), x, warn=False)
    path = store(Plan(micro_batch_size=GLOBAL_BATCH),
                 cache_key(profile, Topology.detect(), global_batch_size=GLOBAL_BATCH, loop="plain"))
    os.chmod(path, 0o666)
    with pytest.raises(CacheError, match="can be written by others .* chmod 600"):
        autopar.wrap(make_model(), sample=x)


# ---- a model that trains but cannot be traced (issue 10): a safe plan, said once -----------------------
@pytest.fixture()
def weights_unreadable(monkeypatch):
    """A trace may not read the weights' values (as for a model over MAX_REAL_WEIGHT_BYTES): _ChecksItsLabels then
    cannot be traced, and the safe plan is what is left (tests/profile/test_build.py traces it with its values)."""
    import autopar.profile.build as build
    monkeypatch.setattr(build, "MAX_REAL_WEIGHT_BYTES", 0)


class _ChecksItsLabels(torch.nn.Module):
    """Reads the value of what its weights compute in forward (a check on its logits): trains, but a fake-tensor
    trace cannot run it (DataDependentOutputException; reads of the sample's own values are traced from it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(3)))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.layers(x)
        if not torch.isfinite(logits).all():
            raise ValueError("the logits are not finite")
        return torch.nn.functional.cross_entropy(logits, labels)


def _labelled(step: int = 0) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"x": torch.randn(4, 8, generator=g), "labels": torch.randint(0, 8, (4,), generator=g)}


def _autopar_records(caplog, fn):
    logger = get_logger()
    logger.addHandler(caplog.handler)
    try:
        result = fn()
    finally:
        logger.removeHandler(caplog.handler)
    return result, [r for r in caplog.records if r.name == "autopar"]


@pytest.mark.parametrize("verbose", [True, False])
def test_wrap_applies_a_safe_plan_to_a_model_it_cannot_trace_and_says_so_once(caplog, verbose, weights_unreadable):
    model, reference_model = _ChecksItsLabels(), _ChecksItsLabels()
    wrapped, records = _autopar_records(caplog, lambda: autopar.wrap(model, sample=_labelled(), verbose=verbose))
    assert wrapped is model
    warned = [r for r in records if r.levelno == logging.WARNING]
    assert len(warned) == 1, [r.getMessage() for r in records]
    text = warned[0].getMessage()
    assert "could not be traced on fake tensors (DataDependentOutputException" in text
    assert "safe plan from the model's structure" in text and "no prediction" in text
    assert "one process, micro-batch 4, fp32, no checkpointing, no compile" in text
    p = autopar.plan_of(model)
    assert (p.precision, p.compile, p.checkpointing, p.dp_shard, p.micro_batch_size) == ("fp32", False, "none", 1, 4)
    assert p.prediction is None and p.model_fingerprint == model_fingerprint(reference_model)
    if verbose:
        assert any(api_mod.SAFE_SOURCE in r.getMessage() for r in records if r.levelno == logging.INFO)
    # it trains as the unwrapped model does
    for m in (model, reference_model):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for step in range(3):
            m(**_labelled(step)).backward()
            opt.step()
            opt.zero_grad()
    for (name, a), b in zip(model.named_parameters(), reference_model.parameters()):
        torch.testing.assert_close(a, b, msg=name)


def test_plan_gives_the_safe_plan_with_a_warning_and_predict_raises_the_trace_error(weights_unreadable):
    model = _ChecksItsLabels()
    with pytest.warns(autopar.UntracedWarning, match="could not be traced on fake tensors") as record:
        p = autopar.plan(model, sample=_labelled(), topology="8xH100-SXM")
    assert len(record) == 1 and "FSDP2 over 8 processes" in str(record[0].message)
    assert (p.precision, p.compile, p.dp_shard, p.tp, p.pp, p.micro_batch_size) == ("bf16", False, 8, 1, 1, 4)
    assert p.global_batch_size == 32 and p.prediction is None
    with pytest.raises(autopar.errors.TraceError, match="could not run one step of _ChecksItsLabels"):
        autopar.predict(model, p, sample=_labelled(), topology="8xH100-SXM")


def test_wrap_applies_a_given_plan_to_a_model_it_cannot_trace_without_the_safe_plan_warning(caplog):
    model = _ChecksItsLabels()
    _, records = _autopar_records(caplog, lambda: autopar.wrap(model, sample=_labelled(), verbose=False,
                                                               plan=Plan(micro_batch_size=4)))
    assert not any("safe plan" in r.getMessage() for r in records)
    assert autopar.plan_of(model).micro_batch_size == 4
