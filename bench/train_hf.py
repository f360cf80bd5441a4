"""A user's training script, as `autopar tune` runs it: a Hugging Face causal LM (the GPT-2-355M or Llama-1B
shape of bench/_common.py, random init) trained on random tokens with autopar.wrap, autopar.train_step
and autopar.dataloader. Nothing in it knows about tuning: under `autopar tune` each run applies the trial's
plan in `wrap` and ends itself after the timed steps.

    python -m bench.train_hf --model gpt2-355m --global-batch 32 [--steps 1000]
    autopar tune --trials 4 -- python -m bench.train_hf --model llama-1b --global-batch 16
"""

from __future__ import annotations

import argparse

import torch

import autopar
from bench._common import MODELS, build


class RandomTokens(torch.utils.data.Dataset):
    """`length` samples of `seq` random token ids (inputs and labels), the same for every run."""

    def __init__(self, length: int, seq: int, vocab: int) -> None:
        self.data = torch.randint(0, vocab, (length, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt2-355m")
    ap.add_argument("--global-batch", type=int, default=None, help="default: the model's in bench._common.MODELS")
    ap.add_argument("--steps", type=int, default=1000)
    args = ap.parse_args()
    global_batch, seq = MODELS[args.model]
    global_batch = args.global_batch or global_batch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = build(args.model)
    data = RandomTokens(global_batch * 4, seq, 30000)
    model = autopar.wrap(model, sample=torch.utils.data.default_collate([data[0]]), global_batch_size=global_batch,
                         loop="train_step")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    step = autopar.train_step(model, opt)
    done = 0
    while done < args.steps:
        for batch in autopar.dataloader(model, data):
            loss = step({k: v.to(device, non_blocking=True) for k, v in batch.items()})
            done += 1
            if done % 50 == 0:
                print(f"step {done} loss {loss.item():.4f}", flush=True)
            if done >= args.steps:
                break


if __name__ == "__main__":
    main()
