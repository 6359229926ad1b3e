"""Sharded checkpoints through torch.distributed.checkpoint (DCP): save, load into a template, reshard.

    ckpt.save("run/step_100", state, extra={"data_pos": 1234})
    state, extra = ckpt.load("run/step_100", like)   # like: a TrainState for the target run

Each rank writes only its own bytes. Entries are keyed by fully-qualified name, in torch's
layout: ``model.<fqn>`` for parameters and buffers, ``optim.state.<fqn>.<name>`` for
optimizer state (``step``, ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``), so a
checkpoint depends on neither the plan nor the world size, and torch FSDP2's
``get_state_dict`` + ``dcp.save`` checkpoints load here (and ours there). ``like`` may use
any world size, plan or mesh: DCP reads, for each rank, only the saved chunks that overlap
its shards; no rank ever holds the full model.

A save is atomic: it writes into a hidden temporary directory, rank 0 writes the commit
marker last, then renames the directory into place. A directory without the marker (a
save killed half-way) is never loaded. ``CheckpointManager`` keeps the last K and finds
the latest; ``blocking=False`` saves in the background.

Full-model files, streamed (no rank gathers the model): ``export_safetensors`` writes
Hugging Face safetensors (one file, or a sharded set with its index), each rank writing
its own bytes; ``import_safetensors`` reads a ``save_pretrained`` directory into shards,
each rank reading only its slices; ``export_state_dict`` / ``import_state_dict`` do the
same with a plain state dict (on rank 0 / from full tensors).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from fsdp_fn._agree import failures, gather_objects
from fsdp_fn._dcp import LoadPlanner, Pieces, SavePlanner, ranges
from fsdp_fn._export import export_safetensors, export_state_dict, import_safetensors, import_state_dict
from fsdp_fn._guard import join
from fsdp_fn._plan import ParamSpec, Unit, unit_label
from fsdp_fn._shard import Layout, Sharded, ensure_live
from fsdp_fn._step import TrainState

__all__ = [
    "COMMIT_MARKER",
    "CheckpointError",
    "CheckpointManager",
    "PendingSave",
    "export_safetensors",
    "export_state_dict",
    "import_safetensors",
    "import_state_dict",
    "is_committed",
    "latest",
    "load",
    "save",
    "wait",
]

COMMIT_MARKER = "COMMITTED"  # written last, inside the directory, before it is renamed into place
_META = "fsdp_fn"  # the entry holding the step, the writers' world size and the user's extra
_FORMAT = 1
# torch.optim's names for the fields of fsdp_fn's optimizer states (others keep their field name).
TORCH_NAMES = {"count": "step", "mu": "exp_avg", "nu": "exp_avg_sq", "trace": "momentum_buffer"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into the target: incomplete, corrupt or mismatched."""


# --- state <-> FQN-keyed DCP entries -----------------------------------------------------


Path_ = tuple[str, ...]


def _walk(state: Any, path: Path_ = ()) -> list[tuple[Path_, Any]]:
    """The leaves of an optimizer state (NamedTuples and tuples of ``Sharded`` and plain values)."""
    if isinstance(state, Sharded) or state is None:
        return [(path, state)]
    if isinstance(state, torch.optim.Optimizer):
        raise TypeError(
            "checkpoints hold fsdp_fn optimizer states (adamw(), sgd(), chains of them); a from_torch "
            "optimizer keeps its state in the torch object"
        )
    if isinstance(state, tuple):
        names = getattr(state, "_fields", None) or [str(i) for i in range(len(state))]
        return [leaf for name, value in zip(names, state, strict=True) for leaf in _walk(value, (*path, name))]
    if isinstance(state, dict):  # multi_transform's states by label, inject_hyperparams' values
        return [leaf for name, value in state.items() for leaf in _walk(value, (*path, str(name)))]
    return [(path, state)]


def _opt_fields(opt_state: Any) -> list[tuple[str, Sharded]]:
    """(name, Sharded) for each sharded leaf of the optimizer state: torch.optim's name for
    AdamW's and SGD's fields (``step``, ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``),
    the field name for others (a chain's accumulated gradients: ``summed``)."""
    leaves = [(path, v) for path, v in _walk(opt_state) if isinstance(v, Sharded)]
    names = [TORCH_NAMES.get(path[-1], path[-1]) for path, _ in leaves]
    if len(set(names)) < len(names):  # two optimizers in one state: keep them apart by path
        names = [".".join(path) for path, _ in leaves]
    return list(zip(names, (v for _, v in leaves), strict=True))


