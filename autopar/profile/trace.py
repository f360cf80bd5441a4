"""ModelProfile: what the planner knows about a model, measured without a GPU and without real memory.

`profile_model(model, sample)` runs one forward and backward of the model on *fake* tensors
(FakeTensorMode: shapes, dtypes and devices, no data): the model's own parameters are never read,
written or given gradients, and no activation memory is allocated, so a model of any size can be
profiled on a laptop, including one built on the meta device.

It finds the repeated blocks (the transformer layers), counts parameters per block and outside them,
finds tied weights, counts forward and backward FLOPs per block (FlopCounterMode), the bytes each block
saves for backward (saved-tensor hooks) and the largest single tensor the step creates.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import warnings
from dataclasses import asdict, dataclass, field, replace
from dataclasses import fields as dataclass_fields
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from ._util.batch import call_model, default_loss, first_tensor, map_tensors, sample_batch_size, split_sample
from .errors import ProfileError, TraceError

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


# ---------------------------------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------------------------------
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


def find_blocks(
    model: nn.Module, blocks: str | Sequence[str] | type | tuple[type, ...] | None = None
) -> tuple[str | None, list[tuple[str, nn.Module]], bool]:
    """Find the model's repeated blocks.

    Returns (container path or None, [(fully qualified name, module)], repeated). `blocks` names them
    explicitly: the path of a container (`"model.layers"`), a list of module paths, or a module class
    (every outermost module of that class). Without it, the container (ModuleList, Sequential or
    ModuleDict, at any depth) whose longest run of same-structure children holds the most parameters
    wins. Where no container repeats, the top-level children that hold parameters become the units and
    `repeated` is False.
    """
    named = dict(model.named_modules())
    if blocks is not None:
        if isinstance(blocks, str):
            if blocks not in named:
                raise ProfileError(_no_such_blocks(model, blocks))
            container = named[blocks]
            found = [(_join(blocks, n), m) for n, m in container.named_children()]
            if not found:
                raise ProfileError(f"blocks={blocks!r} names a module with no children; name the container of the layers.")
            return blocks, found, True
        if isinstance(blocks, type) or (isinstance(blocks, tuple) and all(isinstance(b, type) for b in blocks)):
            found = []
            for name, module in model.named_modules():
                if isinstance(module, blocks) and not any(name.startswith(f + ".") for f, _ in found):
                    found.append((name, module))
            if not found:
                raise ProfileError(f"no module of class {blocks} in {type(model).__name__}; {_containers_hint(model)}")
            return None, found, True
        paths = list(blocks)
        missing = [p for p in paths if p not in named]
        if missing:
            raise ProfileError(_no_such_blocks(model, missing[0]))
        return None, [(p, named[p]) for p in paths], True

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


# ---------------------------------------------------------------------------------------------------
# The profile
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockProfile:
    """One unit of the model (a transformer layer, or a top-level child where nothing repeats)."""

    name: str  # fully qualified module name, e.g. "transformer.h.3"
    num_params: int  # parameters in the block (tied ones counted where first seen)
    param_bytes: int  # bytes of those parameters in the model's dtype
    forward_flops: float  # FLOPs of the block's forward on the sample
    flops: float  # forward + backward FLOPs of the block on the sample
    saved_bytes: int  # activation bytes the block saves for backward on the sample (no checkpointing)
    matmul_params: int = 0  # parameters of the block's Linear-like layers (what tensor parallelism splits)
    saved_hidden_bytes: int = 0  # of saved_bytes, tensors shaped like the hidden states (batch, seq, hidden)
    selective_saved_bytes: int = 0  # outputs of matmuls and attention in the forward (what selective AC keeps)


@dataclass(frozen=True)
class MatmulCall:
    """One call of a Linear-like layer during the traced step: what tensor parallelism splits."""

    name: str  # fully qualified module name
    kind: str  # "linear" (nn.Linear, weight out x in) or "conv1d" (Hugging Face Conv1D, weight in x out)
    input_id: int  # calls with one input_id read the same tensor (e.g. q, k and v projections)
    in_features: int
    out_features: int


def is_matmul_layer(module: nn.Module) -> str | None:
    """"linear" for nn.Linear, "conv1d" for Hugging Face's Conv1D (transposed weight), else None."""
    if isinstance(module, nn.Linear):
        return "linear"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None \
            and module.weight.dim() == 2:
        return "conv1d"
    return None


