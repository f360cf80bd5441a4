"""Choosing a plan: the search over candidate plans, ranked by the cost model.

`search(...)` enumerates plans for a model, a topology and a global batch (`enumerate_plans`): mesh
factorisations with tensor parallelism inside a node and dividing the heads, pipeline degrees up to the
number of blocks, micro-batch sizes, checkpointing, precision, compile, sequence parallelism,
resharding; CPU offload only where nothing else fits. It predicts each plan's memory (autopar.cost),
drops those that do not fit with a headroom, predicts the time of the rest and ranks them by predicted
step time. `autopar.candidates` returns the ranking; `wrap` and `autopar.plan` apply its first plan.
A dropped candidate says why as a `Drop` (a `DropKind` and its numbers; `describe()` gives the text).

Pruned as dominated, never predicted for time:
- fp32 where bf16 exists (slower and larger), tensor parallelism without sequence parallelism (the same
  communication, more activation memory): not enumerated. Eager plans are not pruned: every compiled
  plan has its eager twin, ranked beside it by the prediction, so compile is chosen only where the cost
  model predicts it pays (on a tie, eager ranks first: nothing to compile, nothing to fail). `eager=False`
  keeps compiled plans only (the tuner's `--compiled-only`). A model whose forward reads tensor values
  (`ModelProfile.value_reads`: torch.compile's graph breaks there, which the cost model cannot price) gets
  no compiled plans, unless `eager=False` or `measured=True` (the tuner, which runs its candidates).
  The tuner's search (`measured=True`, torchao installed) has float8 twins of the bf16 plans too
  (Plan.float8, on GPUs with float8 tensor cores); wrap and `autopar.plan` do not offer them until a float8
  step has been measured on the H200 against its prediction. So with CUDA graphs (Plan.cuda_graphs, one
  process): the tuner's compiled plans have twins that replay their graphs; and, where the tuner is asked
  (`max_autotune=True`), twins compiled with inductor's max-autotune (Plan.max_autotune: minutes more compile).
- more recomputation or resharding than needed: of the plans that differ only in checkpointing
  (none < selective < alternate < gemms < full) and in how often they gather (ZeRO stage 1 < stage 2 < FSDP without
  resharding after forward < with it: `_regathers`), one is dropped when another with no more of either also fits. Recomputation and re-gathering only add work, so the kept plan is
  never slower; it is listed as dropped, with the plan that dominates it.

The work is one step per plan considered: the loops run over divisors of the world size and of the
local batch, never over ranks, and only plans that fit are predicted for time.

What is enumerated follows the loop that drives the step (`autopar.plans.Loop`): for `Loop.PLAIN` only
pure data parallelism (every process reads its own batch: no accumulation, no pipeline, no tensor
parallelism); for `Loop.ACCUMULATES` (a framework that accumulates and is told the degrees) accumulation and
tensor parallelism too, no pipeline; for `Loop.TRAIN_STEP` (autopar.train_step with autopar.dataloader /
data_shard) everything.
torch.compile is enumerated on GPUs, and for the GPUs here only where Triton (inductor's GPU backend) is
installed.
"""

from __future__ import annotations

import enum
import importlib.util
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Protocol

from .cost import Calibration, Prediction, predict_profile
from .cost.memory import MemoryPrediction, predict_host_memory, predict_memory
from .errors import PlanError
from .layout import check_pipeline, plan_refusal, sequence_parallel_refusal
from .plans import CHECKPOINTING, Loop, Plan
from .profile import ModelProfile
from .topology import Topology

GiB = 2**30
#: The start of the reason a dominated plan was dropped (the dominating variant follows).
DOMINATED = "dominated: fits, but so does the same plan with no more recomputation or resharding,"


# ---------------------------------------------------------------------------------------------------
# Candidates and why they were dropped
# ---------------------------------------------------------------------------------------------------
class DropKind(enum.Enum):
    """Why a candidate was dropped."""

    MEMORY = "memory"  # the predicted peak exceeds the budget (headroom x a GPU's memory)
    EXACT_MEMORY = "exact memory"  # the exact check's traced peak, plus the overhead, exceeds the budget
    HOST_MEMORY = "host memory"  # CPU offload: what a node's ranks keep in host memory exceeds headroom x its RAM
    DOMINATED = "dominated"  # a plan with no more recomputation or resharding also fits (never slower)
    UNRUNNABLE = "unrunnable"  # the model cannot run the plan (e.g. a pipeline stage without a block)


