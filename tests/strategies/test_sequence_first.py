"""Models whose sample has the sequence in dim 0: torch's RNNs, nn.MultiheadAttention and its transformer layers take
(sequence, batch, features) by default (batch_first=False), as PyTorch's word-language-model example feeds them.
autopar cuts batches along dim 0, so a plan that splits the batch into micro-batches would hand each one part of
every sequence, and train silently on something else (this file's LSTM: 3.9161, the mean loss of the two halves of
its sequences, each without the other's context, against 3.9141 on the whole batch). The trace notes such a module where the sample reaches it with its dim 0 first; plans that split the
batch are refused in one line that says what to change, and so is local_batch across data-parallel ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar import data as data_mod
from autopar.errors import PlanError
from autopar.strategies.apply import check_plan
from autopar.strategies.mesh import DataShard

T, B = 6, 4


class SeqFirstLM(nn.Module):
    def __init__(self, batch_first: bool = False, transpose: bool = False) -> None:
        super().__init__()
        self.transpose = transpose
        self.emb = nn.Embedding(50, 16)
        self.rnn = nn.LSTM(16, 32, 2, batch_first=batch_first)
        self.head = nn.Linear(32, 50)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens.t() if self.transpose else tokens)
        h, _ = self.rnn(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), (targets.t() if self.transpose else targets).flatten())


class SeqFirstEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0), 2)
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.inp(x)).mean(0)).square().mean()


def _tokens(first: str = "time"):
    t = torch.randint(0, 50, (T, B) if first == "time" else (B, T))
    return t, torch.roll(t, 1, 0 if first == "time" else 1)


def test_the_trace_notes_a_module_that_reads_the_samples_dim_0_as_its_sequence():
    profile = autopar.profile_model(SeqFirstLM(), _tokens(), warn=False)
    assert profile.sequence_first == "rnn (LSTM, batch_first=False, called with (6, 4, 16))"
    encoder = autopar.profile_model(SeqFirstEncoder(), torch.randn(T, B, 8), warn=False)
    assert encoder.sequence_first.startswith("enc.layers.0") and "batch_first=False, called with (6, 4, 32)" in \
        encoder.sequence_first
    # batch-first modules, and a batch-first sample transposed for a sequence-first one: nothing to note
    assert autopar.profile_model(SeqFirstLM(batch_first=True), _tokens("batch"), warn=False).sequence_first == ""
    assert autopar.profile_model(SeqFirstLM(transpose=True), _tokens("batch"), warn=False).sequence_first == ""


def test_a_plan_that_splits_the_batch_is_refused_and_one_that_does_not_is_kept():
    model = SeqFirstLM()
    profile = autopar.profile_model(model, _tokens(), warn=False)
    topology = autopar.Topology.from_spec("1xH200")
    for plan in (autopar.Plan(micro_batch_size=T // 2, grad_accum=2),
                 autopar.Plan(pp=2, pp_schedule="1f1b", micro_batch_size=T // 2, grad_accum=2)):
        with pytest.raises(PlanError) as info:
            check_plan(plan, profile, topology, world_size=plan.pp, model=model)
        text = str(info.value)
        assert "\n" not in text and "the sample's dim 0 is the sequence of rnn (LSTM" in text
        assert "batch_first=True" in text and "grad_accum=1" in text
    check_plan(autopar.Plan(micro_batch_size=T), profile, topology, world_size=1, model=model)


def test_the_search_never_splits_its_batch():
    plan = autopar.plan(SeqFirstLM(), sample=_tokens(), topology="8xH100-SXM", loop="train_step")
    assert plan.grad_accum == 1 and plan.pp == 1


def test_local_batch_refuses_to_cut_its_sequences(monkeypatch):
    monkeypatch.setenv("AUTOPAR_NO_WRAP_CACHE", "1")
    model = autopar.wrap(SeqFirstLM(), sample=_tokens(), verbose=False)
    monkeypatch.setattr(data_mod, "data_shard", lambda model: DataShard(1, 2))
    with pytest.raises(PlanError, match="the sample's dim 0 is the sequence of rnn"):
        autopar.local_batch(model, _tokens())
