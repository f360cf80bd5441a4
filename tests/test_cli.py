"""Tests of the `autopar` command run in-process (`autopar.cli.main([...])`): `autopar plan` on a built-in
spec, a Hugging Face config.json and a module:factory, its table, JSON and YAML, the plain-loop option,
and the errors a user meets; the usage text."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from autopar.cli import main
from autopar.models.gpt import GPT, GPTConfig
from autopar.plans import Plan
from autopar.profile import model_fingerprint
from autopar.topology import Topology

FACTORY = textwrap.dedent("""
    import torch
    from autopar.models.gpt import GPT, GPTConfig

    CFG = GPTConfig(vocab_size=256, seq_len=64, num_layers=4, hidden_dim=64, num_heads=4)

    def build():
        return GPT(CFG), torch.randint(0, 256, (2, 64))

    def model_only():
        return GPT(CFG)

    def huge():
        # 3 x 40G parameters: no plan on one GPU holds it, even with CPU offload
        return torch.nn.Sequential(*[torch.nn.Linear(200_000, 200_000) for _ in range(3)]), torch.randn(1, 200_000)

    def broken():
        raise RuntimeError("no weights here")
""")


@pytest.fixture
def factory(tmp_path, monkeypatch):
    (tmp_path / "tiny_factory_mod.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "tiny_factory_mod"


@pytest.fixture(autouse=True)
def _no_progress_lines(monkeypatch):
    """autopar plan's progress lines (a step past 2 s) go to the autopar logger, whose stderr handler was made
    under an earlier test's capture: these tests check stdout and errors, and the progress test turns them on."""
    import autopar._util.progress as progress

    monkeypatch.setattr(progress, "AFTER_S", 1e9)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_usage_lists_every_command(capsys):
    code, out, _ = _run(capsys, "--help")
    assert code == 0 and "autopar {demo,topology,plan,tune,report}" in out and "plan       rank the plans" in out
    code, _, err = _run(capsys, "frobnicate")
    assert code == 2 and err.count("\n") == 1 and "unknown command 'frobnicate'" in err
    assert "the commands are demo, topology, plan, tune, report" in err


def test_spec_on_a_cluster_prints_the_table_and_writes_a_plan(capsys, tmp_path):
    out_file = tmp_path / "plan.yaml"
    code, out, err = _run(capsys, "plan", "gpt2", "--cluster", "8xH100-SXM", "--seq", "256", "--global-batch", "32",
                          "--plain-loop", "--top", "3", "--out", str(out_file))
    assert code == 0, err
    topo = Topology.from_spec("8xH100-SXM")
    assert f"autopar topology {topo.fingerprint()}" in out
    assert "model gpt2: GPT-2 small, 124M" in out and "12 x Block" in out
    assert "32 samples x 256 tokens = 8,192 tokens per step, over 8 GPUs" in out
    assert "traced at depths 2 and 3" in out and "extended to 12 blocks" in out
    header = next(line for line in out.splitlines() if line.startswith("rank"))
    for column in ("plan", "memory/GPU", "step", "tokens/s", "MFU"):
        assert column in header
    rows = [line for line in out.splitlines() if line[:4].strip().isdigit()]
    # a plain loop on 8 GPUs: FSDP 8 or replication 8, each eager or compiled
    assert [r.split()[0] for r in rows] == ["1", "2", "3"]
    assert {r.split()[1] for r in rows} <= {"fsdp8", "rep8"}
    assert "dropped:" in out and "dominated" in out
    assert f"wrote {out_file}" in out and "autopar.wrap(model, sample=batch, plan=" in out
    plan = Plan.load(out_file)
    assert plan.world_size == 8 and plan.global_batch_size == 32 and plan.precision == "bf16"
    assert plan.topology_fingerprint == topo.fingerprint()
    # made from an extrapolated profile: no model fingerprint, so wrap accepts it for any GPT of this shape
    assert plan.model_fingerprint is None
    with torch.device("meta"):
        real = GPT(GPTConfig(vocab_size=50304, seq_len=1024, num_layers=12, hidden_dim=768, num_heads=12))
    Plan.load(out_file, model_fingerprint=model_fingerprint(real), world_size=8)
    assert plan.prediction["step_s"] > 0 and plan.prediction["memory_bytes"] <= 0.95 * topo.device.memory_bytes


