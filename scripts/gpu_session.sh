#!/usr/bin/env bash
# The prepared GPU session (one H200, 15 minutes of device time in all), in priority order: what no CPU
# can reach. Each stage runs under a deadline and its files are copied to OUT as soon as it ends, so a
# session cut short still returns what finished. README, "Reproducing the paper's tables" and "Speed and memory".
#
#   bash scripts/gpu_session.sh [DATA_DIR] [OUT]          # the default stages, in order
#   STAGES="smoke paper" bash scripts/gpu_session.sh ...  # others, or some of them
#   TINY=1 bash scripts/gpu_session.sh                    # the same stages at a toy size on a CPU (its test)
#
# Stages (the default: smoke bench owt analysis extra; paper ran on 2026-12-04, README):
#   smoke     30 steps of GBA; the script stops at once if they fail. Before the first comparison, a 3-step
#             comparison of the five paper models with --jobs 5 (comparisons are skipped if it fails)
#   paper     compare paper-wt103, seeds 42 123 7, five models, --jobs 5 (the run directories come back
#             without weights, which are too large to come back)
#   bench     paper-small, standard and GBA, eager and compiled (training step and decoding)
#   owt       the same at owt-125m
#   analysis  standard and GBA of paper-wt103 seed 42 (trained unless paper ran), then gbattn analyze
#             GBA --against standard: summary and figures in one archive
#   extra     paper-postln, gba-design-paper, depth-paper, seed 42: their results in one archive
# At most 8 files come back from one device call: the default stages write 7.
# Sizing (2026-12-04, one H200): the machine held 570 s for a 531 s command (start and transfers: 39 s); smoke
# took 61 s and paper 469 s. A second call finds the machine warm only within 30 s of the first one's end.
# DATA_DIR defaults to .device/data/wikitext-2, a git-ignored copy that the device tool carries; a
# GBATTN_CACHE set beforehand (a carried token cache) is kept.
set -uo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-.device/data/wikitext-2}
OUT=${2:-${OUT:-runs/gpu-session}}
BUDGET=${BUDGET:-540}  # seconds of work before no new stage starts
STAGES=${STAGES:-smoke bench owt analysis extra}
WORK=${WORK:-/tmp/gbattn-gpu}
start=$(date +%s)
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 GBATTN_CACHE=${GBATTN_CACHE:-$WORK/cache}
PY=${PY:-python3}  # or the Python that has torch; a device image that keeps it in /opt/torch/.venv is found
[ "$PY" = python3 ] && [ -x /opt/torch/.venv/bin/python ] && PY=/opt/torch/.venv/bin/python
log() { echo "[$(( $(date +%s) - start )) s] $*" | tee -a "$OUT/log.txt"; }
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
wants() { [[ " $STAGES " == *" $1 "* ]]; }

"$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
GB=("$PY" -m gbattn.cli)
if [ "${TINY:-0}" = 1 ]; then
  DEVICE=cpu
  BENCH=(--preset cpu-char --attn standard boosted --repeats 1 --steps 1 --decode 4 --batch 2 --compile off --quiet)
  OWT=(--preset cpu-char --attn standard boosted --repeats 1 --steps 1 --decode 4 --batch 2 --quiet)
  SMALL=(--data tiny-shakespeare --set tokenizer=char --set d_model=32 --set max_steps=4 --set epochs=1
         --set eval_every=2 --set train_tokens=null --set eval_tokens=null --set batch_size=4 --threads 2)
  SMOKE=(--data tiny-shakespeare --set tokenizer=char --set d_model=32 --set train_tokens=null
         --set eval_tokens=2048 --set batch_size=4 --threads 2)
  JOBS=2
else
  DEVICE=cuda
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/log.txt"
  BENCH=(--preset paper-small --attn standard boosted --compile both --repeats 3 --steps 5 --decode 64 --quiet)
  OWT=(--preset owt-125m --attn standard boosted --compile both --batch 8 --repeats 3 --steps 3 --decode 32 --quiet)
  SMALL=(--data "$DATA" --set device=cuda)
  SMOKE=(--data "$DATA" --set device=cuda --set eval_tokens=16384)
  JOBS=5
