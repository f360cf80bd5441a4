"""Predict Megatron-LM's Table 1 (Narayanan et al. 2021) with the cost model, "on paper".

Each row: a GPT of the row's shape (autopar.models.gpt, vocab 51,200, sequence 2048) as Megatron-LM computed it
in 2021 (attention unfused, dropout 0.1: tests/cost/test_paper.py's Attention2021), traced on the meta device
at 2 and 3 blocks in bf16 (weights and activations, as under FSDP's mixed precision) and extrapolated to the
row's depth; the cost model's default calibration; the row's A100-80GB cluster (8 GPUs a node, NVLink 3 inside, 8 x 200 Gb/s InfiniBand a node, i.e.
200 Gb/s a GPU); and the row's plan (TP, PP, DP = GPUs / (TP x PP) replicas, no sequence parallelism, full
activation recomputation, bf16, eager kernels). Megatron's micro-batch size and pipeline schedule are not in
the table: the plan with the shortest predicted step that fits in memory is taken, among micro-batches 1, 2,
4, 8 and 1F1B or interleaved 1F1B (Megatron's constraints: layers per stage divisible by the chunks, micro-
batches divisible by PP). The predicted TFLOP/s per GPU uses the paper's own FLOP count,
F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h)), over the predicted step time.

    python -m bench.megatron_table1 [--out bench/results]

writes bench/results/megatron_table1_<date>.txt.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from typing import Any

import torch

import autopar
from autopar.cost import predict_profile
from bench._common import RESULTS, write_dated

# The rows, the paper's software calibration, the profiles and the plans are the test's (tests/cost/test_paper.py),
# so that the benchmark prints what the test asserts.
from tests.cost.test_paper import MEGATRON_2021, SEQ, VOCAB
from tests.cost.test_paper import MEGATRON_TABLE1 as ROWS
from tests.cost.test_paper import _megatron_plans as candidate_plans
from tests.cost.test_paper import _profile as table5_profile
from tests.cost.test_paper import _profile_2021 as row_profile


def paper_flops(batch: int, layers: int, hidden: int) -> float:
    """FLOPs of one iteration as the paper counts them (with the recomputed forward)."""
    return 96 * batch * SEQ * layers * hidden**2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))


def predict_row(row):
    """(plan, prediction, predicted TFLOP/s per GPU) of the best plan for a Table 1 row."""
    _, heads, hidden, layers, tp, pp, gpus, batch, _ = row
    profile = row_profile(hidden, heads, layers)
    topology = autopar.Topology.from_spec(f"{gpus // 8}x8xA100-SXM-80GB", inter_node_gbps=200)
    best = None
    for plan in candidate_plans(layers, tp, pp, gpus, batch):
        pred = predict_profile(profile, plan, topology, MEGATRON_2021)
        if pred.memory.peak_bytes > topology.device.memory_bytes:
            continue
        if best is None or pred.step_s < best[1].step_s:
            best = (plan, pred)
    assert best is not None, f"no plan fits for row {row}"
    plan, pred = best
    return plan, pred, paper_flops(batch, layers, hidden) / pred.step_s / gpus / 1e12


# Korthikanti et al. 2022, Table 5: name, heads, hidden, layers, TP, PP, GPUs, batch, chunks a rank (interleaving),
# iteration seconds with full recompute, with selective recompute + sequence parallelism (A100-80GB)
TABLE5 = [
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 1, 1.42, 1.10),
    ("175B", 96, 12288, 96, 8, 8, 64, 64, 3, 18.13, 13.75),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 3, 49.05, 37.83),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 1, 94.42, 71.49),
]


def table5_lines() -> list[str]:
    """Korthikanti et al. 2022 Table 5 predicted (micro-batch 1; 4 for the 22B model, batch 4 on one TP group)."""
    lines = [f"{'model':>5} {'mb':>2} {'full s':>7} {'pred':>7} {'err':>7} {'sel+SP s':>8} {'pred':>7} {'err':>7} "
             f"{'ratio':>6} {'pred':>6}"]
    for name, heads, hidden, layers, tp, pp, gpus, batch, v, full_s, sel_s in TABLE5:
        profile = table5_profile(hidden, heads, layers)
        topology = autopar.Topology.from_spec(f"{max(gpus // 8, 1)}x8xA100-SXM-80GB", inter_node_gbps=200)
        dp, mb = gpus // (tp * pp), 4 if pp == 1 else 1
        pred = {}
        for checkpointing, sp in (("full", False), ("selective", True)):
            plan = autopar.Plan(pp=pp, tp=tp, dp_replicate=dp, micro_batch_size=mb, grad_accum=batch // dp // mb,
                                pp_schedule=None if pp == 1 else ("interleaved_1f1b" if v > 1 else "1f1b"),
                                pp_stages_per_rank=v, checkpointing=checkpointing, sequence_parallel=sp,
                                precision="bf16")
            pred[checkpointing] = predict_profile(profile, plan, topology, MEGATRON_2021).step_s
        lines.append(f"{name:>5} {mb:>2} {full_s:7.2f} {pred['full']:7.2f} {pred['full'] / full_s - 1:+7.1%} "
                     f"{sel_s:8.2f} {pred['selective']:7.2f} {pred['selective'] / sel_s - 1:+7.1%} "
                     f"{sel_s / full_s:6.3f} {pred['selective'] / pred['full']:6.3f}")
    return lines


def time_parts(pred: Any) -> str:
    """A prediction's time terms of at least a millisecond, seconds each ("compute 0.917 memory 0.212 ...")."""
    return " ".join(f"{k.removesuffix('_s')} {v:.3g}" for k, v in pred.time.parts().items() if v >= 1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    start = time.perf_counter()
    machine = f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, no GPU used)"
    lines = [f"date {datetime.date.today().isoformat()}, machine {machine}, torch {torch.__version__}, "
             f"python {platform.python_version()}",
             "command: " + " ".join(["python -m bench.megatron_table1", *sys.argv[1:]]),
             "Megatron-LM Table 1 (Narayanan et al. 2021) predicted on paper: A100-SXM-80GB, 200 Gb/s a GPU across "
             "nodes, DP replicas, no SP, full recompute, bf16, eager",
             "",
             f"{'params':>8} {'TP':>2} {'PP':>3} {'GPUs':>5} {'batch':>5} {'meas':>5} {'pred':>6} {'err':>7} "
             f"{'mb':>2} {'schedule':>13} {'step s':>7} {'mem GiB':>7}  time parts (s)"]
    errors = []
    for row in ROWS:
        params, _, _, _, tp, pp, gpus, batch, measured = row
        plan, pred, tflops = predict_row(row)
        err = tflops / measured - 1
        errors.append(err)
        schedule = "-" if plan.pp == 1 else (plan.pp_schedule if plan.pp_stages_per_rank == 1
                                             else f"{plan.pp_schedule.replace('_1f1b', '')} v{plan.pp_stages_per_rank}")
        parts = time_parts(pred)
        lines.append(f"{params:7.1f}B {tp:>2} {pp:>3} {gpus:>5} {batch:>5} {measured:>5} {tflops:6.1f} {err:+7.1%} "
                     f"{plan.micro_batch_size:>2} {schedule:>13} {pred.step_s:7.2f} "
                     f"{pred.memory.peak_bytes / 2**30:7.1f}  {parts}")
        print(lines[-1], flush=True)
    lines += ["", f"errors: min {min(errors):+.1%}, max {max(errors):+.1%}, mean |err| "
              f"{sum(abs(e) for e in errors) / len(errors):.1%}; {time.perf_counter() - start:.0f} s"]
    print(lines[-1])
    lines += ["", "Korthikanti et al. 2022, Table 5 (iteration time, full recompute -> selective recompute + SP):"]
    lines += table5_lines()
    print("\n".join(lines[-6:]))
    print("wrote", write_dated(args.out, "megatron_table1", lines))


if __name__ == "__main__":
    main()
