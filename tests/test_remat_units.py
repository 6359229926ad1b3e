"""Rematerialised units inside the ZeRO-3 lifecycle: exact gradients, no extra collective,
less memory, every feature, and models that call torch.utils.checkpoint themselves."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fsdp_fn as ff
from examples.gpt import GPT, Block, GPTConfig, lm_loss
from tests.helpers import local_part

CFG = GPTConfig(vocab=40, seq=12, d_model=16, n_layers=3, n_heads=2)


class DropBlock(nn.Module):
    """A block with dropout: the recomputation must draw the same mask."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.ln = nn.Linear(d, d), nn.LayerNorm(d)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.fc(self.ln(x))))


class DropNet(nn.Module):
    def __init__(self, d: int = 10, checkpoint: str | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.blocks = nn.ModuleList(DropBlock(d) for _ in range(3))
        self.out = nn.Linear(d, 2)
        self.checkpoint = checkpoint  # None, "reentrant" or "non_reentrant": the model checkpoints its blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            if self.checkpoint is None:
                x = b(x)
            else:
                x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=self.checkpoint == "reentrant")
        return self.out(x)


def _mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def _grads(group, remat, checkpoint=None, seed=3):
    """(loss, unsharded gradient) of one value_and_grad pass, with the RNG seeded alike."""
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = DropNet(checkpoint=checkpoint)
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([DropBlock])), group)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8 * world, 5, generator=g), torch.randn(8 * world, 2, generator=g)
    batch = (x.chunk(world)[rank], y.chunk(world)[rank])
    torch.manual_seed(seed + rank)  # the dropout masks
    with ff.comm_log() as log:
        loss, grads = ff.value_and_grad(fn, _mse, remat=remat)(params, fn.buffers, batch)
    return loss, {u: grads[u].clone() for u in grads}, [(c.op, c.unit, c.numel) for c in log.records]


REMATS = {
    "full": lambda: True,
    "save_dots": lambda: ff.Remat(policy=ff.save_dots),
    "every_2": lambda: ff.Remat(every=2),
    "policy": lambda: ff.layer_policy([DropBlock]),
    "none": lambda: None,
}


def _compare(group, remat, checkpoint=None):
    remat = REMATS[remat]()
    loss0, plain, log0 = _grads(group, None)
    loss1, again, log1 = _grads(group, remat, checkpoint)
    worst = max((plain[u] - again[u]).abs().max().item() for u in plain)
    return loss0.item() == loss1.item(), worst, log0 == log1


@pytest.mark.parametrize("remat", ["full", "save_dots", "every_2", "policy"])
def test_remat_gradients_are_bitwise_at_one_rank_and_add_no_collective(pool, remat):
    (same_loss, worst, same_log) = pool.run(_compare, remat, world=1)[0]
    assert same_loss
    assert worst == 0.0  # bitwise: the dropout masks were replayed
    for same_loss, worst, same_log in pool.run(_compare, remat, world=3):
        assert same_loss
        assert worst <= 1e-6
        assert same_log  # the same collectives, in the same order: remat adds none


@pytest.mark.parametrize("checkpoint", ["reentrant", "non_reentrant"])
def test_models_calling_torch_checkpoint_train_with_the_same_gradients(pool, checkpoint):
    for same_loss, worst, same_log in pool.run(_compare, "none", checkpoint, world=2):
        assert same_loss
        assert worst <= 1e-6
        assert same_log  # routed to the unit's own remat: gathered once in backward


def _gpt_step_memory(group, remat):
    remat = REMATS[remat]()
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, seq=64, d_model=32, n_layers=4, n_heads=2)
    model = GPT(cfg)
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([Block]))
    step = ff.train_step(fn, lm_loss, ff.adamw(), remat=remat)
    state = step.init(ff.shard(fn.params, plan, group))
    tokens = torch.randint(0, cfg.vocab, (8 * world, cfg.seq + 1), generator=torch.Generator().manual_seed(0))
    batch = local_part(tokens, rank, world)
    state, _ = step(state, batch)
    with ff.MemoryMeter() as meter:
        meter.tag(state, "state")
        state, metrics = step(state, batch)
    return meter.category_peaks()["activations"], metrics["loss"].item(), ff.unshard(state.params)


