"""``gbattn export``: a run directory as a Hugging Face model directory.

The directory holds what ``save_pretrained`` writes (``config.json``, ``generation_config.json``,
``model.safetensors``: no pickle) and the tokenizer in transformers' form (``tokenizer.json``,
``tokenizer_config.json``), so that after ``import gbattn.hf`` the Auto classes load it offline;
plus gbattn's own tokenizer file, ``gbattn-tokenizer.json``. ``config.json`` carries gbattn's own
config.json content (model, train, preset, data, seq_len, ...) and the exported ``step`` under the
key ``gbattn``, so ``gbattn eval | generate | analyze`` take the directory too
(``gbattn.rundir.load_run``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from transformers.utils import logging as hf_logging

from gbattn import rundir
from gbattn.errors import UserError
from gbattn.files import (
    building_suffix,
    full_disk_reason,
    portable_path,
    remove_abandoned,
    sync_directory,
    write_json,
)
from gbattn.hf.modeling import GbattnForCausalLM
from gbattn.hf.tokenization import hf_tokenizer, model_token_ids
from gbattn.rundir import (
    CONFIG,
    EXPORT_STAGING,
    SAFETENSORS_INDEX,
    UNFINISHED_EXPORT,
    LoadedRun,
    load_run,
)

GBATTN_TOKENIZER = rundir.EXPORTED_TOKENIZER
# Files transformers may write beside a model and its tokenizer that an export does not always write (4.x writes
# special_tokens_map.json, 5.x does not): transformers reads an earlier export's over the new tokenizer's own.
TRANSFORMERS_SIDE_FILES = ("special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                           "chat_template.json", "generation_config.json")


@contextlib.contextmanager
def quiet_transformers():
    """transformers' progress bars and load reports off: gbattn reports what went wrong itself."""
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def portable_paths(section: dict) -> dict:
    """The run's config without the paths of this machine (a directory to share): the data path,
    a start run's path, the corpus name and a tokenizer file's path (``--tokenizer hf=PATH``) become
    their last component, a file's with its folder (``files.portable_path``); ``gbattn eval EXPORT
    --data PATH`` names the data where it is elsewhere."""
    section = json.loads(json.dumps(section))
    for part, key in (("train", "data"), ("train", "init_from"), ("data", "corpus"), ("extra", "init_from")):
        record = section.get(part)
        if isinstance(record, dict) and isinstance(record.get(key), str):
            record[key] = portable_path(record[key])
    train = section.get("train")
    if isinstance(train, dict) and isinstance(train.get("tokenizer"), str) and "=" in train["tokenizer"]:
        kind, path = train["tokenizer"].split("=", 1)  # gpt2=PATH, hf=PATH
        train["tokenizer"] = f"{kind}={portable_path(path)}"
    return section


def wrap_run(run: LoadedRun):
    """(model, tokenizer) in transformers' form of a loaded run; the model shares the run's GPT
    (README, "Hugging Face transformers")."""
    if not isinstance(run, LoadedRun):  # (a path, as export_run takes: "'str' object has no attribute 'tokenizer'")
        raise TypeError(f"wrap_run takes a loaded run (gbattn.load_run(path)), not a {type(run).__name__}")
    tokenizer = hf_tokenizer(run.tokenizer, run.model_cfg.block_size)
    section = portable_paths({k: v for k, v in run.config.items() if k != "model"})
    section["step"] = run.step
    if run.checkpoint != rundir.EXPORTED:  # (a re-export keeps the run's best or last; changed weights say so)
        section["checkpoint"] = run.checkpoint
    # which weights these are: weights saved over them later (fine-tuned, another dtype) are not this step's
    section["weights_digest"] = rundir.weights_digest(run.model.state_dict())
    model = GbattnForCausalLM.from_gpt(run.model, run=section, **model_token_ids(tokenizer))
    return model, tokenizer


def portable_tokenizer_class(config_path: Path) -> None:
    """Name the tokenizer class every supported transformers version has: 5.x writes its own
    ``TokenizersBackend``, which ``AutoTokenizer`` of 4.x cannot load; both load the fast tokenizer."""
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("tokenizer_class") != "PreTrainedTokenizerFast":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        write_json(config, config_path)


