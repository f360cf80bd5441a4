"""Plan.float8: the blocks' large linear layers train in float8 (torchao's Float8Linear, tensorwise scaling).

The plan's field (validated, left out of the plan's key and file when off), which layers convert
(autopar.layout.float8_converts / float8_layers), the refusal without torchao, and wrap on CPU: the chosen layers
swapped, the rest untouched, and losses and gradients close to the bf16 plan's over several steps (float8's
e4m3 keeps about two significant digits, e5m2 gradients one: a loose tolerance, not parity)."""

from __future__ import annotations

import copy
import importlib.util
import warnings

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.errors import PlanError
from autopar.layout import float8_converts, float8_layers
from autopar.planning import short_name


def test_float8_needs_bf16_and_no_tensor_parallelism():
    with pytest.raises(PlanError, match="precision='bf16'"):
        autopar.Plan(float8=True)
    with pytest.raises(PlanError, match="tp=1"):
        autopar.Plan(precision="bf16", float8=True, tp=2, sequence_parallel=True)
    with pytest.raises(PlanError, match="float8"):
        autopar.Plan(precision="bf16", float8="yes")
    with pytest.raises(PlanError, match="'tensorwise', 'rowwise'"):
        autopar.Plan(precision="bf16", float8=True, float8_recipe="blockwise")
    with pytest.raises(PlanError, match="set float8=True"):
        autopar.Plan(precision="bf16", float8_recipe="rowwise")


def test_a_plan_without_float8_keeps_its_key_and_file_and_one_with_it_round_trips():
    plain = autopar.Plan(precision="bf16", compile=True)
    assert "float8" not in plain.strategy() and "float8" not in plain.to_dict()
    assert plain.key() == autopar.Plan.from_dict(plain.to_dict()).key()
    f8 = plain.replace(float8=True)
    assert f8.key() != plain.key() and autopar.Plan.from_yaml(f8.to_yaml()) == f8
    assert short_name(f8) == "1gpu mb1 bf16 fp8 compile" and "bf16 + float8 linears (tensorwise)" in f8.describe()
    assert "float8_recipe" not in f8.to_dict() and "float8_recipe" not in f8.strategy()  # at its default: left out
    rowwise = f8.replace(float8_recipe="rowwise")
    assert rowwise.key() != f8.key() and autopar.Plan.from_yaml(rowwise.to_yaml()) == rowwise
    assert short_name(rowwise) == "1gpu mb1 bf16 fp8-rowwise compile"
    fsdp = f8.replace(dp_shard=8)
    assert fsdp.float8_all_gather and "(tensorwise, float8 all-gathers)" in fsdp.describe()
    assert not fsdp.replace(float8_recipe="rowwise").float8_all_gather


def test_which_linear_layers_convert():
    assert float8_converts(4096, 14336) and float8_converts(8192, 1024) and float8_converts(1024, 2048)
    assert not float8_converts(4096, 1024)  # small: the casts cost more than the float8 GEMM saves
    assert not float8_converts(4104, 4104 + 8)  # not multiples of 16
    linears = [("embed", 64, 4096), ("layers.0.up", 2048, 8192), ("layers.0.down", 8192, 2048),
               ("layers.0.gate", 64, 64), ("head", 4096, 50304)]
    assert float8_layers(linears, ["layers.0"]) == ("layers.0.up", "layers.0.down")  # in the blocks only


class _Block(nn.Module):
    def __init__(self, d: int = 64, h: int = 1040) -> None:  # 1040 > 1024 outputs: the up projection converts
        super().__init__()
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.layers = nn.ModuleList(_Block() for _ in range(3))
        self.out = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.layers:
            x = block(x)
        return self.out(x)