def test_remat_lowers_activation_memory_with_the_same_training(pool):
    plain = pool.run(_gpt_step_memory, "none", world=2)
    full = pool.run(_gpt_step_memory, "full", world=2)
    dots = pool.run(_gpt_step_memory, "save_dots", world=2)
    for (a0, l0, p0), (a1, l1, p1), (a2, l2, p2) in zip(plain, full, dots):
        assert a1 < 0.6 * a0, (a0, a1)  # measured: full remat keeps well under half the activations
        assert a1 <= a2 <= a0, (a0, a1, a2)  # selective sits between
        assert abs(l0 - l1) <= 1e-6 * abs(l0) and abs(l0 - l2) <= 1e-6 * abs(l0)
        assert all((p0[k] - p1[k]).abs().max().item() <= 1e-6 for k in p0)
        assert all((p0[k] - p2[k]).abs().max().item() <= 1e-6 for k in p0)


FEATURES = {
    "bf16": {"step_kw": {"mixed_precision": ff.MixedPrecision(torch.bfloat16, torch.float32)}},
    "accumulation": {"micro": 2},
    "update_in_backward": {"step_kw": {"update_in_backward": True}},
    "offload": {"step_kw": {"cpu_offload": ff.CPUOffload(device="cpu")}},
    "frozen": {"freeze": ("blocks.0.", "ln1")},
    "tied_split_root": {"model_kw": {"tie": True}, "plan_kw": {"split_root": True}},
    "hybrid": {"hsdp": True},
}


def _with_and_without(group, feature):
    from tests.test_features import _train_with

    kw = dict(FEATURES[feature])
    without = _train_with(group, **kw)
    kw["step_kw"] = {**kw.get("step_kw", {}), "remat": True}
    with_remat = _train_with(group, **kw)
    if group.rank() != 0:
        return None
    return {k: (without[k], with_remat[k]) for k in ("loss", "grad_norm", "param")}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_remat_composes_with_every_feature(pool, feature):
    figures = pool.run(_with_and_without, feature, world=4 if feature == "hybrid" else 2)[0]
    for name, (without, with_remat) in figures.items():
        # the same distance from the unsharded reference, with and without remat
        assert abs(with_remat - without) <= 1e-6 + 1e-3 * abs(without), (name, without, with_remat)


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d)  # (a key bias gets no gradient)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class FeedForward(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 3 * d), nn.Linear(3 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class NestedBlock(nn.Module):
    """A block unit whose attention and feed-forward are units of their own (its norms are the block's)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attention, self.mlp = Attention(d), FeedForward(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class NestedNet(nn.Module):
    def __init__(self, checkpoint: str | None = None, d: int = 6) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(5, d), nn.Linear(d, 2)
        self.layers = nn.ModuleList(NestedBlock(d) for _ in range(2))
        self.checkpoint = checkpoint  # "reentrant", "non_reentrant": it checkpoints its layers (as FSDP2's test)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            if self.checkpoint is None:
                h = layer(h)
            else:
                h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=self.checkpoint == "reentrant")
        return self.out(h)


NESTED = ff.layer_policy([NestedBlock, Attention, FeedForward])


def _batches(steps: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(4, 3, 5, generator=g), torch.randn(4, 3, 2, generator=g)) for _ in range(steps)]


def _nested_units_trained(group, how):
    from fsdp_fn.testing import assert_matches_unsharded

    torch.manual_seed(0)
    model = NestedNet(checkpoint=None if how == "remat" else how)
    return assert_matches_unsharded(
        model,
        _mse,
        _batches(),
        group=group,
        policy=NESTED,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        remat=True if how == "remat" else None,
    )


@pytest.mark.parametrize("how", ["remat", "non_reentrant", "reentrant"])
def test_a_block_with_units_inside_rematerialised_trains_like_torch(pool, how):
    """A block unit holding attention and feed-forward units, rematerialised by ``remat=True`` or by
    the model's own ``torch.utils.checkpoint(layer, h)`` (FSDP2's
    ``test_double_forward_with_nested_fsdp_and_checkpoint``): the recomputation in backward gathers
    the inner units again. Before, ``ValueError: ... unit 'layers.0' cannot be rematerialised: it
    reads parameter 'layers.0.attention.qkv.weight' of unit 'layers.0.attention'``."""
    for world in (1, 2):
        for worst in pool.run(_nested_units_trained, how, world=world):
            assert worst["parameter"] < 1e-5, (world, worst)


def _nested_collectives(group, remat):
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = NestedNet()
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model, NESTED), group)
    x, y = _batches(1)[0]
    with ff.comm_log() as log:
        part = x.chunk(world)[rank], y.chunk(world)[rank]
        _, grads = ff.value_and_grad(fn, _mse, remat=remat)(params, fn.buffers, part)
    return sorted((c.op, c.unit) for c in log.records), ff.unshard(grads)


def test_a_block_with_units_inside_rematerialised_adds_no_collective(pool):
    """Each inner unit is gathered in the block's forward and once more in its recomputation, where
    it stays gathered until its own backward: the collectives of a step without remat (gather,
    refill, reduce-scatter), no more."""
    plain = pool.run(_nested_collectives, None, world=2)
    rematerialised = pool.run(_nested_collectives, True, world=2)
    for (log0, g0), (log1, g1) in zip(plain, rematerialised):
        assert log0 == log1
        assert max((g0[k] - g1[k]).abs().max().item() for k in g0) <= 1e-6


def _nested_units_under_update_in_backward(group):
    """With ``update_in_backward`` each unit's optimizer step waits for its last use's gradient:
    the inner units' come from the recomputation, counted when the loss is known."""
    from fsdp_fn.testing import assert_matches_unsharded

    torch.manual_seed(0)
    return assert_matches_unsharded(
        NestedNet(),
        _mse,
        _batches(),
        group=group,
        policy=NESTED,
        optimizer=ff.adamw(lr=1e-2),
        remat=True,
        schedule=ff.Schedule(update_in_backward=True),
    )


