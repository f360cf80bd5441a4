"""The Hugging Face Trainer on a model autopar planned and sharded.

    model, args = autopar.integrations.hf.prepare(model, args, sample=batch)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[AutoparCallback()])

`prepare` chooses a plan the Trainer can run (or takes the one given), applies it with `autopar.wrap`
(`loop="accumulates"`: the Trainer accumulates gradients itself and runs no pipeline), marks the model the
way transformers marks a model it sharded at load time (`from_pretrained(distributed_config=...)`) so the
Trainer neither wraps it in DDP nor shards it again, and returns a copy of the TrainingArguments set to
match the plan. What it sets, and why, is in `trainer_settings`; docs/integrations/hf.md says it for users.

The markers are transformers' own (transformers 5.x, `distributed/mixin.py`):
- `model._is_distributed_loading_by_transformers = True`: the Trainer skips `accelerate`'s DDP wrap and
  device placement, and defers FSDP2's gradient reduction to the last micro-batch itself;
- `model._tp_size`, `model._fsdp_size`: the Trainer divides the world by the tensor-parallel degree for the
  data-parallel one (batch size, token counts) and hands `accelerate` the degrees, whose data loader then
  gives the ranks of a tensor-parallel group the same batches;
- `model.config.distributed_config`: the degrees, read when accumulating (HSDP's replicas).

The Trainer shards batches over data-parallel ranks as `accelerate` does: rank r takes batches r, r + N, ...
of the one-process loader at the per-device batch size (same sampler, same seed), so the N ranks' global
batches, in order, are those one process sees at the global batch size (docs/integrations/hf.md).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Callable

import torch
import torch.nn as nn
import transformers  # this module is the Hugging Face integration: `pip install -e ".[hf]"` in the clone
from transformers.distributed import DistributedConfig

from .._util import dist as _dist
from .._util.log import get_logger
from ..api import wrap
from ..errors import PlanError
from ..plans import Loop, Plan
from ..strategies.state import plan_of
from ..topology import Topology
from .hf_callback import AutoparCallback, StepMeasurement

__all__ = ["AutoparCallback", "StepMeasurement", "TrainerSettings", "mark_for_trainer", "prepare",
           "trainer_refusal", "trainer_settings"]

#: The loop the Trainer is to autopar: it accumulates gradients itself and calls model(**batch).
LOOP = Loop.ACCUMULATES


@dataclasses.dataclass(frozen=True)
class TrainerSettings:
    """The TrainingArguments fields `prepare` sets to match a plan; every other field stays the user's."""

    per_device_train_batch_size: int  # the plan's micro-batch
    gradient_accumulation_steps: int  # the plan's accumulation
    bf16: bool = False  # autopar applies the plan's precision (autocast, or FSDP2's mixed precision)
    fp16: bool = False
    activation_checkpointing: bool = False  # autopar checkpoints the blocks the plan says (gradient_checkpointing follows)
    torch_compile: bool = False  # autopar compiles what the plan says
    save_only_model: bool = True  # the Trainer saves the weights; AutoparCallback the whole training state

    def __post_init__(self) -> None:
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"TrainerSettings.{name} must be a positive integer, got {value!r}.")

    def changes(self, args: Any) -> dict[str, Any]:
        """The fields of `args` these settings change, with their new values (under the name this transformers
        gives a field: `gradient_checkpointing` before `activation_checkpointing` replaced it)."""
        out = {}
        for name, value in dataclasses.asdict(self).items():
            field = name if hasattr(args, name) else _OLDER_NAMES.get(name, name)
            if getattr(args, field) != value:
                out[field] = value
        return out


#: TrainingArguments fields under their names in transformers before 5.24 (5.17 has no activation_checkpointing).
_OLDER_NAMES = {"activation_checkpointing": "gradient_checkpointing"}


def trainer_settings(plan: Plan) -> TrainerSettings:
    """What the Trainer must be told to run `plan`."""
    return TrainerSettings(per_device_train_batch_size=plan.micro_batch_size,
                           gradient_accumulation_steps=plan.grad_accum)


def trainer_refusal(plan: Plan, *, device_type: str) -> str | None:
    """Why the Trainer cannot run `plan` here (one line that says what to change), or None.

    A pipeline: the Trainer calls the model's forward, which a pipeline-parallel model refuses. Tensor
    parallelism on CPU: `accelerate` refuses it there, and without it the Trainer would give the ranks of a
    tensor-parallel group different batches, training wrong."""
    why = LOOP.refusal(plan)
    if why is not None:
        return "the Hugging Face Trainer cannot run this plan: " + why
    if plan.tp > 1 and device_type != "cuda":
        return (f"the Hugging Face Trainer runs tensor parallelism (tp={plan.tp}) only on GPUs (accelerate refuses it "
                "on CPU, and without it the ranks of a tensor-parallel group would read different batches): give a "
                "plan with tp=1 here, such as FSDP over every process.")
    return None


