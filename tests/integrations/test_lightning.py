"""Lightning's Trainer under AutoparStrategy, with the real packages, on 2 gloo processes (one torchrun launch
runs every scenario: tests/integrations/_lightning_worker.py).

- FSDP, tensor-parallel and pipeline plans, and accumulation, each forced by an explicit autopar.Plan: 10 steps
  of a tiny GPT LightningModule, every loss within 1e-5 (relative, fp32) of one plain process on the same global
  batches (tests/integrations/_lightning_run.py says why the global batches are the same);
- `Trainer(strategy="autopar")`, the one line: autopar chooses, and the losses match too;
- the silent cases, refused or right: the sampler follows autopar's data shard (tensor-parallel peers read the
  same samples, data-parallel ranks different ones), BatchSizeFinder, accumulate_grad_batches, a precision that
  disagrees with the plan, a batch of another size than the plan's;
- a plan cached as `autopar tune` caches its best is the one the strategy applies;
- the run's measurement beside the prediction, fed back to the cost model (a run ledger; a refit from 2 plans).
"""

from __future__ import annotations

import json
from collections import Counter
import subprocess
import sys

import pytest
import torch
import yaml

import autopar
from autopar.integrations._measure import Comparison, MeasureOptions, StepMeasurement
from tests.distributed._launch import ROOT, process_env, torchrun
from tests.integrations._lightning_run import GLOBAL_BATCH, STEPS, reference_losses

pytestmark = pytest.mark.slow

FSDP = {"dp_shard": 2, "micro_batch_size": 4}
MEASURE = {"warmup_steps": 2, "steps": 5}
SCENARIOS = [
    {"name": "fsdp", "run": "fit", "args": {"plan": FSDP, "batch_size": 4, "measure": MEASURE}},
    {"name": "fsdp-accum", "run": "fit", "args": {"plan": {"dp_shard": 2, "micro_batch_size": 2, "grad_accum": 2},
                                                  "batch_size": 4, "measure": MEASURE}},
    {"name": "fsdp-accum-training-step", "run": "fit",
     "args": {"plan": {"dp_shard": 2, "micro_batch_size": 2, "grad_accum": 2}, "batch_size": 4, "loss_fn": False}},
    {"name": "tp", "run": "fit", "args": {"plan": {"tp": 2, "micro_batch_size": 8}, "batch_size": 8}},
    {"name": "pp", "run": "fit", "args": {"plan": {"pp": 2, "pp_schedule": "1f1b", "micro_batch_size": 2,
                                                   "grad_accum": 4}, "batch_size": 8}},
    {"name": "by-name", "run": "by_name", "args": {"batch_size": 4}},
    {"name": "accumulate-grad-batches", "run": "fit",
     "args": {"plan": FSDP, "batch_size": 4, "accumulate_grad_batches": 2}},
    {"name": "bf16-trainer-fp32-plan", "run": "fit", "args": {"plan": FSDP, "batch_size": 4, "precision": "bf16-mixed"}},
    {"name": "fp32-trainer-bf16-plan", "run": "fit", "args": {"plan": {**FSDP, "precision": "bf16"}, "batch_size": 4}},
    {"name": "batch-size-finder", "run": "batch_size_finder", "args": {"plan": FSDP}},
    # the sample (4 sequences) is what the plan is made for; the DataLoader feeds 2 a step
    {"name": "wrong-batch", "run": "fit", "args": {"plan": FSDP, "batch_size": 2, "sample_size": 4}},
    # last: its plan, cached for this model and global batch, would answer "by-name" too
    {"name": "cached", "run": "cached", "args": {"plan": {**FSDP, "checkpointing": "full"}, "batch_size": 4}},
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every scenario's result per rank: {name: [rank 0's, rank 1's]}."""
    tmp = tmp_path_factory.mktemp("lightning")
    spec, out = tmp / "scenarios.json", tmp / "out.pt"
    spec.write_text(json.dumps(SCENARIOS))
    torchrun("tests/integrations/_lightning_worker.py", 2, [str(spec), str(out)], cache_dir=tmp / "cache",
             timeout_s=600)
    ranks = torch.load(out, weights_only=False)  # our own test output; plain types only
    return {s["name"]: [r[s["name"]] for r in ranks] for s in SCENARIOS}


@pytest.fixture(autouse=True)
def _no_trace_left():
    """A Trainer fit in this process (AutoparStrategy on one device) starts a process group and sets MASTER_ADDR,
    WORLD_SIZE and the like in os.environ; later tests of this worker (a plain wrap, `autopar demo` in a subprocess)
    would find them: both are undone after each test."""
    import os

    env = dict(os.environ)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)


