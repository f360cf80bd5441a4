"""Shared by the Lightning tests and their worker: a tiny GPT LightningModule, its data, the one-process
reference, and one `Trainer.fit` under AutoparStrategy with what it recorded.

The data: 80 sequences. Lightning shuffles a training set through its DistributedSampler (seed 0, epoch 0), and
data-parallel rank r of `size` takes every size-th index of that permutation from r, so the global batch of step
k is the permutation's k-th run of 8 indices, whatever the plan: the reference trains on exactly those.
"""

from __future__ import annotations

import hashlib
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

import autopar
from autopar.integrations.lightning import AutoparStrategy, MeasureOptions
from autopar.models.gpt import GPT, lm_loss, synthetic_tokens
from tests._training import CFG, GLOBAL_BATCH, LR, STEPS

SAMPLES = GLOBAL_BATCH * STEPS


def dataset() -> torch.Tensor:
    return torch.cat([synthetic_tokens(GLOBAL_BATCH, CFG, step=s, seed=1) for s in range(STEPS)])


def global_batches() -> list[torch.Tensor]:
    """The global batch of each step as Lightning's sampler orders the data (seed 0, epoch 0)."""
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0))
    data = dataset()
    return [data[order[k * GLOBAL_BATCH:(k + 1) * GLOBAL_BATCH]] for k in range(STEPS)]


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=False)


def reference_losses() -> list[float]:
    """One plain process, no Lightning, no autopar: the whole global batch each step (fp32)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = make_optimizer(model.parameters())
    losses = []
    for x in global_batches():
        loss = lm_loss(model(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


class GPTModule(L.LightningModule):
    """The built-in GPT as a LightningModule, written as a user writes one."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(CFG)
        self.batch_size = batch_size  # what BatchSizeFinder scales

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return lm_loss(self(batch), batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.parameters())

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(dataset(), batch_size=self.batch_size)


def _digest(x: torch.Tensor) -> str:
    return hashlib.sha256(x.contiguous().numpy().tobytes()).hexdigest()[:16]


class Recorder(L.Callback):
    """Per training batch: the loss averaged over all ranks (each data-parallel rank's is the mean of its own
    slice; tensor- and pipeline-parallel peers return the same) and this rank's samples (digests of rows)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.rows: list[list[str]] = []
        self.sampler: tuple[int, int] | None = None

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        sampler = trainer.train_dataloader.sampler  # the one Lightning put in: (num_replicas, rank)
        self.sampler = (sampler.num_replicas, sampler.rank)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs["loss"].detach().clone().float()
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        self.losses.append(loss.item())
        self.rows.append([_digest(row) for row in batch])


def fit(*, plan: dict | None = None, batch_size: int = 4, strategy: Any = None, measure: dict | None = None,
        train_step: bool = False, steps: int = STEPS, sample_size: int | None = None, loss_fn: bool = True,
        **trainer_kwargs: Any) -> dict:
    """One Trainer.fit of a fresh GPTModule; what it recorded, as plain values. `sample_size`: give the strategy a
    sample of that many sequences (default: it takes the first training batch). `loss_fn=False`: give the strategy
    no loss_fn (training_step is the loss)."""
    module = GPTModule(batch_size)
    if strategy is None:
        sample = dataset()[:sample_size] if sample_size is not None else None
        strategy = AutoparStrategy(plan=autopar.Plan(**plan) if plan is not None else None, loss_fn=lm_loss if loss_fn else None,
                                   sample=sample,
                                   train_step=train_step, verbose=False,
                                   measure=MeasureOptions(**measure) if measure is not None else None)
    recorder = Recorder()
    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[recorder, *trainer_kwargs.pop("callbacks", [])], **trainer_kwargs)
    trainer.fit(module)
    state = autopar.applied(module)
    out = {"losses": recorder.losses, "rows": recorder.rows, "sampler": recorder.sampler, "plan": state.plan.to_yaml(),
           "data_shard": tuple(state.data_shard), "automatic_optimization": module.automatic_optimization,
           "global_step": trainer.global_step}
    strat = trainer.strategy
    if strat.measurement is not None:
        out["measured"] = {"metrics": strat.measurement.metrics(), "line": strat.measurement.describe()}
    if strat.feedback is not None:
        fb = strat.feedback
        out["feedback"] = {"ledger": str(fb.ledger_path), "plans": fb.plans_measured,
                           "fit_runs": None if fb.fit is None else fb.fit.runs,
                           "refit": None if fb.refit_path is None else str(fb.refit_path),
                           "line": fb.describe()}
    return out
