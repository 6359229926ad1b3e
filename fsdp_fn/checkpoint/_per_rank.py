"""What each rank saves of its own: its random number generators' states, and the buffers that differ between ranks."""

from __future__ import annotations

import hashlib
import random
import sys
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from fsdp_fn._agree import gather_objects


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
