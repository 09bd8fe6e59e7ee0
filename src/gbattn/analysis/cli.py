"""``gbattn analyze`` (statistics and figures of a trained run's attention, docs/paper.md,
"Analysis") and ``gbattn plot`` (the results chart and the training curves of a comparison
directory)."""

from __future__ import annotations

import functools
import json
import math
import statistics
from pathlib import Path

from gbattn import arguments


def register(sub) -> None:
    p = sub.add_parser("analyze", help="gates, attention entropy per round, norms (and per-token gains with --against) "
                                       "of a trained run; summary.json + PNG figures")
    p.add_argument("run_dir", help="a trained run directory (GBA for gates and corrections; any run for entropy)")
    p.add_argument("--against", metavar="STANDARD_RUN_DIR",
                   help="a run with the same tokenizer and seq_len: per-token loss difference and example figure "
                        "(its weights chosen by --checkpoint too); none by default")
    p.add_argument("--split", default="test", choices=["valid", "test"], help="held-out split (default test)")
    p.add_argument("--data", default=None,
                   help="the corpus where it is now, if not where the run recorded it (default: where the run "
                        "recorded it)")
    p.add_argument("--allow-other-data", action="store_true",
                   help="analyse even if the data differs from what the run was trained on (its fingerprint)")
    p.add_argument("--out", default=None, help="output directory (default RUN_DIR/analysis)")
    p.add_argument("--max-rows", type=arguments.at_least(1), default=64,
                   help="held-out rows to analyse, evenly spaced (default 64)")
    p.add_argument("--batch-size", type=arguments.at_least(1), default=8, help="rows per batch (default %(default)s)")
    # default None: given without --against is refused (cmd_analyze); analyze_run holds the defaults
    p.add_argument("--layer", type=int, default=None,
                   help="layer of the example figure (default -1: the last); with --against only")
    p.add_argument("--top", type=arguments.at_least(0), default=None,
                   help="tokens with the largest gain listed in summary.json (default 20); with --against only")
    p.add_argument("--examples", type=arguments.at_least(0), default=None,
                   help="positions drawn in examples.png, 0 for no figure (default 3); with --against only")
    arguments.checkpoint(p)
    arguments.device(p)
    arguments.threads(p)
    p.add_argument("--pdf", action="store_true", help="also write every figure as PDF")
    arguments.quiet(p)
    p.set_defaults(func=cmd_analyze)

    p = sub.add_parser("plot", help="results chart and training curves of `gbattn compare` directories, or the "
                                    "loss gap between two models against training length (--gap)")
    p.add_argument("compare_dir", nargs="+", help="one comparison directory (several with --gap)")
    p.add_argument("--out",
                   default=None, help="output directory (default COMPARE_DIR/figures)")
    p.add_argument("--gap", default=None, metavar="MODEL",
                   help="draw MODEL's validation loss minus each --against model's, paired by seed and step, against "
                        "tokens per parameter of MODEL, one line per comparison directory (directories of one "
                        "recipe, data, settings and steps pool their seeds into one line; gap.png, gap.json; a "
                        "results.json copied without its run folders is enough; default: none, the results chart "
                        "and curves instead)")
    p.add_argument("--against", nargs="+", default=None, metavar="MODEL", help="with --gap (default: standard)")
    p.add_argument("--pdf", action="store_true", help="also write PDFs")
    p.set_defaults(func=cmd_plot)


# --------------------------------------------------------------------------------------
# analyze
# --------------------------------------------------------------------------------------




def select_rows(n_rows: int, max_rows: int):
    """``max_rows`` row indices spread evenly over the split (all rows if fewer), a numpy array."""
    import numpy as np  # the command modules import nothing heavy at load time (fast --help)

    return np.unique(np.linspace(0, n_rows - 1, min(max_rows, n_rows)).round().astype(np.int64))


# What the round-0 entropy of a variant without boosting rounds leaves out, said beside it.
NOT_ANALYSED = {
    "differential": "the entropy of each head's first map, softmax(Q1 K1^T); the map it applies, that minus "
                    "lambda times its second, is not a distribution",
    "gated": "its own output gate, G1, is not analysed",
}


def check_figures_out(out, create: bool) -> Path:
    """``analyze`` and ``plot``'s ``--out``: writable (:func:`gbattn.files.check_writable_dir`), and not a run,
    comparison, export or denoise output (:func:`gbattn.rundir.check_out`), whose folder the figures and
    summary would join as if they were its own."""
    from gbattn.files import check_writable_dir
    from gbattn.rundir import ANALYSIS_OUTPUT, check_out

    check_out(out, (ANALYSIS_OUTPUT,), "a folder of figures")  # (an earlier analysis: analyze replaces its own)
    return check_writable_dir(out, "--out", create=create)


def _describe(run) -> str:
    opts = ", ".join(f"{k}={v}" for k, v in run.model_cfg.attn_options.items())
    return run.model_cfg.attn + (f" ({opts})" if opts else "")


def _stream_words(residual: str, norm: str) -> str:
    """', attnres-block residual, Post-LN': a run's residual stream and norm where they are not the defaults
    (plain, Pre-LN), for the lines that name a run's attention."""
    return "".join([f", {residual} residual" if residual != "plain" else "", ", Post-LN" if norm == "post" else ""])


def _examples_title(this_name: str, other_name: str, layer: int, gains: list[float]) -> str:
    """The examples figure's title: "gains most" only where some drawn position gains; where
    none does, the positions drawn are where this run loses least."""
    where = f"layer {layer} attention, head-averaged"
    if max(gains, default=0.0) > 0:
        return f"Where {this_name} gains most over {other_name}: {where}"
    return f"{this_name} gains over {other_name} nowhere; where it loses least: {where}"


