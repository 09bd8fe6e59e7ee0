"""Run directories: the one module that reads and writes them.

A run directory describes itself::

    config.json      model config, training config, preset, data fingerprint, versions
    tokenizer.json   the tokenizer (a run directory alone can encode and decode text)
    checkpoint.pt    latest state: weights, optimizer, step, RNG states, best validation so far
    best.pt          weights of the best-validation model
    metrics.jsonl    one JSON event per line (train, eval, test, resume, stop)
    result.json      the final record (written last: its presence means "finished")
    .lock            held by the one process writing the run

Its files are written here (:func:`write_config`, :func:`save_checkpoint`, :func:`append_event`,
:func:`write_result`; the tokenizer saves itself). Every file is written to a temporary name and
renamed, so a crash leaves the previous file (``gbattn.files.atomic_write``); temporary files of a
killed write are removed the next time the run is opened.
Checkpoints are read with ``torch.load(weights_only=True)``: a file that needs arbitrary unpickling
(it could run code) is refused. An exported Hugging Face directory (``config.json`` with a
``gbattn`` section, ``model.safetensors``) loads through :func:`load_run` too.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import itertools
import json
import math
import os
import pickle
import re
import secrets
import socket
import stat
import struct
import warnings
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gbattn.arguments import GENERATE_DEFAULTS
from gbattn.checks import MAX_INT, check_choice
from gbattn.config import PRESETS, ModelConfig, TrainConfig
from gbattn.data.tokenizer import Tokenizer
from gbattn.errors import CheckpointError, ConfigError, UserError, optional_module, shown
from gbattn.files import (
    append_jsonl,
    atomic_write,
    building_owner,
    check_writable_dir,
    check_writable_file,
    dangling_link,
    did_you_mean_path,
    error_detail,
    iter_jsonl,
    process_gone,
    read_json,
    refuse_lfs_pointer,
    refuse_linked_folder,
    refuse_not_regular,
    remove_unwritten,
    shell_path,
    write_json,
)
from gbattn.model.decoding import StopStrings
from gbattn.model.gpt import GPT
from gbattn.runtime import resolve_device

CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
EXPORTED_TOKENIZER = "gbattn-tokenizer.json"  # in an exported directory, tokenizer.json is transformers' form
CHECKPOINT = "checkpoint.pt"
BEST = "best.pt"
METRICS = "metrics.jsonl"
RESULT = "result.json"
LOCK = ".lock"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"  # transformers' shards
# An export being written, or stopped before it finished (hf.export): its staging folder, or gbattn's tokenizer
# file, without config.json.
EXPORT_STAGING = ".export"  # + files.building_suffix()
UNFINISHED_EXPORT = "an unfinished gbattn export"
EXPORT = "a gbattn export"  # a finished one (foreign_model)
RUN_FILES = (CONFIG, TOKENIZER, CHECKPOINT, BEST, METRICS, RESULT)
ANALYSIS_DIR = "analysis"  # `gbattn analyze RUN`'s default folder, in the run
ANALYSIS_SUMMARY = "summary.json"
ANALYSIS_FIGURES = ("gates", "entropy", "norms", "loss_diff", "examples")  # what `analyze` may draw there
LM_EVAL_DIR = "lm-eval"  # `gbattn lm-eval MODEL`'s default folder: results-*.json and samples-*.jsonl
OWN_FILES = (*RUN_FILES, LOCK, SAFETENSORS, EXPORTED_TOKENIZER)  # every file gbattn reads in a run or exported dir
REPORT_FILES = ("results.json", "results.md", "recipe.json", "bench.json", "bench.md", ANALYSIS_SUMMARY)  # its reports


# --------------------------------------------------------------------------------------
# Checkpoints and metrics
# --------------------------------------------------------------------------------------


def save_checkpoint(state: dict, path: str | Path) -> None:
    """``torch.save`` into memory, then :func:`atomic_write` the bytes: ``torch.save`` into a file
    reports a failed write (a full disk) as a ``RuntimeError``, which would bypass the one-line error."""
    buffer = io.BytesIO()
    try:
        torch.save(state, buffer)
    except RuntimeError as e:  # the buffer's MemoryError, which torch's writer reports as "unexpected pos": the CLI's
        if isinstance(e.__context__, MemoryError):  # out-of-memory line, where it was a traceback
            kept = "; the previous one is kept" if Path(path).exists() else ""
            raise MemoryError(f"the checkpoint {Path(path).name} could not be built in memory to be written"
                              f"{kept}") from None
        raise
    with buffer.getbuffer() as content:
        atomic_write(path, content)


def remove_debris(directory: str | Path) -> list[str]:
    """Delete temporary files that a killed or failed write left (``*.tmp<pid>@<host>``, ``*.tmp<pid>`` before
    the host was named), whoever wrote them (the caller holds the run's lock), but a live process's of this host:
    a reader writing beside the run (``eval --per-token RUN/losses.txt``) or probing it for writing lost its file
    mid-write. Another host's process cannot be asked: the lock says it writes no more. Returns their names."""
    removed = []
    for path in Path(directory).glob("*.tmp*"):
        pid, host = building_owner(path.name)
        if not (path.is_file() and pid.isdigit()):
            continue
        if host in ("", socket.gethostname()) and not process_gone(int(pid)):
            continue
        path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed


def foreign_model(directory: str | Path) -> str | None:
    """What a directory holds when it is a model directory other than a gbattn run (a Hugging Face
    checkpoint, a gbattn export), in words; None otherwise (a run, an empty or unrelated directory,
    or a run whose config.json is damaged)."""
    directory = Path(directory)
    try:
        config = read_json(directory / CONFIG)
    except CheckpointError:  # none, or damaged: no model directory's
        config = None
    if isinstance(config, dict) and config.get("model_type") == "gbattn":
        trained_on = any((directory / n).exists() for n in ("trainer_state.json", "optimizer.pt"))
        return (EXPORT if (directory / EXPORTED_TOKENIZER).is_file() and not trained_on
                else "a transformers checkpoint of a gbattn model")
    if isinstance(config, dict) and "model_type" in config:
        return f"a Hugging Face checkpoint ({config['model_type']})"
    if not (directory / CONFIG).exists() and ((directory / EXPORTED_TOKENIZER).is_file()
                                              or any(directory.glob(f"{EXPORT_STAGING}.tmp*"))):
        return UNFINISHED_EXPORT
    if (directory / SAFETENSORS).exists():
        return f"a model directory ({SAFETENSORS})"
    return None


RUN = "a run"
COMPARISON = "a `gbattn compare` comparison"
DENOISE = "a `gbattn denoise` output"
DENOISE_RESULTS_KEYS = ("protocol", "tables", "runs")  # in every results.json gbattn denoise has written
ANALYSIS_OUTPUT = "a `gbattn analyze` output"  # its summary.json (beside its figures)
ANALYSIS_SUMMARY_KEYS = ("run_dir", "attention", "entropy", "figures")  # in every summary.json analyze writes


def folder_holds(directory: str | Path) -> str | None:
    """What a folder holds, in words: :data:`RUN` (its config.json or weights), a model of another kind
    (:func:`foreign_model`: :data:`EXPORT`, :data:`UNFINISHED_EXPORT`, a Hugging Face checkpoint, ...),
    :data:`COMPARISON` (recipe.json, or a results.json with models), :data:`DENOISE` (a results.json with
    :data:`DENOISE_RESULTS_KEYS`), results or bench files no gbattn command wrote, :data:`ANALYSIS_OUTPUT` (its
    summary.json), run directories (one model's seeds in a comparison); None for an empty or missing folder, or one
    of other files only."""
    directory = Path(directory)
    if any((directory / name).exists() for name in (CHECKPOINT, BEST)):
        return RUN
    held = foreign_model(directory)
    if held:
        return held
    if (directory / CONFIG).is_file():  # a run, or one whose config.json is damaged
        return RUN
    if (directory / "recipe.json").is_file():  # a comparison, perhaps with an export or a copied run beside its models
        return COMPARISON
    held = _report_pair(directory, "results", _results_kind) or _report_pair(directory, "bench", _bench_kind)
    if held:
        return held
    if (directory / ANALYSIS_SUMMARY).is_file():  # (train, upcycle and export wrote a model beside another's figures)
        return _summary_kind(directory / ANALYSIS_SUMMARY)
    runs = sorted(p.parent.name for p in directory.glob(f"*/{CONFIG}"))
    if runs:
        return f"run directories ({', '.join(runs[:3])}{', ...' if len(runs) > 3 else ''})"
    return None


def _report_pair(directory: Path, stem: str, kind_of) -> str | None:
    """What ``STEM.json`` and the ``STEM.md`` gbattn writes beside it say a folder holds, in words: ``kind_of`` of
    the JSON object (a kind, a file no gbattn command wrote, or None for a command's own that is no kind), a JSON
    file gbattn cannot read, or a markdown file alone; None for neither file."""
    path = directory / f"{stem}.json"
    if not path.is_file():
        alone = (directory / f"{stem}.md").is_file()
        return f"a {stem}.md without the {stem}.json gbattn writes beside it" if alone else None
    try:
        content = read_json(path)
    except CheckpointError as e:  # its message names the file: "it" here
        return f"a {stem}.json that gbattn cannot read (it {str(e).removeprefix(f'{path} ')})"
    return kind_of(content)


def _summary_kind(path: Path) -> str:
    """:data:`ANALYSIS_OUTPUT` for the summary.json `gbattn analyze` writes; one it did not write (a user's own, which
    analyze replaced, removing figures of its names beside it as "an earlier analysis's") or cannot read, in words."""
    try:
        summary = read_json(path)
    except CheckpointError as e:
        return f"a {ANALYSIS_SUMMARY} that gbattn cannot read (it {str(e).removeprefix(f'{path} ')})"
    if all(key in summary for key in ANALYSIS_SUMMARY_KEYS):
        return ANALYSIS_OUTPUT
    return f"a {ANALYSIS_SUMMARY} that `gbattn analyze` did not write"


def _results_kind(results: dict) -> str:
    if "models" in results:
        return COMPARISON
    if all(key in results for key in DENOISE_RESULTS_KEYS):
        return DENOISE
    return "a results.json that neither `gbattn compare` nor `gbattn denoise` wrote"


def _bench_kind(bench: dict) -> str | None:
    """None for a benchmark's own bench.json (``bench --out`` continues or replaces it)."""
    command, rows = bench.get("command"), bench.get("variants")
    if not (isinstance(command, str) and command.startswith("gbattn bench") and isinstance(rows, list)):
        return "a bench.json that `gbattn bench` did not write"
    return None


def check_out(directory: str | Path, own: tuple[str, ...], output: str) -> str | None:
    """The one rule of every command writing a folder (train, compare, denoise, export, upcycle, bench): an ``--out``
    holding anything gbattn recognises (:func:`folder_holds`) but the command's ``own`` kinds is refused, before
    any work and before its lock is taken, so it stays untouched; ``output`` names what the command writes.
    Returns what it holds (one of ``own``, or None)."""
    try:
        held = folder_holds(directory)
    except OSError as e:  # a folder that cannot be searched (no x permission): its files cannot be seen
        raise UserError(f"--out {directory} cannot be read ({e.strerror or e})") from None
    if held is not None and held not in own:
        raise UserError(f"--out {directory} holds {held}, not {output}: choose another --out")
    return held


def refuse_weights_without_config(directory: str | Path, then: str | None = None) -> None:
    """Weights without the config.json that train writes before any and upcycle after them (one stopped before it
    finished) are nobody's run that gbattn can name: kept, and refused as an ``--out``, so that nothing replaces
    them unasked, and as a run to read (``then``: what to do instead). An ``--out`` (``then`` None) holding a
    tokenizer.json without config.json is refused too: upcycle would replace it and train would keep it as the new
    run's (another program's file, such as a Hugging Face tokenizer folder's, or an upcycle stopped after writing
    it)."""
    directory = Path(directory)
    if (directory / CONFIG).exists():
        return
    weights = [name for name in (CHECKPOINT, BEST) if (directory / name).exists()]
    if weights:
        raise UserError(f"{directory} holds {' and '.join(weights)} but no {CONFIG} (written last): an upcycle or "
                        f"a run stopped before it finished; {then or f'delete {directory} or choose another --out'}")
    if then is None and (directory / TOKENIZER).exists():
        raise UserError(f"--out {directory} holds {TOKENIZER} but no {CONFIG}: not a gbattn run's (another program's "
                        f"file, or an upcycle stopped before it finished), and a new run writes its own; delete it or "
                        f"choose another --out")


def check_output_outside_data(path: str | Path, data: str, what: str) -> None:
    """An output file is neither the corpus being read (``data``, as --data names it: a file or folder here) nor a
    file in its folder, where a new file can change which files the folder's splits are read from."""
    from gbattn.data.corpus import BUNDLED, HF_NAMES

    corpus = Path(os.path.expanduser(data))  # (as load_corpus reads it: ~/c is the home directory's c)
    # a bundled or Hugging Face name (read as that corpus where a folder of its name is here too, as load_corpus does)
    if data in BUNDLED or data in HF_NAMES or not corpus.exists():
        return
    target, corpus = Path(path).resolve(), corpus.resolve()
    if target == corpus or corpus in target.parents:
        raise UserError(f"{what} {path} is {'a file of ' * (target != corpus)}the data being read (--data {data}): "
                        f"write it elsewhere")


# What to do with such weights given as a run to read (eval, generate, export, train --init-from, ...)
UNFINISHED_RUN_ADVICE = "it cannot be loaded: delete it, then upcycle or train it again"  # (its --out refuses it)


def check_output_file(path: str | Path, what: str) -> None:
    """An output file (``eval --per-token``, ``lm-eval --output``) is writable
    (:func:`gbattn.files.check_writable_file`) and never replaces a file of a model directory (a run,
    an export, a transformers checkpoint: the one evaluated or any other): its weights, configs or
    tokenizer; nor an existing report of :data:`REPORT_FILES` (a comparison's results.json). A file of another name
    there, or of such a name elsewhere, is fine."""
    check_writable_file(path, what)
    target = Path(path).resolve()
    folder = target.parent
    model_file = (target.name in (*OWN_FILES, SAFETENSORS_INDEX) or target.suffix in (".pt", ".bin", ".safetensors")
                  or target.name.endswith("config.json"))
    if model_file and any((folder / n).is_file() for n in (CONFIG, CHECKPOINT, BEST, SAFETENSORS, SAFETENSORS_INDEX)):
        raise UserError(f"{what} {path} is a file of the model directory {folder}: write it elsewhere")
    if target.name in REPORT_FILES and target.exists():
        raise UserError(f"{what} {path} would replace a report gbattn writes (compare, denoise, bench, analyze): "
                        "write it elsewhere")


def discard_derived(directory: str | Path) -> list[str]:
    """Delete what was measured of a model directory's weights into its default folders, since the weights are being
    replaced (``train --restart``, an export over an earlier one): `gbattn analyze`'s summary.json and figures in
    ``analysis/``, `gbattn lm-eval`'s results and samples in ``lm-eval/`` (they stayed, and read as the new weights');
    other files stay."""
    analysis, scores = Path(directory) / ANALYSIS_DIR, Path(directory) / LM_EVAL_DIR
    for folder, what in ((analysis, "analyze's files"), (scores, "lm-eval's scores")):
        refuse_linked_folder(folder, f"(and deletes) {what}")  # (deleted through a link planted there)
    # (under analyze's own lock: an analyze running meanwhile wrote its summary of the replaced weights after this
    # removed the old one, read as the new weights')
    with contextlib.ExitStack() as held:
        if (analysis / LOCK).is_file():  # (an analyze has run there: its lock; none made where none ran)
            held.enter_context(RunLock(analysis, what="analysis"))
        # analyze's files only where analyze wrote there (its summary.json): a user's own gates.png and summary.json
        # were deleted as analyze's, as analyze itself no longer does
        analyzed = analysis.is_dir() and folder_holds(analysis) == ANALYSIS_OUTPUT
        removed = [f"{ANALYSIS_DIR}/{name}"
                   for name in (remove_unwritten(analysis, ANALYSIS_FIGURES, []) if analyzed else [])]
        for path in (*([analysis / ANALYSIS_SUMMARY] if analyzed else []), *sorted(scores.glob("results-*.json")),
                     *sorted(scores.glob("samples-*.jsonl"))):
            if path.is_file() or path.is_symlink():
                path.unlink()
                removed.append(f"{path.parent.name}/{path.name}")
    return removed


def discard_run(directory: str | Path) -> list[str]:
    """Delete a run's own files (``--restart``, after :func:`check_out`), and what was measured of its weights in
    its default folders (:func:`discard_derived`); other files stay. config.json goes last: weights without it
    are refused (:func:`refuse_weights_without_config`), so a kill here leaves a run."""
    removed = discard_derived(directory)
    for name in (*(n for n in RUN_FILES if n != CONFIG), CONFIG):
        if (Path(directory) / name).is_file():
            (Path(directory) / name).unlink()
            removed.append(name)
    return removed


def truncate_metrics(path: str | Path, step: int) -> None:
    """On resume, drop events logged after the checkpoint's step (they will be logged again), and the
    test event of a run killed before its result.json was in place (the resumed run tests again)."""
    def kept_event(r: dict) -> bool:  # a line with a damaged step is dropped, as a line cut short is
        at = r.get("step", 0)
        redone = r.get("event") in ("stop", "test")
        return isinstance(at, int) and not isinstance(at, bool) and at <= step and not redone

    if Path(path).is_symlink():  # (its target's lines were copied into the run as its own, the link replaced)
        raise UserError(f"{path} is a link to {os.readlink(path)}: a run's {METRICS} is its own file, never read "
                        f"or written through a link; remove the link")
    # a line at a time (a million lines, 150 MB, took 1.55 GB held whole)
    atomic_write(path, (json.dumps(r) + "\n" for r in iter_jsonl(path) if kept_event(r)))


def read_torch_file(path: str | Path, map_location="cpu"):
    """What ``torch.save`` wrote to ``path``, read with ``weights_only=True`` (tensors and plain
    containers only): the one reader of such files (checkpoints, ``pytorch_model.bin``). A file that
    needs arbitrary unpickling (it could run code) is refused; a damaged one is a one-line error."""
    path = Path(path)
    if not path.is_file():
        refuse_not_regular(path)
        raise CheckpointError(f"no such file: {path}")
    _check_records(path)
    try:
        # torch warns of every protocol but 2, and of its deprecated storages and quantized tensors as it reads them:
        # lines about torch, not the file, above the one line a bad file gets
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        refuse_lfs_pointer(path)
        protocol = _pickle_protocol(path)
        if not zipfile.is_zipfile(path) and protocol is None:  # torch.save writes one of these
            raise CheckpointError(f"{path} is not a torch.save file (another kind of file, or corrupted): restore "
                                  f"a copy of it") from None
        if "weights_only" in str(e) or "Weights only load failed" in str(e):
            if protocol is not None and protocol not in (2, 3):  # torch's safe reader reads neither 0, 1 nor 4
                raise CheckpointError(f"{path} is pickled with protocol {protocol or '0 or 1'}, which torch's safe "
                                      f"reader (weights_only=True) does not read, or holds Python objects beyond "
                                      f"tensors (loading it otherwise could run code): refused; save its tensors "
                                      f"with torch.save's default protocol, or as safetensors") from None
            raise CheckpointError(f"{path} holds Python objects beyond tensors (loading it could run code): refused; "
                                  f"only files of tensors and plain values are read") from None
        detail = error_detail(e)
    # torch's safe unpickler meets damaged bytes with whatever its code raises: an IndexError (an opcode on an
    # empty stack: a text file starting with "r"), an AssertionError (a storage key it did not read), struct.error
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile, KeyError, AttributeError, IndexError,
            AssertionError, struct.error) as e:
        detail = error_detail(e, with_type=True)
    raise CheckpointError(f"{path} is truncated or corrupted ({detail}); restore a copy of it")


