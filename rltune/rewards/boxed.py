"""The one reader of ``\\boxed{...}``, the box a maths answer is written in. Used by
``builtin:exact_numeric`` and ``builtin:math_answer`` alike."""

from __future__ import annotations

import re

# `\boxed`, optional spaces, then the opening brace; `\boxedx` is another command.
_BOX_OPENING = re.compile(r"\\boxed\s*\{")


def last_boxed(text: str) -> str | None:
    """The content of the last closed ``\\boxed{...}`` in ``text`` (nested braces kept
    whole), or None when there is none.

    "Last" is the box that opens last: in ``\\boxed{1} then \\boxed{2}`` it is ``2``, and
    in ``\\boxed{\\boxed{5}}`` the inner ``5``. A box whose brace is never closed is
    skipped, so ``\\boxed{3} and \\boxed{4`` gives ``3``. Braces are counted as written
    (``\\{`` counts too). One pass over the text: a completion of many unclosed boxes
    costs no more than its length.
    """
    box_braces = {match.end() - 1 for match in _BOX_OPENING.finditer(text)}
    if not box_braces:
        return None
    open_braces: list[int] = []
    last: tuple[int, int] | None = None
    for index, char in enumerate(text):
        if char == "{":
            open_braces.append(index)
        elif char == "}" and open_braces:
            start = open_braces.pop()
            if start in box_braces and (last is None or start > last[0]):
                last = (start, index)
    return None if last is None else text[last[0] + 1 : last[1]]
