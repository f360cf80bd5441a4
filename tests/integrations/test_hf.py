"""Tests of autopar.integrations.hf: the Hugging Face Trainer (transformers and accelerate as installed) on a
tiny Llama built from its config, in this process and on 2 gloo processes (one torchrun launch for every
scenario: tests/integrations/_hf_worker.py).

Parity: the Trainer on a prepared model trains as the plain Trainer on one process at the same global batch
(fp32, losses within 1e-5 relative over 10 steps), and the ranks together read, step by step, the rows the one
process reads. The refusals: what the Trainer cannot run (a pipeline; tensor parallelism on CPU, where the
ranks of a tensor-parallel group would read different batches), fp16 and the Trainer's own sharding."""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import math
import types

import pytest
import torch
import yaml

import autopar
from autopar._util.dist import World
from autopar.errors import AutoparError, PlanError
from autopar.integrations import hf
from autopar.integrations.hf_callback import feed_back
from autopar.plan_cache import cache_key, cached_plan_for, lookup, store
from autopar.plans import Loop, Plan
from autopar.topology import Topology
from tests.distributed._launch import torchrun
from tests.integrations import _hf

pytestmark = pytest.mark.usefixtures("one_plain_process")

RTOL = 1e-5  # fp32


def _close(losses: list[float], reference: list[float]) -> bool:
    return len(losses) == len(reference) == _hf.STEPS and all(
        math.isclose(a, b, rel_tol=RTOL) for a, b in zip(losses, reference))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The plain Trainer, one process, the global batch per step: the losses and the rows of each step."""
    return _hf.train(_hf.make_model(), _hf.args(str(tmp_path_factory.mktemp("ref")), per_device=_hf.GLOBAL))


SCENARIOS = [
    {"name": "chosen", "kind": "prepare"},
    {"name": "fsdp", "kind": "prepare", "plan": {"dp_shard": 2, "micro_batch_size": 4}},
    {"name": "fsdp_accum", "kind": "prepare", "plan": {"dp_shard": 2, "micro_batch_size": 2, "grad_accum": 2},
     "accum": 2},
    {"name": "fsdp_saves", "kind": "prepare", "plan": {"dp_shard": 2, "micro_batch_size": 4},
     "args": {"save_strategy": "steps", "save_steps": 5}},
    {"name": "fsdp_resumes", "kind": "resume", "plan": {"dp_shard": 2, "micro_batch_size": 4},
     "resume_plan": {"dp_replicate": 2, "micro_batch_size": 4}, "args": {"save_strategy": "steps", "save_steps": 5}},
    {"name": "tp_prepare", "kind": "prepare", "plan": {"tp": 2, "micro_batch_size": 8}},
    {"name": "tp_marked_by_hand", "kind": "tp_marked_by_hand"},
    {"name": "fsdp_unmarked", "kind": "fsdp_unmarked"},
]


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> dict:
    """Every scenario on 2 gloo processes, in one launch."""
    tmp = tmp_path_factory.mktemp("hf2")
    (tmp / "scenarios.json").write_text(json.dumps(SCENARIOS))
    torchrun("tests/integrations/_hf_worker.py", 2, [str(tmp / "scenarios.json"), str(tmp / "out.pt")],
             cache_dir=tmp / "autopar-cache", timeout_s=480)
    results = torch.load(tmp / "out.pt", weights_only=False)
    results["_dir"] = tmp
    return results


def _global_rows(result: dict) -> list[list[int]]:
    """Each step's rows over every rank, sorted (the order within a global batch does not change its mean)."""
    by_rank = result["rows_by_rank"]
    return [sorted(r for rank in by_rank for r in rank[step]) for step in range(_hf.STEPS)]


# ---- one process ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("plan", [None, Plan(micro_batch_size=4, grad_accum=2)], ids=["chosen", "accumulation"])
def test_one_process_trains_as_the_plain_trainer(reference, tmp_path, plan):
    model, args = hf.prepare(_hf.make_model(), _hf.args(str(tmp_path), per_device=_hf.GLOBAL),
                             sample=_hf.sample(_hf.GLOBAL), plan=plan, verbose=False)
    result = _hf.train(model, args)
    assert _close(result["losses"], reference["losses"]), (result["losses"], reference["losses"])
    assert [sorted(s) for s in result["rows"]] == [sorted(s) for s in reference["rows"]]


