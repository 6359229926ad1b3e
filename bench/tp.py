"""FSDP x tensor parallelism, side by side in one run: fsdp_fn against torch FSDP2 + TP.

Four gloo ranks on a (dp 2, tp 2) mesh train a small Hugging Face Llama with grouped-query
attention, built from a config (nothing downloaded): the data-parallel ranks see different
halves of the global batch, the two ranks of a tensor-parallel pair the same half.

* ``fsdp_fn+tp``: ``make_plan(model, layer_policy([LlamaDecoderLayer]), tp=model._tp_plan,
  mesh=mesh)``: Hugging Face's own plan as data, q/k/v/gate/up ``colwise``, o/down
  ``rowwise``, the embedding ``embedding_rowwise`` (vocabulary split, output summed), the
  head ``colwise_gather_output`` (logits gathered whole); flat-sharded over dp, one unit per
  decoder layer, the rest split by owning module (``split_root="auto"``); ``Schedule`` at its
  defaults.
* ``fsdp2+tp``: torch's ``parallelize_module`` over the tp sub-mesh (``ColwiseParallel`` on
  q/k/v/gate/up, ``RowwiseParallel`` on o/down; the embedding
  ``RowwiseParallel(input_layouts=Replicate())`` and the head
  ``ColwiseParallel(output_layouts=Replicate())``, torch's counterparts of Hugging Face's two
  styles), then ``fully_shard`` over the dp sub-mesh on each decoder layer and the root;
  ``torch.optim.AdamW(foreach=True)``.
* ``fsdp_fn`` and ``fsdp2``: the same model with no tensor parallelism, sharded 1-D over all
  four ranks (each sees a quarter of the batch): the reference rows.
* ``single``: one process on the global batch, ``torch.optim.AdamW(foreach=True)``.

Reported per system: the largest difference to one process of the loss over every step
(warm-up and timed steps of the first repetition) and of the parameters after them; the bytes
each rank holds of parameters, gradients (at the end of backward, before the optimizer) and
optimizer state, counted storage by storage (a DTensor's local tensors, padding included);
the step's peak live tensor bytes per rank with two instruments on the same step
(``fsdp_fn.MemoryMeter``, and torch's ``FSDPMemTracker`` for FSDP2, ``MemTracker`` for
fsdp_fn's step and one process); the median step (the slowest rank's) over every timed
step of every repetition, each repetition running every system once in a random order in
one pool of ranks.

    python bench/tp.py                                  # tiny Llama, 2 layers, 8x64 tokens per step
    python bench/tp.py --size small --reps 2            # 5.0M parameters, 4 layers, vocabulary 4093
    python bench/tp.py --layers 4 --systems fsdp_fn+tp,fsdp2+tp --json out/tp.json

Every figure is CPU, gloo: torch.set_num_threads(1) per rank, two ranks per core on a
two-core machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import fsdp_fn as ff
from bench.compare import OpsOnlyTracker, fsdp2_rule
from examples.gpt import stdlib_text, token_batches
from fsdp_fn._memory import _storages, _tensors
from fsdp_fn.testing import RankPool

WORLD = 4
MESH = (2, 2)  # (dp, tp)
PLATFORM = "CPU, gloo"


@dataclass(frozen=True)
class System:
    """One row: the levers it uses, in short (the table's column), and in full."""

    levers: str
    about: str


SYSTEMS: dict[str, System] = {
    "fsdp_fn+tp": System(
        "dp 2 x tp 2; HF _tp_plan as data (head colwise_gather_output); unit per layer",
        "fsdp_fn, mesh (dp 2, tp 2): make_plan(tp=model._tp_plan): q/k/v/gate/up colwise, o/down rowwise, "
        "embedding embedding_rowwise (vocabulary split, output summed), lm_head colwise_gather_output (logits "
        "gathered); flat-sharded over dp, one unit per decoder layer, split_root auto; Schedule defaults",
    ),
    "fsdp2+tp": System(
        "dp 2 x tp 2; parallelize_module (head Colwise, output Replicate); fully_shard per layer + root",
        "FSDP2 + TP, mesh (dp 2, tp 2): parallelize_module over tp (ColwiseParallel q/k/v/gate/up, RowwiseParallel "
        "o/down, embedding RowwiseParallel(input_layouts=Replicate()), lm_head "
        "ColwiseParallel(output_layouts=Replicate())), then fully_shard over dp on each decoder layer and the root; "
        "AdamW foreach",
    ),
    "fsdp_fn+tp+vocab": System(
        "fsdp_fn+tp, head vocab_parallel + parallel_cross_entropy",
        "fsdp_fn+tp with lm_head vocab_parallel: the logits stay split over tp, the loss is "
        "ff.tp.parallel_cross_entropy (three all-reduces of one number per token)",
    ),
    "fsdp2+tp+loss_parallel": System(
        "fsdp2+tp, head output Shard(-1) + loss_parallel()",
        "fsdp2+tp with lm_head ColwiseParallel(output_layouts=Shard(-1), use_local_output=False): the logits stay "
        "split over tp, the loss and its backward under torch's loss_parallel()",
    ),
    "fsdp_fn": System(
        "no TP: dp 4; unit per layer",
        "fsdp_fn, no TP: 1-D over 4 ranks, one unit per decoder layer, split_root auto; Schedule defaults",
    ),
    "fsdp2": System(
        "no TP: dp 4; fully_shard per layer + root",
        "FSDP2, no TP: fully_shard over 4 ranks on each decoder layer and the root; AdamW foreach",
    ),
    "single": System("one process, the global batch", "one process on the global batch; AdamW foreach"),
}
DEFAULT_SYSTEMS = ("fsdp_fn+tp", "fsdp2+tp", "fsdp_fn+tp+vocab", "fsdp2+tp+loss_parallel", "fsdp_fn", "fsdp2", "single")

SIZES: dict[str, dict[str, int]] = {
    # GQA (twice as many query heads as key/value heads); an odd vocabulary: the embedding's and the head's
    # pieces over tp 2 are torch.chunk's uneven ones on both systems.
    "tiny": {"vocab": 509, "hidden": 64, "intermediate": 176, "layers": 2, "heads": 4, "kv_heads": 2},
    "small": {"vocab": 4093, "hidden": 256, "intermediate": 688, "layers": 4, "heads": 8, "kv_heads": 4},
}


@dataclass(frozen=True)
class Config:
    vocab: int = 509
    hidden: int = 64
    intermediate: int = 176
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    seq: int = 64
    batch: int = 8  # sequences in the global batch (a multiple of 4: every data-parallel rank's part)
    steps: int = 10  # timed steps per repetition
    warmup: int = 2
    lr: float = 3e-3

    def llama(self) -> Any:
        import transformers

        return transformers.LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=self.seq,
            use_cache=False,
        )


