"""Gradient norms and clipping stay exact where a float32 sum over a flat shard drifts.

A unit of 4.2M parameters (2.1M per rank at W=2): one long float32 ``vector_norm`` of such
a shard is off by ~1e-4 relative. The step's norm must match the float64 norm of the
unsharded gradient, and its clipping torch's (``clip_grads_with_norm_``) given that norm.
torch's own ``clip_grad_norm_`` cannot be the reference at this size on CPU: its float32 norm
of one 4.2M-element parameter is itself off by ~1e-4.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fsdp_fn as ff
from fsdp_fn._norms import square_norm
from tests.helpers import MLP, batch_for, local_part, mse_loss, rel

WIDTHS = (1024, 4096, 8)  # the first unit: 1024 x 4096 + 4096 = 4.2M parameters
STEPS = 2
LR = 0.5


@pytest.mark.parametrize("numel", [0, 1, 511, 512, 5_000_003])
def test_square_norm_is_exact_at_any_size(numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 1e-3 + 1e-4
    exact = x.double().square().sum().item()
    got = square_norm(x)
    assert got.dtype == torch.float64 and got.dim() == 0
    # One row: its fp32 rounding (~1e-7); millions of rows: the roundings cancel.
    assert abs(got.item() - exact) <= (1e-9 if numel > 10**6 else 2.5e-7) * exact
    if numel > 10**6:  # the size where one float32 sum drifts: the test can tell the two apart
        assert rel(torch.linalg.vector_norm(x).double().square().item(), exact) > 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_square_norm_accumulates_low_precision_in_float32_and_keeps_float64(dtype):
    x = (torch.randn(3_000_001, generator=torch.Generator().manual_seed(0)) * 1e-2).to(dtype)
    exact = x.double().square().sum().item()
    tol = 1e-12 if dtype == torch.float64 else 1e-7
    assert rel(square_norm(x).item(), exact) <= tol


def _reference(model: nn.Module, batches, clip: float | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the global batch: float64 gradient norms, torch's clipping and SGD."""
    model = copy.deepcopy(model)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=LR)
    norms = []
    for b in batches:
        opt.zero_grad()
        mse_loss(model, b).backward()
        norm = torch.sqrt(sum(p.grad.double().square().sum() for p in params))
        norms.append(norm.item())
        if clip is not None:
            torch.nn.utils.clip_grads_with_norm_(params, clip, norm.float())
        opt.step()
    return norms, {k: v.detach() for k, v in model.named_parameters()}


def _train(group, clip: float | None):
    torch.manual_seed(0)
    model = MLP(WIDTHS, act=nn.Tanh)
    world, rank = group.size(), group.rank()
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([nn.Linear]))
    opt = ff.sgd(lr=LR) if clip is None else ff.chain(ff.clip_by_global_norm(clip), ff.sgd(lr=LR))
    step = ff.train_step(fn, mse_loss, opt)
    state = step.init(ff.shard(fn.params, plan, group))
    batches = [batch_for("mlp", model, k, size=8) for k in range(STEPS)]
    norms = []
    for b in batches:
        state, metrics = step(state, local_part(b, rank, world))
        norms.append(metrics["grad_norm"].item())
    full = ff.unshard(state.params)
    if rank != 0:
        return None
    assert max(u.numel for u in plan.units) > 4 * 10**6  # units of several million elements
    ref_norms, ref_params = _reference(model, batches, clip)
    start = dict(model.named_parameters())
    # Relative error of the update each parameter received (all of it comes from the gradient).
    update = max(((full[k] - v).norm() / (v - start[k].detach()).norm()).item() for k, v in ref_params.items())
    return {"norm": max(rel(a, b) for a, b in zip(norms, ref_norms)), "update": update, "ref_norms": ref_norms}


@pytest.mark.parametrize("clip", [None, 2.0])
def test_grad_norm_and_clipping_match_torch_on_units_of_millions(pool, clip):
    out = pool.run(_train, clip, world=2)[0]
    assert out["norm"] < 1e-6  # float32 output; a float32 sum per shard is off by ~1e-5 here
    if clip is not None:
        assert min(out["ref_norms"]) > 2 * clip  # clipping really scaled every step
    assert out["update"] < 1e-5
