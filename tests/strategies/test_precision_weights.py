"""bf16 plans give the model's forward, in bf16, the trainable weights that autocast does not reach
(autopar.strategies.precision, ModelProfile.bf16_weights): a Mixture of Experts' batched expert weights, which
transformers multiplies in a grouped GEMM on no autocast list (fp32 under autocast: 88% of Mixtral's step on an
H100, bench/results/zoo_h100_moe_bf16_2026-12-06.jsonl). The bf16 trace names them and is made again with them in
bf16; wrap's autocast forward reads them through bf16 copies, so the loss and the gradients are those of autocast
over bf16 copies of them, the parameters the optimizer steps stay fp32, and a second wrap from wrap's cache keeps
them. A tiny Mixtral (bench/zoo.py) on the CPU, planned for an H200 (bf16)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.func import functional_call

import autopar
from autopar.profile import profile_model
from bench.zoo import build_model, family, make_sample

pytestmark = pytest.mark.filterwarnings("ignore")


def _mixtral():
    fam = family("mixtral")
    if fam.unavailable() is not None:
        pytest.skip(fam.unavailable())
    return fam, build_model(fam, "tiny"), make_sample(fam, "tiny")


def _experts(model) -> list[str]:
    return sorted(n for n, p in model.named_parameters() if ".experts." in n and p.dim() == 3)


def test_the_bf16_trace_names_the_weights_autocast_does_not_reach_and_multiplies_them_in_bf16():
    fam, model, sample = _mixtral()
    profile = profile_model(model, sample, loss_fn=fam.loss_fn, precision="bf16", warn=False)
    assert sorted(profile.bf16_weights) == _experts(model) and profile.bf16_weights
    gemms = {(r.kind, r.dtype) for g in profile.op_groups for r in g.ops if r.kind in ("gemm", "grouped_gemm")}
    assert ("grouped_gemm", "bfloat16") in gemms and ("grouped_gemm", "float32") not in gemms
    assert profile_model(model, sample, loss_fn=fam.loss_fn, precision="fp32", warn=False).bf16_weights == ()
    llama = family("llama")
    assert profile_model(build_model(llama, "tiny"), make_sample(llama, "tiny"), loss_fn=llama.loss_fn,
                         precision="bf16", warn=False).bf16_weights == ()  # autocast reaches all its matmuls


def test_the_first_trace_stops_after_the_first_such_block_and_gives_the_profile_two_whole_traces_gave(monkeypatch):
    """The autocast trace stops at the end of the first block whose matmuls read fp32 weights (every later op would
    be traced again) and the retrace takes those weights and their namesakes in every block in bf16: the same
    profile as tracing the whole step twice (the second with the weights the first named)."""
    import autopar.profile.build as build
    import autopar.profile.trace as trace

    fam, model, sample = _mixtral()
    runs = []
    real_run = trace.StepTrace.run

    def counted(self):
        runs.append(self.stop_at_fp32_weights)
        try:
            return real_run(self)
        except trace.Fp32WeightsFound as found:
            runs.append(("stopped after block", found.block))
            raise

    monkeypatch.setattr(trace.StepTrace, "run", counted)
    fast = profile_model(model, sample, loss_fn=fam.loss_fn, precision="bf16", warn=False)
    assert runs == [True, ("stopped after block", 0), False]
    runs.clear()
    real_init = trace.StepTrace.__init__

    def whole(self, *args, **kwargs):  # as before: the first trace runs the whole step
        real_init(self, *args, **{**kwargs, "stop_at_fp32_weights": False})

    monkeypatch.setattr(build.StepTrace, "__init__", whole)
    slow = profile_model(model, sample, loss_fn=fam.loss_fn, precision="bf16", warn=False)
    assert runs == [False, False]
    assert fast.bf16_weights == slow.bf16_weights and sorted(fast.bf16_weights) == _experts(model)
    assert fast == slow


def test_wrap_trains_as_autocast_over_bf16_copies_of_them_and_keeps_the_fp32_parameters():
    fam, model, sample = _mixtral()
    reference = copy.deepcopy(model)
    keys = {k: v.dtype for k, v in model.state_dict().items()}
    seen = []
    experts = model.model.layers[0].mlp.experts
    plan = autopar.Plan(micro_batch_size=sample["input_ids"].shape[0], precision="bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        autopar.wrap(model, sample=sample, plan=plan, topology="1xH200", loss_fn=fam.loss_fn, verbose=False)
    handle = experts.register_forward_pre_hook(lambda module, args: seen.append(module.gate_up_proj.dtype))
    loss = fam.loss_fn(model(**sample), sample)
    loss.backward()
    handle.remove()
    assert seen == [torch.bfloat16] and type(experts.gate_up_proj) is torch.nn.Parameter
    assert experts.gate_up_proj.dtype == torch.float32 and experts.gate_up_proj.grad.dtype == torch.float32
    assert {k: v.dtype for k, v in model.state_dict().items()} == keys  # names and dtypes unchanged
    assert any("bf16" in n and "autocast does not reach" in n for n in autopar.applied(model).notes)
    params = dict(reference.named_parameters())
    names = _experts(reference)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = functional_call(reference, {**params, **{n: params[n].to(torch.bfloat16) for n in names}}, (), sample)
    expected = fam.loss_fn(out, sample)
    expected.backward()
    assert loss.item() == expected.item()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name


def test_a_second_wrap_from_wraps_cache_gives_them_in_bf16_too(monkeypatch):
    monkeypatch.setenv("AUTOPAR_COMPILE_BACKEND", "eager")
    fam, _, sample = _mixtral()
    names = []
    for _ in range(2):
        model = build_model(fam, "tiny")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            autopar.wrap(model, sample=sample, topology="1xH200", loss_fn=fam.loss_fn, measure=False, verbose=False)
        names.append((autopar.plan_of(model).prediction.get("cached_at"), tuple(model.forward.weights)))
    (first_cached, first), (second_cached, second) = names
    assert first_cached is None and second_cached  # the second from wrap's cache
    assert sorted(first) == _experts(build_model(fam, "tiny")) and second == first


def test_a_pipeline_stage_reads_its_own_experts_in_bf16(tmp_path):
    """Two bf16 pipeline stages without FSDP (each stage's forward under autocast): each rank's expert modules read
    their weights in bf16, the parameters and their gradients stay fp32, and the step's loss is one process's
    under wrap's autocast forward (which reads them in bf16 too), within bf16 rounding."""
    import json

    from tests.distributed._launch import torchrun

    fam, model, sample = _mixtral()
    torchrun("tests/distributed/_pipeline_bf16_worker.py", 2, [str(tmp_path)], cache_dir=tmp_path / "cache")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    held = [sorted(r["seen"]) for r in ranks]
    assert held == [["model.layers.0.mlp.experts"], ["model.layers.1.mlp.experts"]]  # one layer a stage
    for r in ranks:
        assert all(dtypes and set(dtypes) == {"torch.bfloat16"} for dtypes in r["seen"].values()), r["seen"]
        assert r["experts"] and set(map(tuple, r["experts"].values())) == {("torch.float32", "torch.float32")}
        assert any("autocast does not reach" in n for n in r["notes"]), r["notes"]
    plan = autopar.Plan(micro_batch_size=2, grad_accum=2, precision="bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        autopar.wrap(model, sample=sample, plan=plan, topology="1xH200", loss_fn=fam.loss_fn, verbose=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = autopar.train_step(model, opt, fam.loss_fn)(sample)
    assert ranks[0]["loss"] == ranks[1]["loss"] == pytest.approx(float(loss), rel=2e-2)


def test_a_namesake_no_matmul_reads_is_left_to_autocast_and_the_retraces_are_bounded(monkeypatch):
    """The retrace's guess (the first block's fp32 matmul weights' namesakes in every block) is checked: a weight
    given in bf16 that no matmul read goes back to fp32; the traces of one step are at most MAX_BF16_WEIGHT_TRACES."""
    import autopar.profile.build as build
    import autopar.profile.trace as trace

    fam, model, sample = _mixtral()
    extra = "model.layers.1.input_layernorm.weight"  # a block's weight no matmul reads
    real_guess = build._in_every_block
    monkeypatch.setattr(build, "_in_every_block", lambda *args: tuple(sorted({*real_guess(*args), extra})))
    runs = []
    real_run = trace.StepTrace.run

    def counted(self):
        runs.append(tuple(self.bf16_weights))
        return real_run(self)

    monkeypatch.setattr(trace.StepTrace, "run", counted)
    profile = profile_model(model, sample, loss_fn=fam.loss_fn, precision="bf16", warn=False)
    assert sorted(profile.bf16_weights) == _experts(model) and extra not in profile.bf16_weights
    assert len(runs) == 3 and extra in runs[1] and extra not in runs[2]
