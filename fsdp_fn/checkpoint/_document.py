"""Values as JSON text plus tensors: how a checkpoint holds ``extra``, RNG states and counters without pickle.

A value made of ``None``, ``bool``, ``int``, ``float``, ``str``, lists, tuples, dicts with
string keys, sets and frozensets of those, and dense tensors becomes one JSON text and the
list of its tensors: a tensor is written as ``{"__tensor__": i}`` (its place in the list),
a tuple as ``{"__tuple__": [...]}`` (so it comes back a tuple; sets alike, as
``__set__`` and ``__frozenset__``). Reading the text is ``json.loads``
and putting the tags back: it runs no code. Anything else is refused when it is written,
naming where it sits in the value.

>>> text, tensors = encode({"pos": (3, 4), "w": torch.ones(2)}, "extra")
>>> text
b'{"pos": {"__tuple__": [3, 4]}, "w": {"__tensor__": 0}}'
>>> decode(text, tensors, "extra")
{'pos': (3, 4), 'w': tensor([1., 1.])}
>>> encode({"when": object()}, "extra")
Traceback (most recent call last):
...
fsdp_fn.checkpoint._integrity.CheckpointError: extra['when'] is a builtins.object: a checkpoint holds only JSON ...
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from fsdp_fn.checkpoint._integrity import CheckpointError

TENSOR = "__tensor__"
SEQUENCES: dict[str, type] = {"__tuple__": tuple, "__set__": set, "__frozenset__": frozenset}
_TAGS = {TENSOR, *SEQUENCES}
_JSON = (
    "a checkpoint holds only JSON values (None, bool, int, float, str, lists, dicts with str keys), tuples, sets "
    "and tensors, so that loading it runs no code"
)


def _hint(value: Any) -> str:
    if type(value).__module__.split(".")[0] == "numpy":
        return ": convert it (torch.from_numpy(a), or a.item() for a number)"
    for base in (bool, int, float, str, tuple, list, dict, set, frozenset):
        if isinstance(value, base):  # a NamedTuple, an IntEnum, an OrderedDict: it would come back as the base
            return f": pass a plain {base.__name__}"
    return ": store its fields (a dict of them) and rebuild it after load"


def encode(value: Any, where: str) -> tuple[bytes, list[torch.Tensor]]:
    """``value`` as JSON text and the tensors it holds (not copied); ``CheckpointError`` naming the
    first part that is neither JSON nor a dense tensor (``where`` names the value itself)."""
    tensors: list[torch.Tensor] = []

    def walk(v: Any, at: str) -> Any:
        t = type(v)
        if v is None or t in (bool, int, float, str):
            return v
        if isinstance(v, torch.Tensor):
            if t not in (torch.Tensor, torch.nn.Parameter) or v.layout != torch.strided or v.is_meta:
                raise CheckpointError(f"{at} is a {t.__name__} ({v.layout}, on {v.device}): {_JSON}")
            tensors.append(v.detach())
            return {TENSOR: len(tensors) - 1}
        if t is list:
            return [walk(x, f"{at}[{i}]") for i, x in enumerate(v)]
        if t is tuple:
            return {"__tuple__": [walk(x, f"{at}[{i}]") for i, x in enumerate(v)]}
        if t in (set, frozenset):
            items = sorted(v, key=repr)  # the same text for the same set
            return {f"__{t.__name__}__": [walk(x, f"{at}'s element {x!r}") for x in items]}
        if t is dict:
            if len(v) == 1 and next(iter(v)) in _TAGS:
                raise CheckpointError(f"{at} is a dict whose only key is {next(iter(v))!r}, which fsdp_fn reserves")
            out = {}
            for k, x in v.items():
                if type(k) is not str:
                    raise CheckpointError(f"{at} has the key {k!r}, a {type(k).__name__}: JSON's keys are strings")
                out[k] = walk(x, f"{at}[{k!r}]")
            return out
        raise CheckpointError(f"{at} is a {t.__module__}.{t.__qualname__}: {_JSON}{_hint(v)}")

    try:
        return json.dumps(walk(value, where)).encode(), tensors
    except RecursionError:
        raise CheckpointError(f"{where} is nested too deeply to be written as JSON") from None


def decode(text: bytes, tensors: list[torch.Tensor], where: str) -> Any:
    """The value ``encode`` wrote as ``text`` with ``tensors``; ``CheckpointError`` if the text is
    not such a value."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{where} is not valid JSON ({type(e).__name__}: {e})") from None

    def walk(v: Any) -> Any:
        if isinstance(v, list):
            return [walk(x) for x in v]
        if not isinstance(v, dict):
            return v
        if len(v) == 1 and TENSOR in v:
            i = v[TENSOR]
            if type(i) is not int or not 0 <= i < len(tensors):
                raise CheckpointError(f"{where} refers to tensor {i!r}, which it does not hold")
            return tensors[i]
        tag = next(iter(v)) if len(v) == 1 else None
        if tag in SEQUENCES:
            if not isinstance(v[tag], list):
                raise CheckpointError(f"{where} holds a {SEQUENCES[tag].__name__} that is not a list of values")
            try:
                return SEQUENCES[tag](walk(x) for x in v[tag])
            except TypeError as e:  # an unhashable element of a set
                raise CheckpointError(f"{where} holds a {SEQUENCES[tag].__name__} that cannot be built: {e}") from None
        return {k: walk(x) for k, x in v.items()}

    try:
        return walk(obj)
    except RecursionError:
        raise CheckpointError(f"{where} is nested too deeply") from None