def test_plain_loop_yields_no_accumulation_and_no_pipeline(capsys, factory):
    code, out, err = _run(capsys, "plan", f"{factory}:build", "--cluster", "2x4xH100-SXM", "--global-batch", "64",
                          "--plain-loop", "--top", "1000", "--json", "--out", "-")
    assert code == 0, err
    data = json.loads(out)
    assert data["allow_train_step"] is False and data["ranked"]
    assert all(r["plan"]["grad_accum"] == 1 and r["plan"]["pp"] == 1 for r in data["ranked"])
    assert data["chosen"]["grad_accum"] == 1 and data["out"] is None
    assert data["feasible"] == len(data["ranked"]) and data["candidates"] >= data["feasible"]
    assert sum(d["count"] for d in data["dropped"]) == data["candidates"] - data["feasible"]
    assert data["model"]["fingerprint"] is not None and data["topology"]["world_size"] == 8


def test_module_factory_keeps_the_model_fingerprint(capsys, factory, tmp_path):
    out_file = tmp_path / "p.yaml"
    code, out, err = _run(capsys, "plan", f"{factory}:build", "--cluster", "2xH100-SXM", "--out", str(out_file))
    assert code == 0, err
    assert "model tiny_factory_mod:build: GPT from tiny_factory_mod:build()" in out
    assert "traced at full depth" in out
    assert "4 samples x 64 tokens" in out  # default global batch: the sample's 2 x 2 GPUs
    plan = Plan.load(out_file)
    cfg = GPTConfig(vocab_size=256, seq_len=64, num_layers=4, hidden_dim=64, num_heads=4)
    assert plan.model_fingerprint == model_fingerprint(GPT(cfg))  # the traced model is the model itself


def test_module_factory_without_a_sample_needs_seq(capsys, factory):
    code, _, err = _run(capsys, "plan", f"{factory}:model_only", "--cluster", "H100-SXM", "--out", "-")
    assert code == 2 and "pass --seq N" in err
    code, out, err = _run(capsys, "plan", f"{factory}:model_only", "--cluster", "H100-SXM", "--seq", "32",
                          "--out", "-")
    assert code == 0, err
    assert "1 samples x 32 tokens" in out and "schema_version: 1" in out  # --out - prints the YAML


def test_module_factory_errors(capsys, factory):
    code, _, err = _run(capsys, "plan", f"{factory}:broken", "--cluster", "H100-SXM")
    assert code == 2 and "tiny_factory_mod:broken() failed under torch.device('meta')" in err
    code, _, err = _run(capsys, "plan", f"{factory}:missing", "--cluster", "H100-SXM")
    assert code == 2 and "has no callable 'missing'" in err
    code, _, err = _run(capsys, "plan", "no_such_module_xyz:build", "--cluster", "H100-SXM")
    assert code == 2 and "cannot import 'no_such_module_xyz'" in err


def test_hf_config_file(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.GPT2Config(n_embd=64, n_layer=4, n_head=4, vocab_size=1000, n_positions=128,
                            bos_token_id=0, eos_token_id=0).save_pretrained(tmp_path / "cfg")
    out_file = tmp_path / "p.yaml"
    # on CPU processes only the fp32 trace is needed (no bf16): the quickest way through a config
    code, out, err = _run(capsys, "plan", str(tmp_path / "cfg" / "config.json"), "--cluster", "1xcpu",
                          "--global-batch", "8", "--plain-loop", "--out", str(out_file))
    assert code == 0, err
    assert "Hugging Face gpt2" in out and "4 x GPT2Block" in out and "extended to 4 blocks" in out
    assert "8 samples x 128 tokens" in out  # the config's 128 positions
    plan = Plan.load(out_file)
    assert plan.model_fingerprint is None and plan.global_batch_size == 8
    # the written plan is what wrap takes for the real model
    import autopar

    cfg = transformers.GPT2Config.from_pretrained(tmp_path / "cfg")
    ids = torch.randint(0, 1000, (8, 128))
    model = autopar.wrap(transformers.GPT2LMHeadModel(cfg), sample={"input_ids": ids, "labels": ids},
                         plan=str(out_file), topology="1xcpu", verbose=False)
    assert autopar.plan_of(model).key() == plan.key()
    model(input_ids=ids, labels=ids).loss.backward()
    # the folder works too, and a longer sequence than the positions is refused
    code, _, err = _run(capsys, "plan", str(tmp_path / "cfg"), "--cluster", "1xcpu", "--seq", "256")
    assert code == 2 and "takes at most 128 tokens" in err


def test_specs_have_the_published_sizes():
    from autopar.named_models import SPECS, known_specs

    assert known_specs() == ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "llama-1b", "llama3-8b", "llama3-70b",
                             "llama3-405b")
    billions = {name: round(spec.config().num_params / 1e9, 2) for name, spec in SPECS.items()}
    assert billions == {"gpt2": 0.12, "gpt2-medium": 0.35, "gpt2-large": 0.77, "gpt2-xl": 1.56, "llama-1b": 1.1,
                        "llama3-8b": 8.03, "llama3-70b": 70.55, "llama3-405b": 405.85}  # Llama 3: 8.03B, 70.6B, 406B
    with torch.device("meta"):
        model = SPECS["llama3-405b"].build()  # no memory: shapes only
    assert sum(p.numel() for p in model.parameters()) == SPECS["llama3-405b"].config().num_params


