"""Cross entropy over a linear output head, a chunk of rows at a time.

A language model's loss head is ``F.cross_entropy(head(h), targets)``: its logits
(rows x vocabulary), their log-softmax and, in backward, their gradients are the largest
activations of a step. ``chunked_cross_entropy`` computes the same loss and gradients
without ever holding them whole: the forward keeps only each row's log-sum-exp, the
backward recomputes the logits of one chunk of rows at a time and turns them into that
chunk's gradient at once. It is an ``autograd.Function`` with a separate
``setup_context``, so it runs under plain autograd and inside ``torch.func.grad``/``vjp``
(fsdp_fn's train step). Given the head module, it runs inside one call of that module, so
in a train step the head's unit is gathered once, as for an ordinary forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import nn
from torch.autograd.function import FunctionCtx

Reduction = Literal["mean", "sum"]


def _row_chunks(n: int, chunks: int) -> Iterator[slice]:
    size = -(-n // chunks) if n else 1
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One chunk's logits, in float32 (the head's own dtype for its matrix product)."""
    out = hidden @ weight.t() if bias is None else torch.addmm(bias, hidden, weight.t())
    return out.float()


class _ChunkedCrossEntropy(torch.autograd.Function):
    """(hidden (N, D), weight (V, D), bias (V) or None, targets (N)) -> (loss, log-sum-exp per row)."""

    @staticmethod
    def forward(
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunks: int,
        ignore_index: int,
        reduction: Reduction,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for rows in _row_chunks(hidden.shape[0], chunks):
            logits = _logits(hidden[rows], weight, bias)
            lse[rows] = torch.logsumexp(logits, dim=-1)
            t = targets[rows]
            valid = t != ignore_index
            picked = logits.gather(1, torch.where(valid, t, 0).unsqueeze(1)).squeeze(1)
            total += torch.where(valid, lse[rows] - picked, 0.0).sum()
            del logits  # before the next chunk's: one chunk's logits live at a time
        if reduction == "mean":
            total = total / (targets != ignore_index).sum()
        return total.to(torch.promote_types(hidden.dtype, weight.dtype)), lse

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple[Any, ...], output: Any) -> None:
        hidden, weight, bias, targets, chunks, ignore_index, reduction = inputs
        lse = output[1]
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        ctx.chunks, ctx.ignore_index, ctx.reduction = chunks, ignore_index, reduction  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor | None, _: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if grad_loss is None:  # the loss was not used
            return (None,) * 7
        valid = targets != ctx.ignore_index
        scale = grad_loss.float()
        if ctx.reduction == "mean":
            scale = scale / valid.sum()
        # Gradients of the weight and bias add up over chunks: in float32 when the head computes lower.
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        for rows in _row_chunks(hidden.shape[0], ctx.chunks):
            h, ok = hidden[rows], valid[rows]
            # d loss / d logits = softmax - one_hot(target), per valid row, times the scale.
            g = _logits(h, weight, bias).sub_(lse[rows].unsqueeze(1)).exp_()
            g[torch.arange(g.shape[0], device=g.device), torch.where(ok, targets[rows], 0)] -= 1.0
            g.mul_(torch.where(ok, scale, 0.0).unsqueeze(1))
            if grad_b is not None:
                grad_b += g.sum(0)
            g = g.to(hidden.dtype)
            if grad_h is not None:
                grad_h[rows] = g @ weight.to(hidden.dtype)
            if grad_w is not None:
                grad_w.addmm_(g.t().to(acc), h.to(acc))
            del g
        return (
            grad_h,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            grad_b.to(bias.dtype) if grad_b is not None else None,
            None,
            None,
            None,
            None,
        )


def _check(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor) -> None:
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"chunked_cross_entropy: hidden {tuple(hidden.shape)} does not fit the head's weight "
            f"{tuple(weight.shape)}: the weight must be (vocabulary, hidden size {hidden.shape[-1]})"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"chunked_cross_entropy: bias {tuple(bias.shape)} must be ({weight.shape[0]},)")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(f"chunked_cross_entropy: targets must be class indices (integers), got {targets.dtype}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"chunked_cross_entropy: targets {tuple(targets.shape)} must have hidden's shape without its last "
            f"dimension, {tuple(hidden.shape[:-1])}"
        )


