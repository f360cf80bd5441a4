"""Which Hugging Face attention masks torch.compile builds where the eager forward skips them
(autopar.profile.hf_masks), and the marks the trace gives the attention calls (autopar.profile.watch)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from autopar.profile.hf_masks import _TORCH_BEFORE_2_14, CompileMasks
from autopar.profile.watch import _compile_marks

MASKING = "transformers.masking_utils"
# masking_utils' two skip checks as transformers 5.24 writes them, reduced: no skip while exporting, nor where the
# padding mask's values cannot be read (a traced or fake tensor); else skip when nothing is padded
_SOURCE = """
def is_torchdynamo_exporting():
    return False

def is_tracing(tensor=None):
    return tensor is not None and getattr(tensor, "fake", False)

def _ignore_bidirectional_mask_sdpa(padding_mask, kv_length, local_attention_size=None):
    return not (is_torchdynamo_exporting() or (padding_mask is not None and is_tracing(padding_mask))) \\
        and (padding_mask is None or bool(padding_mask.all()))

def _ignore_causal_mask_sdpa(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
    return _ignore_bidirectional_mask_sdpa(padding_mask, kv_length)
"""


class _FakeLike(torch.Tensor):
    """A tensor the stub's `is_tracing` takes for a fake one (as the trace's fake tensors are)."""

    fake = True


@pytest.fixture
def masking(monkeypatch):
    module = types.ModuleType(MASKING)
    exec(_SOURCE, module.__dict__)
    monkeypatch.setitem(sys.modules, MASKING, module)
    return module


def test_a_mask_skipped_eagerly_is_one_compile_builds_before_torch_2_14(masking):
    masks = CompileMasks()
    with masks.installed():
        assert masking._ignore_bidirectional_mask_sdpa(None, 16) is True  # the eager answer is kept
    assert masks.bidirectional is _TORCH_BEFORE_2_14 and not masks.causal
    assert masking._ignore_bidirectional_mask_sdpa.__name__ == "_ignore_bidirectional_mask_sdpa"  # restored


def test_a_mask_the_trace_builds_only_for_its_fake_padding_mask_is_one_eager_skips(masking):
    """An all-ones padding mask: the trace (its tensors count as tracing) builds the mask, a real eager run skips
    it, torch.compile builds it (before 2.14): recorded as eager_skips_*."""
    masks = CompileMasks()
    padding = torch.ones(2, 16, dtype=torch.bool).as_subclass(_FakeLike)
    with masks.installed():
        assert masking._ignore_causal_mask_sdpa(padding, 16, 16, 0, 0) is False
    assert masks.eager_skips_causal is _TORCH_BEFORE_2_14 and not masks.causal
    padded = torch.ones(2, 16, dtype=torch.bool)
    padded[0, -3:] = False
    padded = padded.as_subclass(_FakeLike)
    masks = CompileMasks()
    with masks.installed():
        masking._ignore_causal_mask_sdpa(padded, 16, 16, 0, 0)
    assert not masks.eager_skips_causal  # a padded batch is masked eagerly too


def test_nothing_is_installed_without_masking_utils(monkeypatch):
    monkeypatch.delitem(sys.modules, MASKING, raising=False)
    masks = CompileMasks()
    with masks.installed():
        pass
    assert not (masks.causal or masks.bidirectional or masks.eager_skips_causal or masks.eager_skips_bidirectional)


def test_marks_follow_the_masks_and_leave_a_per_head_bias_alone():
    masks = CompileMasks()
    masks.causal, masks.bidirectional = True, True
    assert _compile_marks(1, 0, {}, masks) == (2, 0)  # causal, masked only compiled
    assert _compile_marks(0, 0, {}, masks) == (0, 2)  # uncausal: SDPA's math path compiled
    eager_skips = CompileMasks()
    eager_skips.eager_skips_causal = True
    one_head = {"attn_mask": torch.zeros(2, 1, 16, 16)}
    per_head = {"attn_mask": torch.zeros(2, 4, 16, 16)}  # a position bias (T5, Swin): a mask in every run
    assert _compile_marks(0, 1, one_head, eager_skips) == (2, 0)
    assert _compile_marks(0, 1, per_head, eager_skips) == (0, 1)
    assert _compile_marks(0, 1, one_head, CompileMasks()) == (0, 1)


def test_a_hugging_face_encoder_given_an_all_ones_mask_is_marked_both_ways():
    """Tiny BERT with an all-ones attention mask: a real eager run skips the mask, torch.compile builds it (it
    cannot read a traced padding mask's values): every attention record, forward and backward, is uncausal and
    masked 2 (fused eagerly, SDPA's math path compiled as one graph)."""
    transformers = pytest.importorskip("transformers")
    from autopar.profile import profile_model

    config = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config).train()
    ids = torch.randint(0, 128, (2, 16))
    sample = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    profile = profile_model(model, sample, precision="bf16", warn=False)
    marks = {(r.backward, r.shape[7], r.shape[9]) for g in profile.op_groups for r in g.ops if r.kind == "attention"}
    assert marks == {(False, 0, 2), (True, 0, 2)}
    assert profile.value_reads == 0  # the mask checks' reads of the padding mask are autopar's, not the model's


def test_a_hugging_face_decoder_trained_without_its_cache_is_causal_eagerly():
    """Tiny Llama, no attention mask, traced as wrap trains it (no key/value cache): the model asks whether its
    position ids pack several sequences into a row, which the trace cannot read; a real eager run reads one
    sequence a row and builds no mask (a causal fused kernel), torch.compile builds one. Every attention record is
    causal 2 (causal eagerly, masked compiled), not masked in every run."""
    transformers = pytest.importorskip("transformers")
    from autopar.profile import profile_model

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 128, (2, 16))
    profile = profile_model(model, {"input_ids": ids, "labels": ids}, precision="bf16", warn=False)
    marks = {(r.backward, r.shape[7], r.shape[9]) for g in profile.op_groups for r in g.ops if r.kind == "attention"}
    assert marks == {(False, 2, 0), (True, 2, 0)}
    assert profile.value_reads == 0  # the position ids' values read for the question are autopar's