def _short_name(run) -> str:
    label = (run.config.get("extra") or {}).get("label")
    if label:
        return label
    cfg = run.model_cfg
    name = f"GBA M={cfg.attn_options.get('rounds', 2)}" if cfg.attn == "boosted" else cfg.attn
    return name + _stream_words(cfg.residual, cfg.norm)  # a Post-LN or AttnRes run is not the plain one


def _check_against(run, other, run_dir, against_dir) -> list[str]:
    from gbattn.errors import UserError

    if run.tokenizer.fingerprint != other.tokenizer.fingerprint:
        raise UserError(f"--against {against_dir}: its tokenizer ({other.tokenizer.fingerprint}) differs from "
                        f"{run_dir}'s ({run.tokenizer.fingerprint}); compare runs trained with the same tokenizer")
    if run.seq_len != other.seq_len:
        raise UserError(f"--against {against_dir}: seq_len {other.seq_len} differs from {run_dir}'s {run.seq_len}; "
                        f"compare runs with the same sequence length")
    notes = []
    mine, theirs = run.data_fingerprint, other.data_fingerprint
    if mine and theirs and mine != theirs:
        notes.append(f"{against_dir} was trained on another corpus; both models are evaluated on {run_dir}'s rows")
    return notes


def _context_text(tokenizer, ids: list[int], keep: int = 24) -> str:
    return tokenizer.decode(ids[-keep:], skip_special=False)


def _token_text(tokenizer, token_id: int) -> str:
    """One token as analysis shows it: a special token by its name (``<unk>``), never as nothing."""
    return tokenizer.decode([int(token_id)], skip_special=False)


