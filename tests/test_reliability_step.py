"""Issue 32 (reliability, second round), the training step and the sample:

- autopar.train_step without loss_fn refuses a model output that carries no loss (a logits tensor) with a
  LossError, before anything is stepped; an output that is itself a scalar loss, or has `.loss`, is trained on;
- a sample= that does not fit the model's forward is refused by autopar.wrap and autopar.plan with a SampleError
  that names the sample's keys and the forward's parameters, before any trace (no fallback plan, no warning);
- the ranks of a tensor- or pipeline-parallel group given different batches (a DistributedSampler over every
  rank) are refused at the first step on every rank (PeerBatchError); the same batches train.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.errors import LossError, PeerBatchError, SampleError, TraceError
from autopar.plans import Plan
from tests.distributed._launch import torchrun

pytestmark = pytest.mark.usefixtures("one_plain_process")


class Logits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class ReturnsItsLoss(Logits):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).pow(2).mean()


def _wrapped(model: nn.Module) -> nn.Module:
    return autopar.wrap(model, sample=torch.randn(8, 4), plan=Plan(micro_batch_size=8), verbose=False)


# ---- item 2: no loss_fn and no loss in the output ------------------------------------------------------------
def test_train_step_without_loss_fn_refuses_logits_and_leaves_the_parameters_unchanged():
    model = _wrapped(Logits())
    before = [p.detach().clone() for p in model.parameters()]
    step = autopar.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(LossError) as info:
        step(torch.randn(8, 4))
    message = str(info.value)
    assert "\n" not in message
    assert "a tensor of shape (8, 3) with no .loss" in message and "pass loss_fn=" in message
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())


class Pair(Logits):
    def forward(self, x: torch.Tensor):
        return self.layer(x), x


class WithLoss(Logits):
    def forward(self, x: torch.Tensor):
        logits = self.layer(x)
        return {"logits": logits, "loss": logits.pow(2).mean()}


def test_train_step_without_loss_fn_takes_only_a_loss_the_model_returned():
    x = torch.randn(8, 4)
    for cls in (ReturnsItsLoss, WithLoss):  # the output is the loss, or carries it: trained on
        model = _wrapped(cls())
        before = [p.detach().clone() for p in model.parameters()]
        expected = model.layer(x).pow(2).mean().item()
        loss = autopar.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1))(x)
        assert loss.item() == pytest.approx(expected)
        assert not any(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    model = _wrapped(Pair())  # a tuple of tensors: no loss in it, refused
    refusal = r"^the model's output is a tuple of 2 value\(s\) with no \.loss: pass loss_fn="
    with pytest.raises(LossError, match=refusal):
        autopar.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1))(x)
    assert all(p.grad is None for p in model.parameters())


# ---- item 12: a sample that does not fit the forward ---------------------------------------------------------
@pytest.mark.parametrize("entry", ["wrap", "plan"])
def test_a_sample_that_does_not_fit_the_forward_is_refused_before_any_trace(entry, monkeypatch):
    import autopar.profile.build as build

    def no_trace(*args, **kwargs):  # the sample must be refused before the step is traced
        raise AssertionError("traced")

    monkeypatch.setattr(build, "_traced_step", no_trace)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback plan, no warning blaming the forward
        with pytest.raises(SampleError) as info:
            getattr(autopar, entry)(Logits(), sample={"inputs": torch.randn(8, 4)})
    assert not isinstance(info.value, TraceError)
    message = str(info.value)
    assert "\n" not in message
    assert "sample= does not fit Logits.forward(x)" in message
    assert "it has keys ['inputs'], forward takes ['x']" in message


def test_a_sample_that_fits_the_forward_is_not_refused():
    from autopar._util.batch import check_sample_fits

    class Kw(nn.Module):
        def forward(self, input_ids, labels=None, **kwargs):
            return input_ids

    x = torch.zeros(2, 3)
    check_sample_fits(Logits(), x)
    check_sample_fits(Logits(), (x,))
    check_sample_fits(Logits(), {"x": x})
    check_sample_fits(Kw(), {"input_ids": x, "labels": x, "attention_mask": x})
    with pytest.raises(SampleError, match=r"is 2 positional value\(s\), forward takes \['x'\]"):
        check_sample_fits(Logits(), (x, x))


# ---- item 5: tensor- and pipeline-parallel peers given different batches -------------------------------------
@pytest.fixture(scope="module")
def peer_results(tmp_path_factory):
    """Each rank's results of tests/distributed/_peer_batch_worker.py on 2 gloo processes (one launch)."""
    out = tmp_path_factory.mktemp("peers")
    torchrun("tests/distributed/_peer_batch_worker.py", 2, [str(out)], cache_dir=out / "autopar-cache")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_tensor_and_pipeline_peers_given_different_batches_are_refused_on_every_rank(peer_results):
    ranks = peer_results
    for result in ranks:
        for name, kind in (("tp-different", "tensor-parallel"), ("pp-different", "pipeline-parallel")):
            r = result[name]
            assert r["error"] == PeerBatchError.__name__ and not r["moved"] and r["losses"] == []
            assert f"the ranks of a {kind} group were given different batches" in r["message"]
            assert "autopar.dataloader" in r["message"] and "\n" not in r["message"]
        for name in ("tp-same", "pp-same"):
            assert result[name]["error"] is None and result[name]["moved"] and len(result[name]["losses"]) == 2
    assert ranks[0]["tp-same"]["losses"] == ranks[1]["tp-same"]["losses"]


@pytest.mark.slow
def test_a_pipeline_step_without_loss_fn_on_logits_is_refused_on_every_stage(peer_results):
    """The last stage's LossError is raised by every stage after the schedule (not left waiting), nothing stepped."""
    last, first = peer_results[1]["pp-no-loss-fn"], peer_results[0]["pp-no-loss-fn"]
    assert last["error"] == first["error"] == LossError.__name__
    assert "a tensor of shape (4, 32, 128) with no .loss: pass loss_fn=" in last["message"]
    assert "the last pipeline stage's error" in first["message"] and "pass loss_fn=" in first["message"]
    for r in (first, last):
        assert not r["moved"] and not r["grads"] and r["losses"] == []
