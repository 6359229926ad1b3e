"""Checkpoints under tensor parallelism: the whole parameters' names and shapes, each rank its piece,
as FSDP2 + TP writes them; resharded between (dp, tp) meshes and 1-D; FSDP2 + TP interop both ways;
safetensors over both axes."""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp_fn as ff
import fsdp_fn.checkpoint as ckpt
from tests.helpers import local_part, reference_run, tiny_llama

# Grouped-query attention (4 heads, 2 key-value heads), a vocabulary (61) and an MLP width (87)
# that no tensor-parallel size divides: the pieces are uneven, and so are the shards within them.
CFG = {"vocab_size": 61, "hidden_size": 32, "intermediate_size": 87, "num_attention_heads": 4, "num_key_value_heads": 2}
LR = 1e-2

# name: (ranks, mesh shape, its axes' names); "stage" runs two independent (dp, tp) meshes side by
# side (as pipeline stages would), so a 2-rank (1, 2) mesh runs in the pool of 4. None: 1-D, no TP.
MESHES = {
    "dp2.tp2": (4, (2, 2), ("dp", "tp")),
    "dp1.tp2": (4, (2, 1, 2), ("stage", "dp", "tp")),
    "dp4.tp1": (4, (4, 1), ("dp", "tp")),
    "rep2.dp1.tp2": (4, (2, 1, 2), ("dp_replicate", "dp", "tp")),
    "dp3": (3, None, None),
    "dp4": (4, None, None),
}


def _loss(model, batch):
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


def _batch(k: int) -> torch.Tensor:
    return torch.randint(0, CFG["vocab_size"], (12, 9), generator=torch.Generator().manual_seed(k))


# --- helpers run on the ranks -------------------------------------------------------------


def _target(group, mesh: str):
    """(what to shard over, whether it has a tensor axis, data-parallel ranks and this rank's place
    among them, the stage this rank is in)."""
    from torch.distributed.device_mesh import init_device_mesh

    _, shape, names = MESHES[mesh]
    if shape is None:
        return group, False, group.size(), group.rank(), 0
    full = init_device_mesh("cpu", shape, mesh_dim_names=names)
    stage = 0
    if names[0] == "stage":
        stage = full.get_coordinate()[0]
        full = full["dp", "tp"]
    data = [i for i, n in enumerate(full.mesh_dim_names) if n != "tp"]
    coordinate = full.get_coordinate()
    world, rank = 1, 0
    for i in data:  # the batch is split over every axis but the tensor-parallel one
        world, rank = world * full.size(i), rank * full.size(i) + coordinate[i]
    return full, True, world, rank, stage


def _setup(group, mesh: str, seed: int = 0, **cfg):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.set_num_threads(1)
    model = tiny_llama(seed, **{**CFG, **cfg})
    fn = ff.functionalize(model)
    target, tp, world, rank, stage = _target(group, mesh)
    policy = ff.layer_policy([LlamaDecoderLayer])
    plan = ff.make_plan(model, policy, tp=model._tp_plan, mesh=target) if tp else ff.make_plan(model, policy)
    step = ff.train_step(fn, _loss, ff.adamw(lr=LR))
    state = step.init(ff.shard(fn.params, plan, target))
    return model, step, state, (world, rank, stage)


def _train(step, state, where, first: int, last: int):
    world, rank, _ = where
    losses = []
    for k in range(first, last):
        state, metrics = step(state, local_part(_batch(k), rank, world))
        losses.append(metrics["loss"].item())
    return state, losses


