"""A visual task a tiny vision-language model can learn: count the shapes in a picture, or name a colour.

Rows are TRL's VLM GRPO format: a chat ``prompt`` whose user turn holds an ``{"type": "image"}`` part and
the question, an ``image`` column (an RGB ``PIL.Image``) and the ``answer``. Pictures are drawn with
``PIL.ImageDraw`` (no anti-aliasing: every pixel is the background or one shape's colour) from a private
RNG, so the same call gives the same pixels.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from PIL import Image, ImageDraw

from rlkit.tasks.arith import first_number
from rlkit.tasks.base import Rows, aligned_column, check_n, check_split, completion_text, rng_for, split_of

# Colour words and their fills: far apart from each other and from the white background.
COLORS = {"red": (220, 30, 30), "green": (30, 150, 50), "blue": (40, 70, 220), "yellow": (230, 180, 0),
          "purple": (140, 50, 170)}
KINDS = ("square", "circle", "triangle")
QUESTIONS = ("count", "color")
BACKGROUND = (255, 255, 255)
GAP = 2  # px of background kept between any two shapes' boxes (and 1 px at the picture's edges)
_AREA = {"square": 1.0, "circle": math.pi / 4, "triangle": 0.5}  # filled area / side**2
_WORD = re.compile(r"[a-z]+")


def _fits(box: tuple[int, int, int], boxes: list[tuple[int, int, int]]) -> bool:
    """Whether square box (x, y, side) keeps GAP px from every box already placed."""
    x, y, s = box
    return all(x + s + GAP <= bx or bx + bs + GAP <= x or y + s + GAP <= by or by + bs + GAP <= y
               for bx, by, bs in boxes)


def draw_scene(scene: Sequence[dict], size: int) -> Image.Image:
    """The picture of a scene (``[{"kind", "color", "x", "y", "side"}, ...]``) on a white square.

    >>> draw_scene([{"kind": "circle", "color": "red", "x": 1, "y": 1, "side": 9}], size=16).getpixel((5, 5))
    (220, 30, 30)
    """
    img = Image.new("RGB", (size, size), BACKGROUND)
    pen = ImageDraw.Draw(img)
    for shape in scene:
        x, y, s, fill = shape["x"], shape["y"], shape["side"], COLORS[shape["color"]]
        if shape["kind"] == "square":
            pen.rectangle([x, y, x + s - 1, y + s - 1], fill=fill)
        elif shape["kind"] == "circle":
            pen.ellipse([x, y, x + s - 1, y + s - 1], fill=fill)
        else:  # an isosceles triangle, apex up
            pen.polygon([(x + (s - 1) // 2, y), (x, y + s - 1), (x + s - 1, y + s - 1)], fill=fill)
    return img


@dataclass(frozen=True)
class Shapes:
    """Pictures of 1 to 3 filled squares, circles and triangles; the question asks how many, or a colour.

    Each picture is ``size`` x ``size`` px, white, with ``min_shapes`` to ``max_shapes`` shapes that don't
    touch (at least 2 px apart), each ``size // 6`` to ``size // 3`` px wide, in the colours of ``COLORS``.

    - ``question="count"``: "How many shapes are in the picture?"; the answer is the number, e.g. ``"2"``.
      ``reward`` is 1.0 if the first integer in the completion (cut at eos) is the answer, else 0.0.
    - ``question="color"``: "What color is the largest shape?" (or "the shape" if ``max_shapes == 1``);
      the shapes have distinct colours, the largest covers at least 1.5x the area of any other, and the
      answer is its colour word. ``reward`` is 1.0 if the first colour word in the completion is it.

    Expected reward of random guessing (uniform over the possible answers, which are equally likely):
    ``1 / (max_shapes - min_shapes + 1)`` for "count" (1/3 by default) and ``1 / len(COLORS)`` = 0.2
    for "color"; always giving the same answer scores the same. Replies without a number (or colour
    word), and number words such as "two", score 0.

    Train and test never share a picture: each scene's split is fixed by a stable hash of its
    description (shapes, colours, positions, sizes; ``test_fraction`` of scenes to test), whatever the
    seeds. ``system`` adds a system message before the user turn.

    >>> task = Shapes()
    >>> row = task(n=2, seed=0)[0]
    >>> sorted(row), row["image"].size, row["image"].mode, row["answer"] in ("1", "2", "3")
    (['answer', 'image', 'prompt', 'question', 'scene'], (56, 56), 'RGB', True)
    >>> row["prompt"][0]["content"][0], row["prompt"][0]["content"][1]["text"]
    ({'type': 'image'}, 'How many shapes are in the picture? Answer with just the number.')
    >>> task.reward(None, ["2", "There are 2 shapes", "3<|im_end|>", ""], answer=["2"] * 4)
    [1.0, 1.0, 0.0, 0.0]
    >>> Shapes(question="color").reward(None, ["Red.", "The largest is blue", "green"], answer="blue")
    [0.0, 1.0, 0.0]
    """

    size: int = 56
    min_shapes: int = 1
    max_shapes: int = 3
    question: str = "count"
    test_fraction: float = 0.3
    system: str | None = None
    name: str = "shapes"

    def __post_init__(self):
        if not isinstance(self.size, int) or isinstance(self.size, bool) or not 16 <= self.size <= 1024:
            raise ValueError(f"size={self.size!r} must be an int in 16..1024 (the picture's side in px)")
        if self.question not in QUESTIONS:
            raise ValueError(f"question={self.question!r} is not a question; use one of {list(QUESTIONS)}")
        if not isinstance(self.min_shapes, int) or not isinstance(self.max_shapes, int) or \
                not 1 <= self.min_shapes <= self.max_shapes:
            raise ValueError(f"min_shapes={self.min_shapes!r}, max_shapes={self.max_shapes!r} must be ints with "
                             "1 <= min_shapes <= max_shapes")
        # Room for max_shapes of the smallest side with gaps, with slack so random placement finds it.
        cell = self.min_side + GAP
        room = ((self.size - 2) // cell) ** 2 // 3
        if self.max_shapes > room:
            raise ValueError(f"max_shapes={self.max_shapes} shapes don't fit a {self.size}px picture (room for "
                             f"about {room}); lower max_shapes or raise size")
        if self.question == "color" and self.max_shapes > len(COLORS):
            raise ValueError(f"question='color' gives every shape its own colour, so max_shapes={self.max_shapes} "
                             f"must be at most {len(COLORS)} (the colours: {list(COLORS)})")
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"test_fraction={self.test_fraction!r} must be strictly between 0 and 1")

    @property
    def min_side(self) -> int:
        """The smallest shape's side in px (``size // 6``)."""
        return max(4, self.size // 6)

    @property
    def max_side(self) -> int:
        """The largest shape's side in px (``size // 3``)."""
        return max(self.min_side, self.size // 3)

    @property
    def text(self) -> str:
        """The question asked next to the picture."""
        if self.question == "count":
            return "How many shapes are in the picture? Answer with just the number."
        which = "the largest shape" if self.max_shapes > 1 else "the shape"
        words = ", ".join(list(COLORS)[:-1]) + " or " + list(COLORS)[-1]
        return f"What color is {which}? Answer with one word: {words}."

    # ---- data ------------------------------------------------------------------------------------
    def _scene(self, rng) -> list[dict]:
        """Shapes placed without touching; for "color", distinct colours and one clearly largest shape."""
        for _ in range(10_000):
            count = rng.randint(self.min_shapes, self.max_shapes)
            if self.question == "color":
                colors = rng.sample(list(COLORS), count)
            else:
                colors = [rng.choice(list(COLORS)) for _ in range(count)]
            scene: list[dict] = []
            boxes: list[tuple[int, int, int]] = []
            for color in colors:
                kind, side = rng.choice(KINDS), rng.randint(self.min_side, self.max_side)
                for _ in range(200):
                    box = (rng.randint(1, self.size - side - 1), rng.randint(1, self.size - side - 1), side)
                    if _fits(box, boxes):
                        boxes.append(box)
                        scene.append({"kind": kind, "color": color, "x": box[0], "y": box[1], "side": side})
                        break
                else:
                    break  # no room left: draw the scene again
            if len(scene) < count:
                continue
            if self.question == "color" and count > 1:
                areas = sorted((_AREA[s["kind"]] * s["side"] ** 2 for s in scene), reverse=True)
                if areas[0] < 1.5 * areas[1]:
                    continue  # no clearly largest shape
            return scene
        raise RuntimeError(f"{self!r} found no scene in 10000 tries; lower max_shapes or raise size")

    def _answer(self, scene: list[dict]) -> str:
        if self.question == "count":
            return str(len(scene))
        return max(scene, key=lambda s: _AREA[s["kind"]] * s["side"] ** 2)["color"]

    def scene_key(self, scene: Sequence[dict]) -> str:
        """The text a scene is identified by (its shapes sorted, so drawing order doesn't matter)."""
        shapes = sorted(f"{s['kind']} {s['color']} at {s['x']},{s['y']} side {s['side']}" for s in scene)
        return f"{self.size}px: " + "; ".join(shapes)

    def dataset(self, n: int = 1000, seed: int = 0, split: str = "train") -> Rows:
        """``n`` rows ``{"prompt", "image", "answer", "question", "scene"}`` from ``split``; same seed, same
        pixels."""
        check_split(split)
        check_n(n)
        rng = rng_for(seed, split)
        system = [{"role": "system", "content": self.system}] if self.system else []
        rows = Rows()
        tries = 0
        while len(rows) < n:
            scene = self._scene(rng)
            tries += 1
            if split_of(self.scene_key(scene), self.test_fraction) != split:
                if tries > 100_000:
                    raise RuntimeError(f"split={split!r}: no scene in 100000 tries; check test_fraction")
                continue
            tries = 0
            content = [{"type": "image"}, {"type": "text", "text": self.text}]
            rows.append({"prompt": system + [{"role": "user", "content": content}],
                         "image": draw_scene(scene, self.size), "answer": self._answer(scene),
                         "question": self.text, "scene": scene})
        return rows

    __call__ = dataset

    def target(self, row: dict) -> str:
        """The ideal completion for a row (what SFT would teach, before eos)."""
        return str(row["answer"])

    @property
    def max_new_tokens(self) -> int:
        """Room for the one-word answer, eos and a spare or two."""
        return 4

    # ---- rewards ---------------------------------------------------------------------------------
    def predicted(self, completion: Any) -> str | None:
        """The answer a completion gives: its first integer ("count") or first colour word ("color")."""
        if self.question == "count":
            number = first_number(completion)
            return None if number is None else str(number)
        return next((w for w in _WORD.findall(completion_text(completion).lower()) if w in COLORS), None)

    def _normal(self, answer: Any) -> str:
        text = str(answer).strip().lower()
        return str(int(text)) if self.question == "count" and re.fullmatch(r"-?\d+", text) else text

    def reward(self, prompts: Sequence[Any], completions: Sequence[Any], answer: Any = None,
               **_: Any) -> list[float]:
        """1.0 if the completion's first number / colour word is the answer, else 0.0 (TRL signature)."""
        answers = aligned_column("answer", {"answer": answer}, len(completions), "reward",
                                 "the answer column of the task's dataset")
        return [float(self.predicted(c) == self._normal(a)) for c, a in zip(completions, answers)]
