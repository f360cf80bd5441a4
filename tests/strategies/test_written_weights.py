"""A parameter the forward writes in place: nn.Embedding(max_norm=) renormalises the rows its batch reads, in the
weight itself. Under FSDP the write landed in the gathered copy, which is freed after the forward, and each
data-parallel rank would renormalise its own rows only: on 2 gloo ranks (dp_shard=2, dp_replicate=2) the embedding
came out 3.4 from one process's after one AdamW step, silently. The trace finds the write
(ModelProfile.params_written); plans that use FSDP or split the batch or the weights over ranks are refused in one
line; one process and gradient accumulation train it as one process on the whole batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.layout import plan_refusal
from tests.strategies._refusal import FSDP_PLANS, refusal


class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 16, max_norm=1.0)
        self.head = nn.Linear(16, 50)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.emb(tokens)).flatten(0, 1), targets.flatten())


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, 50, (8, 6), generator=torch.Generator().manual_seed(step))
    return t, torch.roll(t, 1, 1)


def test_the_trace_finds_the_written_weight_and_nothing_else():
    assert autopar.profile_model(_LM(), _batch(0), warn=False).params_written == ("emb.weight",)
    plain = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 4))
    assert autopar.profile_model(plain, torch.randint(0, 50, (8, 6)), warn=False).params_written == ()


@pytest.mark.parametrize("fields", FSDP_PLANS)
def test_plans_that_would_lose_or_split_the_write_are_refused_in_one_line(fields):
    text = refusal(_LM(), _batch(0), fields)
    assert text.startswith("_LM's forward writes emb.weight in place") and "one process" in text


def test_tensor_and_pipeline_parallel_plans():
    """tp splits the weight (refused); a pipeline's stages write the one weight as one process does."""
    profile = autopar.profile_model(_LM(), _batch(0), warn=False)
    assert plan_refusal(autopar.Plan(tp=2, micro_batch_size=8), profile).startswith("_LM's forward writes emb.weight")
    assert plan_refusal(autopar.Plan(pp=2, pp_schedule="1f1b", micro_batch_size=4, grad_accum=2), profile) is None


def test_one_process_with_accumulation_trains_as_one_process_on_the_whole_batch(monkeypatch):
    monkeypatch.setenv("AUTOPAR_NO_WRAP_CACHE", "1")
    plain, model = _LM(), _LM()
    autopar.wrap(model, sample=_batch(0), plan=autopar.Plan(micro_batch_size=4, grad_accum=2), loop="train_step",
                 verbose=False)
    step = autopar.train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), lambda loss, batch: loss)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for s in range(3):
        want = plain(*_batch(s))
        want.backward()
        opt.step()
        opt.zero_grad()
        assert step(_batch(s)).item() == pytest.approx(want.item(), rel=1e-5)
    torch.testing.assert_close(model.emb.weight, plain.emb.weight, rtol=1e-5, atol=1e-6)
