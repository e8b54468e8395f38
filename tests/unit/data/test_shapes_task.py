"""builtin:shapes: scenes, answers, splits and the sloppy teacher, checked against the
pixels drawn and against hand-built scenes."""

from __future__ import annotations

import io
import random
from collections import Counter

import pytest
from PIL import Image

from rltune.data.tasks import TASKS
from rltune.data.tasks.shapes import (
    BACKGROUND,
    CELL,
    COLOURS,
    QUESTIONS,
    Scene,
    Shape,
    draw_problems,
    left_answer,
    shapes_rows,
    sloppy_answer,
    with_sloppy_teacher,
)

# The palette's RGB of each colour.
RGB = {"red": (220, 40, 40), "green": (40, 170, 40), "blue": (40, 70, 220)}


def _pixels(png: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(png))
    assert image.size == (112, 112)
    return image.convert("RGB")


def _cell_colours(image: Image.Image) -> dict[tuple[int, int], tuple[str, int]]:
    """``(row, col) -> (colour, pixel count)`` of every non-empty 28x28 cell."""
    found = {}
    for r in range(4):
        for c in range(4):
            counts = Counter(image.getpixel((c * CELL + x, r * CELL + y))
                             for x in range(CELL) for y in range(CELL))
            counts.pop(BACKGROUND, None)
            if counts:
                rgb, n = counts.most_common(1)[0]
                (name,) = (k for k, v in RGB.items() if v == rgb)
                found[(r, c)] = (name, sum(counts.values()))
    return found


@pytest.fixture(scope="module")
def train():
    return TASKS["shapes"]("train")


@pytest.fixture(scope="module")
def held_out():
    return TASKS["shapes"]("eval")


def test_sizes_fields_and_balance(train, held_out):
    assert (len(train), len(held_out)) == (4000, 300)
    row = train[0]
    assert set(row) == {"id", "prompt", "images", "answer", "completion"}
    assert row["id"] == "shapes-train-0" and row["completion"] == row["answer"]
    assert isinstance(row["images"], list) and row["images"][0][:8] == b"\x89PNG\r\n\x1a\n"
    answers = Counter((r["prompt"], r["answer"]) for r in held_out)
    # the kinds take turns: 100 eval rows each; counts 0..3 and yes/no equally likely
    assert sum(v for (q, _), v in answers.items() if q == QUESTIONS["count"]) == 100
    train_answers = Counter((r["prompt"], r["answer"]) for r in train)
    for a in "0123":
        assert 280 < train_answers[(QUESTIONS["count"], a)] < 390, train_answers
    for a in ("yes", "no"):
        assert 600 < train_answers[(QUESTIONS["left"], a)] < 730, train_answers
    for a in COLOURS:
        assert 390 < train_answers[(QUESTIONS["largest"], a)] < 500, train_answers


def test_answers_agree_with_the_pixels(train):
    """Counting red cells and finding the biggest blot in the drawn image gives the
    row's answer: the answer is about the picture, not only about the scene record."""
    for row in train[:60]:
        cells = _cell_colours(_pixels(row["images"][0]))
        assert 2 <= len(cells) <= 4
        if row["prompt"] == QUESTIONS["count"]:
            assert row["answer"] == str(sum(c == "red" for c, _ in cells.values()))
        elif row["prompt"] == QUESTIONS["largest"]:
            sizes = sorted((n, c) for c, n in cells.values())
            assert sizes[-1][0] > 2 * sizes[-2][0]  # one large shape, the others small
            assert row["answer"] == sizes[-1][1]


def test_left_of_by_hand():
    def scene(*shapes: tuple[str, int, int]) -> Scene:
        return Scene(tuple(Shape(k, "red", r, c, False) for k, r, c in shapes))

    assert left_answer(scene(("circle", 3, 0), ("square", 0, 1))) == "yes"  # rows do not matter
    assert left_answer(scene(("square", 1, 1), ("circle", 1, 2))) == "no"
    assert left_answer(scene(("circle", 0, 3), ("square", 2, 2), ("circle", 1, 0))) == "yes"
    assert left_answer(scene(("square", 0, 2), ("circle", 3, 2))) is None  # same column


def test_splits_are_deterministic_and_disjoint(train, held_out):
    assert TASKS["shapes"]("eval") == held_out
    eval_images = {r["images"][0] for r in held_out}
    assert len(eval_images) == 300
    assert not eval_images & {r["images"][0] for r in train}


def test_avoided_scenes_are_skipped():
    """Drawing again from the same stream while avoiding what it drew first gives none of
    those scenes (train avoids eval's scenes this way)."""
    first = draw_problems(random.Random(3), 30)
    avoid = frozenset(scene for _, scene, _ in first)
    again = draw_problems(random.Random(3), 30, avoid)
    assert not avoid & {scene for _, scene, _ in again}
    assert len({scene for _, scene, _ in again}) == 30


@pytest.mark.parametrize(
    ("question", "answer", "sloppy"),
    [
        (QUESTIONS["count"], "0", "0"), (QUESTIONS["count"], "1", "0"),
        (QUESTIONS["count"], "2", "1"), (QUESTIONS["count"], "3", "2"),
        (QUESTIONS["left"], "no", "yes"), (QUESTIONS["left"], "yes", "yes"),
        (QUESTIONS["largest"], "green", "blue"), (QUESTIONS["largest"], "red", "red"),
        (QUESTIONS["largest"], "blue", "blue"),
    ],
)
def test_the_teachers_habits(question, answer, sloppy):
    assert sloppy_answer(question, answer) == sloppy


def test_the_sloppy_split(train):
    sloppy = TASKS["shapes"]("train-sloppy")
    assert [(r["id"], r["answer"], r["images"]) for r in sloppy] == [
        (r["id"], r["answer"], r["images"]) for r in train
    ]
    applies = [r for r in train if sloppy_answer(r["prompt"], r["answer"]) != r["answer"]]
    wrong = sum(s["completion"] != s["answer"] for s in sloppy)
    # the habits apply to 19/36 = 53 % of the rows (counts 1-3: 1/4, "no": 1/6, green: 1/9)
    assert 0.49 < len(applies) / len(train) < 0.57
    assert wrong / len(applies) == pytest.approx(0.8, abs=0.03)
    assert all(s["completion"] in (r["answer"], sloppy_answer(r["prompt"], r["answer"]))
               for s, r in zip(sloppy, train))


def test_slip_bounds_and_unknown_split():
    assert with_sloppy_teacher([], slip=1.0) == []
    with pytest.raises(ValueError, match="slip"):
        with_sloppy_teacher([], slip=1.5)
    with pytest.raises(ValueError, match="'train', 'eval' and 'train-sloppy'"):
        TASKS["shapes"]("test")


def test_the_small_task_is_the_big_ones_first_eval_rows(held_out):
    small = TASKS["shapes_small"]("eval")
    assert len(small) == 24 and len(TASKS["shapes_small"]("train")) == 96
    assert [r["images"] for r in small] == [r["images"] for r in held_out[:24]]


def test_rows_are_drawn_by_their_own_stream():
    """The rows do not depend on the global random state."""
    random.seed(0)
    a = shapes_rows("eval", n_eval=6)
    random.seed(1)
    assert shapes_rows("eval", n_eval=6) == a
