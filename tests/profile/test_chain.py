"""Pipelines only on models whose blocks are one chain (autopar/profile/chain.py).

Each model below trained silently wrong under a pipeline plan on 2 and 4 gloo ranks (a helper's battery of users'
models, 2026-12-07: losses 8e-4 to 0.67 from one process), because a stage runs the forward with the other stages'
blocks and outer modules replaced; each is now refused, in one line that names what breaks the chain, and the
search plans them without a pipeline. The blocks users and transformers write as a chain keep their pipelines.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.errors import PlanError
from autopar.layout import check_pipeline, pipeline_refusal
from autopar.plans import Plan
from autopar.profile import profile_model

D, T = 16, 8


class Block(nn.Module):
    def __init__(self, width: int = D) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, h, extra=None, mask=None):
        h = h + torch.tanh(self.lin(h))
        return h if extra is None else h + extra


class Net(nn.Module):
    """Embedding, 4 blocks, head; `mode` says what runs around the blocks."""

    def __init__(self, mode: str = "chain") -> None:
        super().__init__()
        self.mode = mode
        self.emb = nn.Embedding(32, D)
        self.t_mlp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(D, 32)
        if mode == "tied":
            self.blocks[3].lin.weight = self.blocks[0].lin.weight

    def forward(self, x):
        h = self.emb(x)
        mask = torch.ones(x.shape[0], T, T).tril()  # computed from no parameter: every stage computes it again
        skips = []
        for i, block in enumerate(self.blocks):
            if self.mode == "unet" and i >= 2:
                h = h + skips[3 - i]  # an early block's output added to a late block's input
            if self.mode == "layerdrop" and i == 2:
                continue
            extra = torch.relu(self.t_mlp(torch.ones(D))) if self.mode == "timestep" else None
            h = block(h, extra, mask=mask)
            if self.mode == "scale" and i % 2:
                h = h * 0.9  # computed between blocks
            skips.append(h)
        out = self.head(h)
        if self.mode == "aux":  # every block's output read after the blocks (an auxiliary loss of each)
            out = out + sum(s.square().mean() for s in skips)
        return out


def _loss(out, x):
    return nn.functional.cross_entropy(out.flatten(0, 1), x.flatten())


def _profile(mode: str):
    torch.manual_seed(0)
    return profile_model(Net(mode), torch.randint(0, 32, (4, T)), loss_fn=_loss, warn=False)


@pytest.mark.parametrize("mode, says", [
    ("unet", r"add runs between block blocks\.1 and the next block"),
    ("scale", r"mul runs between block blocks\.1 and the next block"),
    ("layerdrop", r"block blocks\.3 runs where block blocks\.2 was due"),
    ("timestep", r"block blocks\.0 takes arg1, computed from parameters outside the blocks"),
    ("aux", r"pow after the blocks reads a value made in block blocks\.0"),
    ("tied", r"blocks\.0\.lin\.weight and blocks\.3\.lin\.weight are one parameter in two blocks"),
])
def test_blocks_that_are_not_one_chain_are_refused_a_pipeline_in_one_line(mode, says):
    p = _profile(mode)
    why = pipeline_refusal(p)
    assert why is not None and "\n" not in why and why.endswith("set pp=1"), why
    with pytest.raises(PlanError, match=says):
        check_pipeline(Plan(pp=2, pp_schedule="gpipe", micro_batch_size=2, grad_accum=2), p)


def test_a_chain_with_arguments_computed_from_no_parameter_keeps_its_pipeline():
    p = _profile("chain")
    assert p.pipeline_chain == "" and pipeline_refusal(p) is None


class Stages(nn.Module):
    """A CNN whose blocks change the width (a ResNet's stages as one run of blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1),
                                    nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.Conv2d(16, 16, 3, padding=1))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.blocks(x).mean((2, 3)))


def test_blocks_whose_hidden_states_change_shape_are_refused_a_pipeline():
    """A stage receives buffers of the first block's input shape: a stage at another width crashed."""
    p = profile_model(Stages(), torch.randn(2, 3, 8, 8), warn=False,
                      blocks=["blocks.0", "blocks.1", "blocks.2", "blocks.3"])
    assert "block blocks.1 takes hidden states of shape (2, 8, 8, 8), the first block (2, 3, 8, 8)" in p.pipeline_chain


def test_decoder_language_models_of_transformers_keep_their_pipelines():
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    ids = torch.randint(0, 64, (2, T))
    for model in (LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)),
                  MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                                   num_local_experts=4, num_experts_per_tok=2))):
        p = profile_model(model, {"input_ids": ids, "labels": ids}, warn=False)
        assert p.pipeline_chain == "" and pipeline_refusal(p) is None, (type(model).__name__, p.pipeline_chain)


def test_the_search_plans_a_model_that_is_no_chain_without_a_pipeline():
    torch.manual_seed(0)
    plan = autopar.plan(Net("unet"), sample=torch.randint(0, 32, (8, T)), loss_fn=_loss, topology="4xH100-SXM",
                        loop="train_step")
    assert plan.pp == 1 and math.prod((plan.dp_shard, plan.dp_replicate, plan.tp)) == 4
