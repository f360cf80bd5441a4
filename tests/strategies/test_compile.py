"""Tests of autopar.strategies.compile with the "aot_eager" backend (fast on CPU): per block and whole model,
the loss and gradients match eager within 1e-5, and the module keeps its type, names and state_dict keys."""

from __future__ import annotations

import pytest
import torch

from autopar.models.gpt import GPT, Block, GPTConfig, lm_loss, synthetic_tokens
from autopar.strategies.compile import apply_compile, default_backend

CFG = GPTConfig(vocab_size=128, seq_len=32, num_layers=2, hidden_dim=64, num_heads=4)
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def _blocks(model):
    return [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]


def _loss_and_grads(model):
    x = synthetic_tokens(4, CFG, seed=5)
    loss = lm_loss(model(x), x)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def eager():
    return _loss_and_grads(_model())


def _structure(model):
    return ([n for n, _ in model.named_modules()], list(model.state_dict()), [type(m) for m in model.modules()])


@pytest.mark.parametrize("per_block", [True, False], ids=["per-block", "whole-model"])
def test_compiled_model_matches_eager(eager, per_block):
    ref_loss, ref_grads = eager
    model = _model()
    before = _structure(model)
    compiled = apply_compile(model, _blocks(model), per_block=per_block, backend="aot_eager")
    assert compiled == (["blocks.0", "blocks.1"] if per_block else ["<model>"])
    assert _structure(model) == before and type(model) is GPT
    assert all(type(b) is Block for b in model.blocks)
    # it really is compiled: per block, each block's forward is a compiled function (module hooks such as
    # FSDP's stay outside the graph); whole model, the model's forward is (what wraps it later stays outside)
    if per_block:
        assert all("forward" in vars(b) and hasattr(vars(b)["forward"], "_torchdynamo_orig_callable")
                   for b in model.blocks)
    else:
        assert hasattr(vars(model)["forward"], "_torchdynamo_orig_callable")
    loss, grads = _loss_and_grads(model)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], **TOL, msg=n)
    # a second step (new input, same shapes) reuses the graphs and still matches
    model.zero_grad(set_to_none=True)
    loss2, _ = _loss_and_grads(model)
    torch.testing.assert_close(loss2, ref_loss, **TOL)


def test_each_compiled_block_matches_its_eager_self():
    torch.manual_seed(1)
    model = _model()
    x = torch.randn(2, CFG.seq_len, CFG.hidden_dim)

    def run(block):
        xi = x.clone().requires_grad_(True)
        out = block(xi)
        out.square().sum().backward()
        grads = {n: p.grad.clone() for n, p in block.named_parameters()}
        block.zero_grad(set_to_none=True)
        return out.detach(), xi.grad, grads

    eager = {name: run(block) for name, block in _blocks(model)}
    apply_compile(model, _blocks(model), per_block=True, backend="aot_eager")
    for name, block in _blocks(model):
        out, x_grad, grads = run(block)
        ref_out, ref_x_grad, ref_grads = eager[name]
        torch.testing.assert_close(out, ref_out, **TOL, msg=name)
        torch.testing.assert_close(x_grad, ref_x_grad, **TOL, msg=name)
        for n, g in ref_grads.items():
            torch.testing.assert_close(grads[n], g, **TOL, msg=f"{name}.{n}")
    # the blocks differ (different weights), so matching each one means each ran its own weights
    assert not torch.equal(eager["blocks.0"][0], eager["blocks.1"][0])


def test_per_block_without_blocks_compiles_the_whole_model():
    model = _model()
    assert apply_compile(model, [], per_block=True, backend="aot_eager") == ["<model>"]
    assert hasattr(vars(model)["forward"], "_torchdynamo_orig_callable")


def test_default_backend_reads_the_environment(monkeypatch):
    monkeypatch.delenv("AUTOPAR_COMPILE_BACKEND", raising=False)
    assert default_backend() == "inductor"
    monkeypatch.setenv("AUTOPAR_COMPILE_BACKEND", "aot_eager")
    assert default_backend() == "aot_eager"
    seen = []
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or real_compile(fn, **kw))
    model = _model()
    apply_compile(model, _blocks(model), per_block=True)  # backend from the environment
    assert seen == [{"backend": "aot_eager"}] * CFG.num_layers
    seen.clear()
    apply_compile(_model(), [], per_block=False, backend="eager")  # an explicit backend wins
    assert seen == [{"backend": "eager"}]


@pytest.mark.parametrize("mode", ["selective", "alternate", "gemms"])
@pytest.mark.parametrize("per_block", [True, False], ids=["per-block", "whole-model"])
def test_checkpointed_then_compiled_matches_eager(eager, mode, per_block):
    """Selective checkpointing's policies under dynamo and AOTAutograd (as apply.py orders them: checkpointing, then
    compile): "alternate" counts each checkpointed call's GEMMs while the graph is traced, and the step still gives
    eager's loss and gradients, twice."""
    from autopar.strategies.checkpointing import apply_checkpointing

    ref_loss, ref_grads = eager
    model = _model()
    apply_checkpointing(_blocks(model), mode=mode)
    apply_compile(model, _blocks(model), per_block=per_block, backend="aot_eager")
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss, grads = _loss_and_grads(model)
        torch.testing.assert_close(loss, ref_loss, **TOL)
        for n in ref_grads:
            torch.testing.assert_close(grads[n], ref_grads[n], **TOL, msg=n)
