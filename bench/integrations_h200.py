"""Issue 12's GPU must-show: each example script (examples/lightning_gpt.py, examples/hf_trainer.py) runs, and the
tokens/s its framework logs is within 5% of `autopar.wrap` on the same model and plan in a plain loop.

For each example and round: the example runs as a user runs it (a subprocess; the first round lets autopar choose
the plan and writes it with --plan-out, later rounds pass it back with --plan), then the same model, data, plan
and optimizer run under `wrap` in a plain PyTorch loop (a subprocess of this script, `--loop`), timed as the
integrations time a run (autopar.integrations._measure.StepTimer: the mean of the steps after the warm-up, the
device synchronised at both ends). Rounds alternate which of the two runs first (the GPU machine's host speed
drifts). One JSON line per run, and a summary line per example with the ratio of the medians.

    python -m bench.integrations_h200 --out $OUT/integrations.jsonl              # on the H200
    python -m bench.integrations_h200 --out /tmp/i.jsonl --device cpu --rounds 1 # a smoke run on a CPU

The plain loop is the user's loop without the framework: forward, loss, backward, the framework's optimizer
(Lightning: the module's AdamW; HF: the optimizer the Trainer builds from its arguments), zero_grad. It does
not clip gradients or step a learning-rate schedule, which the Trainer does: that is the framework's cost. For
the HF example a third run, `loop_like_trainer`, adds what the Trainer does by default each step (clipping the
gradients' norm to 1.0, `max_grad_norm`, and testing the loss for nan/inf on the host, `logging_nan_inf_filter`, a
device synchronisation): the summary's `ratio_like_trainer` says how much of the gap those two are (issue 12: the
Trainer at 0.93x the plain loop on the H200, 2026-12-02).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import autopar
from autopar.integrations._measure import MeasureOptions, StepTimer
from bench._common import ROOT

EXAMPLES = ROOT / "examples"


@dataclasses.dataclass(frozen=True)
class Setting:
    """What both runs of one example share: the example's own arguments for the model, batch and steps."""

    example: str  # "lightning" or "hf"
    args: tuple[str, ...]
    warmup_steps: int
    steps: int  # measured steps


def settings(device: str, measure_steps: int) -> list[Setting]:
    warm = 3
    if device == "cpu":  # tiny models, seconds
        return [Setting("lightning", ("--size", "tiny", "--batch-size", "8", "--accelerator", "cpu"), warm, 4),
                Setting("hf", ("--size", "tiny", "--seq", "64", "--global-batch", "8"), warm, 4)]
    return [Setting("lightning", ("--size", "gpt2-medium", "--batch-size", "8", "--accelerator", "gpu",
                                  "--precision", "bf16-mixed"), warm, measure_steps),
            Setting("hf", ("--size", "1b", "--seq", "1024", "--vocab", "32000", "--global-batch", "8"),
                    warm, measure_steps)]


def _example_command(s: Setting, plan: Path, record: Path, *, choose: bool) -> list[str]:
    script = EXAMPLES / ("lightning_gpt.py" if s.example == "lightning" else "hf_trainer.py")
    cmd = [sys.executable, str(script), *s.args, "--record", str(record)]
    cmd += ["--plan-out", str(plan)] if choose else ["--plan", str(plan)]
    if s.example == "lightning":
        cmd += ["--warmup", str(s.warmup_steps), "--measure-steps", str(s.steps),
                "--steps", str(s.warmup_steps + s.steps + 1)]
    else:  # AutoparCallback(warmup_steps=3) measures every step after its warm-up
        cmd += ["--steps", str(s.warmup_steps + s.steps)]
    return cmd


def _run(cmd: list[str], timeout_s: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "wall_s": round(time.perf_counter() - t0, 1)}
    out = {"status": "ok" if done.returncode == 0 else "error", "rc": done.returncode,
           "wall_s": round(time.perf_counter() - t0, 1)}
    if done.returncode != 0:
        out["tail"] = (done.stdout + done.stderr)[-1500:]
    return out


