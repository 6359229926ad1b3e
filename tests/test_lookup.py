"""A lookup unit (a plain nn.Embedding) fetches the rows it reads instead of gathering its table."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fsdp_fn as ff
from tests.helpers import local_part, reference_run, rows_fetched

# Rows of 6 elements in a 37-row table: at W=2, 3, 4 the slots (111, 74, 56 elements) end
# inside a row, so rows come in two pieces from two ranks.
VOCAB, DIM = 37, 6


class Tagger(nn.Module):
    """Two lookups (one with a padding row and frequency-scaled gradients, one used twice, the
    second time with its indices as a keyword, ``input=``) and a head."""

    def __init__(self, scale: bool = True, sparse: bool = False) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, DIM, padding_idx=3, sparse=sparse)
        self.tags = nn.Embedding(5, DIM, scale_grad_by_freq=scale)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.tokens(ids)  # an extra lookup whose rows get no gradient
        hidden = self.tokens(ids) + self.tags(tags) + self.tags(input=tags.flip(-1))
        return self.head(torch.tanh(hidden))


def loss_fn(model, batch):
    ids, tags, target = batch
    return nn.functional.cross_entropy(model(ids, tags).reshape(-1, VOCAB), target.reshape(-1))


def _batches(world: int, steps: int = 3) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2 * world, 9), generator=g)
        ids[0, :3] = 3  # the padding row, several times
        ids[-1] = ids[-1, 0]  # one row many times on the last rank
        out.append(
            (
                ids,
                torch.randint(0, 5, (2 * world, 9), generator=g),
                torch.randint(0, VOCAB, (2 * world, 9), generator=g),
            )
        )
    return out


def _train(group, rows: bool, scale: bool = True):
    """Three AdamW steps; ``rows=False`` keeps the lookups gathering their tables (a forward hook
    on a module makes its unit no lookup)."""
    with rows_fetched():  # (small tables: a step would gather them)
        return _train_fetching(group, rows, scale)


def _train_fetching(group, rows: bool, scale: bool):
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = Tagger(scale)
    if not rows:
        for m in (model.tokens, model.tags):
            m.register_forward_hook(lambda m, i, o: None)
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([nn.Embedding, nn.Linear]))
    step = ff.train_step(fn, loss_fn, ff.adamw(lr=1e-2))
    state = step.init(ff.shard(fn.params, plan, group))
    metrics = []
    with ff.comm_log() as log, ff.MemoryMeter() as meter:
        for batch in _batches(world):
            state, m = step(state, local_part(batch, rank, world))
            metrics.append((float(m["loss"]), float(m["grad_norm"])))
    ops = {(c.op, c.unit) for c in log.records if c.unit in ("tokens", "tags")}
    return {
        "params": ff.unshard(state.params),
        "moments": [ff.unshard(s) for s in state.opt_state[0][1:]],
        "metrics": metrics,
        "ops": ops,
        "gathered": meter.category_peaks()["gathered"],
        "lookups": {u.name for u in plan.units if u.lookup},
    }


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fetched_rows_train_exactly_as_the_gathered_table(pool, world):
    # Catches: a row piece from the wrong rank or offset, a row's gradient summed in another
    # order than the reduce-scatter's, a padding row or a frequency scale lost, a repeated
    # lookup or a no-grad lookup miscounted; each would change some bit of the result.
    fetched = pool.run(_train, True, world=world)
    gathered = pool.run(_train, False, world=world)
    for a, b in zip(fetched, gathered, strict=True):
        assert a["lookups"] == b["lookups"] == {"tokens", "tags"}  # the hooks tell the runtime, not the plan
        assert a["ops"] == {(op, u) for op in ("row_fetch", "row_reduce") for u in ("tokens", "tags")}
        assert b["ops"] == {(op, u) for op in ("all_gather", "reduce_scatter") for u in ("tokens", "tags")}
        assert a["metrics"] == b["metrics"]
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), name
        for ma, mb in zip(a["moments"], b["moments"], strict=True):
            assert all(torch.equal(ma[k], mb[k]) for k in ma)
        # The head is the only unit gathered whole; the tables never are.
        head = (DIM * VOCAB + VOCAB) * 4
        assert a["gathered"] < head + VOCAB * DIM * 4 <= b["gathered"]


def _reference(world):
    torch.manual_seed(0)
    model = Tagger(scale=False)
    batches = _batches(world)
    return reference_run(model, loss_fn, batches, lambda p: torch.optim.AdamW(p, lr=1e-2))


def test_fetched_rows_match_one_process(pool):
    # The same three steps as one process with torch.optim.AdamW on the global batch (without
    # scale_grad_by_freq, which counts each rank's own indices under any data parallelism).
    world = 3
    ref = _reference(world)
    for got in pool.run(_train, True, False, world=world):
        losses = [m[0] for m in got["metrics"]]
        norms = [m[1] for m in got["metrics"]]
        assert losses == pytest.approx(ref["losses"], rel=1e-5)
        assert norms == pytest.approx(ref["norms"], rel=1e-5)
        for name, p in ref["params"].items():
            torch.testing.assert_close(got["params"][name], p, rtol=1e-5, atol=1e-6)


def _bad_indices(group, kind):
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = Tagger()
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([nn.Embedding, nn.Linear]))
    step = ff.train_step(fn, loss_fn, ff.adamw(lr=1e-2))
    state = step.init(ff.shard(fn.params, plan, group))
    ids, tags, target = local_part(_batches(world, 1)[0], rank, world)
    bad = ids.clone()
    if kind == "range":
        bad[0, 0] = VOCAB
    else:
        bad = bad.float()
    try:
        step(state, (bad, tags, target))
    except Exception as e:  # the rank's own error, or another rank's relayed (RankFailure) if it came first
        message = str(e)
    else:
        message = ""
    state, metrics = step(state, (ids, tags, target))  # the state is still usable
    return message, bool(torch.isfinite(metrics["loss"]))


@pytest.mark.parametrize("kind", ["range", "dtype"])
def test_bad_indices_name_the_lookup_and_leave_the_state_usable(pool, kind):
    for message, finite in pool.run(_bad_indices, kind, world=2):
        assert "unit 'tokens'" in message, message
        assert ("index 37" in message) if kind == "range" else ("int32 or int64" in message)
        assert finite


def _sparse(group):
    """``nn.Embedding(sparse=True)``: three SGD steps, and one gradient through each path."""
    world, rank = group.size(), group.rank()
    torch.manual_seed(0)
    model = Tagger(scale=False, sparse=True)
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([nn.Embedding, nn.Linear]))
    batches = _batches(world)
    step = ff.train_step(fn, loss_fn, ff.sgd(lr=0.5, momentum=0.9))
    params = ff.shard(fn.params, plan, group)
    # One gradient three ways: the train step's lean pass, the composable path under plain
    # autograd (shards that require grad), and value_and_grad's lean pass.
    batch = local_part(batches[0], rank, world)
    leaves = params.replace({k: v.detach().clone().requires_grad_() for k, v in params.shards.items()})
    loss_fn(lambda *a: ff.apply_sharded(fn, leaves, fn.buffers, *a), batch).backward()
    _, grads = ff.value_and_grad(fn, loss_fn)(params, fn.buffers, batch)
    composable = max((leaves[u].grad - grads[u]).abs().max().item() for u in plan.unit_names)
    state = step.init(params)
    metrics = []
    for b in batches:
        state, m = step(state, local_part(b, rank, world))
        metrics.append((float(m["loss"]), float(m["grad_norm"])))
    return ff.unshard(state.params), metrics, composable


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_sparse_embedding_trains_like_one_process(pool, world):
    # Catches: a sparse gradient copied into the flat one (torch cannot), taken as the flat
    # gradient itself, or reshaped by autograd's view backward on the composable path.
    torch.manual_seed(0)
    model = Tagger(scale=False, sparse=True)
    ref = reference_run(model, loss_fn, _batches(world), lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9))
    assert ref["params"]["tokens.weight"].layout == torch.strided
    for params, metrics, composable in pool.run(_sparse, world=world):
        assert composable < 1e-6, composable
        assert [m[0] for m in metrics] == pytest.approx(ref["losses"], rel=1e-5)
        assert [m[1] for m in metrics] == pytest.approx(ref["norms"], rel=1e-5)
        for name, p in ref["params"].items():
            torch.testing.assert_close(params[name], p, rtol=1e-5, atol=1e-6)


def test_an_embedding_with_max_norm_is_refused_naming_it():
    # Its forward rescales the rows it reads in place: a change to the parameter that a
    # gathered copy (or a fetched row) would lose, so torch's training could not be matched.
    model = Tagger()
    model.tags.max_norm = 1.0
    with pytest.raises(ValueError, match="nn.Embedding 'tags' has max_norm=1.0: its forward rescales the rows"):
        ff.make_plan(model, ff.layer_policy([nn.Embedding, nn.Linear]))