def _full(state) -> dict[str, torch.Tensor]:
    """Parameters and AdamW state, whole (gathered over every axis), keyed as in the checkpoint."""
    out = {f"model.{k}": v.clone() for k, v in ff.unshard(state.params).items()}
    opt = state.opt_state[0]  # adamw's chain: (scale_by_adam, add_decayed_weights, scale_by_learning_rate)
    for name, tree in (("exp_avg", opt.mu), ("exp_avg_sq", opt.nu)):
        for k, v in ff.unshard(tree, frozen=False).items():
            out[f"optim.state.{k}.{name}"] = v.clone()
    for unit in state.params.plan.units:
        steps = opt.count[unit.name]
        for i, spec in enumerate(unit.params):
            out[f"optim.state.{spec.name}.step"] = (steps if steps.dim() == 0 else steps[i]).clone()
    return out


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """The keys whose tensors differ in any bit, dtype or shape (or are missing on one side)."""
    keys = sorted(set(got) | set(want))
    return [
        k
        for k in keys
        if k not in got or k not in want or got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])
    ]


def _save(group, directory, mesh: str, steps: int = 2):
    model, step, state, where = _setup(group, mesh)
    state, _ = _train(step, state, where, 0, steps)
    stage = where[2]
    ckpt.save(directory if stage == 0 else f"{directory}.stage{stage}", state, extra={"next": steps})
    drawn = torch.rand(3)  # what the RNG state saved draws next
    return _full(state), drawn


def _load(group, directory, mesh: str):
    model, step, like, where = _setup(group, mesh, seed=1)  # other values: the load must overwrite them
    torch.manual_seed(100 + dist.get_rank())
    state, extra = ckpt.load(directory, like)
    drawn = torch.rand(3)
    full = _full(state)
    state, losses = _train(step, state, where, extra["next"], extra["next"] + 1)
    return full, extra, state.step, drawn, losses[0]


# --- the format ---------------------------------------------------------------------------


def test_entries_are_the_whole_parameters_each_rank_writing_its_piece(pool, tmp_path):
    # Catches: local (per-TP-rank) shapes in the checkpoint, a TP rank's piece written at the first
    # rank's offsets (or not at all), a replicated parameter written by every rank of the axis.
    d = tmp_path / "c"
    pool.run(_save, str(d), "dp2.tp2", world=4)
    md = ckpt.read_metadata(d)
    model = tiny_llama(**CFG)
    for name, p in model.named_parameters():
        for key in (f"model.{name}", f"optim.state.{name}.exp_avg", f"optim.state.{name}.exp_avg_sq"):
            assert tuple(md.state_dict_metadata[key].size) == tuple(p.shape), key
    assert ckpt.verify(d).chunks > 0  # every tensor covered exactly by its chunks, no overlap, digests match

    def chunks(key):  # (offsets, sizes, file) of each chunk
        sizes = {tuple(c.offsets): tuple(c.sizes) for c in md.state_dict_metadata[key].chunks}
        return [
            (tuple(i.offset), sizes[tuple(i.offset)], info.relative_path)
            for i, info in md.storage_data.items()
            if i.fqn == key
        ]

    # a (dp, tp) mesh numbers its ranks dp * 2 + tp: ranks 1 and 3 hold the second piece of a split
    tp_rank = {f"__{r}_0.distcp": r % 2 for r in range(4)}
    for key, dim, length in [
        ("model.model.layers.0.mlp.down_proj.weight", 1, 87),  # rowwise: its input features
        ("model.model.layers.1.mlp.gate_proj.weight", 0, 87),  # colwise: its output features
        ("optim.state.model.layers.1.self_attn.k_proj.weight.exp_avg", 0, 16),  # GQA: 2 heads of 8
        ("model.model.embed_tokens.weight", 0, 61),  # the vocabulary, 31 + 30
    ]:
        found = chunks(key)
        assert {tp_rank[f] for *_, f in found} == {0, 1}, key  # each piece written, by the ranks holding it
        half = -(-length // 2)  # torch.chunk's pieces: [0, half) and [half, length)
        for offsets, sizes, file in found:
            lo, hi = (0, half) if tp_rank[file] == 0 else (half, length)
            assert lo <= offsets[dim] and offsets[dim] + sizes[dim] <= hi, (key, offsets, sizes, file)
    for key in ("model.model.norm.weight", "optim.state.model.layers.0.input_layernorm.weight.exp_avg"):
        files = {f for *_, f in chunks(key)}
        assert files and files <= {"__0_0.distcp", "__2_0.distcp"}, files  # replicated: tp rank 0 alone writes it


# --- resharding ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [
        ("dp2.tp2", "dp2.tp2"),
        ("dp2.tp2", "dp1.tp2"),
        ("dp2.tp2", "dp4.tp1"),
        ("dp2.tp2", "dp3"),
        ("dp2.tp2", "rep2.dp1.tp2"),
        ("dp4", "dp2.tp2"),
        ("dp1.tp2", "dp2.tp2"),
    ],
)
def test_saved_at_one_mesh_loads_bitwise_at_another_and_trains_on(pool, tmp_path, saved, loaded):
    # Catches: a piece read at another TP rank's offsets, local shapes compared with whole ones, the
    # optimizer state resharded wrong, the RNG state of another mesh's rank restored.
    d = str(tmp_path / "c")
    written = pool.run(_save, d, saved, world=MESHES[saved][0])
    want = written[0][0]
    got = pool.run(_load, d, loaded, world=MESHES[loaded][0])
    ref = reference_run(tiny_llama(**CFG), _loss, [_batch(k) for k in range(3)], lambda p: torch.optim.AdamW(p, lr=LR))
    for rank, (full, extra, step, drawn, loss) in enumerate(got):
        assert extra == {"next": 2} and step == 3
        assert not _same(full, want), _same(full, want)[:5]
        if saved == loaded:  # each rank its own RNG state, as saved
            assert torch.equal(drawn, written[rank][1])
        else:  # another mesh: the RNG is left as it was
            assert torch.equal(drawn, torch.rand(3, generator=torch.Generator().manual_seed(100 + rank)))
        assert loss == pytest.approx(ref["losses"][2], rel=1e-5)  # the third step of an unsharded run


