"""scripts/postln_plateau.py: when a Post-LN run's training loss leaves the start-of-training plateau, read from its
metrics, and the probe runs that stop there, trained with the configs `gbattn compare --recipe cpu-postln` gives."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import load_script


def _metrics(path: Path, losses: dict[int, float]) -> Path:
    events = [{"event": "train", "step": step, "loss": loss} for step, loss in losses.items()]
    events.insert(2, {"event": "eval", "split": "valid", "step": 20, "valid_loss": 1.0})  # not a training loss
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def test_plateau_exit_is_the_first_logged_training_loss_below_the_threshold(tmp_path):
    script = load_script("postln_plateau")
    metrics = _metrics(tmp_path / "metrics.jsonl", {10: 8.3, 20: 6.7, 30: 6.71, 40: 6.39, 50: 6.5, 60: 6.0})
    assert script.plateau_exit(metrics, 6.4) == (40, 60)
    assert script.plateau_exit(metrics, 6.0) == (None, 60)  # 6.0 is not below 6.0
    assert script.plateau_exit(metrics, 9.0) == (10, 60)


def test_a_damaged_metrics_line_is_skipped_not_trusted(tmp_path):
    """A line cut short by a kill, a loss that is no number and a line that is no object are skipped (as `gbattn
    plot` skips them): the exit is the first sound logged loss below the threshold."""
    script = load_script("postln_plateau")
    metrics = _metrics(tmp_path / "metrics.jsonl", {10: 8.3, 20: 6.7})
    with metrics.open("a") as f:
        f.write('{"event": "train", "step": 30, "loss": "6.0"}\n[1, 2]\n{"event": "train", "step": 40, "loss": 6.3}\n'
                '{"event": "train", "step": 50, "lo')
    assert script.plateau_exit(metrics, 6.4) == (40, 40)


def test_probes_train_the_recipes_configs_and_stop_once_off_the_plateau(tmp_path, monkeypatch):
    """A threshold above every loss: each probe stops at its first logged step (10 of the recipe's 1,200), and the
    results name the data by its folder, with a fully trained folder (--also) read the same way."""
    script = load_script("postln_plateau")
    data = "tiny-shakespeare"  # shipped with the package
    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "cache"))
    also = tmp_path / "full"
    (also / "gba-m2-postln" / "seed7").mkdir(parents=True)
    _metrics(also / "gba-m2-postln" / "seed7" / "metrics.jsonl", {10: 7.0, 20: 6.7, 30: 6.3})
    (also / "gba-m2-postln" / "seed7.bak").mkdir()  # a copy, not a run of seed "7.bak"
    _metrics(also / "gba-m2-postln" / "seed7.bak" / "metrics.jsonl", {10: 7.0})
    out, results = tmp_path / "probes", tmp_path / "results" / "plateau.json"  # a folder not made yet
    monkeypatch.setattr("sys.argv", ["postln_plateau.py", "--data", data, "--out", str(out), "--seeds", "3",
                                     "--also", str(also), "--threshold", "100", "--results", str(results)])
    script.main()
    record = json.loads(results.read_text())
    assert record["data"] == "tiny-shakespeare" and str(tmp_path) not in json.dumps(record)
    runs = {(r["label"], r["seed"], r["run"]): (r["exit_step"], r["last_step"]) for r in record["runs"]}
    assert runs[("standard-postln", 3, "probe")][0] == 10 and runs[("gba-m2-postln", 3, "probe")][0] == 10
    assert all(last < 1200 for exit_step, last in runs.values())  # stopped, not trained to the end
    assert runs[("gba-m2-postln", 7, "full run")] == (10, 30)  # read with the same threshold
    assert len(runs) == 3  # the two probes and seed 7's full run
    from gbattn.experiments.compare import spec_configs
    from gbattn.experiments.recipes import get_recipe

    recipe = get_recipe("cpu-postln")
    for label in ("standard-postln", "gba-m2-postln"):
        config = json.loads((out / label / "seed3" / "config.json").read_text())
        model_cfg, train_cfg = spec_configs(recipe, next(s for s in recipe.models if s.label == label), data, 3,
                                            {"threads": 1}, None)
        assert config["model"]["norm"] == "post" and config["train"]["max_steps"] == 1200
        assert config["model"]["attn"] == model_cfg.attn and config["train"]["lr"] == train_cfg.lr
        assert config["model"]["d_model"] == model_cfg.d_model
