"""functionalize: a pure function, and the user's module left exactly as it was."""

from __future__ import annotations

import copy

import torch
from torch import nn

import fsdp_fn as ff
from examples.gpt import GPT, Block, GPTConfig
from tests.helpers import MLP


def snapshot(module: nn.Module):
    return (
        type(module),
        [(n, id(p), p.detach().clone()) for n, p in module.named_parameters()],
        {k: v.clone() for k, v in module.state_dict().items()},
        [type(p) for p in module.parameters()],
        [(type(m), dict(m._forward_hooks), dict(m._forward_pre_hooks)) for m in module.modules()],
    )


def same(a, b) -> bool:
    return (
        a[0] is b[0]
        and [(n, i) for n, i, _ in a[1]] == [(n, i) for n, i, _ in b[1]]
        and all(torch.equal(x, y) for (_, _, x), (_, _, y) in zip(a[1], b[1]))
        and a[2].keys() == b[2].keys()
        and all(torch.equal(a[2][k], b[2][k]) for k in a[2])
        and a[3] == b[3]
        and len(a[4]) == len(b[4])
        and all(x[0] is y[0] and len(x[1]) == len(y[1]) and len(x[2]) == len(y[2]) for x, y in zip(a[4], b[4]))
    )


def test_apply_equals_module():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 2))
    before = snapshot(m)
    fn = ff.functionalize(m)
    x = torch.randn(6, 3)
    ref = copy.deepcopy(m)(x)
    torch.testing.assert_close(fn(fn.params, fn.buffers, x), ref)
    assert set(fn.params) == {"0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"}
    assert set(fn.buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    assert fn.buffers["1.num_batches_tracked"].item() == 1  # the copies moved, the module did not
    assert same(before, snapshot(m))


def test_grad_through_apply():
    torch.manual_seed(0)
    m = MLP()
    fn = ff.functionalize(m)
    x = torch.randn(4, 7)
    grads = torch.func.grad(lambda p: fn(p, fn.buffers, x).square().sum())(fn.params)
    m(x).square().sum().backward()
    for name, p in m.named_parameters():
        torch.testing.assert_close(grads[name], p.grad)


def _module_untouched_by_training(group):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=37, seq=9, d_model=12, n_layers=2, n_heads=2, tie=True))
    before = snapshot(model)
    from examples.gpt import lm_loss

    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([Block])), group)
    step = ff.train_step(fn, lm_loss, ff.adamw(lr=0.1))
    state = step.init(params)
    for k in range(2):
        state, _ = step(state, torch.randint(0, 37, (2, 10), generator=torch.Generator().manual_seed(k)))
    moved = ff.unshard(state.params)["wte.weight"]
    return same(before, snapshot(model)) and not torch.equal(moved, model.wte.weight)


def test_module_untouched_by_sharded_training(pool):
    assert all(pool.run(_module_untouched_by_training, world=2))