@dataclass(frozen=True)
class ModelProfile:
    """What the planner knows about a model, for the sample it was profiled with.

    FLOPs and saved bytes are for one forward and backward of the sample (`sample_batch_size` samples);
    `*_per_sample` helpers scale them, since both are linear in the batch.
    """

    model_class: str
    fingerprint: str  # hash of parameter names and shapes: identifies the architecture, not the weights
    blocks_path: str | None  # container of the blocks ("transformer.h"), None if given as paths/classes
    block_class: str | None
    repeated: bool  # False: no repeated blocks, top-level children are the units
    blocks: tuple[BlockProfile, ...]
    num_params: int  # unique parameters
    num_trainable_params: int
    num_params_outside_blocks: int
    num_lookup_params: int  # parameters of embeddings not tied to a matmul: looked up, no FLOPs
    param_bytes: int  # unique parameter bytes in the model's dtype
    param_dtype: str
    tied_params: tuple[tuple[str, ...], ...]  # groups of names that share one Parameter
    forward_flops: float
    flops: float  # forward + backward FLOPs of one step on the sample
    saved_bytes_outside_blocks: int  # activations saved for backward outside the blocks (embeddings, head, loss)
    largest_transient_bytes: int  # the largest single tensor created by the step
    largest_transient_op: str
    sample_batch_size: int
    tokens_per_sample: int | None  # sequence length for token inputs, else None
    profile_precision: str  # "fp32", "bf16" (autocast) or "bf16-pure" (bf16 weights, as FSDP's mixed precision)
    traced: bool = True  # False: structure only (trace=False), FLOPs and bytes unknown (zero)
    matmul_calls: tuple[MatmulCall, ...] = ()  # Linear-like calls in order (empty when not traced)
    block_input: str | None = None  # how a block receives the hidden states: "arg0" or "kwarg:NAME"
    block_input_shape: tuple[int, ...] | None = None  # shape of those hidden states for the sample (batch first)
    block_num_args: int = 1  # positional arguments a block is called with
    block_input_bytes: int = 0  # bytes of those hidden states (what full checkpointing keeps per block)
    block_output_arity: int = 0  # 0: a block returns a tensor; n: a tuple of n items, hidden states first
    modules_before_blocks: tuple[str, ...] = ()  # modules with parameters called before the first block
    modules_after_blocks: tuple[str, ...] = ()  # ... after the last block (final norm, head)
    root_param_names: tuple[str, ...] = ()  # parameters held by the model itself, not by a submodule
    num_ops: int = 0  # ops that allocate an output in one step (eager kernel launches)
    traffic_bytes: int = 0  # bytes read and written by the non-matmul ops of one step (memory-bound work)
    weight_traffic_bytes: int = 0  # the part of traffic_bytes on weight-shaped tensors (gradient casts and
    #                                accumulation): paid once per micro-batch, not per sample
    hidden_dim: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    num_layers: int | None = None
    vocab_size: int | None = None
    ffn_dim: int | None = None
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        assert self.num_params > 0 and self.sample_batch_size > 0, "profile of an empty model or batch"

    def __hash__(self) -> int:
        """Computed once per object: the cost model caches by profile (pipeline stage splits, TP pairs), and
        hashing every block each time was half of an 80-block model's search."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in dataclass_fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_hash", None)  # string hashes differ between processes
        return state

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_params_in_blocks(self) -> int:
        return sum(b.num_params for b in self.blocks)

    @property
    def saved_bytes(self) -> int:
        """All activation bytes saved for backward by one step on the sample."""
        return sum(b.saved_bytes for b in self.blocks) + self.saved_bytes_outside_blocks

    @property
    def flops_per_sample(self) -> float:
        return self.flops / self.sample_batch_size

    @property
    def saved_bytes_per_sample(self) -> float:
        return self.saved_bytes / self.sample_batch_size

    @property
    def tokens_per_step(self) -> int | None:
        return None if self.tokens_per_sample is None else self.tokens_per_sample * self.sample_batch_size

    def formula_flops(self) -> float | None:
        """6 N + 12 L h s FLOPs per token times the sample's tokens (Kaplan 2020 / PaLM appendix B), or None.

        N counts the parameters that take part in matmuls: lookup-only embeddings are left out (Kaplan's
        non-embedding count, with a tied output head kept since it is a matmul).
        """
        if None in (self.tokens_per_sample, self.hidden_dim, self.num_layers):
            return None
        s = self.tokens_per_sample
        per_token = 6 * (self.num_params - self.num_lookup_params) + 12 * self.num_layers * self.hidden_dim * s
        return per_token * s * self.sample_batch_size

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["blocks"] = [asdict(b) for b in self.blocks]
        d["tied_params"] = [list(g) for g in self.tied_params]
        d["notes"] = list(self.notes)
        d["matmul_calls"] = [asdict(c) for c in self.matmul_calls]
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelProfile":
        """The profile `to_dict` wrote, also after a JSON round trip (lists become the tuples they were):
        `ModelProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p`."""
        if not isinstance(data, Mapping):
            raise ProfileError(f"a profile must be a mapping of field names to values, got {type(data).__name__}.")
        names = {f.name for f in dataclass_fields(cls)}
        unknown = sorted(set(map(str, data)) - names)
        if unknown:
            raise ProfileError(f"unknown profile field(s) {', '.join(unknown)}; ModelProfile.to_dict writes: "
                               f"{', '.join(sorted(names))}.")
        values = dict(data)
        values["blocks"] = tuple(b if isinstance(b, BlockProfile) else BlockProfile(**b)
                                 for b in values.get("blocks", ()))
        values["matmul_calls"] = tuple(c if isinstance(c, MatmulCall) else MatmulCall(**c)
                                       for c in values.get("matmul_calls", ()))
        values["tied_params"] = tuple(tuple(g) for g in values.get("tied_params", ()))
        for name in ("notes", "modules_before_blocks", "modules_after_blocks", "root_param_names"):
            if name in values:
                values[name] = tuple(values[name])
        if values.get("block_input_shape") is not None:
            values["block_input_shape"] = tuple(values["block_input_shape"])
        try:
            return cls(**values)
        except TypeError as exc:
            raise ProfileError(f"not a profile written by ModelProfile.to_dict: {exc}") from None

    def describe(self) -> str:
        def n(x: float) -> str:
            for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
                if abs(x) >= div:
                    return f"{x / div:.2f}{unit}"
            return f"{x:.0f}"

        blocks = (f"{self.num_blocks} x {self.block_class} at {self.blocks_path or '(listed paths)'}"
                  if self.repeated else f"{self.num_blocks} top-level units (no repeated blocks found)")
        lines = [
            f"model {self.model_class} ({self.fingerprint})",
            f"  parameters    {n(self.num_params)} ({n(self.num_params_in_blocks)} in blocks, "
            f"{n(self.num_params_outside_blocks)} outside), {self.param_dtype}, {self.param_bytes / 2**20:.1f} MiB",
            f"  blocks        {blocks}",
        ]
        if self.tied_params:
            lines.append("  tied          " + "; ".join(" = ".join(g) for g in self.tied_params))
        shape = [f"{k}={v}" for k, v in (("hidden", self.hidden_dim), ("heads", self.num_heads),
                                          ("kv_heads", self.num_kv_heads), ("layers", self.num_layers),
                                          ("ffn", self.ffn_dim), ("vocab", self.vocab_size)) if v is not None]
        if shape:
            lines.append("  shape         " + ", ".join(shape))
        tokens = f", {self.tokens_per_sample} tokens each" if self.tokens_per_sample else ""
        lines += [
            f"  sample        {self.sample_batch_size} samples{tokens}",
            f"  per step      {n(self.flops)}FLOP (forward {n(self.forward_flops)}FLOP), "
            f"{self.saved_bytes / 2**20:.1f} MiB saved for backward ({self.profile_precision}), "
            f"largest tensor {self.largest_transient_bytes / 2**20:.1f} MiB ({self.largest_transient_op})",
        ]
        for note in self.notes:
            lines.append(f"  note          {note}")
        return "\n".join(lines)


def model_fingerprint(model: nn.Module) -> str:
    """A short hash of the model class and its parameter names and shapes (not values, not dtype)."""
    items = [type(model).__qualname__] + [
        f"{name}:{tuple(p.shape)}" for name, p in model.named_parameters(remove_duplicate=False)
    ]
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


class _StepWatcher(TorchDispatchMode):
    """Watches every op of the traced step: the largest tensor it creates (bytes, op); which storages derive
    from parameters only (casts, transposes and views of weights, e.g. autocast's bf16 weight copies: those
    are weights, not activations, and do not grow with the batch); how many ops run (kernel launches); the
    bytes the non-matmul ops read and write (memory-bound time); and, per block in the forward, the bytes
    of matmul and attention outputs (what selective checkpointing keeps)."""

    def __init__(self, param_storages: set[Any], current: list[int], num_blocks: int,
                 param_shapes: set[tuple[int, ...]] = frozenset()) -> None:
        super().__init__()
        self.param_shapes = param_shapes  # an op whose every output has a parameter's shape works on weights
        self.weight_traffic_bytes = 0
        self.nbytes, self.op = 0, "none"
        self.weight_storages = set(param_storages)
        self.current = current  # the block stack, shared with the block hooks
        self.forward = True
        self.num_ops = 0
        self.traffic_bytes = 0
        self.selective = [0] * num_blocks
        self._matmul = _matmul_ops()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors_in = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        inputs = [_storage_key(t) for t in tensors_in]
        from_weights = bool(inputs) and all(k in self.weight_storages for k in inputs)
        allocated = 0
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            key = _storage_key(t)
            if from_weights:
                self.weight_storages.add(key)
            elif key not in inputs:  # views allocate nothing
                nbytes = t.numel() * t.element_size()
                allocated += nbytes
                if nbytes > self.nbytes:
                    self.nbytes, self.op = nbytes, str(func.overloadpacket.__name__)
        if allocated:
            self.num_ops += 1
            packet = func.overloadpacket
            if packet in self._matmul:
                if self.forward and self.current:
                    self.selective[self.current[-1]] += allocated
            else:
                moved = allocated + sum(t.numel() * t.element_size() for t in tensors_in)
                self.traffic_bytes += moved
                # Weight traffic: casts of the weights (autocast's copies, forward) and, in backward, ops whose
                # inputs and outputs all have a parameter's shape (gradient casts and accumulation). Inputs
                # count too, so that an activation whose shape happens to match a weight's (tokens = hidden
                # in a flattened 2-D layer) is not taken for one unless everything it touches is.
                if from_weights or (not self.forward and all(tuple(t.shape) in self.param_shapes for t in tensors_in)
                                    and all(tuple(t.shape) in self.param_shapes for t in
                                            torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))):
                    self.weight_traffic_bytes += moved
        return out


# CUDA autocast's float32 ops (torch.amp documentation, "CUDA Ops that can autocast to float32"), by the
# __name__ of the torch function, method or operator that reaches them.
_CUDA_FP32_OPS = frozenset((
    "__pow__", "__rpow__", "__rdiv__", "__rtruediv__", "acos", "asin", "binary_cross_entropy_with_logits", "cosh",
    "cosine_embedding_loss", "cdist", "cosine_similarity", "cross_entropy", "cumprod", "cumsum", "dist", "erfinv",
    "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss", "layer_norm", "log", "log_softmax",
    "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss", "multilabel_margin_loss", "multi_margin_loss",
    "nll_loss", "norm", "normalize", "pdist", "poisson_nll_loss", "pow", "prod", "reciprocal", "rsqrt", "sinh",
    "smooth_l1_loss", "soft_margin_loss", "softmax", "softmin", "softplus", "sum", "renorm", "tan",
    "triplet_margin_loss"))


class _CudaAutocastPolicy(torch.overrides.TorchFunctionMode):
    """CUDA autocast's casts for a bf16 trace run elsewhere (CPU or meta, under that device's autocast, whose
    float32 list differs: CPU autocast runs e.g. `pow` in bf16). The floating-point bf16/fp16 inputs of
    CUDA's float32 ops are cast to float32 first, above autograd as autocast casts, so the trace saves and
    moves the bytes a GPU run does (GPT-2's tanh GELU runs in float32 on a GPU: x ** 3 promotes the chain).
    Measured on an H200 (bench/profile_kernels.py): GPT-2-355M's elementwise kernels are mostly float32."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _CUDA_FP32_OPS and "out" not in kwargs \
                and torch.is_autocast_enabled(self.device_type):  # autocast leaves out= calls alone
            def up(t: Any) -> Any:
                if isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16):
                    return t.float()
                return t

            args, kwargs = torch.utils._pytree.tree_map(up, (tuple(args), kwargs))
        return func(*args, **kwargs)


