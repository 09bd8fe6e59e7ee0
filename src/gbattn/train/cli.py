"""``gbattn train``."""

from __future__ import annotations

import json
from pathlib import Path

from gbattn import arguments


def register(sub) -> None:
    p = sub.add_parser("train", help="train one model into a run directory (resumable)")
    arguments.preset(p)
    arguments.model(p)
    p.add_argument("--data", default=None, help="a corpus: tiny-shakespeare (shipped), an HF name "
                   "(wikitext-103-raw-v1, ...), a local directory or a text file (README, 'Data'); required for a "
                   "new run (default with --resume or --init-from: that run's)")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--seed", type=arguments.SEED, default=None,
                   help="the run's random seed (default: the recipe's, 42)")
    p.add_argument("--tokenizer", default=None,
                   help="bpe (paper), char, gpt2, gpt2=PATH or hf=PATH (a tokenizer.json) (default: the preset's: "
                        "char for cpu-char, gpt2 for owt-125m and owt-350m, else bpe)")
    arguments.device(p)
    arguments.threads(p, resumed=True)
    compiled = p.add_mutually_exclusive_group()  # both at once: an error, not the last one silently
    compiled.add_argument("--compile", dest="compile", action="store_true", default=None,
                          help="torch.compile the model (default off: on a CPU it saved at most about its own "
                               "compile time over a CPU recipe's run; on one H200 a step ran 1.4-2.1x faster, paying "
                               "for its compiling after 1,100-5,200 steps, measured for standard and GBA only; "
                               "README, 'Compiled vs eager')")
    compiled.add_argument("--no-compile", dest="compile", action="store_false", help="never torch.compile")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--restart", action="store_true", help="discard the run in --out and start a new one in it")
    p.add_argument("--init-from", default=None, metavar="RUN_DIR",
                   help="start from this run's weights with a fresh optimizer (e.g. a `gbattn upcycle` directory); "
                        "the model is that run's (default: none, a fresh initialisation)")
    arguments.quiet(p, also="plan or evaluation lines: the final JSON line only")
    p.set_defaults(func=cmd_train)


# Options that select the run; on --resume they must equal the recorded ones.
RUN_OPTIONS = ("preset", "attn", "residual", "data", "seed", "tokenizer")


def resume_conflicts(args, saved: dict, model_cfg, train_cfg) -> list[str]:
    """The options of ``train --resume`` that would change the recorded run, as 'option (recorded: value)'."""
    from gbattn.config import (
        ModelConfig,
        TrainConfig,
        parse_sets,
        set_path,
        split_overrides,
    )
    from gbattn.train.trainer import compile_switch, same_corpus

    recorded = {"preset": saved.get("preset"), "attn": model_cfg.attn, "residual": model_cfg.residual,
                "data": train_cfg.data, "seed": train_cfg.seed, "tokenizer": train_cfg.tokenizer}
    differ = [
        f"--{name} {getattr(args, name)} (recorded: {'none' if recorded[name] is None else recorded[name]})"
        for name in RUN_OPTIONS
        if getattr(args, name) is not None and getattr(args, name) != recorded[name]
        and (recorded[name] is not None or name == "preset")  # a run made without a preset was made by no preset
        and not (name == "data" and same_corpus(args.data, saved, train_cfg))
    ]
    train_sets, model_sets = split_overrides(parse_sets(args.sets))
    resolved = model_cfg.resolved()  # (a value equal to its default changes nothing: attn.rounds=2 of a run with {})
    for key, value in model_sets.items():
        if key == "vocab_size" and value == saved.get("vocab_size_asked"):  # the tokenizer's vocabulary was taken
            continue
        d = model_cfg.to_dict()
        set_path(d, key, value)
        if ModelConfig.from_dict(d).resolved() != resolved:
            differ.append(f"--set {key}={value} (recorded: {_recorded(resolved.to_dict(), key)})")
    for key, value in train_sets.items():
        if key == "data" and same_corpus(value, saved, train_cfg):  # as --data: the same corpus at another path
            continue
        if key not in TrainConfig.RESULT_NEUTRAL and train_cfg.replace(**{key: value}) != train_cfg:
            differ.append(f"--set {key}={value} (recorded: {getattr(train_cfg, key)})")
    asked = args.compile if args.compile is not None else train_sets.get("compile")
    # (checked first: --set compile=no is "must be true or false or null", not a switch to compiled training)
    switched = asked is not None and compile_switch(model_cfg, train_cfg, train_cfg.replace(compile=asked))
    if switched:
        differ.append(switched)
    return differ


