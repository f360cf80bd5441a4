"""bench/multigpu.py (issue 15): the multi-GPU scenarios, made for any world size, and a smoke run of the script
on 2 gloo processes (its GPU run is the same code on NCCL): every plan trains as one process does on the full
batch (bf16 tolerance) and its record holds the measurement beside autopar's prediction."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import autopar
from bench.multigpu import GLOBAL_BATCH, PARITY_REL, report, scenarios
from tests._training import TORCHRUN_VARS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_scenario_is_a_valid_plan_of_the_world_size_and_the_global_batch(world):
    made = scenarios(world, GLOBAL_BATCH["small"])
    assert made.pop("wrap") is None  # wrap's own choice
    want = {"fsdp", "tp-sp", "pp-1f1b", "pp-interleaved"} | ({"hsdp"} if world >= 4 else set()) \
        | ({"pp-zero-bubble"} if world == 2 else set()) | ({"pp-tp-fsdp"} if world >= 8 else set())
    assert set(made) == want
    for kwargs in made.values():
        plan = autopar.Plan(precision="bf16", **kwargs)
        assert plan.world_size == world and plan.global_batch_size == GLOBAL_BATCH["small"]


def test_the_script_runs_on_two_gloo_processes_and_each_plan_trains_as_one_process(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    out = tmp_path / "m.jsonl"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "bench.multigpu", "--device", "cpu", "--size", "tiny", "--scenarios",
                           "fsdp,pp-1f1b,wrap", "--steps", "3", "--timed-steps", "1", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["scenario"] for r in recs] == ["fsdp", "pp-1f1b", "wrap"]
    for r in recs:
        assert r["status"] == "ok", r.get("traceback")
        assert r["world_size"] == 2 and len(r["losses"]) == 3 and len(r["reference_losses"]) == 3
        assert r["parity_ok"] and r["max_loss_rel_diff"] <= PARITY_REL
        assert r["step_s"] > 0 and r["predicted_step_s"] > 0 and len(r["peak_bytes_per_rank"]) == 2
    assert recs[0]["plan"]["dp_shard"] == 2 and recs[1]["plan"]["pp"] == 2
    table = report(recs)
    assert table.count("| 2 | tiny |") == 3 and "| ok |" in table


def test_the_search_scenarios_are_one_plan_of_every_shape_the_search_enumerates():
    from pathlib import Path as _Path

    from bench.multigpu import Options, search_scenarios

    opts = Options("tiny", "cpu", 2, 0, 1e-3, _Path("unused"), "")
    made = search_scenarios(opts, 4)
    plans = [autopar.Plan(precision="bf16", **kwargs) for kwargs in made.values()]
    assert len(plans) > 50 and all(p.world_size == 4 and p.global_batch_size == 8 for p in plans)
    shapes = {(p.pp, p.dp_replicate, p.dp_shard, p.tp) for p in plans}
    assert {(1, 1, 4, 1), (1, 4, 1, 1), (1, 2, 1, 2), (1, 1, 2, 2), (2, 1, 2, 1), (2, 2, 1, 1), (4, 1, 1, 1), (2, 1, 1, 2)} <= shapes
    assert {p.checkpointing for p in plans} == {"none", "selective", "alternate", "gemms", "full"}
    assert {p.zero_stage for p in plans} == {1, 2, 3} and not any(p.compile for p in plans)
    assert all(not p.uses_fsdp for p in plans if p.pp_schedule == "zero_bubble")  # refused beside FSDP