@dataclass(frozen=True)
class Drop:
    """Why a candidate was dropped: its kind and the numbers that say so. Make one with `memory`,
    `dominated` or `unrunnable`; `describe()` is the text `Candidate.reason` shows."""

    kind: DropKind
    needed_bytes: float | None = None  # MEMORY, EXACT_MEMORY: the predicted (or traced + overhead) peak per GPU;
    #                                    HOST_MEMORY: the host memory one node needs
    limit_bytes: float | None = None  # MEMORY, EXACT_MEMORY: the budget per GPU; HOST_MEMORY: per node
    checkpointing: str | None = None  # DOMINATED: the dominating plan's checkpointing
    reshard_after_forward: bool | None = None  # DOMINATED: the dominating plan's resharding
    zero_stage: int | None = None  # DOMINATED: the dominating plan's ZeRO stage
    detail: str | None = None  # UNRUNNABLE: what the model cannot do

    @classmethod
    def memory(cls, needed_bytes: float, limit_bytes: float, *, exact: bool = False) -> Drop:
        return cls(DropKind.EXACT_MEMORY if exact else DropKind.MEMORY, needed_bytes=float(needed_bytes),
                   limit_bytes=float(limit_bytes))

    @classmethod
    def host_memory(cls, needed_bytes: float, limit_bytes: float) -> Drop:
        return cls(DropKind.HOST_MEMORY, needed_bytes=float(needed_bytes), limit_bytes=float(limit_bytes))

    @classmethod
    def dominated(cls, by: Plan) -> Drop:
        return cls(DropKind.DOMINATED, checkpointing=by.checkpointing, reshard_after_forward=by.reshard_after_forward,
                   zero_stage=by.zero_stage)

    @classmethod
    def unrunnable(cls, detail: str) -> Drop:
        return cls(DropKind.UNRUNNABLE, detail=detail)

    def describe(self) -> str:
        if self.kind in (DropKind.MEMORY, DropKind.EXACT_MEMORY):
            assert self.needed_bytes is not None and self.limit_bytes is not None
            text = f"needs {self.needed_bytes / GiB:.1f} GiB per GPU, more than {self.limit_bytes / GiB:.1f} GiB"
            return f"exact check: {text}" if self.kind is DropKind.EXACT_MEMORY else text
        if self.kind is DropKind.HOST_MEMORY:
            assert self.needed_bytes is not None and self.limit_bytes is not None
            return (f"CPU offload needs {self.needed_bytes / GiB:,.0f} GiB of host memory per node, more than "
                    f"{self.limit_bytes / GiB:,.0f} GiB")
        if self.kind is DropKind.DOMINATED:
            stage = "" if self.zero_stage in (None, 3) else f", zero_stage={self.zero_stage}"
            return (f"{DOMINATED} checkpointing={self.checkpointing}, "
                    f"reshard_after_forward={self.reshard_after_forward}{stage}")
        return self.detail or "not runnable"


class ExactCheck(Protocol):
    """What a candidate keeps of the exact memory check (autopar.exact.ExactMemory, a layer above)."""

    peak_bytes: float  # the traced allocated peak of one rank; bytes
    trace_s: float  # seconds the check took


@dataclass(frozen=True)
class Candidate:
    """A plan with its prediction. A dropped one (`feasible` False) says why in `drop` (text: `reason`);
    its `prediction` is None, and its plan's `prediction` holds the memory where that was predicted."""

    plan: Plan
    prediction: Prediction | None
    feasible: bool
    drop: Drop | None = None
    exact: ExactCheck | None = None  # autopar.exact.ExactMemory, when the exact check verified this candidate

    @property
    def reason(self) -> str | None:
        """Why it was dropped, in words (None for a feasible candidate)."""
        return self.drop.describe() if self.drop is not None else None