def test_a_block_with_units_inside_rematerialised_updates_in_backward(pool):
    for worst in pool.run(_nested_units_under_update_in_backward, world=2):
        assert worst["parameter"] < 1e-5, worst


class SharingBlock(nn.Module):
    """Calls a module it shares with the other block (a unit of its own, gathered by each block's
    call of it), and reads a parameter of its own."""

    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.own, self.shared = nn.Linear(6, 6), shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.shared(torch.tanh(self.own(x)))


def _shared_module_trained(group, schedule):
    from fsdp_fn.testing import assert_matches_unsharded

    torch.manual_seed(0)
    shared = nn.Linear(6, 6)
    model = nn.Sequential(nn.Linear(5, 6), SharingBlock(shared), SharingBlock(shared), nn.Linear(6, 2))
    return assert_matches_unsharded(
        model,
        _mse,
        _batches(),
        group=group,
        policy=ff.layer_policy([SharingBlock]),
        optimizer=ff.adamw(lr=1e-2),
        remat=True,
        schedule=ff.Schedule(update_in_backward=schedule == "update_in_backward"),
    )


@pytest.mark.parametrize("schedule", ["default", "update_in_backward"])
def test_blocks_sharing_a_module_rematerialised_train_like_torch(pool, schedule):
    """The shared module's parameters are a unit of their own, gathered by each block's call of it:
    each block's recomputation gathers it again. Before, ``ValueError: train_step(remat=...): unit
    '2' cannot be rematerialised: it reads parameter '2.shared.weight' of unit '1.shared.weight'``."""
    for world in (1, 2):
        for worst in pool.run(_shared_module_trained, schedule, world=world):
            assert worst["parameter"] < 1e-5, (world, worst)