def _check_records(path: Path) -> None:
    """A torch.save zip file's records against the CRC-32 that torch.save stored with each. torch.load does not
    check them: a flipped bit in a weight would load as another weight, and train, evaluate or be shared so.
    A record stored with CRC 0 is not checked: torch.save with ``compute_crc32=False`` stores no checksums (a real
    CRC of 0 is 1 in 2**32). A file that zipfile cannot open is left to torch.load, which says what it makes of it."""
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, EOFError, ValueError, zipfile.BadZipFile):
        return  # BadZipFile: the legacy format (no checksums), or not a zip file at all
    with archive:
        infos = archive.infolist()
        _refuse_expanding_records(path, infos)
        for info in infos:
            if info.CRC == 0:
                continue
            try:
                with archive.open(info) as record:
                    while record.read(1 << 20):
                        pass
            except zipfile.BadZipFile as e:  # zipfile checks the CRC-32 as the record's last bytes are read
                why = ("fails the CRC-32 check that torch.save stored with it" if "CRC" in str(e)
                       else f"is damaged ({e})")
                raise CheckpointError(f"{path} is corrupted: its record {info.filename} {why}; "
                                      f"restore a copy of it") from None
            except (OSError, EOFError, ValueError, RuntimeError, NotImplementedError, zlib.error):
                return  # RuntimeError: an encrypted record; NotImplementedError: a compression zipfile lacks


def _refuse_expanding_records(path: Path, infos: list[zipfile.ZipInfo]) -> None:
    """A one-line CheckpointError where a torch.save zip file's records could expand past the file before anything
    checks them: a compressed record (torch.save stores every record as it is; a bzip2 record of 1 GiB of zeros
    takes a few KB), a record listed twice (200 listings of one record: 200 GiB read from 13 KB), or records
    declaring more bytes than the file holds."""
    seen: set[str] = set()
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"{path}: its record {info.filename} is compressed (method {info.compress_type}), "
                                  f"which torch.save never does (a compressed record can expand far past the file): "
                                  f"refused; save the weights again with torch.save")
        if info.filename in seen:
            raise CheckpointError(f"{path} lists its record {info.filename} twice, which torch.save never does: "
                                  f"the file is damaged; restore a copy of it")
        seen.add(info.filename)
    declared, size = sum(info.file_size for info in infos), path.stat().st_size
    if declared > size:
        raise CheckpointError(f"{path}: its records declare {declared:,} bytes, more than the file's {size:,}: "
                              f"the file is damaged; restore a copy of it")


# The first bytes of a legacy-format torch.save file of pickle protocol 0 or 1 (its magic number pickled without PROTO)
_LEGACY_MAGIC_NO_PROTO = b"L119547037146038801333356L"


def _pickle_protocol(path: Path) -> int | None:
    """The protocol of the pickle a torch.save file holds, from its PROTO opcode (protocol 2 or later) at the start
    of the file (the legacy format, and plain pickles) or of the zip format's data.pkl; 0 for torch's pickle without
    one (protocol 0 or 1); None where there is none."""
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                name = next((n for n in archive.namelist() if n.rsplit("/", 1)[-1] == "data.pkl"), None)
                if name is None:
                    return None
                head = archive.open(name).read(2)
                no_proto = len(head) == 2
        else:
            with open(path, "rb") as f:
                head = f.read(len(_LEGACY_MAGIC_NO_PROTO))
            no_proto = head == _LEGACY_MAGIC_NO_PROTO
    except (OSError, zipfile.BadZipFile, RuntimeError):  # RuntimeError: an encrypted member
        return None
    if len(head) >= 2 and head[0] == 0x80:
        return head[1]
    return 0 if no_proto else None


def load_checkpoint(path: str | Path, map_location="cpu") -> dict:
    """A checkpoint's state (:func:`read_torch_file`), checked to hold named weight tensors."""
    state = read_torch_file(path, map_location)
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise CheckpointError(f"checkpoint {path} is not a gbattn checkpoint (no model weights in it)")
    if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state["model"].items()):
        raise CheckpointError(f"checkpoint {path} is not a gbattn checkpoint (its weights are not named tensors)")
    _upgrade_scalar_gates(state)
    return state


def _upgrade_scalar_gates(state: dict) -> None:
    """Checkpoints written before every parameter had a dimension (FSDP2 shards dimension 0) hold
    the scalar gate's logit as a 0-dim tensor, and so its AdamW moments: they become shape (1,).
    No parameter is 0-dim now, so every 0-dim moment belongs to such a gate."""
    weights = state["model"]
    for name, value in weights.items():
        if name.endswith("gate.logit") and value.dim() == 0:
            weights[name] = value.reshape(1)
    optim_state = state.get("optimizer")
    moments = optim_state.get("state") if isinstance(optim_state, dict) else None
    for param_state in moments.values() if isinstance(moments, dict) else ():
        for key in ("exp_avg", "exp_avg_sq"):
            value = param_state.get(key) if isinstance(param_state, dict) else None
            if isinstance(value, torch.Tensor) and value.dim() == 0:
                param_state[key] = value.reshape(1)


# --------------------------------------------------------------------------------------
# One writer per run directory
# --------------------------------------------------------------------------------------