def test_prepare_sets_the_arguments_and_markers_the_trainer_reads(tmp_path):
    user = _hf.args(str(tmp_path), per_device=_hf.GLOBAL, activation_checkpointing=True, save_strategy="steps")
    plan = Plan(micro_batch_size=2, grad_accum=4, checkpointing="full")
    model, args = hf.prepare(_hf.make_model(), user, sample=_hf.sample(_hf.GLOBAL), plan=plan, verbose=False)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 4)
    assert (args.bf16, args.fp16, args.torch_compile) == (False, False, False)
    assert not args.activation_checkpointing and not args.gradient_checkpointing  # its deprecated alias follows
    assert args.save_only_model and str(args.save_strategy.value) == "steps"  # the user's schedule kept
    assert user.per_device_train_batch_size == _hf.GLOBAL and user.activation_checkpointing  # a copy: yours unchanged
    assert model._is_distributed_loading_by_transformers and model.is_distributed_loading_by_transformers
    assert (model._tp_size, model._fsdp_size) == (1, 1)
    assert model.config.distributed_config.dp_size == 1 and autopar.applied(model).checkpointed
    assert hf.trainer_settings(plan).changes(args) == {}


def test_remove_unused_columns_keeps_input_ids_under_bf16_autocast(tmp_path):
    # issue 12: the bf16 autocast wrapper hid the forward's signature and the Trainer dropped input_ids
    model, args = hf.prepare(_hf.make_model(), _hf.args(str(tmp_path), per_device=_hf.GLOBAL, max_steps=2),
                             sample=_hf.sample(_hf.GLOBAL), plan=Plan(micro_batch_size=8, precision="bf16"),
                             verbose=False)
    assert "input_ids" in inspect.signature(model.forward).parameters and args.remove_unused_columns
    result = _hf.train(model, args)
    assert "input_ids" in result["columns"] and "source" not in result["columns"]  # the unused column dropped
    assert len(result["losses"]) == 2 and all(math.isfinite(x) for x in result["losses"])


@pytest.mark.parametrize("plan, message", [
    (Plan(pp=2, pp_schedule="gpipe", micro_batch_size=4, grad_accum=2),
     "the Hugging Face Trainer cannot run this plan: a pipeline plan \\(pp=2\\) runs only under autopar.train_step"),
    (Plan(tp=2, micro_batch_size=8), "tensor parallelism \\(tp=2\\) only on GPUs"),
], ids=["pipeline", "tensor-parallel-on-cpu"])
def test_prepare_refuses_plans_the_trainer_cannot_run_before_touching_the_model(tmp_path, plan, message):
    model = _hf.make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(PlanError, match=message):
        hf.prepare(model, _hf.args(str(tmp_path), per_device=_hf.GLOBAL), sample=_hf.sample(_hf.GLOBAL), plan=plan)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert getattr(model, "_autopar_applied", None) is None and not model.is_distributed_loading_by_transformers
    path = tmp_path / "plan.yaml"  # the same from a plan file
    plan.save(path)
    with pytest.raises(PlanError, match=message):
        hf.prepare(model, _hf.args(str(tmp_path), per_device=_hf.GLOBAL), sample=_hf.sample(_hf.GLOBAL), plan=path)


@pytest.mark.parametrize("change, message", [
    ({"fp16": True}, "not fp16"), ({"fsdp": "full_shard"}, "drop the Trainer's fsdp"),
])
def test_prepare_refuses_arguments_it_cannot_honour(tmp_path, change, message):
    user = _hf.args(str(tmp_path), per_device=_hf.GLOBAL)
    object.__setattr__(user, *next(iter(change.items())))  # as TrainingArguments on a GPU would hold them
    with pytest.raises(PlanError, match=message):
        hf.prepare(_hf.make_model(), user, sample=_hf.sample(_hf.GLOBAL))
    with pytest.raises(PlanError, match="PreTrainedModel"):
        hf.prepare(torch.nn.Linear(2, 2), _hf.args(str(tmp_path), per_device=1), sample=torch.zeros(1, 2))


