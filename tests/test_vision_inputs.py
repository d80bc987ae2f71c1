"""Image inputs (rlkit.vision) and the Shapes task: every accepted input kind, every error's message, and
the task's pictures checked against their answers by an independent pixel count."""

from __future__ import annotations

import base64
import io
from collections import Counter

import pytest
from PIL import Image

from rlkit.tasks import Shapes, shapes
from rlkit.tasks.pictures import COLORS
from rlkit.vision import (
    MAX_IMAGE_PIXELS,
    MODES,
    ImageError,
    has_images,
    image_slots,
    load_image,
    row_images,
    thumbnail_html,
)


def chat(slots: int, text: str = "How many shapes are in the picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * slots + [{"type": "text", "text": text}]}]


def png_bytes(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def picture(size=(12, 8)) -> Image.Image:
    img = Image.new("RGB", size, "white")
    img.putpixel((1, 2), (10, 20, 30))
    return img


# ---- accepted inputs ---------------------------------------------------------------------------------
def test_defaults():
    assert MAX_IMAGE_PIXELS == 4096 * 4096
    assert MODES == ("RGB", "RGBA", "L", "LA", "P", "1")


@pytest.mark.parametrize("mode", MODES)
def test_pil_image_of_every_mode_comes_back_rgb(mode):
    out = load_image(Image.new(mode, (5, 3)))
    assert out.mode == "RGB" and out.size == (5, 3)


def test_rgb_pil_image_is_returned_as_is_and_alpha_goes_on_white():
    img = picture()
    assert load_image(img) is img
    transparent = Image.new("RGBA", (2, 2), (0, 0, 0, 0))
    assert load_image(transparent).getpixel((0, 0)) == (255, 255, 255)


def test_path_str_pathlike_and_file_url(tmp_path):
    path = tmp_path / "pic.png"
    picture().save(path)
    for value in (path, str(path), f"file://{path}"):
        out = load_image(value)
        assert out.mode == "RGB" and out.tobytes() == picture().tobytes()
    jpg = tmp_path / "gray.jpg"
    Image.new("L", (6, 6), 100).save(jpg)
    assert load_image(jpg).mode == "RGB"


def test_bytes_bytearray_and_data_uri():
    data = png_bytes(picture())
    assert load_image(data).tobytes() == picture().tobytes()
    assert load_image(bytearray(data)).size == (12, 8)
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    assert load_image(uri).tobytes() == picture().tobytes()


def test_datasets_style_dicts(tmp_path):
    path = tmp_path / "pic.png"
    picture().save(path)
    assert load_image({"bytes": png_bytes(picture()), "path": None}).tobytes() == picture().tobytes()
    assert load_image({"bytes": None, "path": str(path)}).tobytes() == picture().tobytes()


def test_real_datasets_image_column():
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": chat(1), "image": picture(), "answer": "1"},
            {"prompt": chat(1), "image": Image.new("P", (4, 4)), "answer": "1"}]
    ds = datasets.Dataset.from_list(rows, features=datasets.Features({
        "prompt": [{"role": datasets.Value("string"),
                    "content": [{"type": datasets.Value("string"), "text": datasets.Value("string")}]}],
        "image": datasets.Image(), "answer": datasets.Value("string")}))
    row = ds[0]
    assert image_slots(row["prompt"]) == 1  # Arrow filled the image part's "text" with None
    (img,) = row_images(row, index=0)
    assert img.mode == "RGB" and img.tobytes() == picture().tobytes()
    assert row_images(ds[1], index=1)[0].size == (4, 4)
    undecoded = ds.cast_column("image", datasets.Image(decode=False))
    assert isinstance(undecoded[0]["image"], dict)
    assert row_images(undecoded[0], index=0)[0].tobytes() == picture().tobytes()
    assert has_images(ds) and has_images(undecoded)
    plain = datasets.Dataset.from_list([{"prompt": "1+1=", "image": None}, {"prompt": "2+2=", "image": None}])
    assert not has_images(plain)
    listed = datasets.Dataset.from_list([{"prompt": "x", "images": []}, {"prompt": "y", "images": [png_bytes(picture())]}])
    assert has_images(listed) and not has_images(listed.select([0]))


# ---- errors ------------------------------------------------------------------------------------------
def test_missing_file_names_where_path_and_fix(tmp_path):
    missing = tmp_path / "nope.png"
    with pytest.raises(ImageError, match=r"^row 3, image 0: the file .*nope\.png' does not exist; check the path"):
        load_image(missing, where="row 3, image 0")


def test_text_file_named_png(tmp_path):
    fake = tmp_path / "fake.png"
    fake.write_text("not an image at all")
    with pytest.raises(ImageError, match=r"row 2, image 1: the file .*fake\.png' is not an image Pillow can read"):
        load_image(fake, where="row 2, image 1")
    with pytest.raises(ImageError, match=r"row 0, image 0: the bytes \(19 bytes \(b'not an i'\.\.\.\)\) is not an image"):
        load_image(fake.read_bytes(), where="row 0, image 0")
    with pytest.raises(ImageError, match="is a directory"):
        load_image(tmp_path, where="row 0, image 0")


def test_truncated_file_fails_when_loaded(tmp_path):
    noise = Image.effect_noise((64, 64), 50).convert("RGB")
    data = png_bytes(noise)
    path = tmp_path / "cut.png"
    path.write_bytes(data[: len(data) * 6 // 10])
    with pytest.raises(ImageError, match=r"row 4, image 0: .* cannot be decoded .*truncated or corrupt; re-encode"):
        load_image(path, where="row 4, image 0")


@pytest.mark.parametrize("mode", ["CMYK", "I;16", "F", "I"])
def test_wrong_mode_names_mode_and_fix(mode, tmp_path):
    with pytest.raises(ImageError, match=rf"row 1, image 0: .*mode '{mode}'.*img\.convert\(\"RGB\"\)"):
        load_image(Image.new(mode, (4, 4)), where="row 1, image 0")
    if mode == "CMYK":  # also from a file
        path = tmp_path / "cmyk.jpg"
        Image.new(mode, (4, 4)).save(path)
        with pytest.raises(ImageError, match=r"row 1, image 0: the file .*cmyk\.jpg' has mode 'CMYK'"):
            load_image(path, where="row 1, image 0")


def test_too_many_pixels_says_size_limit_and_fix(tmp_path):
    msg = r"row 2, image 0: .* is 100x80 = 8,000 pixels, past the limit max_pixels=5,000; resize it .* or raise max_pixels"
    with pytest.raises(ImageError, match=msg):
        load_image(Image.new("RGB", (100, 80)), where="row 2, image 0", max_pixels=5000)
    path = tmp_path / "big.png"
    Image.new("RGB", (100, 80)).save(path)
    with pytest.raises(ImageError, match=msg):
        row_images({"prompt": chat(1), "image": str(path)}, index=2, max_pixels=5000)
    with pytest.raises(ValueError, match="max_pixels=0 must be a positive int"):
        load_image(picture(), max_pixels=0)


def test_zero_size_and_wrong_types():
    with pytest.raises(ImageError, match=r"row 0, image 0: .* is empty \(0x5 pixels\); pass a real image"):
        load_image(Image.new("RGB", (0, 5)), where="row 0, image 0")
    with pytest.raises(ImageError, match=r"row 7, image 0: a value of type int is not an image input; pass a PIL image"):
        load_image(7, where="row 7, image 0")
    with pytest.raises(ImageError, match=r"row 7, image 0: a value of type NoneType is not an image input"):
        load_image(None, where="row 7, image 0")
    with pytest.raises(ImageError, match=r"empty bytes"):
        load_image(b"", where="row 7, image 0")
    with pytest.raises(ImageError, match=r"a dict with keys \['bytes', 'path'\] holds no image"):
        load_image({"bytes": None, "path": None}, where="row 7, image 0")
    with pytest.raises(ImageError, match=r"is a URL; images are not downloaded"):
        load_image("https://example.com/cat.png", where="row 7, image 0")
    np = pytest.importorskip("numpy")
    with pytest.raises(ImageError, match=r"a value of type ndarray is not an image input.*PIL\.Image\.fromarray"):
        load_image(np.zeros((2, 2, 3), dtype="uint8"), where="row 7, image 0")


def test_more_images_than_slots():
    row = {"prompt": chat(1), "image": picture(), "images": [picture()]}
    with pytest.raises(ImageError, match=r'^row 3 has 2 images but its prompt has 1 image slot \({"type": "image"} '
                                         r"parts\); add a part per image or drop images"):
        row_images(row, index=3)


def test_images_with_a_string_prompt():
    with pytest.raises(ImageError, match=r"^row 9 has 1 image but its prompt has 0 image slots .*add a part per "
                                         r"image or drop images \(a plain-string prompt holds none: make it a chat"):
        row_images({"prompt": "How many shapes?", "image": picture()}, index=9)


def test_fewer_images_than_slots():
    with pytest.raises(ImageError, match=r"^row 4 has 1 image but its prompt has 2 image slots .*give one image per "
                                         r"slot .* or drop the extra parts"):
        row_images({"prompt": chat(2), "images": [picture()], "image": None}, index=4)
    with pytest.raises(ImageError, match=r"^row 5 has 0 images but its prompt has 1 image slot"):
        row_images({"prompt": chat(1)}, index=5)
    with pytest.raises(ImageError, match=r"row 6: the images column holds a value of type Image, not a list; wrap it"):
        row_images({"prompt": chat(1), "images": picture()}, index=6)


def test_row_images_order_and_where():
    red, green, blue = (Image.new("RGB", (2, 2), c) for c in ("red", "green", "blue"))
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"}]},
              {"role": "assistant", "content": "ok"},
              {"role": "user", "content": [{"type": "image", "image": red}, {"type": "image"}]}]
    out = row_images({"prompt": prompt, "image": green, "images": [blue]}, index=0)
    assert [img.getpixel((0, 0)) for img in out] == [(255, 0, 0), (0, 128, 0), (0, 0, 255)]
    with pytest.raises(ImageError, match=r"^row 8, image 2: the image \(a PIL image\) has mode 'CMYK'"):
        row_images({"prompt": prompt, "image": green, "images": [Image.new("CMYK", (2, 2))]}, index=8)
    assert row_images({"prompt": "no images", "image": None, "images": []}, index=0) == []


# ---- slots, has_images, thumbnails -------------------------------------------------------------------
def test_image_slots():
    assert image_slots("How many?") == 0 and image_slots(None) == 0
    assert image_slots([{"role": "user", "content": "How many?"}]) == 0
    assert image_slots(chat(1)) == 1 and image_slots(chat(3)) == 3
    mixed = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": [{"type": "image", "image": picture()}, {"type": "text", "text": "a"},
                                          {"type": "image_url", "image_url": {"url": "data:..."}}]},
             {"role": "user", "content": [{"type": "image"}]}]
    assert image_slots(mixed) == 3


