"""A model whose bf16 step cannot run on a GPU (an op a bf16 input reaches has no CUDA bf16 kernel: the FFTs) is
planned in fp32 for GPUs, with a note that says why; a bf16 plan given for it is refused in one line. CPU autocast
casts an FFT's input to float32, so without the check a trace on this CPU would hide what a GPU run raises."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.profile import ModelProfile
from autopar.profile.cuda_autocast import CudaAutocastPolicy, NoCudaBf16KernelError


class Spectral(nn.Module):
    """A Fourier layer whose FFT gets what the Linear before it gives (bf16 under autocast)."""

    def __init__(self, cast: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.cast = cast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h = h.float() if self.cast else h
        return x + torch.fft.irfft(torch.fft.rfft(h, dim=-1), n=32, dim=-1).to(x.dtype)


class Net(nn.Module):
    def __init__(self, cast: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Spectral(cast) for _ in range(3))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_the_policy_refuses_an_fft_of_a_bf16_input_and_lets_float32_through():
    x = torch.randn(4, 32)
    with CudaAutocastPolicy("cpu"), torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(NoCudaBf16KernelError, match="torch.fft.rfft gets a bf16 input"):
            torch.fft.rfft(x.bfloat16())
        assert torch.fft.rfft(x).dtype == torch.complex64
    with CudaAutocastPolicy("cuda", cast=False), pytest.raises(NoCudaBf16KernelError):  # the check alone, as on a GPU
        torch.stft(x.bfloat16(), n_fft=8, return_complex=True)


def test_a_model_whose_bf16_step_has_an_fft_is_planned_in_fp32_for_a_gpu_saying_why():
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autopar.plan(Net(), sample=torch.randn(8, 32), topology="1xH200")
    assert plan.precision == "fp32"
    said = [str(w.message) for w in caught if "bf16 step cannot run on a GPU" in str(w.message)]
    assert len(said) == 1 and "torch.fft.rfft gets a bf16 input" in said[0] and "plans it in fp32" in said[0]
    profile = autopar.profile_model(Net(), torch.randn(8, 32), warn=False)  # its fp32 trace: no refusal of its own
    assert profile.bf16_refusal is None


def test_the_same_model_casting_before_its_fft_keeps_bf16():
    torch.manual_seed(0)
    assert autopar.plan(Net(cast=True), sample=torch.randn(8, 32), topology="1xH200").precision == "bf16"


def test_a_given_bf16_plan_for_it_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("AUTOPAR_NO_WRAP_CACHE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(autopar.PlanError) as info:
            autopar.wrap(Net(), sample=torch.randn(8, 32), topology="1xH200", verbose=False,
                         plan=autopar.Plan(precision="bf16", micro_batch_size=8))
    text = str(info.value)
    assert "\n" not in text and "precision='bf16' cannot run Net on a GPU" in text and "precision='fp32'" in text


def test_the_refusal_is_kept_by_the_profile_s_dict():
    from autopar.planning import base_profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        profile = base_profile(Net(), torch.randn(8, 32), loss_fn=None, blocks=None, warn=False, bf16=True)
    assert profile.bf16_refusal and profile.profile_precision == "fp32"
    assert ModelProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile
