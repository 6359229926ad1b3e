"""What fsdp_fn trusts in a checkpoint directory: nothing it has not checked.

- **No code runs.** DCP's ``.metadata`` is a pickle; it is read by an unpickler that admits
  only DCP's own metadata types (a planted ``__reduce__`` names a function, which is
  refused before it can be called). Tensor chunks are read by ``torch.load(...,
  weights_only=True)``, torch's unpickler for tensors. Nothing else is unpickled.
- **Nothing outside is read.** Every file the checkpoint names is a relative path, free
  of ``..``, that stays inside the directory once symlinks are resolved (``confined``).
- **Damage is refused.** At save, each rank hashes (SHA-256) every chunk it wrote, reading
  it back; rank 0 writes the digests to ``digests.json`` and the digests of that file and
  of ``.metadata`` into the commit marker, written last. At load the marker is read
  first, then those two files against it; the chunks of every tensor must cover it
  exactly, each chunk's storage entry must be the one recorded, and each chunk a rank
  reads must match its digest before it is used.

Digests catch damage (a flipped bit, a truncated or swapped file, an edited entry), not a
forger who rewrites the digests too: that needs a signature, which checkpoints here do
not carry (nor do safetensors' or orbax's).

>>> import tempfile
>>> root = Path(tempfile.mkdtemp()).resolve()
>>> confined(root, "__0_0.distcp", "an entry") == root / "__0_0.distcp"
True
>>> confined(root, "../elsewhere/__0_0.distcp", "the entry of 'model.w'")
Traceback (most recent call last):
...
fsdp_fn.checkpoint._integrity.CheckpointError: ...: the entry of 'model.w' names '../elsewhere/__0_0.distcp', a ...
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import IO, Any, NamedTuple

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.utils import _create_file_view
from torch.futures import Future

from fsdp_fn._guard import busy

COMMIT_MARKER = "COMMITTED"  # written last, inside the directory, before it is renamed into place
METADATA = ".metadata"  # DCP's
DIGESTS = "digests.json"
FORMAT = 2  # 1: fsdp_fn's own entries pickled, no digests
_MARKER_LIMIT = 1 << 20  # bytes: a marker is a few hundred


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved, loaded, verified or restored; the first line says why
    (the directory, the file, the parameter, the rank)."""


def sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


# --- paths -----------------------------------------------------------------------------------


def confined(root: Path, name: object, what: str) -> Path:
    """``root / name`` with symlinks resolved, or ``CheckpointError`` unless ``name`` is a relative
    path without ``..`` that stays inside ``root`` (itself resolved). Reads nothing."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise CheckpointError(f"{root}: {what} names {name!r}, which is not a file name")
    pure = PurePosixPath(name)
    if pure.is_absolute() or PureWindowsPath(name).drive or ".." in pure.parts:
        raise CheckpointError(
            f"{root}: {what} names {name!r}, a path that leaves the checkpoint directory; "
            "a checkpoint reads only its own files"
        )
    try:
        real = (root / name).resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise CheckpointError(f"{root}: {what} names {name!r}, which cannot be resolved ({e})") from None
    if real == root or not real.is_relative_to(root):
        raise CheckpointError(
            f"{root}: {what} names {name!r}, which leads outside the checkpoint directory (to {real}, "
            "through a symlink); a checkpoint reads only its own files"
        )
    return real


def _read(path: Path, limit: int | None = None) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(-1 if limit is None else limit + 1)
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read: {e}") from None
    if limit is not None and len(data) > limit:
        raise CheckpointError(f"{path} is larger than {limit} bytes: not a file fsdp_fn wrote")
    return data


# --- the commit marker and the digests -------------------------------------------------------


class Marker(NamedTuple):
    """The commit marker: the step, the writers' world size, the digests of ``.metadata`` and ``digests.json``."""

    step: int
    world: int
    metadata: str
    digests: str


ChunkKey = tuple[str, tuple[int, ...] | None]  # (entry, the chunk's offsets; None for bytes)
Record = tuple[str, int, int, str]  # (file, offset, length, sha256)