def test_a_trainer_older_than_load_time_sharding_trains_one_process_and_refuses_several(tmp_path, monkeypatch):
    # transformers 5.17: DistributedConfig has no dp_replicate_size and the Trainer wraps a sharded model in DDP
    monkeypatch.setattr(hf, "TRAINER_TAKES_SHARDED_MODELS", False)
    model, args = hf.prepare(_hf.make_model(), _hf.args(str(tmp_path), per_device=_hf.GLOBAL, max_steps=2),
                             sample=_hf.sample(_hf.GLOBAL), plan=Plan(micro_batch_size=8), verbose=False)
    assert model._is_distributed_loading_by_transformers and model.config.distributed_config.tp_size == 1
    assert len(_hf.train(model, args)["losses"]) == 2
    fresh, user = _hf.make_model(), _hf.args(str(tmp_path), per_device=_hf.GLOBAL)
    two = World(size=2, rank=1, local_rank=1, local_size=2)  # torchrun's second process
    monkeypatch.setattr(hf._dist, "world", lambda: two)
    with pytest.raises(PlanError, match=r"would wrap the sharded model in DDP .*transformers>=5.24") as info:
        hf.prepare(fresh, user, sample=_hf.sample(_hf.GLOBAL))
    assert "\n" not in str(info.value) and getattr(fresh, "_autopar_applied", None) is None


def test_settings_use_the_older_name_of_a_field_this_transformers_lacks():
    # transformers 5.17's TrainingArguments has gradient_checkpointing and no activation_checkpointing
    older = types.SimpleNamespace(per_device_train_batch_size=8, gradient_accumulation_steps=1, bf16=False, fp16=False,
                                  gradient_checkpointing=True, torch_compile=False, save_only_model=True)
    assert hf.trainer_settings(Plan(micro_batch_size=4, grad_accum=2)).changes(older) == {
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "gradient_checkpointing": False}


def test_default_save_strategy_is_handled(tmp_path):
    # The Trainer refuses a model marked as sharded at load time under its default save_strategy ("steps")
    # unless save_only_model=True; prepare sets it (the callback saves the rest through autopar.save).
    from transformers import Trainer

    user = _hf.args(str(tmp_path), per_device=_hf.GLOBAL, save_strategy="steps")
    model, args = hf.prepare(_hf.make_model(), user, sample=_hf.sample(_hf.GLOBAL), verbose=False)
    Trainer(model=model, args=args, train_dataset=_hf.Rows())  # constructs
    with pytest.raises(ValueError, match="save_only_model=True"):
        Trainer(model=model, args=dataclasses.replace(args, save_only_model=False), train_dataset=_hf.Rows())


def _resumable(out, *, stop_at: int | None = None, **kw):
    """A prepared Trainer of 6 steps that saves every 2, under a schedule that changes every step (warm-up, then
    linear decay) and a plan that accumulates, so a resume that lost either would train differently."""
    from transformers import Trainer

    user = _hf.args(str(out), per_device=_hf.GLOBAL, max_steps=6, save_strategy="steps", save_steps=2,
                    lr_scheduler_type="linear", warmup_steps=2, **kw)
    model, args = hf.prepare(_hf.make_model(), user, sample=_hf.sample(_hf.GLOBAL),
                             plan=Plan(micro_batch_size=4, grad_accum=2), verbose=False)
    stop = [] if stop_at is None else [_hf.StopAt(stop_at)]
    return model, Trainer(model=model, args=args, train_dataset=_hf.Rows(),
                          callbacks=[hf.AutoparCallback(feedback=False), *stop])


