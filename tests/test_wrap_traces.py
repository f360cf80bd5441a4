"""What wrap traces before it chooses: the traces the choice reads, and no others.

Each fake-tensor trace of a training step costs seconds on a large model (the first hour's wait). wrap on one
process traces the fp32 step and the bf16 autocast step; the bf16-weights step (FSDP's mixed precision) only
when the chosen plan manages its parameters with FSDP (one process: it offloads), and then it chooses again
with that trace. Where wrap measures the chosen plan on the device (the compile race), dynamo's graph count is
not asked for: the measurement decides compile."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import autopar
import autopar.api as api
import autopar.planning as planning
from autopar.plans import Plan


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3)], nn.Linear(32, 4))


@pytest.fixture
def traces(monkeypatch):
    """Every traced profile_model call as (precision, graphs); no cache of any kind is read."""
    monkeypatch.setenv("AUTOPAR_NO_WRAP_CACHE", "1")
    monkeypatch.setenv("AUTOPAR_COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(planning, "_TRACES", type(planning._TRACES)())  # no memo from another test
    calls: list[tuple[str, bool]] = []
    real = api.profile_model

    def recording(*args, **kwargs):
        if kwargs.get("trace", True):
            calls.append((kwargs.get("precision", "fp32"), kwargs.get("graphs", True)))
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "profile_model", recording)
    monkeypatch.setattr(planning, "profile_model", recording)
    return calls


def _wrap(**kwargs) -> nn.Module:
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        autopar.wrap(model, sample=torch.randn(8, 32), topology="1xH200", **kwargs)
    return model


def test_one_process_on_a_gpu_with_bf16_traces_the_autocast_step_only(traces):
    """The search offers only bf16 plans on GPUs with bf16, and reads their autocast trace: wrap makes that one
    trace its profile, no fp32 one beside it."""
    model = _wrap(measure=False)
    assert [p for p, _ in traces] == ["bf16"]
    assert not autopar.applied(model).plan.uses_fsdp
    assert autopar.applied(model).profile.profile_precision == "bf16"


def test_a_given_plan_is_applied_from_the_same_one_trace(traces):
    """Every planner path makes the same profile on GPUs with bf16 (the plan cache's key reads its FLOPs, which
    autocast changes a little): a given plan's wrap too."""
    _wrap(measure=False, plan=autopar.Plan(micro_batch_size=8))
    assert [p for p, _ in traces] == ["bf16"]


def test_a_measured_wrap_does_not_ask_dynamo_for_its_graph_count(traces):
    _wrap(measure=True)
    assert traces and all(graphs is False for _, graphs in traces), traces


def test_an_unmeasured_wrap_keeps_the_graph_count_for_the_compiled_price(traces):
    _wrap(measure=False)
    assert ("bf16", True) in traces


def test_a_plan_that_offloads_has_its_bf16_weights_step_traced_and_is_chosen_again(traces, monkeypatch):
    """The first choice offloads (FSDP on one process): the bf16-weights trace is made and the plan is chosen
    again, with the cost model now reading that trace for it (decided, not applied: offload needs a GPU)."""
    chosen_with: list[tuple[str, ...]] = []
    real_choose = api._choose

    def choose(profile, topo, *, variants, **kwargs):
        chosen_with.append(tuple(sorted(variants)))
        plan = real_choose(profile, topo, variants=variants, **kwargs)
        return plan.replace(cpu_offload=True) if plan.precision == "bf16" else plan

    monkeypatch.setattr(api, "_choose", choose)
    decision = api._decide(_model(), torch.randn(8, 32), autopar.profile_model(_model(), torch.randn(8, 32)),
                           planning.resolve_topology("1xH200"), **_decide_kwargs(world_size=1))
    assert decision.error is None, decision.error
    assert decision.plan.cpu_offload
    assert chosen_with == [("bf16",), ("bf16", "bf16-pure")]
    assert sorted(p for p, _ in traces) == ["bf16", "bf16-pure"]  # (the fp32 profile was made above, untraced here)


def test_several_processes_trace_the_bf16_weights_step_up_front(monkeypatch):
    seen: list[tuple[str, ...]] = []
    real = planning.bf16_variants

    def variants(*args, precisions=("bf16", "bf16-pure"), **kwargs):
        seen.append(tuple(precisions))
        return real(*args, precisions=precisions, **kwargs)

    monkeypatch.setattr(api, "bf16_variants", variants)
    decision = api._decide(_model(), torch.randn(8, 32), autopar.profile_model(_model(), torch.randn(8, 32)),
                           planning.resolve_topology("8xH100-SXM"), **_decide_kwargs(world_size=8))
    assert decision.error is None, decision.error
    assert seen == [("bf16", "bf16-pure")]
    assert isinstance(decision.plan, Plan)


def _decide_kwargs(*, world_size: int) -> dict:
    return dict(plan=None, force=False, loss_fn=None, blocks=None, world_size=world_size,
                global_batch_size=8 * world_size, loop=autopar.Loop.PLAIN)


class _NoBf16Step(nn.Module):
    """A step that raises in bf16 (an op with no bf16 kernel) and runs in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers(x)
        if h.dtype == torch.bfloat16:
            raise RuntimeError("Unsupported dtype BFloat16")
        return h


def test_a_bf16_step_that_cannot_be_traced_is_said_not_kept_silent(monkeypatch):
    """Planning for a GPU, a model whose bf16 step raises is planned from its fp32 trace, and its notes (a warning
    when quiet) say so and that its bf16 plans may not run."""
    monkeypatch.setattr(planning, "_TRACES", type(planning._TRACES)())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profile, _ = planning.profile_variants(_NoBf16Step(), torch.randn(8, 32), autopar.Topology.from_spec("1xH200"))
    note = next(n for n in profile.notes if n.startswith("its bf16 step could not be traced"))
    assert "Unsupported dtype BFloat16" in note and "may not run" in note
    assert profile.profile_precision == "fp32"
    assert [str(w.message) for w in caught if "bf16 step could not be traced" in str(w.message)] == ["autopar: " + note]