def test_unknown_spec_lists_the_known_ones(capsys):
    code, out, err = _run(capsys, "plan", "llama5-1t", "--cluster", "8xH100-SXM")
    assert code == 2 and out == ""
    assert "unknown model 'llama5-1t'" in err
    for name in ("gpt2", "gpt2-xl", "llama-1b", "llama3-8b", "llama3-70b", "llama3-405b"):
        assert name in err
    code, _, err = _run(capsys, "plan", "missing/config.json", "--cluster", "8xH100-SXM")
    assert code == 2 and "no Hugging Face config at missing/config.json" in err


def test_bad_cluster_batch_and_sequence(capsys, factory):
    code, _, err = _run(capsys, "plan", "gpt2", "--cluster", "8xV100")
    assert code == 2 and "'V100' is not a known GPU" in err
    code, _, err = _run(capsys, "plan", "gpt2", "--cluster", "8xH100-SXM", "--seq", "2048")
    assert code == 2 and "takes at most 1024 tokens" in err and "--seq 1024" in err
    # a plain loop is pure data parallelism: the batch must split over all 8 GPUs
    code, _, err = _run(capsys, "plan", f"{factory}:build", "--cluster", "8xH100-SXM", "--global-batch", "3",
                        "--plain-loop")
    assert code == 2 and "splits over none of the data-parallel degrees" in err and "(8)" in err
    assert "drop --loop plain: pipelines and tensor parallelism leave fewer data-parallel ranks" in err
    assert "drop --loop plain" in err
    code, _, err = _run(capsys, "plan", f"{factory}:build", "--cluster", "8xH100-SXM", "--tokens-per-step", "100")
    assert code == 2 and "not a whole number of 64-token samples" in err
    with pytest.raises(SystemExit):  # argparse: one of the two batch options
        main(["plan", "gpt2", "--global-batch", "8", "--tokens-per-step", "8192"])
    capsys.readouterr()


def test_nothing_fits_says_what_would_help(capsys, factory):
    code, out, err = _run(capsys, "plan", f"{factory}:huge", "--cluster", "H100-SXM")
    assert code == 2 and out == ""
    assert "no plan for tiny_factory_mod:huge fits 1 x H100-SXM" in err
    assert "The smallest" in err and "needs" in err
    assert "What would help: more GPUs" in err


def test_verify_runs_the_exact_memory_check_on_the_best_plans(capsys, factory):
    code, out, err = _run(capsys, "plan", f"{factory}:build", "--cluster", "2xH100-SXM", "--verify", "1", "--out", "-")
    assert code == 0, err
    section = out.split("exact memory check")[1].split("chosen (rank 1):")[0]
    rows = [line for line in section.splitlines()[1:] if line.strip()]
    assert len(rows) == 1 and rows[0].strip().startswith("fits")
    number, unit = rows[0].split(" traced")[0].split()[-2:]
    assert float(number) > 0 and unit in ("MiB", "GiB")
    assert "upper bound for this compiled plan" in rows[0]  # planned for GPUs: compiled, traced eager


