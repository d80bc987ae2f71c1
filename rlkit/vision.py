"""Image inputs for vision-language RL: load, check and count the images of each dataset row.

Rows follow TRL's VLM GRPO format: a conversational ``prompt`` whose user content holds one
``{"type": "image"}`` part per image, plus an ``image`` column (one image) or an ``images`` column (a list).
Every image goes through ``load_image``: whatever form it came in (a PIL image, a path, encoded bytes, or
the ``{"bytes", "path"}`` dict that ``datasets`` stores) it comes back fully decoded and RGB, or an
``ImageError`` names the row, the value and the fix. Pure Python and Pillow: no torch, no transformers.

>>> from PIL import Image
>>> row = {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}],
...        "image": Image.new("L", (32, 16), 128)}
>>> [img.size for img in row_images(row, index=0)], row_images(row, index=0)[0].mode
([(32, 16)], 'RGB')
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from PIL import Image, UnidentifiedImageError

MAX_IMAGE_PIXELS = 4096 * 4096  # default limit on width * height; a 4K photo is ~8.3M pixels
MODES = ("RGB", "RGBA", "L", "LA", "P", "1")  # modes converted to RGB; any other mode is an error
IMAGE_PART_TYPES = ("image", "image_url")  # content parts that stand for one image each
_ACCEPTED = ('a PIL image, a path to an image file, the encoded bytes of one, or a {"bytes": ..., "path": ...} '
             "dict as datasets stores it")


class ImageError(ValueError):
    """An image input that can't be used, with where it is (row, image), the value and the fix."""


def _prefix(where: str) -> str:
    return f"{where}: " if where else ""


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe_bytes(data: bytes) -> str:
    head = data[:8]
    return f"{len(data)} bytes ({head!r}{'...' if len(data) > 8 else ''})"


