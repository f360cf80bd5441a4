"""On one GPU: a model whose bf16 step feeds an FFT a bf16 input (transformers' FNet) raises under bf16 autocast by hand
(cuFFT has no bf16), and `autopar.wrap` plans it in fp32, with the note that says why, and trains it."""

from __future__ import annotations

import warnings

import pytest
import torch

import autopar

pytestmark = pytest.mark.gpu


def _fnet():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.FNetConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                                  max_position_embeddings=128, use_tpu_fourier_optimizations=False)
    torch.manual_seed(0)
    return transformers.FNetForMaskedLM(cfg)


def _batch(device: str = "cpu") -> dict:
    ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(1)).to(device)
    return {"input_ids": ids, "labels": ids}


def test_fnet_raises_under_bf16_autocast_by_hand():
    model = _fnet().cuda()
    with pytest.raises(RuntimeError, match="BFloat16"), torch.autocast("cuda", dtype=torch.bfloat16):
        model(**_batch("cuda")).loss.backward()


def test_wrap_plans_fnet_in_fp32_and_it_trains(monkeypatch):
    monkeypatch.setenv("AUTOPAR_NO_WRAP_CACHE", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = autopar.wrap(_fnet(), sample=_batch(), verbose=False)
    assert autopar.plan_of(model).precision == "fp32"
    assert any("bf16 step cannot run on a GPU" in str(w.message) for w in caught)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = {k: v.to(autopar.applied(model).device) for k, v in _batch().items()}
    losses = []
    for _ in range(4):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
