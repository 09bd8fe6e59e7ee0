"""The comparison runner: every model and seed, matched widths and compute, skip finished runs."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil

import pytest
import torch

from gbattn import rundir
from gbattn.config import build_configs
from gbattn.errors import CheckpointError, Interrupted, Terminated, UserError
from gbattn.experiments import compare as compare_mod
from gbattn.experiments.compare import run_compare
from gbattn.experiments.recipes import RECIPES, get_recipe
from gbattn.model.params import count_params
from helpers import TINY, killed_at, signal_during_step, write_corpus


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_builds_its_models(name):
    """Every shipped recipe's model configs validate and build (litgpt's config-hub test), on the meta
    device, with exactly the parameters that the FLOP and parameter-matching arithmetic counts."""
    import torch

    from gbattn.model import GPT

    recipe = get_recipe(name)
    for spec in recipe.models:
        sets = {**recipe.train, **spec.model, **{f"attn.{k}": v for k, v in spec.attn_options.items()}}
        model_cfg, _ = build_configs(recipe.preset, spec.attn, recipe.default_data or "x", sets)
        with torch.device("meta"):
            model = GPT(model_cfg)
        assert sum(p.numel() for p in model.parameters()) == count_params(model_cfg), spec.label


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_judges_gba_at_equal_parameters_and_equal_compute(name):
    """Every recipe but cpu-baselines (mechanisms side by side at one size; cpu-char matches GBA at the same
    setting) has a compute-matched standard row, matched to a GBA model of the same norm and residual stream, and
    all but depth, depth-paper and upcycle a parameter-matched one (README, "Reproducing the paper's tables")."""
    specs = {s.label: s for s in get_recipe(name).models}
    matched = [s for s in specs.values() if s.compute_matched_to]
    assert bool(matched) == (name != "cpu-baselines"), f"{name} has no compute-matched row"
    param_matched = [s for s in specs.values() if s.param_matched_to]
    assert bool(param_matched) == (name not in ("depth", "depth-paper", "upcycle", "cpu-baselines")), name
    assert all(s.attn == "standard" and specs[s.param_matched_to].attn == "boosted" for s in param_matched)
    for s in matched:
        ref = specs[s.compute_matched_to]
        assert s.attn == "standard" and (ref.upcycle or {"attn": ref.attn})["attn"] == "boosted"
        assert s.model == specs[s.compute_matched_to].model  # same norm and residual stream


def tiny_sets(**overrides) -> dict:
    """--set values of a 2-step character-level comparison at TINY's sizes."""
    return dict(TINY, max_steps=2, eval_every=2, tokenizer="char", batch_size=8, seq_len=32, train_tokens=None,
                eval_tokens=None, warmup_steps=1, **overrides)


def test_compare_runs_matches_and_resumes(tmp_path, monkeypatch):
    data = write_corpus(tmp_path / "c")
    sets = dict(TINY, max_steps=6, eval_every=3, tokenizer="char", batch_size=8, seq_len=32, sampling="rows",
                train_tokens=None, eval_tokens=None, warmup_steps=2)
    report = run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), seeds=[1, 2], sets=sets, quiet=True)
    assert report["complete"]
    rows = {r["label"]: r for r in report["models"]}
    assert list(rows) == ["standard", "twicing", "param-fair", "compute-matched", "gba-m2"]
    assert rows["param-fair"]["parameters"] >= rows["gba-m2"]["parameters"] > rows["standard"]["parameters"]
    assert rows["param-fair"]["d_model"] > 32
    # Compute-matched: more steps for the cheaper model, about the same training FLOPs.
    cm, gba = rows["compute-matched"], rows["gba-m2"]
    assert cm["steps"] > gba["steps"]
    assert cm["train_flops"] == pytest.approx(gba["train_flops"], rel=1 / gba["steps"])
    for r in rows.values():
        assert set(r["test_ppl"]) == {"1", "2"} and r["test_ppl_std"] is not None
        assert [p["step"] for p in r["curves"]["1"]][-1] == r["steps"]
    md = (tmp_path / "cmp" / "results.md").read_text()
    assert "| gba-m2 |" in md and "Validation perplexity during training" in md
    json.loads((tmp_path / "cmp" / "results.json").read_text())

    # A second invocation trains nothing: every run is finished. (Its recipe.json as gbattn wrote it
    # before data paths that climb out of the working directory were recorded by their last component.)
    recipe_json = tmp_path / "cmp" / "recipe.json"
    recipe_json.write_text(json.dumps({**json.loads(recipe_json.read_text()), "data": f"../elsewhere/{data.name}"}))
    monkeypatch.setattr(compare_mod, "train", lambda *a, **k: pytest.fail("retrained a finished run"))
    again = run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), seeds=[1, 2], sets=sets, quiet=True)
    assert [r["test_ppl"] for r in again["models"]] == [r["test_ppl"] for r in report["models"]]


def test_compare_refuses_other_settings_in_same_dir(tmp_path):
    data = write_corpus(tmp_path / "c")
    sets = tiny_sets()
    run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=sets, only=["standard"], quiet=True)
    # the --set values that differ, as typed (a Python dict of every --set value, before)
    with pytest.raises(UserError, match=r"holds a comparison with other --set values: lr: not set there, --set lr=0.5 "
                                        r"now; use another --out or the same settings$"):
        run_compare(
            "cpu-proxy", tmp_path / "cmp", data=str(data), sets={**sets, "lr": 0.5}, only=["standard"], quiet=True
        )
    changed = {**sets, "max_steps": sets["max_steps"] + 1, "attn.gate": "scalar"}
    with pytest.raises(UserError, match=rf"other --set values: attn.gate: not set there, --set attn.gate=scalar now; "
                                        rf"max_steps: --set max_steps={sets['max_steps']} there, --set "
                                        rf"max_steps={sets['max_steps'] + 1} now;"):
        run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=changed, only=["standard"], quiet=True)
    # a recipe.json whose --set values are not a JSON object (edited by hand): one line, not an AttributeError
    recipe_json = tmp_path / "cmp" / "recipe.json"
    recipe_json.write_text(json.dumps({**json.loads(recipe_json.read_text()), "sets": ["lr=0.5"]}))
    with pytest.raises(UserError, match=r"holds a comparison with sets=\['lr=0.5'\], not \{"):
        run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=sets, only=["standard"], quiet=True)


def test_a_call_without_seeds_continues_the_seeds_the_comparison_holds(tmp_path, monkeypatch):
    """`compare` again without --seeds on a comparison of seeds 1 and 2: those seeds, not the
    recipe's default 42 trained on top of them."""
    data = write_corpus(tmp_path / "c")
    run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), seeds=[2, 1], sets=tiny_sets(), only=["standard"],
                quiet=True)
    monkeypatch.setattr(compare_mod, "train", lambda *a, **k: pytest.fail("trained a run"))
    report = run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=tiny_sets(), only=["standard"],
                         quiet=True)
    assert report["seeds"] == [1, 2] and report["complete"]
    assert json.loads((tmp_path / "cmp" / "recipe.json").read_text())["seeds"] == [1, 2]


def test_a_comparison_continues_with_other_result_neutral_settings(tmp_path, monkeypatch):
    """--set keys that change no result (device, compile, log_every, eval_batch_size, ...) may differ
    between invocations (a comparison continued on another device); a run resumed takes this
    invocation's, in this process and in a --jobs child alike."""
    data = write_corpus(tmp_path / "c")
    sets = tiny_sets()
    run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=sets, only=["standard"], quiet=True)
    run_dir = tmp_path / "cmp" / "standard" / "seed42"
    (run_dir / rundir.RESULT).unlink()  # as if stopped before it finished
    neutral = {"log_every": 1, "eval_batch_size": 4, "device": "cpu"}
    seen = {}
    monkeypatch.setattr(compare_mod, "train", lambda run, resume=False, overrides=None, **k: seen.update(overrides)
                        or pytest.fail("stop here"))
    with pytest.raises(pytest.fail.Exception, match="stop here"):
        run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets={**sets, **neutral}, only=["standard"],
                    quiet=True)
    assert {k: seen.get(k) for k in neutral} == neutral
    commands = []

    class Child:
        def __init__(self, cmd, **kwargs):
            commands.append(cmd)
            self.returncode = 1

        def poll(self):
            return 1

        def wait(self, timeout=None):
            return 1

    monkeypatch.setattr(compare_mod.subprocess, "Popen", Child)
    with pytest.raises(UserError):  # the child "failed": only its command line matters here
        run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets={**sets, **neutral}, only=["standard"],
                    quiet=True, jobs=2, threads=2)
    (cmd,) = commands
    assert all(f"{k}={v}" in cmd for k, v in neutral.items()) and "threads=2" in cmd  # (one run: every thread)


def test_compare_records_a_path_in_a_set_value_as_its_command_does(tmp_path, monkeypatch):
    """--set tokenizer=hf=/abs/tokenizer.json: results.json and recipe.json recorded the absolute path in their sets
    (the command beside it was made portable); a recipe.json written before, holding the path as typed, still
    continues with the same command."""
    from gbattn.data.corpus import load_corpus
    from gbattn.data.tokenizer import get_tokenizer
    data = write_corpus(tmp_path / "c")
    tokenizer = tmp_path / "tok dir" / "tokenizer.json"
    tokenizer.parent.mkdir()
    tokenizer.write_text(get_tokenizer("bpe", load_corpus(str(data)), vocab_size=120, verbose=False).payload)
    monkeypatch.setattr(compare_mod, "_Runner", lambda *a: pytest.fail("recorded"))
    sets = {**tiny_sets(), "tokenizer": f"hf={tokenizer}"}
    with pytest.raises(pytest.fail.Exception, match="recorded"):
        run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=sets, only=["standard"], quiet=True)
    recorded = json.loads((tmp_path / "cmp" / "recipe.json").read_text())
    assert recorded["sets"]["tokenizer"] == "hf=tok dir/tokenizer.json" and str(tmp_path) not in json.dumps(recorded)
    recorded["sets"]["tokenizer"] = f"hf={tokenizer}"  # as a recipe.json of before recorded it
    (tmp_path / "cmp" / "recipe.json").write_text(json.dumps(recorded))
    with pytest.raises(pytest.fail.Exception, match="recorded"):
        run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=sets, only=["standard"], quiet=True)


def test_a_run_trained_with_a_tokenizer_file_is_the_recipes_by_another_path_to_that_file(tmp_path, monkeypatch):
    """A run records --set tokenizer=hf=PATH as given (absolute here): continued with the relative path its results.md
    shows, or from another folder, its finished run was refused as "another run than this recipe asks for". The
    tokenizer's fingerprint decides, as the data's does: another file with another tokenizer is still refused."""
    from gbattn.data.corpus import load_corpus
    from gbattn.data.tokenizer import get_tokenizer
    from gbattn.train.trainer import train
    from helpers import tiny_configs

    data = write_corpus(tmp_path / "c")
    for name, vocab in (("tk", 120), ("other", 60)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer.json").write_text(
            get_tokenizer("bpe", load_corpus(str(data)), vocab_size=vocab, verbose=False).payload)
    run = tmp_path / "run"
    train(run, *tiny_configs(data, tokenizer=f"hf={tmp_path / 'tk' / 'tokenizer.json'}", max_steps=2, eval_every=2),
          quiet=True)
    model_cfg, train_cfg = rundir.read_configs(rundir.read_config(run / rundir.CONFIG), run / rundir.CONFIG)
    monkeypatch.chdir(tmp_path)
    compare_mod.check_run(run, model_cfg, train_cfg.replace(tokenizer="hf=tk/tokenizer.json"))
    with pytest.raises(UserError, match=r"holds another run than this recipe asks for \(train.tokenizer: recorded "
                                        r"'hf=/.*/tk/tokenizer.json', asked 'hf=other/tokenizer.json'\)"):
        compare_mod.check_run(run, model_cfg, train_cfg.replace(tokenizer="hf=other/tokenizer.json"))
    with pytest.raises(UserError, match=r"\(train.tokenizer: recorded .*, asked 'hf=gone/tokenizer.json'\)"):
        compare_mod.check_run(run, model_cfg, train_cfg.replace(tokenizer="hf=gone/tokenizer.json"))


def test_compare_refuses_settings_it_cannot_honour_and_runs_on_other_data(tmp_path):
    """--set seed (every 'seed' would be that one), --set of a key the recipe sets per model (it
    would be overridden), and a finished run reused after its data changed under the same name."""
    data = write_corpus(tmp_path / "c")
    sets = tiny_sets()
    with pytest.raises(UserError, match="use --seeds"):
        run_compare("cpu-proxy", tmp_path / "a", data=str(data), sets={**sets, "seed": 7}, quiet=True)
    # every model started from one run's weights, reported as trained from scratch (and recipe.json recorded it)
    with pytest.raises(UserError, match=r"^--set init_from=\.\.\. would start every run of the comparison from"):
        run_compare("cpu-proxy", tmp_path / "a", data=str(data), sets={**sets, "init_from": str(tmp_path / "r")},
                    only=["standard"], quiet=True)
    assert not (tmp_path / "a").exists()
    # ... however the option is spelt: attn_options.rounds, and attn_options={...}, passed and were ignored
    for key, value in (("attn.rounds", 3), ("attn_options.rounds", 3), ("attn_options", {"rounds": 3}),
                       ("attn.rounds.x", 3)):  # (a key under one the recipe sets: ignored silently before)
        with pytest.raises(UserError, match=rf"^--set {key}: the recipe sets it per model"):
            run_compare("cpu-proxy", tmp_path / "b", data=str(data), sets={**sets, key: value}, only=["gba-m2"],
                        quiet=True)
    # a depth the recipe's layer selection was not numbered for: gba-upper-half trained two middle layers of six
    with pytest.raises(UserError, match=re.escape("--set n_layers: gba-upper-half gives attn.layers=[2, 3], layers "
                                                  "numbered for the recipe's depth")):
        run_compare("gba-design", tmp_path / "d", data=str(data), sets={**sets, "n_layers": 6}, only=["standard"],
                    quiet=True)
    assert not (tmp_path / "d").exists()
    with pytest.raises(UserError, match=r"^--set attn=\.\.\. would give every model of the recipe that one attention"):
        run_compare("cpu-proxy", tmp_path / "s", data=str(data), sets={**sets, "attn": "boosted"}, quiet=True)
    # --set split of a corpus that comes in splits (a folder) would be ignored: refused before anything is recorded
    with pytest.raises(UserError, match=r"^--set split cuts a single text file by characters; --data .* is a folder, "
                                        r"read as one file per split"):
        run_compare("cpu-proxy", tmp_path / "s", data=str(data), sets={**sets, "split": [0.8, 0.1, 0.1]}, quiet=True)
    assert not (tmp_path / "s" / "recipe.json").exists()
    run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=sets, only=["standard"], quiet=True)
    train_file = data / "wiki.train.tokens"
    train_file.write_text("".join(reversed(train_file.read_text().splitlines(keepends=True))))
    with pytest.raises(UserError, match="was trained on other data"):
        run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=sets, only=["standard", "gba-m2"],
                    quiet=True)
    # A new seed first (it trains first): refused before it trains or recipe.json records it, where it trained and
    # only then was the old run refused.
    recorded = (tmp_path / "cmp" / "recipe.json").read_text()
    with pytest.raises(UserError, match=r"standard.seed42 was trained on other data"):
        run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=sets, seeds=[1, 42], only=["standard"],
                    quiet=True)
    assert not (tmp_path / "cmp" / "standard" / "seed1").exists()
    assert (tmp_path / "cmp" / "recipe.json").read_text() == recorded
    # The same when the old run is not among those asked now: another seed alone (the comparison holds seed 42 too)
    # or another model alone (the comparison holds standard too) is refused before it trains.
    for seeds, only in (([1], ["standard"]), ([42], ["twicing"])):
        with pytest.raises(UserError, match=r"standard.seed42 was trained on other data"):
            run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=sets, seeds=seeds, only=only, quiet=True)
        assert not (tmp_path / "cmp" / only[0] / f"seed{seeds[0]}").exists()
        assert (tmp_path / "cmp" / "recipe.json").read_text() == recorded
    # and when that run is unfinished (config.json, no result.json): refused before seed 1 trains, not only once
    # seed 42 is asked again
    (tmp_path / "cmp" / "standard" / "seed42" / rundir.RESULT).unlink()
    with pytest.raises(UserError, match=r"standard.seed42 was trained on other data"):
        run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=sets, seeds=[1], only=["standard"], quiet=True)
    assert not (tmp_path / "cmp" / "standard" / "seed1").exists()


def test_the_same_corpus_by_another_path_keeps_the_finished_runs(tmp_path, monkeypatch):
    """A comparison trained with --data as an absolute path, then asked again from the corpus's parent folder with
    --data as a relative path (the same bytes, the same fingerprint): its runs are reused, not refused as "another
    run", as train --resume and eval take the same corpus by another path; the report is the same."""
    data = write_corpus(tmp_path / "c")
    sets = tiny_sets()
    first = run_compare("cpu-proxy", tmp_path / "cmp", data=str(data.resolve()), sets=sets, only=["standard"],
                        quiet=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(compare_mod, "train", lambda *args, **kwargs: pytest.fail("a finished run was trained again"))
    again = run_compare("cpu-proxy", tmp_path / "cmp", data="c", sets=sets, only=["standard"], quiet=True)
    assert again["models"][0]["test_ppl"] == first["models"][0]["test_ppl"]
    recorded = json.loads((tmp_path / "cmp" / "standard" / "seed42" / rundir.CONFIG).read_text())["train"]["data"]
    assert recorded == str(data.resolve())  # the run's own record is left as it was


def test_a_finished_run_that_recorded_no_data_fingerprint_is_reused(tmp_path):
    """A run written before runs recorded their data's fingerprint has nothing to compare with the data's now: it is
    reused (its configs are still checked), not refused as "trained on other data"."""
    data = write_corpus(tmp_path / "c")
    sets = tiny_sets()
    first = run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=sets, only=["standard"], quiet=True)
    config_path = tmp_path / "cmp" / "standard" / "seed42" / rundir.CONFIG
    config = json.loads(config_path.read_text())
    assert config["data"].pop("fingerprint")
    config_path.write_text(json.dumps(config))
    again = run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=sets, only=["standard"], quiet=True)
    assert again["models"][0]["test_ppl"] == first["models"][0]["test_ppl"]


