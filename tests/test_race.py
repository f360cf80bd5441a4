"""autopar.race: the applied model's step timed eager and compiled on the device, the faster kept in place.

On CPU the compile backends are test backends registered with dynamo: one that runs the captured graph
after a sleep (compile that does not pay), one that raises (compile that fails)."""

from __future__ import annotations

import dataclasses
import time
import warnings

import pytest
import torch
import torch.nn as nn

import autopar
import autopar.race as race_module
from autopar.race import CompileRace, measured_prediction, race_compile
from autopar.strategies.compile import apply_compile, compiled_modules

SLOW, BROKEN = "autopar_test_slow_backend", "autopar_test_broken_backend"


def _register() -> None:
    from torch._dynamo import list_backends, register_backend

    if SLOW in list_backends(exclude_tags=()):
        return

    @register_backend(name=SLOW)
    def slow(gm: torch.fx.GraphModule, example_inputs):  # noqa: ARG001
        def run(*args):
            time.sleep(0.3)  # far beyond a tiny eager step, even on a loaded CPU
            return gm(*args)
        return run

    @register_backend(name=BROKEN)
    def broken(gm: torch.fx.GraphModule, example_inputs):  # noqa: ARG001
        raise RuntimeError("this backend cannot compile anything")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn, self.drop, self.fc2 = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Dropout(0.5), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def _compiled(backend: str) -> Net:
    _register()
    torch.manual_seed(0)
    model = Net()
    apply_compile(model, [], per_block=False, backend=backend)
    return model


def _is_compiled(model: nn.Module) -> bool:
    return hasattr(vars(model).get("forward"), "_torchdynamo_orig_callable")


def test_a_compiled_step_slower_than_eager_is_dropped_and_the_model_is_left_as_it_was():
    model = _compiled(SLOW)
    x = torch.randn(8, 16)
    params = [p.detach().clone() for p in model.parameters()]
    buffers = [b.detach().clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    result = race_compile(model, x, device=torch.device("cpu"), loss_fn=lambda out, _: out.square().mean())
    assert not result.kept_compiled and result.eager_step_s < result.compiled_step_s
    assert "kept eager" in result.why and "eager" in result.describe()
    assert not _is_compiled(model) and compiled_modules(model) == []
    # nothing trained, no gradient left, BatchNorm's statistics and the random stream as they were
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(b, c) for b, c in zip(model.buffers(), buffers))
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_compile_that_fails_keeps_eager_and_names_the_error():
    model = _compiled(BROKEN)
    result = race_compile(model, torch.randn(8, 16), device=torch.device("cpu"))
    assert not result.kept_compiled and result.compiled_step_s is None and result.eager_step_s is not None
    assert "the compiled step did not run" in result.why and "cannot compile anything" in result.why
    assert not _is_compiled(model)
    model(torch.randn(8, 16)).sum().backward()  # the model runs eagerly


FAILED_COMPILE_S = 3.0  # seconds the test's backend takes before it fails


def test_a_compile_that_fails_counts_as_compile_warm_up_not_as_measuring():
    """A failed compile is time a user's own torch.compile pays too (Mamba-2 on the H200: 61.5 s of measuring, about
    47 s of it its failed compile, bench/results/zoo_h200_wrap_2026-12-06c.jsonl): wrap's measuring time is its
    timed steps."""
    from torch._dynamo import list_backends, register_backend

    slow_broken = "autopar_test_slow_broken_backend"
    if slow_broken not in list_backends(exclude_tags=()):
        @register_backend(name=slow_broken)
        def broken_after_a_while(gm: torch.fx.GraphModule, example_inputs):  # noqa: ARG001
            time.sleep(FAILED_COMPILE_S)
            raise RuntimeError("this backend fails after a while")

    torch.manual_seed(0)
    model = Net()
    apply_compile(model, [], per_block=False, backend=slow_broken)
    began = time.perf_counter()
    result = race_compile(model, torch.randn(8, 16), device=torch.device("cpu"))
    wall_s = time.perf_counter() - began
    assert result.compiled_step_s is None and not result.kept_compiled
    assert result.compiled_warmup_s >= FAILED_COMPILE_S
    # the race's measuring and its failed compile are disjoint parts of the call's time: counted as measuring, the
    # failed compile would make their sum exceed the call by FAILED_COMPILE_S. (A fixed bound on measuring_s failed
    # under CI's load: the tiny model's eager step took 0.1 s there, 5.3 s of timed rounds, 2026-12-07.)
    assert result.measuring_s + result.compiled_warmup_s <= wall_s


