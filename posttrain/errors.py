"""Errors shared by modules that cannot import each other (the config imports the registries), and
the one "unknown name" message every registry and config check gives.
"""

import difflib


class ConfigError(ValueError):
    """A recipe or override is invalid; the message says which key and what is allowed."""


class RankError(RuntimeError):
    """A learner rank (``train.processes > 1``) died or raised; the message says which, how, and how to resume."""


def unknown_name(key: str, kind: str, name: str, choices: list[str]) -> str:
    """The error for a name that is not a registry entry: the key, the name, the closest choice
    ("did you mean") and every choice.
    """
    close = difflib.get_close_matches(name, [str(c) for c in choices], n=1)
    hint = f" did you mean {close[0]!r}?" if close else ""
    return f"{key}: unknown {kind} {name!r};{hint} choices: {choices}"
