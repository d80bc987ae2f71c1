"""Checkpoints and trained models on S3 (rlkit.remote), against a real S3-compatible server: moto's server mode on
127.0.0.1, spoken to over HTTP by s3fs exactly as AWS would be. A save to s3:// resumes exactly (step, metrics,
weights bit for bit) and the next step runs; a save cut short half-way leaves the last good checkpoint named by
CURRENT and loadable; save_pretrained's folder downloads into a model with the local folder's logits; and bad
input (an unknown protocol, missing credentials, a URL with nothing there, no bucket, no server) is a
CheckpointError with the fix, raised before anything is staged."""

from __future__ import annotations

import json
import logging
import math
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _require import need_module

import rlkit
from rlkit.errors import CheckpointError
from rlkit.models import tiny_lm
from rlkit.trainer import Trainer

need_module("s3fs", "RLKIT_REQUIRE_REMOTE")
need_module("moto.server", "RLKIT_REQUIRE_REMOTE")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BUCKET = "rlkit-test"
KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on a free port, the AWS_* environment pointing at it (fake keys), a bucket made."""
    import fsspec
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {**KEYS, "AWS_ENDPOINT_URL": endpoint}.items():
            mp.setenv(k, v)
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        fs.mkdir(BUCKET)
        yield SimpleNamespace(endpoint=endpoint, fs=fs)
    server.stop()


@pytest.fixture
def staged(tmp_path, monkeypatch):
    """The staging folder of uploads and downloads, to check nothing is left in it."""
    folder = tmp_path / "staging"
    monkeypatch.setenv("RLKIT_STAGING_DIR", str(folder))
    return folder


def _trainer(cluster=None, **kw) -> Trainer:
    return Trainer(model=tiny_lm("qwen2", size="test"), dataset=rlkit.tasks.repeat, plan=rlkit.ParallelPlan(),
                   rollout=rlkit.Rollout(engine="hf", n=4, max_new_tokens=8), prompts_per_step=4, lr=1e-2, seed=0,
                   cluster=cluster, **kw)  # as tests/test_save_pretrained.py's: each step moves the weights


def _same_rows(a: list[dict], b: list[dict]) -> bool:
    def same(x, y):
        return (isinstance(x, float) and math.isnan(x) and isinstance(y, float) and math.isnan(y)) or x == y

    return len(a) == len(b) and all(r.keys() == s.keys() and all(same(r[k], s[k]) for k in r) for r, s in zip(a, b))


def _weights(tr: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tr.workers.full_weights().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _store(s3, prefix: str) -> list[str]:
    s3.fs.invalidate_cache()
    return sorted(p[len(f"{BUCKET}/{prefix}/"):] for p in s3.fs.find(f"{BUCKET}/{prefix}"))


def _pointer(s3, prefix: str) -> dict:
    return json.loads(s3.fs.cat_file(f"{BUCKET}/{prefix}/CURRENT"))


@pytest.mark.ray
@pytest.mark.timeout(400)
def test_save_to_s3_and_load_resumes_exactly(s3, staged, tmp_path, ray_cluster):
    url = f"s3://{BUCKET}/run"
    tr = _trainer(ray_cluster, run_dir=str(tmp_path / "run"))
    try:
        tr.fit(steps=2, view="none")
        assert tr.save(url) == url
        rows, weights = [dict(r) for r in tr.history.rows], _weights(tr)
    finally:
        tr.close()
    pointer = _pointer(s3, "run")
    version = pointer["version"]
    assert version.startswith("v-00000002-") and pointer["step"] == 2
    # the store: CURRENT and one version holding every file it names, at the sizes it names
    assert _store(s3, "run") == sorted(["CURRENT", *(f"{version}/{n}" for n in pointer["files"])])
    assert {"trainer.json", "model_config.json", "actor/.metadata", "actor/extra_rank0.pt"} <= set(pointer["files"])
    assert all(s3.fs.size(f"{BUCKET}/run/{version}/{n}") == size for n, size in pointer["files"].items())
    assert not list(staged.iterdir())  # the staged local save is gone

    resumed = Trainer.load(url, dataset=rlkit.tasks.repeat, cluster=ray_cluster)
    try:
        assert resumed.step == 2 and _same_rows(resumed.history.rows, rows)
        assert _equal(_weights(resumed), weights)  # the actor, bit for bit
        assert not list(staged.iterdir())  # the download is gone too: the workers hold what they read
        resumed.fit(steps=1, view="none")
        assert resumed.step == 3 and [r["step"] for r in resumed.history.rows] == [1, 2, 3]
        assert not _equal(_weights(resumed), weights)  # the next step trained

        # a second save: a new version, CURRENT names it, the older one deleted
        resumed.save(url)
        again = _pointer(s3, "run")
        assert again["step"] == 3 and again["version"] != version
        assert {p.split("/")[0] for p in _store(s3, "run")} == {"CURRENT", again["version"]}
    finally:
        resumed.close()


@pytest.mark.timeout(300)
def test_a_save_cut_short_leaves_the_last_good_checkpoint(s3, staged, tmp_path, monkeypatch):
    import s3fs

    url = f"s3://{BUCKET}/cut"
    tr = _trainer(run_dir=str(tmp_path / "run"))
    try:
        tr.fit(steps=1, view="none")
        tr.save(url)
        good, good_weights, good_pointer = _store(s3, "cut"), _weights(tr), s3.fs.cat_file(f"{BUCKET}/cut/CURRENT")
        tr.fit(steps=1, view="none")
        assert not _equal(_weights(tr), good_weights)

        # the connection drops after two files of the new version are up, and the clean-up cannot reach the
        # store either (as when the process is killed): the half version stays, CURRENT does not name it
        real_put, real_rm, put = s3fs.S3FileSystem._put_file, s3fs.S3FileSystem._rm, []

        async def dropping_put(self, lpath, rpath, *args, **kwargs):
            if len(put) == 2:
                raise ConnectionResetError("connection reset by peer (injected)")
            put.append(rpath)
            return await real_put(self, lpath, rpath, *args, **kwargs)

        async def no_rm(self, *args, **kwargs):
            raise ConnectionResetError("connection reset by peer (injected)")

        monkeypatch.setattr(s3fs.S3FileSystem, "_put_file", dropping_put)
        monkeypatch.setattr(s3fs.S3FileSystem, "_rm", no_rm)
        with pytest.raises(CheckpointError, match=r"the upload to s3://rlkit-test/cut failed \(ConnectionResetError.*"
                                                  r"unchanged \(s3://rlkit-test/cut/CURRENT names the last complete"):
            tr.save(url)
        half = sorted(set(_store(s3, "cut")) - set(good))
        assert len(half) == 2 and len({p.split("/")[0] for p in half}) == 1  # two files of one new version
        assert s3.fs.cat_file(f"{BUCKET}/cut/CURRENT") == good_pointer

        # the same cut with the store reachable for the clean-up: the new version's files are deleted
        monkeypatch.setattr(s3fs.S3FileSystem, "_rm", real_rm)
        put.clear()
        with pytest.raises(CheckpointError, match="ConnectionResetError"):
            tr.save(url)
        assert _store(s3, "cut") == sorted(good + half)
        monkeypatch.setattr(s3fs.S3FileSystem, "_put_file", real_put)
        assert not list(staged.iterdir())
    finally:
        tr.close()

    resumed = Trainer.load(url, dataset=rlkit.tasks.repeat)  # the last good checkpoint
    try:
        assert resumed.step == 1 and _equal(_weights(resumed), good_weights)
        resumed.save(url)  # a good save after: CURRENT names it, the half version and the old one are gone
        assert {p.split("/")[0] for p in _store(s3, "cut")} == {"CURRENT", _pointer(s3, "cut")["version"]}
    finally:
        resumed.close()


@pytest.mark.timeout(300)
def test_save_pretrained_to_s3_is_the_local_folder(s3, staged, tmp_path, monkeypatch):
    import s3fs
    from transformers import AutoModelForCausalLM

    for k in (*KEYS, "AWS_ENDPOINT_URL"):  # explicit storage_options this time, nothing from the environment
        monkeypatch.delenv(k)
    options = {"key": "testing", "secret": "testing", "endpoint_url": s3.endpoint}
    url = f"s3://{BUCKET}/final"
    tr = _trainer(run_dir=str(tmp_path / "run"))
    try:
        tr.fit(steps=1, view="none")
        local = Path(tr.save_pretrained(tmp_path / "local"))
        real_put, order = s3fs.S3FileSystem._put_file, []

        async def recording_put(self, lpath, rpath, *args, **kwargs):
            order.append(rpath.rsplit("/", 1)[-1])
            return await real_put(self, lpath, rpath, *args, **kwargs)

        monkeypatch.setattr(s3fs.S3FileSystem, "_put_file", recording_put)
        assert tr.save_pretrained(url, storage_options=options) == url
        assert order[-1] == "config.json" and sorted(order) == sorted(p.name for p in local.iterdir())
        # an earlier model's file the new one lacks is deleted; the folder is replaced whole
        s3.fs.pipe_file(f"{BUCKET}/final/model-00002-of-00002.safetensors", b"old")
        tr.save_pretrained(url, storage_options=options)
        assert _store(s3, "final") == sorted(p.name for p in local.iterdir())
        with pytest.raises(CheckpointError, match="holds a trainer.save checkpoint"):
            s3.fs.pipe_file(f"{BUCKET}/ckpt/CURRENT", b"{}")
            tr.save_pretrained(f"s3://{BUCKET}/ckpt", storage_options=options)
    finally:
        tr.close()

    down = tmp_path / "down"
    s3.fs.get(f"{BUCKET}/final/", str(down), recursive=True)
    assert {p.name: p.read_bytes() for p in down.iterdir()} == {p.name: p.read_bytes() for p in local.iterdir()}
    ids = torch.tensor([[1, 5, 9, 42, 7, 3]])
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(down).eval()(ids).logits
        want = AutoModelForCausalLM.from_pretrained(local).eval()(ids).logits
    assert torch.equal(got, want) and got.abs().sum() > 0
    assert not list(staged.iterdir())


# ---- bad input: each a CheckpointError with the fix, before anything is staged ----------------------------------
def _never(*_a, **_k):
    pytest.fail("the save was staged before the URL was checked")


_FAKE = SimpleNamespace(step=0, save=_never, save_pretrained=_never, workers=object())


@pytest.mark.timeout(60)
def test_an_unknown_protocol_says_the_fix(staged):
    fix = r"fsspec knows no protocol 'nosuchproto'.*pip install s3fs for s3://\), or save to a local path"
    with pytest.raises(CheckpointError, match=fix):
        Trainer.load("nosuchproto://bucket/run", dataset=rlkit.tasks.repeat)
    with pytest.raises(CheckpointError, match=fix):
        Trainer.save(_FAKE, "nosuchproto://bucket/run")
    with pytest.raises(CheckpointError, match=fix):
        Trainer.save_pretrained(_FAKE, "nosuchproto://bucket/final")
    assert not staged.exists() or not list(staged.iterdir())


@pytest.mark.timeout(60)
def test_missing_credentials_name_the_environment_variables(s3, staged, tmp_path, monkeypatch):
    for k in KEYS:
        monkeypatch.delenv(k)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(k, raising=False)
    (tmp_path / "empty").write_text("")
    for k in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(k, str(tmp_path / "empty"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance metadata service to ask here
    fix = (r"s3://rlkit-test/run: no credentials found for s3:// \(NoCredentialsError\): set AWS_ACCESS_KEY_ID and "
           r"AWS_SECRET_ACCESS_KEY \(or AWS_PROFILE\), and AWS_ENDPOINT_URL for an S3-compatible server")
    with pytest.raises(CheckpointError, match=fix):
        Trainer.load(f"s3://{BUCKET}/run", dataset=rlkit.tasks.repeat)
    with pytest.raises(CheckpointError, match=fix):
        Trainer.save(_FAKE, f"s3://{BUCKET}/run")
    with pytest.raises(CheckpointError, match="no credentials found for s3://"):
        Trainer.save_pretrained(_FAKE, f"s3://{BUCKET}/final")
    assert not staged.exists() or not list(staged.iterdir())


@pytest.mark.timeout(60)
def test_nothing_there_no_bucket_no_server(s3, staged, monkeypatch):
    s3.fs.pipe_file(f"{BUCKET}/empty-ish/notes.txt", b"x")
    with pytest.raises(CheckpointError, match=r"no rlkit checkpoint at s3://rlkit-test/empty-ish: s3://rlkit-test/"
                                              r"empty-ish/CURRENT is missing, so nothing was saved there or the save "
                                              r"was interrupted before it finished \(it holds \['notes.txt'\]\)"):
        Trainer.load(f"s3://{BUCKET}/empty-ish", dataset=rlkit.tasks.repeat)
    with pytest.raises(CheckpointError, match=r"the bucket 'no-such-bucket' does not exist .*aws s3 mb"):
        Trainer.save(_FAKE, "s3://no-such-bucket/run")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{dead}")
    with pytest.raises(CheckpointError, match=r"the store does not answer .*check AWS_ENDPOINT_URL"):
        Trainer.load(f"s3://{BUCKET}/run", dataset=rlkit.tasks.repeat)
    assert not staged.exists() or not list(staged.iterdir())
