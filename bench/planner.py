"""The planner against what it predicts and against every uniform grouping, measured.

On the tiny GPT of ``bench/overhead.py`` (vocab 512, d 64, seq 32, 2 sequences per rank, 16
blocks, AdamW), CPU, gloo, W ranks: the budget is FSDP2's measured peak with ``fully_shard``
on every block (``MemoryMeter`` with ``bench/compare.py``'s FSDP2 rule), ``measure_costs``
times the costs, ``plan_for_budget`` chooses, from the plan a user gets by default (one unit a
block; the embedding and head units of their own, ``split_root="auto"``). Then every uniform grouping (1..16 blocks a
unit, without and with remat) is timed and metered, and DDP timed beside them, so the
report says how close the prediction came (step and peak), whether the choice fits the
budget, and how far the chosen plan is from the fastest measured one that fits. Every row
is timed one step of each in turn (DDP's and FSDP2's with them, twice ``--steps`` timed
steps a row; for the bench GPT, whose rows hold hundreds of MB each, in two passes over the rows,
the second in the reverse order, ``--steps`` a row in each), and reports the median.

    python bench/planner.py                     # W=2, 16 blocks, CPU, gloo
    python bench/planner.py --layers 8 --steps 10 --json out/planner.json
    python bench/planner.py --model bench --steps 1 --json out/planner_bench.json

``--model bench`` is ``bench/compare.py``'s GPT (d 512, 8 blocks, vocab 8192) at the realistic
batch (8 x 256 tokens per rank), and the budget FSDP2's peak with activation checkpointing
on every block (``torch.distributed._composable.checkpoint``), whose step is timed beside.
``--model llama`` is a small Hugging Face Llama (hidden 128, 8 decoder layers, GQA 4/2 heads,
vocab 1024; 4 x 64 tokens per rank), its decoder layers the blocks, the budget as for the
tiny GPT.

    python bench/planner.py --model llama --json out/planner_llama.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import fsdp_fn as ff
from bench.compare import OpsOnlyTracker, fsdp2_rule
from examples.gpt import GPT, Block, GPTConfig, lm_loss
from fsdp_fn.testing import RankPool

MODELS = {  # (GPTConfig fields, sequences per rank)
    "tiny": ({"vocab": 512, "seq": 32, "d_model": 64, "n_heads": 2}, 2),
    "bench": ({"vocab": 8192, "seq": 256, "d_model": 512, "n_heads": 8}, 8),
    "llama": ({"vocab": 1024, "seq": 64, "hidden": 128, "intermediate": 344, "heads": 4, "kv_heads": 2}, 4),
}
_KIND = ["tiny"]  # (set per rank by bench())


def _model(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = MODELS[_KIND[0]][0]
    if _KIND[0] != "llama":
        return GPT(GPTConfig(**cfg, n_layers=layers))
    import transformers

    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=cfg["vocab"],
            hidden_size=cfg["hidden"],
            intermediate_size=cfg["intermediate"],
            num_hidden_layers=layers,
            num_attention_heads=cfg["heads"],
            num_key_value_heads=cfg["kv_heads"],
            max_position_embeddings=cfg["seq"],
            use_cache=False,
        )
    )


def _block() -> type:
    if _KIND[0] != "llama":
        return Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(model.model.layers if _KIND[0] == "llama" else model.blocks)  # type: ignore[union-attr,arg-type]


def _loss(model: Any, batch: torch.Tensor) -> torch.Tensor:
    if _KIND[0] != "llama":
        return lm_loss(model, batch)
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


def _batch(rank: int, k: int) -> torch.Tensor:
    cfg, sequences = MODELS[_KIND[0]]
    g = torch.Generator().manual_seed(1000 * k + rank)
    return torch.randint(0, cfg["vocab"], (sequences, cfg["seq"] + 1), generator=g)


def _times(run: Any, rank: int, steps: int) -> list[float]:
    run(_batch(rank, 0))
    times = []
    for k in range(steps):
        start = time.perf_counter()
        run(_batch(rank, k + 1))
        times.append(time.perf_counter() - start)
    return times


def _interleaved(runs: dict[Any, Any], rank: int, steps: int) -> dict[Any, list[float]]:
    """``steps`` timed steps of every run, one step of each in turn (every other round in
    the reverse order), after one untimed step each."""
    for run in runs.values():
        run(_batch(rank, 0))
    times: dict[Any, list[float]] = {key: [] for key in runs}
    keys = list(runs)
    for k in range(steps):
        for key in keys if k % 2 == 0 else keys[::-1]:
            start = time.perf_counter()
            runs[key](_batch(rank, k + 1))
            times[key].append(time.perf_counter() - start)
    return times


def _metered(run: Any, rank: int, rule: Any = None) -> tuple[int, int]:
    """The peak of the second step, the state it holds included (tagged: made before the meter),
    by ``MemoryMeter`` and, on the same step, by torch's ``FSDPMemTracker``/``MemTracker``."""
    run(_batch(rank, 0))
    batch = _batch(rank, 1)
    tracker = run.tracker(batch)
    with tracker, ff.MemoryMeter(rule=rule) as meter:
        run.tag(meter)
        run(batch)
    return meter.peak()["total"], tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def _torch_system(kind: str, layers: int, group: Any, checkpoint: bool = False) -> Any:
    from torch.distributed._composable import checkpoint as composable_checkpoint
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    model = _model(layers)
    if kind == "fsdp2":
        mesh = DeviceMesh.from_group(group, "cpu")
        for block in _blocks(model):
            if checkpoint:
                composable_checkpoint(block)
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped: torch.nn.Module = model
    else:
        wrapped = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3, foreach=True)

    def run(batch: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        _loss(wrapped, batch).backward()
        opt.step()

    def tag(meter: ff.MemoryMeter) -> None:
        meter.tag(list(wrapped.parameters()), "params")
        state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        meter.tag(state, "optimizer")

    def tracker(batch: torch.Tensor) -> Any:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
        from torch.distributed._tools.mem_tracker import MemTracker

        if kind == "fsdp2":
            t = FSDPMemTracker(wrapped, opt)
            t.track_inputs((batch,))
            return t
        t = MemTracker()
        t.track_external(wrapped, opt, batch)
        return t

    run.tag, run.tracker = tag, tracker  # type: ignore[attr-defined]
    return run


def _fsdp_fn(plan: ff.Plan, remat: bool, kept: bool, layers: int, group: Any) -> Any:
    fn = ff.functionalize(_model(layers))
    schedule = ff.Schedule(reshard_after_forward=not kept)
    step = ff.train_step(fn, _loss, ff.adamw(lr=1e-3), remat=remat or None, schedule=schedule)
    holder = {"state": step.init(ff.shard(fn.params, plan, group))}

    def run(batch: torch.Tensor) -> None:
        holder["state"], _ = step(holder["state"], batch)

    def tracker(batch: torch.Tensor) -> Any:
        from fsdp_fn._memory import _tensors

        t = OpsOnlyTracker()
        t.track_external(*_tensors(holder["state"]), batch)
        return t

    run.tag = lambda meter: meter.tag(holder["state"], "state")  # type: ignore[attr-defined]
    run.tracker = tracker  # type: ignore[attr-defined]
    return run


def _slowest(value: float, group: Any) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return float(t)


def bench(group: Any, layers: int, steps: int, sizes: list[int], kind: str = "tiny") -> dict[str, Any]:
    torch.set_num_threads(1)
    _KIND[0] = kind
    rank = group.rank()
    ac = kind == "bench"  # the budget: FSDP2 per block, with activation checkpointing at the realistic batch
    metered, tracked = _metered(_torch_system("fsdp2", layers, group, ac), rank, fsdp2_rule)
    budget = int(_slowest(metered, group))
    apart = [abs(metered - tracked)]  # the two instruments on every metered step, bytes
    fn = ff.functionalize(_model(layers))
    base = ff.make_plan(fn.module, ff.layer_policy([_block()]))  # the default plan: the root split (embedding, head)
    start = time.perf_counter()
    costs = ff.measure_costs(fn, _loss, _batch(rank, 0), base, group)
    measured_in = time.perf_counter() - start
    start = time.perf_counter()
    refused = None
    try:
        choice = ff.plan_for_budget(fn, _loss, _batch(rank, 0), base, costs, budget)
    except ValueError as e:  # reported; the predictions without a budget go beside the measurements
        refused = str(e)
        choice = ff.plan_for_budget(fn, _loss, _batch(rank, 0), base, costs, None)
    planned_in = time.perf_counter() - start
    rows = []
    chosen = (choice.chosen.per_unit, choice.chosen.remat, choice.chosen.kept)
    configs = [
        (per_unit, remat, kept)
        for per_unit in sorted(set(sizes) | {costs.blocks})  # (and all in one, as the planner weighs it)
        for remat, kept in ((False, False), (True, False), (False, True))
    ]
    configs += [chosen] if chosen not in configs else []
    # A machine whose speed drifts over the run must weigh on every row alike. The small
    # models' rows (DDP's and FSDP2's too) are all built at once and run one step of each in
    # turn; the bench GPT's (hundreds of MB of state each) in two passes over the rows, the
    # second in the reverse order, as measure_costs times its own.
    times: dict[Any, list[float]] = {c: [] for c in configs}
    if kind != "bench":
        runs = {c: _fsdp_fn(base.grouped(c[0]), c[1], c[2], layers, group) for c in configs}
        runs["ddp"] = _torch_system("ddp", layers, group)
        runs["fsdp2"] = _torch_system("fsdp2", layers, group, ac)
        times = _interleaved(runs, rank, 2 * steps)  # (as many steps as the two passes time)
    else:
        for order in (configs, configs[::-1]):
            for per_unit, remat, kept in order:
                run = _fsdp_fn(base.grouped(per_unit), remat, kept, layers, group)
                times[per_unit, remat, kept] += _times(run, rank, steps)
        times["ddp"] = _times(_torch_system("ddp", layers, group), rank, steps)
        times["fsdp2"] = _times(_torch_system("fsdp2", layers, group, ac), rank, steps)
    ddp_ms, fsdp2_ms = (1e3 * _slowest(statistics.median(times[k]), group) for k in ("ddp", "fsdp2"))
    for per_unit, remat, kept in configs:
        plan = base.grouped(per_unit)
        step_s = _slowest(statistics.median(times[per_unit, remat, kept]), group)
        metered, tracked = _metered(_fsdp_fn(plan, remat, kept, layers, group), rank)
        apart.append(abs(metered - tracked))
        peak = int(_slowest(metered, group))
        predicted = next(
            (c for c in choice.candidates if (c.per_unit, c.remat, c.kept) == (per_unit, remat, kept)), None
        )
        rows.append(
            {
                "per_unit": per_unit,
                "remat": remat,
                "kept": kept,
                "units": len(plan.units),
                "step_ms": 1e3 * step_s,
                "peak": peak,
                "predicted_ms": 1e3 * predicted.step_s if predicted else None,
                "predicted_peak": predicted.peak_bytes if predicted else None,
            }
        )
    return {
        "meter_vs_tracker_max_abs": int(_slowest(max(apart), group)),
        "budget": budget,
        "refused": refused,
        "choice": choice.to_dict(),
        "explain": choice.explain(),
        "rows": rows,
        "ddp_ms": ddp_ms,
        "fsdp2_ms": fsdp2_ms,
        "fsdp2": "FSDP2 + activation checkpointing" if ac else "FSDP2",
        "measure_s": measured_in,
        "plan_s": planned_in,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--steps", type=int, default=10, help="timed steps per row and pass")
    p.add_argument("--json", type=pathlib.Path)
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    args = p.parse_args()
    if args.model != "tiny" and args.layers == 16:
        args.layers = 8
    every = (1, 2, 4, 8, 16) if args.model != "tiny" else (1, 2, 3, 4, 6, 8, 12, 16)  # (the bench GPT's steps are slow)
    sizes = sorted({k for k in every if k <= args.layers} | {args.layers})
    with RankPool(args.world, threads=1, timeout=3600) as pool:
        report = pool.run(bench, args.layers, args.steps, sizes, args.model)[0]
    choice = ff.PlanChoice.from_dict(report["choice"])
    c = choice.chosen
    print(
        f"# planner, CPU, gloo, W={args.world}, {args.model} {'Llama' if args.model == 'llama' else 'GPT'} ({args.layers} blocks), "
        f"budget = {report['fsdp2']} per block's peak"
    )
    if report["refused"]:
        print(f"REFUSED: {report['refused']}\n(the candidates' predictions, without the budget:)")
    print(report["explain"])
    print(f"measure_costs {report['measure_s']:.1f} s, plan_for_budget {report['plan_s']:.1f} s")
    print(
        f"{'blocks/unit':>11} {'remat':>5} {'units':>5} {'step ms':>8} {'predicted':>9} {'peak MiB':>9} {'predicted':>9}"
    )
    for r in report["rows"]:
        pm = f"{r['predicted_ms']:.1f}" if r["predicted_ms"] is not None else "-"
        pp = f"{r['predicted_peak'] / 2**20:.2f}" if r["predicted_peak"] is not None else "-"
        print(
            f"{r['per_unit']:>11} {'on' if r['remat'] else 'off':>5} {'yes' if r['kept'] else 'no':>5} "
            f"{r['units']:>5} {r['step_ms']:>8.1f} {pm:>9} "
            f"{r['peak'] / 2**20:>9.2f} {pp:>9}"
        )
    mine = next(r for r in report["rows"] if (r["per_unit"], r["remat"], r["kept"]) == (c.per_unit, c.remat, c.kept))
    fitting = [r for r in report["rows"] if r["peak"] <= report["budget"]]
    best = min(fitting, key=lambda r: r["step_ms"]) if fitting else None
    print(
        f"MemoryMeter against torch's FSDPMemTracker/MemTracker on every metered step: at most "
        f"{report['meter_vs_tracker_max_abs']} bytes apart"
    )
    print(
        f"budget {report['budget'] / 2**20:.2f} MiB; DDP step {report['ddp_ms']:.1f} ms; "
        f"{report['fsdp2']} step {report['fsdp2_ms']:.1f} ms"
    )
    print(
        f"chosen: {c.per_unit} blocks a unit, remat {'on' if c.remat else 'off'}, kept {'yes' if c.kept else 'no'}: "
        f"measured {mine['step_ms']:.1f} ms "
        f"({mine['step_ms'] / report['ddp_ms']:.2f}x DDP, {mine['step_ms'] / report['fsdp2_ms']:.2f}x "
        f"{report['fsdp2']}), predicted {c.step_s * 1e3:.1f} ms "
        f"({abs(c.step_s * 1e3 / mine['step_ms'] - 1) * 100:.0f}% off); peak {mine['peak'] / 2**20:.2f} MiB, "
        f"predicted {c.peak_bytes / 2**20:.2f} MiB ({(c.peak_bytes / mine['peak'] - 1) * 100:+.0f}%), "
        f"{'within' if mine['peak'] <= report['budget'] else 'OVER'} the budget"
    )
    if best is not None:
        print(
            f"fastest measured that fits: {best['per_unit']} blocks a unit, remat {'on' if best['remat'] else 'off'}, "
            f"kept {'yes' if best['kept'] else 'no'}, "
            f"{best['step_ms']:.1f} ms: the choice is {(mine['step_ms'] / best['step_ms'] - 1) * 100:+.0f}% from it"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
