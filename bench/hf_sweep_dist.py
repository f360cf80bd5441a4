"""hf-sweep on several processes: every architecture of `hf-sweep`'s tasks at its small size, wrapped with a
multi-rank plan (FSDP over every rank, replication, tensor parallelism) on CPU processes talking gloo, launched by
torchrun as a user's job is, trained 2 AdamW steps and compared with one plain process on the global batch
(issue 33: "plan any model, never raise", and train it right under the plans a cluster runs).

Per (architecture, plan) one `torchrun --standalone` launch of `--world-size` processes. Every rank builds the
model (seeded: the same weights everywhere) and trains a deep copy of it plainly on the global batch (the
reference), then wraps the model with the plan and trains it on its own share of the batch (a data-parallel
rank's rows; every tensor-parallel rank the whole batch). Dropout is off on both (eval mode: dropout's masks
differ between one process's batch and its shards; BatchNorm then uses its running statistics in both). Rank 0
compares with the reference: each step's loss (the data-parallel ranks' mean), the first step's gradients tensor by
tensor, and the final parameters together (gathered whole), fp32, relative 1e-5 or 10 times what the same training
in one process with the batch in the ranks' shares, accumulated, differs by (`_compare` says why).

Statuses: `ok`; `mismatch` (it trained, not as one process: the largest errors recorded); `refused` (autopar
refused the plan with a typed error: its one line recorded, not a failure of the run); `autopar_failed` (wrap or
the wrapped step raised otherwise); `model_failed` / `build_failed` (not autopar's: the plain model did not
build or train); `timeout` / `crashed`.

    python -m bench hf-sweep-dist --from bench/results/hf_sweep_2026-12-07.jsonl --plans fsdp,tp --out FILE
    python -m bench hf-sweep-dist --report FILE
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._common import results_path, stamp
from bench.hf_sweep import BATCH, TASKS, architectures, build, make_sample, where

STEPS = 2
LR = 1e-3
#: AdamW's eps: 1e-6, not torch's 1e-8. AdamW divides each element's step by its gradient's size, so an element whose
#: gradient is rounding noise (a router's, an unused position's, a key bias's: 1e-10 and less) moves by lr in a
#: direction the noise picks, and the final parameters then differ by far more than the gradients did (deepseek_v4's
#: hyper-connection weights: gradients equal to 2e-7, parameters apart by 4e-4 after two steps). With eps 1e-6 a
#: noise gradient moves its element by lr x 1e-4 at most, and every gradient above 1e-5 still steps by about lr.
EPS = 1e-6
#: How many times the reordered reference's own difference a wrapped run may differ by (`_compare`).
NOISE = 10.0
RTOL = 1e-5
PLANS = ("fsdp", "replicate", "tp")


def plan_for(kind: str, world_size: int) -> dict[str, int]:
    """The Plan's fields of a plan kind over `world_size` ranks, each data-parallel rank given BATCH samples."""
    if kind == "fsdp":
        return {"dp_shard": world_size, "micro_batch_size": BATCH}
    if kind == "replicate":
        return {"dp_replicate": world_size, "micro_batch_size": BATCH}
    if kind == "tp":
        return {"tp": world_size, "micro_batch_size": BATCH}
    raise ValueError(f"unknown plan kind {kind!r}: one of {', '.join(PLANS)}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)}")
    p.add_argument("--archs", default=None, help="comma-separated architectures (default: every one of the task)")
    p.add_argument("--from", dest="source", nargs="+", default=None,
                   help="hf-sweep results files: only the architectures recorded `ok` (a later file's record wins)")
    p.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated, of {', '.join(PLANS)}")
    p.add_argument("--skip-ok", default=None,
                   help="an hf-sweep-dist results file: its runs recorded ok are not run again (a resumed sweep)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--arch-timeout-s", type=float, default=180.0, help="a launch is killed after this")
    p.add_argument("--out", default=None, help="the JSON-lines file (default: $OUT/hf_sweep_dist.jsonl)")
    p.add_argument("--report", default=None, help="print the Markdown table of a results file and exit")
    p.add_argument("--trial-only", action="store_true",
                   help="run autopar's tensor-parallel trial of each plan (autopar.strategies.tensor_parallel_trial) "
                        "instead of training: does it pass what trains, and refuse what raises?")
    p.add_argument("--rank-child", nargs=4, default=None, metavar=("TASK", "ARCH", "PLAN", "OUT"),
                   help=argparse.SUPPRESS)
    return p


#: Set by --trial-only for the ranks: each runs autopar's tensor-parallel trial of the plan and records its verdict.
TRIAL_ONLY_ENV = "AUTOPAR_SWEEP_TRIAL_ONLY"


