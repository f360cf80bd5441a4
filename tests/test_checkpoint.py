"""autopar.save / autopar.load on one process (issue 11, items 4 and 5): a save killed at any point leaves a
checkpoint that loads, bit-exact (the earlier one, or the new one once it was complete), and a flipped,
truncated or missing file is refused with the file named. (Checkpoints across plans and world sizes:
tests/distributed/test_checkpoint.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import yaml

import autopar
from autopar.errors import AutoparError
from tests.distributed._ckpt_models import model_and_optimizer
from tests.distributed._launch import ROOT, process_env

KILL_WORKER = "tests/distributed/_ckpt_kill_worker.py"


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _loaded(path) -> tuple[list[torch.Tensor], dict]:
    model, opt = model_and_optimizer(99)  # other values: the load must replace every one
    autopar.load(model, opt, path)
    return _params(model), opt.state_dict()


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _kill_during_save(path, seed: int, when: str, tmp_path) -> int:
    proc = subprocess.run([sys.executable, str(ROOT / KILL_WORKER), str(path), str(seed), when], cwd=ROOT,
                          env=process_env(tmp_path / "cache"), capture_output=True, text=True, timeout=300)
    return proc.returncode


@pytest.fixture()
def saved(tmp_path):
    """Checkpoint A (seed 1) at tmp/ckpt, and the values of A and of B (seed 2)."""
    model, opt = model_and_optimizer(1)
    path = tmp_path / "ckpt"
    autopar.save(model, opt, path)
    return path, _params(model), _params(model_and_optimizer(2)[0])


@pytest.mark.parametrize("when", ["after:0.05", "after:0.15", "after:0.3", "before_switch"])
def test_a_save_killed_before_its_switch_leaves_the_earlier_checkpoint(saved, tmp_path, when):
    path, a, b = saved
    code = _kill_during_save(path, 2, when, tmp_path)
    params, _ = _loaded(path)
    if code == 0:  # the timer came after the save had ended: the new one, complete
        assert _same(params, b)
    else:
        assert code == -9 and (_same(params, a) or _same(params, b)), when  # killed: one of the two, whole


def test_a_save_killed_between_its_renames_loads_the_new_complete_one_with_a_warning(saved, tmp_path):
    path, a, b = saved
    assert _kill_during_save(path, 2, "between", tmp_path) == -9
    assert not path.exists()  # the instant the switch was killed in
    with pytest.warns(UserWarning, match="a save was interrupted while switching folders"):
        params, _ = _loaded(path)
    assert _same(params, b)
    model, opt = model_and_optimizer(3)  # saving again puts a checkpoint back in place
    autopar.save(model, opt, path)
    assert _same(_loaded(path)[0], _params(model))


def test_a_flipped_truncated_or_missing_file_is_refused_by_name(saved):
    path, a, _ = saved
    shard = next(p for p in sorted(path.iterdir()) if p.suffix == ".distcp")
    original = shard.read_bytes()
    flipped = bytearray(original)
    for i in range(1000, 1400):
        flipped[i] ^= 0xFF
    shard.write_bytes(bytes(flipped))
    with pytest.raises(AutoparError, match=f"{shard.name} is changed"):
        _loaded(path)
    shard.write_bytes(original[: len(original) // 2])
    with pytest.raises(AutoparError, match=f"{shard.name} is truncated"):
        _loaded(path)
    shard.unlink()
    with pytest.raises(AutoparError, match=f"{shard.name} is missing"):
        _loaded(path)
    shard.write_bytes(original)
    assert _same(_loaded(path)[0], a)


def test_every_file_is_listed_with_its_size_and_hash(saved):
    path, _, _ = saved
    meta = yaml.safe_load((path / "autopar.yaml").read_text())
    on_disk = {p.name for p in path.iterdir() if p.name != "autopar.yaml"}
    assert set(meta["files"]) == on_disk and ".metadata" in on_disk
    assert all(len(v["sha256"]) == 64 and v["bytes"] == (path / k).stat().st_size for k, v in meta["files"].items())
    assert not list(path.parent.glob(".ckpt.*"))  # no folder left beside it


def test_a_checkpoint_saved_before_checksums_still_loads(saved):
    path, a, _ = saved
    meta = yaml.safe_load((path / "autopar.yaml").read_text())
    del meta["files"]
    (path / "autopar.yaml").write_text(yaml.safe_dump(meta))
    assert _same(_loaded(path)[0], a)


def test_loading_into_another_kind_of_optimizer_is_refused(saved):
    """An AdamW checkpoint loaded into Adam was silently accepted (issue 11, item 11)."""
    path, a, _ = saved
    model, _ = model_and_optimizer(99)
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(AutoparError, match="holds the state of an optimizer of kind AdamW, and this one is Adam:"):
        autopar.load(model, adam, path)
    assert yaml.safe_load((path / "autopar.yaml").read_text())["optimizer"] == "AdamW"


def test_each_rank_hashes_its_own_shards_and_never_another_rank_s_sums_files(tmp_path):
    """Rank 0 once hashed rank 3's sums file while it was being written through a temporary name (and failed)."""
    from autopar.checkpoint import _own_files

    for name in (".metadata", "__0_0.distcp", "__1_0.distcp", ".autopar-sums.0.yaml", "..autopar-sums.1.yaml.x.tmp"):
        (tmp_path / name).write_text("x")
    assert [p.name for p in _own_files(tmp_path, 0)] == ["__0_0.distcp", ".metadata"]
    assert [p.name for p in _own_files(tmp_path, 1)] == ["__1_0.distcp"]
