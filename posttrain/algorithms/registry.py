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
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable[..., object])


class UnknownNameError(KeyError):
    """Raised when a registry has no entry of the requested name."""

    def __init__(self, kind: str, name: str, choices: list[str]) -> None:
        close = difflib.get_close_matches(name, choices, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        self.kind, self.name, self.choices = kind, name, choices
        super().__init__(f"unknown {kind} {name!r}.{hint} Choices: {', '.join(choices)}")

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


class Registry(Generic[F]):
    """Name -> function table for one kind of part (advantage, loss, ...)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Return a decorator that registers ``fn`` under ``name``; a duplicate name raises ``ValueError``."""

        def deco(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = fn
            return fn

        return deco

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

    def params(self, name: str) -> list[str]:
        """Keyword parameter names the entry accepts."""
        sig = inspect.signature(self.get(name))
        return [p.name for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY]
