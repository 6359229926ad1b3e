"""Rematerialisation: exact gradients inside torch.func, saving policies, the Remat value,
and torch.utils.checkpoint routed through it. Single process: remat communicates nothing."""

from __future__ import annotations

import functools
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.func import functional_call, grad, grad_and_value, vjp
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_fn as ff
from examples.gpt import GPT, Block, GPTConfig
from tests.helpers import tiny_llama

POLICIES = [ff.save_nothing, ff.save_dots]


def detached(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in module.named_parameters()}


def equal(a: Any, b: Any) -> bool:
    """Two pytrees of tensors, bitwise."""
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb, strict=True))


class OpCount(TorchDispatchMode):
    """How many times each aten operator is dispatched (i.e. actually computed) in the block."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        key = str(func.overloadpacket)
        self.counts[key] = self.counts.get(key, 0) + 1
        return func(*args, **(kwargs or {}))

    def dots(self) -> int:
        return sum(self.counts.get(k, 0) for k in ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm"))


# --- the primitive: exact gradients -------------------------------------------------------------------


def mlp_with_dropout() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.GELU(), nn.Dropout(0.3), nn.Linear(13, 5)), torch.randn(6, 7)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_mlp_gradients_bitwise_under_grad_vjp_and_grad_and_value(policy: ff.SavePolicy) -> None:
    model, x = mlp_with_dropout()
    params = detached(model)

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, policy: ff.SavePolicy | None) -> torch.Tensor:
        def f(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            return functional_call(model, p, (x,))

        return (ff.remat(f, policy) if policy else f)(p, x).square().sum()

    def seeded(transform: Any, policy: ff.SavePolicy | None) -> Any:
        torch.manual_seed(1)  # the same dropout masks in both runs
        return transform(loss, argnums=(0, 1))(params, x, policy)

    for transform in (grad, grad_and_value):
        assert equal(seeded(transform, None), seeded(transform, policy))

    def pulled(policy: ff.SavePolicy | None) -> Any:
        torch.manual_seed(1)
        out, pull = vjp(lambda p, x: loss(p, x, policy), params, x)
        return out, pull(torch.ones(()))

    assert equal(pulled(None), pulled(policy))


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_gpt_block_with_dropout_bitwise_and_rng_replayed(policy: ff.SavePolicy) -> None:
    torch.manual_seed(0)
    block = Block(GPTConfig(d_model=32, n_heads=4, seq=16))
    params, x = detached(block), torch.randn(2, 16, 32)

    def f(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return F.dropout(functional_call(block, p, (x,)), 0.2)

    def run(g: Any) -> tuple[Any, torch.Tensor]:
        torch.manual_seed(1)
        out, pull = vjp(lambda p, x: g(p, x).square().sum(), params, x)
        grads = pull(torch.ones(()))
        return (out, grads), torch.get_rng_state()

    (plain, rng_plain), (rematted, rng_remat) = run(f), run(ff.remat(f, policy))
    assert equal(plain, rematted)
    # The recomputation replays the generator and puts it back: what follows draws the same numbers.
    assert torch.equal(rng_plain, rng_remat)


def test_different_masks_would_change_the_gradient() -> None:
    """The bitwise tests above could fail: without the RNG replay the masks differ."""
    model, x = mlp_with_dropout()
    params = detached(model)
    f = ff.remat(lambda p, x: functional_call(model, p, (x,)))
    torch.manual_seed(1)
    a = grad(lambda p: f(p, x).sum())(params)
    b = grad(lambda p: f(p, x).sum())(params)  # the generator moved on: other masks
    assert not equal(a, b)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_module_under_plain_autograd(policy: ff.SavePolicy) -> None:
    """remat(module): the module's parameters are inputs of the region; .grad is filled as without remat."""
    model, x = mlp_with_dropout()
    grads = []
    for wrap in (lambda m: m, lambda m: ff.remat(m, policy)):
        model.zero_grad()
        torch.manual_seed(1)
        wrap(model)(x).square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
    assert equal(grads[0], grads[1])