def _matmul_ops() -> set[Any]:
    """Op packets whose time is FLOPs (matmuls, attention); everything else is memory-bound."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward", "_efficient_attention_forward",
             "convolution")
    return {getattr(aten, n) for n in names if hasattr(aten, n)}


def _flash_like_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                     dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                     enable_gqa: bool = False) -> torch.Tensor:
    """scaled_dot_product_attention as a GPU runs it, for the trace: a fused (flash) kernel in the autocast
    dtype that saves q, k, v, the output and the softmax statistics for backward, never the (seq x seq)
    attention matrix. On CPU tensors torch may pick the unfused math kernel, which saves that matrix in
    fp32 and would overstate a GPU's activation memory many times over."""
    if torch.is_autocast_enabled(query.device.type):
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = (t.to(dtype) for t in (query, key, value))
        if isinstance(attn_mask, torch.Tensor) and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(dtype)
    gqa = key.size(-3) != query.size(-3)
    if gqa:  # grouped-query attention: every query head reads its key/value head
        groups = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
    if gqa and query.dtype == torch.float32:
        # CUDA's fused kernels take grouped-query attention only in 16-bit (flash); in fp32 SDPA falls back to
        # the math kernel, which saves the attention matrix (seen on an H200: a Llama-1B shape in fp32 OOMs).
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale)[0]
    with torch.autocast(query.device.type, enabled=False):
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return out


