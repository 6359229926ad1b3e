"""Checkpoints: DCP format keyed by FQN, resharding, bitwise resume, atomic saves, clear errors."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import math
import os
import pickle
import re
import shutil
import signal
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

import fsdp_fn as ff
import fsdp_fn.checkpoint as ckpt
from examples.gpt import GPT, Block, GPTConfig, lm_loss
from fsdp_fn.checkpoint import _opt_state
from fsdp_fn.checkpoint._dcp import boxes
from fsdp_fn.testing import RankError, RankPool
from tests.helpers import batch_for, local_part, make, reference_run, tiny_llama

CFG = GPTConfig(vocab=37, seq=9, d_model=12, n_layers=3, n_heads=2)
LR = 1e-2


# --- helpers run on the ranks -------------------------------------------------------------


def _setup(group, cfg=CFG, *, policy="blocks", split_root=False, hsdp=False, meta=False, seed=0):
    """(model, step, state) for the tiny GPT: the same initial values whatever the plan or world size."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    if meta:
        with torch.device("meta"):
            model = GPT(cfg)
    target = group
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh

        target = init_device_mesh("cpu", (2, group.size() // 2), mesh_dim_names=("replicate", "shard"))
    pol = ff.layer_policy([Block]) if policy == "blocks" else ff.size_policy(min_num_params=200)
    plan = ff.make_plan(model, pol, split_root=split_root)
    fn = ff.functionalize(model)
    step = ff.train_step(fn, lm_loss, ff.adamw(lr=LR))
    if meta:
        params, buffers = ff.init_shards(model, plan, target, device="meta")
        return model, step, step.init(params, buffers)
    return model, step, step.init(ff.shard(fn.params, plan, target))


def _train(model, step, state, group, first: int, last: int):
    rank, world = group.rank(), group.size()
    out = []
    for k in range(first, last):
        state, metrics = step(state, local_part(batch_for("gpt", model, k), rank, world))
        out.append((metrics["loss"].item(), metrics["grad_norm"].item()))
    return state, out


def _full(state) -> dict[str, torch.Tensor]:
    """Parameters and AdamW state unsharded (every rank), keyed as in the checkpoint."""
    out = {f"model.{k}": v.clone() for k, v in ff.unshard(state.params).items()}
    opt = state.opt_state[0]  # adamw's chain: (scale_by_adam, add_decayed_weights, scale_by_learning_rate)
    for name, tree in (("exp_avg", opt.mu), ("exp_avg_sq", opt.nu)):
        for k, v in ff.unshard(tree).items():
            if k in {p.name for u in tree.plan.units for p in u.params}:
                out[f"optim.state.{k}.{name}"] = v.clone()
    for unit in state.params.plan.units:
        steps = opt.count[unit.name]
        for i, spec in enumerate(unit.params):
            out[f"optim.state.{spec.name}.step"] = (steps if steps.dim() == 0 else steps[i]).clone()
    return out


def _save_after(group, directory, steps=2):
    model, step, state = _setup(group)
    state, _ = _train(model, step, state, group, 0, steps)
    ckpt.save(directory, state, extra={"next": steps})
    return _full(state)


def _load_full(group, directory, **setup_kw):
    model, step, like = _setup(group, **setup_kw)
    state, extra = ckpt.load(directory, like)
    full = _full(state)
    state, metrics = _train(model, step, state, group, extra["next"], extra["next"] + 2)
    return full, extra, metrics, state.step


# --- boxes -------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3, 2), ()])
def test_boxes_cover_a_flat_range_exactly(shape):
    n = 1
    for d in shape:
        n *= d
    ref = torch.arange(n).reshape(shape)
    for lo in range(n + 1):
        for hi in range(lo, n + 1):
            got = boxes(shape, lo, hi)
            assert len(got) <= max(1, 2 * len(shape) - 1)
            flat = [ref[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))].reshape(-1) for b in got]
            covered = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.long)
            assert torch.equal(covered, torch.arange(lo, hi)), (shape, lo, hi)
            assert all(b.start == int(f[0]) for b, f in zip(got, flat))


# --- format and resharding ----------------------------------------------------------------


def _keys(group, directory):
    md = dcp_metadata(directory)
    return sorted(md.state_dict_metadata)


def dcp_metadata(directory):
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(directory).read_metadata()


def test_entries_are_keyed_by_fqn_in_torch_layout(pool, tmp_path):
    d = str(tmp_path / "c")
    pool.run(_save_after, d, world=2)
    keys = set(dcp_metadata(d).state_dict_metadata)
    torch.manual_seed(0)
    names = [n for n, _ in GPT(CFG).named_parameters()]
    for n in names:
        assert f"model.{n}" in keys
        assert {f"optim.state.{n}.{s}" for s in ("step", "exp_avg", "exp_avg_sq")} <= keys
    assert "model.blocks.1.fc.weight" in keys
    assert json.loads((Path(d) / ckpt.COMMIT_MARKER).read_text())["step"] == 2
    # each rank wrote its own file
    assert sorted(p.name for p in Path(d).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.parametrize(
    ("world", "setup_kw"),
    [
        (1, {}),
        (3, {}),
        (4, {}),
        (3, {"policy": "size", "split_root": True}),
        (4, {"hsdp": True, "split_root": True}),
        (2, {"meta": True}),
    ],
    ids=["W1", "W3", "W4", "W3-other-plan", "W4-hybrid-mesh", "W2-meta-template"],
)
def test_save_at_two_loads_resharded_bitwise_and_trains_on(pool, tmp_path, world, setup_kw):
    d = str(tmp_path / "c")
    saved = pool.run(_save_after, d, world=2)[0]
    got = pool.run(_load_full, d, world=world, **setup_kw)
    for full, extra, _metrics, step in got:
        assert extra == {"next": 2} and step == 4  # 2 loaded, 2 more
        assert full.keys() == saved.keys()
        for k, v in saved.items():
            assert torch.equal(full[k], v), k
    # training continues with parity to the unsharded reference (4 steps straight)
    torch.manual_seed(0)
    model = GPT(CFG)
    ref = reference_run(
        model, lm_loss, [batch_for("gpt", model, k) for k in range(4)], lambda p: torch.optim.AdamW(p, lr=LR)
    )
    losses = [loss for loss, _ in got[0][2]]
    assert losses == pytest.approx(ref["losses"][2:], rel=1e-5)


def _integer_state(group, seed):
    model, policy, loss_fn = make("int", seed)
    fn = ff.functionalize(model)
    step = ff.train_step(fn, loss_fn, ff.adamw(lr=LR))
    return model, step, step.init(ff.shard(fn.params, ff.make_plan(model, policy), group))


def _exactly(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    same = (got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in want.items())
    return got.keys() == want.keys() and all(same)


def _integer_checkpoint(group, directory, phase):
    """After two AdamW steps of a model with integer parameters: save, export_safetensors and
    export_state_dict; at another world size (from a model of other values) load, import_safetensors
    and import_state_dict, each compared with what was saved, the integer parameters' dtype too."""
    from safetensors.torch import load_file

    d = Path(directory)
    if phase == "save":
        model, step, state = _integer_state(group, seed=0)
        for k in range(2):
            state, _ = step(state, local_part(batch_for("int", model, k), group.rank(), group.size()))
        ckpt.save(d / "c", state, extra={"next": 2})
        files = ckpt.export_safetensors(d / "hf", state.params)
        sd = ckpt.export_state_dict(state.params)
        full = _full(state)
        if group.rank() == 0:
            torch.save({k.removeprefix("model."): v for k, v in full.items() if k.startswith("model.")}, d / "full.pt")
        written = load_file(files[0]) if group.rank() == 0 else None
        return full, sd, written
    model, step, like = _integer_state(group, seed=1)  # other values, the integer ones too
    state, extra = ckpt.load(d / "c", like)
    full = _full(state)
    saved = torch.load(d / "full.pt")
    imported = ff.unshard(ckpt.import_safetensors(d / "hf", like.params))
    from_sd = ff.unshard(ckpt.import_state_dict(saved, like.params))
    state, metrics = step(state, local_part(batch_for("int", model, 2), group.rank(), group.size()))
    return full, _exactly(imported, saved), _exactly(from_sd, saved), math.isfinite(metrics["loss"].item())


@pytest.mark.parametrize("world", [1, 3])
def test_integer_parameters_round_trip_through_checkpoints_and_exports_at_another_world_size(pool, tmp_path, world):
    # Catches: an integer parameter saved, exported or loaded in a floating dtype (or not at all),
    # resharded wrong where 5 elements divide by neither 2 nor 3, or given optimizer state.
    saved, sd, written = pool.run(_integer_checkpoint, str(tmp_path), "save", world=2)[0]
    model, _, _ = make("int")
    integers = {k: v for k, v in model.named_parameters() if not v.is_floating_point()}
    params = {k.removeprefix("model."): v for k, v in saved.items() if k.startswith("model.")}
    names = [n for n, _ in model.named_parameters()]
    assert sorted(params) == sorted(names)
    assert _exactly({k: params[k] for k in integers}, integers)  # frozen: never moved
    md = dcp_metadata(str(tmp_path / "c")).state_dict_metadata
    assert {k: md[f"model.{k}"].properties.dtype for k in integers} == {k: v.dtype for k, v in integers.items()}
    assert not [k for k in md if any(k.startswith(f"optim.state.{n}.") for n in integers)]  # no optimizer state
    assert _exactly(sd, params) and list(sd) == names  # the module's own order
    assert _exactly(written, params)  # safetensors holds I32, BOOL and I64 as they are
    loaded = pool.run(_integer_checkpoint, str(tmp_path), "load", world=world)
    for full, from_safetensors, from_state_dict, trains in loaded:
        assert _exactly(full, saved)
        assert from_safetensors and from_state_dict and trains


# --- torch FSDP2 interop ------------------------------------------------------------------


def _fsdp2(group, model):
    import copy

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    peer = copy.deepcopy(model)
    mesh = DeviceMesh.from_group(group, "cpu")
    for block in peer.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(peer, mesh=mesh)
    return peer, torch.optim.AdamW(peer.parameters(), lr=LR)


def _fsdp2_full(peer, opt) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(peer, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for name, v in st.items():
            out[f"optim.state.{fqn}.{name}"] = v
    return out


def _fsdp2_step(peer, opt, batch, group):
    opt.zero_grad()
    loss = lm_loss(peer, batch)
    loss.backward()
    opt.step()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return total.item() / group.size()


def _from_fsdp2(group, directory):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, step, like = _setup(group)
    rank, world = group.rank(), group.size()
    peer, opt = _fsdp2(group, model)
    for k in range(2):
        _fsdp2_step(peer, opt, local_part(batch_for("gpt", model, k), rank, world), group)
    msd, osd = get_state_dict(peer, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=directory, process_group=group)
    theirs = _fsdp2_full(peer, opt)
    state, extra = ckpt.load(directory, like)
    mine = _full(state)
    same = mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    batch = local_part(batch_for("gpt", model, 2), rank, world)
    loaded_step = state.step
    state, metrics = step(state, batch)
    return same, loaded_step, extra, metrics["loss"].item(), _fsdp2_step(peer, opt, batch, group)


def _to_fsdp2(group, directory):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, step, state = _setup(group)
    rank, world = group.rank(), group.size()
    state, _ = _train(model, step, state, group, 0, 2)
    hyper = torch.optim.AdamW([torch.zeros(1)], lr=LR).defaults
    ckpt.save(directory, state, hyperparams=hyper)
    mine = _full(state)
    peer, opt = _fsdp2(group, model)
    msd, osd = get_state_dict(peer, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=directory, process_group=group)
    set_state_dict(peer, opt, model_state_dict=msd, optim_state_dict=osd)
    theirs = _fsdp2_full(peer, opt)
    same = mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    batch = local_part(batch_for("gpt", model, 2), rank, world)
    _, metrics = step(state, batch)
    return same, metrics["loss"].item(), _fsdp2_step(peer, opt, batch, group)


def test_a_torch_fsdp2_checkpoint_loads_into_fsdp_fn(pool, tmp_path):
    for same, step, extra, mine, theirs in pool.run(_from_fsdp2, str(tmp_path / "c"), world=2):
        assert same  # parameters and AdamW state, bitwise
        assert step == 2 and extra is None  # the step from torch's optimizer state
        assert mine == pytest.approx(theirs, rel=1e-5)  # and training goes on alike


def test_an_fsdp_fn_checkpoint_loads_into_torch_fsdp2(pool, tmp_path):
    for same, mine, theirs in pool.run(_to_fsdp2, str(tmp_path / "c"), world=2):
        assert same
        assert mine == pytest.approx(theirs, rel=1e-5)


# --- bit-identical resume (dropout: every rank's RNG state is in the checkpoint) ------------


class DropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Dropout(0.3), nn.Linear(13, 5), nn.Dropout(0.2))

    def forward(self, x):
        return self.net(x)


def _mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _dropout_run(group, root, first, last, *, save_at=None):
    """Train steps [first, last) of the dropout MLP; resume from ``root``'s latest when first > 0."""
    rank, world = group.rank(), group.size()
    torch.manual_seed(0)
    model = DropoutMLP()
    fn = ff.functionalize(model)
    step = ff.train_step(fn, _mse, ff.adamw(lr=LR))
    state = step.init(ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([nn.Linear])), group))
    torch.manual_seed(100 + rank)  # dropout masks differ per rank
    manager = ckpt.CheckpointManager(root, keep=2)
    if first:
        state, extra = manager.restore(state)
        assert extra["data"] == first
    trace = []
    for k in range(first, last):
        g = torch.Generator().manual_seed(k)
        x, y = torch.randn(8, 7, generator=g), torch.randn(8, 5, generator=g)
        state, metrics = step(state, local_part((x, y), rank, world))
        trace.append((metrics["loss"].item(), metrics["grad_norm"].item()))
        if save_at == k + 1:
            manager.save(state, extra={"data": k + 1})
    return trace, _full_mlp(state)