def test_nested_regions() -> None:
    """A region that rematerialises another inside it (a checkpointed model whose layers checkpoint)."""
    model, x = mlp_with_dropout()
    params = detached(model)

    def outer(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        inner = ff.remat(lambda p, x: functional_call(model, p, (x,)), ff.save_dots)
        return inner(p, x).tanh() + inner(p, x)

    def run(f: Any) -> Any:
        torch.manual_seed(1)
        return grad(lambda p: f(p, x).square().sum())(params)

    assert equal(run(outer), run(ff.remat(outer)))


def test_pytree_arguments_kwargs_and_outputs() -> None:
    torch.manual_seed(0)
    w, b = torch.randn(4, 3), torch.randn(3)
    idx = torch.tensor([1, 0])

    def f(inp: dict[str, Any], scale: float, *, bias: torch.Tensor, mode: str) -> dict[str, Any]:
        assert mode == "sum"
        y = torch.tanh(inp["x"] @ inp["w"] + bias) * scale
        return {"y": y, "pair": (y[idx], y.sum()), "argmax": y.argmax(), "note": "ok", "none": None}

    def loss(fn: Any, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = fn({"x": torch.ones(2, 4), "w": w}, 0.5, bias=b, mode="sum")
        return out["y"].sum() + out["pair"][0].square().sum() + out["pair"][1]

    assert equal(*(grad(functools.partial(loss, fn), argnums=(0, 1))(w, b) for fn in (f, ff.remat(f))))
    out = ff.remat(f)({"x": torch.ones(2, 4), "w": w}, 0.5, bias=b, mode="sum")
    assert out["note"] == "ok" and out["none"] is None and out["argmax"].dtype == torch.int64
    assert equal(out["y"], f({"x": torch.ones(2, 4), "w": w}, 0.5, bias=b, mode="sum")["y"])


def test_input_returned_as_is() -> None:
    x = torch.randn(3)
    g = grad(lambda x: ff.remat(lambda x: (x, x.sin()))(x)[0].sum() + ff.remat(lambda x: x)(x).sum())(x)
    assert torch.equal(g, torch.full((3,), 2.0))


def test_inputs_saved_by_reference() -> None:
    """The forward keeps the inputs themselves, not copies: a runtime that frees and refills an
    input's storage in place (fsdp_fn's gathered units) is seen by the recomputation."""
    flat = torch.randn(12, requires_grad=True)
    out = ff.remat(lambda f, x: torch.tanh(x @ f.view(4, 3)))(flat, torch.randn(2, 4))
    saved = out.grad_fn.saved_tensors  # type: ignore[union-attr]
    assert len(saved) == 2 and saved[0].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


class _Refill(torch.autograd.Function):
    """Identity whose backward refills ``buffer``'s storage (freed after forward) from ``copy``."""

    @staticmethod
    def forward(buffers: types.SimpleNamespace, out: torch.Tensor) -> torch.Tensor:
        return out.view_as(out)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.buffers = inputs[0]  # plain tensors in an object torch.func does not look into

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        buffer, copy = ctx.buffers.buffer, ctx.buffers.copy
        with torch._C._DisableFuncTorch():
            buffer.untyped_storage().resize_(copy.untyped_storage().nbytes())
            buffer.untyped_storage().copy_(copy.untyped_storage())
        return None, grad


def test_outputs_not_kept_alive_by_the_region() -> None:
    """The region holds its inputs, never its outputs: while the graph lives (the loss is
    alive), an output its consumer does not save is freed (a rematerialised output head's logits)."""
    x = torch.randn(1000, requires_grad=True)
    out = ff.remat(lambda x: (x * 2.0, x.sum()))(x)[0]
    alive = torch.utils.weak.WeakTensorKeyDictionary()
    alive[out] = True
    loss = out.sum()  # sum saves nothing
    del out
    assert len(alive) == 0
    loss.backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))  # type: ignore[arg-type]


def test_input_storage_freed_after_forward_and_refilled_before_backward() -> None:
    """How fsdp_fn's unit runtime uses remat: the gathered flat buffer is freed after the
    region's forward and refilled before its backward; gradients stay exact."""
    torch.manual_seed(0)
    shard, x = torch.randn(24), torch.randn(5, 4)

    def runner(flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ flat[:12].view(4, 3)) @ flat[12:].view(3, 4)

    def loss(shard: torch.Tensor, free: bool) -> torch.Tensor:
        flat = shard * 2.0  # the "gathered" buffer: an autograd output
        out = ff.remat(runner)(flat, x)
        if free:
            plain = flat
            while torch._C._functorch.is_functorch_wrapped_tensor(plain):
                plain = torch._C._functorch.get_unwrapped(plain)
            with torch._C._DisableFuncTorch():
                copy = plain.clone()
                plain.untyped_storage().resize_(0)
            out = _Refill.apply(types.SimpleNamespace(buffer=plain, copy=copy), out)
        return out.square().sum()

    assert equal(grad(loss)(shard, False), grad(loss)(shard, True))


