#!/usr/bin/env bash
# Install TRL 1.16 into its own venv (default .venv-trl, git-ignored) for bench/bench_vs_trl.py.
#
#   bash bench/setup_trl.sh            # or: make bench-trl (runs this first)
#   TRL_VENV="$HOME/venvs/trl" bash bench/setup_trl.sh   # another place (then pass --trl-python)
#
# Same pip as the Makefile's `setup`: the machine's pip config (local index, wheels on disk, the torch
# cap) applies; torch is pinned first so pip never resolves an unpinned torch into a multi-GB CUDA
# build. transformers and accelerate are pinned to the main venv's versions when it exists, so both
# sides run the same model code. py-spy (a standalone profiler binary) comes along for the profile.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TRL_VENV:-.venv-trl}
PY=${PY:-python3}
STAMP="$VENV/.trl-installed"
if [ -f "$STAMP" ]; then echo "$VENV: TRL already installed ($(cat "$STAMP"))"; exit 0; fi

test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1; then "$VENV/bin/pip" install -q 'torch>=2.8,<=2.14.1'
else "$VENV/bin/pip" install -q torch==2.13.0; fi

pins=()
if [ -x .venv/bin/python ]; then
  read -r tf acc pf < <(.venv/bin/python -c "import transformers, accelerate, peft
print(transformers.__version__, accelerate.__version__, peft.__version__)")
  pins+=("transformers==$tf" "accelerate==$acc" "peft==$pf")
else
  pins+=(peft)  # TRL's LoRA path (bench_vs_trl.py --lora)
fi
"$VENV/bin/pip" install -q 'trl==1.16.0' datasets "${pins[@]}" py-spy
"$VENV/bin/python" -c "import trl, transformers, torch; print('trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)" | tee "$STAMP"