def _full_mlp(state):
    return {
        "params": ff.unshard(state.params),
        "exp_avg": ff.unshard(state.opt_state[0].mu),
        "exp_avg_sq": ff.unshard(state.opt_state[0].nu),
        "steps": {u: s.clone() for u, s in state.opt_state[0].count.shards.items()},
        "rng": torch.get_rng_state(),
    }


@pytest.fixture(scope="module")
def fresh():
    """Two ranks of their own: new processes for resumes, and ranks a test may kill."""
    with RankPool(2, timeout=180) as p:
        yield p


def test_resume_in_new_processes_is_bitwise_identical(pool, fresh, tmp_path):
    root = str(tmp_path / "run")
    straight = pool.run(_dropout_run, str(tmp_path / "unused"), 0, 6, world=2)
    first = pool.run(_dropout_run, root, 0, 3, save_at=3, world=2)
    second = fresh.run(_dropout_run, root, 3, 6, world=2)
    for (trace, full), (t1, _), (t2, resumed) in zip(straight, first, second):
        assert trace == t1 + t2  # every loss and gradient norm, exactly
        for kind in ("params", "exp_avg", "exp_avg_sq", "steps"):
            assert full[kind].keys() == resumed[kind].keys()
            assert all(torch.equal(full[kind][k], resumed[kind][k]) for k in full[kind]), kind
        assert torch.equal(full["rng"], resumed["rng"])


# --- atomic saves, retention, errors ------------------------------------------------------


def _save_steps(group, root, steps, keep, kill_rank=None):
    """Save the tiny GPT at each of ``steps``; ``kill_rank`` SIGKILLs itself inside the last save."""
    import torch.distributed.checkpoint.filesystem as fs

    model, step, state = _setup(group)
    manager = ckpt.CheckpointManager(root, keep=keep)
    for s in steps:
        state = state._replace(step=s)
        if kill_rank is not None and s == steps[-1] and group.rank() == kill_rank:
            write = fs.FileSystemWriter.write_data

            def write_then_die(self, plan, planner, write=write):
                out = write(self, plan, planner)
                out.wait()  # this rank's data is on disk; the commit has not happened
                os.kill(os.getpid(), signal.SIGKILL)

            fs.FileSystemWriter.write_data = write_then_die
        manager.save(state, extra=s)
    return manager.steps(), str(manager.latest())


def _restore(group, root):
    _, _, like = _setup(group)
    state, extra = ckpt.CheckpointManager(root).restore(like)
    return state.step, extra


def test_retention_keeps_the_last_k_and_finds_the_latest(pool, tmp_path):
    root = tmp_path / "run"
    (root / ".step_00000009.tmp").mkdir(parents=True)  # a killed save's leftovers
    steps, last = pool.run(_save_steps, str(root), [1, 2, 3, 4, 5], 2, world=2)[0]
    assert steps == [4, 5] and last == str(root / "step_00000005")
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004", "step_00000005"]
    assert pool.run(_restore, str(root), world=3) == [(5, 5)] * 3
    with pytest.raises(RankError, match="already exists; checkpoints are never overwritten"):
        pool.run(_save_steps, str(root), [5], 2, world=2)


def _skipping_run(group, root, name_by_loop):
    """Six calls of a step under ``apply_if_finite``, the third one's gradient NaN, a save after
    every second call: named after ``state.step`` or after the loop's count."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))
    fn = ff.functionalize(model)
    step = ff.train_step(fn, _mse, ff.apply_if_finite(ff.adamw()))
    state = step.init(ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([nn.Linear])), group))
    manager = ckpt.CheckpointManager(root, keep=None)
    for k in range(6):
        g = torch.Generator().manual_seed(k)
        x, y = torch.randn(4, 7, generator=g), torch.randn(4, 5, generator=g)
        state, _ = step(state, (x * float("nan") if k == 2 else x, y))
        if name_by_loop and (k + 1) % 2 == 0:
            manager.save(state, step=k + 1, extra={"data": k + 1})
        elif not name_by_loop and state.step % 2 == 0:  # the state does not move at the skipped step
            try:
                manager.save(state, extra={"data": k + 1})
            except ckpt.CheckpointError as e:
                return str(e), state.step, manager.steps()
    restored, extra = manager.restore(state)
    return manager.steps(), restored.step, extra


def test_a_skipped_step_does_not_move_the_step_a_manager_names_after(pool, tmp_path):
    """``state.step`` counts the steps applied: after a skipped one a loop that saves when
    ``state.step % K == 0`` saves the same step again, refused with the fix in the message;
    named after the loop's own count, the checkpoints and the data position agree."""
    for message, applied, steps in pool.run(_skipping_run, str(tmp_path / "by_state"), False, world=2):
        assert "step_00000002 already exists; checkpoints are never overwritten" in message, message
        assert "pass save(state, step=...) the loop's own count" in message
        assert applied == 2 and steps == [2]
    for steps, applied, extra in pool.run(_skipping_run, str(tmp_path / "by_loop"), True, world=2):
        assert steps == [2, 4, 6] and applied == 5 and extra == {"data": 6}


