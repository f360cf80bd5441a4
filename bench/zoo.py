"""The public model zoo (issue 10): model families of every kind, built from configs with no downloads.

    python -m bench.zoo --list          # the table: family, kind, realistic shape, batch, parameters, status

Each `Family` is data: its name and kind, `build(size)` (a fresh model; "tiny" for CPU parity tests,
"realistic" for planning, which `build_model` builds on the meta device), `sample(size, batch_size, device,
generator)` (one batch as the model takes it, passed as `model(**sample)`), `loss_fn(output, sample)` (the
targets come from the sample: Hugging Face's `output.loss` where labels are passed), the realistic shape in
words and its batch, and the packages it needs. `ZOO` is the registry; a family whose packages cannot be
imported (timm and torchvision on a CPU-only torch, peft when not installed) reports why in `unavailable()`.

The realistic sizes are the named models' shapes; the largest keep fewer layers, said in `realistic`.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar import DeviceSpec, ModelProfile

SIZES = ("tiny", "realistic")
KINDS = ("encoder", "encoder-decoder", "decoder", "moe", "mla", "state-space", "hybrid", "vision-cnn",
         "vision-transformer", "dense-prediction", "video", "speech", "two-tower", "vision-language", "lora", "mlp")

Sample = dict[str, Any]


@dataclass(frozen=True)
class Family:
    """One model family of the zoo."""

    name: str
    kind: str  # one of KINDS
    build: Callable[[str], nn.Module]  # size -> a fresh model in training mode
    sample: Callable[[str, int, torch.device, torch.Generator], Sample]  # (size, batch, device, generator)
    loss_fn: Callable[[Any, Any], torch.Tensor]  # (output, sample) -> scalar loss
    realistic: str  # the realistic size in words
    realistic_batch: int  # samples per GPU at the realistic size
    tiny_batch: int = 4
    requires: tuple[str, ...] = ("transformers",)

    def unavailable(self) -> str | None:
        """Why this family cannot be built here (a package that does not import), or None."""
        for name in self.requires:
            try:
                importlib.import_module(name)
            except Exception as exc:  # timm/torchvision CUDA wheels raise more than ImportError on a CPU torch
                return f"{name} does not import: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return None


def build_model(family: Family, size: str, *, seed: int = 0) -> nn.Module:
    """The family's model at `size`, seeded: "realistic" on the meta device (no memory), "tiny" on the CPU."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    torch.manual_seed(seed)
    if size == "realistic":
        with torch.device("meta"):
            model = family.build(size)
    else:
        model = family.build(size)
    return model.train()


def make_sample(family: Family, size: str, batch_size: int | None = None, *, seed: int = 0) -> Sample:
    """One batch for the family at `size`, real tensors on the CPU (as a user's batch is: a step that reads its
    values, e.g. a CTC loss's label lengths, is traced from them); `seed` picks the batch."""
    if batch_size is None:
        batch_size = family.realistic_batch if size == "realistic" else family.tiny_batch
    return family.sample(size, batch_size, torch.device("cpu"), torch.Generator().manual_seed(seed))


def call(model: nn.Module, sample: Sample) -> Any:
    """The model's output for a sample, called the way autopar calls it for a dict: model(**sample)."""
    return model(**sample)


# ---- inputs ------------------------------------------------------------------------------------------------
def _ints(high: int, shape: tuple[int, ...], device: torch.device, gen: torch.Generator, low: int = 0) -> torch.Tensor:
    if device.type == "meta":
        return torch.empty(shape, dtype=torch.long, device=device)
    return torch.randint(low, high, shape, generator=gen)


def _floats(shape: tuple[int, ...], device: torch.device, gen: torch.Generator) -> torch.Tensor:
    if device.type == "meta":
        return torch.empty(shape, device=device)
    return torch.randn(shape, generator=gen)


def _causal_lm_sample(size: str, batch: int, device: torch.device, gen: torch.Generator, *,
                      vocab: Mapping[str, int], seq: Mapping[str, int]) -> Sample:
    ids = _ints(vocab[size], (batch, seq[size]), device, gen)
    return {"input_ids": ids, "labels": ids}