@pytest.fixture(scope="module")
def reference():
    return reference_losses()


def _ok(result: dict) -> dict:
    assert "error" not in result, f"{result['error']}: {result['message']}"
    return result


def _plan(result: dict) -> dict:
    return yaml.safe_load(result["plan"])


def _assert_parity(result: dict, reference: list[float]) -> None:
    losses = _ok(result)["losses"]
    assert len(losses) == STEPS
    assert losses == pytest.approx(reference, rel=1e-5), (losses, reference)


@pytest.mark.parametrize("name", ["fsdp", "fsdp-accum", "fsdp-accum-training-step", "tp", "pp"])
def test_each_plan_kind_trains_as_one_process_does(runs, reference, name):
    # fsdp-accum-training-step: no loss_fn, so each micro-batch's loss is the module's training_step
    for rank in runs[name]:
        _assert_parity(rank, reference)
        assert rank["global_step"] == STEPS  # train_step's optimizer steps count as Lightning's steps


def test_plans_that_split_the_step_run_through_train_step_under_manual_optimization(runs):
    expected = {"fsdp": True, "tp": True, "fsdp-accum": False, "pp": False}
    for name, automatic in expected.items():
        assert [r["automatic_optimization"] for r in runs[name]] == [automatic, automatic], name
    assert _plan(runs["pp"][0])["pp"] == 2 and _plan(runs["fsdp-accum"][0])["grad_accum"] == 2


def test_trainer_strategy_autopar_is_the_one_line(runs, reference):
    for rank in runs["by-name"]:
        _assert_parity(rank, reference)
        plan = _plan(rank)
        assert plan["dp_replicate"] * plan["dp_shard"] == 2 and plan["micro_batch_size"] == 4  # chosen: every rank reads its own


def test_the_sampler_follows_autopar_s_data_shard(runs):
    """Tensor-parallel peers read the same samples (Lightning's own split over the world would give them different
    ones), and data-parallel ranks different ones; both plans see the same global batches (the parity above)."""
    tp, fsdp = runs["tp"], runs["fsdp"]
    assert [r["data_shard"] for r in tp] == [(0, 1), (0, 1)] and [r["sampler"] for r in tp] == [(1, 0), (1, 0)]
    assert tp[0]["rows"] == tp[1]["rows"]
    assert [r["data_shard"] for r in fsdp] == [(0, 2), (1, 2)] and [r["sampler"] for r in fsdp] == [(2, 0), (2, 1)]
    for step in range(STEPS):
        a, b = fsdp[0]["rows"][step], fsdp[1]["rows"][step]
        assert len(a) == len(b) == GLOBAL_BATCH // 2 and a != b
        assert Counter(a) + Counter(b) == Counter(tp[0]["rows"][step])  # the same global batch under either plan


@pytest.mark.parametrize("name, words", [
    ("accumulate-grad-batches", ["accumulate_grad_batches=2", "global_batch_size"]),
    ("bf16-trainer-fp32-plan", ["precision='bf16-mixed'", "precision='fp32'", "Trainer(precision='32-true')"]),
    ("fp32-trainer-bf16-plan", ["precision='32-true'", "precision='bf16'", "Trainer(precision='bf16-mixed')"]),
    ("batch-size-finder", ["BatchSizeFinder", "stale", "remove it"]),
    ("wrong-batch", ["2 samples", "made for 4", "batch_size=4"]),
])
def test_settings_that_disagree_with_the_plan_are_refused(runs, name, words):
    for rank in runs[name]:
        assert rank.get("error") == "PlanError", rank
        for word in words:
            assert word in rank["message"], (word, rank["message"])