def test_a_compiled_step_that_is_faster_is_kept_in_place(monkeypatch):
    """The decision on measured times: compile 2x faster keeps the compiled forward (the timer stands in for
    a device where compile pays; the test backends cannot be faster than eager on a CPU)."""
    model = _compiled(SLOW)
    calls = []

    def timer(step, device, *, warmup, steps):
        calls.append(_is_compiled(model))
        return 0.0, (0.005 if _is_compiled(model) else 0.010)

    monkeypatch.setattr(race_module, "_time", timer)
    result = race_compile(model, torch.randn(8, 16), device=torch.device("cpu"))
    # eager first, then the compiled forward the plan applied; then rounds in turn, the order reversed each round
    assert calls == [False, True, True, False, False, True]
    assert result.kept_compiled and "compile is 2.00x faster" in result.why and _is_compiled(model)


@pytest.mark.parametrize("warm_s, step_s, expected", [(0.001, 0.01, [3] * 2 + [25] * 4), (0.001, 0.001, [3] * 2 + [50] * 4),
                                                     (0.3, 0.3, [2] * 6), (5.0, 5.0, [1] * 2)])
def test_a_round_lasts_long_enough_and_the_race_stays_within_its_budget(monkeypatch, warm_s, step_s, expected):
    """Eager's warm-up step sets the first round's steps: 3 a mode, fewer once 3 rounds x 2 modes of them would
    pass TIMED_BUDGET_S (4 s), never fewer than one. The first round's times set the later rounds': MIN_ROUND_S
    (0.25 s) of steps at least, at most MAX_ROUND_STEPS (50), within the budget; and no later round once the timed
    steps have taken the budget (a 5 s step: one round, Mamba-2's 4.7 s eager step on the H200)."""
    model = _compiled(SLOW)
    steps = []
    monkeypatch.setattr(race_module, "_warm", lambda step, device: warm_s)
    monkeypatch.setattr(race_module, "_time", lambda step, device, *, warmup, **kw:
                        (steps.append(kw["steps"]), (0.0, step_s))[1])
    race_compile(model, torch.randn(8, 16), device=torch.device("cpu"))
    assert steps == expected


def test_within_the_margin_compile_is_kept(monkeypatch):
    model = _compiled(SLOW)
    monkeypatch.setattr(race_module, "_time",
                        lambda step, device, **kw: (0.0, 0.0099 if not _is_compiled(model) else 0.0100))
    assert race_compile(model, torch.randn(8, 16), device=torch.device("cpu")).kept_compiled


def test_the_race_runs_on_a_meta_sample_with_real_values_of_its_shapes():
    model = _compiled(SLOW)
    result = race_compile(model, torch.empty(8, 16, device="meta"), device=torch.device("cpu"))
    assert isinstance(result, CompileRace) and result.eager_step_s is not None


