"""The per-op time model beyond decoder LLMs (autopar.cost.ops, autopar.cost.time): MoE experts that stay in fp32
under autocast, depthwise and misaligned convolutions, attention that compile leaves unfused, and the host
launching kernels in the order the groups run."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.cost import Calibration
from autopar.cost.ops import OpsTime, Rates, TPSplit, _record_time, op_seconds
from autopar.cost.time import HostCosts, _Group, _queued_s
from autopar.profile.model_profile import OpRecord
from tests.cost._op_records import watched

H200 = autopar.Topology.from_spec("1xH200")
CAL = Calibration()


def _rates(**plan) -> Rates:
    return Rates.of(H200.device, autopar.Plan(**{"precision": "bf16", **plan}), CAL)


def _grouped(e=8, m=2048, n=28672, k=4096) -> OpRecord:
    return OpRecord(kind="grouped_gemm", backward=False, shape=(e, m, n, k), dtype="bfloat16", count=1,
                    flops=2.0 * e * m * n * k, bytes=2 * e * (m * k + k * n + m * n), batch_dim=1)


def _conv(m=64 * 50 * 50, n=1, k=49, groups=96, channels_last=1, c_in=None, backward=False) -> OpRecord:
    shape = (m, n, k, groups, channels_last) + ((c_in,) if c_in is not None else ())
    return OpRecord(kind="conv", backward=backward, shape=shape, dtype="bfloat16", count=1,
                    flops=2.0 * m * n * k * groups, bytes=2 * m * groups * (n + 1), batch_dim=0)


def _attention(b=32, h=12, s=512, d=64, causal=0, masked=0, backward=False) -> OpRecord:
    per = (3 * d + 2 * d) if backward else 2 * d
    return OpRecord(kind="attention", backward=backward, shape=(b, h, h, s, s, d, d, causal, 0, masked),
                    dtype="bfloat16", count=1, flops=2.0 * b * h * s * s * per, bytes=8 * b * h * s * d)


def test_grouped_gemms_under_autocast_over_fp32_weights_run_at_the_fp32_rate_and_bf16_under_fsdp():
    """torch._grouped_mm is on no autocast list: with fp32 master weights (no FSDP) the experts run in fp32 on
    CUDA cores; FSDP's mixed precision hands them bf16 weights (tensor cores)."""
    r = _grouped()
    trace = dict(trace_precision="bf16-pure")  # the bf16-weights trace (the only one MoE experts trace in)
    autocast = Rates.of(H200.device, autopar.Plan(precision="bf16"), CAL, **trace)
    fsdp = Rates.of(H200.device, autopar.Plan(precision="bf16", dp_shard=8), CAL, **trace)
    assert autocast.fp32_weights and not fsdp.fp32_weights
    assert not _rates().fp32_weights  # an autocast trace's records say their dtype themselves
    e, m, n, k = r.shape  # one fp32 GEMM a group, each at the SIMT rate of its own M x N output and K depth
    rate = H200.device.peak_flops("fp32") * CAL.fp32_matmul_efficiency * k / (k + CAL.fp32_matmul_half_depth) \
        * m * n / (m * n + CAL.fp32_matmul_half_output)
    fp32 = r.flops / rate
    assert op_seconds(r, autocast) == pytest.approx(fp32, rel=1e-9)
    assert op_seconds(r, fsdp) < fp32 / 5
    # many small experts run slower a FLOP than a few large ones: each small GEMM fills the SMs alone
    small = _grouped(e=64, m=128, n=2048, k=1024)  # measured on the H200: 0.29 of the fp32 peak, a large one 0.77
    assert op_seconds(small, autocast) / small.flops > 1.5 * op_seconds(r, autocast) / r.flops
    # and the fallback launches a kernel a group
    assert _record_time(small, 1.0, TPSplit(), autocast, 1.0).launches == 64
    assert _record_time(small, 1.0, TPSplit(), fsdp, 1.0).launches == 1


