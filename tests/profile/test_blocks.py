"""find_blocks and blocks=: repeated containers found, blocks named by path, list or class, and the errors; blocks in
every family (both stacks, stages, MoE layers, speech encoders, two towers, no repeated blocks) and what pipeline
and tensor parallelism make of blocks in several containers."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.errors import PlanError, ProfileError
from autopar.layout import check_pipeline, pairs_from_calls, pipeline_refusal, sequence_parallel_refusal
from autopar.models.gpt import Block, lm_loss, synthetic_tokens
from autopar.plans import Plan
from autopar.profile import MatmulCall, ModelProfile, find_blocks, iter_block_modules, profile_model
from autopar.strategies.apply import check_plan, last_blocks
from autopar.strategies.tensor_parallel import tp_layout
from tests.profile._helpers import SMALL, _gpt, _mlp


def test_repeated_sequential_is_found_as_blocks():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), *[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(3)],
                          nn.Linear(32, 2))
    p = profile_model(model, torch.randn(2, 8))
    assert p.repeated and p.blocks_path == ""  # the root Sequential is the container
    assert [b.name for b in p.blocks] == ["1", "2", "3"]
    assert p.num_params_in_blocks == 3 * (32 * 32 + 32)


def test_blocks_by_path_list_and_class(gpt_profile):
    model, x, auto = gpt_profile
    by_path = profile_model(model, x, blocks="blocks", loss_fn=lm_loss)
    assert by_path.blocks_path == "blocks" and [b.name for b in by_path.blocks] == [b.name for b in auto.blocks]
    assert by_path.flops == auto.flops
    by_list = profile_model(model, x, blocks=["blocks.0", "blocks.2"])
    assert by_list.blocks_path is None and [b.name for b in by_list.blocks] == ["blocks.0", "blocks.2"]
    assert by_list.num_params_outside_blocks == auto.num_params_outside_blocks + auto.blocks[1].num_params
    assert by_list.blocks[1].flops == auto.blocks[2].flops
    by_class = profile_model(model, x, blocks=Block)
    assert by_class.blocks_path is None and [b.name for b in by_class.blocks] == [b.name for b in auto.blocks]
    assert by_class.block_class == "Block"
    by_classes = profile_model(model, x, blocks=(nn.LayerNorm,))
    # outermost LayerNorms: two per block and the final one
    assert len(by_classes.blocks) == 2 * SMALL.num_layers + 1
    # the units named by hand on a model without repeated blocks
    p = profile_model(_mlp(), torch.randn(2, 8), blocks=["0", "4"], warn=False)
    assert p.repeated and not p.notes and [b.name for b in p.blocks] == ["0", "4"]


def test_find_blocks_returns_modules():
    model = _gpt()
    path, found, repeated = find_blocks(model)
    assert path == "blocks" and repeated
    assert [m for _, m in found] == list(model.blocks)
    assert [m for _, m in find_blocks(model, Block)[1]] == list(model.blocks)


def test_blocks_path_that_does_not_exist_lists_the_containers():
    with pytest.raises(ProfileError) as info:
        profile_model(_gpt(), synthetic_tokens(2, SMALL), blocks="model.layers")
    msg = str(info.value)
    assert "no module at 'model.layers' in GPT" in msg
    assert "blocks (ModuleList, 3 children)" in msg
    with pytest.raises(ProfileError, match="no module at 'blocks.9'"):
        profile_model(_gpt(), synthetic_tokens(2, SMALL), blocks=["blocks.0", "blocks.9"])


def test_blocks_errors_for_leaf_path_and_missing_class():
    with pytest.raises(ProfileError, match="no children"):
        find_blocks(_gpt(), "lm_head")
    with pytest.raises(ProfileError, match="no module of class .*Conv2d.*containers in the model: blocks"):
        find_blocks(_gpt(), nn.Conv2d)

    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2)

        def forward(self, x):
            return self.a(x)

    with pytest.raises(ProfileError, match="no ModuleList, Sequential or ModuleDict: pass blocks="):
        find_blocks(Flat(), "b")


def test_iter_block_modules_refuses_a_profile_of_another_model(gpt_profile):
    model, _, p = gpt_profile
    assert [m for _, m in iter_block_modules(model, p)] == list(model.blocks)
    with pytest.raises(ProfileError, match="another model"):
        list(iter_block_modules(_mlp(), p))



# ---- every family: both stacks, stages, MoE layers, speech encoders, two towers ---------------------------------
def _hf(config: str, model: str, **kwargs):
    """A tiny Hugging Face model on the meta device (structure only: find_blocks reads no values)."""
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        return getattr(transformers, model)(getattr(transformers, config)(**kwargs))


_LM = dict(vocab_size=64, max_position_embeddings=32)
_MOE = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, **_LM)
_SEQ2SEQ = dict(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)

FAMILIES = {
    # encoder-decoders: both stacks (T5's first block holds the relative position bias, the others do not)
    "t5": (("T5Config", "T5ForConditionalGeneration"),
           dict(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3, num_heads=4,
                decoder_start_token_id=0, pad_token_id=0), ("T5Block",), 2),
    "bart": (("BartConfig", "BartForConditionalGeneration"), dict(max_position_embeddings=32, **_SEQ2SEQ),
             ("BartEncoderLayer", "BartDecoderLayer"), 2),
    "whisper": (("WhisperConfig", "WhisperForConditionalGeneration"),
                dict(num_mel_bins=8, max_source_positions=16, max_target_positions=32, pad_token_id=0,
                     bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, **_SEQ2SEQ),
                ("WhisperEncoderLayer", "WhisperDecoderLayer"), 2),
    # vision stages of different widths: the blocks inside every stage (a stage's first block differs)
    "swin": (("SwinConfig", "SwinForImageClassification"),
             dict(image_size=32, patch_size=2, embed_dim=16, depths=[2, 1], num_heads=[2, 4], window_size=4),
             ("SwinLayer",), 2),
    "convnext": (("ConvNextConfig", "ConvNextForImageClassification"),
                 dict(hidden_sizes=[8, 16, 32], depths=[2, 1, 3], num_stages=3, image_size=32), ("ConvNextLayer",), 3),
    "resnet": (("ResNetConfig", "ResNetForImageClassification"),
               dict(embedding_size=8, hidden_sizes=[16, 32], depths=[2, 3], layer_type="bottleneck"),
               ("ResNetBottleNeckLayer",), 2),
    "resnet-basic": (("ResNetConfig", "ResNetForImageClassification"),
                     dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic"),
                     ("ResNetBasicLayer",), 2),
    "vit": (("ViTConfig", "ViTForImageClassification"),
            dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64), ("ViTLayer",), 1),
    # MoE: DeepSeek's first layer dense, the rest MoE (one container, two structures); routed experts
    "deepseek-v3": (("DeepseekV3Config", "DeepseekV3ForCausalLM"),
                    dict(num_hidden_layers=3, first_k_dense_replace=1, moe_intermediate_size=16, n_routed_experts=4,
                         n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=16,
                         q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                         **{**_MOE, "num_key_value_heads": 4}), ("DeepseekV3DecoderLayer",), 1),
    "mixtral": (("MixtralConfig", "MixtralForCausalLM"),
                dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, **_MOE),
                ("MixtralDecoderLayer",), 1),
    "qwen2-moe": (("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
                  dict(num_hidden_layers=2, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                       num_experts=4, num_experts_per_tok=2, **_MOE), ("Qwen2MoeDecoderLayer",), 1),
    "olmoe": (("OlmoeConfig", "OlmoeForCausalLM"),
              dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, pad_token_id=1, eos_token_id=0,
                   **{**_MOE, "intermediate_size": 16}), ("OlmoeDecoderLayer",), 1),
    # speech: the transformer layers; wav2vec2's small convolutional feature extractor stays outside
    "wav2vec2": (("Wav2Vec2Config", "Wav2Vec2ForCTC"),
                 dict(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                      conv_dim=(16, 16, 16), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
                      num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4), ("Wav2Vec2EncoderLayer",), 1),
    # two towers: both towers' layers
    "clip": (("CLIPConfig", "CLIPModel"),
             dict(text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=16),
                  vision_config=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                                     image_size=32, patch_size=8), projection_dim=16), ("CLIPEncoderLayer",), 2),
}


def _outermost_of(model: nn.Module, classes: tuple[str, ...]) -> list[str]:
    """The names of every outermost module of these classes, in module order: what the blocks should be."""
    found: list[str] = []
    for name, module in model.named_modules():
        if type(module).__name__ in classes and not any(name.startswith(f + ".") for f in found):
            found.append(name)
    return found


@pytest.mark.parametrize("family", FAMILIES, ids=list(FAMILIES))
def test_find_blocks_in_every_family(family):
    (config, model_class), kwargs, classes, containers = FAMILIES[family]
    model = _hf(config, model_class, **kwargs)
    path, found, repeated = find_blocks(model)
    names = [n for n, _ in found]
    assert repeated and names == _outermost_of(model, classes)
    parents = list(dict.fromkeys(n.rpartition(".")[0] for n in names))
    assert len(parents) == containers, parents
    assert path == (parents[0] if containers == 1 else None)


def test_two_stacks_two_towers_and_stages_are_named_as_such():
    t5 = find_blocks(_hf("T5Config", "T5ForConditionalGeneration", **FAMILIES["t5"][1]))[1]
    assert [n for n, _ in t5] == [f"encoder.block.{i}" for i in range(2)] + [f"decoder.block.{i}" for i in range(3)]
    clip = [n for n, _ in find_blocks(_hf("CLIPConfig", "CLIPModel", **FAMILIES["clip"][1]))[1]]
    assert [n.split(".")[0] for n in clip] == ["text_model"] * 2 + ["vision_model"] * 3
    resnet = [n for n, _ in find_blocks(_hf("ResNetConfig", "ResNetForImageClassification",
                                            **FAMILIES["resnet"][1]))[1]]
    assert resnet == [f"resnet.encoder.stages.{s}.layers.{i}" for s, n in enumerate((2, 3)) for i in range(n)]
    wav2vec2 = _hf("Wav2Vec2Config", "Wav2Vec2ForCTC", **FAMILIES["wav2vec2"][1])
    assert not any("feature_extractor" in n for n, _ in find_blocks(wav2vec2)[1])


class _Expert(nn.Module):
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, ffn), nn.Linear(ffn, dim)


class _MoELayer(nn.Module):
    """An MoE layer with its experts in a ModuleList (as older Mixtral code and many MoE models hold them)."""

    def __init__(self, dim: int, experts: int, dense: bool = False) -> None:
        super().__init__()
        self.attn = nn.Linear(dim, dim)
        self.mlp = _Expert(dim, 4 * dim) if dense else nn.ModuleList(_Expert(dim, dim) for _ in range(experts))


def test_moe_layers_are_the_blocks_not_their_experts():
    class MoE(nn.Module):
        def __init__(self, dense_first: int) -> None:
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.layers = nn.ModuleList(_MoELayer(8, 4, dense=i < dense_first) for i in range(3))

    for dense_first in (0, 1, 2):  # all MoE; DeepSeek-style dense first layers (the same class, two structures)
        path, found, repeated = find_blocks(MoE(dense_first))
        assert path == "layers" and repeated and [n for n, _ in found] == ["layers.0", "layers.1", "layers.2"]


def test_a_stage_container_with_equal_stages_keeps_the_stages():
    """Stages are looked into only where they differ; identical repeated modules are the blocks themselves."""
    class Stage(nn.Module):
        def __init__(self, dim: int, depth: int) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(depth))

    class Net(nn.Module):
        def __init__(self, dims: tuple[int, ...]) -> None:
            super().__init__()
            self.stages = nn.ModuleList(Stage(d, 2) for d in dims)

    assert [n for n, _ in find_blocks(Net((8, 16)))[1]] == [f"stages.{s}.blocks.{i}" for s in (0, 1) for i in (0, 1)]
    path, found, _ = find_blocks(Net((8, 8)))
    assert path == "stages" and [n for n, _ in found] == ["stages.0", "stages.1"]


# ---- no repeated blocks: the top-level units -----------------------------------------------------------------
class _Wrapped(nn.Module):
    """A plain MLP inside one Sequential (as bench/zoo.py's MLP): the Sequential's layers are the units."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32),
                                 nn.GELU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_a_model_without_repeated_blocks_gets_its_top_level_units():
    path, found, repeated = find_blocks(_Wrapped())
    assert (path, repeated) == (None, False) and [n for n, _ in found] == ["net.0", "net.2", "net.4", "net.6"]
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(16, 10))
    path, found, repeated = find_blocks(cnn)
    assert (path, repeated) == (None, False) and [n for n, _ in found] == ["0", "2", "6"]
    p = profile_model(_Wrapped(), torch.randn(4, 8), warn=False)
    assert not p.repeated and p.num_params_outside_blocks == 0 and p.num_blocks == 4
    assert "net.0, net.2, net.4, net.6" in p.notes[0] and all(b.flops > 0 for b in p.blocks)


