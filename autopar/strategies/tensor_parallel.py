"""Tensor parallelism (Megatron-style) over the plan's "tp" mesh axis, and sequence parallelism.

In every block, a group of Linear-like layers that read the same input (q/k/v; gate/up; one fused qkv)
is split column-wise (each rank computes a slice of the heads or of the MLP's inner dim) and the layer
that maps the result back to the hidden size is split row-wise (partial sums, all-reduced). One
all-reduce per pair in forward and one in backward; weights, gradients and optimizer state of those
layers shrink by the TP degree.

Which layers pair up is read from the profile's trace of the model (the order of Linear-like calls and
which ones share an input), from a Hugging Face model's own `base_model_tp_plan` where it ships one, and
from common layer names when the model could not be traced. nn.Linear layers use torch's
ColwiseParallel / RowwiseParallel; Hugging Face's Conv1D (GPT-2, transposed weights) and fused
projections (one layer computing q, k and v) use autopar's own styles, which shard the weight with
DTensor placements (a strided shard for fused layers, so every rank holds its own heads of q, k and v
while the full tensor keeps the model's layout) and compute on the local shard.

Sequence parallelism additionally shards the activations between those pairs (norms, dropouts,
residual adds) along the sequence dim: blocks receive and pass on DTensors sharded on dim 1, the
all-reduces become reduce-scatter + all-gather, and norms run under torch's SequenceParallel. The
hidden states are gathered again after a stage's last block, so the code around the blocks
(embeddings, final norm, head, loss) sees plain tensors.

The input embedding (vocab-parallel, RowwiseParallel) and the output head (ColwiseParallel) are split
too when the vocabulary divides by the degree; a head tied to the embedding stays tied. Inside
`autopar.train_step` the loss is vocab-parallel (torch's loss_parallel: cross-entropy on the vocabulary
shards, the full logits never gathered); a plain loop receives the logits gathered.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from ..errors import PlanError
from ..layout import TPPair, outside_inputs, pairs_from_calls
from ..profile import ModelProfile, is_matmul_layer
from .fsdp import unshardable_params

# Attributes of an attention module that count heads or head-sized widths; under TP each rank holds
# 1/tp of them, so they are divided where a module keeps them (e.g. GPT-2's `split_size`).
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
_KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
_WIDTH_ATTRS = ("split_size", "all_head_size", "inner_dim")

# Common names, for models that could not be traced: (column layers, row layer) under one parent.
_NAMED_PAIRS = (
    (("q_proj", "k_proj", "v_proj"), "o_proj"),
    (("query", "key", "value"), None),  # BERT: the row layer is the sibling module's dense layer
    (("wq", "wk", "wv"), "wo"),
    (("c_attn",), "c_proj"),
    (("gate_proj", "up_proj"), "down_proj"),
    (("up_proj",), "down_proj"),
    (("w1", "w3"), "w2"),
    (("fc1",), "fc2"),
    (("c_fc",), "c_proj"),
)


@dataclass(frozen=True)
class TPLayout:
    """What tensor parallelism splits in a model."""

    pairs: tuple[TPPair, ...]
    norms: tuple[str, ...]  # norm layers inside the blocks (sequence-parallel)
    embedding: str | None  # the input embedding (vocab-parallel), if split
    head: str | None  # the output head (column-parallel over the vocabulary), if split
    tied_head: bool  # head and embedding share their weight
    source: str  # "trace", "hf_tp_plan" or "names"
    notes: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------------------------
# Finding the pairs
# ---------------------------------------------------------------------------------------------------
def _hf_tp_plan(model: nn.Module) -> dict[str, str] | None:
    """A Hugging Face model's own TP plan as {fully qualified layer pattern: style}, or None."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None)
    if not isinstance(plan, dict) or not plan:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and not hasattr(model, prefix):
        prefix = ""
    return {(f"{prefix}.{k}" if prefix else k): str(v) for k, v in plan.items()}