def test_wrap_races_the_compile_it_chose_and_its_plan_says_what_it_kept(monkeypatch):
    """A plan for an H200 applied on this CPU compiles (bf16 + compile): with measure=True and a compile that
    does not pay, wrap keeps eager, and the plan, its summary and autopar.applied say so."""
    _register()
    monkeypatch.setenv("AUTOPAR_COMPILE_BACKEND", SLOW)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)], nn.Linear(64, 8))
    sample = torch.randn(32, 64)
    chosen = autopar.plan(model, sample=sample, topology="1xH200")
    if not chosen.compile:
        pytest.skip("the cost model does not compile this model on an H200")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        autopar.wrap(model, sample=sample, topology="1xH200", measure=True)
    state = autopar.applied(model)
    assert not state.plan.compile and state.compiled == ()
    p = state.plan.prediction
    assert p["measured_forward_backward_s"] > 0
    # the step as measured plus the modelled optimizer step; the cost model's figure kept beside it
    assert p["step_s"] == pytest.approx(p["measured_forward_backward_s"] + p["optimizer_s"])
    assert p["modelled_step_s"] == chosen.prediction["step_s"]
    assert p["samples_per_s"] == pytest.approx(chosen.prediction["samples_per_s"] * p["modelled_step_s"] / p["step_s"])
    assert state.plan.prediction["planning_s"] >= 0
    # where the time before the first step went, by phase (the fake traces, the ranking)
    phases = state.plan.prediction["planning_phases_s"]
    assert {"tracing", "bf16_tracing", "choosing"} <= set(phases) and all(s >= 0 for s in phases.values())
    assert sum(phases.values()) <= state.plan.prediction["planning_s"] + 0.01
    assert "eager: compile did not pay; measuring took" in state.plan.describe()
    assert any("kept eager" in note for note in state.notes)
    loss = model(sample).float().square().mean()
    loss.backward()  # trains eagerly
    assert all(p.grad is not None for p in model.parameters())


class RealStepRaises(nn.Module):
    """Runs on fake tensors (the trace), raises on real ones: a stand-in for an op with no kernel for the plan's
    dtype on the device (CUDA's FFT in bf16: "Unsupported dtype BFloat16")."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(3)], nn.Linear(64, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch._subclasses.fake_tensor import is_fake

        if not is_fake(x):
            raise RuntimeError("no kernel for this step here")
        return self.layers(x)


@pytest.mark.parametrize("compiles", [False, True])
def test_wrap_refuses_a_plan_whose_step_runs_in_no_mode_naming_each_error(monkeypatch, compiles):
    """wrap's measurement ran no step of its plan (eager and compiled both raised): refused in one line that names
    both errors and what to change, not kept for the loop's first step to fail on."""
    _register()
    monkeypatch.setenv("AUTOPAR_NO_WRAP_CACHE", "1")
    if compiles:
        monkeypatch.setenv("AUTOPAR_COMPILE_BACKEND", SLOW)
    kwargs = dict(topology="1xH200") if compiles else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chosen = autopar.plan(RealStepRaises(), sample=torch.randn(32, 64), **kwargs)
        if chosen.compile != compiles:
            pytest.skip(f"the cost model's plan here has compile={chosen.compile}")
        with pytest.raises(autopar.PlanError) as info:
            autopar.wrap(RealStepRaises(), sample=torch.randn(32, 64), measure=True, verbose=False, **kwargs)
    text = str(info.value)
    assert "\n" not in text and "ran no training step on cpu" in text and "no kernel for this step here" in text
    if compiles:
        assert "eager: RuntimeError" in text and "compiled: " in text
    assert "precision='fp32'" in text and "micro_batch_size" in text


