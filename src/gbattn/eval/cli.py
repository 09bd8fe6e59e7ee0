"""``gbattn eval`` and ``gbattn generate``."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

from gbattn import arguments
from gbattn.terminal import note, terminal_text


def register(sub) -> None:
    p = sub.add_parser("eval", help="perplexity of a trained run on its valid or test split")
    p.add_argument("run_dir", help="a run directory or a directory written by `gbattn export`")
    p.add_argument("--split", default="test", choices=["valid", "test"],
                   help="(default %(default)s) as the run scored it: its first eval_tokens tokens (the run's "
                        "setting), in whole rows of its seq_len; the line says how many were scored")
    arguments.checkpoint(p)
    p.add_argument("--per-token", metavar="FILE",
                   help="also write every token's loss (nats) to FILE: a numpy array for a .npy name, else text, "
                        "one loss per line, every digit the loss has (default: not written)")
    p.add_argument("--batch-size", type=arguments.at_least(1), default=None,
                   help="rows per batch (default: the run's eval_batch_size, as its trainer evaluated)")
    p.add_argument("--data", default=None,
                   help="the corpus (a name, file or directory) when it is not where the run recorded it, e.g. "
                        "for a run or export made on another machine (default: the run's --data)")
    p.add_argument("--allow-other-data", action="store_true",
                   help="evaluate even if the data differs from what the run was trained on (its fingerprint)")
    arguments.device(p)
    arguments.threads(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("generate", help="generate text from a trained run (KV-cached decoding)")
    p.add_argument("run_dir", help="a run directory or a directory written by `gbattn export`")
    p.add_argument("--prompt", required=True, type=arguments.text, help="the text to continue")
    p.add_argument("--max-new-tokens", type=arguments.at_least(0),
                   default=arguments.GENERATE_DEFAULTS["max_new_tokens"],
                   help="tokens to generate after the prompt (default %(default)s)")
    p.add_argument("--temperature", type=arguments.non_negative_number,
                   default=arguments.GENERATE_DEFAULTS["temperature"],
                   help="0 = greedy (default %(default)s)")
    p.add_argument("--top-k", type=arguments.at_least(1), default=None,  # (None: not given, GENERATE_DEFAULTS')
                   help=f"sample from the k most likely tokens (default {arguments.GENERATE_DEFAULTS['top_k']}); a k "
                        f"of the vocabulary's size or more keeps every token")
    p.add_argument("--top-p", type=arguments.probability_mass, default=None,
                   help="nucleus sampling: from the most likely tokens that together hold at least this probability, "
                        "after --top-k (default: no cut)")
    p.add_argument("--seed", type=arguments.SEED, default=None, help="sampling seed (default: a new draw each time)")
    p.add_argument("--num-samples", type=arguments.at_least(1), default=1,
                   help="samples to draw from the same prompt, in one batch drawing from one seed: the same seed "
                        "with another count gives other samples, the first one too (default %(default)s)")
    p.add_argument("--stop", metavar="TEXT", action="append", type=arguments.text, default=None,
                   help="stop once every sample's new text holds TEXT, and print each sample up to it (TEXT left "
                        "out); repeat for several; taken as typed, so a newline is $'\\n' in bash (default: none)")
    arguments.checkpoint(p)
    p.add_argument("--no-cache", action="store_true", help="recompute the whole context at every step")
    compiled = p.add_mutually_exclusive_group()
    compiled.add_argument("--compile", dest="compile", action="store_const", const=True, default=None,
                          help="compile the decode step (default: where measured faster; README, 'Compiled vs eager')")
    compiled.add_argument("--no-compile", dest="compile", action="store_const", const=False, help="decode eagerly")
    arguments.device(p)
    arguments.threads(p)
    p.set_defaults(func=cmd_generate)


def cmd_eval(args) -> None:
    import numpy as np

    from gbattn.data.corpus import test_split_note, tested_split
    from gbattn.data.prepare import other_data_note, prepare_run_data
    from gbattn.data.tokens import num_rows
    from gbattn.errors import UserError
    from gbattn.eval.perplexity import evaluate
    from gbattn.files import atomic_write, finite
    from gbattn.progress import Progress
    from gbattn.rundir import check_output_file, check_output_outside_data, load_run
    from gbattn.runtime import autocast, precision_name, resolve_device, set_threads, use_tf32

    if args.per_token:
        check_output_file(args.per_token, "--per-token")
    set_threads(args.threads)
    device = resolve_device(args.device or "auto")
    use_tf32(device)  # as the trainer scored valid and test
    run = load_run(args.run_dir, args.checkpoint, device)
    data = prepare_run_data(run, args.data, args.allow_other_data, args.split)
    if args.per_token:  # (it replaced a corpus file with losses)
        # (the data as load_corpus read it: the corpus's name is for display, ~/c or ./wikitext-2-v1 as a hub name
        # let the losses be written over a split)
        check_output_outside_data(args.per_token, args.data or run.train_cfg.data, "--per-token")
    tokens = data.splits[args.split]
    if num_rows(tokens, run.seq_len) == 0:
        raise UserError(f"{data.split_of(args.split)} has {len(tokens):,} tokens: fewer than one row of "
                        f"{run.seq_len + 1}, so there is nothing to evaluate")
    bar = Progress(num_rows(tokens, run.seq_len), desc=f"eval {args.split}", unit="row")
    # The run's own precision (amp), as its trainer scored valid and test: result.json's number again.
    batch_size = args.batch_size or run.train_cfg.eval_batch_size
    res = evaluate(run.model, tokens, run.seq_len, batch_size, device, autocast(device, run.train_cfg.amp),
                   per_token=bool(args.per_token), progress=bar.update)
    bar.close()
    precision = precision_name(device, run.train_cfg.amp)
    out = {"run_dir": str(args.run_dir), "split": args.split, "checkpoint": run.checkpoint, "step": run.step,
           "loss": res.loss, "ppl": res.ppl, "tokens": res.tokens, "precision": precision}
    tested = tested_precision(run)
    if tested is not None and tested != precision:  # (amp=auto: a GPU run scored on a CPU, unsaid)
        note(f"note: {run.run_dir} was tested in {tested} (amp={run.train_cfg.amp} on the device it trained on), "
             f"and is scored here in {precision} on {device.type}: its numbers differ from result.json's in the last "
             f"digits")
    if args.split == "test":  # the split scored, as result.json's test_split ("valid" where the data has no test)
        out["test_split"] = tested_split(data.notes)
    other_data = other_data_note(run, data)
    if other_data:  # --allow-other-data: not the run's own held-out data
        out["other_data"] = other_data
    if args.per_token:  # serialised first, then written whole (files.atomic_write), its folder made if new
        buffer = io.BytesIO()
        if args.per_token.lower().endswith(".npy"):  # (losses.NPY was written as text, which np.load refused)
            np.save(buffer, res.per_token)
        else:  # every digit of the loss (six decimals changed the perplexity from the 9th digit; a loss under 5e-7
            np.savetxt(buffer, res.per_token, fmt=f"%.{np.finfo(res.per_token.dtype).precision + 3}g")  # read 0)
        Path(args.per_token).parent.mkdir(parents=True, exist_ok=True)
        atomic_write(args.per_token, buffer.getbuffer())
        out["per_token_file"] = args.per_token
    print(f"{args.split} perplexity {res.ppl:.3f} (loss {res.loss:.4f} nats) over {res.tokens:,} tokens, "
          f"{run.weights_text}"
          + (test_split_note(data.notes) if args.split == "test" else "") + (f"; {other_data}" if other_data else ""))
    print(json.dumps(finite(out)))  # strict JSON (an infinite perplexity is null)


def tested_precision(run) -> str | None:
    """What a finished run's test was scored in: its result.json's ``test_precision``, or, for a run from before that
    was recorded, what its ``amp`` gives on the device of its last leg (a GPU's name, or ``cpu (...)``); None for an
    export, an unfinished run or a result.json that cannot be read."""
    import torch

    from gbattn.errors import UserError
    from gbattn.rundir import RESULT, read_json
    from gbattn.runtime import precision_name

    path = Path(run.run_dir) / RESULT
    if run.checkpoint == "exported" or not path.is_file():
        return None
    try:
        result = read_json(path)
    except UserError:
        return None
    recorded = result.get("test_precision")
    if recorded in ("bfloat16", "float32"):
        return recorded
    device = result.get("device")
    if not isinstance(device, str) or not device:
        return None
    last = device.split("; ")[-1]
    return precision_name(torch.device("cpu" if last.startswith("cpu") else "cuda"), run.train_cfg.amp)


def cmd_generate(args) -> None:
    import time

    import torch

    from gbattn.errors import DataError, UserError
    from gbattn.model.decoding import StopStrings, cache_plan, decoder_for, is_greedy
    from gbattn.progress import Progress
    from gbattn.rundir import load_run
    from gbattn.runtime import resolve_device, set_threads

    if args.compile and args.no_cache:  # (--compile was dropped, unsaid)
        raise UserError("--compile compiles the cached decode step, and --no-cache recomputes the whole context at "
                        "every token: give one of them")
    set_threads(args.threads)
    device = resolve_device(args.device or "auto")
    run = load_run(args.run_dir, args.checkpoint, device)
    if args.checkpoint != "last" and run.checkpoint == "last":  # (load_run's fallback, which eval and analyze name)
        note(f"note: {args.run_dir} has no best-validation weights (best.pt): generating from the last checkpoint, "
             f"step {run.step}")
    try:
        ids = run.tokenizer.encode(args.prompt)
    except DataError as e:  # (the line named neither the prompt nor the option)
        raise DataError(f"--prompt: {e}") from None
    if not ids:
        raise UserError("the prompt encodes to no tokens")
    unknown = ids.count(run.tokenizer.unknown_id) if run.tokenizer.unknown_id is not None else 0
    if unknown:  # the prompt shown has <unk> where the user typed other text: say why, as the tokenizer spells it
        unk = run.tokenizer.decode([run.tokenizer.unknown_id]).strip() or "<unk>"  # ([UNK]: it said <unk>)
        note(f"note: {unknown} of the prompt's {len(ids)} token{'s' if len(ids) != 1 else ''} "
             f"{'is' if unknown == 1 else 'are'} {unk} (text this tokenizer never saw in "
             f"training, or {unk} itself); the model reads them as {unk}, and the text shown has {unk} in their place")
    try:
        stop_at = StopStrings(run.tokenizer.decode, args.stop) if args.stop else None
    except DataError as e:  # (text that is not UTF-8, named as --prompt's is)
        raise DataError(f"--stop: {e}") from None
    if is_greedy(args.temperature):  # what only sampling reads changed nothing, unsaid
        # (after every check: a refused command says one line)
        unused = [flag for flag, given in (("--top-k", args.top_k is not None), ("--top-p", args.top_p is not None),
                                           ("--seed", args.seed is not None)) if given]
        same = f"the {args.num_samples} samples are the same" if args.num_samples > 1 else ""
        if unused or same:
            note(f"note: --temperature {args.temperature:g} decodes greedily: "
                 + "; ".join(filter(None, [f"{' and '.join(unused)} change{'s' if len(unused) == 1 else ''} nothing"
                                           if unused else "", same])))
    idx = torch.tensor([ids] * args.num_samples, device=device)
    step, how = decoder_for(run.model, compile=False if args.no_cache else args.compile,
                            max_new_tokens=args.max_new_tokens, prompt_length=len(ids))
    block = run.model.cfg.block_size
    if args.compile and cache_plan(block, args.max_new_tokens, len(ids))[0] == 0:  # (dropped, unsaid)
        why = (f"the prompt of {len(ids)} tokens fills block_size={block}, so every token recomputes the context"
               if len(ids) >= block else f"{args.max_new_tokens} new token{'s' if args.max_new_tokens != 1 else ''} "
               f"take{'s' if args.max_new_tokens == 1 else ''} no cached step")
        note(f"note: --compile compiles the cached decode step, and {why}: nothing is compiled")
    # A bar for long generations only (one token per step for the whole batch).
    bar = Progress(args.max_new_tokens, desc="generating", unit="token", disable=args.max_new_tokens < 1000)
    made = []  # when each new token was made: a compiled step compiles on its first call, before the second token

    def made_one(n: int) -> None:
        made.append(time.perf_counter())
        bar.update(n)

    def show(out) -> None:
        on_terminal = sys.stdout.isatty()
        for row in out.tolist():
            text = stop_at.text(row, len(ids)) if stop_at is not None else run.tokenizer.decode(row)
            print(terminal_text(text) if on_terminal else text)  # piped: the text as decoded
            print("---")

    t0 = time.perf_counter()
    try:
        # compile=False: the choice is made above (step, or eager decoding), not again by generate's own default
        top_k = arguments.GENERATE_DEFAULTS["top_k"] if args.top_k is None else args.top_k
        out = run.model.generate(idx, args.max_new_tokens, temperature=args.temperature, top_k=top_k,
                                 top_p=args.top_p, seed=args.seed, use_cache=not args.no_cache, decode_step=step,
                                 compile=False, progress=made_one, stop=stop_at)
    except KeyboardInterrupt as stop:  # Ctrl-C: what was made is shown, then the command stops as interrupted
        bar.close()
        partial = getattr(stop, "partial_BT", None)
        if partial is not None:
            show(partial)
            note(f"note: stopped after {len(made):,} of {args.max_new_tokens:,} new tokens")
        raise
    if device.type == "cuda":  # the tokens are queued, not made, until the GPU is done
        torch.cuda.synchronize(device)
    end = time.perf_counter()
    dt = end - t0
    bar.close()
    show(out)
    if run.tokenizer.kind == "bpe":
        note("note: the paper's BPE keeps no word boundaries, so its pieces are shown separated by spaces "
             "(README, 'Data')")
    new = len(made)  # fewer than --max-new-tokens where --stop ended it
    tokens = args.num_samples * new
    if tokens == 0:  # (it said "0 tokens/s, KV cache")
        note(f"{args.num_samples} x 0 tokens: the prompt alone, no decoding")
        return
    if step is not None and new < 2:  # the prefill made the only token: no decode step ran, so none compiled
        how = how.replace(", compiled decode step", "", 1)
    if step is None or new < 2:  # no compiled step ran: the whole time is decoding
        rate = f"{tokens / max(dt, 1e-9):,.0f} tokens/s"
    elif new == 2:
        rate = "compiling the decode step included"
    else:  # the rate of the tokens after the compiling
        rate = (f"{args.num_samples * (new - 2) / max(end - made[1], 1e-9):,.0f} tokens/s after the "
                f"first 2 tokens, which took {made[1] - t0:.2f} s with compiling the decode step")
    stopped = ""
    if new < args.max_new_tokens:  # the summary of the tokens made, not of those asked for
        if len(ids) < run.model.cfg.block_size:  # (a prompt that fills it used no cache, and says so)
            planned_past = cache_plan(run.model.cfg.block_size, args.max_new_tokens, len(ids))[1]
            how = how.removesuffix(planned_past) + cache_plan(run.model.cfg.block_size, new, len(ids))[1]
        stopped = f"; stopped at --stop after {new:,} of {args.max_new_tokens:,}"
    note(f"{args.num_samples} x {new} tokens in {dt:.2f} s ({rate}, "
         f"{'no cache' if args.no_cache else how}{stopped})")  # stdout holds the text alone
