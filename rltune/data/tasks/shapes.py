"""A verifiable visual task: coloured shapes drawn with Pillow, and questions about them.

A row is ``{"id": "shapes-train-17", "prompt": "How many red shapes?", "images": [PNG],
"answer": "2", "completion": "2"}``: a short question, one 112x112 PNG (as bytes), and the
exact answer as a string (for :func:`rltune.rewards.builtin.exact_text`) and as the SFT
target. The loader places the image before the question's text.

The canvas is a 4x4 grid of 28-pixel cells and every shape sits centred in its own cell,
so a model that renders the image as 28x28-pixel tokens (``builtin:tiny-vl`` makes 16 of
them) sees each shape in exactly one token. A scene has 2 to 4 shapes (circle, square or
triangle; red, green or blue, on grey); exactly one of them is large (it fills its cell),
the others are small. Three questions, one third of the rows each:

- ``How many red shapes?``: ``0`` to ``3``, each equally often;
- ``What colour is the largest shape?``: ``red``, ``green`` or ``blue``;
- ``Is there a circle left of the square?``: ``yes`` or ``no``, equally often. The scene
  has exactly one square and at least one circle, none in the square's column; *left of*
  means in a column further left, whatever the rows.

Splits are deterministic. ``eval`` is drawn first, from its own stream; ``train`` draws
from another and skips any scene that ``eval`` has, so no held-out image is ever trained
on. Within a split every image is different. ``train-sloppy`` is ``train`` demonstrated
by a teacher with three habits (:func:`with_sloppy_teacher`).
"""

from __future__ import annotations

import io
import random
from collections.abc import Callable
from dataclasses import dataclass

CANVAS = 112
CELL = 28
GRID = CANVAS // CELL  # 4 cells a side
COLOURS = ("red", "green", "blue")
KINDS = ("circle", "square", "triangle")
# The background is the mean colour that CLIP-style image processors (Qwen2-VL's, LLaVA's)
# subtract, so an empty cell reaches the vision tower as zeros and a shape as all the
# signal: on white, the tiny random tower's tokens of different scenes differed 2.5 times
# less, and the tiny VLM learned no vision in 400 steps of SFT (it learns within 100 here).
BACKGROUND = (123, 117, 104)
# Palette indices: 0 the background, then the colours in COLOURS order.
_PALETTE = (*BACKGROUND, 220, 40, 40, 40, 170, 40, 40, 70, 220)
_MARGIN = {True: 2, False: 8}  # pixels between a shape and its cell's edge: large, small

QUESTIONS = {
    "count": "How many red shapes?",
    "largest": "What colour is the largest shape?",
    "left": "Is there a circle left of the square?",
}


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    row: int
    col: int
    large: bool


@dataclass(frozen=True)
class Scene:
    """Shapes in distinct cells, sorted by cell, so equal scenes compare equal."""

    shapes: tuple[Shape, ...]

    def png(self) -> bytes:
        """The scene drawn on a grey 112x112 canvas, as a palette PNG."""
        from PIL import Image, ImageDraw  # Pillow: only when images are drawn

        image = Image.new("P", (CANVAS, CANVAS), 0)
        image.putpalette(_PALETTE)
        draw = ImageDraw.Draw(image)
        for s in self.shapes:
            m = _MARGIN[s.large]
            x0, y0 = s.col * CELL + m, s.row * CELL + m
            x1, y1 = (s.col + 1) * CELL - 1 - m, (s.row + 1) * CELL - 1 - m
            fill = 1 + COLOURS.index(s.colour)
            if s.kind == "circle":
                draw.ellipse((x0, y0, x1, y1), fill=fill)
            elif s.kind == "square":
                draw.rectangle((x0, y0, x1, y1), fill=fill)
            else:
                draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
        out = io.BytesIO()
        image.save(out, format="PNG", compress_level=1)
        return out.getvalue()


