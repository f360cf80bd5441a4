"""Lightning's strategy for autopar: `Trainer(strategy="autopar")` plans and applies the parallelism.

    import autopar.integrations.lightning                        # registers "autopar" in StrategyRegistry
    trainer = L.Trainer(strategy="autopar", devices=2, max_steps=100)
    trainer = L.Trainer(strategy=AutoparStrategy(sample=batch, plan=None, global_batch_size=None), ...)

`AutoparStrategy` is a `ModelParallelStrategy` whose parallelism is autopar's plan, not a dp x tp split:

- `setup_environment` starts the process group (Lightning's launcher or torchrun) and builds no mesh of its own;
  it refuses, with one line saying what to change, what would disagree with any plan (BatchSizeFinder,
  `accumulate_grad_batches`, a precision autopar does not plan).
- `setup` wraps the LightningModule with `autopar.wrap` (the given plan, one cached by `autopar tune`, or the
  cost model's) on the sample (given, else `example_input_array`, else the first training batch), takes the
  plan's mesh, refuses a Trainer precision other than the plan's, then builds the optimizers (after wrap).
- `distributed_sampler_kwargs` is autopar's data shard: tensor- and pipeline-parallel peers read the same
  samples, data-parallel ranks different ones, whatever the mesh.
- Plans a plain loop runs (data and tensor parallel, no accumulation) train through the module's own
  `training_step` (automatic optimization). Plans that split the step (gradient accumulation, pipelines), or
  any plan when `train_step=True`, run under manual optimization through `autopar.train_step`, one
  optimizer step per training batch of `plan.local_batch_size` samples: each micro-batch's loss is the module's
  `training_step` (without a pipeline or a `loss_fn`), else `loss_fn(forward(micro_batch), micro_batch)`.
- A callback times the run's steps and logs them beside the plan's prediction, and feeds them back to the cost
  model as a tuner's trial is fed back (autopar/integrations/_measure.py).

Lightning is an optional dependency (the `autopar[lightning]` extra): this module imports it at the top, and
nothing in autopar imports this module, so `import autopar` never imports Lightning.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.nn as nn

# Lightning: optional (autopar[lightning]); only users of this integration import this module.
import lightning.pytorch as pl
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.callbacks import BatchSizeFinder, Callback
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn

from .._util.batch import check_sample_fits, sample_batch_size
from .._util.dist import world
from .._util.log import get_logger
from ..api import wrap
from ..errors import AutoparError, PlanError
from ..planning import bf16_variants
from ..plans import Plan
from ..step import train_step as autopar_train_step
from ..strategies.state import Applied, applied, data_shard, is_wrapped
from ..topology import Topology, resolve_topology
from ._measure import Comparison, FeedBack, MeasureOptions, StepTimer, feed_back, measure, predicted

__all__ = ["AutoparStrategy", "MeasureOptions", "register"]

#: Lightning's precision flags and the plan precision each one means (any other is refused).
PRECISIONS = {"32-true": "fp32", "bf16-mixed": "bf16"}
#: The metric a plan run through autopar.train_step with a loss_fn or a pipeline logs its loss as (the module's
#: training_step is not called there).
LOSS_NAME = "train_loss"
#: Each module's automatic_optimization before a strategy set it False to run autopar.train_step (a second fit of
#: the same module finds it False): whether the user's training_step optimizes manually.
_USERS_AUTOMATIC: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def _wrap(module: nn.Module, *, sample: Any, plan: Any, global_batch_size: int | None, loss_fn: Callable | None,
          topology: Any, blocks: Any, init_fn: Callable | None, verbose: bool, train_step: bool) -> None:
    """The one call of autopar.wrap in this integration. `train_step`: the loop drives the plan through
    autopar.train_step under manual optimization (so wrap may choose accumulation, pipelines, tensor parallelism);
    otherwise wrap chooses as for a plain loop, and a given plan is taken as it is (the strategy runs a plan that
    accumulates or pipelines through autopar.train_step all the same)."""
    wrap(module, sample=sample, plan=plan, topology=topology, global_batch_size=global_batch_size, loss_fn=loss_fn,
         blocks=blocks, init_fn=init_fn, verbose=verbose,
         loop="train_step" if train_step else None)  # None: the plain loop's choice, a given plan as it is


# ---------------------------------------------------------------------------------------------------------------
# What the Trainer asks that would disagree with any plan: refused before anything is set up
# ---------------------------------------------------------------------------------------------------------------
def check_trainer(trainer: pl.Trainer) -> None:
    """Refuse (PlanError, one line with the remedy) a Trainer whose settings autopar's plan would contradict."""
    if any(isinstance(cb, BatchSizeFinder) for cb in trainer.callbacks):
        raise PlanError(
            "BatchSizeFinder (or Tuner.scale_batch_size) changes the batch size after autopar planned for it, so the "
            "plan (its micro-batch, accumulation and memory) would be stale: remove it; autopar already fits the "
            "batch to memory (AutoparStrategy(train_step=True, global_batch_size=N) lets it choose micro-batches "
            "and accumulation), or find the batch size on a plain Trainer first and give it to the DataLoader.")
    if trainer.accumulate_grad_batches != 1:
        raise PlanError(
            f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) would accumulate on top of the plan, "
            f"making the global batch {trainer.accumulate_grad_batches}x the one autopar planned: remove it, and pass "
            "AutoparStrategy(global_batch_size=N, train_step=True) (or a Plan with grad_accum) so that autopar "
            "splits the batch into micro-batches itself.")
    precision = str(trainer.precision)
    if precision not in PRECISIONS:
        raise PlanError(
            f"Trainer(precision={precision!r}): autopar plans fp32 or bf16 with fp32 master weights, which are "
            f"Trainer(precision='32-true') and Trainer(precision='bf16-mixed'); use one of those.")


