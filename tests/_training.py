"""Shared by the parity tests and their worker processes: the model, the data and the reference run.

The reference is one process on the full global batch, plain PyTorch, no autopar. Its bf16 variant
reproduces FSDP2's MixedPrecisionPolicy by hand: parameters cast to bf16 for compute (with autograd, so
gradients land on the fp32 parameters), outputs cast to fp32, fp32 master weights and optimizer state.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from autopar.models.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens

# torchrun's variables: tests of one plain process clear them (tests/conftest.py `one_plain_process`).
TORCHRUN_VARS = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK", "MASTER_ADDR", "MASTER_PORT")

CFG = GPTConfig(vocab_size=128, seq_len=32, num_layers=4, hidden_dim=64, num_heads=4)
GLOBAL_BATCH = 8
STEPS = 10
LR = 3e-3


def make_model(kind: str = "gpt", seed: int = 0) -> nn.Module:
    """The built-in GPT, or a tiny Hugging Face Llama (GQA), Qwen3 (GQA, q/k norms over a head's width), OLMo 2 (GQA,
    q/k norms over all heads' width), GLM (a fused gate/up projection), GPT-NeoX
    (q/k/v fused per head) or GPT-2 (Conv1D, fused qkv, tied head)."""
    torch.manual_seed(seed)
    if kind == "gpt":
        return GPT(CFG)
    import transformers

    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=CFG.vocab_size, hidden_size=CFG.hidden_dim, intermediate_size=128,
                                       num_hidden_layers=CFG.num_layers, num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=CFG.seq_len, attn_implementation="sdpa")
        return transformers.LlamaForCausalLM(cfg)
    if kind == "qwen3":  # a norm over each head's width on q and k (q_norm / k_norm)
        cfg = transformers.Qwen3Config(vocab_size=CFG.vocab_size, hidden_size=CFG.hidden_dim, intermediate_size=128,
                                       num_hidden_layers=CFG.num_layers, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=16, max_position_embeddings=CFG.seq_len, attn_implementation="sdpa")
        return transformers.Qwen3ForCausalLM(cfg)
    if kind == "olmo2":  # q_norm / k_norm over all heads of q, of k (split with their projections under TP)
        cfg = transformers.Olmo2Config(vocab_size=CFG.vocab_size, hidden_size=CFG.hidden_dim, intermediate_size=128,
                                       num_hidden_layers=CFG.num_layers, num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=CFG.seq_len, attn_implementation="sdpa",
                                       pad_token_id=0, bos_token_id=0, eos_token_id=0)
        return transformers.Olmo2ForCausalLM(cfg)
    if kind == "glm":  # one fused gate_up_proj, cut by a chunk of its last dim (the trace reads it: a strided shard)
        cfg = transformers.GlmConfig(vocab_size=CFG.vocab_size, hidden_size=CFG.hidden_dim, intermediate_size=128,
                                     num_hidden_layers=CFG.num_layers, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=16, max_position_embeddings=CFG.seq_len, attn_implementation="sdpa",
                                     attention_bias=False,  # (a key bias: a rounding-noise gradient, as GPT-NeoX's)
                                     pad_token_id=0, bos_token_id=0, eos_token_id=0)
        return transformers.GlmForCausalLM(cfg)
    if kind == "neox":  # one fused q/k/v projection, each head's q, k and v side by side (its own TP plan: colwise)
        cfg = transformers.GPTNeoXConfig(vocab_size=CFG.vocab_size, hidden_size=CFG.hidden_dim, intermediate_size=128,
                                         num_hidden_layers=CFG.num_layers, num_attention_heads=4,
                                         max_position_embeddings=CFG.seq_len, hidden_dropout=0.0, attention_dropout=0.0,
                                         attention_bias=False,  # (a key bias: a rounding-noise gradient)
                                         attn_implementation="sdpa")
        return transformers.GPTNeoXForCausalLM(cfg)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=CFG.vocab_size, n_embd=CFG.hidden_dim, n_layer=CFG.num_layers,
                                      n_head=4, n_positions=CFG.seq_len, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, attn_implementation="sdpa")
        return transformers.GPT2LMHeadModel(cfg)
    raise ValueError(kind)


def sample_of(kind: str, tokens: torch.Tensor):
    """What the model is called with: the tokens (built-in GPT) or a Hugging Face dict with labels."""
    return tokens if kind == "gpt" else {"input_ids": tokens, "labels": tokens}


def loss_of(kind: str):
    """loss_fn(output, sample) for the model kind."""
    if kind == "gpt":
        return lambda output, sample: lm_loss(output, sample)
    return lambda output, sample: output.loss


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=False)


def batch(step: int) -> torch.Tensor:
    return synthetic_tokens(GLOBAL_BATCH, CFG, step=step, seed=1)


def local_rows(x: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    n = x.shape[0] // size
    return x[rank * n:(rank + 1) * n]


def _bf16_forward(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:  # the built-in GPT only
        params = {name: p.to(torch.bfloat16) for name, p in model.named_parameters()}
        return torch.func.functional_call(model, params, (x,), tie_weights=True).float()

    return forward


def reference(precision: str = "fp32", steps: int = STEPS, kind: str = "gpt", *, grads: bool = False):
    """Losses per step and final parameters of one process training on the full batch (and, with
    grads=True, the gradients of the first step as a third item)."""
    model = make_model(kind)
    opt = make_optimizer(model)
    forward = _bf16_forward(model) if precision == "bf16" else model
    compute = loss_of(kind)
    losses = []
    for step in range(steps):
        x = sample_of(kind, batch(step))
        loss = compute(forward(x) if kind == "gpt" else forward(**x), x)
        loss.backward()
        if step == 0:
            first = {n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)
                     if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return (losses, params, first) if grads else (losses, params)