def test_a_rerun_of_a_subset_keeps_every_finished_run_in_the_report(tmp_path):
    """Standard and GBA on seeds 1 and 2, then a rerun asking for standard on seed 1 only: the
    report still holds both models on both seeds (it held only what the rerun asked for)."""
    data = write_corpus(tmp_path / "c")
    sets = tiny_sets()
    first = run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), seeds=[1, 2], sets=sets,
                        only=["standard", "gba-m2"], quiet=True)
    again = run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), seeds=[1], sets=sets, only=["standard"],
                        quiet=True)
    assert [r["label"] for r in again["models"]] == ["standard", "gba-m2"] and again["seeds"] == [1, 2]
    assert [r["test_ppl"] for r in again["models"]] == [r["test_ppl"] for r in first["models"]]
    assert again["complete"]


def train_interrupted_at(label: str):
    """compare's ``train``, raising KeyboardInterrupt (Ctrl-C) when it starts a run of model ``label``."""
    real_train = compare_mod.train

    def train(run_dir, *args, **kw):
        if run_dir.parent.name == label:
            raise KeyboardInterrupt
        return real_train(run_dir, *args, **kw)

    return train


def test_a_stopped_invocation_leaves_every_finished_run_in_the_report(tmp_path, monkeypatch):
    """Seed 1 of standard and GBA, then an invocation adding seed 2 that is interrupted while training GBA
    (Ctrl-C): results.json and results.md still hold seed 1 of both models, and seed 2 of standard (after
    standard's seed 2 they held that one run alone until a rerun finished)."""
    data = write_corpus(tmp_path / "c")
    sets = tiny_sets()
    kwargs = dict(data=str(data), sets=sets, only=["standard", "gba-m2"], quiet=True)
    first = run_compare("cpu-proxy", tmp_path / "cmp", seeds=[1], **kwargs)
    monkeypatch.setattr(compare_mod, "train", train_interrupted_at("gba-m2"))
    with pytest.raises(Interrupted, match=r"compare interrupted: the runs in progress \(gba-m2/seed2\)"):
        run_compare("cpu-proxy", tmp_path / "cmp", seeds=[2], **kwargs)
    report = json.loads((tmp_path / "cmp" / "results.json").read_text())
    rows = {r["label"]: r for r in report["models"]}
    assert {label: r["seeds"] for label, r in rows.items()} == {"standard": [1, 2], "gba-m2": [1]}
    assert rows["gba-m2"]["test_ppl"] == first["models"][1]["test_ppl"] and not report["complete"]
    md = (tmp_path / "cmp" / "results.md").read_text()
    assert "| gba-m2 |" in md and "INCOMPLETE" in md


def test_more_jobs_than_threads_says_where_the_threads_were_set(tmp_path, monkeypatch, capsys):
    """`OMP_NUM_THREADS=1 gbattn compare --jobs 2` on a 2-core machine: the note blamed the cores ("more runs than
    cores"); it names where the one thread was set."""
    import subprocess

    data = str(write_corpus(tmp_path / "c"))
    real_popen = subprocess.Popen
    monkeypatch.setattr(compare_mod.subprocess, "Popen", lambda cmd, **kw: real_popen(["false"], **kw))
    monkeypatch.setattr(compare_mod, "default_threads", lambda: 1)  # (the cores free, where OMP_NUM_THREADS is none)
    for threads, env, source in ((1, None, "--threads"), (None, "1", "OMP_NUM_THREADS"),
                                 (None, "0", "the cores free to this process")):  # (0: not a count, ignored)
        if env:
            monkeypatch.setenv("OMP_NUM_THREADS", env)
        with pytest.raises(UserError, match="run\\(s\\) failed"):
            run_compare("cpu-proxy", tmp_path / f"cmp{source}", data=data, sets=tiny_sets(),
                        only=["standard", "gba-m2"], quiet=True, jobs=2, threads=threads)
        assert (f"note: --jobs 2 with 1 CPU thread in all ({source}): each run takes 1 thread, 2 in all, more than "
                f"given") in capsys.readouterr().err


def test_a_comparison_whose_runs_trained_several_at_once_says_their_speeds_were_shared(tmp_path, monkeypatch):
    """compare --jobs 5 on one GPU: five runs shared it, and the one that trained after the others, alone, showed 1.6x
    standard's tokens/s for the same model, unsaid. recipe.json records how many runs trained at once (the most any
    command started side by side), results.json carries it and results.md says so under its table; a comparison of
    one run at a time records nothing and says nothing, nor does a --jobs call that had one run left to train (it
    recorded the runs that could have shared the machine). A damaged record is one line."""
    import subprocess

    from gbattn.experiments.report import read_report

    data = str(write_corpus(tmp_path / "c"))
    real_popen = subprocess.Popen
    monkeypatch.setattr(compare_mod.subprocess, "Popen", lambda cmd, **kw: real_popen(["false"], **kw))
    out = tmp_path / "cmp"
    with pytest.raises(UserError, match="run\\(s\\) failed"):
        run_compare("cpu-proxy", out, data=data, sets=tiny_sets(), only=["standard", "gba-m2"], quiet=True, jobs=2,
                    threads=2)
    assert json.loads((out / "recipe.json").read_text())["runs_at_once"] == 2
    run_compare("cpu-proxy", out, data=data, sets=tiny_sets(), only=["standard", "gba-m2"], quiet=True, threads=1)
    report = json.loads((out / "results.json").read_text())
    assert report["runs_at_once"] == 2  # (kept when continued one run at a time: two of its runs could share)
    assert ("tokens/s and wall-clock were measured with up to 2 runs training at once (compare --jobs), sharing the "
            "machine for some or all of their time") in (out / "results.md").read_text()
    alone = tmp_path / "alone"
    run_compare("cpu-proxy", alone, data=data, sets=tiny_sets(), only=["standard"], quiet=True, threads=1)
    assert "runs_at_once" not in json.loads((alone / "results.json").read_text())
    with pytest.raises(UserError, match="1 run\\(s\\) failed"):  # gba-m2 alone left to train, under --jobs 2
        run_compare("cpu-proxy", alone, data=data, sets=tiny_sets(), only=["standard", "gba-m2"], quiet=True, jobs=2,
                    threads=2)
    assert "runs_at_once" not in json.loads((alone / "recipe.json").read_text())
    assert "training at once" not in (alone / "results.md").read_text()
    recorded = json.loads((out / "recipe.json").read_text())
    (out / "recipe.json").write_text(json.dumps({**recorded, "runs_at_once": "2"}))
    with pytest.raises(CheckpointError, match=r"recipe.json: runs_at_once='2' must be an integer >= 1; restore"):
        run_compare("cpu-proxy", out, data=data, sets=tiny_sets(), only=["standard", "gba-m2"], quiet=True)
    (out / "results.json").write_text(json.dumps({**report, "runs_at_once": 0}))
    with pytest.raises(CheckpointError, match=r"runs_at_once=0 must be an integer >= 1"):
        read_report(out / "results.json")


def test_a_comparison_stopped_between_runs_says_none_was_in_progress(tmp_path, monkeypatch):
    """Ctrl-C between two runs said "the runs in progress (none) stopped at their last checkpoint"."""
    data = write_corpus(tmp_path / "c")
    real_configs = compare_mod.matched_configs

    def configs(recipe, spec, *args):
        if spec.label == "gba-m2":
            raise KeyboardInterrupt
        return real_configs(recipe, spec, *args)

    monkeypatch.setattr(compare_mod, "matched_configs", configs)
    with pytest.raises(Interrupted, match=r"^compare interrupted: no run was in progress; rerun the same command to "
                                          r"resume$"):
        run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=tiny_sets(), seeds=[1],
                    only=["standard", "gba-m2"], quiet=True)


def test_the_report_of_a_comparison_stopped_before_a_model_trained_says_it_is_incomplete(tmp_path, monkeypatch):
    """results.json and results.md are rewritten after every finished run, so they are what a comparison killed
    (-9) between two runs leaves. A model asked for with no run finished yet did not count: after the upcycle recipe's
    first 2 of 7 models, killed, the report read '"complete": true' and results.md had no INCOMPLETE mark. Now a
    model asked for and not trained yet leaves the report incomplete; the rerun that trains it completes it."""
    data = write_corpus(tmp_path / "c")
    kwargs = dict(data=str(data), sets=tiny_sets(), seeds=[1], only=["standard", "gba-m2"], quiet=True)
    real_train = compare_mod.train
    monkeypatch.setattr(compare_mod, "train", train_interrupted_at("gba-m2"))
    with pytest.raises(Interrupted, match=r"compare interrupted: the runs in progress \(gba-m2/seed1\)"):
        run_compare("cpu-proxy", tmp_path / "cmp", **kwargs)
    report = json.loads((tmp_path / "cmp" / "results.json").read_text())
    assert [r["label"] for r in report["models"]] == ["standard"] and report["complete"] is False
    assert "INCOMPLETE (runs missing: gba-m2/seed1)" in (tmp_path / "cmp" / "results.md").read_text()
    monkeypatch.setattr(compare_mod, "train", real_train)
    assert run_compare("cpu-proxy", tmp_path / "cmp", **kwargs)["complete"]
    assert "INCOMPLETE" not in (tmp_path / "cmp" / "results.md").read_text()


def test_ctrl_c_in_a_run_trained_by_a_one_job_comparison_says_where_its_checkpoint_is(tmp_path, monkeypatch):
    """Ctrl-C during a step of a run that a one-job comparison trains in its own process: the run's own stop
    (a KeyboardInterrupt) goes through compare unchanged, saying at which step its checkpoint is saved and that
    rerunning the comparison continues it, with status 130."""
    data = write_corpus(tmp_path / "c")
    signal_during_step(0, monkeypatch)  # Ctrl-C in the first step
    with pytest.raises(Interrupted, match=r"^interrupted at step 1; checkpoint saved in .*standard.seed42: continue "
                                          r"with .* \(or rerun the same `gbattn compare` command\)$") as stop:
        run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=tiny_sets(), only=["standard"], quiet=True)
    assert stop.value.exit_code == 130


def test_a_rerun_of_a_subset_leaves_the_report_incomplete_while_another_model_has_an_unfinished_run(
        tmp_path, monkeypatch):
    """Standard and GBA asked, stopped while GBA trained (its run directory holds config.json, no result.json),
    then a rerun with --only standard: the table has no GBA row, so it must not read complete (it did: only the
    models this invocation asked for counted). Once GBA finishes, it is complete."""
    data = write_corpus(tmp_path / "c")
    kwargs = dict(data=str(data), sets=tiny_sets(), seeds=[1], quiet=True)
    real_train = compare_mod.train

    def train_started_then_stopped(run_dir, model_cfg=None, train_cfg=None, **kw):
        if run_dir.parent.name != "gba-m2":
            return real_train(run_dir, model_cfg, train_cfg, **kw)
        run_dir.mkdir(parents=True)
        rundir.write_config(run_dir, kw["preset"], model_cfg, train_cfg, kw["extra"])  # as training starts
        raise KeyboardInterrupt

    monkeypatch.setattr(compare_mod, "train", train_started_then_stopped)
    with pytest.raises(Interrupted, match="compare interrupted"):
        run_compare("cpu-proxy", tmp_path / "cmp", only=["standard", "gba-m2"], **kwargs)
    monkeypatch.setattr(compare_mod, "train", real_train)
    report = run_compare("cpu-proxy", tmp_path / "cmp", only=["standard"], **kwargs)
    assert [r["label"] for r in report["models"]] == ["standard"] and report["complete"] is False
    assert "INCOMPLETE (runs missing: gba-m2/seed1)" in (tmp_path / "cmp" / "results.md").read_text()
    assert run_compare("cpu-proxy", tmp_path / "cmp", only=["gba-m2"], **kwargs)["complete"]


def test_a_sigterm_outside_a_training_loop_stops_a_comparison_as_terminated(tmp_path, monkeypatch):
    """SIGTERM while a one-job comparison is between training loops (a run's final test evaluation, the report)
    raises cli's Terminated: the comparison says it was terminated and exits 143, not 'interrupted' with 130."""
    data = write_corpus(tmp_path / "c")

    def terminated(*args, **kw):
        raise Terminated

    monkeypatch.setattr(compare_mod, "train", terminated)
    with pytest.raises(Interrupted, match=r"compare terminated: the runs in progress \(standard/seed42\)") as stop:
        run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=tiny_sets(), only=["standard"], quiet=True)
    assert stop.value.exit_code == 143


def test_a_one_job_comparison_leaves_sigterm_to_the_handler_it_found(tmp_path, monkeypatch):
    """One job trains in this process: SIGTERM stays with the handler the comparison found (cli's, which raises
    Terminated at once, and the trainer's during a loop), not --jobs' own, which only notes it: with that one, a SIGTERM
    during a run's final evaluation would let the run go on to its end and name no run in progress."""
    import signal

    handler, seen, real_train = signal.getsignal(signal.SIGTERM), [], compare_mod.train
    monkeypatch.setattr(compare_mod, "train", lambda *a, **kw: seen.append(signal.getsignal(signal.SIGTERM)) or
                        real_train(*a, **kw))
    run_compare("cpu-proxy", tmp_path / "cmp", data=str(write_corpus(tmp_path / "c")), sets=tiny_sets(),
                only=["standard"], quiet=True)
    assert seen == [handler]


def test_a_comparison_recorded_with_a_corpus_file_name_alone_continues(tmp_path):
    """recipe.json written before an absolute corpus file kept its folder recorded its name alone (input.txt for
    /data/tiny-shakespeare/input.txt): the same command, now recorded as tiny-shakespeare/input.txt, continues
    that comparison (it was refused as 'holds a comparison with data='input.txt''); other data is still refused."""
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps({"recipe": "cpu-char", "data": "input.txt", "seeds": [42], "sets": {},
                                "command": "gbattn x"}))

    def request(data):
        return {"recipe": "cpu-char", "data": data, "seeds": [42], "sets": {}, "command": "gbattn y"}

    continued = request("tiny-shakespeare/input.txt")
    compare_mod._check_request(path, continued, data_as_given="/data/tiny-shakespeare/input.txt")
    assert continued["commands"] == ["gbattn x"]  # recorded before `commands` was: its one command comes first
    for other in ("tiny-shakespeare/other.txt", "wikitext-2"):
        with pytest.raises(UserError, match="holds a comparison with data='input.txt'"):
            compare_mod._check_request(path, request(other), data_as_given=f"/data/{other}")


def test_run_compare_continues_a_comparison_recorded_with_a_corpus_file_name_alone(tmp_path, monkeypatch):
    """The same, through run_compare: it passes --data as typed (an absolute path), not its portable form, so the
    old recipe.json's 'input.txt' is taken for the file now recorded as tiny-shakespeare/input.txt."""
    corpus = tmp_path / "tiny-shakespeare" / "input.txt"
    corpus.parent.mkdir()
    corpus.write_text("to be or not to be\n" * 50)
    out = tmp_path / "cmp"
    out.mkdir()
    (out / "recipe.json").write_text(json.dumps({"recipe": "cpu-proxy", "data": "input.txt", "seeds": [1],
                                                 "sets": tiny_sets(), "command": "gbattn x"}))

    def past_the_request_check(*args, **kwargs):
        raise RuntimeError("past the request check")

    monkeypatch.setattr(compare_mod, "prepare_data", past_the_request_check)
    with pytest.raises(RuntimeError, match="past the request check"):
        run_compare("cpu-proxy", out, data=str(corpus.resolve()), sets=tiny_sets(), seeds=[1], only=["standard"],
                    quiet=True)


def test_a_folder_named_otherwise_is_refused_before_recipe_json_takes_its_name(tmp_path, monkeypatch):
    """A comparison started with --data 'wt small' and rerun with --data './wt small/' (the same folder, written
    otherwise): the old-recipe.json shim above took it for a corpus file's folder, so recipe.json was rewritten
    with './wt small/' before its runs refused it, and the first command was refused from then on. It is the same
    data (a relative path is recorded normalised): the comparison continues, recipe.json keeps its name for it, and
    so does the first command; another folder is still refused before anything is written."""
    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path / "wt small")
    write_corpus(tmp_path / "wt other", lines_per_split=(70, 20, 20))
    kwargs = dict(sets=tiny_sets(), seeds=[1], only=["standard"], quiet=True)
    run_compare("cpu-proxy", "cmp", data="wt small", **kwargs)
    assert json.loads((tmp_path / "cmp" / "recipe.json").read_text())["data"] == "wt small"
    assert run_compare("cpu-proxy", "cmp", data="./wt small/", **kwargs)["complete"]
    recorded = (tmp_path / "cmp" / "recipe.json").read_text()
    assert json.loads(recorded)["data"] == "wt small"
    with pytest.raises(UserError, match="holds a comparison with data='wt small', not 'wt other'"):
        run_compare("cpu-proxy", "cmp", data="./wt other/", **kwargs)
    assert (tmp_path / "cmp" / "recipe.json").read_text() == recorded
    assert run_compare("cpu-proxy", "cmp", data="wt small", **kwargs)["complete"]
    # a nested folder, recorded relative, given by its absolute path (which results files shorten to its last part)
    write_corpus(tmp_path / "corp" / "splits")
    run_compare("cpu-proxy", "nested", data="corp/splits/", **kwargs)
    assert run_compare("cpu-proxy", "nested", data=str(tmp_path / "corp" / "splits"), **kwargs)["complete"]
    assert json.loads((tmp_path / "nested" / "recipe.json").read_text())["data"] == "corp/splits"
    # ... and the other way round: recorded by its absolute path (as splits), continued relative, then absolute again
    # (recipe.json took the relative name, and the first command was refused after)
    run_compare("cpu-proxy", "absolute", data=str(tmp_path / "corp" / "splits"), **kwargs)
    assert run_compare("cpu-proxy", "absolute", data="./corp/splits/", **kwargs)["complete"]
    assert json.loads((tmp_path / "absolute" / "recipe.json").read_text())["data"] == "splits"
    assert run_compare("cpu-proxy", "absolute", data=str(tmp_path / "corp" / "splits"), **kwargs)["complete"]


