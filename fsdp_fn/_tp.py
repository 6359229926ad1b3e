"""Tensor parallelism on plain local tensors: the axis's differentiable collectives, and the hooks
that run them around the plan's split modules for the duration of one call.

Each rank of the tensor-parallel axis runs the same forward on the same batch with its piece of
every split parameter (``_tp_plan.py``), so everything outside the split modules is the same on
every rank of the axis, the loss included. Two pairs carry values across the split, each the
other's transpose (Megatron's ``f`` and ``g``; torchtitan's local-tensor path):

* ``copy_in`` (identity forward, sum backward): a replicated value entering a column-split
  module; each rank's gradient of it is one part of the whole.
* ``sum_out`` (sum forward, identity backward): a row-split module's partial outputs summed,
  the same on every rank after.
* ``gather_last`` / ``split_last``: a column-split output gathered whole (its backward keeps
  this rank's piece of the gradient), and the reverse.

Every rule calls the other's differentiable ``apply``, so grad of grad, jvp, vmap and HVP see the
collectives they need; the tangent of each is the same collective of the tangent. The
collectives go through the axis group's ``Comm`` and the collective log like FSDP's own.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import FunctionCtx

from fsdp_fn._collectives import _same_batch_size, all_gather_into, all_reduce_, reduce_scatter
from fsdp_fn._tp_plan import (
    COLWISE,
    COLWISE_GATHER_OUTPUT,
    EMBEDDING_ROWWISE,
    REPLICATED_WITH_GRAD_ALLREDUCE,
    ROWWISE,
    ROWWISE_SPLIT_INPUT,
    SEQUENCE_PARALLEL,
    SEQUENCE_SPLIT_INPUT,
    VOCAB_PARALLEL,
    TensorPlan,
    chunk_bounds,
)

# --- the axis's differentiable collectives --------------------------------------------------------


class _Copy(torch.autograd.Function):
    """Identity forward on a value every rank of the axis holds alike; its backward sums the
    ranks' gradients (``_Sum``): each rank's is the part its piece of the split module reads."""

    @staticmethod
    def forward(x: torch.Tensor, group: dist.ProcessGroup, name: str | None) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, ctx.group, ctx.name = inputs  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _Sum.apply(grad, ctx.group, ctx.name), None, None

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor, *_: None) -> torch.Tensor:
        return cast(torch.Tensor, _Copy.apply(tangent, ctx.group, ctx.name))

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[int | None, ...], x: torch.Tensor, group: Any, name: str | None
    ) -> tuple[torch.Tensor, Any]:
        return _Copy.apply(x, group, name), in_dims[0]


class _Sum(torch.autograd.Function):
    """The sum over the axis's ranks (a new tensor, the same on each); its backward is the
    identity (``_Copy``): every rank's loss reads the same sum."""

    @staticmethod
    def forward(x: torch.Tensor, group: dist.ProcessGroup, name: str | None) -> torch.Tensor:
        # (no detach: inside a rematerialised region the forward is traced operator by operator,
        # and a detach there would read as the output not coming from the input)
        out = x.clone(memory_format=torch.contiguous_format)
        with _untraced():
            total = all_reduce_(out.detach().clone(), group, name)
        return out.copy_(total)

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, ctx.group, ctx.name = inputs  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _Copy.apply(grad, ctx.group, ctx.name), None, None

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor, *_: None) -> torch.Tensor:
        return cast(torch.Tensor, _Sum.apply(tangent, ctx.group, ctx.name))

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[int | None, ...], x: torch.Tensor, group: Any, name: str | None
    ) -> tuple[torch.Tensor, Any]:
        if in_dims[0] is not None:
            _same_batch_size(x.shape[in_dims[0]], group, name, "all_reduce")
        return _Sum.apply(x, group, name), in_dims[0]  # elementwise: one sum of the whole batch