def _seq2seq_sample(size: str, batch: int, device: torch.device, gen: torch.Generator, *,
                    vocab: Mapping[str, int], seq: Mapping[str, int], target: Mapping[str, int]) -> Sample:
    return {"input_ids": _ints(vocab[size], (batch, seq[size]), device, gen),
            "labels": _ints(vocab[size], (batch, target[size]), device, gen)}


def _image_sample(size: str, batch: int, device: torch.device, gen: torch.Generator, *,
                  image: Mapping[str, int], classes: Mapping[str, int]) -> Sample:
    return {"pixel_values": _floats((batch, 3, image[size], image[size]), device, gen),
            "labels": _ints(classes[size], (batch,), device, gen)}


def _features_sample(size: str, batch: int, device: torch.device, gen: torch.Generator, *,
                     features: Mapping[str, int], classes: Mapping[str, int]) -> Sample:
    return {"x": _floats((batch, features[size]), device, gen), "labels": _ints(classes[size], (batch,), device, gen)}


def _hf_loss(output: Any, sample: Any) -> torch.Tensor:
    """Hugging Face computed the loss from the sample's labels (or, for CLIP, its contrastive targets)."""
    return output.loss


def _cross_entropy(output: torch.Tensor, sample: Any) -> torch.Tensor:
    return F.cross_entropy(output, sample["labels"])


def _dims(tiny: Any, realistic: Any) -> dict[str, Any]:
    return {"tiny": tiny, "realistic": realistic}


def _transformers() -> Any:
    import transformers  # optional: only the zoo's Hugging Face families need it

    return transformers


_NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


# ---- encoder-only and encoder-decoder ---------------------------------------------------------------------
_BERT = _dims(dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                   max_position_embeddings=64, **_NO_DROPOUT),
              dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                   intermediate_size=3072, max_position_embeddings=512))


def _bert(size: str) -> nn.Module:
    t = _transformers()
    return t.BertForMaskedLM(t.BertConfig(**_BERT[size]))


_T5 = _dims(dict(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                 dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0),
            dict(vocab_size=32128, d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_decoder_layers=12,
                 num_heads=12, decoder_start_token_id=0, pad_token_id=0))


def _t5(size: str) -> nn.Module:
    t = _transformers()
    return t.T5ForConditionalGeneration(t.T5Config(**_T5[size]))


_BART = _dims(dict(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                   decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                   dropout=0.0, attention_dropout=0.0, activation_dropout=0.0),
              dict(vocab_size=50265, d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                   decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072,
                   max_position_embeddings=1024))


def _bart(size: str) -> nn.Module:
    t = _transformers()
    return t.BartForConditionalGeneration(t.BartConfig(**_BART[size]))


# ---- decoder LLMs -----------------------------------------------------------------------------------------
_GPT2 = _dims(dict(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                   attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
              dict(vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024))


def _gpt2(size: str) -> nn.Module:
    t = _transformers()
    return t.GPT2LMHeadModel(t.GPT2Config(**_GPT2[size]))


_LLAMA = _dims(dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64),
               dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                    tie_word_embeddings=True))


def _llama(size: str) -> nn.Module:
    t = _transformers()
    return t.LlamaForCausalLM(t.LlamaConfig(**_LLAMA[size]))


_QWEN2 = _dims(dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64),
               dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                    tie_word_embeddings=True))


def _qwen2(size: str) -> nn.Module:
    t = _transformers()
    return t.Qwen2ForCausalLM(t.Qwen2Config(**_QWEN2[size]))


_GEMMA = _dims(dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=1, head_dim=8, max_position_embeddings=64),
               dict(vocab_size=256000, hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
                    num_attention_heads=8, num_key_value_heads=1, head_dim=256, max_position_embeddings=8192))


def _gemma(size: str) -> nn.Module:
    t = _transformers()
    return t.GemmaForCausalLM(t.GemmaConfig(**_GEMMA[size]))


_MISTRAL = _dims(dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, sliding_window=8),
                 dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=8,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                      sliding_window=4096))


def _mistral(size: str) -> nn.Module:
    t = _transformers()
    return t.MistralForCausalLM(t.MistralConfig(**_MISTRAL[size]))


