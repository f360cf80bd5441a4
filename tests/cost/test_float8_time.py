"""The cost model's float8 linears (Plan.float8): the GEMMs of the blocks' layers float8_converts picks run at the
float8 rate and pay their casts; nothing else changes. On a GEMM-bound model with large layers a compiled float8
plan is predicted faster than bf16; a model with no such layer is predicted exactly as bf16; the casts make an
eager float8 step pay more of its saving than a compiled one; a GPU without float8 keeps bf16's time."""

from __future__ import annotations

import functools

import pytest
import torch

import autopar
from autopar.cost import Calibration, predict_profile
from autopar.layout import float8_weight_shapes
from autopar.models.llama import Llama, LlamaConfig, lm_loss
from autopar.profile import profile_model

H200 = autopar.Topology.from_spec("1xH200")


@functools.lru_cache(maxsize=None)
def _traced(hidden: int, ffn: int):
    cfg = LlamaConfig(vocab_size=512, seq_len=1024, num_layers=2, hidden_dim=hidden, num_heads=4, num_kv_heads=4,
                      ffn_dim=ffn)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(cfg)
    sample = torch.randint(0, 512, (8, 1024))  # 8,192 tokens: the GEMMs' M
    return (profile_model(model, sample, loss_fn=lm_loss, graphs=False),
            {"bf16": profile_model(model, sample, loss_fn=lm_loss, precision="bf16", graphs=False)})


def _step_s(hidden: int, ffn: int, topology=H200, **plan) -> float:
    profile, variants = _traced(hidden, ffn)
    return predict_profile(profile, autopar.Plan(precision="bf16", micro_batch_size=8, **plan), topology,
                           Calibration(), variants=variants).step_s


def test_large_linear_layers_are_predicted_faster_in_float8_compiled():
    # ffn 8192 > 1024 outputs: the gate and up projections convert; the down projection (8192 in) too
    assert float8_weight_shapes(_traced(2048, 8192)[1]["bf16"])
    bf16, float8 = _step_s(2048, 8192, compile=True), _step_s(2048, 8192, compile=True, float8=True)
    assert float8 < 0.97 * bf16


def test_a_model_without_a_layer_worth_converting_is_predicted_as_bf16():
    assert not float8_weight_shapes(_traced(256, 512)[1]["bf16"])
    assert _step_s(256, 512, compile=True, float8=True) == pytest.approx(_step_s(256, 512, compile=True), rel=1e-12)


def test_the_casts_cost_eager_more_than_compiled():
    eager = _step_s(2048, 8192) - _step_s(2048, 8192, float8=True)
    compiled = _step_s(2048, 8192, compile=True) - _step_s(2048, 8192, compile=True, float8=True)
    assert compiled > eager  # the same GEMMs saved; eager's casts at the unfused bandwidth, more launches


def test_a_gpu_without_float8_keeps_the_bf16_time():
    a100 = autopar.Topology.from_spec("1xA100-SXM-80GB")
    assert _step_s(2048, 8192, a100, compile=True, float8=True) == pytest.approx(
        _step_s(2048, 8192, a100, compile=True), rel=1e-12)


def test_only_the_tuners_search_has_float8_plans_and_only_on_a_gpu_with_float8(monkeypatch):
    import importlib.util

    from autopar.search import search

    profile, variants = _traced(2048, 8192)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "torchao" else real(name, *a))

    def float8_plans(topology, measured):
        ranked = search(profile, autopar.Topology.from_spec(topology), global_batch_size=8, variants=variants,
                        measured=measured)
        return [c.plan for c in ranked if c.plan.float8]

    tuned = float8_plans("1xH200", True)
    assert tuned and all(p.precision == "bf16" and p.tp == 1 for p in tuned)
    assert not float8_plans("1xH200", False)  # wrap and autopar.plan: not on the prediction alone
    assert not float8_plans("1xA100-SXM-80GB", True)  # no float8 tensor cores


