"""`autopar demo`: the embedded default job.

A built-in GPT trains on a synthetic corpus under the plan autopar chooses: 2 processes on CPU (gloo),
or one process per GPU. Rank 0 prints the topology, the model profile, the plan, the loss of every
step and the throughput. Run directly it launches itself under torchrun; under torchrun it is one rank.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import autopar
from autopar._util.args import ArgumentParser, at_least_1
from autopar._util.dist import close_process_group, end_rank_process
from autopar.models.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens
from autopar.profile import model_fingerprint

#: Model sizes: a tiny one for CPUs (the demo finishes in well under 2 minutes on 2 cores) and a
#: GPT-2-small shape for GPUs.
SIZES = {
    "tiny": dict(vocab_size=512, seq_len=128, num_layers=4, hidden_dim=128, num_heads=4),
    "gpt2-small": dict(vocab_size=50304, seq_len=1024, num_layers=12, hidden_dim=768, num_heads=12),
}


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="autopar demo", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=at_least_1(), default=20, help="optimizer steps (default 20)")
    p.add_argument("--nproc", type=at_least_1("; leave it out for the default (every GPU here, or 2 processes on "
                                              "a CPU)"),  # (0 once meant the default, silently)
                   default=None, help="processes to launch (default: one per GPU, or 2 on CPU)")
    p.add_argument("--size", choices=sorted(SIZES), default=None,
                   help="model size (default: tiny on CPU, gpt2-small on GPUs)")
    p.add_argument("--batch", type=at_least_1(" (samples per process)"), default=None,
                   help="samples per process per step (default 8)")
    p.add_argument("--plan", default=None, help="apply this plan YAML instead of choosing one")
    return p


def _check_plan(p: argparse.ArgumentParser, args: argparse.Namespace, nproc: int) -> None:
    """Read --plan before any process starts: a missing, empty or garbled file, a plan for another number of
    processes or another model is refused with argparse's one line (exit 2), not by every rank's traceback."""
    if args.plan is None:
        return
    with torch.device("meta"):  # the demo's model, without memory: its fingerprint only
        fingerprint = model_fingerprint(GPT(GPTConfig(**SIZES[_size(args)])))
    try:
        autopar.Plan.load(args.plan, model_fingerprint=fingerprint, world_size=nproc)
    except autopar.AutoparError as exc:
        p.error(f"--plan {args.plan}: {exc}")


def _launch(args: argparse.Namespace, nproc: int) -> int:
    """Start the demo under torchrun with `nproc` processes; returns its exit code."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "autopar.demo", "--steps", str(args.steps)]
    for flag in ("size", "batch", "plan"):
        if getattr(args, flag) is not None:
            cmd += [f"--{flag}", str(getattr(args, flag))]
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // nproc)))
    return subprocess.call(cmd, env=env)


def _size(args: argparse.Namespace) -> str:
    return args.size or ("gpt2-small" if torch.cuda.is_available() else "tiny")


def _rank_main(args: argparse.Namespace) -> None:
    """One rank: train, then close torch.distributed in order (a barrier, then destroy_process_group). A rank
    launched by torchrun then leaves through end_rank_process (see __main__ below and its docstring)."""
    _train(args)
    close_process_group()


def _train(args: argparse.Namespace) -> None:
    on_gpu = torch.cuda.is_available()
    size = _size(args)
    cfg = GPTConfig(**SIZES[size])
    batch = args.batch or 8
    topology = autopar.Topology.detect()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"autopar demo: GPT '{size}' on {world} process(es), {batch} samples of {cfg.seq_len} tokens per process")
    say(topology.describe(), flush=True)

    torch.manual_seed(0)
    model = GPT(cfg)
    sample = synthetic_tokens(batch, cfg)
    model = autopar.wrap(model, sample=sample, topology=topology, plan=args.plan,
                         loss_fn=lm_loss)
    plan, shard = autopar.plan_of(model), autopar.data_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=on_gpu or None)
    device = autopar.applied(model).device
    tokens_per_step = plan.global_batch_size * cfg.seq_len

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    warmup = min(2, max(args.steps - 1, 0))
    losses, t_start = [], None
    for step in range(args.steps):
        if step == warmup:
            sync()
            t_start = time.perf_counter()
        rows = synthetic_tokens(plan.global_batch_size, cfg, step=step, seed=1)
        n = plan.global_batch_size // shard.size
        x = rows[shard.rank * n:(shard.rank + 1) * n].to(device)
        loss = lm_loss(model(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach()
        if dist.is_initialized():
            dist.all_reduce(mean)
            mean = mean / dist.get_world_size()
        losses.append(mean.item())
        say(f"step {step + 1:3d}/{args.steps}  loss {losses[-1]:.4f}", flush=True)
    sync()
    timed = args.steps - warmup
    if t_start is not None and timed > 0:
        elapsed = time.perf_counter() - t_start
        tokens_per_s = tokens_per_step * timed / elapsed
        line = f"throughput: {tokens_per_s:,.0f} tokens/s over {timed} steps ({elapsed / timed * 1e3:.1f} ms/step)"
        profile = autopar.applied(model).profile
        if on_gpu:
            flops_per_token = profile.model_flops() / profile.tokens_per_step
            peak = topology.device.peak_flops(plan.precision) * world
            line += f", MFU {flops_per_token * tokens_per_s / peak:.1%} of {plan.precision} peak"
        say(line)
    say(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "no steps run", flush=True)


def _default_nproc() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if "LOCAL_RANK" in os.environ:  # one rank under torchrun (checked by the launcher already)
        _rank_main(args)
        return 0
    nproc = args.nproc or _default_nproc()
    _check_plan(parser, args, nproc)
    if nproc == 1:
        _rank_main(args)
        return 0
    return _launch(args, nproc)


if __name__ == "__main__":
    status = main()
    if "LOCAL_RANK" in os.environ:  # a rank under torchrun: no interpreter finalization with gloo threads alive
        end_rank_process(status)
    sys.exit(status)
