"""Published multi-GPU runs predicted "on paper" (issue 13): every row of ../shared/anchors/scale_tables.md's
llm-foundry H100 BF16 table, and Megatron-LM's Table 1 (bench/megatron_table1.py's rows), each as its own plan
on its own cluster, predicted against the published throughput; and what `autopar plan`'s search finds for the
same model, cluster and global batch.

llm-foundry rows (MosaicML llm-foundry, scripts/train/benchmarking/README.md, "H100 80GB BF16"):
- the model: MPT shapes from the repository's yamls (scripts/train/yamls/pretrain/mpt-*.yaml: d_model,
  n_heads, n_layers, expansion_ratio 4, vocab 50,368), built as autopar's GPT (pre-norm blocks, GELU MLP,
  tied head, SDPA) on the meta device, traced at 2 and 3 blocks with bf16 weights (FSDP mixed precision) and
  extended to the row's depth;
- the cluster: GPUs / 8 nodes of 8 H100-SXM (the spec's defaults: NVLink 4 inside a node, 400 Gb/s a GPU
  across nodes);
- the plan: FSDP over every GPU (FULL_SHARD), the row's micro-batch and accumulation, full activation
  checkpointing where the row says AC, bf16, eager.
The table's "MP Mode" column is DEFAULT (Composer's FSDP mixed precision: parameters gathered in bf16, gradients
reduced in fp32), as autopar's FSDP2 bf16 plans do. What the plan cannot say of the run: FSDP1's flat parameters,
Composer's loop and MPT's own kernels of 2023 (bench/NOTES.md, 2026-12-05: why the rows are over-predicted).
The same README's A100 80GB table (the same software on a GPU it had matured on) is predicted too, as a check of
where the H100 rows' error lies: its rows, and for the configurations both tables ran the published H100 / A100
speed-up against the predicted one (bench/NOTES.md, 2026-12-07).

    python -m bench.paper [--out bench/results] [--no-search]

writes bench/results/paper_<date>.txt. torchtitan's Llama 3.1 8B rows on H200s (TitanRow: FSDP, compile, Float8
linears) are predicted too; its H100 rows are listed with why they are not (TORCHTITAN_NOT_EXPRESSIBLE).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import sys
import time
from dataclasses import dataclass, replace

import torch

import autopar
from autopar.cost import predict_profile
from autopar.models.gpt import GPT, GPTConfig
from autopar.plans import Loop
from autopar.profile import ModelProfile, extrapolate_profile, profile_model
from autopar.search import search
from bench._common import RESULTS, write_dated
from bench.megatron_table1 import ROWS as MEGATRON_ROWS
from bench.megatron_table1 import predict_row as megatron_row
from bench.megatron_table1 import time_parts

MPT_VOCAB = 50368
# d_model, n_heads, n_layers (llm-foundry scripts/train/yamls/pretrain/mpt-<name>.yaml)
MPT = {"70b": (8192, 64, 80), "30b": (7168, 56, 48), "13b": (5120, 40, 40), "7b": (4096, 32, 32),
       "3b": (2560, 20, 32), "1b": (2048, 16, 24), "760m": (1536, 12, 24), "350m": (1024, 16, 24),
       "125m": (768, 12, 12)}


@dataclass(frozen=True)
class FoundryRow:
    """One row of the llm-foundry H100 80GB BF16 table."""

    model: str
    seq_len: int
    num_gpus: int
    mfu_percent: float
    micro_batch_size: int
    grad_accum: int
    tokens_per_s_per_gpu: float
    checkpointing: bool
    gpu: str = "H100-SXM"
    inter_node_gbps: float | None = None  # None: the spec's default (400 Gb/s a GPU)

    @property
    def plan(self) -> autopar.Plan:
        return autopar.Plan(dp_shard=self.num_gpus, micro_batch_size=self.micro_batch_size,
                            grad_accum=self.grad_accum, checkpointing="full" if self.checkpointing else "none",
                            precision="bf16")

    @property
    def global_batch_size(self) -> int:
        return self.num_gpus * self.micro_batch_size * self.grad_accum

    @property
    def topology(self) -> autopar.Topology:
        return autopar.Topology.from_spec(f"{max(self.num_gpus // 8, 1)}x8x{self.gpu}",
                                          inter_node_gbps=self.inter_node_gbps)


FOUNDRY_H100_BF16 = [FoundryRow(*r) for r in (
    ("70b", 2048, 64, 42.57, 8, 4, 1039, True), ("70b", 2048, 32, 36.15, 2, 16, 882, True),
    ("30b", 2048, 32, 43.92, 14, 3, 2308, True), ("30b", 4096, 8, 35.86, 1, 21, 1802, True),
    ("13b", 2048, 64, 39.86, 2, 1, 4800, False), ("13b", 4096, 8, 41.60, 10, 3, 4717, True),
    ("7b", 2048, 8, 46.44, 6, 1, 10643, False), ("7b", 8192, 8, 37.14, 8, 2, 6935, True),
    ("3b", 2048, 64, 40.80, 6, 3, 22525, False), ("3b", 8192, 8, 40.31, 3, 6, 16578, False),
    ("1b", 2048, 8, 41.82, 14, 1, 45455, False), ("1b", 16384, 8, 35.22, 2, 4, 19649, False),
    ("760m", 2048, 32, 37.57, 24, 1, 67971, False), ("760m", 512, 8, 40.42, 96, 2, 83749, False),
)]

# The same README's "A100 80GB with 1600 Gbps node-node interconnect (RoCE)" table, every row: the same 2023
# software (Composer, FSDP1, MPT's kernels) on a GPU it had matured on. Not a must-show row: where the H100 rows'
# error lies (main() sets the configurations both tables ran side by side).
FOUNDRY_A100_80GB = [FoundryRow(*r, gpu="A100-SXM-80GB", inter_node_gbps=200.0) for r in (
    ("70b", 2048, 64, 53.33, 8, 4, 410, True), ("70b", 2048, 32, 48.56, 2, 16, 373, True),
    ("30b", 8192, 8, 39.38, 1, 21, 574, True), ("30b", 4096, 8, 51.37, 1, 21, 814, True),
    ("30b", 2048, 8, 55.3, 3, 21, 916, True), ("30b", 1024, 8, 55.82, 6, 21, 946, True),
    ("30b", 512, 8, 56.4, 12, 21, 967, True), ("13b", 32768, 8, 51.69, 1, 3, 1016, True),
    ("13b", 16384, 8, 54.07, 3, 3, 1431, True), ("13b", 8192, 8, 56.07, 5, 3, 1795, True),
    ("13b", 4096, 8, 57.62, 10, 3, 2060, True), ("13b", 2048, 8, 59.57, 2, 3, 2262, False),
    ("13b", 1024, 8, 59.48, 40, 3, 2330, True), ("7b", 65536, 8, 46.97, 1, 2, 1013, True),
    ("7b", 32768, 8, 49.46, 2, 2, 1672, True), ("7b", 16384, 8, 51.96, 4, 2, 2453, True),
    ("7b", 8192, 8, 54.47, 8, 2, 3206, True), ("7b", 4096, 8, 54.84, 16, 2, 3684, True),
    ("7b", 2048, 8, 64.23, 6, 2, 4641, False), ("7b", 1024, 8, 58.01, 64, 2, 4357, True),
    ("3b", 65536, 8, 46.05, 1, 2, 1767, True), ("3b", 32768, 8, 47.18, 3, 6, 3029, True),
    ("3b", 16384, 8, 57.13, 1, 6, 5529, False), ("3b", 8192, 8, 59.34, 3, 6, 7695, False),
    ("3b", 4096, 8, 60.53, 5, 6, 9457, False), ("3b", 2048, 8, 62.11, 10, 2, 10811, False),
    ("3b", 1024, 8, 62.73, 20, 6, 11580, False), ("3b", 512, 8, 63.71, 40, 6, 12127, False),
    ("1b", 65536, 8, 46.18, 1, 2, 3044, True), ("1b", 32768, 8, 55.52, 1, 4, 6275, False),
    ("1b", 16384, 8, 56.6, 2, 4, 9956, False), ("1b", 8192, 8, 56.69, 3, 4, 13814, False),
    ("1b", 4096, 8, 59.0, 7, 4, 17807, False), ("1b", 2048, 8, 59.86, 14, 4, 20513, False),
    ("1b", 1024, 8, 60.15, 18, 4, 22112, False), ("1b", 512, 8, 60.68, 56, 4, 23148, False),
    ("760m", 65536, 8, 45.34, 1, 2, 4143, True), ("760m", 32768, 8, 54.57, 1, 2, 8802, False),
    ("760m", 16384, 8, 54.64, 3, 2, 14274, False), ("760m", 8192, 8, 55.31, 6, 2, 20933, False),
    ("760m", 4096, 8, 56.05, 12, 2, 27351, False), ("760m", 2048, 8, 56.85, 24, 2, 32434, False),
    ("760m", 1024, 8, 47.76, 48, 2, 29765, False), ("760m", 512, 8, 45.07, 96, 2, 29446, False),
    ("350m", 65536, 8, 52.7, 1, 2, 7524, False), ("350m", 32768, 8, 52.46, 2, 2, 13652, False),
    ("350m", 16384, 8, 53.28, 4, 2, 23559, False), ("350m", 8192, 8, 53.8, 8, 2, 36569, False),
    ("350m", 4096, 8, 53.31, 16, 2, 49555, False), ("350m", 2048, 8, 51.62, 32, 2, 58782, False),
    ("350m", 1024, 8, 50.51, 64, 2, 64813, False), ("350m", 512, 8, 50.61, 128, 2, 69330, False),
    ("125m", 65536, 8, 54.13, 1, 2, 20368, False), ("125m", 32768, 8, 52.71, 2, 2, 36407, False),
    ("125m", 16384, 8, 50.61, 4, 2, 60040, False), ("125m", 8192, 8, 48.85, 8, 2, 90392, False),
    ("125m", 4096, 8, 46.08, 16, 2, 118396, False), ("125m", 2048, 8, 44.79, 40, 2, 142830, False),
    ("125m", 2048, 8, 44.45, 32, 2, 141737, False), ("125m", 1024, 8, 43.15, 64, 2, 156468, False),
    ("125m", 512, 8, 42.56, 128, 2, 165681, False),
)]
# inter_node_gbps 200: the table's 1600 Gb/s RoCE a node of 8 GPUs, per GPU

TORCHTITAN_NOT_EXPRESSIBLE = [
    "Llama 3.1 70B, 256 H100, FSDP 32 x TP 8, Float8 + compile: 829 tokens/s/GPU, 71.9 GiB (float8 under TP: "
    "autopar refuses it; and the GPU below)",
    "Llama 3.1 405B, 512 H100, FSDP 8 x TP 8 x PP 8, Float8 + async TP: 100 (1F1B) / 128 (interleaved) tokens/s/GPU "
    "(the same)",
    "Llama 3.1 8B, 8 / 128 H100, FSDP, selective AC, local batch 2: 5,762 / 5,605 eager, 6,667 / 6,514 compiled, "
    "8,532 / 8,380 + Float8 (llama3_h100_202412_torchtitan.md, Tables 1 and 3): its H100 is a 96 GB HBM2e part at "
    "500 W whose peak the source does not know ('between SXM and NVL'), so no spec of autopar's describes it",
]

# Llama 3.1 8B (meta-llama/Llama-3.1-8B's config.json: hidden 4096, 32 layers, 32 heads, 8 key/value heads, MLP
# 14336, vocabulary 128256, RoPE theta 500000), as transformers' LlamaForCausalLM
LLAMA31_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
                  tie_word_embeddings=False)


@dataclass(frozen=True)
class TitanRow:
    """A torchtitan run of Llama 3.1 8B on H200s (pytorch/torchtitan benchmarks/llama3_8b_h200_2025-06_torchtitan.md,
    Trainy, June 2025, torch 2.8): nodes of 8 H200 (NVLink), 400 Gb/s a GPU across nodes; the repository's
    llama3_8b.toml (seq 8192, selective activation checkpointing) with local batch 2, torch.compile, Float8 linears
    (tensorwise) with float8 all-gather; FSDP over every GPU."""

    nodes: int
    tokens_per_s_per_gpu: float
    memory_gib: float
    local_batch: int = 2
    seq_len: int = 8192

    @property
    def num_gpus(self) -> int:
        return 8 * self.nodes

    @property
    def plan(self) -> autopar.Plan:
        return autopar.Plan(dp_shard=self.num_gpus, micro_batch_size=self.local_batch, checkpointing="selective",
                            precision="bf16", compile=True, float8=True)

    @property
    def topology(self) -> autopar.Topology:
        return autopar.Topology.from_spec(f"{self.nodes}x8xH200")


TITAN_H200 = [TitanRow(4, 10938, 47.96), TitanRow(8, 10753, 46.97)]


@functools.lru_cache(maxsize=None)
def _traced(hidden: int, heads: int, blocks: int, seq_len: int) -> ModelProfile:
    cfg = GPTConfig(vocab_size=MPT_VOCAB, seq_len=seq_len, num_layers=blocks, hidden_dim=hidden, num_heads=heads)
    with torch.device("meta"):
        model = GPT(cfg)
    return profile_model(model, torch.zeros(1, seq_len, dtype=torch.long, device="meta"), warn=False,
                         precision="bf16-pure", graphs=False)


@functools.lru_cache(maxsize=None)
def _llama_traced(blocks: int, seq_len: int) -> ModelProfile:
    import transformers  # the torchtitan rows' model: transformers' Llama at Llama 3.1 8B's config

    config = transformers.LlamaConfig(**{**LLAMA31_8B, "num_hidden_layers": blocks})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).train()
    ids = torch.zeros(1, seq_len, dtype=torch.long)
    return profile_model(model, {"input_ids": ids, "labels": ids}, warn=False, precision="bf16-pure", graphs=False)


def llama31_8b_profile(seq_len: int) -> ModelProfile:
    return extrapolate_profile(_llama_traced(2, seq_len), _llama_traced(3, seq_len), LLAMA31_8B["num_hidden_layers"])


def titan_lines(row: TitanRow) -> list[str]:
    """A torchtitan row predicted under its own plan with autopar's selective, alternate, gemms and full
    checkpointing: tokens/s/GPU and peak memory against the published. torchtitan's op-level SAC keeps every other
    aten.mm's output (autopar's "alternate"), but its save list has no _scaled_mm, the GEMM of a Float8Linear: with
    Float8 every linear's GEMM is recomputed and attention's output kept, autopar's "gemms"."""
    profile = llama31_8b_profile(row.seq_len)
    out = []
    for ac in ("selective", "alternate", "gemms", "full"):
        pred = predict_profile(profile, replace(row.plan, checkpointing=ac), row.topology)
        tokens = row.local_batch * row.seq_len / pred.step_s
        gib = pred.memory.peak_bytes / 2**30
        parts = time_parts(pred)
        out.append(f"  8B {row.seq_len:>6} {row.num_gpus:>4} {row.local_batch:>3}x1 {ac:>9} "
                   f"{row.tokens_per_s_per_gpu:>7.0f} {tokens:>8.0f} {tokens / row.tokens_per_s_per_gpu - 1:+7.1%}  "
                   f"{gib:6.1f} GiB (published {row.memory_gib:.1f}, {gib / row.memory_gib - 1:+.0%})  | {parts}")
    return out