def test_has_images_is_cheap():
    assert not has_images([]) and not has_images([{"prompt": "1+1=", "answer": "2"}])
    assert not has_images([{"prompt": "x", "image": None, "images": []}])
    assert has_images([{"prompt": "x"}, {"prompt": chat(1)}])  # an image part is enough
    assert has_images([{"prompt": "x", "images": ["/does/not/exist.png"]}])  # nothing is opened
    assert has_images([{"prompt": "x", "image": {"bytes": b"junk", "path": None}}])


def test_thumbnail_html():
    html = thumbnail_html(Image.new("RGB", (200, 100), "red"), size=64)
    assert html.startswith('<img src="data:image/png;base64,') and 'width="64" height="32"' in html
    data = base64.b64decode(html.split("base64,")[1].split('"')[0])
    thumb = Image.open(io.BytesIO(data))
    assert thumb.format == "PNG" and thumb.size == (64, 32) and thumb.getpixel((3, 3))[:3] == (255, 0, 0)
    small = picture()
    assert 'width="12" height="8"' in thumbnail_html(small, size=64) and small.size == (12, 8)  # not enlarged
    assert 'width="32" height="64"' in thumbnail_html(png_bytes(Image.new("L", (50, 100))))


# ---- the Shapes task ---------------------------------------------------------------------------------
WHITE = (255, 255, 255)


