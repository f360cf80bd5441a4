"""The model's structure, read without running it: its blocks (find_blocks, iter_block_modules), which layers
are Linear-like (is_matmul_layer), and its shape facts (hidden size, heads, layers, vocab, FFN).

A block is the unit autopar shards (FSDP), checkpoints and compiles: a transformer layer, a vision stage's
residual block, an MoE layer. A model's blocks may lie in several containers (an encoder-decoder's two
stacks, a two-tower model's towers, a vision model's stages): see find_blocks and docs/profile.md#blocks."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch.nn as nn

from ..errors import ProfileError
from .model_profile import ModelProfile

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
# A class of blocks is kept beside the largest one when its blocks hold at least this share of the largest
# class's parameters (an encoder beside its decoder: kept; wav2vec2's small convolutional feature extractor
# beside its transformer layers: left outside the blocks).
_SIGNIFICANT_SHARE = 0.1
# A stage's blocks: the container inside a stage that holds at least this share of the stage's parameters.
_STAGE_SHARE = 0.5

BlocksSpec = str | Sequence[str] | type | tuple[type, ...] | None
Units = list[tuple[str, nn.Module]]


def find_blocks(model: nn.Module, blocks: BlocksSpec = None) -> tuple[str | None, Units, bool]:
    """Find the model's blocks.

    Returns (container path or None, [(fully qualified name, module)], repeated); found blocks come in the
    model's module order (an encoder's before its decoder's), named ones in the order given.
    The path is the one container that holds every block; None when they lie in several (an encoder-decoder),
    were given as paths or a class, or nothing repeats.

    `blocks` names them explicitly: the path of a container (`"model.layers"`: its children); a sequence of
    paths, each a block, or a container standing for its children (a ModuleList or ModuleDict, or any path
    written `"path.*"`), e.g. `("encoder.block", "decoder.block")`; a module class or tuple of classes (every
    outermost module of them). Without it, see `_detected_blocks`. Where nothing repeats, the model's
    top-level units hold the parameters and `repeated` is False.
    """
    if blocks is None:
        found = _detected_blocks(model)
    elif isinstance(blocks, str):
        found = _blocks_in_container(model, blocks)
    elif isinstance(blocks, type) or (isinstance(blocks, tuple) and all(isinstance(b, type) for b in blocks)):
        found = None, _blocks_of_class(model, blocks), True
    else:
        found = _listed_blocks(model, list(blocks))
    return _without_bare_containers(*found)


_NO_FORWARD = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)  # torch's containers without one


def _runs_forward(module: nn.Module) -> bool:
    """Whether the module has a forward to call (_NO_FORWARD's have none)."""
    return not isinstance(module, _NO_FORWARD)


def _without_bare_containers(path: str | None, units: Units, repeated: bool) -> tuple[str | None, Units, bool]:
    """A unit that runs no forward of its own (a ModuleList or ModuleDict: a stage that is only a list of its
    blocks, PoolFormer's, PVT's; a ParameterList or ParameterDict, whose parameters the model reads directly) can be
    no block: FSDP2 gathers a unit's parameters when it is called, and the trace attributes a block's work to its
    call. Its children stand in for it, recursively (the blocks then lie in several containers: path None); its own
    parameters stay with the unit around it (the model's, for a top-level one)."""
    def expand(name: str, module: nn.Module) -> Units:
        if _runs_forward(module):
            return [(name, module)]
        return [u for n, c in module.named_children() if _numel(c) > 0 for u in expand(_join(name, n), c)]

    if all(_runs_forward(m) for _, m in units):
        return path, units, repeated
    return None, [u for name, module in units for u in expand(name, module)], repeated


def _blocks_in_container(model: nn.Module, path: str) -> tuple[str, Units, bool]:
    """The children of the module at `path` (blocks="model.layers")."""
    named = dict(model.named_modules())
    if path not in named:
        raise ProfileError(_no_such_blocks(model, path))
    found = [(_join(path, n), m) for n, m in named[path].named_children()]
    if not found:
        raise ProfileError(f"blocks={path!r} names a module with no children; name the container of the layers.")
    return path, found, True


def _listed_blocks(model: nn.Module, paths: list[str]) -> tuple[str | None, Units, bool]:
    """blocks=[...]: each path a block, or a container (a ModuleList / ModuleDict, or "path.*") for its children."""
    named = dict(model.named_modules())
    found: Units = []
    containers: list[str] = []
    for path in paths:
        target = path[:-2] if path.endswith(".*") else path
        if target not in named:
            raise ProfileError(_no_such_blocks(model, target))
        if path.endswith(".*") or isinstance(named[target], (nn.ModuleList, nn.ModuleDict)):
            containers.append(target)
            found += _blocks_in_container(model, target)[1]
        else:
            found.append((path, named[path]))
    _check_distinct([n for n, _ in found])
    path = containers[0] if len(paths) == 1 and containers else None
    return path, found, True


def _check_distinct(names: list[str]) -> None:
    """Each listed block once, none inside another (FSDP and checkpointing wrap each block on its own)."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ProfileError(f"blocks: {name!r} is named twice; name each block once.")
        seen.add(name)
    for name in names:
        parts = name.split(".")
        outer = next((".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in seen), None)
        if outer is not None:
            raise ProfileError(f"blocks: {name!r} lies inside the block {outer!r}; name blocks none of which "
                               "holds another.")


def _blocks_of_class(model: nn.Module, classes: type | tuple[type, ...]) -> Units:
    """Every outermost module of `classes` (blocks=LlamaDecoderLayer)."""
    found: Units = []
    for name, module in model.named_modules():
        if isinstance(module, classes) and not any(name.startswith(f + ".") for f, _ in found):
            found.append((name, module))
    if not found:
        raise ProfileError(f"no module of class {classes} in {type(model).__name__}; {_containers_hint(model)}")
    return found


# ---- finding the blocks --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Group:
    """Blocks found in one container: its children of one class."""

    container: str  # the container's path ("" for the model itself)
    members: tuple[tuple[str, nn.Module], ...]  # (fully qualified name, module), in the container's order
    cls: str  # the members' class
    repeats: bool  # two consecutive members have the same structure

    @property
    def numel(self) -> int:
        return sum(_numel(m) for _, m in self.members)


def _detected_blocks(model: nn.Module) -> tuple[str | None, Units, bool]:
    """The model's blocks, found from its structure alone:

    1. Every container (ModuleList, Sequential, ModuleDict) whose children include blocks: a run of two or
       more consecutive children of one structure (class, parameter names, shapes and dtypes). The blocks are
       the run's class's children of that container, so a first layer that differs (T5's relative position
       bias, DeepSeek's dense layers before the MoE ones, a ResNet stage's first bottleneck) is one too; of
       leaf layers (plain nn.Linear), only the run. Two or more composite children of one class count too
       where none repeat (tiny configs with one layer of each kind).
    2. The outermost of those: a container inside another container's block is part of that block (an MoE
       layer's experts, a bottleneck's convolutions).
    3. Stages: where a container's blocks all differ and each holds one container of blocks with most of its
       parameters (Swin's, ConvNeXt's and ResNet's stages), the stages' blocks are the blocks.
    4. Every class of blocks holding at least a tenth of the largest class's parameters: both stacks of an
       encoder-decoder, both towers of CLIP, every stage.
    Where no container has blocks, the top-level units (see `_top_level_units`) stand in, not repeated.
    """
    groups = [g for group in _outermost(_candidate_groups(model)) for g in _stage_blocks(group)]
    kept = _significant(groups)
    if not kept:
        return None, _top_level_units(model), False
    order = {name: i for i, (name, _) in enumerate(model.named_modules(remove_duplicate=False))}
    found = sorted((m for g in kept for m in g.members), key=lambda m: order.get(m[0], len(order)))
    containers = {g.container for g in kept}
    return (containers.pop() if len(containers) == 1 else None), found, True


def _candidate_groups(model: nn.Module) -> list[_Group]:
    out = []
    for path, module in model.named_modules():
        if isinstance(module, _CONTAINERS):
            group = _group_of(path, module, min_members=2)
            if group is not None:
                out.append(group)
    return out


def _group_of(path: str, container: nn.Module, *, min_members: int) -> _Group | None:
    """The blocks among `container`'s children (step 1 of `_detected_blocks`), or None."""
    children = [(n, c) for n, c in container.named_children() if _numel(c) > 0]
    run = _repeated_run(container)
    if run:
        cls = type(run[0][1])
        members = [(n, c) for n, c in children if type(c) is cls] if _composite(run[0][1]) else run
        return _Group(path, tuple((_join(path, n), c) for n, c in members), cls.__qualname__, True)
    by_class = collections.Counter(type(c) for _, c in children)
    if not by_class:
        return None
    cls, count = max(by_class.items(), key=lambda kv: (kv[1], sum(_numel(c) for _, c in children if type(c) is kv[0])))
    members = [(n, c) for n, c in children if type(c) is cls]
    if count < min_members or not _composite(members[0][1]):
        return None
    return _Group(path, tuple((_join(path, n), c) for n, c in members), cls.__qualname__, False)


def _outermost(groups: list[_Group]) -> list[_Group]:
    """The groups that do not lie inside another group's block (step 2)."""
    members = {name for g in groups for name, _ in g.members}

    def inside(path: str) -> bool:
        parts = path.split(".") if path else []
        return any(".".join(parts[:i]) in members for i in range(1, len(parts) + 1))

    return [g for g in groups if not inside(g.container)]


def _stage_blocks(group: _Group) -> list[_Group]:
    """The blocks inside each stage where `group`'s members are stages (step 3), else [group]."""
    if group.repeats:
        return [group]
    inner = [_blocks_of_stage(name, module) for name, module in group.members]
    if any(g is None for g in inner) or len({g.cls for g in inner}) != 1:
        return [group]
    return inner


def _blocks_of_stage(name: str, stage: nn.Module) -> _Group | None:
    """The container inside `stage` holding most of its parameters, whose children (one class, composite) are
    its blocks; the shallowest such one."""
    total = _numel(stage)
    for path, module in stage.named_modules():
        if path and isinstance(module, _CONTAINERS) and _numel(module) >= _STAGE_SHARE * total:
            group = _group_of(_join(name, path), module, min_members=1)
            if group is not None and len({type(m) for _, m in group.members}) == 1 and \
                    group.numel == _numel(module):
                return group
    return None


def _significant(groups: list[_Group]) -> list[_Group]:
    """The groups of every block class holding at least _SIGNIFICANT_SHARE of the largest class's parameters."""
    by_class: dict[str, int] = collections.defaultdict(int)
    for g in groups:
        by_class[g.cls] += g.numel
    if not by_class:
        return []
    largest = max(by_class.values())
    return [g for g in groups if by_class[g.cls] >= _SIGNIFICANT_SHARE * largest]


def _top_level_units(model: nn.Module) -> Units:
    """The top-level children that hold parameters; through a wrapper that holds one child and nothing else
    (an MLP's `net` Sequential, a classifier around its network), that child's children."""
    prefix, module = "", model
    while True:
        units = [(_join(prefix, n), m) for n, m in module.named_children() if _numel(m) > 0]
        if len(units) != 1 or list(units[0][1].parameters(recurse=False)) or not _composite(units[0][1]):
            return units
        prefix, module = units[0]


def _signature(module: nn.Module) -> tuple:
    """Class plus parameter names and shapes: two modules with one signature are the same structure."""
    return (type(module).__qualname__,) + tuple(
        (name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters()
    )


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _composite(module: nn.Module) -> bool:
    """The module is made of submodules with parameters (a layer, not a leaf such as nn.Linear)."""
    return any(_numel(c) > 0 for c in module.children())


def _repeated_run(container: nn.Module) -> Units:
    """The longest run of consecutive same-structure children of `container` holding parameters."""
    children = list(container.named_children())
    best: Units = []
    run: Units = []
    for name, child in children:
        if run and _signature(child) == _signature(run[-1][1]):
            run.append((name, child))
        else:
            run = [(name, child)]
        if len(run) >= 2 and _numel(run[0][1]) > 0:
            if sum(_numel(m) for _, m in run) > sum(_numel(m) for _, m in best):
                best = list(run)
    return best


def _join(prefix: str | None, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _containers_hint(model: nn.Module) -> str:
    found = [f"{p or '<root>'} ({type(m).__name__}, {len(list(m.children()))} children)"
             for p, m in model.named_modules() if isinstance(m, _CONTAINERS)]
    if not found:
        return "the model has no ModuleList, Sequential or ModuleDict: pass blocks=[...] with the paths of its layers."
    return "containers in the model: " + ", ".join(found[:8]) + ("..." if len(found) > 8 else "")


def _no_such_blocks(model: nn.Module, path: str) -> str:
    return f"blocks: no module at {path!r} in {type(model).__name__}; {_containers_hint(model)}"


def iter_block_modules(model: nn.Module, profile: ModelProfile) -> Iterable[tuple[str, nn.Module]]:
    """The model's block modules, by the names the profile recorded."""
    named = dict(model.named_modules())
    for block in profile.blocks:
        if block.name not in named:
            raise ProfileError(
                f"the profile names a block {block.name!r} that this model does not have: the profile was made "
                "for another model; profile this one."
            )
        yield block.name, named[block.name]


def is_norm_layer(module: nn.Module) -> bool:
    """A norm layer: nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, or any module whose class name ends in "Norm"."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)) or type(module).__name__.endswith("Norm")


def is_matmul_layer(module: nn.Module) -> str | None:
    """"linear" for nn.Linear, "conv1d" for Hugging Face's Conv1D (transposed weight), else None."""
    if isinstance(module, nn.Linear):
        return "linear"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None \
            and module.weight.dim() == 2:
        return "conv1d"
    return None


def _config_value(config: object, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def shape_facts(model: nn.Module, units: Units) -> dict[str, int | None]:
    """Hidden size, heads, layers, vocab and FFN size: from a Hugging Face style config, else from structure
    (`units`: the repeated blocks, or [] where nothing repeats)."""
    cfg = getattr(model, "config", None)
    facts = {
        "hidden_dim": _config_value(cfg, "hidden_size", "n_embd", "hidden_dim", "d_model", "dim"),
        "num_heads": _config_value(cfg, "num_attention_heads", "n_head", "num_heads", "n_heads"),
        "num_kv_heads": _config_value(cfg, "num_key_value_heads", "n_kv_heads", "num_kv_heads"),
        "num_layers": _config_value(cfg, "num_hidden_layers", "n_layer", "num_layers", "n_layers"),
        "vocab_size": _config_value(cfg, "vocab_size"),
        "ffn_dim": _config_value(cfg, "intermediate_size", "n_inner", "ffn_dim"),
    }
    if units:
        _facts_from_block(facts, units)
    if facts["vocab_size"] is None:
        embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
        if embeddings:
            facts["vocab_size"] = max(m.num_embeddings for m in embeddings)
    if facts["num_kv_heads"] is None and facts["num_heads"] is not None and cfg is not None:
        facts["num_kv_heads"] = facts["num_heads"]
    return facts


def _facts_from_block(facts: dict[str, int | None], units: Units) -> None:
    """Fill the layers, heads and hidden size the config left out from the blocks (heads from the first
    submodule that names them, hidden size from the most common Linear input width)."""
    if facts["num_layers"] is None:
        facts["num_layers"] = len(units)
    block = units[0][1]
    if facts["num_heads"] is None:
        for m in block.modules():
            facts["num_heads"] = _config_value(m, "num_heads", "n_head", "num_attention_heads", "n_heads")
            if facts["num_heads"]:
                break
    if facts["hidden_dim"] is None:
        dims = collections.Counter(m.in_features for m in block.modules() if isinstance(m, nn.Linear))
        if dims:
            facts["hidden_dim"] = dims.most_common(1)[0][0]
