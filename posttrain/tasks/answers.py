r"""Reading a final answer out of a completion: the last ``\boxed{...}``. Tasks check their answers with it,
and the ``math`` reward (``rewards/math.py``) starts its extraction with it.
"""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOXED_BARE = re.compile(r"\\boxed\s+([^\s$]+)")  # \boxed 5 (no braces)


def last_boxed(text: str) -> str | None:
    r"""Content of the last complete ``\boxed{...}`` / ``\fbox{...}`` (balanced braces), else ``None``.

    Escaped braces ``\{`` ``\}`` (set notation) do not count towards the balance. An unclosed
    last box (a truncated completion) is skipped for the one before it. ``\boxed 5`` (no braces)
    counts when it comes after every braced box.
    """
    best: tuple[int, str] | None = None
    for m in reversed(list(_BOXED.finditer(text))):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            if text[i] == "\\":  # \{ and \} are literal braces, not grouping
                i += 2
                continue
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            best = (m.start(), text[m.end() : i - 1].strip())
            break
    bare = list(_BOXED_BARE.finditer(text))
    if bare and (best is None or bare[-1].start() > best[0]):
        return bare[-1].group(1)
    return best[1] if best else None
