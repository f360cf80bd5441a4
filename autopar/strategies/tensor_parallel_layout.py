"""What tensor parallelism splits in a model, and whether it can split it correctly.

`tp_layout` finds the pairs (the column layers reading one input, the row layer mapping back to the hidden size)
from the profile's trace, a Hugging Face model's `base_model_tp_plan` or common layer names, the norms inside the
blocks (sequence-parallel) and the vocabulary's embedding and head. `tensor_parallel_refusal` and
`check_tensor_parallel` say, in one line, why a model cannot be split or why a degree does not divide it.
autopar.strategies.tensor_parallel applies the layout.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

from ..errors import PlanError
from ..layout import TPPair, outside_inputs, pairs_from_calls
from ..profile import ModelProfile, is_matmul_layer, is_norm_layer
from .fsdp import unshardable_params

# Attributes of an attention module that count heads or head-sized widths; under TP each rank holds
# 1/tp of them, so they are divided where a module keeps them (e.g. GPT-2's `split_size`).
HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
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
                                    attention=len(cols) >= 3 or chunks == 3,
                                    parts_layout="whole" if chunks == 3 else ""))  # (GPT-2's c_attn: [q | k | v])
                break
    return pairs


def _norms(model: nn.Module, block_names: Sequence[str], hidden: int | None) -> tuple[str, ...]:
    out = []
    for name, module in model.named_modules():
        if not any(name.startswith(b + ".") for b in block_names):
            continue
        weight = getattr(module, "weight", None)
        if is_norm_layer(module) and isinstance(weight, torch.Tensor) and weight.dim() == 1 and \
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
            pairs += pairs_from_calls(calls, hidden or 0, hf_expanded or None, outside=outside,
                                      num_heads=profile.num_heads)
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
    split = {n for pair in pairs for n in norms_on_split_outputs(pair, profile)}  # not sequence-parallel: split
    return TPLayout(pairs=tuple(pairs), norms=tuple(n for n in _norms(model, block_names, hidden) if n not in split),
                    embedding=emb, head=head, tied_head=tied, source=source, notes=tuple(notes))


def norms_on_split_outputs(pair: TPPair, profile: ModelProfile) -> list[str]:
    """The norms that read one of the pair's column layers' whole output, as the trace recorded them (OLMo 2's q_norm
    and k_norm: each over all heads of its projection): tensor parallelism splits them with it (tensor_parallel's
    `_apply_split_norm`: each rank normalizes its share with the statistics of the whole width). Not for a fused
    layer (its output holds several parts), and none where the trace did not record norm calls."""
    if pair.chunks != 1 or not profile.norm_calls:
        return []
    widths = {c.output_id: c.out_features for c in profile.matmul_calls if c.name in pair.colwise and c.output_id >= 0}
    names: list[str] = []
    for call in profile.norm_calls:
        if widths.get(call.input_id) == call.width and call.name not in names:
            names.append(call.name)
    return names


def rms_norm_like(module: nn.Module) -> bool:
    """Whether `module` computes an RMS norm over its input's last dim with a per-channel scale (`a * x / sqrt(mean(x
    ** 2) + eps)`, `a` its weight or 1 + its weight): what `_apply_split_norm` needs, as two random inputs show on a
    copy (meta weights given random values). A LayerNorm (its mean subtracted) is not."""
    import copy

    width = getattr(module, "weight", None)
    if not isinstance(width, torch.Tensor) or width.dim() != 1:
        return False
    probe = copy.deepcopy(module)
    if any(t.is_meta for t in [*probe.parameters(), *probe.buffers()]):
        probe = probe.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            for p in probe.parameters():
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            x = torch.randn(2, 3, width.shape[0], generator=gen)
            x[1] = x[1] * 3 + 0.5
            y = probe.float()(x)
        r = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        scale = y / r
    except Exception:  # a norm that cannot run on its own like this
        return False
    return bool(torch.allclose(scale, scale[0, :1].expand_as(scale), rtol=1e-3, atol=1e-4))


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
            values = [getattr(module, a, None) for a in HEAD_ATTRS]
            heads |= {v for v in values if isinstance(v, int) and not isinstance(v, bool)}
        split = _split_param_ids(named, [pair]) | {id(getattr(owner, name))
                                                   for owner, name in per_head_params(named, pair, profile)}
        for owner_name, owner in parent.named_modules():
            if is_norm_layer(owner):  # a norm over a head's width acts per head (its gradient: _sum_grads_over_tp)
                continue
            for name, t in [*owner.named_parameters(recurse=False), *owner.named_buffers(recurse=False)]:
                if id(t) not in split and t.is_floating_point() and t.dim() >= 1 and t.shape[-1] in heads:
                    full = ".".join(n for n in (pair.parent, owner_name, name) if n)
                    return full, tuple(t.shape)
    return None


def _split_param_ids(named: dict[str, nn.Module], pairs: Sequence[TPPair]) -> set[int]:
    """The ids of the parameters of the pairs' column and row layers (those tensor parallelism splits)."""
    return {id(t) for pair in pairs for n in (*pair.colwise, pair.rowwise) if n in named
            for t in named[n].parameters()}


def per_head_params(named: dict[str, nn.Module], pair: TPPair, profile: ModelProfile) -> list[tuple[nn.Module, str]]:
    """The trainable parameters of an attention module (its own, or an nn.Embedding's inside it) with one entry per
    query head along their last dim (T5's relative attention bias, GPT-OSS's attention
    sinks, Swin's relative position bias table): (owner module, parameter name). Tensor parallelism splits them
    along that dim with the heads (tensor_parallel's `_apply_per_head_params`), so each rank holds its own heads'
    values. Per-head buffers, and tensors with one entry per key/value head, stay refused."""
    if not pair.attention or pair.parent not in named or not profile.num_heads:
        return []
    split = _split_param_ids(named, [pair])
    out = []
    for owner_name, owner in named[pair.parent].named_modules():
        if owner_name and not isinstance(owner, nn.Embedding):  # the attention's own, or a lookup table's
            continue
        for name, t in owner.named_parameters(recurse=False):
            if id(t) not in split and t.requires_grad and t.is_floating_point() and t.dim() >= 1 \
                    and t.shape[-1] == profile.num_heads:
                out.append((owner, name))
    return out


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
    that weight sums its own heads only: tensor_parallel's `_sum_grads_over_tp` completes it (hf-sweep-dist, 2026-12-06: gemma3,
    apertus, exaone4, afmoe trained apart under tp=2 before it). A norm over several heads would need its
    statistics from heads on other ranks."""
    per_head, across = [], []
    heads = _head_widths(named, pair, profile)
    split = norms_on_split_outputs(pair, profile)
    for owner_name, owner in named[pair.parent].named_modules():
        widths = {t.shape[-1] for t in owner.parameters(recurse=False) if t.dim() >= 1}
        if not is_norm_layer(owner) or not widths or not profile.hidden_dim or max(widths) >= profile.hidden_dim:
            continue
        if ".".join(n for n in (pair.parent, owner_name) if n) in split:  # split with its projection
            continue
        if widths <= heads:
            per_head.append(owner)
        else:
            across.append(".".join(n for n in (pair.parent, owner_name) if n))
    return per_head, across


def _unsplit_param_between_split_layers(named: dict[str, nn.Module], layout: TPLayout) -> str | None:
    """A parameter of a submodule of an attention or MLP module that holds no weight matrix (not a Linear or
    convolution layer) and is no norm (the norms: `_norms_on_split_heads` and sequence parallelism), or None:
    Apertus's xIELU activation between the MLP's column and row layers, whose gradient each rank would sum over its
    own share of the activations only (hf-sweep-dist, 2026-12-06: apertus trained apart under tp=2). Where in the
    module it acts the trace does not say, so it is refused, not summed. The module's own parameters are not looked
    at: a layer scale there (ConvNeXt's, BEiT's) multiplies the row layer's whole output."""
    split = _split_param_ids(named, layout.pairs)
    for pair in layout.pairs:
        if pair.parent not in named:
            continue
        for owner_name, owner in named[pair.parent].named_modules():
            own = list(owner.named_parameters(recurse=False))
            if not owner_name or is_norm_layer(owner) or any(t.dim() > 1 for _, t in own):  # (a layer with a weight)
                continue
            for name, t in own:
                if id(t) not in split and t.requires_grad:
                    return ".".join(n for n in (pair.parent, owner_name, name) if n)
    return None


def tensor_parallel_refusal(model: nn.Module, profile: ModelProfile) -> str | None:
    """Why tensor parallelism cannot split `model` correctly at any degree (one line), or None: no layers to
    split, a 0-d parameter (FSDP2 keeps it out of its sharding as a plain replicated tensor, autopar.strategies.
    fsdp; beside the tensor-parallel DTensors its gradient is not checked), a fused nn.Linear projection whose
    layout neither the trace nor the model's own plan shows, a norm over several heads' width, a per-head tensor of
    an attention module that the split layers do not cover, or a learned parameter between the split layers that
    is no layer's and no norm's (`_unsplit_param_between_split_layers`)."""
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
    fused = next((pair.colwise[0] for pair in layout.pairs
                  if pair.chunks > 1 and pair.kinds[0] == "linear" and pair.parts_layout != "whole"), None)
    if fused is not None:
        # GPT-2's Conv1D computes [q | k | v], each over all heads (split by a strided shard); a fused nn.Linear may
        # interleave them per head instead (GPT-NeoX's, CodeGen's, Persimmon's), which the strided shard splits
        # wrongly (hf-sweep-dist, 2026-12-06: gpt_neox, codegen, fuyu trained 0.2-0.5% off one process under tp=2,
        # silently). Where the trace saw how the model cuts the output (autopar.layout.fused_parts_layout), that
        # decides; else this refusal.
        return (f"tensor parallelism cannot tell how {profile.model_class}'s fused projection {fused} lays out its "
                "parts (query, key and value, or gate and up: each whole in turn, or interleaved per head or "
                "channel), and a wrong guess trains wrongly without an error: set tp=1")
    named = dict(model.named_modules())
    unlike = next((n for pair in layout.pairs for n in norms_on_split_outputs(pair, profile)
                   if n in named and not rms_norm_like(named[n])), None)
    if unlike is not None:
        return (f"tensor parallelism would split the width that {unlike} normalizes (it reads a split projection's "
                "whole output), and autopar splits only RMS norms, whose statistic it sums over the ranks: set tp=1")
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