class Holder(nn.Module):
    """Not a unit: its linear layer is one, its norm is the root's."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin, self.ln = nn.Linear(d, d), nn.LayerNorm(d)

    def mix(self, t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(self.ln(t)))


class ClosureNet(nn.Module):
    """Checkpoints a closure over itself that calls a unit, or a bound method of another module that does."""

    def __init__(self, how: str, reentrant: bool = False, d: int = 7) -> None:
        super().__init__()
        self.inp, self.lin, self.out = nn.Linear(5, d), nn.Linear(d, d), nn.Linear(d, 2)
        self.holder = Holder(d)
        self.how, self.reentrant = how, reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        ck = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=self.reentrant)
        if self.how == "closure":
            h = ck(lambda t: torch.tanh(self.lin(t)) + t, h)
        elif self.how == "default":  # the unit in a default argument, where the routing does not look
            h = ck(lambda t, lin=self.lin: torch.tanh(lin(t)), h)
        else:
            h = ck(self.holder.mix, h) + self.lin(h)
        return self.out(h)


def _closure_trained(group, how, reentrant, optimizer):
    from fsdp_fn.testing import assert_matches_unsharded

    torch.manual_seed(0)
    return assert_matches_unsharded(
        ClosureNet(how, reentrant),
        _mse,
        _batches(),
        group=group,
        policy=ff.layer_policy([nn.Linear]),
        optimizer=(lambda ps: torch.optim.AdamW(ps, lr=1e-2)) if optimizer == "torch" else None,
    )


@pytest.mark.parametrize("optimizer", ["torch", "none"])
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("how", ["closure", "method"])
def test_a_checkpointed_closure_that_calls_a_unit_trains_like_torch(pool, how, reentrant, optimizer):
    """``checkpoint(lambda t: self.lin(t), x)`` and ``checkpoint(self.holder.mix, x)``, ``lin`` a unit:
    the units inside the modules the function reaches are inputs of the region (their shards),
    gathered in its forward and again in its recomputation; trained (``optimizer="torch"``,
    ``train_step``) or differentiated once (``value_and_grad``) like torch's checkpoint on one
    process. Before, ``RematError: remat(ClosureNet.forward.<locals>.<lambda>): dim uses a tensor
    of shape (28,) ... that requires grad but is not an argument of the region``: a shard."""
    for world in (1, 2):
        for worst in pool.run(_closure_trained, how, reentrant, optimizer, world=world):
            key = "parameter" if optimizer == "torch" else "gradient"
            assert worst[key] < 1e-5, (world, worst)


def _unit_out_of_sight(group):
    torch.manual_seed(0)
    try:
        _closure_trained(group, "default", False, "torch")
    except ff.RematError as e:
        return str(e)
    return "no error"


def test_a_unit_a_checkpointed_function_reaches_out_of_sight_is_named(pool):
    """A unit the region's function reaches other than through what the routing looks at (here a
    default argument) could not be gathered by the recomputation: named. Before, ``dim uses a
    tensor of shape (28,) ... that requires grad but is not an argument of the region`` (a shard)."""
    for message in pool.run(_unit_out_of_sight, world=2):
        assert message.startswith("unit 'lin' runs inside a rematerialised region") and "a bound method's" in message


def _composable(group, name, plain):
    """This rank's gradient from ``apply_sharded`` (under ``torch.func.grad``, or a plain
    ``.backward()`` on shards that require grad), against torch's on the whole batch, one process."""
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    if name == "nested":
        model, policy = NestedNet(checkpoint="non_reentrant"), NESTED
    else:
        model, policy = ClosureNet(name), ff.layer_policy([nn.Linear])
    reference = copy.deepcopy(model)
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model, policy), group)
    x, y = _batches(1)[0]
    part = x.chunk(world)[rank], y.chunk(world)[rank]

    def loss(shards):
        return F.mse_loss(ff.apply_sharded(fn, params.replace(shards), fn.buffers, part[0]), part[1])

    if plain:
        shards = {k: v.detach().requires_grad_() for k, v in params.shards.items()}
        loss(shards).backward()
        grads = {k: torch.zeros_like(v) if v.grad is None else v.grad for k, v in shards.items()}
    else:
        grads = torch.func.grad(loss)(params.shards)
    mine = ff.unshard(params.replace(grads))
    F.mse_loss(reference(x), y).backward()
    return max((mine[k] - p.grad).abs().max().item() for k, p in reference.named_parameters() if p.grad is not None)


