"""A model with a sparse-gradient embedding (nn.Embedding / nn.EmbeddingBag with sparse=True, as recommendation
models build them): FSDP2 cannot shard or reduce a sparse gradient (its backward failed deep in FSDP's
`fsdp::chunk_cat` with NotImplementedError for SparseCPU), so a plan that manages the parameters with FSDP is refused
before the model is touched, in one line that says what to change; one process without offload keeps it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar
from tests.strategies._refusal import FSDP_PLANS, refusal


class Recommender(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.items = nn.EmbeddingBag(100, 16, mode="sum", sparse=True)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.items(ids)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.head(h)


@pytest.mark.parametrize("fields", FSDP_PLANS)
def test_a_plan_that_uses_fsdp_is_refused_in_one_line(fields):
    text = refusal(Recommender(), torch.randint(0, 100, (8, 4)), fields)
    assert "items of Recommender has sparse=True" in text and "sparse=False" in text


def test_one_process_keeps_it_and_trains(monkeypatch):
    monkeypatch.setenv("AUTOPAR_NO_WRAP_CACHE", "1")
    torch.manual_seed(0)
    model = autopar.wrap(Recommender(), sample=torch.randint(0, 100, (8, 4)), verbose=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randint(0, 100, (8, 4))).square().mean().backward()
    assert model.items.weight.grad.is_sparse
    opt.step()


def test_planning_for_several_gpus_says_no_plan_can_train_it_and_why_and_one_gpu_plans_one_process():
    ids = torch.randint(0, 100, (8, 4))
    with pytest.raises(autopar.InfeasiblePlanError) as info:
        autopar.plan(Recommender(), sample=ids, topology="8xH100-SXM")
    text = str(info.value)
    assert "\n" not in text and text.startswith("no plan can train Recommender on 8 processes: items of Recommender")
    assert "sparse=False" in text
    one = autopar.plan(Recommender(), sample=ids, topology="1xH200")
    assert not one.uses_fsdp


def test_the_profile_names_the_sparse_embeddings_from_the_structure_alone():
    profile = autopar.profile_model(Recommender(), torch.randint(0, 100, (8, 4)), warn=False, trace=False)
    assert profile.sparse_grad_modules == ("items",)


def test_its_step_is_traced_with_the_sparse_gradient():
    """The trace follows strided tensors' storages; the embedding's sparse gradient has none (it raised
    'Cannot access storage of SparseTensorImpl', and the model got only a structural profile)."""
    profile = autopar.profile_model(Recommender(), torch.randint(0, 100, (8, 4)), warn=False)
    assert profile.traced and profile.flops > 0