def test_a_comparison_is_never_written_into_a_run_or_a_folder_of_runs(tmp_path, monkeypatch):
    """--out of a run, or of one model's seeds, is refused before anything is written (bad-inputs table in
    test_trust.py); a comparison that holds a run beside its models (an export, a copy) still continues."""
    import shutil

    data = write_corpus(tmp_path / "c")
    sets = tiny_sets()
    run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=sets, only=["standard"], quiet=True)
    run = tmp_path / "cmp" / "standard" / "seed42"
    before = sorted(p.name for p in run.iterdir())
    for out in (run, run.parent):
        with pytest.raises(UserError, match="not a comparison"):
            run_compare("cpu-proxy", out, data=str(data), sets=sets, only=["standard"], quiet=True)
    assert sorted(p.name for p in run.iterdir()) == before and not (run.parent / "recipe.json").exists()
    shutil.copytree(run, tmp_path / "cmp" / "exported")
    monkeypatch.setattr(compare_mod, "train", lambda *a, **k: pytest.fail("retrained a finished run"))
    assert run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=sets, only=["standard"], quiet=True)[
        "complete"]


def test_the_command_line_of_results_md_is_every_invocation_that_trained_part_of_it(tmp_path, monkeypatch):
    """A rerun of a subset that trains nothing leaves the Command line alone (it was replaced by the
    rerun's, which does not reproduce the table); one that trains a run is added after it."""
    from gbattn import runtime

    monkeypatch.setattr(runtime, "_INVOCATION", [])
    data = write_corpus(tmp_path / "c")
    sets = tiny_sets()
    commands = [["compare", "--seeds", "1", "2", "--only", "standard", "gba-m2"],
                ["compare", "--seeds", "1", "--only", "standard"], ["compare", "--seeds", "3", "--only", "standard"]]
    for argv, seeds, only in zip(commands, ([1, 2], [1], [3]), (["standard", "gba-m2"], ["standard"], ["standard"])):
        runtime.set_invocation(argv)
        report = run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), seeds=seeds, sets=sets, only=only,
                             quiet=True)
        md = (tmp_path / "cmp" / "results.md").read_text().splitlines()
        if argv is commands[1]:
            assert md[2] == f"Command: `gbattn {' '.join(commands[0])}`  " and md[3].startswith("Data:")
            assert report["commands"] == ["gbattn " + " ".join(commands[0])], report["commands"]
    assert report["commands"] == ["gbattn " + " ".join(commands[0]), "gbattn " + " ".join(commands[2])]
    assert report["command"] == "gbattn " + " ".join(commands[2]) and report["seeds"] == [1, 2, 3]
    assert md[2:4] == [f"Command: `gbattn {' '.join(commands[0])}`  ", f"then: `gbattn {' '.join(commands[2])}`  "]
    assert json.loads((tmp_path / "cmp" / "recipe.json").read_text())["commands"] == report["commands"]


def test_the_recorded_command_holds_no_path_of_this_machine(tmp_path, monkeypatch):
    """recipe.json, results.json and results.md record the command with its absolute paths cut to their last part,
    as every results file does (README, "Results")."""
    from gbattn import runtime

    monkeypatch.setattr(runtime, "_INVOCATION", [])
    data = write_corpus(tmp_path / "c")
    runtime.set_invocation(["compare", "--recipe", "cpu-proxy", "--data", str(data), "--out", str(tmp_path / "cmp")])
    report = run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), seeds=[1], sets=tiny_sets(), only=["standard"],
                         quiet=True)
    portable = "gbattn compare --recipe cpu-proxy --data c --out cmp"
    assert report["command"] == portable
    assert json.loads((tmp_path / "cmp" / "recipe.json").read_text())["command"] == portable
    for name in ("recipe.json", "results.json", "results.md"):
        assert str(tmp_path) not in (tmp_path / "cmp" / name).read_text(), name


def test_only_a_matched_model_says_what_it_needs_and_seeds_count_once(tmp_path):
    data = write_corpus(tmp_path / "c")
    sets = tiny_sets()
    with pytest.raises(UserError, match="it needs gba-m2 seed 1, which is neither finished here nor asked for") as e:
        run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), seeds=[1], sets=sets, only=["compute-matched"],
                    quiet=True)
    assert "rerun the same command" not in str(e.value)  # it would stop the same way: --only must name gba-m2
    # Once gba-m2's run is finished here, --only compute-matched trains, matched to that run read from disk
    run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), seeds=[1], sets=sets, only=["gba-m2"], quiet=True)
    # ... whose training tokens and FLOPs must be the ones its configs give: a hand-edited 0 or 1e30 set the matched
    # run's steps to 0 or 10^23, refused in words about a max_steps nobody gave; FLOPs per token and FLOPs (or
    # tokens and FLOPs) scaled together by 10 kept train_flops = flops_per_token_train x train_tokens_seen, and the
    # matched run trained 10x its steps, the table printing the scaled FLOPs (a result from a gbattn that counted
    # FLOPs otherwise would do the same)
    result_path = tmp_path / "cmp" / "gba-m2" / "seed1" / rundir.RESULT
    recorded = result_path.read_text()
    reference = json.loads(recorded)
    flops, per_token, tokens = (reference[k] for k in ("train_flops", "flops_per_token_train", "train_tokens_seen"))
    for edits in ({"train_flops": 0.0}, {"train_flops": 1e30}, {"train_flops": 1.001 * flops},  # (0.1% off)
                  {"train_flops": 0.0, "train_tokens_seen": 0},  # (0 FLOPs of 0 tokens: still no reference)
                  {"train_flops": 10 * flops, "flops_per_token_train": 10 * per_token},
                  {"train_flops": 10 * flops, "train_tokens_seen": 10 * tokens},
                  {"steps": 2 * reference["steps"]}):
        first = next(k for k in ("steps", "train_tokens_seen", "flops_per_token_train", "train_flops") if k in edits)
        result_path.write_text(json.dumps({**reference, **edits}))
        with pytest.raises(UserError, match=re.escape(
                f"{result_path} records other training tokens or FLOPs than its run's config.json gives ({first}: "
                f"{edits[first]!r}, its configs give ")):
            run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), seeds=[1], sets=sets, only=["compute-matched"],
                        quiet=True)
        assert not (tmp_path / "cmp" / "compute-matched").exists()
    result_path.write_text(recorded)
    rows = {r["label"]: r for r in run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), seeds=[1], sets=sets,
                                                only=["compute-matched"], quiet=True)["models"]}
    assert rows["compute-matched"]["steps"] > rows["gba-m2"]["steps"]
    assert rows["compute-matched"]["train_flops"] == pytest.approx(rows["gba-m2"]["train_flops"], rel=0.5)
    report = run_compare("cpu-proxy", tmp_path / "two", data=str(data), seeds=[1, 1], sets=sets, only=["standard"],
                         quiet=True)
    assert report["seeds"] == [1] and report["complete"]


def test_upcycle_recipe_continues_from_the_trained_base(tmp_path, monkeypatch):
    """The upcycle recipe: continuations start from the base run's weights (upcycled ones compute the
    base's function), the compute-matched continuation gets GBA's continuation FLOPs."""
    import torch

    from gbattn import rundir

    data = write_corpus(tmp_path / "c")
    sets = dict(TINY, max_steps=4, eval_every=2, tokenizer="char", batch_size=8, seq_len=32, train_tokens=None,
                eval_tokens=None, warmup_steps=1, threads=1)
    report = run_compare("upcycle", tmp_path / "cmp", data=str(data), sets=sets, quiet=True)
    rows = {r["label"]: r for r in report["models"]}
    assert set(rows) == {"base", "standard-continued", "gba-upcycled", "gba-shared-upcycled",
                         "standard-continued-compute-matched", "gba-scratch", "standard-scratch"}
    out = tmp_path / "cmp"
    base = rundir.load_run(out / "base" / "seed42")
    upcycled_to = {s.label: s.upcycle for s in get_recipe("upcycle").models if s.upcycle}
    for label in ("gba-upcycled", "gba-shared-upcycled"):
        config = json.loads((out / label / "seed42" / rundir.CONFIG).read_text())
        assert config["train"]["init_from"] == str(out / label / "seed42-start")
        start = rundir.load_run(out / label / "seed42-start")
        # upcycled to the recipe's options (shared K/V, tanh gate), not the variant's defaults
        assert start.model_cfg.attn == upcycled_to[label]["attn"]
        assert upcycled_to[label]["attn_options"].items() <= start.model_cfg.attn_options.items(), label
        idx = torch.randint(0, base.model_cfg.vocab_size, (2, 20))
        torch.testing.assert_close(start.model(idx), base.model(idx), rtol=1e-5, atol=1e-5)
    assert json.loads((out / "standard-continued" / "seed42" / rundir.CONFIG).read_text())["train"]["init_from"] == str(
        out / "base" / "seed42")
    cm, gba = rows["standard-continued-compute-matched"], rows["gba-upcycled"]
    assert cm["steps"] > gba["steps"] and cm["train_flops"] == pytest.approx(gba["train_flops"], rel=1 / gba["steps"])
    # The same comparison moved elsewhere: every continuation is reused (its recorded start path is
    # the old one), nothing trains or is written again (each start is written once, and checked against its base).
    moved = tmp_path / "moved"
    out.rename(moved)
    monkeypatch.setattr("gbattn.experiments.compare.train", lambda *a, **k: pytest.fail("a finished run retrained"))
    monkeypatch.setattr("gbattn.experiments.compare.write_run", lambda *a, **k: pytest.fail("a start written again"))
    again = run_compare("upcycle", moved, data=str(data), sets=sets, quiet=True)
    assert [r["test_ppl"] for r in again["models"]] == [r["test_ppl"] for r in report["models"]]
    # ... and a continuation killed before its first checkpoint (its config.json and start kept): resumed in the moved
    # comparison it was refused, its recorded start path the old one ("not a directory from here: resume from the
    # directory the run was started in", which a moved comparison cannot); it starts again from its start here
    monkeypatch.undo()
    run = moved / "gba-upcycled" / "seed42"
    for name in (rundir.CHECKPOINT, rundir.RESULT, rundir.BEST):
        (run / name).unlink()
    assert json.loads((run / rundir.CONFIG).read_text())["train"]["init_from"] == str(out / "gba-upcycled" /
                                                                                     "seed42-start")
    resumed = run_compare("upcycle", moved, data=str(data), sets=sets, quiet=True)
    assert [r["test_ppl"] for r in resumed["models"]] == [r["test_ppl"] for r in report["models"]]


def test_an_upcycled_start_is_reused_only_as_the_upcycle_of_its_own_base(tmp_path):
    """A continuation's seed<N>-start folder was reused as it was: one renamed from another seed (its base's other
    weights), or another label's (another upcycle), was trained on and published under this label, its run checked
    against the start's own config. It is refused unless it is the upcycle the recipe makes of this base."""
    from gbattn.upcycle import upcycle, write_run

    data = write_corpus(tmp_path / "c")
    sets = dict(TINY, max_steps=2, eval_every=2, tokenizer="char", batch_size=8, seq_len=32, train_tokens=None,
                eval_tokens=None, warmup_steps=1, threads=1)
    out = tmp_path / "cmp"
    run_compare("upcycle", out, data=str(data), sets=sets, seeds=[1], only=["base", "gba-upcycled"], quiet=True)
    (out / "gba-upcycled" / "seed1-start").rename(out / "gba-upcycled" / "seed2-start")  # seed 1's, as seed 2's
    with pytest.raises(UserError, match="seed2-start holds another model than gba-upcycled starts from .*base/seed2"
                                        " upcycled to attn=boosted.: move it away .it is made again."):
        run_compare("upcycle", out, data=str(data), sets=sets, seeds=[2], only=["base", "gba-upcycled"], quiet=True)
    assert not (out / "gba-upcycled" / "seed2").exists()
    shutil.rmtree(out / "gba-upcycled" / "seed2-start")  # moved away, as told: made again (seed 1's was, beside it)
    run_compare("upcycle", out, data=str(data), sets=sets, seeds=[2], only=["base", "gba-upcycled"], quiet=True)
    # another upcycle of the same base (shared K/V, tanh gate) in its place: another model
    upcycle_start = out / "gba-upcycled" / "seed1-start"
    shutil.rmtree(upcycle_start)
    spec = next(s for s in get_recipe("upcycle").models if s.label == "gba-shared-upcycled")
    write_run(upcycle(out / "base" / "seed1", spec.upcycle["attn"], spec.upcycle["attn_options"]), upcycle_start)
    with pytest.raises(UserError, match="seed1-start holds another model than gba-upcycled starts from"):
        run_compare("upcycle", out, data=str(data), sets=sets, seeds=[1], only=["base", "gba-upcycled"], quiet=True)


def test_a_continuation_that_started_from_other_weights_is_refused(tmp_path):
    """A finished continuation copied from another comparison records the same configs (its start's path is
    this comparison's): its config.json's digest of the weights it started from tells it from this one's."""
    from gbattn.experiments.compare import check_run
    from gbattn.train.trainer import train
    from helpers import tiny_configs

    data = write_corpus(tmp_path / "c")
    model_cfg, train_cfg = tiny_configs(data, attn="standard", max_steps=2, eval_every=2)
    base, other_base = tmp_path / "one" / "base" / "seed1", tmp_path / "two" / "base" / "seed1"
    train(base, model_cfg, train_cfg, quiet=True)
    model_cfg = rundir.load_run(base).model_cfg  # (its vocabulary the tokenizer's)
    train(other_base, model_cfg, train_cfg.replace(seed=train_cfg.seed + 1), quiet=True)
    continued = train_cfg.replace(init_from=str(base))
    train(tmp_path / "continued", model_cfg, continued, quiet=True)
    check_run(tmp_path / "continued", model_cfg, continued)  # its own start: reused
    # (the same start as a comparison names it, base/seed1, in another comparison)
    with pytest.raises(UserError, match="continued started from other weights than .*two/base/seed1 holds .its "
                                        "config.json's init_from_weights.: move it away"):
        check_run(tmp_path / "continued", model_cfg, continued.replace(init_from=str(other_base)))


def test_a_comparison_moved_with_its_data_resumes_its_unfinished_runs(tmp_path):
    """A comparison moved together with its corpus, continued with --data where the corpus is now: its unfinished
    runs resumed from the data path they recorded (gone), and the advice was to pass the --data given. They resume
    from the data given (the fingerprint is the run's), with one job and with a child process each (--jobs 2)."""
    data = write_corpus(tmp_path / "old" / "c")
    out = tmp_path / "old" / "cmp"
    sets = tiny_sets()
    report = run_compare("cpu-proxy", out, data=str(data), seeds=[1, 2], sets=sets, only=["standard"], quiet=True)
    for seed in (1, 2):  # unfinished: resumed from their last checkpoint
        (out / "standard" / f"seed{seed}" / rundir.RESULT).unlink()
    (tmp_path / "old").rename(tmp_path / "new")
    moved = tmp_path / "new" / "cmp"
    again = run_compare("cpu-proxy", moved, data=str(tmp_path / "new" / "c"), seeds=[1], sets=sets, only=["standard"],
                        quiet=True)
    jobs = run_compare("cpu-proxy", moved, data=str(tmp_path / "new" / "c"), seeds=[2], sets=sets, only=["standard"],
                       quiet=True, jobs=2)
    assert again["models"][0]["test_ppl"]["1"] == report["models"][0]["test_ppl"]["1"]
    assert jobs["models"][0]["test_ppl"] == report["models"][0]["test_ppl"]


def test_an_upcycled_start_killed_before_its_config_is_written_again(tmp_path):
    """A comparison killed while writing a continuation's upcycled start, between its best.pt and its config.json
    (written last): rerunning the same command, as a killed comparison is told to, was refused ("holds best.pt but no
    config.json ...; delete it or choose another --out"). The comparison writes its own start again."""
    import torch

    from gbattn.train.trainer import train
    from gbattn.upcycle import upcycle, write_run
    from helpers import tiny_configs

    data = write_corpus(tmp_path / "c")
    out = tmp_path / "cmp"
    configs = tiny_configs(data, attn="standard", max_steps=2, eval_every=2)
    train(out / "base" / "seed1", *configs, quiet=True)
    spec = next(s for s in get_recipe("upcycle").models if s.label == "gba-upcycled")
    start = out / spec.label / "seed1-start"
    write_run(upcycle(out / "base" / "seed1", spec.upcycle["attn"], spec.upcycle.get("attn_options")), start)
    expected = rundir.load_checkpoint(start / rundir.BEST)["model"]
    (start / rundir.CONFIG).unlink()  # what a kill between the two writes leaves
    start_cfg, train_cfg = compare_mod._continuation(spec, 1, configs[1], out)
    assert train_cfg.init_from == str(start) and start_cfg.attn == "boosted"
    written = rundir.load_run(start).model.state_dict()
    assert written.keys() == expected.keys() and all(torch.equal(written[k], expected[k]) for k in expected)


def test_a_damaged_result_of_a_finished_run_is_one_line(tmp_path):
    """A finished run whose result.json lost a field the report reads, or holds it as text: the
    comparison names the file and the field (it ended in a KeyError or TypeError in the report)."""
    from gbattn import rundir
    from gbattn.errors import CheckpointError

    data = write_corpus(tmp_path / "c")
    sets = tiny_sets()
    run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=sets, only=["standard"], quiet=True)
    path = tmp_path / "cmp" / "standard" / "seed42" / rundir.RESULT
    result = json.loads(path.read_text())
    for damaged, expected in (({k: v for k, v in result.items() if k != "train_flops"}, "has no 'train_flops'"),
                              ({**result, "test_ppl": "12.3"}, "test_ppl='12.3' must be a number")):
        path.write_text(json.dumps(damaged))
        with pytest.raises(CheckpointError, match=expected):
            run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=sets, only=["standard"], quiet=True)


