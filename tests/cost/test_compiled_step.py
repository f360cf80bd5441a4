"""A compiled step as the cost model prices it (autopar.cost.ops, autopar.cost.time, autopar.search): GEMM
alignment, SDPA's math path under compile, the loss run eagerly outside the compiled graph, and no compiled
plans offered blindly for a forward that reads tensor values."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.cost import Calibration, predict_profile
from autopar.cost.memory import stage_blocks
from autopar.cost.ops import FUSED_KINDS, OpsTime, Rates, TPSplit, _alignment, _misaligned, _record_time, \
    _unfused_attention_s, op_seconds
from autopar.cost.time import HostCosts, _stage_work
from autopar.profile import profile_model
from autopar.profile.model_profile import OpRecord
from autopar.search import enumerate_plans
from tests.cost._op_records import profiled

H200 = autopar.Topology.from_spec("1xH200")
CAL = Calibration()


def _rates(**plan) -> Rates:
    return Rates.of(H200.device, autopar.Plan(**{"precision": "bf16", **plan}), CAL)


# ---- alignment -------------------------------------------------------------------------------
def test_a_dimension_s_alignment_is_its_largest_power_of_two_up_to_eight():
    assert [_alignment(d) for d in (50257, 30522, 30524, 4096, 200, 197)] == [1, 2, 4, 8, 8, 1]


def test_a_misaligned_gemm_s_rate_scales_with_its_loads_width_capped_at_aligned():
    assert _misaligned(8, 0.16) == 1.0
    assert _misaligned(1, 0.16) == pytest.approx(0.16)
    assert _misaligned(2, 0.16) == pytest.approx(0.32)
    assert _misaligned(4, 0.16) == pytest.approx(0.64)
    assert _misaligned(4, 0.4) == 1.0  # 1.6: capped


# ---- SDPA's math path ------------------------------------------------------------------------
def _attention(b=8, h=12, s=2048, d=64, causal=0, masked=0, backward=False, count=1) -> OpRecord:
    per = 5 * d if backward else 2 * d
    return OpRecord(kind="attention", backward=backward, shape=(b, h, h, s, s, d, d, causal, 0, masked),
                    dtype="bfloat16", count=count, flops=2.0 * b * h * s * s * per * count,
                    bytes=8 * b * h * s * d * count)


def test_compiled_bf16_attention_with_a_mask_only_compile_builds_runs_the_math_path():
    """Not causal, unmasked eagerly, with a mask only torch.compile builds (masked 2: autopar.profile.hf_masks):
    priced by _unfused_attention_s (more than eager's fused kernel at 2048 keys), 3 kernels a call forward and 6
    backward; eager, the fused kernel's one, as if unmasked."""
    eager, compiled = _rates(), _rates(compile=True)
    assert op_seconds(_attention(masked=2), eager) == pytest.approx(op_seconds(_attention(), eager))
    assert op_seconds(_attention(), compiled) == pytest.approx(op_seconds(_attention(), eager))  # no mask at all
    for backward, kernels in ((False, 3), (True, 6)):
        r = _attention(backward=backward, count=2, masked=2)
        shape = [float(x) for x in r.shape]
        assert op_seconds(r, compiled) == pytest.approx(2 * _unfused_attention_s(shape, backward, compiled))
        assert op_seconds(r, compiled) > op_seconds(r, eager)
        assert _record_time(r, 1.0, TPSplit(), compiled, 1.0).launches == 2 * kernels
        assert _record_time(r, 1.0, TPSplit(), eager, 1.0).launches == 2


def test_causal_or_masked_attention_stays_the_fused_kernel_compiled():
    eager, compiled = _rates(), _rates(compile=True)
    for r in (_attention(causal=1), _attention(masked=1), _attention(causal=1, backward=True),
              _attention(masked=1, backward=True)):
        assert op_seconds(r, compiled) == pytest.approx(op_seconds(r, eager), rel=1e-9)
        assert _record_time(r, 1.0, TPSplit(), compiled, 1.0).launches == 1
    fp32 = _attention()  # fp32 plans run no math path either
    assert op_seconds(fp32, _rates(precision="fp32", compile=True)) == pytest.approx(
        op_seconds(fp32, _rates(precision="fp32")), rel=1e-9)


def test_per_block_compile_keeps_the_fused_kernels_of_masks_only_a_whole_graph_builds():
    """Under FSDP (or a pipeline) each block is compiled alone and the model builds its mask eagerly, outside
    the graphs, where it skips it as the trace did: a masked-2 call stays the fused unmasked kernel, a causal-2
    one causal; compiled as one graph they take the math path and the masked kernel."""
    per_block, whole = _rates(compile=True, dp_shard=2), _rates(compile=True)
    assert per_block.compiled and not per_block.whole_graph and whole.whole_graph
    for backward in (False, True):
        for marked, plain in ((_attention(masked=2, backward=backward), _attention(backward=backward)),
                              (_attention(causal=2, backward=backward), _attention(causal=1, backward=backward))):
            assert op_seconds(marked, per_block) == pytest.approx(op_seconds(plain, per_block))
            assert op_seconds(marked, whole) > op_seconds(plain, whole)


def test_a_misaligned_sequence_costs_more_per_score_element_on_the_math_path():
    """ViT's 197 tokens: the math path's bf16 GEMMs are not padded (extern_misaligned_bmm), so a score element
    costs more than at 192 or 200 tokens; without the misalignment factor, about the same."""
    compiled = _rates(compile=True)
    aligned = dataclasses.replace(compiled, extern_misaligned_bmm=1.0)
    for backward in (False, True):
        def per_score(s: int, rates: Rates) -> float:
            return op_seconds(_attention(b=64, s=s, backward=backward, masked=2), rates) / (64 * 12 * s * s)
        odd = per_score(197, compiled)
        assert odd > 1.1 * per_score(200, compiled) and odd > 1.1 * per_score(192, compiled)
        assert per_score(197, aligned) == pytest.approx(per_score(200, aligned), rel=0.05)


# ---- the loss: eager, outside the compiled graph ---------------------------------------------
def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))


