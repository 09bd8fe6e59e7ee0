"""``gbattn compare``: train every model of a recipe for every seed, skip finished runs, resume
killed ones, and write ``results.json`` and ``results.md`` (experiments/report.py).

Layout: ``OUT/recipe.json`` (what was asked), ``OUT/<label>/seed<S>/`` (one run directory each),
``OUT/results.json`` and ``OUT/results.md`` (rewritten after every finished run). A run directory is
reused or resumed only when its recorded model and training configs are the ones the recipe asks
for. ``jobs > 1`` trains that many runs at once as separate processes, CPU threads divided between
them; each run is the same computation as when trained alone with the same threads.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from gbattn import errors, rundir
from gbattn.checks import MAX_INT, did_you_mean, is_count
from gbattn.config import TrainConfig, build_configs, field_path, refuse_unused_epochs, training_input_length
from gbattn.data.corpus import check_split_setting, refuse_record_file
from gbattn.data.prepare import prepare_data
from gbattn.data.tokenizer import FILE_KINDS, Tokenizer, _gpt2_payload
from gbattn.errors import CheckpointError, DataError, Interrupted, Terminated, UserError
from gbattn.experiments.recipes import (
    ModelSpec,
    Recipe,
    added_models_problem,
    depends_on,
    get_recipe,
    training_order,
    with_models,
)
from gbattn.experiments.report import write_results
from gbattn.files import open_to_append, option_path, portable_path, refuse_linked_folder, write_json
from gbattn.model.params import count_params, flops_per_token, param_matched_width
from gbattn.parent_death import stop_with_parent
from gbattn.progress import Progress
from gbattn.runtime import (
    command_line,
    default_threads,
    launched_processes,
    omp_threads,
    portable_argument,
    resolve_device,
)
from gbattn.terminal import note
from gbattn.train.trainer import STOPPING_SIGNALS, earlier_warmup_rule, fitted_warmup, stop_words, train
from gbattn.upcycle import upcycle, write_run


def spec_configs(recipe: Recipe, spec: ModelSpec, data: str, seed: int, sets: dict, vocab_size: int | None):
    """Model and training configs of one model of a recipe (before width/step matching)."""
    if sets.get("epochs") is not None and "max_steps" not in sets and recipe.train.get("max_steps") is not None:
        # (build_configs takes the recipe's max_steps for one given with the --set: "max_steps=1200 (given too)")
        refuse_unused_epochs(sets["epochs"], recipe.train["max_steps"], f"recipe {recipe.name}'s",
                             sets.get("sampling", recipe.train.get("sampling", TrainConfig.sampling)))
    merged = dict(recipe.train)
    merged.update(sets)
    merged.update(spec.model)
    for key, value in spec.attn_options.items():
        merged[f"attn.{key}"] = value
    if vocab_size is not None:
        merged["vocab_size"] = vocab_size
    if spec.steps_share is not None:
        steps = merged.get("max_steps")
        if steps is None:
            raise UserError(f"recipe {recipe.name}: {spec.label} trains a share of max_steps, which is not set")
        # A start rounds down and its continuation up, so that the two add up to the whole (an odd budget too;
        # round() made 41 steps 20 + 20).
        share = round(steps * spec.steps_share, 9)  # 100 x 0.55 is 55.00000000000001 in floats: 55, not 56
        merged["max_steps"] = max(1, math.ceil(share) if spec.init_from else math.floor(share))
    return build_configs(recipe.preset, spec.attn, data, merged, seed=seed)


def comparable(model_cfg, train_cfg) -> dict:
    """What must match for a run to count as the recipe's: every field that changes the result. A
    continuation's start is named within the comparison (``<label>/seed<N>``), so a comparison
    directory reached by another path, or moved, keeps its finished runs."""
    train_d = {k: v for k, v in train_cfg.to_dict().items() if k not in (*TrainConfig.RESULT_NEUTRAL, "fit_warmup")}
    if train_d.get("init_from"):
        train_d["init_from"] = "/".join(Path(train_d["init_from"]).parts[-2:])
    model_d = model_cfg.to_dict()
    if model_cfg.dropout == 0:
        model_d.pop("dropout_sites")  # no dropout anywhere: the sites change nothing
    return {"model": model_d, "train": train_d}


def config_differences(recorded: dict, other: dict, other_word: str) -> list[str]:
    """Each field where two :func:`comparable` records differ, as ``part.key: recorded R, <other_word> O``."""
    return [f"{part}.{k}: recorded {recorded[part].get(k)!r}, {other_word} {other[part].get(k)!r}"
            for part in ("model", "train") for k in sorted(set(other[part]) | set(recorded[part]))
            if other[part].get(k) != recorded[part].get(k)]


def check_run_data(run_dir: Path, config: dict, data: str, fingerprint: str | None) -> None:
    """Refuse a run (its ``config``) that trained on other data than ``data`` holds now (``fingerprint``)."""
    recorded = rundir.recorded_fingerprint(config)
    if fingerprint and recorded and recorded != fingerprint:
        raise UserError(f"{run_dir} was trained on other data than {data} holds now (fingerprint "
                        f"{recorded[:16]} recorded, {fingerprint[:16]} now); move it away or use another --out")


def read_run_result(run_dir: Path, model_cfg, train_cfg) -> dict:
    """A finished run's result.json (:func:`rundir.read_result`) whose model, as it describes it for the table, is
    ``model_cfg`` (the one its config.json records, :func:`check_run`), and whose training tokens and FLOPs are the
    ones its configs give (``train_cfg``; docs/baselines.md: a compute-matched baseline's steps come from them): a
    hand-edited one, or one from a gbattn that counted FLOPs otherwise, is refused, not published or matched."""
    path = run_dir / rundir.RESULT
    result = rundir.read_result(path)
    model = {"attn": model_cfg.attn, "residual": model_cfg.residual, "norm": model_cfg.norm,
             "d_model": model_cfg.d_model, "parameters": count_params(model_cfg)}
    differ = [f"{key}: {result[key]!r}, config.json's model {value!r}" for key, value in model.items()
              if key in result and result[key] != value]  # (residual and norm: not in results before they existed)
    if differ:
        raise UserError(f"{path} describes another model than its run's config.json ({'; '.join(differ)}): move the "
                        f"run away or use another --out")
    # Its tokens and FLOPs as the trainer counts them (every step reads batch_size x seq_len tokens). Scaled
    # together, train_flops = flops_per_token_train x train_tokens_seen still held: a compute-matched baseline
    # trained 10x its steps and the table printed the scaled FLOPs.
    seq_len = model_cfg.input_length(train_cfg.seq_len)
    per_token = flops_per_token(model_cfg, seq_len=seq_len, backward=True)
    recorded_steps = rundir.read_config(run_dir / rundir.CONFIG).get("steps", result["steps"])
    tokens = recorded_steps * train_cfg.batch_size * seq_len
    expected = {"steps": recorded_steps, "train_tokens_seen": tokens, "flops_per_token_train": per_token,
                "train_flops": per_token * tokens, "tokens_per_parameter": tokens / model["parameters"]}
    differ = [f"{key}: {result[key]!r}, its configs give {value!r}" for key, value in expected.items()
              if key in result and not math.isclose(result[key], value, rel_tol=1e-9)]
    if differ:
        raise UserError(f"{path} records other training tokens or FLOPs than its run's config.json gives "
                        f"({'; '.join(differ)}): a hand-edited result, or one from a gbattn that counted them "
                        f"otherwise; move the run away (or delete its result.json and resume it) or use another --out")
    return result


def check_run(run_dir: Path, model_cfg, train_cfg, fingerprint: str | None = None) -> None:
    """Refuse a run directory whose recorded configs are not the ones asked for, or that trained on
    other data (its recorded fingerprint differs from ``fingerprint``, the data's now). Data with the run's
    fingerprint is its data whatever path reaches it (another working directory, a link, a copy), as for
    ``train --resume`` and ``eval``; without both fingerprints the paths must be equal."""
    config_path = run_dir / rundir.CONFIG
    config = rundir.read_config(config_path)
    check_run_data(run_dir, config, train_cfg.data, fingerprint)
    recorded_model, recorded_train = rundir.read_configs(config, config_path)
    want, have = comparable(model_cfg, train_cfg), comparable(recorded_model, recorded_train)
    if fingerprint and rundir.recorded_fingerprint(config) == fingerprint:
        want["train"].pop("data", None), have["train"].pop("data", None)
    if same_tokenizer_file(config, recorded_train.tokenizer, train_cfg.tokenizer):
        want["train"].pop("tokenizer"), have["train"].pop("tokenizer")
    differ = config_differences(have, want, "asked")
    # fit_warmup is not compared as a field (runs from before it existed record it off): the warmup it gives
    # over the run's steps is. With every other field equal, the asked run would have as many steps.
    steps, used = config.get("steps"), config.get("warmup_steps")
    asked = fitted_warmup(train_cfg, steps)[0] if steps is not None and used is not None else used
    if not differ and asked != used:
        earlier_rule = earlier_warmup_rule(train_cfg, steps, used)
        differ.append(f"the warmup over its {steps:,} steps: recorded {used:,}, asked {asked:,} "
                      f"(fit_warmup={train_cfg.fit_warmup}"
                      + (f"; {earlier_rule}" if earlier_rule else "") + ")")
    if differ:
        raise UserError(f"{run_dir} holds another run than this recipe asks for ({'; '.join(differ[:4])}"
                        f"{'; ...' if len(differ) > 4 else ''}); move it away or use another --out")
    if train_cfg.init_from:
        check_started_from(run_dir, config, train_cfg.init_from)


def same_tokenizer_file(config: dict, recorded: str, asked: str) -> bool:
    """Whether a run (its ``config``) recorded ``--tokenizer hf=PATH`` (or ``gpt2=PATH``) of a file with the tokenizer
    that ``asked`` names now by another path: a run records the path it was given (absolute, or relative to where it
    started), and a comparison continued with the relative one its results.md shows, or from another folder, was
    refused as another run. The recorded tokenizer fingerprint is compared, as the data's is."""
    kind, given = recorded.partition("=")[0], asked.partition("=")[0]
    if recorded == asked or "=" not in recorded or "=" not in asked or kind != given or kind not in FILE_KINDS:
        return False
    try:
        return Tokenizer(kind, _gpt2_payload(asked)).fingerprint == rundir.recorded_fingerprint(config, of="tokenizer")
    except DataError:  # (the file asked for is not there: the paths differ, as before)
        return False


def check_started_from(run_dir: Path, config: dict, start: str) -> None:
    """Refuse a continuation (its ``config``) that started from other weights than ``start`` holds: its
    config.json records their digest once it has started. Its configs alone are the same in a copy of
    another comparison's continuation (another base, or the same trained again: other weights)."""
    recorded = (config.get("extra") or {}).get("init_from_weights")
    if recorded is not None and recorded != rundir.weights_digest(rundir.load_run(start).model.state_dict()):
        raise UserError(f"{run_dir} started from other weights than {start} holds (its config.json's "
                        f"init_from_weights): move it away or use another --out")


def run_compare(recipe_name: str, out_dir: str | Path, data: str | None = None, seeds: list[int] | None = None,
                sets: dict | None = None, only: list[str] | None = None, quiet: bool = False,
                threads: int | None = None, jobs: int = 1, models: dict[str, str] | None = None,
                matched: list[str] | None = None) -> dict:
    """Train (or reuse) every run of a recipe; returns the report. ``threads``: CPU threads in all
    (divided between ``jobs``); it changes speed, not the comparison's identity. ``models`` (label -> variant
    spec) and ``matched`` (labels given their parameter- and compute-matched baselines) add models of the
    user's own (:func:`~gbattn.experiments.recipes.with_models`); the comparison records them, and a later call
    continues with them whether or not it names them again."""
    if launched_processes() > 1:  # each process would run the whole comparison, and its runs would wait for the others
        raise UserError(f"compare runs in one process, not under torchrun ({launched_processes()} processes here): "
                        f"--jobs N trains N of its runs at once; torchrun --nproc_per_node N -m gbattn.cli train "
                        f"trains one run on N processes")
    recipe = get_recipe(recipe_name)
    data = recipe.default_data if data is None else data  # an empty one is refused where the data is read
    if data is None:
        raise UserError(f'recipe {recipe.name!r} needs --data (README, section "Reproducing the paper\'s tables")')
    seeds_given = bool(seeds)
    seeds = list(dict.fromkeys(seeds or recipe.seeds))  # each seed once, in the order given
    sets = dict(sets or {})
    if "seed" in sets:
        raise UserError("--set seed=... would give every run of the comparison that one seed: use --seeds")
    if "init_from" in sets:  # (accepted, it started every model from one run's weights, reported as from scratch)
        raise UserError("--set init_from=... would start every run of the comparison from that one run's weights: a "
                        "recipe's continuations name their own start (train one continuation with `gbattn train "
                        "--init-from RUN`)")
    check_split_setting(data, sets)  # train refuses it too
    if "attn" in sets:
        raise UserError("--set attn=... would give every model of the recipe that one attention variant: the recipe "
                        "chooses each model's (train another variant with `gbattn train --attn`)")
    out = Path(out_dir)
    rundir.check_out(out, (rundir.COMPARISON,), "a comparison")  # a run, denoise's results, ...: refused
    lock = rundir.RunLock(out, what="comparison")
    try:
        request = {"recipe": recipe.name, "data": portable_path(data), "seeds": seeds, "sets": portable_sets(sets),
                   "command": command_line(portable=True), "models": dict(models or {}),
                   "matched": list(dict.fromkeys(matched or []))}
        _check_request(out / "recipe.json", request, seeds_given, data_as_given=data)
        for key in ("models", "matched"):  # recorded only when there are some: a recipe.json as before otherwise
            if not request[key]:
                del request[key]
        recipe = with_models(recipe, request.get("models", {}), request.get("matched", []))
        specs = [s for s in recipe.models if not only or s.label in only]
        labels = [s.label for s in recipe.models]
        unknown = sorted(set(only or []) - set(labels))
        if unknown:  # (named as typed, not as a Python list: "--only ['bar', 'foo']")
            commas = "; labels are given apart, --only a b" if any("," in label for label in unknown) else ""
            raise UserError(f"--only {' '.join(unknown)}: not in recipe {recipe.name!r}"
                            f"{did_you_mean(unknown, labels)} ({', '.join(labels)}){commas}")
        # --matched's baselines that --only leaves out (they were skipped, unsaid, --matched recorded all the same)
        skipped = [f"{kind}-{label}" for label in (matched or []) for kind in ("param-fair", "compute-matched")
                   if only and label in only and f"{kind}-{label}" in labels and f"{kind}-{label}" not in only]
        if skipped:
            note(f"note: --only leaves out {', '.join(skipped)}, the baselines --matched gives: name them in --only "
                 f"to train them")
        # Model keys a recipe sets per model are applied after --set (spec_configs): refuse them, for every model of
        # the comparison (--set is recorded for all: one given with --only for other models left those refused)
        # (a key as typed: attn.x and attn_options.x name one field, and attn_options={...} sets every option)
        fixed = {path for spec in recipe.models
                 for path in (*spec.model, *(f"attn_options.{k}" for k in spec.attn_options))}
        per_model = sorted(key for key in sets for path in [field_path(key)]
                           if any(path == f or f.startswith(path + ".") or path.startswith(f + ".") for f in fixed))
        if per_model:  # (--residual is given as that option, or as --set residual: named both ways)
            shown = ", ".join("--residual (--set residual)" if key == "residual" else f"--set {key}"
                              for key in per_model)
            raise UserError(f"{shown}: the recipe sets {'it' if len(per_model) == 1 else 'them'} per model, so the "
                            f"value would be overridden; train such a model with `gbattn train`")
        # A model's layer selection numbers the recipe's layers: another depth would keep the numbers and the label
        # ("gba-upper-half" was two middle layers of six, or an error about a model the user never named)
        numbered = [spec for spec in recipe.models if "layers" in spec.attn_options]
        if numbered and "n_layers" in map(field_path, sets):
            spec = numbered[0]
            raise UserError(f"--set n_layers: {spec.label} gives attn.layers={spec.attn_options['layers']}, layers "
                            f"numbered for the recipe's depth, which its label describes; keep the depth, or train "
                            f"such a model with `gbattn train`")
        if not seeds_given:  # no --seeds: the seeds the comparison holds (the recipe's for a new one)
            seeds = request["seeds"]
        # the folders its runs train in, by names of its own: a link planted there (a comparison received from
        # elsewhere) trained a run into, or deleted an upcycled start's files from, wherever it led
        for spec in specs:
            for folder in (out / spec.label, *(out / spec.label / f"seed{seed}{end}" for seed in seeds
                                                for end in ("", "-start"))):
                refuse_linked_folder(folder, "a comparison's runs")
        in_all = (threads or default_threads()) if jobs > 1 else threads  # measured once: it can change between reads
        # Divided between the runs that can train at once: --jobs 4 of one run gave it a quarter of the threads, the
        # other three quarters idle
        at_once = max(1, min(jobs, runs_at_once(specs, seeds)))
        per_run_threads = max(1, in_all // at_once) if jobs > 1 else threads
        untrained = any(not (out / spec.label / f"seed{seed}" / rundir.RESULT).exists() for spec in specs
                        for seed in seeds)  # (all finished before: nothing to divide the threads between)
        if jobs > 1 and in_all < at_once and untrained:  # a warning: stderr, apart from the output, under --quiet too
            # (it blamed the cores where OMP_NUM_THREADS=1 on a 2-core machine set the one thread)
            source = ("--threads" if threads else "OMP_NUM_THREADS" if omp_threads() is not None
                      else "the cores free to this process")
            note(f"note: --jobs {jobs} with {in_all} CPU thread{'s' if in_all != 1 else ''} in all ({source}): each "
                 f"run takes 1 thread, {at_once} in all, more than given (on a CPU, more threads than cores only "
                 f"slows each run down)")
        run_sets = {**sets, "threads": per_run_threads} if per_run_threads else sets
        # The tokenizer fixes the vocabulary for every model (and warms the token cache once).
        first_configs = [spec_configs(recipe, spec, data, seeds[0], run_sets, None) for spec in specs]
        probe_model, probe_train = first_configs[0]
        # Mistakes every run would stop at, found before recipe.json records the settings (a device that is not here,
        # --set device=cuda on a CPU machine, was "5 run(s) failed", one after another)
        resolve_device(probe_train.device)
        for configs in first_configs:
            training_input_length(*configs)
        if not (out / "recipe.json").exists():  # a new comparison's choice (one begun on such a file goes on)
            refuse_record_file(probe_train.data)
        prepared = prepare_data(probe_train, probe_model.vocab_size, progress=not quiet)
        # Every run already here trained on this data, before anything trains or is recorded: a corpus changed since
        # refused only when its run was reached, after the new seeds' runs had trained and recipe.json taken them.
        for seed in request["seeds"]:
            for spec in recipe.models:
                run_dir = out / spec.label / f"seed{seed}"
                if (run_dir / rundir.CONFIG).is_file():
                    check_run_data(run_dir, rundir.read_config(run_dir / rundir.CONFIG), data,
                                   prepared.corpus_fingerprint)
        # Recorded once the data is read: a --data that cannot be (a typo, a folder without splits) leaves no
        # recipe.json behind to refuse the corrected command as "another comparison".
        write_json(request, out / "recipe.json")
        vocab = prepared.tokenizer.vocab_size
        runner = _Runner(recipe, specs, seeds, data, run_sets, vocab, out, request, quiet, jobs,
                         prepared.corpus_fingerprint)
        return runner.run()
    finally:
        lock.release()


class _Runner:
    """Schedules the runs of a comparison: in this process (one job) or as child processes."""

    def __init__(self, recipe, specs, seeds, data, sets, vocab, out, request, quiet, jobs, fingerprint=None) -> None:
        self.recipe, self.specs, self.seeds, self.data, self.sets = recipe, specs, seeds, data, sets
        self.fingerprint = fingerprint
        self.vocab, self.out, self.request, self.quiet, self.jobs = vocab, out, request, quiet, jobs
        self.results: dict[str, dict[int, dict]] = {s.label: {} for s in specs}
        self.training_here: tuple[str, int] | None = None  # the run this process is training (one job)
        self.bar = Progress(
            len(specs) * len(seeds), desc=f"compare {recipe.name}", unit="run", disable=quiet, interval=0
        )

    def run(self) -> dict:
        todo = [(spec, seed) for seed in self.seeds for spec in training_order(self.specs)]
        running: dict[tuple[str, int], subprocess.Popen] = {}
        failed: list[str] = []
        unasked = 0  # of the failed: runs that wait for a model this invocation leaves out
        # SIGTERM (and SIGHUP, SIGUSR1, SIGUSR2 where their handler is the default, which ended this process
        # silently) to this process: stop the children (they checkpoint), then say so
        stopped: list[int] = []
        previous = {}
        if self.jobs > 1 and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, *STOPPING_SIGNALS):
                if sig == signal.SIGTERM or signal.getsignal(sig) is signal.SIG_DFL:
                    previous[sig] = signal.signal(sig, lambda signum, frame: stopped.append(signum))
        try:
            while (todo or running) and not stopped:
                for key, proc in list(running.items()):
                    if proc.poll() is not None:
                        del running[key]
                        self._collect(*key, proc, failed)
                started = False
                for spec, seed in list(todo):  # in training order; a compute-matched run waits for its reference
                    if len(running) >= self.jobs:
                        break
                    if self._ready(spec, seed):
                        todo.remove((spec, seed))
                        started = True
                        proc = self._start(spec, seed)
                        if proc is not None:
                            running[(spec.label, seed)] = proc
                            if len(running) > self.request.get("runs_at_once", 1):  # trained beside one another:
                                # results.md says their speeds shared the machine (recorded as it happens: a call
                                # whose runs could have shared it, and did not, claimed they had)
                                self.request["runs_at_once"] = len(running)
                                write_json(self.request, self.out / "recipe.json")
                if running:
                    time.sleep(0.5)
                elif todo and not started:  # what is left waits for a run that failed or was not asked for
                    for s, seed in todo:
                        missing = self._not_asked_for(s, seed)
                        failed.append(f"{s.label}/seed{seed} (not trained: {self._waits_for(missing, seed)})")
                        unasked += bool(missing)
                    break
        except KeyboardInterrupt as e:  # Ctrl-C, or a SIGTERM between training loops (cli's Terminated): as for a
            # SIGTERM caught above, the children stop at a checkpoint and it is said so, with the signal that came
            if isinstance(e, Interrupted):  # the run trained here stopped at its checkpoint, in its own words
                raise
            stopped.append(signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT)
        finally:
            in_progress = [*running, self.training_here] if self.training_here else list(running)
            interrupted = [f"{label}/seed{seed}" for label, seed in in_progress]
            _stop_children(list(running.values()))
            for sig, old in previous.items():
                signal.signal(sig, old)
        self.bar.close()
        if stopped:
            how = stop_words(stopped[0])
            stopped_runs = (f"the runs in progress ({', '.join(interrupted)}) stopped at their last checkpoint"
                            if interrupted else "no run was in progress")
            error = Interrupted(f"compare {how}: {stopped_runs}; rerun the same command to resume")
            error.exit_code = 128 + int(stopped[0])  # 130, 143, ...: as a shell reports the signal
            raise error
        if failed:  # a run waiting for a model not asked for would wait again: its reason says to add it to --only
            retry = "; rerun the same command to retry them" if len(failed) > unasked else ""
            raise UserError(f"{len(failed)} run(s) failed: {'; '.join(failed)}{retry}")
        return self._report()

    def _report(self) -> dict:
        """results.json and results.md over every finished run of this comparison: the ones asked for
        now, and those an earlier invocation trained for other models (--only) or seeds (--seeds),
        each checked as a reused run is (its configs and data), so a rerun of a subset keeps them."""
        for seed in self.request["seeds"]:
            for spec in training_order(self.recipe.models):
                run_dir = self.out / spec.label / f"seed{seed}"
                if seed in self.results.get(spec.label, {}) or not (run_dir / rundir.RESULT).exists():
                    continue
                model_cfg, train_cfg = matched_configs(self.recipe, spec, self.data, seed, self.sets, self.vocab,
                                                       self.results, self.out)
                check_run(run_dir, model_cfg, train_cfg, self.fingerprint)
                self.results.setdefault(spec.label, {})[seed] = read_run_result(run_dir, model_cfg, train_cfg)
        # The models with a finished run, those asked now, and those with a run started by an earlier invocation
        # (config.json, no result.json): one with none finished yet leaves the report incomplete, not left out.
        asked = {s.label for s in self.specs} | {
            s.label for s in self.recipe.models for seed in self.request["seeds"]
            if (self.out / s.label / f"seed{seed}" / rundir.CONFIG).exists()}
        specs = [s for s in self.recipe.models if self.results.get(s.label) or s.label in asked]
        return write_results(self.out, self.recipe, self.request, specs, self.results)

    @staticmethod
    def _waits_for(missing: list[str], seed: int) -> str:
        """Why a run cannot start: the run it starts from or is matched to failed, or is not part of
        this invocation (--only) and not finished in the directory (``missing``, :meth:`_not_asked_for`)."""
        if missing:
            return (f"it needs {', '.join(missing)} seed {seed}, which is neither finished here nor asked for: add it "
                    f"to --only")
        return "the run it starts from or is matched to failed"

    def _not_asked_for(self, spec: ModelSpec, seed: int) -> list[str]:
        """The models ``spec`` starts from or is matched to that this invocation leaves out (--only) and
        the directory holds no finished run of, for ``seed``."""
        asked = {s.label for s in self.specs}
        return [ref for ref in depends_on(spec) if ref not in asked
                and not (self.out / ref / f"seed{seed}" / rundir.RESULT).exists()]

    def _ready(self, spec: ModelSpec, seed: int) -> bool:
        """A run waits for the runs it starts from or is matched to."""
        for ref in depends_on(spec):
            if ref in self.results:
                if seed not in self.results[ref]:
                    return False
            elif not (self.out / ref / f"seed{seed}" / rundir.RESULT).exists():  # --only left it out
                return False
        return True

    def _start(self, spec: ModelSpec, seed: int) -> subprocess.Popen | None:
        """Reuse a finished run, or train it (here with one job, else in a child process)."""
        run_dir = self.out / spec.label / f"seed{seed}"
        model_cfg, train_cfg = matched_configs(self.recipe, spec, self.data, seed, self.sets, self.vocab,
                                               self.results, self.out)
        existing, finished = (run_dir / rundir.CONFIG).exists(), (run_dir / rundir.RESULT).exists()
        if existing or finished:  # a result without its config.json: nothing says it is this run, refused
            check_run(run_dir, model_cfg, train_cfg, self.fingerprint)
        if finished:
            self.results[spec.label][seed] = read_run_result(run_dir, model_cfg, train_cfg)
            self.bar.update(1, last=f"{spec.label}/seed{seed} (done before)")
            return None
        if existing and train_cfg.init_from and not (run_dir / rundir.CHECKPOINT).exists():
            _start_from_here(run_dir, train_cfg.init_from)
        if existing and (run_dir / rundir.CHECKPOINT).exists():
            train_cfg = train_cfg.replace(threads=kept_threads(run_dir, train_cfg.threads))
        if self.request["command"] not in self.request["commands"]:
            # The invocations that trained part of the table, in order: a rerun with --only or fewer
            # --seeds reports every finished run, so its command alone would not reproduce the table.
            self.request["commands"].append(self.request["command"])
            write_json(self.request, self.out / "recipe.json")
        self.bar.write(f"{'resuming' if existing else 'training'} {spec.label} seed {seed}: attn={model_cfg.attn} "
                       f"d_model={model_cfg.d_model} steps={train_cfg.max_steps or 'epochs'} -> {run_dir}")
        extra = {"label": spec.label, "recipe": self.recipe.name}
        if self.jobs == 1:
            self.training_here = (spec.label, seed)
            self.results[spec.label][seed] = (
                train(run_dir, resume=True, quiet=self.quiet, overrides=_resumed(train_cfg, self.sets)) if existing
                else train(run_dir, model_cfg, train_cfg, quiet=self.quiet, extra=extra, preset=self.recipe.preset))
            self.training_here = None
            self._finished(spec.label, seed)
            return None
        return start_run(run_dir, self.recipe.preset, model_cfg, train_cfg, extra, _resumed(train_cfg, self.sets))

    def _collect(self, label: str, seed: int, proc: subprocess.Popen, failed: list[str]) -> None:
        """A child (:func:`start_run`) ended: its result, or its failure in ``failed`` with its exit status (or the
        signal that killed it) and the last line it wrote to train.log (which holds earlier attempts' lines too)."""
        run_dir, returncode = self.out / label / f"seed{seed}", proc.returncode
        # Finished when its result.json reads back, whatever the exit status: a child sent Ctrl-C or SIGTERM
        # from outside during its last step writes it all the same, then exits 130 or 143.
        if (run_dir / rundir.RESULT).exists():
            try:
                self.results[label][seed] = rundir.read_result(run_dir / rundir.RESULT)
            except CheckpointError:
                if returncode == 0:
                    raise
            else:
                self._finished(label, seed)
                return
        with open(run_dir / "train.log", "rb") as log:
            log.seek(proc.log_start)
            tail = log.read().decode("utf-8", errors="replace").strip().splitlines()[-1:]
        how = f"killed by {_signal_name(-returncode)}" if returncode < 0 else f"exit {returncode}"
        failed.append(f"{label}/seed{seed} ({how}: {tail[0] if tail else 'no output'})")

    def _finished(self, label: str, seed: int) -> None:
        """A run finished: the report over every finished run (an invocation that is stopped now leaves
        the earlier invocations' runs in results.json and results.md, not this one's alone)."""
        self.bar.update(1, last=f"{label}/seed{seed}")
        self._report()


def kept_threads(run_dir: Path, share: int | None) -> int | None:
    """The CPU threads a run resumed from its checkpoint trains with: those it recorded, where this invocation's
    ``share`` of them (None: the default count) allows, so that its arithmetic, and its numbers, are the ones it
    would have had uninterrupted; else ``share``. The same `--jobs 2` command run again gave a run its whole share
    of 2 threads once the other run had finished, where it had trained on 1: other last bits in its results."""
    recorded = (rundir.read_config(run_dir / rundir.CONFIG).get("train") or {}).get("threads")
    if type(recorded) is int and 0 < recorded < (share or default_threads()):
        return recorded
    return share


def _start_from_here(run_dir: Path, init_from: str) -> None:
    """A continuation with no checkpoint yet starts again from its start weights: from ``init_from``, where this
    call finds them. Its config.json records the path as it was where the run was first started (relative to that
    working directory): a comparison moved, or continued from another directory, was refused ("not a directory
    from here"), with advice it could not follow."""
    config = rundir.read_config(run_dir / rundir.CONFIG)
    if isinstance(config.get("train"), dict) and config["train"].get("init_from") != init_from:
        config["train"]["init_from"] = init_from
        write_json(config, run_dir / rundir.CONFIG)


def start_run(run_dir: Path, preset: str | None, model_cfg, train_cfg: TrainConfig, extra: dict,
              resumed: dict) -> subprocess.Popen:
    """Train ``run_dir`` in a child process, `gbattn train --resume` with the settings ``resumed`` (:func:`_resumed`:
    threads, device, ..., and --data), writing its config.json first (a planned run) when it has none. The child
    logs to its train.log and gets SIGTERM (checkpoints and stops) when this process dies; the process's
    ``log_start`` is the size train.log had when it started (where its output begins: the log keeps every earlier
    attempt's)."""
    if not (run_dir / rundir.CONFIG).exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        rundir.write_config(run_dir, preset, model_cfg, train_cfg, extra, planned=True)
    cmd = [sys.executable, "-m", "gbattn.cli", "train", "--resume", "--out", option_path(run_dir), "--quiet"]
    for key, value in resumed.items():
        if key == "data":  # (as --data takes a path: --set would read one like `1e3` as a number)
            cmd += ["--data", option_path(value)]
        elif value is not None:  # (threads: a child of --jobs N always gets its share)
            cmd += ["--set", f"{key}={str(value).lower() if isinstance(value, bool) else value}"]
    with open_to_append(run_dir / "train.log") as log:  # the child keeps its own handle; never through a link
        log_start = os.fstat(log.fileno()).st_size
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    proc.log_start = log_start
    return proc


def _signal_name(signum: int) -> str:
    """``SIGKILL`` for 9: the name of the signal that ended a child (its negative return code), else "signal N"."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _resumed(train_cfg: TrainConfig, sets: dict) -> dict:
    """What of this invocation a resumed run takes over its recorded settings: the threads (None, this call's
    default: a run an earlier --jobs N left kept that call's share of them), the result-neutral keys given with --set
    (device, compile, ...), and the data as given now (check_run found the run's fingerprint there: a comparison
    moved with its corpus resumed from the path its runs recorded, and failed)."""
    keys = [k for k in TrainConfig.RESULT_NEUTRAL if k in sets or k == "threads"]
    neutral = {k: getattr(train_cfg, k) for k in keys if k == "threads" or getattr(train_cfg, k) is not None}
    return {**neutral, "data": train_cfg.data}


def _stop_children(procs: list[subprocess.Popen]) -> None:
    """Ask each running child to checkpoint and stop (SIGTERM) and wait for them all. A Ctrl-C meanwhile (a second
    one) stops them at once, as it stops `gbattn train`: SIGINT, each keeping its last checkpoint; this process
    still waits, so that it never ends with runs training in its directory."""
    signum = signal.SIGTERM
    while True:
        try:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signum)
            for proc in procs:
                proc.wait()
            return
        except KeyboardInterrupt:
            signum = signal.SIGINT


def _die_with_parent() -> None:
    """In a child: receive SIGTERM when the comparison process dies (Linux), so a killed comparison
    leaves no run training on its own (the child checkpoints and stops)."""
    stop_with_parent()
    os.setpgrp()  # Ctrl-C in the terminal goes to the comparison, which stops its children cleanly


def runs_at_once(specs: list[ModelSpec], seeds: list[int]) -> int:
    """The most runs of ``specs`` x ``seeds`` that can train at the same time, in stages: a run waiting for the runs
    it starts from or is matched to (:func:`depends_on`) a stage after them. Runs finished by an earlier call count
    too: the share of threads a run gets is the command's, so the same command run again after a stop trains the
    runs that had not started with the threads, and to the numbers, they would have had uninterrupted."""
    asked = {spec.label: spec for spec in specs}
    pending = {(spec.label, seed) for spec in specs for seed in set(seeds)}

    def stage(label: str, seed: int) -> int:
        waits = [ref for ref in depends_on(asked[label]) if (ref, seed) in pending]
        return 1 + max((stage(ref, seed) for ref in waits), default=-1)

    stages = [stage(label, seed) for label, seed in pending]
    return max((stages.count(k) for k in set(stages)), default=1)


def matched_configs(recipe, spec, data, seed, sets, vocab, results, out):
    """A spec's configs with its width matched to another model's parameters, or its steps to
    another model's training FLOPs."""
    model_cfg, train_cfg = spec_configs(recipe, spec, data, seed, sets, vocab)
    if spec.param_matched_to:
        ref = next(s for s in recipe.models if s.label == spec.param_matched_to)
        ref_model, _ = spec_configs(recipe, ref, data, seed, sets, vocab)
        width, _ = param_matched_width(model_cfg, count_params(ref_model))
        model_cfg = model_cfg.replace(d_model=width)
    if spec.init_from:
        model_cfg, train_cfg = _continuation(spec, seed, train_cfg, out)
    if spec.compute_matched_to:
        ref_spec = next(s for s in recipe.models if s.label == spec.compute_matched_to)
        ref_result = results.get(spec.compute_matched_to, {}).get(seed)
        path = out / spec.compute_matched_to / f"seed{seed}" / rundir.RESULT
        if ref_result is None:
            if not path.exists():
                raise UserError(f"{spec.label} is matched to {spec.compute_matched_to}'s compute: run that model first")
            # (--only left the reference out: read as a reused run is, its tokens and FLOPs checked against its configs)
            ref_result = read_run_result(path.parent, *matched_configs(recipe, ref_spec, data, seed, sets, vocab,
                                                                       results, out))
        # Its training FLOPs as its configs give them (read_run_result checks a finished run's against them, the
        # trainer wrote a run's just trained): a hand-edited 0 or 1e30 set this run's steps to 0 or 10^23.
        flops = ref_result["train_flops"]
        seq_len = model_cfg.input_length(train_cfg.seq_len)
        per_token = flops_per_token(model_cfg, seq_len=seq_len, backward=True)
        steps = round(flops / (per_token * train_cfg.batch_size * seq_len))
        # The reference's warmup as its run used it (docs/baselines.md: the warmup stays the same and only
        # the cosine stretches); the longer run would fit a default warmup to a tenth of itself, or not at all.
        warmup, _ = fitted_warmup(spec_configs(recipe, ref_spec, data, seed, sets, vocab)[1], ref_result["steps"])
        train_cfg = train_cfg.replace(max_steps=steps, warmup_steps=warmup, fit_warmup=False)
    return model_cfg, train_cfg


def _continuation(spec: ModelSpec, seed: int, train_cfg, out: Path):
    """A run that starts from ``spec.init_from``'s trained weights, upcycled first if the spec says
    so (the upcycled run directory is written once, next to the run): its model config (the start's) and its
    training config."""
    source = out / spec.init_from / f"seed{seed}"
    if not (source / rundir.RESULT).exists():
        raise UserError(f"{spec.label} starts from {spec.init_from}'s trained weights: train that model first")
    start = source
    if spec.upcycle:
        start = out / spec.label / f"seed{seed}-start"
        upcycled = upcycle(source, spec.upcycle["attn"], spec.upcycle.get("attn_options"))
        if not (start / rundir.CONFIG).exists():
            # This comparison's own folder; weights without config.json (written last) are an upcycle killed here
            rundir.discard_run(start)  # before it finished, which write_run would refuse: written again
            write_run(upcycled, start)
        else:  # one there is reused only as this upcycle of this base: a renamed seed's, another label's or another
            held = rundir.load_run(start)  # comparison's was trained on and published under this label
            if (held.model_cfg != upcycled.model_cfg
                    or rundir.weights_digest(held.model.state_dict()) != rundir.weights_digest(upcycled.state)):
                raise UserError(f"{start} holds another model than {spec.label} starts from ({source} upcycled to "
                                f"attn={spec.upcycle['attn']}): move it away (it is made again) or use another --out")
    start_cfg, _ = rundir.read_configs(rundir.read_config(start / rundir.CONFIG), start)
    return start_cfg, train_cfg.replace(init_from=str(start))


def results_part(key: str, value):
    """What of a recorded request must match a new one: all of it but the ``--set`` keys that change
    no result (device, compile, log_every, ...: a comparison continues on another device)."""
    if key != "sets" or not isinstance(value, dict):
        return value
    # (a path in a value as results files record it: recipe.json written before they did held it as typed)
    return {k: v for k, v in portable_sets(value).items() if k not in TrainConfig.RESULT_NEUTRAL}


def portable_sets(sets: dict) -> dict:
    """``--set`` values as results files record them: a path in one (``tokenizer=hf=/home/me/tok.json``) as the
    command beside them writes it (:func:`gbattn.runtime.portable_argument`)."""
    return {k: portable_argument(v) if isinstance(v, str) else v for k, v in sets.items()}


def _set_value(sets: dict, key: str) -> str:
    """``--set key=value`` as typed, or that it was not given."""
    return f"--set {key}={json.dumps(sets[key]) if not isinstance(sets[key], str) else sets[key]}" if key in sets \
        else "not set"


def same_local_path(a: str, b: str) -> bool:
    """Whether two --data values name one local file or folder (relative ones from the working directory)."""
    try:
        return os.path.samefile(os.path.expanduser(a), os.path.expanduser(b))
    except (OSError, ValueError):  # (not there, or a hub name)
        return False


def _check_request(path: Path, request: dict, seeds_given: bool = True, *, data_as_given: str) -> None:
    """Refuse a comparison directory that holds another comparison; complete this request from it (run_compare
    records it once the data is read). Its seeds become the recorded ones and those given, or the recorded ones
    alone when none were given. ``data_as_given``: --data as typed, before :func:`portable_path`."""
    if path.exists():
        before = rundir.read_json(path)
        if isinstance(before.get("data"), str):  # written before data paths were made portable
            before["data"] = portable_path(before["data"])
            if ("/" not in before["data"] and before["data"] == Path(request["data"]).name
                    and request["data"] != data_as_given):
                # written before a corpus file given by absolute path kept its folder (input.txt for
                # tiny-shakespeare/input.txt): the same data, which check_run confirms by its fingerprint.
                # Only for a path portable_path shortened: './wt/' is not the 'wt' a comparison recorded as
                # typed, and its runs would refuse it once recipe.json had taken its name. It keeps the name it
                # recorded (taking the new one, the first command, from another folder, was refused after)
                request["data"] = before["data"]
            elif before["data"] != request["data"] and same_local_path(before["data"], data_as_given):
                # the same local folder or file named otherwise (corp/splits, recorded relative, given by its
                # absolute path, which results files shorten to splits): it keeps the name recorded
                request["data"] = before["data"]
        for key in ("recipe", "data", "sets"):
            had, asked = results_part(key, before.get(key)), results_part(key, request[key])
            if had == asked:
                continue
            if key == "sets" and isinstance(had, dict):  # the --set values that differ, as typed (not a Python dict)
                differ = [f"{k}: {_set_value(had, k)} there, {_set_value(asked, k)} now"
                          for k in sorted({*had, *asked}) if had.get(k) != asked.get(k)]
                raise UserError(f"{path.parent} holds a comparison with other --set values: {'; '.join(differ)}; use "
                                f"another --out or the same settings")
            raise UserError(f"{path.parent} holds a comparison with {key}={before.get(key)!r}, not {request[key]!r}; "
                            f"use another --out or the same settings")
        seeds = before.get("seeds", [])
        if not isinstance(seeds, list) or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_INT
                                                  for s in seeds):  # (-1: a seed no --seeds takes, reported missing)
            raise CheckpointError(f"{path}: seeds={seeds!r} must be a list of integers in [0, 2**63 - 1]; restore the "
                                  f"file or use another --out")
        request["seeds"] = sorted(set(seeds) | set(request["seeds"]) if seeds_given or not seeds else set(seeds))
        commands = before.get("commands", [before["command"]] if isinstance(before.get("command"), str) else [])
        if not isinstance(commands, list) or not all(isinstance(c, str) for c in commands):
            raise CheckpointError(f"{path}: commands={commands!r} must be a list of strings; restore the file or use "
                                  f"another --out")
        request["commands"] = commands
        runs_at_once = before.get("runs_at_once", 1)  # (none recorded: one run at a time, or a comparison of before)
        if not (is_count(runs_at_once) and runs_at_once <= MAX_INT):
            raise CheckpointError(f"{path}: runs_at_once={errors.shown(runs_at_once)} must be an integer >= 1; restore "
                                  f"the file or use another --out")
        if runs_at_once > 1:
            request["runs_at_once"] = runs_at_once
        recorded, matched = before.get("models", {}), before.get("matched", [])
        if problem := added_models_problem(recorded, matched):
            raise CheckpointError(f"{path}: {problem}; restore the file or use another --out")
        asked = request.setdefault("models", {})
        for label, text in asked.items():
            if recorded.get(label, text) != text:
                raise UserError(f"{path.parent} holds model {label} as --model {label}={recorded[label]}, not "
                                f"{text}; use another label or --out")
        request["models"] = {**recorded, **asked}
        request["matched"] = list(dict.fromkeys([*matched, *request.get("matched", [])]))
    else:
        request["commands"] = []