def _recorded(d: dict, key: str):
    from gbattn.config import field_path

    for part in field_path(key).split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def cmd_train(args) -> None:
    from gbattn import rundir
    from gbattn.checks import coerce
    from gbattn.config import TrainConfig, build_configs, merge_options, parse_sets
    from gbattn.data.corpus import check_split_setting, refuse_record_file
    from gbattn.errors import UserError
    from gbattn.files import finite
    from gbattn.runtime import is_first_process
    from gbattn.train.distributed import shutdown_distributed
    from gbattn.train.trainer import Trainer

    if args.resume and args.restart:
        raise UserError("--resume continues the run in --out and --restart replaces it: give one of them")
    # Options and --set name the same fields one way: both given and different is an error.
    sets = merge_options(parse_sets(args.sets), attn=args.attn, residual=args.residual, data=args.data,
                         seed=args.seed, tokenizer=args.tokenizer, device=args.device, compile=args.compile,
                         threads=args.threads, init_from=args.init_from)
    if args.resume:
        if args.init_from:
            raise UserError("--init-from starts a new run: it does not go with --resume")
        config_path = Path(args.out) / rundir.CONFIG
        _refuse_resume_without_run(Path(args.out))
        saved = rundir.read_config(config_path)
        model_cfg, train_cfg = rundir.read_configs(saved, config_path)
        differ = resume_conflicts(args, saved, model_cfg, train_cfg)
        if differ:
            raise UserError(f"train --resume continues {args.out} as it was started; these options would change it: "
                            f"{'; '.join(differ)}. Leave them out, or start a new run (another --out, or --restart)")
        neutral = {k: v for k, v in sets.items() if k in TrainConfig.RESULT_NEUTRAL}  # with --threads, --device ...
        if sets.get("data") and sets["data"] != train_cfg.data:  # the same corpus at another path (resume_conflicts;
            neutral["data"] = sets["data"]  # --data or --set data=)
        trainer = Trainer(args.out, resume=True, quiet=args.quiet, overrides=neutral)
    else:
        init_from = coerce("init_from", sets.pop("init_from", None), str | None)  # --init-from RUN or --set
        if init_from:  # init_from=RUN: one field, two spellings
            trainer = _init_from_trainer(args, init_from, sets)
        else:
            data = sets.pop("data", None)
            if not data:
                raise UserError("--data is required for a new run: tiny-shakespeare, an HF name, a local directory or "
                                "a text file (README, 'Data')")
            preset = args.preset or "paper-small"
            model_cfg, train_cfg = build_configs(preset, sets.pop("attn", "standard"), data, sets)
            check_split_setting(data, sets)  # a valid split, which would be ignored
            refuse_record_file(data)  # (a new run's; one trained on such a file before resumes and is read as it was)
            trainer = Trainer(args.out, model_cfg, train_cfg, quiet=args.quiet, preset=preset, restart=args.restart)
    try:
        result = trainer.run()
    finally:
        shutdown_distributed()  # under torchrun: leave the process group cleanly
    # (.get: a finished run's result.json read back may lack a perplexity, as read_result allows)
    summary = {k: result.get(k) for k in ("attn", "parameters", "steps", "valid_ppl", "test_ppl", "train_tokens_per_s")}
    summary["test_split"] = result.get("test_split", "test")  # "valid": the data has no test split
    if is_first_process():  # under torchrun: one summary
        print(json.dumps(finite(summary)))  # strict JSON (an infinite perplexity is null, as in result.json)


def _refuse_resume_without_run(out: Path) -> None:
    """``train --resume`` into a folder without a run's config.json: one a run was stopped in before writing it (killed
    during data preparation: nothing trained yet, only its lock left) is said to be so, with the way to start it."""
    from gbattn import rundir
    from gbattn.errors import UserError

    if not out.is_dir() or (out / rundir.CONFIG).exists():
        return  # none at all, or a run: read_config names what is wrong with it
    rundir.refuse_weights_without_config(out)
    if rundir.folder_holds(out) is None:
        raise UserError(f"{out} holds no run to resume (no {rundir.CONFIG}: a run stopped before writing it had not "
                        f"trained yet): start it with the command that started it, without --resume")