@pytest.mark.filterwarnings("ignore:autopar. no repeated blocks")
def test_a_model_without_blocks_plans_and_refuses_a_pipeline_over_its_activations():
    """Its units are FSDP units; pipeline stages would skip the GELUs between them at a boundary."""

    p = profile_model(_Wrapped(), torch.randn(8, 8), warn=False)
    with pytest.raises(PlanError, match=r"block net\.0 is not followed by block net\.1"):
        check_pipeline(Plan(pp=2, pp_schedule="gpipe", micro_batch_size=4, grad_accum=2), p)
    plan = autopar.plan(_Wrapped(), sample=torch.randn(8, 8), topology="8xH100-SXM", loss_fn=_sum_loss)
    assert plan.pp == 1


def _sum_loss(output, sample):
    return output.sum()


# ---- blocks= naming several containers -----------------------------------------------------------------------
def test_blocks_as_several_containers():
    model = _hf("T5Config", "T5ForConditionalGeneration", **FAMILIES["t5"][1])
    auto = find_blocks(model)
    assert find_blocks(model, ("encoder.block", "decoder.block")) == auto
    assert find_blocks(model, ["encoder.block.*", "decoder.block.*"]) == auto
    # one container, named alone: its path, as blocks="encoder.block" gives it
    assert find_blocks(model, ["encoder.block"])[0] == find_blocks(model, "encoder.block")[0] == "encoder.block"
    # a module that is not a ModuleList / ModuleDict is itself a block
    assert [n for n, _ in find_blocks(model, ["encoder", "decoder"])[1]] == ["encoder", "decoder"]
    with pytest.raises(ProfileError, match="lies inside the block 'encoder.block.0'"):
        find_blocks(model, ["encoder.block.0", "encoder.block.0.layer.0"])
    with pytest.raises(ProfileError, match="named twice"):
        find_blocks(model, ["encoder.block", "encoder.block.1"])
    with pytest.raises(ProfileError, match="no module at 'encoder.blocks'"):
        find_blocks(model, ["encoder.blocks.*"])