fi
"$PY" -c "import torch, gbattn; print('torch', torch.__version__, '| gbattn', gbattn.__version__, '|', \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" | tee -a "$OUT/log.txt" || {
  log "no torch in $PY: set PY=/path/to/python"; exit 1; }

stage() {  # stage NAME SECONDS COMMAND...: run under a deadline, never past the budget; its exit status
  local name=$1 limit=$2 budget status; shift 2
  budget=$(left)
  if [ "$budget" -lt 30 ]; then log "skip $name: budget spent"; return 200; fi
  [ "$limit" -gt "$budget" ] && limit=$budget
  log "start $name (at most $limit s)"
  timeout --signal=TERM --kill-after=20 "$limit" "$@" >> "$WORK/$name.log" 2>&1
  status=$?
  log "end $name (exit $status)"
  return $status
}
keep() { [ -f "$1" ] && cp "$1" "$OUT/$2"; }  # at most 8 files come back in one call
runs_without_weights() {  # the run directories of a comparison as one archive, checkpoints left out
  [ -d "$1" ] && tar -C "$1" --exclude='*.pt' --exclude='*.safetensors' --exclude='*.lock' -czf "$OUT/$2" .
}

compare_checked=""  # the 3-step comparison's verdict: "", yes or no
comparisons_work() {  # the 3-step comparison, once, before the first comparison stage
  if [ -z "$compare_checked" ]; then
    stage smoke-compare 120 "${GB[@]}" compare --recipe paper-wt103 --seeds 42 --jobs $JOBS \
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

if wants smoke; then
  stage smoke-train 120 "${GB[@]}" train --preset paper-small --attn boosted --set max_steps=30 --set eval_every=15 \
    --out "$WORK/smoke-train" --quiet "${SMOKE[@]}" || {
    tail -n 30 "$WORK/smoke-train.log" | tee -a "$OUT/log.txt"; log "smoke failed: stopping"; exit 3; }
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
  stage bench-owt-125m 150 "${GB[@]}" bench --device $DEVICE "${OWT[@]}" --out "$WORK/bench-owt-125m"
  keep "$WORK/bench-owt-125m/bench.json" bench-owt-125m.json
  keep "$WORK/bench-owt-125m/bench.md" bench-owt-125m.md
fi
if wants analysis && comparisons_work; then
  # (a comparison continues: the runs of a paper stage before it are reused)
  stage analysis-runs 240 "${GB[@]}" compare --recipe paper-wt103 --seeds 42 --only standard gba-m2 --jobs 2 \
    --out "$WORK/paper-wt103" --quiet "${SMALL[@]}" &&
  stage analysis 90 "${GB[@]}" analyze "$WORK/paper-wt103/gba-m2/seed42" --against "$WORK/paper-wt103/standard/seed42" \
    --device $DEVICE --quiet &&
  tar -C "$WORK/paper-wt103/gba-m2/seed42" -czf "$OUT/analysis-gba-m2-seed42.tar.gz" analysis
fi
if wants extra && comparisons_work; then
  for recipe in paper-postln gba-design-paper depth-paper; do
    stage "$recipe" 300 "${GB[@]}" compare --recipe $recipe --seeds 42 --jobs $JOBS --out "$WORK/extra/$recipe" \
      --quiet "${SMALL[@]}" || break
  done
  [ -d "$WORK/extra" ] && (cd "$WORK/extra" && tar -czf "$OUT/extra-results.tar.gz" ./*/results.json ./*/results.md)
fi
(cd "$WORK" && tail -n 3 ./*.log) >> "$OUT/log.txt" 2>/dev/null  # names relative: no machine paths
log "done; files in OUT: $(ls "$OUT" | tr '\n' ' ')"