def regions(img: Image.Image) -> list[tuple[tuple[int, int, int], int]]:
    """Connected non-white regions (8-neighbour flood fill) as (colour, pixel count), independent of the task."""
    width, height = img.size
    px = img.load()
    seen = [[False] * width for _ in range(height)]
    found = []
    for y0 in range(height):
        for x0 in range(width):
            if seen[y0][x0] or px[x0, y0] == WHITE:
                continue
            color, stack, count = px[x0, y0], [(x0, y0)], 0
            seen[y0][x0] = True
            while stack:
                x, y = stack.pop()
                count += 1
                assert px[x, y] == color, "a region mixes colours: shapes touch or are anti-aliased"
                for dx in (-1, 0, 1):
                    for dy in (-1, 0, 1):
                        nx, ny = x + dx, y + dy
                        if 0 <= nx < width and 0 <= ny < height and not seen[ny][nx] and px[nx, ny] != WHITE:
                            seen[ny][nx] = True
                            stack.append((nx, ny))
            found.append((color, count))
    return found


def test_shapes_rows_are_vlm_rows():
    rows = shapes(n=5, seed=0)
    assert len(rows) == 5 and isinstance(Shapes(), type(shapes))
    for k, row in enumerate(rows):
        assert row["prompt"] == chat(1, "How many shapes are in the picture? Answer with just the number.")
        assert row["image"].mode == "RGB" and row["image"].size == (56, 56)
        assert row["answer"] in {"1", "2", "3"}
        assert len(row_images(row, index=k)) == 1
    assert has_images(rows)
    system = Shapes(system="Answer briefly.")(n=1)[0]["prompt"]
    assert system[0] == {"role": "system", "content": "Answer briefly."} and image_slots(system) == 1