def _model(cfg: Config) -> torch.nn.Module:
    """The model every system starts from: the same weights (seed 0)."""
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg.llama())


def _layer_class() -> type:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def loss_fn(model: Any, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


def _vocab_parallel_loss(group: Any, vocab: int) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The loss of a ``vocab_parallel`` head: each tp rank holds its piece of the logits."""
    from fsdp_fn.tp import parallel_cross_entropy

    def loss(model: Any, batch: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=batch[:, :-1]).logits
        return parallel_cross_entropy(logits, batch[:, 1:], group, vocab)

    return loss


_MESHES: dict[tuple[int, ...], Any] = {}


def _mesh() -> Any:
    """The (dp, tp) mesh over the pool's four ranks, made once per rank process (its groups are kept)."""
    from torch.distributed.device_mesh import init_device_mesh

    if MESH not in _MESHES:
        _MESHES[MESH] = init_device_mesh("cpu", MESH, mesh_dim_names=("dp", "tp"))
    return _MESHES[MESH]


def held_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages that hold ``tensors``' data (a DTensor's local tensors; padding included)."""
    seen: dict[int, int] = {}
    for t in tensors:
        for st in _storages(t):
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


@dataclass
class Built:
    """A system ready to step on this rank.

    ``step(batch)`` -> the mean loss over the global batch; ``held(batch)`` -> bytes this rank holds
    of parameters, gradients and optimizer state; ``full()`` -> every parameter whole (a
    collective: every rank calls it; rank 0's answer is kept).
    """

    step: Callable[[torch.Tensor], float]
    tag: Callable[[ff.MemoryMeter], None]
    tracker: Callable[[torch.Tensor], Any]
    held: Callable[[torch.Tensor], dict[str, int]]
    full: Callable[[], dict[str, torch.Tensor]]
    part: tuple[int, int]  # (which part of the global batch, of how many)


def _build_fsdp_fn(cfg: Config, group: Any, tp: bool, vocab_parallel: bool = False) -> Built:
    full = _model(cfg)
    with torch.device("meta"):  # the module fsdp_fn runs holds no weights: after sharding no rank holds the model
        model = _model(cfg)
    policy = ff.layer_policy([_layer_class()])
    if tp:
        mesh = _mesh()
        styles = dict(model._tp_plan) | ({"lm_head": "vocab_parallel"} if vocab_parallel else {})
        plan = ff.make_plan(model, policy, tp=styles, mesh=mesh)
        where: Any = mesh
        part = (mesh["dp"].get_local_rank(), mesh["dp"].size())
    else:
        plan = ff.make_plan(model, policy)
        where, part = group, (group.rank(), group.size())
    params = ff.shard(dict(full.named_parameters()), plan, where)
    buffers = {k: v.clone() for k, v in full.named_buffers()}
    del full
    fn = ff.functionalize(model)
    loss = _vocab_parallel_loss(_mesh()["tp"].get_group(), cfg.vocab) if vocab_parallel else loss_fn
    train = ff.train_step(fn, loss, ff.adamw(lr=cfg.lr))
    holder = {"state": train.init(params, buffers)}

    def step(batch: torch.Tensor) -> float:
        holder["state"], metrics = train(holder["state"], batch)
        return metrics["loss"].item()  # the mean over all ranks: over the global batch

    def tracker(batch: torch.Tensor) -> Any:
        t = OpsOnlyTracker()
        t.track_external(*_tensors(holder["state"]), batch)
        return t

    def held(batch: torch.Tensor) -> dict[str, int]:
        state = holder["state"]
        # The gradient shards of one pass, as the step's optimizer receives them (value_and_grad
        # runs the same pass; its gradients are Sharded like the parameters).
        _, grads = ff.value_and_grad(fn, loss)(state.params, state.buffers, batch)
        return {
            "params": held_bytes(_tensors(state.params)),
            "grads": held_bytes(_tensors(grads)),
            "optimizer": held_bytes(_tensors(state.opt_state)),
        }

    return Built(
        step,
        lambda meter: meter.tag(holder["state"], "state"),
        tracker,
        held,
        lambda: dict(ff.unshard(holder["state"].params)),
        part,
    )


def _build_torch(cfg: Config, group: Any, kind: str) -> Built:
    """``fsdp2+tp``, ``fsdp2`` (1-D over the group) or ``single``."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    model = _model(cfg)
    part = (0, 1)
    loss_parallel = kind == "fsdp2+tp+loss_parallel"
    if kind.startswith("fsdp2+tp"):
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = _mesh()
        layer_plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], layer_plan)
        parallelize_module(
            model,
            mesh["tp"],
            {
                "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
                if loss_parallel
                else ColwiseParallel(output_layouts=Replicate()),
            },
        )
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        part = (mesh["dp"].get_local_rank(), mesh["dp"].size())
    elif kind == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh_1d = DeviceMesh.from_group(group, "cpu")
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh_1d)
        fully_shard(model, mesh=mesh_1d)
        part = (group.rank(), group.size())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, foreach=True)
    world = group.size()
    grads: list[torch.Tensor] = []
    keep = {"grads": False}

    def step(batch: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        if loss_parallel:  # cross-entropy on logits split over tp; its backward under the same context
            from torch.distributed.tensor.parallel import loss_parallel as parallel_context

            with parallel_context():
                loss = loss_fn(model, batch)
                loss.backward()
            loss = loss.full_tensor()
        else:
            loss = loss_fn(model, batch)
            loss.backward()
        if keep["grads"]:
            grads[:] = [p.grad for p in model.parameters() if p.grad is not None]
        for meter in ff._labels.active:
            meter.tag([p.grad for p in model.parameters() if p.grad is not None], "grads")
        opt.step()
        out = loss.detach().clone()
        if world > 1:  # the mean over every rank (the two ranks of a tp pair hold the same loss)
            dist.all_reduce(out, group=group)
            out /= world
        return out.item()

    def tag(meter: ff.MemoryMeter) -> None:
        meter.tag(list(model.parameters()), "params")
        meter.tag([v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)], "optimizer")
        meter.tag(list(model.buffers()), "buffers")

    def tracker(batch: torch.Tensor) -> Any:
        if kind == "single":
            from torch.distributed._tools.mem_tracker import MemTracker

            t: Any = MemTracker()
            t.track_external(model, opt, batch)
            return t
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        t = FSDPMemTracker(model, opt)
        t.track_inputs((batch,))
        return t

    def held(batch: torch.Tensor) -> dict[str, int]:
        keep["grads"] = True
        step(batch)  # one more step (after the parity steps): its gradients, kept past zero_grad
        keep["grads"] = False
        out = {
            "params": held_bytes(list(model.parameters())),
            "grads": held_bytes(grads),
            "optimizer": held_bytes([v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]),
        }
        grads.clear()
        return out

    def whole() -> dict[str, torch.Tensor]:
        return {
            k: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for k, p in model.named_parameters()
        }

    return Built(step, tag, tracker, held, whole, part)


