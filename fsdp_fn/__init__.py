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
from fsdp_fn._base import (
    EmptyState,
    GradientTransformation,
    Outcome,
    apply_updates,
    chain,
    identity,
    update_in_place,
)
from fsdp_fn._collectives import Collective, CommLog, all_gather, comm_log, comm_of, reduce_scatter_sum, set_comm
from fsdp_fn._comm import Comm, PairwiseComm
from fsdp_fn._composable import apply_sharded
from fsdp_fn._errors import DivergenceError, RankFailure
from fsdp_fn._functional import Functional, functionalize
from fsdp_fn._gather import gather_for
from fsdp_fn._grad import value_and_grad
from fsdp_fn._init import init_shards
from fsdp_fn._losses import chunked_cross_entropy
from fsdp_fn._memory import CATEGORIES, MemoryEstimate, MemoryMeter, estimate_memory
from fsdp_fn._optim import adam, adamw, from_torch, lion, sgd, tree_leaves, tree_map
from fsdp_fn._plan import ROOT, ParamSpec, Plan, Policy, Unit, layer_policy, make_plan, size_policy
from fsdp_fn._planner import Candidate, PlanChoice, StepCosts, measure_costs, plan_for_budget
from fsdp_fn._policy import BackwardPrefetch, CPUOffload, MixedPrecision, Schedule
from fsdp_fn._predict import predict_collectives
from fsdp_fn._remat import Remat, RematError, SavePolicy, remat, route_torch_checkpoint, save_dots, save_nothing
from fsdp_fn._shard import NAMESPACE, Sharded, reduce_grads, shard, unshard
from fsdp_fn._shm import SharedMemoryComm
from fsdp_fn._step import TrainState, TrainStep, clip_grad_norm_, sync_buffers, train_step
from fsdp_fn._tp_plan import TensorPlan
from fsdp_fn._transforms import (
    ScaleByAdamState,
    ScaleByLionState,
    ScaleByScheduleState,
    TraceState,
    add_decayed_weights,
    clip,
    clip_by_global_norm,
    global_norm,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_lion,
    scale_by_schedule,
    set_to_zero,
    trace,
    zero_nans,
)
from fsdp_fn._unfrozen import train_unfrozen
from fsdp_fn._unit import UnitState
from fsdp_fn._wrappers import (
    AccumulateState,
    ApplyIfFiniteState,
    InjectHyperparamsState,
    MaskedState,
    MultiTransformState,
    accumulate,
    apply_if_finite,
    inject_hyperparams,
    masked,
    multi_transform,
)

__all__ = [
    "NAMESPACE",
    "ROOT",
    "CATEGORIES",
    "ActivationEstimate",
    # gradient transformations (optax's protocol and building blocks)
    "GradientTransformation",
    "EmptyState",
    "Outcome",
    "apply_updates",
    "update_in_place",
    "chain",
    "identity",
    "scale",
    "clip",
    "clip_by_global_norm",
    "global_norm",
    "set_to_zero",
    "zero_nans",
    "add_decayed_weights",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "scale_by_adam",
    "scale_by_lion",
    "trace",
    "ScaleByAdamState",
    "ScaleByLionState",
    "ScaleByScheduleState",
    "TraceState",
    "apply_if_finite",
    "ApplyIfFiniteState",
    "accumulate",
    "AccumulateState",
    "masked",
    "MaskedState",
    "multi_transform",
    "MultiTransformState",
    "inject_hyperparams",
    "InjectHyperparamsState",
    "adam",
    "adamw",
    "lion",
    "sgd",
    "from_torch",
    "BackwardPrefetch",
    "CPUOffload",
    "Collective",
    "Comm",
    "PairwiseComm",
    "SharedMemoryComm",
    "CommLog",
    "DivergenceError",
    "Functional",
    "MemoryEstimate",
    "MemoryMeter",
    "MixedPrecision",
    "ParamSpec",
    "RankFailure",
    "Plan",
    "PlanChoice",
    "StepCosts",
    "Candidate",
    "Policy",
    "ActivationStage",
    "Schedule",
    "Sharded",
    "TensorPlan",
    "TrainState",
    "TrainStep",
    "Unit",
    "UnitActivations",
    "UnitState",
    "all_gather",
    "apply_sharded",
    "chunked_cross_entropy",
    "clip_grad_norm_",
    "comm_log",
    "comm_of",
    "estimate_activations",
    "estimate_memory",
    "functionalize",
    "gather_for",
    "init_shards",
    "layer_policy",
    "make_plan",
    "measure_costs",
    "plan_for_budget",
    "predict_collectives",
    "reduce_grads",
    "reduce_scatter_sum",
    "set_comm",
    "shard",
    "size_policy",
    "sync_buffers",
    "train_step",
    "train_unfrozen",
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
from fsdp_fn import tp as tp  # the public submodule: tensor parallelism's collectives, for hand-written models
