"""Samples with their images: thumbnails beside the completions and rewards of a vision-language run.

``StepBatch.table()`` and ``Trainer.samples()`` are pandas DataFrames; when their samples' dataset rows
carry images (``rlkit.vision``: an ``image`` / ``images`` column, or images in the chat prompt's parts),
``with_images`` adds an ``image`` column after ``prompt``. Each cell is a ``Thumbnails``: in Jupyter's HTML
table it shows as ``<img>`` thumbnails (PNG data URIs), in the plain-text repr as the images' sizes
("56x56"). The frame is then a ``SampleTable`` (a DataFrame whose ``_repr_html_`` puts the thumbnails in,
every other cell escaped as pandas escapes it), and a prompt that the processor encoded
(``rlkit.rollout.base.ImagePrompt``) shows as its rendered text, never as its tensors. Frames of text-only
samples come back unchanged (the same object). ``samples_panel_html`` is the live view's sample panel.

>>> import pandas as pd
>>> from PIL import Image
>>> df = pd.DataFrame({"prompt": ["Colour?", "Colour?"], "completion": ["red", "blue"], "reward": [1.0, 0.0]})
>>> row = {"prompt": "Colour?", "image": Image.new("RGB", (56, 40), "red")}
>>> table = with_images(df, [row, row])
>>> table.columns.tolist(), table["image"].map(str).tolist()
(['prompt', 'image', 'completion', 'reward'], ['56x40', '56x40'])
>>> table._repr_html_().count('<img src="data:image/png;base64,')
2
>>> with_images(df, [{"prompt": "Colour?"}] * 2) is df        # no images: the frame as it was
True
"""

from __future__ import annotations

import html
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd

if TYPE_CHECKING:
    from PIL import Image

THUMBNAIL_PX = 64  # a thumbnail's long side in a table
PANEL_SAMPLES = 8  # the live view's sample panel shows the newest this many samples
PANEL_PROMPT_CHARS = 160  # a prompt longer than this is cut in the panel (its full text in the tooltip)


class Thumbnails:
    """One sample's images as a table cell: ``<img>`` thumbnails (at most ``size`` px on the long side) in
    HTML (``_repr_html_``), the images' sizes in text (``repr``). ``images`` are the RGB ``PIL.Image``s.

    >>> from PIL import Image
    >>> cell = Thumbnails([Image.new("RGB", (56, 56)), Image.new("RGB", (200, 100))], size=32)
    >>> cell, cell.sizes
    (56x56, 200x100, [(56, 56), (200, 100)])
    >>> cell._repr_html_().count("<img "), 'width="32" height="16"' in cell._repr_html_()
    (2, True)
    >>> cell == Thumbnails([Image.new("RGB", (56, 56)), Image.new("RGB", (200, 100))])  # same pixels
    True
    """

    __slots__ = ("images", "size", "_html")

    def __init__(self, images: Sequence[Image.Image], size: int = THUMBNAIL_PX) -> None:
        self.images = list(images)
        self.size = size
        self._html: str | None = None

    @property
    def sizes(self) -> list[tuple[int, int]]:
        """Each image's (width, height) in pixels."""
        return [img.size for img in self.images]

    def _repr_html_(self) -> str:
        if self._html is None:  # encoded once, when first shown
            from rlkit.vision import thumbnail_html

            self._html = "".join(thumbnail_html(img, size=self.size) for img in self.images)
        return self._html

    def __eq__(self, other: object) -> bool:  # same images, pixel for pixel: frames of one step compare equal
        return isinstance(other, Thumbnails) and self.images == other.images

    def __hash__(self) -> int:
        return hash(tuple(self.sizes))

    def __repr__(self) -> str:
        return ", ".join(f"{w}x{h}" for w, h in self.sizes)

    __str__ = __repr__


class SampleTable(pd.DataFrame):
    """A DataFrame of samples whose HTML repr shows its ``Thumbnails`` cells as images (``table_html``);
    everything else is a plain DataFrame (filters, copies and slices stay ``SampleTable``s).

    >>> from PIL import Image
    >>> t = SampleTable({"image": [Thumbnails([Image.new("RGB", (8, 8))])], "completion": ["<b>"]})
    >>> html = t._repr_html_()
    >>> '<img src="data:image/png;base64,' in html, "&lt;b&gt;" in html, type(t.head(1)).__name__
    (True, True, 'SampleTable')
    """

    _metadata: list[str] = []

    @property
    def _constructor(self) -> type[SampleTable]:
        return SampleTable

    def _repr_html_(self) -> str | None:
        return table_html(self, notebook=True)