def _loss(pointwise: int):
    """A loss of `pointwise` rounds of three elementwise ops and a mean: compile would fuse them all."""
    def loss_fn(out: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        y = out
        for _ in range(pointwise):
            y = torch.tanh(y) * 1.5 + 0.1
        return y.mean()
    return loss_fn


@pytest.fixture(scope="module")
def heavy_loss():
    return profiled(_mlp(), torch.randn(8, 32), loss_fn=_loss(10))


def _work(profile, **plan):
    """_stage_work of the whole model (one stage) for a bf16 plan at the traced batch."""
    plan = autopar.Plan(precision="bf16", micro_batch_size=8, **plan)
    traffic = 0.5 if profile.profile_precision == "fp32" else 1.0
    return _stage_work(profile, profile, plan, H200, CAL, stage_blocks(profile, plan, 0), traffic)


def _labels(profile) -> list[str]:
    """What each of _stage_work's groups is, in the order they run: before, the blocks, after, the loss."""
    blocks = ["block" for i in range(len(profile.blocks)) if profile.ops_of("blocks", i) is not None]
    return [w for w in ("before",) if profile.ops_of(w)] + blocks + [w for w in ("after", "loss")
                                                                       if profile.ops_of(w)]


def test_the_ops_after_the_model_s_forward_returns_are_the_loss_group(heavy_loss):
    """The loss_fn's 30 forward elementwise ops are recorded in the "loss" group, not in "after"."""
    loss = heavy_loss.ops_of("loss")
    assert loss is not None and loss.where == "loss"
    assert sum(r.count for r in loss.ops if r.kind == "elementwise" and not r.backward) >= 30
    after = heavy_loss.ops_of("after")
    assert after is None or sum(r.count for r in after.ops if r.kind == "elementwise" and not r.backward) < 30


def test_a_compiled_plan_prices_the_loss_group_eagerly(heavy_loss):
    """Compiled (the whole model: one process), the loss still runs eagerly: its launches are its eager
    records' kernels (not the fused kernels), at eager host costs, the same as in the eager plan; the model's
    last ops ("after") are compiled."""
    loss = heavy_loss.ops_of("loss")
    eager_kernels = sum(r.count for r in loss.ops if r.kind not in (*FUSED_KINDS, "view", "weight_cast"))
    fused_kernels = sum(r.count for r in loss.ops if r.kind in FUSED_KINDS)
    assert eager_kernels > fused_kernels
    compiled, eager = _work(heavy_loss, compile=True), _work(heavy_loss)
    last = compiled.order[-1]
    assert last.ops.launches == eager_kernels
    assert last.host == HostCosts.of(CAL, compiled=False)
    assert last == eager.order[-1]
    after = _labels(heavy_loss).index("after")
    assert compiled.order[after].host == HostCosts.of(CAL, compiled=True)
    assert compiled.order[after] != eager.order[after]


def test_under_fsdp_a_compiled_plan_runs_the_ends_eagerly_and_the_blocks_compiled(heavy_loss):
    """Compile wraps the blocks only where the model is sharded: the ops around them run eagerly, the loss
    too."""
    compiled, eager = _work(heavy_loss, compile=True, dp_shard=2), _work(heavy_loss, dp_shard=2)
    labels = _labels(heavy_loss)
    assert len(labels) == len(compiled.order) and "block" in labels and "after" in labels
    for label, c, e in zip(labels, compiled.order, eager.order):
        if label == "block":
            assert c.host == HostCosts.of(CAL, compiled=True)
        else:
            assert c == e and c.host == HostCosts.of(CAL, compiled=False)


def test_a_heavier_loss_costs_a_compiled_step_what_it_costs_an_eager_one():
    """The loss's extra elementwise ops are priced eagerly in both plans: the predicted step grows by the same
    time compiled as eager (fused, it would grow by next to nothing)."""
    x = torch.randn(8, 32)
    light, heavy = profiled(_mlp(), x, loss_fn=_loss(0)), profiled(_mlp(), x, loss_fn=_loss(40))

    def step(profile, compile: bool) -> float:
        plan = autopar.Plan(precision="bf16", micro_batch_size=8, compile=compile)
        return predict_profile(profile, plan, H200, CAL).step_s

    eager_growth = step(heavy, False) - step(light, False)
    compiled_growth = step(heavy, True) - step(light, True)
    assert eager_growth > 0
    assert compiled_growth == pytest.approx(eager_growth, rel=0.05)


# ---- value reads: no compiled plans offered blindly ------------------------------------------
class _Gated(nn.Module):
    """A forward that reads its sample's values (`if x.sum() > 0`): torch.compile's graph breaks there."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            x = x * 2
        return self.b(torch.relu(self.a(x)))


def _plain() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _compiled_plans(profile, **kw) -> int:
    return sum(p.compile for p in enumerate_plans(profile, H200, world_size=1, global_batch_size=8, **kw))


def test_a_forward_that_reads_values_is_offered_no_compiled_plan():
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    gated = profile_model(_Gated(), x, warn=False)
    plain = profile_model(_plain(), x, warn=False)
    assert gated.value_reads >= 1 and plain.value_reads == 0
    assert any("reads tensor values" in n for n in gated.notes) and not any("tensor values" in n for n in plain.notes)
    assert _compiled_plans(gated, measured=True) > 0  # the tuner measures them
    assert _compiled_plans(gated) == 0 and list(enumerate_plans(gated, H200, world_size=1, global_batch_size=8))
    assert _compiled_plans(plain) > 0
    assert _compiled_plans(gated, eager=False) > 0  # asked for compiled plans only: still offered


def test_value_reads_in_the_loss_do_not_count():
    """The loss runs outside the compiled model: reading the sample there breaks no graph of the model's."""
    torch.manual_seed(0)
    profile = profile_model(_plain(), torch.randn(8, 16), warn=False,
                            loss_fn=lambda out, s: out.mean() * (2.0 if s.sum().item() > 0 else 1.0))
    assert profile.value_reads == 0


# ---- convolutions' host work -----------------------------------------------------------------
def test_a_convolution_call_costs_cudnn_s_host_time_beyond_its_launch_eager_and_compiled():
    """cuDNN's own host work per convolution call (Calibration.conv_host_s), eager and compiled, on top of the
    launch; a GEMM pays none of it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.Flatten(),
                          nn.Linear(8 * 16 * 16, 4))
    profile = profiled(model, torch.randn(2, 3, 16, 16))
    records = [r for g in profile.op_groups for r in g.ops]
    convs = [r for r in records if r.kind == "conv"]
    gemms = [r for r in records if r.kind == "gemm"]
    assert convs and any(r.backward for r in convs) and gemms
    for compiled in (False, True):
        rates = _rates(compile=compiled)
        t = sum((_record_time(r, 1.0, TPSplit(), rates, 1.0) for r in convs), OpsTime())
        assert t.convs == sum(r.count for r in convs) > 0
        assert t.backward_convs == sum(r.count for r in convs if r.backward) > 0
        host, bare = HostCosts.of(CAL, compiled), HostCosts.of(CAL.replace(conv_host_s=0.0), compiled)
        extra = host.forward_s(t) + host.backward_s(t) - bare.forward_s(t) - bare.backward_s(t)
        assert extra == pytest.approx(t.convs * CAL.conv_host_s) and CAL.conv_host_s > 0
        g = sum((_record_time(r, 1.0, TPSplit(), rates, 1.0) for r in gemms), OpsTime())
        assert g.convs == 0 and host.forward_s(g) + host.backward_s(g) == bare.forward_s(g) + bare.backward_s(g)