def local_of(batches: list[dict[str, Any]], dp: int, rank: int) -> list[dict[str, Any]]:
    """This rank's batches: a data-parallel rank's rows, every tensor-parallel rank the whole batch."""
    data_rank = rank if dp > 1 else 0
    return [_rows(b, data_rank * BATCH, (data_rank + 1) * BATCH) if dp > 1 else b for b in batches]


def _trial(model: Any, local: list[dict[str, Any]], fields: dict[str, int]) -> tuple[str, dict[str, Any]]:
    """autopar.strategies.tensor_parallel_trial of the plan on this model (every rank; rank 0 records): status
    trial_passed, trial_refused (its line), refused (the layout's checks, before the trial) or autopar_failed."""
    import torch

    import autopar
    from autopar.errors import AutoparError
    from autopar.profile import profile_model
    from autopar.strategies.apply import check_plan
    from autopar.strategies.mesh import build_mesh
    from autopar.strategies.tensor_parallel_trial import tensor_parallel_trial
    from autopar.topology import Topology

    plan = autopar.Plan(**fields)
    try:
        profile = profile_model(model, local[0], warn=False)
        check_plan(plan, profile, Topology.cpu(plan.world_size), world_size=plan.world_size, model=model)
    except AutoparError as exc:
        return "refused", {"error": _error(exc)}
    except Exception as exc:
        return "autopar_failed", {"stage": "profile", "error": _error(exc)}
    why = tensor_parallel_trial(model, local[0], plan, profile, build_mesh(plan, "cpu")["tp"],
                                device=torch.device("cpu"))
    return ("trial_passed", {}) if why is None else ("trial_refused", {"error": why})


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"


def _train(model: Any, batches: list[dict[str, Any]], shards: int = 1) -> tuple[list[float], dict[str, Any]]:
    """STEPS AdamW steps (eps EPS; built here, after any wrap), one batch a step, each batch's loss the mean of its
    `shards` equal parts' (each part's backward of its share, as data-parallel ranks sum theirs): each step's loss,
    and the first step's gradients (whole tensors, gathered from the ranks that shard them)."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, foreach=False)
    losses: list[float] = []
    first: dict[str, Any] = {}
    for batch in batches:
        size = len(next(iter(batch.values())))
        total = 0.0
        for i in range(shards):
            loss = model(**_rows(batch, i * size // shards, (i + 1) * size // shards)).loss / shards
            loss.backward()
            total += float(loss)
        if not losses:
            for name, p in model.named_parameters():
                if p.grad is not None:
                    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    first[name] = g.detach().double().cpu()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, first


def _rows(batch: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
    return {k: v[start:stop] for k, v in batch.items()}


def _full_params(model: Any) -> dict[str, Any]:
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().double().cpu()
    return out


@dataclass(frozen=True)
class Run:
    """One training's figures: each step's loss, the first step's gradients, the final parameters."""

    losses: list[float]
    grads: dict[str, Any]
    params: dict[str, Any]


def _rel(a: Any, b: Any) -> float:
    return float((a - b).norm()) / max(float(b.norm()), 1e-30)


def _compare(run: Run, ref: Run, reordered: Run) -> dict[str, Any]:
    """How far `run` is from `ref` (one process, the global batch at once), against how far `reordered` is (one
    process, the same batch in the data-parallel ranks' shares, accumulated: the same sums in another order, which
    is what data and tensor parallelism change). Each step's loss, each gradient tensor and the final parameters
    together are within RTOL of the reference's size, or within NOISE times the reordering's own difference: a
    gradient that is rounding noise (a key projection's bias under softmax) differs that much between any two
    orders of one sum, and AdamW moves its elements by about lr whichever sign the noise takes. A gradient tensor
    may also differ by its elements' share of RTOL of the whole gradient (RTOL x |whole| x sqrt(its elements /
    all elements): a noise gradient whose two orders happen to agree closely sets no bound of its own)."""
    if set(run.params) != set(ref.params) or set(run.grads) != set(ref.grads):
        return {"same": False, "why": "the parameters (or those with gradients) differ under autopar: "
                f"{sorted((set(run.params) ^ set(ref.params)) | (set(run.grads) ^ set(ref.grads)))[:4]}"}
    import torch

    def vec(d: dict[str, Any]) -> Any:
        return torch.cat([d[n].flatten() for n in sorted(d)])

    def loss_vec(r: Run) -> Any:
        return torch.tensor(r.losses, dtype=torch.float64)

    out: dict[str, Any] = {"loss_rel": _rel(loss_vec(run), loss_vec(ref)),
                           "params_rel": _rel(vec(run.params), vec(ref.params)),
                           "reordered_loss_rel": _rel(loss_vec(reordered), loss_vec(ref)),
                           "reordered_params_rel": _rel(vec(reordered.params), vec(ref.params))}
    same = all(out[k] <= max(RTOL, NOISE * out[f"reordered_{k}"]) for k in ("loss_rel", "params_rel"))
    worst_name, worst = "", 0.0
    whole, elements = float(vec(ref.grads).norm()), sum(g.numel() for g in ref.grads.values())
    for n, g in ref.grads.items():  # the error over what this tensor may differ by: RTOL of its own size, NOISE
        # times the reordering's difference, or its elements' share of RTOL of the whole gradient's size
        share = RTOL * whole * (g.numel() / elements) ** 0.5
        bound = max(RTOL * float(g.norm()), NOISE * float((reordered.grads[n] - g).norm()), share, 1e-30)
        ratio = float((run.grads[n] - g).norm()) / bound
        if ratio > worst:
            worst_name, worst = n, ratio
    out.update(worst_grad=worst_name, worst_grad_over_bound=worst, same=same and worst <= 1.0)
    return out


