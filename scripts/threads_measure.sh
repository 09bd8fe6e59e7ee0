#!/usr/bin/env bash
# The README's "Threads" table, measured: cpu-char standard training (60 steps) and generation (300 tokens)
# with 2 threads (PyTorch's default on 2 cores), 1 thread and gbattn's default thread count, while two other
# single-threaded trainings hold the cores. Writes OUT/threads.json and OUT/threads.md.
#
#   bash scripts/threads_measure.sh [OUT]     (default OUT: results/threads; about 2 minutes on 2 cores;
#                                             PYTHON=path/to/python picks the interpreter gbattn is installed in)
#
# Run it on an otherwise idle machine: the two load trainings are the only other work it means to measure beside.
set -euo pipefail
OUT=${1:-results/threads}
PY=${PYTHON:-python}
WORK=$(mktemp -d)
LOADS=()
cleanup() {
  for pid in "${LOADS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

gbattn() { "$PY" -m gbattn "$@"; }
DATA=(--preset cpu-char --data tiny-shakespeare)

for n in 1 2; do  # the other work: two single-threaded trainings that outlast the measurement
  # (python itself in the background, not the function: $! was a subshell's, and killing it left the training
  # running after the script, reparented to init)
  "$PY" -m gbattn train "${DATA[@]}" --threads 1 --set max_steps=1000000 --quiet --out "$WORK/load$n" \
    >"$WORK/load$n.log" 2>&1 &
  LOADS+=($!)
done
sleep 30  # past their data preparation: both cores busy

for threads in 2 1 default; do
  option=(); [ "$threads" = default ] || option=(--threads "$threads")
  gbattn train "${DATA[@]}" --set max_steps=60 --quiet --out "$WORK/train-$threads" "${option[@]}" >/dev/null
  cut -d' ' -f1 /proc/loadavg >"$WORK/load-train-$threads"
done
for threads in 2 1 default; do
  option=(); [ "$threads" = default ] || option=(--threads "$threads")
  gbattn generate "$WORK/train-1" --prompt "ROMEO:" --max-new-tokens 300 --seed 0 "${option[@]}" \
    2>"$WORK/generate-$threads.err" >/dev/null
  cut -d' ' -f1 /proc/loadavg >"$WORK/load-generate-$threads"
done

mkdir -p "$OUT"
WORK="$WORK" OUT="$OUT" "$PY" - <<'EOF'
import json, os, platform, re
from pathlib import Path

from gbattn.runtime import software_versions

work, out = Path(os.environ["WORK"]), Path(os.environ["OUT"])
rows = {}
for threads in ("2", "1", "default"):
    result = json.loads((work / f"train-{threads}" / "result.json").read_text())
    rate = re.search(r"\(([\d,]+) tokens/s", (work / f"generate-{threads}.err").read_text())
    rows[threads] = {
        "train_tokens_per_s": round(result["train_tokens_per_s"]),
        "train_device": result["device"],
        "generate_tokens_per_s": int(rate.group(1).replace(",", "")),
        "load_average": {"train": float((work / f"load-train-{threads}").read_text()),
                         "generate": float((work / f"load-generate-{threads}").read_text())},
    }
report = {
    "command": "bash scripts/threads_measure.sh",
    "what": "cpu-char standard, tiny-shakespeare: training 60 steps (train_tokens_per_s of result.json), "
            "generation of 300 tokens from 'ROMEO:' (seed 0), beside two single-threaded trainings",
    "cores": os.cpu_count(), "machine": platform.processor() or platform.machine(),
    "versions": software_versions(),
    "threads": rows,
}
(out / "threads.json").write_text(json.dumps(report, indent=1) + "\n")
two, one, default = rows["2"], rows["1"], rows["default"]
chosen = re.search(r"\d+ threads?", default["train_device"]).group()
md = [f"# Threads beside other work ({report['cores']} cores, {report['machine']})", "",
      f"`{report['command']}`: {report['what']}.", "",
      "| what (cpu-char, standard) | 2 threads (PyTorch's default) | 1 thread | gbattn's default |", "| --- | ---: | ---: | ---: |",
      f"| training, tokens/s (60 steps) | {two['train_tokens_per_s']:,} | {one['train_tokens_per_s']:,} | "
      f"{default['train_tokens_per_s']:,} ({chosen} chosen) |",
      f"| generation, tokens/s (300 tokens) | {two['generate_tokens_per_s']:,} | {one['generate_tokens_per_s']:,} | "
      f"{default['generate_tokens_per_s']:,} |", ""]
(out / "threads.md").write_text("\n".join(md))
print("\n".join(md))
EOF