def test_a_finished_run_without_its_config_is_refused_not_reused(tmp_path):
    """A run directory holding result.json but no config.json (deleted, or a result copied in): nothing says it
    is the recipe's run, so it is refused in one line naming the missing file (it was reused unchecked and its
    result reported)."""
    from gbattn.errors import CheckpointError

    data = write_corpus(tmp_path / "c")
    sets = tiny_sets()
    run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=sets, only=["standard"], quiet=True)
    run = tmp_path / "cmp" / "standard" / "seed42"
    (run / rundir.CONFIG).unlink()
    with pytest.raises(CheckpointError, match=r"standard/seed42/config\.json not found"):
        run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=sets, only=["standard"], quiet=True)


def test_a_rerun_of_a_subset_checks_the_finished_runs_it_reports(tmp_path):
    """A rerun asking for standard only still reports gba-m2's finished run, and so checks it as a reused
    run is checked: one whose recorded config is not the recipe's is refused, not reported."""
    data = write_corpus(tmp_path / "c")
    sets = tiny_sets()
    run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=sets, only=["standard", "gba-m2"], quiet=True)
    path = tmp_path / "cmp" / "gba-m2" / "seed42" / "config.json"
    config = json.loads(path.read_text())
    config["model"]["attn_options"]["rounds"] = 3
    path.write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"gba-m2/seed42 holds another run than this recipe asks for"):
        run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=sets, only=["standard"], quiet=True)


def reference_result(train_flops: float, steps: int, tokens_per_step: int = 8 * 32) -> dict:
    """The fields of a reference run's result.json that a compute-matched run reads, as the trainer writes them
    (train_flops = flops_per_token_train x train_tokens_seen)."""
    tokens = steps * tokens_per_step
    return {"train_flops": train_flops, "steps": steps, "train_tokens_seen": tokens,
            "flops_per_token_train": train_flops / tokens}


def test_compute_matched_steps_round_the_reference_flops(tmp_path):
    """Steps = the reference's training FLOPs (its run of the same seed) / (forward+backward FLOPs per token x batch
    x seq_len), to the nearest step: 10.6 steps' worth trains 11 steps, 10.4 trains 10."""
    from gbattn.experiments.compare import matched_configs, spec_configs
    from gbattn.model.params import flops_per_token

    recipe = get_recipe("cpu-proxy")
    spec = next(s for s in recipe.models if s.label == "compute-matched")
    sets = tiny_sets()  # batch 8 x seq_len 32 (block_size 33)
    model_cfg, train_cfg = spec_configs(recipe, spec, "data", 1, sets, 50)
    assert train_cfg.seq_len == 32 and model_cfg.block_size == 33
    per_step = flops_per_token(model_cfg, seq_len=32, backward=True) * 8 * 32
    # seq_len unset trains rows of block_size - 1 = 32 tokens too: the same steps (not a TypeError)
    for sets in (tiny_sets(), {**tiny_sets(), "seq_len": None}):
        for exact, expected in ((10.6, 11), (10.4, 10)):
            # seed 7's reference first: seed 1 is matched to its own seed's run, not to the first one finished
            results = {"gba-m2": {7: reference_result(50 * per_step, 50), 1: reference_result(exact * per_step, 10)}}
            _, matched = matched_configs(recipe, spec, "data", 1, sets, 50, results, tmp_path)
            assert matched.max_steps == expected, (exact, sets["seq_len"])


def test_compute_matched_keeps_the_warmup_its_reference_used(tmp_path):
    """docs/baselines.md: the compute-matched row keeps the reference's warmup and only its cosine stretches.
    cpu-proxy's default warmup of 100 steps in an 80-step GBA run is fitted to 8 (a tenth of the run); the
    compute-matched row's 118 steps would have kept all 100 (not above 118), so it warms up for 8 as given, not
    fitted again."""
    from gbattn.experiments.compare import matched_configs, spec_configs
    from gbattn.model.params import flops_per_token
    from gbattn.train.trainer import fitted_warmup

    recipe = get_recipe("cpu-proxy")
    specs = {s.label: s for s in recipe.models}
    sets = dict(TINY, max_steps=80, tokenizer="char", batch_size=8, seq_len=32, train_tokens=None, eval_tokens=None)
    gba_model, gba_train = spec_configs(recipe, specs["gba-m2"], "data", 1, sets, 50)
    assert gba_train.warmup_steps == 100 and fitted_warmup(gba_train, 80)[0] == 8
    results = {"gba-m2": {1: reference_result(flops_per_token(gba_model, seq_len=32, backward=True) * 8 * 32 * 80, 80)}}
    _, matched = matched_configs(recipe, specs["compute-matched"], "data", 1, sets, 50, results, tmp_path)
    assert matched.max_steps == 118
    assert fitted_warmup(matched, matched.max_steps) == (8, None)
    # A matched run shorter than its reference (30 steps) keeps the 8 too: not fitted again to a tenth, 3
    matched_model, _ = spec_configs(recipe, specs["compute-matched"], "data", 1, sets, 50)
    results["gba-m2"][1] = reference_result(flops_per_token(matched_model, seq_len=32, backward=True) * 8 * 32 * 30, 80)
    _, shorter = matched_configs(recipe, specs["compute-matched"], "data", 1, sets, 50, results, tmp_path)
    assert shorter.max_steps == 30 and fitted_warmup(shorter, shorter.max_steps) == (8, None)
    # ... and one shorter than that warmup (5 steps): the 8 as given, with the warning any run that long gets
    results["gba-m2"][1] = reference_result(flops_per_token(matched_model, seq_len=32, backward=True) * 8 * 32 * 5, 80)
    _, shortest = matched_configs(recipe, specs["compute-matched"], "data", 1, sets, 50, results, tmp_path)
    assert shortest.max_steps == 5 and not shortest.fit_warmup and fitted_warmup(shortest, 5)[0] == 8


@pytest.mark.parametrize("short_name, long_name, factor, steps", [
    ("cpu-char", "cpu-char-long", 4, 8000), ("cpu-proxy", "cpu-proxy-long", 2, 2400)])
def test_a_training_length_recipe_is_its_recipe_stretched(short_name, long_name, factor, steps):
    """Same preset, data, models (less Twicing) and schedule settings as the shorter recipe; ``factor`` times the
    steps (the cosine stretched over them)."""
    from gbattn.experiments.compare import spec_configs

    short, long = get_recipe(short_name), get_recipe(long_name)
    assert long.preset == short.preset and long.default_data == short.default_data
    assert long.models == [m for m in short.models if m.label != "twicing"]
    for spec in long.models:
        model_a, a = spec_configs(short, spec, "data", 42, {}, 65)
        model_b, b = spec_configs(long, spec, "data", 42, {}, 65)
        assert model_a == model_b
        assert b.max_steps == factor * a.max_steps == steps
        assert {k: v for k, v in b.to_dict().items() if k != "max_steps"} == {
            k: v for k, v in a.to_dict().items() if k != "max_steps"}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_recipe_description_names_steps_its_models_train_for(name):
    """A step count in a recipe's description decides whether results.md shows the published numbers (only for
    runs that long): it must be one its models train for (cpu-char's "2,000 steps" is its preset's max_steps)."""
    from gbattn.experiments.compare import spec_configs
    from gbattn.experiments.report import described_steps

    recipe = get_recipe(name)
    described = described_steps(recipe.description)
    steps = {spec_configs(recipe, spec, "data", 42, {}, None)[1].max_steps for spec in recipe.models
             if not spec.compute_matched_to}
    assert described is None or described in steps, (recipe.description, steps)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_seeds_are_distinct_and_as_many_as_published(name):
    """A recipe compared with published numbers runs as many seeds as they were reported over."""
    import re

    recipe = get_recipe(name)
    assert recipe.seeds and len(set(recipe.seeds)) == len(recipe.seeds)
    said = re.search(r"(\d+) seeds?\b", recipe.published_source)
    if said:
        assert len(recipe.seeds) == int(said.group(1)), recipe.published_source


def test_each_recipe_trains_on_the_corpus_and_seeds_it_is_compared_on():
    """A recipe's default data is the corpus its published numbers (or its CPU proxy) were measured on, and the paper
    recipes run the paper's seeds (docs/paper.md: 42 and 123): another corpus would set its rows against the
    published ones, mislabelled."""
    corpus = {"paper-owt": "openwebtext", "cpu-char": "tiny-shakespeare", "cpu-char-long": "tiny-shakespeare",
              "cpu-baselines": "tiny-shakespeare", "gba-design": "tiny-shakespeare"}
    for name, recipe in RECIPES.items():
        expected = corpus.get(name, "wikitext-103-raw-v1" if name.startswith("paper") or name.endswith("-paper")
                              else "wikitext-2-v1")
        assert recipe.default_data == expected, name
    assert get_recipe("paper-wt103").seeds == get_recipe("paper-owt").seeds == [42, 123]


def test_the_paper_table_says_its_published_spread_is_a_population_std():
    """The authors' WikiText-103 script reports np.std over its 2 seeds (n in the denominator); gbattn's
    rows are mean ± sample std (n - 1), sqrt(2) times as large for 2 seeds: the published line says
    which std the published column holds (docs/deviations.md, entry 20)."""
    from gbattn.experiments.report import mean_std

    assert "population std" in get_recipe("paper-wt103").published_source
    assert mean_std([72.5, 71.9])[1] == pytest.approx(0.3 * math.sqrt(2))  # the paper's 72.2 ± 0.3, as gbattn reports

def test_upcycle_recipe_continuations_are_what_their_labels_say():
    """Each continuation starts from base and trains after it; the upcycled ones are GBA M=2, "shared"
    with shared K/V, the other with the default (residual) K/V."""
    from gbattn.experiments.recipes import depends_on, training_order

    specs = get_recipe("upcycle").models
    for spec in specs:
        if spec.init_from:
            assert spec.init_from == "base" and "base" in depends_on(spec), spec.label
    order = [s.label for s in training_order(list(reversed(specs)))]
    assert all(order.index(d) < order.index(s.label) for s in specs for d in depends_on(s))
    upcycled = {s.label: s.upcycle for s in specs if s.upcycle}
    assert set(upcycled) == {"gba-upcycled", "gba-shared-upcycled"}
    for label, up in upcycled.items():
        assert up["attn"] == "boosted" and up["attn_options"]["rounds"] == 2
        assert up["attn_options"].get("kv_source", "residual") == ("shared" if "shared" in label else "residual")


