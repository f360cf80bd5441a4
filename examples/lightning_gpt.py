"""Train autopar's built-in GPT with Lightning, the parallelism planned and applied by autopar.

    python examples/lightning_gpt.py                                   # tiny GPT, one CPU process
    python examples/lightning_gpt.py --devices 2                        # 2 CPU processes (Lightning launches them)
    python examples/lightning_gpt.py --accelerator gpu --devices 8 --size gpt2-medium --precision bf16-mixed \\
        --batch-size 8 --steps 100                                      # a realistic size on 8 GPUs
    python examples/lightning_gpt.py --devices 2 --train-step           # let autopar choose TP / PP / accumulation too

Rank 0 logs autopar's plan, then, after `--warmup` steps, the measured step time, tokens/s, MFU and peak memory
beside the plan's prediction ("[autopar] measured over ..."), and prints the measured tokens/s at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

import lightning as L
import torch

import autopar
from autopar.integrations.lightning import AutoparStrategy, MeasureOptions
from autopar.models.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens

#: --size: (layers, hidden, heads, sequence, vocabulary)
SIZES = {
    "tiny": (4, 128, 4, 128, 512),            # 0.9 M parameters: seconds a step on a CPU
    "gpt2-small": (12, 768, 12, 1024, 50304),  # 124 M
    "gpt2-medium": (24, 1024, 16, 1024, 50304),  # 355 M
    "gpt2-large": (36, 1280, 20, 1024, 50304),  # 774 M
}


class GPTModule(L.LightningModule):
    """A LightningModule as a user writes one: nothing in it knows about autopar."""

    def __init__(self, cfg: GPTConfig, lr: float) -> None:
        super().__init__()
        self.model = GPT(cfg)
        self.lr = lr

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = lm_loss(self(batch), batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--accelerator", default="cpu", help="cpu (default) or gpu")
    p.add_argument("--devices", type=int, default=1, help="processes (Lightning launches them, or use torchrun)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per data-parallel rank and step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="steps before the measured ones")
    p.add_argument("--measure-steps", type=int, default=10)
    p.add_argument("--precision", default="32-true", help="32-true or bf16-mixed (the plan's precision)")
    p.add_argument("--plan", default=None, help="a plan YAML file (autopar plan --out, or autopar tune --plan-out)")
    p.add_argument("--train-step", action="store_true",
                   help="run the plan through autopar.train_step, so autopar may choose TP, PP and accumulation")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--plan-out", default=None, help="write the plan the run used to this YAML file")
    p.add_argument("--record", default=None, help="write the plan and the measurement to this JSON file")
    return p.parse_args()


def main() -> None:
    args = parse()
    layers, hidden, heads, seq, vocab = SIZES[args.size]
    cfg = GPTConfig(vocab_size=vocab, seq_len=seq, num_layers=layers, hidden_dim=hidden, num_heads=heads)
    torch.manual_seed(0)  # every rank builds the same initial weights (autopar also broadcasts them)
    module = GPTModule(cfg, args.lr)
    samples = args.batch_size * args.devices * (args.steps + 1)
    data = synthetic_tokens(samples, cfg, seed=1)  # every rank holds the same dataset; the sampler splits it
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, drop_last=True)
    strategy = AutoparStrategy(loss_fn=lm_loss, plan=args.plan, train_step=args.train_step,
                               measure=MeasureOptions(warmup_steps=args.warmup, steps=args.measure_steps))
    trainer = L.Trainer(strategy=strategy, accelerator=args.accelerator, devices=args.devices,
                        precision=args.precision, max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    if trainer.global_rank == 0:
        print(autopar.plan_of(module).describe())
        measured = strategy.measurement
        if measured is None:
            print(f"not measured: give --steps more than --warmup + --measure-steps ({args.warmup + args.measure_steps})")
        else:
            m = measured.measured
            rate = f"{m.tokens_per_s:,.0f} tokens/s" if m.tokens_per_s is not None else f"{m.samples_per_s:,.1f} samples/s"
            print(f"measured: {rate}, {m.step_s * 1e3:,.1f} ms/step, MFU {m.mfu:.1%}")
        write_outputs(autopar.plan_of(module), None if measured is None else measured.measured, args)


def write_outputs(plan: autopar.Plan, measured: object, args: argparse.Namespace) -> None:
    """--plan-out: the plan as YAML; --record: the plan and the measurement (StepMeasurement's fields) as JSON."""
    if args.plan_out:
        plan.save(args.plan_out)
    if args.record:
        record = {"plan": plan.to_dict(), "measured": None if measured is None else dataclasses.asdict(measured)}
        pathlib.Path(args.record).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