def test_sigkill_during_a_save_leaves_the_previous_checkpoint_loadable(fresh, tmp_path):
    root = tmp_path / "run"
    with pytest.raises(RankError, match="rank 1 died"):
        fresh.run(_save_steps, str(root), [1, 2], 3, kill_rank=1, world=2)
    partial = root / ".step_00000002.tmp"
    assert (partial / "__1_0.distcp").is_file()  # rank 1 had written its part
    assert ckpt.latest(root) == root / "step_00000001"
    assert fresh.run(_restore, str(root), world=2) == [(1, 1), (1, 1)]
    with pytest.raises(RankError, match="not a complete checkpoint: it has no COMMITTED marker"):
        fresh.run(_load_full, str(partial), world=2)
    # The restarted job reaches the killed step again and saves it over the leftovers.
    for steps, last in fresh.run(_save_steps, str(root), [2], 3, world=2):
        assert steps == [1, 2] and last == str(root / "step_00000002")
    assert not partial.exists()
    assert fresh.run(_restore, str(root), world=2) == [(2, 2), (2, 2)]


def _save_fails(group, root, where):
    """Save step 1, then a step 2 that fails on one rank alone (``where``: rank 0 creating its
    directory or committing it; rank 1 writing its data to a full disk), then step 2 again where it
    can succeed. The error as ``except Exception`` sees it."""
    _, _, state = _setup(group)
    manager = ckpt.CheckpointManager(root)
    manager.save(state._replace(step=1))
    from torch.distributed.checkpoint.filesystem import FileSystem

    rename, create_stream = os.rename, FileSystem.create_stream
    if where == "commit" and group.rank() == 0:

        def full_disk(src, dst):  # on fsdp_fn's commit of the directory only (DCP renames its files too)
            if Path(src).name == ".step_00000002.tmp":
                raise OSError(28, "No space left on device")
            rename(src, dst)

        os.rename = full_disk
    if where == "write" and group.rank() == 1:

        def no_space(self, path, mode):  # DCP's data files, as a full disk refuses them
            if Path(path).suffix == ".distcp":
                raise OSError(28, "No space left on device", str(path))
            return create_stream(self, path, mode)

        FileSystem.create_stream = no_space
    try:
        if where == "create":
            ckpt.save(Path(root) / "a_file" / "step_00000002", state._replace(step=2))
        else:
            manager.save(state._replace(step=2))
        error = "saved"
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        os.rename, FileSystem.create_stream = rename, create_stream
    latest = str(manager.latest())
    manager.save(state._replace(step=2))  # the state and the group are still usable
    return error, latest, manager.steps()


@pytest.mark.parametrize("where", ["create", "commit", "write"])
def test_a_save_failing_on_one_rank_fails_on_every_rank_and_keeps_the_last(pool, tmp_path, where):
    # Catches: rank 0's error leaving the other ranks waiting for a commit that never comes
    # (a hang), a failed save taking the last checkpoint with it, and (write) DCP's
    # CheckpointException, a BaseException that `except Exception` misses, its cause in a traceback.
    root = tmp_path / "run"
    root.mkdir()
    (root / "a_file").write_text("not a directory")
    for error, latest, steps in pool.run(_save_fails, str(root), where, world=2):
        if where == "write":
            first = error.splitlines()[0]
            assert first.startswith(
                f"CheckpointError: cannot write {root / 'step_00000002'}: rank 1: OSError: [Errno 28] "
                f"No space left on device: '{root / '.step_00000002.tmp' / '__1_0.distcp'}'"
            ), error
        else:
            assert error.startswith(f"CheckpointError: rank 0: cannot {where} "), error
        assert latest == str(root / "step_00000001")
        assert steps == [1, 2]


def _load_error(group, directory, cfg_kw, dtype=None):
    cfg = GPTConfig(**{**CFG.__dict__, **cfg_kw})
    model, step, like = _setup(group, cfg)
    if dtype is not None:
        model = GPT(cfg).to(dtype)
        fn = ff.functionalize(model)
        step = ff.train_step(fn, lm_loss, ff.adamw())
        like = step.init(ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([Block])), group))
    try:
        ckpt.load(directory, like)
    except ckpt.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"n_layers": 4}, r"has no parameter 'blocks\.3\.ln1\.weight' \(unit 'blocks\.3'\): missing"),
        ({"n_layers": 2}, r"has parameter 'blocks\.2\.ln1\.weight' that the target model does not have"),
        (
            {"vocab": 38},
            r"parameter 'wte\.weight' \(unit \(root\)\) has shape \(37, 12\) in the checkpoint, \(38, 12\)",
        ),
        ("float64", r"parameter 'wte\.weight' .* is torch\.float32 in the checkpoint, torch\.float64 in the target"),
        (
            "truncate",
            r"the data of (parameter|optimizer state '\w+' of) '\S+' .* is in __1_0\.distcp, which is truncated",
        ),
        ("no-marker", r"not a complete checkpoint: it has no COMMITTED marker"),
        ("bad-metadata", r"\.metadata does not match its digest in COMMITTED: the file is damaged"),
        ("missing", r"CheckpointError: no checkpoint at .*nowhere: no such path"),
    ],
)
def test_a_mismatched_partial_or_corrupt_checkpoint_is_named(pool, tmp_path, change, message):
    d = tmp_path / "c"
    pool.run(_save_after, str(d), 0, world=2)
    if change == "truncate":
        f = d / "__1_0.distcp"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif change == "no-marker":
        (d / ckpt.COMMIT_MARKER).unlink()
    elif change == "bad-metadata":
        (d / ".metadata").write_bytes(b"not a pickle")
    elif change == "missing":
        d = tmp_path / "nowhere"
    kw = change if isinstance(change, dict) else {}
    got = pool.run(_load_error, str(d), kw, torch.float64 if change == "float64" else None, world=2)
    for text in got:
        assert __import__("re").search(message, text), text


# --- untrusted directories: no code runs, nothing outside is read, damage is refused --------


class _Planted:
    """Unpickling it runs a shell command that creates ``marker`` (what a downloaded checkpoint may hold)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def pristine(pool, tmp_path_factory):
    """A checkpoint of the tiny GPT after 2 steps at W=2 (``extra={"next": 2}``); tests edit copies."""
    d = tmp_path_factory.mktemp("pristine") / "c"
    pool.run(_save_after, str(d), world=2)
    return d


def _copy(pristine: Path, to: Path) -> Path:
    shutil.copytree(pristine, to)
    return to


def _marker_edit(d: Path, **fields) -> None:
    marker = json.loads((d / ckpt.COMMIT_MARKER).read_text())
    (d / ckpt.COMMIT_MARKER).write_text(json.dumps({**marker, **fields}))


def _metadata_edit(d: Path, edit, *, forge: bool = True) -> None:
    """Edit ``d``'s DCP metadata (the test wrote it: unpickled here as is); ``forge``: record the new
    file's digest in the marker too, so only the checks past the digests stand in the way."""
    md = pickle.loads((d / ".metadata").read_bytes())
    edit(md)  # in place
    data = pickle.dumps(md)
    (d / ".metadata").write_bytes(data)
    if forge:
        _marker_edit(d, metadata=hashlib.sha256(data).hexdigest())


def _digests_edit(d: Path, edit) -> None:
    """Edit ``digests.json`` and record its new digest in the marker (a forger's edit); nothing to
    forge in a checkpoint written before digests existed."""
    if not (d / "digests.json").exists():
        return
    found = json.loads((d / "digests.json").read_text())
    found["chunks"] = edit(found["chunks"])
    data = json.dumps(found).encode()
    (d / "digests.json").write_bytes(data)
    _marker_edit(d, digests=hashlib.sha256(data).hexdigest())


def _entry(d: Path, fqn: str, file: str = "__1_0.distcp"):
    """(index, storage info) of a chunk of ``fqn`` in ``file``."""
    md = pickle.loads((d / ".metadata").read_bytes())
    return next((i, s) for i, s in md.storage_data.items() if i.fqn == fqn and s.relative_path == file)


def _flip_a_bit(d: Path, fqn: str, file: str = "__1_0.distcp") -> None:
    """Flip the lowest bit of one element of ``fqn``'s chunk in ``file`` (one ulp of a float)."""
    _, info = _entry(d, fqn, file)
    blob = (d / file).read_bytes()
    chunk = blob[info.offset : info.offset + info.length]
    raw = torch.load(io.BytesIO(chunk), weights_only=True).contiguous().view(torch.uint8).numpy().tobytes()
    at = info.offset + chunk.find(raw) + len(raw) // 2
    (d / file).write_bytes(blob[:at] + bytes([blob[at] ^ 1]) + blob[at + 1 :])


def _load_each(group, directories):
    """Load each directory into a fresh template; what happened to each, as text."""
    out = []
    for d in directories:
        _, _, like = _setup(group)
        try:
            _, extra = ckpt.load(d, like)
            out.append(f"loaded: extra={extra!r}")
        except Exception as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def _verify_error(d: Path) -> str:
    try:
        ckpt.verify(d)
    except ckpt.CheckpointError as e:
        return str(e)
    return "verified"


