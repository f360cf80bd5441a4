"""extrapolate_profile: a deep model's profile from two shallow traces equals the real deeper trace."""

from __future__ import annotations

import pytest

from autopar.errors import ProfileError
from autopar.models.gpt import GPTConfig, lm_loss, synthetic_tokens
from autopar.profile import ModelProfile, profile_model
from tests.profile._helpers import _gpt


_EXTRA_CFG = GPTConfig(vocab_size=128, seq_len=64, num_layers=5, hidden_dim=64, num_heads=4)


def _depth_profile(depth: int, precision: str = "fp32") -> ModelProfile:
    from dataclasses import replace

    tokens = synthetic_tokens(2, _EXTRA_CFG)
    return profile_model(_gpt(replace(_EXTRA_CFG, num_layers=depth)), tokens, loss_fn=lm_loss, precision=precision)


@pytest.mark.parametrize("precision", ["fp32", "bf16-pure"])
def test_extrapolated_profile_equals_a_real_deeper_trace(precision):
    from autopar.profile import extrapolate_profile

    shallow, deeper, real = (_depth_profile(d, precision) for d in (2, 3, 5))
    p = extrapolate_profile(shallow, deeper, 5)
    for name in ("num_params", "num_trainable_params", "param_bytes", "flops", "forward_flops", "num_ops",
                 "traffic_bytes", "saved_bytes", "saved_bytes_outside_blocks", "largest_transient_bytes",
                 "num_params_outside_blocks", "num_lookup_params", "num_layers", "num_blocks", "block_input_bytes"):
        assert getattr(p, name) == getattr(real, name), name
    assert [b.name for b in p.blocks] == [b.name for b in real.blocks] == [f"blocks.{i}" for i in range(5)]
    assert [(b.flops, b.saved_bytes, b.num_params) for b in p.blocks] == \
        [(b.flops, b.saved_bytes, b.num_params) for b in real.blocks]
    assert p.formula_flops() == real.formula_flops()
    # it plans, but it is not the real model: its own fingerprint, and a note saying so
    assert p.fingerprint != real.fingerprint and p.fingerprint.startswith("x")
    assert any("extrapolated from traces with 2 and 3 blocks to 5 blocks" in n for n in p.notes)
    # the deeper trace's own depth is allowed (the blocks are then the trace's own)
    same = extrapolate_profile(shallow, deeper, 3)
    assert (same.num_params, same.flops, same.num_blocks) == (deeper.num_params, deeper.flops, 3)


def test_extrapolate_profile_refuses_bad_inputs():
    from autopar.profile import extrapolate_profile

    two, three = _depth_profile(2), _depth_profile(3)
    with pytest.raises(ProfileError, match="the second with more blocks"):
        extrapolate_profile(three, two, 8)
    with pytest.raises(ProfileError, match="the second with more blocks"):
        extrapolate_profile(two, two, 8)
    with pytest.raises(ProfileError, match="fewer than the deeper trace's 3 blocks"):
        extrapolate_profile(two, three, 2)
    with pytest.raises(ProfileError, match="same sample and precision"):
        extrapolate_profile(two, _depth_profile(3, "bf16"), 8)
    from dataclasses import replace

    longer = profile_model(_gpt(replace(_EXTRA_CFG, num_layers=3)), synthetic_tokens(4, _EXTRA_CFG), loss_fn=lm_loss)
    with pytest.raises(ProfileError, match="same sample and precision"):
        extrapolate_profile(two, longer, 8)