def _losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def test_resuming_the_trainer_restores_the_optimizer_and_schedule_and_trains_as_without_a_stop(tmp_path):
    """Under prepare the Trainer saves only the model (the optimizer state goes to checkpoint-N/autopar): its own
    resume_from_checkpoint reloaded the weights and went on with a fresh AdamW and schedule, without a word. The
    callback restores both: steps 3-6 after a resume at step 2 equal the run that never stopped."""
    whole_model, whole = _resumable(tmp_path / "whole")
    whole.train()
    _, first = _resumable(tmp_path / "cut", stop_at=2)
    first.train()
    for name in ("autopar/autopar.yaml", "scheduler.pt", "rng_state.pth"):
        assert (tmp_path / "cut" / "checkpoint-2" / name).is_file(), name
    resumed_model, resumed = _resumable(tmp_path / "cut")
    resumed.train(resume_from_checkpoint=True)  # the last checkpoint in output_dir: checkpoint-2
    expected, got = _losses(whole), _losses(resumed)
    assert sorted(got) == list(range(1, 7)) and all(math.isclose(got[s], expected[s], rel_tol=RTOL) for s in got), (
        got, expected)
    assert math.isclose(resumed.lr_scheduler.get_last_lr()[0], whole.lr_scheduler.get_last_lr()[0], rel_tol=1e-9)
    for (name, a), b in zip(whole_model.named_parameters(), resumed_model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=name)


def test_a_resume_the_callback_cannot_restore_fully_is_refused_in_one_line(tmp_path):
    import shutil

    _resumable(tmp_path / "a", stop_at=2)[1].train()
    _resumable(tmp_path / "b", stop_at=2, learning_rate=5e-3)[1].train()  # another run's checkpoint-2
    # from another output_dir: the callback finds a checkpoint-2 of another history there
    with pytest.raises(AutoparError, match=r"resumed at step 2 from a checkpoint other than .*b/checkpoint-2 \(their "
                                           r"histories differ\)"):
        _resumable(tmp_path / "b")[1].train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    shutil.rmtree(tmp_path / "a" / "checkpoint-2" / "autopar")  # saved without the callback's state
    with pytest.raises(AutoparError, match=r"at step 2 needs the training state AutoparCallback saves in "
                                           r".*a/checkpoint-2/autopar, which is not there"):
        _resumable(tmp_path / "a")[1].train(resume_from_checkpoint=True)
    (tmp_path / "b" / "checkpoint-2" / "scheduler.pt").unlink()  # saved by an autopar that kept no schedule
    with pytest.raises(AutoparError, match=r"holds no learning-rate schedule .* autopar\.load\(model, optimizer, "):
        _resumable(tmp_path / "b")[1].train(resume_from_checkpoint=True)


def test_a_peft_model_is_prepared_through_the_model_inside_it_and_trains_as_the_plain_trainer(tmp_path):
    """prepare refused a PEFT model with "wrap other modules with autopar.wrap and your own loop"; it now names the
    model inside, which trains as the plain Trainer trains the PEFT model, and the PEFT model still saves its
    adapter."""
    import peft

    def lora():
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        return peft.get_peft_model(_hf.make_model(), config)

    plain = lora()
    reference = _hf.train(plain, _hf.args(str(tmp_path / "plain"), per_device=_hf.GLOBAL, max_steps=4))
    model = lora()
    user = _hf.args(str(tmp_path / "prepared"), per_device=_hf.GLOBAL, max_steps=4)
    with pytest.raises(PlanError, match=r"^prepare takes the transformers model inside a PEFT model, not the "
                                        r"PeftModel: prepare\(peft_model\.base_model\.model, args, sample=\.\.\.\)"):
        hf.prepare(model, user, sample=_hf.sample(_hf.GLOBAL), verbose=False)
    inner, args = hf.prepare(model.base_model.model, user, sample=_hf.sample(_hf.GLOBAL), verbose=False)
    result = _hf.train(inner, args)
    assert len(result["losses"]) == 4 and all(
        math.isclose(a, b, rel_tol=RTOL) for a, b in zip(result["losses"], reference["losses"]))
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(torch.allclose(p, dict(plain.named_parameters())[n], rtol=1e-5, atol=1e-7)
                           for n, p in trained.items())
    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_prepare_picks_up_a_plan_autopar_tune_cached(tmp_path):
    sample = _hf.sample(_hf.GLOBAL)
    profile = autopar.profile_model(_hf.make_model(), sample, warn=False)
    tuned = Plan(micro_batch_size=2, grad_accum=4, checkpointing="full")  # not the cost model's choice
    chosen, _ = hf.prepare(_hf.make_model(), _hf.args(str(tmp_path), per_device=_hf.GLOBAL), sample=sample,
                           verbose=False)
    assert autopar.plan_of(chosen).strategy() != tuned.strategy()
    # what the tuner stores for a script whose wrap said loop="accumulates" (autopar.tune.engine._cache_key)
    store(tuned, cache_key(profile, Topology.detect(), global_batch_size=_hf.GLOBAL, loop="accumulates"),
          measurement={"tokens_per_s": 1234.0})
    model, args = hf.prepare(_hf.make_model(), _hf.args(str(tmp_path), per_device=_hf.GLOBAL), sample=sample,
                             verbose=False)
    assert autopar.plan_of(model).strategy() == tuned.strategy()
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 4)


