"""A small byte-level GPT and its data: the Python standard library's own source files.

The text ships with every Python installation, so the model-parallel examples, tests and
benchmarks train on real text with no download. The layer names follow the common
transformer layout (``attn.q/k/v/proj``, ``mlp.fc/proj``) that tensor-parallel plans name,
and ``forward`` runs a list of blocks, which a pipeline split cuts between.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256  # bytes
    context: int = 64
    width: int = 64
    heads: int = 4
    layers: int = 4


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.width // config.heads
        self.q = nn.Linear(config.width, config.width)
        self.k = nn.Linear(config.width, config.width)
        self.v = nn.Linear(config.width, config.width)
        self.proj = nn.Linear(config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q, k, v = (f(x).view(batch, time, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.width, 4 * config.width)
        self.proj = nn.Linear(4 * config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.width)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.width)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer over bytes; returns logits of shape (batch, time, vocab)."""

    def __init__(self, config: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.width)
        self.pos = nn.Embedding(config.context, config.width)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def next_byte_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of every position's next byte (the loss_fn for ``train_step``)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def stdlib_text(max_bytes: int = 2_000_000) -> torch.Tensor:
    """The standard library's .py files, in a fixed order, as a uint8 tensor of bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)


class ByteWindows(Dataset):
    """Non-overlapping windows of ``context`` bytes: sample i is (bytes, the same bytes shifted by one)."""

    def __init__(self, text: torch.Tensor, context: int) -> None:
        self.text, self.context = text.long(), context

    def __len__(self) -> int:
        return (len(self.text) - 1) // self.context

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.context
        return self.text[start : start + self.context], self.text[start + 1 : start + self.context + 1]


def splits(context: int = GPTConfig.context, max_bytes: int = 2_000_000, val_fraction: float = 0.1) -> tuple[ByteWindows, ByteWindows]:
    """Training and validation windows: the last ``val_fraction`` of the text is held out."""
    text = stdlib_text(max_bytes)
    cut = int(len(text) * (1 - val_fraction))
    return ByteWindows(text[:cut], context), ByteWindows(text[cut:], context)
