"""Tests of autopar.strategies.precision: apply_autocast runs the matmuls in bf16 and returns fp32 outputs
without changing the module; to_fp32_outputs on every output shape; the FSDP2 policies."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.models.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens
from autopar._util.batch import to_fp32_outputs
from autopar.strategies.precision import apply_autocast, compute_dtype, fsdp_policy

CFG = GPTConfig(vocab_size=128, seq_len=32, num_layers=2, hidden_dim=64, num_heads=4)
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_dot_product_flash_attention_for_cpu"}


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


class _MatmulDtypes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in MATMULS:
            dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point())
            self.seen.append((name, dtypes))
        return func(*args, **(kwargs or {}))


def test_autocast_matmuls_run_in_bf16_and_outputs_are_fp32():
    x = synthetic_tokens(2, CFG)
    model = _model()
    fp32_out = model(x).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = model(x).detach()
    assert reference.dtype == torch.bfloat16
    keys = list(model.state_dict())
    apply_autocast(model, precision="bf16", device_type="cpu")
    with _MatmulDtypes() as rec:
        out = model(x)
    assert out.dtype == torch.float32
    assert torch.equal(out.detach(), reference.float())  # exactly what torch.autocast computes
    assert not torch.equal(out.detach(), fp32_out)  # and not the fp32 result
    torch.testing.assert_close(out.detach(), fp32_out, rtol=0.05, atol=0.05)
    assert rec.seen, "no matmul seen"
    for name, dtypes in rec.seen:
        assert dtypes and all(d == torch.bfloat16 for d in dtypes), (name, dtypes)
    # the module is the user's: type, names, parameters (fp32) unchanged
    assert type(model) is GPT and list(model.state_dict()) == keys
    assert all(p.dtype == torch.float32 for p in model.parameters())
    lm_loss(out, x).backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_fp32_is_a_no_op():
    model = _model()
    forward = model.forward
    apply_autocast(model, precision="fp32", device_type="cpu")
    assert "forward" not in vars(model) and model.forward == forward
    x = synthetic_tokens(2, CFG)
    with _MatmulDtypes() as rec:
        model(x)
    assert all(all(d == torch.float32 for d in dtypes) for _, dtypes in rec.seen)


def test_autocast_keeps_kwargs_and_structured_outputs():
    class Dual(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, *, scale=1.0):
            y = self.lin(x) * scale
            return {"y": y, "pair": (y, x.long()), "n": 3}

    m = Dual()
    apply_autocast(m, precision="bf16", device_type="cpu")
    out = m(torch.randn(2, 4), scale=2.0)
    assert out["y"].dtype == torch.float32 and out["pair"][0].dtype == torch.float32
    assert out["pair"][1].dtype == torch.int64 and out["n"] == 3


def test_compute_dtype():
    assert compute_dtype("bf16") is torch.bfloat16 and compute_dtype("fp32") is torch.float32
    with pytest.raises(KeyError):
        compute_dtype("fp16")


# ---- to_fp32_outputs ---------------------------------------------------------------------------------
Pair = namedtuple("Pair", ["logits", "aux"])


def test_to_fp32_outputs_on_tensors():
    b = torch.ones(2, dtype=torch.bfloat16)
    h = torch.ones(2, dtype=torch.float16)
    f = torch.ones(2)
    i = torch.ones(2, dtype=torch.int64)
    assert to_fp32_outputs(b).dtype == torch.float32 and to_fp32_outputs(h).dtype == torch.float32
    assert to_fp32_outputs(f) is f and to_fp32_outputs(i) is i
    assert torch.equal(to_fp32_outputs(b), f)


def test_to_fp32_outputs_keeps_gradients_flowing():
    w = torch.ones(3, requires_grad=True)
    out = to_fp32_outputs((w.to(torch.bfloat16) * 2,))[0]
    out.sum().backward()
    assert out.dtype == torch.float32 and torch.equal(w.grad, torch.full((3,), 2.0))


def test_to_fp32_outputs_on_containers():
    b = torch.ones(2, dtype=torch.bfloat16)
    out = to_fp32_outputs((b, [b, 1, "s"], {"k": b, "n": None}))
    assert isinstance(out, tuple) and isinstance(out[1], list) and isinstance(out[2], dict)
    assert out[0].dtype == torch.float32 and out[1][0].dtype == torch.float32
    assert out[1][1:] == [1, "s"] and out[2]["n"] is None and out[2]["k"].dtype == torch.float32
    d = {"logits": b, "ids": torch.arange(3)}
    assert to_fp32_outputs(d) is d and d["logits"].dtype == torch.float32  # dicts are updated in place
    assert to_fp32_outputs(None) is None and to_fp32_outputs(3.5) == 3.5


def test_to_fp32_outputs_on_namedtuples():
    b = torch.ones(2, dtype=torch.bfloat16)
    out = to_fp32_outputs(Pair(b, (b, torch.arange(2))))
    assert type(out) is Pair
    assert out.logits.dtype == torch.float32 and out.aux[0].dtype == torch.float32
    assert out.aux[1].dtype == torch.int64


def test_to_fp32_outputs_on_a_hugging_face_output():
    pytest.importorskip("transformers")
    from transformers.modeling_outputs import CausalLMOutput

    b = torch.ones(2, 3, dtype=torch.bfloat16)
    out = CausalLMOutput(loss=b.sum(), logits=b)
    res = to_fp32_outputs(out)
    assert isinstance(res, CausalLMOutput)
    assert res.logits.dtype == torch.float32 and res["logits"].dtype == torch.float32 and res[1].dtype == torch.float32
    assert res.loss.dtype == torch.float32


def test_to_fp32_outputs_leaves_float64_alone():
    d = torch.ones(2, dtype=torch.float64)
    assert to_fp32_outputs(d).dtype == torch.float64


# ---- FSDP2 policies --------------------------------------------------------------------------------------
def test_fsdp_policies():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    assert fsdp_policy("fp32", root=True) == MixedPrecisionPolicy()
    root = fsdp_policy("bf16", root=True)
    inner = fsdp_policy("bf16", root=False)
    assert root.param_dtype is torch.bfloat16 and root.reduce_dtype is torch.float32
    assert root.output_dtype is torch.float32
    assert inner.param_dtype is torch.bfloat16 and inner.reduce_dtype is torch.float32 and inner.output_dtype is None


def test_an_output_with_the_models_own_loss_keeps_autocasts_dtypes():
    """A Hugging Face-like output carrying the loss the model computed comes back as autocast made it (the loss
    fp32, the logits bf16, as under the user's own autocast); without a loss, every floating output is fp32."""

    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(8, 16)

        def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
            logits = self.head(x)
            out = {"logits": logits}
            if labels is not None:
                out["loss"] = nn.functional.cross_entropy(logits, labels)  # fp32 under autocast
            return out

    model = WithLoss()
    apply_autocast(model, precision="bf16", device_type="cpu")
    x, labels = torch.randn(4, 8), torch.randint(0, 16, (4,))
    out = model(x, labels=labels)
    assert out["logits"].dtype == torch.bfloat16 and out["loss"].dtype == torch.float32
    plain = model(x)
    assert plain["logits"].dtype == torch.float32


def test_autocast_keeps_the_forwards_signature_name_and_doc():
    # The Hugging Face Trainer keeps the dataset columns the forward's signature names (remove_unused_columns):
    # a forward whose signature hides its parameters loses input_ids (issue 12).
    import inspect

    from transformers import LlamaConfig, LlamaForCausalLM  # optional dependency (the test extra has it)

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    before = inspect.signature(model.forward)
    apply_autocast(model, precision="bf16", device_type="cpu")
    after = inspect.signature(model.forward)
    assert after == before and {"input_ids", "attention_mask", "labels"} <= set(after.parameters)
    assert model.forward.__name__ == "forward" and model.forward.__doc__ == type(model).forward.__doc__
    ids = torch.randint(0, 64, (2, 8))
    assert model(input_ids=ids, labels=ids).loss.dtype == torch.float32  # keyword arguments pass through
    assert model(ids).logits.dtype == torch.float32  # without labels: fp32 outputs