# ---- state-space and hybrid LMs (on a CPU, and on a GPU without mamba-ssm, transformers' torch SSD path) ----
_MAMBA2 = _dims(dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, num_heads=8,
                     head_dim=8, n_groups=1, conv_kernel=4, chunk_size=8, time_step_rank=4),
                dict(vocab_size=50288, hidden_size=768, num_hidden_layers=24, state_size=128, expand=2, num_heads=24,
                     head_dim=64, n_groups=1, conv_kernel=4, chunk_size=256, time_step_rank=48,
                     tie_word_embeddings=True))


def _mamba2(size: str) -> nn.Module:
    t = _transformers()
    return t.Mamba2ForCausalLM(t.Mamba2Config(**_MAMBA2[size]))


_BAMBA = _dims(dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8,
                    mamba_n_groups=1, mamba_expand=2, mamba_chunk_size=8, max_position_embeddings=64),
               dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=8,
                    num_attention_heads=32, num_key_value_heads=8, attn_layer_indices=[4], mamba_n_heads=128,
                    mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_expand=2, mamba_chunk_size=256,
                    max_position_embeddings=8192))


def _bamba(size: str) -> nn.Module:
    t = _transformers()
    return t.BambaForCausalLM(t.BambaConfig(**_BAMBA[size]))


# ---- mixture of experts and MLA ---------------------------------------------------------------------------
_MIXTRAL = _dims(dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                      max_position_embeddings=64),
                 dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                      num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                      max_position_embeddings=32768))


def _mixtral(size: str) -> nn.Module:
    t = _transformers()
    return t.MixtralForCausalLM(t.MixtralConfig(**_MIXTRAL[size]))


_QWEN2_MOE = _dims(dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=64),
                   dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
                        shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
                        num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=16,
                        max_position_embeddings=8192))


def _qwen2_moe(size: str) -> nn.Module:
    t = _transformers()
    return t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(**_QWEN2_MOE[size]))


_OLMOE = _dims(dict(vocab_size=128, hidden_size=32, intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                    pad_token_id=1, eos_token_id=0),
               dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_experts=64,
                    num_experts_per_tok=8, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                    max_position_embeddings=4096))


def _olmoe(size: str) -> nn.Module:
    t = _transformers()
    return t.OlmoeForCausalLM(t.OlmoeConfig(**_OLMOE[size]))


_DEEPSEEK_V3 = _dims(
    dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
         first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
         n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=24,
         qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=64),
    dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
         num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=16,
         n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1, kv_lora_rank=512,
         q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=8192))


def _deepseek_v3(size: str) -> nn.Module:
    t = _transformers()
    return t.DeepseekV3ForCausalLM(t.DeepseekV3Config(**_DEEPSEEK_V3[size]))


# ---- vision -----------------------------------------------------------------------------------------------
_IMAGE = _dims(32, 224)
_CLASSES = _dims(10, 1000)

_RESNET = _dims(dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=10),
                dict(embedding_size=64, hidden_sizes=[256, 512, 1024, 2048], depths=[3, 4, 6, 3],
                     layer_type="bottleneck", num_labels=1000))


def _resnet(size: str) -> nn.Module:
    t = _transformers()
    return t.ResNetForImageClassification(t.ResNetConfig(**_RESNET[size]))


_CONVNEXT = _dims(dict(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=10, image_size=32),
                  dict(hidden_sizes=[96, 192, 384, 768], depths=[3, 3, 9, 3], num_stages=4, num_labels=1000,
                       image_size=224))


def _convnext(size: str) -> nn.Module:
    t = _transformers()
    return t.ConvNextForImageClassification(t.ConvNextConfig(**_CONVNEXT[size]))


_VIT = _dims(dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, num_labels=10, **_NO_DROPOUT),
             dict(image_size=224, patch_size=16, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                  intermediate_size=3072, num_labels=1000))


def _vit(size: str) -> nn.Module:
    t = _transformers()
    return t.ViTForImageClassification(t.ViTConfig(**_VIT[size]))


_SWIN = _dims(dict(image_size=32, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4,
                   num_labels=10, **_NO_DROPOUT),
              dict(image_size=224, patch_size=4, embed_dim=96, depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24],
                   window_size=7, num_labels=1000))


def _swin(size: str) -> nn.Module:
    t = _transformers()
    return t.SwinForImageClassification(t.SwinConfig(**_SWIN[size]))