def run_pair(s: Setting, work: Path, round_index: int, timeout_s: float) -> list[dict[str, Any]]:
    plan = work / f"{s.example}_plan.yaml"
    choose = not plan.exists()
    order: tuple[str, ...] = ("example", "loop") if round_index % 2 == 0 else ("loop", "example")
    if choose:
        order = ("example", "loop")  # the example chooses the plan the loop then runs
    if s.example == "hf":
        order = (*order, "loop_like_trainer")
    records = []
    for kind in order:
        record = work / f"{s.example}_{kind}_{round_index}.json"
        if kind == "example":
            cmd = _example_command(s, plan, record, choose=choose)
        else:
            cmd = [sys.executable, "-m", "bench.integrations_h200", "--loop", s.example, "--plan", str(plan),
                   "--record", str(record), "--loop-args", json.dumps(list(s.args)),
                   "--warmup", str(s.warmup_steps), "--measure-steps", str(s.steps)]
            if kind == "loop_like_trainer":
                cmd.append("--like-trainer")
        rec: dict[str, Any] = {"example": s.example, "run": kind, "round": round_index, "command": " ".join(cmd),
                               **_run(cmd, timeout_s)}
        if record.exists():
            rec.update(json.loads(record.read_text()))
        records.append(rec)
    return records


# ---- the plain loop under wrap (a subprocess: `--loop lightning|hf`) ----------------------------------------
def _load_example(name: str) -> Any:
    path = EXAMPLES / ("lightning_gpt.py" if name == "lightning" else "hf_trainer.py")
    spec = importlib.util.spec_from_file_location(f"_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _example_args(name: str, argv: list[str]) -> tuple[Any, argparse.Namespace]:
    """The example's own parser over the shared arguments (its defaults for the rest)."""
    module = _load_example(name)
    saved = sys.argv
    try:
        sys.argv = [name, *argv]
        if name == "lightning":
            return module, module.parse()
        return module, _hf_parse(argv)
    finally:
        sys.argv = saved


def _hf_parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="tiny")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--global-batch", type=int, default=8)
    return p.parse_known_args(argv)[0]


def _lightning_job(module: Any, a: argparse.Namespace, device: torch.device) -> tuple[Any, Any, Any, Any]:
    layers, hidden, heads, seq, vocab = module.SIZES[a.size]
    cfg = module.GPTConfig(vocab_size=vocab, seq_len=seq, num_layers=layers, hidden_dim=hidden, num_heads=heads)
    torch.manual_seed(0)
    lm = module.GPTModule(cfg, a.lr)
    data = module.synthetic_tokens(a.batch_size * 64, cfg, seed=1)
    loader = torch.utils.data.DataLoader(data, batch_size=a.batch_size, drop_last=True)
    # the LightningModule itself is what the strategy plans (its fingerprint is the plan's); forward calls the GPT
    return lm, loader, module.lm_loss, lambda model: torch.optim.AdamW(model.parameters(), lr=a.lr)


def _hf_job(module: Any, a: argparse.Namespace, device: torch.device) -> tuple[Any, Any, Any, Any]:
    from transformers import Trainer, TrainingArguments  # the HF example's packages (an optional extra)

    hidden, layers, heads, kv, ffn = module.SIZES[a.size]
    cfg = module.LlamaConfig(vocab_size=a.vocab, hidden_size=hidden, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=ffn,
                             max_position_embeddings=a.seq)
    torch.manual_seed(0)
    model = module.LlamaForCausalLM(cfg)
    data = module.RandomTokens(a.global_batch * 64, a.seq, a.vocab)
    loader = torch.utils.data.DataLoader(data, batch_size=a.global_batch, drop_last=True)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="autopar-bench-"), learning_rate=3e-4,
                             report_to=[], use_cpu=device.type == "cpu")

    def optimizer(m: torch.nn.Module) -> torch.optim.Optimizer:
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, m)
        return cls([p for p in m.parameters() if p.requires_grad], **kwargs)

    return model, loader, None, optimizer


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, dict):
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    return batch.to(device, non_blocking=True)