class RunLock:
    """An exclusive ``flock`` on ``DIR/.lock``, held until :meth:`release` or the process ends (the
    OS releases it on kill -9, so a killed run can be resumed at once)."""

    _held: dict[str, RunLock] = {}

    def __init__(self, directory: str | Path, what: str = "run") -> None:
        self.directory = Path(directory)
        key = str(self.directory.resolve())
        if key in RunLock._held:  # this process already holds it (e.g. compare, then its runs)
            self.fd, self.token = None, RunLock._held[key].token
            return
        # the folders this lock's check makes (the directory and its parents not there yet: removed again if empty)
        self.made = [self.directory, *itertools.takewhile(lambda p: not p.exists() and p != p.parent,
                                                          self.directory.parents)]
        self.created = not self.directory.exists()
        check_writable_dir(self.directory, "--out")
        try:  # never through a link: a .lock symlink would have the pid written into its target
            # (0o666 less the umask, as every file gbattn writes: a group's shared folder lets its members lock it)
            self.fd = os.open(self.directory / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        except OSError as e:
            raise UserError(f"{self.directory / LOCK} cannot be opened as the lock file ({e.strerror or e}; a link or "
                            f"a non-file is refused): remove it") from None
        if not stat.S_ISREG(os.fstat(self.fd).st_mode):  # a FIFO, a device
            os.close(self.fd)
            raise UserError(f"{self.directory / LOCK} is not a regular file: remove it")
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self.fd)
            self.fd = None
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = self.holder()  # (this caller's kind was named: an export refused by a training, "its export")
                raise UserError(f"{self.directory} is in use by another gbattn process"
                                f"{f' (its {holder} is being written)' if holder else ''}; wait for it to finish or "
                                f"choose another --out") from None
            raise
        # (its third line, a random token: other processes of a torchrun find it there when they see this folder)
        self.token = secrets.token_hex(8)
        try:
            os.ftruncate(self.fd, 0)
            os.write(self.fd, f"{os.getpid()}\n{what}\n{self.token}\n".encode())
        except OSError as e:  # a full disk: "No space left on device", naming nothing, and a stray --out left behind
            self.key = key  # (what release reads: the lock's file closed, a folder it made removed)
            self.release()
            raise UserError(f"could not write the lock file {self.directory / LOCK} ({e.strerror or e})") from None
        with contextlib.suppress(OSError):  # (on a shared file system, before the other nodes read it)
            os.fsync(self.fd)
        RunLock._held[key] = self
        self.key = key
        remove_debris(self.directory)

    @staticmethod
    def token_in(directory: str | Path) -> str | None:
        """The token in ``directory``'s lock file (:class:`RunLock` writes it), or None where there is none."""
        lines = RunLock._lines(Path(directory))
        return lines[2] if len(lines) > 2 else None

    @staticmethod
    def _lines(directory: Path) -> list[str]:
        try:
            fd = os.open(directory / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                return os.read(fd, 200).decode("utf-8", errors="replace").splitlines()
            finally:
                os.close(fd)
        except OSError:
            return []

    def holder(self) -> str | None:
        """What the process holding the lock writes (its second line: "run", "comparison", "export", ...), or None
        where it does not say (a gbattn before it did, or one that has not written it yet)."""
        lines = self._lines(self.directory)
        return lines[1] if len(lines) > 1 and re.fullmatch(r"[\w `.-]{1,60}", lines[1]) else None

    def release(self) -> None:
        """Unlock; a directory this lock created that holds nothing else (the work failed before
        writing anything, e.g. on bad --data) is removed, so a typo leaves no stray directory."""
        if self.fd is not None:
            RunLock._held.pop(self.key, None)
            # (the folder deleted while the work ran, or no file descriptor left to list it: this error, raised while
            # the work's own went up, was the one said, "d: No such file or directory", and the lock stayed open)
            with contextlib.suppress(OSError):
                if self.created and [p.name for p in self.directory.iterdir()] == [LOCK]:
                    (self.directory / LOCK).unlink()
                    for folder in self.made:  # (typo1/typo2/run left typo1/typo2) the first one not empty stops it
                        folder.rmdir()
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# --------------------------------------------------------------------------------------
# Configs of a run, and old run directories
# --------------------------------------------------------------------------------------

# What a field meant in run directories written before it existed (the paper-exact dropout sites and warmup added them).
_OLD_MODEL_DEFAULTS = {"dropout_sites": ["embedding", "attention", "attn-output", "ffn-output"]}
_OLD_TRAIN_DEFAULTS = {"warmup_from_zero": False, "fit_warmup": False}
# Model fields every gbattn run directory has recorded since the first version: one that is missing is damage,
# not a default (without n_heads, 2-head weights ran as 4 heads). Fields added later take their old meaning.
_ALWAYS_RECORDED_MODEL = ("vocab_size", "block_size", "d_model", "n_layers", "n_heads", "ffn_mult", "dropout", "norm",
                          "pos", "rope_base", "bias", "tie_embeddings", "attn", "attn_options", "residual",
                          "attnres_block")
_RECORDED_TOGETHER_MODEL = ("n_kv_heads", "ffn", "ffn_hidden", "norm_type", "norm_eps")


def write_config(directory: str | Path, preset: str | None, model_cfg: ModelConfig, train_cfg: TrainConfig,
                 extra: dict | None = None, **details: Any) -> None:
    """``config.json``, in the one layout every writer uses (trainer, upcycle, a planned run of
    ``compare``): preset, model, train, extra, then what the writer knows (data, steps, ...)."""
    write_json({"preset": preset, "model": model_cfg.to_dict(), "train": train_cfg.to_dict(), "extra": extra or {},
                **details}, Path(directory) / CONFIG)


def write_result(directory: str | Path, result: dict) -> None:
    """``result.json``, the final record: written last, its presence means the run finished."""
    write_json(result, Path(directory) / RESULT)


def append_event(directory: str | Path, event: dict) -> None:
    """One event (train, eval, test, resume, stop) appended to ``metrics.jsonl``."""
    append_jsonl(Path(directory) / METRICS, event)


_JSON_KIND = {int: "an integer", float: "a number", str: "a string", dict: "a JSON object", list: "a JSON list",
              bool: "true or false"}


def _check_fields(record: dict, kinds: dict[str, tuple[type, ...]], where: str | Path, required=()) -> None:
    """One-line error for the first field of ``record`` that is missing (``required``) or of
    another type than ``kinds`` says (a bool is not a number; None is allowed where not required)."""
    for key, kind in kinds.items():
        value = record.get(key)
        if value is None:
            if key in required:
                raise CheckpointError(f"{where} has no {key!r}: not a complete gbattn record")
            continue
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in kind):
            names = "a number" if float in kind else " or ".join(_JSON_KIND[k] for k in kind)
            raise CheckpointError(f"{where}: {key}={value!r} must be {names}")


_CONFIG_FIELDS = {"preset": (str,), "data": (dict,), "extra": (dict,), "seq_len": (int,), "step": (int,),
                  "steps": (int,), "warmup_steps": (int,), "gbattn": (dict,), "checkpoint": (str,),
                  "weights_digest": (str,)}
_DATA_FIELDS = {"corpus": (str,), "fingerprint": (str,), "tokenizer": (str,)}


def check_config(config: dict, where: str | Path) -> dict:
    """``config`` (a run's ``config.json``, or an exported one's gbattn section) with the fields
    gbattn reads checked: a damaged file is a one-line :class:`CheckpointError`, not a traceback later."""
    _check_fields(config, _CONFIG_FIELDS, where)
    _check_fields(config.get("data") or {}, _DATA_FIELDS, f"{where} (data)")
    preset = config.get("preset")  # (a name no preset has, or "", trained --init-from runs on paper-small's recipe)
    if preset is not None and preset not in PRESETS:
        raise CheckpointError(f"{where}: preset={preset!r} is not a preset gbattn has (choose one of "
                              f"{', '.join(PRESETS)}, or null): the file is damaged")
    if isinstance(config.get("seq_len"), int) and config["seq_len"] < 1:
        raise CheckpointError(f"{where}: seq_len={config['seq_len']} must be >= 1")
    for count in ("step", "steps", "warmup_steps"):  # an export's step, which eval reports; a run's steps and warmup
        if isinstance(config.get(count), int) and config[count] < 0:
            raise CheckpointError(f"{where}: {count}={config[count]} must be >= 0")
    step, steps = config.get("step"), config.get("steps")
    if isinstance(step, int) and isinstance(steps, int) and step > steps:
        raise CheckpointError(f"{where}: step={step:,} is past the run's steps={steps:,} (the "
                              f"weights' training step, which eval and lm-eval report): the file is damaged")
    return config


def read_config(path: str | Path) -> dict:
    """``config.json`` of a run (or exported) directory, checked (:func:`check_config`)."""
    return check_config(read_json(path), path)


# The standard names transformers reads at the top level of a config.json, and the gbattn model fields they stand
# for (gbattn.hf.GbattnConfig's properties over its gbattn model dict).
STANDARD_FIELDS = {"hidden_size": "d_model", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
                   "num_key_value_heads": "n_kv_heads", "max_position_embeddings": "block_size",
                   "vocab_size": "vocab_size", "tie_word_embeddings": "tie_embeddings", "rope_theta": "rope_base"}


