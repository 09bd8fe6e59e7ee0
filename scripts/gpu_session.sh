#!/usr/bin/env bash
# One short GPU session (one H200, about 12 minutes of device time), in priority order: what no CPU
# can reach. Each stage runs under a deadline; its results are copied to $OUT as soon as it ends, so
# a session cut short still returns what finished. README, "Reproducing the paper's tables" and "Speed and memory".
#
#   bash scripts/gpu_session.sh DATA_DIR [OUT]     # DATA_DIR: a local WikiText copy (wiki.train.tokens, ...)
#   TINY=1 bash scripts/gpu_session.sh             # the same stages at a toy size on a CPU (its test)
#
# Stages: 1. paper-small bench, eager and compiled, every variant (compiled speedups on CUDA);
# 2. owt-125m bench, standard and GBA (step and FLOP ratios); 3. compare paper-wt103, seeds 42 123 7,
# five models (the paper table over three seeds); 4. if time is left: paper-postln, gba-design-paper,
# depth-paper (seed 42). DATA_DIR defaults to .device/data/wikitext-2, a git-ignored copy that the
# device tool carries.
set -uo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-.device/data/wikitext-2}
OUT=${2:-${OUT:-runs/gpu-session}}
BUDGET=${BUDGET:-700}  # seconds of work before no new stage starts
WORK=${WORK:-/tmp/gbattn-gpu}
start=$(date +%s)
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 GBATTN_CACHE="$WORK/cache"
PY=${PY:-python3}  # or the Python that has torch; a device image that keeps it in /opt/torch/.venv is found
[ "$PY" = python3 ] && [ -x /opt/torch/.venv/bin/python ] && PY=/opt/torch/.venv/bin/python
log() { echo "[$(( $(date +%s) - start )) s] $*" | tee -a "$OUT/log.txt"; }
left() { echo $(( BUDGET - ($(date +%s) - start) )); }

"$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
GB=("$PY" -m gbattn.cli)
if [ "${TINY:-0}" = 1 ]; then
  DEVICE=cpu
  BENCH=(--preset cpu-char --repeats 1 --steps 1 --decode 4 --batch 2 --compile off --quiet)
  OWT=(--preset cpu-char --attn standard boosted --repeats 1 --steps 1 --decode 4 --batch 2 --quiet)
  SMALL=(--data tiny-shakespeare --set tokenizer=char --set d_model=32 --set max_steps=4 --set epochs=1
         --set eval_every=2 --set train_tokens=null --set eval_tokens=null --set batch_size=4 --threads 2)
  JOBS=2
else
  DEVICE=cuda
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/log.txt"
  BENCH=(--preset paper-small --compile both --repeats 3 --steps 5 --decode 64 --quiet)
  OWT=(--preset owt-125m --attn standard boosted --compile both --batch 8 --repeats 3 --steps 3 --decode 32 --quiet)
  SMALL=(--data "$DATA" --set device=cuda)
  JOBS=5
fi
"$PY" -c "import torch, gbattn; print('torch', torch.__version__, '| gbattn', gbattn.__version__, '|', \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" | tee -a "$OUT/log.txt" || {
  log "no torch in $PY: set PY=/path/to/python"; exit 1; }

stage() {  # stage NAME SECONDS COMMAND...: run under a deadline, never past the budget
  local name=$1 limit=$2; shift 2
  local budget; budget=$(left)
  if [ "$budget" -lt 30 ]; then log "skip $name: budget spent"; return 1; fi
  [ "$limit" -gt "$budget" ] && limit=$budget
  log "start $name (at most $limit s)"
  timeout --signal=TERM --kill-after=20 "$limit" "$@" >> "$WORK/$name.log" 2>&1
  log "end $name (exit $?)"
}
keep() { [ -f "$1" ] && cp "$1" "$OUT/$2"; }  # at most 8 files come back: these

stage bench-paper-small 240 "${GB[@]}" bench --device $DEVICE "${BENCH[@]}" --out "$WORK/bench-paper-small"
keep "$WORK/bench-paper-small/bench.json" bench-paper-small.json
stage bench-owt-125m 150 "${GB[@]}" bench --device $DEVICE "${OWT[@]}" --out "$WORK/bench-owt-125m"
keep "$WORK/bench-owt-125m/bench.json" bench-owt-125m.json
stage paper-wt103 480 "${GB[@]}" compare --recipe paper-wt103 --seeds 42 123 7 --jobs $JOBS --out "$WORK/paper-wt103" \
  --quiet "${SMALL[@]}"
keep "$WORK/paper-wt103/results.json" paper-wt103.json
for recipe in paper-postln gba-design-paper depth-paper; do
  stage "$recipe" 300 "${GB[@]}" compare --recipe $recipe --seeds 42 --jobs $JOBS --out "$WORK/$recipe" --quiet \
    "${SMALL[@]}" || break
  keep "$WORK/$recipe/results.json" "$recipe.json"
done
tail -n 3 "$WORK"/*.log >> "$OUT/log.txt" 2>/dev/null
log "done; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