def test_a_plan_cached_by_autopar_tune_is_the_one_applied(runs):
    for rank in runs["cached"]:
        plan = _ok(rank)
        applied = autopar.Plan.from_yaml(plan["plan"])
        assert applied.key() == rank["cached_key"] and applied.checkpointing == "full"


def test_the_run_is_measured_beside_the_prediction_and_fed_back(runs):
    first, second = runs["fsdp"][0], runs["fsdp-accum"][0]
    for run in (first, second):
        m = _ok(run)["measured"]["metrics"]
        assert m["autopar/step_s"] > 0 and m["autopar/predicted_step_s"] > 0 and m["autopar/mfu"] > 0
        assert m["autopar/tokens_per_s"] == pytest.approx(GLOBAL_BATCH * 32 / m["autopar/step_s"])
        assert m["autopar/peak_memory_bytes"] > 0 and "predicted" in run["measured"]["line"]
    assert first["feedback"]["plans"] == 1 and first["feedback"]["fit_runs"] is None
    assert second["feedback"]["ledger"] == first["feedback"]["ledger"]
    assert second["feedback"]["plans"] == 2 and second["feedback"]["fit_runs"] == 2  # refitted, as a study does
    assert "feedback" not in runs["fsdp"][1]  # rank 0 records


def test_importing_autopar_does_not_import_lightning_and_the_integration_registers_autopar(tmp_path):
    code = ("import sys, autopar; assert 'lightning' not in sys.modules, 'autopar imported lightning'\n"
            "import autopar.integrations; assert 'lightning' not in sys.modules\n"
            "from lightning.pytorch.strategies import StrategyRegistry; assert 'autopar' not in StrategyRegistry\n"
            "import lightning as L, autopar.integrations.lightning as apl\n"
            "t = L.Trainer(strategy='autopar', accelerator='cpu', devices=1, logger=False)\n"
            "assert isinstance(t.strategy, apl.AutoparStrategy), type(t.strategy)\nprint('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=process_env(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_the_example_trains_and_prints_its_tokens_per_second(tmp_path):
    proc = subprocess.run([sys.executable, "examples/lightning_gpt.py", "--steps", "5", "--warmup", "1",
                           "--measure-steps", "3", "--batch-size", "4"], cwd=ROOT,
                          env=dict(process_env(tmp_path), OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "measured: " in proc.stdout and " tokens/s, " in proc.stdout, proc.stdout[-2000:]
    assert "[autopar] measured over 3 steps: " in proc.stderr and "(predicted " in proc.stderr


def test_measure_options_and_measurements_validate_themselves():
    with pytest.raises(autopar.AutoparError, match="steps must be an integer of at least 1"):
        MeasureOptions(steps=0)
    with pytest.raises(autopar.AutoparError, match="feed_back must be True or False"):
        MeasureOptions(feed_back="yes")
    with pytest.raises(autopar.AutoparError, match="step_s must be positive"):
        StepMeasurement(steps=1, step_s=0.0, samples_per_s=1.0, tokens_per_s=None, mfu=0.1, peak_memory_bytes=1,
                        memory_source="cuda max allocated")
    m = StepMeasurement(steps=4, step_s=0.2, samples_per_s=40.0, tokens_per_s=None, mfu=0.25, peak_memory_bytes=2**30,
                        memory_source="cuda max allocated")
    line = Comparison(m, {"step_s": 0.1, "samples_per_s": 80.0, "mfu": 0.5, "memory_bytes": 2**29}).describe()
    assert line == ("measured over 4 steps: 200.0 ms/step (predicted 100.0 ms, measured/predicted 2.00), 40.0 samples/s "
                    "(predicted 80.0, measured/predicted 0.50), MFU 25.0% (predicted 50.0%, measured/predicted 0.50), "
                    "peak 1.00 GiB (cuda max allocated) (predicted 0.50 GiB, measured/predicted 2.00)")


def test_a_batch_the_forward_does_not_take_is_refused_before_a_forward_loss_runs_it():
    """A pipeline plan, or a loss_fn given, calls the forward with each micro-batch; the usual (x, y) batch of a
    forward(x) failed in the step with a bare TypeError (found by a helper)."""
    from autopar.errors import SampleError
    from autopar.integrations.lightning import TrainStepRunner

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.lin(x)

    runner = object.__new__(TrainStepRunner)  # the check alone: no Trainer, and the step must not run
    runner.module, runner.steps, runner.forward_loss = Net(), 0, True
    runner.step = lambda batch: pytest.fail("the step ran on a batch the forward does not take")
    with pytest.raises(SampleError, match=r"^this training batch \(a pipeline plan, or a loss_fn given, .* does not "
                                          r"fit Net\.forward\(x\) .* or, with pp=1, pass no loss_fn: training_step "
                                          r"is then each micro-batch's loss\.$"):
        runner((torch.zeros(2, 4), torch.zeros(2, dtype=torch.long)))


class _Regression(__import__("lightning").LightningModule):
    """A LightningModule as users write one: batches of (x, y), forward(x), the loss in training_step (logged), a
    scheduler stepped every step."""

    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                       torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.automatic_optimization = not manual

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("mse", loss)
        return {"loss": loss}

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.7),
                                                   "interval": "step"}}


