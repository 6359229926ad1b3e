"""Tensor parallelism on a named mesh axis: FSDP x TP (x replicate) trains like one process.

The convention: the ranks of the tensor-parallel axis see the same batch and compute the same
loss; the data-parallel ranks (shard and replicate axes) see different parts of the global batch.
Each rank holds its piece (``torch.chunk``'s, as DTensor's ``Shard``) of every split parameter,
flat-sharded over the shard axis; a parameter the plan does not split is whole on the axis.
So every figure a rank reports is the one process's on the global batch: losses, the global
gradient norm, and (after ``unshard``, which gathers over both axes) the parameters.
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F

import fsdp_fn as ff
from examples.gpt import GPT, Block, GPTConfig
from fsdp_fn._shard import local_slice, unit_views
from fsdp_fn._tp import copy_in, gather_last, parallel_cross_entropy, split_last, sum_out
from fsdp_fn._tp_plan import TensorPlan, chunk_bounds
from fsdp_fn.testing import RankPool
from tests.helpers import reference_run, tiny_llama

# GQA (4 query, 2 key/value heads), a vocabulary and an MLP width that no tp size divides.
LLAMA = {
    "vocab_size": 61,
    "hidden_size": 32,
    "intermediate_size": 87,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
GPT_CFG = {"vocab": 37, "seq": 9, "d_model": 12, "n_layers": 2, "n_heads": 2, "tp_ready": True}
STEPS = 3
BATCH = 4  # sequences in the global batch


@pytest.fixture(scope="module")
def pool2():
    """Two ranks of their own: a mesh is made by every rank of the job (torch's new_group), so the
    session's four-rank pool makes only four-rank meshes."""
    with RankPool(2, timeout=300) as p:
        yield p


def _llama_loss(model, batch):
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


def _gpt_loss(model, batch):
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def _hugging_face(kind, **kw):
    """Qwen3 (its plan splits q/k/v and sums the per-head norms' gradients: replicated_with_grad_allreduce)
    and Phi3 (fused qkv and gate_up gathered whole, o and down taking their input's piece:
    rowwise_split_input), small, from a config."""
    import transformers

    config = {
        "vocab_size": 61,
        "hidden_size": 32,
        "intermediate_size": 88,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32,
    }
    torch.manual_seed(0)
    if kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config, head_dim=8, **kw))
        layer = transformers.models.qwen3.modeling_qwen3.Qwen3DecoderLayer
    else:
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**config, pad_token_id=0, **kw))
        layer = transformers.models.phi3.modeling_phi3.Phi3DecoderLayer
    return model, ff.layer_policy([layer]), _llama_loss, 61, 10


def _model(kind, **kw):
    if kind in ("qwen3", "phi3"):
        return _hugging_face(kind, **kw)
    if kind == "llama":
        import transformers

        model = tiny_llama(**(LLAMA | kw))
        layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer
        return model, ff.layer_policy([layer]), _llama_loss, model.config.vocab_size, 10
    torch.manual_seed(0)
    model = GPT(GPTConfig(**(GPT_CFG | kw)))
    return model, ff.layer_policy([Block]), _gpt_loss, model.cfg.vocab, model.cfg.seq + 1


def _batches(vocab, length, steps=STEPS):
    return [torch.randint(0, vocab, (BATCH, length), generator=torch.Generator().manual_seed(k)) for k in range(steps)]


def _data_index(mesh):
    """Which part of the global batch this rank sees: its place over the data axes (all but tp)."""
    names, coord = mesh.mesh_dim_names, mesh.get_coordinate()
    index, parts = 0, 1
    for name, c, n in zip(names, coord, mesh.mesh.shape, strict=True):
        if name != "tp":
            index, parts = index * n + c, parts * n
    return index, parts


