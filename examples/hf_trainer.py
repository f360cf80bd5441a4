"""The Hugging Face Trainer on a model autopar plans and shards (docs/integrations/hf.md).

A Llama built from its config (no download) trains on random tokens for a few steps; autopar chooses the
plan, the Trainer runs it, and AutoparCallback logs the measured step time and tokens/s beside the prediction.

    python examples/hf_trainer.py                                     # a tiny Llama on this CPU
    torchrun --nproc-per-node 2 examples/hf_trainer.py                # 2 CPU processes (FSDP over gloo)
    torchrun --nproc-per-node 8 examples/hf_trainer.py --size 1b --seq 2048 --global-batch 64 --steps 30
                                                                      # a 1B-parameter Llama on 8 GPUs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import autopar
from autopar.integrations.hf import AutoparCallback, prepare

SIZES = {  # hidden, layers, heads, kv heads, ffn
    "tiny": (64, 2, 4, 2, 128),
    "125m": (768, 12, 12, 4, 2048),
    "1b": (2048, 16, 32, 8, 8192),
    "8b": (4096, 32, 32, 8, 14336),
}


class RandomTokens(torch.utils.data.Dataset):
    """`rows` sequences of `seq` random tokens, their own labels (a causal LM's loss shifts them)."""

    def __init__(self, rows: int, seq: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary (default 1024; Llama 3 has 128256)")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step over all processes")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--output-dir", default=None, help="where the Trainer writes (default: a temporary folder)")
    p.add_argument("--plan", default=None, help="a plan YAML file (default: autopar chooses one)")
    p.add_argument("--plan-out", default=None, help="write the plan the run used to this YAML file")
    p.add_argument("--record", default=None, help="write the plan and the measurement to this JSON file")
    a = p.parse_args()
    hidden, layers, heads, kv, ffn = SIZES[a.size]
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=ffn, max_position_embeddings=a.seq)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if a.global_batch % world:
        p.error(f"--global-batch {a.global_batch} does not split over {world} processes")
    data = RandomTokens(a.global_batch * (a.steps + 1), a.seq, a.vocab)
    out = a.output_dir or tempfile.mkdtemp(prefix="autopar-hf-")
    args = TrainingArguments(output_dir=out, max_steps=a.steps, per_device_train_batch_size=a.global_batch // world,
                             learning_rate=3e-4, logging_steps=5, save_strategy="no", report_to=[],
                             use_cpu=not torch.cuda.is_available())
    model, args = prepare(model, args, sample=data[:a.global_batch // world], plan=a.plan)  # plan, shard, mark
    callback = AutoparCallback(warmup_steps=3)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()  # AutoparCallback logs "[autopar] measured over N steps: ... tokens/s (predicted ...)"
    if trainer.is_world_process_zero():
        plan = autopar.plan_of(model)
        print(plan.describe())
        if a.plan_out:
            plan.save(a.plan_out)
        if a.record:
            measured = None if callback.measurement is None else dataclasses.asdict(callback.measurement)
            pathlib.Path(a.record).write_text(json.dumps({"plan": plan.to_dict(), "measured": measured}, indent=1))


if __name__ == "__main__":
    main()