def _build(name: str, cfg: Config, group: Any) -> Built:
    if name == "fsdp_fn+tp":
        return _build_fsdp_fn(cfg, group, tp=True)
    if name == "fsdp_fn+tp+vocab":
        return _build_fsdp_fn(cfg, group, tp=True, vocab_parallel=True)
    if name == "fsdp_fn":
        return _build_fsdp_fn(cfg, group, tp=False)
    return _build_torch(cfg, group, name)


def _global_batch(text: bytes, cfg: Config, k: int) -> torch.Tensor:
    """Step ``k``'s global batch: windows of byte tokens of Python's standard library source (modulo a
    vocabulary under 256)."""
    return token_batches(text, cfg.batch, cfg.seq, seed=k) % cfg.vocab


def run_system(group: Any, name: str, cfg: Config, measure: bool) -> dict[str, Any]:
    """``cfg.warmup + cfg.steps`` steps of one system on this rank; with ``measure``, then the
    parameters whole, the bytes held and one step under both memory instruments."""
    torch.set_num_threads(1)
    # FSDP2 warns that the root returns a view (an in-place op on it would skip its pre-backward hook):
    # the loss reads the logits out of place. DTensor warns that full_tensor() of a parameter on the 2-D
    # mesh takes two all-gathers: that is the parity check's, after the timed steps.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    text = stdlib_text()
    built = _build(name, cfg, group)
    index, parts = built.part
    times, losses = [], []
    for k in range(cfg.warmup + cfg.steps):
        batch = _global_batch(text, cfg, k).chunk(parts)[index]
        if group.size() > 1:
            dist.barrier(group=group)
        t0 = time.perf_counter()
        losses.append(built.step(batch))
        times.append(time.perf_counter() - t0)
    result: dict[str, Any] = {"times": times[cfg.warmup :], "losses": losses}
    if measure:
        full = built.full()
        result["params"] = full if group.rank() == 0 else None
        batch = _global_batch(text, cfg, cfg.warmup + cfg.steps).chunk(parts)[index]
        result["held"] = built.held(batch)
        tracker = built.tracker(batch)
        rule = fsdp2_rule if name.startswith("fsdp2") else None
        with tracker, ff.MemoryMeter(rule=rule) as meter:
            built.tag(meter)
            built.step(batch)
        result["peak"] = meter.peak()
        result["torch_tracker_peak"] = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return result


