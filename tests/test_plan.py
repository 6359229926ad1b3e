"""The plan is a value: units from a policy with the seed's signature, every parameter once."""

from __future__ import annotations

import functools
import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

import fsdp_fn as ff
from examples.gpt import GPT, Block, GPTConfig
from tests.helpers import MLP, IntegerParams, Permute, Permuted


def gpt(**kw):
    return GPT(GPTConfig(**{"vocab": 37, "seq": 9, "d_model": 12, "n_layers": 3, "n_heads": 2, **kw}))


def test_layer_policy_one_unit_per_block_root_holds_the_rest():
    plan = ff.make_plan(gpt(), ff.layer_policy([Block]))
    assert plan.unit_names == ("", "blocks.0", "blocks.1", "blocks.2")
    root = plan.unit("")
    assert {p.name for p in root.params} == {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias", "head.weight"}
    assert plan.unit("blocks.1").params[0].name == "blocks.1.ln1.weight"


def test_no_policy_is_one_root_unit():
    m = MLP()
    plan = ff.make_plan(m)
    assert plan.unit_names == ("",)
    assert plan.numel == sum(p.numel() for p in m.parameters())


def test_size_policy_like_torch_default():
    m = gpt()
    ours = ff.make_plan(m, ff.size_policy(min_num_params=1000))
    theirs = ff.make_plan(m, functools.partial(size_based_auto_wrap_policy, min_num_params=1000))
    # torch's own policy plugs in unchanged (same signature); ModuleList is never a unit.
    assert ours == theirs
    assert "blocks" not in ours.unit_names
    assert "blocks.0" in ours.unit_names
    assert ff.make_plan(m, ff.size_policy()).unit_names == ("",)  # default min_num_params = 1e8


def test_any_callable_with_seed_signature():
    calls = []

    def policy(module, recurse, unwrapped_params, **kwargs):
        calls.append((type(module).__name__, recurse, unwrapped_params))
        return recurse or isinstance(module, nn.Linear)

    m = MLP((4, 6, 2))
    plan = ff.make_plan(m, policy)
    assert plan.unit_names == ("net.0", "net.2")
    assert ("Linear", False, 4 * 6 + 6) in calls
    assert ("MLP", True, sum(p.numel() for p in m.parameters())) in calls


def test_plan_is_a_value():
    m = gpt()
    plan = ff.make_plan(m, ff.layer_policy([Block]))
    assert plan == ff.make_plan(m, ff.layer_policy([Block]))
    assert ff.Plan.from_json(plan.to_json()) == plan
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert hash(plan) == hash(ff.Plan.from_json(plan.to_json()))
    assert plan.fingerprint() == ff.Plan.from_json(plan.to_json()).fingerprint()
    assert plan.fingerprint() != ff.make_plan(m).fingerprint()
    text = str(plan)
    assert "blocks.2" in text and "(root)" in text


def test_gather_bytes_counts_padding():
    m = MLP((7, 13, 5))
    unit = ff.make_plan(m, ff.layer_policy([nn.Linear])).unit("net.0")
    assert unit.numel == 7 * 13 + 13
    assert unit.gather_bytes() == 104 * 4
    assert unit.gather_bytes(world=3) == 105 * 4  # padded to a multiple of 3
    assert unit.shard_numel(3) == 35
    assert unit.gather_bytes(world=4, dtype=torch.bfloat16) == 104 * 2


def test_unit_of_and_local_ranges_against_the_flat_buffer():
    # Catches: a parameter attributed to the wrong unit (error messages name it), and a rank's
    # per-parameter ranges off by the shard's start (the optimizer steps parameters by them).
    model = gpt(tie=True)
    plan = ff.make_plan(model, ff.layer_policy([Block]))
    for name, _ in model.named_parameters(remove_duplicate=False):
        assert any(name == p.name or name in p.aliases for p in plan.unit_of(name).all_params), name
    for unit in plan.units:
        flat = torch.arange(unit.numel)  # element k of the unit's flat buffer holds k
        for world in (1, 2, 3, 4):
            padded = torch.cat([flat, flat.new_full((unit.padded_numel(world) - unit.numel,), -1)])
            for rank in range(world):
                shard = padded.chunk(world)[rank]
                covered = []
                for i, lo, hi in unit.local_ranges(world, rank):
                    at = unit.offsets[i]
                    covered += shard[lo:hi].tolist()
                    assert all(at <= k < at + unit.params[i].numel for k in shard[lo:hi].tolist())
                assert sorted(covered) == [k for k in shard.tolist() if k >= 0]


def test_tied_weights_in_different_units_go_to_their_common_unit():
    m = gpt(tie=True)
    plan = ff.make_plan(m, ff.layer_policy([Block, nn.Linear]))
    owner = plan.unit_of("head.weight")
    assert owner.name == ""
    spec = next(p for p in owner.params if p.name == "wte.weight")
    assert spec.aliases == ("head.weight",)
    assert "head" not in plan.unit_names  # nothing left for it once its weight moved up


def test_split_root_gives_a_weight_tied_across_modules_a_unit_both_gather():
    # Catches: the tied weight's own unit made without the modules that use it (never gathered).
    m = gpt(tie=True)
    plan = ff.make_plan(m, ff.layer_policy([Block]), split_root=True)
    tied = plan.unit_of("head.weight")
    assert tied.name == "wte.weight", plan.unit_names
    assert tied.modules == ("wte", "head")
    assert [p.name for p in tied.params] == ["wte.weight"] and tied.params[0].aliases == ("head.weight",)
    assert plan.unit_names.index("wte.weight") < plan.unit_names.index("blocks.0")  # gathered at its first use


@st.composite
def module_trees(draw, depth=0):
    n = draw(st.integers(1, 3))
    children = []
    for _ in range(n):
        if depth < 2 and draw(st.booleans()):
            children.append(draw(module_trees(depth=depth + 1)))
        else:
            children.append(nn.Linear(draw(st.integers(1, 5)), draw(st.integers(1, 5)), bias=draw(st.booleans())))
    return nn.Sequential(*children)


@given(tree=module_trees(), min_params=st.integers(0, 60), share=st.booleans())
def test_every_parameter_in_exactly_one_unit(tree, min_params, share):
    linears = [m for m in tree.modules() if isinstance(m, nn.Linear)]
    if share and len(linears) > 1 and linears[0].weight.shape == linears[-1].weight.shape:
        linears[-1].weight = linears[0].weight
    plan = ff.make_plan(tree, ff.size_policy(min_params))
    names = [n for p in plan.params for n in (p.name, *p.aliases)]
    assert sorted(names) == sorted(n for n, _ in tree.named_parameters(remove_duplicate=False))
    assert len(names) == len(set(names))
    assert plan.numel == sum(p.numel() for p in tree.parameters())


def test_policy_not_callable():
    with pytest.raises(TypeError, match="policy must be callable"):
        ff.make_plan(MLP(), 3)


def test_policy_not_returning_bool():
    with pytest.raises(TypeError, match=r"returned int 1 for module \(root\) \(recurse=True\)"):
        ff.make_plan(MLP(), lambda m, r, n: 1)


def test_integer_and_bool_parameters_ride_in_frozen_parts_of_their_own_dtype():
    # FSDP2 takes a frozen integer parameter; before, make_plan refused it ("only floating-point
    # parameters can be sharded"). Catches: a part that mixes dtypes, an integer dtype that does
    # not survive JSON, bytes counted in the gather dtype, a trainable shard of an integer dtype.
    model = IntegerParams()
    plan = ff.make_plan(model, ff.layer_policy([Permuted]))
    root, block = plan.unit(""), plan.unit("blocks.0")
    assert [p.name for p in root.params] == ["head.weight", "head.bias"] and root.dtype == torch.float32
    assert [[p.name for p in part.params] for part in root.frozen_parts] == [["pick"], ["keep"]]
    assert [part.dtype for part in root.frozen_parts] == [torch.int32, torch.bool]
    assert [part.dtype for part in block.frozen_parts] == [torch.int64, torch.float32]
    assert [part.params[0].name for part in block.frozen_parts] == ["blocks.0.perm", "blocks.0.scale"]
    back = ff.Plan.from_json(plan.to_json())
    assert back == plan and back.fingerprint() == plan.fingerprint()
    assert [p.dtype for p in back.unit("").frozen] == [torch.int32, torch.bool]
    assert "(2 frozen, int64)" in str(plan) and "(2 frozen, int32, bool)" in str(plan)
    # at W=2 with a bf16 gather: the trainable and float parts in bf16, the int64 one in its own 8 bytes
    assert block.gather_bytes(2, torch.bfloat16) == 30 * 2 + 6 * 8 + 6 * 2
    assert root.gather_bytes(2, torch.bfloat16) == 18 * 2 + 4 * 4 + 4 * 1
    # A unit of an integer parameter alone: an empty float32 trainable shard, its value in its frozen part.
    alone = ff.make_plan(model, ff.layer_policy([Permuted]), split_root=True)
    assert [p.name for p in alone.unit("").frozen] == ["pick", "keep"]  # the root's own
    unit = ff.make_plan(nn.Sequential(nn.Linear(5, 5), Permute()), split_root=True).unit("1")
    assert unit.params == () and unit.dtype == torch.float32 and unit.frozen_parts[0].dtype == torch.int64


@pytest.mark.parametrize("requires_grad", [True, False])
def test_complex_parameter_named(requires_grad):
    m = MLP()
    m.register_parameter("phase", nn.Parameter(torch.ones(3, dtype=torch.complex64), requires_grad=requires_grad))
    grad = " and requires grad" if requires_grad else ""
    with pytest.raises(TypeError, match=f"parameter 'phase' has dtype torch.complex64{grad}; only floating-point"):
        ff.make_plan(m)


def test_container_unit_refused():
    with pytest.raises(ValueError, match="'blocks' \\(ModuleList\\).*forward never runs"):
        ff.make_plan(gpt(), lambda m, r, n: r or isinstance(m, nn.ModuleList))


def test_module_without_parameters():
    # A plan of no unit, as FSDP2 accepts such a module: it round-trips, costs nothing, issues
    # only the step's metrics gather (before: "ReLU has no parameters: there is nothing to shard").
    plan = ff.make_plan(nn.ReLU())
    assert plan.units == () and ff.Plan.from_json(plan.to_json()) == plan
    assert ff.estimate_memory(plan, world=2).total == 0
    assert [c.unit for c in ff.predict_collectives(plan, 2)] == [None]


def test_mixed_dtypes_in_a_unit_named():
    m = MLP((3, 4, 2))
    m.net[2].half()
    with pytest.raises(TypeError, match="unit \\(root\\) mixes dtypes"):
        ff.make_plan(m)
    assert ff.make_plan(m, ff.layer_policy([nn.Linear])).unit("net.2").dtype == torch.float16


def test_merged_units_are_one_unit_of_their_parameters_in_order_and_a_value():
    plan = ff.make_plan(gpt(n_layers=4), ff.layer_policy([Block]))
    merged = plan.merged(["blocks.1", "blocks.2"])
    assert merged.unit_names == ("", "blocks.0", "blocks.1..blocks.2", "blocks.3")
    unit = merged.unit("blocks.1..blocks.2")
    assert unit.members == unit.modules == ("blocks.1", "blocks.2")
    assert unit.params == plan.unit("blocks.1").params + plan.unit("blocks.2").params
    assert ff.Plan.from_json(merged.to_json()) == merged  # members serialised
    assert merged.fingerprint() != plan.fingerprint()
    assert plan.unit_fingerprints()["blocks.0"] == merged.unit_fingerprints()["blocks.0"]  # the others unchanged
    assert "2 modules, one gather" in str(merged)
    # merging a merged unit with its neighbour flattens the modules; grouped runs of k
    assert merged.merged(["blocks.1..blocks.2", "blocks.3"]).unit("blocks.1..blocks.3").members == (
        "blocks.1",
        "blocks.2",
        "blocks.3",
    )
    assert plan.grouped(3).unit_names == ("", "blocks.0..blocks.2", "blocks.3")
    assert plan.grouped(1) == plan
    assert plan.grouped(8).unit_names == ("", "blocks.0..blocks.3")


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["blocks.0"], "merging needs two or more units"),
        (["blocks.0", "blocks.9"], "unit 'blocks.9' is not in the plan"),
        (["", "blocks.0"], r"unit \(root\) cannot be merged: only a module's own units"),
        (["blocks.0", "blocks.2"], "are not consecutive in the plan"),
    ],
)
def test_merging_what_cannot_be_one_unit_is_refused_naming_it(names, message):
    plan = ff.make_plan(gpt(), ff.layer_policy([Block]))
    with pytest.raises(ValueError, match=message):
        plan.merged(names)


