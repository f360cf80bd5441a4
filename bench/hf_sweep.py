"""Every architecture the installed transformers registers for a task, at small size on this CPU: the model's own
training step, `autopar.plan` for one H200 and for 8 H100s, and `wrap` + 2 steps here, the first loss against
the model's own under the same dropout masks (issue 33: "plan any model, never raise"; no architecture is
chosen by hand, so none is fitted to).

Each architecture runs in its own process (`--child`), with a time limit; the record says how far it got. A
model that cannot be built from its default config made small, or whose own step fails without autopar, is
recorded as such and is not autopar's failure. One JSON line per architecture; `--report FILE` prints the
Markdown table.

    python -m bench hf-sweep --tasks causal-lm,vision,audio,seq2seq,segmentation --out DIR   # DIR/hf_sweep.jsonl
    python -m bench hf-sweep --report bench/results/hf_sweep_DATE.jsonl > bench/results/hf_sweep_DATE.md

`--size published` plans each architecture at the size its default config describes (transformers' defaults are
mostly a published checkpoint's dimensions: Llama's 7B, Mixtral's 8x7B, DeepSeek-V3's 671B), built on the meta
device with a batch of realistic shape (PUBLISHED_SAMPLE): only `autopar.plan` for both topologies runs (a meta
model has no step of its own and wrap needs real weights). It is issue 33's "plans any model, fast" held against
architectures no one chose: the seconds of each plan against the 60 s bound, and what raised.

    python -m bench hf-sweep --size published --tasks causal-lm --jobs 1 --arch-timeout-s 200 --out DIR
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import copy
import json
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

from bench._common import results_path, stamp

TOPOLOGIES = ("1xH200", "8xH100-SXM")
TASKS = {  # task: (transformers' auto-model mapping, its auto class)
    "causal-lm": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
    "vision": ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForImageClassification"),
    "audio": ("MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", "AutoModelForAudioClassification"),
    "seq2seq": ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM"),
    "segmentation": ("MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES", "AutoModelForSemanticSegmentation"),
}
# Integer config fields set where a config has them (and they are ints): two layers, narrow widths, a small
# vocabulary, few experts, 64-pixel images. Lists (a CNN's stage widths) keep their defaults.
SMALL = dict(
    num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=256, max_position_embeddings=256, head_dim=16, n_layer=2, n_embd=64, n_head=4, d_model=64,
    num_layers=2, ffn_dim=128, moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
    num_experts_per_tok=2, n_positions=256, hidden_dim=64, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=16, shared_expert_intermediate_size=64, n_shared_experts=1,
    first_k_dense_replace=1, d_ff=128, num_heads=4, d_kv=16, state_size=16, expand=2, n_groups=1, conv_kernel=4,
    chunk_size=16, mamba_d_state=16, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, attention_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    encoder_layers=2, decoder_layers=2, encoder_ffn_dim=128, decoder_ffn_dim=128, encoder_attention_heads=4,
    decoder_attention_heads=4, num_decoder_layers=2, image_size=64)
BATCH, TOKENS, TARGET_TOKENS, AUDIO_SAMPLES, LABELS = 2, 32, 16, 16000, 3
# --size published: (samples a batch, tokens or pixels or audio samples, target tokens) per task; the tokens capped
# at the config's max_position_embeddings, the pixels the config's image_size where it has one
PUBLISHED_SAMPLE = {"causal-lm": (4, 2048, 0), "seq2seq": (8, 512, 128), "vision": (32, 224, 0),
                    "segmentation": (8, 512, 0), "audio": (8, 64000, 0)}
PLAN_BOUND_S = 60.0  # issue 33's bound on autopar.plan at realistic size, per model and topology (2 cores)
PHASE = "# phase "  # how a child's stderr line names the phase it starts
AUTOPAR_PHASES = ("plan", "wrap")  # the child's phases where autopar runs (before them: the model's build, own step)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)}")
    p.add_argument("--archs", default=None, help="comma-separated architectures (default: every one of the task)")
    p.add_argument("--arch-timeout-s", type=float, default=150.0, help="an architecture's process is killed after this")
    p.add_argument("--jobs", type=int, default=2, help="architectures run at once")
    p.add_argument("--out", default=None, help="the JSON-lines file (default: $OUT/hf_sweep.jsonl)")
    p.add_argument("--report", default=None, help="print the Markdown table of a results file and exit")
    p.add_argument("--size", choices=("small", "published"), default="small",
                   help="small: SMALL's widths, trained; published: the default config's size on meta, planned only")
    p.add_argument("--child", nargs=2, default=None, metavar=("TASK", "ARCH"), help=argparse.SUPPRESS)
    return p


def architectures(task: str) -> list[str]:
    from transformers.models.auto import modeling_auto

    return list(getattr(modeling_auto, TASKS[task][0]))


def _phase(name: str) -> None:
    """How far the child got: the parent reads the last line of its stderr when it kills it."""
    print(f"{PHASE}{name}", file=sys.stderr, flush=True)


def build(task: str, arch: str, size: str = "small") -> Any:
    """The architecture's model for `task`: SMALL's widths on the CPU, or ("published") its default config's on
    the meta device."""
    import torch
    import transformers

    config = transformers.CONFIG_MAPPING[arch]()
    if size == "small":
        _make_small(config)
    if task != "causal-lm" and task != "seq2seq":
        config.num_labels = LABELS
    torch.manual_seed(0)
    auto = getattr(transformers, TASKS[task][1])
    if size == "small":
        return auto.from_config(config)
    with torch.device("meta"):
        return auto.from_config(config).train()


def _make_small(config: Any, depth: int = 0) -> None:
    """SMALL's fields on `config` and on its sub-configs (a vision-language model's text and vision towers), and
    token ids (padding, start, end) that a smaller vocabulary no longer holds set to 0."""
    staged = isinstance(getattr(config, "hidden_sizes", None), (list, tuple))  # a CNN's widths, per stage
    for key, value in SMALL.items():
        if staged and key in ("hidden_size", "num_hidden_layers"):  # derived from the stages: left as they are
            continue
        now = getattr(config, key, None)
        if isinstance(now, int) and not isinstance(now, bool):
            _set(config, key, value)
    # dimensions other fields derive from: rotary embeddings' width (DeepSeek's head_dim is its rope width,
    # CodeGen's rotary_dim at most a head's)
    if isinstance(getattr(config, "qk_rope_head_dim", None), int) and hasattr(config, "head_dim"):
        config.head_dim = config.qk_rope_head_dim
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    width = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if isinstance(getattr(config, "rotary_dim", None), int) and isinstance(heads, int) and isinstance(width, int):
        config.rotary_dim = min(config.rotary_dim, width // heads)
    if hasattr(config, "n_group"):  # expert groups (DeepSeek's router): one group of the few experts left
        config.n_group, config.topk_group = 1, 1
    vocab = getattr(config, "vocab_size", None)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "padding_idx"):
        now = getattr(config, key, None)
        if isinstance(vocab, int) and isinstance(now, int) and now >= vocab:
            _set(config, key, 0)
    if depth < 2:
        for name in getattr(config, "sub_configs", {}) or {}:
            sub = getattr(config, name, None)
            if sub is not None and hasattr(sub, "to_dict"):
                _make_small(sub, depth + 1)


def _set(config: Any, key: str, value: Any) -> None:
    """`config.key = value`, unless the config refuses it (a derived property: left as the config makes it)."""
    try:
        setattr(config, key, value)
    except (AttributeError, TypeError, ValueError):
        pass


def make_sample(task: str, model: Any, batch: int = BATCH, size: str = "small") -> dict[str, Any]:
    """A batch for `task`: SMALL's (BATCH samples, TOKENS tokens, 64 px where the config names no image size), or
    ("published") PUBLISHED_SAMPLE's shapes."""
    import torch

    config = model.config
    published = size == "published"
    if published:
        batch, length, targets = PUBLISHED_SAMPLE[task]
    else:
        length, targets = (AUDIO_SAMPLES if task == "audio" else TOKENS), TARGET_TOKENS
    if task in ("vision", "segmentation"):
        px = getattr(config, "image_size", length if published else 64)
        px = px[0] if isinstance(px, (list, tuple)) else px if isinstance(px, int) else 64
        channels = getattr(config, "num_channels", 3) or 3
        labels = torch.randint(0, LABELS, (batch, px, px) if task == "segmentation" else (batch,))
        return {"pixel_values": torch.randn(batch, channels, px, px), "labels": labels}
    if task == "audio":
        return {"input_values": torch.randn(batch, length), "labels": torch.randint(0, LABELS, (batch,))}
    vocab = getattr(config, "vocab_size", 256) or 256
    if published:
        limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        length = min(length, limit) if isinstance(limit, int) and limit > 0 else length
        targets = min(targets, length)
    else:
        vocab = min(vocab, 256)
    ids = torch.randint(0, vocab, (batch, length))
    labels = ids if task == "causal-lm" else torch.randint(0, vocab, (batch, targets))
    return {"input_ids": ids, "labels": labels}


