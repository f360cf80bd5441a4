"""The Plan: everything a run needs to reproduce a parallelism strategy, as one frozen value.

A Plan is validated when it is built: a Plan object that exists is consistent in itself. Whether it fits
a given world (number of processes), global batch or model is checked against those by `check_world`,
`check_batch` and `check_model`, each raising a `PlanError` that says what to change.

Derived, never stored: the world size (the product of the mesh degrees) and the global batch
(micro-batch x accumulation x data-parallel degree).

Files are YAML, read with `yaml.safe_load` only: a plan file can hold plain values and nothing else. Every
field's type is checked when a plan is built, so when a file is read, on every rank (the numbers of `prediction`
and `measurement` by name: seconds and bytes finite); a plan that compiles checks its backend
(AUTOPAR_COMPILE_BACKEND, else inductor) against torch.compile's registered ones then, not at the first forward.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from ._util.compile_backend import configured_compile_backend
from ._util.io import atomic_write_text
from ._util.yaml_text import MAX_YAML_CHARS, load_yaml
from .errors import PlanError, PlanMismatchError

SCHEMA_VERSION = 1

#: mesh axes, outermost first: pipeline stages, replicated data-parallel groups, sharded data-parallel
#: ranks, tensor-parallel ranks (innermost, so that a TP group sits on neighbouring GPUs of one node).
MESH_AXES = ("pp", "dp_replicate", "dp_shard", "tp")
#: options added after plans were first written: left out of a plan's key and file when off (older ones keep theirs)
_LEFT_OUT_WHEN_OFF = ("float8", "cuda_graphs", "max_autotune")
CHECKPOINTING = ("none", "selective", "alternate", "gemms", "full")  # by what they recompute (search's order)
PRECISIONS = ("fp32", "bf16")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
ZERO_STAGES = (1, 2, 3)
FLOAT8_RECIPES = ("tensorwise", "rowwise")  # torchao's float8 training recipes a plan can name (Plan.float8_recipe)

#: The numbers a prediction (autopar.cost.Prediction.summary) or a measurement records, by what they measure:
#: seconds and bytes are finite and not negative; rates and fractions are numbers, not negative (NaN: unknown).
#: Other names keep plain values (numbers, strings, true/false, null, mappings of those).
_FINITE_NUMBERS = {"memory_bytes": "bytes", "allocated_bytes": "bytes", "step_s": "seconds"}
_NUMBERS = {"samples_per_s": "samples per second", "tokens_per_s": "tokens per second",
            "throughput": "samples or tokens per second", "mfu": "a fraction", "steps": "a count"}
_MAX_RECORD_DEPTH = 8  # nested mappings in a prediction or measurement

# Fields that say what the strategy is; provenance (fingerprints, prediction, measurement) is not part of it.
_STRATEGY_FIELDS = (
    "pp", "dp_replicate", "dp_shard", "tp", "micro_batch_size", "grad_accum", "pp_schedule",
    "pp_stages_per_rank", "reshard_after_forward", "cpu_offload", "sequence_parallel", "checkpointing",
    "checkpoint_every", "precision", "compile",
)


class Loop(str, enum.Enum):
    """What drives each training step after `wrap`, and so which plans can run (`wrap(..., loop=...)`).

    - `PLAIN`: `loss = loss_fn(model(x), x); loss.backward(); opt.step()`, every process reading its own
      batch. One forward per step: no accumulation, no pipeline. The search keeps to pure data parallelism
      (tensor-parallel peers would read different samples); a tensor-parallel plan you give runs if your loop
      feeds the peers of a group the same samples (`autopar.data_shard`).
    - `ACCUMULATES`: a framework that accumulates gradients itself and is told the plan's degrees, so that it
      gives the ranks of a tensor-parallel group the same samples (Hugging Face Trainer, Lightning):
      accumulation and tensor parallelism, no pipeline (its loop calls `model(x)`, which a pipeline refuses).
    - `TRAIN_STEP`: `autopar.train_step` with `autopar.dataloader`: every plan.
    """

    PLAIN = "plain"
    ACCUMULATES = "accumulates"
    TRAIN_STEP = "train_step"

    @classmethod
    def parse(cls, value: "Loop | str") -> "Loop":
        """`value` as a Loop; anything else is refused, naming the values."""
        try:
            return cls(value)
        except ValueError:
            raise PlanError(f"loop must be one of {', '.join(repr(m.value) for m in cls)}, got {value!r}.") from None

    @classmethod
    def resolve(cls, loop: "Loop | str | None", uses_train_step: bool | None) -> "Loop | None":
        """The loop of `loop=` and the deprecated `uses_train_step=` (True: TRAIN_STEP; False: as if left out);
        None when neither says. Both given is refused."""
        if uses_train_step is not None:
            if loop is not None:
                raise PlanError("pass loop= only: uses_train_step= is its deprecated spelling "
                                "(uses_train_step=True is loop='train_step').")
            warnings.warn("autopar: uses_train_step= is deprecated; pass loop='train_step' (True) or leave it out "
                          "(False, a plain loop).", DeprecationWarning, stacklevel=3)
            return cls.TRAIN_STEP if uses_train_step else None
        return None if loop is None else cls.parse(loop)

    @property
    def accumulates(self) -> bool:
        """Whether the loop runs several micro-batches per optimizer step (grad_accum > 1)."""
        return self is not Loop.PLAIN

    @property
    def pipelines(self) -> bool:
        """Whether the loop runs a pipeline schedule (pp > 1): only autopar.train_step does."""
        return self is Loop.TRAIN_STEP

    @property
    def shares_data(self) -> bool:
        """Whether the loop gives the ranks of a tensor-parallel group the same samples, so that the search may
        choose tensor parallelism."""
        return self is not Loop.PLAIN

    def refusal(self, plan: "Plan") -> str | None:
        """Why this loop cannot run `plan` (one line saying what to change), or None."""
        if plan.pp > 1 and not self.pipelines:
            return (f"a pipeline plan (pp={plan.pp}) runs only under autopar.train_step, not under loop={self.value!r}: "
                    "give a plan with pp=1, or drive the step with autopar.train_step (loop='train_step').")
        if plan.zero_stage < 3 and not self.pipelines:
            return (f"zero_stage={plan.zero_stage} is run across micro-batches by autopar.train_step, not under "
                    f"loop={self.value!r}: give a plan with zero_stage=3, or drive the step with autopar.train_step "
                    "(loop='train_step').")
        if plan.grad_accum > 1 and not self.accumulates:
            return (f"a plan with gradient accumulation (grad_accum={plan.grad_accum}) needs a loop that accumulates, "
                    "not loop='plain': give a plan with grad_accum=1, or use loop='accumulates' (a framework that "
                    "accumulates) or loop='train_step'.")
        return None

    def check(self, plan: "Plan") -> None:
        """Raise PlanError when this loop cannot run `plan`."""
        why = self.refusal(plan)
        if why is not None:
            raise PlanError(why)


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"Plan.{name} must be a positive integer, got {value!r}.")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise PlanError(f"Plan.{name} must be true or false, got {value!r}.")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise PlanError(f"Plan.{name} must be one of {', '.join(map(repr, choices))}, got {value!r}.")


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _plain_mapping(name: str, value: Any, depth: int = 0) -> dict[str, Any] | None:
    """A copy of `value` holding only str keys and numbers, strings, bools or None (YAML-safe, comparable); the
    numbers of _FINITE_NUMBERS and _NUMBERS checked by name. Refused: one line naming the field, its value and
    what it must be."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise PlanError(f"Plan.{name} must be a mapping of names to numbers, got {value!r} "
                        f"({type(value).__name__}).")
    if depth >= _MAX_RECORD_DEPTH:
        raise PlanError(f"Plan.{name} nests more than {_MAX_RECORD_DEPTH} mappings deep: a prediction or "
                        "measurement maps names to numbers.")
    out: dict[str, Any] = {}
    for k, v in value.items():
        if not isinstance(k, str):
            raise PlanError(f"Plan.{name} keys must be strings, got {k!r} ({type(k).__name__}).")
        field_name = f"{name}.{k}"
        if k in _FINITE_NUMBERS:
            if not _is_number(v) or not math.isfinite(v) or v < 0:
                raise PlanError(f"Plan.{field_name} must be a finite number of {_FINITE_NUMBERS[k]}, not negative, "
                                f"got {v!r} ({type(v).__name__}).")
        elif k in _NUMBERS:
            if not _is_number(v) or v < 0:
                raise PlanError(f"Plan.{field_name} must be a number ({_NUMBERS[k]}), not negative, got {v!r} "
                                f"({type(v).__name__}).")
        if isinstance(v, Mapping):
            out[k] = _plain_mapping(field_name, v, depth + 1)
        elif v is None or isinstance(v, (bool, int, float, str)):
            out[k] = float(v) if isinstance(v, float) else v
        else:
            raise PlanError(f"Plan.{field_name} must be a number, string or bool (or null), got {v!r} "
                            f"({type(v).__name__}).")
    return out