def _planted_cases(pristine: Path, tmp_path: Path, marker: Path) -> dict[str, Path]:
    cases = {}

    def plant(md):
        md.planner_data = _Planted(marker)

    # in .metadata, its new digest in the marker: only the unpickler stands in the way
    _metadata_edit(cases.setdefault("metadata", _copy(pristine, tmp_path / "metadata")), plant)
    # the same with the marker's old digest, and with no marker at all (as torch writes them)
    _metadata_edit(cases.setdefault("stale-digest", _copy(pristine, tmp_path / "stale")), plant, forge=False)
    _metadata_edit(cases.setdefault("no-marker", _copy(pristine, tmp_path / "no-marker")), plant, forge=False)
    (cases["no-marker"] / ckpt.COMMIT_MARKER).unlink()
    # fsdp_fn's own entry as a pickled object (as the old format held it), digests forged
    d = cases.setdefault("own-entry", _copy(pristine, tmp_path / "own-entry"))
    buf = io.BytesIO()
    torch.save({"step": 2, "extra": _Planted(marker)}, buf)
    (d / "__9_0.distcp").write_bytes(buf.getvalue())

    def pickled_entry(md):
        for index in [i for i in md.storage_data if i.fqn.startswith("fsdp_fn")]:
            del md.storage_data[index]
        md.state_dict_metadata = {k: v for k, v in md.state_dict_metadata.items() if not k.startswith("fsdp_fn")}
        md.state_dict_metadata["fsdp_fn"] = BytesStorageMetadata()
        md.storage_data[MetadataIndex("fsdp_fn")] = _StorageInfo("__9_0.distcp", 0, len(buf.getvalue()))

    _metadata_edit(d, pickled_entry)
    _digests_edit(
        d,
        lambda records: (
            [r for r in records if not r[0].startswith("fsdp_fn")]
            + [["fsdp_fn", None, "__9_0.distcp", 0, len(buf.getvalue()), hashlib.sha256(buf.getvalue()).hexdigest()]]
        ),
    )
    # a tensor chunk's bytes replaced by a pickled object, its digest forged
    d = cases.setdefault("chunk", _copy(pristine, tmp_path / "chunk"))
    index, _ = _entry(d, "model.wpe.weight")
    blob = (d / "__1_0.distcp").read_bytes()
    buf = io.BytesIO()
    torch.save(_Planted(marker), buf)
    planted = buf.getvalue()
    (d / "__1_0.distcp").write_bytes(blob + planted)  # appended: the chunk's entry points at it

    def at_the_end(md):
        md.storage_data[index] = _StorageInfo("__1_0.distcp", len(blob), len(planted))

    _metadata_edit(d, at_the_end)
    offsets = list(index.offset)
    _digests_edit(
        d,
        lambda records: [
            [*r[:2], "__1_0.distcp", len(blob), len(planted), hashlib.sha256(planted).hexdigest()]
            if r[0] == "model.wpe.weight" and r[1] == offsets
            else r
            for r in records
        ],
    )
    return cases


def test_loading_runs_no_code_from_the_directory(pool, pristine, tmp_path):
    """A command planted in a checkpoint (``.metadata``, fsdp_fn's own entry, a tensor chunk; with
    digests forged, stale, or no marker at all) never runs on load, verify or restore: the marker
    file it would create never appears, and each load names the cause. Before: the command ran
    from ``.metadata`` and from fsdp_fn's pickled entry, also without ``COMMITTED``."""
    marker = tmp_path / "ran"
    cases = _planted_cases(pristine, tmp_path, marker)
    expected = {
        "metadata": r"metadata file cannot be read \(UnpicklingError: it names posix\.system, which is not one of DCP",
        "stale-digest": r"\.metadata does not match its digest in COMMITTED: the file is damaged",
        "no-marker": r"metadata file cannot be read \(UnpicklingError: it names posix\.system",
        "own-entry": r"its entry 'fsdp_fn' is not what fsdp_fn writes",
        "chunk": r"rank 1: \S+: the data of 'model\.wpe\.weight' \(chunk at \(5, 6\)\) in __1_0\.distcp "
        r"is not a tensor \(UnpicklingError",
    }
    got = pool.run(_load_each, [str(d) for d in cases.values()], world=2)
    for rank in got:
        for name, text in zip(cases, rank):
            assert text.startswith("CheckpointError: "), (name, text)
            assert re.search(expected[name], text), (name, text)
    for name, d in cases.items():
        if name != "no-marker":
            assert re.search(expected[name] if name != "chunk" else "is not a tensor", _verify_error(d)), name
    # a manager skips the planted checkpoint for the one before it
    root = tmp_path / "run"
    root.mkdir()
    shutil.copytree(pristine, root / "step_00000001")
    shutil.copytree(cases["metadata"], root / "step_00000002")
    for step, extra, skipped in pool.run(_restore_report, str(root), world=2):
        assert (step, extra) == (2, {"next": 2})  # step_00000001 holds the state after 2 steps
        assert [p for p, _ in skipped] == ["step_00000002"] and "UnpicklingError" in skipped[0][1]
    assert not marker.exists()


def _save_extra(group, directory, extra, planted=None):
    """Save with ``extra`` (with ``planted``: ``{"loader": _Planted(planted)}``, made here: the pool
    pickles what it sends), then load; the ``extra`` loaded, or the error."""
    if planted is not None:
        extra = {"loader": _Planted(Path(planted))}
    _, _, state = _setup(group)
    try:
        ckpt.save(directory, state, extra=extra)
    except ckpt.CheckpointError as e:
        return f"CheckpointError: {e}"
    _, _, like = _setup(group)
    return ckpt.load(directory, like)[1]


def test_extra_holds_json_values_and_tensors_and_refuses_anything_else(pool, tmp_path):
    """``extra`` is written as JSON and tensors, so loading it runs no code: tuples, sets and tensors
    come back as they were; an object (one whose unpickling would run a command, a NumPy array, a
    dict with int keys) is refused at save on every rank, naming where it sits, and nothing is
    written. Before: it was pickled, and its unpickling ran at load."""
    import numpy as np

    value = {"pos": (3, [4, 5.5]), "seen": frozenset({"a", "b"}), "w": torch.arange(6.0).view(2, 3), "none": None}
    for back in pool.run(_save_extra, str(tmp_path / "ok"), value, world=2):
        assert back.keys() == value.keys() and back["pos"] == (3, [4, 5.5]) and back["seen"] == frozenset("ab")
        assert torch.equal(back["w"], value["w"]) and back["none"] is None
    marker = tmp_path / "ran"
    bad = [
        (None, r"extra\['loader'\] is a tests\.test_checkpoint\._Planted: a checkpoint holds"),
        ({"rng": [np.zeros(3)]}, r"extra\['rng'\]\[0\] is a numpy\.ndarray: .*torch\.from_numpy"),
        ({1: "a"}, r"extra has the key 1, a int: JSON's keys are strings"),
    ]
    for i, (extra, message) in enumerate(bad):
        planted = str(marker) if extra is None else None
        for text in pool.run(_save_extra, str(tmp_path / f"bad{i}"), extra, planted, world=2):
            assert isinstance(text, str) and re.match(f"CheckpointError: {message}", text), text  # not loaded
        assert not (tmp_path / f"bad{i}").exists() and not (tmp_path / f".bad{i}.tmp").exists()
    assert not marker.exists()


def test_loading_reads_nothing_outside_the_directory(pool, pristine, tmp_path):
    """Storage entries naming ``../outside/...`` or an absolute path, and a data file that is a symlink
    out of the directory, are refused naming the entry, also with the digests forged to match
    (before: loaded from there); a safetensors index whose ``weight_map`` leads out is refused too."""
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(pristine / "__1_0.distcp", outside / "__1_0.distcp")
    cases = {}
    for name, target in (("dotdot", "../outside/__1_0.distcp"), ("absolute", str(outside / "__1_0.distcp"))):
        d = cases[name] = _copy(pristine, tmp_path / name)
        _metadata_edit(
            d,
            lambda md, t=target: [
                setattr(s, "relative_path", t) for s in md.storage_data.values() if s.relative_path == "__1_0.distcp"
            ],
        )
        _digests_edit(d, lambda rs, t=target: [[*r[:2], t, *r[3:]] if r[2] == "__1_0.distcp" else r for r in rs])
    d = cases["symlink"] = _copy(pristine, tmp_path / "symlink")
    (d / "__1_0.distcp").unlink()
    (d / "__1_0.distcp").symlink_to(outside / "__1_0.distcp")
    # through a symlink into a sibling whose name extends the checkpoint's ("symlink-sibling-x"
    # beside "symlink-sibling"): a check that compared string prefixes would let it through
    d = cases["symlink-sibling"] = _copy(pristine, tmp_path / "symlink-sibling")
    (tmp_path / "symlink-sibling-x").mkdir()
    shutil.move(d / "__1_0.distcp", tmp_path / "symlink-sibling-x" / "__1_0.distcp")
    (d / "__1_0.distcp").symlink_to(tmp_path / "symlink-sibling-x" / "__1_0.distcp")
    got = pool.run(_load_each, [str(d) for d in cases.values()], world=2)
    for rank in got:
        for name, text in zip(cases, rank):
            assert text.startswith("CheckpointError: "), (name, text)
            assert re.search(r"the storage entry of '[\w.]+' \(chunk at \([\d, ]+\)\) names '[^']+', ", text), text
            assert ("through a symlink" in text) == name.startswith("symlink"), text
    for d in cases.values():
        assert "leave" in _verify_error(d) or "leads outside" in _verify_error(d)
    # safetensors: an index's weight_map that leads out of the directory, by .. or by a symlink
    for how in ("dotdot", "symlink"):
        hf = tmp_path / f"hf-{how}"
        pool.run(_export_to, str(hf), world=2)
        index = json.loads((hf / "model.safetensors.index.json").read_text())
        first = sorted(set(index["weight_map"].values()))[0]
        shutil.move(hf / first, outside / first)
        if how == "dotdot":
            index["weight_map"] = {
                k: f"../outside/{first}" if v == first else v for k, v in index["weight_map"].items()
            }
            (hf / "model.safetensors.index.json").write_text(json.dumps(index))
        else:
            (hf / first).symlink_to(outside / first)
        for text in pool.run(_import_from, str(hf), world=2):
            assert re.match(r"CheckpointError: .*the index's weight_map entry '[\w.]+' names", text), text


