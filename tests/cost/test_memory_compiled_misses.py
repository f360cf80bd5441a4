"""Compiled plans' saved bytes where the H200 measured far less than predicted (autopar.profile.remat): an attention
call that is neither causal nor masked stays fused under torch.compile unless Hugging Face's masking_utils builds a
mask for it only while dynamo traces (Whisper's encoder and timm's ViT have no mask: fused; BERT's and ViT's on
transformers 5.17 get one: SDPA's math path)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.cost import Calibration
from autopar.cost.memory import predict_memory
from autopar.profile import profile_model
from autopar.profile.hf_masks import _TORCH_BEFORE_2_14
from tests.cost._attention import TinyAttention

HIDDEN, SEQ, HEADS, BATCH = 64, 32, 4, 2
MASKING = "transformers.masking_utils"
# masking_utils' skip test as transformers 5.17 writes it (no mask while not tracing) and as 5.24 does (no padding
# mask: none while tracing too); the model asks it by name through the module, as masking_utils' sdpa_mask does.
_SKIP_517 = """
def is_tracing(tensor=None):
    return False

def _ignore_bidirectional_mask_sdpa(padding_mask, kv_length, local_attention_size=None):
    return not is_tracing(padding_mask) and padding_mask is None

def create_bidirectional_mask(kv_length):
    return None if _ignore_bidirectional_mask_sdpa(None, kv_length) else "a mask"
"""
_SKIP_524 = _SKIP_517.replace("not is_tracing(padding_mask) and padding_mask is None",
                              "not (padding_mask is not None and is_tracing(padding_mask)) and padding_mask is None")


# transformers 5.24's full test: also no skip while exporting, which dynamo answers True before torch 2.14
_SKIP_524_EXPORTING = _SKIP_524.replace("def is_tracing(tensor=None):", """def is_torchdynamo_exporting():
    return False

def is_tracing(tensor=None):""").replace("not (padding_mask is not None", "not (is_torchdynamo_exporting() or padding_mask is not None")


class _Encoder(nn.Module):
    """Two attention layers; with `masking`, the mask asked of a masking_utils-like module first (it is skipped)."""

    def __init__(self, causal: bool, masking: types.ModuleType | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TinyAttention(HIDDEN, HEADS, causal) for _ in range(2))
        self.masking = masking

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.masking is not None:
            assert self.masking.create_bidirectional_mask(x.shape[1]) is None  # skipped in the traced forward
        for layer in self.layers:
            x = layer(x)
        return x


def _loss(out: torch.Tensor, _x: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _profile(model: nn.Module):
    with torch.device("meta"):
        return profile_model(model, torch.zeros(BATCH, SEQ, HIDDEN), loss_fn=_loss, precision="bf16", warn=False)


def _masking(source: str) -> types.ModuleType:
    module = types.ModuleType(MASKING)
    exec(source, module.__dict__)
    return module


def _extra_over_causal(masking: types.ModuleType | None, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Per layer, what the compiled step saves beyond the same layers' causal attention (a fused kernel)."""
    if masking is not None:
        monkeypatch.setitem(sys.modules, MASKING, masking)
    with torch.device("meta"):
        full, causal = _Encoder(False, masking), _Encoder(True, masking)
    full_p, causal_p = _profile(full), _profile(causal)
    assert [b.saved_bytes for b in full_p.blocks] == [b.saved_bytes for b in causal_p.blocks]  # eager: the same
    return [f.compiled_saved_bytes - c.compiled_saved_bytes for f, c in zip(full_p.blocks, causal_p.blocks)]


SCORES = BATCH * HEADS * SEQ * SEQ


def test_attention_with_no_mask_to_build_stays_fused_when_compiled(monkeypatch):
    """Whisper's encoder, timm's ViT: plain SDPA, no mask anywhere: inductor keeps the fused kernel."""
    monkeypatch.delitem(sys.modules, MASKING, raising=False)
    assert _extra_over_causal(None, monkeypatch) == [0, 0]


def test_a_mask_built_only_while_compiling_makes_the_call_unfused(monkeypatch):
    """transformers 5.17: the skipped mask is built under dynamo, SDPA runs its math path (bf16 scores and
    probabilities saved, 2 bytes each)."""
    assert _extra_over_causal(_masking(_SKIP_517), monkeypatch) == [4 * SCORES, 4 * SCORES]


def test_a_mask_skipped_while_compiling_too_keeps_the_call_fused(monkeypatch):
    masking = _masking(_SKIP_524)
    assert _extra_over_causal(masking, monkeypatch) == [0, 0]
    assert masking._ignore_bidirectional_mask_sdpa.__name__ == "_ignore_bidirectional_mask_sdpa"  # restored


def test_a_compiled_plan_of_an_encoder_with_no_mask_saves_no_more_than_eager(monkeypatch):
    """The whole prediction: Whisper's miss in miniature (compiled above eager where the H200 measured below)."""
    monkeypatch.delitem(sys.modules, MASKING, raising=False)
    with torch.device("meta"):
        profile = _profile(_Encoder(False))
    cal = Calibration(context_bytes=0.0, reserve_bytes=0.0, largest_reserve_factor=0.0)
    eager = predict_memory(profile, autopar.Plan(micro_batch_size=BATCH, precision="bf16"), cal)
    compiled = predict_memory(profile, autopar.Plan(micro_batch_size=BATCH, precision="bf16", compile=True), cal)
    assert compiled.activations_bytes <= eager.activations_bytes


def test_a_mask_skipped_unless_exporting_is_built_compiling_before_torch_2_14(monkeypatch):
    """transformers 5.24 skips the mask only when not exporting either, and dynamo answers
    `torch.compiler.is_exporting()` True before torch 2.14 (pytorch#176499): there the call runs unfused
    compiled; from 2.14 on it stays fused."""
    expected = [4 * SCORES, 4 * SCORES] if _TORCH_BEFORE_2_14 else [0, 0]
    assert _extra_over_causal(_masking(_SKIP_524_EXPORTING), monkeypatch) == expected


def test_per_block_compile_saves_no_score_matrix_for_a_mask_only_a_whole_graph_builds(monkeypatch):
    """Under FSDP each block is compiled alone and the mask is built (and skipped) eagerly, outside the graphs:
    the blocks save what the fused kernel saves; compiled as one graph, the score matrices too."""
    monkeypatch.setitem(sys.modules, MASKING, _masking(_SKIP_517))
    with torch.device("meta"):
        profile = _profile(_Encoder(False, sys.modules[MASKING]))
    assert [b.compiled_unfused_bytes for b in profile.blocks] == [4 * SCORES, 4 * SCORES]
    cal = Calibration(context_bytes=0.0, reserve_bytes=0.0, largest_reserve_factor=0.0)
    plan = {"micro_batch_size": BATCH, "precision": "bf16", "compile": True}
    whole = predict_memory(profile, autopar.Plan(**plan), cal)
    per_block = predict_memory(profile, autopar.Plan(**plan, dp_shard=2), cal)
    fused = sum(b.compiled_saved_bytes - b.compiled_unfused_bytes for b in profile.blocks)
    assert whole.activations_bytes - per_block.activations_bytes == pytest.approx(8 * SCORES, rel=1e-6)
    assert per_block.activations_bytes >= fused