_MOBILENET_V2 = _dims(dict(image_size=32, depth_multiplier=0.25, finegrained_output=False, num_labels=10,
                           classifier_dropout_prob=0.0),
                      dict(image_size=224, depth_multiplier=1.0, num_labels=1000))


def _mobilenet_v2(size: str) -> nn.Module:
    t = _transformers()
    return t.MobileNetV2ForImageClassification(t.MobileNetV2Config(**_MOBILENET_V2[size]))


# ---- dense prediction and video ---------------------------------------------------------------------------
_SEGFORMER = _dims(dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
                        patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                        decoder_hidden_size=16, num_labels=5, classifier_dropout_prob=0.0, drop_path_rate=0.0),
                   dict(depths=[3, 4, 6, 3], hidden_sizes=[64, 128, 320, 512], decoder_hidden_size=768,
                        num_labels=150))
_SEGMENT_IMAGE = _dims(32, 512)


def _segformer(size: str) -> nn.Module:
    t = _transformers()
    return t.SegformerForSemanticSegmentation(t.SegformerConfig(**_SEGFORMER[size]))


def _segformer_sample(size: str, batch: int, device: torch.device, gen: torch.Generator) -> Sample:
    """Images and their per-pixel class masks (B, H, W): the model upsamples its logits to the mask's size."""
    side = _SEGMENT_IMAGE[size]
    return {"pixel_values": _floats((batch, 3, side, side), device, gen),
            "labels": _ints(_SEGFORMER[size]["num_labels"], (batch, side, side), device, gen)}


_VIDEOMAE = _dims(dict(image_size=32, patch_size=8, num_frames=4, tubelet_size=2, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=64, num_labels=10),
                  dict(image_size=224, patch_size=16, num_frames=16, tubelet_size=2, hidden_size=768,
                       num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, num_labels=400))


def _videomae(size: str) -> nn.Module:
    t = _transformers()
    return t.VideoMAEForVideoClassification(t.VideoMAEConfig(**_VIDEOMAE[size]))


def _video_sample(size: str, batch: int, device: torch.device, gen: torch.Generator) -> Sample:
    cfg = _VIDEOMAE[size]  # pixel_values: (batch, frames, channels, height, width)
    return {"pixel_values": _floats((batch, cfg["num_frames"], 3, cfg["image_size"], cfg["image_size"]), device, gen),
            "labels": _ints(cfg["num_labels"], (batch,), device, gen)}


# ---- speech -----------------------------------------------------------------------------------------------
_WHISPER = _dims(dict(vocab_size=128, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2,
                      encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                      max_source_positions=16, max_target_positions=32, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2, decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None,
                      dropout=0.0, attention_dropout=0.0, activation_dropout=0.0),
                 dict(vocab_size=51865, num_mel_bins=80, d_model=768, encoder_layers=12, decoder_layers=12,
                      encoder_attention_heads=12, decoder_attention_heads=12, encoder_ffn_dim=3072,
                      decoder_ffn_dim=3072, max_source_positions=1500, max_target_positions=448))
_WHISPER_TARGET = _dims(8, 128)


def _whisper(size: str) -> nn.Module:
    t = _transformers()
    return t.WhisperForConditionalGeneration(t.WhisperConfig(**_WHISPER[size]))


def _whisper_sample(size: str, batch: int, device: torch.device, gen: torch.Generator) -> Sample:
    cfg = _WHISPER[size]  # the encoder takes 2 x max_source_positions frames (its conv halves them)
    return {"input_features": _floats((batch, cfg["num_mel_bins"], 2 * cfg["max_source_positions"]), device, gen),
            "labels": _ints(cfg["vocab_size"], (batch, _WHISPER_TARGET[size]), device, gen, low=3)}


_WAV2VEC2 = _dims(dict(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                       conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                       num_conv_pos_embedding_groups=4, mask_time_prob=0.0, hidden_dropout=0.0,
                       activation_dropout=0.0, attention_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0,
                       layerdrop=0.0, pad_token_id=0, ctc_loss_reduction="mean"),
                  dict(vocab_size=32, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                       intermediate_size=3072, mask_time_prob=0.0, layerdrop=0.0, pad_token_id=0,
                       ctc_loss_reduction="mean"))
_AUDIO = _dims(1600, 64000)  # raw samples: 0.1 s and 4 s at 16 kHz
_TRANSCRIPT = _dims(8, 40)  # CTC targets, shorter than the encoder's frames (159 and 199)