# --- the primitive: refusals ------------------------------------------------------------------------------


def test_captured_tensor_that_requires_grad_is_refused() -> None:
    w, x = torch.randn(4, 3), torch.randn(2, 4)
    with pytest.raises(ff.RematError, match=r"shape \(4, 3\).*requires grad but is not an argument"):
        grad(lambda w: ff.remat(lambda x: (x @ w).sum())(x))(w)
    lin = nn.Linear(4, 3)
    with pytest.raises(ff.RematError, match=r"remat the module itself"):
        ff.remat(lambda x: lin(x))(x)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch.func.jvp's import
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_every_transform_matches_the_plain_function(policy: ff.SavePolicy) -> None:
    """vmap (per-sample gradients, dropout with randomness='different'), jvp, jacfwd/jacrev
    Hessians, forward-over-reverse Hessian-vector products and plain double backward: remat
    changes no result. ``g`` runs two products, one with a bias: a tangent's products pass
    through the recomputation too, and once took the kept results of the primal's (a wrong
    Hessian-vector product under ``save_dots``, silently; ``hessian`` raised)."""
    torch.manual_seed(0)
    w, x, b = torch.randn(3, 3), torch.randn(4, 3), torch.randn(3)

    def f(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(torch.tanh(x @ w), 0.5).sum()

    def g(w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.addmm(b, torch.tanh(x @ w), w)).square().sum()

    def results(f: Any, g: Any) -> list[Any]:
        torch.manual_seed(1)
        out = [torch.func.vmap(grad(f), in_dims=(None, 0), randomness="different")(w, x)]
        out.append(torch.func.jvp(g, (w,), (torch.ones_like(w),)))
        out.append(torch.func.jacfwd(torch.func.jacrev(g))(w))
        out.append(torch.func.jacrev(torch.func.jacrev(g))(w))
        out.append(torch.func.jvp(grad(g), (w,), (torch.ones_like(w),)))
        out.append(torch.func.hessian(g)(w))
        leaf = w.clone().requires_grad_()
        (first,) = torch.autograd.grad(g(leaf), leaf, create_graph=True)
        out.append(torch.autograd.grad(first.sum(), leaf))
        return out

    assert equal(results(f, g), results(ff.remat(f, policy), ff.remat(g, policy)))


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="remat wants a callable"):
        ff.remat(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="SavePolicy"):
        ff.remat(torch.sin, policy="dots")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="aten operators"):
        ff.SavePolicy("mine", frozenset({torch.mm}))


def conv_bn() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2))
    return model, torch.randn(5, 3, 4, 4)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_buffers_changed_in_place_move_once_as_without_remat(policy: ff.SavePolicy) -> None:
    """BatchNorm's running statistics and batch counter: the recomputation starts from their
    values before the forward and its own changes are dropped (before, they moved twice)."""
    results = []
    for wrap in (lambda f: f, lambda f: ff.remat(f, policy)):
        model, x = conv_bn()
        wrap(model)(x).square().sum().backward()  # plain autograd: a module as the region
        grads = [p.grad for p in model.parameters()]
        params, buffers = detached(model), {k: v.clone() for k, v in model.named_buffers()}
        g = grad(wrap(lambda p, b, m=model, x=x: functional_call(m, {**p, **b}, (x,)).square().sum()))(params, buffers)
        results.append((grads, dict(model.named_buffers()), g, buffers))
    assert equal(results[0], results[1])
    assert results[0][3]["1.num_batches_tracked"].item() == 2  # each pass moved the statistics once


