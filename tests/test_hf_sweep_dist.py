"""bench hf-sweep-dist: an architecture wrapped with a multi-rank plan on gloo processes against one plain process,
the comparison's bounds, and the report's reading of the statuses."""

from __future__ import annotations

import json

import torch

from bench import hf_sweep_dist


def test_an_architecture_under_fsdp_on_two_processes_trains_as_one_process():
    rec = hf_sweep_dist.launch("causal-lm", "llama", "fsdp", 2, timeout_s=240)
    assert rec["status"] == "ok", rec
    assert rec["world_size"] == 2 and rec["loss_rel"] <= 1e-5 and rec["params_rel"] <= 1e-5
    assert len(rec["losses"]) == len(rec["ref_losses"]) == hf_sweep_dist.STEPS


def test_the_comparison_flags_a_loss_or_a_parameter_off_by_more_than_its_bound():
    ref = {"a": torch.ones(4, dtype=torch.float64), "b": torch.full((2,), 2.0, dtype=torch.float64)}
    same = hf_sweep_dist._compare([1.0, 0.9], [1.0, 0.9], {k: v.clone() for k, v in ref.items()}, ref)
    assert same["same"] and same["loss_rel"] == 0
    loss_off = hf_sweep_dist._compare([1.0, 0.9001], [1.0, 0.9], ref, ref)
    assert not loss_off["same"] and abs(loss_off["loss_rel"] - 1e-4 / 0.9) < 1e-9
    tensor_off = hf_sweep_dist._compare([1.0], [1.0], {"a": ref["a"], "b": ref["b"] * 1.01}, ref)
    assert not tensor_off["same"] and tensor_off["worst_tensor"] == "b"
    renamed = hf_sweep_dist._compare([1.0], [1.0], {"a": ref["a"]}, ref)
    assert not renamed["same"] and "names differ" in renamed["why"]


def test_the_report_counts_statuses_per_plan_and_lists_what_is_autopars(tmp_path):
    head = {"date": "2026-12-06T00:00:00", "device": "cpu", "torch": "t", "transformers": "x", "command": "c",
            "commit": "abcdef0", "world_size": 2}
    rows = [
        {"task": "causal-lm", "arch": "a", "plan_kind": "fsdp", "status": "ok"},
        {"task": "causal-lm", "arch": "b", "plan_kind": "fsdp", "status": "mismatch", "loss_rel": 0.01,
         "params_rel": 0.02, "worst_tensor": "w", "worst_tensor_rel": 0.5},
        {"task": "causal-lm", "arch": "a", "plan_kind": "tp", "status": "refused", "stage": "wrap",
         "error": "PlanError: 3 heads do not split over 2 ranks"},
        {"task": "vision", "arch": "c", "plan_kind": "tp", "status": "model_failed", "error": "x"},
    ]
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps({**r, **head}) + "\n" for r in rows))
    text = hf_sweep_dist.report(str(path))
    assert "| fsdp | 1 | 0 | 1 | 0 | 0 | 0 | 0 | 0 |" in text
    assert "| tp | 0 | 1 | 0 | 0 | 0 | 0 | 0 | 1 |" in text
    assert "| causal-lm | b | fsdp | mismatch | loss rel 1.0e-02, params rel 2.0e-02, worst w 5.0e-01 |" in text
    assert "| causal-lm | a | tp | refused | wrap PlanError: 3 heads do not split over 2 ranks |" in text
    assert "| vision | c |" not in text