def test_upcycle_recipe_splits_the_scratch_budget_in_halves():
    """base and every continuation train half of the from-scratch runs' steps: base + continuation
    = scratch (docs/method.md, "Upcycling")."""
    from gbattn.experiments.compare import spec_configs

    recipe = get_recipe("upcycle")
    steps = {s.label: spec_configs(recipe, s, "data", 42, {}, 64)[1].max_steps for s in recipe.models}
    scratch = steps.pop("gba-scratch")
    assert steps.pop("standard-scratch") == scratch == 1200
    assert set(steps.values()) == {scratch // 2}, steps
    # a shorter run asked for with --set keeps the split (it once gave every model the whole 40)
    short = {s.label: spec_configs(recipe, s, "data", 42, {"max_steps": 40}, 64)[1].max_steps for s in recipe.models}
    assert short.pop("gba-scratch") == short.pop("standard-scratch") == 40 and set(short.values()) == {20}, short
    for odd in (41, 43, 1201):  # round() made 41 steps 20 + 20 and 43 steps 22 + 22
        split = {s.label: spec_configs(recipe, s, "data", 42, {"max_steps": odd}, 64)[1].max_steps
                 for s in recipe.models}
        assert split["base"] + split["standard-continued"] == split["standard-scratch"] == odd, split
        continued = {split[label] for label in ("standard-continued", "gba-upcycled", "gba-shared-upcycled")}
        assert continued == {odd // 2 + 1}, split
    share = dataclasses.replace(recipe, models=[dataclasses.replace(s, steps_share=0.55) for s in recipe.models[:2]])
    assert [spec_configs(share, s, "data", 42, {"max_steps": 100}, 64)[1].max_steps for s in share.models] == [55, 55]


def _run_result(test_ppl: float, wall_clock_s: float) -> dict:
    """A finished run's result.json, with the fields the report aggregates."""
    return {"attn": "standard", "attn_options": {}, "d_model": 32, "parameters": 1_000, "flops_per_token_train": 6e3,
            "test_ppl": test_ppl, "valid_ppl": test_ppl + 1.0, "valid_loss": 2.0, "steps": 10,
            "train_tokens_seen": 640, "tokens_per_parameter": 0.64, "train_flops": 3.84e6,
            "wall_clock_s": wall_clock_s, "train_tokens_per_s": 100.0, "device": "cpu", "curve": []}


def test_report_of_an_unfinished_comparison_says_so_and_averages_each_column(tmp_path):
    """Standard finished seeds 1 and 2, GBA seed 1 only: results.json and results.md say the comparison
    is incomplete; test ppl is the mean of the test perplexities (not the validation ones) and the
    wall-clock column the mean per run. With GBA's seed 2 in, it is complete."""
    from gbattn.experiments.recipes import ModelSpec, Recipe
    from gbattn.experiments.report import results_markdown, write_results

    recipe = Recipe("r", "a test (10 steps)", "cpu-char", [ModelSpec("standard"), ModelSpec("gba-m2", "boosted")])
    request = {"data": "x", "seeds": [1, 2], "sets": {}}
    results = {"standard": {1: _run_result(10.0, 60.0), 2: {**_run_result(12.0, 120.0), "valid_ppl": 14.0}},
               "gba-m2": {1: _run_result(9.0, 60.0)}}
    report = write_results(tmp_path, recipe, request, recipe.models, results)
    assert not report["complete"] and report["missing"] == ["gba-m2/seed2"]
    assert "INCOMPLETE (runs missing: gba-m2/seed2)" in (tmp_path / "results.md").read_text()
    many = {**report, "missing": [f"m/seed{seed}" for seed in range(8)]}  # the first six named
    assert "INCOMPLETE (runs missing: m/seed0, m/seed1, m/seed2, m/seed3, m/seed4, m/seed5, and 2 more)" in (
        results_markdown(many))
    seven = {**report, "missing": [f"m/seed{seed}" for seed in range(7)]}  # one past the six named: said
    assert "m/seed4, m/seed5, and 1 more)" in results_markdown(seven)
    six = {**report, "missing": [f"m/seed{seed}" for seed in range(6)]}  # all six named: no "and 0 more"
    assert "INCOMPLETE (runs missing: m/seed0, m/seed1, m/seed2, m/seed3, m/seed4, m/seed5)" in results_markdown(six)
    standard = report["models"][0]
    assert (standard["test_ppl_mean"], standard["valid_ppl_mean"], standard["wall_clock_s"]) == (11.0, 12.5, 90.0)
    # each spread is its own column's sample std: test 10, 12; validation 11, 14
    assert (standard["test_ppl_std"], standard["valid_ppl_std"]) == (pytest.approx(2 ** 0.5), pytest.approx(4.5 ** 0.5))
    results["gba-m2"][2] = _run_result(9.5, 60.0)
    assert write_results(tmp_path, recipe, request, recipe.models, results)["complete"]
    assert "INCOMPLETE" not in (tmp_path / "results.md").read_text()


def test_a_report_row_keeps_each_runs_losses_devices_norm_and_the_published_value(tmp_path):
    """Two seeds on different devices at different speeds: the row's tokens/s is their mean, its device
    both (each once), its validation losses the runs' own (not perplexities); a Post-LN run is named so
    in the table, and the recipe's published value is the row's."""
    from gbattn.experiments.recipes import ModelSpec, Recipe
    from gbattn.experiments.report import write_results

    recipe = Recipe("r", "a test (10 steps)", "cpu-char", [ModelSpec("standard")], published={"standard": (6.5, 0.1)},
                    published_source="a paper")
    first, second = _run_result(10.0, 60.0), _run_result(12.0, 60.0)
    first.update(norm="post", residual="attnres-block", train_tokens_per_s=100.0, valid_loss=2.25)
    second.update(norm="post", residual="attnres-block", train_tokens_per_s=300.0, valid_loss=2.5,
                  device="cuda (a GPU)")
    report = write_results(tmp_path, recipe, {"data": "x", "seeds": [1, 2], "sets": {}}, recipe.models,
                           {"standard": {1: first, 2: second}})
    (row,) = report["models"]
    assert row["tokens_per_s"] == 200.0 and row["device"] == "cpu; cuda (a GPU)"
    assert row["valid_loss"] == {"1": 2.25, "2": 2.5} and row["norm"] == "post" and row["published"] == (6.5, 0.1)
    md = (tmp_path / "results.md").read_text()
    assert "| standard | standard, Post-LN, attnres-block |" in md and "| 6.50 ± 0.10 |" in md
    assert "Published: a paper." in md and row["residual"] == "attnres-block"


def test_a_row_compiled_on_some_seeds_only_says_its_tokens_per_s_count_the_compiling(tmp_path):
    """gba-m2's seed 1 trained eager and its seed 2 compiled: the row's tokens/s and wall-clock (means over its seeds)
    count seed 2's compiling, so the row is compiled and results.md says so; compiled when any run is, not only when
    every run is, nor as its first run is."""
    from gbattn.experiments.recipes import ModelSpec, Recipe
    from gbattn.experiments.report import write_results

    recipe = Recipe("r", "a test (10 steps)", "cpu-char", [ModelSpec("standard"), ModelSpec("gba-m2", "boosted")])
    results = {"standard": {seed: {**_run_result(10.0, 60.0), "compiled": False} for seed in (1, 2)},
               "gba-m2": {1: {**_run_result(9.0, 60.0), "compiled": False},
                          2: {**_run_result(9.5, 60.0), "compiled": True}}}
    report = write_results(tmp_path, recipe, {"data": "x", "seeds": [1, 2], "sets": {}}, recipe.models, results)
    assert [r["compiled"] for r in report["models"]] == [False, True]
    assert ("\ntokens/s and wall-clock of gba-m2 count torch.compile's compiling (once for each leg of a run that "
            "trained compiled).\n") in (tmp_path / "results.md").read_text()


def test_a_runs_result_json_whose_compiled_is_a_number_is_refused(tmp_path):
    """result.json's compiled (whether its time and tokens/s count torch.compile's compiling) is true or false, as
    gbattn writes it: an edited or hand-made 1 was taken as true by the comparison reading it; refused as "yes" is."""
    from gbattn.errors import CheckpointError

    for value in (1, 0):
        rundir.write_result(tmp_path, {**_run_result(10.0, 60.0), "compiled": value})
        with pytest.raises(CheckpointError, match=f"result.json: compiled={value} must be true or false"):
            rundir.read_result(tmp_path / rundir.RESULT)
    rundir.write_result(tmp_path, {**_run_result(10.0, 60.0), "compiled": False})
    assert rundir.read_result(tmp_path / rundir.RESULT)["compiled"] is False


def test_a_report_row_lists_its_seeds_in_numeric_order_whatever_order_they_finished_in(tmp_path):
    """Runs finish in any order (--jobs, --seeds 123 7 42): the row's seeds and per-seed values are in
    numeric seed order all the same."""
    from gbattn.experiments.recipes import ModelSpec, Recipe
    from gbattn.experiments.report import write_results

    recipe = Recipe("r", "a test (10 steps)", "cpu-char", [ModelSpec("standard")])
    runs = {123: _run_result(12.0, 60.0), 7: _run_result(10.0, 60.0), 42: _run_result(11.0, 60.0)}
    report = write_results(tmp_path, recipe, {"data": "x", "seeds": [7, 42, 123], "sets": {}}, recipe.models,
                           {"standard": runs})
    (row,) = report["models"]
    assert row["seeds"] == [7, 42, 123]
    for key in ("test_ppl", "valid_ppl", "valid_loss", "curves"):
        assert list(row[key]) == ["7", "42", "123"], key


def test_a_report_rows_wall_clock_and_tokens_per_second_are_means_over_three_seeds(tmp_path):
    """Wall-clock and tokens/s are means over the seeds (100 s, 200/s), not medians (60 s, 100/s), which
    two seeds cannot tell apart."""
    from gbattn.experiments.recipes import ModelSpec, Recipe
    from gbattn.experiments.report import write_results

    recipe = Recipe("r", "a test (10 steps)", "cpu-char", [ModelSpec("standard")])
    runs = {1: _run_result(10.0, 60.0), 2: _run_result(11.0, 60.0), 3: _run_result(12.0, 180.0)}
    runs[3]["train_tokens_per_s"] = 400.0
    report = write_results(tmp_path, recipe, {"data": "x", "seeds": [1, 2, 3], "sets": {}}, recipe.models,
                           {"standard": runs})
    assert (report["models"][0]["wall_clock_s"], report["models"][0]["tokens_per_s"]) == (100.0, 200.0)


def test_a_report_rows_length_columns_are_the_runs_own(tmp_path):
    """The row's parameters, steps, train tokens, tokens per parameter and train FLOPs are the run's result (its
    train_tokens_seen as train_tokens), and results.md shows them in their units (M tokens, PFLOP)."""
    from gbattn.experiments.recipes import ModelSpec, Recipe
    from gbattn.experiments.report import write_results

    recipe = Recipe("r", "a test (10 steps)", "cpu-char", [ModelSpec("standard")])
    run = {**_run_result(10.0, 60.0), "parameters": 2_000, "steps": 30, "train_tokens_seen": 5_000_000,
           "tokens_per_parameter": 2_500.0, "train_flops": 7.5e15}
    report = write_results(tmp_path, recipe, {"data": "x", "seeds": [1], "sets": {}}, recipe.models,
                           {"standard": {1: run}})
    (row,) = report["models"]
    assert (row["parameters"], row["steps"], row["train_tokens"], row["train_flops"]) == (2_000, 30, 5_000_000, 7.5e15)
    assert row["tokens_per_parameter"] == row["train_tokens"] / row["parameters"] == 2_500.0
    assert "| 2,000 | 10.00 | — | 11.00 | — | 30 | 5.00M | 2.5e+03 | 7.5 | 100 | 1.0 min |" in (
        tmp_path / "results.md").read_text()
    # a run of a few seconds: every row of a short comparison said "0.0 min"
    write_results(tmp_path, recipe, {"data": "x", "seeds": [1], "sets": {}}, recipe.models,
                  {"standard": {1: {**run, "wall_clock_s": 2.44}}})
    assert "| 7.5 | 100 | 2.4 s |" in (tmp_path / "results.md").read_text()
    write_results(tmp_path, recipe, {"data": "x", "seeds": [1], "sets": {}}, recipe.models,
                  {"standard": {1: {**run, "wall_clock_s": 3.1}}})
    assert "| 7.5 | 100 | 3.1 s |" in (tmp_path / "results.md").read_text()  # (not "0.1 min": 6 s)


def test_a_report_row_names_the_models_it_is_matched_to_and_continues(tmp_path):
    """Each row carries its spec's param_matched_to, compute_matched_to and init_from, and results.md says what
    the param-fair and compute-matched rows are matched to (the table's reader relies on those lines)."""
    from gbattn.experiments.recipes import ModelSpec, Recipe
    from gbattn.experiments.report import write_results

    specs = [ModelSpec("standard"), ModelSpec("param-fair", param_matched_to="gba-m2"),
             ModelSpec("compute-matched", compute_matched_to="gba-m2"), ModelSpec("gba-m2", "boosted"),
             ModelSpec("standard-continued", init_from="standard")]
    recipe = Recipe("r", "a test (10 steps)", "cpu-char", specs)
    results = {s.label: {1: {**_run_result(10.0, 60.0), "attn": s.attn}} for s in specs}
    report = write_results(tmp_path, recipe, {"data": "x", "seeds": [1], "sets": {}}, specs, results)
    assert [(r["param_matched_to"], r["compute_matched_to"], r["init_from"]) for r in report["models"]] == [
        (None, None, None), ("gba-m2", None, None), (None, "gba-m2", None), (None, None, None),
        (None, None, "standard")]
    md = (tmp_path / "results.md").read_text()
    assert "`param-fair`: gba-m2 with standard attention at the smallest width giving at least its parameters" in md
    # matched to a model of the user's own (compare --matched): each param-matched row by its own label and its own
    # gap (the note called `param-fair-tw` "`param-fair`", and gave both rows' gaps under that one name)
    mine = [*specs, ModelSpec("tw", "twicing"), ModelSpec("param-fair-tw", param_matched_to="tw")]
    sizes = {"tw": 100, "param-fair-tw": 103, "gba-m2": 200, "param-fair": 210}
    write_results(tmp_path, recipe, {"data": "x", "seeds": [1], "sets": {}}, mine,
                  {**{s.label: {1: {**_run_result(10.0, 60.0), "attn": s.attn, "parameters": sizes.get(s.label, 150)}}
                      for s in mine}})
    assert ("`param-fair`: gba-m2 with standard attention at the smallest width giving at least its parameters "
            "(+5.0%); `param-fair-tw`: tw with standard attention at the smallest width giving at least its "
            "parameters (+3.0%); `compute-matched`:") in (tmp_path / "results.md").read_text()
    assert "`compute-matched`: standard trained for as many training FLOPs" in md and "as gba-m2 used." in md
    assert "standard-continued continue standard's trained weights" in md


def test_the_validation_table_says_continued_steps_count_from_the_continuation(tmp_path):
    """A continued model's curve restarts at step 1 after its base's steps: the validation table's step column
    pairs it with a from-scratch model's earlier step, so results.md says how many steps to add (the curves
    figure draws it after the base's tokens)."""
    from gbattn.experiments.recipes import ModelSpec, Recipe
    from gbattn.experiments.report import write_results

    specs = [ModelSpec("base", steps_share=0.5), ModelSpec("standard-continued", init_from="base", steps_share=0.5),
             ModelSpec("standard-scratch")]
    recipe = Recipe("r", "a test (10 steps)", "cpu-char", specs)
    curve = [{"step": 5, "tokens": 320, "valid_loss": 2.0, "valid_ppl": 7.4}]
    results = {s.label: {1: {**_run_result(10.0, 60.0), "curve": curve}} for s in specs}
    write_results(tmp_path, recipe, {"data": "x", "seeds": [1], "sets": {}}, specs, results)
    validation_table = (tmp_path / "results.md").read_text().split("## Validation perplexity during training")[1]
    assert ("The steps of standard-continued count from the start of their continuation: add base's 10 steps"
            in validation_table)


# -- what a recipe's rows are, and what compare asks of its directory --------------------------------

# Options a GBA row's label names: (part of the label, option, value).
LABEL_OPTIONS = [("-m3", "rounds", 3), ("kv-input", "kv_source", "input"), ("shared", "kv_source", "shared"),
                 ("gate-vector", "gate", "vector"), ("gate-scalar", "gate", "scalar"), ("upper-half", "layers", [2, 3])]


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_row_is_the_model_its_label_names(name):
    """Built as compare builds it (spec_configs): a gba row is GBA M=2 (M=3 for -m3) with the option its
    label names, nothing else; twicing, gated and differential rows those variants (no-attn-bias: without
    attention biases), every other row standard; postln rows are Post-LN and
    attnres rows AttnRes-block, the others Pre-LN with plain residuals; a param-fair row has its
    reference's block; continued and upcycled rows start from base."""
    from gbattn.experiments.compare import spec_configs

    recipe = get_recipe(name)
    specs = {s.label: s for s in recipe.models}
    for spec in recipe.models:
        label = spec.label
        model_cfg, _ = spec_configs(recipe, spec, "data", 42, {}, 64)
        assert model_cfg.norm == ("post" if "postln" in label else "pre"), label
        assert model_cfg.residual == ("attnres-block" if "attnres" in label else "plain"), label
        attn, options = model_cfg.attn, model_cfg.attn_options
        if spec.upcycle:
            attn, options = spec.upcycle["attn"], spec.upcycle.get("attn_options", {})
        if label.startswith("gba"):
            named = {"rounds": 2, **{key: value for part, key, value in LABEL_OPTIONS if part in label}}
            assert attn == "boosted" and {k: options.get(k) for k in named} == named, (label, options)
            assert set(options) - set(named) <= ({"gate"} if spec.upcycle else set()), (label, options)
        else:
            named = next((a for a in ("twicing", "gated", "differential") if label.startswith(a)), "standard")
            assert (attn, options) == (named, {}), label
        assert model_cfg.attn_bias is (False if "no-attn-bias" in label else None), label
        if spec.param_matched_to:
            assert spec.model == specs[spec.param_matched_to].model, label
        if "continued" in label or "upcycled" in label:
            assert spec.init_from == "base", label


def test_recipes_hold_the_models_their_descriptions_name():
    """cpu-modern is the cpu-proxy models in a Llama-style block; the best-design recipes hold the design
    study's M=2 and M=3 with their three baselines."""
    from gbattn.experiments.compare import spec_configs

    modern = get_recipe("cpu-modern")
    for spec in modern.models:
        model_cfg, _ = spec_configs(modern, spec, "data", 42, {}, 64)
        assert (model_cfg.norm_type, model_cfg.ffn, model_cfg.pos, model_cfg.bias) == (
            "rmsnorm", "swiglu", "rope", False), spec.label
    for name in ("gba-design-proxy", "gba-design-paper"):
        assert [s.label for s in get_recipe(name).models] == [
            "standard", "param-fair", "compute-matched", "gba-m2", "gba-m3"], name
    # The seeds the issues and the README name: the design study and the paper-scale GPU script use
    # three (every seed agrees in sign by chance 1 time in 4, against 1 in 2 with two seeds), the paper's tables two.
    assert get_recipe("gba-design").seeds == [42, 123, 7] == get_recipe("gba-design-paper").seeds
    assert get_recipe("paper-wt103").seeds == [42, 123]
    # the training-length tables: the three seeds of cpu-proxy's and gba-design's
    assert get_recipe("cpu-proxy-long").seeds == [42, 123, 7] == get_recipe("cpu-char-long").seeds


def test_training_order_starts_the_runs_others_wait_for_first_and_refuses_a_cycle():
    """A matched or continued model trains after its reference, the models others wait for start first (the
    longest chain of waiting models first: with --jobs 2 cpu-char-long trained standard and param-fair at once,
    then GBA, and compute-matched alone at the end), the rest in display order; models that wait for each other
    are one line, not an endless loop."""
    from gbattn.errors import ConfigError
    from gbattn.experiments.recipes import ModelSpec, training_order

    order = [s.label for s in training_order(get_recipe("cpu-proxy").models)]
    assert order == ["gba-m2", "standard", "twicing", "param-fair", "compute-matched"]
    order = [s.label for s in training_order(get_recipe("cpu-char-long").models)]
    assert order == ["gba-m2", "standard", "param-fair", "compute-matched"]
    # base <- gba-upcycled <- standard-continued-compute-matched: the longest chain, then its second link
    order = [s.label for s in training_order(get_recipe("upcycle").models)]
    assert order[:2] == ["base", "gba-upcycled"]
    assert order[2:] == [s.label for s in get_recipe("upcycle").models if s.label not in order[:2]]
    cycle = [ModelSpec("a", compute_matched_to="b"), ModelSpec("b", init_from="a"), ModelSpec("c")]
    with pytest.raises(ConfigError, match=r"models \['a', 'b'\] depend on each other"):
        training_order(cycle)


def test_param_fair_width_is_the_smallest_with_the_reference_parameters():
    """param-fair's d_model: at least gba-m2's parameters, and one head's width less would not be."""
    from gbattn.experiments.compare import matched_configs, spec_configs

    recipe = get_recipe("cpu-proxy")
    specs = {s.label: s for s in recipe.models}
    sets = tiny_sets()
    gba, _ = spec_configs(recipe, specs["gba-m2"], "data", 1, sets, 50)
    fair, _ = matched_configs(recipe, specs["param-fair"], "data", 1, sets, 50, {}, None)
    assert count_params(fair) >= count_params(gba) > count_params(fair.replace(d_model=fair.d_model - fair.n_heads))
    assert fair.d_model > gba.d_model and fair.attn == "standard"
    # The width is solved for param-fair's own settings, not its reference's: with half GBA's FFN it is wider
    # still, and has at least GBA's parameters all the same.
    narrow_ffn = dataclasses.replace(specs["param-fair"], model={"ffn_mult": 2})
    recipe = dataclasses.replace(recipe, models=[specs["gba-m2"], narrow_ffn])
    fair_narrow_ffn, _ = matched_configs(recipe, narrow_ffn, "data", 1, sets, 50, {}, None)
    assert fair_narrow_ffn.ffn_mult == 2 and fair_narrow_ffn.d_model > fair.d_model
    assert count_params(fair_narrow_ffn) >= count_params(gba)


def test_a_matched_or_continued_model_without_its_reference_is_one_line(tmp_path):
    """matched_configs of a compute-matched row before its reference finished, or of a continuation before
    base finished: a UserError that names the model to train first."""
    from gbattn.experiments.compare import matched_configs

    sets = tiny_sets()
    recipe = get_recipe("cpu-proxy")
    spec = next(s for s in recipe.models if s.label == "compute-matched")
    with pytest.raises(UserError, match="compute-matched is matched to gba-m2's compute: run that model first"):
        matched_configs(recipe, spec, "data", 1, sets, 50, {}, tmp_path)
    recipe = get_recipe("upcycle")
    spec = next(s for s in recipe.models if s.label == "standard-continued")
    with pytest.raises(UserError, match="standard-continued starts from base's trained weights: train that model"):
        matched_configs(recipe, spec, "data", 1, sets, 50, {}, tmp_path)


def test_a_share_of_max_steps_is_at_least_one_step_and_needs_max_steps():
    """The upcycle recipe's halves of max_steps=1 are one step each (not 0); trained by epochs (max_steps
    unset), a share of max_steps is a one-line error."""
    from gbattn.experiments.compare import spec_configs

    recipe = get_recipe("upcycle")
    base = next(s for s in recipe.models if s.label == "base")
    assert spec_configs(recipe, base, "data", 42, {"max_steps": 1}, 64)[1].max_steps == 1
    with pytest.raises(UserError, match="base trains a share of max_steps, which is not set"):
        spec_configs(recipe, base, "data", 42, {"max_steps": None, "epochs": 1}, 64)


def test_dropout_sites_count_only_when_there_is_dropout():
    """A recorded run whose dropout sites differ from the recipe's is another run when there is dropout,
    and the same run when dropout is 0 (the sites change nothing)."""
    from gbattn.experiments.compare import comparable

    for dropout, same in ((0.0, True), (0.1, False)):
        model_cfg, train_cfg = build_configs("cpu-char", "standard", "data", {"dropout": dropout})
        other = model_cfg.replace(dropout_sites=["embedding"])
        assert (comparable(model_cfg, train_cfg) == comparable(other, train_cfg)) is same, dropout


def test_a_continuation_is_the_same_run_wherever_the_comparison_lies_but_not_from_another_model():
    """A continuation's start counts by its model and seed within the comparison: a comparison directory that
    was moved keeps it, one that starts from another model's weights (same seed) is another run."""
    from gbattn.experiments.compare import comparable

    model_cfg, train_cfg = build_configs("cpu-char", "standard", "data", {})

    def starting_from(path):
        return comparable(model_cfg, train_cfg.replace(init_from=path))

    assert starting_from("/old/cmp/base/seed42") == starting_from("/new/place/base/seed42")
    assert starting_from("/old/cmp/base/seed42") != starting_from("/old/cmp/standard/seed42")


def test_each_seed_trains_its_own_run(tmp_path):
    """Seeds 1 and 2: each run records and trains with its own seed (not one seed for all)."""
    from gbattn import rundir

    data = write_corpus(tmp_path / "c")
    report = run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), seeds=[1, 2], sets=tiny_sets(),
                         only=["standard"], quiet=True)
    for seed in (1, 2):
        config = rundir.read_config(tmp_path / "cmp" / "standard" / f"seed{seed}" / rundir.CONFIG)
        assert config["train"]["seed"] == seed
    ppl = report["models"][0]["test_ppl"]
    assert ppl["1"] != ppl["2"], ppl


def test_a_refused_run_names_four_differences_and_says_when_there_are_more(tmp_path):
    """check_run's message lists at most four differing fields, and ends them in '; ...' only when there are
    more than four."""
    from gbattn.experiments.compare import check_run

    model_cfg, train_cfg = build_configs("cpu-char", "standard", "data", {})
    rundir.write_config(tmp_path, "cpu-char", model_cfg, train_cfg, planned=True)
    four = train_cfg.replace(lr=5e-4, seed=7, batch_size=4, weight_decay=0.5)
    for asked_model, more in ((model_cfg, False), (model_cfg.replace(n_layers=3), True)):
        with pytest.raises(UserError) as refused:
            check_run(tmp_path, asked_model, four)
        message = str(refused.value)
        assert message.count(", asked ") == 4 and ("; ...)" in message) is more, message


