"""bench/microbench_ops.py: its fit recovers the time model's factors from records the model itself priced with
known factors, and the script runs end to end on CPU (--device cpu --quick, then --fit)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import autopar
from autopar.cost import Calibration
from bench import microbench_ops as mb
from bench._common import RESULTS

TRUTH = Calibration(matmul_efficiency=0.7, matmul_half_width=60.0, matmul_rows_half=100.0, misaligned_gemm_factor=0.2,
                    misaligned_bmm_factor=0.07,
                    fp32_matmul_efficiency=0.6, conv_efficiency=0.6, conv_nchw_factor=0.5, attention_efficiency=0.65,
                    attention_half_keys=200.0, attention_half_head_dim=40.0, masked_attention_factor=0.5,
                    grouped_gemm_efficiency=0.7, fp32_matmul_half_depth=50.0, fp32_matmul_half_output=1e5)
H200 = autopar.Topology.from_spec("1xH200").device


def _records() -> list[dict]:
    out = []
    for m in (1024, 4096, 16384):
        for n in (1024, 4096, 16384):
            for k in (64, 256, 1024, 4096):
                out.append(dict(kind="gemm", shape=[1, m, n, k], dtype="bfloat16", flops=2.0 * m * n * k,
                                bytes=2 * (m * k + k * n + m * n), batch_dim=1))
    for bh, seq, d in ((768, 197, 64), (1536, 77, 64), (6144, 49, 32)):  # unaligned batched score GEMMs
        for m, n, k in ((seq, seq, d), (seq, d, seq)):
            out.append(dict(kind="gemm", shape=[bh, m, n, k], dtype="bfloat16", flops=2.0 * bh * m * n * k,
                            bytes=2 * bh * (m * k + k * n + m * n), batch_dim=0))
    for m, n, k in ((256, 1024, 65536), (512, 512, 65536), (128, 2048, 65536), (256, 256, 131072)):
        out.append(dict(kind="gemm", shape=[1, m, n, k], dtype="bfloat16", flops=2.0 * m * n * k,
                        bytes=2 * (m * k + k * n + m * n), batch_dim=1))
    out.append(dict(kind="gemm", shape=[1, 16384, 50257, 1024], dtype="bfloat16", flops=2.0 * 16384 * 50257 * 1024,
                    bytes=2 * (16384 * 1024 + 1024 * 50257 + 16384 * 50257), batch_dim=1))
    for m in (128, 512, 2048, 8192):  # fp32 GEMMs over output sizes and depths (the SIMT rate's two losses)
        for k in (128, 512, 4096):
            out.append(dict(kind="gemm", shape=[1, m, 4096, k], dtype="float32", flops=2.0 * m * 4096 * k,
                            bytes=4 * (m * k + k * 4096 + m * 4096), batch_dim=1))
    for cl in (1, 0):
        for m, n, k in ((64 * 56 * 56, 64, 576), (64 * 28 * 28, 128, 1152), (64 * 14 * 14, 256, 2304)):
            out.append(dict(kind="conv", shape=[m, n, k, 1, cl], dtype="bfloat16", flops=2.0 * m * n * k,
                            bytes=2 * m * (n + k // 9), channels_last=cl, phase="forward"))
    for d in (64, 128):
        for seq in (512, 1024, 2048, 4096, 8192):
            for causal, masked in ((1, 0), (0, 0), (0, 1)):
                b, h = max(1, 32768 // seq), 16
                out.append(dict(kind="attention", shape=[b, h, h, seq, seq, d, d, causal, 0, masked], dtype="bfloat16",
                                flops=2.0 * b * h * seq * seq * 7 * d, bytes=8 * 2 * b * h * seq * d))
    out.append(dict(kind="grouped_gemm", shape=[8, 2048, 4096, 14336], dtype="bfloat16",
                    flops=2.0 * 8 * 2048 * 4096 * 14336, bytes=2 * 8 * 14336 * 4096, batch_dim=1))
    for r in out:
        r["seconds"] = mb._predicted(r, H200, TRUTH)
    return out


def test_the_fit_recovers_the_factors_the_records_were_priced_with(tmp_path):
    path = tmp_path / "microbench_ops.json"
    header = dict(date="test", device="NVIDIA H200", torch="test", command="test", spec=H200.to_dict())
    path.write_text("\n".join(json.dumps(x) for x in [header, *_records()]) + "\n")
    cal, notes = mb.fit(str(path))
    for name in ("matmul_efficiency", "matmul_half_width", "matmul_rows_half", "misaligned_gemm_factor",
                 "misaligned_bmm_factor", "fp32_matmul_efficiency", "conv_efficiency", "conv_nchw_factor", "attention_efficiency",
                 "attention_half_keys", "attention_half_head_dim", "masked_attention_factor",
                 "grouped_gemm_efficiency", "fp32_matmul_half_depth", "fp32_matmul_half_output"):
        assert getattr(cal, name) == pytest.approx(getattr(TRUTH, name), rel=0.05), (name, notes)


def test_the_default_fp32_factors_are_the_fit_of_the_committed_h200_micro_benchmarks():
    """autopar's fp32 GEMM factors are what `--fit` gives on the H200 files in bench/results (rounded)."""
    cal, notes = mb.fit([str(RESULTS / "microbench_ops_h200_2026-12-01.json"),
                         str(RESULTS / "microbench_ops_h200_2026-12-02.json")])
    default = Calibration()
    for name in ("fp32_matmul_efficiency", "fp32_matmul_half_depth", "fp32_matmul_half_output"):
        assert getattr(default, name) == pytest.approx(getattr(cal, name), rel=0.02), (name, notes)