def _key(index: MetadataIndex) -> ChunkKey:
    return index.fqn, None if index.offset is None else tuple(index.offset)


def _chunk_name(key: ChunkKey) -> str:
    fqn, offsets = key
    return repr(fqn) if offsets is None else f"{fqn!r} (chunk at {offsets})"


def read_marker(root: Path) -> Marker | None:
    """The commit marker of ``root`` (resolved), ``None`` where there is none."""
    file = root / COMMIT_MARKER
    if not file.exists() and not file.is_symlink():
        return None
    real = confined(root, COMMIT_MARKER, "the commit marker")
    try:
        found = json.loads(_read(real, _MARKER_LIMIT))
    except CheckpointError:
        raise
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{root}: its {COMMIT_MARKER} marker cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(found, dict):
        raise CheckpointError(f"{root}: its {COMMIT_MARKER} marker is not what fsdp_fn writes (a JSON object)")
    if found.get("format") != FORMAT:
        raise CheckpointError(
            f"{root} was written by an earlier fsdp_fn (checkpoint format {found.get('format', 1)!r}), which "
            f"pickled its own entries and kept no digests; this version reads format {FORMAT} only, since it never "
            "unpickles checkpoint data: load it with the fsdp_fn that wrote it and save it again"
        )
    fields = {"step": int, "world": int, "metadata": str, "digests": str}
    for name, kind in fields.items():
        if type(found.get(name)) is not kind:
            raise CheckpointError(f"{root}: its {COMMIT_MARKER} marker has no valid {name!r}: it is damaged")
    return Marker(found["step"], found["world"], found["metadata"], found["digests"])


def marker_step(directory: Path) -> int | None:
    """The step in ``directory``'s commit marker, ``None`` if it has none that fsdp_fn can read."""
    try:
        marker = read_marker(directory.resolve())
    except (CheckpointError, OSError):
        return None
    return None if marker is None else marker.step


def _read_digests(root: Path, marker: Marker) -> dict[ChunkKey, Record]:
    data = _read(confined(root, DIGESTS, "the digests file"))
    if sha256(data) != marker.digests:
        raise CheckpointError(f"{root}: {DIGESTS} does not match its digest in {COMMIT_MARKER}: the file is damaged")
    try:
        found = json.loads(data)
        records: dict[ChunkKey, Record] = {}
        for fqn, offsets, file, offset, length, digest in found["chunks"]:
            types = (str, str, int, int, str)
            if not all(type(v) is k for v, k in zip((fqn, file, offset, length, digest), types, strict=True)):
                raise TypeError("a record of the wrong types")
            if offsets is not None and not (isinstance(offsets, list) and all(type(o) is int for o in offsets)):
                raise TypeError("offsets that are not a list of ints")
            records[fqn, None if offsets is None else tuple(offsets)] = (file, offset, length, digest)
    except (ValueError, TypeError, KeyError, RecursionError) as e:  # the digest matched: written so
        raise CheckpointError(f"{root}: {DIGESTS} is not what fsdp_fn writes ({type(e).__name__}: {e})") from None
    return records


def commit(tmp: Path, writer: Writer, step: int, world: int) -> None:
    """Write ``digests.json`` and then the commit marker into ``tmp`` (rank 0, after DCP's save), synced."""
    records = [[fqn, None if o is None else list(o), *record] for (fqn, o), record in sorted(writer.records.items())]
    text = json.dumps({"algorithm": "sha256", "chunks": records}, separators=(",", ":")).encode()
    _write_synced(tmp / DIGESTS, text)
    assert writer.metadata_digest is not None
    marker = {
        "format": FORMAT,
        "step": step,
        "world": world,
        "time": time.time(),
        "metadata": writer.metadata_digest,
        "digests": sha256(text),
    }
    _write_synced(tmp / COMMIT_MARKER, json.dumps(marker).encode())


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


# --- DCP's metadata, read without running code -----------------------------------------------