class _Along(torch.autograd.Function):
    """The scaffolding of the four collectives along one dimension below, each ``(x, group, n,
    name)`` and linear in ``x``: the context keeps ``group``, ``n`` (the whole dimension's length)
    and ``name``, and the tangent of the output is the same collective of the tangent. Each says
    its own forward, backward (its transpose) and vmap rule."""

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, ctx.group, ctx.n, ctx.name = inputs  # type: ignore[attr-defined]

    @classmethod
    def jvp(cls, ctx: Any, tangent: torch.Tensor, *_: None) -> torch.Tensor:  # type: ignore[override]
        return cast(torch.Tensor, cls.apply(tangent, ctx.group, ctx.n, ctx.name))


class _GatherLast(_Along):
    """Every rank's piece along the last dimension, concatenated in rank order (torch.chunk's
    pieces of ``n``); its backward keeps this rank's piece of the gradient (``_SplitLast``)."""

    @staticmethod
    def forward(x: torch.Tensor, group: dist.ProcessGroup, n: int, name: str | None) -> torch.Tensor:
        world, rank = group.size(), group.rank()
        step = -(-n // world)
        lo, hi = chunk_bounds(n, world, rank)
        if x.shape[-1] != hi - lo:
            raise ValueError(
                f"a tensor-parallel gather of {n} features over {world} ranks wants {hi - lo} here (rank {rank}), "
                f"got {x.shape[-1]}"
            )
        mine = F.pad(x, (0, step - (hi - lo))).contiguous()
        with _untraced():
            every = mine.new_empty(world * mine.numel())
            all_gather_into(every, mine.detach().reshape(-1).clone(), group, name)
        pieces = every.view(world, *mine.shape).unbind(0)
        pieces[rank].copy_(mine)  # (the same values: in a region's trace, the result comes from x)
        return torch.cat([p[..., : b - a] for p, (a, b) in zip(pieces, _bounds(n, world), strict=True)], dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _SplitLast.apply(grad, ctx.group, ctx.n, ctx.name), None, None, None

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[int | None, ...], x: torch.Tensor, group: Any, n: int, name: str | None
    ) -> tuple[torch.Tensor, Any]:
        dim = in_dims[0]
        if dim is None:
            return _GatherLast.apply(x, group, n, name), None
        batch = x.movedim(dim, 0)  # (the last dimension stays last)
        _same_batch_size(batch.shape[0], group, name, "all_gather")
        return _GatherLast.apply(batch, group, n, name), 0


class _SplitLast(_Along):
    """This rank's piece along the last dimension of a value every rank holds alike; its backward
    gathers the pieces' gradients (``_GatherLast``)."""

    @staticmethod
    def forward(x: torch.Tensor, group: dist.ProcessGroup, n: int, name: str | None) -> torch.Tensor:
        lo, hi = chunk_bounds(n, group.size(), group.rank())
        return x[..., lo:hi].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _GatherLast.apply(grad, ctx.group, ctx.n, ctx.name), None, None, None

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[int | None, ...], x: torch.Tensor, group: Any, n: int, name: str | None
    ) -> tuple[torch.Tensor, Any]:
        dim = in_dims[0]
        if dim is None:
            return _SplitLast.apply(x, group, n, name), None
        return _SplitLast.apply(x.movedim(dim, 0), group, n, name), 0


class _SeqGather(_Along):
    """Sequence parallelism's entry to a split module: every rank's piece of the sequence (dim -2,
    ``n`` rows in all, torch.chunk's pieces), whole on each rank. The split module reads it with its
    own piece of the weight, so each rank's gradient of it is a part: the backward sums them and
    keeps this rank's rows (``_SeqScatter``)."""

    @staticmethod
    def forward(x: torch.Tensor, group: dist.ProcessGroup, n: int, name: str | None) -> torch.Tensor:
        return _GatherLast.forward(x.movedim(-2, -1), group, n, name).movedim(-1, -2).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _SeqScatter.apply(grad, ctx.group, ctx.n, ctx.name), None, None, None

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[int | None, ...], x: torch.Tensor, group: Any, n: int, name: str | None
    ) -> tuple[torch.Tensor, Any]:
        dim = in_dims[0]
        if dim is None:
            return _SeqGather.apply(x, group, n, name), None
        batch = x.movedim(dim, 0)  # (the sequence stays second to last)
        _same_batch_size(batch.shape[0], group, name, "all_gather")
        return _SeqGather.apply(batch, group, n, name), 0


