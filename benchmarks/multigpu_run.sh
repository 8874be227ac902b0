#!/usr/bin/env bash
# Multi-GPU parity of the chunked trainers on one host with two GPUs, in under 9 minutes:
#
#     bash benchmarks/multigpu_run.sh OUT_DIR
#
# For sft, dpo and grpo ($CHUNKLOSS_TRAINERS) under FSDP2 and DeepSpeed ZeRO-3 (configs/accelerate/*.yaml):
# benchmarks/multigpu_parity.py on 2 GPUs, and its reference with the same config on 1 GPU, global batch;
# then the comparisons (OUT_DIR/<trainer>_<backend>.json), the multigpu pytest on them, and the result set
# OUT_DIR/multigpu.{json,md,png}. Logs and a run report: OUT_DIR/logs/. Wheels in .whl/ and .whl-ds/ are
# installed into $CHUNKLOSS_SITE first (multigpu_common.sh). If DeepSpeed does not import, its error goes to
# OUT_DIR/zero3.error and the rest runs. Every run is killed at its limit, cut to a deadline of
# $CHUNKLOSS_BUDGET_S seconds (default 480). .whl-ds/ holds DeepSpeed 0.19.8 built with DS_BUILD_OPS=0 and
# DS_ACCELERATOR=cuda (ops JIT-build on the host's nvcc) and the runtime dependencies the host lacks, for
# CPython 3.12 (hjson, py-cpuinfo, msgpack, ninja, einops, nvidia-ml-py, pydantic with pydantic-core,
# annotated-types, typing-inspection and typing-extensions).
set -u

BUDGET=${CHUNKLOSS_BUDGET_S:-480}
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

# --- runs -------------------------------------------------------------------------------------------
DEADLINE=$((BUDGET - RESERVE))


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
report multigpu \
  "pytest -m multigpu (exit $PYTEST_RC): $(grep -E '(passed|failed|skipped|error)' "$LOGS/pytest.log" | tail -n 1)" \
  "ZeRO-3 head on CPU, 2 gloo processes vs 1 (test_zero3_gloo_grads_equal_single_process): $CPU_TEST" \
  "$([ "$HAVE_DS" = 1 ] && tail -n 1 "$LOGS/deepspeed_import.log" || head -n 5 "$OUT/zero3.error")"
note "done in ${SECONDS}s; pytest exit $PYTEST_RC"
exit "$PYTEST_RC"
