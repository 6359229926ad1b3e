"""Full-model files from shards and back, streamed: safetensors (Hugging Face layout) and state dicts.

Export: the file layout (header, every tensor's byte range) follows from the plan alone,
so rank 0 writes the headers and every rank writes the bytes of its own shard pieces at
their offsets (``os.pwrite``); no rank gathers anything. Import: each rank reads only the
rectangles of each tensor that overlap its shard (``safe_open(...).get_slice``).

Under tensor parallelism the files hold the whole tensors under their names: a rank's shard runs
over its piece of each split parameter, whose bytes lie in the whole tensor as runs (rows of a
piece split on its last dimension), each written at its offset; the first rank of the axis alone
writes the parameters it does not split. Import reads each rank's piece's rectangles.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdp_fn._agree import failures
from fsdp_fn._errors import RankFailure
from fsdp_fn._guard import run_guarded
from fsdp_fn._plan import ParamSpec, Unit, unit_label
from fsdp_fn._shard import Layout, Sharded
from fsdp_fn._tp_plan import chunk_bounds
from fsdp_fn.checkpoint._dcp import Placement, boxes, runs, whole_shape
from fsdp_fn.checkpoint._integrity import CheckpointError, confined

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _parts(params: Sharded) -> Iterator[tuple[Unit, Unit, torch.Tensor]]:
    """(unit, part, this rank's shard of it): each unit's trainable part, then its frozen parts."""
    for unit in params.plan.units:
        yield unit, unit, params[unit.name]
        if unit.frozen:
            for part, shard in zip(unit.frozen_parts, params.layout.frozen[unit.name], strict=True):
                yield unit, part, shard


def _local(part: Unit, flat: torch.Tensor, layout: Layout) -> Iterator[tuple[ParamSpec, int, int, torch.Tensor]]:
    """(parameter, first, end, its elements [first, end) in ``flat``) for each parameter this rank holds part of
    (under tensor parallelism, elements of this rank's piece of it: ``Placement``)."""
    for i, first, end, at in part.held(layout.world, layout.rank):
        yield part.params[i], first, end, flat[at : at + end - first]


def _bounds(length: int, size: int) -> list[tuple[int, int]]:
    return [chunk_bounds(length, size, r) for r in range(size)]


def _tensor_rank(layout: Layout) -> int:
    """This rank's place on the tensor-parallel axis (0 without one)."""
    return layout.tensor_axis.group.rank() if layout.tensor_axis is not None else 0


def _spans(spec: ParamSpec, a: int, b: int, layout: Layout) -> Iterator[tuple[int, int, int]]:
    """The elements ``[a, b)`` of this rank's piece of ``spec`` as contiguous runs of the whole tensor:
    (start in the whole tensor's flat order, start among the elements, length). One run unless the
    piece is split on a dimension after the first (a row-split weight: a run per row at most)."""
    if spec.split is None:
        yield a, 0, b - a
        return
    dim = spec.split[0]
    if math.prod(spec.shape[:dim]) == 1:  # the piece is one block of the whole tensor
        yield Placement.of(spec, layout.plan.tensor).origin[dim] * math.prod(spec.shape[dim + 1 :]) + a, 0, b - a
        return
    for index, at, sizes, place in _placed(spec, a, b, layout):
        for whole_at, box_at, n in runs(place.whole, tuple(i.start for i in index), sizes):
            yield whole_at, at + box_at, n


def _placed(
    spec: ParamSpec, a: int, b: int, layout: Layout
) -> Iterator[tuple[tuple[slice, ...], int, tuple[int, ...], Placement]]:
    """The elements ``[a, b)`` of this rank's piece of ``spec`` as rectangles of the whole tensor:
    (its index in the whole tensor, where it starts among the elements, its sizes, the placement)."""
    place = Placement.of(spec, layout.plan.tensor)
    for box in boxes(spec.shape, a, b):
        at = place.moved(box.offsets)
        yield tuple(slice(o, o + s) for o, s in zip(at, box.sizes, strict=True)), box.start - a, box.sizes, place


# --- export ------------------------------------------------------------------------------


def _file_names(sizes: list[int], max_shard_size: int | None) -> list[int]:
    """The file index of each tensor: consecutive tensors fill a file up to ``max_shard_size`` bytes."""
    out, file, used = [], 0, 0
    for size in sizes:
        if max_shard_size is not None and used and used + size > max_shard_size:
            file, used = file + 1, 0
        out.append(file)
        used += size
    return out


def _layout(specs: list[ParamSpec], dtype: torch.dtype | None, max_shard_size: int | None) -> dict[str, Any]:
    """Files, their headers and every tensor's (file, byte offset) — the same on every rank."""
    shapes = [whole_shape(p) for p in specs]
    sizes = [math.prod(shape) * (dtype or p.dtype).itemsize for p, shape in zip(specs, shapes, strict=True)]
    index = _file_names(sizes, max_shard_size)
    count = index[-1] + 1 if index else 1
    names = [SINGLE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    headers: list[dict[str, Any]] = [{"__metadata__": {"format": "pt"}} for _ in names]
    used = [0] * count
    where: dict[str, tuple[int, int]] = {}
    for spec, shape, size, f in zip(specs, shapes, sizes, index, strict=True):
        d = dtype or spec.dtype
        if d not in _DTYPES:
            raise TypeError(f"parameter {spec.name!r} is {d}, which safetensors cannot hold")
        headers[f][spec.name] = {
            "dtype": _DTYPES[d],
            "shape": list(shape),
            "data_offsets": [used[f], used[f] + size],
        }
        where[spec.name] = (f, used[f])
        used[f] += size
    encoded = []
    for h in headers:
        text = json.dumps(h, separators=(",", ":")).encode()
        encoded.append(text + b" " * (-(8 + len(text)) % 8))  # data starts 8-byte aligned
    return {"names": names, "headers": encoded, "sizes": used, "where": where, "index": index, "bytes": sum(sizes)}


def export_safetensors(
    directory: str | os.PathLike[str],
    params: Sharded,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int | None = None,
) -> list[Path]:
    """Write the full model as Hugging Face safetensors, each rank its own bytes.

    One file, ``model.safetensors``, or with ``max_shard_size`` (bytes) a numbered set
    and ``model.safetensors.index.json``. Every rank of the group calls it: the first
    rank writes the headers, every rank the bytes of its own shard pieces at their
    offsets (replicas of a hybrid mesh: only the first). Under tensor parallelism every rank
    of the mesh calls it and the files hold the whole tensors: each rank writes its piece's
    bytes where they lie in the whole one (a parameter the axis does not split: its first
    rank). Tied parameters are written once,
    under their first name (as ``save_pretrained`` does); ``dtype`` casts on the way out.
    Memory: one parameter's piece of this rank's shard at a time (to cast it); nothing is
    gathered. Communication: two barriers, each carrying failures (a rank that fails, e.g.
    one the file system refuses, raises its error; the others raise ``RankFailure`` naming
    it, never waiting). The directory must be on a file system every rank sees.

    Args:
        directory: where the files go (made if it does not exist).
        params: the sharded parameters; frozen ones are written too.
        dtype: the dtype to write every parameter in; ``None`` keeps each one's.
        max_shard_size: the most bytes of tensor data per file (a tensor larger than it
            gets a file of its own); ``None``: one file.

    Returns:
        The paths of the model files (without the index), the same on every rank.

    Raises:
        TypeError: if a parameter would be written in a dtype safetensors cannot hold
            (before any file is written, on every rank).
        RankFailure: on the other ranks, naming the rank that failed, when a rank cannot
            write (the file system refuses it); that rank raises its own error
            (``OSError``, say).
    """
    layout = params.layout
    specs = [p for _, part, _ in _parts(params) for p in part.params]
    files = _layout(specs, dtype, max_shard_size)
    root = Path(directory)
    paths = [root / n for n in files["names"]]
    group = layout.group
    tensor_rank = _tensor_rank(layout)
    first = group.rank() == 0 and layout.first_replica and tensor_rank == 0
    with _settled(layout, "export_safetensors: the files' headers"):
        if first:
            root.mkdir(parents=True, exist_ok=True)
            for path, header, size in zip(paths, files["headers"], files["sizes"], strict=True):
                with open(path, "wb") as f:
                    f.write(len(header).to_bytes(8, "little"))
                    f.write(header)
                    f.truncate(8 + len(header) + size)
    with _settled(layout, "export_safetensors: the parameters' bytes"):
        if layout.first_replica:  # replicas hold the same bytes
            with ExitStack() as stack:
                fds = [os.open(p, os.O_WRONLY) for p in paths]
                for fd in fds:
                    stack.callback(os.close, fd)
                for _, part, flat in _parts(params):
                    for spec, a, b, piece in _local(part, flat, layout):
                        if spec.split is None and tensor_rank != 0:  # the same on every rank of the axis
                            continue
                        f, start = files["where"][spec.name]
                        data = piece.detach().to(dtype or spec.dtype).contiguous().view(torch.uint8).numpy()
                        itemsize = (dtype or spec.dtype).itemsize
                        base = 8 + len(files["headers"][f]) + start
                        for whole_at, at, n in _spans(spec, a, b, layout):
                            lo = at * itemsize
                            os.pwrite(fds[f], data[lo : lo + n * itemsize].data, base + whole_at * itemsize)
                for fd in fds:
                    os.fsync(fd)
            if first and len(paths) > 1:
                weight_map = {spec.name: files["names"][f] for spec, f in zip(specs, files["index"], strict=True)}
                (root / INDEX).write_text(
                    json.dumps({"metadata": {"total_size": files["bytes"]}, "weight_map": weight_map}, indent=2)
                )
    return paths


@contextmanager
def _settled(layout: Layout, what: str) -> Iterator[None]:
    """Run the block, then a barrier over the shard group and the replicas that carries
    failures (``failures``): when the block fails on any rank (the file system refuses it),
    every rank raises, that rank its own error and the others ``RankFailure`` naming it."""
    error: Exception | None = None
    try:
        yield
    except Exception as e:
        error = e
    found = failures(None if error is None else f"{type(error).__name__}: {error}", list(layout.groups), what)
    if error is not None:
        raise error
    if found:
        raise RankFailure(f"{what} failed on another rank: {'; '.join(found)}")


def export_state_dict(params: Sharded, *, dst: int = 0, timeout: float = 300.0) -> dict[str, torch.Tensor] | None:
    """The full parameters on rank ``dst`` of the group (``None`` on the others), one unit at a time.

    Keyed as the module's ``state_dict()`` keys its parameters, in its order: a tied
    parameter under each of its names (one tensor), so ``module.load_state_dict(export,
    strict=False)`` loads every parameter. Memory: rank ``dst`` ends with the whole model;
    the others hold nothing beyond their shards. Communication: one gather to ``dst`` per
    unit part. Every rank of the group calls it. Under tensor parallelism the rank ``dst``
    of the shard group that is first on the tensor-parallel axis gets the whole parameters:
    the axis's other ranks at ``dst`` send it their pieces (one gather per split parameter),
    and every rank of the mesh calls it.

    Args:
        params: the sharded parameters; frozen ones are exported too.
        dst: the rank, in the shard group, that receives the parameters.
        timeout: seconds a rank waits for the others' parts: a rank that dies or goes
            silent meanwhile is a ``RankFailure`` naming it (the gathers run on a thread of
            their own, watched by the guard).

    Returns:
        On rank ``dst`` (under tensor parallelism, the one first on that axis), the full
        parameters by name, in the module's order (new tensors); ``None`` on the other ranks.
    """
    layout = params.layout
    group, rank = layout.group, layout.rank
    axis = layout.tensor_axis
    out: dict[str, torch.Tensor] = {}

    def gather_all() -> None:
        for _, part, flat in _parts(params):
            pieces = [torch.empty_like(flat) for _ in range(layout.world)] if rank == dst else None
            dist.gather(flat.detach().contiguous(), pieces, group=group, group_dst=dst)
            if pieces is not None:
                full = torch.cat(pieces)
                for spec, at in zip(part.params, part.offsets, strict=True):
                    value = full[at : at + spec.numel].view(spec.shape)
                    if axis is not None and spec.split is not None:
                        whole = _gather_pieces(value, spec.split, axis.group)
                        if whole is None:  # sent to the axis's first rank
                            continue
                        value = whole
                    out[spec.name] = value.clone()
                    for alias in spec.aliases:  # tied: the same tensor, as the module's state dict has it
                        out[alias] = out[spec.name]
                del full, pieces

    run_guarded(group if axis is None else layout.guard_group, "export_state_dict", timeout, gather_all)
    if rank != dst or _tensor_rank(layout) != 0:
        return None
    order = [name for name in params.plan.order if name in out]
    return {name: out[name] for name in [*order, *(n for n in out if n not in set(order))]}


def _gather_pieces(piece: torch.Tensor, split: tuple[int, int], group: dist.ProcessGroup) -> torch.Tensor | None:
    """The whole tensor from every tensor-parallel rank's ``piece`` (``torch.chunk``'s pieces of
    ``split``'s dimension), on the group's first rank; ``None`` on the others."""
    dim, length = split
    size = group.size()
    step = -(-length // size)
    padded = piece.new_zeros((*piece.shape[:dim], step, *piece.shape[dim + 1 :]))
    padded.narrow(dim, 0, piece.shape[dim]).copy_(piece)
    first = group.rank() == 0
    every = [torch.empty_like(padded) for _ in range(size)] if first else None
    dist.gather(padded, every, group=group, group_dst=0)
    if every is None:
        return None
    return torch.cat([p.narrow(dim, 0, hi - lo) for p, (lo, hi) in zip(every, _bounds(length, size), strict=True)], dim)


# --- import ------------------------------------------------------------------------------

Reader = Callable[[str, tuple[slice, ...]], torch.Tensor]


def _fill(like: Sharded, names: set[str], read: Reader, source: str, strict: bool) -> Sharded:
    """Copy into ``like``'s shards (in place; meta ones replaced) the pieces ``read(name, box)`` returns."""
    layout = like.layout
    specs = [p for _, part, _ in _parts(like) for p in part.params]
    known = {n for p in specs for n in (p.name, *p.aliases)}
    missing = [p.name for p in specs if p.name not in names and not any(a in names for a in p.aliases)]
    meta = any(t.is_meta for t in (*like.shards.values(), *(t for v in layout.frozen.values() for t in v)))
    if missing and (strict or meta):
        unit = like.plan.unit_of(missing[0]).name
        raise KeyError(
            f"{source} has no parameter {missing[0]!r} (unit {unit_label(unit)})"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
            + ("" if strict else ": on the meta device there is no value to keep for it")
        )
    if missing:  # strict=False, as torch's load_state_dict: kept as they are in like, and said
        warnings.warn(
            f"{source} has no parameter {missing[0]!r}"
            + (f" (and {len(missing) - 1} more: {', '.join(map(repr, missing[1:6]))}...)" if len(missing) > 1 else "")
            + "; strict=False keeps the values like holds for them",
            stacklevel=3,
        )
    kept = {p.name for p in specs if p.name in missing}
    # (the pieces of the missing parameters, copied before the shards are zeroed: memory of those pieces)
    saved = {}
    if kept:
        for _, part, flat in _parts(like):
            for spec, a, _, piece in _local(part, flat, layout):
                if spec.name in kept:
                    saved[spec.name, a] = piece.clone()
    unexpected = sorted(names - known)
    if strict and unexpected:
        raise KeyError(
            f"{source} has {unexpected[0]!r}, which the model does not have"
            + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
            + "; strict=False ignores such entries"
        )

    def ready(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(t.shape, dtype=t.dtype) if t.is_meta else t.zero_()

    shards = {k: ready(v) for k, v in like.shards.items()}
    frozen = {k: tuple(ready(t) for t in v) for k, v in layout.frozen.items()}
    if any(a is not b for k, v in layout.frozen.items() for a, b in zip(frozen[k], v, strict=True)):
        layout = layout.with_frozen(frozen)
    out = Sharded(shards, layout)
    for _, part, flat in _parts(out):
        for spec, a, b, piece in _local(part, flat, layout):
            if spec.name in kept:
                piece.copy_(saved[spec.name, a])
                continue
            name = spec.name if spec.name in names else next(n for n in spec.aliases if n in names)
            for index, at, sizes, _ in _placed(spec, a, b, layout):
                value = read(name, index)
                if tuple(value.shape) != sizes:
                    raise ValueError(f"{source}: {name!r} is not of shape {whole_shape(spec)}")
                piece[at : at + value.numel()].copy_(value.reshape(-1))
    return out


def _check_shapes(source: str, shapes: Mapping[str, tuple[int, ...]], like: Sharded) -> None:
    for spec in like.plan.params:
        whole = whole_shape(spec)
        for n in (spec.name, *spec.aliases):
            if n in shapes and tuple(shapes[n]) != whole:
                raise ValueError(f"{source}: {n!r} has shape {tuple(shapes[n])}, the model's parameter has {whole}")


def import_state_dict(state_dict: Mapping[str, torch.Tensor], like: Sharded, *, strict: bool = True) -> Sharded:
    """Shards of a full ``state_dict`` (keyed by FQN) in ``like``'s layout, written into ``like``'s tensors.

    Each rank copies only its own pieces (values are cast to the shard dtype; under tensor
    parallelism the state dict holds whole tensors, of which each rank takes its piece's part).
    ``strict=False`` ignores entries the model does not have (e.g. buffers) and, as torch's
    ``load_state_dict``, allows parameters the state dict lacks: they keep ``like``'s values,
    and a warning names them. Memory: one piece at a time beyond the shards (and a copy of
    the missing parameters' pieces). No communication.

    Args:
        state_dict: full tensors keyed by fully-qualified name (a tied parameter under any
            one of its names), the same on every rank.
        like: the sharded parameters whose layout the result takes; their tensors are
            written into (meta tensors are replaced by new ones).
        strict: ``False`` ignores entries the model does not have and keeps ``like``'s
            values for parameters the state dict lacks.

    Returns:
        A ``Sharded`` in ``like``'s layout, holding ``like``'s tensors, now filled.

    Raises:
        KeyError: with ``strict`` (or a ``like`` on the meta device), if ``state_dict`` has
            no entry for a parameter of the model (naming it and its unit); with
            ``strict``, if it has one the model does not have.
        ValueError: if an entry's shape is not its parameter's.
    """
    _check_shapes("the state dict", {k: tuple(v.shape) for k, v in state_dict.items()}, like)
    return _fill(like, set(state_dict), lambda n, index: state_dict[n].detach()[index], "the state dict", strict)


def safetensors_files(path: str | os.PathLike[str]) -> list[Path]:
    """A safetensors file, or a directory's ``model.safetensors`` or the files its index names.

    A directory is untrusted: every file read from it (the index's ``weight_map`` entries
    too) must be a relative path, free of ``..``, inside it once symlinks are resolved
    (``CheckpointError`` naming the entry otherwise). safetensors itself runs no code.
    """
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise FileNotFoundError(f"no safetensors files at {p}")
    root = p.resolve()
    if (p / INDEX).is_file():
        index = confined(root, INDEX, "the index")
        try:
            weight_map = json.loads(index.read_bytes())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError(f"its weight_map is a {type(weight_map).__name__}")
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise CheckpointError(f"{p / INDEX} is not a safetensors index ({type(e).__name__}: {e})") from None
        return [confined(root, n, f"the index's weight_map entry {k!r}") for k, n in _first_of_each(weight_map)]
    if (p / SINGLE).is_file():
        return [confined(root, SINGLE, "the model file")]
    found = sorted(p.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no safetensors files at {p}")
    return [confined(root, f.name, "a safetensors file") for f in found]


def _first_of_each(weight_map: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """(a parameter, its file) for each distinct file of a ``weight_map``, in order."""
    firsts: dict[Any, str] = {}
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise CheckpointError(f"the safetensors index's weight_map entry {name!r} is {file!r}, not a file name")
        firsts.setdefault(file, name)
    return [(name, file) for file, name in firsts.items()]


def import_safetensors(path: str | os.PathLike[str], like: Sharded, *, strict: bool = True) -> Sharded:
    """Shards read from safetensors (a file, or a ``save_pretrained`` directory) in ``like``'s layout.

    Each rank reads only the rectangles of each tensor that overlap its shard (under tensor
    parallelism, its shard of its piece) (``safe_open(...).get_slice``); values are cast to
    the shard dtype and written into ``like``'s tensors. Memory: one rectangle at a time
    beyond the shards. No communication.

    Args:
        path: a safetensors file, or a directory: its ``model.safetensors``, the files its
            ``model.safetensors.index.json`` names, or else every ``*.safetensors`` in it.
            A directory is untrusted: every file read from it must lie inside it.
        like: the sharded parameters whose layout the result takes; their tensors are
            written into (meta tensors are replaced by new ones).
        strict: ``False`` ignores tensors the model does not have.

    Returns:
        A ``Sharded`` in ``like``'s layout, holding ``like``'s tensors, now filled.

    Raises:
        FileNotFoundError: if there are no safetensors files at ``path``.
        CheckpointError: if the directory's index is not a safetensors index, or names a
            file outside the directory (an absolute path, ``..``, a symlink out of it).
        KeyError: if the files hold no tensor for a parameter of the model (naming it and
            its unit), or, with ``strict``, one the model does not have.
        ValueError: if a tensor's shape is not its parameter's.
    """
    from safetensors import safe_open

    files = safetensors_files(path)
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(f), framework="pt")) for f in files]  # type: ignore[no-untyped-call]
        owner = {k: h for h in handles for k in h.keys()}  # noqa: SIM118 (safe_open is not iterable)
        shapes = {k: tuple(h.get_slice(k).get_shape()) for k, h in owner.items()}
        _check_shapes(str(path), shapes, like)

        def read(name: str, index: tuple[slice, ...]) -> torch.Tensor:
            sl = owner[name].get_slice(name)
            return sl[index] if index else sl[:]  # type: ignore[no-any-return]

        return _fill(like, set(owner), read, str(path), strict)
