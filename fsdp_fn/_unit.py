"""A unit's lifecycle in the lean pass: SHARDED -> GATHERED -> FREED -> GATHERED -> SHARDED.

Its phases are methods of ``GatheredUnit``, named as FSDP2 names its parameter group's:
``unshard`` (issue the all-gather), ``wait_for_unshard``, ``reshard`` (after the forward),
``pre_backward`` (gathered again), ``post_backward`` (the full gradient handed on); the
runtime's pre- and post-forward hooks run around the forward, and its ``finalize_backward``
settles what is left when the whole backward is over.

SHARDED: only this rank's shard exists. GATHERED (pre-forward): the flat buffer holds the
full parameters, the unit's parameters are views into it. FREED (post-forward): the
buffer's storage is released (``untyped_storage().resize_(0)``); autograd's saved tensors
still alias it. GATHERED again (pre-backward): a hook on the unit's outputs' gradients
refills it before the unit's backward runs (a hook, not an identity ``autograd.Function``,
whose outputs would be views that code after the unit may not change in place), and so
does a hook on any other node of its forward where the loss's backward enters it. SHARDED
(post-backward): the full gradient goes to the owner, the buffer is dropped.

Each parameter's gradient is written into its slice of one flat gradient buffer the moment
autograd produces it, so a unit's full gradient exists once, never also as per-parameter
tensors; that buffer is the previous unit's, once its reduce-scatter ended, when the sizes
match (``Owner.spare_grad``). Inside ``torch.func`` saved-tensor hooks are refused, which is
why freeing works on storage. This file knows nothing of the runtime: what a use needs
from the call that runs it comes in as an ``Owner``.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
from torch.autograd.function import FunctionCtx
from torch.autograd.graph import get_gradient_edge, register_multi_grad_hook

from fsdp_fn._collectives import all_gather_into, comm_of
from fsdp_fn._function import plain, plain_apply, plain_mode
from fsdp_fn._labels import label, retag
from fsdp_fn._phases import phased
from fsdp_fn._plan import ROOT, Unit
from fsdp_fn._shard import unit_views

_transforms_active = torch._C._are_functorch_transforms_active


class UnitState(enum.Enum):
    """Where a unit's gathered flat buffer is in its lifecycle within one step (FSDP2's ``ShardedState``).

    ``SHARDED`` -> ``GATHERED`` (its all-gather issued) -> ``FREED`` after its forward ->
    ``GATHERED`` again for its backward (the refill) -> ``SHARDED`` once its backward is
    done (released). Memory: a unit holds its full (padded) parameters only while
    ``GATHERED``.
    """

    SHARDED = "sharded"
    """Only this rank's shard exists; the gathered buffer is not allocated."""
    GATHERED = "gathered"
    """The flat buffer holds (or, while its all-gather is in flight, will hold) the full parameters."""
    FREED = "freed"
    """Forward is done and the buffer's storage is released; backward will refill it."""