class _SeqScatter(_Along):
    """Sequence parallelism's exit from a row-split module: its partial outputs (the whole
    sequence, dim -2, ``n`` rows) summed over the ranks, this rank's piece of the rows kept (one
    reduce-scatter); the backward gathers the pieces' gradients whole (``_SeqGather``)."""

    @staticmethod
    def forward(x: torch.Tensor, group: dist.ProcessGroup, n: int, name: str | None) -> torch.Tensor:
        world, rank = group.size(), group.rank()
        step = -(-n // world)
        lo, hi = chunk_bounds(n, world, rank)
        rows = x.movedim(-2, 0)
        with _untraced():
            padded = F.pad(rows.detach().reshape(n, -1), (0, 0, 0, step * world - n)).contiguous()
            mine = reduce_scatter(padded.view(-1), group, name)
        out = x.narrow(-2, lo, hi - lo).contiguous().clone()  # (in a region's trace: made from x)
        return out.copy_(mine.view(step, *rows.shape[1:])[: hi - lo].movedim(0, -2))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _SeqGather.apply(grad, ctx.group, ctx.n, ctx.name), None, None, None

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[int | None, ...], x: torch.Tensor, group: Any, n: int, name: str | None
    ) -> tuple[torch.Tensor, Any]:
        dim = in_dims[0]
        if dim is None:
            return _SeqScatter.apply(x, group, n, name), None
        batch = x.movedim(dim, 0)
        _same_batch_size(batch.shape[0], group, name, "reduce_scatter")
        return _SeqScatter.apply(batch, group, n, name), 0


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup, n: int, name: str | None = None) -> torch.Tensor:
    """Every rank's piece of the sequence (dim -2; ``n`` rows in all, split as ``torch.chunk``),
    whole on each rank, for a split module to read; the backward sums the ranks' gradients and
    keeps this rank's rows (a reduce-scatter). Memory: the whole sequence; communication: one
    all-gather forward, one reduce-scatter backward."""
    return cast(torch.Tensor, _SeqGather.apply(x, group, n, name))


def scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup, name: str | None = None) -> torch.Tensor:
    """A split module's partial outputs over the whole sequence (dim -2) summed over the ranks,
    this rank's piece of the rows kept (``torch.chunk``'s); the backward gathers the gradient whole.
    Memory: one piece; communication: one reduce-scatter forward, one all-gather backward."""
    return cast(torch.Tensor, _SeqScatter.apply(x, group, x.shape[-2], name))


def split_sequence(x: torch.Tensor, group: dist.ProcessGroup, name: str | None = None) -> torch.Tensor:
    """This rank's piece of the sequence (dim -2, ``torch.chunk``'s) of a value every rank holds
    whole; the backward gathers the gradient whole. Communication: one all-gather backward."""
    return split_last(x.movedim(-2, -1), group, x.shape[-2], name).movedim(-1, -2)


def gather_dim(x: torch.Tensor, group: dist.ProcessGroup, split: tuple[int, int]) -> torch.Tensor:
    """A parameter's whole value from every rank's piece (``ParamSpec.split``: its dimension and
    whole length); differentiable (``gather_last`` along that dimension)."""
    dim, n = split
    return gather_last(x.movedim(dim, -1), group, n, "unshard").movedim(-1, dim)