def _export_to(group, directory):
    _, _, state = _setup(group)
    ckpt.export_safetensors(directory, state.params, max_shard_size=6000)


def _import_from(group, directory):
    _, _, like = _setup(group)
    try:
        ckpt.import_safetensors(directory, like.params)
    except ckpt.CheckpointError as e:
        return f"CheckpointError: {e}"
    return "imported"


def _claim_elements(md, key, numel):
    """A forger's claim: entry ``key`` (one chunk) holds ``numel`` bytes, its chunk and its
    storage entry as many (the data file is as it was)."""
    entry = md.state_dict_metadata[key]
    entry.size = torch.Size([numel])
    (chunk,) = entry.chunks
    chunk.sizes = torch.Size([numel])
    index = MetadataIndex(key, (0,))
    info = md.storage_data[index]
    md.storage_data[index] = _StorageInfo(info.relative_path, info.offset, numel)


def test_damage_is_refused_naming_the_file_and_the_parameter(pool, pristine, tmp_path):
    """One flipped bit in a tensor's bytes, two chunks' storage entries swapped, a chunk removed from
    the metadata (digests forged to match), an edited ``extra``, a metadata field of the wrong type:
    every one is a ``CheckpointError`` on every rank naming the file and the parameter, and
    ``verify`` finds each. Before: the bit, the swap, the removed chunk and the edit loaded
    silently with other values; the wrong type raised a raw ``AttributeError``."""
    cases = {}
    _flip_a_bit(cases.setdefault("bit", _copy(pristine, tmp_path / "bit")), "model.blocks.1.fc.weight")
    # a per-rank document (rank 1's RNG state): its digest is checked as a parameter's is
    _flip_a_bit(cases.setdefault("rng-bit", _copy(pristine, tmp_path / "rng-bit")), "rng.1")
    d = cases["swap"] = _copy(pristine, tmp_path / "swap")
    # two chunks of one shape, (1, 6): the halves of row 22 of a weight, one in each rank's file

    def swap(md):
        a, b = MetadataIndex("model.blocks.0.fc.weight", (22, 0)), MetadataIndex("model.blocks.0.fc.weight", (22, 6))
        md.storage_data[a], md.storage_data[b] = md.storage_data[b], md.storage_data[a]

    _metadata_edit(d, swap)
    d = cases["removed"] = _copy(pristine, tmp_path / "removed")

    def remove(md):
        entry = md.state_dict_metadata["model.blocks.0.fc.weight"]
        entry.chunks = [c for c in entry.chunks if tuple(c.offsets) != (22, 6)]
        del md.storage_data[MetadataIndex("model.blocks.0.fc.weight", (22, 6))]

    _metadata_edit(d, remove)
    _digests_edit(d, lambda rs: [r for r in rs if not (r[0] == "model.blocks.0.fc.weight" and r[1] == [22, 6])])
    d = cases["extra"] = _copy(pristine, tmp_path / "extra")
    blob = (d / "__0_0.distcp").read_bytes()
    assert blob.count(b'"next": 2') == 1
    (d / "__0_0.distcp").write_bytes(blob.replace(b'"next": 2', b'"next": 3'))
    d = cases["format-1"] = _copy(pristine, tmp_path / "format-1")  # as an earlier fsdp_fn wrote its marker
    (d / ckpt.COMMIT_MARKER).write_text(json.dumps({"step": 2, "world": 2, "time": 0.0}))
    d = cases["type"] = _copy(pristine, tmp_path / "type")
    _metadata_edit(d, lambda md: setattr(md.state_dict_metadata["model.wte.weight"], "chunks", "many"))
    for name, key in (("forged-size", "fsdp_fn"), ("forged-rng", "rng.1")):  # a claim of 1e12 elements
        d = cases[name] = _copy(pristine, tmp_path / name)
        _metadata_edit(d, partial(_claim_elements, key=key, numel=10**12))
        _digests_edit(d, lambda rs, key=key: [[*r[:4], 10**12, r[5]] if r[0] == key else r for r in rs])
    expected = {
        "bit": r"the data of 'model\.blocks\.1\.fc\.weight' \(chunk at \(\d+, \d+\)\) in __1_0\.distcp does not match "
        r"its digest \(sha256\): the file is damaged",
        "rng-bit": r"the data of 'rng\.1' \(chunk at \(0,\)\) in __1_0\.distcp does not match its digest",
        "swap": r"the storage entry of 'model\.blocks\.0\.fc\.weight' \(chunk at \(22, [06]\)\) names bytes "
        r"\d+\.\.\d+ of '__\d_0\.distcp', which digests\.json does not record",
        "removed": r"the chunks of 'model\.blocks\.0\.fc\.weight' cover 570 of its 576 elements \(a chunk is missing\)",
        "extra": r"the data of 'fsdp_fn' \(chunk at \(0,\)\) in __0_0\.distcp does not match its digest",
        "format-1": r"was written by an earlier fsdp_fn \(checkpoint format 1\), which pickled its own entries",
        "type": r"its metadata is damaged: the entry 'model\.wte\.weight' has the chunks 'many'",
        # (load: before anything is allocated; verify: as it reads the bytes)
        "forged-size": r"its entry 'fsdp_fn' claims \(1000000000000,\) torch\.uint8 elements \(1000000000000 "
        r"bytes\), but its data files hold \d+ bytes of it|the data of 'fsdp_fn' \(chunk at \(0,\)\) in __0_0\.distcp "
        r"is cut short",
        "forged-rng": r"its entry 'rng\.1' claims \(1000000000000,\) torch\.uint8 elements"
        r"|the data of 'rng\.1' .* is cut short",
    }
    got = pool.run(_load_each, [str(d) for d in cases.values()], world=2)
    for rank in got:
        for name, text in zip(cases, rank):
            first = text.splitlines()[0]
            assert first.startswith("CheckpointError: ") and re.search(expected[name], first), (name, text)
    for name, d in cases.items():
        assert re.search(expected[name], _verify_error(d)), (name, _verify_error(d))
    verified = ckpt.verify(pristine)
    assert verified.step == 2 and verified.bytes == sum(f.stat().st_size for f in pristine.glob("*.distcp"))


def _restore_report(group, root):
    _, _, like = _setup(group)
    manager = ckpt.CheckpointManager(root)
    state, extra = manager.restore(like)
    return state.step, extra, [(p.name, why) for p, why in manager.skipped]


def _manager_run(group, root):
    _, _, state = _setup(group)
    ckpt.save(Path(root) / "best", state._replace(step=2), extra="by hand")
    manager = ckpt.CheckpointManager(root, keep=2)
    for s in (1, 2, 3, 4):
        manager.save(state._replace(step=s), extra=s)
    return manager.steps(), str(manager.latest())


def test_the_manager_prunes_only_its_own_and_restores_the_newest_that_loads(pool, tmp_path):
    """A checkpoint saved by hand under the manager's root (``root/best``, step 2) is neither pruned
    nor restored; with a bit flipped in the newest, ``restore`` loads the one before, logs it and
    says which it skipped and why. Before: ``best`` was pruned, and the damaged one loaded."""
    root = tmp_path / "run"
    steps, latest = pool.run(_manager_run, str(root), world=2)[0]  # rank 0 prunes
    assert steps == [3, 4] and latest == str(root / "step_00000004")
    assert sorted(p.name for p in root.iterdir()) == ["best", "step_00000003", "step_00000004"]
    _flip_a_bit(root / "step_00000004", "model.wte.weight", "__0_0.distcp")
    for step, extra, skipped in pool.run(_restore_report, str(root), world=2):
        assert (step, extra) == (3, 3)
        assert [p for p, _ in skipped] == ["step_00000004"]
        assert re.search(r"'model\.wte\.weight' .* in __0_0\.distcp does not match its digest", skipped[0][1])


def _abandoned_save(group, root):
    """Save step 1; start a background save of step 2 whose writing begins only after the process
    group is destroyed (a job that ends without ``wait()``); then what interpreter exit does:
    wait for the writer thread. Also DCP's own fallback, offered our writer with the group gone."""
    import threading
    import warnings

    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from fsdp_fn.checkpoint import _background, _save
    from fsdp_fn.checkpoint._dcp import SavePlanner

    rank = group.rank()
    _, _, state = _setup(group)
    manager = ckpt.CheckpointManager(root)
    manager.save(state._replace(step=1), extra=1)
    go, write = threading.Event(), _save._write

    def late(*args):
        go.wait()
        return write(*args)

    _save._write = late
    pending = manager.save(state._replace(step=2), extra=2, blocking=False)
    side = _background._side_group(group)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # DCP's note that it falls back
        dist.destroy_process_group()
        go.set()
        pending._thread.join()
        errors = [str(pending._error)]
        try:
            from fsdp_fn.checkpoint._integrity import Writer

            tmp = Path(root) / ".fallback.tmp"
            tmp.mkdir(exist_ok=True)
            dcp_save(
                {"x": torch.ones(2)},
                storage_writer=Writer(tmp, world=2),
                planner=SavePlanner(),
                process_group=side,
            )
            errors.append("saved")
        except BaseException as e:
            errors.append(str(e))
    Path(root, f"errors.{rank}").write_text(json.dumps(errors))
    os._exit(0)  # the process ends here: the pool starts new ones


