"""`autopar.plan` then `autopar.predict` (or plans for two topologies) of one model trace it once a process
(autopar/planning.py, `profile_variants`): the second call takes the first one's traces while the model's structure,
sample shapes, loss and blocks are the same, and traces afresh when any of them changed."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar
from autopar import planning


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


@pytest.fixture
def traces(monkeypatch):
    count = [0]
    real = planning.profile_model

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(planning, "profile_model", counted)
    return count


def test_plan_then_predict_and_a_second_topology_trace_the_model_once(traces):
    model, x = Net(), torch.randn(8, 16)
    plan = autopar.plan(model, sample=x, topology="1xH200")
    after_plan = traces[0]
    # bf16 (autocast) alone, the profile: the search offers only bf16 plans on GPUs with bf16; not bf16-pure
    # (FSDP's bf16 weights): one GPU runs FSDP only to offload, which the search tries only when nothing else fits
    assert after_plan == 1 and not plan.uses_fsdp
    fresh = autopar.predict(Net(), plan, sample=x, topology="1xH200")  # another model object: traced
    assert traces[0] == 2 * after_plan
    again = autopar.predict(model, plan, sample=x, topology="1xH200")
    assert traces[0] == 2 * after_plan  # the same model: its traces reused
    eight = autopar.plan(model, sample=x, topology="8xH100-SXM")
    assert traces[0] == 2 * after_plan + 1  # and only the trace its FSDP plans read is added: bf16-pure
    assert again.step_s == pytest.approx(fresh.step_s) and again.memory_bytes == fresh.memory_bytes
    assert autopar.predict(Net(), eight, sample=x, topology="8xH100-SXM").memory_bytes == \
        autopar.predict(model, eight, sample=x, topology="8xH100-SXM").memory_bytes  # as a fresh trace predicts


@pytest.mark.parametrize("change", ["sample shape", "frozen layer", "eval mode", "no bf16"])
def test_a_changed_model_or_sample_is_traced_afresh(traces, change):
    model, x, topology = Net(), torch.randn(8, 16), "1xH200"
    autopar.plan(model, sample=x, topology=topology)
    before = traces[0]
    if change == "sample shape":
        x = torch.randn(4, 16)
    elif change == "frozen layer":
        model.layers[0].requires_grad_(False)
    elif change == "eval mode":
        model.eval()
    elif change == "no bf16":
        topology = None  # this machine: a CPU, no bf16
    autopar.plan(model, sample=x, topology=topology)
    assert traces[0] > before


def test_a_model_whose_forward_writes_its_config_is_traced_once(traces):
    """Hugging Face's classifiers set `config.problem_type` at their first forward with labels: the traces are
    kept under the model as the trace left it, so predict after plan reads them."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                                    num_labels=10)
    model = transformers.ResNetForImageClassification(cfg)
    sample = {"pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.randint(0, 10, (4,))}
    assert model.config.problem_type is None
    plan = autopar.plan(model, sample=sample, topology="1xH200")
    assert model.config.problem_type is not None  # the premise: the traced forward wrote it
    after_plan = traces[0]
    autopar.predict(model, plan, sample=sample, topology="1xH200")
    assert traces[0] == after_plan


@pytest.mark.parametrize("topology", ["1xH200", "8xH100-SXM"])
def test_bf16_plans_are_predicted_alike_from_a_bf16_profile_and_an_fp32_one(topology):
    """The planner's profile on GPUs with bf16 is the autocast trace, not the fp32 one: every plan the search
    ranks is predicted the same from either (its bf16 plans read the bf16 traces for their activations, and
    nothing else the two differ in); an fp32 plan is predicted from the fp32 trace, made when first read."""
    from autopar.models.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens

    torch.manual_seed(0)
    model, x = GPT(GPTConfig()), synthetic_tokens(8, GPTConfig())
    traced = {p: autopar.profile_model(model, x, loss_fn=lm_loss, precision=p, warn=False)
              for p in ("fp32", "bf16", "bf16-pure")}
    variants = {p: traced[p] for p in ("bf16", "bf16-pure")}
    world = planning.resolve_topology(topology).world_size

    def ranked(profile):
        return [(c.plan.strategy(), c.prediction.step_s, c.prediction.memory_bytes)
                for c in autopar.candidates(profile, topology=topology, variants=variants, global_batch_size=8 * world)
                if c.feasible]

    assert ranked(traced["bf16"]) == ranked(traced["fp32"]) and ranked(traced["fp32"])
    fp32_plan = autopar.Plan(dp_shard=world, micro_batch_size=8, precision="fp32")
    from_fp32 = autopar.predict(traced["fp32"], fp32_plan, topology=topology, variants=variants)
    from_model = autopar.predict(model, fp32_plan, sample=x, loss_fn=lm_loss, topology=topology)
    assert from_model.memory_bytes == from_fp32.memory_bytes and from_model.step_s == pytest.approx(from_fp32.step_s)


def test_wrap_and_the_planner_key_a_job_alike_on_gpus_with_bf16():
    """The plan cache's key reads the profile's FLOPs, which autocast changes a little (a Llama's by ~1%): wrap
    (what a tuner's probe sends too) and autopar.plan / autotune make the same profile there, so a plan one of them
    caches is found by the others."""
    import warnings

    from autopar.models.llama import Llama, LlamaConfig
    from autopar.plan_cache import sample_signature

    torch.manual_seed(0)
    cfg = LlamaConfig()
    x = torch.randint(0, cfg.vocab_size, (4, 32))
    planned, _ = planning.profile_variants(Llama(cfg), x, planning.resolve_topology("1xH200"), warn=False)
    model = Llama(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        autopar.wrap(model, sample=x, topology="1xH200", measure=False, verbose=False)
    wrapped = autopar.applied(model).profile
    assert planned.profile_precision == wrapped.profile_precision == "bf16"
    assert sample_signature(planned) == sample_signature(wrapped)