def analyze_run(run_dir, against=None, split: str = "test", out=None, max_rows: int = 64, batch_size: int = 8,
                layer: int = -1, top: int = 20, examples: int = 3, checkpoint: str | None = None, device: str = "auto",
                pdf: bool = False, quiet: bool = False, data: str | None = None,
                allow_other_data: bool = False) -> dict:
    """Analyse ``run_dir`` and write ``summary.json`` and the figures into ``out``
    (default ``run_dir/analysis``); returns the summary."""
    from gbattn.analysis import figures, stats
    from gbattn.checks import check_choice
    from gbattn.data.corpus import test_split_note
    from gbattn.data.prepare import other_data_note, prepare_run_data
    from gbattn.data.tokens import num_rows
    from gbattn.errors import UserError
    from gbattn.eval.perplexity import perplexity
    from gbattn.files import folder_name, refuse_linked_folder, relative_path, remove_unwritten, write_json
    from gbattn.progress import Progress
    from gbattn.rundir import (
        ANALYSIS_DIR,
        ANALYSIS_FIGURES,
        ANALYSIS_OUTPUT,
        ANALYSIS_SUMMARY,
        RunLock,
        check_model_dir,
        folder_holds,
        load_run,
    )
    from gbattn.runtime import autocast_dtype, resolve_device

    figures.require_matplotlib()  # fail before the slow part
    if max_rows < 1 or batch_size < 1:
        raise UserError(f"--max-rows ({max_rows}) and --batch-size ({batch_size}) must be >= 1")
    if top < 0 or examples < 0:  # (-1 listed every token that gained, and drew one example per row)
        raise UserError(f"--top ({top}) and --examples ({examples}) must be >= 0")
    check_choice("split", split, ("valid", "test"))  # the held-out splits (another was a KeyError after loading)
    run_dir = check_model_dir(run_dir)  # before its default --out is derived (a file's was blamed on --out)
    if not out:
        refuse_linked_folder(run_dir / ANALYSIS_DIR, "an analysis", "--out")
    out = Path(out) if out else run_dir / ANALYSIS_DIR
    check_figures_out(out, create=False)
    # One writer, from before the slow part: a second analysis into this folder is refused at once (it was
    # refused only when its figures were drawn, its minutes of work lost).
    with RunLock(out, what="analysis"):  # (two analyses into one folder mixed their figures)
        # figures of its names are removed from an earlier analysis's folder only (its summary.json): a user's own
        # gates.png or examples.pdf were deleted as "figures an earlier analysis left"
        earlier = folder_holds(out) == ANALYSIS_OUTPUT
        dev = resolve_device(device)
        run = load_run(run_dir, checkpoint, dev)
        L = run.model_cfg.n_layers
        if not -L <= layer < L:
            raise UserError(f"--layer {layer}: the model has {L} layers (use 0..{L - 1}, or -1 for the last)")
        layer = layer % L
        notes = []
        other = None
        if against:
            other = load_run(against, checkpoint, dev)
            notes += _check_against(run, other, run_dir, against)

        data = prepare_run_data(run, data, allow_other_data, split)
        if split == "test" and test_split_note(data.notes):  # as eval says beside its test figure
            notes.append(test_split_note(data.notes).strip(" ()"))
        other_data = other_data_note(run, data)
        if other_data:  # --allow-other-data: as eval says beside its figure
            notes.append(other_data)
        tokens = data.splits[split]
        n_rows = num_rows(tokens, run.seq_len)
        if n_rows == 0:
            raise UserError(f"{data.split_of(split)} has {len(tokens):,} tokens: fewer than one row of "
                            f"{run.seq_len + 1}, so there is nothing to analyze")  # (as eval's: it named the run's)
        row_ids = select_rows(n_rows, max_rows)

        name = folder_name(run_dir)  # "." or "..": the folder's own name, not "" or ".."; a link by its own
        bar = Progress(len(row_ids), desc=f"analyze {name}", unit="row", disable=quiet)
        collected = stats.collect(run.model, tokens, run.seq_len, row_ids, batch_size, dev,
                                  against=other.model if other else None, progress=bar)
        bar.close()
        st = collected.stats
        mean_loss = float(collected.loss_NT.mean())
        if autocast_dtype(dev, run.train_cfg.amp) is not None:  # (its loss differed from eval's in the 4th decimal)
            notes.append(f"the loss is in float32; `gbattn eval` on {dev.type} scores the run in bfloat16 (its "
                         f"amp={run.train_cfg.amp}), so the two differ in the last digits")
        summary = {
            "run_dir": relative_path(run_dir, out.parent),
            "attention": _describe(run),
            "residual": run.model_cfg.residual,  # plain, attnres-full or attnres-block
            "norm": run.model_cfg.norm,  # pre (Pre-LN) or post (Post-LN)
            "checkpoint": run.checkpoint,
            "step": run.step,
            "split": split,
            "rows": len(row_ids),
            "row_ids": row_ids.tolist(),
            "seq_len": run.seq_len,
            "tokens": int(collected.loss_NT.size),
            "n_layers": L,
            "n_heads": run.model_cfg.n_heads,
            "d_model": run.model_cfg.d_model,
            "rounds": st.rounds,
            "loss": {"mean_nats": mean_loss, "ppl": perplexity(mean_loss), "precision": "float32"},
            "paper": stats.PAPER,
        }
        no_boost = (f"{_describe(run)} attention has no boosting rounds: GBA's gates and corrections do not exist "
                    f"(GBA runs only); only round-0 entropy is reported"
                    + (f" ({NOT_ANALYSED[run.model_cfg.attn]})" if run.model_cfg.attn in NOT_ANALYSED else ""))
        gates = st.gate_summary()
        if gates is None:
            notes.append(no_boost)
            summary["gates"] = {"available": False, "reason": no_boost}
        else:
            summary["gates"] = {"available": True, **gates, "paper_mean_per_layer": stats.PAPER["gate_mean_per_layer"],
                                "paper_mean_per_layer_revised": stats.PAPER["gate_mean_per_layer_revised"]}
        entropy = st.entropy_summary()
        entropy["paper"] = {k: stats.PAPER[k] for k in ("entropy_round0_nats", "entropy_correction_nats",
                                                        "entropy_relative_drop", "entropy_note")}
        entropy["paper"]["seq_len"] = stats.PAPER["seq_len"]
        summary["entropy"] = entropy
        norms = st.norm_summary(run.model_cfg.norm)
        summary["norms"] = {"available": False, "reason": no_boost} if norms is None else {"available": True, **norms}

        written: list[Path] = []
        title = f"{_short_name(run)} ({name}, {split}, {len(row_ids)} rows × {run.seq_len} tokens)"
        if gates is not None:
            fig = figures.gates_figure(gates, stats.PAPER, f"GBA gates g_m — {title}", figures.paper_gates_label(
                gates, stats.PAPER, L, _describe(run)))
            written += figures.save(fig, out, "gates", pdf)
        written += figures.save(figures.entropy_figure(entropy, stats.PAPER if st.boosted else None,
                                                       f"Attention entropy per round — {title}"), out, "entropy", pdf)
        if norms is not None:
            fig = figures.norms_figure(norms, f"Residual and gated-correction norms — {title}")
            written += figures.save(fig, out, "norms", pdf)

        if other is not None:
            summary["loss_diff"], more = _loss_difference(run, other, collected, tokens, row_ids, layer, top, examples,
                                                          dev, out, pdf)
            written += more
            corrected = [r["layer"] for r in entropy["per_layer"] if len(r["mean_per_round"]) > 1]
            if examples and corrected and layer not in corrected:  # (GBA in some layers: the default, the last one,
                # may have none, and its "round 0 vs round 1" examples held round 0 alone, unsaid)
                notes.append(f"the examples show layer {layer}, which has no correction round (attn.layers): round 0 "
                             f"only; --layer {corrected[-1]} shows the last layer that has one")
        removed = remove_unwritten(out, ANALYSIS_FIGURES, written) if earlier else []
        if removed:
            notes.append(f"removed {', '.join(removed)}: figures an earlier analysis left in this folder that this one "
                         f"does not draw")
        summary["notes"] = notes
        summary["figures"] = [relative_path(p, out) for p in written]
        write_json(summary, out / ANALYSIS_SUMMARY)
    print_summary(summary, out / ANALYSIS_SUMMARY)
    return summary


