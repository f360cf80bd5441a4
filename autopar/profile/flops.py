"""Attention and grouped GEMMs as the trace counts them: FLOP formulas for every scaled-dot-product-attention
kernel and for torch._grouped_mm (MoE experts), the op packets whose time is FLOPs (matmul_ops), and the
flash-like stand-in for SDPA (flash_like_attention) that a trace on a CPU runs instead of torch's own, as a GPU
would run it: flash, or the memory-efficient kernel where CUDA takes it (flash_like_sdpa(), a TorchFunctionMode)."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable, Sequence

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, shape_wrapper

# The builtin F.scaled_dot_product_attention is, as a TorchFunctionMode receives it (taken from torch._C, so
# that F's attribute replaced elsewhere does not change what is routed).
_SDPA = torch._C._nn.scaled_dot_product_attention
_DROPOUT = torch.nn.functional.dropout


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


def _forward_formula(q: Sequence[int], k: Sequence[int], v: Sequence[int], *args: Any, out_shape: Any = None,
                     **kwargs: Any) -> int:
    return _sdpa_flops(q, k, v)


def _backward_formula(grad: Sequence[int], q: Sequence[int], k: Sequence[int], v: Sequence[int], *args: Any,
                      out_shape: Any = None, **kwargs: Any) -> int:
    return _sdpa_backward_flops(q, k, v)


def _grouped_mm_formula(a: Sequence[int], b: Sequence[int], *args: Any, out_shape: Sequence[int] = (),
                        **kwargs: Any) -> int:
    """FLOPs of torch._grouped_mm (MoE experts; torch's FlopCounterMode counts none): every output element is
    one dot product of mat_a's last dim, except that two 2-d operands split that dim among the groups (the
    weight gradient: out is (groups, m, n), each group contracting its own rows)."""
    out = 1
    for size in out_shape:
        out *= size
    if len(a) == 2 and len(b) == 2 and out_shape:
        out //= max(out_shape[0], 1)
    return 2 * out * a[-1]


def flop_formulas() -> dict[Any, Callable[..., int]]:
    """FLOP formulas that replace or add to FlopCounterMode's: every scaled-dot-product-attention kernel
    (CPU flash attention has none in torch; grouped-query attention fails torch's before 2.13) and the grouped
    GEMM of MoE experts (torch._grouped_mm, which torch's counter does not count)."""
    aten = torch.ops.aten
    out: dict[Any, Callable[..., int]] = {}
    if hasattr(aten, "_grouped_mm"):
        out[aten._grouped_mm] = _grouped_mm_formula
    forward = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    for name in forward:
        if hasattr(aten, name):
            out[getattr(aten, name)] = _forward_formula
        if hasattr(aten, name + "_backward"):
            out[getattr(aten, name + "_backward")] = _backward_formula
    return out


class FlopTally:
    """The FLOPs of a traced step's ops, in all and by scope, as torch's FlopCounterMode counts them: its formulas
    (torch.utils.flop_counter's registry, flop_formulas() over it), and an op without one that decomposes
    (a CompositeImplicitAutograd kernel reaching the dispatch: `to.dtype`, `silu_backward`) run as its pieces and
    counted by theirs. Without a dispatch mode and module tracker of its own: the trace's StepWatcher runs each op
    it sees through `run`, in the scope it gives the op (the block; forward and backward alike). The counter's own
    layer was a quarter of the time `autopar.plan` took on a state-space LM (Mamba-2, 24 blocks of about 1,700 ops
    each: 9.9 s against 7.3 s without it, 2 CPU cores)."""

    def __init__(self) -> None:
        formulas = {k: v if getattr(v, "_get_raw", False) else shape_wrapper(v) for k, v in flop_formulas().items()}
        self.registry: dict[Any, Callable[..., int]] = {**flop_registry, **formulas}
        self.total = 0  # FLOPs so far
        self.by_scope: dict[int, int] = defaultdict(int)  # scope -> FLOPs so far
        self._decomposes: dict[Any, bool] = {}  # op -> whether it has a CompositeImplicitAutograd kernel

    def run(self, func: Any, args: tuple, kwargs: dict, scope: int) -> Any:
        """`func(*args, **kwargs)`, its FLOPs (or its pieces') counted in `scope`."""
        formula = self.registry.get(getattr(func, "overloadpacket", None))
        if formula is None and self._composite(func):
            with _Pieces(self, scope):
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if formula is not None:
            self.add(int(formula(*args, **kwargs, out_val=out)), scope)
        return out

    def count(self, func: Any, args: tuple, kwargs: dict, out: Any, scope: int) -> None:
        """The FLOPs of an op run elsewhere (fp32_grouped_mm), counted in `scope`."""
        formula = self.registry.get(getattr(func, "overloadpacket", None))
        if formula is not None:
            self.add(int(formula(*args, **kwargs, out_val=out)), scope)

    def add(self, flops: int, scope: int) -> None:
        self.total += flops
        self.by_scope[scope] += flops

    def _composite(self, func: Any) -> bool:
        known = self._decomposes.get(func)
        if known is None:
            key = torch._C.DispatchKey.CompositeImplicitAutograd
            known = isinstance(func, torch._ops.OpOverload) and func is not torch.ops.prim.device.default and (
                key in func.py_kernels or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key))
            self._decomposes[func] = known
        return known


class _Pieces(TorchDispatchMode):
    """The pieces of a decomposed op, each run through the tally in the op's scope (FlopTally.run)."""

    def __init__(self, tally: FlopTally, scope: int) -> None:
        super().__init__()
        self.tally, self.scope = tally, scope

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.tally.run(func, args, kwargs or {}, self.scope)


#: The dense GEMMs (what "alternate" checkpointing keeps every other one of: autopar.strategies.checkpointing)
GEMMS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm")


def gemm_ops() -> set[Any]:
    """Op packets of the dense GEMMs (GEMMS)."""
    return {getattr(torch.ops.aten, n) for n in GEMMS if hasattr(torch.ops.aten, n)}


def matmul_ops() -> set[Any]:
    """Op packets whose time is FLOPs (matmuls, attention); everything else is memory-bound. Selective
    checkpointing keeps their outputs (autopar.strategies.checkpointing)."""
    aten = torch.ops.aten
    names = (*GEMMS, "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward", "_efficient_attention_forward",
             "convolution", "_grouped_mm")
    return {getattr(aten, n) for n in names if hasattr(aten, n)}


def fp32_grouped_mm(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """torch._grouped_mm on float32 fake tensors, as a GPU runs it, or None for any other call. CUDA's kernel
    takes float32 (aten GroupedBlas.cpp: one mm per group), but the meta kernel that fake tensors run refuses
    anything but bf16, so an fp32 step, or a bf16-autocast one over fp32 weights (_grouped_mm is on no
    autocast list: the MoE experts get the fp32 weights, and transformers casts the tokens to them), could not
    be traced. Here the meta kernel runs on bf16 copies and the output is made float32: the caller (the
    trace's StepWatcher, above the FakeTensorMode) records the call as it came, float32 operands and output."""
    if getattr(func, "overloadpacket", None) is not getattr(torch.ops.aten, "_grouped_mm", None) or len(args) < 2:
        return None
    a, b = args[0], args[1]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.float32 in (a.dtype, b.dtype)
            and (is_fake(a) or a.is_meta)):
        return None
    rest = dict(kwargs)
    if rest.get("out_dtype") is not None:
        rest["out_dtype"] = torch.bfloat16
    out = func(a.to(torch.bfloat16), b.to(torch.bfloat16), *args[2:], **rest)
    return out.to(torch.float32)


def flash_like_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                         dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                         enable_gqa: bool = False) -> torch.Tensor:
    """scaled_dot_product_attention as a GPU runs it, for the trace: a fused (flash) kernel in the autocast
    dtype that saves q, k, v, the output and the softmax statistics for backward, never the (seq x seq)
    attention matrix. On CPU tensors torch may pick the unfused math kernel, which saves that matrix in
    fp32 and would overstate a GPU's activation memory many times over. A learned bias (a mask that requires
    grad) or a value head dim other than the query's takes the memory-efficient kernel, as on CUDA; a learned
    bias broadcast over the batch or heads under dropout takes the math kernel, as on CUDA (_cuda_takes_math)."""
    if torch.is_autocast_enabled(query.device.type):
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = (t.to(dtype) for t in (query, key, value))
        if isinstance(attn_mask, torch.Tensor) and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(dtype)
    gqa = key.size(-3) != query.size(-3)
    if gqa:  # grouped-query attention: every query head reads its key/value head
        groups = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
    if _cuda_takes_math(query, attn_mask, dropout_p):
        with torch.autocast(query.device.type, enabled=False):  # as below autocast's SDPA cast, on CUDA
            return _cuda_math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale)
    if gqa and query.dtype == torch.float32:
        # CUDA's fused kernels take grouped-query attention only in 16-bit (flash); in fp32 SDPA falls back to
        # the math kernel, which saves the attention matrix (seen on an H200: a Llama-1B shape in fp32 OOMs).
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, _additive(attn_mask, query.dtype), dropout_p, is_causal, scale=scale)[0]
    if _needs_efficient_kernel(query, value, attn_mask):
        return _efficient_attention(query, key, value, attn_mask, dropout_p, is_causal, scale)
    with torch.autocast(query.device.type, enabled=False):
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return out