def _train_tp(
    group,
    kind,
    shape,
    names,
    *,
    clip=None,
    micro=1,
    schedule=None,
    model_kw=None,
    plan_kw=None,
    step_kw=None,
    sgd=False,
    vocab_parallel=False,
    freeze=(),
    grouped=1,
    sequence=False,
):
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    model, policy, loss_fn, vocab, length = _model(kind, **(model_kw or {}))
    for name, p in model.named_parameters():
        if any(f in name for f in freeze):
            p.requires_grad_(False)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    fn = ff.functionalize(model)
    styles = {**model._tp_plan, **(SEQUENCE_STYLES[kind] if sequence else {})}
    ours = loss_fn
    if vocab_parallel:  # the head's logits stay split; the loss reads them where they are
        styles["head"] = "vocab_parallel"
        tp_group = mesh["tp"].get_group()

        def ours(m, batch):
            logits = m(batch[:, :-1])
            return ff.tp.parallel_cross_entropy(logits, batch[:, 1:], tp_group, vocab)

    plan = ff.make_plan(model, policy, tp=styles, mesh=mesh, **(plan_kw or {})).grouped(grouped)
    params = ff.shard(fn.params, plan, mesh)
    optimizer = ff.sgd(0.1) if sgd else ff.adamw(1e-2)
    optimizer = optimizer if clip is None else ff.chain(ff.clip_by_global_norm(clip), optimizer)
    schedule = {**(schedule or {}), **({"micro_batches": micro} if micro > 1 else {})}
    step = ff.train_step(fn, ours, optimizer, schedule=ff.Schedule(**schedule), **(step_kw or {}))
    state = step.init(params)
    index, parts = _data_index(mesh)
    batches = _batches(vocab, length)
    losses, norms = [], []
    for b in batches:
        local = b.chunk(parts)[index]
        state, metrics = step(state, [local.chunk(micro)[i] for i in range(micro)] if micro > 1 else local)
        losses.append(metrics["loss"].item())
        norms.append(metrics["grad_norm"].item())
    full = ff.unshard(state.params)
    precision = (schedule or {}).get("mixed_precision")
    ref = reference_run(
        model,
        loss_fn,
        batches,
        partial(torch.optim.SGD, lr=0.1) if sgd else partial(torch.optim.AdamW, lr=1e-2),
        clip=clip,
        param_dtype=precision.param_dtype if precision is not None else None,
    )
    split = [s for s in plan.params if s.split is not None]
    return {
        "loss": max(abs(a - b) for a, b in zip(losses, ref["losses"], strict=True)),
        "norm": max(abs(a - b) / b for a, b in zip(norms, ref["norms"], strict=True)),
        "param": max((full[k] - v).abs().max().item() for k, v in ref["params"].items()),
        "names": sorted(full) == sorted(ref["params"]),
        "split_local": sum(s.numel for s in split),
        "split_whole": sum(s.numel // s.shape[s.split[0]] * s.split[1] for s in split),
        "whole": sum(p.numel() for p in model.parameters()),
        "shard": sum(t.numel() for t in state.params.values()),
        "padding": sum(u.padded_numel(plan_dp(mesh)) - u.numel for u in plan.units),
        "dp": plan_dp(mesh),
        "estimate": ff.estimate_memory(plan, plan_dp(mesh)).params,  # bytes: the plan knows the pieces
    }


def plan_dp(mesh):
    return mesh["dp"].size() if "dp" in mesh.mesh_dim_names else 1


def _close(r, loss=2e-5, norm=2e-5, param=1e-4):  # (FSDP2 + TP: 2.9e-5 after 5 AdamW steps)
    assert r["names"]
    assert r["loss"] < loss, r
    assert r["norm"] < norm, r
    assert r["param"] < param, r


# Sequence parallelism on top of each model's plan: the first layer splits the sequence, the
# norms run on the pieces.
SEQUENCE_STYLES = {
    "gpt": {
        "blocks.0": "sequence_split_input",
        "blocks.*.ln1": "sequence_parallel",
        "blocks.*.ln2": "sequence_parallel",
        "ln_f": "sequence_parallel",
    },
    "llama": {
        "model.layers.0": "sequence_split_input",
        "model.layers.*.input_layernorm": "sequence_parallel",
        "model.layers.*.post_attention_layernorm": "sequence_parallel",
        "model.norm": "sequence_parallel",
    },
}

MESHES = {
    "dp2-tp2": ((2, 2), ("dp", "tp")),
    "tp2-dp2": ((2, 2), ("tp", "dp")),  # the names decide, not the order
    "rep2-dp1-tp2": ((2, 1, 2), ("dp_replicate", "dp", "tp")),
}


@pytest.mark.parametrize("kind", ["llama", "gpt"])
@pytest.mark.parametrize("mesh", list(MESHES), ids=list(MESHES))
def test_fsdp_by_tp_trains_like_one_process(pool, kind, mesh):
    # Catches: a collective missing in forward or backward (losses or gradients off by a factor or
    # a part), a replicated parameter's gradient summed over tp (2x), the norm counted twice, a
    # split on the wrong dimension (unshard would not rebuild the whole parameter), uneven pieces.
    shape, names = MESHES[mesh]
    for r in pool.run(_train_tp, kind, shape, names, world=math.prod(shape)):
        _close(r)
        tp = shape[names.index("tp")]
        # memory: each rank holds 1/(dp x tp) of every split parameter (torch.chunk's pieces: at most
        # one row more), 1/dp of the rest, plus padding to a multiple of dp per unit
        assert r["split_local"] * tp <= r["split_whole"] + tp * r["split_local"] // min(8, r["split_local"])
        assert r["shard"] * r["dp"] <= r["split_local"] + (r["whole"] - r["split_whole"]) + r["padding"]
        assert r["split_whole"] >= r["whole"] // 2  # most of the model is split
        assert r["estimate"] == r["shard"] * 4


@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_tp_alone_trains_like_one_process(pool2, kind):
    # (on its own: a 2-rank job)
    _close(pool2.run(_train_tp, kind, (1, 2), ("dp", "tp"), world=2)[0])


@pytest.mark.parametrize("option", ["plain", "remat"])
def test_sequence_parallel_trains_like_one_process(pool, option):
    # Catches: a norm's (or a row-split bias's) gradient left as one rank's part of the sequence, a
    # row-split output summed whole instead of scattered (or scattered in the wrong rows: the
    # sequence of 9 splits 5 + 4), a recomputation that cannot gather (the length is the forward's).
    step_kw = {"remat": ff.Remat()} if option == "remat" else {}
    _close(pool.run(_train_tp, "gpt", (2, 2), ("dp", "tp"), sequence=True, step_kw=step_kw, world=4)[0])


def test_a_model_that_takes_the_sequence_length_from_its_block_input_is_named(pool):
    # Hugging Face's Llama reshapes q/k/v by its layer input's shape, which holds a piece of the
    # sequence under sequence parallelism: the error says so and what to change.
    try:
        with pytest.raises(Exception, match="take the sequence length from the tensor reshaped"):
            pool.run(_train_tp, "llama", (2, 2), ("dp", "tp"), sequence=True, world=4)
    finally:
        # The error comes on the ranks whose piece of the sequence does not fit, while the others
        # may have issued their next gathers: whether the group is still in step depends on
        # timing (the next call would say "cannot communicate any more"). Fresh ranks for the rest.
        pool.close()


def test_vocabulary_parallel_head_and_loss(pool):
    # Catches: a split head's logits read as whole (a loss over half the vocabulary), a target on
    # another rank's piece counted twice or never, the maximum's shift taken per rank.
    _close(pool.run(_train_tp, "gpt", (2, 2), ("dp", "tp"), vocab_parallel=True, world=4)[0])


OPTIONS = {
    "offload": {"schedule": {"cpu_offload": ff.CPUOffload(device="cpu")}},
    "tied": {"model_kw": {"tie": True}},  # the table and the head split alike: the vocabulary
    "split-root": {"plan_kw": {"split_root": True}},
    "kept-gathered": {"schedule": {"reshard_after_forward": False}},
    "micro-summed": {"micro": 2, "schedule": {"reduce_each_micro_batch": False}},
    "frozen": {"freeze": ("blocks.0.qkv", "ln_f")},  # split and replicated parameters frozen
    "merged": {"grouped": 2},
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_options_compose_with_tp(pool, option):
    _close(pool.run(_train_tp, "gpt", (2, 2), ("dp", "tp"), world=4, **OPTIONS[option])[0])


def test_gradient_transformations_across_axes(pool):
    # Catches: clip_by_global_norm with a norm that misses the tp sum (clips differently per tp rank
    # and the replicated parameters diverge); micro-batches; update_in_backward under tp.
    # (clipped to 0.05 the gradients are ~30x smaller and AdamW's steps as large: measured 1.4e-4)
    _close(pool.run(_train_tp, "llama", (2, 2), ("dp", "tp"), clip=0.05, world=4)[0], param=4e-4)
    _close(pool.run(_train_tp, "gpt", (2, 2), ("dp", "tp"), micro=2, world=4)[0])
    _close(pool.run(_train_tp, "gpt", (2, 2), ("dp", "tp"), schedule={"update_in_backward": True}, world=4)[0])


@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_remat_under_tp(pool, kind):
    # Catches: a recomputation in backward that runs the split modules without their collectives
    # (the hooks of the call are gone by then: RematError, or wrong gradients), a collective's work
    # handle kept by the remat trace (its tensor outlives the forward).
    _close(pool.run(_train_tp, kind, (2, 2), ("dp", "tp"), step_kw={"remat": ff.Remat()}, world=4)[0])


def test_mixed_precision_under_tp(pool):
    # bf16 forward and backward, fp32 reductions, SGD (AdamW would magnify bf16's last digit: see
    # test_features.BF16); catches a collective that casts, or sums in bf16 what should be fp32.
    bf16 = ff.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    r = pool.run(_train_tp, "gpt", (2, 2), ("dp", "tp"), schedule={"mixed_precision": bf16}, sgd=True, world=4)[0]
    _close(r, loss=2e-3, norm=1e-2, param=2e-3)  # measured 2.0e-4, 1.3e-3, 2.7e-4


def test_compiled_units_under_tp(pool):
    _close(pool.run(_train_tp, "gpt", (2, 2), ("dp", "tp"), step_kw={"compile": {"backend": "aot_eager"}}, world=4)[0])


def test_three_axes_at_eight_ranks():
    # (replicate 2, dp 2, tp 2): eight ranks on this machine's two cores, one tiny model (the HF
    # Llama, GQA; the example GPT runs three axes at (2, 1, 2) on the four-rank pool).
    with RankPool(8, timeout=300) as pool8:
        for r in pool8.run(_train_tp, "llama", (2, 2, 2), ("dp_replicate", "dp", "tp"), world=8):
            _close(r)


# --- the collectives, through every transform ------------------------------------------------------


def _tp_linear_chain(group):
    """A column-split then row-split MLP (Megatron's), with a gathered and a split output, through
    grad, jvp, HVP, vmap and grad of grad, against the same math on whole tensors (float64)."""
    world, rank = group.size(), group.rank()
    g = torch.Generator().manual_seed(0)  # the same whole tensors on every rank
    d, h, n = 5, 7, 4  # h = 7 splits unevenly
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w1, w2 = torch.randn(h, d, generator=g, dtype=torch.float64), torch.randn(d, h, generator=g, dtype=torch.float64)
    v1, v2 = torch.randn(h, d, generator=g, dtype=torch.float64), torch.randn(d, h, generator=g, dtype=torch.float64)
    lo, hi = chunk_bounds(h, world, rank)

    def whole(a, b):
        y = torch.tanh(x @ a.T) @ b.T
        return (y.sin() * torch.arange(d, dtype=torch.float64)).sum()

    def split(a, b):  # a: rows [lo, hi) of w1, b: columns [lo, hi) of w2
        y = sum_out(torch.tanh(copy_in(x, group) @ a.T) @ b.T, group)
        return (y.sin() * torch.arange(d, dtype=torch.float64)).sum()

    mine = (w1[lo:hi], w2[:, lo:hi])
    out = {}
    ga, gb = torch.func.grad(split, argnums=(0, 1))(*mine)
    wa, wb = torch.func.grad(whole, argnums=(0, 1))(w1, w2)
    out["grad"] = max((ga - wa[lo:hi]).abs().max().item(), (gb - wb[:, lo:hi]).abs().max().item())
    _, tangent = torch.func.jvp(split, mine, (v1[lo:hi], v2[:, lo:hi]))
    _, want = torch.func.jvp(whole, (w1, w2), (v1, v2))
    out["jvp"] = abs(tangent - want).item()
    # Hessian-vector product, forward over reverse: (H v)'s rows of this rank's piece
    hv = torch.func.jvp(lambda a, b: torch.func.grad(split, argnums=(0, 1))(a, b), mine, (v1[lo:hi], v2[:, lo:hi]))[1]
    hw = torch.func.jvp(lambda a, b: torch.func.grad(whole, argnums=(0, 1))(a, b), (w1, w2), (v1, v2))[1]
    out["hvp"] = max((hv[0] - hw[0][lo:hi]).abs().max().item(), (hv[1] - hw[1][:, lo:hi]).abs().max().item())
    # reverse over reverse: grad of <grad, v> (every rank's dot is one part of the whole one)
    rr = torch.func.grad(lambda a: (torch.func.grad(split)(a, mine[1]) * v1[lo:hi]).sum())(mine[0])
    rw = torch.func.grad(lambda a: (torch.func.grad(whole)(a, w2) * v1).sum())(w1)
    out["grad_of_grad"] = (rr - rw[lo:hi]).abs().max().item()
    # per-example gradients under vmap (every rank vmaps over the same examples)
    per = torch.vmap(
        torch.func.grad(lambda a, xi: sum_out(torch.tanh(copy_in(xi, group) @ a.T) @ mine[1].T, group).sum()),
        in_dims=(None, 0),
    )(mine[0], x)
    want_per = torch.vmap(torch.func.grad(lambda a, xi: (torch.tanh(xi @ a.T) @ w2.T).sum()), in_dims=(None, 0))(w1, x)
    out["vmap"] = (per - want_per[:, lo:hi]).abs().max().item()
    # gathered output and its transpose
    z = torch.randn(n, h, generator=g, dtype=torch.float64)
    c = torch.randn(n, h, generator=g, dtype=torch.float64)
    gathered = gather_last(z[:, lo:hi].contiguous(), group, h)
    out["gather"] = (gathered - z).abs().max().item()
    gz = torch.func.grad(lambda p: (gather_last(p, group, h) * c).sum())(z[:, lo:hi].contiguous())
    out["gather_grad"] = (gz - c[:, lo:hi]).abs().max().item()
    gs = torch.func.grad(lambda q: (split_last(q, group, h) * c[:, lo:hi]).sum())(z)
    out["split_grad"] = (gs - c).abs().max().item()
    vg = torch.vmap(lambda p: gather_last(p, group, h))(z[:, lo:hi].contiguous())
    out["gather_vmap"] = (vg - z).abs().max().item()
    # the vocabulary-parallel cross-entropy against the whole one
    logits = torch.randn(6, h, generator=g, dtype=torch.float64)
    targets = torch.tensor([0, 6, 3, -100, 4, 1])
    ce = partial(parallel_cross_entropy, targets=targets, group=group, vocab=h)
    piece = logits[:, lo:hi].contiguous()
    out["ce"] = abs(ce(piece) - F.cross_entropy(logits, targets)).item()
    gce = torch.func.grad(ce)(piece)
    out["ce_grad"] = (gce - torch.func.grad(lambda t: F.cross_entropy(t, targets))(logits)[:, lo:hi]).abs().max().item()
    try:  # a target outside the vocabulary: F.cross_entropy's IndexError, not a loss that counts it as 0
        ce(piece, targets=torch.tensor([0, h]))
        out["ce_out_of_range_raises"] = 1.0
    except IndexError:
        out["ce_out_of_range_raises"] = 0.0
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_tensor_parallel_collectives_through_every_transform(pool, world):
    # Catches: a transpose that is not the other's (gradients off by the axis size), a jvp or vmap
    # rule missing, an uneven split gathered in the wrong order, a cross-entropy that counts the
    # ignored target or a target on another rank's piece.
    for r in pool.run(_tp_linear_chain, world=world):
        for key, value in r.items():
            assert value < 1e-10, (key, value)


def _model_transforms(group):
    """The example GPT at (dp 1, tp 2) in float64 through apply_sharded: grad, jvp, HVP and per-example
    gradients of the whole model against one process."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    model, policy, loss_fn, vocab, length = _model("gpt")
    model = model.double()
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, policy, tp=model._tp_plan, mesh=mesh)
    params = ff.shard(fn.params, plan, mesh)
    tensor = plan.tensor
    batch = _batches(vocab, length, 1)[0]
    whole = dict(model.named_parameters())

    def local(tree):  # per-parameter whole tensors -> this rank's flat units (dp 1: one shard each)
        pieces = {s.name: tensor.local(tree[s.name], s.split) for s in plan.params}
        return params.replace({u.name: local_slice(u, pieces, 1, 0) for u in plan.units})

    def pieces(sharded):
        return {k: v for u in plan.units for k, v in unit_views(u, sharded[u.name]).items()}

    # (forward mode through attention needs its math kernel: the CPU flash kernel has no jvp)
    math_kernel = torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH)
    math_kernel.__enter__()

    def ours(p, b=batch):
        return loss_fn(lambda *a: ff.apply_sharded(fn, p, fn.buffers, *a), b)

    def theirs(p, b=batch):
        return loss_fn(lambda *a: torch.func.functional_call(model, p, a), b)

    def worst(got, want):
        got = pieces(got)
        return max((got[s.name] - tensor.local(want[s.name], s.split)).abs().max().item() for s in plan.params)

    g = torch.Generator().manual_seed(3)
    v = {k: torch.randn(t.shape, generator=g, dtype=t.dtype) for k, t in whole.items()}
    w = {k: t.detach() for k, t in whole.items()}
    out = {}
    out["grad"] = worst(torch.func.grad(ours)(params), torch.func.grad(theirs)(w))
    out["jvp"] = abs(torch.func.jvp(ours, (params,), (local(v),))[1] - torch.func.jvp(theirs, (w,), (v,))[1]).item()
    hv = torch.func.jvp(torch.func.grad(ours), (params,), (local(v),))[1]
    out["hvp"] = worst(hv, torch.func.jvp(torch.func.grad(theirs), (w,), (v,))[1])
    per = torch.vmap(torch.func.grad(lambda p, x: ours(p, x.unsqueeze(0))), in_dims=(None, 0))(params, batch)
    want = torch.vmap(torch.func.grad(lambda p, x: theirs(p, x.unsqueeze(0))), in_dims=(None, 0))(w, batch)
    out["per_example"] = max(
        worst(per.replace({u: t[i] for u, t in per.shards.items()}), {k: t[i] for k, t in want.items()})
        for i in range(BATCH)
    )
    math_kernel.__exit__(None, None, None)
    return out


def test_whole_model_transforms_under_tp(pool2):
    # Catches: the hooks' collectives missing under a transform's levels (grad of the split pieces
    # off by the axis size, jvp of the gathered head missing its other half), vmap of a split model.
    for r in pool2.run(_model_transforms, world=2):
        for key, value in r.items():
            assert value < 1e-9, (key, value)


# --- the plan --------------------------------------------------------------------------------------


def test_plan_splits_by_hugging_face_styles():
    model = tiny_llama(**LLAMA)
    plan = ff.make_plan(model, tp=TensorPlan.of(model._tp_plan, size=2, rank=1))
    specs = {s.name: s for s in plan.params}
    assert specs["model.layers.0.self_attn.q_proj.weight"].shape == (16, 32)  # rows: 2 of 4 heads
    assert specs["model.layers.0.self_attn.q_proj.weight"].split == (0, 32)
    assert specs["model.layers.0.self_attn.o_proj.weight"].split == (1, 32)  # columns
    assert specs["model.layers.0.mlp.up_proj.weight"].shape == (43, 32)  # 87 = 44 + 43
    assert specs["model.embed_tokens.weight"].shape == (30, 32)  # 61 = 31 + 30
    assert specs["lm_head.weight"].split == (0, 61)
    assert specs["model.norm.weight"].split is None  # replicated
    again = ff.Plan.from_json(plan.to_json())
    assert again == plan and again.tensor == plan.tensor
    # a plan without tensor parallelism serialises as before (checkpoints compare fingerprints)
    assert "tensor" not in ff.make_plan(model).to_dict()


def test_plan_errors_name_the_module():
    model = tiny_llama(**LLAMA)
    with pytest.raises(ValueError, match="style 'colwise' is for an nn.Linear; module 'model.norm' is a LlamaRMSNorm"):
        ff.make_plan(model, tp=TensorPlan.of({"model.norm": "colwise"}, size=2))
    with pytest.raises(ValueError, match="style 'diagonal' .* is not one fsdp_fn runs"):
        TensorPlan.of({"lm_head": "diagonal"}, size=2)
    with pytest.raises(ValueError, match="needs mesh=, a DeviceMesh with one tensor-parallel axis"):
        ff.make_plan(model, tp=model._tp_plan)
    tied = GPT(GPTConfig(**(GPT_CFG | {"tie": True})))
    with pytest.raises(ValueError, match=r"tied parameter 'wte.weight' \(also 'head.weight'\) is split on different"):
        ff.make_plan(tied, tp=TensorPlan.of({"wte": "embedding_rowwise", "head": "rowwise"}, size=2))
    # the example GPT's own styles split the tied table alike (the vocabulary, both)
    assert ff.make_plan(tied, tp=TensorPlan.of(tied._tp_plan, size=2)).unit("").params[0].split == (0, 37)


def _plan_for_another_place(group):
    from torch.distributed.device_mesh import init_device_mesh

    model = tiny_llama(**LLAMA)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    plan = ff.make_plan(model, tp=TensorPlan.of(model._tp_plan, size=2, rank=1 - group.rank()))
    try:
        ff.shard(ff.functionalize(model).params, plan, mesh)
    except ValueError as e:
        return str(e)
    return "no error"


def test_shards_of_a_plan_for_another_place_on_the_axis(pool2):
    for rank, msg in enumerate(pool2.run(_plan_for_another_place, world=2)):
        assert f"a tensor-parallel axis of 2 ranks, this rank at {1 - rank}; the mesh has axis 'tp': 2 ranks" in msg


class _FixedHeads(torch.nn.Module):
    """An attention input projection reshaped by the whole model's head count."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(8, 8)
        self.o = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.o(self.q(x).view(x.shape[0], 4, 2).reshape(x.shape[0], -1))


def _fixed_heads(group):
    from torch.distributed.device_mesh import init_device_mesh

    model = _FixedHeads()
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, tp={"q": "colwise", "o": "rowwise"}, mesh=mesh)
    params = ff.shard(fn.params, plan, mesh)
    try:
        ff.apply_sharded(fn, params, fn.buffers, torch.ones(3, 8))
    except RuntimeError as e:
        return "\n".join([str(e), *getattr(e, "__notes__", [])])
    return "no error"


def test_a_fixed_head_count_is_named_with_its_fix(pool2):
    msg = pool2.run(_fixed_heads, world=2)[0]
    assert "is invalid for input of size" in msg
    assert "reshape by -1 heads" in msg and "the root unit" in msg


def _logged_step(group, kind):
    from collections import Counter

    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    model, policy, loss_fn, vocab, length = _model(kind)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, policy, tp=model._tp_plan, mesh=mesh)
    params = ff.shard(fn.params, plan, mesh)
    optimizer = ff.chain(ff.clip_by_global_norm(1.0), ff.adamw(1e-2))
    step = ff.train_step(fn, loss_fn, optimizer)
    state = step.init(params)
    index, parts = _data_index(mesh)
    for b in _batches(vocab, length, 2):
        with ff.comm_log() as log:
            state, _ = step(state, b.chunk(parts)[index])
    local = b.chunk(parts)[index]
    predicted = ff.predict_collectives(
        plan, 2, first_step=False, optimizer=optimizer, comm=ff.comm_of(params.group), tokens=local[:, :-1].numel()
    )

    def key(records):  # (a buffer's broadcast, Llama's rotary table's, is the module's, not the plan's)
        return Counter((c.op, c.unit, c.numel, c.dtype, c.world) for c in records if c.op != "broadcast")

    return key(log.records) == key(predicted), key(log.records) - key(predicted), key(predicted) - key(log.records)


