"""Tensor parallelism tried on a meta copy before the model is touched (autopar.strategies.tensor_parallel_trial):
a forward that reshapes to a width tensor parallelism cannot divide is refused in one line naming the model's
line, with the model left as it was, where the plan was given; chosen again without tensor parallelism where wrap
chose it; a model that runs, and one whose step reads a value fake tensors cannot hold, are not refused.
Two gloo ranks under torchrun (tests/strategies/_tp_trial_worker.py)."""

from __future__ import annotations

import json

import pytest

from tests.distributed._launch import torchrun

WORKER = "tests/strategies/_tp_trial_worker.py"


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("tp_trial")
    torchrun(WORKER, 2, [str(tmp / "out.json")], cache_dir=tmp / "cache", timeout_s=600)
    return json.loads((tmp / "out.json").read_text())


def test_a_given_plan_whose_split_does_not_run_is_refused_before_the_model_is_touched(record):
    given = record["given"]
    assert given["error"] is not None
    assert given["error"].startswith("tensor parallelism (tp=2) does not run GPT: its first forward and backward "
                                     "raised RuntimeError: shape")
    assert "_tp_trial_worker.py:" in given["error"] and "in forward" in given["error"]  # the model's own line
    assert given["error"].endswith("pass a plan with tp=1 (data parallelism runs the model as it is).")
    assert "\n" not in given["error"]
    assert given["untouched"]


def test_wraps_own_choice_is_made_again_without_tensor_parallelism(record):
    chosen = record["chosen"]
    assert chosen["asked"][0] is None and "does not run GPT" in chosen["asked"][1]  # chosen again, told why
    assert chosen["tp"] == 1 and chosen["dp"] == 2
    assert any("choosing again without tensor parallelism" in w for w in chosen["warnings"])
    assert chosen["loss"] == pytest.approx(chosen["loss"]) and chosen["loss"] > 0  # a finite loss: it trains


def test_a_model_that_runs_under_tensor_parallelism_passes(record):
    assert record["trial_plain"] is None
    assert record["plain"]["tp"] == 2 and record["plain"]["loss"] > 0


def test_a_step_reading_a_computed_value_concludes_nothing(record):
    assert record["trial_reads"] is None


# ---- planning in one process (autopar.plan): the trial over a fake process group of the plan's size -------------
def test_the_trial_runs_in_a_fake_group_when_planning_in_one_process(one_plain_process):
    import torch.distributed as dist

    import autopar
    from autopar.models.gpt import lm_loss
    from autopar.profile import profile_model
    from autopar.strategies.tensor_parallel_trial import trial_in_fake_group
    from tests._training import batch
    from tests.strategies._tp_trial_worker import TP_PLAN, WidthAttention, gpt

    rows, plan = batch(0), autopar.Plan(**TP_PLAN)
    reasons = {}
    for name, attention in (("width", WidthAttention), ("plain", None)):
        model = gpt(attention)
        reasons[name] = trial_in_fake_group(model, rows, plan, profile_model(model, rows, loss_fn=lm_loss, warn=False),
                                            loss_fn=lm_loss)
        assert not dist.is_initialized()  # the fake group is gone after
    assert reasons["plain"] is None
    assert reasons["width"].startswith("its first forward and backward raised RuntimeError: shape")
    assert "_tp_trial_worker.py:" in reasons["width"]


def test_autopar_plan_chooses_again_without_tensor_parallelism(one_plain_process, monkeypatch):
    import autopar
    import autopar.api as api
    from autopar.models.gpt import lm_loss
    from tests._training import batch
    from tests.strategies._tp_trial_worker import TP_PLAN, WidthAttention, gpt

    real = api._choose
    refusals = []

    def tp_first(*args, tp_refusal=None, **kwargs):  # the cost model's choice, were it tp=2
        refusals.append(tp_refusal)
        if tp_refusal is None:
            return autopar.Plan(**TP_PLAN)
        return real(*args, tp_refusal=tp_refusal, **kwargs)

    monkeypatch.setattr(api, "_choose", tp_first)
    with pytest.warns(UserWarning, match=r"tensor parallelism \(tp=2\) does not run GPT: .*; choosing again without"):
        chosen = autopar.plan(gpt(WidthAttention), sample=batch(0), topology="2xH100-SXM", loss_fn=lm_loss,
                              global_batch_size=8, loop="accumulates")
    assert chosen.tp == 1
    assert refusals[0] is None and refusals[1].startswith("tensor parallelism (tp=2) does not run GPT: its first")
