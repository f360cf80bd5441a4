"""Tests of autopar.sampler / autopar.dataloader / autopar.local_batch in one process: with the plan's data-parallel
size 1 (the whole dataset, batches of plan.local_batch_size, the last partial batch dropped) and, with the data
shard faked as rank 1 of 4, the rank's own disjoint share of a dataset and its rows of a global batch."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

import autopar
from autopar import data as data_mod
from autopar.errors import PlanError
from autopar.models.gpt import lm_loss
from autopar.plans import Plan
from autopar.strategies.mesh import DataShard
from tests._training import TORCHRUN_VARS, batch, make_model

PLAN = Plan(micro_batch_size=4, grad_accum=2)  # local batch 8


@pytest.fixture(scope="module")
def model():
    with pytest.MonkeyPatch.context() as mp:
        for name in TORCHRUN_VARS:
            mp.delenv(name, raising=False)
        assert not torch.distributed.is_initialized()
        m = make_model("gpt")
        autopar.wrap(m, sample=batch(0), plan=PLAN, loss_fn=lm_loss, verbose=False)
    assert autopar.plan_of(m).local_batch_size == 8 and tuple(autopar.data_shard(m)) == (0, 1)
    return m


def _as_rank(monkeypatch, rank: int, size: int = 4) -> None:
    """Make autopar believe this process reads data shard `rank` of `size`."""
    monkeypatch.setattr(data_mod, "data_shard", lambda model: DataShard(rank, size))


def _dataset(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n), torch.arange(n) * 10)


# ---- one data-parallel rank ---------------------------------------------------------------------------
def test_sampler_on_one_rank_reads_the_whole_dataset(model):
    s = autopar.sampler(model, _dataset(21), shuffle=False)
    assert isinstance(s, DistributedSampler) and (s.num_replicas, s.rank) == (1, 0)
    assert list(s) == list(range(21))
    shuffled = autopar.sampler(model, _dataset(21), seed=3)
    order = list(shuffled)
    assert sorted(order) == list(range(21)) and order != list(range(21))
    assert list(autopar.sampler(model, _dataset(21), seed=3)) == order  # the seed fixes the order
    shuffled.set_epoch(1)
    assert sorted(shuffled) == list(range(21)) and list(shuffled) != order  # a new order each epoch


def test_dataloader_on_one_rank_gives_local_batches_and_drops_the_last(model):
    loader = autopar.dataloader(model, _dataset(21), shuffle=False)
    assert loader.batch_size == autopar.plan_of(model).local_batch_size == 8 and loader.drop_last
    batches = list(loader)
    assert len(batches) == len(loader) == 2  # 21 samples: two batches of 8, the last 5 dropped
    assert torch.equal(batches[0][0], torch.arange(8)) and torch.equal(batches[1][0], torch.arange(8, 16))
    assert torch.equal(batches[1][1], torch.arange(8, 16) * 10)
    seen = torch.cat([b[0] for b in autopar.dataloader(model, _dataset(21), seed=1)])
    assert len(seen) == 16 and len(set(seen.tolist())) == 16


def test_local_batch_on_one_rank_is_the_whole_batch(model):
    x = batch(0)
    assert torch.equal(autopar.local_batch(model, x), x)


# ---- rank 1 of 4 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("shuffle", [False, True])
def test_sampler_gives_each_rank_a_disjoint_quarter(model, monkeypatch, shuffle):
    shares = []
    for rank in range(4):
        _as_rank(monkeypatch, rank)
        s = autopar.sampler(model, _dataset(18), shuffle=shuffle, seed=5)
        assert (s.num_replicas, s.rank) == (4, rank)
        shares.append(list(s))
    assert [len(s) for s in shares] == [4] * 4  # 18 samples over 4 ranks: 4 each, 2 dropped
    flat = [i for s in shares for i in s]
    assert len(set(flat)) == 16 and set(flat) <= set(range(18))
    if not shuffle:
        assert shares[1] == [1, 5, 9, 13]


def test_dataloader_reads_only_the_ranks_share(model, monkeypatch):
    _as_rank(monkeypatch, 1)
    loader = autopar.dataloader(model, _dataset(64), shuffle=False)
    rows = [b[0] for b in loader]
    assert [len(r) for r in rows] == [8, 8]  # 64 / 4 ranks = 16 samples: two local batches of 8
    assert torch.cat(rows).tolist() == list(range(1, 64, 4))


def test_local_batch_takes_the_ranks_rows(model, monkeypatch):
    _as_rank(monkeypatch, 1)
    x = torch.arange(8 * 3).reshape(8, 3)
    assert torch.equal(autopar.local_batch(model, x), x[2:4])
    positions = torch.arange(5)
    b = {"input_ids": torch.arange(40).reshape(8, 5), "labels": torch.arange(40).reshape(8, 5) + 1,
         "position_ids": positions}
    out = autopar.local_batch(model, b)
    assert type(out) is dict and list(out) == list(b)
    assert torch.equal(out["input_ids"], b["input_ids"][2:4]) and torch.equal(out["labels"], b["labels"][2:4])
    assert out["position_ids"] is positions  # not batched: every rank gets it whole
    xs, ys = autopar.local_batch(model, (x, x * 2))
    assert torch.equal(xs, x[2:4]) and torch.equal(ys, x[2:4] * 2)
    _as_rank(monkeypatch, 3)
    assert torch.equal(autopar.local_batch(model, x), x[6:8])


def test_local_batch_takes_the_ranks_targets_of_a_detection_batch(model, monkeypatch):
    _as_rank(monkeypatch, 1)
    targets = [{"boxes": torch.rand(n, 4)} for n in (8, 1, 2, 3, 8, 1, 2, 3)]  # 8 boxes: as many as images
    out = autopar.local_batch(model, {"pixel_values": torch.randn(8, 3, 4, 4), "labels": targets})
    assert out["pixel_values"].shape[0] == 2 and out["labels"] == targets[2:4]


def test_local_batch_slices_a_batch_encoding(model, monkeypatch):
    transformers = pytest.importorskip("transformers")
    _as_rank(monkeypatch, 1)
    enc = transformers.BatchEncoding({"input_ids": torch.arange(40).reshape(8, 5),
                                      "attention_mask": torch.ones(8, 5, dtype=torch.long)})
    out = autopar.local_batch(model, enc)
    assert torch.equal(out["input_ids"], enc["input_ids"][2:4])
    assert out["attention_mask"].shape == (2, 5)


def test_local_batch_refuses_a_batch_that_does_not_divide(model, monkeypatch):
    _as_rank(monkeypatch, 1)
    with pytest.raises(PlanError, match="a global batch of 6 samples does not split over 4 data-parallel ranks"):
        autopar.local_batch(model, torch.zeros(6, 2))
    with pytest.raises(PlanError, match="a global batch of 9 samples"):
        autopar.local_batch(model, {"input_ids": torch.zeros(9, 2, dtype=torch.long)})


@pytest.mark.parametrize("kwargs", [{"batch_size": 4}, {"sampler": None}, {"batch_size": 8, "num_workers": 0}])
def test_dataloader_sets_batch_size_and_sampler_itself(model, kwargs):
    with pytest.raises(PlanError, match="sets batch_size and sampler from the plan"):
        autopar.dataloader(model, _dataset(16), **kwargs)


def test_dataloader_passes_other_options_on(model):
    loader = autopar.dataloader(model, _dataset(16), shuffle=False, collate_fn=lambda rows: [r[0] for r in rows])
    assert [int(t) for t in next(iter(loader))] == list(range(8))


def test_helpers_refuse_a_model_that_was_not_wrapped():
    plain = torch.nn.Linear(2, 2)
    for call in (lambda: autopar.sampler(plain, _dataset(4)), lambda: autopar.dataloader(plain, _dataset(4)),
                 lambda: autopar.local_batch(plain, torch.zeros(4, 2))):
        with pytest.raises(PlanError, match="not wrapped by autopar.wrap"):
            call()


def test_a_dataset_smaller_than_one_batch_is_refused_not_left_to_yield_nothing(model):
    with pytest.raises(PlanError, match="7 samples give each of the 1 data-parallel rank.s. 7, fewer than one batch "
                                        "of 8: every epoch would yield nothing"):
        autopar.dataloader(model, _dataset(7))
    assert len(list(autopar.dataloader(model, _dataset(7), drop_last=False))) == 1  # the remedy it names


# ---- an iterable dataset ------------------------------------------------------------------------------
class _Stream(torch.utils.data.IterableDataset):
    """Samples 0..n-1 in order (the same on every rank), split between DataLoader workers by the dataset itself."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(start, self.n, step):
            yield torch.tensor(i), torch.tensor(i * 10)