# ---------------------------------------------------------------------------------------------------
# The plans considered
# ---------------------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    """The divisors of n, ascending, in O(sqrt n) steps (never one step per rank of a large world)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def _micro_batches(local: int, limit: int = 6) -> list[int]:
    """Micro-batch sizes for a local batch: its divisors, at most `limit` of them spread over the range."""
    divs = _divisors(local)
    if len(divs) <= limit:
        return divs
    step = (len(divs) - 1) / (limit - 1)
    return sorted({divs[round(i * step)] for i in range(limit)})


def tensor_parallel_degrees(profile: ModelProfile, topology: Topology, world_size: int) -> list[int]:
    """TP degrees the search tries: divisors of the GPUs of one node (a TP group never spans nodes), at most
    8, that divide the attention heads, the key/value heads and the hidden size."""
    per_node = min(topology.devices_per_node, world_size)
    heads = [h for h in (profile.num_heads, profile.num_kv_heads) if h]
    return [t for t in _divisors(per_node) if t <= 8 and all(h % t == 0 for h in heads)
            and (t == 1 or profile.hidden_dim is None or profile.hidden_dim % t == 0)]


def data_parallel_degrees(profile: ModelProfile, topology: Topology, *, world_size: int,
                          loop: Loop | str = Loop.PLAIN) -> list[int]:
    """The data-parallel degrees the search tries under `loop`, ascending: a global batch must divide by one."""
    out, loop = set(), Loop.parse(loop)
    for tp in (tensor_parallel_degrees(profile, topology, world_size) if loop.shares_data else [1]):
        for pp in _divisors(world_size // tp):
            if pp == 1 or (loop.pipelines and pp <= len(profile.blocks)):
                out.add(world_size // (tp * pp))
    return sorted(out)


def largest_tensor_hint(profile: ModelProfile, plan: Plan, topology: Topology) -> str:
    """A refusal's last sentence where one tensor of the step takes a quarter of a GPU or more at the plan's
    micro-batch: no sharding or checkpointing shrinks it, so the user learns which op of theirs makes it."""
    nbytes = profile.largest_transient_bytes * plan.micro_batch_size / profile.sample_batch_size
    if nbytes < topology.device.memory_bytes / 4:
        return ""
    where = f" in {profile.largest_transient_where}" if profile.largest_transient_where else ""
    return (f" One tensor of the step alone is {nbytes / 2**30:.1f} GiB at micro-batch {plan.micro_batch_size} "
            f"(aten.{profile.largest_transient_op}{where}); no sharding or checkpointing divides one tensor: the op "
            "that makes it must change (a matmul or einsum for a broadcast product and sum, a fused kernel), or the "
            "micro-batch must shrink.")


def breaks_cut_blocks(profile: ModelProfile) -> bool:
    """Whether dynamo's graph breaks (`profile.graph_breaks`, autopar.profile.graphs) may cut the blocks: a break
    in a block's forward recurs in every block and cuts its fusion where the cost model prices the block whole
    (True also where the breaks lie is not known). Breaks outside the blocks (the embeddings, a mask built
    by a helper dynamo does not trace) leave the blocks whole graphs, which the cost model prices: HF GPT-2 355M
    (transformers 5.17) compiles into 2 graphs and ran 47.4 ms compiled against 108.8 ms eager on an H200,
    interleaved (bench/results/zoo_race_2026-12-01.jsonl), where wrap had kept it eager for its one break."""
    if not profile.graph_breaks:
        return False
    return profile.graph_breaks_in_blocks is not False


def compile_unpriced(profile: ModelProfile) -> bool:
    """Whether the cost model cannot price `profile`'s compiled step, so the ranking leaves compile out unless it is
    measured: a forward that reads tensor values (`profile.value_reads`) or whose graph breaks may cut its blocks
    (breaks_cut_blocks). wrap on a GPU measures it instead (autopar.api: its race runs the compiled twin)."""
    return bool(profile.value_reads) or breaks_cut_blocks(profile)


def compiles_here(topology: Topology) -> bool:
    """Whether compiled plans are enumerated for `topology`: GPUs, and for the GPUs here only where Triton
    (inductor's GPU backend) is installed."""
    return topology.is_gpu and (topology.source != "detected" or importlib.util.find_spec("triton") is not None)


def enumerate_plans(profile: ModelProfile, topology: Topology, *, world_size: int, global_batch_size: int,
                    loop: Loop | str = Loop.PLAIN, offload: bool = False, compile_available: bool = True,
                    eager: bool = True, measured: bool = False, float8: bool = False,
                    max_autotune: bool = False) -> Iterator[Plan]:
    """Every plan the search considers (see the module docstring). Accumulation and tensor parallelism only
    where `loop` runs them (Loop.ACCUMULATES, Loop.TRAIN_STEP), pipelines only under Loop.TRAIN_STEP; CPU
    offload only with `offload`; eager plans beside compiled ones (where compile is available) unless
    `eager=False` (compiled ones only: compile is not always faster, on a GPU or in the cost model). A model
    whose forward reads tensor values (`profile.value_reads`: torch.compile's graph breaks there, which the cost
    model cannot price) gets no compiled plans, unless `eager=False` or `measured` (the tuner, which runs them).
    `float8`: bf16 plans have float8 twins (Plan.float8, tp=1) on a GPU with float8 tensor cores.
    `max_autotune` (the tuner, when asked: autotune(max_autotune=True)): compiled plans have max-autotune twins
    (Plan.max_autotune), priced as their twins (the cost model does not price inductor's kernel choice).

    The work is one step per plan yielded: the loops run over divisors of the world size and of the
    local batch, never over ranks."""
    loop = Loop.parse(loop)
    sp_ok = sequence_parallel_refusal(profile) is None  # else TP runs without sequence parallelism
    # A plain loop gives every process its own batch: only pure data parallelism keeps that true (tensor-
    # parallel peers must read the same samples, which autopar.dataloader / data_shard or a framework told the
    # degrees arrange: Loop.shares_data).
    tps = tensor_parallel_degrees(profile, topology, world_size) if loop.shares_data else [1]
    # Pruned as dominated: fp32 where bf16 exists (slower and larger), and tensor parallelism without
    # sequence parallelism (the same communication, more activation memory). Eager is not: compiled BERT
    # and ViT ran no faster than eager on an H200 and compiled GPT-2 1.5B slower
    # (bench/results/zoo_h200_2026-12-01.jsonl), so the prediction decides between the two.
    # (fp32 also where the model's bf16 step cannot run on a GPU: ModelProfile.bf16_refusal)
    # (and where the weights are float64, as scientific models train them: autocast does not cast float64 ops, so a
    # bf16 plan would run in float64 while predicted in bf16: layout.float64_refusal)
    precisions = ["bf16"] if topology.is_gpu and topology.device.supports("bf16") and profile.bf16_refusal is None \
        and profile.param_dtype != "float64" else ["fp32"]
    compiles = ([False, True] if eager else [True]) if topology.is_gpu and compile_available else [False]
    # float8 linears (Plan.float8) beside bf16 where asked (`float8`: the tuner, which measures its candidates,
    # on a GPU with float8 tensor cores and torchao installed): the cost model prices them, but no float8 step
    # has been measured on the H200 yet, so wrap and autopar.plan do not choose them on the prediction alone.
    floats8 = [("bf16", True)] if float8 and "bf16" in precisions and topology.device.supports("fp8") else []
    if eager and not measured and compile_unpriced(profile):
        # A forward that reads tensor values (`.item()`, `if tensor:`, ops shaped by values) breaks
        # torch.compile's graph there, and how often the pieces run (per layer, per step) is not in the trace:
        # the compiled step cannot be predicted, so it is not chosen blindly (compiled wav2vec2 ran 0.81-0.86x
        # its eager speed on an H200: bench/results/zoo_h200_profile_2026-12-01c.jsonl). So does a forward that
        # dynamo cuts inside its blocks (breaks_cut_blocks). `eager=False` and the tuner (`measured`: it runs
        # them) still get them.
        compiles = [False]
    blocks = len(profile.blocks)
    fingerprints = {"model_fingerprint": profile.fingerprint, "topology_fingerprint": topology.fingerprint()}
    for tp in tps:
        for pp in _divisors(world_size // tp):
            if pp > 1 and (not loop.pipelines or pp > blocks or offload):
                continue
            dp = world_size // (tp * pp)
            if global_batch_size % dp:
                continue
            local = global_batch_size // dp
            splits = {(1, dp)}
            in_node = max(1, topology.devices_per_node // (tp * pp)) if topology.devices_per_node % (tp * pp) == 0 else 1
            if topology.num_nodes > 1 and dp % in_node == 0 and in_node > 1:
                splits.add((dp // in_node, in_node))  # HSDP: shard within a node, replicate across nodes
            if dp > 1 and not offload:
                splits.add((dp, 1))  # replicated (DDP-like)
            for replicate, shard in sorted(splits):
                for mb in _micro_batches(local):
                    accum = local // mb
                    if accum > 1 and not loop.accumulates:
                        continue
                    schedules: list[tuple[str | None, int]] = [(None, 1)]
                    if pp > 1:
                        schedules = [("1f1b", 1)] if accum >= pp else [("gpipe", 1)]
                        if accum >= pp and accum % pp == 0 and 2 * pp <= blocks:
                            schedules += [("interleaved_1f1b", 2)]
                            if dp == 1 and tp == 1:  # zero-bubble beside FSDP: refused (layout.check_pipeline)
                                schedules += [("zero_bubble", 2)]
                    for schedule, per_rank in schedules:
                        for ckpt in CHECKPOINTING:
                            # float8 linears under TP: not applied yet (Plan refuses them)
                            for precision, f8 in [(p, False) for p in precisions] + (floats8 if tp == 1 else []):
                                for compile_, graphs, tuned in _compile_modes(compiles, measured, world_size,
                                                                              offload, max_autotune):
                                    for sp in ([True] if tp > 1 and sp_ok else [False]):
                                        for reshard, zero in _gather_schedules(shard, accum, pp, offload, loop):
                                            yield Plan(pp=pp, dp_replicate=replicate, dp_shard=shard, tp=tp,
                                                       micro_batch_size=mb, grad_accum=accum, pp_schedule=schedule,
                                                       pp_stages_per_rank=per_rank, reshard_after_forward=reshard,
                                                       zero_stage=zero, cpu_offload=offload, sequence_parallel=sp,
                                                       checkpointing=ckpt, precision=precision, compile=compile_,
                                                       float8=f8, cuda_graphs=graphs, max_autotune=tuned,
                                                       **fingerprints)


def _compile_modes(compiles: list[bool], measured: bool, world_size: int, offload: bool,
                   max_autotune: bool = False) -> list[tuple[bool, bool, bool]]:
    """(compile, cuda_graphs, max_autotune) triples: each compile choice; for the tuner (`measured`: it runs its
    candidates) in one process without offload, a compiled plan's CUDA-graph twin too (Plan.cuda_graphs), whose
    graphs' memory pool and copied outputs the trial measures (the cost model prices its launches, not that
    memory); where the tuner is asked (`max_autotune`), each compiled mode's max-autotune twin (Plan.max_autotune)."""
    graphs = measured and world_size == 1 and not offload
    modes = [(c, False) for c in compiles] + ([(True, True)] if graphs and True in compiles else [])
    return [(c, g, False) for c, g in modes] + \
        [(c, g, True) for c, g in modes if c and measured and max_autotune]


def _gather_schedules(shard: int, accum: int, pp: int, offload: bool, loop: Loop) -> list[tuple[bool, int]]:
    """(reshard_after_forward, zero_stage) pairs for a data-parallel split: FSDP resharding after forward or
    not; with accumulation under autopar.train_step, also ZeRO stages 2 and 1 (gathered once a step)."""
    if shard == 1:
        return [(True, 3)]
    pairs = [(True, 3), (False, 3)]
    if accum > 1 and pp == 1 and not offload and loop.pipelines:
        pairs += [(False, 2), (False, 1)]
    return pairs


def search(profile: ModelProfile, topology: Topology, *, world_size: int | None = None, global_batch_size: int,
           variants: Mapping[str, ModelProfile] | None = None, calibration: Calibration | None = None,
           loop: Loop | str = Loop.PLAIN, headroom: float = 0.95, eager: bool = True,
           tp_refusal: str | None = None, measured: bool = False, max_autotune: bool = False) -> list[Candidate]:
    """Every candidate plan: the feasible ones first, fastest first; then the dropped ones with the reason
    (those that do not fit, the smallest first; then the dominated ones; then those the model cannot run).
    Feasible: the predicted peak (reserved memory + CUDA context) within `headroom` of a GPU's memory, for a
    CPU-offload plan also what a node's ranks keep in host memory within `headroom` of the node's
    (`topology.host_memory_bytes`, when known), and not dominated (see the module docstring). CPU offload is
    tried only when no other plan fits.

    A plan is predicted for memory first; only a feasible one is predicted for time too. A dropped one
    has no `Candidate.prediction` (None); its plan's `prediction` holds the memory (`memory_bytes`,
    `allocated_bytes`) where it was predicted, and `drop` says why it was dropped.

    `eager`: rank eager plans beside compiled ones where compile is enumerated (the default); False keeps
    the compiled ones only (enumerate_plans).

    `tp_refusal`: why tensor parallelism cannot split the model (autopar.strategies.tensor_parallel's
    `tensor_parallel_refusal`, which needs the model): its plans are dropped as unrunnable with that reason.

    `variants` may be any mapping (e.g. one that traces a precision on first use): only the precisions
    some plan needs are read."""
    world_size = world_size or topology.world_size
    cal = calibration or Calibration()
    # float8 plans for the tuner, which runs them here: torchao must import
    float8 = measured and importlib.util.find_spec("torchao") is not None
    compile_available = compiles_here(topology)
    budget = headroom * topology.device.memory_bytes
    out: list[Candidate] = []
    for offload in ((False, True) if topology.is_gpu else (False,)):
        groups: dict[tuple, list[Plan]] = {}
        for plan in enumerate_plans(profile, topology, world_size=world_size, global_batch_size=global_batch_size,
                                    loop=loop, offload=offload, compile_available=compile_available, eager=eager,
                                    measured=measured, float8=float8, max_autotune=max_autotune):
            groups.setdefault(_group_key(plan), []).append(plan)
        memories: dict[int, MemoryPrediction] = {}  # id(plan that fits) -> its memory, computed once

        def fitting(plan: Plan) -> Plan | None:
            """The plan with its memory if it runs and fits; else None, its Candidate (why not) in `out`."""
            if plan.tp > 1 and tp_refusal is not None:
                out.append(Candidate(plan, None, False, Drop.unrunnable(tp_refusal)))
                return None
            why = plan_refusal(plan, profile)
            if why is not None:
                out.append(Candidate(plan, None, False, Drop.unrunnable(why)))
                return None
            if plan.pp > 1:
                try:
                    check_pipeline(plan, profile)
                except PlanError as exc:
                    out.append(Candidate(plan, None, False, Drop.unrunnable(str(exc).split(":")[0])))
                    return None
            memory = predict_memory(profile, plan, cal, variants=variants)
            need = plan.replace(prediction={"memory_bytes": float(memory.peak_bytes),
                                            "allocated_bytes": float(memory.allocated_bytes)})
            host = _host_drop(profile, plan, topology, headroom, world_size)
            if memory.peak_bytes > budget:
                out.append(Candidate(need, None, False, Drop.memory(memory.peak_bytes, budget)))
            elif host is not None:
                out.append(Candidate(need, None, False, host))
            else:
                memories[id(need)] = memory
                return need
            return None

        for plans in groups.values():
            fits = [need for plan in plans if (need := fitting(plan)) is not None]
            fits += _partial_checkpointing(fits, fitting)
            for plan in fits:
                better = next((q for q in fits if q is not plan and _no_more_work(q, plan)), None)
                if better is not None:
                    out.append(Candidate(plan, None, False, Drop.dominated(by=better)))
                    continue
                pred = predict_profile(profile, plan, topology, cal, variants=variants, memory=memories[id(plan)])
                out.append(Candidate(plan.replace(prediction=pred.summary()), pred, True))
        if any(c.feasible for c in out):
            break
    out.sort(key=rank_key)
    return out


_CKPT_ORDER = {mode: i for i, mode in enumerate(CHECKPOINTING)}  # recomputation: none < selective < ... < full


def _host_drop(profile: ModelProfile, plan: Plan, topology: Topology, headroom: float, world_size: int) -> Drop | None:
    """Why a CPU-offload plan does not fit one node's host memory (None if it does, or the memory is not known)."""
    if not plan.cpu_offload or topology.host_memory_bytes is None:
        return None
    host = predict_host_memory(profile, plan, ranks_per_node=min(topology.devices_per_node, world_size))
    limit = headroom * topology.host_memory_bytes
    return Drop.host_memory(host.node_bytes, limit) if host.node_bytes > limit else None


def _group_key(plan: Plan) -> tuple[object, ...]:
    """Everything but checkpointing, resharding and the ZeRO stage: plans with one key differ only in work they
    redo."""
    return tuple(v for k, v in plan.strategy().items()
                 if k not in ("checkpointing", "reshard_after_forward", "zero_stage"))


def _regathers(plan: Plan) -> int:
    """How much a plan gathers and reduces again, in order: resharding after forward (3), FSDP without it (2),
    ZeRO stage 2 (1: one gather a step), stage 1 (0: one gather and one reduce-scatter a step)."""
    return 3 if plan.reshard_after_forward else {3: 2, 2: 1, 1: 0}[plan.zero_stage]


#: checkpoint_every tried where the checkpointing a plan needs to fit is for every block (_partial_checkpointing)
PARTIAL_EVERY = (2, 3, 4)


def _partial_checkpointing(fits: list[Plan], fitting: Callable[[Plan], Plan | None]) -> list[Plan]:
    """Checkpointing by a memory budget rather than all or nothing: where a plan of the group checkpoints every
    block and the same plan without checkpointing (the same resharding) does not fit, the same checkpointing of
    every 2nd, 3rd or 4th block (Plan.checkpoint_every: torchtitan's per-layer activation checkpointing) while it
    still fits (memory grows with the period, so the first that does not fit ends the tries); `fitting` predicts
    each (None: it does not fit). The dominance pass then keeps the one recomputing least."""
    uncheckpointed = {(p.reshard_after_forward, p.zero_stage) for p in fits if p.checkpointing == "none"}
    out: list[Plan] = []
    for plan in fits:
        if plan.checkpointing == "none" or plan.checkpoint_every != 1 \
                or (plan.reshard_after_forward, plan.zero_stage) in uncheckpointed:
            continue
        for every in PARTIAL_EVERY:
            partial = fitting(plan.replace(checkpoint_every=every, prediction=None))
            if partial is None:
                break
            out.append(partial)
    return out


def _recomputed_share(plan: Plan) -> float:
    """The share of the blocks a plan checkpoints (0 without checkpointing)."""
    return 0.0 if plan.checkpointing == "none" else 1.0 / plan.checkpoint_every


def _no_more_work(q: Plan, plan: Plan) -> bool:
    """Whether q (same group as plan) recomputes and re-gathers no more than plan, and is a different plan:
    checkpointing no heavier (none < selective < alternate < gemms < full) of no more of the blocks, re-gathering no
    more."""
    return (_CKPT_ORDER[q.checkpointing] <= _CKPT_ORDER[plan.checkpointing]
            and _recomputed_share(q) <= _recomputed_share(plan)
            and _regathers(q) <= _regathers(plan)
            and (q.checkpointing, _recomputed_share(q), _regathers(q))
            != (plan.checkpointing, _recomputed_share(plan), _regathers(plan)))


def rank_key(c: Candidate) -> tuple[bool, int, float, bool]:
    """The order of `search`'s list: feasible first, by step time (on a tie, eager before compiled); then
    those that do not fit, by memory needed; then the dominated; then those the model cannot run."""
    if c.feasible:
        assert c.prediction is not None
        return (False, 0, c.prediction.step_s, c.plan.compile)
    if c.drop is not None and c.drop.kind is DropKind.DOMINATED:
        return (True, 1, 0.0, False)
    need = (c.plan.prediction or {}).get("memory_bytes")
    return (True, 0, float(need), False) if need is not None else (True, 2, 0.0, False)
