#!/usr/bin/env bash
# Multi-GPU parity of the chunked trainers on one host with two GPUs, in under 9 minutes:
#
#     bash benchmarks/multigpu_run.sh OUT_DIR
#
# For sft, dpo, grpo, kto and rloo ($CHUNKLOSS_TRAINERS) under $CHUNKLOSS_BACKENDS (default "fsdp2 zero3",
# configs/accelerate/*.yaml): benchmarks/multigpu_parity.py on 2 GPUs and its 1-GPU reference (same config,
# global batch), their comparisons (OUT_DIR/<trainer>_<backend>.json), the multigpu pytest on them and the
# result set OUT_DIR/multigpu.{json,md,png}; logs and a run report in OUT_DIR/logs/. Every run is killed at its
# limit, cut to a deadline of $CHUNKLOSS_BUDGET_S seconds (default 480). A DeepSpeed that does not import
# leaves OUT_DIR/zero3.error and the rest runs. Wheels in .whl/ and .whl-ds/ are installed first
# (multigpu_common.sh); .whl-ds/ holds DeepSpeed 0.19.8 (DS_BUILD_OPS=0, DS_ACCELERATOR=cuda: its ops JIT-build
# on the host's nvcc) and the runtime dependencies the host lacks, for CPython 3.12.
#
# $CHUNKLOSS_MODEL (default tiny) names a real shape of benchmarks/multigpu_scale.py instead (qwen3-4b,
# llama3-8b): 30 steps of $CHUNKLOSS_SEQ_LEN-token sequences (default 2048), checkpointing on unless
# CHUNKLOSS_GRADIENT_CHECKPOINTING=0, each run limited to $CHUNKLOSS_RUN_S seconds (default 240), files and set
# named after the model, and per backend a third run, the reference's batch in two micro-batches, that
# measures the bf16 noise the real-size test allows.
set -u

BUDGET=${CHUNKLOSS_BUDGET_S:-480}
MODEL=${CHUNKLOSS_MODEL:-tiny}
SFX="" RUN_S=150 MODEL_ARGS=(--model "$MODEL")
if [ "$MODEL" != tiny ]; then
  SFX=_$MODEL RUN_S=${CHUNKLOSS_RUN_S:-240}
  MODEL_ARGS+=(--seq-len "${CHUNKLOSS_SEQ_LEN:-2048}")
  [ "${CHUNKLOSS_GRADIENT_CHECKPOINTING:-1}" = 0 ] && MODEL_ARGS+=(--no-gradient-checkpointing)
fi
RESERVE=45  # seconds kept after the runs for the comparisons, the pytest and the summary
MIN_RUN=20 SKIPPED_RC=124 WORKER=multigpu_parity
# shellcheck source=benchmarks/multigpu_common.sh
source "$(dirname "$0")/multigpu_common.sh"

HAVE_DS=1
if deepspeed_imports; then
  timeout 30 ds_report > "$LOGS/ds_report.log" 2>&1 || true
else
  HAVE_DS=0
fi

DEADLINE=$((BUDGET - RESERVE))

# launch TRAINER BACKEND NPROC ACCUMULATE PORT NAME: benchmarks/multigpu_parity.py under accelerate, on 2
# processes, or on 1 as the reference (the global batch, in ACCUMULATE micro-batches).
launch() {
  local t=$1 b=$2 n=$3 acc=$4 port=$5 name=$6
  local script=()
  [ "$n" = 1 ] && script=(--single --world 2 --accumulate "$acc")
  guarded "$name" "$RUN_S" "$OUT/$name" \
    "$PY" -m accelerate.commands.launch --config_file "$CONFIGS/$b.yaml" --num_processes "$n" \
    --main_process_port "$port" -m benchmarks.multigpu_parity --trainer "$t" --out "$OUT/$name" \
    "${MODEL_ARGS[@]}" "${script[@]}"
}

BACKENDS=""
for b in ${CHUNKLOSS_BACKENDS:-fsdp2 zero3}; do
  [ "$b" = zero3 ] && [ "$HAVE_DS" = 0 ] && continue
  BACKENDS="$BACKENDS $b"