def _expand_hf_plan(patterns: dict[str, str], names: Sequence[str]) -> dict[str, str]:
    out = {}
    for name in names:
        for pattern, style in patterns.items():
            if fnmatch.fnmatchcase(name, pattern):
                out[name] = style
                break
    return out


def _pairs_from_names(model: nn.Module, block_names: Sequence[str]) -> list[TPPair]:
    named = dict(model.named_modules())
    pairs: list[TPPair] = []
    for block in block_names:
        # BERT's MLP: block.intermediate.dense (column) -> block.output.dense (row)
        col, row = f"{block}.intermediate.dense", f"{block}.output.dense"
        if is_matmul_layer(named.get(col, nn.Module())) and is_matmul_layer(named.get(row, nn.Module())):
            pairs.append(TPPair(colwise=(col,), rowwise=row, kinds=(is_matmul_layer(named[col]),
                                                                     is_matmul_layer(named[row]))))
        for name, module in named.items():
            if not name.startswith(block + ".") and name != block:
                continue
            children = dict(module.named_children())
            for cols, row in _NAMED_PAIRS:
                if not all(c in children and is_matmul_layer(children[c]) for c in cols):
                    continue
                if row is None:  # BERT: attention.self.{query,key,value} -> attention.output.dense
                    parent, _, _ = name.rpartition(".")
                    row_name = f"{parent}.output.dense"
                    if row_name not in named:
                        continue
                elif row in children and is_matmul_layer(children[row]):
                    row_name = f"{name}.{row}"
                else:
                    continue
                col_names = tuple(f"{name}.{c}" for c in cols)
                if any(col_names[0] in p.colwise for p in pairs):
                    continue
                kinds = tuple(is_matmul_layer(named[c]) for c in col_names) + (is_matmul_layer(named[row_name]),)
                chunks = 3 if cols == ("c_attn",) else 1
                pairs.append(TPPair(colwise=col_names, rowwise=row_name, kinds=kinds, chunks=chunks,
                                    attention=len(cols) >= 3 or chunks == 3))
                break
    return pairs


def _norms(model: nn.Module, block_names: Sequence[str], hidden: int | None) -> tuple[str, ...]:
    out = []
    for name, module in model.named_modules():
        if not any(name.startswith(b + ".") for b in block_names):
            continue
        weight = getattr(module, "weight", None)
        is_norm = isinstance(module, (nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm))) or \
            type(module).__name__.endswith("Norm")
        if is_norm and isinstance(weight, torch.Tensor) and weight.dim() == 1 and \
                (hidden is None or weight.shape[0] == hidden) and not list(module.children()):
            out.append(name)
    return tuple(out)


def _embedding_and_head(model: nn.Module, profile: ModelProfile) -> tuple[str | None, str | None, bool]:
    named = {id(m): n for n, m in model.named_modules()}
    emb = head = None
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    try:
        emb = get_in() if callable(get_in) else None
        head = get_out() if callable(get_out) else None
    except (NotImplementedError, AttributeError):
        emb = head = None
    if emb is None and profile.vocab_size:
        candidates = [m for m in model.modules() if isinstance(m, nn.Embedding) and m.num_embeddings == profile.vocab_size]
        emb = candidates[0] if candidates else None
    if head is None and profile.vocab_size:
        outside = [c for c in profile.matmul_calls if c.out_features == profile.vocab_size
                   and not any(c.name.startswith(b.name + ".") for b in profile.blocks)]
        if outside:
            head = model.get_submodule(outside[-1].name)
    if head is None and isinstance(emb, nn.Embedding):  # untraced: the Linear that shares the embedding's weight
        head = next((m for m in model.modules() if isinstance(m, nn.Linear) and m.weight is emb.weight), None)
    emb_name = named.get(id(emb)) if isinstance(emb, nn.Embedding) else None
    head_name = named.get(id(head)) if isinstance(head, nn.Linear) else None
    tied = emb_name is not None and head_name is not None and head.weight is emb.weight
    if emb_name is not None:
        users = {n.rpartition(".")[0] for n, p in model.named_parameters(remove_duplicate=False) if p is emb.weight}
        if users - {emb_name, head_name if tied else emb_name}:
            # its weight is used elsewhere, by a layer that is not split with it (T5's and BART's stacks each
            # hold an embedding sharing it): keep it whole, and the head tied to it too
            emb_name, head_name, tied = None, None if tied else head_name, False
    return emb_name, head_name, tied