def _to_rgb(img: Image.Image) -> Image.Image:
    """RGB, with transparent pixels put on white (as the Qwen-VL utilities do) rather than on black."""
    if img.mode == "RGB":
        return img
    if img.mode in ("RGBA", "LA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def _check(img: Image.Image, what: str, where: str, max_pixels: int) -> None:
    """Size and mode, read from the header: nothing is decoded yet."""
    width, height = img.size
    if width <= 0 or height <= 0:
        raise ImageError(f"{_prefix(where)}{what} is empty ({width}x{height} pixels); pass a real image or "
                         "drop it from the row")
    if width * height > max_pixels:
        raise ImageError(f"{_prefix(where)}{what} is {width}x{height} = {width * height:,} pixels, past the "
                         f"limit max_pixels={max_pixels:,}; resize it (e.g. img.thumbnail((1024, 1024))) or "
                         "raise max_pixels")
    if img.mode not in MODES:
        raise ImageError(f"{_prefix(where)}{what} has mode {img.mode!r}, which is not converted (converted: "
                         f"{', '.join(MODES)}); convert it with img.convert(\"RGB\") first")


def _decode(img: Image.Image, what: str, where: str) -> None:
    """Decode every pixel now, so a truncated or corrupt file fails here, not in the middle of a step."""
    try:
        img.load()
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageError(f"{_prefix(where)}{what} cannot be decoded ({exc}): the data is truncated or "
                         "corrupt; re-encode or re-download the image, or drop it from the row") from exc


def _open(source: Any, what: str, where: str, max_pixels: int) -> Image.Image:
    """Open a file path or a byte stream, check it, decode it and return an RGB image it does not hold."""
    try:
        with Image.open(source) as img:
            _check(img, what, where, max_pixels)
            _decode(img, what, where)
            rgb = _to_rgb(img)
            return rgb.copy() if rgb is img else rgb  # closing the file must not close the image returned
    except UnidentifiedImageError as exc:
        raise ImageError(f"{_prefix(where)}{what} is not an image Pillow can read (unknown or corrupt "
                         "format); pass a PNG, JPEG, WebP, GIF or BMP file, or check that the value points "
                         "at the image and not at, e.g., a text or HTML file") from exc
    except Image.DecompressionBombError as exc:
        raise ImageError(f"{_prefix(where)}{what} is refused by Pillow as a decompression bomb ({exc}); resize "
                         "it, or raise PIL.Image.MAX_IMAGE_PIXELS as well as max_pixels") from exc
    except OSError as exc:
        raise ImageError(f"{_prefix(where)}{what} cannot be read ({exc}); check that the file is readable "
                         "and is an image") from exc


def _from_path(value: str | os.PathLike, where: str, max_pixels: int) -> Image.Image:
    if isinstance(value, str):
        if value.startswith(("http://", "https://")):
            raise ImageError(f"{_prefix(where)}{_short(value)!r} is a URL; images are not downloaded: download "
                             "it and pass the path (or bytes) instead")
        if value.startswith("data:"):  # data:image/png;base64,...
            header, _, payload = value.partition(",")
            if not header.endswith(";base64"):
                raise ImageError(f"{_prefix(where)}the data URI {_short(value, 40)!r} is not base64-encoded; "
                                 "pass the image bytes, a path, or a 'data:image/...;base64,...' URI")
            try:
                data = base64.b64decode(payload, validate=True)
            except ValueError as exc:
                raise ImageError(f"{_prefix(where)}the data URI {_short(value, 40)!r} holds invalid base64 "
                                 f"({exc}); re-encode the image with base64.b64encode") from exc
            return _open(io.BytesIO(data), f"the data URI ({_describe_bytes(data)})", where, max_pixels)
        if value.startswith("file://"):
            value = value[len("file://"):]
    path = os.fspath(value)
    what = f"the file {_short(path)!r}"
    if not os.path.exists(path):
        raise ImageError(f"{_prefix(where)}{what} does not exist; check the path (a relative path is "
                         f"resolved from the current directory, {_short(os.getcwd())!r})")
    if os.path.isdir(path):
        raise ImageError(f"{_prefix(where)}{what} is a directory; pass the path of one image file")
    return _open(path, what, where, max_pixels)


def _from_dict(value: Mapping, where: str, max_pixels: int) -> Image.Image:
    data, path = value.get("bytes"), value.get("path")
    if ("bytes" not in value and "path" not in value) or (data is None and path is None):
        keys = sorted(map(str, value))
        raise ImageError(f"{_prefix(where)}a dict with keys {keys} holds no image; pass {_ACCEPTED} "
                         "(at least one of 'bytes' and 'path' not None)")
    if data is not None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ImageError(f"{_prefix(where)}the dict's 'bytes' is of type {type(data).__name__}, not bytes; "
                             "store the encoded image file's bytes there")
        data = bytes(data)
        return _open(io.BytesIO(data), f'the dict\'s "bytes" ({_describe_bytes(data)})', where, max_pixels)
    if not isinstance(path, (str, os.PathLike)):
        raise ImageError(f"{_prefix(where)}the dict's 'path' is of type {type(path).__name__}, not a path; store the "
                         "image file's path there")
    return _from_path(path, where, max_pixels)


def load_image(value: Any, *, where: str = "", max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """One image input as a fully decoded RGB ``PIL.Image``; ``ImageError`` (naming ``where``) if unusable.

    Accepts a PIL image; a path (``str`` or ``os.PathLike``, also ``file://...`` or a base64
    ``data:image/...`` URI) to an image file; the encoded bytes of an image file; or a dict
    ``{"bytes": ... or None, "path": ... or None}`` as ``datasets``' ``Image(decode=False)`` stores it.
    Modes in ``MODES`` are converted to RGB (transparent pixels go on white); an RGB PIL image comes back
    as itself. Width * height may be at most ``max_pixels``; it is checked from the header, before decoding.

    >>> from PIL import Image
    >>> buf = io.BytesIO(); Image.new("RGBA", (4, 2)).save(buf, format="PNG")
    >>> [load_image(v).size for v in (Image.new("P", (4, 2)), buf.getvalue(), {"bytes": buf.getvalue(),
    ...                                                                         "path": None})]
    [(4, 2), (4, 2), (4, 2)]
    >>> load_image(Image.new("CMYK", (4, 2)), where="row 3, image 0")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    rlkit.vision.ImageError: row 3, image 0: the image (a PIL image) has mode 'CMYK', which is not converted ...
    >>> load_image("missing.png", where="row 1, image 0")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    rlkit.vision.ImageError: row 1, image 0: the file 'missing.png' does not exist; check the path ...
    """
    if not isinstance(max_pixels, int) or isinstance(max_pixels, bool) or max_pixels < 1:
        raise ValueError(f"max_pixels={max_pixels!r} must be a positive int (the largest width * height)")
    if isinstance(value, Image.Image):
        what = "the image (a PIL image)"
        _check(value, what, where, max_pixels)
        _decode(value, what, where)
        return _to_rgb(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        if not data:
            raise ImageError(f"{_prefix(where)}the image is empty bytes (b''); pass the encoded image file's "
                             "bytes, or drop it from the row")
        return _open(io.BytesIO(data), f"the bytes ({_describe_bytes(data)})", where, max_pixels)
    if isinstance(value, (str, os.PathLike)):
        return _from_path(value, where, max_pixels)
    if isinstance(value, Mapping):
        return _from_dict(value, where, max_pixels)
    hint = ""
    if type(value).__module__ == "numpy":
        hint = " (for a numpy array, use PIL.Image.fromarray(array))"
    elif type(value).__module__.startswith("torch"):
        hint = " (for a tensor, use torchvision's to_pil_image or PIL.Image.fromarray(t.numpy()))"
    raise ImageError(f"{_prefix(where)}a value of type {type(value).__name__} is not an image input; pass {_ACCEPTED}{hint}")


# ---- prompts and rows --------------------------------------------------------------------------------
def _image_parts(messages: Any) -> Iterator[Mapping]:
    """The image parts of a chat prompt, in message order; none for a plain string (or None)."""
    if messages is None or isinstance(messages, str):
        return
    if isinstance(messages, Mapping):  # a single message
        messages = [messages]
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str) or content is None:
            continue
        for part in content:
            if isinstance(part, Mapping) and part.get("type") in IMAGE_PART_TYPES:
                yield part


def _embedded(part: Mapping) -> Any:
    """The image a prompt part carries itself (``None`` for a bare ``{"type": "image"}`` slot)."""
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, Mapping) else url
    for key in ("image", "url", "path"):
        if part.get(key) is not None:
            return part[key]
    return None


def image_slots(messages: Any) -> int:
    """How many images a prompt asks for: its ``{"type": "image"}`` (or ``"image_url"``) content parts.

    A plain-string prompt has none.

    >>> image_slots([{"role": "user", "content": [{"type": "image"}, {"type": "image"},
    ...                                           {"type": "text", "text": "Which is bigger?"}]}])
    2
    >>> image_slots("Which is bigger?"), image_slots([{"role": "user", "content": "Which is bigger?"}])
    (0, 0)
    """
    return sum(1 for _ in _image_parts(messages))


def _plural(k: int, word: str) -> str:
    return f"{k} {word}{'' if k == 1 else 's'}"


def row_images(row: Mapping, *, index: int, max_pixels: int = MAX_IMAGE_PIXELS) -> list[Image.Image]:
    """A row's images, each loaded and checked by ``load_image``, matched one to one with its prompt's slots.

    Order: images embedded in the prompt's parts (``{"type": "image", "image": <value>}``), in message
    order, then the ``image`` column (one image, may be ``None``), then the ``images`` column (a list).
    The count must equal ``image_slots(row["prompt"])``; counts are checked before anything is decoded.

    >>> from PIL import Image
    >>> prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    >>> len(row_images({"prompt": prompt, "images": [Image.new("RGB", (8, 8))]}, index=0))
    1
    >>> row_images({"prompt": prompt, "images": [Image.new("RGB", (8, 8))] * 2}, index=5)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    rlkit.vision.ImageError: row 5 has 2 images but its prompt has 1 image slot ({"type": "image"} parts); ...
    """
    prompt = row.get("prompt")
    values = [_embedded(part) for part in _image_parts(prompt)]
    values = [v for v in values if v is not None]
    if row.get("image") is not None:
        values.append(row["image"])
    many = row.get("images")
    if many is not None:
        if not isinstance(many, (list, tuple)):
            raise ImageError(f"row {index}: the images column holds a value of type {type(many).__name__}, not a list; wrap "
                             "it (images=[img]) or put a single image in the image column")
        values.extend(many)
    slots = image_slots(prompt)
    if len(values) != slots:
        head = (f"row {index} has {_plural(len(values), 'image')} but its prompt has "
                f"{_plural(slots, 'image slot')} ({{\"type\": \"image\"}} parts); ")
        if len(values) > slots:
            fix = "add a part per image or drop images"
            if isinstance(prompt, str):
                fix += (" (a plain-string prompt holds none: make it a chat, [{\"role\": \"user\", \"content\": "
                        "[{\"type\": \"image\"}, {\"type\": \"text\", \"text\": ...}]}])")
        else:
            fix = ("give one image per slot (in the image or images column, or in the part as "
                   "{\"type\": \"image\", \"image\": ...}) or drop the extra parts")
        raise ImageError(head + fix)
    return [load_image(v, where=f"row {index}, image {k}", max_pixels=max_pixels) for k, v in enumerate(values)]


def _carries(value: Any) -> bool:
    """Whether an ``image``/``images`` cell holds anything (``None`` and ``[]`` don't)."""
    if value is None:
        return False
    return not (isinstance(value, (list, tuple)) and not value)


def _dataset_has_images(ds: Any) -> bool:
    """``has_images`` for a ``datasets.Dataset``: image columns read as Arrow (nothing decoded)."""
    import pyarrow.compute as pc

    columns = set(ds.column_names)
    table = ds.with_format("arrow")
    if "image" in columns:
        col = table["image"]
        if col.null_count < len(col):
            return True
    if "images" in columns:
        col = table["images"]
        lengths = pc.list_value_length(col) if len(col) else None
        if lengths is not None and (pc.max(lengths).as_py() or 0) > 0:
            return True
    if "prompt" in columns:
        return any(image_slots(p) for p in ds.select_columns(["prompt"])["prompt"])
    return False


def has_images(rows: Iterable[Mapping]) -> bool:
    """Whether any row carries images: image parts in its prompt, or a non-empty ``image``/``images`` cell.

    Cheap: nothing is opened or decoded (a ``datasets.Dataset``'s image columns are read as Arrow).

    >>> from PIL import Image
    >>> has_images([{"prompt": "2+2=", "image": None}]), has_images([{"prompt": "hi", "images": []},
    ...                                                               {"prompt": "hi", "image": Image.new("1", (1, 1))}])
    (False, True)
    """
    if hasattr(rows, "with_format") and hasattr(rows, "column_names") and hasattr(rows, "data"):
        return _dataset_has_images(rows)
    for row in rows:
        if image_slots(row.get("prompt")) or _carries(row.get("image")) or _carries(row.get("images")):
            return True
    return False


def thumbnail_html(img: Any, size: int = 64) -> str:
    """An ``<img>`` tag holding a PNG thumbnail at most ``size`` px on its long side (for notebook tables).

    ``img`` is anything ``load_image`` accepts. Images smaller than ``size`` are not enlarged.

    >>> from PIL import Image
    >>> thumbnail_html(Image.new("RGB", (200, 100), "red"), size=64)  # doctest: +ELLIPSIS
    '<img src="data:image/png;base64,..." width="64" height="32" alt="200x100 image">'
    """
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"size={size!r} must be a positive int (the thumbnail's long side in px)")
    image = load_image(img, where="thumbnail_html")
    width, height = image.size
    thumb = image.copy() if image is img else image
    thumb.thumbnail((size, size))
    buf = io.BytesIO()
    thumb.save(buf, format="PNG")
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return (f'<img src="data:image/png;base64,{data}" width="{thumb.width}" height="{thumb.height}" '
            f'alt="{width}x{height} image">')
