#!/usr/bin/env bash
# Multi-GPU scale at a real model size: chunkloss's trainers and TRL 1.16's under FSDP2 and DeepSpeed ZeRO-3 on
# one host, the per-GPU batch growing until out of memory (from the repository root):
#
#     bash benchmarks/multigpu_scale.sh OUT_DIR
#
# For each backend (configs/accelerate/{fsdp2,zero3}.yaml), trainer (sft, dpo, grpo) and implementation
# (chunked: chunkloss's Chunked*Trainer; trl: TRL's *Trainer), one accelerate launch on $CHUNKLOSS_GPUS GPUs
# (default 2) of benchmarks/multigpu_scale.py, which trains each per-GPU batch of $CHUNKLOSS_BATCHES in turn
# (default 1,2,4,8,16,32,64) on a randomly initialised $CHUNKLOSS_MODEL (default qwen3-4b; llama3-8b) with
# $CHUNKLOSS_SEQ_LEN-token sequences (default 2048), $CHUNKLOSS_STEPS steps per batch (default 6, the first
# $CHUNKLOSS_WARMUP = 2 left out of the median), gradient checkpointing on unless
# CHUNKLOSS_GRADIENT_CHECKPOINTING=0, the chunked trainers' per-chunk step compiled unless
# CHUNKLOSS_CHUNK_COMPILE=0, until a batch runs out of memory or the launch's share of the time budget runs
# out. Results: OUT_DIR/<trainer>_<backend>_<impl>/batch_<B>.json (or .oom.rank<R>.json,
# .skipped.json); then the result set OUT_DIR/multigpu_scale.{json,md,png} (copy it into benchmarks/results/).
# A launch that fails after some batches are done is launched again from the first batch without a result
# (its logs and error file get a .r<N> suffix); one that fails at its first batch is not.
# CHUNKLOSS_ONE_BATCH_PER_LAUNCH=1 gives every batch a launch of its own (a fresh process per batch, nothing
# left over from the batches before it; each launch then pays the start-up again and is bounded by the time
# limit alone). Logs and a run report: OUT_DIR/logs/.
#
# Time: the budget, $CHUNKLOSS_BUDGET_S seconds (default 540), is shared evenly by the launches still to run
# (time one leaves over goes to the next); each launch is killed at the end of its share and told its share so
# that it starts no batch it cannot finish; a share under $CHUNKLOSS_MIN_RUN_S seconds (default 90) skips the
# launch. CHUNKLOSS_TRAINERS (default "sft dpo grpo"), CHUNKLOSS_BACKENDS (default "fsdp2 zero3") and
# CHUNKLOSS_IMPLS (default "chunked trl") pick a subset, so that the sweep can be split over several calls
# into the same OUT_DIR: each call's summary gathers every run found there.
#
# Wheels in .whl/ and .whl-ds/ (git-ignored) are installed into $CHUNKLOSS_SITE (default /tmp/site) unless
# CHUNKLOSS_SKIP_INSTALL=1, as benchmarks/multigpu_run.sh describes (how .whl-ds/ is built is there). If
# DeepSpeed does not import, the error goes to OUT_DIR/zero3.error and the ZeRO-3 launches are skipped.
# CHUNKLOSS_ACCELERATE_CONFIGS (default configs/accelerate) is the folder of fsdp2.yaml and zero3.yaml.
set -u