def tp_layout(model: nn.Module, profile: ModelProfile) -> TPLayout:
    """Which layers tensor parallelism splits in `model` (see the module docstring for how they are found)."""
    block_names = [b.name for b in profile.blocks]
    hidden = profile.hidden_dim
    notes: list[str] = []
    hf = _hf_tp_plan(model)
    if profile.matmul_calls:
        all_names = [c.name for c in profile.matmul_calls]
        hf_expanded = _expand_hf_plan(hf, all_names) if hf else None
        source = "hf_tp_plan" if hf_expanded else "trace"
        pairs = []
        outside = outside_inputs(profile)  # per block: cross-attention reads the encoder's output
        for block in block_names:
            calls = [c for c in profile.matmul_calls if c.name.startswith(block + ".")]
            pairs += pairs_from_calls(calls, hidden or 0, hf_expanded or None, outside=outside)
    else:
        source = "names"
        pairs = _pairs_from_names(model, block_names)
        notes.append("the model was not traced: tensor-parallel layers found by their names")
    if not pairs:
        raise PlanError(
            f"tensor parallelism found no Linear layers to split in {profile.model_class}'s blocks (a group of "
            "layers reading one input, then a layer mapping back to the hidden size): set tp=1."
        )
    covered = {b for b in block_names if any(p.rowwise.startswith(b + ".") for p in pairs)}
    if len(covered) < len(block_names):
        notes.append(f"{len(block_names) - len(covered)} of {len(block_names)} blocks have nothing to split")
    emb, head, tied = _embedding_and_head(model, profile)
    return TPLayout(pairs=tuple(pairs), norms=_norms(model, block_names, hidden), embedding=emb, head=head,
                    tied_head=tied, source=source, notes=tuple(notes))


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith("Norm")


def _attentions(named: dict[str, nn.Module], layout: TPLayout) -> list[tuple[TPPair, nn.Module]]:
    """Each attention pair of the layout with the module that holds it (of `named`, the model's modules by name:
    on this pipeline stage)."""
    return [(pair, named[pair.parent]) for pair in layout.pairs if pair.attention and pair.parent in named]


def _unsplit_per_head_tensor(model: nn.Module, profile: ModelProfile, layout: TPLayout) -> tuple[str, tuple] | None:
    """A parameter or buffer of an attention module, outside its split layers, with one entry per head (T5's
    relative attention bias, Swin's relative position bias table): (name, shape), or None. Its attention adds it
    to the scores of every head, and each rank would add all heads' values to its own share of the heads."""
    named = dict(model.named_modules())
    for pair, parent in _attentions(named, layout):
        heads = {profile.num_heads} - {None}
        for module in parent.modules():
            values = [getattr(module, a, None) for a in _HEAD_ATTRS]
            heads |= {v for v in values if isinstance(v, int) and not isinstance(v, bool)}
        split = {id(t) for n in (*pair.colwise, pair.rowwise) if n in named for t in named[n].parameters()}
        for owner_name, owner in parent.named_modules():
            if _is_norm(owner):  # a norm over a head's width acts per head (its gradient: _sum_grads_over_tp)
                continue
            for name, t in [*owner.named_parameters(recurse=False), *owner.named_buffers(recurse=False)]:
                if id(t) not in split and t.is_floating_point() and t.dim() >= 1 and t.shape[-1] in heads:
                    full = ".".join(n for n in (pair.parent, owner_name, name) if n)
                    return full, tuple(t.shape)
    return None