def test_callback_measures_beside_the_prediction_and_feeds_the_plan_cache(tmp_path):
    model, args = hf.prepare(_hf.make_model(), _hf.args(str(tmp_path), per_device=_hf.GLOBAL),
                             sample=_hf.sample(_hf.GLOBAL), verbose=False)
    callback = hf.AutoparCallback(warmup_steps=2)
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("autopar")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        _hf.train(model, args, callbacks=[callback])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    # every logged step's measurement once, and the run's end adds no copy of the last step's
    measured = [line for line in said if "ms/step (predicted" in line]
    assert len(measured) == _hf.STEPS - 2 and all(line.startswith("step ") for line in measured), said
    m = callback.measurement
    assert m is not None and m.steps == _hf.STEPS - 2 and m.step_s > 0
    assert math.isclose(m.tokens_per_s, _hf.GLOBAL * _hf.SEQ / m.step_s)
    assert m.predicted_step_s is not None and m.predicted_tokens_per_s is not None  # the cost model's plan
    assert "ms/step (predicted" in m.describe() and m.peak_rss_bytes > 0
    state = autopar.applied(model)
    key = cache_key(state.profile, state.topology, global_batch_size=_hf.GLOBAL, loop=Loop.ACCUMULATES)
    kept = lookup(key)
    assert kept is not None and kept.strategy() == state.plan.strategy()
    assert kept.measurement["tokens_per_s"] == pytest.approx(m.tokens_per_s)
    # an ordinary run's plan is cached as a measured run's, and wrap says so, never "tuned" (issue 34, item 7)
    assert kept.measurement["source"] == "a measured run (the Hugging Face Trainer)"
    _, note = cached_plan_for(state.profile, state.topology, world_size=1, global_batch_size=_hf.GLOBAL,
                              loop=Loop.ACCUMULATES)
    assert "(from a measured run (the Hugging Face Trainer), measured " in note and "tuned" not in note
    # a plan measured faster is not replaced by a slower one
    faster = dataclasses.replace(m, step_s=m.step_s / 10, samples_per_s=m.samples_per_s * 10,
                                 tokens_per_s=m.tokens_per_s * 10)
    store(Plan(micro_batch_size=2, grad_accum=4), key, measurement=faster.to_cache())
    assert feed_back(state, m, loop=Loop.ACCUMULATES) is None
    assert lookup(key).grad_accum == 4


def test_bf16_asked_of_an_fp32_plan_is_said(tmp_path):
    with pytest.warns(UserWarning, match="the arguments ask for bf16, but the plan trains in fp32"):
        _, args = hf.prepare(_hf.make_model(), _hf.args(str(tmp_path), per_device=_hf.GLOBAL, bf16=True),
                             sample=_hf.sample(_hf.GLOBAL), verbose=False)
    assert not args.bf16  # autopar applies the plan's precision; the Trainer's own autocast stays off


def test_callback_refuses_a_model_prepare_did_not_wrap(tmp_path):
    with pytest.raises(PlanError, match="AutoparCallback needs the model autopar.integrations.hf.prepare returned"):
        _hf.train(_hf.make_model(), _hf.args(str(tmp_path), per_device=_hf.GLOBAL, max_steps=1),
                  callbacks=[hf.AutoparCallback()])


def test_importing_autopar_imports_no_transformers():
    import subprocess
    import sys

    code = "import sys, autopar; print('transformers' in sys.modules, 'accelerate' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


