"""Rematerialisation (activation checkpointing) that runs inside ``torch.func`` transforms.

``remat(fn)`` is ``jax.checkpoint`` for PyTorch: the forward keeps only ``fn``'s inputs
(and what the saving policy names); the backward runs ``fn`` again, with the random
number generators replayed, and differentiates the recomputation with ``torch.func.vjp``.
It is an ``autograd.Function`` with a separate ``setup_context``, so it needs no
saved-tensor hooks, which ``torch.func.grad``/``vjp`` refuse (and with them
``torch.utils.checkpoint``). ``route_torch_checkpoint()`` sends
``torch.utils.checkpoint.checkpoint`` calls through it. ``Remat`` is the value a train
step takes: which units to rematerialise and what to save.

The rooms, one concern each: ``_policies`` (``SavePolicy``, ``save_nothing``, ``save_dots``),
``_modes`` (the forward recorded, the recomputation checked and replayed), ``_early_stop``
(the tail no backward reads, left out), ``_function`` (the ``autograd.Function`` and
``remat``), ``_state`` (a module's parameters and buffers as region inputs), ``_units``
(``Remat``), ``_routing`` (``torch.utils.checkpoint`` routed, process-wide), ``_errors``
(``RematError``).
"""

from fsdp_fn._remat._errors import RematError
from fsdp_fn._remat._function import remat
from fsdp_fn._remat._policies import SavePolicy, save_dots, save_nothing
from fsdp_fn._remat._routing import route_torch_checkpoint
from fsdp_fn._remat._units import Remat

__all__ = ["Remat", "RematError", "SavePolicy", "remat", "route_torch_checkpoint", "save_dots", "save_nothing"]
