"""Checkpoints move between plans: saved under FSDP on 4 ranks (and under a pipeline on 2), loaded under
tensor parallelism on 2 ranks and into one plain process. The loaded parameters and optimizer state equal
the saved ones, and training resumed from the checkpoint gives the losses of the uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autopar
from tests._training import make_model, make_optimizer
from tests.distributed._launch import ROOT, process_env, torchrun

pytestmark = pytest.mark.slow

WORKER = "tests/distributed/_ckpt_worker.py"


def _single_process(args: list[str], *, cache_dir: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / WORKER), *args], env=process_env(cache_dir), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    cache = tmp / "autopar-cache"  # this fixture's own: no plan cached by another test or by the user
    out = {}

    def ranks(world_size: int, mode: str, plan: dict, ckpt: str, result: str) -> None:
        torchrun(WORKER, world_size, [mode, json.dumps(plan), str(tmp / ckpt), str(tmp / result)], cache_dir=cache)

    def one_process(plan: dict, ckpt: str, result: str) -> None:
        _single_process(["load", json.dumps(plan), str(tmp / ckpt), str(tmp / result)], cache_dir=cache)

    # Saved under FSDP on 4 ranks; loaded under TP on 2 ranks and in one process.
    ranks(4, "save", {"dp_shard": 4, "micro_batch_size": 2}, "fsdp", "s.pt")
    ranks(2, "load", {"tp": 2, "micro_batch_size": 8}, "fsdp", "tp.pt")
    one_process({"micro_batch_size": 8}, "fsdp", "one.pt")
    # Saved by a pipeline (a tied weight with a copy on each stage); loaded in one process.
    plan = {"pp": 2, "pp_schedule": "1f1b", "micro_batch_size": 2, "grad_accum": 4}
    ranks(2, "save", plan, "pp", "pps.pt")
    one_process({"micro_batch_size": 8}, "pp", "ppone.pt")
    # And the other way: the FSDP checkpoint (one tied weight) into a pipeline (a copy per stage).
    ranks(2, "load", plan, "fsdp", "topp.pt")
    for name in ("s", "tp", "one", "pps", "ppone", "topp"):
        out[name] = torch.load(tmp / f"{name}.pt", weights_only=False)
    out["dir"] = tmp
    return out


def _assert_same_state(saved: dict, loaded: dict) -> None:
    assert set(saved["model"]) == set(loaded["model"])
    for name, tensor in saved["model"].items():
        torch.testing.assert_close(loaded["model"][name], tensor, rtol=0, atol=0, msg=name)
    s_opt, l_opt = saved["optim"]["state"], loaded["optim"]["state"]
    assert l_opt and s_opt
    # A pipeline keeps one copy of a tied weight per stage (and optimizer state for each); where the weight
    # is one parameter, one name holds the state. A name on one side only must hold the state of a name
    # on both sides.
    for one, other in ((s_opt, l_opt), (l_opt, s_opt)):
        for extra in set(one) - set(other):
            partners = [n for n in set(one) & set(other)
                        if all(torch.equal(torch.as_tensor(one[extra][k]), torch.as_tensor(one[n][k])) for k in one[n])]
            assert partners, f"optimizer state of {extra} has no equal under another name"
    for name, state in ((n, s_opt[n]) for n in set(l_opt) & set(s_opt)):
        assert set(state) == set(l_opt[name]) == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in state.items():
            torch.testing.assert_close(torch.as_tensor(l_opt[name][key]), torch.as_tensor(value), rtol=0, atol=0,
                                       msg=f"{name}.{key}")


CASES = [("s", "tp"), ("s", "one"), ("pps", "ppone"), ("s", "topp")]
IDS = ["fsdp4-to-tp2", "fsdp4-to-one-process", "pp2-to-one-process", "fsdp4-to-pp2"]


@pytest.mark.parametrize("saved,loaded", CASES, ids=IDS)
def test_loaded_state_equals_saved_state(runs, saved, loaded):
    _assert_same_state(runs[saved]["state"], runs[loaded]["state"])


@pytest.mark.parametrize("saved,loaded", CASES, ids=IDS)
def test_resumed_training_matches_the_uninterrupted_run(runs, saved, loaded):
    uninterrupted, resumed = runs[saved]["losses"], runs[loaded]["losses"]
    assert len(resumed) == len(uninterrupted) == 5
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(uninterrupted), rtol=1e-5, atol=0)


def test_checkpoint_of_another_model_is_refused(runs):
    from autopar.models.gpt import GPT, GPTConfig

    other = GPT(GPTConfig(vocab_size=128, seq_len=32, num_layers=2, hidden_dim=64, num_heads=4))
    with pytest.raises(autopar.PlanMismatchError, match="another model"):
        autopar.load(other, torch.optim.AdamW(other.parameters()), runs["dir"] / "fsdp")


def test_another_kind_of_optimizer_is_refused_with_a_clear_message(runs):
    model = make_model()
    with pytest.raises(autopar.AutoparError, match="optimizer of kind AdamW, and this one is SGD: .*build a AdamW to resume"):
        autopar.load(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), runs["dir"] / "fsdp")
    with pytest.raises(autopar.AutoparError, match="optimizer must be of the kind that was saved"):  # forced: DCP's
        autopar.load(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), runs["dir"] / "fsdp",
                     force=True)


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
