#!/usr/bin/env bash
# The prepared GPU session (one H200, 15 minutes of device time in all), in priority order: what no CPU
# can reach. Each stage runs under a deadline and its files are copied to OUT as soon as it ends, so a
# session cut short still returns what finished. README, "Reproducing the paper's tables" and "Speed and memory".
#
#   bash scripts/gpu_session.sh [DATA_DIR] [OUT]          # the default stages, in order
#   STAGES="smoke paper" bash scripts/gpu_session.sh ...  # others, or some of them
#   TINY=1 bash scripts/gpu_session.sh                    # the same stages at a toy size on a CPU
#                                                         # (tests/test_gpu_session.py runs some of them so)
#
# Stages (the default: smoke resume bench owt extra analysis; paper ran on 2026-12-04, README):
#   smoke     30 steps of GBA; the script stops at once if they fail
#   resume    a GBA run stopped by SIGTERM after 30 s and resumed for 15 s more: the log says whether resuming works
#             on this device (on 2026-12-04 it did not on CUDA, and the extra stage's runs were lost with it)
#   check     a 3-step comparison of the five paper models with --jobs, once before the first comparison stage
#             (comparisons are skipped if it fails): worth it when other stages follow the comparisons
#   paper     compare paper-wt103, seeds 42 123 7, five models, --jobs 5 (the run directories come back
#             without weights, which are too large to come back)
#   bench     paper-small, every variant, eager and compiled (training step and decoding)
#   owt       the same at owt-125m
#   extra     at once, on one device: paper-postln (seed 42, six models), gba-design-paper's new row (GBA M=3,
#             seeds 42 123 7) and depth-paper's standard and GBA M=2 (seed 42: the analysis stage's runs, and
#             a check that a seed trains to the same figures as in the paper stage's session); their run
#             directories, results included, in one archive without weights
#   analysis  gbattn analyze GBA --against standard, seed 42 of paper-wt103's models (extra's runs when it ran,
#             trained here otherwise): summary and figures in one archive
# At most 8 files come back from one device call: the default stages write 7.
# Sizing (2026-12-04, one H200): the machine held 570 s for a 531 s command (start and transfers: 39 s); smoke
# took 19 s and paper 469 s. A second call finds the machine warm only within 30 s of the first one's end; the
# stages' work folder (WORK) lies under runs/, which the device keeps between calls to a warm machine, so a
# stage cut short by the budget continues in the next call (STAGES="extra analysis").
# DATA_DIR defaults to .device/data/wikitext-2, a git-ignored copy that the device tool carries; a
# GBATTN_CACHE set beforehand (a carried token cache) is kept. Paths given (DATA_DIR, OUT, WORK, GBATTN_CACHE)
# are read from the folder the script is called from; the defaults lie in the repository.
# Killed (SIGTERM, SIGINT, SIGHUP), the script stops its stages too (they checkpoint and stop) before it exits.
set -uo pipefail
caller=$PWD
given() { case $1 in /*) echo "$1" ;; *) echo "$caller/$1" ;; esac; }  # a path given, from the caller's folder
fail() { echo "gpu_session.sh: $*" >&2; exit 2; }
ALL_STAGES="smoke resume check paper bench owt extra analysis"
BUDGET=${BUDGET:-540}  # seconds of work before no new stage starts
STAGES=${STAGES-smoke resume bench owt extra analysis}
[[ $BUDGET =~ ^[0-9]+$ ]] || fail "BUDGET=$BUDGET is not a number of seconds"
BUDGET=$((10#$BUDGET))  # (08 is no octal number: decimal, as written)
read -ra named <<< "$STAGES"
[ ${#named[@]} -gt 0 ] || fail "STAGES is empty: name some of $ALL_STAGES"
for name in "${named[@]}"; do
  [[ " $ALL_STAGES " == *" $name "* ]] || fail "STAGES names '$name', which is no stage: choose from $ALL_STAGES"
done
DATA=${1:+$(given "$1")}; OUT=${2:-${OUT:-}}; OUT=${OUT:+$(given "$OUT")}; WORK=${WORK:+$(given "$WORK")}
[ -n "${GBATTN_CACHE:-}" ] && GBATTN_CACHE=$(given "$GBATTN_CACHE")
cd "$(dirname "$0")/.."
DATA=${DATA:-.device/data/wikitext-2}
OUT=${OUT:-runs/gpu-session}
WORK=${WORK:-runs/gpu-work}
start=$(date +%s)
mkdir -p "$OUT" "$WORK" || fail "cannot make OUT=$OUT or WORK=$WORK"
export PYTHONUNBUFFERED=1 GBATTN_CACHE=${GBATTN_CACHE:-$WORK/cache}
PY=${PY:-python3}  # or the Python that has torch; a device image that keeps it in /opt/torch/.venv is found
[ "$PY" = python3 ] && [ -x /opt/torch/.venv/bin/python ] && PY=/opt/torch/.venv/bin/python
log() { echo "[$(( $(date +%s) - start )) s] $*" | tee -a "$OUT/log.txt"; }
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
wants() { [[ " $STAGES " == *" $1 "* ]]; }
running=()  # the deadlines (timeout's processes) of the stages running now
stop_stages() {  # stop_stages STATUS, on a signal: each timeout passes SIGTERM on to its stage's processes, which
  # checkpoint and stop; the script ends with the shell's status for the signal (130 for SIGINT, 143 for SIGTERM)
  trap - TERM INT HUP
  log "stopped by a signal: stopping the running stages"
  [ ${#running[@]} -gt 0 ] && kill -TERM "${running[@]}" 2> /dev/null
  wait
  exit "$1"
}
trap 'stop_stages 143' TERM
trap 'stop_stages 130' INT
trap 'stop_stages 129' HUP

# INSTALL=0: gbattn is installed already (its test, which must not reinstall it under the other tests)
[ "${INSTALL:-1}" = 1 ] && "$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
GB=("$PY" -m gbattn.cli)
if [ "${TINY:-0}" = 1 ]; then
  DEVICE=cpu
  BENCH=(--preset cpu-char --attn standard boosted --repeats 1 --steps 1 --decode 4 --batch 2 --compile off --quiet)
  OWT=(--preset cpu-char --attn standard boosted --repeats 1 --steps 1 --decode 4 --batch 2 --quiet)
  SMALL=(--data tiny-shakespeare --set tokenizer=char --set d_model=32 --set max_steps=4
         --set eval_every=2 --set train_tokens=null --set eval_tokens=null --set batch_size=4 --threads 2)
  SMOKE=(--data tiny-shakespeare --set tokenizer=char --set d_model=32 --set train_tokens=null
         --set eval_tokens=2048 --set batch_size=4 --threads 2)
  JOBS=2
  SMOKE_LIMIT=400  # (a loaded 2-core CPU took over 120 s for the smoke run's 30 steps: the test failed, nothing did)
else
  DEVICE=cuda
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/log.txt"
  BENCH=(--preset paper-small --attn standard boosted boosted:kv_source=shared twicing gated differential --compile both
         --repeats 3 --steps 5 --decode 64 --quiet)
  OWT=(--preset owt-125m --attn standard boosted --compile both --batch 8 --repeats 3 --steps 3 --decode 32 --quiet)
  SMALL=(--data "$DATA" --set device=cuda)
  SMOKE=(--data "$DATA" --set device=cuda --set eval_tokens=16384)
  JOBS=5
  SMOKE_LIMIT=120
fi
"$PY" -c "import torch" 2>> "$OUT/log.txt" || { log "no torch in $PY: set PY=/path/to/python"; exit 1; }
"$PY" -c "import torch, gbattn; print('torch', torch.__version__, '| gbattn', gbattn.__version__, '|', \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" 2>&1 | tee -a "$OUT/log.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { log "gbattn does not import in $PY (its install failed?)"; exit 1; }

STOP_MARGIN=25  # a stage stopped at its deadline may take 20 s more (--kill-after) and its files a few to copy
deadline() {  # deadline NAME SECONDS: sets limit to SECONDS, or what is left of the budget after STOP_MARGIN, and
  # cut_by_budget to 1 where the budget shortened it; 200 when the budget is spent
  local budget
  budget=$(( $(left) - STOP_MARGIN ))
  if [ "$budget" -lt 30 ]; then log "skip $1: budget spent"; return 200; fi
  limit=$2 cut_by_budget=0; [ "$limit" -gt "$budget" ] && limit=$budget cut_by_budget=1
  log "start $1 (at most $limit s)"
  touch "$WORK/.stage-started"  # keep copies only the files written after this
}
stage() {  # stage NAME SECONDS COMMAND...: run under a deadline, never past the budget; its exit status
  local name=$1 limit status; deadline "$1" "$2" || return 200; shift 2
  timeout --signal=TERM --kill-after=20 "$limit" "$@" >> "$WORK/$name.log" 2>&1 &
  running=($!); wait $!; status=$?; running=()
  log "end $name (exit $status)"
  return $status
}
keep() {  # keep FILE NAME: FILE to OUT/NAME if the stage that just ran wrote it (at most 8 files come back a call)
  if [ -f "$1" ] && [ "$1" -nt "$WORK/.stage-started" ]; then cp "$1" "$OUT/$2"
  else log "no new ${1#"$WORK"/}: not copied"; fi
}
runs_without_weights() {  # the run directories of a comparison as one archive, checkpoints left out, if the stage
  # that just ran wrote in them (an earlier call's alone do not come back as this one's)
  # (in the run directories: compare rewrites its own results files, and takes its lock, when it trains nothing)
  local new
  new=$(find "$1" -mindepth 3 -type f -newer "$WORK/.stage-started" ! -name .lock -print -quit 2> /dev/null)
  if [ -n "$new" ]; then
    tar -C "$1" --exclude='*.pt' --exclude='*.safetensors' --exclude='*.lock' -czf "$OUT/$2" .
  else log "nothing new in ${1#"$WORK"/}: $2 not made"; fi
}

compare_checked=""  # the 3-step comparison's verdict: "", yes or no
comparisons_work() {  # the 3-step comparison (stage check), once, before the first comparison stage
  wants check || return 0
  if [ -z "$compare_checked" ]; then
    stage smoke-compare $SMOKE_LIMIT "${GB[@]}" compare --recipe paper-wt103 --seeds 42 --jobs $JOBS \
      --out "$WORK/smoke-compare" --quiet --set max_steps=3 --set eval_every=3 "${SMOKE[@]}"
    case $? in
      0) compare_checked=yes ;;
      200) return 1 ;;  # no time left to check: nothing known, nothing run
      *) compare_checked=no
         tail -n 30 "$WORK/smoke-compare.log" | tee -a "$OUT/log.txt"; log "comparisons fail: skipping them" ;;
    esac
  fi
  [ "$compare_checked" = yes ]
}

# (--restart: WORK is kept between calls to a warm machine, where an earlier call's run was refused as "already
# holds a run" and the smoke stage stopped the session)
if wants smoke; then
  stage smoke-train $SMOKE_LIMIT "${GB[@]}" train --preset paper-small --attn boosted --set max_steps=30 --set eval_every=15 \
    --out "$WORK/smoke-train" --restart --quiet "${SMOKE[@]}"
  status=$?
  if [ $status = 124 ] && [ "$cut_by_budget" = 1 ]; then
    log "smoke cut short by the budget: not known to fail"  # (so is every later stage: skipped)
  elif [ $status != 0 ] && [ $status != 200 ]; then  # (200: skipped, the budget spent: so is every later stage's)
    tail -n 30 "$WORK/smoke-train.log" | tee -a "$OUT/log.txt"; log "smoke failed: stopping"; exit 3
  fi
fi
checkpoint_step() {  # checkpoint_step RUN_DIR: the step its checkpoint holds, or nothing
  "$PY" -c "import sys, torch; print(torch.load(sys.argv[1], map_location='cpu', weights_only=True)['step'])" \
    "$1/checkpoint.pt" 2> /dev/null
}
if wants resume; then  # both stop at their deadline (124) when they train; a refused resume ends at once (2)
  RESUME=(train --preset paper-small --attn boosted --set max_steps=100000 --set eval_every=100000
          --out "$WORK/smoke-resume" --quiet "${SMOKE[@]}")
  stage resume-start 30 "${GB[@]}" "${RESUME[@]}" --restart
  case $? in
    124) stopped_at=$(checkpoint_step "$WORK/smoke-resume")
         if [ -z "$stopped_at" ]; then
           log "resume not tested: the run left no checkpoint in 30 s"
         else
           stage resume-continue 15 "${GB[@]}" "${RESUME[@]}" --resume
           case $? in
             124) continued_to=$(checkpoint_step "$WORK/smoke-resume")
                  if [ -n "$continued_to" ] && [ "$continued_to" -gt "$stopped_at" ]; then
                    log "resume works on this device (stopped at step $stopped_at, resumed to step $continued_to)"
                  else
                    tail -n 5 "$WORK/resume-continue.log" | tee -a "$OUT/log.txt"
                    log "RESUME FAILS on this device: stopped at step $stopped_at, the resumed run's checkpoint holds" \
                        "step ${continued_to:-none}"
                  fi ;;
             200) log "resume not tested: budget spent" ;;
             *) tail -n 5 "$WORK/resume-continue.log" | tee -a "$OUT/log.txt"; log "RESUME FAILS on this device" ;;
           esac
         fi ;;
    200) log "resume not tested: budget spent" ;;
    *) tail -n 5 "$WORK/resume-start.log" | tee -a "$OUT/log.txt"; log "resume not tested: its run did not start" ;;
  esac
fi
if wants paper && comparisons_work; then
  stage paper-wt103 480 "${GB[@]}" compare --recipe paper-wt103 --seeds 42 123 7 --jobs $JOBS --out "$WORK/paper-wt103" \
    --quiet "${SMALL[@]}"
  keep "$WORK/paper-wt103/results.json" paper-wt103.json
  keep "$WORK/paper-wt103/results.md" paper-wt103.md
  runs_without_weights "$WORK/paper-wt103" paper-wt103-runs.tar.gz
fi
if wants bench; then
  stage bench-paper-small 240 "${GB[@]}" bench --device $DEVICE "${BENCH[@]}" --out "$WORK/bench-paper-small"
  keep "$WORK/bench-paper-small/bench.json" bench-paper-small.json
  keep "$WORK/bench-paper-small/bench.md" bench-paper-small.md
fi
if wants owt; then
  stage bench-owt-125m 300 "${GB[@]}" bench --device $DEVICE "${OWT[@]}" --out "$WORK/bench-owt-125m"
  keep "$WORK/bench-owt-125m/bench.json" bench-owt-125m.json
  keep "$WORK/bench-owt-125m/bench.md" bench-owt-125m.md
fi
if wants extra && comparisons_work; then
  # Three comparisons at once (eleven runs at most): a small model leaves an H200 mostly idle
  EXTRA=$WORK/extra
  if deadline extra 420; then
    extra_compare() {  # extra_compare RECIPE ARGS...: one comparison, in the background
      local recipe=$1; shift
      timeout --signal=TERM --kill-after=20 "$limit" "${GB[@]}" compare --recipe "$recipe" --out "$EXTRA/$recipe" \
        "$@" --quiet "${SMALL[@]}" >> "$WORK/extra-$recipe.log" 2>&1 &
      running+=($!)
    }
    extra_compare paper-postln --seeds 42 --jobs $((JOBS + 1))
    extra_compare gba-design-paper --only gba-m3 --seeds 42 123 7 --jobs 3
    extra_compare depth-paper --only standard gba-m2 --seeds 42 --jobs 2
    status=0; for pid in "${running[@]}"; do wait "$pid" || status=$?; done; running=()
    log "end extra (exit $status)"
    runs_without_weights "$EXTRA" extra-runs.tar.gz
  fi
fi
if wants analysis && comparisons_work; then
  RUNS=$WORK/extra/depth-paper
  [ -f "$RUNS/gba-m2/seed42/result.json" ] && [ -f "$RUNS/standard/seed42/result.json" ] || {
    RUNS=$WORK/paper-wt103
    stage analysis-runs 240 "${GB[@]}" compare --recipe paper-wt103 --seeds 42 --only standard gba-m2 --jobs 2 \
      --out "$RUNS" --quiet "${SMALL[@]}"; }
  stage analysis 90 "${GB[@]}" analyze "$RUNS/gba-m2/seed42" --against "$RUNS/standard/seed42" \
    --device $DEVICE --quiet &&
  tar -C "$RUNS/gba-m2/seed42" -czf "$OUT/analysis-gba-m2-seed42.tar.gz" analysis
fi
(cd "$WORK" && tail -n 3 ./*.log) >> "$OUT/log.txt" 2>/dev/null  # names relative: no machine paths
log "done; files in OUT: $(ls "$OUT" | tr '\n' ' ')"
