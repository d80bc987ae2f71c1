"""What a test module needs installed, and whether a missing piece may skip it.

``make test`` sets ``RLKIT_REQUIRE_BACKENDS=1`` (Megatron-Core and DeepSpeed), ``RLKIT_REQUIRE_BROWSER=1``
(Chromium), ``RLKIT_REQUIRE_REAL_MODEL=1`` (the SmolLM2 wheel and gguf) and ``RLKIT_REQUIRE_REMOTE=1`` (s3fs and
moto's S3 server), as ``make test-vllm`` sets
``RLKIT_REQUIRE_VLLM=1``: the setup installed them, so a broken install fails the run instead of turning
into skips that leave it green. Elsewhere (a bare ``pytest`` in a venv without the extras) they skip.
"""

from __future__ import annotations

import importlib
import os

import pytest


def required(guard: str) -> bool:
    """Whether the environment variable ``guard`` says a missing piece is a failure (``"1"``)."""
    return os.environ.get(guard) == "1"


def need_module(name: str, guard: str):
    """``pytest.importorskip(name)``, unless ``guard`` is set: then a failing import fails the test."""
    return importlib.import_module(name) if required(guard) else pytest.importorskip(name)


def missing(what: str, guard: str, fix: str) -> None:
    """Skip for a missing ``what`` (with the ``fix``), or fail when ``guard`` is set."""
    message = f"{what} is missing: {fix}"
    if required(guard):
        pytest.fail(f"{message} ({guard}=1: the setup should have installed it)", pytrace=False)
    pytest.skip(message)