def _loss_difference(run, other, collected, tokens, row_ids, layer, top, n_examples, dev, out, pdf):
    """Per-token loss difference (other − this run), its top tokens and the example figure."""
    import numpy as np

    from gbattn.analysis import figures, stats
    from gbattn.data.tokens import rows_batch
    from gbattn.eval.perplexity import perplexity
    from gbattn.files import relative_path

    diff_NT = collected.against_loss_NT - collected.loss_NT
    flat = diff_NT.ravel()
    positive, negative, tied = stats.tie_fractions(flat)
    this_name, other_name = _short_name(run), _short_name(other)
    if this_name == other_name:
        other_name += " (against)"
    counts, edges = np.histogram(flat, bins=60)
    tok = run.tokenizer
    top_list = []
    for r, t in stats.top_gains(np.where(diff_NT > stats.TIE_NATS, diff_NT, -np.inf), top):
        x, y = rows_batch(tokens, run.seq_len, row_ids[r : r + 1])
        ids = x[0, : t + 1].tolist()
        top_list.append({"row": int(row_ids[r]), "position": t, "token": _token_text(tok, y[0, t]),
                         "context": _context_text(tok, ids), "loss": float(collected.loss_NT[r, t]),
                         "against_loss": float(collected.against_loss_NT[r, t]), "diff": float(diff_NT[r, t])})
    min_position = min(8, run.seq_len // 4)
    picks = stats.top_gains(diff_NT, n_examples, min_position=min_position, one_per_row=True)
    found = stats.attention_examples(run.model, tokens, run.seq_len, row_ids, picks, layer, dev)
    drawn = []
    for (r, t), ex in zip(picks, found):
        drawn.append(
            {
                **ex,
                "tokens": [_token_text(tok, i) for i in ex["input_ids"]],
                "target": _token_text(tok, ex["target_id"]),
                "loss": float(collected.loss_NT[r, t]),
                "against_loss": float(collected.against_loss_NT[r, t]),
            }
        )
    written = figures.save(figures.loss_diff_figure(diff_NT, this_name, other_name, stats.TIE_NATS), out,
                           "loss_diff", pdf)
    if drawn:  # --examples 0: no figure rather than an empty one
        written += figures.save(
            figures.examples_figure(
                drawn,
                layer,
                title=_examples_title(this_name, other_name, layer, [d["against_loss"] - d["loss"] for d in drawn]),
            ),
            out,
            "examples",
            pdf,
        )
    against_loss = float(collected.against_loss_NT.mean())
    summary = {
        "against": relative_path(other.run_dir, out.parent),
        "against_attention": _describe(other),
        "against_residual": other.model_cfg.residual,
        "against_norm": other.model_cfg.norm,
        "against_checkpoint": other.checkpoint,  # best, last (a run with no best.pt yet) or exported
        "against_step": other.step,
        "definition": "per token: loss of the --against run − loss of this run, nats; positive = this run better",
        "mean": float(flat.mean()),
        "median": float(np.median(flat)),
        "std": float(flat.std()),
        "tie_nats": stats.TIE_NATS,
        "fraction_positive": positive,  # this run better by more than tie_nats
        "fraction_negative": negative,
        "fraction_tied": tied,
        "loss": float(collected.loss_NT.mean()),
        "against_loss": against_loss,
        "against_ppl": perplexity(against_loss),
        "histogram": {"edges": edges.tolist(), "counts": counts.tolist()},
        "mean_by_position": diff_NT.mean(0).tolist(),
        "top_tokens": top_list,
        "examples": {"layer": layer, "min_position": min_position,
                     "positions": [{"row": ex["row"], "position": ex["position"], "target": ex["target"],
                                    "attention_per_round": ex["attention"].tolist()} for ex in drawn]},
    }
    return summary, written


def _join(values, fmt="{:.2f}", sep=" / ") -> str:
    return sep.join(fmt.format(v) for v in values)


def print_summary(summary: dict, summary_path: Path) -> None:
    """A few lines: ours beside the paper's numbers, and the files written (figure names in
    summary.json are relative to its folder; the terminal gets the full paths)."""
    from gbattn.analysis import figures
    from gbattn.rundir import weights_named
    from gbattn.terminal import printable_text

    paper = summary["paper"]
    block = _stream_words(summary["residual"], summary["norm"])  # the defaults (plain, Pre-LN) unsaid
    weights = weights_named(summary["checkpoint"], f"at step {summary['step']}")  # (changed ones: not that step's)
    run_name = printable_text(summary["run_dir"])  # (a received folder's name may hold an escape sequence)
    print(f"analyzed {run_name} ({summary['attention']}{block}, {weights}) on {summary['rows']} "
          f"{summary['split']} rows x {summary['seq_len']} tokens: "
          f"loss {summary['loss']['mean_nats']:.4f} nats, ppl {summary['loss']['ppl']:.2f}")
    g = summary["gates"]
    if g["available"]:
        several = any(r["round"] > 1 for r in g["per_layer"])
        names = [f"L{r['layer']}" + (f" g{r['round']}" if several else "") for r in g["per_layer"]]
        per = [f"{name} {r['mean']:.2f}±{r['std']:.2f}" for name, r in zip(names, g["per_layer"])]
        which = figures.paper_gates_label(g, paper, summary.get("n_layers"), summary["attention"])
        print(f"  gates, mean±std per layer:   {' / '.join(per)}    {which}: {_join(paper['gate_mean_per_layer'])} "
              f"(revision {_join(paper['gate_mean_per_layer_revised'])})")
    else:
        print(f"  gates: {g['reason']}")
    e = summary["entropy"]
    means = e["mean_per_round"]
    line = "  entropy, nats (bound log(t+1), max {:.2f}): ".format(e["max_possible"])
    layers = e.get("layers_per_round") or []
    partial = len(set(layers)) > 1  # GBA in some layers only: round 0's mean is over more layers than round 1's
    line += " -> ".join(f"round {m} {v:.2f}" + (f" ({figures.count_words(layers[m], 'layer')})" if partial else "")
                        for m, v in enumerate(means))
    if e.get("relative_drop") is not None:
        per_layer = ", ".join(f"L{r['layer']} {figures.change_percent(r['relative_drop'])}" for r in e["per_layer"]
                              if r.get("relative_drop") is not None)
        basis = ""
        if partial:  # the change is over the corrected layers only: say their own round 0 and round 1
            corrected = [r["mean_per_round"] for r in e["per_layer"] if len(r["mean_per_round"]) > 1]
            round0, round1 = (statistics.fmean(m[k] for m in corrected) for k in (0, 1))
            basis = (f"in the {figures.count_words(len(corrected), 'layer')} with a correction: "
                     f"{round0:.2f} -> {round1:.2f}, ")
        of = " round 1 against round 0" if len(means) > 2 else ""  # (after round 2's value, it read as round 2's)
        line += (f" ({basis}{figures.change_words(e['relative_drop'])}{of}; change per layer {per_layer})    "
                 f"paper: {paper['entropy_round0_nats']:.2f} -> {paper['entropy_correction_nats']:.2f} "
                 f"({figures.change_words(paper['entropy_relative_drop'])}, layer 0 the exception, "
                 f"T={paper['seq_len']})")
    print(line)
    n = summary["norms"]
    if n["available"]:
        several = any(r["round"] > 1 for r in n["per_layer"])  # named like the gates (GBA may skip layers)
        print("  norms per layer, |r| -> |g*c| -> |x-F after|: " + " / ".join(
            f"L{r['layer']}" + (f" round {r['round']}" if several else "")
            + f" {r['residual']:.2f}->{r['gated_correction']:.2f}->{r['residual_after']:.2f}" for r in n["per_layer"]))
    d = summary.get("loss_diff")
    if d:
        best = d["top_tokens"][0] if d["top_tokens"] else None
        weights = weights_named(d["against_checkpoint"], f"at step {d['against_step']}")
        other = d["against_attention"] + _stream_words(d.get("against_residual", "plain"), d.get("against_norm", "pre"))
        print(f"  vs {d['against']} ({other}, {weights}): loss {d['against_loss']:.4f} -> "
              f"{d['loss']:.4f} nats; "
              f"per-token gain mean {d['mean']:+.4f}, median {d['median']:+.4f}; this run better on "
              f"{100 * d['fraction_positive']:.0f}% of tokens, worse on {100 * d['fraction_negative']:.0f}%, "
              f"within {d['tie_nats']:g} nats on {100 * d['fraction_tied']:.0f}%"
              + (f"; largest gain {best['diff']:+.2f} on {best['token']!r}" if best else ""))
    for note in summary.get("notes", []):  # the "no boosting rounds" note is on the gates line already
        if not note.startswith(f"{summary['attention']} attention "):
            print(f"  note: {note}")
    folder = Path(summary_path).parent
    print(printable_text("  figures: " + ", ".join(str(folder / name) for name in summary["figures"])))
    print(printable_text(f"  summary: {summary_path}"))


AGAINST_ONLY = ("layer", "top", "examples")  # analyze's options of the per-token gains over --against


def cmd_analyze(args) -> None:
    from gbattn.errors import UserError
    from gbattn.runtime import set_threads

    given = {name: getattr(args, name) for name in AGAINST_ONLY if getattr(args, name) is not None}
    if given and not args.against:  # (they were taken and changed nothing)
        flags = [f"--{name}" for name in given]
        flags = " and ".join(filter(None, [", ".join(flags[:-1]), flags[-1]]))
        raise UserError(f"{flags} {'goes' if len(given) == 1 else 'go'} with --against STANDARD_RUN_DIR (the "
                        f"per-token gains of this run over that one)")
    set_threads(args.threads)
    analyze_run(args.run_dir, against=args.against, split=args.split, out=args.out, max_rows=args.max_rows,
                batch_size=args.batch_size, checkpoint=args.checkpoint, device=args.device or "auto", pdf=args.pdf,
                quiet=args.quiet, data=args.data, allow_other_data=args.allow_other_data, **given)


# --------------------------------------------------------------------------------------
# plot
# --------------------------------------------------------------------------------------


def numbers(event: dict, *keys: str) -> bool:
    """Whether every key of a metrics event holds a finite number that fits a float (a damaged line is skipped
    like a cut one: gbattn writes a non-finite value as null, so NaN, Infinity or a 400-digit count is damage)."""
    from gbattn.experiments.report import is_number

    return all(is_number(event.get(k)) and math.isfinite(event[k]) for k in keys)


def seed_metrics(compare_dir: Path, label: str) -> list[tuple[str, Path]]:
    """(seed, path) of ``<label>/seed<S>/metrics.jsonl`` for each run folder of a model, S as `gbattn compare`
    names it (a non-negative integer): a copy such as ``seed42.bak`` is not a run of seed "42.bak"."""
    from gbattn.rundir import METRICS

    found = []
    for path in sorted((compare_dir / label).glob("seed*/" + METRICS)):
        seed = path.parent.name[len("seed"):]
        if seed.isascii() and seed.isdecimal() and str(int(seed)) == seed:
            found.append((seed, path))
    return found


def check_evaluations(compare_dir: Path, label: str, seed: str, events: list, row: dict) -> None:
    """Refuse the evaluations of a finished run's metrics.jsonl (``events``) that are not the ones results.json's
    ``row`` records for it: its folder holds another run (a copy of another comparison's, say), whose curve was
    drawn and paired beside the table of this one. Evaluations at steps results.json does not record (a cut
    file, or results.json written by hand) are not compared."""
    from gbattn.errors import UserError
    from gbattn.rundir import valid_curve

    curves = row.get("curves")
    recorded = curves.get(seed) if isinstance(curves, dict) else None
    if not valid_curve(recorded):  # (results.json written before they recorded curves: nothing to check against)
        return
    recorded = {p["step"]: (p["tokens"], p.get("valid_loss")) for p in recorded}
    for e in events:  # (a step that is no integer is a damaged line, skipped as the curves do: [4] was a traceback)
        if e.get("event") == "eval" and type(e.get("step")) is int and recorded.get(e["step"], ()) not in (
                (), (e.get("tokens"), e.get("valid_loss"))):
            raise UserError(f"{compare_dir / label / f'seed{seed}'} holds another run than {compare_dir}'s "
                            f"results.json records for {label} seed {seed} (its evaluation at step {e.get('step')} "
                            f"differs): put back that run, or run `gbattn compare` on it again")


def read_curves(compare_dir: Path, report: dict) -> dict:
    """label -> seed -> {"train": [(tokens, loss)], "valid": [(tokens, ppl)]} from every
    ``<label>/seed<S>/metrics.jsonl`` (finished runs in results.json order, then unfinished ones)."""
    from gbattn.experiments.recipes import RECIPES
    from gbattn.files import iter_jsonl
    from gbattn.rundir import METRICS

    labels = [r["label"] for r in report.get("models", [])]
    found = sorted(compare_dir.glob("*/seed*/" + METRICS))
    for path in found:
        if path.parent.parent.name not in labels:
            labels.append(path.parent.parent.name)
    curves: dict = {}
    rows = {r["label"]: r for r in report.get("models", [])}
    for label in labels:
        for seed, path in seed_metrics(compare_dir, label):
            train, evaluations = [], []  # a line at a time: a million lines were held whole (1.37 GB for 130 MB)
            for e in iter_jsonl(path):
                if e.get("event") == "train" and numbers(e, "tokens", "loss"):
                    train.append((e["tokens"], e["loss"]))
                elif e.get("event") == "eval":
                    evaluations.append(e)
            if label in rows:
                check_evaluations(compare_dir, label, seed, evaluations, rows[label])
            valid = [(e["tokens"], e["valid_ppl"]) for e in evaluations if numbers(e, "tokens", "valid_ppl")]
            if train or valid:
                curves.setdefault(label, {})[seed] = {"train": train, "valid": valid}
    # A model that continues another's trained weights is drawn after that model's tokens; one not finished yet (no
    # row) by its recipe's record of what it continues (it was drawn from 0, over the start of that model's curve)
    recipe = RECIPES.get(report.get("recipe"))
    continues = {spec.label: spec.init_from for spec in (recipe.models if recipe else ()) if spec.init_from}
    for label in curves:
        _, before = trained_before({**rows, label: rows.get(label, {"init_from": continues.get(label)})}, label)
        if before:
            curves[label] = {seed: {kind: [(t + before, v) for t, v in points]
                                    for kind, points in c.items()} for seed, c in curves[label].items()}
    return curves


def trained_before(rows: dict, label: str) -> tuple[int, int]:
    """(steps, train tokens) the model ``label`` of results.json's ``rows`` (label -> row) was trained for before its
    own first step: those of the model whose trained weights it continues (``init_from``, whose steps and tokens its
    own count from the start of the continuation), or (0, 0). The curves figure draws a continuation after them, and
    --gap pairs it with a model trained from scratch at the same whole training length."""
    from gbattn.experiments.report import is_number

    base = rows.get(rows[label].get("init_from"))
    # (a count: not a bool, and not a 400-digit number, which no float holds)
    if base and isinstance(base.get("train_tokens"), int) and is_number(base["train_tokens"]):
        return base["steps"], base["train_tokens"]
    return 0, 0


def read_comparison(compare_dir: Path) -> dict:
    """The results.json of a comparison directory (:func:`gbattn.experiments.report.read_report`); a folder
    gbattn recognises as something else (a run, an export, a denoise output, one model's seeds) is one line
    naming what it holds."""
    from gbattn.errors import UserError
    from gbattn.experiments.report import read_report
    from gbattn.files import did_you_mean_path, refuse_not_regular
    from gbattn.rundir import COMPARISON, RUN, folder_holds

    try:
        held = folder_holds(compare_dir)
    except OSError:  # a folder that cannot be searched: the results.json check below says so
        held = None
    if held is not None and held != COMPARISON and not held.startswith("a results.json"):
        hint = "; `gbattn analyze` reads a run" if held == RUN else ""
        raise UserError(f"{compare_dir} holds {held}, not a `gbattn compare` directory: `gbattn plot` draws a "
                        f"comparison's results.json and curves{hint}")
    if not (compare_dir / "results.json").is_file():
        refuse_not_regular(compare_dir / "results.json")
        if held == COMPARISON:  # its recipe.json: a comparison stopped before its first run finished
            raise UserError(f"{compare_dir} is a comparison with no finished run yet (no results.json, which "
                            f"`gbattn compare` writes as each run finishes): plot it once one has")
        if compare_dir.exists() and not compare_dir.is_dir():  # not "FILE/results.json not found"
            raise UserError(f"{compare_dir} is a file, not a `gbattn compare` directory")
        raise UserError(f"{compare_dir / 'results.json'} not found: is {compare_dir} a `gbattn compare` "
                        f"directory?{did_you_mean_path(compare_dir)}")  # runs/cpu-chra for runs/cpu-char
    return read_report(compare_dir / "results.json")


def plot_compare(compare_dir, out=None, pdf: bool = False) -> list[Path]:
    """results.png and curves.png of a comparison directory, from results.json and each run's
    metrics.jsonl only (no model is loaded). A UserError names every run that results.json lists
    but whose curves are missing (a copied results.json without its run directories)."""
    from gbattn.analysis import figures
    from gbattn.errors import UserError
    from gbattn.experiments.report import run_steps_text
    from gbattn.files import refuse_linked_folder, remove_unwritten
    from gbattn.rundir import METRICS, RunLock

    figures.require_matplotlib()
    compare_dir = Path(compare_dir)
    report = read_comparison(compare_dir)
    if not out:
        refuse_linked_folder(compare_dir / "figures", "a comparison's figures", "--out")
    out = Path(out) if out else compare_dir / "figures"
    curves = read_curves(compare_dir, report)
    missing = []  # runs results.json lists whose curves cannot be read: a partial figure would mislead
    for row in report.get("models", []):
        for seed in row.get("seeds", []):
            if str(seed) in curves.get(row["label"], {}):
                continue
            run = f"{row['label']}/seed{seed}"
            if not (compare_dir / run).is_dir():
                missing.append(f"{run}/ (no directory)")
            elif not (compare_dir / run / METRICS).is_file():
                missing.append(f"{run}/{METRICS} (no file)")
            else:
                missing.append(f"{run}/{METRICS} (no train or eval events)")
    if missing:
        raise UserError(f"cannot plot {compare_dir}: results.json lists runs whose curves are missing: "
                        f"{', '.join(missing)}; copy every run directory along with results.json")
    if not curves:
        raise UserError(f"cannot plot {compare_dir}: no run has curves (results.json lists no finished run and no "
                        f"<label>/seed<S>/{METRICS} holds train or eval events)")
    check_figures_out(out, create=True)
    rows = report.get("models", [])
    finished = {(row["label"], str(seed)) for row in rows for seed in row.get("seeds", [])}
    unfinished = [f"{label} seed {seed}" for label, runs in curves.items() for seed in runs
                  if (label, seed) not in finished]
    # Runs asked for and not finished that left no curve (results.json's "missing", LABEL/seedN): named, not silently
    # absent from a figure titled "every run".
    not_drawn = [run for run in report.get("missing") or []
                 if run.rpartition("/seed")[2] not in curves.get(run.rpartition("/seed")[0], {})]
    setting = f"{report.get('recipe', '')} on {report.get('data', '')} ({run_steps_text(rows)})"
    with RunLock(out, what="folder of figures"):  # one writer: two plots into one --out mixed their figures
        written = figures.save(figures.results_figure(report), out, "results", pdf)
        written += figures.save(figures.curves_figure(curves, setting, unfinished, not_drawn), out, "curves", pdf)
        remove_unwritten(out, ("results", "curves"), written)  # PDFs of an earlier --pdf, now out of date
    return written


def gap_series(compare_dirs: Path | list[Path], model: str, reference: str, read=None) -> dict:
    """``model``'s validation loss minus ``reference``'s at every evaluation both ran (same seed and
    step), averaged over the seeds results.json lists as finished for both (a run still training would add
    its early points only), against the tokens per parameter ``model`` had seen. A finished seed whose run
    folder is not there (results.json copied alone, as in the repository's ``results/``) is read from the
    validation curve results.json records for it, the same evaluations; ``reference_steps``
    says how long the reference trained (a compute-matched one trains longer: its end is not paired). Several
    directories (one comparison continued elsewhere with ``--seeds``, see :func:`same_comparison`) pool their
    seeds; a seed in two of them is one line. Each directory is named by its own name, also when given as ``.``
    or ``..``, the names joined with " + ". A model that continues another's trained weights (``init_from``,
    the upcycle recipe's) counts its steps and tokens from the start of its continuation: those of the model it
    continues are added (:func:`trained_before`, as the curves figure draws it), so that it is paired with a model
    trained from scratch at the same whole training length, and its ``steps`` are the whole training's. ``read``:
    how a directory's results.json is read (default :func:`read_comparison`)."""
    from gbattn.checks import did_you_mean
    from gbattn.errors import UserError
    from gbattn.experiments.report import is_loss, is_perplexity
    from gbattn.files import folder_name, iter_jsonl
    from gbattn.rundir import METRICS, valid_curve
    from gbattn.terminal import note

    compare_dirs = [compare_dirs] if isinstance(compare_dirs, Path) else compare_dirs
    name = " + ".join(folder_name(d) for d in compare_dirs)
    losses: dict[str, dict[tuple[str, int], tuple[int, float]]] = {}
    seen: dict[tuple[str, str], Path] = {}  # (label, seed) -> the directory it came from
    first: dict = {}
    for compare_dir in compare_dirs:
        rows = {r["label"]: r for r in (read or read_comparison)(compare_dir).get("models", [])}
        for label in (model, reference):
            if label not in rows:
                raise UserError(f"{compare_dir} has no finished {label!r} runs{did_you_mean(label, list(rows))} "
                                f"(it has {', '.join(rows) or 'none'})")
        first = first or rows
        for label in (model, reference):
            finished = {str(seed) for seed in rows[label].get("seeds", [])}
            # a seed that diverged (no test perplexity) is left out of every mean of results.md: it was paired here
            test_ppl = rows[label].get("test_ppl") or {}
            diverged = sorted((s for s in finished if s in test_ppl and not is_perplexity(test_ppl[s])), key=int)
            if diverged:
                several = len(diverged) > 1
                note(f"note: {compare_dir}: {label} seed{'s' if several else ''} {', '.join(diverged)} diverged (no "
                     f"test perplexity) and {'are' if several else 'is'} left out of the gap, as results.md's means "
                     f"leave {'them' if several else 'it'} out")
                finished -= set(diverged)
            for seed in sorted(finished):
                if (label, seed) in seen:
                    raise UserError(f"{label} seed {seed} is in both {seen[label, seed]} and {compare_dir}: "
                                    f"plot one of them")
                seen[label, seed] = compare_dir
            evaluations = {seed: [e for e in iter_jsonl(path) if e.get("event") == "eval"]
                           for seed, path in seed_metrics(compare_dir, label) if seed in finished}
            for seed, events in evaluations.items():
                check_evaluations(compare_dir, label, seed, events, rows[label])
            curves = rows[label].get("curves")
            curves = curves if isinstance(curves, dict) else {}
            for seed in sorted(finished - set(evaluations)):  # a copied comparison (results.json alone): its curves
                if valid_curve(curves.get(seed)):
                    evaluations[seed] = curves[seed]
            # A finished seed without evaluations (an emptied or cut metrics.jsonl) was left out of the mean, silently,
            # where plot refuses the same directory
            # (or whose evaluations stop before the other seeds' do, each seed of a model training as many steps: one
            # cut after its first evaluation left the later steps to the other seeds)
            evaluated_to = {seed: max((e["step"] for e in events if type(e.get("step")) is int), default=-1)
                            for seed, events in evaluations.items()}
            last = max([0, *evaluated_to.values()])
            lacking = [seed for seed in sorted(finished, key=int) if evaluated_to.get(seed, -1) < last]
            if lacking:
                raise UserError(f"cannot plot the gap of {compare_dir}: results.json lists {label} seed "
                                f"{', '.join(lacking)} as finished, but no {label}/seed<S>/{METRICS} nor results.json "
                                f"holds its evaluations{f' up to step {last:,}, as the other seeds do' if last else ''}"
                                f"; copy every run directory along with results.json")
            steps_before, tokens_before = trained_before(rows, label)  # a continuation: its whole training
            for seed, events in evaluations.items():
                for e in events:
                    if numbers(e, "step", "tokens", "valid_loss") and is_loss(e["valid_loss"]):
                        losses.setdefault(label, {})[(seed, steps_before + e["step"])] = (tokens_before + e["tokens"],
                                                                                          e["valid_loss"])
    paired: dict[int, list[tuple[int, float]]] = {}
    for key, (tokens, loss) in losses.get(model, {}).items():
        if key in losses.get(reference, {}):
            paired.setdefault(key[1], []).append((tokens, loss - losses[reference][key][1]))
    if not paired:
        raise UserError(f"{' + '.join(map(str, compare_dirs))}: {model} and {reference} share no evaluation (same "
                        f"seed and step)")
    parameters = first[model]["parameters"]
    points = [{"step": step, "tokens_per_parameter": statistics.fmean(t for t, _ in v) / parameters,
               "difference": statistics.fmean(d for _, d in v), "seeds": len(v)} for step, v in sorted(paired.items())]
    return {"directory": name, "steps": trained_before(first, model)[0] + first[model]["steps"], "model": model,
            "reference": reference, "reference_steps": trained_before(first, reference)[0] + first[reference]["steps"],
            "points": points}


def same_comparison(compare_dirs: list, model: str, read=None) -> list[list[Path]]:
    """The directories grouped into lines of a gap figure: those holding the same recipe on the same data with
    the same settings (result-neutral ones aside) and the same ``model`` trained as long (one comparison continued
    in another directory with ``--seeds``) are one line, in the order first given; the others a line each. ``read``
    as for :func:`gap_series`."""
    from gbattn.experiments.compare import results_part

    groups: dict[str, list[Path]] = {}
    for d in compare_dirs:
        report = (read or read_comparison)(Path(d))
        rows = {r["label"]: r for r in report["models"]}  # read_report checked: a list of rows, each labelled
        row = rows.get(model, {})
        # The settings as `gbattn compare` tells one comparison from another (a result-neutral --set, such as
        # eval_batch_size or device, is the same comparison), and what the models are: the models --model and
        # --matched added, and the variant and size of ``model`` (a label names another model in each).
        key = json.dumps([report.get("recipe"), report.get("data"), results_part("sets", report.get("sets")),
                          report.get("added"), report.get("matched"),
                          [row.get(k) for k in ("attn", "attn_options", "norm", "residual", "parameters", "steps")]],
                         sort_keys=True, default=str)
        groups.setdefault(key if report.get("recipe") else str(Path(d).resolve()), []).append(Path(d))
    return list(groups.values())


def plot_gap(compare_dirs: list, model: str, references: list[str], out=None, pdf: bool = False) -> list[Path]:
    """gap.png and gap.json (with the command that wrote it): ``model`` minus each reference against training
    length, one line per comparison (directories that continue one another pool their seeds); ``out``: the first
    comparison's figures/ by default, as :func:`plot_compare`'s."""
    from gbattn.analysis import figures
    from gbattn.errors import UserError
    from gbattn.files import refuse_linked_folder, remove_unwritten, write_json
    from gbattn.rundir import RunLock
    from gbattn.runtime import command_line

    figures.require_matplotlib()
    if not out:  # (one planted there had gap.png written and gap.pdf deleted through it)
        refuse_linked_folder(Path(compare_dirs[0]) / "figures", "a comparison's figures", "--out")
    out = Path(out) if out else Path(compare_dirs[0]) / "figures"
    if model in references:
        raise UserError(f"--against {model} is the --gap model itself: its gap to itself is 0 at every step")
    # Each once, in the order given: a repeat drew the same line (or panel) twice over.
    references = list(dict.fromkeys(references))
    by_path: dict = {}
    for d in compare_dirs:
        by_path.setdefault(Path(d).resolve(), d)
    compare_dirs = list(by_path.values())
    read = functools.cache(read_comparison)  # each results.json read (and checked) once, however many references
    groups = same_comparison(compare_dirs, model, read)
    series = [gap_series(group, model, ref, read) for ref in references for group in groups]
    out = check_figures_out(out, create=True)
    with RunLock(out, what="folder of figures"):  # one writer, as plot_compare
        write_json({"command": command_line(portable=True), "model": model, "references": references,
                    "series": series}, out / "gap.json")
        written = figures.save(figures.gap_figure(series, model, references), out, "gap", pdf)
        remove_unwritten(out, ("gap",), written)  # a PDF of an earlier --pdf, now out of date
    return written + [out / "gap.json"]


def cmd_plot(args) -> None:
    from gbattn.errors import UserError

    if args.against and not args.gap:  # the results chart and curves draw every model
        raise UserError("--against goes with --gap MODEL (the gap of MODEL to each --against model)")
    if args.gap:
        written = plot_gap(args.compare_dir, args.gap, args.against or ["standard"], args.out, args.pdf)
    elif len(args.compare_dir) > 1:
        raise UserError("several comparison directories go with --gap MODEL; plot them one at a time otherwise")
    else:
        written = plot_compare(args.compare_dir[0], args.out, args.pdf)
    from gbattn.terminal import printable_text

    print(printable_text("figures: " + ", ".join(str(p) for p in written)))