def table_html(df: pd.DataFrame, *, notebook: bool = False) -> str | None:
    """``df`` as an HTML table with its ``Thumbnails`` cells drawn as ``<img>`` tags and every other cell
    exactly as pandas renders it (escaped). ``notebook``: as Jupyter shows a DataFrame (``_repr_html_``:
    the display options' row and column limits; None where ``display.notebook_repr_html`` is off), else
    ``to_html()`` (every row). A frame without thumbnails gives pandas' own HTML, unchanged.

    >>> from PIL import Image
    >>> df = pd.DataFrame({"image": [Thumbnails([Image.new("RGB", (8, 8))]), None], "reward": [1.0, 0.0]})
    >>> table_html(df).count("<img "), table_html(df[["reward"]]) == df[["reward"]].to_html()
    (1, True)
    """
    token = secrets.token_hex(4)  # placeholders no cell text can hold
    cells: list[Thumbnails] = []
    shown = pd.DataFrame(df, copy=True)  # a plain DataFrame: its HTML is pandas' own
    for j in range(df.shape[1]):
        column = df.iloc[:, j]
        if column.dtype != object or not any(isinstance(v, Thumbnails) for v in column):
            continue
        values = []
        for v in column:
            if isinstance(v, Thumbnails):
                values.append(f"@{token}-{len(cells)}@")
                cells.append(v)
            else:
                values.append(v)
        shown.isetitem(j, values)
    out = pd.DataFrame._repr_html_(shown) if notebook else shown.to_html()
    if out is None or not cells:
        return out
    # one pass: a table of hundreds of samples is encoded only for the rows pandas shows
    return re.sub(rf"@{token}-(\d+)@", lambda m: cells[int(m.group(1))]._repr_html_(), out)


# ---- which images a sample shows -----------------------------------------------------------------------
def shown_images(row: Mapping[str, Any] | None, index: int = 0) -> list[Image.Image]:
    """The images of a dataset row, as RGB ``PIL.Image``s, for showing: images in the chat prompt's parts, then
    the ``image`` column, then the ``images`` column (``rlkit.vision.row_images``'s order). Unlike
    ``row_images`` it never raises: an image that does not load is left out, and a row the trainer has
    rendered (its prompt an ``ImagePrompt``, whose parts are gone) shows its ``image`` / ``images`` columns.

    >>> from PIL import Image
    >>> [im.size for im in shown_images({"prompt": "Which?", "images": [Image.new("L", (4, 2)), "missing.png"]})]
    [(4, 2)]
    >>> shown_images({"prompt": "2+2="}), shown_images(None)
    ([], [])
    """
    from rlkit import vision

    if not isinstance(row, Mapping):
        return []
    prompt = row.get("prompt")
    if isinstance(prompt, (list, tuple, Mapping)) and vision.image_slots(prompt):  # a chat: its parts count too
        try:
            return vision.row_images(row, index=index)
        except vision.ImageError:
            pass  # counts that do not match: show what the columns hold
    values = [row["image"]] if row.get("image") is not None else []
    many = row.get("images")
    if many is not None:
        values.extend(many if isinstance(many, (list, tuple)) else [many])
    out = []
    for k, value in enumerate(values):
        try:
            out.append(vision.load_image(value, where=f"row {index}, image {k}"))
        except vision.ImageError:
            continue
    return out


def _is_image_prompt(value: Any) -> bool:
    from rlkit.rollout.base import ImagePrompt

    return isinstance(value, ImagePrompt)


def prompt_text(prompt: Any) -> Any:
    """A prompt as a table shows it: an ``ImagePrompt`` (token ids, pixel tensors) as its rendered text, any
    other prompt as it is.

    >>> import torch
    >>> from rlkit.rollout.base import ImagePrompt
    >>> prompt_text(ImagePrompt([1, 9, 2], torch.zeros(4, 6), torch.tensor([[1, 2, 2]]), "<|image_pad|>Colour?"))
    '<|image_pad|>Colour?'
    >>> prompt_text("2+2=")
    '2+2='
    """
    return prompt.text if _is_image_prompt(prompt) else prompt


def with_images(df: pd.DataFrame, rows: Sequence[Mapping[str, Any] | None], *, size: int = THUMBNAIL_PX,
                column: str = "image", after: str = "prompt") -> pd.DataFrame:
    """``df`` (one row per sample) with each sample's images: ``rows`` holds each sample's dataset row (None:
    none known), in ``df``'s order. When any has images, a ``SampleTable`` with a ``column`` of ``Thumbnails``
    (None for a sample without images) inserted after column ``after`` (at the end without it); samples of
    one row share one cell. Prompts that are ``ImagePrompt``s show as their text (``prompt_text``). Without
    images or ``ImagePrompt``s ``df`` itself comes back.

    >>> from PIL import Image
    >>> df = pd.DataFrame({"prompt": ["Which?", "2+2="], "reward": [1.0, 0.0]})
    >>> t = with_images(df, [{"image": Image.new("RGB", (56, 56))}, None])
    >>> t["image"].tolist(), type(t).__name__
    ([56x56, None], 'SampleTable')
    """
    if len(rows) != len(df):
        raise ValueError(f"with_images got {len(rows)} rows for {len(df)} samples; give one row (or None) per sample")
    cache: dict[int, Thumbnails | None] = {}
    cells = []
    for i, row in enumerate(rows):
        if id(row) not in cache:
            images = shown_images(row, index=i)
            cache[id(row)] = Thumbnails(images, size=size) if images else None
        cells.append(cache[id(row)])
    image_prompts = "prompt" in df.columns and any(_is_image_prompt(p) for p in df["prompt"])
    if not image_prompts and all(c is None for c in cells):
        return df
    out = SampleTable(df, copy=True)
    if image_prompts:
        out["prompt"] = [prompt_text(p) for p in df["prompt"]]
    if any(c is not None for c in cells):
        at = list(out.columns).index(after) + 1 if after in out.columns else len(out.columns)
        out.insert(at, column, pd.Series(cells, index=out.index, dtype=object))
    return out


