"""A small character-level GPT written for the course, whose attention can be switched at any time
between PyTorch's `F.scaled_dot_product_attention` and flashedu's drop-in
`flashedu.scaled_dot_product_attention`.

Pre-norm transformer blocks (LayerNorm, causal self-attention, a 4x GELU MLP), learned position
embeddings, trained on `flashedu/data/workshop.txt`, a short tale written for the course (about
9 KB). The point is the swap: the same weights and the same batches give the same losses either way,
so the tiled attention with its recomputing backward is a real drop-in inside a model that trains.

    text = load_text(); tok = CharTokenizer(text); data = tok.encode(text)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size), attention="flashedu")
    losses = train(model, data, steps=100)

Limits: a toy (about 0.1M parameters at the defaults), no dropout, no weight tying, CPU-sized; with
attention="flashedu" on a CPU every attention call runs the Python-looped `flashedu.torch_tiled`, so
it is slower than PyTorch's fused kernel.

Introduced in notebooks/05_pytorch_autograd.ipynb.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from importlib import resources

import torch
import torch.nn.functional as F
from torch import nn

from . import api

ATTENTION = {"sdpa": F.scaled_dot_product_attention, "flashedu": api.scaled_dot_product_attention}


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int = 64  # context length T
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64  # C; head size C // n_head


def load_text(name: str = "workshop.txt") -> str:
    """A text shipped in flashedu/data."""
    return resources.files("flashedu").joinpath("data", name).read_text(encoding="utf-8")


class CharTokenizer:
    """One token per distinct character of the text, in sorted order."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in s], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def split_heads(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """(B, T, C) -> (B, H, T, C // H): head h is channels h*hs .. (h+1)*hs - 1 of every position."""
    B, T, C = x.shape
    return x.view(B, T, n_head, C // n_head).transpose(1, 2)


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    """(B, H, T, hs) -> (B, T, H * hs), the inverse of `split_heads`."""
    B, H, T, hs = y.shape
    return y.transpose(1, 2).reshape(B, T, H * hs)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, attention: str):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.attention = attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(x.shape[-1], dim=2)  # (B, T, C) each
        q, k, v = (split_heads(t, self.n_head) for t in (q, k, v))  # (B, H, T, hs)
        y = ATTENTION[self.attention](q, k, v, is_causal=True)  # (B, H, T, hs)
        return self.proj(merge_heads(y))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, config: GPTConfig, attention: str):
        super().__init__()
        C = config.n_embd
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.attn = CausalSelfAttention(config, attention)
        self.mlp = nn.Sequential(nn.Linear(C, 4 * C), nn.GELU(), nn.Linear(4 * C, C))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT(config, attention="sdpa" | "flashedu"); forward(idx (B, T)) -> logits (B, T, vocab), loss
    or None."""

    def __init__(self, config: GPTConfig, attention: str = "sdpa"):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, attention) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)
        self.set_attention(attention)

    @property
    def attention(self) -> str:
        return self.blocks[0].attn.attention

    def set_attention(self, attention: str) -> "GPT":
        """Switch every layer to "sdpa" (PyTorch) or "flashedu"; the weights are untouched."""
        if attention not in ATTENTION:
            raise ValueError(
                f"GPT: attention must be one of {sorted(ATTENTION)}, got {attention!r}"
            )
        for block in self.blocks:
            block.attn.attention = attention
        return self

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(
                f"GPT: sequence length {T} exceeds block_size={self.config.block_size}"
            )
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, vocab)
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, *, generator: torch.Generator | None = None
    ):
        """Append `max_new_tokens` tokens to idx (B, T), sampling each from the softmax of the last
        logits."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size :])
            probs = torch.softmax(logits[:, -1].double(), dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx


def get_batch(data: torch.Tensor, block_size: int, batch_size: int, generator: torch.Generator):
    """Random windows of the token stream: inputs x (B, T) and next-token targets y (B, T)."""
    start = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    x = torch.stack([data[s : s + block_size] for s in start.tolist()])
    y = torch.stack([data[s + 1 : s + 1 + block_size] for s in start.tolist()])
    return x, y


def train(
    model: GPT,
    data: torch.Tensor,
    *,
    steps: int,
    batch_size: int = 16,
    lr: float = 3e-3,
    seed: int = 0,
) -> list[float]:
    """`steps` AdamW steps on batches drawn from `seed`; returns the training loss of each step."""
    generator = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        x, y = get_batch(data, model.config.block_size, batch_size, generator)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def compare_attention(
    model: GPT, data: torch.Tensor, *, steps: int, **train_kw
) -> dict[str, list[float]]:
    """Train two copies of `model` (same weights, same batches), one per attention; their losses by
    name."""
    return {
        name: train(copy.deepcopy(model).set_attention(name), data, steps=steps, **train_kw)
        for name in ATTENTION
    }
