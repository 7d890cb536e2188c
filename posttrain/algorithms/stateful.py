"""State carried across steps for stateful registry entries (history-aware advantages, shapers).

An entry ``NAME`` of a module is stateful when the module also defines ``NAME_update_state(state,
rewards, ...) -> State`` (the contract of ``posttrain.algorithms``: state in, state out, no hidden
globals). The loop then passes ``state=`` to the entry and, after the step, advances the state with
this step's rewards (and ``lengths`` when the updater takes them). The state is part of the loop
state, so checkpoints hold it and a resumed run continues the same history.

Entropy regularizers use the same contract with the step's statistic in place of the rewards:
``NAME_update_state(state, entropy, ...)``, ``entropy`` the batch token-mean of the entropy the
entry regularizes (``posttrain.algorithms.entropy.measure``; AEnt's adaptive coefficient).

The recipe's ``*_params`` may hold the updater's keyword parameters too (``momentum``, ``eta``,
``window``, ...); :func:`split_params` sends each to its function (a name both declare, such as
AEnt's starting ``coef``, to both).
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, is_dataclass
from functools import partial
from types import ModuleType

from torch import Tensor


def updater(module: ModuleType, name: str) -> Callable[..., object] | None:
    """``module.<name>_update_state``, or ``None`` for a stateless entry."""
    fn = getattr(module, f"{name}_update_state", None)
    return fn if callable(fn) else None


def updater_params(module: ModuleType, name: str) -> list[str]:
    """Keyword-only parameters of the entry's updater (none for a stateless entry)."""
    fn = updater(module, name)
    if fn is None:
        return []
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY]


def split_params(module: ModuleType, name: str, params: Mapping[str, object]) -> tuple[dict, dict]:
    """(the entry's own parameters, the updater's keyword parameters); a name both declare goes to both."""
    upd = set(updater_params(module, name))
    entry = set(module.REGISTRY.params(name))
    own = {k: v for k, v in params.items() if k not in upd or k in entry}
    return own, {k: v for k, v in params.items() if k in upd}


def _state_class(fn: Callable[..., object]) -> type:
    """The ``State`` of the updater's ``state: State | None`` annotation."""
    hint = typing.get_type_hints(fn)["state"]
    return ([a for a in typing.get_args(hint) if a is not type(None)] or [hint])[0]


@dataclass
class EntryState:
    """The updater of one stateful entry, bound to its parameters, and the state's class."""

    update: partial
    state_cls: type
    inputs: tuple[str, ...]  # inputs the updater takes besides (state, rewards), e.g. ("lengths",)

    @classmethod
    def of(cls, module: ModuleType, name: str, params: Mapping[str, object]) -> EntryState | None:
        """The entry's updater bound to ``params`` (its keyword parameters), or ``None``."""
        fn = updater(module, name)
        if fn is None:
            return None
        positional = [
            p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD
        ]
        return cls(partial(fn, **params), _state_class(fn), tuple(positional[2:]))

    def load(self, saved: Mapping[str, object] | None) -> object | None:
        """The state object from its checkpointed form (``None``: no history yet)."""
        return None if saved is None else self.state_cls(**saved)

    def advance(self, state: object | None, rewards: Tensor | float, inputs: Mapping[str, Tensor]) -> dict:
        """Fold a step's rewards (an entropy regularizer: its batch entropy) into ``state``; returns the
        new state in its checkpointed form (a dict).
        """
        new = self.update(state, rewards, **{k: inputs[k] for k in self.inputs})
        return asdict(new) if is_dataclass(new) else dict(new)
