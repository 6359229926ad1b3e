"""What is alive at a system's memory peak: live storages by category and by the op that made them.

    python bench/where_memory.py fsdp_fn fsdp2                       # rows of compare.SYSTEMS, W=2
    python bench/where_memory.py "fsdp_fn:split_root=0,max_inflight=1" "fsdp_fn:update_in_backward=1"
    python bench/where_memory.py --seq 256 --batch 8 fsdp_fn:split_root=1

A row is a name from ``bench/compare.py``'s ``SYSTEMS`` or ``kind:option=value,...`` (values
are Python literals; 0/1 for flags). The bench GPT, one warm step, then one step measured
with a ``MemoryMeter`` that also remembers which op created each storage.
"""

from __future__ import annotations

import argparse
import ast
import collections
import os
import pathlib
import sys
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import compare as C

import fsdp_fn as ff
from fsdp_fn._memory import _storages
from fsdp_fn.testing import RankPool

MIB = 2**20


class OriginMeter(ff.MemoryMeter):
    """A ``MemoryMeter`` that keeps, for the moment of the peak, every live storage's creating op."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.op, self.ops, self.origin = "tag", 0, {}
        self.at_peak: list[tuple[str, str, int]] = []
        self.peak_at = (0, "")

    def _register(self, t: Any, category: str, override: bool) -> None:
        for st in _storages(t):
            entry = self.entries.get(st._cdata)
            if entry is None or entry.ref.expired():
                self.origin[st._cdata] = self.op
        super()._register(t, category, override)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.op, self.ops = str(func), self.ops + 1
        return super().__torch_dispatch__(func, types, args, kwargs)

    def sample(self, what: str = "") -> None:
        before = self._peak["total"]
        super().sample(what)
        if self._peak["total"] > before:
            self.peak_at = (self.ops, what)
            self.at_peak = [
                (e.category, self.origin.get(k, "?"), e.nbytes)
                for k, e in self.entries.items()
                if e.nbytes and not e.ref.expired()
            ]


def system(spec: str) -> C.System:
    if spec in C.SYSTEMS:
        return C.SYSTEMS[spec]
    kind, _, options = spec.partition(":")
    parsed = {}
    for item in filter(None, options.split(",")):
        key, _, value = item.partition("=")
        parsed[key] = ast.literal_eval(value)
    for flag in ("split_root", "update_in_backward", "keep_tail_gathered"):
        if flag in parsed:
            parsed[flag] = bool(parsed[flag])
    return C.System(kind, parsed, spec)


def measure(group: Any, spec: str, cfg: C.Config) -> dict[str, Any]:
    row = system(spec)
    built = C.BUILDERS[row.kind](cfg, group, **row.options)
    batch = C._batches(C.stdlib_text(), cfg, 0, group.rank(), group.size(), whole=False)
    built.step(batch)
    with OriginMeter(rule=C.fsdp2_rule if row.kind == "fsdp2" else None) as meter:
        built.tag(meter)
        built.step(batch)
    by_origin: collections.Counter[tuple[str, str]] = collections.Counter()
    for category, op, nbytes in meter.at_peak:
        by_origin[(category, op)] += nbytes
    return {"peak": meter.peak(), "at": meter.peak_at, "ops": meter.ops, "top": by_origin.most_common(12)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rows", nargs="+")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    args = p.parse_args()
    cfg = C.Config(seq=args.seq, batch=args.batch)
    with RankPool(args.world, warnings_as_errors=False) as pool:
        for spec in args.rows:
            out = pool.run(measure, spec, cfg, world=args.world)[0]
            peak = out["peak"]
            print(
                f"[CPU, gloo] {spec}: peak {peak['total'] / MIB:.1f} MiB at op {out['at'][0]} of {out['ops']} ({out['at'][1]})"
            )
            print("   " + ", ".join(f"{k} {v / MIB:.1f}" for k, v in peak.items() if k != "total"))
            for (category, op), nbytes in out["top"]:
                print(f"   {nbytes / MIB:8.1f}  {category:12s} {op}")


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
