"""Models named on the command line, and their profiles at full depth without tracing full depth.

`autopar plan MODEL` takes MODEL as one of:

- a **built-in spec** name (`known_specs()`): GPT-2 shapes on `autopar.models.gpt` (`gpt2`, `gpt2-medium`,
  `gpt2-large`, `gpt2-xl`) and Llama shapes on `autopar.models.llama` (`llama-1b`, `llama3-8b`,
  `llama3-70b`, `llama3-405b`);
- a **Hugging Face config** (a `config.json` file, or a folder holding one): the model is built with
  `transformers.AutoModelForCausalLM.from_config` on the meta device (transformers is optional);
- **`module:factory`**: `factory()` (called under `torch.device("meta")`, so a large model takes no
  memory) returns an `nn.Module`, or `(model, sample)`.

`model_profiles(source, ...)` returns the fp32 profile the planner reads and the bf16 traces its bf16
plans need ("bf16": autocast, "bf16-pure": bf16 weights as FSDP's mixed precision runs; only on
topologies with bf16), each traced when the cost model first reads it. Specs and Hugging Face configs
are traced at depths 2 and 3 (meta device, a sample of 1 x seq_len tokens) and extended to their full
depth by `autopar.profile.extrapolate_profile`, which is exact for models whose blocks are identical:
planning a 405B model costs a 3-layer trace. A factory's model is traced as it is, at its own depth.

A plan made from an extrapolated profile has no model to fingerprint: `autopar plan` writes it with
`model_fingerprint: null`, which `Plan.check_model` accepts for any model (wrap then checks the plan's
degrees against the model itself: heads, blocks, vocabulary).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from .errors import ModelSpecError
from .profile import ModelProfile, extrapolate_profile, profile_model
from ._util.batch import sample_batch_size
from .topology import Topology
from .planning import TracedVariants
from .models.gpt import GPTConfig
from .models.llama import LlamaConfig
from .models.gpt import GPT
from .models.llama import Llama
from .models.gpt import lm_loss

# Depths of the two traces a profile is extended from (`extrapolate_profile`).
SHALLOW_DEPTH, DEEPER_DEPTH = 2, 3


@dataclass(frozen=True)
class ModelSpec:
    """A built-in model shape. `family` is "gpt" (autopar.models.gpt) or "llama" (autopar.models.llama)."""

    name: str
    family: str
    hidden_dim: int
    num_layers: int
    num_heads: int
    vocab_size: int
    seq_len: int  # the default sequence length (and, for GPT, the length of the position table)
    num_kv_heads: int | None = None  # llama only
    ffn_dim: int | None = None  # llama only (GPT: 4 x hidden)
    description: str = ""

    def config(self, *, num_layers: int | None = None, seq_len: int | None = None) -> Any:
        """The model config at `num_layers` (default: full depth), taking sequences of `seq_len` tokens."""
        layers = num_layers or self.num_layers
        if self.family == "gpt":
            return GPTConfig(vocab_size=self.vocab_size, seq_len=self.seq_len, num_layers=layers,
                             hidden_dim=self.hidden_dim, num_heads=self.num_heads)
        return LlamaConfig(vocab_size=self.vocab_size, seq_len=max(self.seq_len, seq_len or 0), num_layers=layers,
                           hidden_dim=self.hidden_dim, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                           ffn_dim=self.ffn_dim)

    def build(self, *, num_layers: int | None = None, seq_len: int | None = None) -> nn.Module:
        """The model, on the current default device (use `with torch.device("meta")` for no memory)."""
        cfg = self.config(num_layers=num_layers, seq_len=seq_len)
        if self.family == "gpt":
            return GPT(cfg)
        return Llama(cfg)


def _gpt(name: str, hidden: int, layers: int, heads: int, what: str) -> ModelSpec:
    # GPT-2's shapes (Radford et al. 2019), with the vocabulary padded from 50,257 to 50,304 (a multiple
    # of 64, as nanoGPT trains it) and tied embeddings; 1,024 positions.
    return ModelSpec(name=name, family="gpt", hidden_dim=hidden, num_layers=layers, num_heads=heads,
                     vocab_size=50304, seq_len=1024, description=what)


SPECS: dict[str, ModelSpec] = {s.name: s for s in (
    _gpt("gpt2", 768, 12, 12, "GPT-2 small, 124M"),
    _gpt("gpt2-medium", 1024, 24, 16, "GPT-2 medium, 355M"),
    _gpt("gpt2-large", 1280, 36, 20, "GPT-2 large, 774M"),
    _gpt("gpt2-xl", 1600, 48, 25, "GPT-2 XL, 1.5B"),
    ModelSpec(name="llama-1b", family="llama", hidden_dim=2048, num_layers=16, num_heads=32, num_kv_heads=8,
              ffn_dim=8192, vocab_size=32000, seq_len=2048, description="Llama, 1.1B (Llama 2 vocabulary)"),
    # Llama 3 shapes (Meta, "The Llama 3 Herd of Models", 2024, table 3); 8,192-token context.
    ModelSpec(name="llama3-8b", family="llama", hidden_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
              ffn_dim=14336, vocab_size=128256, seq_len=8192, description="Llama 3 8B"),
    ModelSpec(name="llama3-70b", family="llama", hidden_dim=8192, num_layers=80, num_heads=64, num_kv_heads=8,
              ffn_dim=28672, vocab_size=128256, seq_len=8192, description="Llama 3 70B"),
    ModelSpec(name="llama3-405b", family="llama", hidden_dim=16384, num_layers=126, num_heads=128, num_kv_heads=8,
              ffn_dim=53248, vocab_size=128256, seq_len=8192, description="Llama 3 405B"),
)}


def known_specs() -> tuple[str, ...]:
    return tuple(SPECS)


# ---------------------------------------------------------------------------------------------------
# MODEL arguments
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSource:
    """What a MODEL argument resolved to: how to build it (at a chosen depth, where that is possible) and
    how to feed and score it for the trace."""

    kind: str  # "spec", "hf" or "factory"
    name: str  # what the user typed
    model_class: str  # for people
    num_layers: int | None  # full depth (None: unknown, the model is traced as it is)
    default_seq_len: int | None  # the sequence length when none is given (None: the sample's, or required)
    max_seq_len: int | None  # the longest sequence the model takes (None: no limit known)
    build: Callable[[int | None, int], nn.Module] | None = None  # (num_layers, seq_len) -> model on meta
    make_sample: Callable[[int], Any] | None = None  # seq_len -> one-sample batch on meta
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    model: nn.Module | None = None  # a factory's model (built once)
    sample: Any = None  # a factory's sample, if it gave one
    description: str = ""

    @property
    def extrapolated(self) -> bool:
        """Whether profiles come from shallow traces (so plans carry no model fingerprint)."""
        return self.build is not None


def _token_sample(seq_len: int, *, labels: bool = False) -> Any:
    tokens = torch.zeros((1, seq_len), dtype=torch.long, device="meta")
    return {"input_ids": tokens, "labels": tokens} if labels else tokens


def resolve_model(model: str) -> ModelSource:
    """A built-in spec name, a Hugging Face config.json (or a folder with one), or `module:factory`."""
    if not isinstance(model, str) or not model.strip():
        raise ModelSpecError(f"MODEL must be a spec name, a config.json path or module:factory; got {model!r}.")
    model = model.strip()
    if model in SPECS:
        return _spec_source(SPECS[model])
    lowered = {k.lower(): k for k in SPECS}
    if model.lower() in lowered:
        return _spec_source(SPECS[lowered[model.lower()]])
    path = Path(model).expanduser()
    if path.is_file() or (path.is_dir() and (path / "config.json").is_file()):
        return _hf_source(path)
    if ":" in model and not path.exists() and not os.path.isabs(model):
        return _factory_source(model)
    if path.suffix == ".json" or os.sep in model:
        raise ModelSpecError(f"no Hugging Face config at {model}: give the path of a config.json file (or of the "
                             "folder that holds it).")
    raise ModelSpecError(
        f"unknown model {model!r}. Built-in specs: {', '.join(SPECS)}. Or give the path of a Hugging Face "
        "config.json, or module:factory (a function returning an nn.Module, or (model, sample))."
    )


def _spec_source(spec: ModelSpec) -> ModelSource:
    def build(num_layers: int | None, seq_len: int) -> nn.Module:
        with torch.device("meta"):
            return spec.build(num_layers=num_layers, seq_len=seq_len)

    cls = "GPT" if spec.family == "gpt" else "Llama"
    return ModelSource(kind="spec", name=spec.name, model_class=cls, num_layers=spec.num_layers,
                       default_seq_len=spec.seq_len, max_seq_len=spec.seq_len if spec.family == "gpt" else None,
                       build=build, make_sample=_token_sample, loss_fn=lm_loss, description=spec.description)


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ModelSpecError("a Hugging Face config needs the transformers package: pip install transformers") from None
    return transformers


_LAYER_NAMES = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_POSITION_NAMES = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
# The default sequence for a Hugging Face model: its context, at most this (long-context models such as
# Llama 3.1's 131,072 positions are trained mostly on shorter sequences).
HF_DEFAULT_SEQ_CAP = 4096


def _hf_source(path: Path) -> ModelSource:
    transformers = _import_transformers()
    file = path / "config.json" if path.is_dir() else path
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelSpecError(f"cannot read {file} as a Hugging Face config (JSON): {exc}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ModelSpecError(f"{file} has no model_type: it is not a Hugging Face config.json (save one with "
                             "config.save_pretrained(folder)).")
    try:
        config = transformers.AutoConfig.for_model(data["model_type"], **{k: v for k, v in data.items()
                                                                          if k != "model_type"})
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelSpecError(f"transformers {transformers.__version__} cannot build a config from {file}: {exc}. "
                             "Upgrade transformers, or fix the file.") from None
    layers_attr = next((n for n in _LAYER_NAMES if isinstance(getattr(config, n, None), int)), None)
    num_layers = getattr(config, layers_attr) if layers_attr else None
    positions = next((getattr(config, n) for n in _POSITION_NAMES if isinstance(getattr(config, n, None), int)), None)

    def at_depth(layers: int | None) -> Any:
        cfg = config
        if layers is not None and layers_attr is not None and layers != num_layers:
            cfg = type(config).from_dict(config.to_dict())
            setattr(cfg, layers_attr, layers)
            for name in ("layer_types", "block_types"):  # per-layer lists (hybrid models) follow the depth
                value = getattr(cfg, name, None)
                if isinstance(value, list) and len(value) >= layers:
                    setattr(cfg, name, value[:layers])
        return cfg

    def build(layers: int | None, seq_len: int) -> nn.Module:
        with torch.device("meta"):
            try:
                return transformers.AutoModelForCausalLM.from_config(at_depth(layers))
            except ValueError as exc:
                raise ModelSpecError(f"transformers cannot build a causal LM from {file} ({data['model_type']}): "
                                     f"{exc}") from None

    return ModelSource(kind="hf", name=str(path), model_class=(data.get("architectures") or [data["model_type"]])[0],
                       num_layers=num_layers, default_seq_len=min(positions, HF_DEFAULT_SEQ_CAP) if positions else None,
                       max_seq_len=positions, build=build if num_layers else None,
                       make_sample=lambda s: _token_sample(s, labels=True),
                       model=None if num_layers else build(None, 0),
                       description=f"Hugging Face {data['model_type']} from {file}")


def _factory_source(spec: str) -> ModelSource:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ModelSpecError(f"{spec!r} is not module:factory (e.g. mypkg.models:build_model).")
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path  # the `autopar` script does not put the cwd on the path
    if added:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelSpecError(f"cannot import {module_name!r} for {spec!r}: {exc}. Run from the folder that holds it, "
                             "or add it to PYTHONPATH.") from None
    finally:
        if added:
            sys.path.remove(cwd)
    factory: Any = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
    if not callable(factory):
        raise ModelSpecError(f"{module_name} has no callable {attr!r}: module:factory names a function that returns "
                             "an nn.Module, or (model, sample).")
    try:
        with torch.device("meta"):  # shapes are all the planner needs: a 70B factory takes no memory
            made = factory()
    except Exception as exc:  # the user's code: say where it failed
        raise ModelSpecError(f"{spec}() failed under torch.device('meta') ({type(exc).__name__}: {exc}); a factory "
                             "for planning must build the model without reading weights.") from exc
    model, sample = (made if isinstance(made, tuple) and len(made) == 2 else (made, None))
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"{spec}() returned {type(made).__name__}; it must return an nn.Module or "
                             "(model, sample).")
    seq = None
    if sample is not None:
        first = _first_int_tensor(sample)
        seq = int(first.shape[1]) if first is not None and first.dim() == 2 else None
    return ModelSource(kind="factory", name=spec, model_class=type(model).__name__, num_layers=None,
                       default_seq_len=seq, max_seq_len=None, model=model, sample=sample,
                       description=f"{type(model).__name__} from {spec}()")


def _first_int_tensor(sample: Any) -> torch.Tensor | None:
    if isinstance(sample, torch.Tensor):
        return sample
    values = sample.values() if isinstance(sample, Mapping) else sample if isinstance(sample, (tuple, list)) else ()
    for v in values:
        if isinstance(v, torch.Tensor):
            return v
    return None


# ---------------------------------------------------------------------------------------------------
# Profiles
# ---------------------------------------------------------------------------------------------------
def precisions_for(topology: Topology) -> tuple[str, ...]:
    """The traces the planner needs on this hardware: fp32, and the two bf16 ones where the GPUs have bf16."""
    if topology.is_gpu and topology.device.supports("bf16"):
        return ("fp32", "bf16", "bf16-pure")
    return ("fp32",)


def model_profiles(source: ModelSource, topology: Topology, *, seq_len: int | None = None
                   ) -> tuple[ModelProfile, TracedVariants]:
    """The fp32 profile of `source` at full depth for one sample of `seq_len` tokens, and its bf16 variants
    (see the module docstring), each traced when first read. Specs and configs are traced at depths 2 and
    3 and extended to full depth."""
    if source.build is not None:
        seq = check_seq_len(source, seq_len)
        full = source.num_layers
        assert full is not None
        sample = source.make_sample(seq)
        depths = (SHALLOW_DEPTH, DEEPER_DEPTH) if full > DEEPER_DEPTH else (full,)
        models = {d: source.build(d, seq) for d in depths}

        def trace(precision: str) -> ModelProfile:
            # dynamo's graph probe (seconds a run) once: the search reads the fp32 profile's breaks, and an
            # extended profile keeps the deeper trace's
            profiles = [profile_model(models[d], sample, loss_fn=source.loss_fn, precision=precision, warn=False,
                                      graphs=precision == "fp32" and d == depths[-1]) for d in depths]
            return profiles[0] if len(profiles) == 1 else extrapolate_profile(profiles[0], profiles[1], full)
    else:
        model = source.model
        assert model is not None
        sample = source.sample
        if sample is None:
            if seq_len is None:
                raise ModelSpecError(f"{source.name} gave no sample: pass --seq N (the model is then fed token ids of "
                                     "shape 1 x N), or return (model, sample) from the factory.")
            sample = _token_sample(seq_len)
        elif seq_len is not None and seq_len != source.default_seq_len:
            raise ModelSpecError(f"{source.name} gave a sample of {source.default_seq_len} tokens, but --seq is "
                                 f"{seq_len}: drop --seq, or return a sample of that length.")

        def trace(precision: str) -> ModelProfile:
            return profile_model(model, sample, loss_fn=source.loss_fn, precision=precision, warn=False,
                                 graphs=precision == "fp32")  # the search reads the fp32 profile's breaks

    return trace("fp32"), TracedVariants(trace, precisions_for(topology)[1:])


def check_seq_len(source: ModelSource, seq_len: int | None) -> int:
    """The sequence length to plan for: `seq_len`, else the model's default; refused past its limit."""
    seq = seq_len if seq_len is not None else source.default_seq_len
    if seq is None:
        raise ModelSpecError(f"{source.name}: no default sequence length is known; pass --seq N.")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 2:
        raise ModelSpecError(f"the sequence length must be an integer of at least 2 tokens, got {seq!r}.")
    if source.max_seq_len is not None and seq > source.max_seq_len:
        raise ModelSpecError(f"{source.name} takes at most {source.max_seq_len} tokens (its position table); "
                             f"--seq {seq} is longer: use --seq {source.max_seq_len} or less.")
    return seq


def model_sample_batch(source: ModelSource) -> int:
    """Samples in the batch the profile was traced on (1 for specs and configs)."""
    return sample_batch_size(source.sample) if source.sample is not None else 1


__all__ = ["ModelSource", "ModelSpec", "ModelSpecError", "SPECS", "TracedVariants", "known_specs", "model_profiles",
           "precisions_for", "resolve_model"]