def test_merging_nested_or_mixed_dtype_units_is_refused():
    model = gpt()
    nested = ff.make_plan(model, ff.layer_policy([Block, nn.Linear]))
    assert nested.unit_names[1:3] == ("blocks.0", "blocks.0.qkv")
    with pytest.raises(ValueError, match="module 'blocks.0.qkv' lies inside 'blocks.0'"):
        nested.merged(["blocks.0", "blocks.0.qkv"])
    model.blocks[1].double()
    mixed = ff.make_plan(model, ff.layer_policy([Block]))
    with pytest.raises(ValueError, match=r"trainable parameters are of several dtypes \(\['float32', 'float64'\]\)"):
        mixed.merged(["blocks.0", "blocks.1"])
    assert mixed.grouped(3).unit_names == ("", "blocks.0", "blocks.1", "blocks.2")  # runs stop at a dtype change
    with pytest.raises(ValueError, match="size must be a positive int"):
        mixed.grouped(0)


def test_unfreezing_into_a_unit_of_another_dtype_is_refused_naming_it():
    model = gpt()
    model.blocks[0].ln1.double().requires_grad_(False)
    plan = ff.make_plan(model, ff.layer_policy([Block]))
    with pytest.raises(ValueError, match="parameter 'blocks.0.ln1.weight' of unit 'blocks.0' is trainable now but is"):
        plan.with_trainable(["blocks.0.ln1.weight"])
    with pytest.raises(ValueError, match="not frozen parameters of the plan"):
        plan.with_trainable(["blocks.1.ln1.weight"])
    moved = plan.with_trainable([])
    assert moved == plan