def check_standard_names(config: dict, where: str | Path) -> None:
    """An exported ``config.json``'s standard names at its top level (mirrors that save_pretrained writes beside
    the gbattn model dict, for tools that read the file itself) agree with that dict: transformers would build the
    model from the one, gbattn's readers from the other. A field missing from the dict, or not a number there, is
    left to the dict's own check, which names it."""
    model = config["gbattn"].get("model")
    if not isinstance(model, dict):
        return
    for name, field in STANDARD_FIELDS.items():
        recorded = model.get(field)
        if field == "n_kv_heads":
            recorded = recorded or model.get("n_heads")  # None: as many as the query heads
        if not isinstance(recorded, (int, float)):  # (bool is an int: tie_embeddings)
            continue
        if name in config and config[name] != recorded:
            raise CheckpointError(f"{where}: {name}={config[name]!r} at its top level disagrees with {field}="
                                  f"{recorded!r} in its gbattn model dict: transformers builds the model from the "
                                  f"one, gbattn from the other; delete {name} from config.json")


def gbattn_section(config: dict, where: str | Path) -> dict | None:
    """The run's own config in a ``config.json`` (from :func:`read_config`): the file itself for a
    run directory, its checked ``gbattn`` section for an exported one (:func:`check_standard_names`); None for
    another model's config (a Hugging Face checkpoint)."""
    if isinstance(config.get("gbattn"), dict):
        check_standard_names(config, where)
        return check_config(config["gbattn"], f"{where} (gbattn)")
    # a run's own config.json has no model_type; a Hugging Face config with fields named model and train does
    return config if "model" in config and "train" in config and "model_type" not in config else None


def refuse_hf_checkpoint(config: dict, path: str | Path, then: str = "give DIR") -> None:
    """A one-line error where a gbattn run is wanted and ``path``'s ``config.json`` (``config``) is a
    Hugging Face checkpoint's (a model_type other than gbattn's, no run in it): it says how to convert it."""
    model_type = config.get("model_type")
    if model_type is not None and model_type != "gbattn" and gbattn_section(config, Path(path) / CONFIG) is None:
        raise UserError(f"{path} is a Hugging Face checkpoint ({model_type}), not a gbattn run: convert it first with "
                        f"`gbattn upcycle {shell_path(path)} --attn standard --out DIR` (or --attn boosted), "
                        f"then {then}")


def recorded_fingerprint(config: dict, of: str = "data") -> str | None:
    """The fingerprint a run recorded of its data (``of="tokenizer"``: of its tokenizer); None if it recorded
    none. ``config`` from :func:`read_config`."""
    return (config.get("data") or {}).get("fingerprint" if of == "data" else of)


def valid_curve(curve) -> bool:
    """Whether ``curve`` is a validation curve as the trainer writes it: a list of points, each with
    an integer step, a token count and a validation loss and perplexity (numbers, or null where they
    were not finite)."""
    def point(p) -> bool:
        return (isinstance(p, dict) and all(isinstance(p.get(k), int) and not isinstance(p.get(k), bool)
                                            for k in ("step", "tokens"))
                and all(p.get(k) is None or isinstance(p.get(k), (int, float)) and not isinstance(p.get(k), bool)
                        for k in ("valid_loss", "valid_ppl")))  # null: a non-finite value, as write_json stores it

    return isinstance(curve, list) and all(point(p) for p in curve)


_NUMBER = (int, float)
_RESULT_FIELDS = {"attn": (str,), "attn_options": (dict,), "d_model": (int,), "parameters": (int,),
                  "flops_per_token_train": _NUMBER, "test_ppl": _NUMBER, "valid_ppl": _NUMBER, "valid_loss": _NUMBER,
                  "steps": (int,), "train_tokens_seen": (int,), "tokens_per_parameter": _NUMBER,
                  "train_flops": _NUMBER, "wall_clock_s": _NUMBER, "train_tokens_per_s": _NUMBER, "device": (str,),
                  "curve": (list,), "compiled": (bool,)}
# The least value of each count or measure a finished run records: a perplexity is exp(a loss >= 0).
_RESULT_LEAST = {**{k: 0 for k, kind in _RESULT_FIELDS.items() if kind in (_NUMBER, (int,))},
                 "d_model": 1, "parameters": 1, "test_ppl": 1, "valid_ppl": 1}


def read_result(path: str | Path) -> dict:
    """``result.json`` of a finished run with every field a comparison reads checked."""
    result = read_json(path)
    # Perplexities and losses may be null: write_json stores an infinite one (a loss >= 50) or NaN so.
    # (compiled: kept since 2026-12-07, a run of an earlier gbattn has none)
    _check_fields(result, _RESULT_FIELDS, path, required=tuple(
        k for k in _RESULT_FIELDS if k not in ("test_ppl", "valid_ppl", "valid_loss", "compiled")))
    # write_json never writes NaN or an infinity (null): a hand-made one (1e400 reads as inf) is refused too
    for key, least in _RESULT_LEAST.items():
        if result.get(key) is not None and not least <= result[key] < math.inf:
            raise CheckpointError(f"{path}: {key}={result[key]!r} must be a finite number >= {least}")
    if not valid_curve(result["curve"]):
        raise CheckpointError(f"{path}: its validation curve is malformed (points need step, tokens, valid_loss and "
                              f"valid_ppl)")
    from gbattn.experiments.report import curve_out_of_range  # (it imports this module)

    wrong = curve_out_of_range(result["curve"])  # (a perplexity of 0 went into compare's table, and plot refused it)
    if wrong:
        raise CheckpointError(f"{path}: its validation curve has {wrong}")
    # Taken without them (as null), they are there as null for every reader: compare's table indexed them, a
    # KeyError traceback where a result.json or a point of its curve lacked one.
    for record, keys in ((result, ("test_ppl", "valid_ppl", "valid_loss")), *((p, ("valid_loss", "valid_ppl"))
                                                                            for p in result["curve"])):
        for key in keys:
            record.setdefault(key, None)
    return result


def recorded_model_config(model_d: dict, where: str | Path) -> ModelConfig:
    """The ModelConfig of a recorded model section (a run's or an export's ``config.json``): a field every
    gbattn run records that is missing is damage, a CheckpointError; fields it predates keep their old meaning."""
    # (fields added together, by the Llama-style block options: a section recording one of them records all, and a
    # norm_type left out ran LayerNorm over RMSNorm weights, silently)
    together = [k for k in _RECORDED_TOGETHER_MODEL if k in model_d]
    missing = [k for k in _ALWAYS_RECORDED_MODEL + (_RECORDED_TOGETHER_MODEL if together else ()) if k not in model_d]
    if missing:
        raise CheckpointError(f"{where}: its model section has no {', '.join(missing)} (every gbattn run records "
                              f"them): a damaged or hand-edited config")
    try:
        return ModelConfig.from_dict({**_OLD_MODEL_DEFAULTS, **model_d})
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e}") from None


def read_configs(config: dict, where: str | Path):
    """(ModelConfig, TrainConfig) of a ``config.json`` dict; fields it predates keep their old meaning."""
    try:
        model_d, train_d = config["model"], config["train"]
        if not isinstance(model_d, dict) or not isinstance(train_d, dict):
            raise TypeError
        model_cfg = recorded_model_config(model_d, where)
        train_d = {**_OLD_TRAIN_DEFAULTS, **train_d}
        if train_d.get("eval_every") == 0:  # in older runs, 0 meant "every epoch only"
            train_d["eval_every"] = None
        return model_cfg, TrainConfig.from_dict(train_d)
    except (KeyError, TypeError):
        raise CheckpointError(f"{where} has no model and train sections: is it a gbattn run directory?") from None
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e}") from None


# --------------------------------------------------------------------------------------
# Loading a trained run (Python API: gbattn.load_run)
# --------------------------------------------------------------------------------------


