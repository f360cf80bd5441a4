"""One rank of tests/strategies/test_tensor_parallel_trial.py, launched by torchrun on 2 gloo processes.

argv: OUT.json (rank 0 writes it). The built-in GPT, and the same GPT whose attention reshapes its heads' output
back to a width it keeps as an attribute (`self.width`, the model's whole width: XGLM's, TrOCR's `embed_dim`),
which tensor parallelism cannot know to divide, so under tp=2 its forward raises. Records:
- given: wrap of the reshaping GPT with a given tp=2 plan: the error, and whether the model is as it was
  (no parameter replaced, every value the same);
- chosen: wrap's own choice (autopar.api._decide made to pick tp=2 first, as the cost model may for a framework
  that accumulates): the plan then applied, the warning logged, and a training step's loss;
- trial_plain / trial_reads: tensor_parallel_trial on the plain GPT (it runs) and on a GPT whose attention reads a
  value the weights computed (`float(...)`: fake tensors cannot say, so the trial concludes nothing);
- plain: wrap of the plain GPT with tp=2: the plan applied.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings

import torch
import torch.distributed as dist

import autopar
import autopar.api as api
from autopar.errors import PlanError
from autopar.models.gpt import CausalSelfAttention, lm_loss
from autopar.profile import profile_model
from autopar.strategies.mesh import build_mesh
from autopar.strategies.tensor_parallel_trial import tensor_parallel_trial
from tests._training import CFG, GLOBAL_BATCH, batch, make_model

TP_PLAN = {"tp": 2, "micro_batch_size": GLOBAL_BATCH}


class WidthAttention(CausalSelfAttention):
    """Its heads' output reshaped to `self.width`, the whole width: wrong by the tp degree on a tp rank."""

    width = CFG.hidden_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, self.width))


class ReadingAttention(CausalSelfAttention):
    """Reads a value its weights computed (a Python float of the queries): no fake tensor holds it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out * 0.5 if float(out.abs().amax()) > 1e6 else out


def gpt(attention: type | None = None) -> torch.nn.Module:
    model = make_model("gpt")
    if attention is not None:
        for block in model.blocks:
            block.attn.__class__ = attention
    return model


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def given(rows: torch.Tensor) -> dict:
    model = gpt(WidthAttention)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        autopar.wrap(model, sample=rows, plan=autopar.Plan(**TP_PLAN), loss_fn=lm_loss, verbose=False)
        error = None
    except PlanError as exc:
        error = str(exc)
    after = dict(model.named_parameters())
    return {"error": error, "untouched": set(after) == set(before) and all(
        type(after[n]) is torch.nn.Parameter and type(after[n].data) is torch.Tensor and torch.equal(after[n], v)
        for n, v in before.items())}


def chosen(rows: torch.Tensor) -> dict:
    real = api._decide
    asked: list[str | None] = []

    def tp_first(*args, tp_failed=None, **kwargs):  # the cost model's choice, were it tp=2
        asked.append(tp_failed)
        if tp_failed is None:
            return api._Decision(autopar.Plan(**TP_PLAN), "chosen by the cost model")
        return real(*args, tp_failed=tp_failed, **kwargs)

    api._decide = tp_first
    log = Records()
    logging.getLogger("autopar").addHandler(log)
    try:
        model = gpt(WidthAttention)
        autopar.wrap(model, sample=rows, loss_fn=lm_loss, loop="accumulates", global_batch_size=GLOBAL_BATCH,
                     verbose=False)
    finally:
        api._decide = real
        logging.getLogger("autopar").removeHandler(log)
    plan = autopar.plan_of(model)
    loss = lm_loss(model(rows), rows)
    loss.backward()
    return {"tp": plan.tp, "dp": plan.dp_size, "asked": asked, "warnings": [w for w in log.lines if "tp=2" in w],
            "loss": float(loss)}


def trial(attention: type | None, rows: torch.Tensor) -> str | None:
    model = gpt(attention)
    plan = autopar.Plan(**TP_PLAN)
    profile = profile_model(model, rows, loss_fn=lm_loss, warn=False)
    return tensor_parallel_trial(model, rows, plan, profile, build_mesh(plan, "cpu")["tp"], device=torch.device("cpu"),
                                 loss_fn=lm_loss)


def main(out: str) -> None:
    dist.init_process_group("gloo")
    warnings.simplefilter("ignore")
    rows = batch(0)  # tensor-parallel peers read the same rows
    record = {"given": given(rows), "chosen": chosen(rows), "trial_plain": trial(None, rows),
              "trial_reads": trial(ReadingAttention, rows)}
    model = gpt()
    autopar.wrap(model, sample=rows, plan=autopar.Plan(**TP_PLAN), loss_fn=lm_loss, verbose=False)
    record["plain"] = {"tp": autopar.plan_of(model).tp, "loss": float(lm_loss(model(rows), rows))}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