done
# The 1-GPU references (the same accelerate config, one process, the global batch): one stream per backend,
# FSDP2's on GPU 0 and ZeRO-3's on GPU 1, side by side. Then the 2-GPU runs, one at a time.
gpu=0
streams=()
for b in $BACKENDS; do
  (
    port=$((29610 + 10 * gpu))
    for t in $TRAINERS; do
      port=$((port + 1))
      CUDA_VISIBLE_DEVICES=$gpu launch "$t" "$b" 1 1 "$port" "${t}_$b${SFX}_ref"
      if [ "$MODEL" != tiny ]; then
        port=$((port + 1))
        CUDA_VISIBLE_DEVICES=$gpu launch "$t" "$b" 1 2 "$port" "${t}_$b${SFX}_noise"
      fi
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
    launch "$t" "$b" 2 1 "$port" "${t}_$b$SFX"
  done
done

for t in $TRAINERS; do
  for b in fsdp2 zero3; do
    r=${t}_$b$SFX
    noise=()
    [ -f "$OUT/${r}_noise/run.json" ] && noise=(--noise "$OUT/${r}_noise" "$OUT/${r}_ref")
    if [ -f "$OUT/$r/run.json" ] && [ -f "$OUT/${r}_ref/run.json" ]; then
      if ! timeout "$(left)" "$PY" -m benchmarks.multigpu_parity --trainer "$t" --compare "$OUT/$r" \
        "$OUT/${r}_ref" "${noise[@]}" --out "$OUT/$r.json" > "$LOGS/compare_$r.log" 2>&1; then
        { echo "comparison failed:"; tail -n 20 "$LOGS/compare_$r.log"; } > "$OUT/$r.error"
      fi
      cat "$LOGS/compare_$r.log"
    elif [ -f "$OUT/${r}_ref.error" ]; then
      { echo "1-GPU reference failed:"; cat "$OUT/${r}_ref.error"; } > "$OUT/$r.error"
    fi
  done
done

note "pytest -m multigpu on the comparisons in $OUT"
SELECT=(-m multigpu -k "not real_size")
[ "$MODEL" != tiny ] && SELECT=(-k real_size)
CHUNKLOSS_MULTIGPU_RESULTS=$OUT CHUNKLOSS_MODEL=$MODEL timeout "$(left)" "$PY" -m pytest -q -rA \
  -p no:cacheprovider "${SELECT[@]}" tests/trainers/test_multigpu.py 2>&1 | tee "$LOGS/pytest.log"
PYTEST_RC=${PIPESTATUS[0]}
# The ZeRO-3 head on CPU (2 gloo processes against one, fp32), if DeepSpeed imports and time is left: its
# first run JIT-builds DeepSpeed's CPU shared-memory op.
CPU_TEST="not run"
if [ "$HAVE_DS" = 1 ] && [ "$MODEL" = tiny ] && [ "$(left)" -gt 100 ]; then
  DEADLINE=$((BUDGET + 10))  # this run may use the time kept for the summary, less 15 s
  guarded zero3_cpu_test 150 "$OUT/zero3_cpu_test" \
    "$PY" -m pytest -q -rA -p no:cacheprovider -k zero3_gloo tests/trainers/test_multigpu.py
  CPU_TEST="exit $?: $(grep -E '(passed|failed|skipped|error)' "$LOGS/zero3_cpu_test.log" | tail -n 1)"
fi

timeout "$(left)" "$PY" -m benchmarks.multigpu_parity --summary "$OUT" --model "$MODEL" > "$LOGS/summary.log" 2>&1
report "multigpu$SFX" \
  "pytest -m multigpu (exit $PYTEST_RC): $(grep -E '(passed|failed|skipped|error)' "$LOGS/pytest.log" | tail -n 1)" \
  "ZeRO-3 head on CPU, 2 gloo processes vs 1 (test_zero3_gloo_grads_equal_single_process): $CPU_TEST" \
  "$([ "$HAVE_DS" = 1 ] && tail -n 1 "$LOGS/deepspeed_import.log" || head -n 5 "$OUT/zero3.error")"
note "done in ${SECONDS}s; pytest exit $PYTEST_RC"
exit "$PYTEST_RC"
