"""The model's structure, read without running it: its repeated blocks (find_blocks, iter_block_modules),
which layers are Linear-like (is_matmul_layer), and its shape facts (hidden size, heads, layers, vocab, FFN)."""

from __future__ import annotations

import collections
from typing import Iterable, Sequence

import torch.nn as nn

from ..errors import ProfileError
from .model_profile import ModelProfile

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)

BlocksSpec = str | Sequence[str] | type | tuple[type, ...] | None


def find_blocks(model: nn.Module, blocks: BlocksSpec = None) -> tuple[str | None, list[tuple[str, nn.Module]], bool]:
    """Find the model's repeated blocks.

    Returns (container path or None, [(fully qualified name, module)], repeated). `blocks` names them
    explicitly: the path of a container (`"model.layers"`), a list of module paths, or a module class
    (every outermost module of that class). Without it, the container (ModuleList, Sequential or
    ModuleDict, at any depth) whose longest run of same-structure children holds the most parameters
    wins. Where no container repeats, the top-level children that hold parameters become the units and
    `repeated` is False.
    """
    if blocks is None:
        return _detected_blocks(model)
    if isinstance(blocks, str):
        return _blocks_in_container(model, blocks)
    if isinstance(blocks, type) or (isinstance(blocks, tuple) and all(isinstance(b, type) for b in blocks)):
        return None, _blocks_of_class(model, blocks), True
    named = dict(model.named_modules())
    paths = list(blocks)
    missing = [p for p in paths if p not in named]
    if missing:
        raise ProfileError(_no_such_blocks(model, missing[0]))
    return None, [(p, named[p]) for p in paths], True


def _blocks_in_container(model: nn.Module, path: str) -> tuple[str, list[tuple[str, nn.Module]], bool]:
    """The children of the module at `path` (blocks="model.layers")."""
    named = dict(model.named_modules())
    if path not in named:
        raise ProfileError(_no_such_blocks(model, path))
    found = [(_join(path, n), m) for n, m in named[path].named_children()]
    if not found:
        raise ProfileError(f"blocks={path!r} names a module with no children; name the container of the layers.")
    return path, found, True


def _blocks_of_class(model: nn.Module, classes: type | tuple[type, ...]) -> list[tuple[str, nn.Module]]:
    """Every outermost module of `classes` (blocks=LlamaDecoderLayer)."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, classes) and not any(name.startswith(f + ".") for f, _ in found):
            found.append((name, module))
    if not found:
        raise ProfileError(f"no module of class {classes} in {type(model).__name__}; {_containers_hint(model)}")
    return found


def _detected_blocks(model: nn.Module) -> tuple[str | None, list[tuple[str, nn.Module]], bool]:
    """The container whose longest same-structure run holds the most parameters; else the top-level children."""
    best_path, best_run, best_numel = None, [], 0
    for path, module in model.named_modules():
        if not isinstance(module, _CONTAINERS):
            continue
        run = _repeated_run(module)
        numel = sum(_numel(m) for _, m in run)
        if numel > best_numel:
            best_path, best_run, best_numel = path, run, numel
    if best_run:
        return best_path, [(_join(best_path, n), m) for n, m in best_run], True
    units = [(n, m) for n, m in model.named_children() if _numel(m) > 0]
    return None, units, False


def _signature(module: nn.Module) -> tuple:
    """Class plus parameter names and shapes: two modules with one signature are the same structure."""
    return (type(module).__qualname__,) + tuple(
        (name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters()
    )


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _repeated_run(container: nn.Module) -> list[tuple[str, nn.Module]]:
    """The longest run of consecutive same-structure children of `container` holding parameters."""
    children = list(container.named_children())
    best: list[tuple[str, nn.Module]] = []
    run: list[tuple[str, nn.Module]] = []
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


def shape_facts(model: nn.Module, units: list[tuple[str, nn.Module]]) -> dict[str, int | None]:
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


def _facts_from_block(facts: dict[str, int | None], units: list[tuple[str, nn.Module]]) -> None:
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