def _wav2vec2(size: str) -> nn.Module:
    t = _transformers()
    return t.Wav2Vec2ForCTC(t.Wav2Vec2Config(**_WAV2VEC2[size]))


def _wav2vec2_sample(size: str, batch: int, device: torch.device, gen: torch.Generator) -> Sample:
    return {"input_values": _floats((batch, _AUDIO[size]), device, gen),
            "labels": _ints(_WAV2VEC2[size]["vocab_size"], (batch, _TRANSCRIPT[size]), device, gen, low=1)}


# ---- two towers -------------------------------------------------------------------------------------------
_CLIP = _dims(dict(text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=16, bos_token_id=0,
                                    eos_token_id=2, pad_token_id=1),
                   vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      image_size=32, patch_size=8),
                   projection_dim=16),
              dict(text_config=dict(vocab_size=49408, hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                                    num_attention_heads=8, max_position_embeddings=77),
                   vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                      num_attention_heads=12, image_size=224, patch_size=32),
                   projection_dim=512))


def _clip(size: str) -> nn.Module:
    t = _transformers()
    return t.CLIPModel(t.CLIPConfig(**_CLIP[size]))


def _clip_sample(size: str, batch: int, device: torch.device, gen: torch.Generator) -> Sample:
    """Captions and images; `return_loss=True` makes CLIP compute its contrastive loss (targets: the pairing)."""
    text, vision = _CLIP[size]["text_config"], _CLIP[size]["vision_config"]
    return {"input_ids": _ints(text["vocab_size"], (batch, text["max_position_embeddings"]), device, gen),
            "pixel_values": _floats((batch, 3, vision["image_size"], vision["image_size"]), device, gen),
            "return_loss": True}


# ---- vision-language --------------------------------------------------------------------------------------
_LLAVA = _dims(
    dict(text_config=dict(model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=64),
         vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, image_size=32, patch_size=8, projection_dim=32),
         image_token_index=127),
    dict(text_config=dict(model_type="llama", vocab_size=32064, hidden_size=4096, intermediate_size=11008,
                          num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=32,
                          max_position_embeddings=4096),
         vision_config=dict(model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096,
                            num_hidden_layers=24, num_attention_heads=16, image_size=336, patch_size=14,
                            projection_dim=768),
         image_token_index=32000))
_LLAVA_SEQ = _dims(32, 2048)  # tokens, the image's among them


def _llava(size: str) -> nn.Module:
    """LLaVA-1.5's fine-tune: the CLIP tower frozen, the projector and the language model trained."""
    t = _transformers()
    model = t.LlavaForConditionalGeneration(t.LlavaConfig(**_LLAVA[size], projector_hidden_act="gelu",
                                                          vision_feature_layer=-2,
                                                          vision_feature_select_strategy="default"))
    model.model.vision_tower.requires_grad_(False)
    return model