class FlatPart:
    """One flat part of a gathered unit: this rank's shard, the gathered buffer, the pending gather.

    The buffer comes from the group's comm (``Comm.buffer``, ``regrow``, ``free``), so a comm
    with streams of its own decides which stream its memory belongs to."""

    def __init__(self, part: Unit, shard: torch.Tensor, group: Any, dtype: torch.dtype, device: torch.device) -> None:
        self.part, self.shard, self.group = part, shard, group  # shard: plain, 1-D
        self.dtype, self.device = dtype, device
        self.comm = comm_of(group)
        # One rank, same dtype and device (or nothing to hold): the shard is the whole unit, used in place.
        self.in_place = part.numel == 0 or (group.size() == 1 and shard.dtype == dtype and shard.device == device)
        self.buffer: torch.Tensor | None = None
        self.work: Any = None
        self._source: torch.Tensor | None = None  # the cast/copied shard, alive while its gather runs
        # A parameter that lies wholly in this rank's shard is a view of the shard itself, so the
        # gather copies into its own slot of the buffer only the pieces of the parameters that cross
        # the slot's edges (at most two), not the whole shard: one copy of the shard (and the first
        # touch of its pages) less per gather. Not when the gather casts or moves the shard.
        world = group.size()
        own = not self.in_place and world > 1 and shard.dtype == dtype and shard.device == device
        self.offsets = part.offsets
        self.in_shard, self.own_pieces, self.slots, self._start = _layout_of(part, world, group.rank() if own else -1)
        self._detached = shard.detach()

    def start(self) -> None:
        """Allocate (or regrow) the gathered buffer through the comm and issue its all-gather;
        does not wait. Memory: the full (padded) part, and a cast or moved copy of the shard
        while the gather runs (when the gather dtype or device differs)."""
        if self.in_place:
            self.buffer = self.shard.view_as(self.shard)
            return
        world = self.group.size()
        if self.buffer is None:
            self.buffer = self.comm.buffer(self.shard.numel() * world, self.dtype, self.device)
        else:
            self.comm.regrow(self.buffer)
        source = self.shard
        if world > 1 and (source.dtype != self.dtype or source.device != self.device):
            with label("comm"):
                source = source.to(device=self.device, dtype=self.dtype, non_blocking=True)
        self._source = source
        self.work = all_gather_into(self.buffer, source, self.group, self.part.name, async_op=True, own=self.own_pieces)

    def view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``: a view into ``flat`` (this part's gathered buffer), or into the
        shard when it lies wholly there (its values were never copied into ``flat``)."""
        spec, at = self.part.params[index], self.offsets[index]
        if self.in_shard[index]:
            at -= self._start
            return self._detached[at : at + spec.numel].view(spec.shape)
        return flat[at : at + spec.numel].view(spec.shape)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every parameter of the part, as ``view`` makes it."""
        if not any(self.in_shard):
            return unit_views(self.part, flat)
        return {spec.name: self.view(flat, i) for i, spec in enumerate(self.part.params)}

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.work = self._source = None

    def drop(self) -> None:
        """Wait for the gather, then free the buffer's storage through the comm (``Comm.free``)."""
        self.wait()
        if not self.in_place and self.buffer is not None:
            self.comm.free(self.buffer)


def _layout_of(
    part: Unit, world: int, rank: int
) -> tuple[
    tuple[bool, ...], tuple[tuple[int, int], ...] | None, tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...], int
]:
    """What ``FlatPart`` reads of ``part``'s layout on ``rank`` of ``world``, made once per part
    (a step makes a ``FlatPart`` per unit): which parameters lie wholly in this rank's shard,
    the pieces of its slot to copy from the shard (``None``: all of it), each parameter's
    ``as_strided`` view (shape, strides, offset in the flat buffer), and where this rank's slot
    starts. ``rank`` -1: no parameter is read from the shard."""
    memo: dict[tuple[int, int], Any] = part.__dict__.setdefault("_view_layouts", {})  # (as Unit.held keeps its own)
    known = memo.get((world, rank))
    if known is not None:
        return known  # type: ignore[no-any-return]
    in_shard = [False] * len(part.params)
    own_pieces: list[tuple[int, int]] | None = None
    start = part.shard_numel(world) * rank if rank > 0 else 0
    if rank >= 0:
        own_pieces = []
        for i, lo, hi in part.local_ranges(world, rank):
            numel = part.params[i].numel
            if numel and hi - lo == numel:
                in_shard[i] = True
            elif hi > lo:
                own_pieces.append((lo, hi))
    slots = [
        (spec.shape, torch.empty(spec.shape, device="meta").stride(), at)
        for spec, at in zip(part.params, part.offsets, strict=True)
    ]
    pieces = None if own_pieces is None else tuple(own_pieces)
    layout = memo[world, rank] = (tuple(in_shard), pieces, tuple(slots), start)
    return layout


