"""Model shapes that real scripts bring, small enough for the contract's two CPU processes.

``GPT`` is laid out as nanoGPT is: blocks in a ModuleList inside a ModuleDict
(``transformer.h.0``), the head's weight tied to the token embedding, and
``forward(idx, targets)`` returning ``(logits, loss)``. ``Output`` is the dict-with-attributes
shape of Hugging Face's ``ModelOutput``. ``BatchNormCNN`` carries running statistics, the
state that most often trains differently under a strategy.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, CONTEXT, WIDTH, HEADS, LAYERS = 32, 8, 16, 2, 2


class Output(dict):
    """A dict whose keys are also attributes, as ``transformers.utils.ModelOutput`` is."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError as error:
            raise AttributeError(name) from error


@dataclasses.dataclass
class ModelOutput(OrderedDict):
    """Hugging Face's output class itself, reduced: a dataclass and an ordered dict whose items are also attributes."""

    loss: Any = None
    logits: Any = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                self[f.name] = getattr(self, f.name)

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(WIDTH, 3 * WIDTH)
        self.c_proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        q, k, v = (t.view(batch, time, HEADS, -1).transpose(1, 2) for t in self.c_attn(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(batch, time, WIDTH))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's layout; ``output_object`` returns an ``Output`` instead of a tuple."""

    def __init__(self, output_object: bool = False, tied: bool = True) -> None:
        super().__init__()
        self.output_object = output_object
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(VOCAB, WIDTH),
                wpe=nn.Embedding(CONTEXT, WIDTH),
                h=nn.ModuleList(Block() for _ in range(LAYERS)),
                ln_f=nn.LayerNorm(WIDTH),
            )
        )
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:  # as nanoGPT and GPT-2 do
            self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(positions)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))
        if self.output_object:
            return Output(logits=logits) if loss is None else Output(loss=loss, logits=logits)
        return logits, loss


class BatchNormCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.classifier = nn.Linear(4 * 6 * 6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def tokens(n: int, seed: int = 5) -> torch.utils.data.TensorDataset:
    """Windows of a repeating sequence with noise: (idx, the next token at each position)."""
    g = torch.Generator().manual_seed(seed)
    idx = (torch.arange(CONTEXT + 1).repeat(n, 1) + torch.randint(0, VOCAB, (n, 1), generator=g)) % VOCAB
    return torch.utils.data.TensorDataset(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())


def images(n: int, seed: int = 7) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 6, 6, generator=g)
    return torch.utils.data.TensorDataset(x, (x.mean((1, 2, 3)) > 0).long())