# ---- what a profile with blocks in several containers says, and what pipelines and TP make of it --------------
@pytest.fixture(scope="module")
def bart_profile():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(transformers.BartConfig(
        max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, **_SEQ2SEQ))
    sample = {"input_ids": torch.randint(0, 64, (2, 12)), "labels": torch.randint(0, 64, (2, 6))}
    return model, profile_model(model, sample, loss_fn=lambda out, s: out.loss)


def test_profile_of_an_encoder_decoder_has_both_stacks(bart_profile):

    model, p = bart_profile
    assert p.repeated and p.blocks_path is None and p.block_class is None
    assert p.block_containers == ("model.encoder.layers", "model.decoder.layers")
    assert [b.name for b in p.blocks] == [f"model.encoder.layers.{i}" for i in range(2)] + \
        [f"model.decoder.layers.{i}" for i in range(3)]
    assert all(b.flops > 0 and b.saved_bytes > 0 for b in p.blocks)  # both stacks ran inside their blocks
    decoder, encoder = p.blocks[-1], p.blocks[0]
    assert decoder.num_params > encoder.num_params  # cross-attention
    assert p.num_params_in_blocks == sum(q.numel() for layer in (*model.model.encoder.layers,
                                                                 *model.model.decoder.layers)
                                         for q in layer.parameters())
    assert "5 blocks in 2 containers: model.encoder.layers (2), model.decoder.layers (3)" in p.describe()
    assert ModelProfile.from_dict(p.to_dict()).block_containers == p.block_containers