def export_run(run_dir: str | Path, out: str | Path, checkpoint: str | None = None) -> Path:
    """Write the exported directory ``out`` for run ``run_dir`` (``best`` weights, the default, or ``last``)
    (README, "Hugging Face transformers")."""
    run_dir, out = rundir.as_directory(run_dir, "run_dir"), rundir.as_directory(out, "out")
    if out.exists() and run_dir.exists() and out.resolve() == run_dir.resolve():
        raise UserError(f"--out {out} is the run directory itself; export to another directory")
    rundir.check_out(out, (rundir.EXPORT, UNFINISHED_EXPORT), "a gbattn export")  # an earlier export is replaced
    run = load_run(run_dir, checkpoint, "cpu")
    # One writer (the lock proves --out writable first, as check_writable_dir does): a training started in --out
    # meanwhile had its tokenizer.json replaced by the export's, and two exports at once could leave one's
    # config.json beside the other's weights. Checked again under the lock.
    with rundir.RunLock(out, what="export"):
        rundir.check_out(out, (rundir.EXPORT, UNFINISHED_EXPORT), "a gbattn export")
        _write_export(run, out)
    return out


def _write_export(run: LoadedRun, out: Path) -> None:
    """The export of ``run`` staged in ``out`` and moved into place (:func:`move_into_place`)."""
    remove_abandoned(out)  # the staging folders of exports killed before they finished
    staging = out / f"{EXPORT_STAGING}{building_suffix()}"
    try:
        model, tokenizer = wrap_run(run)
        try:
            with quiet_transformers():
                model.save_pretrained(staging)
                tokenizer.save_pretrained(staging)
            portable_tokenizer_class(staging / "tokenizer_config.json")
            run.tokenizer.save(staging / GBATTN_TOKENIZER)
        except Exception as e:  # (safetensors' own SafetensorError for a full disk: a traceback)
            reason = full_disk_reason(e)
            if reason is None:
                raise
            kept = "an earlier export there is kept" if (out / rundir.CONFIG).is_file() else "nothing was written"
            raise UserError(f"could not write the export to {out} ({reason}); {kept}") from None
        umask = os.umask(0)
        os.umask(umask)
        for weights in staging.glob("model*.safetensors"):  # transformers writes them (or each shard) 0600; the
            weights.chmod(0o666 & ~umask)                   # other files get the umask's
        move_into_place(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def move_into_place(staging: Path, out: Path) -> None:
    """The staged export's files into ``out`` in an order that no kill can leave looking complete: an
    earlier export's config.json is removed before anything moves, gbattn's tokenizer file moves first
    (without config.json it marks an unfinished export, which gbattn refuses to load and a new export
    replaces), config.json last (with it, gbattn and transformers take the directory for a model). An earlier
    export's weight files and transformers' side files (:data:`TRANSFORMERS_SIDE_FILES`) that this one does not
    write are removed, and so is what was measured of its weights (``rundir.discard_derived``)."""
    staged = {p.name for p in staging.iterdir()}
    blocked = sorted(name for name in staged if (out / name).is_dir() and not (out / name).is_symlink())
    if blocked:
        raise UserError(f"--out {out} has a directory named {blocked[0]} where the export writes that file; export "
                        f"to another directory")
    # analyze's and lm-eval's results of the weights replaced would read as the new ones' (first: an analyze still
    # writing there refuses this export before anything of the earlier one is touched)
    rundir.discard_derived(out)
    (out / CONFIG).unlink(missing_ok=True)
    # An earlier export's weights that this one does not replace (a single file where shards now come, or the
    # other way round) would be loaded beside or instead of the new ones; so would its tokenizer's side files.
    for old in [*out.glob("model*.safetensors"), out / SAFETENSORS_INDEX, *map(out.joinpath, TRANSFORMERS_SIDE_FILES)]:
        if old.name not in staged and (old.is_file() or old.is_symlink()):
            old.unlink()
    names = sorted(staged - {GBATTN_TOKENIZER, CONFIG})
    for name in (GBATTN_TOKENIZER, *names, CONFIG):
        os.replace(staging / name, out / name)
    sync_directory(out)