class ReadsValues(nn.Module):
    """A forward that reads a tensor's value (a graph break the cost model cannot price)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4))
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        if x.abs().amax() > 1e3:  # a value read: dynamo breaks the graph here
            x = x / 1e3
        return self.head(x)


def test_an_eager_plan_chosen_because_compile_cannot_be_priced_has_its_compiled_twin_raced(monkeypatch):
    """The cost model leaves compile out for a forward that reads tensor values (it cannot price the graph
    breaks); where wrap measures, it applies the compiled twin and races it against eager, keeping the faster:
    here compile does not pay (the slow test backend), so eager is kept, with both measured."""
    _register()
    monkeypatch.setenv("AUTOPAR_COMPILE_BACKEND", SLOW)
    torch.manual_seed(0)
    model, sample = ReadsValues(), torch.randn(32, 64)
    chosen = autopar.plan(model, sample=sample, topology="1xH200")
    assert not chosen.compile  # not chosen on the prediction alone
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        autopar.wrap(model, sample=sample, topology="1xH200", measure=True, verbose=False)
    state = autopar.applied(model)
    p = state.plan.prediction
    assert p["measured_compiled_s"] > 0.3 and p["measured_eager_s"] > 0  # both raced
    assert not state.plan.compile and state.compiled == ()  # eager kept: compile did not pay
    assert "compiled " in state.notes[-1] and "did not run" not in state.notes[-1]


def test_wrap_does_not_race_a_given_plan_nor_on_a_cpu_by_default(monkeypatch):
    _register()
    monkeypatch.setenv("AUTOPAR_COMPILE_BACKEND", SLOW)
    called = []
    monkeypatch.setattr("autopar.api.race_compile", lambda *a, **k: called.append(1))
    model = nn.Sequential(nn.Linear(8, 8))
    autopar.wrap(model, sample=torch.randn(4, 8), plan=autopar.Plan(compile=True, micro_batch_size=4))
    model2 = nn.Sequential(nn.Linear(8, 8))
    autopar.wrap(model2, sample=torch.randn(4, 8))
    assert called == []


def test_a_plan_without_compile_has_its_eager_step_measured_alone():
    torch.manual_seed(0)
    model = Net()
    result = race_compile(model, torch.randn(8, 16), device=torch.device("cpu"))
    assert not result.kept_compiled and result.compiled_step_s is None and result.eager_step_s > 0
    assert result.why == "the plan does not compile: its eager step measured"


def test_the_plan_carries_the_measured_step_and_allocated_peak_with_the_modelled_ones_beside():
    """The step: the kept mode's forward + backward plus the modelled optimizer step; the allocated peak: the kept
    mode's measured peak plus the optimizer state the race does not hold, the allocator's share above it as
    modelled; the rates scaled with the step."""
    gib = 2**30
    modelled = {"step_s": 0.2, "optimizer_s": 0.01, "samples_per_s": 40.0, "allocated_bytes": 30 * gib,
                "memory_bytes": 33 * gib, "optimizer_state_bytes": 4 * gib}
    race = CompileRace(eager_step_s=0.3, compiled_step_s=0.15, compiled_warmup_s=20.0, kept_compiled=True, why="",
                       measuring_s=1.2, eager_peak_bytes=25 * gib, compiled_peak_bytes=20 * gib, rows=8)
    p = measured_prediction(autopar.Plan(micro_batch_size=8, prediction=modelled), race)
    assert p["step_s"] == pytest.approx(0.16) and p["modelled_step_s"] == 0.2
    assert p["samples_per_s"] == pytest.approx(40.0 * 0.2 / 0.16)
    assert p["measured_peak_allocated_bytes"] == 20 * gib and p["modelled_allocated_bytes"] == 30 * gib
    assert p["allocated_bytes"] == 24 * gib and p["memory_bytes"] == 27 * gib  # 20 + 4; 3 GiB above it as modelled
    eager = measured_prediction(autopar.Plan(micro_batch_size=8, prediction=modelled),
                                dataclasses.replace(race, kept_compiled=False))
    assert eager["allocated_bytes"] == 29 * gib and eager["step_s"] == pytest.approx(0.31)
    # accumulating: each micro-batch's step as measured; the gradients kept between them: the modelled peak
    accumulating = measured_prediction(autopar.Plan(micro_batch_size=8, grad_accum=2, prediction=modelled), race)
    assert accumulating["step_s"] == pytest.approx(2 * 0.15 + 0.01) and accumulating["allocated_bytes"] == 30 * gib
    off_gpu = measured_prediction(autopar.Plan(micro_batch_size=8, prediction=modelled),
                                  dataclasses.replace(race, compiled_peak_bytes=None))
    assert off_gpu["allocated_bytes"] == 30 * gib and "measured_peak_allocated_bytes" not in off_gpu
    # a race on fewer samples than the plan's micro-batch: recorded, the modelled figures kept
    short = measured_prediction(autopar.Plan(micro_batch_size=16, prediction=modelled), race)
    assert short["step_s"] == 0.2 and short["allocated_bytes"] == 30 * gib and short["measured_forward_backward_s"]


def test_the_allocator_s_reserve_measured_on_the_device_replaces_the_modelled_one():
    """memory_bytes: the measured allocated peak + the optimizer state + the context + the reserve the race measured
    (a mixture of experts' routed batches fragment the cache beyond the trace's replay; a state-space model's
    largest tensor made the modelled rule reserve far more than CUDA did)."""
    gib = 2**30
    modelled = {"step_s": 0.2, "optimizer_s": 0.01, "allocated_bytes": 30 * gib, "memory_bytes": 33 * gib,
                "optimizer_state_bytes": 4 * gib, "context_bytes": 0.75 * gib}  # modelled reserve: 2.25 GiB
    race = CompileRace(eager_step_s=0.3, compiled_step_s=0.15, compiled_warmup_s=20.0, kept_compiled=True, why="",
                       compiled_peak_bytes=20 * gib, rows=8, kept_reserve_bytes=5 * gib)
    p = measured_prediction(autopar.Plan(micro_batch_size=8, prediction=modelled), race)
    assert p["allocated_bytes"] == 24 * gib and p["memory_bytes"] == (24 + 0.75 + 5) * gib
    assert p["measured_reserve_bytes"] == 5 * gib and p["modelled_memory_bytes"] == 33 * gib
    small = measured_prediction(autopar.Plan(micro_batch_size=8, prediction=modelled),
                                dataclasses.replace(race, kept_reserve_bytes=1 * gib))
    assert small["memory_bytes"] == (24 + 0.75 + 1) * gib
    unmeasured = measured_prediction(autopar.Plan(micro_batch_size=8, prediction=modelled),
                                     dataclasses.replace(race, kept_reserve_bytes=None))
    assert unmeasured["memory_bytes"] == 27 * gib and "measured_reserve_bytes" not in unmeasured  # 3 GiB as modelled


def test_a_plan_that_accumulates_races_one_micro_batch(monkeypatch):
    """The sample is one rank's batch; a plan of 4 micro-batches trains on a quarter of it at a time, and the race
    runs that quarter (the whole batch at once is what did not fit)."""
    seen = []
    model = Net()
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    result = race_compile(model, torch.randn(16, 16), device=torch.device("cpu"), rows=4)
    assert seen and set(seen) == {4} and result.rows == 4
    assert race_compile(Net(), torch.randn(2, 16), device=torch.device("cpu"), rows=4).rows == 2  # all it has


@pytest.mark.slow
def test_two_ranks_race_in_step_and_keep_the_same_mode_and_the_slowest_rank_s_time(tmp_path):
    """wrap on 2 gloo processes with measure=True: the race's steps (and its collectives: the later rounds' length,
    the slowest rank's times) run in step on both ranks, which keep the same mode and carry the same measured step."""
    import json

    from tests.distributed._launch import torchrun

    torchrun("tests/distributed/_race_worker.py", 2, [str(tmp_path)], cache_dir=tmp_path / "autopar-cache")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["world"] == 2 and ranks[0]["plan"] == ranks[1]["plan"]
    assert ranks[0]["measured_forward_backward_s"] == ranks[1]["measured_forward_backward_s"] > 0
    assert ranks[0]["step_s"] == pytest.approx(ranks[0]["grad_accum"] * ranks[0]["measured_forward_backward_s"]
                                               + ranks[0]["optimizer_s"])
    assert all(len(r["notes"]) == 1 for r in ranks) and ranks[0]["notes"] == ranks[1]["notes"]


