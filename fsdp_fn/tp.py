"""Tensor parallelism's pieces, for a model written for it by hand (torchtitan's local-tensor path).

``make_plan(model, policy, tp=styles, mesh=mesh)`` splits the modules a plan names and runs
their collectives itself; these are the same pieces, for a module of one's own:

* ``copy_in`` / ``sum_out``: a value every rank of the axis holds entering a split computation
  (its gradient summed over the axis) and a split computation's partial results summed (the
  gradient passed through): each the other's transpose.
* ``gather_last`` / ``split_last``: the last dimension's pieces gathered whole, and the reverse.
* ``gather_sequence`` / ``scatter_sequence`` / ``split_sequence``: sequence parallelism's (dim -2):
  the pieces gathered for a split module (the gradient reduce-scattered), a row-split module's
  partial outputs reduce-scattered (the gradient gathered), and a whole value's piece taken.
* ``parallel_cross_entropy``: the cross-entropy of logits whose vocabulary is split over the
  axis (a ``"vocab_parallel"`` head's), without gathering them.

All are differentiable through every ``torch.func`` transform (grad, vjp, jvp, vmap, HVP).
"""

from fsdp_fn._tp import (
    copy_in,
    gather_last,
    gather_sequence,
    parallel_cross_entropy,
    scatter_sequence,
    split_last,
    split_sequence,
    sum_out,
)
from fsdp_fn._tp_plan import (
    COLWISE,
    COLWISE_GATHER_OUTPUT,
    EMBEDDING_ROWWISE,
    REPLICATE,
    REPLICATED_WITH_GRAD_ALLREDUCE,
    ROWWISE,
    ROWWISE_SPLIT_INPUT,
    SEQUENCE_PARALLEL,
    SEQUENCE_SPLIT_INPUT,
    STYLES,
    VOCAB_PARALLEL,
    TensorPlan,
    chunk_bounds,
)

__all__ = [
    "COLWISE",
    "COLWISE_GATHER_OUTPUT",
    "EMBEDDING_ROWWISE",
    "REPLICATE",
    "REPLICATED_WITH_GRAD_ALLREDUCE",
    "ROWWISE",
    "ROWWISE_SPLIT_INPUT",
    "SEQUENCE_PARALLEL",
    "SEQUENCE_SPLIT_INPUT",
    "STYLES",
    "VOCAB_PARALLEL",
    "TensorPlan",
    "chunk_bounds",
    "copy_in",
    "gather_last",
    "gather_sequence",
    "parallel_cross_entropy",
    "scatter_sequence",
    "split_last",
    "split_sequence",
    "sum_out",
]