# --- the driver ---------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model size (single fields still override)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0, help="seeds the order of systems in each repetition")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"of {list(SYSTEMS)}")
    p.add_argument("--json", type=pathlib.Path)
    for name, default in asdict(Config()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=None)
    args = p.parse_args()
    given = {f: getattr(args, f) for f in asdict(Config()) if getattr(args, f) is not None}
    cfg = replace(Config(), **(SIZES[args.size] | given))
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {list(SYSTEMS)}")
    if cfg.batch % WORLD:
        p.error(f"--batch {cfg.batch}: a multiple of {WORLD}, so that every data-parallel rank gets a part")
    if args.reps < 1 or cfg.steps < 1:
        p.error("at least one repetition and one timed step")
    params = sum(t.numel() for t in _model(cfg).parameters())
    print(
        f"[{PLATFORM}] Llama {params / 1e6:.2f}M params (vocab {cfg.vocab}, hidden {cfg.hidden}, "
        f"intermediate {cfg.intermediate}, {cfg.layers} layers, {cfg.heads} heads / {cfg.kv_heads} kv heads), "
        f"W={WORLD}, global batch {cfg.batch}x{cfg.seq} tokens, 1 thread per rank, "
        f"{args.reps} reps x ({cfg.warmup} warm-up + {cfg.steps} timed) steps",
        flush=True,
    )
    runs: dict[str, list[list[dict[str, Any]]]] = {s: [] for s in systems}
    order_rng = random.Random(args.seed)
    started = time.perf_counter()
    with RankPool(WORLD, threads=1, timeout=3600, warnings_as_errors=False) as pool:
        for rep in range(args.reps):
            order = list(systems)
            order_rng.shuffle(order)
            for name in order:
                per_rank = pool.run(run_system, name, cfg, rep == 0, world=1 if name == "single" else WORLD)
                runs[name].append(per_rank)
                step = statistics.median(max(ts) for ts in zip(*(r["times"] for r in per_rank), strict=True))
                print(f"  rep {rep + 1} {name:>22}: median step {1e3 * step:.1f} ms", flush=True)
    report = summarise(runs, cfg, params, args)
    report["elapsed_s"] = time.perf_counter() - started
    print_report(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


def summarise(runs: dict[str, list[list[dict[str, Any]]]], cfg: Config, params: int, args: Any) -> dict[str, Any]:
    ref = runs.get("single")
    ref_losses = ref[0][0]["losses"] if ref else None
    ref_params = ref[0][0]["params"] if ref else None
    rows: dict[str, Any] = {}
    for name, reps in runs.items():
        first = reps[0]
        steps = [max(ts) for per_rank in reps for ts in zip(*(r["times"] for r in per_rank), strict=True)]
        top = max(first, key=lambda r: r["peak"]["total"])  # the rank with the highest peak
        row: dict[str, Any] = {
            "levers": SYSTEMS[name].levers,
            "about": SYSTEMS[name].about,
            "step_ms_median": 1e3 * statistics.median(steps),
            "step_ms_rep_medians": [
                1e3 * statistics.median(max(ts) for ts in zip(*(r["times"] for r in pr), strict=True)) for pr in reps
            ],
            "losses": first[0]["losses"],
            "held_bytes_max_over_ranks": {
                k: max(r["held"][k] for r in first) for k in ("params", "grads", "optimizer")
            },
            "peak_bytes": top["peak"],
            "torch_tracker_peak_bytes": top["torch_tracker_peak"],
            "meter_vs_tracker_max_abs_bytes": max(abs(r["peak"]["total"] - r["torch_tracker_peak"]) for r in first),
            "losses_agree_across_ranks": max(
                abs(a - b) for r in first for a, b in zip(r["losses"], first[0]["losses"], strict=True)
            ),
        }
        if ref_losses is not None and name != "single":
            row["loss_max_abs_diff_to_single"] = max(abs(a - b) for a, b in zip(row["losses"], ref_losses, strict=True))
            mine = first[0]["params"]
            assert sorted(mine) == sorted(ref_params), (name, sorted(set(mine) ^ set(ref_params)))
            diffs = {k: (mine[k] - v).abs().max().item() for k, v in ref_params.items()}
            row["param_max_abs_diff_to_single"] = max(diffs.values())
            row["param_max_abs_diff_where"] = max(diffs, key=lambda k: diffs[k])
        rows[name] = row
    return {
        "platform": PLATFORM,
        "world": WORLD,
        "mesh": {"dp": MESH[0], "tp": MESH[1]},
        "params": params,
        "config": {**asdict(cfg), "size": args.size, "reps": args.reps, "seed": args.seed, "threads": 1},
        "systems": rows,
    }


def print_report(report: dict[str, Any]) -> None:
    rows, cfg = report["systems"], report["config"]
    kib = 1024
    n = cfg["warmup"] + cfg["steps"]
    print(
        f"\n[{report['platform']}] Llama {report['params'] / 1e6:.2f}M params, W={report['world']}, "
        f"global batch {cfg['batch']}x{cfg['seq']} tokens; KiB per rank (the rank with the highest peak)\n"
    )
    print(
        f"| system [{report['platform']}] | levers | loss max abs diff to 1 process ({n} AdamW steps) | params after, max abs diff | "
        "params KiB | grads KiB | optimizer KiB | peak KiB, MemoryMeter | peak KiB, FSDPMemTracker (FSDP2) or MemTracker | step ms (median) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        held = r["held_bytes_max_over_ranks"]
        loss = r.get("loss_max_abs_diff_to_single")
        param = r.get("param_max_abs_diff_to_single")
        print(
            f"| {name} | {r['levers']} | {'-' if loss is None else f'{loss:.1e}'} | {'-' if param is None else f'{param:.1e}'} | "
            f"{held['params'] / kib:.1f} | {held['grads'] / kib:.1f} | {held['optimizer'] / kib:.1f} | "
            f"{r['peak_bytes']['total'] / kib:.1f} | {r['torch_tracker_peak_bytes'] / kib:.1f} | "
            f"{r['step_ms_median']:.1f} |"
        )
    print()
    for name, r in rows.items():
        print(f"  {name:>22}: {r['about']}")
    for name, r in rows.items():
        at = ", ".join(f"{c} {r['peak_bytes'][c] / kib:.1f}" for c in ff.CATEGORIES)
        print(f"  {name:>22}: at the peak (MemoryMeter, KiB): {at}")
    worst = max(r["meter_vs_tracker_max_abs_bytes"] for r in rows.values())
    print(
        f"[{report['platform']}] MemoryMeter vs torch's FSDPMemTracker/MemTracker, same step, every rank: "
        f"max |difference| {worst} bytes"
    )
    for name, r in rows.items():
        reps = ", ".join(f"{m:.1f}" for m in r["step_ms_rep_medians"])
        where = f"; parameters furthest from one process: {r['param_max_abs_diff_where']}" if name != "single" else ""
        print(f"  {name:>22}: step ms per repetition {reps}{where}")
    if "fsdp_fn+tp" in rows and "fsdp2+tp" in rows:
        a, b = rows["fsdp_fn+tp"], rows["fsdp2+tp"]
        print(
            f"[{report['platform']}] fsdp_fn+tp vs fsdp2+tp: step {a['step_ms_median'] / b['step_ms_median']:.2f}x, "
            f"peak {a['peak_bytes']['total'] / b['peak_bytes']['total']:.2f}x"
        )
    print(f"elapsed {report.get('elapsed_s', 0):.0f} s")


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