if [ $# -ne 1 ]; then
  echo "usage: bash benchmarks/multigpu_scale.sh OUT_DIR" >&2
  exit 2
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
mkdir -p "$1/logs" || exit 2
OUT=$(cd "$1" && pwd)
LOGS=$OUT/logs
BUDGET=${CHUNKLOSS_BUDGET_S:-540}
MIN_RUN=${CHUNKLOSS_MIN_RUN_S:-90}
TRAINERS=${CHUNKLOSS_TRAINERS:-sft dpo grpo}
WANTED_BACKENDS=${CHUNKLOSS_BACKENDS:-fsdp2 zero3}
IMPLS=${CHUNKLOSS_IMPLS:-chunked trl}
GPUS=${CHUNKLOSS_GPUS:-2}
MODEL=${CHUNKLOSS_MODEL:-qwen3-4b}
SEQ_LEN=${CHUNKLOSS_SEQ_LEN:-2048}
BATCHES=${CHUNKLOSS_BATCHES:-1,2,4,8,16,32,64}
STEPS=${CHUNKLOSS_STEPS:-6}
WARMUP=${CHUNKLOSS_WARMUP:-2}
FLAGS=()
[ "${CHUNKLOSS_GRADIENT_CHECKPOINTING:-1}" = 0 ] && FLAGS+=(--no-gradient-checkpointing)
[ "${CHUNKLOSS_CHUNK_COMPILE:-1}" = 0 ] && FLAGS+=(--no-chunk-compile)
CONFIGS=${CHUNKLOSS_ACCELERATE_CONFIGS:-configs/accelerate}
ONE_PER_LAUNCH=${CHUNKLOSS_ONE_BATCH_PER_LAUNCH:-0}
RESERVE=40  # seconds kept after the launches for the summary
# The time left for one step after the launches: the budget plus a 25 s grace, at least 10 s.
left() { local t=$((BUDGET + 25 - SECONDS)); [ "$t" -lt 10 ] && t=10; echo "$t"; }
PY=${PYTHON:-python3}

SKIPPED_RC=125 WORKER=multigpu_scale
# shellcheck source=benchmarks/multigpu_common.sh
source "$ROOT/benchmarks/multigpu_common.sh"
"$PY" -m benchmarks.multigpu_scale --head-memory 2>&1 | tee "$LOGS/head_memory.log"

BACKENDS=""
for b in $WANTED_BACKENDS; do
  if [ "$b" = zero3 ]; then
    if timeout 180 "$PY" -c "
import deepspeed, deepspeed.runtime.zero.stage3
from accelerate.utils import DeepSpeedPlugin
print('deepspeed', deepspeed.__version__, deepspeed.__file__)" > "$LOGS/deepspeed_import.log" 2>&1; then
      note "$(tail -n 1 "$LOGS/deepspeed_import.log")"
    else
      { echo "DeepSpeed does not import on this host:"; tail -n 30 "$LOGS/deepspeed_import.log"; } > "$OUT/zero3.error"
      note "DeepSpeed unavailable, ZeRO-3 launches skipped: $(tail -n 1 "$LOGS/deepspeed_import.log")"
      continue
    fi
  fi
  BACKENDS="$BACKENDS $b"
done

# --- launches ---------------------------------------------------------------------------------------
DEADLINE=$((BUDGET - RESERVE))


combos=()
for b in $BACKENDS; do
  for t in $TRAINERS; do
    for i in $IMPLS; do
      combos+=("$t $b $i")
    done
  done
done
port=29700
done_combos=0
for combo in "${combos[@]}"; do
  read -r t b i <<< "$combo"
  name=${t}_${b}_$i
  share=$(((DEADLINE - SECONDS) / (${#combos[@]} - done_combos)))
  done_combos=$((done_combos + 1))
  end=$((SECONDS + share))
  batches=$BATCHES
  n=1
  while [ -n "$batches" ]; do
    lname=$name
    [ "$n" -gt 1 ] && lname=$name.r$n
    limit=$((end - SECONDS))
    port=$((port + 1))
    these=$batches
    [ "$ONE_PER_LAUNCH" = 1 ] && these=${batches%%,*}
    # The script starts no batch it predicts to end after its share, less 30 s for the launcher and teardown.
    guarded "$lname" "$limit" "$OUT/$name" \
      "$PY" -m accelerate.commands.launch --config_file "$CONFIGS/$b.yaml" --num_processes "$GPUS" \
      --main_process_port "$port" -m benchmarks.multigpu_scale --trainer "$t" --impl "$i" --model "$MODEL" \
      --seq-len "$SEQ_LEN" --batch-sizes "$these" --steps "$STEPS" --warmup "$WARMUP" \
      --time-budget-s $((limit - 30)) ${FLAGS[@]+"${FLAGS[@]}"} --out "$OUT/$name"
    rc=$?
    [ "$rc" = 124 ] || [ "$rc" = 125 ] || [ ! -d "$OUT/$name" ] && break
    [ "$rc" = 0 ] && [ "$ONE_PER_LAUNCH" != 1 ] && break
    # The batches still to run: none after an OOM, a skip, or a launch that failed at its first batch.
    batches=$("$PY" -m benchmarks.multigpu_scale --remaining "$OUT/$name" --batch-sizes "$batches" 2> /dev/null)
    [ -n "$batches" ] && [ "$rc" != 0 ] && note "$name: launching again for batches $batches"
    n=$((n + 1))
  done
done

# --- summary ----------------------------------------------------------------------------------------
timeout "$(left)" "$PY" -m benchmarks.multigpu_scale --summary "$OUT" > "$LOGS/summary.log" 2>&1
SUMMARY_RC=$?
{
  echo "summary: exit $SUMMARY_RC (logs/summary.log)"
  cat "$LOGS/env.log"
  awk -F'\t' '{printf "%s exit %s after %ss\n", $1, $2, $3}' "$OUT/runs.tsv"
  echo "Whole script: ${SECONDS}s; NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE."
} > "$LOGS/report.txt"
cat "$OUT/multigpu_scale.md" "$LOGS/report.txt" 2> /dev/null
note "done in ${SECONDS}s; summary exit $SUMMARY_RC"
exit "$SUMMARY_RC"
