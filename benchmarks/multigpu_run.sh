#!/usr/bin/env bash
# Multi-GPU parity of the chunked trainers on one host with two GPUs, in under 9 minutes (from the repository
# root):
#
#     bash benchmarks/multigpu_run.sh OUT_DIR
#
# For each of sft, dpo and grpo and each of FSDP2 and DeepSpeed ZeRO-3 (configs/accelerate/{fsdp2,zero3}.yaml):
# benchmarks/multigpu_parity.py under accelerate launch on 2 GPUs, and the reference with the same config on
# 1 GPU and the global batch (the references of the two backends side by side, on GPU 0 and GPU 1); then each
# 2-GPU run compared with its reference (OUT_DIR/<trainer>_<backend>.json: first-step gradient errors, 20-step
# loss curves, step times, peak memory per GPU), the multigpu pytest reading those comparisons, and the result
# set OUT_DIR/multigpu.{json,md,png} (copy it into benchmarks/results/). Logs and a run report: OUT_DIR/logs/.
#
# Wheels in .whl/ (trl, datasets, ... for a host without network) and .whl-ds/ (both git-ignored) are
# installed into $CHUNKLOSS_SITE (default /tmp/site) unless CHUNKLOSS_SKIP_INSTALL=1. .whl-ds/ holds DeepSpeed
# built with its ops left to JIT-build on the host's nvcc, and the runtime dependencies the host lacks:
#     pip download --no-deps --no-binary :all: deepspeed==0.19.8 -d /tmp/ds
#     DS_BUILD_OPS=0 DS_ACCELERATOR=cuda pip wheel --no-deps --no-build-isolation -w .whl-ds \
#         /tmp/ds/deepspeed-0.19.8.tar.gz    # needs torch in the build environment (CPU torch will do)
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#         --platform any -d .whl-ds hjson py-cpuinfo msgpack ninja einops nvidia-ml-py pydantic==2.13.4 \
#         pydantic-core==2.46.4 annotated-types typing-inspection typing-extensions
# If DeepSpeed does not import, the error goes to OUT_DIR/zero3.error and the rest runs. Every run is killed
# at its time limit, and the limits are cut to the time left before a deadline of $CHUNKLOSS_BUDGET_S seconds
# (default 480), so that the script ends in time even when runs hang. CHUNKLOSS_TRAINERS (default
# "sft dpo grpo") picks the trainers, CHUNKLOSS_ACCELERATE_CONFIGS (default configs/accelerate) the folder of
# fsdp2.yaml and zero3.yaml.
set -u

