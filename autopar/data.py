"""Data that follows the plan: which samples each rank reads.

Ranks that share a data-parallel index (`autopar.data_shard(model).rank`) - the tensor- and pipeline-
parallel peers of one group - must read the same samples; ranks with different indices read disjoint
slices. `sampler` and `dataloader` do that for a map-style dataset, `dataloader` for an iterable one too (each
rank reads the whole stream and keeps its share of every global batch); `local_batch` cuts this rank's slice out of
a global batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .errors import PlanError
from ._util.batch import sample_batch_size, sample_rows
from .strategies.state import applied, data_shard, plan_of


def sampler(model: nn.Module, dataset: Any, *, shuffle: bool = True, seed: int = 0,
            drop_last: bool = True) -> torch.utils.data.DistributedSampler:
    """A DistributedSampler over the data-parallel ranks of the wrapped model's plan."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise PlanError("an iterable dataset has no indices to sample: take its batches from "
                        "autopar.dataloader(model, dataset), which gives each rank its share of the stream.")
    shard = data_shard(model)
    return torch.utils.data.DistributedSampler(dataset, num_replicas=shard.size, rank=shard.rank,
                                               shuffle=shuffle, seed=seed, drop_last=drop_last)


def dataloader(model: nn.Module, dataset: Any, *, shuffle: bool | None = None, seed: int = 0, drop_last: bool = True,
               **kwargs: Any) -> torch.utils.data.DataLoader:
    """A DataLoader yielding this rank's batches of the plan's local batch size (micro-batch x accumulation).

    A last, smaller batch is dropped by default: train_step needs the plan's batch size (drop_last=False
    keeps it for other uses).

    A map-style dataset is shuffled (shuffle=None or True; seed): call `loader.sampler.set_epoch(epoch)` each epoch
    to reshuffle, as with any DistributedSampler. An IterableDataset must yield the same samples in the same order on
    every rank (it shuffles itself, if at all): each rank keeps its share of every run of a global batch's samples
    (`_RankShare`), and a last incomplete global batch is dropped on every rank, so all make the same steps.
    """
    if "batch_size" in kwargs or "sampler" in kwargs:
        raise PlanError("autopar.dataloader sets batch_size and sampler from the plan: leave them out.")
    plan, shard = plan_of(model), data_shard(model)
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return torch.utils.data.DataLoader(_iterable_share(dataset, shard, plan.local_batch_size, shuffle, drop_last),
                                           batch_size=plan.local_batch_size, drop_last=True, **kwargs)
    shuffle = True if shuffle is None else shuffle
    per_rank = len(dataset) // shard.size if hasattr(dataset, "__len__") else None
    if drop_last and per_rank is not None and per_rank < plan.local_batch_size:
        raise PlanError(f"the dataset's {len(dataset)} samples give each of the {shard.size} data-parallel rank(s) "
                        f"{per_rank}, fewer than one batch of {plan.local_batch_size}: every epoch would yield nothing; "
                        "use more samples, a smaller batch, or drop_last=False.")
    return torch.utils.data.DataLoader(dataset, batch_size=plan.local_batch_size, drop_last=drop_last,
                                       sampler=sampler(model, dataset, shuffle=shuffle, seed=seed, drop_last=drop_last),
                                       **kwargs)


class _RankShare(torch.utils.data.IterableDataset):
    """One data-parallel rank's share of an iterable dataset that every rank reads alike: of each run of
    `size` x `batch` samples (one global batch, in the order one process at the global batch size reads them), the
    samples at positions rank, rank + size, ...; an incomplete last run is dropped, so every rank yields the same
    number of samples. In a DataLoader worker it takes its share of what the dataset yields in that worker, as one
    process's worker would batch it."""

    def __init__(self, dataset: torch.utils.data.IterableDataset, rank: int, size: int, batch: int) -> None:
        self.dataset, self.rank, self.size, self.batch = dataset, rank, size, batch

    def __iter__(self) -> Any:
        run: list[Any] = []
        for sample in self.dataset:
            run.append(sample)
            if len(run) == self.size * self.batch:
                yield from run[self.rank::self.size]
                run = []

    def set_epoch(self, epoch: int) -> None:
        """The dataset's own `set_epoch` (a Hugging Face streaming dataset's reshuffles by it)."""
        self.dataset.set_epoch(epoch)


def _iterable_share(dataset: torch.utils.data.IterableDataset, shard: Any, batch: int, shuffle: bool | None,
                    drop_last: bool) -> torch.utils.data.IterableDataset:
    """`dataset` as this rank reads it (see dataloader), or a PlanError saying what to change."""
    if shuffle:
        raise PlanError("autopar.dataloader cannot shuffle an iterable dataset: shuffle it in the dataset, with the "
                        "same seed on every rank, and leave shuffle out.")
    if not drop_last:
        raise PlanError("an iterable dataset's last incomplete global batch cannot give every data-parallel rank a "
                        "batch of the plan's size: leave drop_last=True.")
    return _RankShare(dataset, shard.rank, shard.size, batch) if shard.size > 1 else dataset


def local_batch(model: nn.Module, global_batch: Any) -> Any:
    """This rank's slice of a global batch (dim 0 of every tensor, and lists of one item per sample), by the plan's
    data-parallel index."""
    shard = data_shard(model)
    sequence_first = applied(model).profile.sequence_first
    if shard.size > 1 and sequence_first:
        raise PlanError(f"local_batch cuts a global batch along dim 0, and the sample's dim 0 is the sequence of "
                        f"{sequence_first}: build it with batch_first=True and give batch-first tensors, or cut the "
                        "batch along its batch dimension yourself.")
    size = sample_batch_size(global_batch)
    if size % shard.size:
        raise PlanError(f"a global batch of {size} samples does not split over {shard.size} data-parallel ranks.")
    n = size // shard.size
    return sample_rows(global_batch, shard.rank * n, (shard.rank + 1) * n, size)