def _global_batches(n: int, per_step: int, workers: int = 0) -> list[list[int]]:
    """What one process reads from _Stream(n) at the global batch size (drop_last: full batches only)."""
    loader = torch.utils.data.DataLoader(_Stream(n), batch_size=per_step, drop_last=True, num_workers=workers)
    return [b[0].tolist() for b in loader]


@pytest.mark.parametrize("workers", [0, 2])
def test_the_ranks_of_an_iterable_dataset_read_one_processs_global_batches(model, monkeypatch, workers):
    """4 ranks x 8 samples: each step's batches on the 4 ranks make up the global batch of 32 one process reads at
    that size (with its DataLoader workers too), in the same order of steps; the incomplete last one is dropped on
    every rank, so all make the same number of steps."""
    shares = []
    for rank in range(4):
        _as_rank(monkeypatch, rank)
        loader = autopar.dataloader(model, _Stream(150), num_workers=workers)
        batches = list(loader)
        assert all(len(b[0]) == 8 and torch.equal(b[1], b[0] * 10) for b in batches)
        shares.append([b[0].tolist() for b in batches])
    want = _global_batches(150, 32, workers)
    assert len(want) == 4 and all(len(s) == len(want) for s in shares)
    for step, batch_ in enumerate(want):
        assert sorted(i for s in shares for i in s[step]) == sorted(batch_)
    assert shares[1][0] == want[0][1::4]  # rank 1 takes positions 1, 5, 9, ... of each global batch


def test_one_rank_reads_an_iterable_dataset_in_full_batches(model):
    loader = autopar.dataloader(model, _Stream(21))
    assert [b[0].tolist() for b in loader] == [list(range(8)), list(range(8, 16))]


@pytest.mark.parametrize("kwargs, says", [(dict(shuffle=True), "shuffle it in the dataset"),
                                          (dict(drop_last=False), "leave drop_last=True")])
def test_an_iterable_dataset_refuses_what_it_cannot_do(model, kwargs, says):
    with pytest.raises(PlanError, match=says):
        autopar.dataloader(model, _Stream(64), **kwargs)
    with pytest.raises(PlanError, match="no indices to sample"):
        autopar.sampler(model, _Stream(64))
