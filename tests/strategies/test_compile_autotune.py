"""max-autotune (Plan.max_autotune: inductor's kernels chosen by timing as it compiles): a compile mode only, left out
of older plans' keys and files; refused in one line with a compile backend other than inductor, before the model
changes; compiled with inductor's max-autotune options and training as eager does; offered by the tuner's search
only when asked (autotune(max_autotune=True), `autopar tune --max-autotune`), as twins of its compiled plans priced
as they are; and the study records the choice, so a study is resumed only with the same one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar.cli import _tune_parser
from autopar.cost import Calibration, predict_profile
from autopar.errors import AutoparError, PlanError
from autopar.planning import short_name
from autopar.search import enumerate_plans, search
from autopar.strategies import compile as compile_mod
from autopar.strategies.compile import AUTOTUNE_OPTIONS, max_autotune_refusal
from tests.strategies.test_compile_graphs import _gpt_profiles


def test_max_autotune_is_a_compile_mode_that_keeps_other_plans_keys():
    with pytest.raises(PlanError, match="max_autotune=True is a torch.compile mode: set compile=True"):
        autopar.Plan(precision="bf16", max_autotune=True)
    with pytest.raises(PlanError, match="max_autotune"):
        autopar.Plan(compile=True, max_autotune="yes")
    plain = autopar.Plan(precision="bf16", compile=True, micro_batch_size=4)
    assert "max_autotune" not in plain.strategy() and "max_autotune" not in plain.to_dict()  # older keys and files
    tuned = plain.replace(max_autotune=True)
    assert tuned.key() != plain.key() and autopar.Plan.from_yaml(tuned.to_yaml()) == tuned
    assert short_name(tuned) == "1gpu mb4 bf16 compile+autotune" and "compile: True (max-autotune)" in tuned.describe()
    both = tuned.replace(cuda_graphs=True)
    assert short_name(both) == "1gpu mb4 bf16 compile+graphs+autotune"
    assert "compile: True (CUDA graphs, max-autotune)" in both.describe()


def test_max_autotune_needs_inductor():
    why = max_autotune_refusal("aot_eager")
    assert "'aot_eager'" in why and "AUTOPAR_COMPILE_BACKEND" in why and "max_autotune=False" in why
    assert max_autotune_refusal("inductor") is None


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def _loss(out, sample):
    return out.square().mean()


def test_wrap_refuses_max_autotune_with_another_backend_before_changing_the_model(monkeypatch):
    monkeypatch.setenv("AUTOPAR_COMPILE_BACKEND", "aot_eager")
    torch.manual_seed(0)
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = autopar.Plan(compile=True, max_autotune=True, micro_batch_size=8)
    with pytest.raises(PlanError, match="max_autotune=True is a mode of inductor"):
        autopar.wrap(model, sample=torch.randn(8, 16), plan=plan, loss_fn=_loss, verbose=False)
    assert not autopar.strategies.state.is_wrapped(model) and not compile_mod.compiled_modules(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_max_autotune_compiles_with_inductors_options_and_trains_as_eager(monkeypatch):
    """On this CPU, inductor's max-autotune (its C++ GEMM templates timed against ATen's): the same forward and
    gradients as the eager model, within fp32 rounding; torch.compile was given AUTOTUNE_OPTIONS."""
    monkeypatch.setenv("AUTOPAR_COMPILE_BACKEND", "inductor")
    seen = []
    real = torch.compile

    def spy(fn, *args, **kwargs):
        seen.append(kwargs.get("options"))
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(compile_mod.torch, "compile", spy)
    torch.manual_seed(0)
    model, ref = _mlp(), _mlp()
    ref.load_state_dict(model.state_dict())
    plan = autopar.Plan(compile=True, max_autotune=True, micro_batch_size=8)
    model = autopar.wrap(model, sample=torch.randn(8, 16), plan=plan, loss_fn=_loss, verbose=False)
    assert seen == [AUTOTUNE_OPTIONS] and autopar.plan_of(model).max_autotune
    for step in range(3):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        out, expected = model(x), ref(x)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        _loss(out, x).backward()
        _loss(expected, x).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=name)
            p.grad = q.grad = None


def test_a_raced_graphs_twin_keeps_the_max_autotune_options(monkeypatch):
    seen = []
    monkeypatch.setattr(compile_mod.torch, "compile", lambda fn, *a, **kw: seen.append(kw.get("options")) or fn)
    model = _mlp()
    compile_mod.apply_compile(model, [], per_block=False, backend="inductor", max_autotune=True)
    compile_mod.add_graphs_forwards(model)
    assert seen == [AUTOTUNE_OPTIONS, {**compile_mod.GRAPHS_OPTIONS, **AUTOTUNE_OPTIONS}]
    compile_mod.forget_compiled(model)
    assert not compile_mod.compiled_modules(model)


def test_only_the_tuner_asked_for_it_has_max_autotune_twins_priced_as_their_plans():
    profile, variants = _gpt_profiles()
    one = autopar.Topology.from_spec("1xH200")
    asked = list(enumerate_plans(profile, one, world_size=1, global_batch_size=8, measured=True, max_autotune=True))
    compiled = [p for p in asked if p.compile and not p.max_autotune]
    twins = [p for p in asked if p.max_autotune]
    assert any(p.cuda_graphs for p in twins)  # the CUDA-graph twins have theirs too
    assert sorted(p.replace(max_autotune=False).key() for p in twins) == sorted(p.key() for p in compiled)
    assert not any(p.max_autotune for p in enumerate_plans(profile, one, world_size=1, global_batch_size=8,
                                                           measured=True))  # the tuner, not asked
    assert not any(p.max_autotune for p in enumerate_plans(profile, one, world_size=1, global_batch_size=8,
                                                           max_autotune=True))  # wrap's search runs nothing
    plan = autopar.Plan(precision="bf16", compile=True, micro_batch_size=8)
    a, b = (predict_profile(profile, p, one, Calibration(), variants=variants)
            for p in (plan, plan.replace(max_autotune=True)))
    assert a.step_s == b.step_s and a.memory.peak_bytes == b.memory.peak_bytes
    ranked = search(profile, one, world_size=1, global_batch_size=8, variants=variants, measured=True,
                    max_autotune=True)
    assert any(c.feasible and c.plan.max_autotune for c in ranked)


def test_the_tuner_takes_max_autotune_from_its_command_line_and_a_study_keeps_it(tmp_path):
    assert _tune_parser().parse_args(["--max-autotune"]).max_autotune
    assert not _tune_parser().parse_args([]).max_autotune
    from types import SimpleNamespace

    from autopar.tune.engine import StudyEngine, StudyOptions

    pytest.importorskip("optuna")
    profile, variants = _gpt_profiles()
    probe = SimpleNamespace(profile=profile, variants=variants, topology=autopar.Topology.from_spec("1xH200"),
                            world_size=1, global_batch_size=8, model_fingerprint=profile.fingerprint)
    path = tmp_path / "study.db"

    def measure(plan):  # never called: the study is only initialised here
        raise AssertionError("no trial runs in this test")

    engine = StudyEngine(probe, measure, path, StudyOptions(trials=1, max_autotune=True), lock_held=True)
    engine._open()  # initialises the study: its space and the job it is a study of
    assert any(p.max_autotune for p in engine.space.plans.values())
    again = StudyEngine(probe, measure, path, StudyOptions(trials=1), lock_held=True)
    with pytest.raises(AutoparError, match="max_autotune True there, False here"):
        again._open()