def test_a_run_recorded_with_another_training_config_is_refused_finished_or_not(tmp_path):
    """A run directory whose recorded training config (here lr) is not the recipe's is refused, whether
    it finished or was killed before its result (it was resumed with the recorded lr)."""
    from gbattn import rundir

    data = write_corpus(tmp_path / "c")
    sets = tiny_sets()
    run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=sets, only=["standard"], quiet=True)
    run = tmp_path / "cmp" / "standard" / "seed42"
    config = json.loads((run / rundir.CONFIG).read_text())
    config["train"]["lr"] *= 2
    (run / rundir.CONFIG).write_text(json.dumps(config))
    for _ in ("finished", "killed"):
        with pytest.raises(UserError, match=r"standard/seed42 holds another run than this recipe asks for \(train.lr"):
            run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=sets, only=["standard"], quiet=True)
        (run / rundir.RESULT).unlink(missing_ok=True)


def test_a_killed_run_of_a_comparison_resumes_with_the_threads_asked_now(tmp_path, monkeypatch):
    """A comparison killed inside a run: the rerun resumes that run from its checkpoint (not from scratch)
    with the rerun's threads, which change its speed, not whether it counts as the recipe's; the finished
    run is then reused under any thread count."""
    from gbattn import rundir

    data = write_corpus(tmp_path / "c")
    sets, out = {**tiny_sets(), "max_steps": 4}, tmp_path / "cmp"
    with killed_at(3, monkeypatch):
        with pytest.raises(RuntimeError, match="simulated kill"):
            run_compare("cpu-proxy", out, data=str(data), sets=sets, only=["standard"], quiet=True, threads=1)
        # rerun without --threads: this call's default (the run kept the 1 thread of the call that started it)
        with pytest.raises(RuntimeError, match="simulated kill"):
            run_compare("cpu-proxy", out, data=str(data), sets=sets, only=["standard"], quiet=True)
    run = out / "standard" / "seed42"
    assert rundir.read_config(run / rundir.CONFIG)["train"]["threads"] is None
    assert (run / rundir.CHECKPOINT).exists() and not (run / rundir.RESULT).exists()
    report = run_compare("cpu-proxy", out, data=str(data), sets=sets, only=["standard"], quiet=True, threads=2)
    events = [json.loads(line) for line in (run / rundir.METRICS).read_text().splitlines()]
    assert {"event": "resume", "step": 2} in events, events
    assert rundir.read_config(run / rundir.CONFIG)["train"]["threads"] == 2
    monkeypatch.setattr(compare_mod, "train", lambda *a, **k: pytest.fail("retrained a finished run"))
    again = run_compare("cpu-proxy", out, data=str(data), sets=sets, only=["standard"], quiet=True, threads=1)
    assert again["models"][0]["test_ppl"] == report["models"][0]["test_ppl"]


def test_compare_threads_reach_a_run_trained_in_this_process(tmp_path):
    """--threads with one job: the run trains with them (config.json records them)."""
    from gbattn import rundir

    data = write_corpus(tmp_path / "c")
    run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=tiny_sets(), only=["standard"], quiet=True,
                threads=1)
    assert rundir.read_config(tmp_path / "cmp" / "standard" / "seed42" / rundir.CONFIG)["train"]["threads"] == 1


def test_compare_refuses_another_recipe_or_data_or_only_label_in_the_same_directory(tmp_path):
    """A directory holding a cpu-proxy comparison on one corpus: another recipe, or the same recipe on a
    corpus of another name, is refused before anything trains; --only of a label the recipe lacks is one line."""
    import shutil

    data = write_corpus(tmp_path / "c")
    other = tmp_path / "d"
    shutil.copytree(data, other)
    sets = tiny_sets()
    run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=sets, only=["standard"], quiet=True)
    with pytest.raises(UserError, match="holds a comparison with recipe='cpu-proxy', not 'cpu-char'"):
        run_compare("cpu-char", tmp_path / "cmp", data=str(data), sets=sets, only=["standard"], quiet=True)
    with pytest.raises(UserError, match="holds a comparison with data="):
        run_compare("cpu-proxy", tmp_path / "cmp", data=str(other), sets=sets, only=["standard"], quiet=True)
    with pytest.raises(UserError, match=r"--only gba-m4: not in recipe 'cpu-proxy'"):
        run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), sets=sets, only=["standard", "gba-m4"], quiet=True)


def test_an_empty_data_is_refused_not_replaced_by_the_recipes_default(tmp_path):
    """--data "" is a mistake to name, not a request for the recipe's default corpus (which None asks for)."""
    with pytest.raises(UserError, match="--data is empty"):
        run_compare("cpu-proxy", tmp_path / "cmp", data="", sets=tiny_sets(), only=["standard"], quiet=True)
    assert not (tmp_path / "cmp" / "recipe.json").exists()


def test_a_comparison_whose_data_cannot_be_read_records_nothing(tmp_path):
    """A typo in --data wrote recipe.json before the data was read, so the corrected command was refused
    in the same --out ("holds a comparison with data='typo'")."""
    data, out = write_corpus(tmp_path / "c"), tmp_path / "cmp"
    with pytest.raises(UserError, match="no such file or directory"):
        run_compare("cpu-proxy", out, data=str(tmp_path / "typo"), sets=tiny_sets(), only=["standard"], quiet=True)
    assert not (out / "recipe.json").exists()
    assert run_compare("cpu-proxy", out, data=str(data), sets=tiny_sets(), only=["standard"], quiet=True)["complete"]
    assert json.loads((out / "recipe.json").read_text())["data"] == str(data.name)


def test_a_seq_len_beyond_block_size_is_refused_before_the_comparison_is_recorded(tmp_path, monkeypatch):
    """--set seq_len longer than block_size was refused by each run only: every run failed, and recipe.json
    (written before) refused the corrected command ("holds a comparison with other --set values")."""
    monkeypatch.setattr(compare_mod, "train", lambda *a, **k: pytest.fail("trained"))
    data, out = write_corpus(tmp_path / "c"), tmp_path / "cmp"
    sets = {**tiny_sets(), "block_size": 16, "seq_len": 17}
    with pytest.raises(UserError, match="^seq_len=17 exceeds block_size=16$"):
        run_compare("cpu-proxy", out, data=str(data), sets=sets, only=["standard"], quiet=True)
    assert not (out / "recipe.json").exists() and not (out / "standard").exists()