_DCP = "torch.distributed.checkpoint"
_ADMITTED = {
    *(
        (f"{_DCP}.metadata", name)
        for name in (
            "Metadata",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name: torch.strided
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata types, torch's dtypes and ``torch.Size``; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ADMITTED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not one of DCP's metadata types")


class Opened(NamedTuple):
    """A checkpoint directory whose marker, digests and metadata have been read and checked."""

    root: Path  # resolved
    marker: Marker | None  # None: written by torch's dcp.save (FSDP2, torchtitan): no digests
    metadata: Metadata
    files: dict[str, Path]  # every data file the metadata names -> where it is (confined)
    digests: dict[ChunkKey, Record] | None


def open_checkpoint(directory: str | os.PathLike[str]) -> Opened:
    """Read and check ``directory``'s marker, digests and ``.metadata``, in that order; reads no data.

    A directory without a marker is a checkpoint written by torch's ``dcp.save`` (it has
    none) or an incomplete one; which of the two is for the caller to decide.
    """
    given = Path(directory)
    if not given.is_dir():
        raise CheckpointError(f"no checkpoint at {given}: " + ("not a directory" if given.exists() else "no such path"))
    root = given.resolve()
    marker = read_marker(root)
    if marker is None and (
        (given.name.startswith(".") and given.name.endswith(".tmp")) or not (root / METADATA).is_file()
    ):
        raise CheckpointError(
            f"{given} is not a complete checkpoint: it has no {COMMIT_MARKER} marker "
            "(a save was interrupted before every rank finished); load an earlier one (latest())"
        )
    digests = None if marker is None else _read_digests(root, marker)
    data = _read(confined(root, METADATA, "DCP's metadata file"))
    if marker is not None and sha256(data) != marker.metadata:
        raise CheckpointError(f"{root}: {METADATA} does not match its digest in {COMMIT_MARKER}: the file is damaged")
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:
        raise CheckpointError(
            f"{root}: its metadata file cannot be read ({type(e).__name__}: {e}); nothing in it was run"
        ) from None
    try:
        files = _check_metadata(root, md, digests)
    except (AttributeError, TypeError) as e:  # a field missing, or of a type nothing here expects
        raise CheckpointError(f"{root}: its metadata is damaged: {type(e).__name__}: {e}") from None
    return Opened(root, marker, md, files, digests)


def _ints(value: Any, n: int | None = None) -> bool:
    return isinstance(value, tuple) and all(type(v) is int and v >= 0 for v in value) and (n is None or len(value) == n)


def _check_metadata(root: Path, md: Any, digests: dict[ChunkKey, Record] | None) -> dict[str, Path]:
    """Raise ``CheckpointError`` unless ``md`` is DCP metadata whose every tensor is covered
    exactly by its chunks, whose every chunk has a storage entry in a file inside ``root``
    (and, with ``digests``, the entry recorded there). Returns each file's path."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{root}: its metadata is damaged: {what}")

    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise bad(f"it holds a {type(md).__name__}, not DCP's Metadata")
    storage = md.storage_data
    if not isinstance(storage, dict):
        raise bad("it has no storage entries")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            raise bad(f"a storage entry is keyed by {index!r}")
        if index.offset is not None and not _ints(index.offset):
            raise bad(f"the storage entry of {index.fqn!r} has the offsets {index.offset!r}")
        if not (
            isinstance(info, _StorageInfo)
            and type(info.offset) is int
            and type(info.length) is int
            and info.offset >= 0
            and info.length >= 0
        ):
            raise bad(f"the storage entry of {_chunk_name(_key(index))} is {info!r}")
        descriptors = info.transform_descriptors
        if descriptors is not None and not (
            isinstance(descriptors, list | tuple) and all(isinstance(d, str) for d in descriptors)
        ):
            raise bad(f"the storage entry of {_chunk_name(_key(index))} has the transforms {descriptors!r}")
    for fqn, entry in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise bad(f"an entry is named {fqn!r}")
        if isinstance(entry, BytesStorageMetadata):
            if MetadataIndex(fqn) not in storage:
                raise bad(f"the entry {fqn!r} has no storage entry")
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise bad(f"the entry {fqn!r} is a {type(entry).__name__}")
        props = entry.properties
        if not (isinstance(props, TensorProperties) and isinstance(props.dtype, torch.dtype)):
            raise bad(f"the entry {fqn!r} has the properties {props!r}")
        if not _ints(entry.size):
            raise bad(f"the entry {fqn!r} has the shape {entry.size!r}")
        if not isinstance(entry.chunks, list):
            raise bad(f"the entry {fqn!r} has the chunks {entry.chunks!r}")
        shape = tuple(entry.size)
        boxes: list[Box] = []
        for chunk in entry.chunks:
            if not (isinstance(chunk, ChunkStorageMetadata) and _ints(chunk.offsets, len(shape))):
                raise bad(f"the entry {fqn!r} has the chunk {chunk!r}")
            if not _ints(chunk.sizes, len(shape)):
                raise bad(f"the entry {fqn!r} has the chunk {chunk!r}")
            at, size = tuple(chunk.offsets), tuple(chunk.sizes)
            if any(o + s > d for o, s, d in zip(at, size, shape, strict=True)):
                raise bad(f"the chunk of {fqn!r} at {at} of shape {size} lies outside its shape {shape}")
            info = storage.get(MetadataIndex(fqn, at))
            if info is None:
                raise bad(f"the chunk of {fqn!r} at {at} has no storage entry")
            needs = math.prod(size) * props.dtype.itemsize
            if not info.transform_descriptors and info.length < needs:
                raise bad(f"the chunk of {fqn!r} at {at} needs {needs} bytes; its storage entry holds {info.length}")
            boxes.append((at, size))
        _covers_exactly(root, fqn, shape, boxes)
    if digests is not None:
        for index, info in storage.items():
            key = _key(index)
            recorded = digests.get(key)
            if recorded is None or recorded[:3] != (info.relative_path, info.offset, info.length):
                raise CheckpointError(
                    f"{root}: the storage entry of {_chunk_name(key)} names bytes {info.offset}.."
                    f"{info.offset + info.length} of {info.relative_path!r}, which {DIGESTS} does not record: "
                    "the metadata is damaged"
                )
        if len(digests) != len(storage):
            raise CheckpointError(f"{root}: {DIGESTS} records chunks that the metadata does not have: one is damaged")
    files: dict[str, Path] = {}
    for index, info in storage.items():
        if info.relative_path not in files:
            what = f"the storage entry of {_chunk_name(_key(index))}"
            files[info.relative_path] = confined(root, info.relative_path, what)
    return files


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def _covers_exactly(root: Path, fqn: str, shape: tuple[int, ...], boxes: list[Box]) -> None:
    """``CheckpointError`` unless the boxes (offsets, sizes), inside ``shape``, overlap nowhere and
    add up to it. A sweep along the first dimension compares only boxes whose rows meet."""
    numel = math.prod(shape)
    covered = sum(math.prod(size) for _, size in boxes)
    live = sorted((b for b in boxes if math.prod(b[1])), key=lambda b: b[0][:1])
    active: list[Box] = []
    for at, size in live:
        active = [b for b in active if not shape or b[0][0] + b[1][0] > at[0]]
        for other_at, other_size in active:
            if all(a < o + s and o < a + n for a, n, o, s in zip(at, size, other_at, other_size, strict=True)):
                raise CheckpointError(
                    f"{root}: its metadata is damaged: the chunks of {fqn!r} at {other_at} and {at} overlap"
                )
        active.append((at, size))
    if covered != numel:
        raise CheckpointError(
            f"{root}: its metadata is damaged: the chunks of {fqn!r} cover {covered} of its {numel} elements"
            + (" (a chunk is missing)" if covered < numel else "")
        )


# --- reading and writing chunks ----------------------------------------------------------------


_BLOCK = 8 << 20  # bytes hashed at a time


def _hash(stream: IO[bytes], offset: int, length: int) -> tuple[str, int]:
    """The SHA-256 of ``length`` bytes at ``offset`` and how many there were, read a block at a time."""
    stream.seek(offset)
    h, left = hashlib.sha256(), length
    while left:
        block = stream.read(min(_BLOCK, left))
        if not block:
            break
        h.update(block)
        left -= len(block)
    return h.hexdigest(), length - left


def check_chunk(opened: Opened, stream: IO[bytes], index: MetadataIndex) -> int:
    """Raise ``CheckpointError`` unless a chunk's bytes in its (open) file are all there and match
    their recorded digest; its length. Memory: one block (8 MiB)."""
    info = opened.metadata.storage_data[index]
    digest, found = _hash(stream, info.offset, info.length)
    where = f"{opened.root}: the data of {_chunk_name(_key(index))} in {info.relative_path}"
    if found != info.length:
        raise CheckpointError(f"{where} is cut short ({found} of {info.length} bytes): the file is truncated")
    if opened.digests is not None and digest != opened.digests[_key(index)][3]:
        raise CheckpointError(f"{where} does not match its digest (sha256): the file is damaged")
    return found


def read_tensor(
    opened: Opened,
    stream: IO[bytes],
    index: MetadataIndex,
    *,
    check_digest: bool,
    transform: Callable[[IO[bytes]], IO[bytes]] | None = None,
) -> torch.Tensor:
    """The tensor of one chunk from its (open) file: checked against its digest first
    (``check_digest``), then ``torch.load(weights_only=True)`` from the file (``transform``: DCP's
    stream transforms), and checked to be the dtype and shape the metadata gives it."""
    info = opened.metadata.storage_data[index]
    if check_digest:
        check_chunk(opened, stream, index)
    view: IO[bytes] = _create_file_view(stream, info.offset, info.length)  # type: ignore[arg-type, assignment]
    if transform is not None:
        view = transform(view)
        if not view.seekable():  # torch.load seeks
            view = io.BytesIO(view.read())
    where = f"{opened.root}: the data of {_chunk_name(_key(index))} in {info.relative_path}"
    try:
        tensor = torch.load(view, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{where} is not a tensor ({type(e).__name__}: {e})") from None
    entry = opened.metadata.state_dict_metadata[index.fqn]
    assert isinstance(entry, TensorStorageMetadata)
    assert index.offset is not None
    sizes = next(tuple(c.sizes) for c in entry.chunks if tuple(c.offsets) == tuple(index.offset))
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointError(f"{where} holds a {type(tensor).__name__}, not a tensor")
    if tensor.dtype != entry.properties.dtype or tuple(tensor.shape) != sizes:
        got = f"a {tensor.dtype} tensor of shape {tuple(tensor.shape)}"
        raise CheckpointError(f"{where} holds {got}; the metadata says {entry.properties.dtype} of shape {sizes}")
    return tensor


class Reader(FileSystemReader):
    """DCP's file-system reader, reading only what ``open_checkpoint`` checked: the metadata it
    read, the files it confined, each chunk checked against its digest (``check_digests``)
    before ``torch.load(weights_only=True)``. A pickled entry is refused, never loaded.

    Memory: as DCP's own reader (a chunk's tensor at a time); the digest is computed a block
    (8 MiB) at a time, before the chunk is read again, from the page cache, as a tensor.
    """

    def __init__(self, opened: Opened, *, check_digests: bool = True) -> None:
        super().__init__(opened.root)
        self.opened, self.check_digests = opened, check_digests

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.opened.root}: fsdp_fn reads no rank-local metadata")
        md = self.opened.metadata
        md.storage_meta = md.storage_meta if isinstance(md.storage_meta, StorageMeta) else StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        with busy("reading its data"):  # (a rank silent in its reads is named by the others)
            return self._read(plan, planner)

    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        storage = self.opened.metadata.storage_data
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(storage[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            with open(self.opened.files[name], "rb") as stream:
                for req in sorted(items, key=lambda r: storage[r.storage_index].offset):
                    if req.type == LoadItemType.BYTE_IO:
                        raise CheckpointError(
                            f"{self.opened.root}: {req.storage_index.fqn!r} is a pickled object; fsdp_fn never "
                            "unpickles checkpoint data"
                        )
                    descriptors = storage[req.storage_index].transform_descriptors
                    transform = None
                    if descriptors:

                        def transform(raw: IO[bytes], req: Any = req, d: Any = descriptors) -> IO[bytes]:
                            return self.transforms.transform_load_stream(req, d, raw)

                    tensor = read_tensor(
                        self.opened, stream, req.storage_index, check_digest=self.check_digests, transform=transform
                    )
                    for dim, (at, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                        tensor = tensor.narrow(dim, at, length)
                    target = planner.resolve_tensor(req).detach()
                    if target.shape != tensor.shape:
                        raise CheckpointError(
                            f"{self.opened.root}: {req.storage_index.fqn!r}: a chunk of shape {tuple(tensor.shape)} "
                            f"to read into {tuple(target.shape)}"
                        )
                    target.copy_(tensor)
                    planner.commit_tensor(req, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done


class Digested(NamedTuple):
    """A chunk's storage entry with the SHA-256 of its bytes: what a rank sends rank 0 after writing."""

    info: _StorageInfo
    digest: str


class Writer(FileSystemWriter):
    """DCP's file-system writer that hashes every chunk it wrote (reading it back from the page
    cache, a block of 8 MiB at a time) and refuses to write as a single process when the save's group
    is gone (DCP falls back to that when the default group has been destroyed, and the
    ranks would overwrite each other's files).

    Rank 0 ends with ``records`` (every rank's chunks and digests, gathered by DCP with its
    write results) and ``metadata_digest``; ``hashing_seconds`` is this rank's hashing time.
    """

    def __init__(self, path: Path, *, world: int) -> None:
        super().__init__(path)
        self.expected_world = world
        self.records: dict[ChunkKey, Record] = {}
        self.metadata_digest: str | None = None
        self.hashing_seconds = 0.0

    def _gone(self, why: str) -> CheckpointError:
        return CheckpointError(
            f"the process group of this save is gone ({why}): DCP would write as a single process and the "
            f"ranks would overwrite each other's files; nothing was committed at {self.path}"
        )

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # DCP's single-process fallback makes every rank a coordinator planning for one rank.
        if len(plans) != self.expected_world:
            raise self._gone(f"DCP plans for {len(plans)} ranks where the group had {self.expected_world}")
        return super().prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        with busy("writing its data"):
            results = super().write_data(plan, planner).value()
        start = time.perf_counter()
        out = []
        by_file: dict[str, list[WriteResult]] = {}
        for r in results:
            by_file.setdefault(r.storage_data.relative_path, []).append(r)
        for name, written in by_file.items():
            with open(Path(self.path) / name, "rb") as f:
                for r in sorted(written, key=lambda r: r.storage_data.offset):
                    digest, _ = _hash(f, r.storage_data.offset, r.storage_data.length)
                    out.append(dataclasses.replace(r, storage_data=Digested(r.storage_data, digest)))
        self.hashing_seconds += time.perf_counter() - start
        done: Future[list[WriteResult]] = Future()
        done.set_result(out)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        plain = []
        for rank_results in results:
            plain.append([dataclasses.replace(r, storage_data=r.storage_data.info) for r in rank_results])
            for r in rank_results:
                info = r.storage_data.info
                self.records[_key(r.index)] = (info.relative_path, info.offset, info.length, r.storage_data.digest)
        super().finish(metadata, plain)
        self.metadata_digest = sha256(_read(Path(self.path) / METADATA))


def verify_chunks(opened: Opened) -> tuple[int, int]:
    """Read every chunk of every file and check it against its digest, and each tensor chunk to be
    the tensor the metadata describes (``torch.load(weights_only=True)``; torch's pickled
    values, such as its param groups, are hashed, not read): (chunks, bytes) checked.
    Memory: one chunk's tensor at a time."""
    storage = opened.metadata.storage_data
    by_file: dict[str, list[MetadataIndex]] = {}
    for index, info in storage.items():
        by_file.setdefault(info.relative_path, []).append(index)
    chunks = total = 0
    for name, indices in sorted(by_file.items()):
        with open(opened.files[name], "rb") as stream:
            for index in sorted(indices, key=lambda i: storage[i].offset):
                total += check_chunk(opened, stream, index)
                if index.offset is not None and not storage[index].transform_descriptors:
                    read_tensor(opened, stream, index, check_digest=False)
                chunks += 1
    return chunks, total