def _llava_sample(size: str, batch: int, device: torch.device, gen: torch.Generator) -> Sample:
    """A prompt whose tokens 1.. are the image's placeholders (one a patch; "default" drops CLS), the image, and
    the labels: the tokens, the image's positions ignored (-100)."""
    cfg = _LLAVA[size]
    vision, image_token = cfg["vision_config"], cfg["image_token_index"]
    patches = (vision["image_size"] // vision["patch_size"]) ** 2
    ids = _ints(image_token, (batch, _LLAVA_SEQ[size]), device, gen)
    labels = ids.clone()
    if device.type != "meta":
        ids[:, 1:1 + patches] = image_token
        labels[:, 1:1 + patches] = -100
    side = vision["image_size"]
    return {"input_ids": ids, "pixel_values": _floats((batch, 3, side, side), device, gen), "labels": labels}


# ---- LoRA fine-tune and a plain MLP -----------------------------------------------------------------------
_LORA = _dims(dict(r=4, lora_alpha=8), dict(r=16, lora_alpha=32))


def _llama_lora(size: str) -> nn.Module:
    import peft  # optional (the `test` extra): the LoRA family is skipped without it

    config = peft.LoraConfig(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0,
                             task_type="CAUSAL_LM", **_LORA[size])
    return peft.get_peft_model(_llama(size), config)


class MLP(nn.Module):
    """A plain MLP classifier: features -> logits (`labels` is the sample's target, read by the loss only)."""

    def __init__(self, features: int, hidden: int, depth: int, classes: int) -> None:
        super().__init__()
        widths = [features] + [hidden] * (depth - 1)
        layers: list[nn.Module] = []
        for a, b in zip(widths, widths[1:]):
            layers += [nn.Linear(a, b), nn.GELU()]
        self.net = nn.Sequential(*layers, nn.Linear(widths[-1], classes))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.net(x)


_MLP = _dims(dict(features=32, hidden=64, depth=3, classes=10), dict(features=1024, hidden=8192, depth=8, classes=1000))


def _mlp(size: str) -> nn.Module:
    return MLP(**_MLP[size])


# ---- optional: timm and torchvision (on the GPU machine; their wheels do not load on a CPU torch) ----------
class Classifier(nn.Module):
    """An image model that takes `pixel_values` (and ignores `labels`, read by the loss), as the zoo calls it."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.net(pixel_values)


def _timm_vit(size: str) -> nn.Module:
    import timm  # optional: only on machines whose timm loads

    if size == "tiny":
        return Classifier(timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8,
                                            depth=2, num_classes=10))
    return Classifier(timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=1000))


def _torchvision_resnet(size: str) -> nn.Module:
    import torchvision  # optional: only on machines whose torchvision loads

    if size == "tiny":
        return Classifier(torchvision.models.resnet18(num_classes=10))
    return Classifier(torchvision.models.resnet50(num_classes=1000))


# ---- the registry -----------------------------------------------------------------------------------------
def _lm(vocab: Mapping[str, Any], seq: tuple[int, int]) -> Callable[..., Sample]:
    return partial(_causal_lm_sample, vocab=_dims(vocab["tiny"]["vocab_size"], vocab["realistic"]["vocab_size"]),
                   seq=_dims(*seq))


def _s2s(cfg: Mapping[str, Any], seq: tuple[int, int], target: tuple[int, int]) -> Callable[..., Sample]:
    return partial(_seq2seq_sample, vocab=_dims(cfg["tiny"]["vocab_size"], cfg["realistic"]["vocab_size"]),
                   seq=_dims(*seq), target=_dims(*target))


_IMAGES = partial(_image_sample, image=_IMAGE, classes=_CLASSES)

ZOO: tuple[Family, ...] = (
    Family("bert", "encoder", _bert, _lm(_BERT, (16, 512)), _hf_loss, "BERT-base, 512 tokens", 32),
    Family("t5", "encoder-decoder", _t5, _s2s(_T5, (16, 512), (8, 128)), _hf_loss,
           "T5-base, 512 -> 128 tokens", 32),
    Family("bart", "encoder-decoder", _bart, _s2s(_BART, (16, 512), (8, 128)), _hf_loss,
           "BART-base, 512 -> 128 tokens", 32),
    Family("gpt2", "decoder", _gpt2, _lm(_GPT2, (16, 1024)), _hf_loss, "GPT-2 124M, 1024 tokens", 16),
    Family("llama", "decoder", _llama, _lm(_LLAMA, (16, 2048)), _hf_loss, "Llama-3.2-1B shape, 2048 tokens", 8),
    Family("qwen2", "decoder", _qwen2, _lm(_QWEN2, (16, 2048)), _hf_loss, "Qwen2.5-0.5B shape, 2048 tokens", 8),
    Family("gemma", "decoder", _gemma, _lm(_GEMMA, (16, 2048)), _hf_loss, "Gemma-2B shape, 2048 tokens", 4),
    Family("mistral", "decoder", _mistral, _lm(_MISTRAL, (16, 2048)), _hf_loss,
           "Mistral-7B shape with 8 of 32 layers, 2048 tokens", 4),
    Family("mixtral", "moe", _mixtral, _lm(_MIXTRAL, (16, 2048)), _hf_loss,
           "Mixtral-8x7B shape with 2 of 32 layers, 2048 tokens", 4),
    Family("qwen2-moe", "moe", _qwen2_moe, _lm(_QWEN2_MOE, (16, 2048)), _hf_loss,
           "Qwen1.5-MoE-A2.7B shape with 6 of 24 layers, 2048 tokens", 4),
    Family("olmoe", "moe", _olmoe, _lm(_OLMOE, (16, 2048)), _hf_loss, "OLMoE-1B-7B shape, 2048 tokens", 4),
    Family("deepseek-v3", "mla", _deepseek_v3, _lm(_DEEPSEEK_V3, (16, 2048)), _hf_loss,
           "DeepSeek-V3 architecture (MLA, q/k head 192, v head 128) at DeepSeek-V2-Lite widths, "
           "4 of 27 layers, 2048 tokens", 4),
    Family("mamba2", "state-space", _mamba2, _lm(_MAMBA2, (16, 2048)), _hf_loss,
           "Mamba2-130m shape (transformers' torch SSD scan, chunks of 256), 2048 tokens", 16),
    Family("bamba", "hybrid", _bamba, _lm(_BAMBA, (16, 2048)), _hf_loss,
           "Bamba-9B shape with 8 of 32 layers (attention in layer 4, Mamba2 in the others), 2048 tokens", 4),
    Family("resnet", "vision-cnn", _resnet, _IMAGES, _hf_loss, "ResNet-50, 224 px", 64),
    Family("convnext", "vision-cnn", _convnext, _IMAGES, _hf_loss, "ConvNeXt-T, 224 px", 64),
    Family("mobilenet-v2", "vision-cnn", _mobilenet_v2, _IMAGES, _hf_loss,
           "MobileNetV2-1.0 (depthwise-separable inverted residuals), 224 px", 128),
    Family("vit", "vision-transformer", _vit, _IMAGES, _hf_loss, "ViT-B/16, 224 px", 64),
    Family("swin", "vision-transformer", _swin, _IMAGES, _hf_loss, "Swin-T, 224 px, window 7", 64),
    Family("segformer", "dense-prediction", _segformer, _segformer_sample, _hf_loss,
           "SegFormer-B2 (MiT-b2), 512 px, 150 classes (ADE20K), per-pixel labels", 16),
    Family("videomae", "video", _videomae, _video_sample, _hf_loss,
           "VideoMAE-B, 16 frames of 224 px (tubelets 2x16x16), 400 classes", 8),
    Family("whisper", "speech", _whisper, _whisper_sample, _hf_loss,
           "Whisper-small, 30 s of 80 mel bins -> 128 tokens", 16),
    Family("wav2vec2", "speech", _wav2vec2, _wav2vec2_sample, _hf_loss, "wav2vec2-base CTC, 4 s at 16 kHz", 16),
    Family("clip", "two-tower", _clip, _clip_sample, _hf_loss, "CLIP ViT-B/32, 77 tokens and 224 px", 128),
    Family("llava", "vision-language", _llava, _llava_sample, _hf_loss,
           "LLaVA-1.5-7B shape with 8 of 32 language layers, CLIP ViT-L/14 at 336 px frozen, "
           "2048 tokens of which 576 the image's", 4),
    Family("llama-lora", "lora", _llama_lora, _lm(_LLAMA, (16, 2048)), _hf_loss,
           "LoRA r=16 on q/k/v/o of the Llama-3.2-1B shape (peft), 2048 tokens", 8,
           requires=("transformers", "peft")),
    Family("mlp", "mlp", _mlp, partial(_features_sample, features=_dims(32, 1024), classes=_CLASSES),
           _cross_entropy, "8 layers of 8192, 1024 features -> 1000 classes", 1024, requires=()),
    Family("timm-vit", "vision-transformer", _timm_vit, _IMAGES, _cross_entropy, "timm ViT-B/16, 224 px", 64,
           requires=("timm",)),
    Family("torchvision-resnet", "vision-cnn", _torchvision_resnet, _IMAGES, _cross_entropy,
           "torchvision ResNet-50, 224 px", 64, requires=("torchvision",)),
)



def _hf_sized(model_cls: str, config_cls: str, table: Mapping[str, Any], realistic: Mapping[str, Any],
              size: str) -> nn.Module:
    """A transformers model of `table`'s config at `size`, its realistic size changed by `realistic`."""
    t = _transformers()
    return getattr(t, model_cls)(getattr(t, config_cls)(**{**table[size], **(realistic if size == "realistic" else {})}))


# Issue 14's suite (bench/suite.py) at more sizes of two zoo families: built and measured as families are (bench
# zoo --families NAME), but not in ZOO, so the zoo's "all", its tests and its tables keep one model a family.
# The tiny sizes are the family's own.
_GPT2_355M = dict(n_embd=1024, n_layer=24, n_head=16)  # GPT-2 medium
_GPT2_1_5B = dict(n_embd=1600, n_layer=48, n_head=25)  # GPT-2 XL
# Llama-3.2-3B's shape: hidden 3072, 28 layers, 24 heads over 8 key/value heads, MLP 8192, tied embeddings
_LLAMA_3B = dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                 num_key_value_heads=8)
SIZED: tuple[Family, ...] = (
    Family("gpt2-355m", "decoder", partial(_hf_sized, "GPT2LMHeadModel", "GPT2Config", _GPT2, _GPT2_355M),
           _lm(_GPT2, (16, 1024)), _hf_loss, "GPT-2 355M, 1024 tokens", 16),
    Family("gpt2-1.5b", "decoder", partial(_hf_sized, "GPT2LMHeadModel", "GPT2Config", _GPT2, _GPT2_1_5B),
           _lm(_GPT2, (16, 1024)), _hf_loss, "GPT-2 1.5B, 1024 tokens", 8),
    Family("llama-3b", "decoder", partial(_hf_sized, "LlamaForCausalLM", "LlamaConfig", _LLAMA, _LLAMA_3B),
           _lm(_LLAMA, (16, 2048)), _hf_loss, "Llama-3.2-3B shape, 2048 tokens", 4),
    # the batch at which the hand recipe (bf16 autocast, every activation kept) runs out of an H200's memory
    Family("llama-3b-b16", "decoder", partial(_hf_sized, "LlamaForCausalLM", "LlamaConfig", _LLAMA, _LLAMA_3B),
           _lm(_LLAMA, (16, 2048)), _hf_loss, "Llama-3.2-3B shape, 2048 tokens, 16 a step", 16),
)

