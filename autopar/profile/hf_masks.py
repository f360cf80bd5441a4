"""Which attention masks a Hugging Face model builds under torch.compile but skips when it runs eagerly.

transformers' masking_utils hands SDPA no mask (so that it runs a fused kernel) where the mask would change
nothing: no padding, a plain causal or bidirectional pattern (`_ignore_causal_mask_sdpa`,
`_ignore_bidirectional_mask_sdpa`). While dynamo traces the model it may not look: those checks return False when
`is_tracing` says so (transformers 5.17), or when `is_torchdynamo_exporting()` is true, which dynamo makes a
constant True under torch older than 2.14 (pytorch#176499, as transformers 5.24's own comment says). A compiled
model's SDPA then gets an explicit mask: a causal call runs a masked kernel, and a bidirectional one (an
encoder's) SDPA's math path (autopar.cost.ops). The trace runs the model eagerly; `CompileMasks` asks each skip
check again as dynamo would answer it and remembers, per kind, whether compile would build that mask. Nothing is
installed where transformers' masking_utils is not imported (a model without it builds no such mask).

A training forward without a key/value cache or an attention mask asks one more question: whether its position ids
pack several sequences into a row (`find_packed_sequence_indices`, which reads their values). While tracing it
cannot read them and answers as if they did, and the model builds a mask for them: torch.compile does so too, a
real eager run reads one sequence a row and builds none. `CompileMasks` asks it again as a real run would (the
position ids' values from the sample's shadow) and, where that builds no mask, marks the mask as one only compile
builds (`eager_skips_causal`, or `eager_skips_bidirectional` for an encoder's). Without it every Hugging Face
decoder traced without its cache (as wrap trains it, autopar._util.kv_cache) was priced with a masked attention
kernel in eager steps (Llama-1B's step 16% over its H200 measurement).

Evidence (bench/results/zoo_h200_profile_2026-12-01c.jsonl, H200, torch 2.11, transformers 5.17): compiled
Hugging Face BERT, ViT, BART and wav2vec2 ran their attention as batched GEMMs and a softmax (the math path),
compiled GPT-2 a masked cuDNN kernel; timm's ViT and Whisper's encoder, which build no mask, kept cuDNN's
fused kernel compiled (inductor's post-grad graphs, read on the H200).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

import torch

_SKIPS = {"_ignore_causal_mask_sdpa": "causal", "_ignore_bidirectional_mask_sdpa": "bidirectional"}
_PACKED = "find_packed_sequence_indices"
_TORCH_BEFORE_2_14 = tuple(int(x) for x in torch.__version__.split(".")[:2] if x.isdigit()) < (2, 14)


class CompileMasks:
    """While installed (`installed()`), records whether the model skipped a mask of each kind that
    torch.compile would build: `causal`, `bidirectional` (booleans, for the rest of the forward); and whether
    it built one only because the trace's fake tensors count as tracing (`is_tracing` of a padding mask), where a
    real eager run skips it (an all-ones padding mask) and torch.compile builds it: `eager_skips_causal`,
    `eager_skips_bidirectional`."""

    def __init__(self, shadows: Any = None) -> None:
        """`shadows`: the trace's InputShadows, whose value reads these questions make are not the model's."""
        self.causal = False
        self.bidirectional = False
        self.eager_skips_causal = False
        self.eager_skips_bidirectional = False
        self.marked: dict[tuple, tuple[int, int]] = {}  # an attention call's (shape, causal, masked) as traced ->
        # its marks, set by the forward for its backward (autopar.profile.watch)
        self.shadows = shadows

    @contextlib.contextmanager
    def installed(self) -> Iterator["CompileMasks"]:
        module = sys.modules.get("transformers.masking_utils")
        originals = {name: getattr(module, name) for name in (*_SKIPS, _PACKED)
                     if module is not None and hasattr(module, name)}
        for name, original in originals.items():
            recorder = _PackedRecorder(self, module, original) if name == _PACKED else \
                _Recorder(self, module, original, _SKIPS[name])
            setattr(module, name, recorder)
        try:
            yield self
        finally:
            for name, original in originals.items():
                setattr(module, name, original)


class _Recorder:
    """One of masking_utils' skip checks, wrapped: the trace's answer, and the answers dynamo and a real eager
    run would give (`_skipped`)."""

    def __init__(self, masks: CompileMasks, module: Any, original: Any, kind: str) -> None:
        self.masks, self.module, self.original, self.kind = masks, module, original, kind

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        skipped = self.original(*args, **kwargs)
        if skipped and not self._skipped(args, kwargs, compiling=True):
            setattr(self.masks, self.kind, True)
        elif not skipped and self._skipped(args, kwargs, compiling=False) \
                and not self._skipped(args, kwargs, compiling=True):
            setattr(self.masks, f"eager_skips_{self.kind}", True)
        return skipped

    def _skipped(self, args: tuple, kwargs: dict, *, compiling: bool) -> bool:
        """The check's answer under dynamo (`compiling`: `is_tracing` true, and `is_torchdynamo_exporting`
        before torch 2.14) or in a real eager run (`is_tracing` false: the padding mask's values are read, from
        the sample's shadow)."""
        patched = {"is_tracing": lambda *_a, **_k: compiling}
        if compiling and _TORCH_BEFORE_2_14:
            patched["is_torchdynamo_exporting"] = lambda *_a, **_k: True
        try:
            with _asked_again(self.module, patched, self.masks.shadows):
                return bool(self.original(*args, **kwargs))
        except Exception:  # a value it cannot read (no shadow): the mask is built
            return False


@contextlib.contextmanager
def _asked_again(module: Any, patched: dict[str, Any], shadows: Any) -> Iterator[None]:
    """masking_utils' helpers named in `patched` replaced while one of its checks is asked again, and the value
    reads that question makes (the padding mask's, the position ids': from the sample's shadow) not counted as
    the model's."""
    saved = {name: getattr(module, name) for name in patched if hasattr(module, name)}
    reads = getattr(shadows, "reads", None)
    for name in saved:
        setattr(module, name, patched[name])
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
        if reads is not None:
            shadows.reads = reads


class _PackedRecorder:
    """masking_utils' check for sequences packed into a row, wrapped: the trace's answer, and whether a real eager
    run, reading the position ids' values, would find none (one sequence a row) where the trace found some."""

    def __init__(self, masks: CompileMasks, module: Any, original: Any) -> None:
        self.masks, self.module, self.original = masks, module, original

    def __call__(self, position_ids: Any, *args: Any, **kwargs: Any) -> Any:
        found = self.original(position_ids, *args, **kwargs)
        if found is not None and self._eager_finds_none(position_ids, args, kwargs):
            setattr(self.masks, f"eager_skips_{_mask_kind()}", True)
        return found

    def _eager_finds_none(self, position_ids: Any, args: tuple, kwargs: dict) -> bool:
        try:
            with _asked_again(self.module, {"is_tracing": lambda *_a, **_k: False}, self.masks.shadows):
                return self.original(position_ids, *args, **kwargs) is None
        except Exception:  # values it cannot read (no shadow): the mask is built, as traced
            return False


def _mask_kind(depth: int = 6) -> str:
    """"bidirectional" where the mask being built is an encoder's (masking_utils' create_bidirectional_mask is
    among the callers), else "causal"."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            break
        if "bidirectional" in frame.f_code.co_name:
            return "bidirectional"
        frame = frame.f_back
    return "causal"