@contextlib.contextmanager
def _untraced() -> Iterator[None]:
    """For the block, the dispatch modes running now (a rematerialised region's trace) are set
    aside: a collective runs on buffers of its own there, which a backend's communication thread
    may hold a while after it is done; the caller connects its result to the traced values with
    an operator the trace sees (a copy into a tensor made from the input)."""
    with torch.no_grad(), torch.utils._python_dispatch._disable_current_modes():
        yield


def _bounds(n: int, world: int) -> list[tuple[int, int]]:
    return [chunk_bounds(n, world, r) for r in range(world)]


def copy_in(x: torch.Tensor, group: dist.ProcessGroup, name: str | None = None) -> torch.Tensor:
    """``x`` itself, entering a split module: the backward sums the gradient over ``group``.
    Memory: none; communication: one all-reduce of ``x``'s size in backward (``name``: the
    module's, in the collective log)."""
    return cast(torch.Tensor, _Copy.apply(x, group, name))


def sum_out(x: torch.Tensor, group: dist.ProcessGroup, name: str | None = None) -> torch.Tensor:
    """The sum of ``x`` over ``group``, the same on every rank; the backward passes the gradient
    through. Memory: one copy of ``x``; communication: one all-reduce forward (``name``: the
    module's, in the collective log)."""
    return cast(torch.Tensor, _Sum.apply(x, group, name))


def gather_last(x: torch.Tensor, group: dist.ProcessGroup, n: int, name: str | None = None) -> torch.Tensor:
    """Every rank's piece of the last dimension (``n`` features in all, split as ``torch.chunk``),
    whole on each rank; the backward keeps this rank's piece. Memory: the whole output;
    communication: one all-gather forward (``name``: the module's, in the collective log)."""
    return cast(torch.Tensor, _GatherLast.apply(x, group, n, name))


def split_last(x: torch.Tensor, group: dist.ProcessGroup, n: int, name: str | None = None) -> torch.Tensor:
    """This rank's piece of the last dimension (``n`` features, split as ``torch.chunk``) of a
    value every rank holds alike; the backward gathers the gradient. Communication: one
    all-gather backward (``name``: the module's, in the collective log)."""
    return cast(torch.Tensor, _SplitLast.apply(x, group, n, name))


# --- the vocabulary-parallel cross-entropy --------------------------------------------------------


def parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup, vocab: int, *, ignore_index: int = -100
) -> torch.Tensor:
    """The mean cross-entropy of logits whose vocabulary is split over ``group`` (a
    ``vocab_parallel`` head's output), without gathering them: the maximum, the sum of
    exponentials and the target's logit are each summed over the ranks (Megatron's
    vocabulary-parallel loss). Differentiable through every ``torch.func`` transform.

    Memory: a few (N,) tensors beside the local logits; communication: three all-reduces of N
    numbers (the maximum's carries no gradient).

    Args:
        logits: (..., V_r) this rank's piece of the vocabulary (``torch.chunk``'s of ``vocab``).
        targets: (...) target ids over the whole vocabulary; ``ignore_index`` is left out.
        group: the tensor-parallel axis's group.
        vocab: the whole vocabulary's size.
        ignore_index: a target that counts for nothing.

    Returns:
        The mean over the targets that count, a 0-d tensor, the same on every rank.

    Raises:
        IndexError: if a target other than ``ignore_index`` lies outside the vocabulary (as
            ``F.cross_entropy`` raises; one read of the targets on the host).

    Examples:
        >>> import torch, torch.distributed as dist
        >>> if not dist.is_initialized():
        ...     dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29512", rank=0, world_size=1)
        >>> logits, targets = torch.randn(4, 7), torch.tensor([0, 3, 6, -100])
        >>> loss = parallel_cross_entropy(logits, targets, dist.group.WORLD, 7)  # one rank: the whole vocabulary
        >>> bool(torch.isclose(loss, F.cross_entropy(logits, targets)))
        True
    """
    t = targets.reshape(-1)
    outside = (t != ignore_index) & ((t < 0) | (t >= vocab))
    if bool(outside.any()):  # (F.cross_entropy's IndexError: here a target outside would count as logit 0)
        raise IndexError(f"target {int(t[outside][0])} is out of bounds of the vocabulary of {vocab}")
    lo, hi = chunk_bounds(vocab, group.size(), group.rank())
    flat = logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32))
    with torch.no_grad():
        top = flat.detach().amax(dim=-1)
        top = all_reduce_max(top, group)
    shifted = flat - top.unsqueeze(-1)
    total = sum_out(shifted.exp().sum(dim=-1), group)
    mine = (t >= lo) & (t < hi)
    local = torch.where(mine, t - lo, torch.zeros_like(t))
    picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine
    target_logit = sum_out(picked, group)
    losses = total.log() - target_logit
    keep = t != ignore_index
    return (losses * keep).sum() / keep.sum().clamp(min=1)


