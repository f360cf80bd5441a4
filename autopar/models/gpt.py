"""A small, plain GPT (decoder-only transformer) used by `autopar demo`, the tests and the benchmarks.

Written the way users write models: nothing in it knows about autopar. Separate q/k/v projections (so
tensor parallelism can split them column-wise), pre-norm blocks in an `nn.ModuleList`, token embedding
tied to the output head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 512
    seq_len: int = 128
    num_layers: int = 4
    hidden_dim: int = 128
    num_heads: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "num_layers", "hidden_dim", "num_heads", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}.")
        if self.hidden_dim % self.num_heads:
            raise ValueError(
                f"GPTConfig.hidden_dim={self.hidden_dim} must divide by num_heads={self.num_heads}."
            )

    @property
    def num_params(self) -> int:
        """Parameter count (tied head counted once), for checking profiles exactly."""
        h, v, s, L, f = self.hidden_dim, self.vocab_size, self.seq_len, self.num_layers, self.mlp_ratio
        block = 2 * (2 * h) + 4 * h * h + 3 * h + (h * f * h + f * h) + (f * h * h + h)
        head = 0 if self.tie_embeddings else v * h
        return v * h + s * h + L * block + 2 * h + head


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_dim // cfg.num_heads
        self.q_proj = nn.Linear(cfg.hidden_dim, cfg.hidden_dim)
        # No key bias: softmax is invariant to it, so its gradient is exactly zero (Adam would amplify noise).
        self.k_proj = nn.Linear(cfg.hidden_dim, cfg.hidden_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_dim, cfg.hidden_dim)
        self.o_proj = nn.Linear(cfg.hidden_dim, cfg.hidden_dim)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # (b, s, h) -> (b, s, heads, head_dim) -> (b, heads, s, head_dim); -1 lets TP shard the heads
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(b, s, -1)  # (b, heads, s, head_dim) -> (b, s, h)
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(cfg.hidden_dim, cfg.mlp_ratio * cfg.hidden_dim)
        self.down_proj = nn.Linear(cfg.mlp_ratio * cfg.hidden_dim, cfg.hidden_dim)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(F.gelu(self.up_proj(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_dim)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """`GPT(cfg)(tokens)` maps (batch, seq) token ids to (batch, seq, vocab) logits."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = cfg or GPTConfig()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden_dim)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.hidden_dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_dim)
        self.lm_head = nn.Linear(cfg.hidden_dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2's initialisation (normal 0.02, zero biases); also used to materialise a meta-device model."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        if s > self.config.seq_len:
            raise ValueError(f"sequence of {s} tokens is longer than GPTConfig.seq_len={self.config.seq_len}.")
        pos = torch.arange(s, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)  # (b, s, h)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (b, s, vocab)


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, mean over all predicted positions."""
    # (b, s, v) -> (b * (s - 1), v) against the tokens shifted by one
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), tokens[:, 1:].reshape(-1))


def synthetic_tokens(batch: int, cfg: GPTConfig, *, step: int = 0, seed: int = 0) -> torch.Tensor:
    """A learnable synthetic corpus: each row starts at a random token and follows one fixed rule,
    next = (5 * token + 3) mod m over the first m = min(vocab, 257) tokens, so a model's loss falls
    quickly from ln(vocab): first to ln(m) (which tokens occur), then towards zero (the rule).

    Deterministic in (seed, step): every rank draws the same global batch and takes its own rows.
    """
    m = min(cfg.vocab_size, 257)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, m, (batch, 1), generator=gen)
    # token t = (a_t * start + b_t) mod m with a_0 = 1, b_0 = 0, a_{t+1} = 5 a_t, b_{t+1} = 5 b_t + 3
    a, b = [1], [0]
    for _ in range(cfg.seq_len - 1):
        a.append(5 * a[-1] % m)
        b.append((5 * b[-1] + 3) % m)
    return (torch.tensor(a) * start + torch.tensor(b)) % m  # (batch, seq_len)