def _manager(group, root):
    model, step, state, where = _setup(group, "dp2.tp2")
    manager = ckpt.CheckpointManager(root, keep=1)
    for k in range(2):
        state, _ = _train(step, state, where, k, k + 1)
        manager.save(state, extra={"next": k + 1}, blocking=k == 0)  # the second in the background
    want = _full(state)
    state, _ = _train(step, state, where, 2, 3)  # while it is written
    manager.wait()
    _, _, like, _ = _setup(group, "dp4.tp1", seed=1)
    restored, extra = manager.restore(like)
    return manager.steps(), extra, _same(_full(restored), want)


def test_the_manager_saves_in_the_background_and_restores_a_tensor_parallel_state(pool, tmp_path):
    # Catches: a background save's copy losing the layout's tensor axis, the manager's pruning
    # rank chosen on another group than the save's.
    for steps, extra, differ in pool.run(_manager, str(tmp_path / "run"), world=4):
        assert steps == [2] and extra == {"next": 2}
        assert not differ


def _mismatched(group, directory, phase):
    if phase == "save":
        return _save(group, directory, "dp2.tp2")[1]
    _, _, like, _ = _setup(group, "dp2.tp2", intermediate_size=88)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load(directory, like)
    return str(e.value)


def test_a_checkpoint_of_another_model_is_named_in_whole_shapes(pool, tmp_path):
    # Catches: the check comparing a TP rank's piece (44 or 43 rows) with the whole saved shape.
    d = str(tmp_path / "c")
    pool.run(_mismatched, d, "save", world=4)
    for message in pool.run(_mismatched, d, "load", world=4):
        assert re.search(
            r"gate_proj\.weight.* has shape \(87, 32\) in the checkpoint, \(88, 32\) in the target", message
        )


# --- torch FSDP2 + TP interop ---------------------------------------------------------------


