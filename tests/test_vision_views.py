"""Issue 45's notebook part: a vision-language run's sample tables (``batch.table()``, ``trainer.samples()``)
show each sample's image as a thumbnail beside its completion and reward, its prompt as the rendered text;
the live view's sample panel shows them too; a text-only run's tables are exactly what they were.

The assertions are on what the test controls (the dataset rows' images and questions, the thumbnails
``rlkit.vision.thumbnail_html`` makes of them), never on what the random tiny model samples."""

from __future__ import annotations

import pandas as pd
import pytest
from PIL import Image

import rlkit
from rlkit.models import tiny_lm
from rlkit.vision import thumbnail_html
from rlkit.widgets.live import LiveView
from rlkit.widgets.samples import (
    SampleTable,
    Thumbnails,
    samples_panel_html,
    table_html,
    trainer_samples,
    with_images,
)

IMG = '<img src="data:image/png;base64,'
N, PROMPTS = 2, 2


def _run(model, dataset, run_dir):
    """One generated batch and one trained step of a tiny run: (batch, its table, the trainer's samples, and
    each of those samples' dataset row: the row whose prompt object it answered)."""
    tr = rlkit.Trainer(model=model, dataset=dataset, algorithm="grpo", prompts_per_step=PROMPTS, seed=0,
                       rollout=rlkit.Rollout(engine="hf", n=N, max_new_tokens=4), run_dir=str(run_dir))
    try:
        batch = tr.generate()
        tr.fit(steps=1, view="none")
        # trainer.samples() as the user gets it; trainer_samples is a no-op once the Trainer applies it itself
        answered = [next((r for r in tr.rows if r["prompt"] is p), None) for p in tr.history.samples(tr.step)["prompt"]]
        return batch, batch.table(), trainer_samples(tr.samples(), tr.rows), tr.rows, answered
    finally:
        tr.close()


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    return _run(tiny_lm("qwen2_5_vl"), rlkit.tasks.Shapes(), tmp_path_factory.mktemp("vision") / "run")


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return _run(tiny_lm("qwen2", size="test"), rlkit.tasks.repeat, tmp_path_factory.mktemp("text") / "run")


def _expected_thumbnails(table: pd.DataFrame, rows: list[dict]) -> list[str]:
    """The thumbnail of each sample's own dataset row's image, as rlkit.vision draws it."""
    return [thumbnail_html(rows[r]["image"]) for r in table["row"]]


# ---- batch.table() -------------------------------------------------------------------------------------
def test_batch_table_has_an_image_column_beside_the_completion(vision):
    batch, table, _, rows, _ = vision
    assert isinstance(table, SampleTable) and len(table) == PROMPTS * N
    cols = table.columns.tolist()
    assert cols[cols.index("prompt") + 1:cols.index("prompt") + 4] == ["image", "completion", "reward"]
    assert all(isinstance(c, Thumbnails) and len(c.images) == 1 for c in table["image"])
    # the plain-text repr says the image's size, e.g. "56x56"
    sizes = ["{}x{}".format(*rows[r]["image"].size) for r in table["row"]]
    assert table["image"].map(str).tolist() == sizes
    assert all(s in table[["image"]].to_string() for s in sizes) and "base64" not in repr(table)


def test_batch_table_html_shows_each_samples_thumbnail(vision):
    batch, table, _, rows, _ = vision
    for html in (table._repr_html_(), batch._repr_html_()):
        assert html.count(IMG) == len(table)  # once per shown sample
        assert "&lt;img" not in html  # drawn, not escaped
        for tag in _expected_thumbnails(table, rows):  # each sample's own row's image
            assert tag in html
    # a row's samples show the same image; the rows of the step differ
    assert len(set(_expected_thumbnails(table, rows))) == PROMPTS


def test_batch_table_prompt_is_the_rendered_text(vision):
    _, table, _, rows, _ = vision
    for prompt, r in zip(table["prompt"], table["row"]):
        assert isinstance(prompt, str) and "tensor(" not in prompt
        assert "<|image_pad|>" in prompt and rows[r]["question"] in prompt
    assert "tensor(" not in table._repr_html_() and "ImagePrompt(" not in table._repr_html_()


