"""bench/graph_breaks.py (dynamo's graphs and breaks per zoo family): a tiny run on a CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._training import TORCHRUN_VARS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.zoo
def test_each_family_gets_one_record_of_its_graphs_and_breaks(tmp_path):
    out = tmp_path / "breaks.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    proc = subprocess.run([sys.executable, "-m", "bench.graph_breaks", "--families", "mlp,gpt2", "--size", "tiny",
                           "--family-timeout-s", "200", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=450)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = {r["family"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(recs) == {"mlp", "gpt2"}
    assert recs["mlp"]["status"] == "ok" and recs["mlp"]["graphs"] == 1 and recs["mlp"]["breaks"] == 0
    gpt2 = recs["gpt2"]
    assert gpt2["status"] == "ok" and gpt2["ops"] > 0
    # dynamo's count: every break starts a new graph; explain lists the distinct breaks it saw (one break
    # reason may stand for several graphs), each naming the user frame it hit.
    assert gpt2["breaks"] == gpt2["graphs"] - 1
    assert 1 <= len(gpt2["reasons"]) <= min(gpt2["breaks"], 12)
    assert all(r["where"] for r in gpt2["reasons"])