def test_python_dash_m_autopar_is_the_autopar_command():
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "autopar", "--help"], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: autopar {demo,topology,plan,tune,report}")
    bad = subprocess.run([sys.executable, "-m", "autopar", "nosuchcommand"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert bad.returncode == 2


def test_plan_out_never_overwrites_a_file_that_is_not_a_plan_nor_writes_into_a_folder(capsys, tmp_path, factory):
    """`autopar plan --out FILE` once turned a user's train.py into plan YAML (issue 11, item 3)."""
    script = tmp_path / "train.py"
    script.write_text("print('train')\n")
    args = ("plan", f"{factory}:build", "--cluster", "1xH100-SXM", "--global-batch", "2", "--top", "1")
    code, _, err = _run(capsys, *args, "--out", str(script))
    assert code == 2 and "--out" in err and "not an autopar plan file" in err and len(err.strip().splitlines()) == 1
    assert script.read_text() == "print('train')\n"
    code, _, err = _run(capsys, *args, "--out", str(tmp_path))
    assert code == 2 and "is a folder" in err
    code, _, err = _run(capsys, *args, "--out", str(tmp_path / "new") + "/")
    assert code == 2 and "is a folder" in err and not (tmp_path / "new").exists()
    plan_file = tmp_path / "plan.yaml"
    for _ in range(2):  # a plan file is replaced by the new plan
        code, _, err = _run(capsys, *args, "--out", str(plan_file))
        assert code == 0, err
    assert Plan.load(plan_file).world_size == 1


def test_demo_refuses_nproc_0_rather_than_reading_it_as_the_default(capsys):
    from autopar.demo import main as demo_main

    with pytest.raises(SystemExit) as exit_:
        demo_main(["--nproc", "0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert "argument --nproc: must be at least 1, got 0; leave it out for the default" in err


def test_nothing_fits_names_host_memory_when_offload_fits_the_gpus_and_a_topology_file_gives_more(capsys, tmp_path):
    code, out, err = _run(capsys, "plan", "llama3-405b", "--cluster", "8xH100-SXM", "--out", "-")
    err = "".join(line for line in err.splitlines(keepends=True) if not line.startswith("[autopar] "))  # progress
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "CPU offload fits the GPUs, but the smallest offload plan" in err
    assert "GiB of host memory per node, and a node has 2,048 GiB" in err and "host_memory_bytes" in err
    code, out, err = _run(capsys, "topology", "--cluster", "8xH100-SXM", "--yaml")
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(out.replace("host_memory_bytes: 2199023255552", f"host_memory_bytes: {8 * 2**40}"))
    code, out, err = _run(capsys, "plan", "llama3-405b", "--cluster", str(cluster), "--out", str(tmp_path / "p.yaml"))
    assert code == 0 and "host memory   8,192 GiB per node" in out
    assert Plan.load(tmp_path / "p.yaml").cpu_offload


# ---- issue 34: the first hour of a new user (one-line errors, --version, Ctrl-C) -------------------------------
def test_version_comes_from_the_package_metadata(capsys):
    from importlib import metadata

    (dist,) = set(metadata.packages_distributions()["autopar"])  # pyproject.toml's name, spelt nowhere else
    code, out, err = _run(capsys, "--version")
    assert code == 0 and err == "" and out == f"autopar {metadata.version(dist)}\n"
    assert _run(capsys, "-V")[1] == out


def test_the_usage_in_docs_cli_md_is_the_usage_printed():
    from pathlib import Path

    from autopar.cli import USAGE

    doc = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    assert f"```\n{USAGE}\n```" in doc


def test_a_misspelt_command_is_one_line_with_the_closest_command(capsys):
    code, out, err = _run(capsys, "plna", "gpt2")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "unknown command 'plna' (did you mean 'plan'?)" in err
    code, _, err = _run(capsys, "--verison")
    assert code == 2 and err.count("\n") == 1 and "unknown option '--verison'" in err


@pytest.mark.parametrize("argv", [["topology", "--bogus"], ["plan", "gpt2", "--top", "x"], ["plan"],
                                  ["tune", "--trials", "many", "--", "python", "t.py"], ["tune"], ["report"],
                                  ["demo", "--steps", "0"], ["demo", "--size", "huge"]])
def test_every_command_refuses_bad_arguments_in_one_line_with_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"autopar {argv[0]}: error: "), err
    assert err.rstrip().endswith(f"(autopar {argv[0]} --help lists the options)")


def test_report_out_on_an_existing_file_is_one_line_not_a_traceback(capsys, tmp_path):
    existing = tmp_path / "charts.png"
    existing.write_text("x")
    with pytest.raises(SystemExit) as exit_:
        main(["report", str(tmp_path / "study.db"), "--out", str(existing)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "is a file; --out takes the folder" in err
    assert existing.read_text() == "x"


def test_ctrl_c_during_plan_verify_is_one_line_and_exit_130(capsys, monkeypatch):
    import autopar.cli as cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "candidates", interrupted)  # Ctrl-C while the plans are ranked and verified
    code, out, err = _run(capsys, "plan", "gpt2", "--cluster", "8xH100-SXM", "--verify", "2", "--out", "-")
    assert code == 130 and out == ""
    assert err.strip() == "autopar plan: interrupted (Ctrl-C)." and "Traceback" not in err


def test_plan_shows_the_cached_entry_for_the_job_with_its_source(capsys, factory):
    """Issue 34, item 7: a plan an ordinary run cached is shown as a measured run's, a study's as a study's."""
    import autopar.cli as cli
    from autopar.plan_cache import SOURCE_RUN, SOURCE_TUNER, cache_key, store

    argv = ["plan", f"{factory}:build", "--cluster", "1xH100-SXM", "--global-batch", "2", "--loop", "accumulates",
            "--out", "-"]
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    assert "cached for this model and job" not in out
    run = cli._run_plan(cli._plan_args(argv[1:]))
    key = cache_key(run.profile, run.topology, global_batch_size=2, loop="accumulates")
    for source in (f"{SOURCE_RUN} (the Hugging Face Trainer)", SOURCE_TUNER):
        path = store(run.best, key, measurement={"tokens_per_s": 1000.0, "source": source})
        code, out, err = _run(capsys, *argv)
        assert code == 0, err
        line = next(line for line in out.splitlines() if line.startswith("cached for this model and job"))
        assert f"from {source} (" in line and line.endswith(str(path)) and "tuned" not in line
        code, out, _ = _run(capsys, *argv, "--json")
        assert json.loads(out)["cached"]["source"] == source


def test_plan_verify_says_what_it_does_for_any_step_past_the_threshold(capsys, monkeypatch, factory):
    """Issue 34, item 4: `autopar plan --verify` was silent for 25 s and more; each step past 2 s (here 0.05 s)
    now says what it does on stderr while it runs, and its time at the end; stdout keeps the table."""
    import logging
    import time

    import autopar._util.progress as progress
    import autopar.cli as cli
    from autopar._util.log import get_logger

    monkeypatch.setattr(progress, "AFTER_S", 0.05)
    real = cli.verify_candidates

    def slow(*args, **kwargs):
        time.sleep(0.3)
        return real(*args, **kwargs)

    monkeypatch.setattr(cli, "verify_candidates", slow)
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep()
    get_logger().addHandler(handler)
    try:
        code, out, err = _run(capsys, "plan", f"{factory}:build", "--cluster", "2xH100-SXM", "--verify", "1",
                              "--out", "-")
    finally:
        get_logger().removeHandler(handler)
    assert code == 0, err
    checking = [line for line in seen if line.startswith("checking the 1 best plan(s) with the exact memory check")]
    assert checking[0].endswith(" s so far)") and "done in" in checking[-1]
    assert "exact memory check (allocated peak" in out and "[autopar]" not in out


def test_tune_passes_its_prune_factor_and_0_measures_every_plan_asked(capsys, monkeypatch):
    """--prune-factor F goes to the study (0: none pruned, so --trials plans are measured); below 1 is refused in
    one line (it would skip plans as fast as the best)."""
    import math

    import autopar.cli as cli

    seen = []

    class Report:
        best = None

        def table(self):
            return "table"

    monkeypatch.setattr(cli, "tune", lambda command, **kw: seen.append(kw["prune_factor"]) or Report())
    for argv, expected in ((["tune", "--", "python", "t.py"], cli.PRUNE_FACTOR),
                           (["tune", "--prune-factor", "0", "--", "python", "t.py"], math.inf),
                           (["tune", "--prune-factor", "3", "--", "python", "t.py"], 3.0)):
        assert _run(capsys, *argv)[0] == 1  # no best plan from the stand-in study
        assert seen.pop() == expected
    code, out, err = _run(capsys, "tune", "--prune-factor", "0.5", "--", "python", "t.py")
    assert code == 2 and out == "" and err.count("\n") == 1 and "--prune-factor must be 0" in err
    assert seen == []