def test_pipeline_is_refused_for_blocks_in_several_containers(bart_profile):

    _, p = bart_profile
    why = pipeline_refusal(p)
    assert why is not None and "\n" not in why
    assert "2 containers (model.encoder.layers, model.decoder.layers): set pp=1" in why
    with pytest.raises(PlanError, match="lie in 2 containers"):
        check_pipeline(Plan(pp=2, pp_schedule="gpipe", micro_batch_size=1, grad_accum=2), p)


def test_pipeline_refuses_listed_blocks_with_a_gap_and_takes_one_run(gpt_profile):

    model, x, p = gpt_profile
    assert pipeline_refusal(p) is None and p.block_containers == ("blocks",)
    gap = profile_model(model, x, blocks=["blocks.0", "blocks.2"], loss_fn=lm_loss)
    with pytest.raises(PlanError, match=r"block blocks\.0 is not followed by block blocks\.1"):
        check_pipeline(Plan(pp=2, pp_schedule="gpipe", micro_batch_size=2, grad_accum=2), gap)


def test_sequence_parallel_is_refused_for_blocks_in_several_containers(bart_profile, gpt_profile):
    _, p = bart_profile
    why = sequence_parallel_refusal(p)
    assert why is not None and "\n" not in why and "set sequence_parallel=False" in why
    assert sequence_parallel_refusal(gpt_profile[2]) is None
    with pytest.raises(PlanError, match="sequence parallelism shards the blocks' input"):
        check_plan(Plan(tp=2, micro_batch_size=2, sequence_parallel=True), p, autopar.Topology.from_spec("2xH100-SXM"),
                   world_size=2)


