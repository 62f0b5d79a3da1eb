"""A tiny decoder-only transformer written out in plain torch: embedding, RMSNorm, rotary
attention with grouped KV heads, gated MLP, tied embeddings. No third-party model code."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class DecoderConfig:
    vocab: int = 64
    hidden: int = 32
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 64
    seq: int = 8
    rope_theta: float = 10000.0
    eps: float = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.head_dim = cfg.hidden // cfg.heads
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * self.head_dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        cfg, hd = self.cfg, self.head_dim
        q = self.q_proj(x).view(b, t, cfg.heads, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, cfg.kv_heads, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, cfg.kv_heads, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = cfg.heads // cfg.kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) / hd**0.5
        mask = torch.full((t, t), float("-inf")).triu(1)
        probs = torch.softmax(scores + mask, dim=-1)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, cfg.heads * hd)
        return self.o_proj(out)


class GatedMLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.up = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden, cfg.eps)
        self.attn = Attention(cfg)
        self.norm2 = RMSNorm(cfg.hidden, cfg.eps)
        self.mlp = GatedMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class TinyDecoder(nn.Module):
    def __init__(self, cfg: DecoderConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or DecoderConfig()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.lm_head.weight = self.embed.weight  # tied embeddings

    def rotary(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        hd = self.cfg.hidden // self.cfg.heads
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
        freqs = torch.outer(torch.arange(t).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        cos, sin = self.rotary(ids.shape[1])
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))


def build(seed: int = 0, **overrides) -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(seed)
    cfg = DecoderConfig(**overrides)
    model = TinyDecoder(cfg).eval()
    return model, (torch.randint(0, cfg.vocab, (1, cfg.seq)),)


def calibration(batches: int = 4, seed: int = 1, vocab: int = 64, seq: int = 8) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (1, seq), generator=g),) for _ in range(batches)]


# Calibration sets a sweep compares (examples/sweep.toml names them): more batches, and a
# narrow one that sees only a few tokens (its ranges miss what other inputs reach).


def calibration_large() -> list:
    return calibration(batches=16, seed=3)


def calibration_narrow() -> list:
    return calibration(batches=4, seed=4, vocab=8)
