"""profile_model: a model's ModelProfile for one sample, from its structure (blocks, parameters, tied weights,
shape facts; blocks.py) and one traced step on fake tensors (trace.py)."""

from __future__ import annotations

import collections
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils.checkpoint import CheckpointError

from .._util.batch import check_sample_fits, first_tensor, sample_batch_size
from .._util.own_checkpointing import own_checkpointing_off
from ..errors import ProfileError, TraceError
from .blocks import BlocksSpec, find_blocks, is_matmul_layer, shape_facts
from .graphs import GraphCount, dynamo_graphs
from .model_profile import BlockProfile, ModelProfile, model_fingerprint
from .remat import CompiledSaved, CompiledSavedProbe
from .trace import Fp32WeightsFound, StepTrace, Trace, Units

# Causes of a TraceError that no other precision can avoid: the step reads tensor values.
_DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)
MAX_REAL_WEIGHT_BYTES = 4 * 2**30  # the most weight bytes a trace reads the values of (_weights_readable); bytes


#: The note of a profile made without a trace (`trace=False`).
NOT_TRACED_NOTE = "not traced (trace=False): FLOPs and activation bytes are unknown (zero here)."


def _random_kept() -> Any:
    """The random states as they were, after the trace: the CPU's, and the current GPU's where CUDA runs."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else [])


def profile_model(
    model: nn.Module,
    sample: Any,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    blocks: BlocksSpec = None,
    precision: str = "fp32",
    warn: bool = True,
    trace: bool = True,
    graphs: bool = True,
    weight_values: bool = False,
) -> ModelProfile:
    """Profile `model` on `sample` (one rank's batch as the user's loop feeds it) without real memory.

    `sample` is passed as `model(sample)`, `model(*sample)` or `model(**sample)`; meta tensors are fine.
    `loss_fn(output, sample) -> scalar` drives backward (it gets fake tensors: it must not capture real
    ones); without it, `output.loss` (Hugging Face with labels) or the sum of the output is used (the
    loss's own FLOPs are then slightly off; the model's are exact).
    `precision="bf16"` profiles under bf16 autocast (activation bytes as a bf16 run saves them);
    `precision="bf16-pure"` with bf16 weights and inputs and no autocast (as FSDP2's mixed precision runs).
    `trace=False` reads only the structure (blocks, parameters); FLOPs and bytes are then zero.
    `graphs=False` skips asking dynamo how many graphs it cuts the forward into (`graph_breaks` stays None:
    autopar.profile.graphs). `weight_values=True` traces with the weights' values beside the fake tensors at once
    (where they are readable), for a model another precision's profile found reads them
    (`ModelProfile.traced_with_weight_values`): the fake-only trace that would fail first is skipped.

    An fp32 step that cannot run on fake tensors is traced in bf16 instead (bf16 weights, then autocast):
    some ops exist only in bf16 there (`torch._grouped_mm`, Hugging Face's MoE experts in transformers 5).
    The profile then says so: its `profile_precision` is the one traced (not "fp32"), with a note (and a
    warning); its FLOPs are the fp32 step's, its bytes a bf16 run's, and only bf16 plans can be predicted.
    A TraceError where no precision runs (the first cause given is fp32's).
    """
    if precision not in ("fp32", "bf16", "bf16-pure"):
        raise ProfileError(f"precision must be 'fp32', 'bf16' or 'bf16-pure', got {precision!r}.")
    if not list(model.parameters()):
        raise ProfileError(f"{type(model).__name__} has no parameters: there is nothing to train or parallelise.")
    batch = sample_batch_size(sample)
    if batch == 0:
        raise ProfileError("the sample is an empty batch (batch size 0): give one batch of at least one sample, as "
                           "the training loop feeds it.")
    check_sample_fits(model, sample)  # a sample that cannot be bound to forward: its own error, before any trace
    scripted = next((n for n, m in model.named_modules() if isinstance(m, torch.jit.ScriptModule)), None)
    if scripted is not None:  # the trace's hooks raised "register_forward_pre_hook is not supported on ScriptModules"
        raise ProfileError(f"{scripted or type(model).__name__} is a TorchScript module (torch.jit.script or trace): "
                           "autopar traces a training step through hooks on the model's modules, and FSDP2 shards "
                           "through the same hooks, which TorchScript modules do not take; pass the eager module "
                           "(TorchScript it after training; torch.compile is autopar's compiler).")
    blocks_path, units, repeated = find_blocks(model, blocks)
    notes: list[str] = []
    if not repeated:
        notes.append(_no_blocks_note(units))
        if warn:
            warnings.warn("autopar: " + notes[-1], stacklevel=2)
    params = _Params.of(model, units)
    compiled = None
    if trace:
        # (the random state kept: a forward that draws, torch.rand as DropPath does, leaves a seeded run as it was;
        # the model's own checkpointing off, which wrap replaces by the plan's: autopar/_util/own_checkpointing.py)
        with _random_kept(), own_checkpointing_off(model):
            t, precision, fallback, compiled, valued = _traced_step(model, sample, units, loss_fn=loss_fn,
                                                                    precision=precision, weight_values=weight_values)
        if fallback is not None:
            notes.append(fallback)
            if warn:
                warnings.warn("autopar: " + fallback, stacklevel=2)
        if t.value_reads:
            notes.append(f"the forward reads tensor values {t.value_reads} time(s) (.item(), `if tensor:`, ops "
                         "shaped by values): torch.compile breaks its graph there, which the cost model cannot "
                         "price, so compiled plans are chosen only by measuring them (autopar tune)")
        containers = (blocks_path,) if blocks_path else tuple(dict.fromkeys(n.rpartition(".")[0] for n, _ in units))
        counted = dynamo_graphs(model, sample, blocks_path=containers if repeated else None) \
            if graphs and not t.value_reads else None
        in_blocks = None if counted is None else counted.in_forward_of(m for _, m in units)
        if counted is not None and counted.num_breaks:
            notes.append(_breaks_note(counted, in_blocks))
    else:
        counted = in_blocks = None
        valued = False
        t = Trace.untraced(len(units))
        notes.append(NOT_TRACED_NOTE)
    first = first_tensor(sample)
    tokens = int(first.shape[1]) if first is not None and first.dim() == 2 and not first.is_floating_point() else None
    block_classes = {type(m).__name__ for _, m in units}
    return ModelProfile(
        model_class=type(model).__name__,
        fingerprint=model_fingerprint(model),
        blocks_path=blocks_path,
        block_class=block_classes.pop() if len(block_classes) == 1 else None,
        repeated=repeated,
        blocks=_block_profiles(units, params, t, compiled),
        num_params=params.num_params,
        num_trainable_params=params.num_trainable,
        num_params_outside_blocks=params.num_params - sum(c for c, _ in params.per_block),
        num_lookup_params=params.num_lookup,
        param_bytes=params.nbytes,
        param_dtype=params.dtype,
        tied_params=params.tied,
        forward_flops=t.forward_flops,
        flops=t.flops,
        saved_bytes_outside_blocks=t.saved_outside_bytes,
        largest_transient_bytes=t.largest_bytes,
        largest_transient_op=t.largest_op,
        largest_transient_where=t.largest_where,
        differentiating_forward=t.differentiated_where,
        buffers_written=t.buffers_written,
        params_written=t.params_written,
        params_unused=t.params_unused,
        sequence_first=t.sequence_first,
        sample_batch_size=batch,
        tokens_per_sample=tokens,
        profile_precision=precision,
        traced=trace,
        root_param_names=tuple(n for n, _ in model.named_parameters(recurse=False)),
        sparse_grad_modules=tuple(n for n, m in model.named_modules()
                                  if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse),
        hooked_params=hooked_parameters(model),
        num_ops=t.num_ops,
        traffic_bytes=t.traffic_bytes, weight_traffic_bytes=t.weight_traffic_bytes, op_groups=t.op_groups,
        value_reads=t.value_reads,
        graph_breaks=None if counted is None else counted.num_breaks,
        graph_breaks_in_blocks=in_blocks,
        matmul_calls=t.matmul_calls,
        norm_calls=t.norm_calls,
        block_input=t.block_input,
        block_input_shape=t.block_input_shape,
        block_num_args=t.block_num_args,
        block_input_bytes=t.block_input_bytes,
        block_output_arity=t.block_output_arity,
        pipeline_chain=t.pipeline_chain,
        modules_before_blocks=t.before,
        modules_after_blocks=t.after,
        notes=tuple(notes),
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),  # each shared buffer once
        compiled_saved_bytes_outside_blocks=compiled.outside_bytes if compiled is not None else None,
        live_frontier=t.live_frontier,
        allocator_reserve_bytes=t.allocator_reserve_bytes,
        allocator_replay_on_cuda=t.allocator_replay_on_cuda,
        traced_with_weight_values=valued,
        bf16_weights=t.bf16_weights,
        **shape_facts(model, units if repeated else []),
    )


def _traced_step(model: nn.Module, sample: Any, units: Units, *, loss_fn: Callable | None, precision: str,
                 weight_values: bool = False) -> tuple[Trace, str, str | None, CompiledSaved | None, bool]:
    """(the trace, the precision traced, a note when that is not the one asked for, what a compiled step saves,
    whether it was traced with the weights' values). An fp32 step that cannot be traced is tried with bf16
    weights, then under bf16 autocast; a data-dependent step (one that reads values its weights compute) is traced
    again with the weights' real values beside the fake tensors, where they are real and at most
    MAX_REAL_WEIGHT_BYTES (no precision changes a value read); `weight_values` goes there at once."""
    if weight_values and _weights_readable(model):
        t, compiled = _traced(model, sample, units, loss_fn, precision, real_weights=True)
        return t, precision, _REAL_WEIGHTS_AGAIN, compiled, True
    try:
        t, compiled = _traced(model, sample, units, loss_fn, precision)
        return t, precision, None, compiled, False
    except TraceError as exc:
        if isinstance(exc.__cause__, CheckpointError):  # the forward checkpoints attention itself (_UNFUSED_NOTE)
            t, compiled = _traced(model, sample, units, loss_fn, precision, flash_like=False)
            return t, precision, _UNFUSED_NOTE, compiled, False
        if isinstance(exc.__cause__, _DATA_DEPENDENT):
            if not _weights_readable(model):
                raise
            t, compiled = _traced(model, sample, units, loss_fn, precision, real_weights=True)
            return t, precision, _real_weights_note(exc), compiled, True
        if precision != "fp32":
            raise
        for fallback in ("bf16-pure", "bf16"):
            try:
                t, compiled = _traced(model, sample, units, loss_fn, fallback)
            except TraceError:
                continue
            return t, fallback, _fp32_untraceable_note(exc, fallback), compiled, False
        raise


_UNFUSED_NOTE = ("traced with torch's own attention on the CPU, not the flash kernel a GPU runs: the forward "
                 "checkpoints attention itself (torch.utils.checkpoint), whose replay in backward runs outside autopar's "
                 "stand-in and found other saved tensors; attention's memory is the math kernel's, above a GPU's")


_REAL_WEIGHTS_AGAIN = ("traced with the weights' own values beside the fake tensors, as another precision's trace of "
                       "this step needed (it reads values the weights compute)")


#: Traces of one bf16 step at most while the weights it gives in bf16 are settled (_traced): the first (stopped early),
#: the one with those weights, and one more where the names missed a block or reached one wrongly.
MAX_BF16_WEIGHT_TRACES = 3


def _traced(model: nn.Module, sample: Any, units: Units, loss_fn: Callable | None, precision: str, *,
            real_weights: bool = False, bf16_weights: tuple[str, ...] = (), attempt: int = 1, flash_like: bool = True
            ) -> tuple[Trace, CompiledSaved | None]:
    """One traced step in `precision`, with the probe that partitions its autograd graph as torch.compile
    would (autopar.profile.remat) in place of the loss function (it calls `loss_fn`). Under bf16 autocast, a step
    whose matmuls read trainable weights in fp32 (autocast does not reach them) is traced again with those weights
    given in bf16, as autopar's autocast gives them (autopar.strategies.precision)."""
    probe = CompiledSavedProbe(loss_fn, len(units))
    step = StepTrace(model, sample, units, loss_fn=probe, precision=precision, real_weights=real_weights,
                     bf16_weights=bf16_weights, stop_at_fp32_weights=not bf16_weights and attempt == 1,
                     flash_like=flash_like)
    probe.weight_storages = step.watcher.weight_storages.copy  # the weights' storages, as the trace knows them
    probe.masks = step.watcher.compile_masks  # which masks torch.compile would build, as the trace finds them
    probe.autocast = precision == "bf16"  # its compiled backward runs under autocast too
    try:
        with probe.hooked(units):
            t = step.run()
    except Fp32WeightsFound as found:  # the first such block: its weights, and the other blocks' of the same names
        return _traced(model, sample, units, loss_fn, precision, real_weights=real_weights,
                       bf16_weights=_in_every_block(found.names, found.block, units, model), attempt=attempt + 1,
                       flash_like=flash_like)
    missed = set(t.fp32_matmul_weights) - set(bf16_weights)
    unread = set(bf16_weights) - set(t.matmul_weights)  # a namesake no matmul reads: autocast was right about it
    if precision == "bf16" and (missed or unread) and attempt < MAX_BF16_WEIGHT_TRACES:  # again, those settled
        return _traced(model, sample, units, loss_fn, precision, real_weights=real_weights,
                       bf16_weights=tuple(sorted((set(bf16_weights) | missed) - unread)), attempt=attempt + 1,
                       flash_like=flash_like)
    return t, probe.result()


def _in_every_block(names: tuple[str, ...], block: int, units: Units, model: nn.Module) -> tuple[str, ...]:
    """`names` (trainable weights of block `block`) and the trainable weights of the same name in every other block
    (an MoE's experts' weights, layer after layer): the weights a bf16 trace gives its forward in bf16."""
    prefix = units[block][0] + "."
    trainable = {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    namesakes = {f"{unit}.{name[len(prefix):]}" for name in names if name.startswith(prefix) for unit, _ in units}
    return tuple(sorted(set(names) | (namesakes & trainable)))


def _weights_readable(model: nn.Module) -> bool:
    """Whether a trace may read the weights' values: they are real (not on the meta device) and at most
    MAX_REAL_WEIGHT_BYTES in all (the ops that need them run for real, on the CPU)."""
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}.values()
    return all(not t.is_meta for t in tensors) and \
        sum(t.numel() * t.element_size() for t in tensors) <= MAX_REAL_WEIGHT_BYTES


def _cause_line(exc: TraceError) -> str:
    """`Type: first line` of what made the trace fail (its __cause__, else itself)."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"


def _real_weights_note(exc: TraceError) -> str:
    return (f"the step reads values the weights compute ({_cause_line(exc)[:250]}), which fake tensors "
            "do not have; it was traced with the weights' own values beside them (the ops that need them run for "
            "real on the CPU), so the plan follows the path this sample and these weights take through the model")


def _fp32_untraceable_note(exc: TraceError, traced: str) -> str:
    how = "with bf16 weights (as FSDP's mixed precision runs)" if traced == "bf16-pure" else "under bf16 autocast"
    return (f"the fp32 step could not be traced on fake tensors ({_cause_line(exc)}), so it was "
            f"traced {how} instead: only bf16 plans can be predicted for this model (an op that runs only in "
            "bf16 does this, e.g. torch._grouped_mm in Hugging Face MoE experts).")


def _breaks_note(counted: GraphCount, in_blocks: bool | None) -> str:
    """What the profile says of dynamo's breaks, and what the search does with them (search.breaks_cut_blocks)."""
    first = counted.break_reasons[0] if counted.break_reasons else "no reason given"
    head = f"torch.compile's dynamo cuts the forward into {counted.num_graphs} graphs (first break: {first})"
    if in_blocks is False:
        return (head + "; the breaks lie outside the blocks, which compile whole, so compiled plans are priced as "
                "usual (a break's own cost, one more graph call, is not)")
    return (head + (", inside the blocks" if in_blocks else "") + ", which the cost model cannot price, so "
            "compiled plans are chosen only by measuring them (autopar tune)")


def _no_blocks_note(units: Units) -> str:
    names = ", ".join(n for n, _ in units) or "(none)"
    return (
        f"no repeated blocks (a ModuleList/Sequential of same-structure layers) found; the top-level "
        f"children ({names}) are the units instead. Sharding and checkpointing then work at that "
        "coarser grain: a whole unit's parameters are gathered at once (higher peak memory, less overlap) "
        "and pipeline stages can only split between those children. Pass blocks='path.to.layers' to name them."
    )


@dataclass(frozen=True)
class _Params:
    """The model's parameters, counted from its real structure."""

    num_params: int  # unique parameters
    num_trainable: int
    nbytes: int  # unique parameter bytes in their dtype
    dtype: str  # the most common dtype
    num_lookup: int  # parameters of embeddings not tied to a matmul
    tied: tuple[tuple[str, ...], ...]  # groups of names that share one Parameter
    per_block: tuple[tuple[int, int], ...]  # (parameters, bytes) per unit, tied ones counted where first seen
    matmul_per_block: tuple[int, ...]  # parameters of each unit's Linear-like layers
    trainable_per_block: tuple[int, ...]  # of per_block's parameters, those that require grad

    @classmethod
    def of(cls, model: nn.Module, units: Units) -> "_Params":
        by_id: dict[int, list[str]] = collections.defaultdict(list)
        for name, p in model.named_parameters(remove_duplicate=False):
            by_id[id(p)].append(name)
        unique = {id(p): p for p in model.parameters()}
        embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        matmul_weights = {id(p) for m in model.modules() if not isinstance(m, nn.Embedding)
                          for p in m.parameters(recurse=False)}
        dtypes = collections.Counter(str(p.dtype).replace("torch.", "") for p in unique.values())
        per_block = _params_per_block(units)
        return cls(
            num_params=sum(p.numel() for p in unique.values()),
            num_trainable=sum(p.numel() for p in unique.values() if p.requires_grad),
            nbytes=sum(p.numel() * p.element_size() for p in unique.values()),
            dtype=dtypes.most_common(1)[0][0],
            num_lookup=sum(unique[i].numel() for i in embedding_weights - matmul_weights if i in unique),
            tied=tuple(tuple(names) for names in by_id.values() if len(names) > 1),
            per_block=tuple((count, nbytes) for count, nbytes, _ in per_block),
            trainable_per_block=tuple(trainable for _, _, trainable in per_block),
            matmul_per_block=tuple(sum(p.numel() for m in module.modules() if is_matmul_layer(m)
                                       for p in m.parameters(recurse=False)) for _, module in units),
        )


def _params_per_block(units: Units) -> list[tuple[int, int, int]]:
    """(parameters, bytes, parameters that require grad) of each unit; a parameter shared by two units counts
    in the first."""
    seen: set[int] = set()
    out = []
    for _, module in units:
        count = nbytes = trainable = 0
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                count += p.numel()
                nbytes += p.numel() * p.element_size()
                trainable += p.numel() if p.requires_grad else 0
        out.append((count, nbytes, trainable))
    return out


def _block_profiles(units: Units, params: _Params, t: Trace, compiled: CompiledSaved | None
                    ) -> tuple[BlockProfile, ...]:
    """One BlockProfile per unit. The counter's per-module FLOPs include backward, so a block's forward FLOPs
    are its total times the step's forward share (the same for every matmul-dominated block to within the
    loss's FLOPs). `compiled`: what a compiled step saves per block (None: not partitioned)."""
    fwd_share = t.forward_flops / t.flops if t.flops else 1 / 3
    return tuple(
        BlockProfile(name=name, num_params=params.per_block[i][0], param_bytes=params.per_block[i][1],
                     forward_flops=t.block_flops[i] * fwd_share, flops=t.block_flops[i], saved_bytes=t.saved_bytes[i],
                     matmul_params=params.matmul_per_block[i], saved_hidden_bytes=t.saved_hidden_bytes[i],
                     selective_saved_bytes=t.selective_bytes[i],
                     alternate_saved_bytes=t.alternate_bytes[i], alternate_recompute_flops=t.alternate_recompute_flops[i],
                     gemm_saved_bytes=t.gemm_bytes[i] if t.gemm_bytes else None,
                     gemm_forward_flops=t.gemm_flops[i] if t.gemm_flops else None,
                     num_trainable_params=params.trainable_per_block[i],
                     compiled_saved_bytes=compiled.block_bytes[i] if compiled is not None else None,
                     compiled_unfused_bytes=compiled.unfused_attention_bytes[i] if compiled is not None else 0)
        for i, (name, _) in enumerate(units)
    )


def hooked_parameters(model: nn.Module) -> tuple[str, ...]:
    """Parameters with a gradient hook of the user's (Tensor.register_hook, register_post_accumulate_grad_hook:
    gradient scaling, an optimizer stepped in backward), which FSDP2 drops when it replaces them with their shards."""
    return tuple(n for n, p in model.named_parameters()
                 if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None))
