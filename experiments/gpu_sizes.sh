#!/usr/bin/env bash
# gpu_suite.sh's timing steps on random-weight models of larger shapes, drawn on the GPU itself (weights cannot
# travel to the lent machine: one call carries 64 MiB).
#
#   bash experiments/gpu_sizes.sh OUT_DIR DESC_DIR...
#
# Each DESC_DIR is a description folder (config + tokenizer, no weights) made here with
#   python -m experiments.bench.random_weights --config-only --like <model dir> --out DESC_DIR
# and its config.json edited to the shape wanted. For each, the weights are drawn on the GPU into /tmp/kvboost_random_<name> and
# `gpu_suite.sh ${SIZE_STEPS:-replay,decode}` runs on them into OUT_DIR/<name> (DECODE_BATCHES, REPLAY_NEW_TOKENS
# and TIMEOUT_PERCENT pass through). Timings only: greedy-match columns of random weights say nothing.
set -uo pipefail
out="${1:?usage: gpu_sizes.sh OUT_DIR DESC_DIR...}"
shift
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
failed=0
for desc in "$@"; do
  name="$(basename "$desc")"
  mkdir -p "$out/$name"
  start=$SECONDS
  if ! python3 -m experiments.bench.random_weights --like "$desc" --out "/tmp/kvboost_random_$name" --device "${WEIGHTS_DEVICE:-cuda}" >"$out/$name/weights.log" 2>&1; then
    tail -n 20 "$out/$name/weights.log"
    failed=$((failed + 1))
    continue
  fi
  echo "=== $name: weights drawn in $((SECONDS - start))s ($(du -sh "/tmp/kvboost_random_$name" | cut -f1))"
  MODEL_DIR="/tmp/kvboost_random_$name" bash experiments/gpu_suite.sh "${SIZE_STEPS:-replay,decode}" "$out/$name" || failed=$((failed + $?))
  rm -rf "/tmp/kvboost_random_$name"
done
echo "gpu_sizes: $failed step(s) failed"
exit "$failed"
