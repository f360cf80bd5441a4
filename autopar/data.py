"""Data that follows the plan: which samples each rank reads.

Ranks that share a data-parallel index (`autopar.data_shard(model).rank`) - the tensor- and pipeline-
parallel peers of one group - must read the same samples; ranks with different indices read disjoint
slices. `sampler` and `dataloader` do that for a map-style dataset; `local_batch` cuts this rank's
slice out of a global batch.
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
    shard = data_shard(model)
    return torch.utils.data.DistributedSampler(dataset, num_replicas=shard.size, rank=shard.rank,
                                               shuffle=shuffle, seed=seed, drop_last=drop_last)


def dataloader(model: nn.Module, dataset: Any, *, shuffle: bool = True, seed: int = 0, drop_last: bool = True,
               **kwargs: Any) -> torch.utils.data.DataLoader:
    """A DataLoader yielding this rank's batches of the plan's local batch size (micro-batch x accumulation).

    A last, smaller batch is dropped by default: train_step needs the plan's batch size (drop_last=False
    keeps it for other uses).

    Call `loader.sampler.set_epoch(epoch)` each epoch to reshuffle, as with any DistributedSampler.
    """
    if "batch_size" in kwargs or "sampler" in kwargs:
        raise PlanError("autopar.dataloader sets batch_size and sampler from the plan: leave them out.")
    plan, shard = plan_of(model), data_shard(model)
    per_rank = len(dataset) // shard.size if hasattr(dataset, "__len__") else None
    if drop_last and per_rank is not None and per_rank < plan.local_batch_size:
        raise PlanError(f"the dataset's {len(dataset)} samples give each of the {shard.size} data-parallel rank(s) "
                        f"{per_rank}, fewer than one batch of {plan.local_batch_size}: every epoch would yield nothing; "
                        "use more samples, a smaller batch, or drop_last=False.")
    return torch.utils.data.DataLoader(dataset, batch_size=plan.local_batch_size, drop_last=drop_last,
                                       sampler=sampler(model, dataset, shuffle=shuffle, seed=seed, drop_last=drop_last),
                                       **kwargs)


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
