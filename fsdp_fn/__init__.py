"""fsdp_fn: fully sharded data parallel (ZeRO-3) for PyTorch, as pure functions.

fn     = functionalize(module)                 # plain nn.Module -> pure function + pytrees
plan   = make_plan(module, layer_policy(...))  # which parameters form which unit
params = shard(fn.params, plan, group)         # this rank's 1/W of every unit
full   = gather_for(unit)(params)              # all-gather; its backward is reduce-scatter
grads  = reduce_grads(full_grads, params)      # reduce-scatter: the transpose of gather_for
step   = train_step(fn, loss_fn, adamw())      # torch.func composes them into one step
loss, grads = value_and_grad(fn, loss_fn)(params, buffers, batch)   # gradients as sharded values
"""

from fsdp_fn._activations import ActivationEstimate, ActivationStage, UnitActivations, estimate_activations
from fsdp_fn._collectives import Collective, CommLog, all_gather, comm_log, reduce_scatter_sum
from fsdp_fn._errors import DivergenceError, RankFailure
from fsdp_fn._functional import Functional, functionalize
from fsdp_fn._gather import gather_for
from fsdp_fn._grad import value_and_grad
from fsdp_fn._init import init_shards
from fsdp_fn._losses import chunked_cross_entropy
from fsdp_fn._memory import CATEGORIES, MemoryEstimate, MemoryMeter, estimate_memory
from fsdp_fn._optim import AdamWState, Optimizer, SGDState, adamw, from_torch, sgd, tree_leaves, tree_map
from fsdp_fn._plan import ROOT, ParamSpec, Plan, Policy, Unit, layer_policy, make_plan, size_policy
from fsdp_fn._policy import BackwardPrefetch, CPUOffload, MixedPrecision, Schedule
from fsdp_fn._predict import predict_collectives
from fsdp_fn._remat import Remat, RematError, SavePolicy, remat, route_torch_checkpoint, save_dots, save_nothing
from fsdp_fn._runtime import apply_sharded
from fsdp_fn._shard import NAMESPACE, Sharded, reduce_grads, shard, unshard
from fsdp_fn._step import TrainState, TrainStep, clip_grad_norm_, sync_buffers, train_step
from fsdp_fn._transforms import (
    AccumulateState,
    ApplyIfFiniteState,
    GradientTransformation,
    accumulate,
    apply_if_finite,
    chain,
    clip_by_global_norm,
    global_norm,
)
from fsdp_fn._unit import UnitState

__all__ = [
    "NAMESPACE",
    "ROOT",
    "CATEGORIES",
    "AccumulateState",
    "ActivationEstimate",
    "AdamWState",
    "ApplyIfFiniteState",
    "GradientTransformation",
    "accumulate",
    "apply_if_finite",
    "chain",
    "clip_by_global_norm",
    "global_norm",
    "BackwardPrefetch",
    "CPUOffload",
    "Collective",
    "CommLog",
    "DivergenceError",
    "Functional",
    "MemoryEstimate",
    "MemoryMeter",
    "MixedPrecision",
    "Optimizer",
    "ParamSpec",
    "RankFailure",
    "Plan",
    "Policy",
    "SGDState",
    "ActivationStage",
    "Schedule",
    "Sharded",
    "TrainState",
    "TrainStep",
    "Unit",
    "UnitActivations",
    "UnitState",
    "adamw",
    "all_gather",
    "apply_sharded",
    "chunked_cross_entropy",
    "clip_grad_norm_",
    "comm_log",
    "estimate_activations",
    "estimate_memory",
    "from_torch",
    "functionalize",
    "gather_for",
    "init_shards",
    "layer_policy",
    "make_plan",
    "predict_collectives",
    "reduce_grads",
    "reduce_scatter_sum",
    "sgd",
    "shard",
    "size_policy",
    "sync_buffers",
    "train_step",
    "tree_leaves",
    "tree_map",
    "unshard",
    "value_and_grad",
    "Remat",
    "RematError",
    "SavePolicy",
    "remat",
    "route_torch_checkpoint",
    "save_dots",
    "save_nothing",
]
from fsdp_fn import checkpoint as checkpoint  # the public submodule: ff.checkpoint.save / load