def _seed(seed: int) -> None:
    """torch's, NumPy's and Python's generators: dropout draws from torch's, wav2vec2's SpecAugment masks from
    NumPy's, some layer-drop from Python's."""
    import random

    import numpy
    import torch

    torch.manual_seed(seed)
    numpy.random.seed(seed)
    random.seed(seed)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip()[:300]}"


def where() -> str:
    """The source line the exception being handled was raised at (in an `except` block)."""
    return traceback.format_exc().strip().splitlines()[-3].strip()[:200]


def _failed(exc: BaseException, started: float) -> dict[str, Any]:
    """The record of a call of autopar's that raised (in an `except` block: the traceback is the one handled)."""
    return {"ok": False, "s": round(time.perf_counter() - started, 2), "error": _error(exc), "where": where()}


def measure(task: str, arch: str, size: str = "small") -> dict[str, Any]:
    """One architecture in this process; `status` says how far it got (see `report`)."""
    import torch

    warnings.filterwarnings("ignore")
    rec: dict[str, Any] = {"size": size}
    _phase("build")
    try:
        model = build(task, arch)
        sample = make_sample(task, model)
    except Exception as exc:
        return {**rec, "status": "build_failed", "error": _error(exc)}
    rec["parameters"] = sum(p.numel() for p in model.parameters())
    _phase("own step")
    try:  # the model's own step, without autopar, on a copy: one that cannot train is not autopar's to plan
        plain = copy.deepcopy(model)
        plain(**sample).loss.backward()
        del plain
    except Exception as exc:
        return {**rec, "status": "model_failed", "error": _error(exc)}
    if size == "published":  # the small model's own step ran: the published one is planned (on meta, no step)
        _phase("build published")
        try:
            model = build(task, arch, size)
            sample = make_sample(task, model, size=size)
        except Exception as exc:
            return {**rec, "status": "build_failed", "error": _error(exc)}
        rec["parameters"] = sum(p.numel() for p in model.parameters())
        rec["sample"] = {k: list(v.shape) for k, v in sample.items()}
        return {**rec, **_plans(model, sample)}
    import autopar

    plans = _plans(model, sample)
    rec.update({t: plans[t] for t in TOPOLOGIES})
    failed = plans["status"] == "autopar_failed"  # a safe plan (untraced) or a refusal is judged by wrap, as before
    _phase("wrap")
    t0 = time.perf_counter()
    try:
        with torch.no_grad():  # the model's own loss just before wrap, under the dropout masks wrap's step will get
            _seed(1)
            own = float(model(**sample).loss)
        t1 = time.perf_counter()
        wrapped = autopar.wrap(model, sample=sample, verbose=False)
        wrap_s = time.perf_counter() - t1
        optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
        losses = []
        _seed(1)
        for _ in range(2):
            loss = wrapped(**sample).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
        rec["wrap"] = {"ok": True, "s": round(wrap_s, 2), "steps_s": round(time.perf_counter() - t0 - wrap_s, 2),
                       "own_loss": own, "losses": losses,
                       "same_first_loss": abs(losses[0] - own) <= 1e-4 * max(1.0, abs(own))}
    except Exception as exc:
        failed = True
        rec["wrap"] = _failed(exc, t0)
    if failed:
        rec["status"] = "autopar_failed"
    elif not rec["wrap"]["same_first_loss"]:
        rec["status"] = "mismatch"
    else:
        rec["status"] = "ok"
    return rec


