"""chunked_cross_entropy: F.cross_entropy(head(h)) to float32 rounding, one chunk of logits
live at a time, and inside the sharded train step the same training as one process, with
the same collectives as the unchunked loss."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import fsdp_fn as ff
from examples.gpt import GPT, Block, GPTConfig, lm_loss, lm_loss_chunked
from tests.helpers import local_part, reference_run

# float32: the chunked sums run in another order than F.cross_entropy's.
RTOL, ATOL = 1e-5, 1e-6
CFG = GPTConfig(vocab=40, seq=12, d_model=16, n_layers=2, n_heads=2)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def _problem(bias: bool, n: int = 5, t: int = 7, d: int = 16, v: int = 37):
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(d, v, bias=bias)
    hidden = torch.randn(n, t, d, generator=g, requires_grad=True)
    targets = torch.randint(0, v, (n, t), generator=g)
    targets[0, :3] = -100  # ignored rows
    return head, hidden, targets


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunks", [1, 3, 64])  # one chunk; chunks that do not divide the 35 rows; more than rows
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_loss_and_gradients_equal_cross_entropy(bias, chunks, reduction):
    head, hidden, targets = _problem(bias)
    inputs = [hidden, *head.parameters()]
    want = F.cross_entropy(head(hidden).flatten(0, 1), targets.flatten(), reduction=reduction)
    got = ff.chunked_cross_entropy(hidden, head, targets, chunks=chunks, reduction=reduction)
    _close(got, want)
    for a, b in zip(torch.autograd.grad(got, inputs), torch.autograd.grad(want, inputs), strict=True):
        _close(a, b)


def test_under_torch_func_grad_and_vjp_with_a_weight_tensor():
    head, hidden, targets = _problem(bias=True)
    w, b, h = head.weight.detach(), head.bias.detach(), hidden.detach()

    def chunked(w, b, h):
        return ff.chunked_cross_entropy(h, w, targets, bias=b, chunks=4)

    def plain(w, b, h):
        return F.cross_entropy(F.linear(h, w, b).flatten(0, 1), targets.flatten())

    for a, c in zip(torch.func.grad(chunked, (0, 1, 2))(w, b, h), torch.func.grad(plain, (0, 1, 2))(w, b, h)):
        _close(a, c)
    loss, pull = torch.func.vjp(chunked, w, b, h)
    _close(loss, plain(w, b, h))
    want = torch.func.grad(plain, (0, 1, 2))(w, b, h)
    for a, c in zip(pull(torch.tensor(2.0)), want, strict=True):
        _close(a, 2 * c)


def test_only_one_chunk_of_logits_is_live():
    rows, d, v, chunks = 512, 32, 1024, 8
    g = torch.Generator().manual_seed(0)
    w = torch.randn(v, d, generator=g).requires_grad_()
    h = torch.randn(rows, d, generator=g).requires_grad_()
    t = torch.randint(0, v, (rows,), generator=g)
    logits = rows * v * 4
    grads = (rows * d + v * d) * 4  # the gradients of h and w, which both ways produce

    def peak(loss_fn):
        with ff.MemoryMeter() as meter:
            loss_fn().backward()
        return meter.peak()["total"]

    plain = peak(lambda: F.cross_entropy(h @ w.t(), t))
    chunked = peak(lambda: ff.chunked_cross_entropy(h, w, t, chunks=chunks))
    assert plain >= 2 * logits  # the logits and their log-softmax (then their gradients)
    # One chunk's logits and its softmax gradient at most, besides the gradients themselves.
    assert chunked <= grads + 2 * logits // chunks + 64 * 1024, (chunked, plain)


def test_bad_inputs_are_named():
    head, hidden, targets = _problem(bias=False)
    with pytest.raises(ValueError, match="chunks must be a positive int"):
        ff.chunked_cross_entropy(hidden, head, targets, chunks=0)
    with pytest.raises(ValueError, match=r"targets \(5, 6\) must have hidden's shape"):
        ff.chunked_cross_entropy(hidden, head, targets[:, :6])
    with pytest.raises(TypeError, match="class indices"):
        ff.chunked_cross_entropy(hidden, head, targets.float())
    with pytest.raises(ValueError, match=r"weight \(16, 37\)"):
        ff.chunked_cross_entropy(hidden, head.weight.t(), targets)
    with pytest.raises(TypeError, match="nn.Linear or its weight"):
        ff.chunked_cross_entropy(hidden, torch.nn.Sequential(head), targets)
    with pytest.raises(ValueError, match="bias comes from the head module"):
        ff.chunked_cross_entropy(hidden, head, targets, bias=torch.zeros(37))
    assert "forward" not in head.__dict__  # the module is left as it was, also after a refused call


# --- inside the sharded train step ---------------------------------------------------------------


def _batches(world: int) -> list[torch.Tensor]:
    return [
        torch.randint(0, CFG.vocab, (2 * world, CFG.seq + 1), generator=torch.Generator().manual_seed(k))
        for k in range(2)
    ]


def _chunked_loss(model: Any, batch: torch.Tensor) -> torch.Tensor:
    return lm_loss_chunked(model, batch, chunks=5)  # 5 does not divide a rank's 12 x 2 rows


def _train(group, cfg: GPTConfig, loss_fn: Any, remat: bool) -> dict[str, Any]:
    """Two sharded steps (split root: the head is a unit of its own) with torch's SGD."""
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = GPT(cfg)
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([Block]), split_root=True)
    params = ff.shard(fn.params, plan, group)
    opt = ff.from_torch(torch.optim.SGD(list(params.values()), lr=0.5))
    step = ff.train_step(fn, loss_fn, opt, schedule=ff.Schedule(), remat=remat or None)
    state = step.init(params)
    losses, logs = [], []
    for batch in _batches(world):
        with ff.comm_log() as log:
            state, metrics = step(state, local_part(batch, rank, world))
        losses.append(float(metrics["loss"]))
        logs.append(Counter((c.op, c.unit, c.numel) for c in log.records))
    return {"losses": losses, "logs": logs, "params": ff.unshard(state.params), "plan": plan}


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("remat", [False, True])
def test_train_step_matches_one_process_with_the_same_collectives(pool, tie, remat):
    cfg = GPTConfig(**{**CFG.__dict__, "tie": tie})
    world = 2
    chunked = pool.run(_train, cfg, _chunked_loss, remat, world=world)
    plain = pool.run(_train, cfg, lm_loss, remat, world=world)
    torch.manual_seed(0)
    # One process, F.cross_entropy on the whole logits. SGD, not AdamW: Adam's first steps divide
    # by the gradient's own size, so a gradient that is zero but for rounding (the attention's key
    # bias) would move by +-lr either way, and the parameters would compare rounding noise.
    want = reference_run(GPT(cfg), lm_loss, _batches(world), lambda ps: torch.optim.SGD(ps, lr=0.5))
    got = chunked[0]
    assert "head" in got["plan"].unit_names or tie  # the head is gathered as a unit (with tie: with wte)
    for a, b in zip(got["losses"], want["losses"], strict=True):
        assert a == pytest.approx(b, rel=RTOL, abs=ATOL)
    for name, p in want["params"].items():
        _close(got["params"][name], p)
    for c, p in zip(chunked, plain, strict=True):  # every rank, every step: the same collectives
        assert c["logs"] == p["logs"]