@dataclass
class LoadedRun:
    """A trained model with its tokenizer and configs (``gbattn.load_run``; README, "Using gbattn from Python")."""

    run_dir: Path
    model: Any  # gbattn.model.GPT, in eval mode
    model_cfg: Any  # ModelConfig
    train_cfg: Any  # TrainConfig
    tokenizer: Any  # gbattn.data.tokenizer.Tokenizer
    config: dict  # the run's config.json as written (of an export: its config.json's gbattn section)
    step: int
    checkpoint: str  # which weights: best, last or exported

    @property
    def seq_len(self) -> int:
        return self.config.get("seq_len") or self.model_cfg.input_length(self.train_cfg.seq_len)

    @property
    def weights_text(self) -> str:
        """Which weights these are, as eval says it ("best weights at step 400")."""
        return weights_named(self.checkpoint, f"at step {self.step}")

    @property
    def data_fingerprint(self) -> str | None:
        """The fingerprint of the corpus the run trained on (None if it recorded none)."""
        return recorded_fingerprint(self.config)

    def generate(self, prompt: str, max_new_tokens: int = GENERATE_DEFAULTS["max_new_tokens"],
                 temperature: float = GENERATE_DEFAULTS["temperature"], top_k: int | None = GENERATE_DEFAULTS["top_k"],
                 stop: str | list[str] | None = None, **kwargs) -> str:
        """The text of the prompt's tokens and of those generated after them, decoded together as `gbattn generate`
        prints them, with its defaults (see :func:`gbattn.model.decoding.generate` for the options; that function's
        own are temperature 1 and no top-k). ``stop``: a text or texts at which the new text ends (left out, as
        `gbattn generate --stop` does). It starts with ``prompt`` where the
        tokenizer decodes text as it was (char, gpt2); the paper's BPE spells it piece by piece (``"First Citizen :"``
        for ``"First Citizen:"``), so ``len(prompt)`` does not mark where the new text starts."""
        if not isinstance(prompt, str):  # token ids went on to the tokenizer's "'int' object is not iterable"
            raise UserError(f"prompt of type {type(prompt).__name__}: give a string (run.model.generate takes "
                            f"token ids)")
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise UserError("the prompt encodes to no tokens")
        device = next(self.model.parameters()).device
        stop = StopStrings(self.tokenizer.decode, stop) if stop is not None else None
        out = self.model.generate(torch.tensor([ids], device=device), max_new_tokens, temperature=temperature,
                                  top_k=top_k, stop=stop, **kwargs)[0].tolist()
        return stop.text(out, len(ids)) if stop is not None else self.tokenizer.decode(out)

    def perplexity(self, text: str, batch_size: int | None = None):
        """The model's perplexity on ``text`` (an :class:`gbattn.eval.perplexity.EvalResult`: ``.ppl``, ``.loss``
        in nats, ``.tokens`` predicted), scored as `gbattn eval` scores a split, in the run's precision:
        non-overlapping rows of ``seq_len + 1`` tokens, a remainder shorter than a row not scored; a text
        shorter than one row is scored as one row of its own length (README, "Using gbattn from Python"). The text's
        own tokens, as a split holds them: line by line, blank lines left out but with char (README, "Data"), and
        not the start token a Llama tokenizer's post-processor puts before a prompt (:meth:`Tokenizer.encode_batch`).
        ``batch_size``: rows per batch (default: the run's eval_batch_size, as `gbattn eval`; the batch's shape
        changes the last bits of the loss)."""
        import numpy as np

        from gbattn.data.tokens import encoded_lines
        from gbattn.eval.perplexity import evaluate
        from gbattn.runtime import autocast

        if not isinstance(text, str):
            raise UserError(f"text of type {type(text).__name__}: give a string")
        # Its lines as a split's file is read (universal newlines) and encoded: a byte-level tokenizer's blank lines
        # were tokens of their own, which a split leaves out
        lines = list(encoded_lines(io.StringIO(text, newline=None), self.tokenizer))
        ids = np.asarray([i for seq in self.tokenizer.encode_batch(lines) for i in seq], dtype=np.int64)
        if len(ids) < 2:
            raise UserError(f"the text encodes to {len(ids)} token{'s' * (len(ids) != 1)}: a perplexity needs at "
                            f"least 2 (one predicted from another)")
        device = next(self.model.parameters()).device
        batch_size = self.train_cfg.eval_batch_size if batch_size is None else batch_size  # (0 was the default)
        return evaluate(self.model, ids, min(self.seq_len, len(ids) - 1), batch_size, device,
                        autocast(device, self.train_cfg.amp))


WHICH = ("best", "last")
# An exported directory's weights: the ones exported, or weights saved into it since (fine-tuned and saved with
# save_pretrained, or saved in another dtype), which are not those of the step the export recorded.
EXPORTED, CHANGED = "exported", "changed"


def weights_named(checkpoint: str | None, step: str) -> str:
    """Weights named by their checkpoint and ``step`` ("at step 400", "(step 400)"): "best weights at step 400", or
    "weights changed since their export at step 400" of :data:`CHANGED` weights (not those of the step recorded)."""
    return f"weights changed since their export {step}" if checkpoint == CHANGED else f"{checkpoint} weights {step}"


def exported_weights_label(section: dict, weights: dict) -> str:
    """``"exported"``, or ``"changed"`` where an export's ``weights`` (under the GPT's names) are not the ones its
    gbattn ``section`` recorded (``weights_digest``, written by :func:`gbattn.hf.export.wrap_run`), or where it is a
    re-export of such weights. An export written before the digest is taken at its word."""
    recorded = section.get("weights_digest")
    if section.get("checkpoint") == CHANGED or (recorded is not None and recorded != weights_digest(weights)):
        return CHANGED
    return EXPORTED


def is_exported(path: str | Path) -> bool:
    """An exported Hugging Face directory (``gbattn export``, or a transformers ``save_pretrained`` of
    one): weights in ``model.safetensors``, or a ``config.json`` of model_type ``gbattn``."""
    path = Path(path)
    try:
        config = read_json(path / CONFIG)
    except CheckpointError:  # none, or damaged (nested too deeply, a FIFO): load_run says what is wrong
        config = None
    return _exported(path, config)


def _exported(path: Path, config) -> bool:
    """:func:`is_exported` with ``config.json`` already read (anything, or None). A run's weights (checkpoint.pt,
    or best.pt alone, as an upcycled run has them before training) make it a run whatever lies beside them."""
    if (path / CHECKPOINT).is_file() or (path / BEST).is_file():
        return False
    return (path / SAFETENSORS).is_file() or (isinstance(config, dict) and config.get("model_type") == "gbattn")


def check_exported_checkpoint(path: Path, checkpoint: str | None, recorded) -> None:
    """An exported directory holds the one set of weights it was exported with (``recorded``): asking
    for the run's other checkpoint is a one-line error, not silently ignored."""
    if checkpoint is not None and checkpoint != recorded:
        held = f"its run's {recorded} weights" if recorded in WHICH else "one set of weights"
        raise UserError(f"{path} is an exported directory holding {held}: --checkpoint {checkpoint} (from Python: "
                        f"checkpoint={checkpoint!r}) does not apply (export the run's {checkpoint} weights with "
                        f"`gbattn export RUN --checkpoint {checkpoint}`)")