def _check_args(args: Any, model: nn.Module) -> None:
    """Refuse, before the model is touched, arguments and models the prepared Trainer cannot honour."""
    if not isinstance(args, transformers.TrainingArguments):
        raise PlanError(f"prepare takes the Trainer's transformers.TrainingArguments, got {type(args).__name__}.")
    inner = getattr(getattr(model, "base_model", None), "model", None)
    if type(model).__module__.split(".")[0] == "peft" and isinstance(inner, transformers.PreTrainedModel):
        raise PlanError(f"prepare takes the transformers model inside a PEFT model, not the {type(model).__name__}: "
                        "prepare(peft_model.base_model.model, args, sample=...) and give the Trainer the model it "
                        "returns; peft_model.save_pretrained(...) still saves the adapter (the same modules).")
    if not isinstance(model, transformers.PreTrainedModel):
        raise PlanError(f"prepare takes a transformers PreTrainedModel (the Trainer reads its config), got "
                        f"{type(model).__name__}: wrap other modules with autopar.wrap and your own loop.")
    if args.fp16:
        raise PlanError("autopar trains in fp32 or bf16, not fp16: drop fp16=True (autopar chooses bf16 where the GPUs "
                        "have it).")
    if args.fsdp or args.deepspeed or args.parallelism_config is not None:
        raise PlanError("autopar shards the model itself: drop the Trainer's fsdp, deepspeed and parallelism_config "
                        "arguments.")
    if args.n_gpu > 1:
        raise PlanError(f"the Trainer sees {args.n_gpu} GPUs in one process and would wrap the model in DataParallel: "
                        "launch one process per GPU with torchrun, or make one GPU visible (CUDA_VISIBLE_DEVICES).")
    if _dist.world().size > 1 and not TRAINER_TAKES_SHARDED_MODELS:
        raise PlanError(f"transformers {transformers.__version__}'s Trainer would wrap the sharded model in DDP in a run "
                        "of several processes: pip install 'transformers>=5.24' (or run one process).")


#: Whether this transformers' Trainer takes a model sharded before it (the markers below, with the data-parallel
#: degrees in DistributedConfig): from transformers 5.24. An older Trainer (5.17) reads only `_tp_size` and wraps a
#: sharded model in DDP in a run of several processes; one process trains as it is.
TRAINER_TAKES_SHARDED_MODELS = "dp_replicate_size" in {f.name for f in dataclasses.fields(DistributedConfig)}


def mark_for_trainer(model: nn.Module, plan: Plan) -> None:
    """Mark `model`, which autopar sharded under `plan`, as transformers marks a model it sharded at load time,
    with the plan's degrees (the module docstring says what the Trainer reads)."""
    object.__setattr__(model, "_is_distributed_loading_by_transformers", True)
    object.__setattr__(model, "_tp_size", plan.tp)
    object.__setattr__(model, "_fsdp_size", plan.dp_shard)
    degrees = {"dp_replicate_size": plan.dp_replicate} if TRAINER_TAKES_SHARDED_MODELS else {}
    model.config.distributed_config = DistributedConfig(tp_size=plan.tp, fsdp_size=plan.dp_shard, **degrees)


def _global_batch(args: Any, global_batch_size: int | None) -> int:
    """The global batch the arguments ask the Trainer for: per-device batch x accumulation x processes."""
    if global_batch_size is not None:
        return global_batch_size
    return args.per_device_train_batch_size * args.gradient_accumulation_steps * _dist.world().size


def prepare(
    model: nn.Module,
    args: Any,
    *,
    sample: Any,
    plan: Plan | str | os.PathLike[str] | None = None,
    topology: Topology | str | None = None,
    global_batch_size: int | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    blocks: Any = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    verbose: bool = True,
) -> tuple[nn.Module, Any]:
    """Plan and shard `model` for the Hugging Face Trainer; returns `(model, args)`: the same model, marked for
    the Trainer, and a copy of `args` (TrainingArguments) set to match the plan (`TrainerSettings`).

    - `sample`: one batch as the Trainer feeds the model (a dict with `input_ids` and `labels`; meta is fine).
    - `plan`: a Plan or plan file; a pipeline, or tensor parallelism on CPU, is refused (`trainer_refusal`).
      Without one, autopar takes the plan `autopar tune` cached for this job, else the cost model's choice
      among plans the Trainer runs (`loop="accumulates"`: accumulation and tensor parallelism, no pipeline).
    - `global_batch_size`: default, what `args` asks for: per-device batch x accumulation x processes.
    - `topology`, `loss_fn`, `blocks`, `init_fn`, `verbose`: as for `autopar.wrap`.
    """
    _check_args(args, model)
    global_batch = _global_batch(args, global_batch_size)
    device_type = _dist.device_type()
    if isinstance(plan, (str, os.PathLike)):  # read here, so that it is refused before the model is touched
        plan = Plan.load(plan)
    if plan is not None:
        _refuse(plan, device_type)
    wrap(model, sample=sample, plan=plan, topology=topology, global_batch_size=global_batch, loss_fn=loss_fn,
         blocks=blocks, init_fn=init_fn, verbose=verbose, loop=LOOP)
    chosen = plan_of(model)
    _refuse(chosen, device_type)  # a chosen plan the Trainer cannot run here: said before training starts
    mark_for_trainer(model, chosen)
    if args.bf16 and chosen.precision != "bf16" and _dist.world().rank == 0:
        warnings.warn(f"autopar: the arguments ask for bf16, but the plan trains in {chosen.precision} (autopar chooses "
                      "bf16 only on GPUs that have it); pass plan= with precision='bf16' to train in bf16 anyway.",
                      stacklevel=2)
    settings = trainer_settings(chosen)
    changes = settings.changes(args)
    if verbose and _dist.world().rank == 0 and changes:
        get_logger().info("the Trainer's arguments set to match the plan: %s",
                          ", ".join(f"{k}={v!r} (was {getattr(args, k)!r})" for k, v in changes.items()))
    return model, dataclasses.replace(args, **changes)


def _refuse(plan: Plan, device_type: str) -> None:
    why = trainer_refusal(plan, device_type=device_type)
    if why is not None:
        raise PlanError(why)