def test_the_race_s_step_drops_the_model_s_output_before_backward():
    """As a loop that keeps only the loss: a kept output (a language model's logits) would raise the measured peak."""
    import weakref

    model = Net()
    model.eval()  # (BatchNorm's statistics and dropout aside)
    outputs: list[weakref.ref] = []
    alive_in_backward: list[bool] = []

    def loss_fn(output: torch.Tensor, _batch) -> torch.Tensor:
        outputs.append(weakref.ref(output))
        return output.sum()  # its backward saves nothing of the output

    model.fc1.weight.register_hook(lambda g: alive_in_backward.append(outputs[-1]() is not None))
    race_compile(model, torch.randn(8, 16), device=torch.device("cpu"), loss_fn=loss_fn, warmup=1, steps=3)
    assert alive_in_backward and not any(alive_in_backward)


def _fake_allocator(monkeypatch, *, reserved: int, allocated: int) -> None:
    """torch.cuda's allocator statistics as constants (the race reads them where it reads the reserve)."""
    for name, value in (("empty_cache", lambda: None), ("reset_peak_memory_stats", lambda device=None: None),
                        ("max_memory_reserved", lambda device=None: reserved),
                        ("max_memory_allocated", lambda device=None: allocated)):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(race_module, "_reads_reserve", lambda device: True)