def test_a_depthwise_convolution_runs_on_cuda_cores_slower_on_nchw_and_in_backward():
    cl, nchw = op_seconds(_conv(), _rates()), op_seconds(_conv(channels_last=0), _rates())
    assert cl == pytest.approx(_conv().flops / (H200.device.peak_flops("fp32") * CAL.depthwise_conv_efficiency))
    assert nchw == pytest.approx(cl / CAL.depthwise_nchw_factor, rel=1e-9)
    assert op_seconds(_conv(channels_last=0), _rates(compile=True)) == pytest.approx(cl, rel=1e-9)  # NHWC
    back = op_seconds(_conv(backward=True), _rates())
    assert back == pytest.approx(cl * CAL.depthwise_conv_efficiency / CAL.depthwise_conv_backward_efficiency)


def test_a_convolution_on_an_image_s_three_channels_is_misaligned_in_its_forward_only():
    stem = dict(m=64 * 112 * 112, n=64, k=147, groups=1)
    aligned, three = op_seconds(_conv(**stem, c_in=8), _rates()), op_seconds(_conv(**stem, c_in=3), _rates())
    assert three == pytest.approx(aligned / CAL.misaligned_conv_factor, rel=1e-9)
    assert op_seconds(_conv(**stem), _rates()) == pytest.approx(aligned, rel=1e-9)  # no channel count: aligned
    assert op_seconds(_conv(**stem, c_in=3, backward=True), _rates()) == pytest.approx(
        op_seconds(_conv(**stem, c_in=8, backward=True), _rates()), rel=1e-9)


def test_compile_prices_attention_with_a_mask_only_compile_builds_as_the_unfused_path():
    """BERT-like (not causal, unmasked eagerly, a mask only torch.compile builds: masked 2): compiled, the scores
    go through HBM, so the call costs more than eager's fused kernel and its cost grows with the score matrix;
    causal attention, and attention with no mask to build (timm's, Whisper's encoder's), stay the fused kernel."""
    for backward in (False, True):
        eager = op_seconds(_attention(backward=backward, masked=2), _rates())
        compiled = op_seconds(_attention(backward=backward, masked=2), _rates(compile=True))
        assert compiled > eager
        longer = op_seconds(_attention(s=1024, b=16, backward=backward, masked=2), _rates(compile=True))
        assert longer > 1.5 * compiled  # same tokens, twice the keys a query: the traffic doubles
    for fused in (_attention(causal=1), _attention()):
        assert op_seconds(fused, _rates(compile=True)) == pytest.approx(op_seconds(fused, _rates()), rel=1e-9)


def _groups(ops: tuple, host: HostCosts) -> tuple:
    """Groups of ops whose launches the host issues at `host`'s costs."""
    return tuple(_Group(o, host) for o in ops)


def test_the_host_launching_a_launch_bound_group_first_in_backward_leaves_the_gpu_waiting():
    """Forward: GPU-heavy group A then launch-bound group B (the host runs ahead during A and hides B's
    launches). Backward runs B first: the GPU waits for B's launches, then A's GPU time follows: more than
    max(host, GPU) over the step. With equal groups the queue gives max(host, GPU) again."""
    a = OpsTime(compute_forward_s=1.0, compute_backward_s=2.0, launches=2, backward_launches=1)
    b = OpsTime(compute_forward_s=0.0, compute_backward_s=0.0, launches=2000, backward_launches=1000)
    launch = 1e-3
    total_gpu, total_host = 3.0, 2002 * launch
    queued = _queued_s(_groups((a, b), HostCosts(launch, launch)), 1.0)
    assert queued > max(total_gpu, total_host)
    # A's forward hides B's forward launches; B's backward launches (1 s) then A's backward GPU time (2 s)
    assert queued == pytest.approx(1.0 + 1.0 + 2.0, rel=1e-3)
    even = OpsTime(compute_forward_s=1.0, compute_backward_s=2.0, launches=10, backward_launches=5)
    assert _queued_s(_groups((even, even), HostCosts(launch, launch)), 1.0) == pytest.approx(6.0, rel=1e-9)


