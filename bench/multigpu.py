"""Issue 15: autopar's multi-GPU plans on one host of several GPUs: parity with one GPU, predicted against measured.

    torchrun --standalone --nproc_per_node N -m bench.multigpu --out $OUT/multigpu.jsonl [--scenarios a,b]
    torchrun --standalone --nproc_per_node 8 -m bench.multigpu --size llama3-8b --out $OUT/multigpu_8b.jsonl
    torchrun --standalone --nproc_per_node 2 -m bench.multigpu --device cpu --size tiny --out /tmp/m.jsonl  # gloo
    python -m bench multigpu --report FILE.jsonl [FILE.jsonl ...]                                # the table

One process a GPU (NCCL), or a CPU rank (gloo: the smoke test); unchanged on 2, 4 or 8 GPUs (scenarios() makes
each plan for the world size). For each scenario: a Llama-shaped model (autopar.models.llama, seeded alike on
every rank) wrapped with the scenario's plan (bf16; "wrap": the plan wrap chooses), `--steps` steps on the
global batch (each data-parallel rank its rows; through autopar.train_step where the plan needs it), then
`--timed-steps` more, timed. Before the scenarios rank 0 trains a plain-PyTorch copy on the full batch (bf16
autocast over fp32 weights, AdamW): the one-GPU reference (not at --size llama3-8b, which one GPU cannot hold).
One JSON line a scenario, as it ends: its losses and the reference's and their largest relative difference
(parity at bf16: every loss within PARITY_REL), the measured step (the slowest rank's) and tokens/s a GPU, each
rank's peak (CUDA's max_memory_reserved + the CUDA context), autopar.predict's step and peak for the plan on
this machine, the plan, date, device, torch and command.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import autopar
from autopar.models.llama import Llama, LlamaConfig, lm_loss
from autopar.planning import profile_variants, short_name
from autopar.search import enumerate_plans

#: every loss of a plan within this of the reference's (relative): bf16 compute over reduction orders that differ
#: (sharded, split by tensor parallelism, micro-batched), 10 steps of AdamW
PARITY_REL = 0.02
GiB = 2**30

# name -> (model shape, global batch): "tiny" for the CPU smoke test; "small" a Llama-shaped model one GPU trains
# at the full batch (the reference); "llama3-8b" Llama 3 8B's shape at sequence 8192, 2 samples a GPU (torchtitan's
# and Trainy's published runs: bench/paper.py)
SIZES = {
    "tiny": LlamaConfig(vocab_size=128, seq_len=32, num_layers=4, hidden_dim=64, num_heads=4, num_kv_heads=2,
                        ffn_dim=172),
    "small": LlamaConfig(vocab_size=32000, seq_len=1024, num_layers=8, hidden_dim=1024, num_heads=16, num_kv_heads=8,
                         ffn_dim=2816),
    "llama3-8b": LlamaConfig(vocab_size=128256, seq_len=8192, num_layers=32, hidden_dim=4096, num_heads=32,
                             num_kv_heads=8, ffn_dim=14336),
}
GLOBAL_BATCH = {"tiny": 8, "small": 16}  # llama3-8b: 2 a GPU
#: published tokens/s a GPU for Llama 3 8B at sequence 8192, local batch 2 (the report prints them beside a run)
PUBLISHED_8B = ("torchtitan, 8 H100 (FSDP + compile): 6,667; + Float8: 8,532 (llama3_h100_202412_torchtitan.md); "
                "Trainy, 32 H200 (FSDP + compile + Float8): 10,938 (llama3_8b_h200_2025-06_torchtitan.md)")


def scenarios(world: int, batch: int) -> dict[str, dict[str, Any] | None]:
    """The plans of this world size (bf16 added), by name; None: wrap chooses. FSDP over every rank; HSDP (2
    replicas); tensor parallel 2 with sequence parallel (x FSDP over the rest); pipelines of 2 stages under 1F1B and
    interleaved 1F1B (4 micro-batches, x FSDP over the rest), and zero-bubble on 2 (it runs with pipeline
    parallelism alone: autopar refuses it beside FSDP); on 8 or more, all three at once."""
    out: dict[str, dict[str, Any] | None] = {"fsdp": {"dp_shard": world, "micro_batch_size": batch // world}}
    if world >= 4 and world % 2 == 0:
        out["hsdp"] = {"dp_replicate": 2, "dp_shard": world // 2, "micro_batch_size": batch // world}
    if world % 2 == 0:
        dp = world // 2
        out["tp-sp"] = {"tp": 2, "dp_shard": dp, "sequence_parallel": True, "micro_batch_size": batch // dp}
        for name, schedule, per_rank in (("pp-1f1b", "1f1b", 1), ("pp-interleaved", "interleaved_1f1b", 2)):
            out[name] = {"pp": 2, "dp_shard": dp, "pp_schedule": schedule, "pp_stages_per_rank": per_rank,
                         "micro_batch_size": batch // dp // 4, "grad_accum": 4}
    if world == 2:  # zero-bubble runs with pipeline parallelism alone (autopar.layout.check_pipeline says why)
        out["pp-zero-bubble"] = {"pp": 2, "pp_schedule": "zero_bubble", "pp_stages_per_rank": 2,
                                 "micro_batch_size": batch // 4, "grad_accum": 4}
    if world >= 8 and world % 4 == 0:
        dp = world // 4
        out["pp-tp-fsdp"] = {"pp": 2, "tp": 2, "dp_shard": dp, "sequence_parallel": True, "pp_schedule": "1f1b",
                             "micro_batch_size": batch // dp // 4, "grad_accum": 4}
    out["wrap"] = None
    return out


def search_scenarios(opts: "Options", world: int) -> dict[str, dict[str, Any]]:
    """Every distinct plan shape of autopar's own candidate space at this world size (`--scenarios search`): the
    search's enumeration under autopar.train_step (every mesh, schedule, ZeRO stage, resharding and checkpointing),
    one plan per shape, eager (compile is the zoo's), by their short names; on a CPU the plans of as many H100s."""
    topology = (_this_machine() if opts.device == "cuda"
                else autopar.Topology.from_spec(f"1x{world}xH100-SXM"))
    profile, _ = _traced(opts, world, 2, topology)
    out: dict[str, dict[str, Any]] = {}
    shapes: set[tuple[Any, ...]] = set()
    for plan in enumerate_plans(profile, topology, world_size=world, global_batch_size=opts.global_batch(world),
                                loop="train_step", compile_available=False):
        shape = (plan.pp, plan.dp_replicate, plan.dp_shard, plan.tp, plan.pp_schedule, plan.pp_stages_per_rank,
                 plan.zero_stage, plan.reshard_after_forward, plan.checkpointing, plan.sequence_parallel,
                 plan.grad_accum > 1)
        if shape not in shapes:  # one plan a shape (the first micro-batch size of it)
            shapes.add(shape)
            out[short_name(plan)] = {k: v for k, v in plan.strategy().items() if k != "precision"}
    return out


@dataclass(frozen=True)
class Options:
    size: str
    device: str
    steps: int
    timed_steps: int
    lr: float
    out: Path
    command: str

    @property
    def cfg(self) -> LlamaConfig:
        return SIZES[self.size]

    def global_batch(self, world: int) -> int:
        return GLOBAL_BATCH.get(self.size, 2 * world)


def tokens(opts: Options, world: int, step: int) -> torch.Tensor:
    """The global batch of a step: the same on every rank (seeded by the step)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, opts.cfg.vocab_size, (opts.global_batch(world), opts.cfg.seq_len), generator=g)


def _loss(output: Any, x: torch.Tensor) -> torch.Tensor:
    return lm_loss(output, x)


def build(opts: Options, *, meta: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    if meta or opts.size == "llama3-8b":  # 8B: materialised by wrap, sharded, on its device
        with torch.device("meta"):
            return Llama(opts.cfg)
    return Llama(opts.cfg)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reference(opts: Options, world: int, device: torch.device) -> list[float]:
    """One device, the full batch, plain PyTorch: bf16 autocast over fp32 weights, AdamW; the losses."""
    model = build(opts).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr)
    losses = []
    for step in range(opts.steps):
        x = tokens(opts, world, step).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(x)
        loss = _loss(out, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return losses


@functools.lru_cache(maxsize=None)
def _traced(opts: Options, world: int, rows: int, topology: autopar.Topology) -> tuple[Any, Any]:
    """The model's profile and its precision variants (autopar.planning.profile_variants) from a meta trace of `rows`
    samples, for `topology`; traced once a size (the scenarios of one micro-batch share it)."""
    sample = tokens(opts, world, 0)[:rows].to("meta")
    return profile_variants(build(opts, meta=True), sample, topology, loss_fn=_loss, warn=False)


@functools.lru_cache(maxsize=None)
def _this_machine() -> autopar.Topology:
    return autopar.Topology.detect()


def predicted(opts: Options, plan: autopar.Plan, world: int) -> dict[str, Any]:
    """autopar.predict's step and peak for `plan` on this machine (from a meta trace at one micro-batch)."""
    try:
        topology = _this_machine()
        profile, variants = _traced(opts, world, plan.micro_batch_size, topology)
        pred = autopar.predict(profile, plan, topology=topology, variants=variants)
        return {"predicted_step_s": pred.step_s, "predicted_peak_bytes": pred.memory.peak_bytes}
    except Exception as exc:  # recorded beside the measurement, which still stands
        return {"predicted_error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}


def _peak_bytes(device: torch.device) -> float | None:
    """This rank's peak: CUDA's max_memory_reserved plus the context (memory in use the allocator does not hold)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return torch.cuda.max_memory_reserved(device) + (total - free - torch.cuda.memory_reserved(device))


def run_scenario(name: str, plan_kwargs: dict[str, Any] | None, opts: Options, device: torch.device,
                 ref: list[float] | None) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = opts.global_batch(world)
    plan = autopar.Plan(precision="bf16", **plan_kwargs) if plan_kwargs is not None else None
    dp = plan.dp_size if plan is not None else world
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = build(opts)
    model = autopar.wrap(model, sample=tokens(opts, world, 0)[: batch // dp], plan=plan, global_batch_size=batch,
                         loss_fn=_loss, verbose=False)
    plan = autopar.plan_of(model)
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr)
    shard = autopar.data_shard(model)
    step_fn = autopar.train_step(model, opt, _loss) if plan.needs_train_step else None

    def step(i: int) -> float:
        n = batch // shard.size
        x = tokens(opts, world, i)[shard.rank * n:(shard.rank + 1) * n].to(device)
        if step_fn is not None:
            loss = step_fn(x)
        else:
            loss = _loss(model(x), x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        mean = loss.detach().float().reshape(()).clone()
        dist.all_reduce(mean)
        return mean.item() / world

    losses = [step(i) for i in range(opts.steps)]
    _sync(device)
    t0 = time.perf_counter()
    for i in range(opts.timed_steps):
        step(opts.steps + i)
    _sync(device)
    slowest = torch.tensor([(time.perf_counter() - t0) / max(opts.timed_steps, 1)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    peaks: list[Any] = [None] * world
    dist.all_gather_object(peaks, _peak_bytes(device))
    rec: dict[str, Any] = {"scenario": name, "plan": plan.strategy(), "plan_short": short_name(plan),
                           "losses": losses, "step_s": slowest.item() if opts.timed_steps else None,
                           "peak_bytes_per_rank": peaks}
    if rec["step_s"]:
        rec["tokens_per_s_per_gpu"] = batch * opts.cfg.seq_len / rec["step_s"] / world
    if ref is not None:
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        rec.update(reference_losses=ref, max_loss_rel_diff=rel, parity_ok=rel <= PARITY_REL)
    if rank == 0:
        rec.update(predicted(opts, plan, world))
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.multigpu", description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=list(SIZES), default="small")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--scenarios", default=None, help="comma-separated, of scenarios() for this world size "
                                                      "(default: all; at --size llama3-8b: wrap), or 'search': one "
                                                      "plan of every shape autopar's search enumerates")
    ap.add_argument("--steps", type=int, default=10, help="steps compared with the reference")
    ap.add_argument("--timed-steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default=None, help="JSON lines (default: $OUT/multigpu.jsonl)")
    ap.add_argument("--report", nargs="+", type=Path, default=None, help="print the table of these files and exit")
    args = ap.parse_args(argv)
    if args.report:
        print(report([json.loads(line) for path in args.report for line in path.read_text().splitlines() if line]))
        return 0
    if "WORLD_SIZE" not in os.environ:
        raise SystemExit("launch it with torchrun, one process a GPU: torchrun --standalone --nproc_per_node N "
                         "-m bench.multigpu ...")
    out = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "multigpu.jsonl"
    command = " ".join(["torchrun -m bench.multigpu", *(sys.argv[1:] if argv is None else argv)])
    opts = Options(args.size, args.device, args.steps, args.timed_steps, args.lr, out, command)
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    all_scenarios = (search_scenarios(opts, world) if args.scenarios == "search"
                     else scenarios(world, opts.global_batch(world)))
    names = (list(all_scenarios) if args.scenarios == "search" else args.scenarios.split(",") if args.scenarios
             else ["wrap"] if args.size == "llama3-8b" else list(all_scenarios))
    unknown = [n for n in names if n not in all_scenarios]
    if unknown:
        raise SystemExit(f"no scenario {', '.join(unknown)} at world size {world}; there are {', '.join(all_scenarios)}")
    ref = None
    if args.size != "llama3-8b":
        ref = reference(opts, world, device) if rank == 0 else None
        shared: list[Any] = [ref]
        dist.broadcast_object_list(shared, src=0)
        ref = shared[0]
    env = {"world_size": world, "size": args.size, "global_batch": opts.global_batch(world),
           "seq_len": opts.cfg.seq_len, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "date": datetime.date.today().isoformat(), "command": command}
    for name in names:
        try:
            rec = {**env, **run_scenario(name, all_scenarios[name], opts, device, ref), "status": "ok"}
        except Exception as exc:  # recorded; the next scenario still runs
            rec = {**env, "scenario": name, "status": "error", "error": f"{type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc()[-2000:]}
        if rank == 0:
            out.parent.mkdir(parents=True, exist_ok=True)
            with open(out, "a") as f:
                f.write(json.dumps(rec, default=str) + "\n")
            print(brief(rec), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.destroy_process_group()
    return 0


def brief(rec: dict[str, Any]) -> str:
    parts = [f"{rec['scenario']:<16} {rec['status']:<6}", rec.get("plan_short", "")]
    if rec.get("step_s"):
        parts.append(f"step {rec['step_s'] * 1e3:.1f} ms")
    if rec.get("predicted_step_s"):
        parts.append(f"pred {rec['predicted_step_s'] * 1e3:.1f} ms")
    if "max_loss_rel_diff" in rec:
        parts.append(f"loss vs one GPU {rec['max_loss_rel_diff']:.2e}")
    if rec.get("error"):
        parts.append(rec["error"][:200])
    return "  ".join(p for p in parts if p)


def report(records: list[dict[str, Any]]) -> str:
    """The Markdown table of multigpu records: parity, step and peak, measured against predicted."""
    def num(x: float | None, fmt: str, scale: float = 1.0) -> str:
        return "-" if not x else format(x * scale, fmt)

    def err(pred: float | None, meas: float | None) -> str:
        return f"{pred / meas - 1:+.1%}" if pred and meas else "-"

    lines = ["| world | size | scenario | plan | status | loss vs one GPU | parity | step ms | pred | err | "
             "tokens/s/GPU | peak GiB (max rank) | pred | err |",
             "| ---: | --- | --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in records:
        peaks = [p for p in r.get("peak_bytes_per_rank") or [] if p]
        peak = max(peaks) if peaks else None
        parity = "-" if "parity_ok" not in r else ("ok" if r["parity_ok"] else "MISS")
        lines.append(
            f"| {r.get('world_size')} | {r.get('size')} | {r['scenario']} | {r.get('plan_short', '-')} | "
            f"{r['status']} | {num(r.get('max_loss_rel_diff'), '.2e')} | {parity} | "
            f"{num(r.get('step_s'), '.1f', 1e3)} | {num(r.get('predicted_step_s'), '.1f', 1e3)} | "
            f"{err(r.get('predicted_step_s'), r.get('step_s'))} | {num(r.get('tokens_per_s_per_gpu'), ',.0f')} | "
            f"{num(peak, '.2f', 1 / GiB)} | {num(r.get('predicted_peak_bytes'), '.2f', 1 / GiB)} | "
            f"{err(r.get('predicted_peak_bytes'), peak)} |")
    if any(r.get("size") == "llama3-8b" for r in records):
        lines += ["", f"Published for the Llama 3 8B shape (sequence 8192, 2 a GPU): {PUBLISHED_8B}."]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