def chunked_cross_entropy(
    hidden: torch.Tensor,
    head: nn.Linear | torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunks: int = 8,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """Compute ``F.cross_entropy(head(hidden), targets)`` without the whole logits ever existing.

    Loss and gradients equal the unchunked ones to float32 rounding (the sums run in
    another order); the logits are computed in the head's dtype and reduced in float32.

    Memory: the rows are split into ``chunks`` parts; forward and backward each hold one
    part's logits (``N / chunks x V``, float32) and its softmax at a time; the forward
    keeps one float per row for the backward (plus ``hidden``, the weight and the targets,
    which it references). Compute: the backward recomputes the logits, one matrix product
    more than ``F.cross_entropy`` (four instead of three). Communication: none of its own.
    With the module, the whole loss runs as one call of ``head`` (the module's ``forward``
    is replaced for that call and restored after; its hooks run as usual): in a train
    step the head's unit is gathered once in forward and once in backward, as without
    chunking. With the weight, use one that is already gathered (under fsdp_fn, read it
    inside a forward of the unit that holds it). Reverse-mode only (``torch.func.grad``,
    ``vjp``, ``.backward()``); not ``jvp`` or ``vmap``.

    Args:
        hidden: the head's input, ``(..., D)``.
        head: an ``nn.Linear`` (D -> V), or its weight ``(V, D)``.
        targets: class indices (integers), ``hidden``'s shape without ``D``.
        bias: the head's bias ``(V,)``, only when ``head`` is a weight tensor.
        chunks: how many parts the rows are split into (a positive int).
        ignore_index: rows whose target is this count for nothing.
        reduction: ``"mean"`` over the rows not ignored, or ``"sum"``.

    Returns:
        The loss, a scalar tensor in the promoted dtype of ``hidden`` and the head's weight.

    Raises:
        ValueError: if ``chunks`` is not a positive int, ``reduction`` is neither
            ``"mean"`` nor ``"sum"``, ``bias`` is given with a module head, or the shapes of
            ``hidden``, the weight, the bias and ``targets`` do not fit together.
        TypeError: if ``head`` is neither an ``nn.Linear`` nor a tensor, or ``targets`` are
            not integers.

    Examples:
        >>> import torch, torch.nn.functional as F
        >>> head = torch.nn.Linear(4, 10)
        >>> h, t = torch.randn(6, 4), torch.randint(0, 10, (6,))
        >>> loss = chunked_cross_entropy(h, head, t, chunks=3)
        >>> torch.allclose(loss, F.cross_entropy(head(h), t))
        True
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunked_cross_entropy: chunks must be a positive int, got {chunks!r}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"chunked_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")

    def loss_of(h: torch.Tensor, weight: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        _check(h, weight, b, targets)
        flat = h.reshape(-1, h.shape[-1])
        out: torch.Tensor = _ChunkedCrossEntropy.apply(
            flat, weight, b, targets.reshape(-1), chunks, ignore_index, reduction
        )[0]
        return out

    if isinstance(head, torch.Tensor):
        return loss_of(hidden, head, bias)
    if not isinstance(head, nn.Linear):
        raise TypeError(
            f"chunked_cross_entropy: head must be an nn.Linear or its weight tensor, got {type(head).__name__}; "
            "for another head pass its (vocabulary, hidden) weight, read where it is gathered"
        )
    if bias is not None:
        raise ValueError("chunked_cross_entropy: bias comes from the head module; pass it only with a weight tensor")

    def of_head(h: torch.Tensor) -> torch.Tensor:
        if head.weight.shape[0] != head.out_features:  # (its module says the whole vocabulary)
            raise ValueError(
                f"chunked_cross_entropy: the head's weight holds {head.weight.shape[0]} of its {head.out_features} "
                "rows (a tensor-parallel piece of the vocabulary): a loss over them would be another loss; give "
                "the head the style 'vocab_parallel' and take fsdp_fn.tp.parallel_cross_entropy of its logits"
            )
        return loss_of(h, head.weight, head.bias)

    loss: torch.Tensor = _call_as(head, of_head, hidden)
    return loss


_MISSING = object()


def _call_as(module: nn.Module, forward: Any, *args: Any) -> Any:
    """``module(*args)`` with ``forward`` as its forward for this one call: the module's hooks
    (fsdp_fn's gather and free, FSDP2's unshard) run around it, its parameters are what
    they are inside a call."""
    own = module.__dict__.get("forward", _MISSING)
    module.forward = forward
    try:
        return module(*args)
    finally:
        if own is _MISSING:
            del module.forward
        else:
            module.forward = own
