"""Tensor parallelism tried on a meta copy before the model is touched (autopar.strategies.tensor_parallel_trial):
a forward that reshapes to a width tensor parallelism cannot divide is refused in one line naming the model's
line, with the model left as it was, where the plan was given; chosen again without tensor parallelism where wrap
chose it; a model that runs, and one whose step reads a value fake tensors cannot hold, are not refused.
Two gloo ranks under torchrun (tests/strategies/_tp_trial_worker.py)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from autopar.models.gpt import MLP, CausalSelfAttention
from tests._training import CFG
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


# ---- a reduction over the dimension the split divides: it runs, silently wrong; the trial finds it ---------------
class ConstantHeads(CausalSelfAttention):
    """The head count written as a number in its reshapes: under tp=2 each rank keeps every head and half of each
    head's width, and the scores are partial dot products (no shape error)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, CFG.num_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class UserAttention(CausalSelfAttention):
    """The built-in attention's code, written in the user's file (`-1` for the heads): right under tp=2."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = (q @ k.transpose(-2, -1)) / self.head_dim ** 0.5
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        y = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class NormalizedMLP(MLP):
    """Normalizes its inner activations over their width: under tp=2 each rank normalizes its half alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.normalize(F.gelu(self.up_proj(x)), dim=-1))


def _with(attention: type | None = None, mlp: type | None = None) -> torch.nn.Module:
    from tests.strategies._tp_trial_worker import gpt

    model = gpt(attention)
    for block in model.blocks:
        if mlp is not None:
            block.mlp.__class__ = mlp
    return model


def test_a_reduction_over_the_divided_dimension_is_refused_where_the_split_would_run_silently_wrong(one_plain_process):
    import autopar
    from autopar.models.gpt import lm_loss
    from autopar.profile import profile_model
    from autopar.strategies.tensor_parallel_trial import trial_in_fake_group
    from tests._training import batch
    from tests.strategies._tp_trial_worker import TP_PLAN

    rows, plan = batch(0), autopar.Plan(**TP_PLAN)

    def trial(model: torch.nn.Module) -> str | None:
        return trial_in_fake_group(model, rows, plan, profile_model(model, rows, loss_fn=lm_loss, warn=False),
                                   loss_fn=lm_loss)

    assert trial(_with(UserAttention)) is None  # the user's own attention, heads split right: not refused
    heads = trial(_with(ConstantHeads))
    assert heads.startswith("scaled_dot_product_attention runs over dim 3 of a [1, 4, 32, 8] tensor at "
                            "test_tensor_parallel_trial.py:")
    assert "(16 in the model, 8 on each rank)" in heads and "silently wrong" in heads and "num_heads" in heads
    normalized = trial(_with(mlp=NormalizedMLP))
    assert normalized.startswith("normalize runs over dim 2 of a [1, 32, 128] tensor at test_tensor_parallel_trial.py:")
    assert "(256 in the model, 128 on each rank)" in normalized and "num_heads" not in normalized