def _init_from_trainer(args, init_from: str, sets: dict):
    """A new run whose model (and default data and recipe) is the one in ``init_from`` (``--init-from``)."""
    from gbattn import rundir
    from gbattn.config import DROPOUT_FIELDS, build_configs, split_overrides
    from gbattn.data.corpus import refuse_record_file
    from gbattn.errors import UserError
    from gbattn.files import portable_path
    from gbattn.runtime import is_first_process
    from gbattn.terminal import note
    from gbattn.train.trainer import Trainer

    if Path(init_from).resolve() == Path(args.out).resolve():  # --restart would delete the weights to start from
        raise UserError(f"--init-from {init_from} is --out: a run started from its weights goes to another --out")
    path = Path(init_from) / rundir.CONFIG
    rundir.refuse_weights_without_config(init_from, then=rundir.UNFINISHED_RUN_ADVICE)
    config = rundir.read_config(path)
    rundir.refuse_hf_checkpoint(config, init_from, then="--init-from DIR")
    source = rundir.gbattn_section(config, path)
    source = source if source is not None else config  # read_configs names what is missing
    model_cfg, source_train = rundir.read_configs(source, init_from)
    train_sets, model_sets = split_overrides(sets)  # ``sets`` holds --attn, --data, --seed, ... too
    dropout = {key: model_sets.pop(key) for key in DROPOUT_FIELDS if key in model_sets}  # no parameter changes
    if args.preset and args.preset != source.get("preset") or model_sets:
        # (the options given, not every option that could have been: `--set n_layers=3` was told to leave out
        # --attn, --residual and --preset, and to upcycle, which changes the attention alone)
        given = ([f"--preset {args.preset}"] if args.preset and args.preset != source.get("preset") else []) + [
            f"--{key}" if key in ("attn", "residual") else f"--set {key}" for key in model_sets]
        attention = any(key == "attn" or key.startswith(("attn.", "attn_options")) for key in model_sets)
        raise UserError(f"--init-from trains the model of {init_from} as it is: leave out {', '.join(given)} (model "
                        f"settings other than {' and '.join(DROPOUT_FIELDS)} change its parameters)"
                        + ("; upcycle first to add correction rounds: `gbattn upcycle`" if attention else ""))
    model_cfg = model_cfg.replace(**dropout)
    split = train_sets.pop("split", None)
    if split is not None and source_train.replace(split=split).split != source_train.split:  # (0.9,0.1,0 as typed)
        raise UserError(f"--init-from trains on the split of {init_from} (recorded: {source_train.split}): "
                        f"leave out --set split")
    tokenizer = train_sets.pop("tokenizer", None)
    if tokenizer is not None and tokenizer != source_train.tokenizer:
        raise UserError(f"--init-from trains with the tokenizer of {init_from} (recorded: "
                        f"{source_train.tokenizer}): leave out --tokenizer / --set tokenizer={tokenizer}")
    train_sets.setdefault("seq_len", source_train.seq_len)  # its windows (None: block_size - 1), not the preset's
    preset = source.get("preset") or "paper-small"
    # (README, "Upcycling a trained model"; it was silent; under torchrun, said once)
    if source.get("preset") is None and not args.quiet and is_first_process():
        note(f"note: {init_from} records no preset: training with paper-small's recipe (lr, warmup, epochs, "
             f"batch); --set changes any of them")
    data = train_sets.pop("data", None)
    if data and data != source_train.data:  # other data than the run's own (which it trained on as it is)
        refuse_record_file(data)
    _, train_cfg = build_configs(preset, model_cfg.attn, data or source_train.data, train_sets,
                                 tokenizer=source_train.tokenizer)
    train_cfg = train_cfg.replace(init_from=str(init_from), split=source_train.split)
    # (config.json's train.init_from keeps the path a resume reads; the extras go into result.json, which holds no
    # path of this machine: an absolute one was written there)
    return Trainer(args.out, model_cfg, train_cfg, quiet=args.quiet, preset=preset, restart=args.restart,
                   extra={"init_from": portable_path(str(init_from))})