def test_a_background_save_whose_group_is_gone_never_commits(fresh, tmp_path):
    """``save(blocking=False)``, then ``destroy_process_group()`` and exit without ``wait()``: the
    background writer refuses to write as a single process (DCP's fallback, in which the ranks
    overwrote each other's files), nothing is committed, and ``restore`` loads the step before.
    Before: a broken checkpoint was committed, became ``latest()``, and ``restore`` raised."""
    root = tmp_path / "run"
    with pytest.raises(RankError, match="died"):
        fresh.run(_abandoned_save, str(root), world=2)
    for rank in range(2):
        pending, fallback = json.loads((root / f"errors.{rank}").read_text())
        assert "the process group of the save of" in pending and "was destroyed before it could write" in pending
        assert "nothing was committed" in pending
        assert "the process group of this save is gone" in fallback, fallback
    assert not (root / "step_00000002").exists() and ckpt.latest(root) == root / "step_00000001"
    assert fresh.run(_restore, str(root), world=2) == [(1, 1), (1, 1)]


# --- streamed export and import -------------------------------------------------------------


def _export_fails(group, root, where):
    """An export that the file system refuses on one rank (``where``: rank 0 making the
    directory, or rank 1 writing its bytes), then one that succeeds."""
    from safetensors.torch import load_file

    _, _, state = _setup(group)
    pwrite = os.pwrite
    if where == "bytes" and group.rank() == 1:

        def full_disk(fd, data, offset):
            raise OSError(28, "No space left on device")

        os.pwrite = full_disk
    try:
        ckpt.export_safetensors(Path(root) / ("a_file" if where == "headers" else "out"), state.params)
        error = "exported"
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        os.pwrite = pwrite
    ckpt.export_safetensors(Path(root) / "again", state.params)  # the group is still usable
    full = ff.unshard(state.params)
    loaded = load_file(str(Path(root) / "again" / "model.safetensors"))
    return error, all(torch.equal(loaded[k], v) for k, v in full.items() if k in loaded)


@pytest.mark.parametrize(("where", "failed"), [("headers", 0), ("bytes", 1)])
def test_an_export_refused_on_one_rank_fails_on_every_rank(pool, tmp_path, where, failed):
    # Catches: the other ranks left waiting at the export's barrier for a rank that raised.
    (tmp_path / "a_file").write_text("not a directory")
    for rank, (error, same) in enumerate(pool.run(_export_fails, str(tmp_path), where, world=2)):
        if rank == failed:
            assert error.startswith(("FileExistsError", "NotADirectoryError", "OSError")), error
        else:
            assert error.startswith(
                f"RankFailure: export_safetensors: the {'files' if where == 'headers' else 'parameters'}"
            ), error
            assert f"rank {failed}: " in error, error
        assert same


def _export_import(group, directory, phase):
    """Export at one world size, import at another; the peak bytes beyond the shards, measured."""
    from safetensors.torch import load_file

    cfg = GPTConfig(**{**CFG.__dict__, "tie": True})
    rank = group.rank()
    model, step, state = _setup(group, cfg)
    out = {"unit": max(u.gather_bytes() for u in state.params.plan.units)}
    if phase == "export":
        state, _ = _train(model, step, state, group, 0, 1)
        full = ff.unshard(state.params)
        with ff.MemoryMeter() as meter:
            meter.tag(state, "state")
            files = ckpt.export_safetensors(directory, state.params, max_shard_size=6000)
        out["peak"] = meter.peak()["total"] - meter.peak()["params"] - meter.peak()["optimizer"]
        with ff.MemoryMeter() as meter:
            meter.tag(state, "state")
            sd = ckpt.export_state_dict(state.params)
        if rank:  # rank 0 ends with the whole model, as asked; the others hold nothing more
            out["peak"] = max(out["peak"], meter.peak()["total"] - meter.peak()["params"] - meter.peak()["optimizer"])
        out["files"] = sorted(f.name for f in files)
        if rank == 0:
            written = {}
            for f in files:
                written.update(load_file(f))
            out["same"] = written.keys() == full.keys() - {"head.weight"} and all(
                torch.equal(written[k], full[k]) for k in written
            )
            # the module's own keys in its order, a tied weight under both names (one tensor): before,
            # the alias was missing and model.load_state_dict(sd) failed
            names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
            reloaded = copy.deepcopy(model)
            missing = reloaded.load_state_dict(sd, strict=False).missing_keys
            out["sd"] = (
                list(sd) == names
                and len(names) > len(full)  # the tie is there
                and all(torch.equal(sd[k], full[k]) for k in full)
                and not [k for k in missing if k in names]
                and all(torch.equal(p.detach(), sd[n]) for n, p in reloaded.named_parameters(remove_duplicate=False))
            )
            torch.save(full, os.path.join(directory, "full.pt"))
        else:
            out["same"] = out["sd"] = sd is None
        return out
    full = torch.load(os.path.join(directory, "full.pt"))
    _, _, like = _setup(group, cfg, meta=True)
    with ff.MemoryMeter() as meter:
        params = ckpt.import_safetensors(directory, like.params)
    out["peak"] = meter.peak()["total"] - sum(t.numel() * t.element_size() for t in params.values())
    got = ff.unshard(params)
    from_sd = ff.unshard(ckpt.import_state_dict({k: v for k, v in full.items() if k != "head.weight"}, like.params))
    out["same"] = all(torch.equal(got[k], full[k]) and torch.equal(from_sd[k], full[k]) for k in full)
    return out


def test_export_and_import_stream_each_ranks_own_slices(pool, tmp_path):
    d = str(tmp_path / "hf")
    exported = pool.run(_export_import, d, "export", world=2)
    files = exported[0]["files"]
    assert len(files) > 1 and files == [
        f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)
    ]
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files
    imported = pool.run(_export_import, d, "import", world=3)
    for r in exported + imported:
        assert r["same"] and r.get("sd", True)
        assert r["peak"] <= r["unit"]  # beyond its shards, no rank holds more than one unit


# --- Hugging Face round trip ----------------------------------------------------------------


def _llama(seed):
    return tiny_llama(seed, hidden_size=16, intermediate_size=40, num_attention_heads=2, num_key_value_heads=1)


def _llama_loss(model, batch):
    return model(input_ids=batch, labels=batch).loss


def _hugging_face(group, directory):
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    rank, world = group.rank(), group.size()
    model = _llama(0)
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([LlamaDecoderLayer]), split_root=True)
    step = ff.train_step(fn, _llama_loss, ff.adamw(lr=LR))
    state = step.init(ff.shard(fn.params, plan, group))
    tokens = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        state, _ = step(state, local_part(tokens, rank, world))
    exported = os.path.join(directory, "trained")
    ckpt.export_safetensors(exported, state.params, max_shard_size=8000)
    ours = ff.apply_sharded(fn, state.params, state.buffers, tokens).logits
    out = {}
    if rank == 0:
        model.config.save_pretrained(exported)
        theirs = LlamaForCausalLM.from_pretrained(exported)(tokens).logits
        out["logits"] = (ours - theirs).abs().max().item()
        # and a save_pretrained directory imports into shards
        _llama(1).save_pretrained(os.path.join(directory, "pretrained"), max_shard_size="20KB")
    dist.barrier(group=group)
    reference = _llama(1).state_dict()
    params = ckpt.import_safetensors(os.path.join(directory, "pretrained"), state.params)
    full = ff.unshard(params)
    out["imported"] = all(torch.equal(full[k], reference[k]) for k in full)
    return out


def test_hugging_face_round_trip(pool, tmp_path):
    results = pool.run(_hugging_face, str(tmp_path), world=2)
    assert results[0]["logits"] < 1e-6  # from_pretrained of the export gives fsdp_fn's logits
    assert all(r["imported"] for r in results)
    assert len(list((tmp_path / "pretrained").glob("*.safetensors"))) > 1  # a sharded set, with its index


# --- elastic restart under real torchrun -----------------------------------------------------


def test_torchrun_restarts_a_killed_job_which_resumes_from_its_checkpoint(pool, tmp_path):
    import subprocess
    import sys

    from tests.elastic_job import train

    out = tmp_path / "final.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["--max-restarts", "1", "--monitor-interval", "0.2", "-m", "tests.elastic_job"]
    cmd += [str(tmp_path / "run"), str(out), "6", "3"]
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).parent.parent),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(out)
    assert int(got.pop("restarts")) == 1  # killed once, restarted by torchrun
    assert int(got.pop("resumed_from")) == 2  # from the checkpoint before the kill
    straight = pool.run(train, str(tmp_path / "straight"), 6, world=2)[0]
    straight.pop("resumed_from")
    assert got.keys() == straight.keys()
    assert all(torch.equal(got[k], straight[k]) for k in got)  # as if never interrupted


# --- async save -----------------------------------------------------------------------------


def _async_save(group, root):
    model, step, state = _setup(group)
    state, _ = _train(model, step, state, group, 0, 2)
    saved = _full(state)
    manager = ckpt.CheckpointManager(root, keep=1)
    pending = manager.save(state, extra="two", blocking=False)  # returns once the shards are copied
    state, _ = _train(model, step, state, group, 2, 4)  # training goes on, in place, meanwhile
    assert manager.wait() == pending.directory
    _, _, like = _setup(group)
    loaded, extra = ckpt.load(pending.directory, like)
    full = _full(loaded)
    same = extra == "two" and all(torch.equal(full[k], saved[k]) for k in saved)
    # a failure in the background surfaces at the next wait (or save), naming the rank
    ckpt.save(pending.directory, state, blocking=False)  # it exists already
    try:
        ckpt.wait()
    except ckpt.CheckpointError as e:
        return same, str(e)
    return same, "no error"


