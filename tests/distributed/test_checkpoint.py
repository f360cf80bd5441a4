"""Checkpoints move between plans: saved under FSDP on 4 ranks (and under a pipeline on 2), loaded under
tensor parallelism on 2 ranks and into one plain process. The loaded parameters and optimizer state equal
the saved ones, and training resumed from the checkpoint gives the losses of the uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import autopar
from tests._training import make_model, make_optimizer
from tests.distributed._launch import ROOT, torchrun

pytestmark = pytest.mark.slow

WORKER = "tests/distributed/_ckpt_worker.py"


def _single_process(args: list[str]) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, str(ROOT / WORKER), *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    out = {}
    # Saved under FSDP on 4 ranks; loaded under TP on 2 ranks and in one process.
    torchrun(WORKER, 4, ["save", json.dumps({"dp_shard": 4, "micro_batch_size": 2}), str(tmp / "fsdp"), str(tmp / "s.pt")])
    torchrun(WORKER, 2, ["load", json.dumps({"tp": 2, "micro_batch_size": 8}), str(tmp / "fsdp"), str(tmp / "tp.pt")])
    _single_process(["load", json.dumps({"micro_batch_size": 8}), str(tmp / "fsdp"), str(tmp / "one.pt")])
    # Saved by a pipeline (a tied weight with a copy on each stage); loaded in one process.
    plan = {"pp": 2, "pp_schedule": "1f1b", "micro_batch_size": 2, "grad_accum": 4}
    torchrun(WORKER, 2, ["save", json.dumps(plan), str(tmp / "pp"), str(tmp / "pps.pt")])
    _single_process(["load", json.dumps({"micro_batch_size": 8}), str(tmp / "pp"), str(tmp / "ppone.pt")])
    for name in ("s", "tp", "one", "pps", "ppone"):
        out[name] = torch.load(tmp / f"{name}.pt", weights_only=False)
    out["dir"] = tmp
    return out


def _assert_same_state(saved: dict, loaded: dict) -> None:
    assert set(saved["model"]) == set(loaded["model"])
    for name, tensor in saved["model"].items():
        torch.testing.assert_close(loaded["model"][name], tensor, rtol=0, atol=0, msg=name)
    s_opt, l_opt = saved["optim"]["state"], loaded["optim"]["state"]
    assert set(l_opt) <= set(s_opt) and l_opt
    # A pipeline keeps one copy of a tied weight per stage (and optimizer state for each): in a model where
    # the weight is one parameter, one name holds the state, and the copies' states were equal.
    for extra in set(s_opt) - set(l_opt):
        partners = [n for n in l_opt if all(torch.equal(torch.as_tensor(s_opt[extra][k]), torch.as_tensor(s_opt[n][k]))
                                            for k in s_opt[extra] if s_opt[n][k] is not None)]
        assert partners, f"optimizer state of {extra} was lost"
    for name, state in ((n, s_opt[n]) for n in l_opt):
        assert set(state) == set(l_opt[name]) == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in state.items():
            torch.testing.assert_close(torch.as_tensor(l_opt[name][key]), torch.as_tensor(value), rtol=0, atol=0,
                                       msg=f"{name}.{key}")


@pytest.mark.parametrize("saved,loaded", [("s", "tp"), ("s", "one"), ("pps", "ppone")],
                         ids=["fsdp4-to-tp2", "fsdp4-to-one-process", "pp2-to-one-process"])
def test_loaded_state_equals_saved_state(runs, saved, loaded):
    _assert_same_state(runs[saved]["state"], runs[loaded]["state"])


@pytest.mark.parametrize("saved,loaded", [("s", "tp"), ("s", "one"), ("pps", "ppone")],
                         ids=["fsdp4-to-tp2", "fsdp4-to-one-process", "pp2-to-one-process"])
def test_resumed_training_matches_the_uninterrupted_run(runs, saved, loaded):
    uninterrupted, resumed = runs[saved]["losses"], runs[loaded]["losses"]
    assert len(resumed) == len(uninterrupted) == 5
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(uninterrupted), rtol=1e-5, atol=0)


def test_checkpoint_of_another_model_is_refused(runs):
    from autopar.models.gpt import GPT, GPTConfig

    other = GPT(GPTConfig(vocab_size=128, seq_len=32, num_layers=2, hidden_dim=64, num_heads=4))
    with pytest.raises(autopar.PlanMismatchError, match="another model"):
        autopar.load(other, torch.optim.AdamW(other.parameters()), runs["dir"] / "fsdp")


def test_a_folder_that_is_not_a_checkpoint_is_refused(tmp_path):
    model = make_model()
    with pytest.raises(autopar.AutoparError, match="not an autopar checkpoint"):
        autopar.load(model, make_optimizer(model), tmp_path)


def test_a_tampered_description_cannot_run_code(runs, tmp_path):
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(runs["dir"] / "fsdp", copy)
    marker = tmp_path / "ran"
    (copy / "autopar.yaml").write_text(f'!!python/object/apply:os.system ["touch {marker}"]\n')
    model = make_model()
    with pytest.raises(autopar.AutoparError, match="not plain YAML"):
        autopar.load(model, make_optimizer(model), copy)
    assert not marker.exists()