def test_a_device_that_is_not_here_is_refused_before_the_comparison_is_recorded(tmp_path, monkeypatch):
    """--set device=cuda on a machine without CUDA was found by each run in turn ("5 run(s) failed")."""
    monkeypatch.setattr(compare_mod, "train", lambda *a, **k: pytest.fail("trained"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    data, out = write_corpus(tmp_path / "c"), tmp_path / "cmp"
    with pytest.raises(UserError, match="^device='cuda' but CUDA is not available here; use cpu$"):
        run_compare("cpu-proxy", out, data=str(data), sets={**tiny_sets(), "device": "cuda"}, only=["standard"],
                    quiet=True)
    assert not (out / "recipe.json").exists() and not (out / "standard").exists()


def test_recipe_json_keeps_the_seeds_of_every_invocation_and_refuses_damaged_ones(tmp_path):
    """Seeds 1, then 2, then 1 again: recipe.json records [1, 2] after the second, so the third still
    reports both; a recipe.json whose seeds are not a list of integers is one line (a first invocation whose
    data cannot be read writes none: test_a_comparison_whose_data_cannot_be_read_records_nothing)."""
    from gbattn.errors import CheckpointError

    data = write_corpus(tmp_path / "c")
    sets, out = tiny_sets(), tmp_path / "cmp"
    for seed in (1, 2):
        run_compare("cpu-proxy", out, data=str(data), seeds=[seed], sets=sets, only=["standard"], quiet=True)
    assert json.loads((out / "recipe.json").read_text())["seeds"] == [1, 2]
    report = run_compare("cpu-proxy", out, data=str(data), seeds=[1], sets=sets, only=["standard"], quiet=True)
    assert report["seeds"] == [1, 2] and set(report["models"][0]["test_ppl"]) == {"1", "2"}
    # 5: a TypeError traceback without the list check; -1 and 10**30 (no --seeds takes them) were trained, or reported
    # as missing runs, with exit 0
    for seeds in ("1", [1, True], 5, [-1, 1], [10**30]):
        (out / "recipe.json").write_text(json.dumps({**json.loads((out / "recipe.json").read_text()),
                                                     "seeds": seeds}))
        with pytest.raises(CheckpointError, match=r"must be a list of integers in \[0, 2\*\*63 - 1\]; restore"):
            run_compare("cpu-proxy", out, data=str(data), seeds=[1], sets=sets, only=["standard"], quiet=True)
    # A recipe.json holding no seeds, and no --seeds: the recipe's seeds, as for a new comparison (not none at all)
    (out / "recipe.json").write_text(json.dumps({**json.loads((out / "recipe.json").read_text()), "seeds": []}))
    assert run_compare("cpu-proxy", out, data=str(data), sets=sets, only=["standard"], quiet=True)["seeds"] == [42]
    for commands in ("gbattn compare", ["gbattn compare", 1]):  # the commands of results.md: a list of strings too
        (out / "recipe.json").write_text(json.dumps({**json.loads((out / "recipe.json").read_text()),
                                                     "commands": commands}))
        with pytest.raises(CheckpointError, match=r"commands=.* must be a list of strings; restore the file"):
            run_compare("cpu-proxy", out, data=str(data), sets=sets, only=["standard"], quiet=True)


def test_compare_command_forwards_every_option_and_prints_the_report(tmp_path, monkeypatch, capsys):
    """`gbattn compare`: each option reaches run_compare (--residual as a --set), the defaults are the
    recipe's (None) with one job; results.md is printed, and an incomplete comparison says so."""
    from helpers import run_cli

    calls = []

    def fake_run_compare(recipe, out, **kwargs):
        calls.append((recipe, out, kwargs))
        (tmp_path / "cmp" / "results.md").write_text("# the report\n", encoding="utf-8")
        return {"complete": len(calls) == 1}

    monkeypatch.setattr(compare_mod, "run_compare", fake_run_compare)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cmp").mkdir()
    code, out, _ = run_cli(capsys, ["compare", "--recipe", "cpu-char", "--out", "cmp"])
    assert (code, out) == (0, "# the report\n\n")
    assert calls[0] == ("cpu-char", "cmp", {"data": None, "seeds": None, "sets": {}, "only": None, "quiet": False,
                                            "threads": None, "jobs": 1, "models": {}, "matched": None})
    code, out, _ = run_cli(capsys, ["compare", "--recipe", "cpu-char", "--out", "cmp", "--data", "corpus", "--seeds",
                                    "7", "8", "--only", "standard", "--residual", "attnres-full", "--set", "lr=1e-3",
                                    "--jobs", "2", "--threads", "3", "--quiet"])
    assert (code, out) == (0, "# the report\n\n(incomplete: some runs are missing)\n")
    assert calls[1][2] == {"data": "corpus", "seeds": [7, 8], "sets": {"lr": 1e-3, "residual": "attnres-full"},
                           "only": ["standard"], "quiet": True, "threads": 3, "jobs": 2, "models": {},
                           "matched": None}
    # --set data and --set threads are --data and --threads (recipe.json records that data; the threads are
    # in all): they trained on the --set corpus while recipe.json recorded the recipe's.
    code, _, _ = run_cli(capsys, ["compare", "--recipe", "cpu-char", "--out", "cmp", "--set", "data=corpus", "--set",
                                  "threads=3", "--set", "lr=1e-3"])
    assert code == 0 and calls[2][2] == {"data": "corpus", "seeds": None, "sets": {"lr": 1e-3}, "only": None,
                                         "quiet": False, "threads": 3, "jobs": 1, "models": {}, "matched": None}
    # --model LABEL=VARIANT[:options] (split at the first '=': the options have their own) and --matched
    code, _, _ = run_cli(capsys, ["compare", "--recipe", "cpu-char", "--out", "cmp", "--model",
                                  "gba-m4=boosted:rounds=4,residual=attnres-block", "--model", "std=standard",
                                  "--matched", "gba-m4", "--matched", "std"])
    assert code == 0 and calls[3][2]["models"] == {"gba-m4": "boosted:rounds=4,residual=attnres-block",
                                                   "std": "standard"}
    assert calls[3][2]["matched"] == ["gba-m4", "std"]
    code, _, err = run_cli(capsys, ["compare", "--recipe", "cpu-char", "--out", "cmp", "--seeds", "-1"])
    assert code == 2 and "argument --seeds: -1 must be >= 0" in err and len(calls) == 4


def test_a_jobs_childs_log_that_is_a_link_is_refused_and_its_target_untouched(tmp_path, monkeypatch):
    """A shared comparison directory whose run holds train.log as a link to a file elsewhere: a --jobs
    child's output was appended to that file (outside the directory); it is refused as metrics.jsonl is."""
    import subprocess

    victim = tmp_path / "victim.txt"
    victim.write_text("not gbattn's\n")
    run_dir = tmp_path / "cmp" / "standard" / "seed42"
    run_dir.mkdir(parents=True)
    (run_dir / "train.log").symlink_to(victim)
    started, real_popen = [], subprocess.Popen
    monkeypatch.setattr(compare_mod.subprocess, "Popen", lambda cmd, **kw: started.append(cmd) or real_popen(
        ["echo", "a child's output"], **kw))
    with pytest.raises(UserError, match=r"train.log cannot be opened to append to .*a link, a directory or a FIFO"):
        run_compare("cpu-proxy", tmp_path / "cmp", data=str(write_corpus(tmp_path / "c")), sets=tiny_sets(),
                    only=["standard"], quiet=True, jobs=2, threads=2)
    assert victim.read_text() == "not gbattn's\n" and not started


@pytest.mark.parametrize("planted", ["standard", "standard/seed1", "standard/seed1-start"])
def test_a_run_folder_of_a_comparison_that_is_a_link_is_refused_and_its_target_untouched(tmp_path, planted):
    """A comparison received from elsewhere with LABEL or LABEL/seedN planted as a link: compare trained the whole
    run into wherever it led (as root, /etc), and an upcycled start's folder had its files deleted there. Refused
    before any work, nothing written through it."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "mine.txt").write_text("not gbattn's\n")
    out = tmp_path / "cmp"
    (out / planted).parent.mkdir(parents=True, exist_ok=True)
    (out / planted).symlink_to(victim)
    with pytest.raises(UserError) as caught:
        run_compare("cpu-proxy", out, data=str(write_corpus(tmp_path / "c")), sets=tiny_sets(), only=["standard"],
                    quiet=True, seeds=[1])
    assert str(caught.value) == (f"{out / planted} is a link to {victim}: gbattn writes a comparison's runs only "
                                 f"into a folder of its own there, never through a link (it can lead anywhere); "
                                 f"remove the link")
    assert [p.name for p in victim.iterdir()] == ["mine.txt"] and not (out / "recipe.json").exists()


def test_a_jobs_child_is_given_this_invocations_result_neutral_settings_as_its_cli_reads_them(tmp_path, monkeypatch):
    """--jobs 2: each child's `train --resume` takes the threads divided between the runs at once and the neutral --set
    keys given, written so that --set reads them back as the same values (a bool as true/false: Python's
    'False' would read as the string 'False', which compile refuses)."""
    import subprocess

    from gbattn.config import TrainConfig, parse_sets

    started, real_popen = [], subprocess.Popen
    monkeypatch.setattr(compare_mod.subprocess, "Popen", lambda cmd, **kw: started.append(cmd) or real_popen(
        ["false"], **kw))
    sets = tiny_sets(compile=False, log_every=5)
    with pytest.raises(UserError, match="1 run\\(s\\) failed"):
        run_compare("cpu-proxy", tmp_path / "cmp", data=str(write_corpus(tmp_path / "c")), sets=sets,
                    only=["standard"], quiet=True, jobs=2, threads=4)
    (cmd,) = started
    given = parse_sets([cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--set"])
    assert cmd[cmd.index("--data") + 1] == str(tmp_path / "c"), cmd  # the data as given now (a moved comparison)
    # (one run to train: it takes every thread; divided by --jobs it took 2 of 4, the other 2 idle)
    assert given == {**{k: v for k, v in sets.items() if k in TrainConfig.RESULT_NEUTRAL}, "threads": 4}, cmd
    assert given["compile"] is False and given["log_every"] == 5
    started.clear()
    with pytest.raises(UserError, match="2 run\\(s\\) failed"):  # two runs at once: 2 threads each
        run_compare("cpu-proxy", tmp_path / "cmp", data=str(write_corpus(tmp_path / "c")), sets=sets,
                    only=["standard"], seeds=[1, 2], quiet=True, jobs=4, threads=4)
    assert [parse_sets([cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--set"])["threads"] for cmd in started] == [
        2, 2]


def test_a_run_resumed_from_its_checkpoint_keeps_the_threads_it_trained_with_where_its_share_allows(tmp_path,
                                                                                                      monkeypatch):
    """The same `compare --jobs 2 --threads 2` command run again gave a run stopped while another trained beside it
    (1 thread each) both threads once it trained alone: its last bits, so its numbers, differed from the
    uninterrupted comparison's. It keeps the count it trained with where this invocation's share allows it."""
    import subprocess

    from gbattn.config import parse_sets

    data = str(write_corpus(tmp_path / "c"))
    out = tmp_path / "cmp"
    run_compare("cpu-proxy", out, data=data, sets=tiny_sets(), only=["standard"], quiet=True, threads=1)
    run = out / "standard" / "seed42"
    (run / rundir.RESULT).unlink()  # stopped after its last checkpoint, with 1 thread recorded
    assert rundir.read_config(run / rundir.CONFIG)["train"]["threads"] == 1
    started, real_popen = [], subprocess.Popen
    monkeypatch.setattr(compare_mod.subprocess, "Popen", lambda cmd, **kw: started.append(cmd) or real_popen(
        ["false"], **kw))
    with pytest.raises(UserError, match="1 run\\(s\\) failed"):
        run_compare("cpu-proxy", out, data=data, sets=tiny_sets(), only=["standard"], quiet=True, jobs=2, threads=4)
    (cmd,) = started
    assert parse_sets([cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--set"])["threads"] == 1
    resumed = []

    def resume(*args, **kwargs):  # (--jobs 1: in this process)
        resumed.append(kwargs["overrides"])
        raise UserError("stopped here")

    monkeypatch.setattr(compare_mod, "train", resume)
    with pytest.raises(UserError, match="stopped here"):
        run_compare("cpu-proxy", out, data=data, sets=tiny_sets(), only=["standard"], quiet=True, threads=3)
    assert resumed[0]["threads"] == 1
    # more than this invocation's share: the share (not exact, and said so by the run)
    config = rundir.read_config(run / rundir.CONFIG)
    config["train"]["threads"] = 8
    (run / rundir.CONFIG).write_text(json.dumps(config))
    assert compare_mod.kept_threads(run, 2) == 2 and compare_mod.kept_threads(run, 8) == 8
    assert compare_mod.kept_threads(run, 16) == 8


def test_the_threads_are_divided_between_the_runs_that_can_train_at_once():
    """--jobs N divided the threads by the runs asked for: one waiting for its reference (compute-matched after
    gba-m2) took its share, and those threads sat idle. A run finished earlier counts (it did not, and the same
    command run again after a stop gave a run that had not started all the threads: other last bits than
    uninterrupted, test_a_rerun_trains_the_runs_not_started_with_the_uninterrupted_share)."""
    specs = {spec.label: spec for spec in get_recipe("cpu-proxy").models}
    pick = [specs["standard"], specs["gba-m2"], specs["compute-matched"]]
    assert compare_mod.runs_at_once(pick, [1, 2]) == 4  # standard and gba-m2 of both seeds, then 2
    assert compare_mod.runs_at_once([specs["gba-m2"], specs["compute-matched"]], [1]) == 1
    assert compare_mod.runs_at_once([specs["standard"]], [1, 2]) == 2
    assert compare_mod.runs_at_once([specs["compute-matched"]], [1]) == 1  # its reference not asked: ready
    assert compare_mod.runs_at_once([specs["standard"]], [1]) == 1


def test_a_rerun_trains_the_runs_not_started_with_the_uninterrupted_share(tmp_path, monkeypatch):
    """`--jobs 2 --threads 2` of standard, GBA M=2 and compute-matched: the uninterrupted comparison trains each
    with 1 thread (the first two side by side, then the run matched to GBA). Stopped once the first two had
    finished, the same command run again gave compute-matched, the one run left, both threads: its perplexity
    differed in the last digits."""
    import subprocess

    from gbattn.config import parse_sets

    data = str(write_corpus(tmp_path / "c"))
    out = tmp_path / "cmp"
    run_compare("cpu-proxy", out, data=data, sets=tiny_sets(), only=["standard", "gba-m2"], quiet=True, threads=1)
    started, real_popen = [], subprocess.Popen
    monkeypatch.setattr(compare_mod.subprocess, "Popen", lambda cmd, **kw: started.append(cmd) or real_popen(
        ["false"], **kw))
    with pytest.raises(UserError, match="1 run\\(s\\) failed"):
        run_compare("cpu-proxy", out, data=data, sets=tiny_sets(), only=["standard", "gba-m2", "compute-matched"],
                    quiet=True, jobs=2, threads=2)
    (cmd,) = started
    assert "compute-matched" in " ".join(cmd)
    assert parse_sets([cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--set"])["threads"] == 1


def test_a_jobs_invocation_resumes_an_unfinished_run_without_rewriting_what_its_config_records(tmp_path, monkeypatch):
    """--jobs 2 writes config.json for a planned run only: an unfinished run's config.json stays as its training
    wrote it (its data fingerprint with it) until the child resumes it, so a child that fails before then leaves a
    run that later data checks still refuse on other data, not one that records none."""
    import subprocess

    kwargs = dict(data=str(write_corpus(tmp_path / "c")), sets=tiny_sets(), only=["standard"], quiet=True)
    run_compare("cpu-proxy", tmp_path / "cmp", **kwargs)
    run_dir = tmp_path / "cmp" / "standard" / "seed42"
    (run_dir / rundir.RESULT).unlink()  # stopped before its result was written
    recorded = (run_dir / rundir.CONFIG).read_text()
    real_popen = subprocess.Popen
    monkeypatch.setattr(compare_mod.subprocess, "Popen", lambda cmd, **kw: real_popen(["false"], **kw))
    with pytest.raises(UserError, match=r"1 run\(s\) failed: standard/seed42"):
        run_compare("cpu-proxy", tmp_path / "cmp", jobs=2, threads=2, **kwargs)
    assert (run_dir / rundir.CONFIG).read_text() == recorded


def test_a_jobs_comparison_rewrites_its_report_as_each_childs_run_finishes(tmp_path, monkeypatch):
    """--jobs 2: results.json is rewritten as each child's run finishes, so a comparison that then fails (another
    run's child exits 3) still reports the run that finished, as a one-job comparison does."""
    import subprocess
    import sys

    kwargs = dict(data=str(write_corpus(tmp_path / "c")), sets=tiny_sets(), quiet=True)
    run_compare("cpu-proxy", tmp_path / "cmp", only=["standard"], **kwargs)
    out = tmp_path / "cmp"
    finished = (out / "standard" / "seed42" / rundir.RESULT).read_text()
    for path in (out / "standard" / "seed42" / rundir.RESULT, out / "results.json", out / "results.md"):
        path.unlink()  # standard's run in progress again, and no report yet
    real_popen = subprocess.Popen

    def child(cmd, **kw):  # standard's child writes its result and exits 0; twicing's fails
        run_dir = cmd[cmd.index("--out") + 1]
        script = ("import pathlib, sys\nif 'standard' in sys.argv[1]:\n    (pathlib.Path(sys.argv[1]) / 'result.json')"
                  ".write_text(sys.argv[2])\nelse:\n    sys.exit(3)")
        return real_popen([sys.executable, "-c", script, run_dir, finished], **kw)

    monkeypatch.setattr(compare_mod.subprocess, "Popen", child)
    with pytest.raises(UserError, match=r"^1 run\(s\) failed: twicing/seed42 \(exit 3"):
        run_compare("cpu-proxy", out, only=["standard", "twicing"], jobs=2, threads=2, **kwargs)
    report = json.loads((out / "results.json").read_text())
    assert [(r["label"], r["seeds"]) for r in report["models"] if r["seeds"]] == [("standard", [42])]


def test_a_run_of_jobs_stopped_during_its_last_step_is_finished_whatever_its_exit_status(tmp_path, monkeypatch):
    """A --jobs child sent Ctrl-C or SIGTERM from outside during its last step writes result.json and then
    exits 130 or 143: the comparison counts that run as finished and reports it (it listed it as failed and
    left it out of the report until a rerun); a child that exits 143 without result.json, or with one that does not
    read back, stays failed."""
    import subprocess
    import sys

    data = write_corpus(tmp_path / "c")
    kwargs = dict(data=str(data), sets=tiny_sets(), only=["standard"], quiet=True)
    first = run_compare("cpu-proxy", tmp_path / "cmp", **kwargs)
    result = tmp_path / "cmp" / "standard" / "seed42" / rundir.RESULT
    finished = result.read_text()
    result.unlink()  # the run in progress again: a --jobs invocation resumes it in a child process
    real_popen = subprocess.Popen
    written = [""]  # what the child writes as result.json ("": nothing)

    def child(cmd, **kw):  # the child `gbattn train --resume --out RUN` stopped by a signal during its last step
        script = ("import pathlib, sys\nif sys.argv[2]:\n    (pathlib.Path(sys.argv[1]) / 'result.json')"
                  ".write_text(sys.argv[2])\nprint('terminated during the last step: finished all the same')\n"
                  "sys.exit(143)")
        run_dir = cmd[cmd.index("--out") + 1]
        return real_popen([sys.executable, "-c", script, run_dir, written[0]], **kw)

    monkeypatch.setattr(compare_mod.subprocess, "Popen", child)
    for written[0] in ("", "{}"):
        with pytest.raises(UserError, match=r"1 run\(s\) failed: standard/seed42 \(exit 143: terminated during"):
            run_compare("cpu-proxy", tmp_path / "cmp", jobs=2, threads=2, **kwargs)
        result.unlink(missing_ok=True)
    written[0] = finished
    report = run_compare("cpu-proxy", tmp_path / "cmp", jobs=2, threads=2, **kwargs)
    assert report["complete"] and report["models"][0]["test_ppl"] == first["models"][0]["test_ppl"]
    assert json.loads((tmp_path / "cmp" / "results.json").read_text())["models"][0]["seeds"] == [42]


def test_a_failed_jobs_child_is_named_by_its_logs_last_line_and_a_clean_exit_with_a_damaged_result_is_one_line(
        tmp_path, monkeypatch):
    """--jobs 2: a child that fails is named with the last line of its train.log (where its error is), not
    the first; one that exits 0 with a result.json that does not read back is that file's one line, not a
    failed run to retry. Either way the comparison gives back the SIGTERM handler it found."""
    import signal
    import subprocess
    import sys

    from gbattn.errors import CheckpointError

    real_popen, script = subprocess.Popen, [""]
    monkeypatch.setattr(compare_mod.subprocess, "Popen", lambda cmd, **kw: real_popen(
        [sys.executable, "-c", script[0], cmd[cmd.index("--out") + 1]], **kw))
    kwargs = dict(data=str(write_corpus(tmp_path / "c")), sets=tiny_sets(), only=["standard"], quiet=True, jobs=2,
                  threads=2)
    handler = signal.getsignal(signal.SIGTERM)
    script[0] = "print('loading the data'); print('step 1'); print('boom'); raise SystemExit(3)"
    with pytest.raises(UserError, match=r"^1 run\(s\) failed: standard/seed42 \(exit 3: boom\); rerun"):
        run_compare("cpu-proxy", tmp_path / "cmp", **kwargs)
    assert signal.getsignal(signal.SIGTERM) is handler
    script[0] = "import pathlib, sys; (pathlib.Path(sys.argv[1]) / 'result.json').write_text('{')"
    with pytest.raises(CheckpointError, match=r"result.json"):
        run_compare("cpu-proxy", tmp_path / "cmp", **kwargs)
    assert signal.getsignal(signal.SIGTERM) is handler


def test_a_run_is_refused_when_its_fitted_warmup_is_not_the_one_asked_for(tmp_path):
    """fit_warmup itself is not compared (runs from before it existed record it off), the warmup it gives is:
    a 180-step run that kept a warmup of 200 as given is not the run asked with fit_warmup on (which fits it to
    18), and neither is the other way round; over 1,000 steps both keep the 200, and the run counts."""
    from gbattn.experiments.compare import check_run

    model_cfg, train_cfg = build_configs("cpu-char", "standard", "data", {})
    fitted, kept = train_cfg.replace(warmup_steps=200, fit_warmup=True), train_cfg.replace(warmup_steps=200,
                                                                                           fit_warmup=False)
    for recorded, asked in ((kept, fitted), (fitted, kept)):
        used = 18 if recorded.fit_warmup else 200
        rundir.write_config(tmp_path, "cpu-char", model_cfg, recorded, steps=180, warmup_steps=used)
        with pytest.raises(UserError, match=rf"the warmup over its 180 steps: recorded {used}, asked "
                                            rf"{218 - used} \(fit_warmup={asked.fit_warmup}\)"):
            check_run(tmp_path, model_cfg, asked)
        rundir.write_config(tmp_path, "cpu-char", model_cfg, recorded, steps=1000, warmup_steps=200)
        check_run(tmp_path, model_cfg, asked)
        # config.json from before it recorded the warmup used: nothing to compare it with, the run counts
        rundir.write_config(tmp_path, "cpu-char", model_cfg, recorded, steps=180)
        check_run(tmp_path, model_cfg, asked)
    # fitted by the earlier rule (a default warmup over half the run): the error says so
    for warmup in (100, 180):  # (up to the whole run, which today's rule keeps as given)
        rundir.write_config(tmp_path, "cpu-char", model_cfg, fitted.replace(warmup_steps=warmup), steps=180,
                            warmup_steps=18)
        with pytest.raises(UserError, match=rf"recorded 18, asked {warmup} \(fit_warmup=True; gbattn before "
                                            r"2026-12-04 shortened a default warmup over half the run to a tenth of "
                                            r"it, docs/deviations.md entry 9\)"):
            check_run(tmp_path, model_cfg, fitted.replace(warmup_steps=warmup))
    with pytest.raises(UserError, match=r"recorded 18, asked 200 \(fit_warmup=False\)"):  # not that rule's doing
        rundir.write_config(tmp_path, "cpu-char", model_cfg, fitted, steps=180, warmup_steps=18)
        check_run(tmp_path, model_cfg, kept)
    # a warmup of exactly half the run: the earlier rule kept it (it shortened those over half), so not its doing
    with pytest.raises(UserError, match=r"recorded 18, asked 90 \(fit_warmup=True\)"):
        rundir.write_config(tmp_path, "cpu-char", model_cfg, fitted.replace(warmup_steps=90), steps=180,
                            warmup_steps=18)
        check_run(tmp_path, model_cfg, fitted.replace(warmup_steps=90))


def test_check_run_refuses_a_run_recorded_on_other_data(tmp_path):
    """check_run refuses a run whose config.json records another data fingerprint than the data's now, not only
    run_compare's pre-check over the directory; a run that recorded none, or no fingerprint now, is not refused."""
    from gbattn.experiments.compare import check_run

    model_cfg, train_cfg = build_configs("cpu-char", "standard", "data", {})
    rundir.write_config(tmp_path, "cpu-char", model_cfg, train_cfg, data={"fingerprint": "a" * 64})
    with pytest.raises(UserError, match=rf"was trained on other data than data holds now \(fingerprint {'a' * 16} "
                                        rf"recorded, {'b' * 16} now\)"):
        check_run(tmp_path, model_cfg, train_cfg, "b" * 64)
    check_run(tmp_path, model_cfg, train_cfg, "a" * 64)
    check_run(tmp_path, model_cfg, train_cfg)
    rundir.write_config(tmp_path, "cpu-char", model_cfg, train_cfg)
    check_run(tmp_path, model_cfg, train_cfg, "b" * 64)
    # with no fingerprint on either side (or on the run's side alone), the data paths are compared
    for now in (None, "b" * 64):
        with pytest.raises(UserError, match=r"train\.data: recorded 'data', asked 'elsewhere'"):
            check_run(tmp_path, model_cfg, train_cfg.replace(data="elsewhere"), now)


def test_a_finished_runs_result_that_describes_another_model_is_refused(tmp_path):
    """A finished run is reused when its config.json is the recipe's; its result.json was taken as it was, so a
    hand-edited one (another attention, width or parameter count) was published in the table as that run's.
    Now each of those is checked against the model config.json records, and a mismatch is one line."""
    data = write_corpus(tmp_path / "c")
    kwargs = dict(data=str(data), sets=tiny_sets(), seeds=[1], only=["standard"], quiet=True)
    report = run_compare("cpu-proxy", tmp_path / "cmp", **{**kwargs, "only": ["standard", "gba-m2"]})
    result_path = tmp_path / "cmp" / "standard" / "seed1" / rundir.RESULT
    pristine = json.loads(result_path.read_text())
    assert pristine["parameters"] == report["models"][0]["parameters"]
    for key, value in (("attn", "boosted"), ("parameters", pristine["parameters"] + 1), ("norm", "post"),
                       ("d_model", pristine["d_model"] * 2)):
        result_path.write_text(json.dumps({**pristine, key: value}))
        with pytest.raises(UserError, match=rf"result.json describes another model than its run's config.json "
                                            rf"\({key}: {value!r}, config.json's model "):
            run_compare("cpu-proxy", tmp_path / "cmp", **kwargs)
    # A result written before results recorded residual and norm leaves them out: reused, not refused
    result_path.write_text(json.dumps({k: v for k, v in pristine.items() if k not in ("residual", "norm")}))
    assert run_compare("cpu-proxy", tmp_path / "cmp", **kwargs)["models"][0]["norm"] == "pre"
    result_path.write_text(json.dumps(pristine))
    # A finished run not asked for now (--only standard) is read for the report: checked as well
    other_path = tmp_path / "cmp" / "gba-m2" / "seed1" / rundir.RESULT
    other = json.loads(other_path.read_text())
    other_path.write_text(json.dumps({**other, "attn": "standard"}))
    with pytest.raises(UserError, match=r"gba-m2.seed1.result.json describes another model .*\(attn: 'standard'"):
        run_compare("cpu-proxy", tmp_path / "cmp", **kwargs)
    # ... and its tokens and FLOPs too, against its configs: scaled together they were published as they were
    other_path.write_text(json.dumps({**other, "flops_per_token_train": 10 * other["flops_per_token_train"],
                                      "train_flops": 10 * other["train_flops"]}))
    with pytest.raises(UserError, match=r"gba-m2.seed1.result.json records other training tokens or FLOPs than its "
                                        r"run's config.json gives \(flops_per_token_train: "):
        run_compare("cpu-proxy", tmp_path / "cmp", **kwargs)
    other_path.write_text(json.dumps(other))
    assert run_compare("cpu-proxy", tmp_path / "cmp", **kwargs)["models"] == report["models"]


def test_a_matched_run_waits_for_its_references_run_of_the_same_seed(tmp_path):
    """--jobs: compute-matched seed 2 is not ready while only gba-m2 seed 1 has finished (it would be matched to
    a run that does not exist yet), whether gba-m2 is asked now or left out (--only) with its run on disk."""
    recipe = get_recipe("cpu-proxy")
    specs = {s.label: s for s in recipe.models}
    runner = compare_mod._Runner.__new__(compare_mod._Runner)
    runner.out = tmp_path
    runner.results = {"gba-m2": {1: {"train_flops": 1.0, "steps": 1}}, "compute-matched": {}}
    assert runner._ready(specs["compute-matched"], 1) and not runner._ready(specs["compute-matched"], 2)
    runner.results = {"compute-matched": {}}  # --only compute-matched: gba-m2's finished runs are read from disk
    (tmp_path / "gba-m2" / "seed1").mkdir(parents=True)
    (tmp_path / "gba-m2" / "seed1" / rundir.RESULT).write_text("{}")
    assert runner._ready(specs["compute-matched"], 1) and not runner._ready(specs["compute-matched"], 2)
    assert runner._ready(specs["standard"], 2)  # nothing to wait for


def test_a_run_stuck_behind_a_failed_reference_names_only_what_is_neither_asked_nor_finished(tmp_path):
    """standard-continued-compute-matched starts from base and is matched to gba-upcycled. With --only
    gba-upcycled and it: base, left out but finished in the directory, is not 'neither finished here nor
    asked for' (the run waits for gba-upcycled, which failed); without base's run it is, for that seed alone."""
    specs = {s.label: s for s in get_recipe("upcycle").models}
    runner = compare_mod._Runner.__new__(compare_mod._Runner)
    runner.out, runner.specs = tmp_path, [specs["gba-upcycled"], specs["standard-continued-compute-matched"]]
    (tmp_path / "base" / "seed1").mkdir(parents=True)
    (tmp_path / "base" / "seed1" / rundir.RESULT).write_text("{}")
    assert runner._not_asked_for(specs["standard-continued-compute-matched"], 1) == []
    assert runner._not_asked_for(specs["standard-continued-compute-matched"], 2) == ["base"]


def test_a_comparison_says_which_run_it_trains_and_which_it_resumes(tmp_path, capsys):
    """Without --quiet each run started is announced with its model, steps and directory: 'training' for a new
    run, 'resuming' for one an earlier invocation left unfinished (config.json, no result.json)."""
    kwargs = dict(data=str(write_corpus(tmp_path / "c")), sets=tiny_sets(), seeds=[1], only=["standard"])
    run_dir = tmp_path / "cmp" / "standard" / "seed1"
    run_compare("cpu-proxy", tmp_path / "cmp", **kwargs)
    assert f"training standard seed 1: attn=standard d_model=32 steps=2 -> {run_dir}\n" in capsys.readouterr().err
    (run_dir / rundir.RESULT).unlink()  # stopped before its result was written
    run_compare("cpu-proxy", tmp_path / "cmp", **kwargs)
    assert f"resuming standard seed 1: attn=standard d_model=32 steps=2 -> {run_dir}\n" in capsys.readouterr().err


def test_matched_baselines_that_only_leaves_out_are_named(tmp_path, monkeypatch, capsys):
    """`--only gated --matched gated` trained gated alone: its baselines were skipped, unsaid (recipe.json recorded
    --matched all the same). A note names them, and how to train them."""
    data = write_corpus(tmp_path / "c")
    monkeypatch.setattr(compare_mod, "_Runner", lambda *a: pytest.fail("planned"))
    with pytest.raises(pytest.fail.Exception, match="planned"):
        run_compare("cpu-baselines", tmp_path / "cmp", data=str(data), seeds=[1], sets=tiny_sets(), only=["gated"],
                    quiet=True, matched=["gated"])
    assert ("note: --only leaves out param-fair-gated, compute-matched-gated, the baselines --matched gives: name them "
            "in --only to train them\n") in capsys.readouterr().err
    with pytest.raises(pytest.fail.Exception, match="planned"):
        run_compare("cpu-baselines", tmp_path / "cmp", data=str(data), seeds=[1], sets=tiny_sets(), quiet=True,
                    only=["gated", "param-fair-gated", "compute-matched-gated"], matched=["gated"])
    assert "note:" not in capsys.readouterr().err


def test_a_model_of_your_own_gets_its_matched_baselines_and_stays_in_the_comparison(tmp_path, monkeypatch):
    """`compare --model gba-m3=boosted:rounds=3 --matched gba-m3`: the model trains beside the recipe's, with
    param-fair-gba-m3 (standard, at least its parameters) and compute-matched-gba-m3 (standard, its training
    FLOPs); recipe.json records them, so a later call without --model keeps them, and one that gives the label
    another variant is refused. Model fields in the spec set that model and its baselines."""
    data = write_corpus(tmp_path / "c")
    out = tmp_path / "cmp"
    report = run_compare("cpu-char", out, data=str(data), seeds=[1], sets=tiny_sets(), only=["standard"],
                         quiet=True, models={"gba-m3": "boosted:rounds=3,norm_type=rmsnorm"}, matched=["gba-m3"])
    rows = {r["label"]: r for r in report["models"]}
    assert list(rows) == ["standard"]  # --only: the added models are not trained yet
    assert json.loads((out / "recipe.json").read_text())["models"] == {"gba-m3": "boosted:rounds=3,norm_type=rmsnorm"}
    report = run_compare("cpu-char", out, data=str(data), quiet=True, sets=tiny_sets(),
                         only=["gba-m3", "param-fair-gba-m3", "compute-matched-gba-m3"])
    rows = {r["label"]: r for r in report["models"]}
    assert list(rows) == ["standard", "gba-m3", "param-fair-gba-m3", "compute-matched-gba-m3"]  # the recipe's, then
    # the added ones in the order given, each model's baselines after it
    mine, fair, matched = rows["gba-m3"], rows["param-fair-gba-m3"], rows["compute-matched-gba-m3"]
    assert (mine["attn"], mine["attn_options"]) == ("boosted", {"rounds": 3})
    assert fair["attn"] == matched["attn"] == "standard" and fair["param_matched_to"] == "gba-m3"
    assert fair["parameters"] >= mine["parameters"] > rows["standard"]["parameters"]
    assert matched["steps"] > mine["steps"] and matched["compute_matched_to"] == "gba-m3"
    assert matched["train_flops"] == pytest.approx(mine["train_flops"], rel=1 / mine["steps"])
    for label in ("gba-m3", "param-fair-gba-m3", "compute-matched-gba-m3"):  # the spec's model field, baselines too
        assert rundir.read_config(out / label / "seed1" / rundir.CONFIG)["model"]["norm_type"] == "rmsnorm"
    with pytest.raises(UserError, match=r"holds model gba-m3 as --model gba-m3=boosted:rounds=3,norm_type=rmsnorm, "
                                        r"not boosted:rounds=4; use another label or --out$"):
        run_compare("cpu-char", out, data=str(data), quiet=True, sets=tiny_sets(),
                    models={"gba-m3": "boosted:rounds=4"})
    for models, matched, message in (
            ({"standard": "boosted"}, [], r"--model standard=boosted: recipe 'cpu-char' has a model 'standard' "
                                          r"already"),
            ({"../x": "boosted"}, [], r"--model ../x=boosted: a label is a folder name"),
            ({"m": ":rounds=3"}, [], r"--model m=':rounds=3': name the attention variant first"),
            ({"m": "boosted:rounds"}, [], r"--model m='boosted:rounds': options are key=value"),
            ({}, ["gba-m9"], r"--matched gba-m9: no such model in recipe 'cpu-char' or --model"),
            ({"x": "boosted", "param-fair-x": "standard"}, ["x"], r"--matched x: its baseline's label 'param-fair-x' "
                                                                   r"is taken"),
            # a label that is one of the comparison's own files: results.json trained into a folder that every later
            # call needed as a file ("Not a directory"), recorded in recipe.json for good
            ({"results.json": "boosted"}, [], r"--model results.json=boosted: results.json is a file or folder of "
                                              r"the comparison itself \(results.json, results.md, recipe.json, "
                                              r"figures\); choose another label"),
            ({"figures": "boosted"}, [], r"--model figures=boosted: figures is a file or folder of the comparison")):
        with pytest.raises(UserError, match=f"^{message}"):
            run_compare("cpu-char", tmp_path / "other", data=str(data), quiet=True, sets=tiny_sets(), models=models,
                        matched=matched)
    # --matched of a model that continues another's weights: its "param-fair" baseline was narrower than it (its
    # parameters counted before the upcycle) and stated as matched
    with pytest.raises(UserError, match=r"^--matched gba-upcycled: it continues base's trained weights; baselines "
                                        r"are matched to a model trained from scratch"):
        run_compare("upcycle", tmp_path / "up", data=str(data), quiet=True, sets=tiny_sets(), matched=["gba-upcycled"])
    # ... and a model trained for a share of the budget (upcycle's base: half) gives its param-fair baseline that share
    # (it trained the whole budget, twice its model's steps, stated as matched); compute-matched's come from FLOPs
    from gbattn.experiments.recipes import with_models

    specs = {spec.label: spec for spec in with_models(get_recipe("upcycle"), {}, ["base"]).models}
    assert specs["param-fair-base"].steps_share == specs["base"].steps_share == 0.5
    assert specs["compute-matched-base"].steps_share is None
    # --set epochs with the recipe's max_steps: named as the recipe's (it said "max_steps=1200 (given too)")
    no_steps = {k: v for k, v in tiny_sets().items() if k != "max_steps"}
    with pytest.raises(UserError, match=r"^epochs=1 is not used: max_steps=1200 \(recipe cpu-proxy's\) sets the run's "
                                        r"length; give max_steps=null"):
        run_compare("cpu-proxy", tmp_path / "epochs", data=str(data), quiet=True, sets={**no_steps, "epochs": 1})
    # ... and a value no run takes named as such first, as train names it ("not used" sent the user to a second error)
    with pytest.raises(UserError, match=r"^epochs=-1.0 must be > 0$"):
        run_compare("cpu-proxy", tmp_path / "epochs", data=str(data), quiet=True, sets={**no_steps, "epochs": -1})
    # --matched of a baseline: a param-fair row's "param-fair" was sized from the model it matches (narrower than it,
    # -32% stated as matched), a compute-matched row's trained the recipe's steps and another warmup
    for target, reference in (("param-fair", "gba-m2"), ("compute-matched", "gba-m2")):
        with pytest.raises(UserError, match=rf"^--matched {target}: it is itself a baseline matched to {reference}; "
                                            rf"a baseline of a baseline is standard attention"):
            run_compare("cpu-char", tmp_path / "baseline", data=str(data), quiet=True, sets=tiny_sets(),
                        matched=[target])
    # a --set the recipe sets per model for a model --only leaves out: recorded for the comparison, it left that
    # model refused for good
    with pytest.raises(UserError, match=r"^--residual \(--set residual\): the recipe sets it per model"):
        run_compare("depth", tmp_path / "depth", data=str(data), quiet=True, sets=tiny_sets(residual="attnres-block"),
                    only=["standard", "gba-m2"])
    assert not (tmp_path / "up" / "recipe.json").exists() and not (tmp_path / "depth" / "recipe.json").exists()


def test_a_model_with_its_own_compute_matched_row_is_paired_with_that_row(tmp_path):
    """With `compare --matched`, a comparison holds more than one compute-matched row: the paired table sets each
    model (and its param-fair row) against its own, every other model against the recipe's, and says so."""
    from gbattn.experiments.recipes import ModelSpec, Recipe
    from gbattn.experiments.report import write_results

    specs = [ModelSpec("standard"), ModelSpec("gba-m2", "boosted"),
             ModelSpec("compute-matched", compute_matched_to="gba-m2"), ModelSpec("mine", "twicing"),
             ModelSpec("param-fair-mine", param_matched_to="mine"),
             ModelSpec("compute-matched-mine", compute_matched_to="mine")]
    losses = {"standard": 2.0, "gba-m2": 1.9, "compute-matched": 1.8, "mine": 1.5, "param-fair-mine": 1.45,
              "compute-matched-mine": 1.25}
    results = {s.label: {seed: {**_run_result(10.0, 60.0), "attn": s.attn, "valid_loss": losses[s.label] + seed / 100}
                         for seed in (1, 2)} for s in specs}
    write_results(tmp_path, Recipe("r", "a test (10 steps)", "cpu-char", specs),
                  {"data": "x", "seeds": [1, 2], "sets": {}}, specs, results)
    md = (tmp_path / "results.md").read_text()
    cells = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[5].rstrip(" |")  # Δ vs compute-matched
             for line in md.split("## Paired per-seed")[1].splitlines() if line.startswith("| ") and "nats" not in line}
    assert md.split("## Paired per-seed")[1].count("| Δ vs compute-matched | Δ vs param-fair |") == 1
    assert cells["mine"].startswith("+0.250 (+0.250 / +0.250)")  # against compute-matched-mine, not compute-matched
    assert cells["param-fair-mine"].startswith("+0.200 (+0.200 / +0.200)")
    assert cells["gba-m2"].startswith("+0.100 (+0.100 / +0.100)") and cells["compute-matched-mine"].startswith("-0.550")
    assert ("a model with a compute-matched row of its own, and its param-fair row, against that row; every other "
            "model against compute-matched.") in md
    # and the model against its param-fair row, on its own row (it had no cell: only the rows' mean perplexities)
    mine = next(line for line in md.split("## Paired per-seed")[1].splitlines() if line.startswith("| mine |"))
    assert mine.rstrip(" |").split(" | ")[-1].startswith("+0.050 (+0.050 / +0.050) **same sign**")


def test_a_recipe_json_whose_added_models_are_damaged_is_one_line(tmp_path):
    """recipe.json's models (label -> variant) and matched (labels), edited into other types: a CheckpointError
    naming the file, not a traceback."""
    from gbattn.errors import CheckpointError

    path = tmp_path / "recipe.json"
    base = {"recipe": "cpu-char", "data": "x", "seeds": [1], "sets": {}, "command": "c"}
    for damaged, message in (({"models": ["gba-m3"]}, r"models=\['gba-m3'\] must map labels to variants"),
                             ({"models": {"m": 3}}, r"models=\{'m': 3\} must map labels to variants"),
                             ({"matched": "gba-m3"}, r"matched='gba-m3' must be a list of labels")):
        path.write_text(json.dumps({**base, **damaged}))
        with pytest.raises(CheckpointError, match=message):
            compare_mod._check_request(path, {**base, "models": {}, "matched": []}, data_as_given="x")


def test_results_json_records_the_added_models_and_refuses_them_damaged(tmp_path):
    """results.json carries compare --model and --matched (what joined the recipe's models), so the rows can be
    traced to their variants; read_report refuses them edited into other types with one line."""
    from gbattn.errors import CheckpointError
    from gbattn.experiments.recipes import ModelSpec, Recipe
    from gbattn.experiments.report import read_report, write_results

    specs = [ModelSpec("standard"), ModelSpec("mine", "twicing")]
    request = {"data": "x", "seeds": [1], "sets": {}, "models": {"mine": "twicing"}, "matched": ["mine"]}
    write_results(tmp_path, Recipe("r", "a test (10 steps)", "cpu-char", specs), request, specs,
                  {s.label: {1: {**_run_result(10.0, 60.0), "attn": s.attn}} for s in specs})
    path = tmp_path / "results.json"
    report = read_report(path)
    assert (report["added"], report["matched"]) == ({"mine": "twicing"}, ["mine"])
    for key, value, message in (("added", ["mine"], r"added=\['mine'\] must map labels to variants"),
                                ("matched", "mine", r"matched='mine' must be a list of labels")):
        path.write_text(json.dumps({**report, key: value}))
        with pytest.raises(CheckpointError, match=message):
            read_report(path)


def test_compare_jobs_divide_the_threads_rounded_down_and_count_every_seeds_run(tmp_path, monkeypatch):
    """--threads is every run's threads in all: --jobs 2 --threads 3 gives each run 1 (2 in all; rounded up, 4 in
    all), and the progress bar counts the runs of every seed (3 seeds of one model: 3 runs, not "2/1 runs")."""
    class Stop(Exception):
        pass

    data = str(write_corpus(tmp_path / "c"))
    shares = []

    def first_configs(recipe, spec, data, seed, sets, vocab):
        shares.append(sets.get("threads"))
        raise Stop

    with monkeypatch.context() as patched:
        patched.setattr(compare_mod, "spec_configs", first_configs)
        for jobs, threads in ((2, 3), (4, 6), (2, 5), (3, 7)):
            with pytest.raises(Stop):
                run_compare("cpu-char", tmp_path / f"cmp-{jobs}-{threads}", data=data, sets=tiny_sets(), quiet=True,
                            jobs=jobs, threads=threads)
    assert shares == [1, 1, 2, 2]
    totals = []

    def bar(total, **kwargs):
        totals.append(total)
        raise Stop

    monkeypatch.setattr(compare_mod, "Progress", bar)
    with pytest.raises(Stop):
        run_compare("cpu-char", tmp_path / "cmp", data=data, sets=tiny_sets(), only=["standard", "gba-m2"],
                    seeds=[1, 2, 3], quiet=True, threads=1)
    assert totals == [6]


def test_a_model_label_is_at_most_64_characters(tmp_path):
    """A label names the model's folder: 64 characters are taken, 65 refused, as the message says."""
    from gbattn.experiments.recipes import get_recipe, with_models

    recipe = get_recipe("cpu-char")
    assert "m" * 64 in [spec.label for spec in with_models(recipe, {"m" * 64: "boosted:rounds=3"}, []).models]
    with pytest.raises(UserError, match="at most 64 characters"):
        with_models(recipe, {"m" * 65: "boosted:rounds=3"}, [])


def test_a_from_zero_warmup_kept_as_long_as_the_run_is_refused_naming_that_rule(tmp_path):
    """gbattn before 2026-12-07 kept a default warmup from zero exactly as long as the run (its peak after the last
    step); today's fits it to a tenth. compare refuses such a run, naming that rule, not the half-run one."""
    from gbattn.experiments.compare import check_run

    model_cfg, train_cfg = build_configs("paper-small", "standard", "data", {})
    assert train_cfg.warmup_from_zero and train_cfg.fit_warmup
    asked = train_cfg.replace(warmup_steps=180)
    rundir.write_config(tmp_path, "paper-small", model_cfg, asked, steps=180, warmup_steps=180)
    with pytest.raises(UserError, match=r"recorded 180, asked 18 \(fit_warmup=True; gbattn before 2026-12-07 kept a "
                                        r"default warmup from zero exactly as long as the run, docs/deviations.md "
                                        r"entry 9\)"):
        check_run(tmp_path, model_cfg, asked)
