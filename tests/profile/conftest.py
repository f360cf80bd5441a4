"""The built-in GPT's profile, shared by the profile tests that only read it."""

from __future__ import annotations

import pytest

from autopar.models.gpt import lm_loss, synthetic_tokens
from autopar.profile import profile_model
from tests.profile._helpers import SMALL, _gpt


@pytest.fixture(scope="module")
def gpt_profile():
    model = _gpt()
    x = synthetic_tokens(4, SMALL)
    return model, x, profile_model(model, x, loss_fn=lm_loss)