def _sdpa_flops(q: Sequence[int], k: Sequence[int], v: Sequence[int]) -> int:
    """Forward FLOPs of attention with q (b, hq, sq, d), k (b, hk, sk, d), v (b, hv, sk, dv): two matmuls per
    query head. Grouped-query attention (hk < hq) does as many FLOPs as full attention: every query head
    attends to all keys (torch's own formula refuses hk != hq before torch 2.13)."""
    b, hq, sq, d = q[-4:] if len(q) == 4 else (1, *q[-3:])
    sk, dv = k[-2], v[-1]
    return 2 * b * hq * sq * sk * d + 2 * b * hq * sq * sk * dv


def _sdpa_backward_flops(q: Sequence[int], k: Sequence[int], v: Sequence[int]) -> int:
    """Backward FLOPs of attention as torch 2.13's sdpa_backward_flop_count counts them: the scores again,
    the gradient of the scores, and the gradients of v, q and k (five matmuls per query head)."""
    b, hq, sq, d = q[-4:] if len(q) == 4 else (1, *q[-3:])
    sk, dv = k[-2], v[-1]
    return 2 * b * hq * sq * sk * (3 * d + 2 * dv)


def _flop_formulas() -> dict[Any, Callable[..., int]]:
    """FLOP formulas that replace or add to FlopCounterMode's: every scaled-dot-product-attention kernel
    (CPU flash attention has none in torch; grouped-query attention fails torch's before 2.13)."""
    aten = torch.ops.aten
    out: dict[Any, Callable[..., int]] = {}
    forward = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    for name in forward:
        if hasattr(aten, name):
            out[getattr(aten, name)] = lambda q, k, v, *args, out_shape=None, **kwargs: _sdpa_flops(q, k, v)
        if hasattr(aten, name + "_backward"):
            out[getattr(aten, name + "_backward")] = (
                lambda g, q, k, v, *args, out_shape=None, **kwargs: _sdpa_backward_flops(q, k, v))
    return out


