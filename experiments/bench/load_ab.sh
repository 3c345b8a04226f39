#!/bin/bash
# ABBA load test of two checkouts (before, after, after, before), one kvboost-server at a time on one port, the same
# venv; then the after / before table (experiments/bench/load_ab.py).
#   bash experiments/bench/load_ab.sh BEFORE_CHECKOUT AFTER_CHECKOUT OUT_DIR [load_test arguments...]
# e.g. bash experiments/bench/load_ab.sh /tmp/kvboost-before $PWD /tmp/load_ab --users 32 --turns 4 --concurrency 32 \
#          --max-tokens 32 --warmup 4
set -u
BEFORE=$(cd "$1" && pwd); AFTER=$(cd "$2" && pwd); OUT=$(mkdir -p "$3" && cd "$3" && pwd); shift 3
PY=${PYTHON:-python}; PORT=${PORT:-8123}
run_side() {  # checkout name load_test-arguments...
  local dir=$1 name=$2; shift 2
  (cd "$dir" && PYTHONPATH="$dir" exec "$PY" -m kvboost.serving --host 127.0.0.1 --port "$PORT") > "$OUT/server_$name.log" 2>&1 &
  local server=$!
  for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null && break; sleep 1; done
  (cd "$AFTER" && "$PY" -m experiments.bench.load_test --url "http://127.0.0.1:$PORT/v1" --name "$name" --out "$OUT" "$@") \
      > "$OUT/client_$name.log" 2>&1
  kill "$server"; wait "$server"
}
run_side "$BEFORE" before_1 "$@"
run_side "$AFTER" after_1 "$@"
run_side "$AFTER" after_2 "$@"
run_side "$BEFORE" before_2 "$@"
cd "$AFTER" && "$PY" -m experiments.bench.load_ab --before "$OUT/before_1.json" "$OUT/before_2.json" \
    --after "$OUT/after_1.json" "$OUT/after_2.json" --out "$OUT/load_ab.md"
