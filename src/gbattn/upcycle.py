"""``gbattn upcycle``: a trained standard-attention model (a Hugging Face GPT-2 or Llama checkpoint,
or a gbattn run) as a model of another attention variant that computes exactly the same function
(docs/method.md, "Upcycling").

Every weight of the source is copied; the new parameters start where the new layer equals the old
one, and where they still receive gradient (never two zero factors of one product):

* ``boosted``, ``kv_source=residual`` or ``input``: the value rows W_V^m (and their bias) of every
  correction round are zero, so c_m = A_m V_m = 0 and F_m = F_0. W_Q^m, W_K^m and the gate keep
  their normal init; W_V^m gets gradient g_m * A_m^T dL/dF from the first step.
* ``boosted``, ``kv_source=shared``: c_m = A_m V_0 reuses round 0's values and cannot be zeroed, so
  the gate must be exactly 0: the ``tanh`` gate tanh(W_g [F; c] + b) with W_g = 0, b = 0. Its
  parameters get gradient c_m * dL/dF from the first step.
* ``gated``: W_theta = 0 makes every gate sigmoid(0) = 0.5, and W_out's weight is doubled (its bias
  is not): W_out' (0.5 o) = W_out o, exact in floating point. W_theta gets gradient.
* ``standard``: a copy (a conversion to a gbattn run directory).

``twicing`` (2AV - A(AV) is not AV, and it has no parameters to start at zero) and
``differential`` (another parameterisation) are refused. Command modules import torch only when
the command runs, so ``gbattn --help`` stays fast.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gbattn import arguments

UPCYCLED = ("boosted", "gated", "standard")  # the variants upcycling makes (standard: a copy)
REFUSED = {
    "twicing": "twicing cannot be upcycled exactly: its output 2AV - A(AV) differs from the source's AV and it has no "
               "parameters that could start at zero; train it from scratch, or upcycle to boosted or gated",
    "differential": "differential attention cannot be upcycled exactly: it has another parameterisation (paired "
                    "query/key halves, values twice as wide, a per-head norm) that a standard layer does not map onto; "
                    "train it from scratch, or upcycle to boosted or gated",
}


def register(sub) -> None:
    p = sub.add_parser("upcycle", help="a trained standard model (HF GPT-2/Llama or a gbattn run) as an exactly "
                       "equal model of another attention variant, for `gbattn train --init-from`")
    p.add_argument("source", help="a Hugging Face checkpoint directory (GPT2LMHeadModel or LlamaForCausalLM, or a "
                   "base GPT2Model or LlamaModel whose config ties the head, with tokenizer.json) or a gbattn run "
                   "directory of a standard-attention model")
    p.add_argument("--attn", required=True, help="the new attention variant: boosted, gated (or standard: a copy)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="attn.KEY=VALUE",
                   help="an option of the new attention variant, e.g. --set attn.rounds=3 --set attn.kv_source=input")
    p.add_argument("--out", required=True, help="the new run directory")
    p.add_argument("--seed", type=arguments.SEED, default=0,
                   help="seed of the new parameters' initialisation (default 0)")
    p.set_defaults(func=cmd_upcycle)


def cmd_upcycle(args) -> None:
    from gbattn.config import parse_sets

    sets = parse_sets(args.sets)
    check_new_run_dir(args.out)  # before the conversion: a refused --out costs no work
    result = upcycle(args.source, args.attn, attn_options(sets), seed=args.seed)
    write_run(result, args.out)
    for note in result.notes:
        print(note)
    print(result.summary(args.out))


def attn_options(sets: dict[str, Any]) -> dict[str, Any]:
    """The attention options of ``--set attn.KEY=VALUE`` (or ``attn_options.KEY=VALUE``, or ``attn_options={...}``,
    as `gbattn train` takes them); any other field is refused (the block is the source's)."""
    from gbattn.config import field_path, set_path
    from gbattn.errors import ConfigError

    other = [k for k in sets if field_path(k).split(".")[0] != "attn_options"]
    if other:
        raise ConfigError(f"--set {other[0]}: upcycle keeps the source's block and changes only the attention "
                          f"variant; give its options as attn.KEY=VALUE")
    d: dict[str, Any] = {}
    for key, value in sets.items():
        set_path(d, key, value)
    return d.get("attn_options", {})


@dataclass
class Upcycled:
    """An upcycled model: config, weights and tokenizer, and what was done."""

    source: Any  # gbattn.convert.Source
    model_cfg: Any  # ModelConfig of the new model
    state: dict
    rule: str  # how the new parameters were initialised
    copied: int  # parameters copied from the source
    new: int  # new parameters
    notes: list[str]
    seed: int = 0  # of the new parameters' initialisation

    def summary(self, out: str | Path) -> str:
        opts = ", ".join(f"{k}={json.dumps(v)}" for k, v in self.model_cfg.attn_options.items())
        source = self.source.name if self.source.name == self.source.kind else f"{self.source.kind} {self.source.name}"
        from gbattn.rundir import CHANGED, weights_named

        if self.source.checkpoint == CHANGED:  # (weights saved over an export: not its step's)
            source += f" ({weights_named(CHANGED, f'at step {self.source.step}')})"
        elif self.source.checkpoint is not None:
            source += f" ({self.source.checkpoint} weights, step {self.source.step})"
        return (f"upcycled {source} into {out}: {self.copied:,} parameters copied, "
                f"{self.new:,} new; attn={self.model_cfg.attn}{f' ({opts})' if opts else ''}: {self.rule}")


def upcycle(source, attn: str, options: dict | None = None, seed: int = 0) -> Upcycled:
    """``source`` (a path, a loaded run (``gbattn.load_run``) or a :class:`gbattn.convert.Source`) as a model of
    attention ``attn`` with ``options`` that computes the same function; see the module docstring for the rules."""
    from gbattn.attention.registry import variant_options
    from gbattn.checks import MAX_INT, check_choice, checked
    from gbattn.config import ModelConfig
    from gbattn.convert import load_source
    from gbattn.errors import UserError

    # the seed as a run's (a numpy integer was taken, then failed config.json's writing with best.pt written; 1.5
    # seeded 1 and was recorded 1.5)
    seed = checked("seed", seed, int, lambda n: 0 <= n <= MAX_INT, "an integer in [0, 2**63 - 1]")
    if attn in REFUSED:
        raise UserError(REFUSED[attn])
    # a typo is named as every command names it (did you mean ...?), among the variants upcycling makes
    check_choice("attn", attn, UPCYCLED)
    variant_options(attn, options)  # before the source, whose weights may take minutes to read (layers: checked below)
    src = load_source(source)
    if src.model_cfg.attn != "standard":
        raise UserError(f"{src.name} has attn={src.model_cfg.attn!r}: upcycling starts from a standard-attention model")
    options, notes = dict(options or {}), list(src.notes)
    shared, gate_asked = attn == "boosted" and options.get("kv_source") == "shared", options.get("gate")
    if shared and gate_asked is None:
        options["gate"] = "tanh"
    model_cfg = ModelConfig.from_dict({**src.model_cfg.to_dict(), "attn": attn, "attn_options": options})
    if shared and _has_rounds(model_cfg):  # without a correction round there is no gate: a copy
        if gate_asked is None:
            notes.append("kv_source=shared: the tanh gate (exactly 0 at the start) is used, as attn.gate was not set")
        elif gate_asked != "tanh":
            raise UserError(f"kv_source=shared reuses round 0's values, so only a gate that starts at exactly 0 keeps "
                            f"the function: use --set attn.gate=tanh (not {gate_asked!r})")
    model, copied = _copy(src, model_cfg, seed)
    rule = _initialise(model, model_cfg)
    new = sum(p.numel() for p in model.parameters()) - copied
    return Upcycled(src, model_cfg, model.state_dict(), rule, copied, new, notes, seed)


def _copy(src, model_cfg, seed: int):
    """A new :class:`GPT` (new parameters at their normal init, seeded) holding every source weight;
    a fused projection that gained rows (boosted ``input``, gated) takes the source's as its first rows."""
    import torch

    from gbattn.errors import CheckpointError
    from gbattn.model.gpt import GPT

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(model_cfg)
    target = model.state_dict()
    with torch.no_grad():
        for key, value in src.state.items():
            dst = target.get(key)
            if dst is None or dst.shape[1:] != value.shape[1:] or dst.shape[0] < value.shape[0]:
                raise CheckpointError(f"{src.name}: weight {key} has no place in the {model_cfg.attn} model")
            if dst.shape != value.shape and not key.endswith((".attn.qkv.weight", ".attn.qkv.bias")):
                raise CheckpointError(f"{src.name}: weight {key} has shape {tuple(value.shape)}, the {model_cfg.attn} "
                                      f"model's is {tuple(dst.shape)}")
            dst[: value.shape[0]].copy_(value)
        missing = sorted(k for k in target if k.rsplit(".", 1)[0] not in _new_modules(model) and k not in src.state)
        if missing:
            raise CheckpointError(f"{src.name}: the source lacks {', '.join(missing[:5])}")
    # named_parameters() names a tied parameter once
    return model, sum(src.state[name].numel() for name, _ in model.named_parameters() if name in src.state)


def _new_modules(model) -> set[str]:
    """Names of the modules that only the new variant has (the correction rounds)."""
    return {name for name, _ in model.named_modules() if ".corrections." in name}


def _has_rounds(cfg) -> bool:
    """Whether a boosted model has a correction round in some layer (attn.rounds > 1, attn.layers not empty)."""
    from gbattn.attention.registry import variant_options

    options = variant_options(cfg.attn, cfg.attn_options)
    return options.rounds > 1 and options.layers != []


def _zero_rows(linear, rows: slice) -> None:
    linear.weight[rows] = 0
    if linear.bias is not None:
        linear.bias[rows] = 0


def _initialise(model, cfg) -> str:
    """Apply the function-preserving start of ``cfg.attn`` to the new parameters; returns its description."""
    import torch

    from gbattn.attention.registry import variant_options

    options = variant_options(cfg.attn, cfg.attn_options, cfg.n_heads, cfg.kv_heads, cfg.n_layers)
    with torch.no_grad():
        for block in model.blocks:
            attn = block.attn
            q, kv = attn.q_width, attn.kv_width
            if cfg.attn == "gated":
                attn.qkv.weight[q + 2 * kv:] = 0  # W_theta (no bias): every gate sigmoid(0) = 0.5
                attn.out.weight.mul_(2)  # W_out (0.5 o) * 2 = W_out o, exactly
            for m, correction in enumerate(getattr(attn, "corrections", []), start=1):
                if options.kv_source == "residual":
                    _zero_rows(correction.proj, slice(q + kv, q + 2 * kv))
                elif options.kv_source == "input":
                    lo = q + 2 * kv + 2 * kv * (m - 1)
                    _zero_rows(attn.qkv, slice(lo + kv, lo + 2 * kv))
                else:
                    correction.gate.proj.weight.zero_()
                    correction.gate.proj.bias.zero_()
    if cfg.attn == "gated":
        return "gate projection W_theta zeroed (every gate sigmoid(0) = 0.5) and W_out's weight doubled"
    if cfg.attn == "standard":
        return "a copy (no new parameters)"
    if not _has_rounds(cfg):
        return "a copy: no layer has a correction round (attn.rounds=1 or no attn.layers), so no new parameters"
    if options.kv_source == "shared":
        return ("tanh gates zeroed (W_g = 0, b = 0: g_m = 0, gradient c_m * dL/dF); the correction queries W_Q^m "
                "at their normal init")
    where = "correction projections" if options.kv_source == "residual" else "fused input projection"
    rest = "W_Q^m and W_K^m at their normal init, no gate (g_m = 1)" if options.gate == "none" else (
        f"W_Q^m, W_K^m and the {options.gate} gates at their normal init")
    return f"value rows W_V^m of the {where} zeroed (c_m = 0); {rest}"


def check_new_run_dir(out: str | Path) -> None:
    """The ``--out`` of an upcycled run holds nothing gbattn recognises (:func:`gbattn.rundir.check_out`): a run
    (its config.json, or weights without one: kept, gbattn cannot tell whose they are), an export, a comparison,
    results files ... are refused."""
    from gbattn import rundir
    from gbattn.errors import UserError

    out = Path(out)
    rundir.check_out(out, (rundir.RUN,), "a folder for a new run")
    if (out / rundir.CONFIG).exists():  # a directory too: config.json cannot be written there
        raise UserError(f"{out} already holds a run; choose another --out")
    rundir.refuse_weights_without_config(out)


def write_run(result: Upcycled, out: str | Path) -> Path:
    """The run directory of an upcycled model: ``tokenizer.json``, ``best.pt`` ({"model", "step": 0};
    no ``checkpoint.pt``, so ``train --init-from`` takes these weights) and ``config.json`` last (its
    ``extra`` records the source (a gbattn source's checkpoint and step too), the rule and the seed of the new
    parameters), each written atomically."""
    from gbattn import rundir
    from gbattn.config import TrainConfig
    from gbattn.errors import CheckpointError, UserError

    if not isinstance(result, Upcycled):  # (a source path: "'str' object has no attribute 'source'", --out made)
        raise TypeError(f"write_run takes what upcycle(SOURCE, attn) returns, not a {type(result).__name__}")
    out = rundir.as_directory(out, "out")  # (None was pathlib's "expected str, bytes or os.PathLike object")
    # What it holds, checked as a run's files are read back (its config, shapes and finite values: the meta model
    # is built from a checked copy of the config): a model_cfg or state changed after upcycle() (n_heads set to 3,
    # NaN weights) was written, and the run then refused as damaged
    model_cfg = result.model_cfg
    try:
        rundir.check_weights_fit(model_cfg, result.state, "the upcycled model")
    except CheckpointError as e:  # (its advice is a file's: "the file is damaged; restore a copy of it")
        reason = str(e).removesuffix(": the file is damaged; restore a copy of it")
        raise UserError(f"{reason}: changed after upcycle() (write_run writes what upcycle returns)") from None
    src = result.source
    if src.train_cfg is not None:
        train_cfg = src.train_cfg.replace(init_from=None)
    else:
        train_cfg = TrainConfig(tokenizer=src.tokenizer.kind)
    # which weights of a gbattn source (best, last or exported) at which step; a Hugging Face checkpoint has one set
    taken = {} if src.checkpoint is None else {"source_checkpoint": src.checkpoint, "source_step": src.step}
    seq_len = src.config.get("seq_len") or model_cfg.input_length(train_cfg.seq_len)  # refused before writing
    # (the lock proves --out writable, making it: made before, a stopped write left the folder behind, holding .lock)
    with rundir.RunLock(out, "upcycled model"):
        check_new_run_dir(out)  # again under the lock: another process may have written there since
        try:
            src.tokenizer.save(out / rundir.TOKENIZER)
            rundir.save_checkpoint({"model": result.state, "step": 0}, out / rundir.BEST)
            rundir.write_config(
                out, src.preset, model_cfg, train_cfg,
                {"upcycled_from": src.name, "source_kind": src.kind, **taken, "rule": result.rule,
                 "seed": result.seed},
                data=src.config.get("data", {"tokenizer": src.tokenizer.fingerprint}),
                seq_len=seq_len,
                steps=0,
                parameters=result.copied + result.new,
            )
        except BaseException:  # stopped (Ctrl-C, SIGTERM) or failed before config.json: its files go, and the same
            if not (out / rundir.CONFIG).exists():  # command runs again (they were refused as an unfinished run's)
                for name in (rundir.TOKENIZER, rundir.BEST):
                    (out / name).unlink(missing_ok=True)
            raise
    return out
