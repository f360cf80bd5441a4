"""autopar.save / autopar.load on one process (issue 11, items 4 and 5): a save killed at any point leaves a
checkpoint that loads, bit-exact (the earlier one, or the new one once it was complete), and a flipped,
truncated or missing file is refused with the file named. (Checkpoints across plans and world sizes:
tests/distributed/test_checkpoint.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time

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
    model, opt = model_and_optimizer(3)  # the next save that completes clears what the killed one left beside it
    autopar.save(model, opt, path)
    assert _beside(path) == [] and _same(_loaded(path)[0], _params(model))


def _beside(path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


def test_a_save_clears_only_what_killed_saves_to_its_path_left(saved):
    path, _, _ = saved
    old = 1_000_000_000  # 2001: before any save of this test
    made = {}
    for name, files in {".ckpt.new-0123456789ab": ["__0_0.distcp", ".metadata.tmp", ".autopar-sums.0.yaml"],
                        ".ckpt.old-0123456789ac": ["__0_0.distcp", "__1_0.distcp", ".metadata", "autopar.yaml",
                                                   ".autopar.yaml.k2j_9x.tmp"],
                        ".ckpt.new-0123456789ad": ["__0_0.distcp", "notes.txt"],  # a file of the user's inside
                        ".ckpt.new-0123456789ae": ["__0_0.distcp"],  # written after the save began (another save)
                        ".ckpt.new-not-a-token": ["__0_0.distcp"], ".other.new-0123456789ab": ["__0_0.distcp"]}.items():
        folder = path.parent / name
        folder.mkdir()
        for f in files:
            (folder / f).write_bytes(b"x")
        made[name] = folder
    for name, folder in made.items():
        if not name.endswith("ae"):
            for f in [*folder.iterdir(), folder]:
                os.utime(f, (old, old))
    later = time.time() + 3600
    os.utime(made[".ckpt.new-0123456789ae"] / "__0_0.distcp", (later, later))
    model, opt = model_and_optimizer(3)
    autopar.save(model, opt, path)
    assert sorted(p.name for p in path.parent.iterdir() if p.name != "ckpt") == [
        ".ckpt.new-0123456789ad", ".ckpt.new-0123456789ae", ".ckpt.new-not-a-token", ".other.new-0123456789ab"]
    assert (made[".ckpt.new-0123456789ad"] / "notes.txt").read_bytes() == b"x"


def test_a_save_killed_between_its_renames_loads_the_new_complete_one_with_a_warning(saved, tmp_path):
    path, a, b = saved
    assert _kill_during_save(path, 2, "between", tmp_path) == -9
    assert not path.exists()  # the instant the switch was killed in
    with pytest.warns(UserWarning, match="a save was interrupted while switching folders"):
        params, _ = _loaded(path)
    assert _same(params, b)
    model, opt = model_and_optimizer(3)  # saving again puts a checkpoint back in place, and nothing beside it
    autopar.save(model, opt, path)
    assert _same(_loaded(path)[0], _params(model)) and _beside(path) == []


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


def test_a_checkpoint_saved_before_checksums_still_loads_with_verify_off(saved):
    path, a, _ = saved
    meta = yaml.safe_load((path / "autopar.yaml").read_text())
    del meta["files"], meta["param_groups"]
    (path / "autopar.yaml").write_text(yaml.safe_dump(meta))
    model, opt = model_and_optimizer(99)
    autopar.load(model, opt, path, verify=False)
    assert _same(_params(model), a)


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


# ---------------------------------------------------------------------------------------------------
# Issue 32: a save replaces only what it may, a failed save leaves nothing, groups are matched by name.


def _tree(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_save_onto_a_folder_that_is_not_a_checkpoint_is_refused_and_leaves_it_untouched(tmp_path):
    """It used to replace the folder: notes.txt and data/train.csv were gone."""
    folder = tmp_path / "project"
    (folder / "data").mkdir(parents=True)
    (folder / "notes.txt").write_text("my notes")
    (folder / "data" / "train.csv").write_text("x,y\n1,2\n")
    before = _tree(folder)
    model, opt = model_and_optimizer(1)
    with pytest.raises(AutoparError, match=r"holds files that are not an autopar checkpoint's \(data, notes.txt\)"):
        autopar.save(model, opt, folder)
    assert _tree(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project"]  # no hidden folder left beside it


@pytest.mark.parametrize("name", ["notes.txt", "__2024_results.csv"])
def test_a_checkpoint_folder_holding_a_file_of_the_users_is_not_replaced(saved, name):
    """Also one named like a shard: only DCP's whole names (__N_I.distcp) go without the manifest's listing (a save
    over a checkpoint deleted __2024_results.csv of the user's)."""
    path, a, _ = saved
    (path / name).write_text("kept")
    model, opt = model_and_optimizer(2)
    with pytest.raises(AutoparError, match=rf"\({name}\)"):
        autopar.save(model, opt, path)
    assert (path / name).read_text() == "kept" and _same(_loaded(path)[0], a)


@pytest.mark.parametrize("where", ["cwd", "home", "root"])
def test_the_current_directory_home_and_root_are_never_replaced_even_empty(tmp_path, monkeypatch, where):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(tmp_path if where != "cwd" else empty)
    monkeypatch.setenv("HOME", str(empty if where == "home" else tmp_path / "elsewhere"))
    target = {"cwd": ".", "home": str(empty), "root": "/"}[where]
    what = {"cwd": "the current directory", "home": "your home folder", "root": "the root of the file system"}
    model, opt = model_and_optimizer(1)
    with pytest.raises(AutoparError, match=f"is {what[where]}: autopar.save never replaces it"):
        autopar.save(model, opt, target)
    assert list(empty.iterdir()) == []


def test_an_empty_folder_and_an_autopar_checkpoint_are_replaced(tmp_path, saved):
    empty = tmp_path / "new"
    empty.mkdir()
    model, opt = model_and_optimizer(2)
    autopar.save(model, opt, empty)
    path, _, b = saved
    autopar.save(model, opt, path)
    assert _same(_loaded(empty)[0], b) and _same(_loaded(path)[0], b)


def test_a_save_through_a_symlink_writes_into_the_folder_it_points_to_and_keeps_the_link(saved, tmp_path):
    path, _, b = saved
    link = tmp_path / "latest"
    link.symlink_to(path, target_is_directory=True)
    autopar.save(*model_and_optimizer(2), link)
    assert link.is_symlink() and link.resolve() == path.resolve()
    assert _same(_loaded(link)[0], b) and _same(_loaded(path)[0], b)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("stage", ["shards", "manifest"])
def test_a_save_that_runs_out_of_space_leaves_nothing_and_says_how_much_it_needed(saved, monkeypatch, stage):
    import errno

    import torch.distributed.checkpoint.filesystem as fs

    import autopar.checkpoint as ckpt

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if stage == "shards":
        monkeypatch.setattr(fs, "_write_item", full)
    else:
        monkeypatch.setattr(ckpt, "atomic_write_text", full)
    path, a, _ = saved
    model, opt = model_and_optimizer(2)
    need = sum(p.numel() * 4 for p in model.parameters()) * 3  # weights and AdamW's two moments, fp32
    with pytest.raises(AutoparError, match=r"no space left on device \(.* free on the file system of .*; this "
                                           rf"process's share of the checkpoint needs about {need / 2**20:.1f} MiB\)"):
        autopar.save(model, opt, path)
    assert sorted(p.name for p in path.parent.iterdir() if p.name.startswith(".ckpt")) == []
    monkeypatch.undo()
    assert _same(_loaded(path)[0], a)


@pytest.mark.parametrize("files", ["missing", [], "a-string", {"x": "not a digest"}])
def test_a_manifest_without_a_mapping_of_files_is_refused_as_damaged_unless_verify_is_off(saved, files):
    path, a, _ = saved
    meta = yaml.safe_load((path / "autopar.yaml").read_text())
    if files == "missing":
        del meta["files"]
    else:
        meta["files"] = files
    (path / "autopar.yaml").write_text(yaml.safe_dump(meta))
    model, opt = model_and_optimizer(99)
    with pytest.raises(AutoparError, match=r"autopar.yaml is damaged: its `files` is .*verify=False"):
        autopar.load(model, opt, path)
    autopar.load(model, opt, path, verify=False)
    assert _same(_params(model), a)


def _grouped(seed: int, order: str, lrs=(0.1, 0.2), decays=(0.0, 0.5)):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    groups = {"a": {"params": list(model[0].parameters()), "lr": lrs[0], "weight_decay": decays[0]},
              "b": {"params": list(model[1].parameters()), "lr": lrs[1], "weight_decay": decays[1]}}
    opt = torch.optim.AdamW([groups[k] for k in order])
    model(torch.randn(2, 8)).square().sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def test_parameter_groups_built_in_another_order_get_their_own_settings_back(tmp_path):
    """They were restored by position: each group got the other's lr and weight decay."""
    model, opt = _grouped(1, "ab")
    autopar.save(model, opt, tmp_path / "ck")
    model2, opt2 = _grouped(2, "ba", lrs=(9.0, 9.0), decays=(9.0, 9.0))
    autopar.load(model2, opt2, tmp_path / "ck")
    first, second = opt2.param_groups  # built b, a
    assert (first["lr"], first["weight_decay"]) == (0.2, 0.5) and (second["lr"], second["weight_decay"]) == (0.1, 0.0)
    assert first["params"][0] is model2[1].weight and second["params"][0] is model2[0].weight
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(opt.state[p]["exp_avg"], opt2.state[q]["exp_avg"])


def test_parameter_groups_that_hold_other_parameters_than_the_saved_ones_are_refused(tmp_path):
    model, opt = _grouped(1, "ab")
    autopar.save(model, opt, tmp_path / "ck")
    torch.manual_seed(3)
    model2 = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    mixed = torch.optim.AdamW([{"params": [model2[0].weight, model2[1].weight]},
                               {"params": [model2[0].bias, model2[1].bias]}])
    with pytest.raises(AutoparError, match="parameter group 0 matches no saved group"):
        autopar.load(model2, mixed, tmp_path / "ck")


class _TwoHeads(torch.nn.Module):
    """A trunk and two heads; the batch says which head its loss uses (head b unused until a batch asks for it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3), torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, head: str) -> torch.Tensor:
        return getattr(self, head)(torch.relu(self.trunk(x))).square().mean()


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, heads: str, first: int = 0) -> list[float]:
    losses = []
    for i, head in enumerate(heads, start=first):
        loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(i)), head)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_parameter_the_optimizer_never_stepped_loads_without_state_and_resumes_as_one_run(tmp_path):
    """Head b had no AdamW state when saved: loading made state for it (torch's get_state_dict) and looked for it in
    the checkpoint, so the checkpoint could not be loaded; now head b gets no state, as it had."""
    straight = _TwoHeads()
    straight_opt = torch.optim.AdamW(straight.parameters(), lr=1e-2)
    _steps(straight, straight_opt, "aab")
    model = _TwoHeads()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _steps(model, opt, "aa")
    autopar.save(model, opt, tmp_path / "ck")
    resumed = _TwoHeads()
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    autopar.load(resumed, resumed_opt, tmp_path / "ck")
    assert resumed.b.weight not in resumed_opt.state and resumed.a.weight in resumed_opt.state
    _steps(resumed, resumed_opt, "b", first=2)
    for p, q in zip(resumed.parameters(), straight.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_a_save_before_the_first_step_changes_nothing_and_loads_as_never_stepped(tmp_path):
    """torch's get_state_dict stepped a fresh optimizer once (lr 0) to make its state: AdamW's count was 1 before
    the first real step, and the run's losses changed (9e-3 over 4 steps)."""
    plain = _TwoHeads()
    want = _steps(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), "aaa")
    model = _TwoHeads()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    autopar.save(model, opt, tmp_path / "ck")
    assert not opt.state
    assert _steps(model, opt, "aaa") == want
    resumed = _TwoHeads()
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    autopar.load(resumed, resumed_opt, tmp_path / "ck")
    assert not resumed_opt.state
    assert _steps(resumed, resumed_opt, "aaa") == want


def test_an_optimizer_with_another_number_of_groups_is_told_so(tmp_path):
    model, opt = _grouped(1, "ab")
    autopar.save(model, opt, tmp_path / "ck")
    torch.manual_seed(3)
    model2 = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    with pytest.raises(AutoparError, match="has 2 optimizer parameter groups and this optimizer 1"):
        autopar.load(model2, torch.optim.AdamW(model2.parameters()), tmp_path / "ck")