@pytest.mark.parametrize("plain", [False, True])
@pytest.mark.parametrize("model", ["nested", "closure", "method"])
def test_checkpointed_units_inside_a_region_differentiate_through_apply_sharded(pool, model, plain):
    """The composable path (``apply_sharded``, ``value_and_grad`` inside a transform): the region's
    recomputation gathers its units with the differentiable all-gather, whose reduce-scatter
    gives their shards' gradient, under ``torch.func.grad`` and plain autograd alike."""
    for world in (1, 2):
        for worst in pool.run(_composable, model, plain, world=world):
            assert worst <= 1e-6, (world, worst)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.own = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.own(x))


def _nested_compiled(group):
    torch.manual_seed(0)
    model = nn.Sequential(Outer(), nn.Linear(4, 1))
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, lambda m, recurse, n, **kw: recurse or isinstance(m, Outer) or m is model[0].inner)
    step = ff.train_step(fn, _mse, ff.sgd(), remat=ff.layer_policy([Outer]), compile={"backend": "eager"})
    try:
        step(step.init(ff.shard(fn.params, plan, group)), (torch.randn(2, 4), torch.randn(2, 1)))
    except ValueError as e:
        return str(e)
    return "no error"


class TiedBlock(nn.Module):
    def __init__(self, w: nn.Parameter) -> None:
        super().__init__()
        self.own, self.w = nn.Linear(4, 4), w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.own(x)) @ self.w


def _tied_directly(group):
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    model = nn.Sequential(TiedBlock(w), TiedBlock(w), nn.Linear(4, 1))
    fn = ff.functionalize(model)
    step = ff.train_step(fn, _mse, ff.sgd(), remat=True)
    try:
        plan = ff.make_plan(model, ff.layer_policy([TiedBlock]))
        step(step.init(ff.shard(fn.params, plan, group)), (torch.randn(2, 4), torch.randn(2, 1)))
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_unit_reading_a_parameter_no_module_inside_it_gathers_is_refused_by_name(pool):
    """A parameter two blocks share directly is a unit gathered around each block, not inside it."""
    (message,) = pool.run(_tied_directly, world=1)
    assert "unit '0' cannot be rematerialised: it reads parameter '0.w' of unit '0.w', which no module" in message


def test_a_compiled_unit_with_units_inside_is_refused_by_name(pool):
    """A compiled unit is recomputed by its compiled code, which does not gather the units inside it."""
    (message,) = pool.run(_nested_compiled, world=1)
    assert "unit '0' cannot be rematerialised: it reads parameter '0.inner.weight' of unit '0.inner'" in message
    assert "it is compiled" in message