def test_the_reserve_is_read_with_the_optimizer_state_held_from_the_first_backward(monkeypatch):
    """_reserve_over_peak makes AdamW's state (two tensors of each trainable parameter's shape) where a loop's first
    optimizer step does, after backward with the gradients alive, holds it through the later steps, and lets it go
    after; the reserve is the allocator's reserved peak over its allocated peak."""
    import weakref

    from autopar import race as race_mod

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[1].bias.requires_grad_(False)  # frozen: no state of its own
    _fake_allocator(monkeypatch, reserved=10 << 20, allocated=7 << 20)
    made: list[weakref.ref] = []
    real_zeros_like = torch.zeros_like

    def zeros_like(t, *args, **kwargs):
        out = real_zeros_like(t, *args, **kwargs)
        made.append(weakref.ref(out))
        return out

    monkeypatch.setattr(torch, "zeros_like", zeros_like)
    alive_at_start, grads_when_made = [], []

    def step(after_backward=None):
        alive_at_start.append(sum(r() is not None for r in made))
        model(torch.ones(1, 4)).sum().backward()
        before = len(made)
        after_backward()
        if len(made) > before:
            grads_when_made.append(all(p.grad is not None for p in model.parameters() if p.requires_grad))
        for p in model.parameters():
            p.grad = None

    reserve = race_mod._reserve_over_peak(step, model, torch.device("cpu"), steps=3)
    assert reserve == 3 << 20
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(made) == 2 * len(trainable) and grads_when_made == [True]  # made once, at the first backward
    assert alive_at_start == [0, len(made), len(made)]  # held through the later steps
    assert all(r() is None for r in made)  # and let go after


def test_reserve_steps_are_two_at_least_for_a_step_that_allows_it():
    from autopar.race import RESERVE_STEPS, reserve_steps

    assert reserve_steps(0.01) == RESERVE_STEPS
    assert reserve_steps(1.0) == 2  # the second step is the first with the optimizer's state resident
    assert reserve_steps(3.0) == 1  # two would take over RESERVE_MAX_S


@pytest.mark.parametrize("backend", [BROKEN, None])
def test_a_long_eager_step_is_timed_and_read_for_the_reserve_in_one_step(monkeypatch, backend):
    """A step whose warm-up takes seconds (one step a round, one step all the reserve's reading would run): eager's
    one timed step is also the reserve's reading, so where eager is kept (compile failed, or the plan does not
    compile) no step runs after the race; its time, the allocated peak before the optimizer's state and the
    reserve are the race's."""
    model = _compiled(backend) if backend else Net()
    _fake_allocator(monkeypatch, reserved=10 << 20, allocated=7 << 20)
    monkeypatch.setattr(race_module, "_warm", lambda step, device: 5.0)
    monkeypatch.setattr(race_module, "TIMED_BUDGET_S", 1e-9)  # the tiny step's one round is the budget, as 5 s are
    runs: list[int] = []
    real_run = race_module._reserve_run
    monkeypatch.setattr(race_module, "_reserve_run", lambda *a, **kw: (runs.append(kw["steps"]), real_run(*a, **kw))[1])
    timed: list[bool] = []
    monkeypatch.setattr(race_module, "_time", lambda *a, **kw: (timed.append(True), (0.0, 5.0))[1])
    result = race_compile(model, torch.randn(8, 16), device=torch.device("cpu"))
    assert runs == [1] and not result.kept_compiled  # one step, eager's timed step; none after the race
    assert result.eager_step_s is not None and result.eager_step_s < 5.0  # the tiny step's own time, measured
    assert result.kept_reserve_bytes == 3 << 20 and result.eager_peak_bytes == 7 << 20
    assert timed == ([True] if backend else [])  # only the compiled mode's warm-up and timing went through _time


