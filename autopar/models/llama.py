"""A small, plain Llama-architecture model (Llama 2 / 3 shapes) used by `autopar plan`'s built-in specs,
the tests and the benchmarks.

Like `autopar.models.gpt`, nothing in it knows about autopar, and it needs nothing beyond torch:
pre-norm blocks (RMSNorm) in an `nn.ModuleList` named `layers`, rotary position embeddings (RoPE),
grouped-query attention (GQA: `num_kv_heads` key/value heads shared by `num_heads` query heads) through
`F.scaled_dot_product_attention(..., is_causal=True)`, a SwiGLU MLP, and an output head that is not
tied to the token embedding (as in Llama 3).

`Llama(cfg)(tokens)` returns (batch, seq, vocab) logits; `Llama(cfg)(tokens, targets)` returns the mean
next-token cross-entropy instead (targets (batch, seq) are the tokens to predict at each position).
The model builds on the meta device (`with torch.device("meta"): Llama(cfg)`) and `reset_parameters()`
initialises it after `to_empty`. The RoPE angles are computed in the forward from the positions, so the
model holds no buffers to materialise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama model. The field names are the ones `autopar.profile` reads as shape facts."""

    vocab_size: int = 512
    seq_len: int = 128  # the longest sequence the model accepts
    num_layers: int = 4
    hidden_dim: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    ffn_dim: int = 344
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0  # Llama 3's RoPE base (Llama 2 used 10,000)
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "num_layers", "hidden_dim", "num_heads", "num_kv_heads", "ffn_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {value!r}.")
        if self.hidden_dim % self.num_heads:
            raise ValueError(f"LlamaConfig.hidden_dim={self.hidden_dim} must divide by num_heads={self.num_heads}.")
        if (self.hidden_dim // self.num_heads) % 2:
            raise ValueError(f"LlamaConfig: the head size hidden_dim / num_heads = {self.hidden_dim // self.num_heads} "
                             "must be even for rotary embeddings.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"LlamaConfig.num_heads={self.num_heads} must divide by num_kv_heads={self.num_kv_heads} "
                             "(each key/value head serves a whole group of query heads).")
        if not self.norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError("LlamaConfig.norm_eps and rope_theta must be positive.")

    @property
    def head_dim(self) -> int:
        return self.hidden_dim // self.num_heads

    @property
    def num_params(self) -> int:
        """Parameter count (a tied head counted once), for checking profiles exactly."""
        h, kv, f, v = self.hidden_dim, self.num_kv_heads * self.head_dim, self.ffn_dim, self.vocab_size
        block = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h  # q, o; k, v; gate, up, down; two norms
        head = 0 if self.tie_embeddings else v * h
        return v * h + self.num_layers * block + h + head


def rope_angles(seq_len: int, head_dim: int, theta: float, device: torch.device | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (seq_len, head_dim), the first half repeated: position p,
    pair i turns by p * theta^(-2i / head_dim) (Su et al. 2021)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (i, i + head_dim / 2) pair of x (batch, heads, seq, head_dim) by the angles: the "rotate
    half" layout of Hugging Face's Llama, x cos + rotate_half(x) sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_dim, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # (b, s, heads * head_dim) -> (b, heads, s, head_dim); -1 lets tensor parallelism split the heads
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # bf16 under autocast: no promotion to fp32
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.size(1) != q.size(1))
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) (Shazeer 2020)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden_dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.hidden_dim, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """`Llama(cfg)(tokens)` maps (batch, seq) token ids to (batch, seq, vocab) logits; with `targets`
    (batch, seq) it returns the mean cross-entropy of the logits against them."""

    def __init__(self, cfg: LlamaConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = cfg or LlamaConfig()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden_dim)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, 0.02) weights, the output projections scaled by 1/sqrt(2 layers) (GPT-2 / torchtitan
        style), unit norms. Also used to materialise a meta-device model."""
        std = 0.02
        out_std = std / (2 * self.config.num_layers) ** 0.5
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                last = name.rsplit(".", 1)[-1]
                nn.init.normal_(module.weight, std=out_std if last in ("o_proj", "down_proj") else std)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        b, s = tokens.shape
        if s > self.config.seq_len:
            raise ValueError(f"sequence of {s} tokens is longer than LlamaConfig.seq_len={self.config.seq_len}.")
        cos, sin = rope_angles(s, self.config.head_dim, self.config.rope_theta, device=tokens.device)
        x = self.tok_emb(tokens)  # (b, s, h)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))  # (b, s, vocab)
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, mean over all predicted positions (as autopar.models.gpt.lm_loss)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), tokens[:, 1:].reshape(-1))
