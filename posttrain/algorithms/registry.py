"""The one registry helper used by every point of the loop.

A :class:`Registry` maps a name to one function. Registering a name twice is an error (two
methods silently shadowing each other is the bug this prevents), and looking up an unknown name
raises a ``KeyError`` whose message lists the valid names, so a typo in a recipe is caught with a
useful message.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable[..., object])

# The plugin being imported (posttrain/plugins.py pushes its path while it runs the user's module), so that
# every entry it registers records where it came from: `posttrain algorithms` marks it, a clash names it.
LOADING: list[str] = []
ALL: list[Registry] = []  # every registry, so that a plugin that failed halfway can be taken out of all


def origin_of(fn: object) -> str | None:
    """Where an entry being registered now comes from: ``None`` for posttrain's own (built-in), else the plugin
    being imported, else the module of the user's function (a script's ``__main__``).
    """
    module = getattr(fn, "__module__", None) or ""
    if module == "posttrain" or module.startswith("posttrain."):  # a built-in, even one a plugin's import loads
        return None
    return LOADING[-1] if LOADING else module or None


def clash_message(kind: str, name: str, new: str | None, old: str | None, old_fn: object) -> str:
    """The error for a name registered twice: who registers it now, and who had it (a built-in, with its
    module, or a plugin), so that a user's clash says which built-in it hides.
    """
    where = f"{getattr(old_fn, '__module__', '?')}.{getattr(old_fn, '__qualname__', '?')}"
    had = f"the {kind} {name!r} registered by {old}" if old else f"the built-in {kind} {name!r} ({where})"
    if new is None and old is None:
        return f"{kind} {name!r} is already registered ({where})"
    return f"{kind} {name!r} from {new or 'posttrain'} clashes with {had}; give yours another name"


class UnknownNameError(KeyError):
    """Raised when a registry has no entry of the requested name."""

    def __init__(self, kind: str, name: str, choices: list[str]) -> None:
        close = difflib.get_close_matches(name, choices, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        self.kind, self.name, self.choices = kind, name, choices
        super().__init__(f"unknown {kind} {name!r}.{hint} Choices: {', '.join(choices)}")

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


@dataclass(frozen=True)
class Traits:
    """What an entry declares, at registration, that it needs and what it cannot run with.

    ``config/checks.py`` reads the traits of every entry a run chooses and applies one generic check, so a
    method never adds a rule to the config: it declares its traits here. Every field's default is the
    permissive one, so an entry that declares nothing runs everywhere.
    """

    async_safe: bool = True  # False: needs what only the learner's current step has (rollout.max_staleness = 0)
    row_coupled: bool = False  # a row's term depends on other rows of its minibatch: no micro-batches
    aggregation: str | None = None  # the only loss aggregation under which its paper's objective holds
    replays_rows: bool = False  # (batch selectors) trains on rows stored from earlier steps
    plans_minibatches: bool = False  # (batch selectors) draws its own minibatches, which may cut a group's rows apart
    replayable: bool = True  # False: keeps per-row state that rows stored for replay lose
    drivers: tuple[str, ...] | None = None  # runs only with these rollout drivers (None: any)
    engines: tuple[str, ...] | None = None  # runs only with these rollout engines (None: any)
    reads_behaviour: bool = False  # reads the sampler's log-probs mu of every row
    external_rows: bool = False  # (drivers) puts rows in a group that no sampler drew (no behaviour log-probs)
    one_process: bool = False  # runs only in one process on the full model (no ranks, LoRA, Ray, other engines)
    needs_critic: bool = False  # reads a value model's V(s_t): the loop builds the critic
    note: str = ""  # why, in a few words, for the error message when a trait refuses a setting


class Registry(Generic[F]):
    """Name -> function table for one kind of part (advantage, loss, ...)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}
        self._traits: dict[str, Traits] = {}
        self._origins: dict[str, str] = {}  # user entries only: name -> plugin file or module
        ALL.append(self)

    def register(self, name: str, **traits: object) -> Callable[[F], F]:
        """Return a decorator that registers ``fn`` under ``name`` with its :class:`Traits`; a duplicate
        name, or a trait :class:`Traits` does not have, raises ``ValueError``.
        """
        known = {f.name for f in fields(Traits)}
        unknown = sorted(set(traits) - known)
        if unknown:
            raise ValueError(f"{self.kind} {name!r}: unknown trait(s) {unknown}; traits: {sorted(known)}")
        declared = Traits(**traits)  # type: ignore[arg-type]

        def deco(fn: F) -> F:
            origin = origin_of(fn)
            if name in self._entries:
                old = self._entries[name]
                raise ValueError(clash_message(self.kind, name, origin, self._origins.get(name), old))
            self._entries[name] = fn
            self._traits[name] = declared
            if origin is not None:
                self._origins[name] = origin
            return fn

        return deco

    def origin(self, name: str) -> str | None:
        """Where entry ``name`` came from: a plugin's path or a user module (``None``: built-in)."""
        return self._origins.get(name)

    def unregister(self, name: str) -> None:
        """Remove a user's entry (the reward callables that ``posttrain.train(rewards=...)`` lends for one
        run); a built-in cannot be removed.
        """
        if name in self._entries and name not in self._origins:
            raise ValueError(f"{self.kind} {name!r} is built in; only a user's entries can be unregistered")
        self._entries.pop(name, None)
        self._traits.pop(name, None)
        self._origins.pop(name, None)

    def traits(self, name: str) -> Traits:
        """What entry ``name`` declared at registration (:class:`Traits`; the permissive defaults for an entry
        put in the table without :meth:`register`, as tests do); unknown names list the choices.
        """
        self.get(name)
        return self._traits.get(name, Traits())

    def get(self, name: str) -> F:
        """Return the function registered as ``name``; unknown names list the choices."""
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownNameError(self.kind, name, self.names()) from None

    def names(self) -> list[str]:
        """Sorted registered names."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def summary(self, name: str) -> str:
        """First line of the entry's docstring (for ``posttrain algorithms``)."""
        doc = inspect.getdoc(self.get(name)) or ""
        return doc.splitlines()[0] if doc else ""

    def doc(self, name: str) -> str:
        """Full docstring of the entry."""
        return inspect.getdoc(self.get(name)) or ""

    def required(self, name: str) -> list[str]:
        """Keyword-only parameters without a default: the inputs the entry cannot run without."""
        sig = inspect.signature(self.get(name))
        return [p.name for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY and p.default is p.empty]

    def check_params(self, name: str, params: Mapping[str, object]) -> None:
        """Raise ``TypeError`` for parameters entry ``name`` does not declare or required inputs it lacks."""
        accepted = self.params(name)
        bad = [k for k in params if k not in accepted]
        if bad:
            raise TypeError(f"{self.kind} {name!r} got unknown parameter(s) {bad}; it accepts {accepted}")
        missing = [k for k in self.required(name) if k not in params]
        if missing:
            raise TypeError(f"{self.kind} {name!r} needs input(s) {missing} passed by keyword")

    def declared(self, name: str, kwargs: Mapping[str, object]) -> dict[str, object]:
        """The subset of ``kwargs`` entry ``name`` declares (for registries whose callers pass every input)."""
        accepted = set(self.params(name))
        return {k: v for k, v in kwargs.items() if k in accepted}

    def default(self, name: str, param: str, fallback: object = None) -> object:
        """The default of keyword parameter ``param`` of entry ``name``; ``fallback`` when it has none."""
        p = inspect.signature(self.get(name)).parameters.get(param)
        return fallback if p is None or p.default is inspect.Parameter.empty else p.default

    def params(self, name: str) -> list[str]:
        """Keyword parameter names the entry accepts."""
        sig = inspect.signature(self.get(name))
        return [p.name for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY]
