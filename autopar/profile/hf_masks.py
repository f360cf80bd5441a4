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
        originals = {name: getattr(module, name) for name in _SKIPS if module is not None and hasattr(module, name)}
        for name, original in originals.items():
            setattr(module, name, _Recorder(self, module, original, _SKIPS[name]))
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
        saved = {name: getattr(self.module, name) for name in patched if hasattr(self.module, name)}
        reads = getattr(self.masks.shadows, "reads", None)
        for name in saved:
            setattr(self.module, name, patched[name])
        try:
            return bool(self.original(*args, **kwargs))
        except Exception:  # a value it cannot read (no shadow): the mask is built
            return False
        finally:
            for name, value in saved.items():
                setattr(self.module, name, value)
            if reads is not None:  # the padding mask's values read for this question: not a read of the model's
                self.masks.shadows.reads = reads
