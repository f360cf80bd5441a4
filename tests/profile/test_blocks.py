"""find_blocks and blocks=: repeated containers found, blocks named by path, list or class, and the errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autopar.errors import ProfileError
from autopar.models.gpt import Block, lm_loss, synthetic_tokens
from autopar.profile import find_blocks, iter_block_modules, profile_model
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