def test_tensor_parallel_pairs_are_found_per_block_with_cross_attention(bart_profile):

    model, p = bart_profile
    layout = tp_layout(model, p)
    by_row = {pair.rowwise: pair for pair in layout.pairs}
    for stack, n in (("encoder", 2), ("decoder", 3)):
        for i in range(n):
            block = f"model.{stack}.layers.{i}"
            assert by_row[f"{block}.self_attn.out_proj"].colwise == tuple(f"{block}.self_attn.{x}_proj" for x in "qkv")
            assert by_row[f"{block}.fc2"].colwise == (f"{block}.fc1",)
    # cross-attention: the query reads the decoder's hidden states, keys and values the encoder's output
    cross = by_row["model.decoder.layers.1.encoder_attn.out_proj"]
    assert cross.colwise == tuple(f"model.decoder.layers.1.encoder_attn.{x}_proj" for x in "qkv") and cross.attention
    assert cross.replicated == ("model.decoder.layers.1.encoder_attn.k_proj", "model.decoder.layers.1.encoder_attn.v_proj")
    assert len(layout.pairs) == 2 * 2 + 3 * 3 and not layout.notes
    # the embedding both stacks' embeddings share (and the head tied to it) stays whole: a split one would
    # meet the stacks' own embedding modules with a sharded weight
    assert (layout.embedding, layout.head, layout.tied_head) == (None, None, False)


def test_pairs_from_calls_joins_outside_inputs_to_the_column_group():

    def call(name: str, input_id: int, i: int = 8, o: int = 8) -> MatmulCall:
        return MatmulCall(name=name, kind="linear", input_id=input_id, in_features=i, out_features=o)

    calls = [call("q", 0), call("k", 0), call("v", 0), call("o", 1),  # self-attention
             call("cq", 2), call("ck", 9), call("cv", 9), call("co", 3),  # cross-attention on input 9
             call("up", 4, o=32), call("down", 5, i=32)]
    pairs = pairs_from_calls(calls, 8, None, outside=frozenset({9}))
    assert [(p.colwise, p.rowwise, p.replicated) for p in pairs] == [
        (("q", "k", "v"), "o", ()), (("cq", "ck", "cv"), "co", ("ck", "cv")), (("up",), "down", ())]