def trainer_samples(df: pd.DataFrame, rows: Sequence[Mapping[str, Any]], *, size: int = THUMBNAIL_PX) -> pd.DataFrame:
    """``Trainer.samples()``'s frame with images: each sample's ``prompt`` is the very ``ImagePrompt`` object of
    the dataset row (of ``rows``, the trainer's rows) it answers, which gives the row and so its images.
    A frame without ``ImagePrompt``s (a text-only run) comes back unchanged (the same object).

    >>> import torch
    >>> from PIL import Image
    >>> from rlkit.rollout.base import ImagePrompt
    >>> p = ImagePrompt([1, 9, 2], torch.zeros(4, 6), torch.tensor([[1, 2, 2]]), "<|image_pad|>Colour?")
    >>> rows = [{"prompt": p, "image": Image.new("RGB", (56, 56))}]
    >>> df = pd.DataFrame({"step": [1, 1], "prompt": [p, p], "completion": ["red", "blue"], "reward": [1.0, 0.0]})
    >>> trainer_samples(df, rows)[["prompt", "image"]].values.tolist()
    [['<|image_pad|>Colour?', 56x56], ['<|image_pad|>Colour?', 56x56]]
    >>> text = pd.DataFrame({"prompt": ["2+2="], "completion": ["4"]})
    >>> trainer_samples(text, rows) is text
    True
    """
    if df.empty or "prompt" not in df.columns or not any(_is_image_prompt(p) for p in df["prompt"]):
        return df
    by_prompt = {id(r.get("prompt")): r for r in rows if _is_image_prompt(r.get("prompt"))}
    return with_images(df, [by_prompt.get(id(p)) for p in df["prompt"]], size=size)


# ---- the live view's sample panel ----------------------------------------------------------------------
def samples_panel_html(df: pd.DataFrame | None, limit: int = PANEL_SAMPLES) -> str:
    """The live view's sample panel: the newest ``limit`` samples of ``df`` (``Trainer.samples()``'s frame)
    as an HTML table of step, image thumbnails, prompt, completion (``readable``) and reward. Empty ("")
    when the samples have no ``image`` column (a text-only run shows no panel).

    >>> from PIL import Image
    >>> df = with_images(pd.DataFrame({"step": [3], "prompt": ["Which?"], "completion": ["a <b>"], "reward": [0.5]}),
    ...                  [{"image": Image.new("RGB", (56, 56))}])
    >>> panel = samples_panel_html(df)
    >>> panel.count('<img src="data:image/png;base64,'), "a &lt;b&gt;" in panel, samples_panel_html(df[["reward"]])
    (1, True, '')
    """
    from rlkit.widgets.live import readable

    if df is None or df.empty or "image" not in df.columns:
        return ""
    recent = df.tail(limit)
    ids = recent["completion_ids"] if "completion_ids" in recent.columns else [None] * len(recent)
    head = ("step", "image", "prompt", "completion", "reward")
    out = ["<table style='font:11px monospace;border-collapse:collapse;margin-top:4px'><tr>"
           + "".join(f"<th style='padding:0 6px;text-align:left'>{h}</th>" for h in head) + "</tr>"]
    for (_, r), completion_ids in zip(recent.iterrows(), ids):
        image = r["image"]._repr_html_() if isinstance(r["image"], Thumbnails) else ""
        prompt = readable(prompt_text(r.get("prompt")))
        short = prompt if len(prompt) <= PANEL_PROMPT_CHARS else prompt[:PANEL_PROMPT_CHARS - 1] + "…"
        reward = r.get("reward")
        cells = (html.escape(str(r.get("step", ""))), image,
                 f"<span title='{html.escape(prompt, quote=True)}'>{html.escape(short)}</span>",
                 html.escape(readable(r.get("completion"), completion_ids)),
                 html.escape("-" if reward is None else f"{float(reward):.3g}"))
        out.append("<tr>" + "".join(f"<td style='padding:2px 6px;vertical-align:middle;text-align:left'>{c}</td>"
                                    for c in cells) + "</tr>")
    return "<div style='font-size:11px;font-weight:bold;margin-top:6px'>recent samples</div>" + "".join(out) + "</table>"


__all__ = ["SampleTable", "Thumbnails", "prompt_text", "samples_panel_html", "shown_images", "table_html",
           "trainer_samples", "with_images"]