FAMILIES: dict[str, Family] = {f.name: f for f in ZOO + SIZED}
assert len(FAMILIES) == len(ZOO) + len(SIZED) and all(f.kind in KINDS for f in FAMILIES.values()), \
    "zoo names are unique, kinds known"


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"no zoo family {name!r}; the zoo has {', '.join(FAMILIES)}") from None


def roofline_s(profile: ModelProfile, device: DeviceSpec) -> float:
    """The traced step's roofline time on `device`, seconds: per op the trace recorded (its `count` calls, in
    every block that has them), the larger of its FLOPs at the peak of the dtype it ran in (bf16/fp16 on
    tensor cores; fp32 at the plain fp32 rate, as without TF32) and its bytes read and written at the HBM
    bandwidth, summed. A floor no run of this trace beats, except where compile fuses memory-bound ops."""
    half = device.peak_flops("bf16" if device.supports("bf16") else "fp32")
    seconds = 0.0
    for group in profile.op_groups:
        repeats = len(group.blocks) if group.where == "blocks" else 1
        for op in group.ops:
            peak = half if op.dtype in ("bfloat16", "float16") else device.fp32_flops
            seconds += repeats * max(op.flops / peak, op.bytes / device.hbm_bytes_per_s)
    return seconds


def count_params(model: nn.Module) -> tuple[int, int]:
    """(all, trainable) unique parameters."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def _si(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def table(*, params: bool = True) -> str:
    """The zoo as a Markdown table (with realistic parameter counts, built on meta, when `params`)."""
    rows = ["| family | kind | realistic size | batch | parameters (trainable) | status |",
            "| --- | --- | --- | --- | --- | --- |"]
    for f in ZOO:
        why = f.unavailable()
        count = ""
        if params and why is None:
            total, trainable = count_params(build_model(f, "realistic"))
            count = _si(total) + ("" if trainable == total else f" ({_si(trainable)})")
        rows.append(f"| {f.name} | {f.kind} | {f.realistic} | {f.realistic_batch} | {count} | "
                    f"{'ok' if why is None else 'skipped: ' + why} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.zoo", description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the zoo's table")
    parser.add_argument("--no-params", action="store_true", help="do not build the models to count parameters")
    args = parser.parse_args(argv)
    if not args.list:
        parser.print_help()
        return 0
    print(table(params=not args.no_params))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