def rank_main(task: str, arch: str, kind: str, out: str) -> None:
    """One rank of a launch (torchrun's environment); rank 0 writes the record to `out`."""
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    rec: dict[str, Any] = {"task": task, "arch": arch, "plan_kind": kind, "world_size": world}

    def done(status: str, **fields: Any) -> None:
        if rank == 0:
            Path(out).write_text(json.dumps({**rec, "status": status, **fields}))

    try:
        model = build(task, arch)
        model.eval()  # dropout off (its masks differ between a batch and its shards)
        fields = plan_for(kind, world)
        dp = fields.get("dp_shard", 1) * fields.get("dp_replicate", 1)
        torch.manual_seed(1)
        batches = [make_sample(task, model, batch=BATCH * dp) for _ in range(STEPS)]
    except Exception as exc:
        return done("build_failed", error=_error(exc))
    if os.environ.get(TRIAL_ONLY_ENV) == "1":  # --trial-only: the tensor-parallel trial alone, nothing trained
        status, fields = _trial(model, local_of(batches, dp, rank), fields)
        return done(status, **fields)
    try:
        runs = []
        for shards in (1, max(dp, 2)):  # the global batch at once; in the ranks' shares (or halves), accumulated
            reference = copy.deepcopy(model)
            losses, grads = _train(reference, batches, shards)
            runs.append(Run(losses, grads, _full_params(reference)))
            del reference
        ref, reordered = runs
    except Exception as exc:
        return done("model_failed", error=_error(exc))
    import autopar
    from autopar.errors import AutoparError

    local = local_of(batches, dp, rank)
    stage = "wrap"
    try:
        t0 = time.perf_counter()
        wrapped = autopar.wrap(model, sample=local[0], plan=autopar.Plan(**fields), verbose=False)
        wrapped.eval()
        rec["wrap_s"] = round(time.perf_counter() - t0, 2)
        # what the plan split: parameters sharded on some mesh dimension (FSDP's dim 0, TP's rows or columns)
        rec.update(params=sum(1 for _ in wrapped.parameters()),
                   sharded_params=sum(any(type(pl).__name__ == "Shard" for pl in getattr(q, "placements", ()))
                                      for q in wrapped.parameters()))
        stage = "train"
        losses, grads = _train(wrapped, local)
        if dp > 1:  # each data-parallel rank's mean over its rows: the global batch's mean is their mean
            t = torch.tensor(losses, dtype=torch.float64)
            dist.all_reduce(t)
            losses = (t / dp).tolist()
        params = _full_params(wrapped)
    except AutoparError as exc:
        return done("refused" if stage == "wrap" else "autopar_failed", stage=stage, error=_error(exc),
                    error_type=type(exc).__name__)
    except Exception as exc:
        return done("autopar_failed", stage=stage, error=_error(exc), where=where())
    result = _compare(Run(losses, grads, params), ref, reordered)
    rec.update(losses=losses, ref_losses=ref.losses, **{k: v for k, v in result.items() if k != "same"})
    done("ok" if result["same"] else "mismatch")
    dist.destroy_process_group()