def test_completion_text_stays_escaped_next_to_thumbnails(vision):
    _, table, _, _, _ = vision
    t = table.copy()
    t["completion"] = "<script>x</script>"
    html = t._repr_html_()
    assert "<script>" not in html and "&lt;script&gt;" in html and html.count(IMG) == len(t)
    assert type(t[t["reward"] >= -1]) is SampleTable  # filtered, still drawn with its images


# ---- trainer.samples() ---------------------------------------------------------------------------------
def test_trainer_samples_show_thumbnails_and_prompt_text(vision):
    _, _, samples, _, answered = vision
    assert len(samples) == PROMPTS * N and "image" in samples.columns
    cols = samples.columns.tolist()
    assert cols[cols.index("prompt") + 1] == "image"
    html = samples._repr_html_()
    assert html.count(IMG) == len(samples) and "tensor(" not in html
    for prompt, cell, row in zip(samples["prompt"], samples["image"], answered):
        assert isinstance(prompt, str) and "tensor(" not in prompt and "<|image_pad|>" in prompt
        assert row["question"] in prompt and thumbnail_html(row["image"]) in html
        assert cell._repr_html_() == thumbnail_html(row["image"])  # the sample's own row's image
        assert str(cell) == "{}x{}".format(*row["image"].size)


# ---- text-only runs: as before ------------------------------------------------------------------------
def test_text_only_tables_have_no_image_column(text):
    batch, table, samples, rows, _ = text
    assert type(table) is pd.DataFrame and "image" not in table.columns
    assert table.columns.tolist()[:7] == ["uid", "row", "prompt", "completion", "reward", "tokens", "finish_reason"]
    assert table_html(table) == table.to_html() and IMG not in batch._repr_html_()
    assert type(samples) is pd.DataFrame and "image" not in samples.columns
    assert samples.columns.tolist() == ["step", "prompt", "completion", "reward"]
    assert trainer_samples(samples, rows) is samples
    view = LiveView(1, mode="none", samples=lambda: samples)
    assert view.samples_html() == "" and view._repr_html_() is None  # no panel: the PNG shows, as before


# ---- the live view's sample panel ----------------------------------------------------------------------
def test_live_view_sample_panel_shows_the_thumbnails(vision):
    _, _, samples, _, answered = vision
    view = LiveView(1, mode="widget", title="run", samples=lambda: samples)
    assert len(view.widget.children) == 4  # progress, status, curves, samples
    view.update({"step": 1, "reward/mean": 0.5, "kl": 0.0})
    panel = view.widget.children[-1].value
    assert panel == view.samples_html() and panel.count(IMG) == len(samples)
    for row in answered:
        assert thumbnail_html(row["image"]) in panel
    view.close()
    static = view._repr_html_()  # where widgets don't render: the dashboard and the panel as HTML
    assert static.startswith("<img src='data:image/png;base64,") and static.count(IMG) == len(samples)


def test_live_view_without_samples_is_as_before():
    view = LiveView(1, mode="widget", title="run")
    assert len(view.widget.children) == 3 and view.samples_html() == "" and view._repr_html_() is None
    view.close()


def test_sample_panel_keeps_the_newest_and_reports_a_failing_source():
    img = Image.new("RGB", (40, 20), "blue")
    df = with_images(pd.DataFrame({"step": range(1, 13), "prompt": ["Which?"] * 12, "completion": ["a"] * 12,
                                   "reward": [0.0] * 12}), [{"image": img}] * 12)
    panel = samples_panel_html(df, limit=3)
    assert panel.count(IMG) == 3 and "<td style='padding:2px 6px;vertical-align:middle;text-align:left'>12</td>" in panel

    def broken():
        raise RuntimeError("gone")

    assert "samples: gone" in LiveView(mode="none", samples=broken).samples_html()


def test_frames_of_the_same_samples_compare_equal(vision):
    batch, table, _, _, _ = vision
    again = batch.table()
    assert again.equals(table) and again["image"].iloc[0] is not table["image"].iloc[0]
    assert table["image"].nunique() == PROMPTS  # one image per prompt, its samples share it