def test_a_short_eager_step_has_its_reserve_read_after_the_race(monkeypatch):
    model = Net()
    _fake_allocator(monkeypatch, reserved=10 << 20, allocated=7 << 20)
    monkeypatch.setattr(race_module, "_warm", lambda step, device: 0.01)
    runs: list[int] = []
    real_run = race_module._reserve_run
    monkeypatch.setattr(race_module, "_reserve_run", lambda *a, **kw: (runs.append(kw["steps"]), real_run(*a, **kw))[1])
    result = race_compile(model, torch.randn(8, 16), device=torch.device("cpu"))
    assert runs == [race_module.reserve_steps(result.eager_step_s)] and result.kept_reserve_bytes == 3 << 20


def _short_warm_up(step, device) -> float:
    """Eager's warm-up step as a short one: the graphs are raced on short steps only, and a loaded CI machine's
    first step can take longer than the race's budget allows for more than one step a round."""
    return 0.001


def _forward_kind(model: nn.Module) -> str:
    forward = vars(model).get("forward")
    if forward is not None and forward is vars(model).get("_autopar_graphs_forward"):
        return "graphs"
    return "compiled" if _is_compiled(model) else "eager"


@pytest.mark.parametrize("graphs_s, kept", [(0.0025, True), (0.0049, False)])
def test_cuda_graphs_race_as_a_third_contender_and_are_kept_where_they_pay(monkeypatch, graphs_s, kept):
    """graphs=True: the compiled forward compiled again to replay CUDA graphs (inductor's reduce-overhead mode; on
    this CPU the test backend's second compile stands in) runs beside eager and compiled, one warm-up step more
    (its recording); kept where it is EAGER_MARGIN faster than the better of the two, in place of the compiled
    forward; else dropped, the compiled forward kept."""
    model = _compiled(SLOW)
    compiled_forward = vars(model)["forward"]
    calls = []

    def timer(step, device, *, warmup, steps):
        kind = _forward_kind(model)
        calls.append((kind, warmup))
        return 0.0, {"eager": 0.010, "compiled": 0.005, "graphs": graphs_s}[kind]

    monkeypatch.setattr(race_module, "_time", timer)
    monkeypatch.setattr(race_module, "_warm", _short_warm_up)
    result = race_compile(model, torch.randn(8, 16), device=torch.device("cpu"), graphs=True)
    assert calls[:3] == [("eager", 0), ("compiled", 2), ("graphs", 3)]  # round 1; then reversed, and so on
    assert sorted(k for k, _ in calls) == ["compiled"] * 3 + ["eager"] * 3 + ["graphs"] * 3
    assert result.graphs_step_s == graphs_s and result.kept_graphs is kept and result.kept_compiled
    assert "_autopar_graphs_forward" not in vars(model)  # settled: kept as the compiled forward, or dropped
    if kept:
        assert "CUDA graphs are 2.00x faster than compiled: kept CUDA graphs" in result.why
        assert vars(model)["forward"] is not compiled_forward and _is_compiled(model)
        assert result.kept_step_s == graphs_s and "CUDA graphs 2.5 ms" in result.describe()
        p = measured_prediction(autopar.Plan(micro_batch_size=8, prediction={"step_s": 0.01, "optimizer_s": 0.001}),
                                result)
        assert p["measured_forward_backward_s"] == graphs_s and p["measured_graphs_s"] == graphs_s
        assert p["step_s"] == pytest.approx(graphs_s + 0.001)
    else:
        assert "compile is 2.00x faster: kept compile; CUDA graphs did not pay (1.02x)" == result.why
        assert vars(model)["forward"] is compiled_forward