class Owner(Protocol):
    """What a gathered use needs from the call that runs it (the runtime), as callbacks.

    ``inflight`` counts the bytes of non-root unit buffers allocated now (the prefetch limit).
    ``adds_during_backward``: the owner may add into a full gradient it was handed while
    the backward still runs (summing uses without reducing them), so autograd's own
    tensor must never be handed on as one.
    """

    inflight: int
    adds_during_backward: bool

    def before_backward(self, use: GatheredUnit) -> None:
        """The use's storage is refilled and its backward is about to run."""

    def before_grad(self, use: GatheredUnit) -> None:
        """The use's first parameter gradient is here; its flat gradient is about to be allocated."""

    def spare_grad(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """A free full gradient buffer of exactly this size to write into, if the owner has one."""

    def after_backward(self, use: GatheredUnit, full: torch.Tensor) -> None:
        """The use's backward has run: ``full`` is its full (trainable) gradient."""


class GatheredUnit:
    """One gathered use of a unit inside one call: its flat parts, pending work, state, and
    which of its parameters the backward reached."""

    def __init__(self, unit: Unit, parts: list[FlatPart], owner: Owner) -> None:
        self.unit, self.parts, self.owner = unit, parts, owner
        self.state = UnitState.SHARDED
        self.received = [False] * len(unit.params)
        self.offsets = unit.offsets  # where each trainable parameter starts in the flat buffer
        self.grad: torch.Tensor | None = None  # the trainable part's flat gradient, filled by the backward
        # A unit run by its own module gets its gradients within that module's backward: each is
        # written into the flat gradient as it comes. The root's (or one gathered by several
        # modules) come spread over the whole backward: they are held as autograd made them and
        # written when the last is in, so the flat buffer does not live the whole backward.
        self.write_at_once = unit.name != ROOT and not unit.hooks
        self.held: dict[int, torch.Tensor] = {}
        self.taken = False  # the flat gradient is autograd's own tensor (see _may_take)
        self.refill = True  # freed after forward, gathered again for backward (not a lookup's)
        self.outputs: frozenset[int] = frozenset()  # sequence numbers of the nodes of the outputs that refill it
        self.made = range(0)  # sequence numbers of the autograd nodes its forward made
        self.node = -1  # the sequence number of its gather's autograd node
        # Only non-root units whose gather allocates take a buffer that counts against the limit.
        counted = unit.name != ROOT and not all(p.in_place for p in self.parts)
        self.nbytes = sum(p.shard.numel() * int(p.group.size()) * p.dtype.itemsize for p in parts) if counted else 0

    @property
    def shard(self) -> torch.Tensor:
        """This rank's shard of the trainable part (plain)."""
        return self.parts[0].shard

    def unshard(self) -> None:
        """Allocate (or re-grow) the buffers and issue the all-gathers; do not wait (GATHERED)."""
        # Plain tensors only: a prefetch runs outside any autograd.Function, where a
        # transform would otherwise wrap the new buffers.
        with torch._C._DisableFuncTorch():
            for part in self.parts:
                part.start()
        self.state = UnitState.GATHERED
        self.owner.inflight += self.nbytes

    def wait_for_unshard(self) -> None:
        """Wait for the all-gathers ``unshard`` issued: the buffer holds the full parameters."""
        for part in self.parts:
            part.wait()

    def refill_on_backward(self, outputs: list[torch.Tensor]) -> None:
        """Hook the gradients of ``outputs`` (tensors the forward returned): the first to come,
        before any of the unit's backward runs, refills the buffer (if no prefetch did)."""
        # Their nodes' numbers, not the nodes: a use that held its outputs' nodes would be in a
        # cycle through autograd's C++ graph (its GatherUnit's context holds the use), which the
        # garbage collector cannot see: the graph, activations and all, would outlive the step.
        # The numbers are unique within the thread that ran the forward, except autograd's
        # last, shared by leaves' accumulators and parameter views, whose backward reads no
        # gathered buffer: a use that only they reach can go.
        self.outputs = frozenset(get_gradient_edge(t).node._sequence_nr() for t in outputs)
        if len(outputs) == 1:  # (a hook of the one tensor runs once a backward, as "any" would)
            outputs[0].register_hook(self._refill_hook)
        else:
            register_multi_grad_hook(outputs, self._refill_hook, mode="any")

    def _refill_hook(self, _grad: Any) -> None:
        self.pre_backward()

    def refill_on_entry(self, nodes: Sequence[Any]) -> None:
        """Also refill before any of ``nodes`` runs: nodes of its forward that the loss's backward
        reaches other than through its outputs (a tensor the forward kept on its module)."""
        for node in nodes:
            node.register_prehook(lambda _grads: self.pre_backward())

    @phased("pre_backward")
    def pre_backward(self) -> None:
        """The unit's backward is about to run: its buffer gathered again (unsharded here if no
        prefetch did), then the owner told. Once its backward is done (released), nothing."""
        if self.state is UnitState.SHARDED:
            return
        if self.state is UnitState.FREED:  # not prefetched
            self.unshard()
        self.wait_for_unshard()
        self.owner.before_backward(self)

    def reshard(self) -> None:
        """After forward: release the buffer's storage (FREED); its backward unshards it again."""
        if all(p.in_place for p in self.parts):
            return  # nothing was allocated
        for part in self.parts:
            part.drop()
        self.owner.inflight -= self.nbytes
        self.state = UnitState.FREED

    def release(self) -> None:
        """After backward (or when no backward will come): drop everything."""
        if self.state is UnitState.GATHERED:
            for part in self.parts:
                part.drop()
            self.owner.inflight -= self.nbytes
        for part in self.parts:
            part.buffer = None
        self.state = UnitState.SHARDED

    def add_grad(self, index: int, grad: torch.Tensor) -> None:
        """Parameter ``index``'s gradient, from its backward: written into its slice of the flat
        gradient (allocated at the first one), so autograd's own tensor goes at once; or held
        until ``take_grad`` (see ``write_at_once``)."""
        # Autograd runs a view's backward once, with every path's gradient summed: one per use.
        assert not self.received[index], f"a second gradient for {self.unit.params[index].name}"
        if self.write_at_once:
            self._write(index, grad)
        else:
            self.held[index] = grad
        self.received[index] = True

    def _write(self, index: int, grad: torch.Tensor) -> None:
        # (Backward runs without grad mode and, in the step's own pass, outside any transform: then
        # the guards that keep the copy out of autograd and functorch would only cost time.)
        if self.grad is not None and not (torch.is_grad_enabled() or _transforms_active()):
            self._copy(index, grad)
            return
        with plain_mode():
            if self.grad is None:
                self.owner.before_grad(self)
                if self._may_take(grad):
                    # The unit's one parameter fills the flat gradient: take autograd's tensor as it
                    # is, no copy. (It may be shared with another path of the backward, so it is
                    # only ever read: the reduce-scatter sends it and sums into received buffers.)
                    self.grad, self.taken = grad.view(-1), True
                    retag(self.grad, "grads")
                    return
                self.grad, self.taken = self._new_grad(), False
            self._copy(index, grad)

    def _copy(self, index: int, grad: torch.Tensor) -> None:
        flat = self.grad
        assert flat is not None
        shape, strides, at = self.parts[0].slots[index]
        into = flat.as_strided(shape, strides, at + flat.storage_offset())
        if grad.layout == torch.strided:
            into.copy_(grad)
        else:  # nn.Embedding(sparse=True): its rows added in place, never a dense copy of its own
            into.zero_().add_(grad)

    def _may_take(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` can be the flat gradient itself: the unit's only parameter, no padding,
        a dense tensor that owns its whole storage, more than one rank (one rank's reduction hands
        the flat gradient on as the shard), and an owner that never adds into it during backward."""
        part = self.parts[0]
        return (
            len(self.unit.params) == 1
            and grad.layout == torch.strided
            and grad.numel() == self._grad_numel()
            and int(part.group.size()) > 1
            and not self.owner.adds_during_backward
            and grad.dtype == part.dtype
            and grad.device == part.device
            and grad.is_contiguous()
            and grad.storage_offset() == 0
            and grad.untyped_storage().nbytes() == grad.numel() * grad.element_size()
        )

    def take_grad(self) -> torch.Tensor:
        """The flat gradient, complete: zero where the backward reached no parameter (and in the padding)."""
        while self.held:
            index = next(iter(self.held))
            self._write(index, self.held.pop(index))
        with plain_mode():
            flat = self.grad
            if flat is None:  # the backward reached no parameter of this use
                flat = self._new_grad().zero_()
            else:
                for at, spec, got in zip(self.offsets, self.unit.params, self.received, strict=True):
                    if not got:
                        flat[at : at + spec.numel].zero_()
                flat[self.unit.numel :].zero_()
        self.grad = None
        return flat

    def post_backward(self) -> None:
        """The use's backward has run: its full gradient (``take_grad``) goes to the owner (a
        reduce-scatter issued), its buffer is dropped (SHARDED)."""
        full = self.take_grad()
        self.release()
        self.owner.after_backward(self, full)

    def _new_grad(self) -> torch.Tensor:
        """An uninitialised flat gradient: the owner's spare buffer of this size, else a new one."""
        numel, part = self._grad_numel(), self.parts[0]
        grad = self.owner.spare_grad(numel, part.dtype, part.device)
        if grad is None:
            with label("grads"):
                grad = torch.empty(numel, dtype=part.dtype, device=part.device)
        return grad

    def _grad_numel(self) -> int:
        part = self.parts[0]
        return part.shard.numel() * int(part.group.size())

    def views(self, trainable: torch.Tensor) -> dict[str, torch.Tensor]:
        """The unit's parameters: views into ``trainable`` (autograd's output), each one's gradient
        written into the flat gradient by its own backward; frozen ones from their buffer."""
        if torch.is_grad_enabled():
            out = {}
            params = self.unit.params
            if _transforms_active():
                for i, spec in enumerate(params):  # (setup_context runs the node as soon as its gradient is ready)
                    out[spec.name] = _ParamView.apply(trainable, self, i)
            else:  # (one C++ call a parameter: a step makes one per parameter of every unit)
                part = self.parts[0]
                shard, in_shard = part._detached, part.in_shard
                start, shard_start = trainable.storage_offset(), shard.storage_offset() - part._start
                for i, (shape, strides, at) in enumerate(part.slots):
                    out[params[i].name] = (
                        _plain_param_view(trainable, self, i, shape, strides, at + shard_start, shard)
                        if in_shard[i]
                        else _plain_param_view(trainable, self, i, shape, strides, at + start, None)
                    )
        else:
            out = self.parts[0].views(trainable)
        for part in self.parts[1:]:
            assert part.buffer is not None
            out.update(part.views(part.buffer))
        return out


class ForwardSpans:
    """The spans of autograd node numbers that uses' forwards made (nested, as the calls are,
    or apart), to find the edges of a backward graph that enter one from outside it."""

    def __init__(self, uses: Sequence[GatheredUnit]) -> None:
        self.uses = sorted((u for u in uses if u.made), key=lambda u: (u.made.start, -u.made.stop))
        self.starts = [u.made.start for u in self.uses]
        self.parent: list[int] = []  # index of the innermost span around each one (-1: none)
        open_: list[int] = []
        for i, use in enumerate(self.uses):
            while open_ and self.uses[open_[-1]].made.stop <= use.made.start:
                open_.pop()
            self.parent.append(open_[-1] if open_ else -1)
            open_.append(i)

    def innermost(self, nodes: Sequence[int]) -> torch.Tensor:
        """The index of the innermost span that holds each node number (-1: none), for many at once."""
        at = torch.tensor(nodes, dtype=torch.float64)  # (autograd's last number, 2**64 - 1, is exact enough)
        starts = torch.tensor(self.starts, dtype=torch.float64)
        stops = torch.tensor([u.made.stop for u in self.uses], dtype=torch.float64)
        parent = torch.tensor(self.parent, dtype=torch.int64)
        i = torch.searchsorted(starts, at, right=True) - 1
        while True:  # out of the last span that starts before it: maybe inside one around it
            outside = (i >= 0) & (at >= stops[i.clamp(min=0)])
            if not bool(outside.any()):
                return i
            i = torch.where(outside, parent[i.clamp(min=0)], i)

    def entries(self, into: Sequence[int], out_of: Sequence[int]) -> list[tuple[int, GatheredUnit]]:
        """For edges ``out_of[k] -> into[k]`` (node numbers, the gradient flowing from the first to
        the second): ``(k, use)`` for each use whose span an edge enters from outside."""
        if not self.uses or not into:
            return []
        inner = self.innermost([*into, *out_of])
        to, since = inner[: len(into)], inner[len(into) :]
        crossing = ((to >= 0) & (to != since)).nonzero().flatten().tolist()  # (within one span: no entry)
        return [(k, use) for k in crossing for use in self.entered(into[k], out_of[k])]

    def entered(self, node: int, source: int) -> Iterator[GatheredUnit]:
        """The uses whose span holds node number ``node`` but not ``source``, the node whose
        gradient flows into it."""
        i = bisect.bisect_right(self.starts, node) - 1
        while i >= 0 and node not in self.uses[i].made:
            i = self.parent[i]
        while i >= 0 and source not in self.uses[i].made:
            yield self.uses[i]
            i = self.parent[i]


class GatherUnit(torch.autograd.Function):
    """shard -> full flat buffer; backward: the full gradient goes to the owner (into its ``GradSink``)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(shard: torch.Tensor, rec: GatheredUnit) -> torch.Tensor:
        if rec.state is UnitState.SHARDED:  # not prefetched
            rec.unshard()
        rec.wait_for_unshard()
        buffer = rec.parts[0].buffer
        assert buffer is not None
        return buffer if not rec.parts[0].in_place else buffer.view_as(buffer)

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.fsdp_fn_use = inputs[1]  # type: ignore[attr-defined]
        if not torch._C._are_functorch_transforms_active():  # (a transform's node is not in the loss's graph)
            inputs[1].node = ctx._sequence_nr()  # type: ignore[attr-defined]  # how the graph walk knows it reaches this use
        # The parameters' views send their gradients into the use's flat gradient and give
        # autograd none: backward gets None here, not a zero-filled full-size buffer.
        ctx.set_materialize_grads(False)

    @staticmethod
    @phased("post_backward")
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        rec: GatheredUnit = ctx.fsdp_fn_use
        if torch.is_grad_enabled():
            raise RuntimeError(
                "fsdp_fn: a second derivative (or a backward with create_graph=True) through the train step's "
                "lean gathering is not supported: its reduce-scatter is not differentiable; use apply_sharded or "
                "value_and_grad inside your transform (their gathers compose with every torch.func transform)"
            )
        # Only the parameters' views read the buffer, and they hand autograd no gradient: ``grad`` is None.
        rec.post_backward()
        shard = rec.shard
        # The gradient travels through the sink; autograd gets a zero that owns no memory.
        return torch.zeros((), dtype=shard.dtype, device=shard.device).expand(shard.shape), None


gather_unit = plain_apply(GatherUnit)

_AS_SOON_AS_READY = 2**64 - 1  # the sequence number autograd gives AccumulateGrad nodes


class _ParamView(torch.autograd.Function):
    """One parameter of a gathered use: a view into the flat buffer. Its backward writes the
    parameter's gradient into the use's flat gradient and returns none to autograd."""

    generate_vmap_rule = True

    @staticmethod
    def forward(flat: torch.Tensor, rec: GatheredUnit, index: int) -> torch.Tensor:
        return rec.parts[0].view(flat, index)

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.rec, ctx.index = inputs[1], inputs[2]  # type: ignore[attr-defined]
        ctx.set_materialize_grads(False)
        # Run as soon as the gradient is ready, as autograd runs AccumulateGrad: created before
        # the unit's ops, the node would otherwise wait for the unit's whole backward (the
        # engine runs ready nodes latest-created first), holding every parameter's gradient until then.
        ctx._set_sequence_nr(_AS_SOON_AS_READY)  # type: ignore[attr-defined]

    @staticmethod
    @phased("post_backward")
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[None, None, None]:
        if grad is not None:
            ctx.rec.add_grad(ctx.index, plain(grad))
        return None, None, None


def _plain_forward(
    ctx: Any,
    flat: torch.Tensor,
    rec: GatheredUnit,
    index: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    at: int,
    base: torch.Tensor | None,
) -> torch.Tensor:
    ctx.rec, ctx.index = rec, index
    ctx.set_materialize_grads(False)
    ctx._set_sequence_nr(_AS_SOON_AS_READY)
    return (flat if base is None else base).as_strided(shape, strides, at)


@phased("post_backward")
def _plain_backward(ctx: Any, grad: torch.Tensor | None) -> tuple[None, ...]:
    if grad is not None:
        ctx.rec.add_grad(ctx.index, grad)  # (made outside every transform: a plain tensor)
    return _NONES


_NONES = (None,) * 7


# ``_ParamView`` outside every transform (where a step makes one a parameter): an old-style twin
# whose forward is one ``as_strided`` of ``FlatPart.slots`` (``base``: the shard; else ``flat``).
_PlainParamView = type(
    "_ParamView",
    (torch.autograd.Function,),
    {"forward": staticmethod(_plain_forward), "backward": staticmethod(_plain_backward)},
)
_plain_param_view = super(torch.autograd.Function, _PlainParamView).apply  # type: ignore[misc]
# The graph walk (``LeanRuntime.finish_forward``) asks every Python node for the use it gathers:
# a parameter's view gathers none, and answers without raising an AttributeError first.
_PlainParamView._backward_cls.fsdp_fn_use = None  # type: ignore[attr-defined]
_ParamView._backward_cls.fsdp_fn_use = None  # type: ignore[attr-defined]