def _llama(group, checkpointing, remat=None, use_cache=None):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(config)
    model.train()
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([LlamaDecoderLayer]))
    kwargs = {} if use_cache is None else {"use_cache": use_cache}
    step = ff.train_step(fn, lambda m, ids: m(input_ids=ids, labels=ids, **kwargs).loss, ff.adamw(lr=1e-2), remat=remat)
    state = step.init(ff.shard(fn.params, plan, group))
    tokens = torch.randint(0, 64, (4 * world, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    try:
        with ff.comm_log() as log:
            for _ in range(2):
                state, metrics = step(state, local_part(tokens, rank, world))
                losses.append(metrics["loss"].item())
    except ff.RematError as e:
        return str(e)
    return losses, ff.unshard(state.params), len(log.records)


def test_hugging_face_gradient_checkpointing_trains_like_without(pool):
    plain = pool.run(_llama, False, world=2)
    checkpointed = pool.run(_llama, True, world=2)
    for (l0, p0, n0), (l1, p1, n1) in zip(plain, checkpointed):
        assert all(abs(a - b) <= 1e-6 * abs(a) for a, b in zip(l0, l1)), (l0, l1)
        assert max((p0[k] - p1[k]).abs().max().item() for k in p0) <= 1e-6
        assert n0 == n1  # no collective added by the recomputation


def test_hugging_face_remat_needs_no_cache_and_then_trains_like_without(pool):
    """``remat=True`` on a Hugging Face model: in training its forward still fills a key/value
    cache (``use_cache`` defaults to the config's True). The recomputation would append to it,
    and attention then keeps the first keys, the forward's, so the keys' and values'
    projections got no gradient: silently, at every layer. A rematerialised forward now
    refuses to keep a tensor made from its inputs outside its outputs; with ``use_cache=False``, as Hugging Face's
    own gradient checkpointing sets, it trains as without remat."""
    for message in pool.run(_llama, False, True, world=2):
        assert "remat(model.layers.0): the region's forward kept a tensor of shape" in message, message
        assert "call a Hugging Face model with use_cache=False" in message
    plain = pool.run(_llama, False, world=2)
    rematerialised = pool.run(_llama, False, True, False, world=2)
    for (l0, p0, n0), (l1, p1, n1) in zip(plain, rematerialised):
        assert all(abs(a - b) <= 1e-6 * abs(a) for a, b in zip(l0, l1)), (l0, l1)
        assert max((p0[k] - p1[k]).abs().max().item() for k in p0) <= 1e-6
        assert n0 == n1


class ConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.bn(self.conv(x)))


def _batch_norm_units(group, remat):
    """Two steps of a CNN whose units hold BatchNorms; this rank's running statistics, as torch
    moves them on this rank's part of the batch, and the parameters."""
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), ConvBlock(), ConvBlock(), nn.Flatten(), nn.Linear(64, 5))
    reference = copy.deepcopy(model)
    fn = ff.functionalize(model)
    step = ff.train_step(fn, _cross_entropy, ff.sgd(lr=0.1), remat=remat)
    state = step.init(ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([ConvBlock])), group))
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for k in range(2):
        g = torch.Generator().manual_seed(k)
        x, y = torch.randn(3 * world, 3, 4, 4, generator=g), torch.randint(0, 5, (3 * world,), generator=g)
        state, _ = step(state, (x.chunk(world)[rank], y.chunk(world)[rank]))
        opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()  # the running statistics of the whole batch: not compared
        opt.step()
    torch_state = {k: v.detach() for k, v in [*reference.named_parameters(), *reference.named_buffers()]}
    return dict(state.buffers), ff.unshard(state.params), torch_state