def batch_of(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 32, generator=g), torch.randn(n, 8, generator=g)


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, float8: bool, steps: int = 5,
           recipe: str = "tensorwise"):
    def loss_fn(out, _):
        return (out.float() - y).square().mean()

    plan = autopar.Plan(precision="bf16", float8=float8, micro_batch_size=x.shape[0],
                        **({"float8_recipe": recipe} if float8 else {}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = autopar.wrap(model, sample=x, plan=plan, loss_fn=loss_fn)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], []
    for _ in range(steps):
        loss = loss_fn(model(x), x)
        loss.backward()
        grads.append(model.layers[0].up.weight.grad.detach().clone())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses, grads


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_wrap_trains_the_chosen_layers_in_float8_close_to_bf16(recipe):
    pytest.importorskip("torchao")
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    base = _Net()
    x, y = torch.randn(16, 32), torch.randn(16, 8)
    ref, ref_losses, ref_grads = _train(copy.deepcopy(base), x, y, float8=False)
    model, losses, grads = _train(copy.deepcopy(base), x, y, float8=True, recipe=recipe)
    converted = sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear))
    assert converted == [f"layers.{i}.up" for i in range(3)]
    want = ScalingGranularity.TENSORWISE if recipe == "tensorwise" else ScalingGranularity.AXISWISE
    assert all(m.config.cast_config_input.scaling_granularity is want and not m.config.enable_fsdp_float8_all_gather
               for m in model.modules() if isinstance(m, Float8Linear))
    assert not any(isinstance(m, Float8Linear) for m in ref.modules())
    assert any(f"3 linear layer(s) of the blocks train in float8 (torchao's Float8Linear, {recipe} scaling)" in n
               for n in autopar.applied(model).notes)
    assert set(dict(model.named_parameters())) == set(dict(ref.named_parameters()))  # same names, same state_dict
    assert losses[-1] < losses[0]
    for got, want in zip(losses, ref_losses):
        assert got == pytest.approx(want, rel=2e-2)
    for got, want in zip(grads, ref_grads):  # the same direction (e5m2 gradients: 2 mantissa bits, no averaging
        # over a 16-sample batch): cosine over 0.97, and the same size within 10%
        assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.97
        assert got.norm() == pytest.approx(want.norm().item(), rel=0.1)


def test_a_float8_plan_without_torchao_is_refused_in_one_line_before_anything_changes(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    model = _Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PlanError, match=r'pip install torchao') as err:
        _train(model, torch.randn(16, 32), torch.randn(16, 8), float8=True, steps=1)
    assert "\n" not in str(err.value)
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_float8_under_fsdp_on_two_processes_trains_as_one_process_does(tmp_path):
    """dp_shard=2: the float8 layers' weights sharded by FSDP2 (converted first: apply_plan's step 1), each rank
    on its half of the batch; the mean of the ranks' losses follows one process's float8 run on the whole batch
    (each rank scales its own half of the inputs: float8 rounds a little differently), and the first block's up
    weight ends where one process's does."""
    pytest.importorskip("torchao")
    import json

    from tests.distributed._launch import torchrun

    torchrun("tests/strategies/_float8_fsdp_worker.py", 2, [str(tmp_path)], cache_dir=tmp_path / "cache")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["layers"] == [f"layers.{i}.up" for i in range(3)] and r["sharded"] for r in ranks)
    # tensorwise under FSDP gathers in float8 where the process group can send it; gloo cannot: said, in bf16
    assert all(any("gloo process group has no float8 type" in n for n in r["notes"]) for r in ranks)
    torch.manual_seed(0)
    x, y = batch_of(16)
    one, losses, _ = _train(_Net(), x, y, float8=True, steps=3)
    for step, want in enumerate(losses):
        assert (ranks[0]["losses"][step] + ranks[1]["losses"][step]) / 2 == pytest.approx(want, rel=2e-2)
    got, want = torch.tensor(ranks[0]["up"]), one.layers[0].up.weight.detach()
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.999


def test_only_nccl_gathers_float8():
    from autopar.strategies.float8 import float8_all_gather_refusal

    assert float8_all_gather_refusal("nccl") is None and float8_all_gather_refusal("cpu:gloo,cuda:nccl") is None
    for backend in ("gloo", None):
        why = float8_all_gather_refusal(backend)
        assert why is not None and "gathered in bf16" in why and "\n" not in why


def test_fsdps_float8_all_gather_is_refused_for_rowwise():
    pytest.importorskip("torchao")
    from autopar.strategies.float8 import apply_float8

    with pytest.raises(PlanError, match="float8_recipe='tensorwise'"):
        apply_float8(_Net(), ["layers.0.up"], recipe="rowwise", all_gather=True)