def _opt_values(opt_state: Any) -> dict[str, Any]:
    """The optimizer state's plain values (a chain's counters), by path: saved with the step; and,
    for a tree that marks which parameters got a gradient (``accumulate``'s), their names."""
    out: dict[str, Any] = {}
    for path, v in _walk(opt_state):
        if isinstance(v, Sharded) and v.received is not None:
            reached = [spec.name for u in v.plan.units for spec, got in zip(u.params, v.mask(u), strict=True) if got]
            out[".".join((*path, "received"))] = reached
        elif not isinstance(v, Sharded) and v is not None:
            out[".".join(path)] = v
    return out


def _rebuild(state: Any, sharded: dict[int, Sharded], values: dict[str, Any], path: Path_ = ()) -> Any:
    """``state`` with each ``Sharded`` replaced (by identity) and plain values taken from ``values``."""
    if isinstance(state, Sharded):
        node = sharded[id(state)]
        names = values.get(".".join((*path, "received")))
        if names is None:
            return node
        got = set(names)  # by name: the plan loaded into may group the parameters otherwise
        return node.with_received({u.name: tuple(s.name in got for s in u.params) for u in node.plan.units})
    if state is None:
        return None
    if isinstance(state, tuple):
        names = getattr(state, "_fields", None) or [str(i) for i in range(len(state))]
        items = [_rebuild(v, sharded, values, (*path, n)) for n, v in zip(names, state, strict=True)]
        return type(state)(*items) if hasattr(state, "_fields") else tuple(items)
    if isinstance(state, dict):
        return {k: _rebuild(v, sharded, values, (*path, str(k))) for k, v in state.items()}
    return values.get(".".join(path), state)


def _parts(unit: Unit, layout: Layout, shards: Sharded) -> list[tuple[Unit, torch.Tensor]]:
    out = [(unit, shards[unit.name])]
    if unit.frozen:
        out.append((unit.frozen_part, layout.frozen[unit.name]))
    return out


def _pieces(part: Unit, flat: torch.Tensor, layout: Layout) -> list[tuple[ParamSpec, Pieces]]:
    """Each parameter of ``part`` with its elements in this rank's shard ``flat``, as DCP chunks."""
    n = part.shard_numel(layout.world)
    lo = layout.rank * n
    numels = [p.numel for p in part.params]
    out = []
    for i, a, b in ranges(part.offsets, numels, lo, lo + n):
        at = part.offsets[i] + a - lo
        out.append((part.params[i], Pieces(part.params[i].shape, flat[at : at + b - a], a, b)))
    return out


