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
save killed half-way) is never loaded. ``CheckpointManager`` keeps the last K of its own
step directories and restores the newest that loads; ``blocking=False`` saves in the
background.

A checkpoint directory is untrusted input (``_integrity``): loading runs no code from it
(fsdp_fn's own entries are JSON and tensors; DCP's pickled metadata is read by an
unpickler that admits only DCP's types), reads no file outside it, and refuses damage
(a SHA-256 digest per chunk, written at save, checked at load; ``verify(dir)`` checks a
whole directory). Every failure is a ``CheckpointError``.

Full-model files, streamed (no rank gathers the model): ``export_safetensors`` writes
Hugging Face safetensors (one file, or a sharded set with its index), each rank writing
its own bytes; ``import_safetensors`` reads a ``save_pretrained`` directory into shards,
each rank reading only its slices; ``export_state_dict`` / ``import_state_dict`` do the
same with a plain state dict (on rank 0 / from full tensors).
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import shutil
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from fsdp_fn._agree import failures, gather_objects
from fsdp_fn._dcp import LoadPlanner, Pieces, SavePlanner
from fsdp_fn._document import decode, encode
from fsdp_fn._errors import DivergenceError, RankFailure
from fsdp_fn._export import export_safetensors, export_state_dict, import_safetensors, import_state_dict
from fsdp_fn._guard import join
from fsdp_fn._integrity import (
    COMMIT_MARKER,
    CheckpointError,
    Opened,
    Reader,
    Writer,
    commit,
    marker_step,
    open_checkpoint,
    read_tensor,
    verify_chunks,
)
from fsdp_fn._plan import ParamSpec, Unit, unit_label
from fsdp_fn._shard import Layout, Sharded, ensure_live
from fsdp_fn._step import TrainState

__all__ = [
    "COMMIT_MARKER",
    "CheckpointError",
    "CheckpointManager",
    "PendingSave",
    "Verified",
    "export_safetensors",
    "export_state_dict",
    "import_safetensors",
    "import_state_dict",
    "is_committed",
    "latest",
    "load",
    "read_metadata",
    "save",
    "verify",
    "wait",
]

_META = "fsdp_fn"  # the entry (JSON) holding the step, the writers' world size and the user's extra
# torch.optim's names for the fields of fsdp_fn's optimizer states (others keep their field name).
TORCH_NAMES = {"count": "step", "mu": "exp_avg", "nu": "exp_avg_sq", "trace": "momentum_buffer"}
logger = logging.getLogger(__name__)


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
    return [
        (part.params[i], Pieces(part.params[i].shape, flat[at : at + end - first], first, end))
        for i, first, end, at in part.held(layout.world, layout.rank)
    ]


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
    """This process's random number generators' states, as JSON values and tensors."""
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        rng["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return rng


def _set_rng_state(rng: Mapping[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    numpy = sys.modules.get("numpy")
    if "numpy" in rng and numpy is not None:
        name, keys, pos, has_gauss, cached = rng["numpy"]
        numpy.random.set_state((name, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, cached))


# --- fsdp_fn's own entries: JSON documents and their tensors ------------------------------


def _document(key: str, value: Any, where: str, *, copy: bool = False) -> dict[str, torch.Tensor]:
    """The entries holding ``value``: ``key`` its JSON text (as bytes in a uint8 tensor), ``key.i``
    its tensors (on the CPU; copied with ``copy``). ``CheckpointError`` naming the part of
    ``value`` that is neither JSON nor a tensor."""
    text, tensors = encode(value, where)
    out = {key: torch.frombuffer(bytearray(text), dtype=torch.uint8)}
    for i, t in enumerate(tensors):
        t = t.detach().to("cpu")
        out[f"{key}.{i}"] = t.clone() if copy or t.device.type != "cpu" else t
    return out


def _document_keys(md: Metadata, key: str) -> list[str]:
    return [k for k in md.state_dict_metadata if k == key or (k.startswith(f"{key}.") and k[len(key) + 1 :].isdigit())]


def _document_targets(path: Path, md: Metadata, key: str) -> dict[str, torch.Tensor]:
    """Tensors to read the document ``key`` and its tensors into, as the metadata describes them."""
    out = {}
    for k in _document_keys(md, key):
        entry = md.state_dict_metadata[k]
        text = k == key
        if not isinstance(entry, TensorStorageMetadata) or (
            text and (entry.properties.dtype, len(entry.size)) != (torch.uint8, 1)
        ):
            raise CheckpointError(f"{path}: its entry {k!r} is not what fsdp_fn writes (JSON bytes, or a tensor)")
        out[k] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    return out


def _read_document(path: Path, loaded: Mapping[str, torch.Tensor], key: str) -> Any:
    """The value of the document ``key`` among the tensors read (``_document_targets``)."""
    count = sum(1 for k in loaded if k.startswith(f"{key}.") and k[len(key) + 1 :].isdigit())
    if any(f"{key}.{i}" not in loaded for i in range(count)):
        raise CheckpointError(f"{path}: the tensors of its entry {key!r} are not numbered 0..{count - 1}")
    tensors = [loaded[f"{key}.{i}"] for i in range(count)]
    return decode(loaded[key].numpy().tobytes(), tensors, f"{path}: its entry {key!r}")


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
        except BaseException as e:  # surfaced by wait(); logged too, for a job that ends without waiting
            self._error = e
            logger.warning("the background save of %s failed on rank %d: %s", self.directory, self.rank, e)

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
    (replicas of a hybrid mesh: only the first) and hashes them (SHA-256, read back from the
    page cache); rank 0 also writes the replicated values: buffers, step counters, and
    ``extra`` (JSON values, tuples, sets and tensors, e.g. the data loader's position; anything
    else is refused here, naming it, so that loading runs no code), then the digests and
    the commit marker. ``hyperparams`` (torch.optim's names: ``lr``, ``betas``, ...) are
    written as a torch param group, so a torch optimizer loads the checkpoint with a plain
    ``dcp.load``. Atomic: the directory appears, complete, when every rank has written.
    Any failure (a full disk on one rank, say) raises ``CheckpointError`` on every rank.

    ``blocking=False`` copies the shards to host memory (one more copy of the state,
    briefly) and returns a ``PendingSave`` at once; the writing runs in a background
    thread on a second process group, and the next ``save`` or ``wait()`` waits for it. A
    background save whose group is destroyed before it ends (the process exits without
    ``wait()``) never commits. Memory (blocking): one parameter chunk at a time beyond the
    state. Communication: DCP's planning (a gather and a scatter of small plans, the
    digests riding with the write results) and three small barriers.
    """
    wait()  # the previous background save, and its failure, come first
    final = Path(directory)
    if not isinstance(state, TrainState):
        raise TypeError(f"save wants a TrainState (from step.init), got {type(state).__name__}")
    ensure_live(state, "checkpoint.save")
    layout = state.params.layout
    group = _group(layout)
    coordinator = group.rank() == 0
    meta = {"step": state.step, "world": group.size(), "extra": extra, "optimizer": _opt_values(state.opt_state)}
    encode(extra, "extra")  # checked on every rank, before any message, naming what is not JSON
    encode(meta["optimizer"], "the optimizer state")
    own_entries = _document(_META, meta, "the checkpoint", copy=not blocking)
    join(group, "checkpoint.save", timeout)  # a rank that saves alone is named, not left waiting in DCP
    write_shards = layout.replicate is None or layout.replicate.rank() == 0
    if not blocking:
        params, opt_state, buffers = _tree_clone((state.params, state.opt_state, state.buffers))
        state = TrainState(params, opt_state, buffers, state.step)
    entries = _entries(state, write_shards=write_shards, coordinator=coordinator)
    entries.update(_document(f"rng.{dist.get_rank()}", _rng_state(), "the RNG state", copy=not blocking))
    own = _own_buffers(state.buffers, group)
    if own:
        entries.update(_document(f"buffers.{dist.get_rank()}", own, "the per-rank buffers"))
    if coordinator:
        entries.update(own_entries)
        if hyperparams is not None:  # torch's layout, for torch's loader: fsdp_fn never reads these back
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


def _converted(e: BaseException, what: str) -> CheckpointError:
    """One ``CheckpointError`` for a failure inside DCP (its ``CheckpointException`` is a
    ``BaseException`` carrying each rank's exception): the first line names the first rank's cause."""
    if isinstance(e, CheckpointException) and e.failures:
        rank = min(e.failures)
        cause = e.failures[rank][0]
        more = f" (and {len(e.failures) - 1} more ranks)" if len(e.failures) > 1 else ""
        if isinstance(cause, CheckpointError):  # it names the checkpoint already
            return CheckpointError(f"rank {rank}{more}: {cause}")
        return CheckpointError(f"{what}: rank {rank}{more}: {type(cause).__name__}: {cause}")
    return CheckpointError(f"{what}: {type(e).__name__}: {e}")


def _write(final: Path, entries: dict[str, Any], group: dist.ProcessGroup, step: int) -> None:
    if not dist.is_initialized():  # a background save whose process group was destroyed
        raise CheckpointError(
            f"the process group of the save of {final} was destroyed before it could write; nothing was committed"
        )
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
    writer = Writer(tmp, world=group.size())
    try:
        dcp_save(entries, storage_writer=writer, planner=SavePlanner(), process_group=group)
    except (CheckpointException, Exception) as e:
        if isinstance(e, RankFailure | DivergenceError):
            raise
        raise _converted(e, f"cannot write {final}") from e
    # dcp.save returns once the coordinator has written the metadata after every rank's data.
    if coordinator:
        try:
            commit(tmp, writer, step, group.size())
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


def _open(path: Path) -> Opened:
    """The checked checkpoint at ``path``: its marker first, then its digests and metadata."""
    opened = open_checkpoint(path)
    # torch's dcp.save writes no marker and none of our entries; one of ours without it is incomplete.
    if opened.marker is None and _META in opened.metadata.state_dict_metadata:
        raise CheckpointError(
            f"{path} is not a complete checkpoint: it has no {COMMIT_MARKER} marker "
            "(a save was interrupted before every rank finished); load an earlier one (latest())"
        )
    if opened.marker is not None and _META not in opened.metadata.state_dict_metadata:
        raise CheckpointError(f"{path}: its metadata has no {_META!r} entry: it is damaged")
    return opened


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


def _check(path: Path, opened: Opened, target: _Target, like: TrainState) -> None:
    """Raise ``CheckpointError`` naming the first parameter the checkpoint cannot fill (the same on every rank)."""
    saved = opened.metadata.state_dict_metadata
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
    _check_files(path, opened, target)


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


def _check_files(path: Path, opened: Opened, target: _Target) -> None:
    """Every chunk to read lies inside its data file: a truncated file is named with a parameter in it."""
    sizes: dict[str, int] = {}
    for index, info in opened.metadata.storage_data.items():
        key = index.fqn
        if key not in target.entries:
            continue
        name = info.relative_path
        if name not in sizes:
            file = opened.files[name]
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


def load(
    directory: str | os.PathLike[str], like: TrainState, *, check_digests: bool = True, timeout: float = 300.0
) -> tuple[TrainState, Any]:
    """Read the checkpoint at ``directory`` into the layout of ``like``; return the state and ``extra``.

    ``like`` is a ``TrainState`` for the target run (``step.init(shard(...))``, or from
    ``init_shards`` with ``device="meta"``): any world size, plan, or mesh. Its tensors
    are filled in place and returned (donated; meta tensors are replaced by new ones).
    Each rank reads only the saved chunks that overlap its shards. The RNG state of each
    rank is restored when the world size is the one that saved.

    The directory is untrusted: its commit marker is read first, then the digests and
    DCP's metadata against it (no code from the directory runs, no file outside it is
    read), and every tensor must be covered exactly by its chunks. A missing, unexpected,
    mis-shaped or mis-typed parameter, an incomplete, damaged or truncated checkpoint
    raise ``CheckpointError`` naming it, on every rank, before anything is read; each chunk
    a rank reads is checked against its SHA-256 digest before it is used
    (``check_digests=False`` skips that, not the rest: docs/checkpoints.md has the cost).
    A checkpoint written by torch's ``dcp.save`` (FSDP2) has no marker and no digests and
    loads with the other checks. Communication: DCP's planning (a gather and a scatter of
    small plans) and one small all-gather of the ranks' checks.
    """
    wait()
    path = Path(directory)
    if not isinstance(like, TrainState):
        raise TypeError(f"load wants a TrainState to load into (step.init(...)), got {type(like).__name__}")
    ensure_live(like, "checkpoint.load")
    group = _group(like.params.layout)
    join(group, "checkpoint.load", timeout)
    rank = dist.get_rank()
    rng_key, buffers_key = f"rng.{rank}", f"buffers.{rank}"
    raised: Exception | None = None
    try:
        opened = _open(path)
        target = _target(like)
        _check(path, opened, target, like)
        own: dict[str, torch.Tensor] = {}
        if opened.marker is not None:
            for key in (_META, rng_key, buffers_key):
                own.update(_document_targets(path, opened.metadata, key))
    except Exception as e:  # a file the system refuses too: every rank must reach the all-gather below
        raised = e if isinstance(e, CheckpointError) else CheckpointError(f"{path}: {type(e).__name__}: {e}")
    # Every rank raises, or none: a rank that went on alone would wait in DCP's collectives.
    errors: list[str | None] = [None] * group.size()
    dist.all_gather_object(errors, None if raised is None else str(raised), group=group)
    if raised is not None:
        raise raised
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        raise CheckpointError(f"rank {failed[0][0]} cannot load {path}: {failed[0][1]}")
    entries = {**target.entries, **own}
    try:
        dcp_load(
            entries,
            storage_reader=Reader(opened, check_digests=check_digests),
            planner=LoadPlanner(),
            process_group=group,
        )
    except (CheckpointException, Exception) as e:
        if isinstance(e, RankFailure | DivergenceError):
            raise
        raise _converted(e, f"cannot load {path}") from e
    for tree in (like.params, *(v for _, v in _opt_fields(like.opt_state))):
        tree.consumed = f"its tensors were loaded into by checkpoint.load({str(path)!r}): use the state it returned"
    loaded = target.state
    if opened.marker is None:  # written by torch (FSDP2): its optimizer's step, no extra
        return loaded._replace(step=_torch_step(target)), None
    meta = _meta(path, own)
    if meta["world"] == group.size():  # the same ranks: each its own RNG state and buffers
        try:
            if rng_key in own:
                _set_rng_state(_read_document(path, own, rng_key))
            buffers = _read_document(path, own, buffers_key) if buffers_key in own else {}
            for name, value in buffers.items():
                if name in loaded.buffers:
                    loaded.buffers[name].copy_(value)
        except (TypeError, ValueError, RuntimeError, KeyError, AttributeError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{path}: rank {rank}'s RNG state or buffers are damaged ({e})") from e
    values = meta["optimizer"]
    if values:  # a chain's counters, as saved
        _check_values(path, values, _opt_values(loaded.opt_state))
        same = {id(v): v for _, v in _opt_fields(loaded.opt_state)}
        loaded = loaded._replace(opt_state=_rebuild(loaded.opt_state, same, values))
    return loaded._replace(step=meta["step"]), meta["extra"]


def _meta(path: Path, own: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """fsdp_fn's entry (step, world size, extra, the optimizer's plain values), checked."""
    meta = _read_document(path, own, _META)
    if not (
        isinstance(meta, dict)
        and type(meta.get("step")) is int
        and meta["step"] >= 0
        and type(meta.get("world")) is int
        and isinstance(meta.get("optimizer"), dict)
        and "extra" in meta
    ):
        raise CheckpointError(f"{path}: its entry {_META!r} is not what fsdp_fn writes")
    return meta


def _check_values(path: Path, saved: Mapping[str, Any], template: Mapping[str, Any]) -> None:
    """The optimizer's plain values in the checkpoint are the template's, of the same kinds (a chain's
    counters): a chain that wraps its links otherwise would silently restart their counts."""
    # (which parameters a round reached is data, there only once some are: not the chain's shape)
    counters, wanted = ({k for k in names if not k.endswith(".received")} for names in (saved, template))
    if counters != wanted:
        only_saved, only_here = sorted(counters - wanted), sorted(wanted - counters)
        raise CheckpointError(
            f"{path}: its optimizer state was saved by another chain of links: it holds "
            f"{', '.join(map(repr, only_saved)) or 'nothing more'} where the target's optimizer keeps "
            f"{', '.join(map(repr, only_here)) or 'nothing more'} (an accumulate's or apply_if_finite's counters "
            "under another path). Load it into a state made by the same optimizer, its links wrapped the same way"
        )
    for name, value in saved.items():
        if name not in template:
            continue  # (a round's reached parameters)
        like = template[name]
        same = type(value) is type(like)
        if same and isinstance(value, torch.Tensor):
            same = value.shape == like.shape and value.dtype == like.dtype
        if not same:
            raise CheckpointError(
                f"{path}: the optimizer state's {name!r} is {value!r} in the checkpoint, a {type(like).__name__} "
                "in the target"
            )


def verify(directory: str | os.PathLike[str]) -> Verified:
    """Check the whole checkpoint at ``directory`` as ``load`` would, on this process alone: its
    marker, digests and metadata, that every tensor is covered exactly by its chunks, that
    every file it names is inside it, every chunk's bytes against their digest, and that
    fsdp_fn's own entries are the JSON it writes. Reads every byte once; runs no code from
    the directory; needs no process group. ``CheckpointError`` naming the first fault.

    >>> verify("/nowhere")
    Traceback (most recent call last):
    ...
    fsdp_fn._integrity.CheckpointError: no checkpoint at /nowhere: no such path
    """
    path = Path(directory)
    opened = _open(path)
    if opened.marker is None:
        raise CheckpointError(
            f"{path} has no {COMMIT_MARKER} marker and no digests (written by torch's dcp.save?): "
            "there is nothing to verify its bytes against; load checks everything else"
        )
    chunks, size = verify_chunks(opened)
    md = opened.metadata
    own = _document_targets(path, md, _META)
    for key, target in own.items():
        indices = [i for i in md.storage_data if i.fqn == key]
        if len(indices) != 1:
            raise CheckpointError(f"{path}: its entry {key!r} is not what fsdp_fn writes (one whole tensor)")
        with open(opened.files[md.storage_data[indices[0]].relative_path], "rb") as stream:
            target.copy_(read_tensor(opened, stream, indices[0], check_digest=True))
    return Verified(path, _meta(path, own)["step"], chunks, size)


def read_metadata(directory: str | os.PathLike[str]) -> Metadata:
    """DCP's metadata of the checkpoint at ``directory`` (its entries: ``.state_dict_metadata``),
    read as ``load`` reads it: after the commit marker and against its digest, by an unpickler
    that admits only DCP's metadata types, then checked (chunks, paths). Runs no code from
    the directory, reads no data; ``CheckpointError`` naming the fault."""
    return _open(Path(directory)).metadata


class Verified(NamedTuple):
    """What ``verify`` checked: the checkpoint's step, and how many chunks and bytes."""

    directory: Path
    step: int
    chunks: int
    bytes: int


# --- a directory of checkpoints ----------------------------------------------------------


def _committed(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete checkpoint under ``root`` (its marker's step), oldest first."""
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        if d.name.startswith(".") or not is_committed(d):
            continue
        step = marker_step(d)
        if step is not None:  # else not one of ours, or damaged: load says which
            found.append((step, d))
    return sorted(found)


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint with the highest step under ``root`` (incomplete ones are skipped)."""
    found = _committed(Path(root))
    return found[-1][1] if found else None


_STEP_DIR = re.compile(r"step_(\d{8,})")


class CheckpointManager:
    """Checkpoints of one run under ``root`` (``root/step_00000100``), the last ``keep`` kept.

    ``save(state)`` names the directory after ``state.step`` (or ``step=``); once it is committed,
    rank 0 deletes the oldest of its own step directories beyond ``keep`` (and the temporary
    directories its interrupted saves left). Nothing else under ``root`` is its own: a
    checkpoint saved there by hand (``root/best``) is never deleted, nor restored.
    ``restore(like)`` loads the newest of its checkpoints that loads, or returns ``None``
    when there is none; ``skipped`` then lists the newer ones it passed over, and why.
    """

    def __init__(self, root: str | os.PathLike[str], *, keep: int | None = 3) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be at least 1 (or None to keep every checkpoint), got {keep!r}")
        self.root, self.keep = Path(root), keep
        self._prune_after: Layout | None = None
        self.skipped: list[tuple[Path, str]] = []  # by the last restore: (directory, why), newest first

    def directory(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def _own(self) -> list[tuple[int, Path]]:
        """(step, directory) of this manager's committed checkpoints (named by ``directory``), oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for d in self.root.iterdir():
            named = _STEP_DIR.fullmatch(d.name)
            if named and d == self.directory(int(named[1])) and is_committed(d):
                found.append((int(named[1]), d))
        return sorted(found)

    def steps(self) -> list[int]:
        """The steps of its complete checkpoints (their directories' names), oldest first."""
        return [n for n, _ in self._own()]

    def latest(self) -> Path | None:
        """Its newest complete checkpoint (``restore`` falls back from it if it does not load)."""
        own = self._own()
        return own[-1][1] if own else None

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
            raise CheckpointError(f"CheckpointManager.save: step must be a whole number >= 0, got {n!r}")
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
        for _, d in self._own()[: -self.keep]:
            shutil.rmtree(d, ignore_errors=True)
        for d in self.root.glob(".step_*.tmp"):  # left by its saves that were killed
            named = _STEP_DIR.fullmatch(d.name[1:-4])
            if named and d.name == f".{self.directory(int(named[1])).name}.tmp":
                shutil.rmtree(d, ignore_errors=True)

    def restore(
        self, like: TrainState, *, check_digests: bool = True, timeout: float = 300.0
    ) -> tuple[TrainState, Any] | None:
        """``load`` the newest of its checkpoints that loads into ``like``; ``None`` when it has none.

        A checkpoint that does not load (damaged, a file missing, a flipped bit) is skipped
        for the one before it: each skipped one is logged (``fsdp_fn.checkpoint``, warning)
        and kept in ``skipped`` with why. When none loads, ``CheckpointError`` lists each and
        why; ``like``'s tensors may then hold part of what was read.
        """
        self.skipped = []
        own = self._own()
        for _, path in reversed(own):
            try:
                restored = load(path, like, check_digests=check_digests, timeout=timeout)
            except CheckpointError as e:
                why = str(e).splitlines()[0]
                self.skipped.append((path, why))
                logger.warning("CheckpointManager.restore skipped %s: %s", path, why)
                continue
            if self.skipped:
                logger.warning(
                    "CheckpointManager.restore loaded %s, skipping %d newer: %s",
                    path,
                    len(self.skipped),
                    ", ".join(p.name for p, _ in self.skipped),
                )
            return restored
        if self.skipped:
            reasons = "; ".join(f"{p.name}: {why}" for p, why in self.skipped)
            raise CheckpointError(f"none of the {len(own)} checkpoints under {self.root} loads: {reasons}")
        return None