def loop(name: str, plan_path: str, record: str, argv: list[str], warmup: int, steps: int, *,
         like_trainer: bool = False) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    module, a = _example_args(name, argv)
    model, loader, loss_fn, make_optimizer = (_lightning_job if name == "lightning" else _hf_job)(module, a, device)
    batches = iter(loader)
    sample = next(batches)
    autopar.wrap(model, sample=sample, plan=plan_path, loss_fn=loss_fn, verbose=False)
    opt = make_optimizer(model)
    timer = StepTimer(MeasureOptions(warmup_steps=warmup, steps=steps, feed_back=False))
    timer.start()
    step_s = None
    for _ in range(warmup + steps):
        batch = _to(next(batches), device)
        out = model(**batch) if isinstance(batch, dict) else model(batch)
        loss = out.loss if loss_fn is None else loss_fn(out, batch)
        loss.backward()
        if like_trainer:  # the Trainer's defaults: max_grad_norm=1.0, logging_nan_inf_filter=True
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            bool(torch.isnan(loss) or torch.isinf(loss))
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_s = timer.step_done() or step_s
    plan = autopar.plan_of(model)
    rows = (sample["input_ids"] if isinstance(sample, dict) else sample).shape
    measured = {"steps": steps, "step_s": step_s, "samples_per_s": rows[0] / step_s,
                "tokens_per_s": rows[0] * rows[1] / step_s,
                "peak_memory_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
                "optimizer": type(opt).__name__, "loss": float(loss)}
    Path(record).write_text(json.dumps({"plan": plan.to_dict(), "measured": measured}, indent=1))


# ---- the comparison -------------------------------------------------------------------------------------------
def summarise(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for example in sorted({r["example"] for r in records}):
        rates = {kind: [r["measured"]["tokens_per_s"] for r in records
                        if r["example"] == example and r["run"] == kind and r.get("measured")]
                 for kind in ("example", "loop", "loop_like_trainer")}
        row: dict[str, Any] = {"example": example, "summary": True, "example_tokens_per_s": rates["example"],
                               "loop_tokens_per_s": rates["loop"]}
        if rates["example"] and rates["loop"]:
            ratio = statistics.median(rates["example"]) / statistics.median(rates["loop"])
            row.update(ratio=round(ratio, 4), within_5pct=ratio >= 0.95)
        if rates["example"] and rates["loop_like_trainer"]:
            row.update(loop_like_trainer_tokens_per_s=rates["loop_like_trainer"],
                       ratio_like_trainer=round(statistics.median(rates["example"])
                                                / statistics.median(rates["loop_like_trainer"]), 4))
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.integrations_h200", description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="JSON lines: one per run, then one summary per example")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--examples", default="lightning,hf")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--measure-steps", type=int, default=20)
    ap.add_argument("--timeout-s", type=float, default=240.0, help="per run")
    ap.add_argument("--loop", choices=("lightning", "hf"), help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    ap.add_argument("--record", help=argparse.SUPPRESS)
    ap.add_argument("--loop-args", default="[]", help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, default=3, help=argparse.SUPPRESS)
    ap.add_argument("--like-trainer", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.loop:
        loop(args.loop, args.plan, args.record, json.loads(args.loop_args), args.warmup, args.measure_steps,
             like_trainer=args.like_trainer)
        return 0
    if not args.out:
        ap.error("--out is required")
    env = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "command": "python -m bench.integrations_h200 " + " ".join(argv if argv is not None else sys.argv[1:])}
    work = Path(tempfile.mkdtemp(prefix="autopar-integrations-"))
    chosen = [s for s in settings(args.device, args.measure_steps) if s.example in args.examples.split(",")]
    records: list[dict[str, Any]] = []
    with open(args.out, "w") as f:
        for round_index in range(args.rounds):
            for s in chosen:
                for rec in run_pair(s, work, round_index, args.timeout_s):
                    rec.update(env)
                    records.append(rec)
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
                    m = rec.get("measured") or {}
                    print(f"{s.example} {rec['run']} round {round_index}: {rec['status']} "
                          f"{m.get('tokens_per_s') or 0:,.0f} tokens/s, wall {rec['wall_s']} s", flush=True)
                    if rec["status"] != "ok":
                        print(rec.get("tail", ""), flush=True)
        for row in summarise(records):
            row.update(env)
            f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