def _fsdp2_tp(model, mesh):
    """``model`` under torch's own tensor parallelism (its ``_tp_plan`` as torch's styles, matched
    here with a regex of our own), then FSDP2 over the dp axis, with AdamW."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    }
    peer = copy.deepcopy(model)
    plan = {}
    for name, _ in peer.named_modules():
        for pattern, style in model._tp_plan.items():
            if re.fullmatch(re.escape(pattern).replace(r"\*", r"[^.]+"), name):
                plan[name] = styles[style]()
                break
    parallelize_module(peer, mesh["tp"], plan)
    for layer in peer.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(peer, mesh=mesh["dp"])
    return peer, torch.optim.AdamW(peer.parameters(), lr=LR)


def _peer_step(peer, opt, k: int, mesh, forward: bool) -> float | None:
    """One AdamW step of the peer: on its dp rank's part of batch ``k``, or (``forward=False``) on
    gradients made up from the parameters alone (elementwise, so any placement takes them)."""
    opt.zero_grad()
    if not forward:
        for p in peer.parameters():
            p.grad = torch.sin(p.detach() * (k + 1))
        opt.step()
        return None
    batch = local_part(_batch(k), mesh["dp"].get_local_rank(), mesh["dp"].size())
    with warnings.catch_warnings():  # FSDP2 warns that the root's output is a view (of the logits)
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        loss = _loss(peer, batch)
    loss.backward()
    opt.step()
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh["dp"].get_group())
    return total.item() / mesh["dp"].size()


def _peer_full(peer, opt) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(peer, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for name, v in st.items():
            out[f"optim.state.{fqn}.{name}"] = v
    return out


def _from_fsdp2_tp(group, directory, width: int):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    forward = width % 2 == 0  # torch's RowwiseParallel cannot run an uneven width (see docs/checkpoints.md)
    model, step, like, where = _setup(group, "dp2.tp2", intermediate_size=width)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    peer, opt = _fsdp2_tp(model, mesh)
    for k in range(2):
        _peer_step(peer, opt, k, mesh, forward)
    msd, osd = get_state_dict(peer, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=directory, process_group=group)
    theirs = _peer_full(peer, opt)
    state, extra = ckpt.load(directory, like)
    differ = _same(_full(state), theirs)
    _, _, flat_like, _ = _setup(group, "dp4", intermediate_size=width)  # and into a 1-D plan
    differ_flat = _same(_full(ckpt.load(directory, flat_like)[0]), theirs)
    mine = theirs_loss = None
    if forward:
        _, losses = _train(step, state, where, 2, 3)
        mine, theirs_loss = losses[0], _peer_step(peer, opt, 2, mesh, forward)
    return differ, differ_flat, state.step, extra, mine, theirs_loss


def _to_fsdp2_tp(group, directory, width: int):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    forward = width % 2 == 0
    model, step, state, where = _setup(group, "dp2.tp2", intermediate_size=width)
    state, _ = _train(step, state, where, 0, 2)
    hyper = torch.optim.AdamW([torch.zeros(1)], lr=LR).defaults
    ckpt.save(directory, state, hyperparams=hyper)
    mine = _full(state)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    peer, opt = _fsdp2_tp(model, mesh)
    msd, osd = get_state_dict(peer, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=directory, process_group=group)
    set_state_dict(peer, opt, model_state_dict=msd, optim_state_dict=osd)
    differ = _same(_peer_full(peer, opt), mine)
    ours = theirs = None
    if forward:
        _, losses = _train(step, state, where, 2, 3)
        ours, theirs = losses[0], _peer_step(peer, opt, 2, mesh, forward)
    return differ, ours, theirs


@pytest.mark.parametrize("width", [87, 88], ids=["uneven-mlp", "trained"])
def test_an_fsdp2_tp_checkpoint_loads_into_fsdp_fn(pool, tmp_path, width):
    # Catches: a piece of FSDP2 + TP's (strided) chunks read at the wrong offsets, in (dp, tp) or 1-D.
    for differ, differ_flat, step, extra, mine, theirs in pool.run(_from_fsdp2_tp, str(tmp_path / "c"), width, world=4):
        assert not differ, differ[:5]  # parameters and AdamW state, bitwise
        assert not differ_flat, differ_flat[:5]
        assert step == 2 and extra is None  # the step from torch's optimizer state
        if width % 2 == 0:
            assert mine == pytest.approx(theirs, rel=1e-5)  # and training goes on alike


@pytest.mark.parametrize("width", [87, 88], ids=["uneven-mlp", "trained"])
def test_an_fsdp_fn_tp_checkpoint_loads_into_fsdp2_tp(pool, tmp_path, width):
    for differ, ours, theirs in pool.run(_to_fsdp2_tp, str(tmp_path / "c"), width, world=4):
        assert not differ, differ[:5]
        if width % 2 == 0:
            assert ours == pytest.approx(theirs, rel=1e-5)


# --- safetensors and state dicts --------------------------------------------------------------


def _export(group, directory):
    model, step, state, where = _setup(group, "dp2.tp2")
    state, _ = _train(step, state, where, 0, 2)
    d = Path(directory)
    files = ckpt.export_safetensors(d / "hf", state.params, max_shard_size=20_000)
    single = ckpt.export_safetensors(d / "one", state.params, dtype=torch.bfloat16)
    exported = ckpt.export_state_dict(state.params)
    return ff.unshard(state.params), exported, files, single


def _import(group, directory, mesh: str):
    _, _, like, _ = _setup(group, mesh, seed=1)
    d = Path(directory)
    ours = ff.unshard(ckpt.import_safetensors(d / "hf", like.params))
    _, _, like, _ = _setup(group, mesh, seed=1)
    pretrained = ff.unshard(ckpt.import_safetensors(d / "pretrained", like.params))
    saved = torch.load(d / "full.pt")
    _, _, like, _ = _setup(group, mesh, seed=1)
    from_state_dict = ff.unshard(ckpt.import_state_dict(saved, like.params))
    return ours, pretrained, from_state_dict


def test_safetensors_hold_whole_tensors_and_import_into_each_ranks_piece(pool, tmp_path):
    # Catches: a TP rank's piece written over another's bytes or at local offsets, local shapes in
    # the header, the row-split weight's rows written as one run, an import reading the first piece.
    from safetensors import safe_open
    from safetensors.torch import load_file

    results = pool.run(_export, str(tmp_path), world=4)
    full, exported, files, single = results[0]
    assert len(files) > 1 and all(r[2] == files for r in results)
    written = {}
    for f in files:
        written.update(load_file(f))
    assert not _same(written, full)  # every tensor whole, under its name, bitwise
    with safe_open(str(single[0]), framework="pt") as f:
        assert {k: f.get_tensor(k).shape for k in f.keys()} == {k: v.shape for k, v in full.items()}  # noqa: SIM118
        assert all(torch.equal(f.get_tensor(k), v.to(torch.bfloat16)) for k, v in full.items())
    # export_state_dict: the whole parameters on the first rank (dp 0, tp 0), in the module's order
    assert list(exported) == [n for n, _ in tiny_llama(**CFG).named_parameters()]
    assert not _same(exported, full)
    assert all(r[1] is None for r in results[1:])
    pretrained = tiny_llama(2, **CFG)
    pretrained.save_pretrained(tmp_path / "pretrained", max_shard_size="30KB")
    torch.save(full, tmp_path / "full.pt")
    want = dict(pretrained.state_dict())
    for mesh in ("dp2.tp2", "dp1.tp2", "dp3"):
        for ours, from_pretrained, from_state_dict in pool.run(_import, str(tmp_path), mesh, world=MESHES[mesh][0]):
            assert not _same(ours, full), (mesh, _same(ours, full)[:5])
            assert not _same(from_pretrained, {k: want[k] for k in from_pretrained}), mesh
            assert not _same(from_state_dict, full), mesh