def _cuda_takes_math(query: torch.Tensor, attn_mask: Any, dropout_p: float) -> bool:
    """Whether CUDA's dispatch runs this call on the math kernel, which saves the (q x k) scores and
    probabilities in fp32 (it upcasts 16-bit inputs, as torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp
    is off by default): a float mask that requires grad and is broadcast over the batch or the heads, under
    dropout. Seen on the H200 (torch 2.11; bench/results/sdpa_calls_h200_2026-12-02.jsonl): T5's self-attention
    in training, its (1, heads, q, k) relative position bias with dropout 0.1, ran `_safe_softmax` in fp32; the
    same kind of bias without dropout (Swin) and a whole (batch, heads, q, k) bias with dropout
    (sdpa_choice_h200_2026-12-02.jsonl) took the memory-efficient kernel."""
    if not (isinstance(attn_mask, torch.Tensor) and attn_mask.is_floating_point() and attn_mask.requires_grad
            and dropout_p > 0):
        return False
    lead = query.dim() - 2  # the batch-like dims the mask is broadcast against, right-aligned
    shape = (1,) * max(0, query.dim() - attn_mask.dim()) + tuple(attn_mask.shape)
    return any(m == 1 and q > 1 for m, q in zip(shape[:lead], query.shape[:lead]))


