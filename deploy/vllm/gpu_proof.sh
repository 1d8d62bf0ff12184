#!/usr/bin/env bash
# The GPU proof of the vllm engine (issue 33), in one call on a lent GPU host with
# vLLM 0.24.0 staged on its torch 2.11 (../shared/device/README.md: stage.sh, then
# install.sh with the last chunk; this script sources /tmp/stage/env.sh):
#
#   bash deploy/vllm/gpu_proof.sh OUTDIR [BUDGET_S]
#
# Parts, most important first, each under its own deadline inside BUDGET_S (default
# 560 s; a part with under 30 s left is skipped and says so). Measured on an H200
# (2026-11-28, bench/results/vllm-gpu-2026-11-28.md): gpu-tests about 200 s (the first
# engine's torch.compile 67 s of it), bench about 150 s; the staging before it about
# 95 s of device time and install.sh about 30 s. A whole proof fits the 15 minutes of
# a lent GPU once, with no time for a second try.
#   gpu-tests    pytest -m gpu tests/test_vllm_gpu.py: A-B-A with CUDA graphs on and
#                off, 16 streams across 3 swaps teacher-forced under each stamped
#                version, 64 streams through swaps, the swap's stream, pause mode,
#                forced preemption, LoRA (numbers: OUTDIR/gpu-results.jsonl)
#   bench        python -m pipeline.bench vllm --parts swap on a random Llama: lock,
#                pause and vLLM's own pause + reload_weights side by side
#   stream-test  pytest -m gpu tests/test_vllm_stream_gpu.py: the actor's streaming
#                loop with a real redis-server
# Writes OUTDIR/env.txt (GPU, driver, versions), OUTDIR/parts.txt (each part's exit
# status and time) and one log per part: at most 7 files (the device tool returns 8).
set -uo pipefail
out=${1:?usage: gpu_proof.sh OUTDIR [BUDGET_S]}
budget=${2:-560}
mkdir -p "$out"
# shellcheck disable=SC1091
source /tmp/stage/env.sh
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# spawn, not fork: in pytest on the host CUDA was initialized before vLLM forked its
# engine core, which then died ("Cannot re-initialize CUDA in forked subprocess")
export VLLM_WORKER_MULTIPROC_METHOD=spawn
start=$(date +%s)

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, vllm, transformers; print('torch', torch.__version__, \
'vllm', vllm.__version__, 'transformers', transformers.__version__, \
'gpu', torch.cuda.get_device_name())"
  redis-server --version
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

part() {  # part NAME LIMIT_S COMMAND...
  local name=$1 limit=$2 left t0 rc
  shift 2
  left=$((budget - ($(date +%s) - start)))
  if [ "$left" -lt 30 ]; then
    echo "$name: skipped, $left s of the budget left" | tee -a "$out/parts.txt"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  t0=$(date +%s)
  timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  echo "$name: rc=$rc in $(($(date +%s) - t0)) s (limit $limit s)" | tee -a "$out/parts.txt"
  grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^update_mode|^lock|^pause|^vllm-reload|^none" \
    "$out/$name.log" | tail -40
}

part gpu-tests 270 env NONSTOP_GPU_RESULTS="$out/gpu-results.jsonl" \
  python3 -m pytest -p no:cacheprovider -m gpu tests/test_vllm_gpu.py -v -rs -s --timeout 200
part bench 170 python3 -m pipeline.bench vllm --parts swap --model gpu-random \
  --swaps 3 --streams 64 --out "$out/vllm-gpu.json"
part stream-test 150 python3 -m pytest -p no:cacheprovider -m gpu \
  tests/test_vllm_stream_gpu.py -v -rs -s --timeout 140
echo "total $(($(date +%s) - start)) s"
