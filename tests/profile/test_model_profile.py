"""ModelProfile's dict, JSON and text forms."""

from __future__ import annotations

import json

import pytest

from autopar.errors import ProfileError
from autopar.models.gpt import lm_loss
from autopar.profile import ModelProfile, profile_model
from tests.profile._helpers import _gpt


def test_to_dict_and_describe(gpt_profile):
    _, _, p = gpt_profile
    d = json.loads(json.dumps(p.to_dict()))
    assert d["num_params"] == p.num_params and len(d["blocks"]) == p.num_blocks
    assert d["tied_params"] == [["tok_emb.weight", "lm_head.weight"]]
    text = p.describe()
    assert "3 x Block at blocks" in text and "tok_emb.weight = lm_head.weight" in text
    assert "hidden=64, heads=4, kv_heads=4, layers=3" in text and "4 samples, 64 tokens each" in text


def test_from_dict_round_trips_exactly_through_json(gpt_profile):
    _, x, p = gpt_profile
    assert p.matmul_calls and p.blocks and p.tied_params  # the nested tuples are all exercised
    back = ModelProfile.from_dict(json.loads(json.dumps(p.to_dict())))
    assert back == p and back.to_dict() == p.to_dict()
    assert isinstance(back.blocks[0], type(p.blocks[0])) and isinstance(back.matmul_calls, tuple)
    assert back.block_input_shape == p.block_input_shape and isinstance(back.block_input_shape, tuple)
    assert back.tied_params == (("tok_emb.weight", "lm_head.weight"),)
    # a bf16 trace and a structure-only profile round-trip too
    model = _gpt()
    for q in (profile_model(model, x, loss_fn=lm_loss, precision="bf16-pure"), profile_model(model, x, trace=False)):
        assert ModelProfile.from_dict(json.loads(json.dumps(q.to_dict()))) == q
    with pytest.raises(ProfileError, match="unknown profile field"):
        ModelProfile.from_dict({**p.to_dict(), "bogus": 1})
    with pytest.raises(ProfileError, match="not a profile"):
        ModelProfile.from_dict({k: v for k, v in p.to_dict().items() if k != "fingerprint"})