def _head_widths(named: dict[str, nn.Module], pair: TPPair, profile: ModelProfile) -> set[int]:
    """One head's width in an attention pair: its modules' `head_dim`, or the first split layer's output features
    over the heads."""
    widths = {v for m in named[pair.parent].modules() for v in [getattr(m, "head_dim", None)]
              if isinstance(v, int) and not isinstance(v, bool)}
    first = named.get(pair.colwise[0])
    if first is not None and profile.num_heads:
        widths.add(_out_features(first, pair.kinds[0]) // pair.chunks // profile.num_heads)
    return widths


def _norms_on_split_heads(named: dict[str, nn.Module], pair: TPPair,
                          profile: ModelProfile) -> tuple[list[nn.Module], list[str]]:
    """The norms inside an attention module narrower than the hidden size: those over one head's width (Qwen3's,
    Gemma 3's q_norm / k_norm), and the names of those over several heads (OLMo 2's k_norm under grouped-query
    attention). Under TP each rank applies a per-head norm's whole weight to its own heads, so its gradient of
    that weight sums its own heads only: `_sum_grads_over_tp` completes it (hf-sweep-dist, 2026-12-06: gemma3,
    apertus, exaone4, afmoe trained apart under tp=2 before it). A norm over several heads would need its
    statistics from heads on other ranks."""
    per_head, across = [], []
    heads = _head_widths(named, pair, profile)
    for owner_name, owner in named[pair.parent].named_modules():
        widths = {t.shape[-1] for t in owner.parameters(recurse=False) if t.dim() >= 1}
        if not _is_norm(owner) or not widths or not profile.hidden_dim or max(widths) >= profile.hidden_dim:
            continue
        if widths <= heads:
            per_head.append(owner)
        else:
            across.append(".".join(n for n in (pair.parent, owner_name) if n))
    return per_head, across


def _unsplit_param_between_split_layers(named: dict[str, nn.Module], layout: TPLayout) -> str | None:
    """A parameter of a submodule of an attention or MLP module that holds no weight matrix (not a Linear or
    convolution layer) and is no norm (those are `_norms_on_split_heads`' and sequence parallelism's), or None: Apertus's xIELU
    activation between the MLP's column and row layers, whose gradient each rank would sum over its own share of
    the activations only (hf-sweep-dist, 2026-12-06: apertus trained apart under tp=2). Where in the module it acts
    the trace does not say, so it is refused, not summed. The module's own parameters are not looked at: a layer
    scale there (ConvNeXt's, BEiT's) multiplies the row layer's whole output."""
    split = {id(t) for pair in layout.pairs for n in (*pair.colwise, pair.rowwise) if n in named
             for t in named[n].parameters()}
    for pair in layout.pairs:
        if pair.parent not in named:
            continue
        for owner_name, owner in named[pair.parent].named_modules():
            own = list(owner.named_parameters(recurse=False))
            if not owner_name or _is_norm(owner) or any(t.dim() > 1 for _, t in own):  # (a layer with a weight)
                continue
            for name, t in own:
                if id(t) not in split and t.requires_grad:
                    return ".".join(n for n in (pair.parent, owner_name, name) if n)
    return None


def tensor_parallel_refusal(model: nn.Module, profile: ModelProfile) -> str | None:
    """Why tensor parallelism cannot split `model` correctly at any degree (one line), or None: no layers to
    split, a 0-d parameter (FSDP2 keeps it out of its sharding as a plain replicated tensor, autopar.strategies.
    fsdp; beside the tensor-parallel DTensors its gradient is not checked), or a per-head tensor of an attention
    module that the split layers do not cover, or a fused nn.Linear projection of q, k and v (whose layout the
    trace does not show)."""
    try:
        layout = tp_layout(model, profile)
    except PlanError as exc:
        return str(exc).rstrip(".")
    return _refusal(model, profile, layout)


def _refusal(model: nn.Module, profile: ModelProfile, layout: TPLayout) -> str | None:
    scalars = [n for n, _ in unshardable_params(model)]
    if scalars:
        return (f"tensor parallelism would leave the 0-d parameter{'s' if len(scalars) > 1 else ''} "
                f"{', '.join(scalars[:3])} of {profile.model_class} a plain tensor beside the tensor-parallel "
                "DTensors, which autopar does not support: set tp=1 (data parallelism handles it)")
    fused = next((pair.colwise[0] for pair in layout.pairs if pair.chunks > 1 and pair.kinds[0] == "linear"), None)
    if fused is not None:
        # GPT-2's Conv1D computes [q | k | v], each over all heads (split by a strided shard); a fused nn.Linear may
        # interleave them per head instead (GPT-NeoX's, CodeGen's, Persimmon's), which the strided shard splits
        # wrongly, and the trace does not say which (hf-sweep-dist, 2026-12-06: gpt_neox, codegen, fuyu trained
        # 0.2-0.5% off one process under tp=2, silently)
        return (f"tensor parallelism cannot tell how {profile.model_class}'s fused projection {fused} lays out its "
                "parts (query, key and value, or gate and up: each whole in turn, or interleaved per head or "
                "channel), and a wrong guess trains wrongly without an error: set tp=1")
    named = dict(model.named_modules())
    across = next((n for pair, _ in _attentions(named, layout) for n in _norms_on_split_heads(named, pair, profile)[1]),
                  None)
    if across is not None:
        return (f"tensor parallelism would split the heads that {across} normalizes together (a norm over several "
                "heads' width), so each rank would normalize its own heads only: set tp=1")
    per_head = _unsplit_per_head_tensor(model, profile, layout)
    if per_head is not None:
        name, shape = per_head
        return (f"tensor parallelism splits {profile.model_class}'s attention heads over the ranks, but not "
                f"{name} {shape}, which holds a value per head that the attention adds to every head's scores: "
                "set tp=1")
    between = _unsplit_param_between_split_layers(named, layout)
    if between is not None:
        return (f"tensor parallelism would keep {between} whole on every rank inside a module whose activations it "
                "splits, where its gradient would be each rank's share only: set tp=1")
    return None


def check_tensor_parallel(model: nn.Module, profile: ModelProfile, tp: int) -> TPLayout:
    """The layout, after checking that tensor parallelism can split the model (`tensor_parallel_refusal`) and
    that every split dim divides by `tp` (the message names the dim)."""
    layout = tp_layout(model, profile)
    why = _refusal(model, profile, layout)
    if why is not None:
        raise PlanError(why + ".")
    named = dict(model.named_modules())
    if profile.num_heads and profile.num_heads % tp:
        raise PlanError(f"tp={tp} does not divide the {profile.num_heads} attention heads (num_heads): "
                        f"choose a tp that divides {profile.num_heads}.")
    if profile.num_kv_heads and profile.num_kv_heads % tp:
        raise PlanError(f"tp={tp} does not divide the {profile.num_kv_heads} key/value heads (num_kv_heads): "
                        f"choose a tp that divides {profile.num_kv_heads}.")
    for pair in layout.pairs:
        for name, kind in zip(pair.colwise, pair.kinds):
            if name not in named:  # on another pipeline stage
                continue
            out = _out_features(named[name], kind)
            if (out // pair.chunks) % tp:
                raise PlanError(f"tp={tp} does not divide the output features of {name} ({out // pair.chunks}"
                                f"{' per fused projection' if pair.chunks > 1 else ''}): choose another tp.")
    return layout


def _out_features(module: nn.Module, kind: str) -> int:
    return module.out_features if kind == "linear" else module.weight.shape[1]


# ---------------------------------------------------------------------------------------------------
# autopar's own parallel styles: local compute on DTensor-sharded weights
# ---------------------------------------------------------------------------------------------------
def _strided(dim: int, chunks: int) -> Any:
    from torch.distributed.tensor import Shard

    if chunks == 1:
        return Shard(dim)
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # pragma: no cover - torch without strided sharding
        raise PlanError("fused projections need DTensor's strided sharding, which this torch lacks: set tp=1.") from None
    return _StridedShard(dim, split_factor=chunks)


def _distribute(module: nn.Module, name: str, mesh: DeviceMesh, placement: Any) -> None:
    from torch.distributed.tensor import distribute_tensor

    param = getattr(module, name, None)
    if param is None:
        return
    module.register_parameter(name, nn.Parameter(distribute_tensor(param.detach(), mesh, [placement]),
                                                 requires_grad=param.requires_grad))


def _col_forward(module: nn.Module, mesh: DeviceMesh, kind: str, x: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Partial, Replicate

    # Megatron's f: identity forward, all-reduce of the input's gradient in backward (gathered along the
    # sequence first under sequence parallelism: all-gather forward, reduce-scatter backward).
    if isinstance(x, DTensor):
        full = x.redistribute(mesh, [Replicate()])
    else:
        full = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    x_local = full.to_local(grad_placements=[Partial()])
    weight = module.weight.to_local()
    bias = module.bias.to_local() if module.bias is not None else None
    if kind == "linear":
        return F.linear(x_local, weight, bias)
    out = x_local @ weight  # conv1d: weight is (in, out / tp)
    return out + bias if bias is not None else out


def _row_forward(module: nn.Module, mesh: DeviceMesh, kind: str, sequence_parallel: bool, x: torch.Tensor) -> Any:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    x_local = x.to_local() if isinstance(x, DTensor) else x
    weight = module.weight.to_local()
    partial = F.linear(x_local, weight) if kind == "linear" else x_local @ weight
    # Megatron's g: all-reduce of the partial sums (reduce-scatter along the sequence under SP).
    out = DTensor.from_local(partial, mesh, [Partial()], run_check=False)
    out = out.redistribute(mesh, [Shard(1)] if sequence_parallel else [Replicate()])
    if module.bias is not None:
        out = out + module.bias
    return out if sequence_parallel else out.to_local()


def _apply_local_colwise(module: nn.Module, mesh: DeviceMesh, *, kind: str, chunks: int) -> None:
    _distribute(module, "weight", mesh, _strided(0 if kind == "linear" else 1, chunks))
    _distribute(module, "bias", mesh, _strided(0, chunks))
    module.forward = functools.partial(_col_forward, module, mesh, kind)


def _apply_local_rowwise(module: nn.Module, mesh: DeviceMesh, *, kind: str, sequence_parallel: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard

    _distribute(module, "weight", mesh, Shard(1 if kind == "linear" else 0))
    _distribute(module, "bias", mesh, Replicate())
    module.forward = functools.partial(_row_forward, module, mesh, kind, sequence_parallel)


class _SumGradOverTP(torch.autograd.Function):
    """Megatron's f on a weight every rank holds whole but applies to its own share of the heads: identity
    forward; backward sums the gradient over the tensor-parallel ranks (each rank's holds its heads' part)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        ctx.mesh = mesh
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        from torch.distributed import _functional_collectives as funcol

        summed = funcol.all_reduce(grad.contiguous(), "sum", ctx.mesh)
        return (summed.wait() if isinstance(summed, funcol.AsyncCollectiveTensor) else summed), None


def _summing_forward(module: nn.Module, mesh: DeviceMesh, forward: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.nn.utils.stateless import _reparametrize_module

    # The module's own forward, reading its parameters through _SumGradOverTP (the parameters FSDP has in place
    # at this call; the state dict's names unchanged).
    weights = {name: _SumGradOverTP.apply(p, mesh) for name, p in module.named_parameters(recurse=False)}
    with _reparametrize_module(module, weights):
        return forward(*args, **kwargs)


def _sum_grads_over_tp(module: nn.Module, mesh: DeviceMesh) -> None:
    """Complete the gradients of `module`'s own parameters (a q/k norm over one head's width) over the TP ranks."""
    module.forward = functools.partial(_summing_forward, module, mesh, module.forward)


# ---------------------------------------------------------------------------------------------------
# Applying
# ---------------------------------------------------------------------------------------------------
def _divide_attrs(module: nn.Module, tp: int, profile: ModelProfile) -> list[str]:
    """Make an attention module's head counts and head-sized widths local; returns what was changed."""
    changed = []
    hidden = profile.hidden_dim
    for attrs, value in ((_HEAD_ATTRS, profile.num_heads), (_KV_HEAD_ATTRS, profile.num_kv_heads),
                         (_WIDTH_ATTRS, hidden)):
        for attr in attrs:
            current = getattr(module, attr, None)
            if isinstance(current, int) and not isinstance(current, bool) and value and current == value \
                    and current % tp == 0:
                setattr(module, attr, current // tp)
                changed.append(attr)
    return changed


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    profile: ModelProfile,
    blocks: Sequence[tuple[str, nn.Module]],
    sequence_parallel: bool,
    stage_ends: Sequence[str] = (),
    split_embeddings: bool = True,
) -> TPLayout:
    """Split `model`'s blocks (those in `blocks`: a pipeline stage's own) over `tp_mesh`; see the module docstring."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)

    tp = tp_mesh.size()
    layout = check_tensor_parallel(model, profile, tp)
    present = {name for name, _ in blocks}
    named = dict(model.named_modules())

    def in_blocks(name: str) -> bool:
        return any(name.startswith(b + ".") for b in present)

    styles: dict[str, Any] = {}
    for pair in layout.pairs:
        if not in_blocks(pair.rowwise):
            continue
        for name, kind in zip(pair.colwise, pair.kinds):
            if kind == "linear" and pair.chunks == 1:
                sharded_input = sequence_parallel and name not in pair.replicated  # (an encoder's output: whole)
                styles[name] = ColwiseParallel(input_layouts=Shard(1) if sharded_input else Replicate(),
                                               output_layouts=Shard(-1), use_local_output=True)
            else:
                _apply_local_colwise(named[name], tp_mesh, kind=kind, chunks=pair.chunks)
        row_kind = pair.kinds[-1]
        if row_kind == "linear":
            styles[pair.rowwise] = RowwiseParallel(input_layouts=Shard(-1),
                                                   output_layouts=Shard(1) if sequence_parallel else Replicate(),
                                                   use_local_output=not sequence_parallel)
        else:
            _apply_local_rowwise(named[pair.rowwise], tp_mesh, kind=row_kind, sequence_parallel=sequence_parallel)
        if pair.attention:  # the attention module and those inside it (BERT's and BigBird's self-attention under
            # the module that holds the output projection too keeps all_head_size for its reshape)
            for module in named[pair.parent].modules():
                _divide_attrs(module, tp, profile)
            for norm in _norms_on_split_heads(named, pair, profile)[0]:
                _sum_grads_over_tp(norm, tp_mesh)
    if sequence_parallel:
        for norm in layout.norms:
            if in_blocks(norm):
                styles[norm] = SequenceParallel()
        stage_blocks = [name for name, _ in blocks]
        for index, name in enumerate(stage_blocks):
            if profile.block_input == "arg0" or profile.block_input is None:
                rest = (None,) * (profile.block_num_args - 1)  # other positional inputs stay as they are
                styles[name] = PrepareModuleInput(input_layouts=(Replicate(), *rest),
                                                  desired_input_layouts=(Shard(1), *rest), use_local_output=False)
            else:
                kw = profile.block_input.split(":", 1)[1]
                styles[name] = PrepareModuleInput(input_kwarg_layouts={kw: Replicate()},
                                                  desired_input_kwarg_layouts={kw: Shard(1)}, use_local_output=False)
        arity = profile.block_output_arity
        ends = [n for n in (stage_ends or stage_blocks[-1:]) if n in present]
        out_layouts = Shard(1) if arity == 0 else (Shard(1),) + (None,) * (arity - 1)
        want = Replicate() if arity == 0 else (Replicate(),) + (None,) * (arity - 1)
        parallelize_module(model, tp_mesh, {n: s for n, s in styles.items() if n not in ends})
        # The last block of a stage both prepares its input and gathers its output again, so that the code
        # after the blocks (or the next pipeline stage) receives plain tensors.
        for last in ends:
            parallelize_module(named[last], tp_mesh, styles[last])
            parallelize_module(named[last], tp_mesh, PrepareModuleOutput(output_layouts=out_layouts,
                                                                         desired_output_layouts=want,
                                                                         use_local_output=True))
    elif styles:
        parallelize_module(model, tp_mesh, styles)

    # The vocabulary: embedding rows and head columns split over the TP ranks, logits gathered.
    emb, head = layout.embedding, layout.head
    vocab_ok = profile.vocab_size is not None and profile.vocab_size % tp == 0
    if split_embeddings and vocab_ok:
        if emb is not None and emb in named:
            parallelize_module(named[emb], tp_mesh, RowwiseParallel(input_layouts=Replicate(),
                                                                    output_layouts=Replicate()))
        if head is not None and head in named:
            # Logits stay split over the vocabulary inside autopar.train_step (vocab-parallel loss);
            # a plain loop receives them gathered.
            parallelize_module(named[head], tp_mesh, ColwiseParallel(input_layouts=Replicate(),
                                                                     output_layouts=Shard(-1),
                                                                     use_local_output=False))
            named[head].register_forward_hook(_gather_logits)
    _retie(model, profile)
    return layout


_LOSS_PARALLEL = threading.local()


def _gather_logits(module: nn.Module, args: Any, output: Any) -> Any:
    """The split head's logits, gathered over the vocabulary unless a vocab-parallel loss is running."""
    from torch.distributed.tensor import DTensor, Replicate

    if getattr(_LOSS_PARALLEL, "active", False) or not isinstance(output, DTensor):
        return None
    return output.redistribute(output.device_mesh, [Replicate()]).to_local()


@contextlib.contextmanager
def loss_parallel_scope(enabled: bool):
    """Within it, a split head returns its logits split over the vocabulary and cross-entropy runs on the
    shards (torch's loss_parallel): the full logits tensor never exists. Forward, loss and backward must all
    run inside it."""
    if not enabled:
        yield
        return
    from torch.distributed.tensor.parallel import loss_parallel

    previous = getattr(_LOSS_PARALLEL, "active", False)
    _LOSS_PARALLEL.active = True
    try:
        with loss_parallel():
            yield
    finally:
        _LOSS_PARALLEL.active = previous


def _retie(model: nn.Module, profile: ModelProfile) -> None:
    """Parameters the model shared before (tied embedding and head, BERT's decoder bias) share again: the
    styles above give each module its own new (sharded) Parameter."""
    from torch.distributed.tensor import DTensor

    for group in profile.tied_params:
        params = []
        for name in group:
            try:
                params.append(model.get_parameter(name))
            except AttributeError:  # not on this pipeline stage
                continue
        if len({id(p) for p in params}) <= 1:
            continue
        keep = next((p for p in params if isinstance(p, DTensor)), params[0])
        for name in group:
            owner, _, attr = name.rpartition(".")
            try:
                setattr(model.get_submodule(owner), attr, keep)
            except AttributeError:
                continue
