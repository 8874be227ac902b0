#!/usr/bin/env bash
# Multi-GPU scale at a real model size, the per-GPU batch growing until out of memory:
#
#     bash benchmarks/multigpu_scale.sh OUT_DIR
#
# One accelerate launch of benchmarks/multigpu_scale.py on $CHUNKLOSS_GPUS GPUs (default 2) per backend
# ($CHUNKLOSS_BACKENDS, default "fsdp2 zero3"), trainer ($CHUNKLOSS_TRAINERS, default "sft dpo grpo kto rloo") and
# implementation ($CHUNKLOSS_IMPLS, default "chunked trl liger"; chunked runs its kernels unless
# CHUNKLOSS_KERNELS=0), on $CHUNKLOSS_MODEL (default qwen3-4b; llama3-8b) with $CHUNKLOSS_SEQ_LEN-token
# sequences (default 2048), per-GPU batches $CHUNKLOSS_BATCHES (default 1,2,...,64), $CHUNKLOSS_STEPS steps
# each (default 7, $CHUNKLOSS_WARMUP = 2 untimed), checkpointing on unless CHUNKLOSS_GRADIENT_CHECKPOINTING=0,
# compiled chunk steps unless CHUNKLOSS_CHUNK_COMPILE=0; CHUNKLOSS_PROFILE=1: torch.profiler over the timed
# steps instead. Results: OUT_DIR/<model>_<trainer>_<backend>_<impl>_gc<0|1>[_nokernels][_profile]/, then the
# sets multigpu_scale and profile_multigpu of every run under OUT_DIR (a sweep split over several calls into
# one OUT_DIR is summarised whole). A launch failing after some batches is launched again for the rest. The
# launches still to run share the budget ($CHUNKLOSS_BUDGET_S, default 540 s) evenly, each given at least
# $CHUNKLOSS_MIN_RUN_S (default 90): when it is short the last launches are skipped.
set -u

BUDGET=${CHUNKLOSS_BUDGET_S:-540}
MIN_RUN=${CHUNKLOSS_MIN_RUN_S:-90}
WANTED_BACKENDS=${CHUNKLOSS_BACKENDS:-fsdp2 zero3}
IMPLS=${CHUNKLOSS_IMPLS:-chunked trl liger}
GPUS=${CHUNKLOSS_GPUS:-2}
MODEL=${CHUNKLOSS_MODEL:-qwen3-4b}
SEQ_LEN=${CHUNKLOSS_SEQ_LEN:-2048}
BATCHES=${CHUNKLOSS_BATCHES:-1,2,4,8,16,32,64}
STEPS=${CHUNKLOSS_STEPS:-7}
WARMUP=${CHUNKLOSS_WARMUP:-2}
FLAGS=()
[ "${CHUNKLOSS_GRADIENT_CHECKPOINTING:-1}" = 0 ] && FLAGS+=(--no-gradient-checkpointing)
[ "${CHUNKLOSS_CHUNK_COMPILE:-1}" = 0 ] && FLAGS+=(--no-chunk-compile)
SUFFIX=_gc${CHUNKLOSS_GRADIENT_CHECKPOINTING:-1}
[ "${CHUNKLOSS_KERNELS:-1}" = 0 ] && FLAGS+=(--kernels off) && SUFFIX=${SUFFIX}_nokernels
[ "${CHUNKLOSS_PROFILE:-0}" = 1 ] && FLAGS+=(--profile) && SUFFIX=${SUFFIX}_profile
RESERVE=40  # seconds kept after the launches for the summary
SKIPPED_RC=125 WORKER=multigpu_scale
# shellcheck source=benchmarks/multigpu_common.sh
source "$(dirname "$0")/multigpu_common.sh"

BACKENDS=""
for b in $WANTED_BACKENDS; do
  [ "$b" = zero3 ] && ! deepspeed_imports && continue
  BACKENDS="$BACKENDS $b"
done

DEADLINE=$((BUDGET - RESERVE))
combos=()
for b in $BACKENDS; do for t in $TRAINERS; do for i in $IMPLS; do combos+=("$t $b $i"); done; done; done
port=29700
done_combos=0
for combo in "${combos[@]}"; do
  read -r t b i <<< "$combo"
  name=${MODEL}_${t}_${b}_$i$SUFFIX
  share=$(((DEADLINE - SECONDS) / (${#combos[@]} - done_combos)))
  [ "$share" -lt "$MIN_RUN" ] && share=$MIN_RUN
  done_combos=$((done_combos + 1))
  end=$((SECONDS + share))
  batches=$BATCHES
  n=1
  while [ -n "$batches" ]; do
    lname=$name
    [ "$n" -gt 1 ] && lname=$name.r$n
    limit=$((end - SECONDS))
    port=$((port + 1))
    # ZeRO-3 keeps memory allocated between the batches of one process, so each of its batches gets a launch.
    this=$batches
    [ "$b" = zero3 ] && this=${batches%%,*}
    # The script starts no batch it predicts to end after its share, less 30 s for the launcher and teardown.
    guarded "$lname" "$limit" "$OUT/$name" \
      "$PY" -m accelerate.commands.launch --config_file "$CONFIGS/$b.yaml" --num_processes "$GPUS" \
      --main_process_port "$port" -m benchmarks.multigpu_scale --trainer "$t" --impl "$i" --model "$MODEL" \
      --seq-len "$SEQ_LEN" --batch-sizes "$this" --steps "$STEPS" --warmup "$WARMUP" \
      --time-budget-s $((limit - 30)) ${FLAGS[@]+"${FLAGS[@]}"} --out "$OUT/$name"
    rc=$?
    [ "$rc" = 124 ] || [ "$rc" = 125 ] || [ ! -d "$OUT/$name" ] && break
    [ "$rc" = 0 ] && [ "$this" = "$batches" ] && break
    # The batches still to run: none after an OOM, a skip, or a launch that failed at its first batch.
    batches=$("$PY" -m benchmarks.multigpu_scale --remaining "$OUT/$name" --batch-sizes "$batches" 2> /dev/null)
    [ -n "$batches" ] && [ "$rc" != 0 ] && note "$name: launching again for batches $batches"
    n=$((n + 1))
  done
done

timeout "$(left)" "$PY" -m benchmarks.multigpu_scale --summary "$OUT" > "$LOGS/summary.log" 2>&1
SUMMARY_RC=$?
report multigpu_scale "summary: exit $SUMMARY_RC (logs/summary.log)"
note "done in ${SECONDS}s; summary exit $SUMMARY_RC"
exit "$SUMMARY_RC"