def mpt_profile(name: str, seq_len: int) -> ModelProfile:
    hidden, heads, layers = MPT[name]
    return extrapolate_profile(_traced(hidden, heads, 2, seq_len), _traced(hidden, heads, 3, seq_len), layers)


def foundry_line(row: FoundryRow, *, with_search: bool) -> tuple[str, float]:
    """The row predicted under its own plan (and the search's best), and the throughput error."""
    profile = mpt_profile(row.model, row.seq_len)
    pred = predict_profile(profile, row.plan, row.topology)
    tokens = row.micro_batch_size * row.grad_accum * row.seq_len / pred.step_s
    err = tokens / row.tokens_per_s_per_gpu - 1
    parts = time_parts(pred)
    line = (f"{row.model:>5} {row.seq_len:>6} {row.num_gpus:>4} {row.micro_batch_size:>3}x{row.grad_accum:<3} "
            f"{'AC' if row.checkpointing else '- ':>2} {row.tokens_per_s_per_gpu:>7.0f} {tokens:>8.0f} {err:+7.1%} "
            f"{pred.memory.peak_bytes / 2**30:6.1f}")
    if with_search:
        ranked = search(profile, row.topology, world_size=row.num_gpus, global_batch_size=row.global_batch_size,
                        loop=Loop.TRAIN_STEP, headroom=0.95)
        best = next((c for c in ranked if c.feasible), None)
        if best is None:
            line += "  search: nothing fits"
        else:
            found = row.global_batch_size * row.seq_len / best.prediction.step_s / row.num_gpus
            line += f"  search {found:8.0f} ({found / tokens:5.2f}x own plan): {_short(best.plan)}"
    return line + f"  | {parts}", err


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def a100_lines(h100_errors: list[float]) -> list[str]:
    """llm-foundry's A100 80GB rows under the same model (no search), and the configurations both of its tables
    ran (model, sequence, GPUs, micro-batch, accumulation, checkpointing): the published H100 / A100 speed-up
    against the predicted one. Where the A100 rows are near and the speed-ups apart, the H100 rows' error is that
    software on that GPU in 2023, not the model's terms. `h100_errors`: the H100 rows' errors, in
    FOUNDRY_H100_BF16's order (main's)."""
    lines = ["llm-foundry A100 80GB BF16, 1600 Gb/s RoCE a node (tokens/s/GPU; the same software on a GPU it had "
             "matured on; a check, not a must-show row):",
             f"{'model':>5} {'seq':>6} {'GPUs':>4} {'mb x acc':>7} {'AC':>2} {'publ':>7} {'pred':>8} {'err':>7} "
             f"{'GiB':>6}"]
    errors, predicted = [], {}
    for row in FOUNDRY_A100_80GB:
        line, err = foundry_line(row, with_search=False)
        lines.append(line)
        print(line, flush=True)
        errors.append(err)
        predicted[_config(row)] = row.tokens_per_s_per_gpu * (1 + err)
    lines.append(f"A100: {sum(abs(e) <= 0.15 for e in errors)} of {len(errors)} within 15%; errors "
                 f"{min(errors):+.1%} .. {max(errors):+.1%}, median |err| {_median([abs(e) for e in errors]):.1%}")
    lines += ["", "the configurations both tables ran: H100 / A100 tokens/s/GPU, published and predicted:"]
    a100 = {_config(r): r for r in FOUNDRY_A100_80GB}
    for h100, h100_err in zip(FOUNDRY_H100_BF16, h100_errors):
        other = a100.get(_config(h100))
        if other is None:
            continue
        pred_h100 = h100.tokens_per_s_per_gpu * (1 + h100_err)
        lines.append(f"  {h100.model:>5} seq {h100.seq_len:>5} {h100.num_gpus:>3} GPUs mb {h100.micro_batch_size}x"
                     f"{h100.grad_accum}: published {h100.tokens_per_s_per_gpu / other.tokens_per_s_per_gpu:.2f}x, "
                     f"predicted {pred_h100 / predicted[_config(other)]:.2f}x (datasheet bf16 peak 3.17x)")
    return lines


