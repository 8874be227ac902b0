# Sourced by benchmarks/multigpu_run.sh and benchmarks/multigpu_scale.sh (with their argument OUT_DIR), not
# run: the working directory (the checkout, ROOT), OUT (OUT_DIR made absolute), LOGS, PY, CONFIGS, TRAINERS,
# the environment of a multi-GPU benchmark (NCCL and logging variables, the wheels, chunkloss importable,
# logs/env.log), `note`, `left`, `deepspeed_imports`, `guarded` and `report`. `left` reads BUDGET; `guarded`
# also reads DEADLINE, MIN_RUN (the shortest limit worth starting a run with, seconds), SKIPPED_RC (its exit
# status for a run it skips) and WORKER (the module whose leftover worker processes it kills).

if [ $# -ne 1 ]; then
  echo "usage: bash benchmarks/$(basename "$0") OUT_DIR" >&2
  exit 2
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
mkdir -p "$1/logs" || exit 2
OUT=$(cd "$1" && pwd)
LOGS=$OUT/logs
PY=${PYTHON:-python3}
CONFIGS=${CHUNKLOSS_ACCELERATE_CONFIGS:-configs/accelerate}
TRAINERS=${CHUNKLOSS_TRAINERS:-sft dpo grpo kto rloo}
# The time left for one step after the runs: the budget plus a 25 s grace, at least 10 s.
left() { local t=$((BUDGET + 25 - SECONDS)); [ "$t" -lt 10 ] && t=10; echo "$t"; }

# NVLink multicast stays off on the shared H200 hosts (NCCL's NVLS, torch symmetric memory, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Progress bars would fill the logs; the Trainer still logs every step.
export TQDM_DISABLE=1 HF_DATASETS_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# DeepSpeed's JIT ops build here; a run killed while building leaves a lock that would stall the next runs.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-${TMPDIR:-/tmp}/chunkloss_torch_extensions}

: > "$OUT/runs.tsv"
note() { echo "[$(basename "$0" .sh) $(date +%T) +${SECONDS}s] $*" | tee -a "$LOGS/driver.log"; }

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
  # No install of chunkloss: the checkout's root on sys.path is enough (every module lives under chunkloss/).
  export PYTHONPATH="$PYTHONPATH:$ROOT"
  note "chunkloss is not installed: importing it from $ROOT"
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

# deepspeed_imports: whether DeepSpeed imports (logs/deepspeed_import.log); if not, OUT/zero3.error says why.
deepspeed_imports() {
  if timeout 180 "$PY" -c "
import deepspeed, deepspeed.runtime.zero.stage3
from deepspeed.utils import safe_get_full_grad
from accelerate.utils import DeepSpeedPlugin
print('deepspeed', deepspeed.__version__, deepspeed.__file__)" > "$LOGS/deepspeed_import.log" 2>&1; then
    note "$(tail -n 1 "$LOGS/deepspeed_import.log")"
    return 0
  fi
  { echo "DeepSpeed does not import on this host:"; tail -n 30 "$LOGS/deepspeed_import.log"; } > "$OUT/zero3.error"
  note "DeepSpeed unavailable, ZeRO-3 runs skipped: $(tail -n 1 "$LOGS/deepspeed_import.log")"
  return 1
}

# report SET LINE...: logs/report.txt (the LINEs, the environment, every run's exit), printed after OUT/SET.md.
report() {
  local name=$1
  shift
  {
    printf '%s\n' "$@"
    cat "$LOGS/env.log"
    awk -F'\t' '{printf "%s exit %s after %ss\n", $1, $2, $3}' "$OUT/runs.tsv"
    echo "Whole script: ${SECONDS}s; NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE."
  } > "$LOGS/report.txt"
  cat "$OUT/$name.md" "$LOGS/report.txt" 2> /dev/null
}

# guarded NAME LIMIT_S RUN_DIR CMD...: runs CMD under setsid, output tee'd to logs/NAME.log; at the limit (cut
# to the time before the deadline) its process group is sent TERM, then KILL, and the worker processes the run
# recorded in RUN_DIR/pids are killed by id (torchrun starts them in process groups of their own). A run that
# fails leaves OUT_DIR/NAME.error.
guarded() {
  local name=$1 limit=$2 dir=$3
  shift 3
  local left=$((DEADLINE - SECONDS))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt "$MIN_RUN" ]; then
    note "$name: skipped, ${left}s left before the deadline"
    printf '%s\tskipped\t0\n' "$name" >> "$OUT/runs.tsv"
    echo "skipped: no time left before the ${BUDGET}s deadline" > "$OUT/$name.error"
    return "$SKIPPED_RC"
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
    if grep -qa "$WORKER" "/proc/$p/cmdline" 2> /dev/null; then
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