def test_shapes_same_seed_same_pixels():
    a, b = shapes(n=20, seed=7), shapes(n=20, seed=7)
    assert [r["image"].tobytes() for r in a] == [r["image"].tobytes() for r in b]
    assert a.column("answer") == b.column("answer")
    c = shapes(n=20, seed=8)
    assert [r["image"].tobytes() for r in a] != [r["image"].tobytes() for r in c]


def test_shapes_train_and_test_share_no_picture():
    for task in (shapes, Shapes(question="color", max_shapes=2)):
        train = {r["image"].tobytes() for r in task(n=50, seed=0, split="train")}
        test = {r["image"].tobytes() for r in task(n=50, seed=0, split="test")}
        assert len(train) > 40 and len(test) > 40
        assert not train & test
        # other seeds draw other pictures, but never ones of the other split
        assert not {r["image"].tobytes() for r in task(n=50, seed=1, split="test")} & train


@pytest.mark.parametrize("task", [Shapes(), Shapes(size=64, min_shapes=2, max_shapes=5)])
def test_shapes_count_answer_matches_the_pixels(task):
    rows = task(n=40, seed=3)
    counts = Counter()
    for row in rows:
        found = regions(row["image"])
        assert str(len(found)) == row["answer"], row["scene"]
        assert all(color in COLORS.values() and area >= 10 for color, area in found)
        counts[row["answer"]] += 1
    assert len(counts) == task.max_shapes - task.min_shapes + 1  # every count occurs


def test_shapes_color_answer_is_the_largest_region():
    task = Shapes(question="color")
    rows = task(n=40, seed=5, split="test")
    names = {rgb: name for name, rgb in COLORS.items()}
    for row in rows:
        found = sorted(regions(row["image"]), key=lambda r: -r[1])
        assert names[found[0][0]] == row["answer"]
        assert len({color for color, _ in found}) == len(found)  # distinct colours
        if len(found) > 1:
            assert found[0][1] > 1.3 * found[1][1]  # clearly largest
        assert "largest shape" in row["prompt"][0]["content"][1]["text"]
    assert "the shape?" in Shapes(question="color", max_shapes=1)(n=1)[0]["prompt"][0]["content"][1]["text"]


def test_shapes_reward():
    completions = ["2", "There are 2 shapes", "3<|im_end|>", ""]
    assert shapes.reward(None, completions, answer=["2"] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert shapes.reward(["p"] * 4, completions, answer=2) == [1.0, 1.0, 0.0, 0.0]
    conversational = [[{"role": "assistant", "content": "2"}], [{"role": "assistant", "content": "two"}]]
    assert shapes.reward(None, conversational, answer=["2", "2"]) == [1.0, 0.0]
    color = Shapes(question="color")
    assert color.reward(None, ["Blue", "It is blue.", "red, not blue", "bluish", ""], answer="blue") == \
        [1.0, 1.0, 0.0, 0.0, 0.0]
    rows = shapes(n=4, seed=0)  # a TRL-style call with the dataset's columns
    assert shapes.reward(rows.column("prompt"), [shapes.target(r) for r in rows], **{
        k: rows.column(k) for k in ("answer", "image", "question")}) == [1.0] * 4
    with pytest.raises(TypeError, match="needs the 'answer' column"):
        shapes.reward(None, ["2"])
    with pytest.raises(ValueError, match="answer= has 1 entries but there are 2"):
        shapes.reward(None, ["2", "3"], answer=["2"])


def test_shapes_bad_configs():
    with pytest.raises(ValueError, match="question='size' is not a question"):
        Shapes(question="size")
    with pytest.raises(ValueError, match="1 <= min_shapes <= max_shapes"):
        Shapes(min_shapes=3, max_shapes=2)
    with pytest.raises(ValueError, match="don't fit a 56px picture"):
        Shapes(max_shapes=20)
    with pytest.raises(ValueError, match="must be at most 5"):
        Shapes(question="color", size=96, max_shapes=6)
    with pytest.raises(ValueError, match="test_fraction"):
        Shapes(test_fraction=0.0)
    with pytest.raises(ValueError, match="split='val' is not a split"):
        shapes(n=1, split="val")
