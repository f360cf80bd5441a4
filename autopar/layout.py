"""Layout rules the cost model and the strategies share: how blocks split into pipeline stages, which
pipeline plans a model can run, and which Linear-like calls pair up for tensor parallelism.

Pure functions of a Plan and a ModelProfile (no torch.distributed, no model): the cost model predicts with
the same split and the same pairs that the strategies apply.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from .errors import PlanError
from .plans import Plan
from .profile import MatmulCall, ModelProfile

# Schedules that run several stages on one rank.
MULTI_STAGE = ("interleaved_1f1b", "zero_bubble")


# ---------------------------------------------------------------------------------------------------
# Splitting the blocks into stages
# ---------------------------------------------------------------------------------------------------
def block_costs(profile: ModelProfile) -> tuple[list[float], float, float]:
    """(cost of each block, extra cost of the first stage, extra cost of the last stage).

    A cost is the share of the step's FLOPs plus the share of the memory held (parameter bytes +
    activation bytes saved for backward), so a stage's cost is about its share of time plus its share
    of memory; the split minimises the largest stage.
    """
    blocks = profile.blocks
    flops = [b.flops for b in blocks]
    mem = [b.param_bytes + b.saved_bytes for b in blocks]
    outside_flops = max(profile.flops - sum(flops), 0.0)
    outside_mem = max(profile.param_bytes - sum(b.param_bytes for b in blocks), 0) + profile.saved_bytes_outside_blocks
    total_flops = sum(flops) + outside_flops or 1.0
    total_mem = sum(mem) + outside_mem or 1.0
    costs = [f / total_flops + m / total_mem for f, m in zip(flops, mem)]
    # Embeddings: lookups (no FLOPs), about half the outside memory; head + loss: the outside FLOPs.
    first = 0.5 * outside_mem / total_mem
    last = outside_flops / total_flops + 0.5 * outside_mem / total_mem
    return costs, first, last


def split_stages(profile: ModelProfile, num_stages: int) -> tuple[tuple[int, ...], ...]:
    """Block indices of each stage: contiguous, non-empty, minimising the costliest stage."""
    return _split_stages(profile, num_stages)


@functools.lru_cache(maxsize=256)
def _split_stages(profile: ModelProfile, num_stages: int) -> tuple[tuple[int, ...], ...]:
    n = len(profile.blocks)
    if num_stages > n:
        raise PlanError(
            f"{num_stages} pipeline stages but {profile.model_class} has {n} blocks: every stage needs at least one "
            f"block; lower pp (or pp_stages_per_rank) so that pp x stages per rank <= {n}."
        )
    costs, first_extra, last_extra = block_costs(profile)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(i: int, j: int, stage: int) -> float:  # blocks i..j-1 as stage `stage`
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == num_stages - 1 else 0.0)
        return prefix[j] - prefix[i] + extra

    inf = float("inf")
    # best[s][j]: the smallest possible largest-stage cost placing blocks 0..j-1 in stages 0..s-1
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, n - (num_stages - s) + 1):
            for i in range(s - 1, j):
                value = max(best[s - 1][i], cost(i, j, s - 1))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    bounds, j = [], n
    for s in range(num_stages, 0, -1):
        i = cut[s][j]
        bounds.append(tuple(range(i, j)))
        j = i
    return tuple(reversed(bounds))


def stage_ids(plan: Plan, pp_rank: int) -> tuple[int, ...]:
    """The stages this pipeline rank runs: one; or, with several per rank, a loop (r, r + pp, ...) or,
    for the two-stage zero-bubble schedule, a V (r, 2 pp - 1 - r)."""
    v = plan.pp_stages_per_rank
    if v == 1:
        return (pp_rank,)
    if plan.pp_schedule == "zero_bubble" and v == 2:
        return (pp_rank, 2 * plan.pp - 1 - pp_rank)
    return tuple(pp_rank + k * plan.pp for k in range(v))


@functools.lru_cache(maxsize=64)  # the search asks once per pipeline plan, of one profile
def pipeline_refusal(profile: ModelProfile) -> str | None:
    """Why pipeline parallelism cannot split this model's blocks (one line), or None.

    A pipeline stage hands the next one its last block's output, as the next block's input: the blocks must
    be one run in one container, each block taking the previous one's output and nothing running between
    them. Blocks in several containers (an encoder-decoder's two stacks, a vision model's stages, two towers)
    are not, and neither are numbered blocks with a gap (a layer between them that is not a block)."""
    containers = profile.block_containers
    if len(containers) > 1:
        shown = ", ".join(c or "<root>" for c in containers[:4]) + (", ..." if len(containers) > 4 else "")
        return (f"pipeline parallelism splits one run of blocks, each taking the previous one's output, and "
                f"{profile.model_class}'s blocks lie in {len(containers)} containers ({shown}): set pp=1")
    indices = [b.name.rpartition(".")[2] for b in profile.blocks]
    if all(i.isdigit() for i in indices):
        gap = next((a for a, b in zip(indices, indices[1:]) if int(b) != int(a) + 1), None)
        if gap is not None:
            where = containers[0] + "." if containers and containers[0] else ""
            return (f"pipeline parallelism splits one run of adjacent blocks, and {profile.model_class}'s block "
                    f"{where}{gap} is not followed by block {where}{int(gap) + 1} (a layer between blocks would be "
                    "skipped at a stage boundary): set pp=1, or name every layer of the run as a block")
    if profile.pipeline_chain:
        return (f"pipeline parallelism runs each stage's blocks on the previous stage's last output alone, and in "
                f"{profile.model_class}'s forward {profile.pipeline_chain} (on another stage that value would be "
                "missing or a placeholder's): set pp=1")
    names = [b.name for b in profile.blocks]
    for group in profile.tied_params:
        owners = {next((b for b in names if n.startswith(b + ".")), None) for n in group}
        if len(owners - {None}) > 1:
            return (f"pipeline parallelism gives each stage its own blocks' parameters, and {profile.model_class}'s "
                    f"{' and '.join(group[:2])} are one parameter in two blocks (each stage would train its own "
                    "copy): set pp=1")
    return None


def check_pipeline(plan: Plan, profile: ModelProfile) -> None:
    """Refuse, with what to change, a pipeline plan this model or schedule cannot run."""
    if plan.pp == 1:
        return
    why = pipeline_refusal(profile)
    if why is not None:
        raise PlanError(why + ".")
    split_stages(profile, plan.pp * plan.pp_stages_per_rank)
    if plan.pp_schedule in ("1f1b", "interleaved_1f1b", "zero_bubble") and plan.grad_accum < plan.pp:
        raise PlanError(
            f"the {plan.pp_schedule} schedule needs at least as many micro-batches as pipeline ranks: "
            f"grad_accum={plan.grad_accum} < pp={plan.pp}. Raise grad_accum (and lower micro_batch_size to keep "
            "the global batch), or use pp_schedule='gpipe'."
        )
    if plan.pp_schedule == "zero_bubble" and plan.uses_fsdp:
        # torch.distributed.pipelining (2.11-2.13) splits each backward into its input half and its weight half, and
        # maps the weight half's gradients to the stage's parameters as they are then; FSDP2 (which every data- or
        # tensor-parallel plan runs through) has swapped them for other tensors by then: KeyError in
        # stage_backward_weight on every rank (bench/multigpu.py on 4 gloo ranks: dp_shard, dp_replicate and tp alike)
        raise PlanError(
            "the zero_bubble schedule cannot run beside data or tensor parallelism (torch's pipelining loses FSDP2's "
            "parameters between a backward's two halves): use pp_schedule='interleaved_1f1b' or '1f1b', or "
            "zero_bubble with pipeline parallelism alone."
        )
    if plan.pp_schedule in MULTI_STAGE and plan.grad_accum % plan.pp:
        raise PlanError(
            f"the {plan.pp_schedule} schedule needs a number of micro-batches divisible by pp={plan.pp}; "
            f"grad_accum={plan.grad_accum} is not."
        )
    if profile.root_param_names:
        raise PlanError(
            f"pipeline parallelism places the parameters around the blocks on the first or last stage by module, "
            f"and {profile.model_class} holds {', '.join(profile.root_param_names)} directly on the model: move them "
            "into a submodule, or set pp=1."
        )
    if profile.block_input is None or not profile.block_input_shape:
        raise PlanError("pipeline parallelism needs a traced profile (how blocks receive their input).")
    if profile.block_input_shape[0] != profile.sample_batch_size:
        raise PlanError(
            f"pipeline parallelism sends a block's input between stages split along the batch, but "
            f"{profile.model_class}'s blocks receive {tuple(profile.block_input_shape)} for a batch of "
            f"{profile.sample_batch_size} (the batch is not dim 0): set pp=1."
        )


def sequence_parallel_refusal(profile: ModelProfile) -> str | None:
    """Why sequence parallelism cannot shard this model's blocks (one line), or None.

    Sequence parallelism shards each block's hidden-states input along the sequence, by the way the profile
    saw the first block called (its positional arguments); blocks in several containers are called in
    several ways (a decoder layer takes the encoder's output too), so tensor parallelism runs without it."""
    containers = profile.block_containers
    if len(containers) > 1:
        return (f"sequence parallelism shards the blocks' input as the first block is called, and "
                f"{profile.model_class}'s blocks lie in {len(containers)} containers, called in their own ways: "
                "set sequence_parallel=False (tensor parallelism runs without it)")
    return None


def sparse_gradient_refusal(plan: Plan, profile: ModelProfile) -> str | None:
    """Why `plan` cannot train this model (one line), or None: an embedding built with sparse=True has a sparse
    gradient, which FSDP2 can neither shard nor reduce (its backward failed in `fsdp::chunk_cat`, NotImplementedError
    for SparseCPU), and every plan that manages the parameters with FSDP (Plan.uses_fsdp) runs it."""
    if plan.uses_fsdp and profile.sparse_grad_modules:
        return (f"{_named(profile.sparse_grad_modules)} of {profile.model_class} "
                "has sparse=True: its gradient is a sparse tensor, which FSDP2 (every plan that shards, replicates "
                "over processes or offloads) cannot shard or reduce; build it with sparse=False (a dense gradient: "
                "any optimizer, not SparseAdam), or train in one process without offload")
    return None


def float64_refusal(plan: Plan, profile: ModelProfile) -> str | None:
    """Why a bf16 `plan` cannot train this model as it says (one line), or None: its weights are float64, and neither
    autocast (which leaves float64 ops in float64) nor autopar's FSDP mixed precision (which casts float32 units only)
    computes them in bf16: the step would run in float64 while the plan, its prediction and its memory say bf16."""
    if plan.precision == "bf16" and profile.param_dtype == "float64":
        return (f"{profile.model_class}'s weights are float64, which bf16 autocast leaves in float64: use "
                "precision='fp32' (the weights' own dtype, float64 kept), or cast the model to float32 before wrap "
                "for a bf16 plan")
    return None


def differentiating_forward_refusal(plan: Plan, profile: ModelProfile) -> str | None:
    """Why `plan` cannot train this model (one line), or None: its forward takes a gradient (a gradient penalty's
    torch.autograd.grad(..., create_graph=True)); under FSDP2 that inner backward runs the units' post-backward hooks,
    which free the gathered weights the outer backward reads ("setStorage: ... storage of size 0"), and with the
    weights kept gathered the gradients came out wrong (gloo, torch 2.13), so every plan that manages the parameters
    with FSDP (Plan.uses_fsdp) or splits the model into pipeline stages is refused."""
    if (plan.uses_fsdp or plan.pp > 1) and profile.differentiating_forward:
        return (f"{profile.model_class} takes a gradient in {profile.differentiating_forward} (torch.autograd.grad "
                "inside forward, as a gradient penalty does), which FSDP2 and pipeline stages cannot run: train it "
                "in one process without offload, or compute that gradient outside the wrapped module")
    return None


def written_weight_refusal(plan: Plan, profile: ModelProfile) -> str | None:
    """Why `plan` cannot train this model (one line), or None: its forward writes a parameter in place
    (ModelProfile.params_written: nn.Embedding(max_norm=) renormalises the rows its batch reads). Under FSDP the
    write lands in the gathered copy, freed after the forward, and with data or tensor parallelism each rank would
    write its own copy from its own samples or shard, where one process writes the one weight from the whole batch:
    every plan that manages the parameters with FSDP (Plan.uses_fsdp), splits the batch over ranks or splits the
    weights (tp) is refused. Gradient accumulation and pipeline stages write the one weight as one process does."""
    if profile.params_written and (plan.uses_fsdp or plan.dp_size > 1 or plan.tp > 1):
        names = profile.params_written
        return (f"{profile.model_class}'s forward writes {_named(names)} in place (as nn.Embedding(max_norm=) "
                "renormalises the rows it reads), which FSDP's gathered copies and data- or tensor-parallel ranks "
                "cannot share: train it in one process (or with pipeline stages only), or renormalise the weight "
                "after each optimizer step instead of in forward")
    return None


def batch_split_refusal(plan: Plan, profile: ModelProfile) -> str | None:
    """Why `plan` cannot train this model (one line), or None: a plan that cuts the batch into micro-batches
    (grad_accum > 1, or a pipeline's) cuts dim 0 of its tensors, which is the sequence of a batch_first=False module
    the sample reaches with its dim 0 first (ModelProfile.sequence_first): each micro-batch would hold part of every
    sequence."""
    if profile.sequence_first and (plan.grad_accum > 1 or plan.pp > 1):
        return (f"autopar cuts a batch into micro-batches along dim 0, and the sample's dim 0 is the sequence of "
                f"{profile.sequence_first}: build it with batch_first=True and give batch-first tensors, or use a "
                "plan with grad_accum=1 and pp=1")
    return None


def gradient_hook_refusal(plan: Plan, names: Sequence[str], model_class: str) -> str | None:
    """Why `plan` cannot train this model (one line), or None: parameters `names` carry gradient hooks of the
    user's, and FSDP2 replaces every parameter with its shard and sets the shard's gradient itself after the
    reduce-scatter, so the hooks would never run (on 2 gloo ranks a hook halving the gradients was dropped: the
    weights came out 0.034 from one process's)."""
    if plan.uses_fsdp and names:
        return (f"{_named(names)} of {model_class} has a gradient "
                "hook (Tensor.register_hook or register_post_accumulate_grad_hook), which FSDP2 drops with the "
                "parameter, so it would never run: change the gradients in your loop between backward and "
                "optimizer.step (p.grad, a shard under FSDP) and remove the hook, or train in one process without "
                "offload")
    return None


def _named(names: Sequence[str]) -> str:
    """The first of `names`, and how many more."""
    return names[0] + (f" and {len(names) - 1} more" if len(names) > 1 else "")


def plan_refusal(plan: Plan, profile: ModelProfile) -> str | None:
    """Why `plan` cannot train this model, for what the model is rather than its size (one line), or None: a sparse
    gradient under FSDP, a forward that takes a gradient under FSDP or a pipeline, bf16 for float64 weights, a
    batch split along a sequence, gradient hooks on parameters under FSDP, a parameter the forward writes."""
    return sparse_gradient_refusal(plan, profile) or differentiating_forward_refusal(plan, profile) or \
        float64_refusal(plan, profile) or batch_split_refusal(plan, profile) or \
        written_weight_refusal(plan, profile) or \
        gradient_hook_refusal(plan, profile.hooked_params, profile.model_class)


@dataclass(frozen=True)
class TPPair:
    """Column-parallel layers reading one input, and the row-parallel layer that maps back to hidden."""

    colwise: tuple[str, ...]  # fully qualified names
    rowwise: str
    kinds: tuple[str, ...]  # "linear" / "conv1d" for each colwise layer, then the rowwise one
    chunks: int = 1  # >1: a single colwise layer computing `chunks` projections at once (fused q, k, v)
    attention: bool = False  # the pair is an attention (several or fused projections), not an MLP
    replicated: tuple[str, ...] = ()  # colwise layers reading a tensor from outside the block (cross-attention's
    #                                   keys and values of the encoder's output): whole on every rank, also
    #                                   under sequence parallelism
    parts_layout: str = ""  # a fused colwise layer's: "whole" (its parts in turn), "interleaved" (per head), "" unknown

    @property
    def parent(self) -> str:
        """The module holding the pair (the attention or MLP module)."""
        names = [n.split(".") for n in (*self.colwise, self.rowwise)]
        common = []
        for parts in zip(*names):
            if len(set(parts)) > 1:
                break
            common.append(parts[0])
        return ".".join(common)


def outside_inputs(profile: ModelProfile) -> frozenset[int]:
    """Inputs (MatmulCall.input_id) that Linear-like layers of two or more blocks read: tensors from outside the
    blocks, such as the encoder's output that every decoder layer's cross-attention reads."""
    return _outside_inputs(profile)


@functools.lru_cache(maxsize=64)
def _outside_inputs(profile: ModelProfile) -> frozenset[int]:
    readers: dict[int, str] = {}
    shared = set()
    blocks = [b.name + "." for b in profile.blocks]
    for call in profile.matmul_calls:
        block = next((b for b in blocks if call.name.startswith(b)), None)
        if block is None:
            continue
        if readers.setdefault(call.input_id, block) != block:
            shared.add(call.input_id)
    return frozenset(shared)


def fused_parts_layout(call: MatmulCall, parts: int, num_heads: int | None) -> str:
    """How a fused projection's `parts` (q, k and v; gate and up) lie in its output, as the trace saw the model take
    the output apart (MatmulCall.consumer): "whole" (each part whole in turn, [q | k | v]: cut along the last dim
    into pieces of one part's width, or viewed with the parts outermost), "interleaved" (per head: viewed with the
    heads outermost, each head's parts side by side), or "" (not seen)."""
    op, _, rest = call.consumer.partition(" ")
    width = call.out_features
    if parts < 2 or width % parts:
        return ""
    if op == "split":
        dim, _, widths = rest.partition(" ")
        pieces = [int(w) for w in widths.split(",") if w]
        return "whole" if dim == "-1" and pieces and all(w == width // parts for w in pieces) else ""
    if op == "view":
        shape = [int(d) for d in rest.split(",") if d]
        suffix: list[int] = []
        for d in reversed(shape):  # the trailing dims the last one was cut into
            suffix.insert(0, d)
            if math.prod(suffix) >= width:
                break
        if math.prod(suffix) != width or len(suffix) < 2 or suffix[0] == num_heads == parts:
            return ""
        if suffix[0] == parts:
            return "whole"
        if num_heads and suffix[0] == num_heads:
            return "interleaved"
    return ""


def pairs_from_calls(calls: Sequence[MatmulCall], hidden: int, hf_plan: dict[str, str] | None, *,
                     outside: frozenset[int] = frozenset(), num_heads: int | None = None) -> list[TPPair]:
    """Pair column groups with their row layer in call order, within one block's calls.

    A group is the column layers reading one input, joined by those reading a tensor from `outside` the block
    (cross-attention: the query reads the block's hidden states, the keys and values the encoder's output);
    a layer reading an outside tensor is never a row layer."""
    pairs: list[TPPair] = []
    i = 0
    while i < len(calls):
        first = calls[i]
        is_col = (lambda c: hf_plan.get(c.name, "").startswith("colwise")) if hf_plan is not None else \
            (lambda c: c.in_features == hidden)
        is_row = (lambda c: c.input_id not in outside and hf_plan.get(c.name, "").startswith("rowwise")) \
            if hf_plan is not None else (lambda c: c.input_id not in outside and c.out_features == hidden)
        if not is_col(first):
            i += 1
            continue
        group = [first]
        j = i + 1
        while j < len(calls) and (calls[j].input_id == first.input_id or calls[j].input_id in outside) \
                and is_col(calls[j]):
            group.append(calls[j])
            j += 1
        if j >= len(calls) or not is_row(calls[j]):
            i = j  # no row partner right after the group: a layer in between would see sharded data
            continue
        row = calls[j]
        parts = 1  # projections one fused column layer computes (its output over the row layer's input)
        if len(group) == 1 and group[0].out_features != row.in_features:
            if group[0].out_features % row.in_features:
                i = j + 1
                continue
            parts = group[0].out_features // row.in_features
        elif len(group) > 1 and any(c.name == row.name for c in group):
            i = j + 1
            continue
        # A model's own plan that splits a fused q/k/v layer as a plain "colwise" says its parts are interleaved per
        # head (GPT-NeoX's query_key_value: each head's q, k and v side by side), so a contiguous shard holds whole
        # heads; else the parts lie whole one after another ([q | k | v]: a strided shard, `chunks`). Not for a layer
        # of two parts: MiniCPM5-MoE's q_gate_proj is one beside k and v projections its plan does not split
        # ("unit_colwise"), which a plain shard of the queries alone trained apart (hf-sweep-dist, 2026-12-06).
        # The trace's own view of the parts (`fused_parts_layout`: how the model cuts the output) wins over that;
        # not where a layer left out of the group reads the same input (MiniCPM5-MoE's k and v projections beside
        # its fused queries and gates, whole on every rank under its plan): the heads' pairing is then unknown.
        alone = not any(c.input_id == first.input_id and c not in group for c in calls)
        seen = fused_parts_layout(group[0], parts, num_heads) if parts > 1 and alone else ""
        plain = seen == "interleaved" or (not seen and hf_plan is not None
                                          and hf_plan.get(group[0].name) == "colwise" and parts >= 3)
        pairs.append(TPPair(colwise=tuple(c.name for c in group), rowwise=row.name,
                            kinds=tuple(c.kind for c in group) + (row.kind,), chunks=1 if plain else parts,
                            attention=len(group) >= 3 or parts >= 3,
                            replicated=tuple(c.name for c in group if c.input_id in outside),
                            parts_layout=seen or ("interleaved" if plain else "")))
        i = j + 1
    return pairs


# ---- float8 linears (Plan.float8) ------------------------------------------------------------------------------
#: A linear layer trains in float8 where its GEMMs are large enough for the float8 GEMM's saving to pay for the
#: casts around it: torchao's H100 tables for tensorwise scaling (torchao/float8/README.md, "Performance"; its
#: convert_to_float8_training auto-filter) have float8 slower than bf16 for layers of at most 4096 input and 1024
#: output features. Both must be multiples of 16 (the float8 GEMM, torch._scaled_mm, needs them). The rule is that
#: table's until a float8 GEMM measurement on the H200 calibrates autopar's own (bench ops, section gemm_fp8).
FLOAT8_SMALL_IN_FEATURES, FLOAT8_SMALL_OUT_FEATURES = 4096, 1024


def float8_converts(in_features: int, out_features: int) -> bool:
    """Whether a linear layer of these features trains in float8 under a float8 plan (see above)."""
    if in_features % 16 or out_features % 16:
        return False
    return not (in_features <= FLOAT8_SMALL_IN_FEATURES and out_features <= FLOAT8_SMALL_OUT_FEATURES)


def float8_layers(linears: Iterable[tuple[str, int, int]], blocks: Sequence[str]) -> tuple[str, ...]:
    """Of the nn.Linear layers given as (name, in_features, out_features), those a float8 plan converts: inside one
    of the `blocks` (their names) and float8_converts; not the embeddings, the head or anything outside the blocks,
    whose precision the loss reads (as torchtitan leaves its output layer)."""
    inside = tuple(b + "." for b in blocks)
    return tuple(dict.fromkeys(name for name, fan_in, fan_out in linears
                               if name.startswith(inside) and float8_converts(fan_in, fan_out)))


def float8_weight_params(profile: ModelProfile, blocks: Iterable[int]) -> float:
    """Elements of the float8 layers' weights (float8_layers) in these blocks (indices into profile.blocks): what
    FSDP gathers in float8 under a plan's float8 all-gather (Plan.float8_all_gather)."""
    calls = {c.name: c for c in profile.matmul_calls if c.kind == "linear"}
    names = [profile.blocks[i].name for i in blocks]
    return float(sum(calls[n].in_features * calls[n].out_features
                     for n in float8_layers(((c.name, c.in_features, c.out_features) for c in calls.values()), names)))


def float8_weight_shapes(profile: ModelProfile) -> frozenset[tuple[int, int]]:
    """The (out, in) weight shapes of those layers, each way round (a GEMM record names a weight's two dims in the
    order its GEMM reads them): how the cost model finds their GEMMs among the trace's records."""
    calls = {c.name: c for c in profile.matmul_calls if c.kind == "linear"}
    names = float8_layers(((c.name, c.in_features, c.out_features) for c in calls.values()),
                          [b.name for b in profile.blocks])
    shapes = {(calls[n].out_features, calls[n].in_features) for n in names}
    return frozenset(shapes | {(k, n) for n, k in shapes})