def _cross_entropy(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def test_batch_norm_statistics_move_once_per_step_under_remat(pool):
    """The recomputation of a unit with a BatchNorm starts from the running statistics as they
    were before its forward and drops its own changes: before, they moved twice per step."""
    for world in (1, 2):
        plain = pool.run(_batch_norm_units, None, world=world)
        rematerialised = pool.run(_batch_norm_units, True, world=world)
        for (b0, p0, ref), (b1, p1, _) in zip(plain, rematerialised):
            assert b0.keys() == b1.keys() and b0["1.bn.num_batches_tracked"].item() == 2
            assert all(torch.equal(b0[k], b1[k]) for k in b0), world
            assert max((p0[k] - p1[k]).abs().max().item() for k in p0) <= 1e-6
            if world == 1:  # one rank sees the whole batch: torch's model itself
                for mine in (p0, b1):
                    assert max((mine[k].double() - ref[k].double()).abs().max().item() for k in mine) <= 1e-6


class ExpertsBlock(nn.Module):
    """Experts in one 3-D parameter, each row's expert taken by index (Mixtral's layout)."""

    def __init__(self, d: int = 6, experts: int = 3) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(experts, d, d) / d**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        picks = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
        return x + torch.stack([torch.tanh(F.linear(row, self.w[int(k)])) for row, k in zip(x, picks)])


class ExpertsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(5, 6), nn.Linear(6, 2)
        self.blocks = nn.ModuleList([ExpertsBlock(), ExpertsBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _experts(group, remat):
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = ExpertsNet()
    fn = ff.functionalize(model)
    step = ff.train_step(fn, lambda m, b: F.mse_loss(m(b[0]), b[1]), ff.adamw(lr=1e-2), remat=remat)
    state = step.init(ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([ExpertsBlock])), group))
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        x, y = torch.randn(8, 5, generator=g), torch.randn(8, 2, generator=g)
        state, _ = step(state, (x.chunk(world)[rank], y.chunk(world)[rank]))
    return ff.unshard(state.params)


def test_experts_taken_by_view_train_rematerialised_as_without(pool):
    """A unit that indexes its parameter (``self.w[k]``: a view of the unit's gathered flat
    buffer) trains under ``remat=True`` exactly as without (before: refused as a captured tensor)."""
    for world in (1, 2):
        plain = pool.run(_experts, None, world=world)
        rematerialised = pool.run(_experts, True, world=world)
        for a, b in zip(plain, rematerialised):
            assert all(torch.equal(a[k], b[k]) for k in a)


class InPlaceBlock(nn.Module):
    """A block that changes its input in place before using it (a scale, ``nn.ReLU(inplace=True)``
    as its first layer), as plain torch allows where backward needs no earlier value."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.ln = nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(1.5)
        x = F.relu(x, inplace=True)
        return x + torch.tanh(self.fc(self.ln(x)))


def _in_place_blocks_rematerialised(group, remat):
    from fsdp_fn.testing import assert_matches_unsharded

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 10), InPlaceBlock(10), InPlaceBlock(10), nn.Linear(10, 2))
    batches = [(torch.randn(6, 5), torch.randn(6, 2)) for _ in range(2)]
    return assert_matches_unsharded(
        model,
        _mse,
        batches,
        group=group,
        policy=ff.layer_policy([InPlaceBlock]),
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        remat=ff.Remat(policy=ff.save_dots) if remat == "save_dots" else True,
    )


@pytest.mark.parametrize("remat", ["save_nothing", "save_dots"])
def test_a_rematerialised_unit_that_writes_its_input_in_place_trains_like_torch(pool, remat):
    """Before: autograd's "a leaf Variable that requires grad is being used in an in-place operation"
    in backward (the recomputation ran on a leaf), and the recomputation would have started from
    the input the forward had already changed. Now the forward keeps the input as it was before
    the write, and autograd is told the region changed it (as it is without remat)."""
    for worst in pool.run(_in_place_blocks_rematerialised, remat, world=2):
        assert worst["parameter"] < 1e-5, worst


class OwnNoise(nn.Module):
    """Noise from a generator of the block's own, which remat does not replay."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x)) * (1 + 0.1 * torch.randn(x.shape, generator=self.gen))


class Counted(nn.Module):
    """A scale that grows with every call: the recomputation sees the next one."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + torch.tanh(self.fc(x)) * self.calls


def _recomputed_other_values(group, kind, remat):
    torch.manual_seed(0)
    block = OwnNoise(6) if kind == "generator" else Counted(6)
    model = nn.Sequential(nn.Linear(4, 6), block, nn.Linear(6, 1))
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([type(block)])), group)
    remat_value = ff.Remat(policy=ff.save_dots) if remat == "save_dots" else True
    step = ff.train_step(fn, _mse, ff.adamw(), remat=remat_value)
    state = step.init(params)
    try:
        step(state, (torch.randn(3, 4), torch.randn(3, 1)))
        return "no error"
    except ff.RematError as e:
        return str(e)


@pytest.mark.parametrize("remat", ["save_nothing", "save_dots"])
@pytest.mark.parametrize("kind", ["generator", "counter"])
def test_a_recomputation_with_other_values_is_named_on_a_checked_step(pool, kind, remat):
    """Same operators, same shapes, other values (torch's checkpoint is silent here too): the first
    step compares a digest of each rematerialised unit's outputs at the recomputation. Before, the
    gradients came from the recomputation's values, silently."""
    for msg in pool.run(_recomputed_other_values, kind, remat, world=2):
        assert msg.startswith("remat(1): the recomputation's output #0 has other values than the forward's"), msg
        assert "a generator of the region's own" in msg