def _is_step(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ("step", "count")


def _step_views(unit: Unit, steps: torch.Tensor, *, every: bool) -> list[tuple[ParamSpec, torch.Tensor]]:
    """Each trainable parameter's step counter: one per parameter (shape ``(P,)``) or one per
    unit (0-d; ``every``: the unit's counter for each parameter, else for its first only)."""
    if steps.dim() == 0:
        return [(spec, steps) for spec in (unit.params if every else unit.params[:1])]
    return [(spec, steps[i]) for i, spec in enumerate(unit.params)]


def _entries(state: TrainState, *, write_shards: bool, coordinator: bool) -> dict[str, Any]:
    """The FQN-keyed entries this rank contributes: views of its shards (no copy)."""
    params, layout = state.params, state.params.layout
    out: dict[str, Any] = {}
    fields = _opt_fields(state.opt_state)
    for unit in layout.plan.units:
        if write_shards:
            for part, flat in _parts(unit, layout, params):
                for spec, pieces in _pieces(part, flat, layout):
                    for name in (spec.name, *spec.aliases):
                        out[f"model.{name}"] = pieces
            for tname, tree in fields:
                if not _is_step(tname):
                    for spec, pieces in _pieces(unit, tree[unit.name], layout):
                        out[f"optim.state.{spec.name}.{tname}"] = pieces
        if coordinator:
            for tname, tree in fields:
                if _is_step(tname):
                    for spec, t in _step_views(unit, tree[unit.name], every=True):
                        out[f"optim.state.{spec.name}.{tname}"] = t
    if coordinator:
        for name, b in state.buffers.items():
            out[f"model.{name}"] = b
    return out


def _own_buffers(buffers: Mapping[str, torch.Tensor], group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """The buffers whose values differ between ranks (``buffer_sync=None``), as this rank has
    them (on the CPU): saved per rank beside rank 0's, which every world size reads. Costs one
    small all-gather of the buffers' digests; nothing when the ranks agree."""
    digests = {name: hashlib.sha1(_bytes(b)).hexdigest() for name, b in buffers.items()}
    everyone = gather_objects(digests, group, "checkpoint.save (buffers)")
    differ = [name for name in buffers if any(d.get(name) != digests[name] for d in everyone)]
    return {name: buffers[name].detach().to("cpu", copy=True) for name in differ}


def _bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _rng_state() -> dict[str, Any]:
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        rng["numpy"] = numpy.random.get_state()
    return rng


def _set_rng_state(rng: Mapping[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    numpy = sys.modules.get("numpy")
    if "numpy" in rng and numpy is not None:
        numpy.random.set_state(rng["numpy"])


# --- groups ------------------------------------------------------------------------------


def _group(layout: Layout) -> dist.ProcessGroup:
    """Every rank that holds the state: the shard group, or the whole world with replicas."""
    if layout.replicate is None:
        return layout.group
    world = dist.group.WORLD
    assert world is not None
    if world.size() != layout.world * layout.replicas:
        raise ValueError(
            f"a hybrid-sharded state ({layout.replicas} replicas of {layout.world} shards) checkpoints "
            f"over the default group, which has {world.size()} ranks, not {layout.world * layout.replicas}"
        )
    return world


_side_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}


def _side_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A second gloo group over the same ranks, for background saves (training keeps the first).

    Made once, by every rank of the default group (``new_group`` is collective over it).
    """
    ranks = tuple(dist.get_process_group_ranks(group))
    if len(ranks) != dist.get_world_size():
        raise ValueError(
            f"blocking=False saves on a second process group made over all {dist.get_world_size()} ranks; "
            f"this state's group holds only ranks {list(ranks)}: save with blocking=True"
        )
    if ranks not in _side_groups:
        made = dist.new_group(list(ranks), backend="gloo")
        assert made is not None
        _side_groups[ranks] = made
    return _side_groups[ranks]


def _agree_on_error(group: dist.ProcessGroup, error: str | None) -> None:
    """Raise the same ``CheckpointError`` on every rank if any rank has an error (``failures``)."""
    found = failures(error, [group], "checkpoint.save")
    if found:
        raise CheckpointError("; ".join(found))


# --- save --------------------------------------------------------------------------------


class PendingSave:
    """A save running in the background; ``wait()`` returns its directory or raises its failure."""

    def __init__(self, directory: Path, rank: int, run: Callable[[], None]) -> None:
        self.directory, self.rank = directory, rank
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(run,), name=f"fsdp_fn-save-{directory.name}")
        self._thread.start()

    def _run(self, run: Callable[[], None]) -> None:
        try:
            run()
        except BaseException as e:  # surfaced by wait()
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> Path:
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(
                f"the background save of {self.directory} failed on rank {self.rank}: {type(error).__name__}: {error}"
            ) from error
        return self.directory


_pending: list[PendingSave] = []


def wait() -> Path | None:
    """Wait for this process's background save, if any; raise its failure (naming the rank)."""
    if not _pending:
        return None
    return _pending.pop().wait()


def save(
    directory: str | os.PathLike[str],
    state: TrainState,
    *,
    extra: Any = None,
    hyperparams: Mapping[str, Any] | None = None,
    blocking: bool = True,
    timeout: float = 300.0,
) -> PendingSave | Path:
    """Write ``state`` (shards, optimizer state, buffers, step, each rank's RNG state) to ``directory``.

    Every rank of the state's group calls it (a rank that calls alone gets an error naming
    the ranks that did not join, within ``timeout`` seconds). Each rank writes only its own chunks
    (replicas of a hybrid mesh: only the first); rank 0 also writes the replicated
    values: buffers, step counters, and ``extra`` (any picklable value, e.g. the data
    loader's position). ``hyperparams`` (torch.optim's names: ``lr``, ``betas``, ...) are
    written as a torch param group, so a torch optimizer loads the checkpoint with a plain
    ``dcp.load``. Atomic: the directory appears, complete, when every rank has written.

    ``blocking=False`` copies the shards to host memory (one more copy of the state,
    briefly) and returns a ``PendingSave`` at once; the writing runs in a background
    thread on a second process group, and the next ``save`` or ``wait()`` waits for it.
    Memory (blocking): one parameter chunk at a time beyond the state. Communication:
    DCP's planning (a gather and a scatter of small plans) and three small barriers.
    """
    wait()  # the previous background save, and its failure, come first
    final = Path(directory)
    if not isinstance(state, TrainState):
        raise TypeError(f"save wants a TrainState (from step.init), got {type(state).__name__}")
    ensure_live(state, "checkpoint.save")
    layout = state.params.layout
    group = _group(layout)
    join(group, "checkpoint.save", timeout)  # a rank that saves alone is named, not left waiting in DCP
    write_shards = layout.replicate is None or layout.replicate.rank() == 0
    coordinator = group.rank() == 0
    if not blocking:
        params, opt_state, buffers = _tree_clone((state.params, state.opt_state, state.buffers))
        state = TrainState(params, opt_state, buffers, state.step)
    entries = _entries(state, write_shards=write_shards, coordinator=coordinator)
    entries[f"rng.{dist.get_rank()}"] = _rng_state()
    own = _own_buffers(state.buffers, group)
    if own:
        entries[f"buffers.{dist.get_rank()}"] = own
    if coordinator:
        entries[_META] = {
            "format": _FORMAT,
            "step": state.step,
            "world": group.size(),
            "extra": extra,
            "optimizer": _opt_values(state.opt_state),
        }
        if hyperparams is not None:
            names = [spec.name for unit in layout.plan.units for spec in unit.params]
            for key, value in {**hyperparams, "params": names}.items():
                entries[f"optim.param_groups.0.{key}"] = value

    if blocking:
        _write(final, entries, group, state.step)
        return final
    side = _side_group(group)
    pending = PendingSave(final, dist.get_rank(), lambda: _write(final, entries, side, state.step))
    _pending.append(pending)
    return pending


def _tree_clone(tree: Any) -> Any:
    from fsdp_fn._optim import tree_map

    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, tree)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(final: Path, entries: dict[str, Any], group: dist.ProcessGroup, step: int) -> None:
    coordinator = group.rank() == 0
    tmp = final.parent / f".{final.name}.tmp"
    error = None
    if coordinator:
        if final.exists():
            error = (
                f"{final} already exists; checkpoints are never overwritten (CheckpointManager names them after "
                "state.step, the steps applied, which a step that apply_if_finite skipped leaves as it was: "
                "pass save(state, step=...) the loop's own count)"
            )
        else:
            try:
                shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save
                tmp.mkdir(parents=True)
            except OSError as e:
                error = f"cannot create {tmp}: {e}"
    _agree_on_error(group, error)
    dcp_save(
        entries,
        storage_writer=FileSystemWriter(tmp),
        planner=SavePlanner(),
        process_group=group,
    )
    # dcp.save returns once the coordinator has written the metadata after every rank's data.
    if coordinator:
        try:
            marker = tmp / COMMIT_MARKER
            with open(marker, "w") as f:
                json.dump({"step": step, "world": group.size(), "time": time.time()}, f)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            os.rename(tmp, final)
            _fsync_dir(final.parent)
        except OSError as e:  # the others learn of it below instead of waiting for a commit that never comes
            error = f"cannot commit {final}: {e}"
    _agree_on_error(group, error)


# --- load --------------------------------------------------------------------------------


def is_committed(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` is a complete checkpoint (its commit marker exists)."""
    return (Path(directory) / COMMIT_MARKER).is_file()


def _read_metadata(path: Path) -> Metadata:
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {path}")
    incomplete = CheckpointError(
        f"{path} is not a complete checkpoint: it has no {COMMIT_MARKER} marker "
        "(a save was interrupted before every rank finished); load an earlier one (latest())"
    )
    if not is_committed(path) and not (path / ".metadata").is_file():
        raise incomplete
    try:
        md = FileSystemReader(path).read_metadata()
    except Exception as e:
        raise CheckpointError(f"{path}: its metadata file cannot be read ({type(e).__name__}: {e})") from e
    # DCP writes its metadata last, so a torch-written checkpoint (no marker, none of our
    # entries) is complete; one of ours without the marker is not.
    if not is_committed(path) and _META in md.state_dict_metadata:
        raise incomplete
    return md


def _ready(t: torch.Tensor) -> torch.Tensor:
    """A tensor to load into: ``t`` itself, or a new one where ``t`` is on the meta device."""
    return torch.empty(t.shape, dtype=t.dtype) if t.is_meta else t


def _zero_padding(unit: Unit, flat: torch.Tensor, layout: Layout) -> None:
    start = unit.numel - layout.rank * unit.shard_numel(layout.world)
    if start < flat.numel():
        flat[max(start, 0) :].zero_()


class _Target(NamedTuple):
    state: TrainState
    entries: dict[str, Any]  # what this rank reads, keyed as in the checkpoint
    expected: dict[str, tuple[tuple[int, ...], torch.dtype, str]]  # every rank's keys: shape, dtype, name


def _target(like: TrainState) -> _Target:
    """Tensors to load into (``like``'s, or new ones where it is on the meta device) and their entries."""
    layout = like.params.layout
    frozen = {k: _ready(v) for k, v in layout.frozen.items()}
    if any(frozen[k] is not v for k, v in layout.frozen.items()):
        layout = Layout(layout.plan, layout.group, frozen, layout.replicate)

    def ready(tree: Sharded) -> Sharded:
        return Sharded({k: _ready(v) for k, v in tree.shards.items()}, layout)

    params = ready(like.params)
    opt_state = _rebuild(like.opt_state, {id(v): ready(v) for _, v in _opt_fields(like.opt_state)}, {})
    buffers = {k: _ready(v) for k, v in like.buffers.items()}
    entries: dict[str, Any] = {}
    expected: dict[str, tuple[tuple[int, ...], torch.dtype, str]] = {}
    for unit in layout.plan.units:
        for part, flat in _parts(unit, layout, params):
            for spec in part.params:
                expected[f"model.{spec.name}"] = (spec.shape, spec.dtype, f"parameter {spec.name!r} ({_where(unit)})")
            _zero_padding(part, flat, layout)
            for spec, pieces in _pieces(part, flat, layout):
                entries[f"model.{spec.name}"] = pieces
        for tname, tree in _opt_fields(opt_state):
            t = tree[unit.name]
            for spec in unit.params:
                what = f"optimizer state {tname!r} of {spec.name!r} ({_where(unit)})"
                expected[f"optim.state.{spec.name}.{tname}"] = (() if _is_step(tname) else spec.shape, t.dtype, what)
            if _is_step(tname):
                for spec, view in _step_views(unit, t, every=False):
                    entries[f"optim.state.{spec.name}.{tname}"] = view
            else:
                _zero_padding(unit, t, layout)
                for spec, pieces in _pieces(unit, t, layout):
                    entries[f"optim.state.{spec.name}.{tname}"] = pieces
    for name, b in buffers.items():
        entries[f"model.{name}"] = b
        expected[f"model.{name}"] = (tuple(b.shape), b.dtype, f"buffer {name!r}")
    state = TrainState(params, opt_state, buffers, like.step)
    return _Target(state, entries, expected)


def _where(unit: Unit) -> str:
    return f"unit {unit_label(unit.name)}"


def _check(path: Path, md: Metadata, target: _Target, like: TrainState) -> None:
    """Raise ``CheckpointError`` naming the first parameter the checkpoint cannot fill (the same on every rank)."""
    saved = md.state_dict_metadata
    names = {n for spec in like.params.plan.params for n in (spec.name, *spec.aliases)}
    unexpected = [k[6:] for k in saved if k.startswith("model.") and k[6:] not in names and k[6:] not in like.buffers]
    if unexpected:
        raise CheckpointError(
            f"{path} has parameter {unexpected[0]!r} that the target model does not have"
            + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
            + ": saved from another model?"
        )
    fresh = _never_stepped(saved, target)
    for key, (shape, dtype, what) in target.expected.items():
        if key not in saved:
            if what.startswith("buffer"):
                del target.entries[key]  # non-persistent buffers (and FSDP2's checkpoints lack them): keep like's
                continue
            if key in fresh:  # as torch.optim has it: no state yet, a fresh start
                _zero(target.entries.pop(key, None))
                continue
            raise CheckpointError(f"{path} has no {what}: missing from the checkpoint")
        entry = saved[key]
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{path}: {what} is saved as an object, not a tensor")
        if tuple(entry.size) != shape:
            raise CheckpointError(
                f"{path}: {what} has shape {tuple(entry.size)} in the checkpoint, {shape} in the target"
            )
        if entry.properties.dtype != dtype:
            raise CheckpointError(
                f"{path}: {what} is {entry.properties.dtype} in the checkpoint, {dtype} in the target"
            )
    _check_files(path, md, target)


def _never_stepped(saved: Mapping[str, Any], target: _Target) -> set[str]:
    """The optimizer keys of the parameters the checkpoint holds no optimizer state for at all,
    while it holds some for others: torch.optim makes a parameter's state at its first step,
    so a torch checkpoint of a head not used yet has none. Those load as a fresh start."""
    if not any(k.startswith("optim.state.") for k in saved):
        return set()
    names = [tname for tname, _ in _opt_fields(target.state.opt_state)]
    fresh: set[str] = set()
    for unit in target.state.params.plan.units:
        for spec in unit.params:
            keys = [f"optim.state.{spec.name}.{tname}" for tname in names]
            if not any(k in saved for k in keys):
                fresh.update(keys)
    return fresh


def _zero(entry: Any) -> None:
    """Zero the tensors a load would have read into (a parameter's step count and moments)."""
    if isinstance(entry, Pieces):
        for chunk in entry.chunks.values():
            chunk.zero_()
    elif isinstance(entry, torch.Tensor):
        entry.zero_()


def _check_files(path: Path, md: Metadata, target: _Target) -> None:
    """Every chunk to read lies inside its data file: a truncated file is named with a parameter in it."""
    storage = md.storage_data or {}
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        key = index.fqn
        if key not in target.entries:
            continue
        name = info.relative_path
        if name not in sizes:
            file = path / name
            sizes[name] = file.stat().st_size if file.is_file() else -1
        if sizes[name] < info.offset + info.length:
            state = "missing" if sizes[name] < 0 else f"truncated ({sizes[name]} bytes)"
            raise CheckpointError(
                f"{path}: the data of {target.expected[key][2]} is in {name}, which is {state}; "
                "the checkpoint is corrupt"
            )


def _torch_step(target: _Target) -> int:
    """The step of a checkpoint written by torch: its optimizer's step counter (0 without one)."""
    steps = [v for k, v in target.entries.items() if k.endswith(".step") and isinstance(v, torch.Tensor)]
    return int(steps[0].item()) if steps else 0


def load(directory: str | os.PathLike[str], like: TrainState, *, timeout: float = 300.0) -> tuple[TrainState, Any]:
    """Read the checkpoint at ``directory`` into the layout of ``like``; return the state and ``extra``.

    ``like`` is a ``TrainState`` for the target run (``step.init(shard(...))``, or from
    ``init_shards`` with ``device="meta"``): any world size, plan, or mesh. Its tensors
    are filled in place and returned (donated; meta tensors are replaced by new ones).
    Each rank reads only the saved chunks that overlap its shards. The RNG state of each
    rank is restored when the world size is the one that saved. A missing, unexpected,
    mis-shaped or mis-typed parameter, an incomplete or a truncated checkpoint raise
    ``CheckpointError`` naming it, before anything is read. Communication: DCP's planning
    (a gather and a scatter of small plans).
    """
    wait()
    path = Path(directory)
    if not isinstance(like, TrainState):
        raise TypeError(f"load wants a TrainState to load into (step.init(...)), got {type(like).__name__}")
    ensure_live(like, "checkpoint.load")
    group = _group(like.params.layout)
    join(group, "checkpoint.load", timeout)
    raised: Exception | None = None
    try:
        md = _read_metadata(path)
        target = _target(like)
        _check(path, md, target, like)
    except (CheckpointError, FileNotFoundError) as e:
        raised = e
    # Every rank raises, or none: a rank that went on alone would wait in DCP's collectives.
    errors: list[str | None] = [None] * group.size()
    dist.all_gather_object(errors, None if raised is None else f"{type(raised).__name__}: {raised}", group=group)
    if raised is not None:
        raise raised
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        raise CheckpointError(f"rank {failed[0][0]} cannot load {path}: {failed[0][1]}")
    rng_key, buffers_key = f"rng.{dist.get_rank()}", f"buffers.{dist.get_rank()}"
    entries = dict(target.entries)
    for key in (_META, rng_key, buffers_key):
        if key in md.state_dict_metadata:
            entries[key] = None
    dcp_load(
        entries,
        storage_reader=FileSystemReader(path),
        planner=LoadPlanner(),
        process_group=group,
    )
    for tree in (like.params, *(v for _, v in _opt_fields(like.opt_state))):
        tree.consumed = f"its tensors were loaded into by checkpoint.load({str(path)!r}): use the state it returned"
    meta = entries.get(_META)
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        meta = {"step": _torch_step(target), "world": None, "extra": None}  # written by torch (FSDP2)
    loaded = target.state
    if meta["world"] == group.size():  # the same ranks: each its own RNG state and buffers
        if entries.get(rng_key) is not None:
            _set_rng_state(entries[rng_key])
        for name, value in (entries.get(buffers_key) or {}).items():
            if name in loaded.buffers:
                loaded.buffers[name].copy_(value)
    values = meta.get("optimizer") or {}
    if values:  # a chain's counters, as saved
        same = {id(v): v for _, v in _opt_fields(loaded.opt_state)}
        loaded = loaded._replace(opt_state=_rebuild(loaded.opt_state, same, values))
    return loaded._replace(step=int(meta["step"])), meta["extra"]


# --- a directory of checkpoints ----------------------------------------------------------


def _committed(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete checkpoint under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        if d.name.startswith(".") or not is_committed(d):
            continue
        try:
            step = int(json.loads((d / COMMIT_MARKER).read_text())["step"])
        except (ValueError, KeyError, TypeError):
            continue  # not one of ours
        found.append((step, d))
    return sorted(found)


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint with the highest step under ``root`` (incomplete ones are skipped)."""
    found = _committed(Path(root))
    return found[-1][1] if found else None


class CheckpointManager:
    """Checkpoints of one run under ``root`` (``root/step_00000100``), the last ``keep`` kept.

    ``save(state)`` names the directory after ``state.step`` (or ``step=``); once it is committed, rank 0
    deletes the oldest ones beyond ``keep`` (and temporary directories left by interrupted
    saves). ``restore(like)`` loads the latest, or returns ``None`` when there is none.
    """

    def __init__(self, root: str | os.PathLike[str], *, keep: int | None = 3) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be at least 1 (or None to keep every checkpoint), got {keep!r}")
        self.root, self.keep = Path(root), keep
        self._prune_after: Layout | None = None

    def directory(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints (their directories' names), oldest first."""
        return [int(d.name.removeprefix("step_")) for _, d in _committed(self.root) if d.name.startswith("step_")]

    def latest(self) -> Path | None:
        return latest(self.root)

    def save(
        self, state: TrainState, *, step: int | None = None, extra: Any = None, blocking: bool = True, **kwargs: Any
    ) -> PendingSave | Path:
        """``save(root/step_N, state, ...)`` then the retention (in the background too, with
        ``blocking=False``). ``N`` is ``step``, by default ``state.step``: the steps applied,
        which a step that ``apply_if_finite`` skipped leaves as it was; a loop that saves
        every K calls names its checkpoints after its own count (``step=k + 1``)."""
        self.wait()  # the previous background save, then its retention
        n = state.step if step is None else step
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"CheckpointManager.save: step must be a whole number >= 0, got {n!r}")
        result = save(self.directory(n), state, extra=extra, blocking=blocking, **kwargs)
        if isinstance(result, Path):
            self._prune(state.params.layout)
        else:
            self._prune_after = state.params.layout
        return result

    def wait(self) -> Path | None:
        """Wait for the background save, if any (raising its failure), then apply the retention."""
        done = wait()
        layout, self._prune_after = self._prune_after, None
        if done is not None and layout is not None:
            self._prune(layout)
        return done

    def _prune(self, layout: Layout) -> None:
        if _group(layout).rank() != 0 or self.keep is None:
            return
        for _, d in _committed(self.root)[: -self.keep]:
            shutil.rmtree(d, ignore_errors=True)
        for d in self.root.glob(".step_*.tmp"):  # left by saves that were killed
            shutil.rmtree(d, ignore_errors=True)

    def restore(self, like: TrainState) -> tuple[TrainState, Any] | None:
        """``load(latest, like)``, or ``None`` when ``root`` holds no complete checkpoint."""
        path = self.latest()
        return None if path is None else load(path, like)