def check_precision(trainer: pl.Trainer, plan: Plan) -> None:
    """Refuse a Trainer precision other than the plan's (Lightning's autocast would run over autopar's)."""
    precision = str(trainer.precision)
    if PRECISIONS.get(precision) != plan.precision:
        want = next(k for k, v in PRECISIONS.items() if v == plan.precision)
        raise PlanError(
            f"Trainer(precision={precision!r}) disagrees with the plan's precision={plan.precision!r}: "
            f"use Trainer(precision={want!r}), or give a plan with precision={PRECISIONS[precision]!r} "
            "(AutoparStrategy(plan=...)).")


def check_batch(batch: Any, plan: Plan) -> None:
    """Refuse a training batch of another size than the plan's local batch (the plan would be stale)."""
    size = sample_batch_size(batch)
    if size != plan.local_batch_size:
        raise PlanError(
            f"this rank's training batch has {size} samples, but the plan was made for {plan.local_batch_size} "
            f"(micro-batch {plan.micro_batch_size} x accumulation {plan.grad_accum}): set the DataLoader's "
            f"batch_size={plan.local_batch_size} and drop_last=True, or plan for the batch you feed "
            "(AutoparStrategy(global_batch_size=...)).")


def _check_schedulers(trainer: pl.Trainer) -> None:
    for config in trainer.lr_scheduler_configs:
        if config.interval != "step" or config.reduce_on_plateau:
            raise PlanError(
                f"under a plan run by autopar.train_step the strategy steps the learning-rate schedulers itself, "
                f"every `frequency` optimizer steps; {type(config.scheduler).__name__} has interval="
                f"{config.interval!r}{' (ReduceLROnPlateau)' if config.reduce_on_plateau else ''}: return it from "
                "configure_optimizers with interval='step'.")


def _output_loss(output: Any, batch: Any) -> torch.Tensor:
    """The loss when AutoparStrategy has no loss_fn: the output's `.loss` (Hugging Face models given labels)."""
    loss = getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise PlanError(
            f"this plan runs through autopar.train_step, which needs the loss of each micro-batch, and the model's "
            f"output ({type(output).__name__}) has no .loss: pass AutoparStrategy(loss_fn=fn), fn(output, batch) "
            "returning the batch's mean loss.")
    return loss