def test_a_write_through_a_view_of_an_input_happens_once() -> None:
    def f(w: torch.Tensor, counts: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        counts[1:].add_(1)  # a view of the input, changed in place
        return (w * x * counts[2]).sum()

    results = []
    for wrap in (lambda f: f, ff.remat):
        counts = torch.zeros(3)
        g = grad(wrap(f))(torch.ones(2), counts, torch.arange(2.0))
        results.append((g, counts))
    assert equal(results[0], results[1])
    assert results[1][1].tolist() == [0.0, 1.0, 1.0]


class RunningMean(nn.Module):
    """Normalises by a running mean of its inputs, updated under ``no_grad`` (an observation
    normaliser): state made from a region input that needs a gradient, kept in a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mu", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.mu.mul_(0.5).add_(0.5 * x.mean(0))
        return torch.tanh(self.lin(x - self.mu))


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_a_buffer_written_from_the_inputs_is_state_not_a_kept_tensor(policy: ff.SavePolicy) -> None:
    """A write into a buffer the region reads is state, moved once as without remat; only a new
    tensor kept outside the outputs is refused (a buffer written in place was, falsely)."""
    x = torch.randn(3, 4, requires_grad=True)
    results = []
    for wrap in (lambda m: m, lambda m: ff.remat(m, policy)):
        torch.manual_seed(0)
        module = RunningMean()
        grads = torch.autograd.grad(wrap(module)(x).square().sum(), (x, *module.parameters()))
        results.append((grads, module.mu.clone()))
    assert equal(results[0], results[1])


def test_an_input_no_output_comes_from_gets_no_gradient_under_vmap() -> None:
    """Under a vmap the backward differentiates the recomputation with torch.func, whose vjp
    hands zeros to an input no output came from: autograd's None instead, as without remat
    (a train step would otherwise step an unused parameter); an input that reaches the
    output only through an in-place write into a view still gets its gradient."""
    a, b, unused = (torch.randn(3, requires_grad=True) for _ in range(3))

    def f(x: torch.Tensor, y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        z = x * 1.0
        z.view(-1).add_(y)
        return z

    for fn in (f, ff.remat(f)):
        out = torch.func.vmap(lambda x, fn=fn: fn(x, b, unused).sum())(torch.stack([a, 2 * a]))
        ga, gb, gu = torch.autograd.grad(out.sum(), [a, b, unused], allow_unused=True)
        assert torch.equal(ga, torch.full((3,), 3.0)) and torch.equal(gb, torch.full((3,), 2.0))
        assert gu is None


def test_recomputation_that_diverges_is_named() -> None:
    calls = []

    def f(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return (x @ x.T).sum() if len(calls) == 1 else torch.bmm(x[None], x.T[None]).sum()

    with pytest.raises(ff.RematError, match=r"ran aten.bmm.default where the forward ran aten.mm.default"):
        grad(ff.remat(f, ff.save_dots))(torch.randn(3, 3))


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_recomputation_on_other_shapes_is_named_under_plain_autograd(policy: ff.SavePolicy) -> None:
    """Control flow on something that changed between forward and backward: the same
    operators on other shapes. Under plain autograd (the train step) every product and
    attention is compared with the forward's by its inputs' shapes and dtypes."""
    calls = []
    w = torch.randn(3, 5, requires_grad=True)

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        rows = x if len(calls) == 1 else x[:2]
        return torch.tanh(torch.tanh(rows @ w) @ w.T).sum()

    with pytest.raises(ff.RematError, match=r"ran aten.mm.default on \(\[2, 3\] float32, \[3, 5\] float32\) where"):
        ff.remat(f, policy)(torch.randn(4, 3), w).backward()


class Remembering(nn.Module):
    """Keeps state across calls, as a key/value cache does: what it keeps from its input
    (``cache="input"``; ``"view"``: and returns a view of it) or from a constant made once
    (``cache="constant"``, a lazy table)."""

    def __init__(self, cache: str) -> None:
        super().__init__()
        self.lin, self.cache, self.kept = nn.Linear(4, 4), cache, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sin(self.lin(x))
        if self.cache == "input":
            # what a Hugging Face cache does: append, then read the first len(h) rows
            self.kept = h if self.kept is None else torch.cat([self.kept, h])
            return torch.tanh(self.kept[: len(h)])
        if self.cache == "view":
            self.kept = h if self.kept is None else torch.cat([self.kept, h])
            return self.kept[: len(h)]
        if self.kept is None:
            self.kept = torch.linspace(0, 1, 4)
        return torch.tanh(h + self.kept)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
@pytest.mark.parametrize("cache", ["input", "view", "constant"])
def test_recomputation_reading_what_the_forward_kept_in_state(policy: ff.SavePolicy, cache: str) -> None:
    """A region that keeps a tensor made from its inputs in state, and reads it again when
    recomputed, would hand that tensor's gradient nowhere: refused when its forward ends,
    naming the region. State made from no input (a lazily built table) is read as before,
    with the same gradients."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)

    def grads(module: nn.Module, wrap: Any) -> tuple[torch.Tensor, ...]:
        module.kept = None
        run = wrap(module)
        return torch.autograd.grad(run(x).square().sum(), (x, *module.parameters()))

    module = Remembering(cache)
    plain = grads(module, lambda m: m)
    if cache == "input":
        kept = r"remat\(Remembering\): the region's forward kept a tensor of shape \[3, 4\]"
        with pytest.raises(ff.RematError, match=kept):
            grads(module, lambda m: ff.remat(m, policy))
    elif cache == "view":  # kept in the output's storage: found when the recomputation reads it
        with pytest.raises(ff.RematError, match=r"remat\(Remembering\): the recomputation's aten.cat.default read a"):
            grads(module, lambda m: ff.remat(m, policy))
    else:
        assert equal(grads(module, lambda m: ff.remat(m, policy)), plain)


# --- saving policies ---------------------------------------------------------------------------------------


def _blocks_rematerialised(model: GPT, idx: torch.Tensor, policy: ff.SavePolicy | None) -> tuple[int, int, Any]:
    """(activation bytes kept by the forward, matrix products run by the backward, gradients)
    with every block of ``model`` rematerialised under ``policy`` (``None``: not at all)."""
    blocks, params = list(model.blocks), detached(model)
    originals = [b.forward for b in blocks]
    if policy is not None:
        for b in blocks:  # this instance's forward, rematerialised with its parameters
            b.forward = ff.remat(b.forward, policy)  # type: ignore[method-assign]
    try:
        with ff.MemoryMeter() as meter:
            logits, pull = vjp(lambda p: functional_call(model, p, (idx,)), params)
            kept = meter.current["activations"]
        with OpCount() as ops:
            grads = pull(torch.ones_like(logits))
    finally:
        for b, fwd in zip(blocks, originals, strict=True):
            b.forward = fwd  # type: ignore[method-assign]
    return kept, ops.dots(), grads


def test_save_dots_keeps_more_and_recomputes_fewer_dots() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, seq=32, d_model=32, n_heads=4, n_layers=2))
    idx = torch.randint(0, 64, (4, 32))
    step = functools.partial(_blocks_rematerialised, model, idx)
    none_kept, none_dots, none_grads = step(None)
    full_kept, full_dots, full_grads = step(ff.save_nothing)
    dots_kept, dots_dots, dots_grads = step(ff.save_dots)
    assert full_kept < dots_kept < none_kept
    assert none_dots == dots_dots < full_dots  # every dot kept: the recomputation runs none
    assert equal(none_grads, full_grads) and equal(none_grads, dots_grads)


