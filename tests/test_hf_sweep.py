"""bench hf-sweep: one architecture measured in-process, and the report's reading of the statuses."""

from __future__ import annotations

import json

from bench import hf_sweep


def test_an_architecture_autopar_handles_is_ok_with_both_plans_and_wrap_s_first_loss_the_models_own():
    rec = hf_sweep.measure("causal-lm", "llama")
    assert rec["status"] == "ok", rec
    assert all(rec[t]["ok"] and rec[t]["plan"] for t in hf_sweep.TOPOLOGIES)
    wrap = rec["wrap"]
    assert wrap["ok"] and wrap["same_first_loss"]
    assert abs(wrap["losses"][0] - wrap["own_loss"]) <= 1e-4 * max(1.0, abs(wrap["own_loss"]))
    assert wrap["losses"][1] < wrap["losses"][0]  # it trained


def test_a_model_whose_own_step_fails_is_not_counted_as_autopars(monkeypatch):
    import torch

    class Broken(torch.nn.Module):
        config = type("Config", (), {"vocab_size": 16})()

        def forward(self, **batch):
            raise RuntimeError("the model's own bug")

    monkeypatch.setattr(hf_sweep, "build", lambda task, arch: Broken())
    rec = hf_sweep.measure("causal-lm", "broken")
    assert rec["status"] == "model_failed" and "the model's own bug" in rec["error"]


def test_the_report_counts_statuses_per_task_and_lists_what_autopar_did_not_do(tmp_path):
    head = {"date": "2026-12-06T00:00:00", "device": "cpu", "torch": "t", "transformers": "x", "command": "c",
            "commit": "abcdef0"}
    ok = {"ok": True, "s": 0.5, "plan": "1gpu"}
    rows = [
        {"task": "causal-lm", "arch": "a", "status": "ok", "1xH200": ok, "8xH100-SXM": ok,
         "wrap": {"ok": True, "s": 0.1, "own_loss": 1.0, "losses": [1.0, 0.9], "same_first_loss": True}},
        {"task": "causal-lm", "arch": "b", "status": "mismatch", "1xH200": ok, "8xH100-SXM": ok,
         "wrap": {"ok": True, "s": 0.1, "own_loss": 1.0, "losses": [1.5, 0.9], "same_first_loss": False}},
        {"task": "vision", "arch": "c", "status": "autopar_failed", "1xH200": ok,
         "8xH100-SXM": {"ok": False, "s": 0.2, "error": "PlanError: nope"}, "wrap": {"ok": True, "s": 0.1,
                                                                                 "own_loss": 1.0, "losses": [1.0, 1.0]}},
        {"task": "vision", "arch": "d", "status": "model_failed", "error": "x"},
        {"task": "vision", "arch": "e", "status": "timeout", "phase": "plan 1xH200", "error": "killed at 120 s"},
        {"task": "vision", "arch": "f", "status": "crashed", "phase": "build", "rc": -9, "error": "# phase build"},
    ]
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps({**r, **head}) + "\n" for r in rows))
    text = hf_sweep.report(str(path))
    assert "| causal-lm | 2 | 1 | 1 | 0 | 0 | 0 | 0 | 0 |" in text
    assert "| vision | 4 | 0 | 0 | 1 | 0 | 1 | 1 | 1 |" in text
    assert "| causal-lm | b | mismatch | own loss 1.000000, wrap's first 1.500000 |" in text
    assert "| vision | c | autopar_failed | 8xH100-SXM: PlanError: nope |" in text
    assert "| vision | e | timeout | phase plan 1xH200: killed at 120 s |" in text
    assert "model_failed" in text and "| vision | d |" not in text  # not autopar's: counted, not listed
    assert "| vision | f |" not in text and "1 timeouts and crashes (killed: out of memory) came before" in text
