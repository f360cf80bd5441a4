"""Small convolutional models shared by the memory and profile tests (BatchNorm buffers, residuals)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class ConvBlock(nn.Module):
    """conv 3x3 - BatchNorm - ReLU with a residual: BatchNorm's running statistics are updated in place by
    every training forward."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.bn(self.conv(x)))