def _cuda_math_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any,
                         dropout_p: float, is_causal: bool, scale: float | None) -> torch.Tensor:
    """SDPA's math kernel as CUDA runs it (aten/src/ATen/native/transformers/attention.cpp): q, k and v upcast
    to fp32, each scaled by sqrt(scale), the (q x k) scores plus the mask, softmax, then dropout by the fused
    kernel (native_dropout: a boolean keep-mask, where the CPU's composite dropout keeps a float one), times v,
    cast back. Saved for backward, as on the GPU: the fp32 q, k, v, probabilities, dropped probabilities and the
    boolean mask. Key and value have the query's heads (grouped-query attention repeated by the caller)."""
    root = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(query.size(-1)))
    q, k, v = (t.to(torch.float32) for t in (query, key, value))
    scores = (q * root) @ (k * root).transpose(-2, -1)  # (..., q, k)
    if is_causal:
        keep = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    bias = _additive(attn_mask, torch.float32)
    if bias is not None:
        scores = scores + bias
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0:
        probs = torch.native_dropout(probs, dropout_p, True)[0]
    return (probs @ v).to(query.dtype)


def _needs_efficient_kernel(query: torch.Tensor, value: torch.Tensor, attn_mask: Any) -> bool:
    """Whether CUDA runs this call on the memory-efficient kernel, not flash: a float mask that requires grad
    (a learned bias: T5's and Swin's relative positions; flash takes no mask, the efficient kernel computes
    its gradient), or a value head dim other than the query's (MLA: flash needs them equal)."""
    grad_mask = isinstance(attn_mask, torch.Tensor) and attn_mask.requires_grad
    return grad_mask or value.size(-1) != query.size(-1)


