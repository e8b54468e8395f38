"""Built-in tasks, addressed as ``builtin:TASK/SPLIT`` in ``data.train`` / ``data.eval``.

Each entry maps a split name to rows shaped like jsonl rows (``id``, ``prompt``,
``answer``, ``completion``), so built-in data goes through the same validation as files.
An unknown split raises ValueError naming the splits the task has.

======================  ===================================================  ===========
task                    problems                                             rows
======================  ===================================================  ===========
``arith``               ``a+b=``, operands 0..99                             train 4000,
                                                                             eval 300
``arith_small``         ``a+b=``, operands 0..9                              train 80,
                                                                             eval 10
``arith_prefs``         preference pairs over ``arith``'s problems: chosen   train 4000,
                        the sum, rejected a plausible mistake (dropped       eval 300
                        carry, off by one, swapped digits)
``lookup``              ``code of NAME?``, the code only in a document       train 240,
                        store (for the search tool; ``train-demo`` has       eval 60
                        demonstrations for a warm-up)
``shapes``              a 112x112 PNG of coloured shapes and a question      train 4000,
                        about it (how many red, the largest one's colour,    eval 300
                        a circle left of the square?); ``train-sloppy`` has
                        a sloppy teacher's demonstrations
``shapes_small``        the same questions, fewer rows                       train 96,
                                                                             eval 24
======================  ===================================================  ===========

Rows of the visual tasks carry their images as PNG bytes in an ``images`` field.

Preference tasks have ``chosen`` and ``rejected`` instead of ``completion``; load them
with ``load_prompts(..., with_pairs=True)``.
"""

from __future__ import annotations

from typing import Any, Callable

from rltune.data.tasks.arith import arith, arith_small
from rltune.data.tasks.arith_prefs import arith_prefs
from rltune.data.tasks.lookup import lookup
from rltune.data.tasks.shapes import shapes, shapes_small

TASKS: dict[str, Callable[[str], list[dict[str, Any]]]] = {
    "arith": arith,
    "arith_small": arith_small,
    "arith_prefs": arith_prefs,
    "lookup": lookup,
    "shapes": shapes,
    "shapes_small": shapes_small,
}