def launch(task: str, arch: str, kind: str, world_size: int, timeout_s: float, *,
           trial_only: bool = False) -> dict[str, Any]:
    """One torchrun launch of `world_size` ranks; the record rank 0 wrote, or what went wrong."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rec.json"
        env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", AUTOPAR_CACHE_DIR=str(Path(tmp) / "c"),
                   **{TRIAL_ONLY_ENV: "1" if trial_only else "0"})
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
               "-m", "bench.hf_sweep_dist", "--rank-child", task, arch, kind, str(out)]
        start = time.perf_counter()
        base = {"task": task, "arch": arch, "plan_kind": kind, "world_size": world_size}
        try:
            proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True,
                                  text=True, timeout=timeout_s, start_new_session=True)
        except subprocess.TimeoutExpired:
            return {**base, "status": "timeout", "error": f"killed at {timeout_s:.0f} s"}
        if out.exists():
            return {**json.loads(out.read_text()), "wall_s": round(time.perf_counter() - start, 1)}
        return {**base, "status": "crashed", "rc": proc.returncode, "error": proc.stderr.strip()[-400:]}


def _latest(paths: list[str], *fields: str) -> dict[tuple, dict[str, Any]]:
    """The records of JSON-lines files by the values of `fields`, a later record superseding an earlier one."""
    out: dict[tuple, dict[str, Any]] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            out[tuple(r[f] for f in fields)] = r
    return out


def _jobs(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(task, architecture, plan kind), one plan kind after another (a run cut short has covered the first)."""
    wanted = None
    if args.source:
        wanted = {key for key, r in _latest(args.source, "task", "arch").items() if r.get("status") == "ok"}
    done = set()
    if args.skip_ok and Path(args.skip_ok).exists():
        done = {key for key, r in _latest([args.skip_ok], "task", "arch", "plan_kind").items()
                if r.get("status") == "ok"}
    archs = None if args.archs is None else set(args.archs.split(","))
    return [(task, arch, kind) for kind in args.plans.split(",") for task in args.tasks.split(",")
            for arch in architectures(task)
            if (wanted is None or (task, arch) in wanted) and (archs is None or arch in archs)
            and (task, arch, kind) not in done]


NOT_AUTOPARS = ("build_failed", "model_failed")
STATUSES = ("ok", "refused", "mismatch", "autopar_failed", "timeout", "crashed", "trial_passed", "trial_refused",
            *NOT_AUTOPARS)


def report(path: str) -> str:
    """The Markdown table: statuses per plan kind, then every row that is not ok and not the model's own."""
    rows = _latest([path], "task", "arch", "plan_kind")
    first = next(iter(rows.values()), {})
    commits = collections.Counter(str(r.get("commit", "?"))[:7] for r in rows.values())
    commands = collections.Counter(str(r.get("command", "?")) for r in rows.values())
    # the trial's statuses (--trial-only) where a record has one
    shown = [s for s in STATUSES if not s.startswith("trial_") or any(r["status"] == s for r in rows.values())]
    out = [f"# hf-sweep-dist: {len(rows)} runs, {first.get('world_size')} gloo ranks, {first.get('date', '?')[:10]}",
           "", f"{first.get('device', '?')}, torch {first.get('torch', '?')}, transformers "
           f"{first.get('transformers', '?')}; the latest record of each run, by the code that made it: "
           + ", ".join(f"{c} ({n})" for c, n in commits.most_common()) + "; commands: "
           + "; ".join(f"`{c}` ({n})" for c, n in commands.most_common()), "",
           "| plan | " + " | ".join(shown) + " |", "| --- |" + " ---: |" * len(shown)]
    counts = collections.Counter((r["plan_kind"], r["status"]) for r in rows.values())
    for kind in dict.fromkeys(r["plan_kind"] for r in rows.values()):
        out.append(f"| {kind} | " + " | ".join(str(counts[(kind, s)]) for s in shown) + " |")
    out += ["", "| task | arch | plan | status | what |", "| --- | --- | --- | --- | --- |"]
    for (task, arch, kind), r in sorted(rows.items()):
        if r["status"] in ("ok", *NOT_AUTOPARS):
            continue
        if r["status"] == "mismatch":
            what = (f"loss rel {r.get('loss_rel', 0):.1e} (reordered {r.get('reordered_loss_rel', 0):.1e}), params "
                    f"rel {r.get('params_rel', 0):.1e} (reordered {r.get('reordered_params_rel', 0):.1e}), worst "
                    f"gradient {r.get('worst_grad')} {r.get('worst_grad_over_bound', 0):.1f}x its bound"
                    + (f"; {r['why']}" if r.get("why") else ""))
        else:
            what = f"{r.get('stage', '')} {r.get('error', '')}".strip()[:220]
        out.append(f"| {task} | {arch} | {kind} | {r['status']} | {what.replace('|', '/')} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.report:
        print(report(args.report))
        return 0
    if args.rank_child:
        rank_main(*args.rank_child)
        return 0
    given = sys.argv[1:] if argv is None else list(argv)
    out = results_path(args.out, "hf_sweep_dist.jsonl")
    head = stamp(" ".join(["python -m bench hf-sweep-dist", *given]))
    with open(out, "a") as f:
        for task, arch, kind in _jobs(args):
            rec = {**launch(task, arch, kind, args.world_size, args.arch_timeout_s, trial_only=args.trial_only),
                   **head}
            f.write(json.dumps(rec) + "\n")
            f.flush()
            print(f"{task} {arch} {kind}: {rec['status']} {rec.get('error', '')[:120]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
