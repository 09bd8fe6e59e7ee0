"""When Post-LN models leave the loss plateau at the start of training (README, "Residual streams").

Every `cpu-postln` run first sits on a plateau, a training loss of about 6.7 nats (WikiText-2, BPE 4,096),
before its loss falls. This trains the recipe's Post-LN standard and GBA M=2 models, with exactly the configs
`gbattn compare --recipe cpu-postln` gives them (same schedule, so the same learning rate at every step),
but only until their training loss leaves the plateau: the first logged step (a mean over the last
`log_every` steps) below ``--threshold``, or ``--cap`` steps. Comparisons already trained in full
(``--also``) are read the same way, every model in them (a Pre-LN one too, for contrast). Two runs at a
time with one thread each, on 2 CPU cores, from the repository root with a local copy of WikiText-2
(README, "Data"):

    python scripts/postln_plateau.py --data path/to/wikitext-2 --out runs/postln-plateau --seeds 42 1 2 3 4 5 \\
        --also runs/cpu-postln-seeds runs/cpu-proxy-seeds --results results/postln-plateau/plateau.json
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from gbattn import rundir
from gbattn.experiments.compare import spec_configs
from gbattn.experiments.recipes import get_recipe
from gbattn.files import portable_path, write_json

RECIPE, LABELS = "cpu-postln", ("standard-postln", "gba-m2-postln")


def plateau_exit(metrics: Path, threshold: float) -> tuple[int | None, int]:
    """The first logged training step whose loss is below ``threshold`` (None: not yet) and the last step logged."""
    exit_step, last = None, 0
    for line in metrics.read_text().splitlines():
        event = json.loads(line)
        if event.get("event") != "train":
            continue
        last = event["step"]
        if exit_step is None and event["loss"] < threshold:
            exit_step = last
    return exit_step, last


def probe(run_dir: Path, label: str, seed: int, data: str) -> subprocess.Popen:
    """Start one run (a planned run directory trained by `gbattn train --resume`, as `compare --jobs` starts it)."""
    recipe = get_recipe(RECIPE)
    spec = next(s for s in recipe.models if s.label == label)
    model_cfg, train_cfg = spec_configs(recipe, spec, data, seed, {"threads": 1}, None)
    if not (run_dir / rundir.CONFIG).exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        rundir.write_config(run_dir, recipe.preset, model_cfg, train_cfg, {"label": label, "recipe": RECIPE},
                            planned=True)
    with open(run_dir / "train.log", "a") as log:
        return subprocess.Popen([sys.executable, "-m", "gbattn.cli", "train", "--resume", "--out", str(run_dir),
                                 "--quiet"], stdout=log, stderr=subprocess.STDOUT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True, help="folder of the probe runs (one per model and seed)")
    parser.add_argument("--seeds", type=int, nargs="+", required=True)
    parser.add_argument("--also", nargs="*", default=[],
                        help="comparison folders trained in full (cpu-postln's, or another recipe's for contrast)")
    parser.add_argument("--threshold", type=float, default=6.4, help="loss (nats) that counts as off the plateau")
    parser.add_argument("--cap", type=int, default=900, help="stop a run still on the plateau at this step")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--results", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    queue = [(label, seed) for seed in args.seeds for label in LABELS]
    running: dict[tuple[str, int], subprocess.Popen] = {}
    while queue or running:
        while queue and len(running) < args.jobs:
            label, seed = queue.pop(0)
            run_dir = out / label / f"seed{seed}"
            metrics = run_dir / "metrics.jsonl"
            if metrics.exists() and _settled(metrics, args.threshold, args.cap):
                continue
            running[(label, seed)] = probe(run_dir, label, seed, args.data)
        time.sleep(2)
        for key, proc in list(running.items()):
            metrics = out / key[0] / f"seed{key[1]}" / "metrics.jsonl"
            if proc.poll() is not None or (metrics.exists() and _settled(metrics, args.threshold, args.cap)):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)  # it checkpoints and stops
                proc.wait()
                del running[key]
                print(f"{key[0]} seed {key[1]}: {plateau_exit(metrics, args.threshold)}", flush=True)
    runs = []
    for folder, kind in [(out, "probe")] + [(Path(a), "full run") for a in args.also]:
        labels = LABELS if kind == "probe" else sorted(p.name for p in folder.iterdir() if p.is_dir())
        for label in labels:
            for run_dir in sorted((folder / label).glob("seed*")):
                metrics = run_dir / "metrics.jsonl"
                if not metrics.exists():
                    continue
                exit_step, last = plateau_exit(metrics, args.threshold)
                runs.append({"label": label, "seed": int(run_dir.name.removeprefix("seed")), "run": kind,
                             "comparison": portable_path(str(folder)), "exit_step": exit_step, "last_step": last})
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    write_json({"recipe": RECIPE, "data": portable_path(args.data), "threshold": args.threshold, "cap": args.cap,
                "command": command(args), "runs": runs},
               args.results)


def command(args) -> str:
    """This invocation, each path as `portable_path` gives it (results files hold no machine's paths)."""
    also = " ".join(portable_path(a) for a in args.also)
    return (f"python scripts/postln_plateau.py --data {portable_path(args.data)} --out {portable_path(args.out)} "
            f"--seeds {' '.join(map(str, args.seeds))}" + (f" --also {also}" if also else "")
            + f" --threshold {args.threshold} --cap {args.cap} --jobs {args.jobs} --results "
            f"{portable_path(args.results)}")


def _settled(metrics: Path, threshold: float, cap: int) -> bool:
    exit_step, last = plateau_exit(metrics, threshold)
    return exit_step is not None or last >= cap


if __name__ == "__main__":
    main()
