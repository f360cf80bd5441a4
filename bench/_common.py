"""What the benchmarks share: the Hugging Face model shapes they measure (random init), their token batches,
and where results go. Imported as `bench._common` by scripts run as `python -m bench.<name>` from the
repository root (bench/README.md)."""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

def write_dated(out_dir: str | Path, stem: str, lines: list[str]) -> Path:
    """`lines` as `out_dir/<stem>_<today>.txt` (the folder made if need be); returns the path."""
    path = Path(out_dir) / f"{stem}_{datetime.date.today().isoformat()}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def git_commit(root: str | Path = ROOT) -> str:
    """`git rev-parse HEAD` of the checkout at `root`; "unknown" outside a checkout (or without git)."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    head = done.stdout.strip()
    return head if done.returncode == 0 and head else "unknown"


def source_digest(root: str | Path = ROOT) -> str:
    """The first 16 hex digits of a SHA-256 over the Python files of autopar/ and bench/ at `root` (their paths and
    bytes, sorted): what code ran, where the checkout's commit cannot say (a device's copy of a working tree whose
    git metadata was older than its files); "unknown" where neither folder is there."""
    root = Path(root)
    files = sorted(f for folder in ("autopar", "bench") for f in (root / folder).rglob("*.py"))
    if not files:
        return "unknown"
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def device_name() -> str:
    """The device a benchmark would run on here: CUDA device 0's name, or "cpu (N cores)"."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({os.cpu_count()} cores)"


def stamp(command: str | None = None, root: str | Path = ROOT) -> dict:
    """What makes a result traceable: date, device, torch, transformers (None where it is not installed), the
    command (default: this process's `python ...` line) and the commit (`git rev-parse HEAD` at `root`, "unknown"
    outside a checkout), and `source`, the digest of the code itself (source_digest). `python -m bench` prints it
    at the start of every run."""
    try:
        transformers = importlib.metadata.version("transformers")  # no import: it is slow and optional
    except importlib.metadata.PackageNotFoundError:
        transformers = None
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": device_name(),
            "torch": torch.__version__, "transformers": transformers,
            "command": command if command is not None else shlex.join(["python", *sys.argv]),
            "commit": git_commit(root), "source": source_digest(root)}


def results_path(out: str | None, name: str) -> Path:
    """A suite's JSON-lines file: `--out` where given, else `name` in $OUT (the device machine's folder that comes
    back; the current folder without it); its folder made."""
    path = Path(out) if out else Path(os.environ.get("OUT", ".")) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


# The plan options a result record names (bench/validate_h200.py, tune_h200.py records).
PLAN_KEYS = ("micro_batch_size", "grad_accum", "checkpointing", "precision", "compile")

MODELS = {
    # name: (global batch, sequence length)
    "gpt2-355m": (16, 1024),
    "llama-1b": (16, 2048),
    "gpt2-tiny": (8, 64),  # a CPU smoke test of the benchmarks
}


def build(name: str) -> torch.nn.Module:
    """A model of MODELS, randomly initialised on the current default device (`with torch.device(...)`)."""
    import transformers  # optional (autopar[hf]): only the benchmarks of Hugging Face models need it

    if name == "gpt2-tiny":
        cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=64, vocab_size=30000,
                                      attn_implementation="sdpa")
        return transformers.GPT2LMHeadModel(cfg)
    if name == "gpt2-355m":
        cfg = transformers.GPT2Config(n_embd=1024, n_layer=24, n_head=16, n_positions=1024, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                   intermediate_size=8192, vocab_size=32000, max_position_embeddings=2048,
                                   attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg)


def token_batch(name: str, batch: int, device: str = "meta") -> dict:
    """`batch` sequences of the model's length, all token 0, as inputs and labels."""
    ids = torch.zeros(batch, MODELS[name][1], dtype=torch.long, device=device)
    return {"input_ids": ids, "labels": ids}


def plan_from_short(short: str) -> dict:
    """The plan options of a tuner row's short description ("1gpu mb16 acc2 bf16 compile", "ac:selective")."""
    kw: dict = {"precision": "bf16"}
    for tok in short.split()[1:]:
        if tok.startswith("mb"):
            kw["micro_batch_size"] = int(tok[2:])
        elif tok.startswith("acc"):
            kw["grad_accum"] = int(tok[3:])
        elif tok.startswith("ac:"):
            kw["checkpointing"] = tok[3:]
        elif tok == "compile":
            kw["compile"] = True
        elif tok in ("bf16", "fp32"):
            kw["precision"] = tok
    return kw


KERNEL_KINDS = (  # (kind, substrings of a CUDA kernel's name), first match wins
    ("gemm", ("triton_tem_",)),  # inductor's GEMM templates (max-autotune)
    ("fused", ("triton_",)),  # inductor's generated kernels, whatever ops their names list
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("memcpy", ("memcpy", "memset")),
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("conv", ("fprop", "dgrad", "wgrad", "conv", "implicit", "nchwtonhwc", "nhwctonchw")),
    ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "sm90", "cublas", "matmul", "splitk", "gemv")),
)


def kernel_kind(name: str) -> str:
    """A CUDA kernel's kind by its name; "memory_bound" for the rest (eager elementwise, reductions, norms)."""
    n = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in n for k in keys)), "memory_bound")


def host_op_us(device: str, num_ops: int = 20000) -> float:
    """Microseconds the host takes to issue one tiny in-place op from Python (`x.add_(1)` on `device`, the GPU
    work negligible): the machine's host speed, which host-bound steps follow. Two leases of the same H200 kind
    ran one compiled plan 1.5x apart (measured 2026-12-01, result file since superseded; git show
    cc44334:bench/results/zoo_h200_wrap_2026-12-01f.md), so records carry it."""
    x = torch.zeros(8, device=device)
    for _ in range(100):  # warm: the first calls load kernels
        x.add_(1)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(num_ops):
        x.add_(1)
    if device == "cuda":
        torch.cuda.synchronize()
    return round((time.perf_counter() - t0) / num_ops * 1e6, 3)