def test_async_save_returns_at_once_and_writes_the_state_as_it_was(fresh, tmp_path):
    for rank, (same, error) in enumerate(fresh.run(_async_save, str(tmp_path / "run"), world=2)):
        assert same
        assert f"background save of {tmp_path / 'run' / 'step_00000002'} failed on rank {rank}" in error
        assert "already exists" in error


# --- wrapped optimizer states (chains) ----------------------------------------------------


def _chained(group, directory, phase):
    """clip + skip-non-finite + accumulate(2, adamw): saved mid-accumulation, loaded at another W."""
    torch.manual_seed(0)
    model = GPT(CFG)
    fn = ff.functionalize(model)
    opt = ff.apply_if_finite(ff.chain(ff.clip_by_global_norm(1.0), ff.accumulate(2, ff.adamw(lr=LR))))
    step = ff.train_step(fn, lm_loss, opt)
    state = step.init(ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([Block])), group))
    if phase == "save":
        state, _ = _train(model, step, state, group, 0, 3)  # the third gradient waits in the accumulator
        ckpt.save(directory, state)
    else:
        state, _ = ckpt.load(directory, state)
    leaves = [(path, v) for path, v in _opt_state._walk(state.opt_state)]
    full = {  # step counters are replicated, (P,) per unit; the rest is sharded
        ".".join(p): dict(v.shards) if p[-1] == "count" else ff.unshard(v)
        for p, v in leaves
        if isinstance(v, ff.Sharded)
    }
    values = {".".join(p): v for p, v in leaves if not isinstance(v, ff.Sharded)}
    state, trace = _train(model, step, state, group, 3, 4)  # the fourth completes the accumulation
    return full, values, trace, ff.unshard(state.params)


def test_a_chained_optimizer_state_round_trips_across_world_sizes(pool, tmp_path):
    d = str(tmp_path / "c")
    saved = pool.run(_chained, d, "save", world=2)[0]
    loaded = pool.run(_chained, d, "load", world=3)[0]
    assert any(k.endswith("acc_grads") for k in saved[0]) and saved[1] == loaded[1]
    for k, tensors in saved[0].items():
        assert all(torch.equal(tensors[n], loaded[0][k][n]) for n in tensors), k
    assert list(loaded[2][0]) == pytest.approx(list(saved[2][0]), rel=1e-5)  # loss, gradient norm
    assert all(torch.allclose(saved[3][k], loaded[3][k], atol=1e-6) for k in saved[3])


class _Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 3), nn.Linear(8, 3)

    def forward(self, h: torch.Tensor, which: str) -> torch.Tensor:
        return self.a(h) if which == "a" else self.b(h)


class _MultiTask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.heads = nn.Linear(5, 8), _Heads()

    def forward(self, x: torch.Tensor, which: str) -> torch.Tensor:
        return self.heads(torch.tanh(self.trunk(x)), which)


def _multitask_loss(model, batch):
    x, y, which = batch
    return F.mse_loss(model(x, which), y)


def _accumulated(group, directory, policy, phase):
    """``accumulate(3, adamw)`` on a two-head model whose head ``b`` only call 3 uses: saved
    after call 3 (``b``'s gradient waits in the round), loaded under ``policy``'s plan."""
    rank, world = group.rank(), group.size()
    torch.manual_seed(0)
    model = _MultiTask()
    fn = ff.functionalize(model)
    pol = ff.layer_policy([_Heads]) if policy == "heads" else ff.layer_policy([nn.Linear])
    step = ff.train_step(fn, _multitask_loss, ff.accumulate(3, ff.adamw(lr=LR)))
    state = step.init(ff.shard(fn.params, ff.make_plan(model, pol), group))
    calls = range(6) if phase == "whole" else range(4) if phase == "save" else range(4, 6)
    if phase == "load":
        state, _ = ckpt.load(directory, state)
    for k in calls:
        g = torch.Generator().manual_seed(k)
        x, y = torch.randn(12, 5, generator=g), torch.randn(12, 3, generator=g)  # one global batch at any W
        state, _ = step(state, (x.chunk(world)[rank], y.chunk(world)[rank], "b" if k == 3 else "a"))
    if phase == "save":
        ckpt.save(directory, state)
    return ff.unshard(state.params)


def test_an_accumulation_saved_mid_round_resumes_under_another_plan(pool, tmp_path):
    """Which parameters got a gradient in the round is kept by name, not by unit: under another
    plan (or world size) head ``b`` is still stepped when the round ends. Before, its summed
    gradient was dropped silently under a plan of other units, or ``zip`` raised."""
    d = str(tmp_path / "acc")
    whole = pool.run(_accumulated, d, "heads", "whole", world=2)[0]
    start = pool.run(_accumulated, d, "heads", "save", world=2)[0]
    assert not torch.equal(whole["heads.b.weight"], start["heads.b.weight"])  # b moves at the round's end
    for policy, world in (("heads", 2), ("linears", 2), ("linears", 3)):
        resumed = pool.run(_accumulated, d, policy, "load", world=world)[0]
        for k, v in whole.items():
            torch.testing.assert_close(resumed[k], v, rtol=1e-5, atol=1e-7, msg=f"{k} ({policy}, W={world})")


def _fsdp2_unused_head(group, directory):
    """FSDP2 trains head ``a`` only (torch.optim has no state for ``b`` yet), saves; fsdp_fn
    loads that and both go on with head ``b``."""
    import copy

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    rank, world = group.rank(), group.size()
    torch.manual_seed(0)
    model = _MultiTask()
    peer = copy.deepcopy(model)
    mesh = DeviceMesh.from_group(group, "cpu")
    fully_shard(peer.heads, mesh=mesh)
    fully_shard(peer, mesh=mesh)
    opt = torch.optim.AdamW(peer.parameters(), lr=LR)
    fn = ff.functionalize(model)
    step = ff.train_step(fn, _multitask_loss, ff.adamw(lr=LR))
    like = step.init(ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([_Heads])), group))

    def batch(k, which):
        g = torch.Generator().manual_seed(k)
        x, y = torch.randn(12, 5, generator=g), torch.randn(12, 3, generator=g)
        return x.chunk(world)[rank], y.chunk(world)[rank], which

    for k in range(2):
        opt.zero_grad()
        _multitask_loss(peer, batch(k, "a")).backward()
        opt.step()
    msd, osd = get_state_dict(peer, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=directory, process_group=group)
    like, _ = step(like, batch(9, "b"))  # a template whose head b has moments and a count already
    state, _ = ckpt.load(directory, like)
    for k in range(2, 4):
        state, _ = step(state, batch(k, "b" if k == 2 else "a"))
        opt.zero_grad()
        _multitask_loss(peer, batch(k, "b" if k == 2 else "a")).backward()
        opt.step()
    theirs, _ = get_state_dict(peer, opt, options=StateDictOptions(full_state_dict=True))
    return ff.unshard(state.params), theirs


def test_a_torch_checkpoint_of_a_parameter_without_optimizer_state_loads_it_fresh(pool, tmp_path):
    """torch.optim makes a parameter's state at its first step: a head no step has used yet
    has none in an FSDP2 checkpoint. It loads as torch has it, a fresh start (step 0, zero
    moments, whatever the template held), and trains on like FSDP2 (before: refused as
    missing from the checkpoint)."""
    for mine, theirs in pool.run(_fsdp2_unused_head, str(tmp_path / "t"), world=2):
        for k, v in theirs.items():
            torch.testing.assert_close(mine[k], v, rtol=1e-5, atol=1e-6, msg=k)