def test_views_and_weight_casts_are_counted_and_cost_eager_host_time_only():
    """x (8, 16) viewed, transposed and reshaped, times a bf16 round trip of a weight: the views are "view"
    records (no bytes), the casts "weight_cast" records with their bytes; eager they add host time at view_host_s
    each (and the cast's bytes); compiled, the views nothing and each cast a kernel of inductor's (its bytes at
    the fused bandwidth)."""
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 16)
    ops = watched(lambda x, w: (x.view(4, 32).reshape(8, 16).t().t() @ w.to(torch.bfloat16).float()), x,
                   params=(w,))
    views = [r for r in ops if r.kind == "view"]
    casts = [r for r in ops if r.kind == "weight_cast"]
    assert sum(r.count for r in views if not r.backward) >= 4 and all(r.bytes == 0 for r in views)
    # fp32 -> bf16 -> fp32: two casts of the weight alone, each reading and writing its 256 elements
    assert [(r.count, r.bytes, r.backward) for r in casts] == [(1, 16 * 16 * (4 + 2), False)] * 2
    eager, compiled = _rates(), _rates(compile=True)
    (forward,) = [r for r in views if not r.backward]
    t = _record_time(forward, 1.0, TPSplit(), eager, 1.0)
    assert t.views == forward.count and t.launches == 0 and t.compute_s == t.memory_s == 0
    assert _record_time(forward, 1.0, TPSplit(), compiled, 1.0) == OpsTime()
    cast = _record_time(casts[0], 1.0, TPSplit(), compiled, 1.0)
    assert cast.launches == 1 and cast.views == 0
    assert cast.memory_s == pytest.approx(casts[0].bytes / compiled.fused_hbm)
    # the host's queue: views add view_s each to the host's time, none to the GPU's
    group = OpsTime(compute_forward_s=0.0, launches=10, views=1000)
    assert _queued_s(_groups((group,), HostCosts(1e-3, 1e-3, 1e-4, 1e-4)), 1.0) == pytest.approx(10 * 1e-3 + 1000 * 1e-4)
    assert _queued_s(_groups((group,), HostCosts(1e-3, 1e-3)), 1.0) == pytest.approx(10 * 1e-3)


def test_a_backward_heavy_launch_bound_step_costs_the_host_less_than_as_many_forward_ops():
    """Eager, autograd's C++ engine issues the backward's kernels and views without the model's Python: the same
    count of launch-bound ops (no GPU time) costs the host less backward than forward, at the calibration's
    per-op costs; compiled, inductor's wrapper launches both graphs' kernels at one cost."""
    n, views = 1000, 500
    forward = OpsTime(launches=n, views=views)
    backward = OpsTime(launches=n, backward_launches=n, views=views, backward_views=views)
    eager = HostCosts.of(CAL, compiled=False)
    fwd_s, bwd_s = _queued_s(_groups((forward,), eager), 1.0), _queued_s(_groups((backward,), eager), 1.0)
    assert fwd_s == pytest.approx(n * CAL.launch_s + views * CAL.view_host_s)
    assert bwd_s == pytest.approx(n * CAL.backward_launch_s + views * CAL.backward_view_host_s)
    assert bwd_s < fwd_s
    compiled = HostCosts.of(CAL, compiled=True)
    assert _queued_s(_groups((backward,), compiled), 1.0) == pytest.approx(_queued_s(_groups((forward,), compiled), 1.0))
    # through the whole model: a step whose traced ops are mostly backward spends less host time per op
    heavy = OpsTime(compute_backward_s=0.0, launches=3 * n, backward_launches=2 * n)
    light = OpsTime(compute_backward_s=0.0, launches=3 * n, backward_launches=n)
    assert _queued_s(_groups((heavy,), eager), 1.0) < _queued_s(_groups((light,), eager), 1.0)
