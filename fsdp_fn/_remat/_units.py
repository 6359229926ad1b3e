"""``Remat``: which units a train step rematerialises, and what their forward keeps.

>>> Remat.of(True)
Remat(units=True, policy=SavePolicy(name='save_nothing', ops=frozenset()), every=1)
>>> Remat.of(None) is None
True
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from fsdp_fn._plan import ROOT, Plan, Policy, unit_label
from fsdp_fn._remat._policies import SavePolicy, save_nothing


@dataclass(frozen=True)
class Remat:
    """Which units a train step rematerialises, and what their forward keeps.

    A selected unit's forward keeps only its inputs (and what ``policy`` names); its
    backward recomputes it (``remat``). Lookups are never selected (a plain
    ``nn.Embedding`` saves only its indices: recomputing it saves nothing and would gather
    its table again in backward). Making one communicates nothing.

    Args:
        units: ``True`` for every non-root unit, or a policy with the auto-wrap signature
            ``(module, recurse, unwrapped_params, **kw) -> bool`` asked once per unit with
            ``recurse=False`` and the unit's parameter count.
        policy: the ``SavePolicy``: which intermediate results the forward keeps.
        every: of the selected units, in module order, rematerialise the first and then
            every ``every``-th (Hugging Face's ``every_n_layers``).

    Raises:
        TypeError: if ``units`` is neither ``True`` nor callable, or ``policy`` is not a
            ``SavePolicy``.
        ValueError: if ``every`` is not a positive int.
    """

    units: bool | Policy = True
    policy: SavePolicy = save_nothing
    every: int = 1

    def __post_init__(self) -> None:
        if self.units is not True and (isinstance(self.units, bool) or not callable(self.units)):
            raise TypeError(
                f"Remat.units must be True (every non-root unit) or a policy callable as "
                f"policy(module, recurse, unwrapped_params), got {self.units!r}; for no remat pass remat=None"
            )
        if not isinstance(self.policy, SavePolicy):
            raise TypeError(f"Remat.policy must be a SavePolicy (save_nothing, save_dots, ...), got {self.policy!r}")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"Remat.every must be a positive int, got {self.every!r}")

    @classmethod
    def of(cls, value: bool | Policy | Remat | None) -> Remat | None:
        """What ``train_step(remat=value)`` means.

        Args:
            value: ``None``/``False`` for none, ``True`` for every non-root unit, a unit
                policy, or a ``Remat``.

        Returns:
            The ``Remat`` (``value`` itself when it is one), or ``None`` for no remat.

        Raises:
            TypeError: if ``value`` is none of these.
        """
        if value is None or value is False:
            return None
        if isinstance(value, Remat):
            return value
        if value is True or callable(value):
            return cls(units=value)
        raise TypeError(
            f"remat must be None, True, a unit policy callable as policy(module, recurse, unwrapped_params), "
            f"or a Remat, got {type(value).__name__} {value!r}"
        )

    def selects(self, plan: Plan, module: nn.Module) -> frozenset[str]:
        """The names of the units to rematerialise (no communication, no allocation).

        Candidates are the non-root units named after a module (a shared tied parameter's
        own unit has no forward of its own) that are no lookup (``Unit.lookup``: nothing to
        recompute); a unit inside another selected unit is left out, since recomputing the
        outer one recomputes it. Then ``every`` thins them, in module order.

        Args:
            plan: the plan made for ``module``.
            module: the model whose submodules the units are.

        Returns:
            The names of the units to rematerialise, as a frozenset.

        Raises:
            ValueError: if a unit is not a submodule of ``module`` (a plan made for another
                model).
            TypeError: if the ``units`` policy returns something that is not a bool.
        """
        chosen = []
        for unit in plan.units:
            if unit.name == ROOT or unit.hooks or unit.lookup:
                continue
            try:
                sub = module.get_submodule(unit.modules[0])  # (a group's first module answers for it)
            except AttributeError as e:
                raise ValueError(
                    f"Remat: unit {unit_label(unit.name)} is not a submodule of {type(module).__name__}: "
                    "was the plan made for another model?"
                ) from e
            if not isinstance(self.units, bool):
                answer = self.units(sub, False, unit.numel + sum(p.numel for p in unit.frozen))
                if not isinstance(answer, bool):
                    raise TypeError(
                        f"Remat unit policy {getattr(self.units, '__qualname__', self.units)!r} returned "
                        f"{type(answer).__name__} {answer!r} for unit {unit_label(unit.name)}; it must return a bool"
                    )
                if not answer:
                    continue
            chosen.append(unit.name)
        outer = [n for n in chosen if not any(n.startswith(o + ".") for o in chosen)]
        return frozenset(outer[:: self.every])
