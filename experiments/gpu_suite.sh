#!/usr/bin/env bash
# The GPU checks of kvboost in one script, for a machine with an NVIDIA GPU (compute capability >= 8.0).
#
#   bash experiments/gpu_suite.sh STEPS OUT_DIR
#
# STEPS: a comma-separated list of
#   tests      the GPU tests (CUDA + Triton kernels, the runner's CUDA graphs); GPU_TESTS=paths narrows them,
#              GPU_PYTEST_ARGS adds pytest options (e.g. --maxfail=3)
#   attention  the attention-kernel benchmark (experiments/bench/bench_attention.py --quick)
#   paged      the paged Triton kernels against SDPA on block tables (experiments/bench/bench_paged_attention.py)
#   replay     the ShareGPT replay in bf16 (run.py, every mode; CUDA graphs for decode and short prefills)
#   decode     decode tokens/s of every path at batch 1, 8 and 32 (experiments/bench/bench_decode.py: hf / eager /
#              graphed); DECODE_BATCHES="1 32" narrows the batch sizes
#   decode_step  kernels per step, GPU time per kernel kind and step time against the weight-streaming floor of the
#              graphed decode step, unfused and fused layers, batch 1 / 8 / 32 (experiments/bench/bench_decode_step.py,
#              random weights drawn on the GPU; STEP_SHAPE=qwen2-1.5b by default, DECODE_BATCHES narrows the batches)
#   all        every step above
# REPLAY_CONVERSATIONS, REPLAY_TURNS, REPLAY_MODES (comma-separated) and REPLAY_NEW_TOKENS size the replay;
# KVBOOST_GRAPH_COMPILE=0 captures the CUDA graphs without inductor (warm-up in seconds instead of minutes).
# MODEL_DIR=folder runs replay, decode and profile on that model instead of the bundled one (e.g. a random-weight copy of
# its architecture from experiments/bench/random_weights.py, for timing where the weights cannot travel).
#
# Every step is time-boxed (a limit per step, scaled by TIMEOUT_PERCENT, default 100) and logged under OUT_DIR; a failing
# step does not stop the next one, and the script's exit status is the number of failed steps. CPU-only machines run
# none of this: the CPU suite is the README's test command.
set -uo pipefail

steps="${1:?usage: gpu_suite.sh STEPS OUT_DIR (STEPS: tests,attention,replay,decode or all)}"
out="${2:?usage: gpu_suite.sh STEPS OUT_DIR}"
[[ "$steps" == all ]] && steps="tests,attention,paged,replay,decode,decode_step"
wants() { [[ ",$steps," == *",$1,"* ]]; }
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$(python3 -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null || echo 9.0)}"
percent="${TIMEOUT_PERCENT:-100}"
failed=0

step() {  # step NAME TIMEOUT_S COMMAND...: run, log to OUT/NAME.log, keep going on failure
  local name="$1" limit=$(($2 * percent / 100))
  shift 2
  local start=$SECONDS
  echo "=== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  echo "=== $name: rc=$rc in $((SECONDS - start))s"
  [[ $rc -eq 0 ]] || failed=$((failed + 1))
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c 'import torch, transformers, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "triton", triton.__version__)'
} >"$out/environment.txt" 2>&1
cat "$out/environment.txt"

default_tests="tests/test_model_runner.py tests/kernel_tests/test_paged_attention_triton.py tests/kernel_tests/test_cuda_kernel.py
  tests/kernel_tests/test_backend_gpu_model.py tests/kernel_tests/test_flash_attn_triton.py tests/kernel_tests/test_attention_backends.py
  tests/kernel_tests/test_awq_gemm.py"
model_args=() bench_model=()
if [[ -n "${MODEL_DIR:-}" ]]; then
  model_args=("model.name_or_path=$MODEL_DIR") bench_model=(--model "$MODEL_DIR")
fi
if wants tests; then
  # One pytest run per file, each with its own time box and summary: a run cut short loses only its own file's
  # failure details. The CPU-side checks (C++ emulation of the kernel, nvcc compile check) are CI's or the
  # compile_check script's; they are left out here to keep device time for the GPU.
  for file in ${GPU_TESTS:-$default_tests}; do
    # shellcheck disable=SC2086  # GPU_PYTEST_ARGS is a list of options
    step "gpu_tests_$(basename "$file" .py)" 150 python3 -m pytest -v --tb=short -rfE -p no:cacheprovider \
      --timeout 120 --deselect tests/kernel_tests/test_cuda_kernel.py::test_kernel_cpu_emulation \
      --deselect tests/kernel_tests/test_cuda_kernel.py::test_compile_check_script ${GPU_PYTEST_ARGS:-} "$file"
  done
fi
if wants attention; then
  step bench_attention 120 python3 -m experiments.bench.bench_attention --quick --out "$out/bench_attention_gpu.json"
fi
if wants paged; then
  step bench_paged_attention 240 python3 -m experiments.bench.bench_paged_attention --out "$out"
fi
if wants replay; then
  step replay_bf16 270 python3 run.py logger=none "workload.num_conversations=${REPLAY_CONVERSATIONS:-4}" \
    "workload.max_turns=${REPLAY_TURNS:-6}" "workload.modes=[${REPLAY_MODES:-baseline,hf_prefix,kvboost_cold,kvboost}]" \
    "workload.max_new_tokens=${REPLAY_NEW_TOKENS:-64}" "${model_args[@]}" hydra.run.dir="$out/replay_bf16"
fi
if wants decode; then
  for batch in ${DECODE_BATCHES:-1 8 32}; do
    step "bench_decode_batch$batch" 150 python3 -m experiments.bench.bench_decode --dtypes bfloat16 --contexts 256 1024 \
      --tokens 64 --repeats 3 --batch "$batch" --paths eager graphed "${bench_model[@]}" --out "$out/decode_batch$batch"
  done
fi
if wants decode_step; then
  # shellcheck disable=SC2086  # DECODE_BATCHES is a list
  step decode_step 300 python3 -m experiments.bench.bench_decode_step --shape "${STEP_SHAPE:-qwen2-1.5b}" \
    --batches ${DECODE_BATCHES:-1 8 32} --context "${STEP_CONTEXT:-1024}" --out "$out/decode_step"
fi
echo "gpu_suite: $failed step(s) failed"
exit "$failed"