def _config(row: FoundryRow) -> tuple:
    return (row.model, row.seq_len, row.num_gpus, row.micro_batch_size, row.grad_accum, row.checkpointing)


def _short(plan: autopar.Plan) -> str:
    mesh = "x".join(f"{axis}{getattr(plan, axis)}" for axis in ("pp", "dp_replicate", "dp_shard", "tp")
                    if getattr(plan, axis) > 1)
    zero = "" if plan.zero_stage == 3 else f" zero{plan.zero_stage}"
    reshard = "" if plan.reshard_after_forward or plan.dp_shard == 1 else " keep"
    return (f"{mesh or '1gpu'} mb{plan.micro_batch_size}x{plan.grad_accum} {plan.checkpointing}{reshard}{zero}"
            f"{' compile' if plan.compile else ''}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.paper", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--no-search", action="store_true", help="predict the published plans only")
    args = parser.parse_args()
    start = time.perf_counter()
    lines = [f"date {datetime.date.today().isoformat()}, torch {torch.__version__}, python {platform.python_version()}, "
             f"{os.cpu_count()} CPUs, no GPU used",
             "command: " + " ".join(["python -m bench.paper", *sys.argv[1:]]),
             "calibration: autopar's defaults (H200-measured, applied to the H100 spec) for every llm-foundry row; "
             "Megatron rows: bench/megatron_table1.py's (autopar's defaults; attention unfused, dropout 0.1, as in 2021)",
             "", "llm-foundry H100 80GB BF16 (tokens/s/GPU; FSDP FULL_SHARD over every GPU):",
             f"{'model':>5} {'seq':>6} {'GPUs':>4} {'mb x acc':>7} {'AC':>2} {'publ':>7} {'pred':>8} {'err':>7} "
             f"{'GiB':>6}"]
    errors = []
    for row in FOUNDRY_H100_BF16:
        line, err = foundry_line(row, with_search=not args.no_search)
        lines.append(line)
        errors.append(err)
        print(line, flush=True)
    within = sum(abs(e) <= 0.15 for e in errors)
    lines += [f"llm-foundry: {within} of {len(errors)} within 15%; errors {min(errors):+.1%} .. {max(errors):+.1%}, "
              f"median |err| {_median([abs(e) for e in errors]):.1%}", "",
              *a100_lines(errors), "",
              "Megatron-LM Table 1 (TFLOP/s per GPU; bench/megatron_table1.py's best plan per row):"]
    for row in MEGATRON_ROWS:
        params, _, _, _, tp, pp, gpus, _, published = row
        plan, pred, tflops = megatron_row(row)
        lines.append(f"{params:6.1f}B TP{tp} PP{pp} {gpus:>5} GPUs: published {published:>4}, predicted {tflops:6.1f} "
                     f"({tflops / published - 1:+.1%})")
        print(lines[-1], flush=True)
    lines += ["", "torchtitan, Llama 3.1 8B on H200 (tokens/s/GPU; FSDP over every GPU, compile, Float8 linears; its "
              "float8 all-gather as autopar's tensorwise FSDP plans gather, at 1 byte a float8 weight's element; its op-level SAC recomputes every other "
              "aten.mm and, under Float8, every linear's _scaled_mm, attention's output kept: autopar's 'gemms'; each row "
              "under autopar's four modes):",
              f"{'model':>4} {'seq':>6} {'GPUs':>4} {'mb x acc':>7} {'AC':>9} {'publ':>7} {'pred':>8} {'err':>7}"]
    for row in TITAN_H200:
        for line in titan_lines(row):
            lines.append(line)
            print(line, flush=True)
    lines += ["", "not predicted:", *(f"  {t}" for t in TORCHTITAN_NOT_EXPRESSIBLE),
              "", f"{time.perf_counter() - start:.0f} s"]
    print("wrote", write_dated(args.out, "paper", lines))


if __name__ == "__main__":
    main()