def as_directory(value, name: str) -> Path:
    """``value``, a run directory given from Python as a str or ``os.PathLike``, as a Path; anything else (None, an
    int, bytes, a loaded run) is a TypeError naming the argument ``name``, where pathlib's "expected str, bytes or
    os.PathLike object" named neither it nor what it takes."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} of type {type(value).__name__}: give a run directory (a str or pathlib.Path)")
    return Path(value)


def chosen_weights(path: Path, checkpoint: str | None) -> tuple[Path, str]:
    """The weights file of run directory ``path`` that ``checkpoint`` (best, last or None: best) reads, and which it
    is: best.pt, or where no evaluation happened yet the last weights, the only ones, reported as what they are."""
    checkpoint = checkpoint or "best"
    weights = path / (BEST if checkpoint == "best" else CHECKPOINT)
    if checkpoint == "best" and not weights.exists():
        weights, checkpoint = path / CHECKPOINT, "last"
    return weights, checkpoint


def check_model_dir(path: str | Path) -> Path:
    """``path`` as a Path when it is a directory (a run's or an exported one), else a one-line
    :class:`CheckpointError`: checked before anything is derived from it (a default output folder inside it)."""
    path = as_directory(path, "path")
    if not path.is_dir():
        what = ("does not exist" if not path.exists() and not path.is_symlink() else
                f"is {dangling_link(path)}" if not path.exists() else "is not a directory")  # (a typo: "not a dir")
        raise CheckpointError(f"{path} {what} (a gbattn run directory or an exported one is expected)"
                              f"{did_you_mean_path(path)}")
    return path


def file_identity(path: Path) -> tuple | None:
    """What changes when a file is replaced or rewritten (its inode, size and time), None for no file."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def load_run(path: str | Path, checkpoint: str | None = None, device: str | torch.device = "cpu") -> LoadedRun:
    """The model of a run directory (``checkpoint``: best-validation weights, the default, or
    ``last``) or of an exported directory, with its tokenizer and configs, in eval mode on ``device``
    (:func:`gbattn.runtime.resolve_device`: auto for CUDA when available, else the CPU; cpu, cuda, cuda:N or, on a
    Mac, mps; README, "Using gbattn from Python"; what is checked on the way: README, "Trust")."""
    path = check_model_dir(path)
    device = resolve_device(device, mps=True)  # else torch.load's error on another device, read as damage
    if checkpoint is not None:
        check_choice("checkpoint", checkpoint, WHICH)
    if foreign_model(path) == UNFINISHED_EXPORT:
        raise CheckpointError(f"{path} holds an export that did not finish (it has no {CONFIG}: stopped while being "
                              f"written): export the run again")
    if not (path / CONFIG).exists():
        # (not an export's staging folder, there while an export is written: it was offered as the run to load)
        runs = sorted(p.parent for p in (*path.glob(f"*/{CONFIG}"), *path.glob(f"*/*/{CONFIG}"))
                      if not any(part.startswith(f"{EXPORT_STAGING}.tmp") for part in p.relative_to(path).parts))
        if runs:  # a comparison's directory (or one model's), not a run
            raise CheckpointError(f"{path} is not a run directory but holds one: {runs[0]}" if len(runs) == 1 else
                                  f"{path} is not a run directory but holds {len(runs)}: give one of them, e.g. "
                                  f"{runs[0]}")
        held = folder_holds(path)
        if held is not None and held != RUN:  # a denoise output, a comparison's results without its runs, ...
            raise CheckpointError(f"{path} holds {held}, not a run directory (nor one written by `gbattn export`)")
        refuse_weights_without_config(path, then=UNFINISHED_RUN_ADVICE)
    config_identity = file_identity(path / CONFIG)  # (an export replacing this one meanwhile changes it)
    config = read_config(path / CONFIG)
    refuse_hf_checkpoint(config, path)
    exported = _exported(path, config)
    if exported:
        if not isinstance(config.get("gbattn"), dict):
            raise CheckpointError(f"{path / CONFIG} has no gbattn section: not a directory exported by gbattn")
        config = gbattn_section(config, path / CONFIG)
        if isinstance(config.get("model"), dict) and "train" not in config:  # (read_configs: "no model and train")
            # (it named from_gpt without run= as the cause: a model made from a GbattnConfig has none either)
            raise CheckpointError(f"{path / CONFIG}: its gbattn section holds a model but no run (no train section): "
                                  f"a model saved without the run it came from (made from a GbattnConfig, or by "
                                  f"GbattnForCausalLM.from_gpt(model) without run=), which gbattn's commands cannot "
                                  f"read; save the model AutoModelForCausalLM loads from a `gbattn export` (an "
                                  f"upcycled model: write_run(up, OUT), then `gbattn export OUT`)")
        check_exported_checkpoint(path, checkpoint, config.get("checkpoint"))
    model_cfg, train_cfg = read_configs(config, path / CONFIG)
    if (config.get("seq_len") or 0) > model_cfg.block_size:
        raise CheckpointError(f"{path / CONFIG}: seq_len={config['seq_len']} exceeds the model's block_size="
                              f"{model_cfg.block_size}: the file is damaged")
    tokenizer_file = path / (EXPORTED_TOKENIZER if exported else TOKENIZER)
    if exported and not tokenizer_file.is_file():
        refuse_not_regular(tokenizer_file)
        raise CheckpointError(f"{path} has no {EXPORTED_TOKENIZER} (gbattn's own tokenizer file, which `gbattn export` "
                              f"writes and transformers' save_pretrained does not): copy it from the exported "
                              f"directory this model came from")
    if not exported and not (path / BEST).exists() and not (path / CHECKPOINT).exists():
        # (before its tokenizer, which a run still preparing its data has not written either: "tokenizer.json not
        # found: is it a gbattn run directory?" was said of a run planned by compare --jobs or starting to train)
        raise CheckpointError(f"{path} holds no weights: its training has not saved a checkpoint yet (one is "
                              f"saved at each evaluation, every checkpoint_minutes, at the end and when stopped)")
    tokenizer = Tokenizer.load(tokenizer_file, expected_vocab=model_cfg.vocab_size,
                               recorded=recorded_fingerprint(config, of="tokenizer"))
    if exported:
        weights = gpt_weights(read_exported_weights(path, device), model_cfg.tie_embeddings, path)
        state, step, which = {"model": weights}, config.get("step", 0), exported_weights_label(config, weights)
        # Its files are read one after another, and `gbattn export` replaces them one after another (config.json
        # removed first, put back last): read during an export, one export's step and config went with another's
        # weights, silently.
        if file_identity(path / CONFIG) != config_identity:
            raise CheckpointError(f"{path} was replaced by another `gbattn export` while it was read: read it again "
                                  f"once that export has finished")
    else:
        weights, checkpoint = chosen_weights(path, checkpoint)
        if not weights.exists():  # checkpoint="last" where only best.pt is: an upcycled run before its training
            raise CheckpointError(f"{path} has no last checkpoint ({CHECKPOINT}), only best-validation weights "
                                  f"({BEST}): an upcycled run not trained yet, a run whose first checkpoint could not "
                                  f"be written (a full disk), or a copy without it; use --checkpoint best (from "
                                  f"Python: checkpoint='best')")
        state, which = load_checkpoint(weights, map_location=device), checkpoint
        step = state.get("step")  # (left out, the weights were reported as those of step 0)
        last = config.get("steps") if type(config.get("steps")) is int else MAX_INT  # the run's steps
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= last:  # as a config's step
            beyond = isinstance(step, int) and not isinstance(step, bool) and step > last >= 0
            raise CheckpointError(
                f"{weights}: step={shown(step)} must be an integer in [0, {last:,}] (the weights' training step, "
                f"at most "
                + (f"the run's steps, which {path / CONFIG} says are {last:,}): one of the two files is damaged or "
                   f"was edited; restore a copy of it" if beyond else
                   "the run's steps): the file is damaged; restore a copy of it"))
    model = model_holding(model_cfg, state["model"], path, device)
    return LoadedRun(path, model, model_cfg, train_cfg, tokenizer, config, int(step) if isinstance(step, int) else 0,
                     which)


# Floating-point dtypes holding two values a byte, which torch cannot convert to float32 (no numbers to read).
PACKED_FLOATS = tuple(getattr(torch, name) for name in ("float4_e2m1fn_x2",) if hasattr(torch, name))


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of a floating-point tensor is finite. Its sum first: a NaN or an infinity makes the sum
    non-finite, and only then (or where finite values overflow the sum) is every value checked (25M weights: 0.04 s
    where isfinite(t).all() takes 0.24 s)."""
    t = t if t.dtype.itemsize > 1 else t.float()  # (float8 has no isfinite)
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def check_finite(weights: dict, where: str | Path) -> None:
    """A one-line error naming the weights that are not floating-point numbers in memory (a ``meta`` tensor
    holds none; a bool, integer or complex one was cast silently, to 0/1 or dropping its imaginary part; a
    packed float4 one cannot be read; a sparse or nested one fits no dense parameter: a nested one's NaN check was a
    NotImplementedError traceback; an expanded one, more values than its file stores, made that check take the memory of
    all of them: 10**12 values from one stored), or that hold NaN or infinite values (a trained model's never do: the
    trainer does not step on a non-finite loss)."""
    def layout(w: torch.Tensor) -> str:
        if w.is_nested:
            return ", nested, not dense"
        if w.layout != torch.strided:
            return f", {w.layout}, not dense"
        if w.is_meta or w.numel() <= (stored := w.untyped_storage().nbytes() // w.element_size()):
            return ""
        return f", {w.numel():,} values from {stored:,} stored, not dense"

    odd = [f"{name}: {w.dtype}{' on meta' if w.is_meta else ''}{layout(w)}" for name, w in weights.items()
           if isinstance(w, torch.Tensor) and (w.is_meta or not w.is_floating_point() or w.dtype in PACKED_FLOATS
                                               or layout(w))]
    if odd:
        raise CheckpointError(f"the weights in {where} are not floating-point numbers ({', '.join(odd[:3])}"
                              f"{', ...' if len(odd) > 3 else ''}): the file is damaged; restore a copy of it")
    damaged = [name for name, w in weights.items()
               if isinstance(w, torch.Tensor) and w.is_floating_point()
               and not all_finite(w)]
    if damaged:
        raise CheckpointError(f"the weights in {where} hold NaN or infinite values ({', '.join(damaged[:3])}"
                              f"{', ...' if len(damaged) > 3 else ''}): the file is damaged; restore a copy of it")


class _NoDrawsOnMeta(torch.overrides.TorchFunctionMode):
    """Random draws (and their scaling) made of nothing while a model is built on the meta device, which holds no
    values: torch's meta ``normal_``, ``randn`` and ``mul`` import ``torch._dynamo``, seconds of every command that
    reads a run (`gbattn eval` of a tiny run, 2-core CPU under load, one thread, 5 runs each: median 9.6 s, 5.6 s
    without the import)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.nn.init.normal_, torch.Tensor.normal_, torch.Tensor.mul, torch.Tensor.__mul__):
            tensor = args[0] if args else kwargs.get("tensor")
            scalar = func in (torch.nn.init.normal_, torch.Tensor.normal_) or (
                len(args) > 1 and type(args[1]) in (int, float))
            if getattr(tensor, "is_meta", False) and scalar:  # (the same shape and dtype: no values to compute)
                return tensor
        if getattr(func, "__name__", None) == "randn":  # (in the meta device's context: an empty meta tensor)
            return torch.empty(*args, **{k: v for k, v in kwargs.items() if k != "generator"})
        return func(*args, **kwargs)