# ---- two processes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["chosen", "fsdp", "fsdp_accum", "fsdp_saves"])
def test_two_processes_train_as_one_at_the_global_batch(two, reference, name):
    result = two[name]
    assert "error" not in result, result.get("traceback")
    assert _close(result["losses"], reference["losses"]), (result["losses"], reference["losses"])
    assert _global_rows(result) == [sorted(s) for s in reference["rows"]]  # the same global batches, in order
    by_rank = result["rows_by_rank"]
    assert all(not set(by_rank[0][s]) & set(by_rank[1][s]) for s in range(_hf.STEPS))  # each rank its own half
    assert result["plan"]["dp_shard"] * result["plan"]["dp_replicate"] == 2 and result["plan"]["pp"] == 1
    assert result["measured_steps"] == _hf.STEPS - 2


def test_two_processes_accumulate_as_the_plan_says(two):
    plan = two["fsdp_accum"]["plan"]
    assert (plan["micro_batch_size"], plan["grad_accum"]) == (2, 2)
    assert all(len(rows) == 4 for rows in two["fsdp_accum"]["rows_by_rank"][0])  # 2 micro-batches of 2


def test_saved_checkpoints_hold_the_weights_and_the_state_autopar_loads_under_another_plan(two, tmp_path):
    from transformers import AutoModelForCausalLM

    saved = two["fsdp_saves"]["saved"]
    assert "checkpoint-5/model.safetensors" in saved and "checkpoint-5/autopar/autopar.yaml" in saved
    folder = two["_dir"] / "fsdp_saves" / "checkpoint-5"
    weights = AutoModelForCausalLM.from_pretrained(folder)  # the Trainer's save: the full weights
    model = autopar.wrap(_hf.make_model(), sample=_hf.sample(_hf.GLOBAL), verbose=False)  # one process
    # the Trainer's two groups (weight decay, none), built by the names the checkpoint records: groups are
    # matched by their parameters' names (issue 32, item 4)
    groups = yaml.safe_load((folder / "autopar" / "autopar.yaml").read_text())["param_groups"]
    named = dict(model.named_parameters())
    optimizer = torch.optim.AdamW([{"params": [named[n] for n in names]} for names in groups])
    autopar.load(model, optimizer, folder / "autopar")
    assert len(groups) == 2 and [len(g["params"]) for g in optimizer.param_groups] == [len(n) for n in groups]
    assert all(torch.equal(p, weights.state_dict()[n]) for n, p in model.named_parameters())
    assert len(optimizer.state) == len(list(model.parameters()))  # the optimizer state came too


def test_two_processes_resume_from_the_checkpoint_as_if_never_stopped(two, reference):
    """Stopped after the checkpoint at step 5 (FSDP) and resumed from it by a new Trainer under another plan
    (replicas): the optimizer state and random states come back, and steps 6-10 read the same rows and give the
    same losses as one process that never stopped."""
    result = two["fsdp_resumes"]
    assert "error" not in result, result.get("traceback")
    assert (result["plan"]["dp_replicate"], result["plan"]["dp_shard"]) == (2, 1)
    assert _close(result["losses"], reference["losses"]), (result["losses"], reference["losses"])
    resumed = [sorted(r for rank in result["rows_by_rank"] for r in rank[s]) for s in range(5)]
    assert resumed == [sorted(s) for s in reference["rows"][5:]]
    assert {"checkpoint-5/rng_state_0.pth", "checkpoint-5/rng_state_1.pth", "checkpoint-5/scheduler.pt"} <= set(
        result["saved"])


def test_tensor_parallel_under_the_trainer_is_refused_on_cpu_where_it_would_train_wrong(two):
    assert "tensor parallelism (tp=2) only on GPUs" in two["tp_prepare"]["error"]
    # what prepare refuses: marked as the probe did (no _tp_size), the Trainer gives the two ranks of
    # the tensor-parallel group different batches; it trained on them silently, and is now refused at the
    # first forward (issue 32, item 5: the peers' batches compared)
    hand = two["tp_marked_by_hand"]
    assert hand["error"].startswith("PeerBatchError: the ranks of a tensor-parallel group were given different "
                                    "batches"), hand


def test_without_the_markers_the_trainer_wraps_the_sharded_model_in_ddp_and_fails(two):
    assert "got mixed torch.Tensor and DTensor" in two["fsdp_unmarked"]["error"]