def _regression_fit(strategy, batch_size: int, module=None) -> tuple[list[float], dict]:
    import lightning as L

    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 6, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    module = module or _Regression()
    losses: list[float] = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    # one process: the batches in the DataLoader's order under both strategies (Lightning's distributed sampler,
    # which AutoparStrategy gets as a parallel strategy, would shuffle them)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=5, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, callbacks=[Losses()])
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=batch_size))
    return losses, {n: p.detach().clone() for n, p in module.named_parameters()}


def test_an_accumulating_plan_runs_the_modules_own_training_step_on_each_micro_batch():
    """A plan with accumulation on the usual (x, y) batches of a forward(x) whose loss is computed in training_step:
    each micro-batch's loss is the module's training_step (was refused: the forward could not take the batch), and
    the run equals plain Lightning on the whole batch, schedule included."""
    from autopar.integrations.lightning import AutoparStrategy

    reference, weights = _regression_fit("auto", 8)
    plan = autopar.Plan(micro_batch_size=2, grad_accum=4)
    strategy = AutoparStrategy(plan=plan, sample=torch.randn(8, 6), verbose=False, measure=None)
    losses, got = _regression_fit(strategy, 8)
    assert losses == pytest.approx(reference, rel=1e-5) and len(losses) == 5, (losses, reference)
    for name, w in weights.items():
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=name)


def test_a_module_that_optimizes_manually_is_refused_under_a_plan_that_splits_the_step():
    """Its training_step steps the optimizer itself; autopar.train_step would have ignored it, silently."""
    from autopar.errors import PlanError
    from autopar.integrations.lightning import AutoparStrategy

    strategy = AutoparStrategy(plan=autopar.Plan(micro_batch_size=2, grad_accum=4), sample=torch.randn(8, 6),
                               verbose=False, measure=None)
    with pytest.raises(PlanError, match=r"^_Regression optimizes manually \(automatic_optimization=False\), so its "
                                        r"training_step steps the optimizer itself"):
        _regression_fit(strategy, 8, module=_Regression(manual=True))


def test_a_first_batch_the_forward_does_not_take_names_the_batch_and_the_sample_to_give():
    """No sample= and no example_input_array: the first training batch is the sample; a dict batch for a
    forward(self, batch) was refused as "sample= does not fit" to a user who gave none."""
    import lightning as L
    from autopar.errors import SampleError
    from autopar.integrations.lightning import AutoparStrategy

    class DictModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, batch):
            return self.lin(batch["x"])

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self(batch), batch["y"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    rows = [{"x": torch.randn(4), "y": torch.randn(1)} for _ in range(8)]
    trainer = L.Trainer(strategy=AutoparStrategy(verbose=False, measure=None), accelerator="cpu", devices=1,
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    with pytest.raises(SampleError, match=r"^the first training batch \(taken as the forward's input: no "
                                          r"AutoparStrategy\(sample=\.\.\.\), no example_input_array\) does not fit "
                                          r"DictModule\.forward\(batch\) .* it has keys \['x', 'y'\].* pass "
                                          r"AutoparStrategy\(sample=\.\.\.\) as forward is called \(sample=\(batch,\)"):
        trainer.fit(DictModule(), torch.utils.data.DataLoader(rows, batch_size=4))
