"""A small GPT-style language model (a plain nn.Module) and text that needs no download."""

from __future__ import annotations

import math
import pathlib
import sysconfig
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_fn import chunked_cross_entropy


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    tie: bool = False  # share the token embedding with the output head
    tp_ready: bool = False  # qkv's outputs by head (a split of its rows holds whole heads): see TP_PLAN


# Tensor parallelism (``ff.make_plan(model, policy, tp=model._tp_plan, mesh=mesh)``, on a model made
# with ``GPTConfig(tp_ready=True)``), in Hugging Face's words: each block's attention and MLP split
# Megatron's way, the vocabulary split over the embedding's rows and the head's outputs.
TP_PLAN = {
    "wte": "embedding_rowwise",
    "blocks.*.qkv": "colwise",
    "blocks.*.proj": "rowwise",
    "blocks.*.fc": "colwise",
    "blocks.*.out": "rowwise",
    "head": "colwise_gather_output",
}


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.tp_ready = cfg.n_heads, cfg.d_model // cfg.n_heads, cfg.tp_ready
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_ready:
            return self._forward_tp_ready(x)
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))

    def _forward_tp_ready(self, x: torch.Tensor) -> torch.Tensor:
        # qkv's outputs are (head, q/k/v, head_dim): a split of its rows holds whole heads, and
        # the head count is -1 (what this rank holds under tensor parallelism); the shapes are
        # the tensors' own (under sequence parallelism x holds a piece of the sequence, qkv all of it).
        h = self.qkv(self.ln1(x))
        q, k, v = h.view(*h.shape[:2], -1, 3, self.head_dim).unbind(3)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).flatten(2))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    _tp_plan = TP_PLAN

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        if cfg.tie:
            self.head.weight = self.wte.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("weight"):
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, chunks: int = 8) -> torch.Tensor:
        """The logits; with ``targets``, the next-token loss instead, computed over ``chunks``
        slices of the rows so that the whole logits never exist (``chunked_cross_entropy``)."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        if targets is not None:
            return chunked_cross_entropy(self.ln_f(x), self.head, targets, chunks=chunks)
        return self.head(self.ln_f(x))


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Next-token cross-entropy; ``batch`` is (B, T+1) tokens."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def lm_loss_chunked(model, batch: torch.Tensor, chunks: int = 8) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """``lm_loss`` with the loss computed inside the model, ``chunks`` slices of the rows at a
    time: the same loss and gradients, without the (B*T, vocab) logits and their gradient."""
    return model(batch[:, :-1], batch[:, 1:], chunks=chunks)  # type: ignore[no-any-return]


def stdlib_text(max_bytes: int = 4 << 20) -> bytes:
    """Python's own standard library source: real text on every machine, no download."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


def token_windows(text: bytes, indices: range, seq: int, seed: int) -> torch.Tensor:
    """Windows of ``seq + 1`` byte tokens, one per global sample index in ``indices``: sample
    ``n`` is the same window whatever the world size or step it falls in, so a run resumed at
    another world size reads on from where it stopped, no sample seen twice."""
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    starts = [
        int(torch.randint(0, data.numel() - seq - 1, (1,), generator=torch.Generator().manual_seed(seed * 2**40 + n)))
        for n in indices
    ]
    return torch.stack([data[s : s + seq + 1] for s in starts])


def token_batches(text: bytes, batch: int, seq: int, seed: int) -> torch.Tensor:
    """Random windows of ``seq + 1`` byte tokens, (batch, seq + 1), from a seeded generator."""
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
    return torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