if [ $# -ne 1 ]; then
  echo "usage: bash benchmarks/multigpu_run.sh OUT_DIR" >&2
  exit 2
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
mkdir -p "$1/logs" || exit 2
OUT=$(cd "$1" && pwd)
LOGS=$OUT/logs
BUDGET=${CHUNKLOSS_BUDGET_S:-480}
TRAINERS=${CHUNKLOSS_TRAINERS:-sft dpo grpo}
CONFIGS=${CHUNKLOSS_ACCELERATE_CONFIGS:-configs/accelerate}
RESERVE=45  # seconds kept after the runs for the comparisons, the pytest and the summary
# The time left for one step after the runs: the budget plus a 25 s grace, at least 10 s.
left() { local t=$((BUDGET + 25 - SECONDS)); [ "$t" -lt 10 ] && t=10; echo "$t"; }
PY=${PYTHON:-python3}

# NVLink multicast stays off on the shared H200 hosts (NCCL's NVLS, torch symmetric memory, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Progress bars would fill the logs; the Trainer still logs every step.
export TQDM_DISABLE=1 HF_DATASETS_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# DeepSpeed's JIT ops build here; a run killed while building leaves a lock that would stall the next runs.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-${TMPDIR:-/tmp}/chunkloss_torch_extensions}

: > "$OUT/runs.tsv"
note() { echo "[multigpu_run $(date +%T) +${SECONDS}s] $*" | tee -a "$LOGS/driver.log"; }

# --- environment -------------------------------------------------------------------------------------
SITE=${CHUNKLOSS_SITE:-/tmp/site}
if [ "${CHUNKLOSS_SKIP_INSTALL:-0}" != 1 ]; then
  wheels=$(ls .whl/*.whl .whl-ds/*.whl 2>/dev/null)
  if [ -n "$wheels" ]; then
    note "installing $(echo "$wheels" | wc -l) wheels into $SITE"
    # shellcheck disable=SC2086
    timeout 180 "$PY" -m pip install -q --no-index --no-deps --upgrade --target "$SITE" $wheels \
      > "$LOGS/install.log" 2>&1 || note "pip install failed (see logs/install.log)"
  fi
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"  # ninja, for DeepSpeed's JIT ops
if ! timeout 120 "$PY" -c "import chunkloss.trainers, chunkloss.kernels" > "$LOGS/import_chunkloss.log" 2>&1; then
  # No install of chunkloss: a package tree of links (chunkloss/ with kernels/ and trainers/ inside, as
  # pyproject.toml maps them), and the working directory off sys.path so that ./chunkloss does not shadow it.
  shim=${TMPDIR:-/tmp}/chunkloss_pkg
  rm -rf "$shim" && mkdir -p "$shim/chunkloss"
  for f in "$ROOT"/chunkloss/*; do ln -s "$f" "$shim/chunkloss/"; done
  ln -s "$ROOT/kernels" "$shim/chunkloss/kernels"
  ln -s "$ROOT/trainers" "$shim/chunkloss/trainers"
  export PYTHONSAFEPATH=1 PYTHONPATH="$shim:$PYTHONPATH:$ROOT"
  note "chunkloss is not installed: using the linked tree $shim (PYTHONSAFEPATH=1)"
fi
{
  nvidia-smi -L 2>&1
  "$PY" - <<'EOF' 2>&1
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
for name in ("transformers", "accelerate", "trl", "datasets", "chunkloss"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as e:  # reported, not fatal here
        print(name, "IMPORT FAILED:", repr(e))
EOF
} > "$LOGS/env.log"
cat "$LOGS/env.log"

HAVE_DS=1
if timeout 180 "$PY" -c "
import deepspeed, deepspeed.runtime.zero.stage3
from deepspeed.utils import safe_get_full_grad
from accelerate.utils import DeepSpeedPlugin
print('deepspeed', deepspeed.__version__, deepspeed.__file__)" > "$LOGS/deepspeed_import.log" 2>&1; then
  note "$(tail -n 1 "$LOGS/deepspeed_import.log")"
  timeout 30 ds_report > "$LOGS/ds_report.log" 2>&1 || true
else
  HAVE_DS=0
  { echo "DeepSpeed does not import on this host:"; tail -n 30 "$LOGS/deepspeed_import.log"; } > "$OUT/zero3.error"
  note "DeepSpeed unavailable, ZeRO-3 runs skipped: $(tail -n 1 "$LOGS/deepspeed_import.log")"
fi

# --- runs -------------------------------------------------------------------------------------------
DEADLINE=$((BUDGET - RESERVE))

# guarded NAME LIMIT_S RUN_DIR CMD...: runs CMD in its own session, output tee'd to logs/NAME.log; at the limit
# (cut to the time before the deadline) its session is sent TERM, then KILL, and the worker processes the run
# recorded in RUN_DIR/pids are killed by id (torchrun starts them in sessions of their own). A run that fails
# leaves OUT_DIR/NAME.error.
guarded() {
  local name=$1 limit=$2 dir=$3
  shift 3
  local left=$((DEADLINE - SECONDS))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 20 ]; then
    note "$name: skipped, ${left}s left before the deadline"
    printf '%s\tskipped\t0\n' "$name" >> "$OUT/runs.tsv"
    echo "skipped: no time left before the ${BUDGET}s deadline" > "$OUT/$name.error"
    return 124
  fi
  note "$name: start (limit ${limit}s)"
  local t0=$SECONDS
  LOG=$LOGS/$name.log setsid bash -c '"$@" 2>&1 | tee "$LOG"; exit "${PIPESTATUS[0]}"' _ "$@" < /dev/null &
  local pid=$! timed_out=0
  while kill -0 "$pid" 2> /dev/null; do
    if [ $((SECONDS - t0)) -ge "$limit" ]; then
      timed_out=1
      kill -TERM -- "-$pid" 2> /dev/null
      sleep 10
      kill -KILL -- "-$pid" 2> /dev/null
      break
    fi
    sleep 1
  done
  wait "$pid"
  local rc=$?
  if [ "$timed_out" = 1 ]; then
    rc=124
    find "$TORCH_EXTENSIONS_DIR" -name lock -delete 2> /dev/null
  fi
  local f p
  for f in "$dir"/pids/*.pid; do
    [ -e "$f" ] || continue
    p=$(cat "$f")
    if grep -qa multigpu_parity "/proc/$p/cmdline" 2> /dev/null; then
      kill -KILL "$p" 2> /dev/null && note "$name: killed leftover worker $p"
    fi
  done
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$OUT/runs.tsv"
  if [ "$rc" = 0 ]; then
    rm -f "$OUT/$name.error"
  else
    # torchrun ends its log with a summary of the failure; the exception lines come before it.
    { echo "exit $rc; exceptions in logs/$name.log:"; grep -aE '[A-Za-z]+(Error|Exception)\b' "$LOGS/$name.log" |
      grep -av Warning | tail -n 5; echo "last lines:"; tail -n 15 "$LOGS/$name.log";
      [ "$timed_out" = 1 ] && echo "timed out after ${limit}s"; } > "$OUT/$name.error"
  fi
  note "$name: exit $rc after $((SECONDS - t0))s"
  return "$rc"
}

# launch TRAINER BACKEND NPROC PORT NAME [--single --world 2]: benchmarks/multigpu_parity.py under accelerate
launch() {
  local t=$1 b=$2 n=$3 port=$4 name=$5
  shift 5
  guarded "$name" 150 "$OUT/$name" \
    "$PY" -m accelerate.commands.launch --config_file "$CONFIGS/$b.yaml" --num_processes "$n" \
    --main_process_port "$port" -m benchmarks.multigpu_parity --trainer "$t" --out "$OUT/$name" "$@"
}

BACKENDS=fsdp2
[ "$HAVE_DS" = 1 ] && BACKENDS="fsdp2 zero3"
# The 1-GPU references (the same accelerate config, one process, the global batch): one stream per backend,
# FSDP2's on GPU 0 and ZeRO-3's on GPU 1, side by side. Then the 2-GPU runs, one at a time.
gpu=0
streams=()
for b in $BACKENDS; do
  (
    port=$((29610 + 10 * gpu))
    for t in $TRAINERS; do
      port=$((port + 1))
      CUDA_VISIBLE_DEVICES=$gpu launch "$t" "$b" 1 "$port" "${t}_${b}_ref" --single --world 2
    done
  ) &
  streams+=($!)
  gpu=$((gpu + 1))
done
wait "${streams[@]}"
port=29640
for b in $BACKENDS; do
  for t in $TRAINERS; do
    port=$((port + 1))
    launch "$t" "$b" 2 "$port" "${t}_$b"
  done
done

# --- comparisons, test, summary ----------------------------------------------------------------------
for t in $TRAINERS; do
  for b in fsdp2 zero3; do
    if [ -f "$OUT/${t}_$b/run.json" ] && [ -f "$OUT/${t}_${b}_ref/run.json" ]; then
      if ! timeout "$(left)" "$PY" -m benchmarks.multigpu_parity --trainer "$t" --compare "$OUT/${t}_$b" \
        "$OUT/${t}_${b}_ref" --out "$OUT/${t}_$b.json" > "$LOGS/compare_${t}_$b.log" 2>&1; then
        { echo "comparison failed:"; tail -n 20 "$LOGS/compare_${t}_$b.log"; } > "$OUT/${t}_$b.error"
      fi
      cat "$LOGS/compare_${t}_$b.log"
    elif [ -f "$OUT/${t}_${b}_ref.error" ]; then
      { echo "1-GPU reference failed:"; cat "$OUT/${t}_${b}_ref.error"; } > "$OUT/${t}_$b.error"
    fi
  done
done

note "pytest -m multigpu on the comparisons in $OUT"
CHUNKLOSS_MULTIGPU_RESULTS=$OUT timeout "$(left)" "$PY" -m pytest -q -rA -p no:cacheprovider -m multigpu \
  tests/trainers/test_multigpu.py 2>&1 | tee "$LOGS/pytest.log"
PYTEST_RC=${PIPESTATUS[0]}
# The ZeRO-3 head on CPU (2 gloo processes against one, fp32), if DeepSpeed imports and time is left: its
# first run JIT-builds DeepSpeed's CPU shared-memory op.
CPU_TEST="not run"
if [ "$HAVE_DS" = 1 ] && [ "$(left)" -gt 100 ]; then
  DEADLINE=$((BUDGET + 10))  # this run may use the time kept for the summary, less 15 s
  guarded zero3_cpu_test 150 "$OUT/zero3_cpu_test" \
    "$PY" -m pytest -q -rA -p no:cacheprovider -k zero3_gloo tests/trainers/test_multigpu.py
  CPU_TEST="exit $?: $(grep -E '(passed|failed|skipped|error)' "$LOGS/zero3_cpu_test.log" | tail -n 1)"
fi

timeout "$(left)" "$PY" -m benchmarks.multigpu_parity --summary "$OUT" > "$LOGS/summary.log" 2>&1
{
  echo "pytest -m multigpu (exit $PYTEST_RC): $(grep -E '(passed|failed|skipped|error)' "$LOGS/pytest.log" | tail -n 1)"
  echo "ZeRO-3 head on CPU, 2 gloo processes vs 1 (test_zero3_gloo_grads_equal_single_process): $CPU_TEST"
  cat "$LOGS/env.log"
  [ "$HAVE_DS" = 1 ] && tail -n 1 "$LOGS/deepspeed_import.log" || head -n 5 "$OUT/zero3.error"
  awk -F'\t' '{printf "%s exit %s after %ss\n", $1, $2, $3}' "$OUT/runs.tsv"
  echo "Whole script: ${SECONDS}s; NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE."
} > "$LOGS/report.txt"
cat "$OUT/multigpu.md" "$LOGS/report.txt" 2> /dev/null
note "done in ${SECONDS}s; pytest exit $PYTEST_RC"
exit "$PYTEST_RC"