def _plans(model: Any, sample: dict[str, Any]) -> dict[str, Any]:
    """`autopar.plan` for each topology: its seconds and plan, or what it raised; status "ok" where none raised,
    "untraced" where a plan came from the model's structure (autopar.UntracedWarning), "refused" where no plan fits
    the hardware (autopar.InfeasiblePlanError's one line), else "autopar_failed"."""
    import autopar
    from autopar.planning import short_name

    rec: dict[str, Any] = {"status": "ok"}
    for topology in TOPOLOGIES:
        _phase(f"plan {topology}")
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                plan = autopar.plan(model, sample=sample, topology=topology)
            rec[topology] = {"ok": True, "s": round(time.perf_counter() - t0, 2), "plan": short_name(plan)}
            untraced = [str(w.message) for w in caught if issubclass(w.category, autopar.UntracedWarning)]
            if untraced:  # the safe plan from the model's structure, without a prediction
                rec[topology]["untraced"] = untraced[0][:300]
                status = "untraced"
            else:
                status = "ok"
        except autopar.InfeasiblePlanError as exc:  # nothing fits: autopar's one-line refusal, not a failure
            rec[topology], status = {**_failed(exc, t0), "refused": True}, "refused"
        except Exception as exc:
            rec[topology], status = _failed(exc, t0), "autopar_failed"
        rec["status"] = max(rec["status"], status, key=_PLAN_STATUSES.index)  # the worst topology's
    return rec