def test_cuda_graphs_that_fail_leave_the_choice_between_eager_and_compiled(monkeypatch):
    model = _compiled(SLOW)

    def timer(step, device, *, warmup, steps):
        kind = _forward_kind(model)
        if kind == "graphs":
            raise RuntimeError("CUDA graphs cannot capture this")
        return 0.0, {"eager": 0.010, "compiled": 0.005}[kind]

    monkeypatch.setattr(race_module, "_time", timer)
    monkeypatch.setattr(race_module, "_warm", _short_warm_up)
    result = race_compile(model, torch.randn(8, 16), device=torch.device("cpu"), graphs=True)
    assert result.kept_compiled and not result.kept_graphs and result.graphs_step_s is None
    assert "CUDA graphs did not run (RuntimeError: CUDA graphs cannot capture this)" in result.why
    assert _is_compiled(model) and "_autopar_graphs_forward" not in vars(model)


def test_wrap_races_cuda_graphs_only_where_the_cost_model_predicts_they_pay_on_a_cuda_device():
    from autopar.race import races_graphs

    cuda = torch.device("cuda", 0)
    plan = autopar.Plan(precision="bf16", compile=True, micro_batch_size=8,
                        prediction={"step_s": 0.020, "graphs_step_s": 0.012})
    assert races_graphs(plan, cuda)
    assert not races_graphs(plan, torch.device("cpu"))
    assert not races_graphs(plan.replace(prediction={"step_s": 0.020, "graphs_step_s": 0.019}), cuda)  # 5%: no
    assert not races_graphs(plan.replace(cuda_graphs=True), cuda)  # replayed already
    assert not races_graphs(plan.replace(prediction={"step_s": 0.02}), cuda)  # not predicted
    assert not races_graphs(autopar.Plan(precision="bf16", compile=True, dp_shard=2, micro_batch_size=4,
                                         prediction=dict(plan.prediction)), cuda)


def test_wrap_asks_its_race_for_cuda_graphs_where_they_are_predicted_to_pay_and_its_plan_says_when_kept(monkeypatch):
    """wrap's glue: the chosen plan's prediction carries its step replayed as CUDA graphs; where races_graphs says
    they may pay, the race is asked for them, and a race that kept them leaves the plan with cuda_graphs=True (the
    race itself stands in here: on this CPU no graph is recorded)."""
    _register()
    monkeypatch.setenv("AUTOPAR_COMPILE_BACKEND", SLOW)
    asked = []

    def race(model, sample, **kw):
        asked.append(kw["graphs"])
        return CompileRace(eager_step_s=0.010, compiled_step_s=0.008, compiled_warmup_s=1.0, kept_compiled=True,
                           why="CUDA graphs are 2.00x faster than compiled: kept CUDA graphs", graphs_step_s=0.004,
                           kept_graphs=True, rows=32)

    monkeypatch.setattr("autopar.api.race_compile", race)
    monkeypatch.setattr("autopar.api.races_graphs", lambda plan, device: "graphs_step_s" in (plan.prediction or {}))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)], nn.Linear(64, 8))
    sample = torch.randn(32, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        autopar.wrap(model, sample=sample, topology="1xH200", measure=True)
    plan = autopar.applied(model).plan
    if not asked:
        pytest.skip("the cost model does not compile this model on an H200")
    assert asked == [True] and plan.compile and plan.cuda_graphs
    assert plan.prediction["measured_forward_backward_s"] == 0.004 and "compile: True (CUDA graphs)" in plan.describe()


def test_cuda_graphs_that_cannot_be_compiled_leave_the_race_to_the_other_two(monkeypatch):
    model = _compiled(SLOW)

    def refuse(model):
        raise RuntimeError("Unexpected optimization option triton.cudagraph_skip_dynamic_graphs")

    monkeypatch.setattr(race_module, "add_graphs_forwards", refuse)
    monkeypatch.setattr(race_module, "_warm", _short_warm_up)
    monkeypatch.setattr(race_module, "_time", lambda step, device, *, warmup, steps:
                        (0.0, 0.005 if _is_compiled(model) else 0.010))
    result = race_compile(model, torch.randn(8, 16), device=torch.device("cpu"), graphs=True)
    assert result.kept_compiled and not result.kept_graphs and result.graphs_step_s is None
    assert result.why.endswith("; CUDA graphs did not run (RuntimeError: Unexpected optimization option "
                               "triton.cudagraph_skip_dynamic_graphs)")