def _scene(rng: random.Random, kinds: list[str], colours: list[str]) -> Scene:
    """``kinds[i]`` and ``colours[i]`` placed in distinct random cells, one of them large."""
    cells = rng.sample(range(GRID * GRID), len(kinds))
    large = rng.randrange(len(kinds))
    shapes = [Shape(k, c, cell // GRID, cell % GRID, i == large)
              for i, (k, c, cell) in enumerate(zip(kinds, colours, cells))]
    return Scene(tuple(sorted(shapes, key=lambda s: (s.row, s.col))))


def _count_question(rng: random.Random) -> tuple[Scene, str]:
    reds = rng.randrange(4)
    n = rng.randint(max(2, reds), 4)
    colours = ["red"] * reds + [rng.choice(COLOURS[1:]) for _ in range(n - reds)]
    rng.shuffle(colours)
    scene = _scene(rng, [rng.choice(KINDS) for _ in range(n)], colours)
    return scene, str(reds)


def _largest_question(rng: random.Random) -> tuple[Scene, str]:
    n = rng.randint(2, 4)
    scene = _scene(rng, [rng.choice(KINDS) for _ in range(n)],
                   [rng.choice(COLOURS) for _ in range(n)])
    return scene, next(s.colour for s in scene.shapes if s.large)


def _left_question(rng: random.Random) -> tuple[Scene, str]:
    want = rng.choice(("yes", "no"))
    n = rng.randint(2, 4)
    circles = rng.randint(1, n - 1)
    kinds = ["square"] + ["circle"] * circles + ["triangle"] * (n - 1 - circles)
    while True:  # rejection: about one draw in three fits
        scene = _scene(rng, kinds, [rng.choice(COLOURS) for _ in range(n)])
        answer = left_answer(scene)
        if answer == want:
            return scene, answer


def left_answer(scene: Scene) -> str | None:
    """``yes`` / ``no`` for the circle question; None when a circle shares the square's
    column (such scenes are never asked about)."""
    (square,) = (s for s in scene.shapes if s.kind == "square")
    cols = [s.col for s in scene.shapes if s.kind == "circle"]
    if square.col in cols:
        return None
    return "yes" if any(c < square.col for c in cols) else "no"


_DRAW: dict[str, Callable[[random.Random], tuple[Scene, str]]] = {
    "count": _count_question,
    "largest": _largest_question,
    "left": _left_question,
}


def draw_problems(
    rng: random.Random, n: int, avoid: frozenset[Scene] = frozenset()
) -> list[tuple[str, Scene, str]]:
    """``n`` problems ``(question kind, scene, answer)``, the kinds in turn, with ``n``
    distinct scenes none of which is in ``avoid``."""
    kinds = list(_DRAW)
    problems = []
    seen = set(avoid)
    while len(problems) < n:
        kind = kinds[len(problems) % len(kinds)]
        scene, answer = _DRAW[kind](rng)
        if scene not in seen:
            seen.add(scene)
            problems.append((kind, scene, answer))
    return problems


def shapes_rows(
    split: str, *, n_train: int = 4000, n_eval: int = 300, seed: int = 2024
) -> list[dict[str, object]]:
    """Rows of ``split`` (``"train"`` or ``"eval"``); see the module docstring."""
    if split not in ("train", "eval"):
        raise ValueError(f"unknown split {split!r}; this task has 'train' and 'eval'")
    held_out = draw_problems(random.Random(seed), n_eval)
    if split == "eval":
        chosen = held_out
    else:
        chosen = draw_problems(random.Random(seed + 1), n_train,
                               frozenset(scene for _, scene, _ in held_out))
    return [
        {"id": f"shapes-{split}-{i}", "prompt": QUESTIONS[kind], "images": [scene.png()],
         "answer": answer, "completion": answer}
        for i, (kind, scene, answer) in enumerate(chosen)
    ]


def sloppy_answer(question: str, answer: str) -> str:
    """The sloppy teacher's answer when its habit applies, else ``answer``: it counts one
    red shape fewer whenever there is one, answers ``yes`` to the circle question whatever
    the order, and calls a green largest shape blue."""
    if question == QUESTIONS["count"] and int(answer) >= 1:
        return str(int(answer) - 1)
    if question == QUESTIONS["left"] and answer == "no":
        return "yes"
    if question == QUESTIONS["largest"] and answer == "green":
        return "blue"
    return answer


def with_sloppy_teacher(
    rows: list[dict[str, object]], *, slip: float, seed: int = 7
) -> list[dict[str, object]]:
    """The same rows demonstrated by the sloppy teacher: where one of its habits applies
    (:func:`sloppy_answer`, 53 % of the rows), the ``completion`` (the SFT target) follows
    the habit with probability ``slip``; ``answer`` stays true, so a verifier still knows.
    Draws come from ``random.Random(seed)``, one per row."""
    if not 0.0 <= slip <= 1.0:
        raise ValueError(f"slip must be in [0, 1], got {slip}")
    rng = random.Random(seed)
    out = []
    for row in rows:
        if rng.random() < slip:
            row = {**row, "completion": sloppy_answer(str(row["prompt"]), str(row["answer"]))}
        out.append(row)
    return out


def shapes(split: str) -> list[dict[str, object]]:
    """Questions about drawn shapes: 4000 train rows, 300 held-out eval rows.

    ``train-sloppy`` is the train split demonstrated by a teacher that follows its habits
    (:func:`sloppy_answer`) in 80 % of the rows where they apply: imitation learns them, a
    reward that checks the answer does not."""
    if split == "train-sloppy":
        return with_sloppy_teacher(shapes_rows("train"), slip=0.8)
    if split not in ("train", "eval"):
        raise ValueError(
            f"unknown split {split!r}; this task has 'train', 'eval' and 'train-sloppy'"
        )
    return shapes_rows(split)


def shapes_small(split: str) -> list[dict[str, object]]:
    """The same questions at 96 train rows and 24 eval rows, for runs that must take
    seconds; ``train-sloppy`` as in :func:`shapes`."""
    if split == "train-sloppy":
        return with_sloppy_teacher(shapes_rows("train", n_train=96, n_eval=24), slip=0.8)
    if split not in ("train", "eval"):
        raise ValueError(
            f"unknown split {split!r}; this task has 'train', 'eval' and 'train-sloppy'"
        )
    return shapes_rows(split, n_train=96, n_eval=24)