#: _plans' statuses, the least worrying first
_PLAN_STATUSES = ("ok", "untraced", "refused", "autopar_failed")


def _run_child(task: str, arch: str, timeout_s: float, size: str = "small") -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.hf_sweep", "--child", task, arch, "--size", size]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                              timeout=timeout_s, start_new_session=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        if lines:
            return json.loads(lines[-1])
        return {"task": task, "arch": arch, "size": size, "status": "crashed", "rc": proc.returncode,
                "phase": _last_phase(proc.stderr), "error": proc.stderr.strip()[-300:]}
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return {"task": task, "arch": arch, "size": size, "status": "timeout", "phase": _last_phase(err),
                "error": f"killed at {timeout_s:.0f} s", "wall_s": round(time.perf_counter() - start, 1)}


def _last_phase(stderr: str) -> str | None:
    """The last phase a child wrote (`_phase`), or None."""
    phases = [x[len(PHASE):] for x in stderr.splitlines() if x.startswith(PHASE)]
    return phases[-1] if phases else None


def report(path: str) -> str:
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    head = rows[0] if rows else {}
    if head.get("size") == "published":
        return report_published(rows)
    out = [f"# hf-sweep, {str(head.get('date', ''))[:10]}, {head.get('device')}, torch {head.get('torch')}, "
           f"transformers {head.get('transformers')}, code {str(head.get('commit', ''))[:7]}",
           f"# {head.get('command')}", "",
           "Statuses: ok (planned for both topologies, wrap trained, its first loss the model's own); mismatch (the "
           "first loss differs); autopar_failed (plan or wrap raised); build_failed / model_failed (the config made "
           "small does not build, or the model's own step fails without autopar: not autopar's); timeout / crashed "
           "(with the phase reached).", "",
           "| task | architectures | ok | mismatch | autopar_failed | build_failed | model_failed | timeout | crashed "
           "| plan s median | plan s max | wrap s max |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    by_task: dict[str, list[dict]] = collections.defaultdict(list)
    for r in rows:
        by_task[r["task"]].append(r)
    for task, rs in by_task.items():
        count = collections.Counter(r["status"] for r in rs)
        secs = [r[t]["s"] for r in rs for t in TOPOLOGIES if isinstance(r.get(t), dict) and r[t].get("ok")]
        cells = [str(count.get(s, 0)) for s in ("ok", "mismatch", "autopar_failed", "build_failed", "model_failed",
                                                "timeout", "crashed")]
        wraps = [r["wrap"]["s"] for r in rs if isinstance(r.get("wrap"), dict) and r["wrap"].get("ok")]
        out.append(f"| {task} | {len(rs)} | {' | '.join(cells)} | "
                   f"{statistics.median(secs) if secs else 0:.2f} | {max(secs) if secs else 0:.2f} | "
                   f"{max(wraps) if wraps else 0:.2f} |")
    bad = [r for r in rows if r["status"] in ("mismatch", "autopar_failed") or
           (r["status"] in ("timeout", "crashed") and str(r.get("phase")).startswith(AUTOPAR_PHASES))]
    early = [r for r in rows if r["status"] in ("timeout", "crashed") and r not in bad]
    out.append(f"\n{len(early)} timeouts and crashes (killed: out of memory) came before autopar ran (building the "
               "model from its default config, or its own step): not listed.")
    if bad:
        out += ["", "## What autopar did not do", "", "| task | architecture | status | what |",
                "| --- | --- | --- | --- |"]
        for r in bad:
            if r["status"] == "mismatch":
                what = f"own loss {r['wrap']['own_loss']:.6f}, wrap's first {r['wrap']['losses'][0]:.6f}"
            elif r["status"] == "autopar_failed":
                what = "; ".join(f"{k}: {r[k]['error'][:160]}" for k in (*TOPOLOGIES, "wrap")
                                 if isinstance(r.get(k), dict) and not r[k].get("ok"))
            else:
                what = f"phase {r.get('phase')}: {str(r.get('error', ''))[:160]}"
            out.append(f"| {r['task']} | {r['arch']} | {r['status']} | {what.replace('|', '/')} |")
    return "\n".join(out)


def report_published(rows: list[dict[str, Any]]) -> str:
    """The table of a `--size published` run: per task, the statuses and autopar.plan's seconds; then every
    architecture autopar raised on, or took over PLAN_BOUND_S to plan, or was killed while planning."""
    head = rows[0] if rows else {}
    out = [f"# hf-sweep --size published, {str(head.get('date', ''))[:10]}, {head.get('device')}, torch "
           f"{head.get('torch')}, transformers {head.get('transformers')}, code {str(head.get('commit', ''))[:7]}",
           f"# {head.get('command')}", "",
           "Each architecture whose small model (`--size small`'s) runs its own step, at its default config's "
           f"size on the meta device: `autopar.plan` for {' and '.join(TOPOLOGIES)} (one process each). Statuses: "
           "ok (both planned by the cost model); untraced (autopar.UntracedWarning: the step could not be traced, "
           "the safe plan from the model's structure came back); refused (no plan fits a topology's memory: "
           "autopar.InfeasiblePlanError, one line saying what to change); autopar_failed (a plan raised anything "
           "else); build_failed / "
           "model_failed (the config does not build, or the small model's own step fails: not autopar's); "
           "timeout / crashed (with the phase reached).", "",
           "| task | architectures | ok | untraced | refused | autopar_failed | build_failed | model_failed | timeout "
           f"| crashed | plan s median | plan s max | over {PLAN_BOUND_S:.0f} s |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    by_task: dict[str, list[dict]] = collections.defaultdict(list)
    for r in rows:
        by_task[r["task"]].append(r)

    def secs(r: dict[str, Any]) -> list[float]:
        return [r[t]["s"] for t in TOPOLOGIES if isinstance(r.get(t), dict) and r[t].get("ok")]

    for task, rs in by_task.items():
        count = collections.Counter(r["status"] for r in rs)
        every = [x for r in rs for x in secs(r)]
        over = sum(1 for r in rs if any(x > PLAN_BOUND_S for x in secs(r)))
        cells = [str(count.get(k, 0)) for k in ("ok", "untraced", "refused", "autopar_failed", "build_failed",
                                                "model_failed", "timeout", "crashed")]
        out.append(f"| {task} | {len(rs)} | {' | '.join(cells)} | "
                   f"{statistics.median(every) if every else 0:.1f} | {max(every) if every else 0:.1f} | {over} |")
    bad = [r for r in rows if r["status"] in ("autopar_failed", "untraced", "refused") or
           any(x > PLAN_BOUND_S for x in secs(r)) or
           (r["status"] in ("timeout", "crashed") and str(r.get("phase")).startswith("plan"))]
    if bad:
        out += ["", f"## Raised, untraced, refused, over {PLAN_BOUND_S:.0f} s, or killed while planning", "",
                "| task | architecture | parameters | status | what |", "| --- | --- | ---: | --- | --- |"]
        for r in sorted(bad, key=lambda r: (r["task"], r["arch"])):
            if r["status"] in ("timeout", "crashed"):
                what = f"phase {r.get('phase')}: {str(r.get('error', ''))[:160]}"
            else:
                what = "; ".join(_plan_cell(t, r[t]) for t in TOPOLOGIES if isinstance(r.get(t), dict))
            params = r.get("parameters")
            out.append(f"| {r['task']} | {r['arch']} | {params / 1e9 if params else 0:.2f}B | {r['status']} | "
                       f"{what.replace('|', '/')} |")
    return "\n".join(out)


def _plan_cell(topology: str, plan: dict[str, Any]) -> str:
    """One topology's plan in the published report: its seconds, and what it raised or that it was untraced."""
    if not plan.get("ok"):
        return f"{topology}: {plan['s']:.1f} s {plan['error'][:150]}"
    return f"{topology}: {plan['s']:.1f} s" + (f" untraced: {plan['untraced'][:200]}" if plan.get("untraced") else "")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.report:
        print(report(args.report))
        return 0
    given = sys.argv[1:] if argv is None else list(argv)
    if args.child:
        task, arch = args.child
        rec = {"task": task, "arch": arch, **measure(task, arch, args.size)}
        print(json.dumps(rec), flush=True)
        return 0
    out = results_path(args.out, "hf_sweep.jsonl")
    head = stamp(" ".join(["python -m bench hf-sweep", *given]))
    jobs = [(task, arch) for task in args.tasks.split(",") for arch in architectures(task)
            if args.archs is None or arch in args.archs.split(",")]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool, open(out, "a") as f:
        futures = [pool.submit(_run_child, task, arch, args.arch_timeout_s, args.size) for task, arch in jobs]
        for done in concurrent.futures.as_completed(futures):
            rec = {**done.result(), **head}
            f.write(json.dumps(rec) + "\n")
            f.flush()
            print(f"{rec['task']} {rec['arch']}: {rec['status']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
