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
import signal
import subprocess
import time
from pathlib import Path

from gbattn.analysis.cli import numbers, seed_metrics
from gbattn.arguments import at_least
from gbattn.cli import run_script
from gbattn.data.prepare import prepare_data
from gbattn.errors import UserError
from gbattn.experiments.compare import spec_configs, start_run
from gbattn.experiments.recipes import get_recipe
from gbattn.files import portable_path, read_jsonl, write_json

RECIPE, LABELS = "cpu-postln", ("standard-postln", "gba-m2-postln")
SETS = {"threads": 1}  # as `compare --jobs 2` on 2 cores sets it


def plateau_exit(metrics: Path, threshold: float) -> tuple[int | None, int]:
    """The first logged training step whose loss is below ``threshold`` (None: not yet) and the last step logged
    (a metrics file is read as `gbattn plot` reads it: a cut or damaged line is skipped, never trusted)."""
    exit_step, last = None, 0
    for event in read_jsonl(metrics):
        if event.get("event") != "train" or not numbers(event, "step", "loss"):
            continue
        last = event["step"]
        if exit_step is None and event["loss"] < threshold:
            exit_step = last
    return exit_step, last


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True, help="folder of the probe runs (one per model and seed)")
    parser.add_argument("--seeds", type=int, nargs="+", required=True)
    parser.add_argument("--also", nargs="*", default=[],
                        help="comparison folders trained in full (cpu-postln's, or another recipe's for contrast)")
    parser.add_argument("--threshold", type=float, default=6.4, help="loss (nats) that counts as off the plateau")
    parser.add_argument("--cap", type=at_least(1), default=900, help="stop a run still on the plateau at this step")
    parser.add_argument("--jobs", type=at_least(1), default=2)
    parser.add_argument("--results", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    for folder in args.also:  # checked before any training (read only after it all: a traceback at the end)
        if not Path(folder).is_dir():
            raise UserError(f"--also {folder}: {'is not a folder' if Path(folder).exists() else 'does not exist'}")
    if Path(args.results).is_dir():
        raise UserError(f"--results {args.results}: is a folder; name the JSON file to write")

    def progress(metrics: Path) -> tuple[int | None, int]:
        return plateau_exit(metrics, args.threshold)  # (None, 0) before the run has logged

    recipe = get_recipe(RECIPE)
    specs = {spec.label: spec for spec in recipe.models if spec.label in LABELS}
    # The vocabulary as `compare` fixes it for every model: the tokenizer's (which also warms the token cache once)
    model_cfg, train_cfg = spec_configs(recipe, specs[LABELS[0]], args.data, args.seeds[0], SETS, None)
    vocab = prepare_data(train_cfg, model_cfg.vocab_size, progress=False).tokenizer.vocab_size
    queue = [(label, seed) for seed in args.seeds for label in LABELS]
    running: dict[tuple[str, int], tuple[subprocess.Popen, Path]] = {}
    while queue or running:
        while queue and len(running) < args.jobs:
            label, seed = queue.pop(0)
            run_dir = out / label / f"seed{seed}"
            exit_step, last = progress(run_dir / "metrics.jsonl")
            if exit_step is not None or last >= args.cap:  # measured by an earlier call
                continue
            model_cfg, train_cfg = spec_configs(recipe, specs[label], args.data, seed, SETS, vocab)
            proc = start_run(run_dir, recipe.preset, model_cfg, train_cfg, {"label": label, "recipe": RECIPE}, {})
            running[label, seed] = proc, run_dir / "metrics.jsonl"
        time.sleep(2)
        for (label, seed), (proc, metrics) in list(running.items()):
            exit_step, last = progress(metrics)
            if proc.poll() is None:
                if exit_step is None and last < args.cap:
                    continue
                proc.send_signal(signal.SIGTERM)  # it checkpoints and stops
            proc.wait()
            del running[label, seed]
            print(f"{label} seed {seed}: {progress(metrics)}", flush=True)
    runs = []
    for folder, kind in [(out, "probe")] + [(Path(a), "full run") for a in args.also]:
        labels = LABELS if kind == "probe" else sorted(p.name for p in folder.iterdir() if p.is_dir())
        for label in labels:
            for seed, metrics in seed_metrics(folder, label):
                if kind == "probe" and int(seed) not in args.seeds:  # another call's probe: not this command's
                    continue
                exit_step, last = plateau_exit(metrics, args.threshold)
                runs.append({"label": label, "seed": int(seed), "run": kind,
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


if __name__ == "__main__":
    run_script(main)
