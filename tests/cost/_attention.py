"""A tiny self-attention layer (fused qkv, SDPA, residual) for the memory tests of compiled attention."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class TinyAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.hidden, self.heads, self.causal = hidden, heads, causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # (b, s, 3 hidden) -> (3, b, heads, s, head dim)
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.hidden // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return x + self.out(y.transpose(1, 2).reshape(b, s, self.hidden))