def test_full_remat_stops_early_as_torch_checkpoint_does(monkeypatch: pytest.MonkeyPatch) -> None:
    # Catches: a recomputation that runs operators no backward reads (each block's last matrix
    # product and residual add), and an early stop that leaves out a value a backward reads.
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, seq=32, d_model=32, n_heads=4, n_layers=3))
    idx = torch.randint(0, 64, (4, 32))
    _, none_dots, none_grads = _blocks_rematerialised(model, idx, None)
    _, stopped_dots, stopped_grads = _blocks_rematerialised(model, idx, ff.save_nothing)
    monkeypatch.setenv("FSDP_FN_REMAT_EARLY_STOP", "0")
    _, whole_dots, whole_grads = _blocks_rematerialised(model, idx, ff.save_nothing)
    blocks = len(model.blocks)
    assert whole_dots == none_dots + 4 * blocks  # qkv, attention's projection, the MLP's two
    assert stopped_dots == none_dots + 3 * blocks  # the MLP's down-projection is left out
    assert equal(none_grads, stopped_grads) and equal(none_grads, whole_grads)


def test_result_modified_in_place_is_recomputed_not_reused() -> None:
    def f(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = x @ w
        y.mul_(2.0)  # the kept mm output changes after it was kept
        return torch.tanh(y).sum()

    w, x = torch.randn(3, 3), torch.randn(2, 3)
    assert equal(grad(f)(w, x), grad(ff.remat(f, ff.save_dots))(w, x))


# --- the Remat value -------------------------------------------------------------------------------------


def gpt_plan(n_layers: int = 4) -> tuple[nn.Module, ff.Plan]:
    model = GPT(GPTConfig(n_layers=n_layers))
    return model, ff.make_plan(model, ff.layer_policy([Block]))


def test_remat_selects_units() -> None:
    model, plan = gpt_plan()
    blocks = {f"blocks.{i}" for i in range(4)}
    assert ff.Remat().selects(plan, model) == blocks
    assert ff.Remat(every=2).selects(plan, model) == {"blocks.0", "blocks.2"}
    assert ff.Remat(every=3).selects(plan, model) == {"blocks.0", "blocks.3"}
    # The root split: its units are candidates too, but not the embeddings (lookups save only
    # their indices, so there is nothing to recompute).
    split = ff.make_plan(model, ff.layer_policy([Block]), split_root=True)
    assert {u.name for u in split.units if u.lookup} == {"wte", "wpe"}
    assert ff.Remat().selects(split, model) == blocks | {"ln_f", "head"}
    # an auto-wrap-signature policy, asked with recurse=False and the unit's parameter count
    asked = []

    def first_two(module: nn.Module, recurse: bool, unwrapped_params: int, **kw: Any) -> bool:
        asked.append((recurse, unwrapped_params))
        return module in (model.blocks[0], model.blocks[1])

    assert ff.Remat(units=first_two, policy=ff.save_dots).selects(plan, model) == {"blocks.0", "blocks.1"}
    assert asked == [(False, plan.unit(f"blocks.{i}").numel) for i in range(4)]
    assert ff.Remat.of(True) == ff.Remat() and ff.Remat.of(None) is None and ff.Remat.of(False) is None
    assert ff.Remat.of(first_two) == ff.Remat(units=first_two)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.inner = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale


def test_remat_leaves_out_units_inside_a_selected_unit() -> None:
    model = nn.Sequential(Outer(), nn.Linear(3, 3))
    plan = ff.make_plan(model, ff.layer_policy([Outer, nn.Linear]))
    assert {"0", "0.inner", "1"} <= set(plan.unit_names)
    assert ff.Remat().selects(plan, model) == {"0", "1"}


def test_remat_bad_values() -> None:
    model, plan = gpt_plan(2)
    with pytest.raises(TypeError, match="Remat.units must be True"):
        ff.Remat(units=False)
    with pytest.raises(TypeError, match="Remat.policy must be a SavePolicy"):
        ff.Remat(policy="dots")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Remat.every must be a positive int, got 0"):
        ff.Remat(every=0)
    with pytest.raises(TypeError, match="remat must be None, True, a unit policy"):
        ff.Remat.of(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"returned int 1 for unit 'blocks.0'"):
        ff.Remat(units=lambda m, r, n: 1).selects(plan, model)
    with pytest.raises(ValueError, match=r"unit 'blocks.1' is not a submodule of GPT"):
        ff.Remat().selects(plan, GPT(GPTConfig(n_layers=1)))


# --- torch.utils.checkpoint, routed ---------------------------------------------------------------------


class Checkpointed(nn.Module):
    """Calls torch's checkpoint three ways: a lambda over self, a submodule, a partial made beforehand."""

    def __init__(self, use_reentrant: bool | None) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.checkpoint = (
            None
            if use_reentrant is None
            else functools.partial(torch_checkpoint.checkpoint, use_reentrant=use_reentrant)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ck = self.checkpoint or (lambda f, *a: f(*a))
        x = ck(lambda x: F.dropout(torch.tanh(self.a(x)), 0.2), x)
        x = ck(self.b, x)
        return ck(functools.partial(F.linear, weight=self.c.weight, bias=self.c.bias), x).sum()


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_torch_checkpoint_routed_inside_vjp(use_reentrant: bool) -> None:
    torch.manual_seed(0)
    model, x = Checkpointed(None), torch.randn(4, 8)
    params = detached(model)

    def run() -> Any:
        torch.manual_seed(1)
        out, pull = vjp(lambda p, x: functional_call(model, p, (x,)), params, x)
        return out, pull(torch.ones(()))

    expected = run()
    model.checkpoint = functools.partial(torch_checkpoint.checkpoint, use_reentrant=use_reentrant)
    with pytest.raises(RuntimeError):  # unrouted, torch refuses (saved-tensor hooks / old-style Function)
        run()
    with ff.route_torch_checkpoint():
        assert equal(run(), expected)


def test_routing_restored_on_exit_and_on_error() -> None:
    names = ("CheckpointFunction", "_checkpoint_without_reentrant_generator")
    before = [getattr(torch_checkpoint, n) for n in names]
    original = torch_checkpoint.checkpoint.__wrapped__  # type: ignore[attr-defined]
    cached = original.__dict__.get("__dynamo_disable")

    def fails() -> None:
        with ff.route_torch_checkpoint():
            with ff.route_torch_checkpoint():  # nested: the outer block keeps the routing
                pass
            assert torch_checkpoint.CheckpointFunction is not before[0]
            raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        fails()
    assert [getattr(torch_checkpoint, n) for n in names] == before
    assert original.__dict__.get("__dynamo_disable") is cached


def test_routed_checkpoint_refuses_context_fn() -> None:
    def context_fn() -> Any:
        return torch_checkpoint.noop_context_fn()

    with ff.route_torch_checkpoint(), pytest.raises(ff.RematError, match=r"context_fn=.*fsdp_fn.save_dots"):
        torch_checkpoint.checkpoint(torch.sin, torch.randn(2), use_reentrant=False, context_fn=context_fn)


def test_composable_checkpoint_refused_by_name() -> None:
    from torch.distributed._composable import checkpoint

    model = Checkpointed(None)
    checkpoint(model.b)
    params = detached(model)
    with ff.route_torch_checkpoint(), pytest.raises(ff.RematError, match=r"_composable.checkpoint of Linear"):
        vjp(lambda p: functional_call(model, p, (torch.randn(2, 8),)), params)


def test_hugging_face_gradient_checkpointing_inside_vjp() -> None:
    model = tiny_llama(0, attention_dropout=0.1).train()
    params, ids = detached(model), torch.randint(0, 64, (2, 12))

    def run() -> Any:
        torch.manual_seed(1)
        out, pull = vjp(lambda p: functional_call(model, p, (ids,), {"labels": ids}).loss, params)
        return out, pull(torch.ones(()))

    expected = run()
    for kwargs in ({"use_reentrant": True}, None):  # None: Hugging Face's default, use_reentrant=False
        with pytest.warns(FutureWarning, match="gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        # Its input hook calls requires_grad_(), which torch.func refuses; inside a transform the
        # embeddings' output already carries the gradient, so the hook is not needed.
        model.disable_input_require_grads()
        assert model.model.layers[0].gradient_checkpointing
        with ff.route_torch_checkpoint():
            assert equal(run(), expected)


class _WritesItsInput(nn.Module):
    def __init__(self, returns_it: bool) -> None:
        super().__init__()
        self.fc, self.returns_it = nn.Linear(4, 4), returns_it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(1.5)
        x += self.fc(torch.tanh(x))
        return x if self.returns_it else torch.sin(x)


@pytest.mark.parametrize("returns_it", [True, False])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_region_that_writes_its_input_in_place_matches_plain_autograd(policy: ff.SavePolicy, returns_it) -> None:
    """The caller sees its tensor changed, with that history, as without remat: it may read it
    again after the region (here the loss does). Under a transform the write is refused by name."""
    torch.manual_seed(0)
    inp, block = nn.Linear(3, 4), _WritesItsInput(returns_it)
    x = torch.randn(5, 3)

    def gradients(region):
        for p in (*inp.parameters(), *block.parameters()):
            p.grad = None
        h = inp(x)
        out = region(h)
        ((out * h).sum() + h.square().sum()).backward()  # h: the values the region left in it
        return [p.grad for p in (*inp.parameters(), *block.parameters())]

    want = gradients(block)
    got = gradients(ff.remat(block, policy))
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    with pytest.raises(ff.RematError, match=r"changes its input #0 in place, which under a torch.func transform"):
        torch.func.grad(lambda h: ff.remat(block, policy)(h.clone()).sum())(torch.randn(5, 4))