class _RunningMean(nn.Module):
    """An input normaliser whose running mean each rank moves with its own data."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(7, 13), nn.Linear(13, 5)
        self.register_buffer("mu", torch.zeros(7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.mu.mul_(0.5).add_(0.5 * x.mean(0))
        return self.l2(torch.tanh(self.l1(x - self.mu)))


def _per_rank_buffers(group, directory, phase, first, last):
    rank, world = group.rank(), group.size()
    torch.manual_seed(0)
    model = _RunningMean()
    fn = ff.functionalize(model)
    step = ff.train_step(fn, _mse, ff.adamw(lr=LR), buffer_sync=None)
    state = step.init(ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([nn.Linear])), group))
    if phase == "load":
        state, _ = ckpt.load(directory, state)
    mu = state.buffers["mu"].clone()
    losses = []
    for k in range(first, last):
        g = torch.Generator().manual_seed(k)
        x, y = torch.randn(12, 7, generator=g), torch.randn(12, 5, generator=g)
        state, m = step(state, (x.chunk(world)[rank], y.chunk(world)[rank]))
        losses.append(m["loss"].item())
    if phase == "save":
        ckpt.save(directory, state)
        mu = state.buffers["mu"].clone()
    return losses, mu


def test_buffers_that_differ_between_ranks_are_saved_per_rank(pool, tmp_path):
    """With ``buffer_sync=None`` each rank's buffers are its own (DDP's
    ``broadcast_buffers=False``): a checkpoint keeps every rank's, and a resume at the same
    world size goes on exactly (before: every rank got rank 0's, and the losses moved). At
    another world size every rank gets rank 0's."""
    d = str(tmp_path / "b")
    straight = pool.run(_per_rank_buffers, None, "straight", 0, 6, world=2)
    saved = pool.run(_per_rank_buffers, d, "save", 0, 3, world=2)
    assert not torch.equal(saved[0][1], saved[1][1])
    resumed = pool.run(_per_rank_buffers, d, "load", 3, 6, world=2)
    for (losses, mu), (at_save_losses, at_save_mu), (whole, _) in zip(resumed, saved, straight):
        assert torch.equal(mu, at_save_mu)
        assert losses == whole[3:] and at_save_losses == whole[:3]
    for _, mu in pool.run(_per_rank_buffers, d, "load", 3, 3, world=3):
        assert torch.equal(mu, saved[0][1])


def _buffers_a_checkpoint_lacks(group, directory):
    """Saved from a model without buffers; loaded into one with a persistent buffer (torch's
    strict load raises) and into one with only a non-persistent one (it may be absent)."""

    def model(persistent: bool | None) -> nn.Module:
        torch.manual_seed(0)
        m = _RunningMean()
        del m._buffers["mu"]
        if persistent is not None:
            m.register_buffer("mu", torch.full((7,), 3.0), persistent=persistent)
        return m

    def state_of(m):
        fn = ff.functionalize(m)
        step = ff.train_step(fn, _mse, ff.adamw(lr=LR))
        return step.init(ff.shard(fn.params, ff.make_plan(m, ff.layer_policy([nn.Linear])), group))

    ckpt.save(directory, state_of(model(None)))
    try:
        ckpt.load(directory, state_of(model(True)))
        persistent = "no error"
    except ckpt.CheckpointError as e:
        persistent = str(e)
    loaded, _ = ckpt.load(directory, state_of(model(False)))
    return persistent, loaded.buffers["mu"]


def test_a_checkpoint_that_lacks_a_persistent_buffer_is_refused_naming_it(pool, tmp_path):
    # Catches: a missing persistent buffer loaded silently (the template's value kept), and a
    # missing non-persistent one refused (a state_dict never holds it).
    for persistent, kept in pool.run(_buffers_a_checkpoint_lacks, str(tmp_path / "c"), world=2):
        assert "has no buffer 'mu', a persistent buffer of the target model" in persistent
        assert torch.equal(kept, torch.full((7,), 3.0))


def test_the_demo_reads_on_from_the_same_sample_at_any_world_size():
    """examples/train_gpt.py draws sample ``n`` of the run the same whatever the world size:
    3 steps at W=2 then 2 at W=3 read 24 distinct windows, the ones a run at W=4 with the same
    per-rank batch reads in its first 3 steps (before: seeds of ``k * world + rank`` made a
    resume at another world size read batches it had trained on)."""
    from examples.gpt import token_windows

    text = bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0)).tolist())
    batch, seq = 2, 8

    def run(world, steps, samples):
        out = []
        for _ in range(steps):
            for r in range(world):  # (rank r's part of the step's global batch)
                out.append(token_windows(text, range(samples + r * batch, samples + (r + 1) * batch), seq, 0))
            samples += batch * world
        return out, samples

    first, at = run(2, 3, 0)
    second, _ = run(3, 2, at)
    resumed = torch.cat(first + second)
    straight = torch.cat(run(4, 3, 0)[0])
    assert torch.equal(resumed, straight)
    assert len({tuple(w.tolist()) for w in resumed}) == 24


def _load_fails_on_one_rank(group, directory, phase):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3))
    fn = ff.functionalize(model)
    step = ff.train_step(fn, lambda m, x: m(x).square().mean(), ff.sgd(lr=0.1))
    state = step.init(ff.shard(fn.params, ff.make_plan(model, ff.layer_policy([nn.Linear])), group))
    if phase == "save":
        ckpt.save(directory, state)
        return ""
    mine = directory if dist.get_rank() == 0 else directory + "-gone"
    try:
        ckpt.load(mine, state, timeout=20)
    except ckpt.CheckpointError as e:
        return str(e)
    return "loaded"


def test_a_load_failing_on_one_rank_fails_on_every_rank(pool, tmp_path):
    """Rank 1 is given a directory that does not exist: it raises, and rank 0, whose checkpoint
    opens, raises naming rank 1 instead of waiting in DCP's collectives for it."""
    d = str(tmp_path / "c")
    pool.run(_load_fails_on_one_rank, d, "save", world=2)
    on_zero, on_one = pool.run(_load_fails_on_one_rank, d, "load", world=2)
    assert on_one == f"no checkpoint at {d}-gone: no such path"
    assert on_zero.startswith("rank 1 cannot load") and "-gone" in on_zero


def _accumulation_into_another_chain(group, directory, phase):
    """``accumulate(2, adamw)`` saved mid-round; loaded into a chain that clips before it."""
    torch.manual_seed(0)
    model = GPT(CFG)
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([Block]))
    inner = ff.accumulate(2, ff.adamw(lr=LR))
    opt = inner if phase == "save" else ff.chain(ff.clip_by_global_norm(1e6), inner)
    step = ff.train_step(fn, lm_loss, opt)
    state = step.init(ff.shard(fn.params, plan, group))
    if phase == "save":
        state, _ = _train(model, step, state, group, 0, 3)  # the third gradient waits in the round
        ckpt.save(directory, state)
        return ""
    try:
        ckpt.load(directory, state)
    except ckpt.CheckpointError as e:
        return str(e)
    return "loaded"


def test_an_accumulation_loaded_into_a_chain_that_wraps_it_otherwise_is_refused(pool, tmp_path):
    # Catches: the summed gradient loading while the round's counter restarted at 0 under the
    # other chain's path, so the next update averaged k+1 gradients over k (2.2e-2 off torch).
    d = str(tmp_path / "acc")
    pool.run(_accumulation_into_another_chain, d, "save", world=2)
    for message in pool.run(_accumulation_into_another_chain, d, "load", world=2):
        assert "its optimizer state was saved by another chain of links" in message, message
        assert "mini_step" in message, message


def _save_with_a_faulty_rank(group, root, how):
    """Save step 1; then rank 1 dies or goes silent while DCP writes step 2 (in its data file)."""
    import time

    from torch.distributed.checkpoint.filesystem import FileSystem

    _, _, state = _setup(group)
    ckpt.save(Path(root) / "step_1", state._replace(step=1))
    create_stream = FileSystem.create_stream

    def faulty(self, path, mode):
        if Path(path).suffix == ".distcp":
            if how == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(15)
        return create_stream(self, path, mode)

    if group.rank() == 1:
        FileSystem.create_stream = faulty
    started = time.monotonic()
    try:
        ckpt.save(Path(root) / "step_2", state._replace(step=2), timeout=4.0)
        error = "saved"
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        FileSystem.create_stream = create_stream
    return error, time.monotonic() - started, str(ckpt.latest(root))


@pytest.mark.parametrize("how", ["killed", "silent"])
def test_a_rank_that_dies_or_goes_silent_inside_a_save_is_named(fresh, tmp_path, how):
    """Before: a SIGKILL gave gloo's "Connection reset by peer" naming no rank (and the next
    call waited the whole timeout); a silent rank held the others for as long as it slept."""
    root = tmp_path / "run"
    try:
        results = fresh.run(_save_with_a_faulty_rank, str(root), how, world=2)
        survivor = results[0]
    except RankError as e:
        survivor = e.results[0][1]
    finally:
        fresh.close()  # the group is unusable after either
    error, seconds, latest = survivor
    assert error.startswith("RankFailure: ") and "rank 1 of group" in error, error
    if how == "killed":
        assert "stopped answering (checkpoint.save)" in error, error
    else:  # (its own thread still answers; the store says where its DCP thread is)
        assert "went silent (checkpoint.save: rank 1 writing its data)" in error and "(timeout 4 s)" in error, error
    assert seconds < 12.0, seconds  # the timeout (4 s) and the grace, not the 15 s of silence
    assert latest.endswith("step_1")  # the last checkpoint stays the latest, intact


def _export_with_a_dead_rank(group):
    """Rank 1 dies just before export_state_dict's gathers; rank 0 (the destination) waits on it."""
    import time

    _, _, state = _setup(group)
    torch.distributed.barrier(group=group)
    if group.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    started = time.monotonic()
    try:
        ckpt.export_state_dict(state.params, timeout=5.0)
        error = "exported"
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    return error, time.monotonic() - started


def test_a_rank_that_dies_during_export_state_dict_is_named(fresh):
    # Catches: gloo's raw "Connection reset/closed by peer" from dist.gather, naming no rank.
    try:
        survivor = fresh.run(_export_with_a_dead_rank, world=2)[0]
    except RankError as e:
        survivor = e.results[0][1]
    finally:
        fresh.close()
    error, seconds = survivor
    assert error.startswith("RankFailure: ") and "rank 1 of group" in error, error
    assert seconds < 12.0, seconds


def _import_with_missing_keys(group):
    """A state dict without some parameters, imported with strict=False, against torch's
    ``load_state_dict(strict=False)`` on the unsharded module: the missing keep their values."""
    import warnings

    model, _, state = _setup(group)
    torch.manual_seed(1)
    other = copy.deepcopy(model)
    for p in other.parameters():
        p.data.normal_()
    sd = {k: v for k, v in other.state_dict().items() if not k.startswith("blocks.1.")}
    reference = copy.deepcopy(model)
    missing = reference.load_state_dict(sd, strict=False).missing_keys
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = ff.unshard(ckpt.import_state_dict(sd, state.params, strict=False))
    try:
        ckpt.import_state_dict(sd, state.params)
        strict = "no error"
    except KeyError as e:
        strict = str(e)
    same = all(torch.equal(got[k], p.detach()) for k, p in reference.named_parameters())
    said = [str(w.message) for w in seen]
    return same, sorted(missing), said, strict


def test_import_state_dict_with_strict_false_keeps_what_the_state_dict_lacks_as_torch(pool):
    for same, missing, said, strict in pool.run(_import_with_missing_keys, world=2):
        assert same
        assert missing and all(k.startswith("blocks.1.") for k in missing)
        assert len(said) == 1 and "has no parameter 'blocks.1." in said[0] and "strict=False keeps" in said[0]
        assert "has no parameter 'blocks.1." in strict