@dataclass(frozen=True)
class Plan:
    """One parallelism strategy. All options are keyword arguments; defaults describe one plain process.

    Mesh degrees (their product is the world size):
      pp            pipeline stages
      dp_replicate  data-parallel replicas (HSDP's replicate axis; plain DDP when dp_shard is 1)
      dp_shard      FSDP2 shard degree
      tp            tensor-parallel degree
    Batch (micro_batch_size x grad_accum x dp_replicate x dp_shard is the global batch):
      micro_batch_size  samples per forward on one data-parallel rank
      grad_accum        micro-batches per optimizer step (with pp > 1: the pipeline's micro-batches)
    Sharded data parallelism across the micro-batches of a step (dp_shard > 1, grad_accum > 1; ZeRO's stages,
    Rajbhandari et al. 2020, as FSDP2 runs them):
      zero_stage    3: parameters gathered and gradients reduce-scattered for every micro-batch (FSDP);
                    2: parameters gathered once a step and kept whole across its micro-batches, gradients
                       reduce-scattered every micro-batch (needs reshard_after_forward=False);
                    1: as 2, and gradients accumulated whole, reduce-scattered once after the last micro-batch
    Precision:
      precision     "fp32", or "bf16" (autocast; FSDP2's mixed precision where it shards)
      float8        with bf16: the large linear layers of the blocks train in float8 (torchao's Float8Linear,
                    dynamic scaling; autopar.layout.float8_converts says which); needs torchao and a GPU with
                    float8 tensor cores (compute capability 8.9 or newer)
      float8_recipe "tensorwise" (a scale a tensor; FSDP gathers in float8) or "rowwise" (a scale a row or
                    column: closer to bf16, more casts); with float8=True only
    Compile:
      compile       torch.compile (the whole model's forward in one process, each block under FSDP or a pipeline)
      cuda_graphs   with compile, in one process on a GPU: the compiled graphs replayed as CUDA graphs
                    (torch.compile's "reduce-overhead" mode, inductor only): the host launches a step's kernels
                    once a graph instead of once a kernel (a host-bound step: small kernels, a fast GPU)
      max_autotune  with compile: inductor's max-autotune (each GEMM's and convolution's kernel chosen by timing
                    candidates as it compiles, coordinate-descent tuning of the others): minutes more compile;
                    not priced by the cost model, so only the tuner's trials (autotune(max_autotune=True)) try it
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    micro_batch_size: int = 1
    grad_accum: int = 1
    pp_schedule: str | None = None
    pp_stages_per_rank: int = 1
    reshard_after_forward: bool = True
    zero_stage: int = 3
    cpu_offload: bool = False
    sequence_parallel: bool = False
    checkpointing: str = "none"
    checkpoint_every: int = 1
    precision: str = "fp32"
    compile: bool = False
    float8: bool = False
    float8_recipe: str = "tensorwise"
    cuda_graphs: bool = False
    max_autotune: bool = False
    model_fingerprint: str | None = None
    topology_fingerprint: str | None = None
    prediction: Mapping[str, Any] | None = field(default=None, compare=False)
    measurement: Mapping[str, Any] | None = field(default=None, compare=False)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        for name in ("pp", "dp_replicate", "dp_shard", "tp", "micro_batch_size", "grad_accum",
                     "pp_stages_per_rank", "checkpoint_every", "schema_version"):
            _check_positive_int(name, getattr(self, name))
        if self.schema_version != SCHEMA_VERSION:
            raise PlanError(
                f"this plan has schema version {self.schema_version}; this autopar reads version "
                f"{SCHEMA_VERSION}. Make the plan again with this autopar (autopar.plan)."
            )
        for name in ("reshard_after_forward", "cpu_offload", "sequence_parallel", "compile", "float8", "cuda_graphs",
                     "max_autotune"):
            _check_bool(name, getattr(self, name))
        _check_choice("checkpointing", self.checkpointing, CHECKPOINTING)
        _check_choice("precision", self.precision, PRECISIONS)
        for name in ("model_fingerprint", "topology_fingerprint"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise PlanError(f"Plan.{name} must be a string or None, got {value!r}.")
        object.__setattr__(self, "prediction", _plain_mapping("prediction", self.prediction))
        object.__setattr__(self, "measurement", _plain_mapping("measurement", self.measurement))
        if self.compile:  # the backend it will compile with, checked now rather than at the first forward
            configured_compile_backend()

        # Options that do not combine.
        if self.pp > 1:
            if self.pp_schedule is None:
                raise PlanError(
                    f"pp={self.pp} needs a pipeline schedule: set pp_schedule to one of {', '.join(PP_SCHEDULES)}."
                )
            _check_choice("pp_schedule", self.pp_schedule, PP_SCHEDULES)
        elif self.pp_schedule is not None:
            raise PlanError(f"pp_schedule={self.pp_schedule!r} only applies with pp > 1; drop it or raise pp.")
        if self.pp_stages_per_rank > 1 and self.pp_schedule not in ("interleaved_1f1b", "zero_bubble"):
            raise PlanError(
                f"pp_stages_per_rank={self.pp_stages_per_rank} needs a multi-stage schedule "
                "('interleaved_1f1b' or 'zero_bubble'); set pp_stages_per_rank=1 or change pp_schedule."
            )
        if self.sequence_parallel and self.tp == 1:
            raise PlanError("sequence_parallel shards activations over the TP axis: it needs tp > 1.")
        if self.checkpoint_every > 1 and self.checkpointing == "none":
            raise PlanError(
                f"checkpoint_every={self.checkpoint_every} has no effect with checkpointing='none': "
                "choose 'full', 'gemms', 'alternate' or 'selective', or set checkpoint_every=1."
            )
        if self.cpu_offload and self.pp > 1:
            raise PlanError("cpu_offload is not combined with pipeline parallelism; set pp=1 or cpu_offload=False.")
        if self.float8 and self.precision != "bf16":
            raise PlanError("float8=True runs the large linear layers' GEMMs in float8 inside bf16 autocast: set "
                            "precision='bf16', or float8=False.")
        _check_choice("float8_recipe", self.float8_recipe, FLOAT8_RECIPES)
        if self.float8_recipe != "tensorwise" and not self.float8:
            raise PlanError(f"float8_recipe={self.float8_recipe!r} applies to float8 linears: set float8=True, or drop it.")
        if self.float8 and self.tp > 1:
            raise PlanError("float8 linears under tensor parallelism need float8 tensor-parallel styles, which "
                            "autopar does not apply yet: set tp=1, or float8=False.")
        if self.cuda_graphs and not self.compiles_whole_model:  # compiled, one process, no offload
            raise PlanError("cuda_graphs=True replays torch.compile's graphs in one process on one GPU (FSDP's, DDP's "
                            "and a pipeline's hooks and collectives run between them): set compile=True with every "
                            "degree 1 and cpu_offload=False, or cuda_graphs=False.")
        if self.max_autotune and not self.compile:
            raise PlanError("max_autotune=True is a torch.compile mode: set compile=True, or max_autotune=False.")
        self._check_zero_stage()

    def _check_zero_stage(self) -> None:
        _check_positive_int("zero_stage", self.zero_stage)
        _check_choice("zero_stage", self.zero_stage, ZERO_STAGES)
        if self.zero_stage == 3:
            return
        stage = f"zero_stage={self.zero_stage} keeps parameters gathered across a step's micro-batches"
        if self.dp_shard == 1 or self.grad_accum == 1:
            raise PlanError(f"{stage}: it needs dp_shard > 1 and grad_accum > 1 (with one micro-batch, "
                            "reshard_after_forward=False is the same); set zero_stage=3.")
        if self.reshard_after_forward or self.cpu_offload or self.pp > 1:
            raise PlanError(f"{stage}: set reshard_after_forward=False, and use it without cpu_offload or pipeline "
                            "parallelism (or set zero_stage=3).")

    # ---- derived values -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Processes the plan runs on: pp x dp_replicate x dp_shard x tp."""
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: ranks that read different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def local_batch_size(self) -> int:
        """Samples one data-parallel rank consumes per optimizer step: micro-batch x accumulation."""
        return self.micro_batch_size * self.grad_accum

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all ranks: micro-batch x accumulation x data-parallel degree."""
        return self.local_batch_size * self.dp_size

    @property
    def uses_fsdp(self) -> bool:
        """Whether parameters are managed by FSDP2 (sharded, replicated across ranks, or offloaded). Tensor-
        parallel plans always are (over a data-parallel axis of one rank if need be), so that every
        parameter is a DTensor: torch's foreach and fused optimizers refuse a mix of DTensors and tensors."""
        return self.dp_size > 1 or self.cpu_offload or self.tp > 1

    @property
    def float8_all_gather(self) -> bool:
        """Whether FSDP2 gathers the float8 linears' weights in float8 (tensorwise and sharded: torchao's
        enable_fsdp_float8_all_gather), where the process group sends float8 (NCCL: autopar.strategies.float8)."""
        return self.float8 and self.float8_recipe == "tensorwise" and self.uses_fsdp and self.dp_shard > 1

    @property
    def compiles_whole_model(self) -> bool:
        """Whether torch.compile compiles the whole model's forward as one graph (one process' plain model);
        under FSDP or a pipeline, whose hooks wrap the blocks, each block is compiled alone and the rest runs
        eagerly (autopar.strategies.apply)."""
        return self.compile and not self.uses_fsdp and self.pp == 1

    @property
    def needs_train_step(self) -> bool:
        """Whether the step must be driven by `autopar.train_step` (a plain loop cannot run this plan)."""
        return self.pp > 1 or self.grad_accum > 1

    @property
    def mesh_shape(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    # ---- checks against the world, the batch, the model ----------------------------------------
    def check_world(self, world_size: int) -> None:
        """Raise if the mesh degrees do not multiply to `world_size`."""
        if self.world_size != world_size:
            raise PlanMismatchError(
                f"the plan's degrees pp={self.pp} x dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} "
                f"x tp={self.tp} = {self.world_size} processes, but this job has {world_size}. Change the degrees "
                f"so that they multiply to {world_size}, or launch {self.world_size} processes."
            )

    def check_batch(self, global_batch_size: int) -> None:
        """Raise if micro-batch x accumulation x data-parallel degree is not `global_batch_size`."""
        if self.global_batch_size != global_batch_size:
            raise PlanError(
                f"the plan's batch micro_batch_size={self.micro_batch_size} x grad_accum={self.grad_accum} x "
                f"data-parallel degree {self.dp_size} = {self.global_batch_size} samples per step, but the global "
                f"batch is {global_batch_size}. autopar never changes the global batch: choose micro_batch_size "
                f"and grad_accum whose product with {self.dp_size} is {global_batch_size} (or, if the global batch "
                "is not what you meant, pass global_batch_size= to wrap)."
            )

    def check_model(self, model_fingerprint: str | None, *, force: bool = False) -> None:
        """Raise if the plan was made for a model with another fingerprint (unless `force`)."""
        if force or self.model_fingerprint is None or model_fingerprint is None:
            return
        if self.model_fingerprint != model_fingerprint:
            raise PlanMismatchError(
                f"this plan was made for another model (fingerprint {self.model_fingerprint}, this model's is "
                f"{model_fingerprint}): its memory and speed estimates do not hold here. Make a plan for this "
                "model (autopar.plan), or pass force=True to apply it anyway."
            )

    # ---- identity, serialisation -----------------------------------------------------------------
    def replace(self, **changes: Any) -> "Plan":
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def strategy(self) -> dict[str, Any]:
        """The fields that define the strategy, without provenance. zero_stage is left out at its default (3),
        so that plans made before it existed keep their keys (plan caches, studies)."""
        out = {name: getattr(self, name) for name in _STRATEGY_FIELDS}
        if self.zero_stage != 3:
            out["zero_stage"] = self.zero_stage
        for name in _LEFT_OUT_WHEN_OFF:  # as zero_stage at its default: older plans keep their keys
            if getattr(self, name):
                out[name] = True
        if self.float8_recipe != "tensorwise":  # the same, at its default
            out["float8_recipe"] = self.float8_recipe
        return out

    def key(self) -> str:
        """A short stable hash of the strategy (the same on every rank for the same plan)."""
        blob = json.dumps(self.strategy(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        out = {"schema_version": self.schema_version}
        for f in dataclasses.fields(self):
            if f.name == "schema_version":
                continue
            value = getattr(self, f.name)
            if f.name in ("model_fingerprint", "topology_fingerprint", "prediction", "measurement") and value is None:
                continue
            if f.name == "zero_stage" and value == 3:  # left out at its default: files an older autopar reads
                continue
            if (f.name in _LEFT_OUT_WHEN_OFF and not value) or (f.name == "float8_recipe" and value == "tensorwise"):
                continue  # the same: left out at their defaults
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        if not isinstance(data, Mapping):
            raise PlanError(f"a plan must be a mapping of option names to values, got {type(data).__name__}.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(map(str, data)) - known)
        if unknown:
            raise PlanError(
                f"unknown plan option(s) {', '.join(unknown)}; known options are: {', '.join(sorted(known))}."
            )
        version = data.get("schema_version", SCHEMA_VERSION)
        if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
            raise PlanError(
                f"this plan has schema version {version}, newer than this autopar reads ({SCHEMA_VERSION}): "
                "upgrade autopar, or make the plan again with this version."
            )
        return cls(**dict(data))

    def to_yaml(self) -> str:
        header = (
            f"# autopar plan: world size {self.world_size}, global batch {self.global_batch_size} "
            f"(derived; not read back)\n"
        )
        return header + yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str, *, source: str = "<string>") -> "Plan":
        try:
            data = load_yaml(text)
        except yaml.YAMLError as exc:
            raise PlanError(
                f"{source} is not a plain YAML plan file ({exc.__class__.__name__}: "
                f"{str(exc).splitlines()[0]}); plan files hold plain values only (no tags, no code)."
            ) from None
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the plan as YAML (atomically: a crash never leaves half a file). Returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, self.to_yaml())
        return path

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        model_fingerprint: str | None = None,
        world_size: int | None = None,
        force: bool = False,
    ) -> "Plan":
        """Read a plan file; refuse one made for another model or world size unless `force`."""
        path = Path(path)
        if not path.is_file():
            raise PlanError(f"no plan file at {path}: give the path of a YAML file written by Plan.save.")
        size = path.stat().st_size
        if size > MAX_YAML_CHARS:
            raise PlanError(f"{path} is {size:,} bytes, too large for a plan file (a plan is about "
                            "1 KiB): give the YAML file Plan.save wrote.")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise PlanError(f"{path} is not UTF-8 text, so not a plan file: give the YAML file Plan.save wrote.") from None
        plan = cls.from_yaml(text, source=str(path))
        plan.check_model(model_fingerprint, force=force)
        if world_size is not None and not force:
            plan.check_world(world_size)
        return plan

    # ---- for people ------------------------------------------------------------------------------
    def describe(self) -> str:
        """The plan in a block a person reads at a glance."""
        mesh = " x ".join(f"{axis}={getattr(self, axis)}" for axis in MESH_AXES)
        lines = [
            f"autopar plan {self.key()}",
            f"  mesh          {mesh}  ({self.world_size} process{'es' if self.world_size != 1 else ''})",
            f"  batch         micro-batch {self.micro_batch_size} x accumulation {self.grad_accum} x data-parallel "
            f"{self.dp_size} = global batch {self.global_batch_size}",
        ]
        if self.uses_fsdp:
            kind = "HSDP" if self.dp_replicate > 1 and self.dp_shard > 1 else (
                "replicated (DDP-like)" if self.dp_shard == 1 and self.dp_replicate > 1 else "FSDP2")
            lines.append(
                f"  data parallel {kind}, reshard after forward: {self.reshard_after_forward}, "
                f"CPU offload: {self.cpu_offload}" + ("" if self.zero_stage == 3 else f", ZeRO stage {self.zero_stage} "
                                                     "(parameters gathered once a step)")
            )
        if self.tp > 1:
            lines.append(f"  tensor par.   tp={self.tp}, sequence parallel: {self.sequence_parallel}")
        if self.pp > 1:
            lines.append(
                f"  pipeline      pp={self.pp}, schedule {self.pp_schedule}, {self.pp_stages_per_rank} stage(s) per rank, "
                f"{self.grad_accum} micro-batches"
            )
        every = "" if self.checkpoint_every == 1 else f" (every {_ordinal(self.checkpoint_every)} block)"
        lines.append(f"  checkpointing {self.checkpointing}{every}")
        float8 = f" + float8 linears ({self.float8_recipe}{', float8 all-gathers' if self.float8_all_gather else ''})" \
            if self.float8 else ""
        modes = ", ".join(m for m, on in (("CUDA graphs", self.cuda_graphs), ("max-autotune", self.max_autotune)) if on)
        graphs = f" ({modes})" if modes else ""
        lines.append(f"  precision     {self.precision}{float8}   compile: {self.compile}{graphs}")
        if self.prediction:
            p = self.prediction
            parts = []
            if "memory_bytes" in p:
                parts.append(f"{p['memory_bytes'] / 2**30:.2f} GiB per device")
            if "step_s" in p:
                parts.append(f"{p['step_s'] * 1e3:.1f} ms/step")
            if "tokens_per_s" in p:
                parts.append(f"{p['tokens_per_s']:,.0f} tokens/s")
            if "mfu" in p and isinstance(p["mfu"], (int, float)) and not math.isnan(p["mfu"]):
                parts.append(f"MFU {p['mfu']:.1%}")
            if parts:
                lines.append("  predicted     " + ", ".join(parts))
            if isinstance(p.get("planning_s"), (int, float)):
                cached = f" (wrap's cache of {p['cached_at'][:10]})" if isinstance(p.get("cached_at"), str) else ""
                lines.append(f"  planned in    {p['planning_s']:.1f} s{cached}")
            if isinstance(p.get("measured_forward_backward_s"), (int, float)):
                took = ""
                if isinstance(p.get("measuring_s"), (int, float)):
                    took = f"; measuring took {p['measuring_s']:.1f} s"
                    if p.get("compile_warmup_s"):
                        took += f", compiling {p['compile_warmup_s']:.1f} s"
                lines.append(f"  measured      {p['measured_forward_backward_s'] * 1e3:.1f} ms forward + backward "
                             f"on this device ({'compiled' if self.compile else 'eager: compile did not pay'}{took})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()