def all_reduce_max(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The elementwise maximum over ``group`` (no gradient): every rank's ``x`` gathered, then the max."""
    every = x.new_empty(group.size() * x.numel())
    all_gather_into(every, x.detach().contiguous().reshape(-1), group, "tensor-parallel max")
    return every.view(group.size(), *x.shape).amax(dim=0)


# --- the hooks around the split modules -----------------------------------------------------------


FIXED_HEADS = (
    "a module inside a tensor-parallel unit reshaped a split output by the whole model's head count; "
    "each rank holds {share} of the heads: reshape by -1 heads (x.view(b, t, -1, head_dim)), as "
    "Hugging Face's models do (under sequence parallelism: take the sequence length from the tensor "
    "reshaped, not from the block's input, which holds a piece of it)"
)


_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def _not_compiled(hook: _Hook) -> _Hook:
    """``hook`` as a compiled unit runs it: between its graphs (Dynamo does not trace the collectives)."""
    return cast(_Hook, torch.compiler.disable(hook))


_SPLIT: set[int] = set()  # the modules whose split modules' hooks are installed now


@contextlib.contextmanager
def split_modules(module: nn.Module, tensor: TensorPlan, group: dist.ProcessGroup) -> Iterator[None]:
    """For the block, each module the plan splits runs its style's collectives around its forward
    (hooks installed now, removed after): a column-split module's input enters through ``copy_in``;
    a row-split module's output leaves through ``sum_out`` (its bias added once, after); a
    vocabulary-split embedding reads only its rows and sums; ``colwise_gather_output`` gathers its
    output. The module's parameters hold this rank's pieces meanwhile (the plan's shapes). Inside
    such a block already (a rematerialised region's forward), it installs nothing more.

    With sequence parallelism (``tensor.sequence_parallel``) the sequence is split from a
    ``sequence_split_input`` module's input on: a split module's input is gathered along it
    (``gather_sequence``), a row-split output reduce-scattered along it (``scatter_sequence``), and
    a ``sequence_parallel`` module (a norm) sums its parameters' gradients; what runs on the
    pieces draws from the rank's own random stream."""
    if id(module) in _SPLIT:
        yield
        return
    handles = []
    streams = Streams(tensor.rank)
    sp = tensor.sequence_parallel
    _SPLIT.add(id(module))
    try:
        for path, m in module.named_modules():
            style = tensor.style_of(path)
            if style in (COLWISE, COLWISE_GATHER_OUTPUT, VOCAB_PARALLEL):
                entry = _gather_sequence_input(group, id(module), path) if sp else _copy_input(group, path)
                handles.append(m.register_forward_pre_hook(entry, with_kwargs=True))
                if style == COLWISE_GATHER_OUTPUT:
                    assert isinstance(m, nn.Linear)
                    handles.append(m.register_forward_hook(_gather_output(group, m.out_features, path), prepend=True))
                else:  # its output is this rank's piece: what runs on it draws from this rank's stream
                    handles.append(m.register_forward_hook(_entering(streams, path)))
            elif style in (ROWWISE, ROWWISE_SPLIT_INPUT):
                stack: list[Any] = []
                if not sp:  # (with the sequence split its output is a piece too)
                    handles.append(m.register_forward_pre_hook(_leaving(streams), prepend=True))
                if style == ROWWISE_SPLIT_INPUT:  # its input is whole: this rank's piece of it
                    assert isinstance(m, nn.Linear)
                    handles.append(
                        m.register_forward_pre_hook(_split_input(group, m.in_features, path), with_kwargs=True)
                    )
                handles.append(m.register_forward_pre_hook(_bias_aside(stack), with_kwargs=True))
                handles.append(m.register_forward_hook(_sum_output(group, stack, path, sp), prepend=True))
            elif style in (REPLICATED_WITH_GRAD_ALLREDUCE, SEQUENCE_PARALLEL):  # whole, run on pieces
                held: list[dict[str, Any]] = []
                handles.append(m.register_forward_pre_hook(_parameters_in(group, held, path), with_kwargs=True))
                handles.append(m.register_forward_hook(_parameters_back(held), prepend=True))
            elif style == SEQUENCE_SPLIT_INPUT:
                handles.append(
                    m.register_forward_pre_hook(
                        _split_sequence_input(group, id(module), streams, path), with_kwargs=True
                    )
                )
            elif style == EMBEDDING_ROWWISE:
                assert isinstance(m, nn.Embedding)
                masks: list[tuple[torch.Tensor, int | None]] = []
                lo, hi = chunk_bounds(m.num_embeddings, tensor.size, tensor.rank)
                handles.append(m.register_forward_pre_hook(_own_rows(lo, hi, masks), with_kwargs=True))
                handles.append(m.register_forward_hook(_sum_rows(group, masks, path), prepend=True))
        yield
    finally:
        streams.leave()
        _SPLIT.discard(id(module))
        for h in handles:
            h.remove()


class Streams:
    """Random streams across a split (Megatron's tracker, without touching the model): between a
    column-split module's output and the next row-split module's input the values are this rank's
    piece, and a dropout there draws from a stream of this rank's own, seeded at entry from the
    shared stream's state, the entering module's name and the rank (a recomputation, which replays
    the shared stream, draws the same; the shared stream itself is not drawn from, so the rest of
    the program sees the numbers it would without tensor parallelism); the shared stream is set
    aside meanwhile, so what runs on values every rank of the axis holds alike draws alike there,
    whatever the pieces' sizes."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.shared: tuple[torch.Generator, torch.Tensor] | None = None  # (generator, its state set aside)

    def enter(self, device: torch.device, where: str) -> None:
        if self.shared is not None:
            return
        generator = _generator(device)
        with torch._C._DisableFuncTorch():  # (a plain tensor of bytes, under a transform too)
            state = generator.get_state()
            digest = hashlib.blake2b(state.numpy().tobytes(), digest_size=8, person=b"fsdp_fn-tp")
        digest.update(f"{where}/{self.rank}".encode())
        self.shared = (generator, state)
        generator.manual_seed(int.from_bytes(digest.digest(), "little") >> 1)

    def leave(self) -> None:
        if self.shared is not None:
            generator, state = self.shared
            generator.set_state(state)
            self.shared = None


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


def _entering(streams: Streams, path: str) -> Any:
    @_not_compiled
    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        streams.enter(output.device, path)

    return hook


def _leaving(streams: Streams) -> Any:
    @_not_compiled
    def hook(module: nn.Module, args: Any) -> None:
        streams.leave()

    return hook


def _copy_input(group: dist.ProcessGroup, path: str) -> Any:
    @_not_compiled
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        return (copy_in(args[0], group, path), *args[1:]), kwargs

    return hook


# The whole sequence's length at the last split, by model (``id``): a split module's gather (in
# the forward, and in a rematerialised region's recomputation during the backward) needs it, as
# the pieces' sizes alone do not say it.
_SEQUENCE_LENGTH: dict[int, int] = {}


def _split_sequence_input(group: dist.ProcessGroup, model: int, streams: Streams, path: str) -> Any:
    @_not_compiled
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x = args[0]
        _SEQUENCE_LENGTH[model] = x.shape[-2]
        streams.enter(x.device, path)  # from here on the values are this rank's piece
        return (split_sequence(x, group, path), *args[1:]), kwargs

    return hook


def _gather_sequence_input(group: dist.ProcessGroup, model: int, path: str) -> Any:
    @_not_compiled
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        n = _SEQUENCE_LENGTH.get(model)
        if n is None:
            raise RuntimeError(
                f"tensor-parallel module {path!r} runs on a sequence split between the split modules "
                "(sequence parallelism) but no module has split it yet: give the first layer the style "
                "'sequence_split_input'"
            )
        return (gather_sequence(args[0], group, n, path), *args[1:]), kwargs

    return hook


def _split_input(group: dist.ProcessGroup, n: int, path: str) -> Any:
    @_not_compiled
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return (split_last(args[0], group, n, path), *args[1:]), kwargs

    return hook


def _parameters_in(group: dist.ProcessGroup, held: list[dict[str, Any]], path: str) -> Any:
    @_not_compiled
    def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
        own = {k: p for k, p in module._parameters.items() if p is not None}
        held.append(own)
        for k, p in own.items():
            module._parameters[k] = copy_in(p, group, path)  # type: ignore[assignment]
        return

    return hook


def _parameters_back(held: list[dict[str, Any]]) -> Any:
    @_not_compiled
    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        module._parameters.update(held.pop())
        return output

    return hook


def _gather_output(group: dist.ProcessGroup, n: int, path: str) -> Any:
    @_not_compiled
    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return gather_last(output, group, n, path)

    return hook


def _bias_aside(stack: list[Any]) -> Any:
    @_not_compiled
    def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
        bias = module._parameters.get("bias")
        stack.append(bias)
        if bias is not None:  # added once, after the sum (every rank would add it)
            module._parameters["bias"] = None
        return

    return hook


def _sum_output(group: dist.ProcessGroup, stack: list[Any], path: str, sequence: bool) -> Any:
    @_not_compiled
    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        bias = stack.pop()
        out = scatter_sequence(output, group, path) if sequence else sum_out(output, group, path)
        if bias is not None:
            module._parameters["bias"] = bias
            # (added to a piece of the sequence, each rank's gradient of it is a part: summed)
            out = out + (copy_in(bias, group, path) if sequence else bias)
        return out

    return hook


def _own_rows(lo: int, hi: int, masks: list[tuple[torch.Tensor, int | None]]) -> Any:
    @_not_compiled
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        ids = args[0]
        outside = (ids < lo) | (ids >= hi)
        # The padding row (no gradient) by its index in this rank's rows, for the call: another
        # rank's (or none) is no row of this one's (torch.where's 0 stands for the rows it lacks,
        # zeroed after, with their gradient).
        table = cast(nn.Embedding, module)
        pad = table.padding_idx
        masks.append((outside, pad))
        table.padding_idx = pad - lo if pad is not None and lo <= pad < hi else None
        return (torch.where(outside, torch.zeros_like(ids), ids - lo), *args[1:]), kwargs

    return hook


def _sum_rows(group: dist.ProcessGroup, masks: list[tuple[torch.Tensor, int | None]], path: str) -> Any:
    @_not_compiled
    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        outside, cast(nn.Embedding, module).padding_idx = masks.pop()
        return sum_out(output.masked_fill(outside.unsqueeze(-1), 0), group, path)

    return hook