def _additive(attn_mask: Any, dtype: torch.dtype) -> torch.Tensor | None:
    """The mask as SDPA adds it to the scores: a boolean one as 0 where kept and -inf where masked (as SDPA
    converts it before its kernels), a float one in the attention's dtype."""
    if not isinstance(attn_mask, torch.Tensor):
        return None
    if attn_mask.dtype == torch.bool:
        return torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill(~attn_mask, float("-inf"))
    return attn_mask.to(dtype)


def _efficient_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any,
                         dropout_p: float, is_causal: bool, scale: float | None) -> torch.Tensor:
    """SDPA on the memory-efficient kernel, as CUDA runs it: a boolean mask becomes an additive bias (0 where
    kept, -inf where masked), the bias is broadcast to (batch, heads, q, k) (its gradient is that size, summed
    back by autograd), and it saves q, k, v, the output and the log-sum-exp, never the attention matrix. Its
    meta kernels compute every shape, also on CPU fake tensors; real CPU tensors (which it has no kernel for) and
    inputs other than 4-d take the math kernel, which gives the same values."""
    bias = _additive(attn_mask, query.dtype)
    if query.dim() != 4 or not (is_fake(query) or query.is_meta):
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, bias, dropout_p, is_causal, scale=scale)[0]
    if bias is not None:
        bias = bias.expand(query.size(0), query.size(1), query.size(2), key.size(2))
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (query, key, value, bias))
    with torch.autocast(query.device.type, enabled=False):
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, needs_grad, dropout_p, is_causal, scale=scale)[0]
    return out


class _FlashLikeSdpa(TorchFunctionMode):
    """Routes every call of F.scaled_dot_product_attention (however the model reached it) to the stand-in, and
    every training-mode F.dropout to the fused kernel CUDA runs (`cuda_like_dropout`); every other torch function
    runs as it would."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _SDPA:
            return flash_like_attention(*args, **(kwargs or {}))
        if func is _DROPOUT:
            return cuda_like_dropout(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def cuda_like_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    """F.dropout as CUDA runs it in training: the fused kernel (native_dropout), which keeps a boolean mask for
    backward. On CPU tensors torch composes dropout from a float mask in the input's dtype (its fused kernel is
    taken for CUDA tensors only: at::dropout's is_fused_kernel_acceptable), which would overstate a GPU's
    activation memory by a mask 2-4x the size of a bool one at every dropout. The same values' distribution;
    an in-place call, evaluation and p outside (0, 1) run torch's own."""
    if not training or inplace or not 0.0 < p < 1.0:
        return _DROPOUT(input, p, training, inplace)
    return torch.native_dropout(input, p, True)[0]


def flash_like_sdpa() -> TorchFunctionMode:
    """A context manager under which F.scaled_dot_product_attention runs flash_like_attention and F.dropout in
    training runs cuda_like_dropout (CUDA's kernels, for a trace on the CPU):
    `with flash_like_sdpa(): ...`. It is a TorchFunctionMode, so it sees the call before autograd, autocast
    and any TorchDispatchMode (FakeTensorMode, FlopCounterMode), whichever order those were entered in. A
    TorchFunctionMode entered after it (the trace's CudaAutocastPolicy) sees the call first and passes it
    on unchanged; the stand-in runs with both off (torch pops a mode while its handler runs), which changes
    nothing, as the policy casts none of the stand-in's ops.

    It covers the forward only. `Tensor.backward` is itself a torch function, so the mode is off while
    backward runs: a forward recomputed in backward (activation checkpointing) would call torch's own SDPA.
    The profile's trace recomputes nothing; the exact check, whose plans checkpoint, replaces the function
    F.scaled_dot_product_attention itself (autopar.exact)."""
    return _FlashLikeSdpa()