def test_the_default_misaligned_bmm_factor_is_the_fit_of_the_committed_h200_micro_benchmarks():
    """The unaligned batched GEMMs' ratio is what `--fit --on-defaults` gives on the H200 files (rounded)."""
    cal, notes = mb.fit(sorted(str(p) for p in RESULTS.glob("microbench_ops_h200_2026-12-0*.json")), on_defaults=True)
    assert Calibration().misaligned_bmm_factor == pytest.approx(cal.misaligned_bmm_factor, rel=0.02), notes


def test_fitting_on_the_defaults_keeps_the_default_gemm_factors_under_the_ratios(tmp_path):
    """`on_defaults`: a one-factor ratio is fitted on the default GEMM factors, so records priced with the
    defaults and a known ratio give that ratio back, whatever the aligned GEMMs' own fit says."""
    truth = Calibration(misaligned_bmm_factor=0.07)
    recs = [r for r in _records() if r["kind"] == "gemm" and r["dtype"] == "bfloat16"]
    for r in recs:
        r["seconds"] = mb._predicted(r, H200, truth) * (1.0 if r["shape"][0] > 1 else 1.3)
    path = tmp_path / "microbench_ops.json"
    header = dict(date="test", device="NVIDIA H200", torch="test", command="test", spec=H200.to_dict())
    path.write_text("\n".join(json.dumps(x) for x in [header, *recs]) + "\n")
    chained, _ = mb.fit(str(path))
    on_defaults, _ = mb.fit(str(path), on_defaults=True)
    assert on_defaults.misaligned_bmm_factor == pytest.approx(0.07, rel=0.05)
    assert chained.misaligned_bmm_factor != pytest.approx(0.07, rel=0.05)


def test_the_script_runs_on_cpu_and_fits_what_it_wrote(tmp_path):
    run = subprocess.run([sys.executable, "-m", "bench.microbench_ops", "--device", "cpu", "--quick", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = [json.loads(x) for x in (tmp_path / "microbench_ops.json").read_text().splitlines()]
    assert lines[0]["device"] == "cpu" and {r["kind"] for r in lines[1:]} >= {"gemm", "conv", "attention",
                                                                                "elementwise", "conv_grouped",
                                                                                "resample"}
    fitted = subprocess.run([sys.executable, "-m", "bench.microbench_ops", "--fit",
                             str(tmp_path / "microbench_ops.json"), "--as-device", "H200"],
                            capture_output=True, text=True, timeout=300)
    assert fitted.returncode == 0, fitted.stderr
    assert "Calibration(" in fitted.stdout
    # grouped convolutions and resampling are reported against the model, not fitted
    assert "grouped conv1d" in fitted.stdout and "at the default calibration" in fitted.stdout
    assert "bilinear" in fitted.stdout and "of the datasheet HBM bandwidth" in fitted.stdout