@pytest.mark.parametrize("kind", ["qwen3", "phi3"])
def test_other_hugging_face_plans_train_like_one_process(pool, kind):
    # Catches: a per-head norm's gradient left as one rank's part (Qwen3's q_norm/k_norm), a whole
    # input fed to a row-split layer unsplit (Phi3's o_proj and down_proj).
    r = pool.run(_train_tp, kind, (2, 2), ("dp", "tp"), world=4)[0]
    _close(r)


@pytest.mark.parametrize("kind", ["llama", "gpt", "qwen3", "phi3"])
def test_collectives_predicted_under_tp(pool, kind):
    # Catches: a split module's collective missing or doubled (a hook installed twice, a bias summed),
    # the wrong size (an uneven piece), the norm's sum over the tensor axis not counted.
    for same, extra, missing in pool.run(_logged_step, kind, world=4):
        assert same, (extra, missing)


# --- random streams --------------------------------------------------------------------------------


class _DropBlock(torch.nn.Module):
    """Dropout where the values are whole on every rank (``drop_in``) and where they are pieces
    (``drop_mid``, between the column- and the row-split layer)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
        self.drop_in, self.drop_mid = torch.nn.Dropout(0.3), torch.nn.Dropout(0.3)

    def forward(self, x):
        return x + self.down(self.drop_mid(torch.relu(self.up(self.drop_in(x)))))


DROP_TP = {"*.up": "colwise", "*.down": "rowwise"}


def _dropout_streams(group):
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = torch.nn.Sequential(_DropBlock(), _DropBlock())
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([_DropBlock]), tp=DROP_TP, mesh=mesh)
    params = ff.shard(fn.params, plan, mesh)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    masks = []
    handle = model[0].drop_mid.register_forward_hook(lambda m, a, out: masks.append(out == 0))
    torch.manual_seed(5)
    out = ff.apply_sharded(fn, params, fn.buffers, x)
    handle.remove()

    def loss_fn(m, batch):
        return m(batch).square().mean()

    def train(remat, steps=2):
        torch.manual_seed(7)
        step = ff.train_step(fn, loss_fn, ff.sgd(0.1), remat=remat)
        state = step.init(copy.deepcopy(params))
        for _ in range(steps):
            state, _ = step(state, x)
        return step, state

    plain = ff.unshard(train(None)[1].params)
    remat = ff.unshard(train(ff.Remat())[1].params)
    # resume: the state and the generator after one step, and the second step again from them
    step, state = train(None, steps=1)
    saved, rng = copy.deepcopy(state), torch.get_rng_state()
    once = ff.unshard(step(state, x)[0].params)
    torch.set_rng_state(rng)
    again = ff.unshard(step(saved, x)[0].params)
    return {
        "out": out.detach(),
        "mask": masks[0],
        "remat_exact": all(torch.equal(plain[k], remat[k]) for k in plain),
        "resume_exact": all(torch.equal(once[k], again[k]) for k in once),
    }


def test_dropout_streams_under_tp(pool2):
    # Catches: a replicated region whose dropout draws differently per tp rank (the ranks' whole
    # activations diverge), a split region whose ranks draw the same mask (correlated pieces), a
    # recomputation that draws other masks than the forward (wrong gradients under remat), a resume
    # that does not replay the same streams.
    a, b = pool2.run(_dropout_streams, world=2)
    assert torch.equal(a["out"], b["out"])  # what every rank holds alike is alike
    assert a["mask"].shape == b["mask"].shape and not torch.equal(a["mask"], b["mask"])
    assert a["mask"].any() and not a["mask"].all()  # dropout ran
    assert a["remat_exact"] and b["remat_exact"]
    assert a["resume_exact"] and b["resume_exact"]


def _functional_loop(group):
    """value_and_grad -> update -> apply_updates (the loop a JAX user writes) under (dp 2, tp 2),
    AdamW clipped by the global norm, against one process."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    model, policy, loss_fn, vocab, length = _model("llama")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, policy, tp=model._tp_plan, mesh=mesh)
    params = ff.shard(fn.params, plan, mesh)
    optimizer = ff.chain(ff.clip_by_global_norm(0.5), ff.adamw(1e-2))
    opt_state, grad_fn = optimizer.init(params), ff.value_and_grad(fn, loss_fn)
    index, parts = _data_index(mesh)
    batches = _batches(vocab, length)
    norms = []
    for b in batches:
        _, grads = grad_fn(params, fn.buffers, b.chunk(parts)[index])
        norms.append(ff.global_norm(grads).item())
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = ff.apply_updates(params, updates)
    full = ff.unshard(params)
    ref = reference_run(model, loss_fn, batches, partial(torch.optim.AdamW, lr=1e-2), clip=0.5)
    return {
        "norm": max(abs(a - b) / b for a, b in zip(norms, ref["norms"], strict=True)),
        "param": max((full[k] - v).abs().max().item() for k, v in ref["params"].items()),
    }