# --- a document as DCP entries: its JSON text as uint8 bytes, its tensors numbered -------------


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
    """Tensors to read the document ``key`` and its tensors into, as the metadata describes them.

    Memory: each entry's claimed size, allocated only once the bytes its storage entries name
    are found to hold it (a forged size of 10**12 elements is refused, not handed to the
    allocator)."""
    stored: dict[str, int] = {}  # the bytes each entry's data files really hold for it
    sizes: dict[str, int] = {}
    for index, info in md.storage_data.items():
        name = info.relative_path
        if name not in sizes:
            file = path / name
            sizes[name] = file.stat().st_size if file.is_file() else 0
        stored[index.fqn] = stored.get(index.fqn, 0) + max(0, min(info.length, sizes[name] - info.offset))
    out = {}
    for k in _document_keys(md, key):
        entry = md.state_dict_metadata[k]
        text = k == key
        if not isinstance(entry, TensorStorageMetadata) or (
            text and (entry.properties.dtype, len(entry.size)) != (torch.uint8, 1)
        ):
            raise CheckpointError(f"{path}: its entry {k!r} is not what fsdp_fn writes (JSON bytes, or a tensor)")
        claimed = math.prod(entry.size) * entry.properties.dtype.itemsize
        if claimed > stored.get(k, 0):
            raise CheckpointError(
                f"{path}: its entry {k!r} claims {tuple(entry.size)} {entry.properties.dtype} elements "
                f"({claimed} bytes), but its data files hold {stored.get(k, 0)} bytes of it: the metadata is damaged"
            )
        out[k] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    return out


def _read_document(path: Path, loaded: Mapping[str, torch.Tensor], key: str) -> Any:
    """The value of the document ``key`` among the tensors read (``_document_targets``)."""
    count = sum(1 for k in loaded if k.startswith(f"{key}.") and k[len(key) + 1 :].isdigit())
    if any(f"{key}.{i}" not in loaded for i in range(count)):
        raise CheckpointError(f"{path}: the tensors of its entry {key!r} are not numbered 0..{count - 1}")
    tensors = [loaded[f"{key}.{i}"] for i in range(count)]
    return decode(loaded[key].numpy().tobytes(), tensors, f"{path}: its entry {key!r}")