def test_a_fused_projection_is_split_as_the_model_s_own_plan_says():
    """A fused q/k/v layer lays its parts whole one after another ([q | k | v]: a strided shard of 3 chunks) unless the
    model's own TP plan splits it as a plain "colwise" (GPT-NeoX's: each head's q, k and v side by side, so a
    contiguous shard holds whole heads). Either way it is an attention."""

    def call(name: str, input_id: int, i: int = 8, o: int = 8) -> MatmulCall:
        return MatmulCall(name=name, kind="linear", input_id=input_id, in_features=i, out_features=o)

    calls = [call("qkv", 0, o=24), call("dense", 1)]
    (strided,) = pairs_from_calls(calls, 8, None)
    (plain,) = pairs_from_calls(calls, 8, {"qkv": "colwise", "dense": "rowwise"})
    (gathered,) = pairs_from_calls(calls, 8, {"qkv": "colwise_gather_output", "dense": "rowwise_split_input"})
    assert (strided.chunks, strided.attention) == (3, True) and (gathered.chunks, gathered.attention) == (3, True)
    assert (plain.chunks, plain.attention) == (1, True)
    # two parts (MiniCPM5-MoE's q and gate beside k and v projections the plan leaves whole): as without a plan
    (two,) = pairs_from_calls([call("q_gate", 0, o=16), call("o", 1)], 8, {"q_gate": "colwise", "o": "rowwise"})
    assert two.chunks == 2


def test_sequence_parallel_gathers_after_each_stack():

    names = ["e.0", "e.1", "d.0", "d.1", "d.2"]
    assert last_blocks([(n, None) for n in names]) == ["e.1", "d.2"]
    assert last_blocks([("h.0", None), ("h.1", None)]) == ["h.1"]


class _Bottleneck(nn.Module):
    """torchvision's Bottleneck layout: convolutions and norms as attributes, a downsample in the first."""

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, 4 * width, 1, bias=False), nn.BatchNorm2d(4 * width)
        self.downsample = nn.Sequential(nn.Conv2d(cin, 4 * width, 1, stride, bias=False),
                                        nn.BatchNorm2d(4 * width)) if stride > 1 or cin != 4 * width else None


def test_torchvision_style_resnet_layers_are_found_in_their_four_containers():
    class ResNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(3, 8, 7, 2, 3, bias=False), nn.BatchNorm2d(8)
            cin, layers = 8, []
            for i, (width, depth) in enumerate(((8, 3), (16, 4), (32, 6), (64, 3))):
                layers.append(nn.Sequential(*(_Bottleneck(cin if j == 0 else 4 * width, width, 2 if i and not j else 1)
                                              for j in range(depth))))
                cin = 4 * width
            self.layer1, self.layer2, self.layer3, self.layer4 = layers
            self.fc = nn.Linear(256, 10)

    path, found, repeated = find_blocks(ResNet())
    assert path is None and repeated
    assert [n for n, _ in found] == [f"layer{i + 1}.{j}" for i, depth in enumerate((3, 4, 6, 3)) for j in range(depth)]


class _Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(x))


class _StagesAsLists(nn.Module):
    """PoolFormer's and PVT's shape: each stage a ModuleList of its layers, iterated by the encoder's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.downs = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 16)])
        self.stages = nn.ModuleList([nn.ModuleList([_Layer(8) for _ in range(2)]),
                                     nn.ModuleList([_Layer(16) for _ in range(3)])])
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for down, stage in zip(self.downs, self.stages):
            x = down(x)
            for layer in stage:
                x = layer(x)
        return self.head(x)


def test_a_stage_that_is_a_list_of_layers_is_no_block_its_layers_are():
    """A ModuleList runs no forward of its own: FSDP2 refuses it as a unit and the trace sees no call of it. The
    stages' layers are the blocks (found, or named through the stages' container)."""
    model = _StagesAsLists()
    path, units, repeated = find_blocks(model)
    assert repeated and path is None
    assert [n for n, _ in units if n.startswith("stages")] == ["stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1",
                                                               "stages.1.2"]
    assert not any(isinstance(m, nn.ModuleList) for _, m in units)
    _, named, _ = find_blocks(model, "stages")
    assert [n for n, _ in named] == ["stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1", "stages.1.2"]
    p = profile_model(model, torch.randn(4, 8))
    assert len([b for b in p.blocks if b.name.startswith("stages")]) == 5