def test_the_functional_loop_under_tp(pool):
    # Catches: global_norm (clip_by_global_norm inside update) missing the sum over the tensor axis,
    # or counting a parameter the axis does not split once per rank.
    for r in pool.run(_functional_loop, world=4):
        assert r["norm"] < 2e-5 and r["param"] < 4e-4, r


def _sequence_pair(group):
    """gather_sequence / scatter_sequence (each the other's transpose) and split_sequence against
    the same sums done by hand over every rank's values (float64; 7 rows split unevenly)."""
    world, rank = group.size(), group.rank()
    g = torch.Generator().manual_seed(0)
    n = 7
    xs = [torch.randn(2, n, 3, generator=g, dtype=torch.float64) for _ in range(world)]  # each rank's partial
    cs = [torch.randn(2, n, 3, generator=g, dtype=torch.float64) for _ in range(world)]  # each rank's cotangent
    pieces = [chunk_bounds(n, world, r) for r in range(world)]
    lo, hi = pieces[rank]
    whole = sum(xs)
    out = {}
    # scatter: this rank's rows of the sum; its transpose gathers this rank's cotangent rows whole
    got = ff.tp.scatter_sequence(xs[rank], group)
    out["scatter"] = (got - whole[:, lo:hi]).abs().max().item()
    grad = torch.func.grad(lambda x: (ff.tp.scatter_sequence(x, group) * cs[rank][:, lo:hi]).sum())(xs[rank])
    want = torch.cat([cs[r][:, a:b] for r, (a, b) in enumerate(pieces)], dim=1)
    out["scatter_grad"] = (grad - want).abs().max().item()
    # gather: the pieces whole; its transpose sums every rank's cotangent and keeps this rank's rows
    got = ff.tp.gather_sequence(whole[:, lo:hi].contiguous(), group, n)
    out["gather"] = (got - whole).abs().max().item()
    grad = torch.func.grad(lambda p: (ff.tp.gather_sequence(p, group, n) * cs[rank]).sum())(
        whole[:, lo:hi].contiguous()
    )
    out["gather_grad"] = (grad - sum(cs)[:, lo:hi]).abs().max().item()
    # forward mode and vmap: the same collective of the tangent, of each batch element
    _, tangent = torch.func.jvp(lambda x: ff.tp.scatter_sequence(x, group), (xs[rank],), (cs[rank],))
    out["scatter_jvp"] = (tangent - sum(cs)[:, lo:hi]).abs().max().item()
    batched = torch.vmap(lambda p: ff.tp.gather_sequence(p, group, n))(whole[:, lo:hi].contiguous())
    out["gather_vmap"] = (batched - whole).abs().max().item()
    # split: this rank's rows of a whole value; its gradient gathered whole
    grad = torch.func.grad(lambda w: (ff.tp.split_sequence(w, group) * whole[:, lo:hi]).sum())(cs[0])
    out["split_grad"] = (grad - whole).abs().max().item()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_sequence_pair_through_transforms(pool, world):
    for r in pool.run(_sequence_pair, world=world):
        for key, value in r.items():
            assert value < 1e-12, (key, value)


def _chunked_loss_on_a_split_head(group):
    from torch.distributed.device_mesh import init_device_mesh

    model, policy, _, vocab, length = _model("gpt")
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    fn = ff.functionalize(model)
    params = ff.shard(fn.params, ff.make_plan(model, policy, tp=model._tp_plan, mesh=mesh), mesh)
    batch = _batches(vocab, length, 1)[0]
    try:
        ff.apply_sharded(fn, params, fn.buffers, batch[:, :-1], batch[:, 1:])  # GPT's chunked loss
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_chunked_loss_on_a_split_head_is_refused(pool2):
    # Catches: chunked_cross_entropy reading a head's piece of the vocabulary as the whole (a loss,
    # silently, over another vocabulary).
    for msg in pool2.run(_chunked_loss_on_a_split_head, world=2):
        assert "the head's weight holds 19 of its 37 rows" in msg or "holds 18 of its 37 rows" in msg, msg
        assert "fsdp_fn.tp.parallel_cross_entropy" in msg