def check_weights_fit(model_cfg, weights: dict, where: str | Path) -> None:
    """``weights`` checked (:func:`load_weights`) against a :class:`GPT` of ``model_cfg`` on the meta device, which
    takes no memory: a config.json whose sizes the weights do not have (``d_model`` edited to 8192) is a one-line
    error before a model takes its memory (it took gigabytes, then failed as "out of memory: choose smaller sizes").
    Its layers are counted first: building a meta model of ``n_layers`` edited to 2000 took minutes."""
    layers = {name.split(".")[1] for name in weights if isinstance(name, str) and name.startswith("blocks.")}
    if len(layers) != model_cfg.n_layers:
        raise CheckpointError(f"the weights in {where} do not match its config (n_layers={model_cfg.n_layers}; the "
                              f"weights hold {len(layers)} blocks)")
    with torch.device("meta"), _NoDrawsOnMeta():
        model = GPT(model_cfg)
    load_weights(model, weights, where)


def model_holding(model_cfg, weights: dict, where: str | Path, device: str | torch.device = "cpu"):
    """A :class:`GPT` of ``model_cfg`` on ``device`` holding ``weights`` (:func:`load_weights`), in eval mode, the
    weights checked first (:func:`check_weights_fit`). Its initial values, replaced at once, are drawn from a forked
    random stream: loading a model leaves the caller's ``torch.manual_seed`` stream where it was."""
    check_weights_fit(model_cfg, weights, where)
    with torch.random.fork_rng(devices=[]):
        model = GPT(model_cfg)
    model = model.to(device)
    model.load_state_dict(weights)
    return model.eval()


def load_weights(model: torch.nn.Module, weights: dict, where: str | Path) -> None:
    """``model.load_state_dict(weights)`` with a one-line error when they do not fit the config or
    are not finite (:func:`check_finite`)."""
    check_finite(weights, where)
    check_tied(model, weights, where)
    try:
        meta = next(model.parameters()).is_meta  # a meta model takes them as they are: names and shapes checked
        # (a plain dict: assign=True marks a state dict's _metadata, and a later load of it assigned too, untying)
        model.load_state_dict(dict(weights) if meta else weights, assign=meta)
    except (RuntimeError, KeyError, ValueError) as e:
        # torch's message starts "Error(s) in loading state_dict for GPT:"; what went wrong is on the next lines
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        detail = lines[1] if len(lines) > 1 and lines[0].startswith("Error(s) in loading") else error_detail(e)
        detail = detail if len(detail) <= 240 else detail[:240].rsplit(", ", 1)[0] + ", ..."
        raise CheckpointError(f"the weights in {where} do not match its config ({detail})") from None


def weights_digest(weights: dict) -> str:
    """``sha256:...`` of a state dict's names, dtypes, shapes and values, in name order: which weights a run
    continuing another's started from (``train --init-from``), to tell them from the ones there later."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        tensor = weights[name].detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}:{tensor.dtype}:{tuple(weights[name].shape)};".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return f"sha256:{digest.hexdigest()}"


def check_tied(model: torch.nn.Module, weights: dict, where: str | Path) -> None:
    """A one-line error when ``weights`` hold two names of one parameter of ``model`` (``lm_head.weight`` and
    ``wte.weight`` under ``tie_embeddings``) with different values: loaded one after the other, the last one
    silently replaced the other (a head of other values became the embedding: test perplexity 1.4e14)."""
    names_of: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(parameter), []).append(name)
    for names in names_of.values():
        held = [weights[n] for n in names if isinstance(weights.get(n), torch.Tensor)]
        if any(w is not held[0] and (w.shape != held[0].shape or w.dtype != held[0].dtype
                                     or not torch.equal(w, held[0])) for w in held[1:]):
            raise CheckpointError(f"the weights in {where} hold {' and '.join(names)}, one parameter of the model "
                                  f"(tied), with different values: the file is damaged; restore a copy of it")


def read_exported_weights(path: Path, device) -> dict:
    """The weights of an exported directory: ``model.safetensors``, or the shards that transformers'
    ``save_pretrained(max_shard_size=...)`` lists in ``model.safetensors.index.json``."""
    if (path / SAFETENSORS).is_file():
        return read_safetensors(path / SAFETENSORS, device)
    if (path / SAFETENSORS_INDEX).is_file():
        return read_shards(path, SAFETENSORS_INDEX, lambda shard: read_safetensors(shard, device))
    pickled = next((name for name in ("pytorch_model.bin", "pytorch_model.bin.index.json") if (path / name).exists()),
                   None)  # transformers 4.x's save_pretrained(safe_serialization=False)
    hint = (f"; its {pickled} is a pickle, which gbattn does not read here: save with save_pretrained(DIR, "
            f"safe_serialization=True)") if pickled else ""
    refuse_not_regular(path / SAFETENSORS)
    raise CheckpointError(f"{path} has no {SAFETENSORS} (nor {SAFETENSORS_INDEX} and its shards): an exported "
                          f"directory keeps its weights there{hint}")


def gpt_weights(weights: dict, tied: bool, where: str | Path) -> dict:
    """An export's weights under the GPT's names: the transformers wrapper's ``model.`` prefix dropped, a tied head
    (saved once) filled in from the embedding. A tied model whose file also holds an ``lm_head.weight`` of other
    values is refused: gbattn loaded it over the embedding, transformers 5 unties the two, 4.x drops the head."""
    if weights and all(k.startswith("model.") for k in weights):  # the transformers wrapper's names
        weights = {k.removeprefix("model."): v for k, v in weights.items()}
    if tied and "wte.weight" in weights:
        embedding, head = weights["wte.weight"], weights.setdefault("lm_head.weight", weights["wte.weight"])
        if head is not embedding and (head.shape != embedding.shape or head.dtype != embedding.dtype
                                      or not torch.equal(head, embedding)):
            raise CheckpointError(f"the weights in {where} tie the output head to the token embedding (tie_embeddings) "
                                  f"but hold an lm_head.weight that differs from wte.weight: the file is damaged; "
                                  f"restore a copy of it")
    return weights


def read_shards(path: Path, index: str, read) -> dict:
    """The tensors of every shard the index file ``path / index`` names (``weight_map``: tensor name ->
    a file beside it), each read with ``read``; a shard elsewhere or a tensor no shard holds is an error."""
    weight_map = read_json(path / index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{path / index} has no weight_map of tensor names to shard files")
    weights: dict = {}
    for shard in sorted(set(weight_map.values())):
        if Path(shard).name != shard or not (path / shard).is_file():
            raise CheckpointError(f"{path / index} names shard {shard!r}, which is not a file in {path}")
        held = read(path / shard)
        # (a tensor in two shards, or in a shard the index does not assign it to, took whichever was read last)
        elsewhere = sorted(name for name in held if weight_map.get(name) != shard)
        if elsewhere:
            named = ", ".join(elsewhere[:3]) + (", ..." if len(elsewhere) > 3 else "")
            raise CheckpointError(f"{path / shard} holds {named}, which {index} does not assign to it: the files are "
                                  f"damaged or from different saves; restore a copy of them")
        weights.update(held)
    missing = sorted(set(weight_map) - set(weights))
    if missing:
        raise CheckpointError(f"{path / index}: the shards lack {', '.join(missing[:5])}")
    return weights


def read_safetensors(path: str | Path, device) -> dict:
    load_file = optional_module("safetensors.torch", "transformers", f"reading {Path(path).name} needs").load_file
    try:
        return load_file(str(path), device=str(device))
    except Exception as e:  # safetensors raises its own error types for any malformed file
        refuse_lfs_pointer(path)
        raise CheckpointError(f"{path} is not a valid safetensors file ({error_detail(e, 100)})") from None