def _storage_key(t: torch.Tensor) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def _config_value(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _shape_facts(model: nn.Module, units: list[tuple[str, nn.Module]]) -> dict[str, int | None]:
    """Hidden size, heads, layers, vocab and FFN size: from a Hugging Face style config, else from structure."""
    cfg = getattr(model, "config", None)
    facts = {
        "hidden_dim": _config_value(cfg, "hidden_size", "n_embd", "hidden_dim", "d_model", "dim"),
        "num_heads": _config_value(cfg, "num_attention_heads", "n_head", "num_heads", "n_heads"),
        "num_kv_heads": _config_value(cfg, "num_key_value_heads", "n_kv_heads", "num_kv_heads"),
        "num_layers": _config_value(cfg, "num_hidden_layers", "n_layer", "num_layers", "n_layers"),
        "vocab_size": _config_value(cfg, "vocab_size"),
        "ffn_dim": _config_value(cfg, "intermediate_size", "n_inner", "ffn_dim"),
    }
    if facts["num_layers"] is None and units:
        facts["num_layers"] = len(units)
    if units:
        block = units[0][1]
        if facts["num_heads"] is None:
            for m in block.modules():
                facts["num_heads"] = _config_value(m, "num_heads", "n_head", "num_attention_heads", "n_heads")
                if facts["num_heads"]:
                    break
        if facts["hidden_dim"] is None:
            dims = collections.Counter(
                m.in_features for m in block.modules() if isinstance(m, nn.Linear)
            )
            if dims:
                facts["hidden_dim"] = dims.most_common(1)[0][0]
    if facts["vocab_size"] is None:
        embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
        if embeddings:
            facts["vocab_size"] = max(m.num_embeddings for m in embeddings)
    if facts["num_kv_heads"] is None and facts["num_heads"] is not None and cfg is not None:
        facts["num_kv_heads"] = facts["num_heads"]
    return facts


def _fake_state(model: nn.Module, fake_mode: Any, device: torch.device, dtype: torch.dtype | None = None
                ) -> dict[str, torch.Tensor]:
    """Fake copies of every parameter and buffer (tied ones stay one tensor), on `device`; floating
    parameters in `dtype` when given (FSDP's mixed precision computes with bf16 weights)."""
    out: dict[str, torch.Tensor] = {}
    memo: dict[int, torch.Tensor] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    ):
        if id(t) not in memo:
            cast = dtype if dtype is not None and isinstance(t, nn.Parameter) and t.is_floating_point() else t.dtype
            with fake_mode:
                fake = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=cast, device=device)
            if isinstance(t, nn.Parameter):
                fake.requires_grad_(t.requires_grad)
            memo[id(t)] = fake
        out[name] = memo[id(t)]
    return out


def _fake_sample(sample: Any, fake_mode: Any, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    def convert(t: torch.Tensor) -> torch.Tensor:
        cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
        with fake_mode:
            return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=cast, device=device)

    return map_tensors(convert, sample)


def _profile_device(model: nn.Module, sample: Any) -> torch.device:
    for t in list(model.parameters()) + ([first_tensor(sample)] if first_tensor(sample) is not None else []):
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


@dataclass
class _Trace:
    """What one traced step measured (zeros when the step is not traced)."""

    forward_flops: float
    flops: float
    block_flops: list[float]
    saved: list[int]
    saved_outside: int
    largest_bytes: int
    largest_op: str
    matmul_calls: tuple[MatmulCall, ...] = ()
    block_input: str | None = None
    block_input_shape: tuple[int, ...] | None = None
    block_num_args: int = 1
    block_input_bytes: int = 0
    block_output_arity: int = 0
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    saved_hidden: list[int] | None = None
    selective: list[int] | None = None
    num_ops: int = 0
    traffic_bytes: int = 0
    weight_traffic_bytes: int = 0


