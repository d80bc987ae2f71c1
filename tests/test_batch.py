"""rlkit.batch: the typed Batch's row operations against rows picked by hand, its errors, and the old
checkpoints (dict batches) it reads."""

from __future__ import annotations

import pickle

import pytest
import torch

from rlkit.batch import Batch, cat, pad, rows, split, take


def _batch(n: int = 5) -> Batch:
    r = torch.arange(n)
    return Batch(input_ids=r[:, None] * 10 + torch.arange(4), attention_mask=torch.ones(n, 4, dtype=torch.long),
                 response_mask=(r[:, None] + torch.arange(2) < n).float(), rollout_logprobs=-r[:, None].float().expand(n, 2),
                 uid=[int(i) // 2 for i in r], completion=[f"c{i}" for i in range(n)],
                 episode=[{"turns": i} for i in range(n)], columns={"prompt": [f"p{i}" for i in range(n)]},
                 timing=0.25)


def _row(b: Batch, i: int) -> tuple:
    """Sample i of ``b``, every per-row field, read by hand."""
    return (b.input_ids[i].tolist(), b.response_mask[i].tolist(), b.rollout_logprobs[i].tolist(), b.uid[i],
            b.completion[i], b.episode[i], b.columns["prompt"][i])


def test_take_split_pad_cat_move_every_field_by_rows():
    b = _batch(5)
    picked = b.take([4, 0, 2])
    assert [_row(picked, j) for j in range(3)] == [_row(b, i) for i in (4, 0, 2)]
    assert picked.timing == 0.25  # meta is copied, not cut

    padded, n = b.pad(4)  # 5 rows -> 8: the last row repeated
    assert n == 5 and len(padded) == 8 and [_row(padded, j) for j in range(5, 8)] == [_row(b, 4)] * 3
    parts = padded.split(4)
    assert [len(p) for p in parts] == [2, 2, 2, 2] and _row(parts[1], 0) == _row(b, 2)
    back = Batch.cat(parts).truncate(n)
    assert [_row(back, i) for i in range(5)] == [_row(b, i) for i in range(5)] and back.timing == 0.25
    assert b.pad(5) == (b, 5)  # nothing to add: the same object
    with pytest.raises(ValueError, match=r"5 rows does not split into 2 equal parts; pad it to a multiple of 2"):
        b.split(2)


def test_the_module_functions_cut_plain_dicts_and_lists_the_same_way():
    d = {"x": torch.arange(6).view(3, 2), "s": ["a", "b", "c"], "meta": 0.5, "nested": {"y": [1, 2, 3]}}
    assert rows(d) == 3 and take(d, [2, 0])["s"] == ["c", "a"] and take(d, [2, 0])["nested"] == {"y": [3, 1]}
    padded, n = pad(d, 2)
    assert n == 3 and padded["x"][-1].tolist() == [4, 5] and padded["meta"] == 0.5
    assert cat(split(padded, 2))["s"] == ["a", "b", "c", "c"]
    with pytest.raises(ValueError, match="different lengths"):
        rows({"a": [1, 2], "b": [1]})


def test_fields_views_and_pickle():
    b = _batch(4)
    assert b.fields() == ["input_ids", "attention_mask", "response_mask", "rollout_logprobs", "uid", "completion",
                          "episode", "columns", "timing"]
    assert "advantages" not in b and "uid" in b and b["uid"] == b.uid and b.get("advantages", 7) == 7
    with pytest.raises(KeyError, match="'advantages': this Batch has"):
        b["advantages"]
    sent = b.replace(advantages=torch.ones(4, 2)).tensors_only()
    assert sent.uid is None and sent.completion is None and sent.columns is None and sent.advantages is not None
    assert sent.generated().advantages is None and sent.generated().rollout_logprobs is not None
    assert torch.equal(b.loss_tokens, b.response_mask)  # no loss_mask: the response's tokens carry loss
    again = pickle.loads(pickle.dumps(b))
    assert [_row(again, i) for i in range(4)] == [_row(b, i) for i in range(4)]


def test_batch_of_names_the_unknown_and_the_missing_fields():
    assert Batch.of({"input_ids": torch.zeros(2, 3), "attention_mask": torch.ones(2, 3)}).response_mask is None
    with pytest.raises(ValueError, match=r"Batch has no field\(s\) \['advantage'\]"):
        Batch.of({"input_ids": torch.zeros(2, 3), "attention_mask": torch.ones(2, 3), "advantage": torch.zeros(2, 1)})
    with pytest.raises(ValueError, match=r"a Batch needs \['attention_mask'\]"):
        Batch.of({"input_ids": torch.zeros(2, 3)})
    with pytest.raises(TypeError, match="expected a Batch or a dict"):
        Batch.of([1, 2])


def test_a_checkpoint_from_before_the_batch_restores_its_batches_in_flight():
    """ahead.pt of a checkpoint written before rlkit.Batch holds dicts with the same keys: they come back as Batches."""
    from rlkit.ahead import AheadQueue

    old = {k: v for k, v in vars(_batch(2)).items() if v is not None}
    old["policy_version"] = torch.tensor([1, 1])
    queue = AheadQueue()
    queue.restore([(2, old, [{"prompt": "p0", "_row": 0}], 1, [{"bytes": 0.0, "seconds": 0.0, "rss_gb": 0.1}])])
    (entry,) = list(queue)
    got = entry.pending.result()
    assert isinstance(got, Batch) and got.uid == [0, 0] and got.policy_version.tolist() == [1, 1]