def test_rowwise_pays_more_casts_than_tensorwise_for_the_same_float8_gemms():
    bf16 = _step_s(2048, 8192, compile=True)
    tensorwise = _step_s(2048, 8192, compile=True, float8=True)
    rowwise = _step_s(2048, 8192, compile=True, float8=True, float8_recipe="rowwise")
    assert tensorwise < rowwise < bf16  # six casts a layer instead of three, the same float8 GEMMs
    cal = Calibration()
    # the casts are all the difference: at tensorwise's bytes an element, rowwise is priced as tensorwise
    from dataclasses import replace

    profile, variants = _traced(2048, 8192)
    same = predict_profile(profile, autopar.Plan(precision="bf16", micro_batch_size=8, compile=True, float8=True,
                                                 float8_recipe="rowwise"), H200,
                           replace(cal, float8_rowwise_cast_bytes=cal.float8_cast_bytes), variants=variants).step_s
    assert same == pytest.approx(tensorwise, rel=1e-12)


def test_fsdp_gathers_the_float8_weights_in_half_the_bytes_with_tensorwise_scaling():
    """Two nodes of 8 (the gathers cross the network): dp_comm's all-gathers carry the float8 layers' weights at 1
    byte an element under tensorwise scaling (Plan.float8_all_gather), at bf16's 2 under rowwise; with everything
    exposed (no overlap) the gathers' seconds drop by the float8 weights' share of the gathered bytes."""
    from dataclasses import replace

    from autopar.cost.time import _group_bandwidth, time_terms
    from autopar.layout import float8_weight_params

    profile, variants = _traced(2048, 8192)
    topology = autopar.Topology.from_spec("2x8xH200")
    cal = replace(Calibration(), fsdp_overlap=0.0, comm_latency_s=0.0)
    plans = {recipe: autopar.Plan(dp_shard=16, precision="bf16", micro_batch_size=8, float8=True,
                                  float8_recipe=recipe) for recipe in ("tensorwise", "rowwise")}
    assert plans["tensorwise"].float8_all_gather and not plans["rowwise"].float8_all_gather
    assert not autopar.Plan(precision="bf16", float8=True).float8_all_gather  # nothing gathered on one GPU
    comm = {r: time_terms(profile, p, topology, cal, variants=variants)[0].dp_comm_s for r, p in plans.items()}
    f8 = float8_weight_params(profile, range(len(profile.blocks)))
    assert f8 == 2 * (3 * 2048 * 8192 + 4 * 2048 * 2048)  # both blocks: gate, up, down; q, k, v, o (2048 out > 1024)
    bw = _group_bandwidth(topology, 16, 1, cal)
    gathers = 2  # forward and backward (resharded after forward), one micro-batch
    assert comm["rowwise"] - comm["tensorwise"] == pytest.approx(gathers * 15 / 16 * f8 / bw, rel=1e-9)


def test_fsdp_holds_the_gathered_float8_weights_at_one_byte_an_element_with_tensorwise_scaling():
    """Memory: under float8 all-gather the gathered units' float8 layers are held at 1 byte an element (no bf16 copy:
    their GEMMs read the gathered float8 weights), so the tensorwise plan's gathered bytes are lower than rowwise's
    (gathered in bf16) by the two units in flight times the float8 weights of the largest block; nothing else
    changes."""
    from autopar.cost import predict_memory
    from autopar.layout import float8_weight_params

    profile, variants = _traced(2048, 8192)
    mems = {r: predict_memory(profile, autopar.Plan(dp_shard=16, precision="bf16", micro_batch_size=8, float8=True,
                                                    float8_recipe=r), Calibration(), variants=variants)
            for r in ("tensorwise", "rowwise")}
    per_block = float8_weight_params(profile, [0])
    assert per_block == 3 * 2048 * 8192 + 4 * 2048 * 2048
    saved = mems["rowwise"].gathered_bytes - mems["tensorwise"].gathered_bytes
    assert saved == pytest.approx(2 * per_block * (2 - 1), rel=1e-9)  # two units, 2 bytes -> 1
    assert mems["rowwise"].activations_bytes == mems["tensorwise"].activations_bytes