def _trace_step(model: nn.Module, sample: Any, units: list[tuple[str, nn.Module]],
                loss_fn: Callable[[Any, Any], torch.Tensor] | None, precision: str) -> _Trace:
    """One forward and backward on fake tensors: FLOPs per module, bytes saved for backward per unit, and
    the largest tensor created."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call
    from torch.utils.flop_counter import FlopCounterMode

    device = _profile_device(model, sample)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    pure = torch.bfloat16 if precision == "bf16-pure" else None  # FSDP mixed precision: bf16 weights and inputs
    state = _fake_state(model, fake_mode, device, pure)
    fake_sample = _fake_sample(sample, fake_mode, device, pure)
    block_of = {id(m): i for i, (_, m) in enumerate(units)}
    current: list[int] = []
    saved = [0] * len(units)
    saved_outside = 0
    counted: set[Any] = set()

    saved_hidden = [0] * len(units)
    calls: list[MatmulCall] = []
    input_ids: dict[Any, int] = {}
    block_io: dict[str, Any] = {}
    finished = [0]  # blocks whose forward has finished
    before: list[str] = []
    after: list[str] = []

    def outer_hook(module: nn.Module, _args: Any) -> None:
        if current:
            return
        name = outer_names[id(module)]
        if finished[0] == 0 and name not in before:
            before.append(name)
        elif finished[0] == len(units) and name not in after:
            after.append(name)

    def pre_hook(module: nn.Module, args: Any, kwargs: Any) -> None:
        current.append(block_of[id(module)])
        if "input" not in block_io:
            block_io["nargs"] = len(args)
            if args and isinstance(args[0], torch.Tensor):
                block_io["input"], block_io["shape"] = "arg0", tuple(args[0].shape)
                block_io["numel"] = args[0].numel()
                block_io["bytes"] = args[0].numel() * args[0].element_size()
            else:
                tensors = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
                block_io["input"] = f"kwarg:{tensors[0]}" if tensors else None
                block_io["shape"] = tuple(kwargs[tensors[0]].shape) if tensors else None
                block_io["numel"] = kwargs[tensors[0]].numel() if tensors else None
                block_io["bytes"] = kwargs[tensors[0]].numel() * kwargs[tensors[0]].element_size() if tensors else 0

    def post_hook(module: nn.Module, _args: Any, out: Any) -> None:
        current.pop()
        finished[0] += 1 if not current else 0
        if "output" not in block_io:
            block_io["output"] = len(out) if isinstance(out, (tuple, list)) else 0

    def matmul_hook(module: nn.Module, args: Any) -> None:
        if not args or not isinstance(args[0], torch.Tensor):
            return
        key = _storage_key(args[0])
        kind = is_matmul_layer(module)
        in_f, out_f = ((module.in_features, module.out_features) if kind == "linear"
                       else (module.weight.shape[0], module.weight.shape[1]))
        calls.append(MatmulCall(name=names[id(module)], kind=kind, input_id=input_ids.setdefault(key, len(input_ids)),
                                in_features=int(in_f), out_features=int(out_f)))

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved_outside
        key = _storage_key(t)
        if key not in watcher.weight_storages and key not in counted:
            counted.add(key)
            nbytes = t.untyped_storage().nbytes()
            if current:
                saved[current[-1]] += nbytes
                if block_io.get("numel") and t.numel() == block_io["numel"]:
                    saved_hidden[current[-1]] += nbytes
            else:
                saved_outside += nbytes
        return t

    handles = []
    for _, m in units:
        handles.append(m.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(m.register_forward_hook(post_hook))
    names = {}
    outer_names = {}
    for name, m in model.named_modules():
        if is_matmul_layer(m):
            names[id(m)] = name
            handles.append(m.register_forward_pre_hook(matmul_hook))
        if name and list(m.parameters(recurse=False)) and \
                not any(name.startswith(u + ".") or name == u for u, _ in units):
            outer_names[id(m)] = name
            handles.append(m.register_forward_pre_hook(outer_hook))
    flop_counter = FlopCounterMode(display=False, custom_mapping=_flop_formulas())
    watcher = _StepWatcher({_storage_key(t) for t in state.values()}, current, len(units),
                           {tuple(t.shape) for t in state.values() if t.dim() >= 2})
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    # A bf16 profile is for GPU plans: where the trace runs on another device, CUDA autocast's float32 ops
    # are cast as a GPU run casts them (_CudaAutocastPolicy).
    policy = _CudaAutocastPolicy(device.type) if precision == "bf16" and device.type != "cuda" else contextlib.nullcontext()
    import unittest.mock

    flash = unittest.mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", _flash_like_sdpa) \
        if device.type == "cpu" else contextlib.nullcontext()
    try:
        with fake_mode, flop_counter, watcher, flash:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                with autocast, policy:
                    args, kwargs = split_sample(fake_sample)
                    output = functional_call(model, state, args, kwargs, tie_weights=True, strict=False)
                    loss = loss_fn(output, fake_sample) if loss_fn is not None else default_loss(output)
            forward_flops = float(flop_counter.get_total_flops())
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ProfileError("loss_fn must return a scalar tensor.")
            watcher.forward = False
            loss.backward()
    except ProfileError:
        raise
    except Exception as exc:  # a model that cannot run on fake tensors, or a sample that does not fit it
        raise TraceError(
            f"could not run one step of {type(model).__name__} on the sample without real memory "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). Check that the sample is "
            "what the model takes (model(x), model(*tuple) or model(**dict)); a model whose forward reads tensor "
            "values (data-dependent Python control flow) cannot be traced on fake tensors: pass wrap a plan "
            "(then only the model's structure is read: profile_model(..., trace=False))."
        ) from exc
    finally:
        for h in handles:
            h.remove()
    counts = flop_counter.get_flop_counts()
    root = type(model).__name__
    per_block = [float(sum(counts.get(f"{root}.{name}", {}).values())) for name, _ in units]
    return _Trace(forward_flops=forward_flops, flops=float(flop_counter.get_total_flops()), block_flops=per_block,
                  saved=saved, saved_outside=saved_outside, largest_bytes=watcher.nbytes, largest_op=watcher.op,
                  saved_hidden=saved_hidden, selective=watcher.selective, num_ops=watcher.num_ops,
                  traffic_bytes=watcher.traffic_bytes, weight_traffic_bytes=watcher.weight_traffic_bytes,
                  matmul_calls=tuple(calls), block_input=block_io.get("input"), block_input_shape=block_io.get("shape"),
                  block_num_args=block_io.get("nargs", 1), block_input_bytes=block_io.get("bytes", 0) or 0,
                  block_output_arity=block_io.get("output", 0), before=tuple(before), after=tuple(after))


def profile_model(
    model: nn.Module,
    sample: Any,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    blocks: str | Sequence[str] | type | tuple[type, ...] | None = None,
    precision: str = "fp32",
    warn: bool = True,
    trace: bool = True,
) -> ModelProfile:
    """Profile `model` on `sample` (one rank's batch as the user's loop feeds it) without real memory.

    `sample` is passed as `model(sample)`, `model(*sample)` or `model(**sample)`; meta tensors are fine.
    `loss_fn(output, sample) -> scalar` drives backward (it gets fake tensors: it must not capture real
    ones); without it, `output.loss` (Hugging Face with labels) or the sum of the output is used (the
    loss's own FLOPs are then slightly off; the model's are exact).
    `precision="bf16"` profiles under bf16 autocast (activation bytes as a bf16 run saves them);
    `precision="bf16-pure"` with bf16 weights and inputs and no autocast (as FSDP2's mixed precision runs).
    `trace=False` reads only the structure (blocks, parameters); FLOPs and bytes are then zero.
    """
    if precision not in ("fp32", "bf16", "bf16-pure"):
        raise ProfileError(f"precision must be 'fp32', 'bf16' or 'bf16-pure', got {precision!r}.")
    params = list(model.parameters())
    if not params:
        raise ProfileError(f"{type(model).__name__} has no parameters: there is nothing to train or parallelise.")
    batch = sample_batch_size(sample)
    blocks_path, units, repeated = find_blocks(model, blocks)
    notes: list[str] = []
    if not repeated:
        names = ", ".join(n for n, _ in units) or "(none)"
        notes.append(
            f"no repeated blocks (a ModuleList/Sequential of same-structure layers) found; the top-level "
            f"children ({names}) are the units instead. Sharding and checkpointing then work at that "
            "coarser grain: a whole unit's parameters are gathered at once (higher peak memory, less overlap) "
            "and pipeline stages can only split between those children. Pass blocks='path.to.layers' to name them."
        )
        if warn:
            warnings.warn("autopar: " + notes[-1], stacklevel=2)

    # Parameters: unique, per block, tied groups.
    by_id: dict[int, list[str]] = collections.defaultdict(list)
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id[id(p)].append(name)
    tied = tuple(tuple(names) for names in by_id.values() if len(names) > 1)
    unique = {id(p): p for p in model.parameters()}
    seen: set[int] = set()
    block_params: list[tuple[int, int]] = []
    for _, module in units:
        count = nbytes = 0
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                count += p.numel()
                nbytes += p.numel() * p.element_size()
        block_params.append((count, nbytes))
    num_params = sum(p.numel() for p in unique.values())
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    matmul_weights = {id(p) for m in model.modules() if not isinstance(m, nn.Embedding)
                      for p in m.parameters(recurse=False)}
    num_lookup = sum(unique[i].numel() for i in embedding_weights - matmul_weights if i in unique)
    dtypes = collections.Counter(str(p.dtype).replace("torch.", "") for p in unique.values())

    if trace:
        t = _trace_step(model, sample, units, loss_fn, precision)
    else:
        t = _Trace(0.0, 0.0, [0.0] * len(units), [0] * len(units), 0, 0, "not traced")
        notes.append("not traced (trace=False): FLOPs and activation bytes are unknown (zero here).")
    # Forward FLOPs per block: the counter's per-module totals include backward, so take the forward share
    # of the whole step (forward/total is the same for every matmul-dominated block to within the loss's FLOPs).
    fwd_share = t.forward_flops / t.flops if t.flops else 1 / 3
    matmul_params = [sum(p.numel() for m in module.modules() if is_matmul_layer(m) for p in m.parameters(recurse=False))
                     for _, module in units]
    block_profiles = tuple(
        BlockProfile(name=name, num_params=block_params[i][0], param_bytes=block_params[i][1],
                     forward_flops=t.block_flops[i] * fwd_share, flops=t.block_flops[i], saved_bytes=t.saved[i],
                     matmul_params=matmul_params[i],
                     saved_hidden_bytes=(t.saved_hidden or [0] * len(units))[i],
                     selective_saved_bytes=(t.selective or [0] * len(units))[i])
        for i, (name, _) in enumerate(units)
    )
    facts = _shape_facts(model, units if repeated else [])
    first = first_tensor(sample)
    tokens = int(first.shape[1]) if first is not None and first.dim() == 2 and not first.is_floating_point() else None
    block_classes = {type(m).__name__ for _, m in units}
    return ModelProfile(
        model_class=type(model).__name__,
        fingerprint=model_fingerprint(model),
        blocks_path=blocks_path,
        block_class=block_classes.pop() if len(block_classes) == 1 else None,
        repeated=repeated,
        blocks=block_profiles,
        num_params=num_params,
        num_trainable_params=sum(p.numel() for p in unique.values() if p.requires_grad),
        num_params_outside_blocks=num_params - sum(c for c, _ in block_params),
        num_lookup_params=num_lookup,
        param_bytes=sum(p.numel() * p.element_size() for p in unique.values()),
        param_dtype=dtypes.most_common(1)[0][0],
        tied_params=tied,
        forward_flops=t.forward_flops,
        flops=t.flops,
        saved_bytes_outside_blocks=t.saved_outside,
        largest_transient_bytes=t.largest_bytes,
        largest_transient_op=t.largest_op,
        sample_batch_size=batch,
        tokens_per_sample=tokens,
        profile_precision=precision,
        traced=trace,
        root_param_names=tuple(n for n, _ in model.named_parameters(recurse=False)),
        num_ops=t.num_ops,
        traffic_bytes=t.traffic_bytes, weight_traffic_bytes=t.weight_traffic_bytes,
        matmul_calls=t.matmul_calls,
        block_input=t.block_input,
        block_input_shape=t.block_input_shape,
        block_num_args=t.block_num_args,
        block_input_bytes=t.block_input_bytes,
        block_output_arity=t.block_output_arity,
        modules_before_blocks=t.before,
        modules_after_blocks=t.after,
        notes=tuple(notes),
        **facts,
    )


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


def extrapolate_profile(shallow: ModelProfile, deeper: ModelProfile, num_blocks: int) -> ModelProfile:
    """The profile of the same model with `num_blocks` blocks, from two traces of it at smaller depths.

    Planning a 70B model needs no 70B trace: trace it with 1 and 2 blocks (say) and extend. Everything
    linear in depth (FLOPs, ops, memory-bound bytes, parameters) grows by the per-block increment
    measured between the two traces, so the result equals a full-depth trace for models whose blocks are
    identical; the blocks are copies of `deeper`'s last one. The result plans; it cannot be applied (its
    matmul calls are the shallow model's), and its fingerprint says it was extrapolated.
    """
    extra = deeper.num_blocks - shallow.num_blocks
    if extra < 1 or shallow.num_blocks < 1:
        raise ProfileError("extrapolate_profile needs two traces of one model, the second with more blocks "
                           f"(got {shallow.num_blocks} and {deeper.num_blocks}).")
    if num_blocks < deeper.num_blocks:
        raise ProfileError(f"num_blocks={num_blocks} is fewer than the deeper trace's {deeper.num_blocks} blocks: "
                           "profile the model at that depth instead.")
    if (shallow.sample_batch_size, shallow.tokens_per_sample, shallow.profile_precision) != \
            (deeper.sample_batch_size, deeper.tokens_per_sample, deeper.profile_precision):
        raise ProfileError("extrapolate_profile: the two traces must use the same sample and precision.")
    more = num_blocks - deeper.num_blocks

    def grow(name: str) -> Any:
        a, b = getattr(shallow, name), getattr(deeper, name)
        step = (b - a) / extra
        value = b + step * more
        return type(b)(round(value)) if isinstance(b, int) else value

    last = deeper.blocks[-1]
    prefix = last.name.rsplit(".", 1)[0] + "." if "." in last.name else ""
    blocks = deeper.blocks + tuple(replace(last, name=f"{prefix}{deeper.num_blocks + i}") for i in range(more))
    digest = hashlib.sha256(f"{deeper.fingerprint}:{num_blocks}".encode()).hexdigest()[:16]
    return replace(
        deeper, blocks=blocks, fingerprint=f"x{digest}",
        num_params=grow("num_params"), num_trainable_params=grow("num_trainable_params"),
        param_bytes=grow("param_bytes"), forward_flops=grow("forward_flops"), flops=grow("flops"),
        num_ops=grow("num_ops"), traffic_bytes=grow("traffic_bytes"),
        weight_traffic_bytes=grow("weight_traffic_bytes"),
        num_layers=num_blocks if deeper.num_layers is not None else None,
        notes=deeper.notes + (f"extrapolated from traces with {shallow.num_blocks} and {deeper.num_blocks} "
                              f"blocks to {num_blocks} blocks (for planning only)",),
    )