# ---------------------------------------------------------------------------------------------------------------
# The step of a plan that autopar.train_step runs (manual optimization)
# ---------------------------------------------------------------------------------------------------------------
class TrainStepRunner:
    """One training batch = one optimizer step, through autopar.train_step; steps the schedulers; logs the loss.

    Without a pipeline or a `loss_fn`, each micro-batch's loss is the module's own `training_step` (its loss, as
    under Lightning's `accumulate_grad_batches`: the step's gradient is the mean of the micro-batches'); with a
    `loss_fn`, or under a pipeline (whose stages call the forward), it is `loss_fn(forward(micro_batch), micro_batch)`
    (else the output's `.loss`)."""

    def __init__(self, trainer: pl.Trainer, module: pl.LightningModule, loss_fn: Callable | None, *,
                 manual: bool) -> None:
        optimizers = trainer.strategy._lightning_optimizers  # LightningOptimizer: its steps count as global steps
        if manual:
            raise PlanError(
                f"{type(module).__name__} optimizes manually (automatic_optimization=False), so its training_step "
                "steps the optimizer itself, but a plan that splits the step (grad_accum > 1, pp > 1, or "
                "train_step=True) is run by autopar.train_step, which owns the step: give a plan with grad_accum=1 "
                "and pp=1 (AutoparStrategy(plan=...)), or let Lightning optimize automatically.")
        if len(optimizers) != 1:
            raise PlanError(f"a plan run by autopar.train_step takes one optimizer; configure_optimizers returned "
                            f"{len(optimizers)}: return one.")
        _check_schedulers(trainer)
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm != "norm":
            raise PlanError("under a plan run by autopar.train_step gradients are clipped by their norm over all "
                            "ranks: use Trainer(gradient_clip_algorithm='norm'), or no gradient_clip_val.")
        self.trainer, self.module = trainer, module
        self.schedulers = list(trainer.lr_scheduler_configs)
        self.steps = 0
        self.forward_loss = loss_fn is not None or applied(module).plan.pp > 1
        self._extra: tuple[tuple, dict] = ((), {})  # training_step's arguments after the batch (batch_idx, ...)
        if self.forward_loss:
            self.step = autopar_train_step(module, optimizers[0], loss_fn if loss_fn is not None else _output_loss,
                                           max_grad_norm=trainer.gradient_clip_val or None)
        else:
            self.step = autopar_train_step(module, optimizers[0], compute_loss=self._training_step_loss,
                                           max_grad_norm=trainer.gradient_clip_val or None)

    def _training_step_loss(self, micro_batch: Any) -> torch.Tensor:
        args, kwargs = self._extra
        output = self.module.training_step(micro_batch, *args, **kwargs)
        loss = output.get("loss") if isinstance(output, dict) else output
        if not isinstance(loss, torch.Tensor):
            raise PlanError(
                f"{type(self.module).__name__}.training_step returned {type(output).__name__}, not a loss: under a "
                "plan run by autopar.train_step each micro-batch's training_step must return its loss (a tensor, or "
                "a dict with 'loss'); skipping a batch (returning None) is not supported there.")
        return loss

    def __call__(self, batch: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.steps == 0 and self.forward_loss:  # the batch is what the forward takes: say so before a TypeError
            check_sample_fits(self.module, batch, what="this training batch (a pipeline plan, or a loss_fn given, "
                              "calls forward with each micro-batch as model(x), model(*batch) or model(**batch), and "
                              "its loss is loss_fn(output, batch))",
                              remedy="make forward take the whole batch (e.g. forward(self, x, y=None)), or, with "
                                     "pp=1, pass no loss_fn: training_step is then each micro-batch's loss.")
        self._extra = (args, kwargs)
        loss = self.step(batch)
        self.steps += 1
        for config in self.schedulers:
            if self.steps % config.frequency == 0:
                config.scheduler.step()
        if self.forward_loss:  # (training_step logs what it logs)
            self.module.log(LOSS_NAME, loss, prog_bar=True, batch_size=sample_batch_size(batch))
        return loss


# ---------------------------------------------------------------------------------------------------------------
# The measurement callback
# ---------------------------------------------------------------------------------------------------------------
class MeasureCallback(Callback):
    """Times the run's optimizer steps (one per training batch) and logs them beside the plan's prediction:
    `autopar/*` metrics to the Trainer's loggers, one line on rank 0, and the feedback (integrations/_measure.py)."""

    def __init__(self, strategy: "AutoparStrategy", options: MeasureOptions) -> None:
        self.strategy, self.options = strategy, options
        self.timer = StepTimer(options)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.timer = StepTimer(self.options)
        self.timer.start()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step_s = self.timer.step_done()
        if step_s is None:
            return
        state = applied(pl_module)
        comparison = Comparison(measure(state, step_s, steps=self.options.steps),
                                predicted(state, variants=self.strategy.variants))
        self.strategy.measurement = comparison
        pl_module.log_dict(comparison.metrics(), on_step=True, on_epoch=False, rank_zero_only=True,
                           batch_size=state.plan.local_batch_size)
        if trainer.global_rank != 0:
            return
        get_logger().info("%s", comparison.describe())
        if self.options.feed_back:
            self.strategy.feedback = _feed_back(state, comparison, self.strategy.variants)


def _feed_back(state: Applied, comparison: Comparison, variants: dict[str, Any]) -> FeedBack | None:
    """feed_back, or a logged warning when the cache cannot be written (the run goes on)."""
    try:
        result = feed_back(state, comparison.measured, variants=variants)
    except (OSError, AutoparError) as exc:
        get_logger().warning("the measurement was not fed back to the cost model: %s", exc)
        return None
    get_logger().info("%s", result.describe())
    return result


# ---------------------------------------------------------------------------------------------------------------
# The strategy
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Options:
    """What AutoparStrategy was given (checked once, at construction)."""

    sample: Any
    plan: Plan | str | None
    global_batch_size: int | None
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    topology: Topology | str | None
    blocks: Any
    init_fn: Callable[[nn.Module], None] | None
    train_step: bool
    verbose: bool
    measure: MeasureOptions | None

    def __post_init__(self) -> None:
        if not isinstance(self.train_step, bool):
            raise AutoparError(f"AutoparStrategy(train_step=) must be True or False, got {self.train_step!r}.")
        if self.measure is not None and not isinstance(self.measure, MeasureOptions):
            raise AutoparError("AutoparStrategy(measure=) takes an autopar.integrations.lightning.MeasureOptions "
                               f"or None, got {type(self.measure).__name__}.")
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise AutoparError(f"AutoparStrategy(loss_fn=) must be callable, got {type(self.loss_fn).__name__}.")


class AutoparStrategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy with autopar's plan (the module docstring). Keyword-only:

    - `sample`: one rank's batch as the LightningModule's forward takes it (default: the module's
      `example_input_array`, else the first batch of the training dataloader).
    - `plan`: an autopar.Plan or a plan YAML path; default: autopar's choice (a plan `autopar tune` cached for
      this model, hardware and batch first, else the cost model's).
    - `global_batch_size`: samples per optimizer step over all ranks (wrap's default: the sample's batch x the
      data-parallel ranks).
    - `loss_fn(output, batch)`: profiles the step, and is the loss of plans run by autopar.train_step.
    - `train_step`: run every plan through autopar.train_step (manual optimization), so that autopar may choose
      accumulation, pipelines and tensor parallelism; plans that split the step always run that way.
    - `measure`: MeasureOptions (the default) to time the run and feed it back; None: no measurement.
    - `topology`, `blocks`, `init_fn`, `verbose`: as autopar.wrap's (`init_fn` initialises a meta-device module).
    """

    strategy_name = "autopar"

    def __init__(self, *, sample: Any = None, plan: Plan | str | None = None, global_batch_size: int | None = None,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, topology: Topology | str | None = None,
                 blocks: Any = None, init_fn: Callable[[nn.Module], None] | None = None, train_step: bool = False,
                 verbose: bool = True,
                 measure: MeasureOptions | None = MeasureOptions(), save_distributed_checkpoint: bool = True,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout) -> None:
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.options = _Options(sample=sample, plan=plan, global_batch_size=global_batch_size, loss_fn=loss_fn,
                                topology=topology, blocks=blocks, init_fn=init_fn, train_step=train_step,
                                verbose=verbose,
                                measure=measure)
        self.runner: TrainStepRunner | None = None
        self.variants: dict[str, Any] = {}  # the bf16 traces, for predicting a given plan and for the refit
        self.measurement: Comparison | None = None  # the run's measured steps beside the prediction
        self.feedback: FeedBack | None = None  # what the measurement changed (rank 0)

    # ---- the mesh and the data ----------------------------------------------------------------------------
    @property
    def device_mesh(self) -> Any:
        """The plan's mesh (axes pp, dp_replicate, dp_shard, tp), or None for a one-process plan."""
        return applied(self.lightning_module).mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """autopar's data shard: ranks of one tensor-parallel group or pipeline read the same samples."""
        shard = data_shard(self.lightning_module)
        return {"num_replicas": shard.size, "rank": shard.rank}

    @property
    def runs_train_step(self) -> bool:
        """Whether the plan runs through autopar.train_step (manual optimization)."""
        return self.options.train_step or applied(self.lightning_module).plan.needs_train_step

    # ---- the hooks --------------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        """The process group (the plan builds the mesh, in setup); refuse what would contradict any plan."""
        check_trainer(self.lightning_module.trainer)
        self._setup_distributed()

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if not is_wrapped(module):  # fit, then validate or test: wrapped once
            self._apply(trainer, module)
        state = applied(module)
        check_precision(trainer, state.plan)
        module._device_mesh = state.mesh
        self.barrier()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)  # after wrap: over the sharded parameters
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            self.runner = None
            if self.runs_train_step:
                manual = not _USERS_AUTOMATIC.setdefault(module, module.automatic_optimization)
                module.automatic_optimization = False
                self.runner = TrainStepRunner(trainer, module, self.options.loss_fn, manual=manual)
            if self.options.measure is not None and not any(isinstance(c, MeasureCallback) for c in trainer.callbacks):
                trainer.callbacks.append(MeasureCallback(self, self.options.measure))

    def _apply(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        opts = self.options
        sample = self._sample(trainer, module)
        if opts.measure is not None and world().rank == 0:
            topo = resolve_topology(opts.topology)
            if topo.is_gpu:  # the bf16 traces of the model, before it is wrapped (empty where there is no bf16)
                self.variants = bf16_variants(module, sample, topo, loss_fn=opts.loss_fn, blocks=opts.blocks)
        _wrap(module, sample=sample, plan=opts.plan, global_batch_size=opts.global_batch_size, loss_fn=opts.loss_fn,
              topology=opts.topology, blocks=opts.blocks, init_fn=opts.init_fn, verbose=opts.verbose,
              train_step=opts.train_step)

    def _sample(self, trainer: pl.Trainer, module: pl.LightningModule) -> Any:
        """The sample wrap profiles: given, else example_input_array, else the first training batch."""
        if self.options.sample is not None:
            return self.options.sample
        if getattr(module, "example_input_array", None) is not None:
            return module.example_input_array
        source = trainer.fit_loop._data_source
        if trainer.state.fn != TrainerFn.FITTING or not source.is_defined():
            raise PlanError("autopar needs one batch of the model's input to plan: pass AutoparStrategy(sample=batch), "
                            "or set the LightningModule's example_input_array.")
        try:
            batch = next(iter(source.dataloader()))
        except StopIteration:
            raise PlanError("the training dataloader is empty, so autopar has no batch to plan with: pass "
                            "AutoparStrategy(sample=batch).") from None
        check_sample_fits(module, batch, what="the first training batch (taken as the forward's input: no "
                          "AutoparStrategy(sample=...), no example_input_array)",
                          remedy="pass AutoparStrategy(sample=...) as forward is called (sample=(batch,) for a "
                                 "forward(self, batch) that takes a dict whole), or set example_input_array.")
        return batch

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        check_batch(batch, applied(self.lightning_module).plan)
        if self.runner is None:
            return super().training_step(*args, **kwargs)
        return self.runner(batch, *args[1:], **{k: v for k, v in kwargs.items() if k != "batch"})

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        register(strategy_registry)


def register(registry: Any = StrategyRegistry) -> None:
    """Register "autopar" (AutoparStrategy with its defaults) in Lightning's StrategyRegistry, once."""
    if AutoparStrategy.strategy_name not in registry:
        registry.register(AutoparStrategy.strategy_name, AutoparStrategy,
                          description="autopar: plans and applies FSDP2 / TP / PP / checkpointing / precision")


register()
