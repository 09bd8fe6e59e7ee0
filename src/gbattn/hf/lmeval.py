"""``gbattn lm-eval``: lm-evaluation-harness tasks on a run or an exported directory, through the
harness's own Hugging Face wrapper (``HFLM``) with the model in memory.

A run directory is wrapped in memory (:func:`gbattn.hf.export.wrap_run`); an exported directory is
loaded with the Auto classes, as any user of it would, in float32 as a run's model is (whatever dtype
it was saved in). ``max_length`` is the number of input tokens the run trained on (its ``seq_len``,
``block_size - 1`` by default: with learned positions the last one, ``block_size - 1``, never trained, and
scoring through it made a token's loss worse with more context), as ``gbattn eval`` scores: longer inputs
keep their last ``max_length`` tokens (lm-eval's rule), and a rolling log-likelihood (perplexity tasks) is
summed over windows of ``max_length`` tokens, the first one after the start-of-text token where the
vocabulary has one, else the end-of-text token (:mod:`gbattn.hf.tokenization`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import traceback
from pathlib import Path

import torch
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from lm_eval.utils import handle_non_serializable, make_table
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer

from gbattn.data.corpus import hub_access
from gbattn.errors import CheckpointError, ConfigError, UserError, shown
from gbattn.files import (
    atomic_write_all,
    building_suffix,
    error_detail,
    finite,
    full_disk_reason,
    json_text,
    read_json,
    refuse_lfs_pointer,
    relative_path,
)
from gbattn.hf.export import quiet_transformers, wrap_run
from gbattn.rundir import (
    CONFIG,
    check_exported_checkpoint,
    check_finite,
    exported_weights_label,
    gbattn_section,
    gpt_weights,
    is_exported,
    load_run,
    read_config,
    read_exported_weights,
    refuse_hf_checkpoint,
)
from gbattn.terminal import note

LOGITS_CACHE = False  # the harness's logits cache, off (run_lm_eval says why); results files record it


class GbattnLM(HFLM):
    """``HFLM`` that decodes generations with special tokens kept: a char model's end-of-text token
    is ``"\\n"``, which ``skip_special_tokens=True`` would delete from the text before the harness
    cuts it at its stop strings (which include the end-of-text token)."""

    def __init__(self, **kwargs) -> None:
        # The harness warns of a model passed in memory that "many other model arguments may be ignored"
        # and not to launch it with accelerate: gbattn passes only arguments that apply to it, and launches
        # nothing, so the two warnings on every run would only mislead.
        harness_log = logging.getLogger(HFLM.__module__)
        harness_log.addFilter(_not_in_memory_warning)
        try:
            super().__init__(**kwargs)
        finally:
            harness_log.removeFilter(_not_in_memory_warning)

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        """The harness's generate() call with a task's ``generation_kwargs`` less those that change no answer
        (:data:`ANSWER_NEUTRAL`: return_dict_in_generate: true was a traceback, the harness reading a tensor of ids;
        use_cache, which the harness passes itself, "got multiple values"); one that generate() refuses is one
        line naming the task's settings (a traceback before)."""
        asked = {k: v for k, v in generation_kwargs.items() if k not in ANSWER_NEUTRAL}

        def settings() -> str:  # (for an error only) the task's settings as the harness hands them on: do_sample and
            # temperature always, its defaults if the task gave none; the prompts' attention_mask is its own
            return ", ".join(f"{k}={shown(v, 40)}" for k, v in sorted(generation_kwargs.items())
                             if k != "attention_mask")

        if max_length <= context.shape[1]:  # (generate()'s "max_length is set to 6", blamed on settings not given)
            raise UserError(f"a task's generation settings leave no token to generate: prompts of {context.shape[1]} "
                            f"tokens and max_length={max_length} (their length + max_gen_toks, or the task's own "
                            f"max_length); give max_gen_toks >= 1, and no max_length")
        if asked.get("num_return_sequences", 1) != 1:  # (the harness's zip() of prompts and answers: a traceback)
            raise UserError(f"a task's generation_kwargs ({settings()}) ask for more than one answer per prompt: the "
                            f"harness reads one; leave num_return_sequences out")
        try:
            return super()._model_generate(context, max_length, stop, **asked)
        except (ValueError, TypeError, ArithmeticError) as e:  # (num_beams: 0 was a ZeroDivisionError traceback)
            raise UserError(f"a task's generation_kwargs ({settings()}) do not work with this model: "
                            f"{error_detail(e, 200, with_type=isinstance(e, ArithmeticError))}") from None

    def tok_decode(self, tokens, skip_special_tokens: bool = False):
        return super().tok_decode(tokens, skip_special_tokens=skip_special_tokens)

    def tok_batch_encode(self, strings, padding_side: str = "left", left_truncate_len=None, truncation: bool = False):
        """The harness's left-padded batch of prompts (generate_until), a prompt that encodes to no tokens (an empty
        one, or whitespace the paper's BPE drops) given the prefix token, as a log-likelihood's empty context is:
        alone it was a (1, 0) batch and a traceback, in a batch a row of padding only, continued from nothing."""
        ids_BT, mask_BT = super().tok_batch_encode(strings, padding_side, left_truncate_len, truncation)
        empty_B = ~mask_BT.bool().any(-1) if mask_BT.shape[-1] else torch.ones(len(strings), dtype=torch.bool)
        if not bool(empty_B.any()):
            return ids_BT, mask_BT
        if not mask_BT.shape[-1]:  # every prompt empty: one column for the prefix tokens
            ids_BT = torch.zeros(len(strings), 1, dtype=torch.long)
            mask_BT = torch.zeros(len(strings), 1, dtype=torch.long)
        ids_BT, mask_BT = ids_BT.clone(), mask_BT.clone()
        ids_BT[empty_B, -1] = self.prefix_token_id  # (its last column: the row stays left-padded)
        mask_BT[empty_B, -1] = 1
        return ids_BT, mask_BT


def check_dtype_fields(config: dict, path: Path) -> None:
    """``config.json``'s ``dtype`` (``torch_dtype`` in transformers 4.x): null or the name of a torch dtype.
    transformers reads it again where it loads the tokenizer, and a bad one failed there, blamed on the
    tokenizer ("the tokenizer in DIR does not load (module 'torch' has no attribute 'bogus')")."""
    for field in ("dtype", "torch_dtype"):
        value = config.get(field)
        if value is not None and not (isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype)):
            raise CheckpointError(f"{path}: {field}={value!r} is not the name of a torch dtype (float32, bfloat16, "
                                  f"float16, ...; `gbattn export` writes float32)")


def check_tokenizer_is_the_exported_one(tokenizer, model_dir: Path, section: dict, block_size: int) -> None:
    """The transformers tokenizer of an exported directory checked against the one `gbattn export` writes from its
    ``gbattn-tokenizer.json`` (whose fingerprint config.json records, as `gbattn eval` reads it): the same
    vocabulary, special tokens and encodings. Its tokenizer.json with two ids swapped, or a tokenizer_config.json
    naming another eos or bos token, was scored silently (byte perplexity 59.57 and 59.16 where it is 58.97). A
    directory without gbattn's file (a save_pretrained, not an export) has nothing to be checked against."""
    from gbattn.data.tokenizer import Tokenizer
    from gbattn.hf.tokenization import hf_tokenizer
    from gbattn.rundir import EXPORTED_TOKENIZER, recorded_fingerprint

    if not (model_dir / EXPORTED_TOKENIZER).exists():
        return
    # (the gbattn section's record: config.json's top level holds none, and an edited file was read unchecked)
    own = Tokenizer.load(model_dir / EXPORTED_TOKENIZER, recorded=recorded_fingerprint(section, of="tokenizer"))
    expected = hf_tokenizer(own, block_size)
    # every token's text, then plain text with blank lines (where the tokenizer has its characters): a changed
    # normalizer, pre-tokenizer or post-processor encodes one of them otherwise, a changed decoder decodes them so
    probe = "".join(expected.decode([i]) for i in range(len(expected)))
    with contextlib.suppress(Exception):  # (a char tokenizer without "H" has no token for it, nor an unknown one)
        expected("\nHello, world!\n\nThe end.  ", verbose=False)
        probe += "\nHello, world!\n\nThe end.  "
    ids = expected(probe, verbose=False)["input_ids"]

    def form(of, t):
        try:
            return of(t)
        except Exception as e:  # a damaged file transformers loads but cannot use (an empty unk_token recursed)
            return f"failed: {type(e).__name__}"

    differs = [what for what, of in (
        ("vocabulary", lambda t: t.get_vocab()),
        ("special tokens", lambda t: (t.special_tokens_map, t.all_special_ids)),
        ("encoding", lambda t: (t(probe, verbose=False)["input_ids"],  # (a probe past model_max_length: no warning)
                                t(probe, add_special_tokens=False, verbose=False)["input_ids"])),
        ("decoding", lambda t: (t.decode(ids), t.decode(ids, skip_special_tokens=True))),
    ) if form(of, tokenizer) != of(expected)]
    if differs:
        raise CheckpointError(f"the tokenizer files in {model_dir} differ from those `gbattn export` writes for its "
                              f"{EXPORTED_TOKENIZER} ({', '.join(differs)}): they were edited, come from another "
                              f"model, or were written by an earlier gbattn; copy them from the exported directory, "
                              f"or export again")


# The JSON file of an exported directory that transformers reads besides config.json and outside the tokenizer's
# loading (whose every failure is one line, "the tokenizer in DIR does not load").
TRANSFORMERS_JSON = ("generation_config.json",)


def refuse_files_elsewhere(model_dir: Path) -> None:
    """Refuse a tokenizer_config.json with a ``*_file`` setting: transformers 4.x reads the file it names, wherever
    that is (a received export's ``"tokenizer_file": "/dev/zero"`` filled the memory; a bare name is read from the
    current folder, not the export's); `gbattn export` writes no such setting."""
    path = model_dir / "tokenizer_config.json"
    if not path.is_file():
        return
    for key, value in read_json(path).items():
        if key.endswith("_file") and value is not None:
            raise CheckpointError(f"{path}: {key}={value!r} names a file for transformers to read, wherever it is "
                                  f"(`gbattn export` writes no such setting); copy the tokenizer files from the "
                                  f"exported directory")


def load_model(model_dir: str | Path, checkpoint: str | None, device: torch.device):
    """(model in eval mode on ``device``, tokenizer, block_size, max_length: the input tokens per row it trained on,
    step, which weights: ``exported`` or the run's ``best``/``last``) of a run or exported directory."""
    if is_exported(model_dir):
        config = read_config(Path(model_dir) / CONFIG)
        # a transformers checkpoint's model.safetensors makes it look exported: the Auto classes would load a
        # model of another library, which has no gbattn record (a traceback before)
        refuse_hf_checkpoint(config, model_dir)
        if config.get("model_type") != "gbattn":  # with a gbattn dict: the Auto classes would build the model
            # model_type names at its library's default size (a 7B Llama for "llama"), or, without one, a model
            # whose name is part of the directory's
            raise CheckpointError(f"{Path(model_dir) / CONFIG}: model_type={config.get('model_type')!r}, not 'gbattn' "
                                  f"as `gbattn export` writes it: transformers would build another kind of model "
                                  f"from it")
        check_dtype_fields(config, Path(model_dir) / CONFIG)
        # gbattn's reader first, as for config.json: a file nested too deeply was a RecursionError traceback from
        # transformers' json.load, a huge one would fill the memory
        for name in TRANSFORMERS_JSON:
            if (Path(model_dir) / name).exists():
                read_json(Path(model_dir) / name)
        if not (Path(model_dir) / "tokenizer.json").is_file():
            raise CheckpointError(f"{model_dir} has no tokenizer.json (`gbattn export` writes it, transformers' "
                                  f"save_pretrained of the model does not): copy the tokenizer files from the "
                                  f"exported directory")
        # gbattn's checks of its record's fields, as gbattn eval makes them (a step that is no integer went into
        # the results); GbattnConfig checks the model's
        section = gbattn_section(config, Path(model_dir) / CONFIG) or {}
        check_exported_checkpoint(Path(model_dir), checkpoint, section.get("checkpoint"))
        # the stored weights as gbattn's own readers check them: safetensors only (the Auto classes would unpickle a
        # pytorch_model.bin in its place), floating-point and finite (integers were cast silently, NaN evaluated)
        stored = read_exported_weights(Path(model_dir), "cpu")
        check_finite(stored, model_dir)
        try:
            with quiet_transformers():  # float32, as a run directory's model: transformers 5.x would load the
                # dtype the weights were saved in (bfloat16 after a save of a converted model), 4.x float32
                model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True,
                                                                   dtype=torch.float32)
        except RuntimeError as e:  # transformers 5 refuses weights of another shape itself (4.x reports them)
            if "size mismatch" not in str(e) and "ignore_mismatched_sizes" not in str(e):
                raise
            raise CheckpointError(f"the weights in {model_dir} do not match its config "
                                  f"({error_detail(e, 160)})") from None
        except ConfigError as e:  # GbattnConfig's own line (gbattn's field names at the top level): whole, its advice
            # included (cut at 160 characters it ended in '...; delet')
            raise CheckpointError(f"{model_dir} does not load in transformers ({e})") from None
        except (SafetensorError, TypeError, ValueError, OSError) as e:  # a damaged model.safetensors or
            # generation_config.json (tracebacks before)
            for weights in sorted(Path(model_dir).glob("*.safetensors")):  # a clone without Git LFS, as gbattn eval
                refuse_lfs_pointer(weights)
            raise CheckpointError(f"{model_dir} does not load in transformers ({error_detail(e, 160)})") from None
        wrong = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if wrong:  # the Auto classes would go on with freshly initialised weights
            detail = "; ".join(f"{k.replace('_', ' ')}: {', '.join(map(str, sorted(v, key=str)[:3]))}"
                               for k, v in wrong.items())
            raise CheckpointError(f"the weights in {model_dir} do not match its config ({detail})")
        gpt_weights(stored, model.config.tie_word_embeddings, model_dir)  # a tied model's other head: refused
        del stored
        refuse_files_elsewhere(Path(model_dir))
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        except Exception as e:  # a file that does not parse; transformers 4.x then tries other loaders (ImportError)
            refuse_lfs_pointer(Path(model_dir) / "tokenizer.json")
            raise CheckpointError(f"the tokenizer in {model_dir} does not load ({error_detail(e, 160)})") from None
        if tokenizer.eos_token_id is None and tokenizer.bos_token_id is None:  # the harness decoded None: a traceback
            raise CheckpointError(f"the tokenizer in {model_dir} names no end-of-text token (eos_token in its "
                                  f"tokenizer_config.json, which `gbattn export` writes), nor a bos_token: lm-eval "
                                  f"starts the text it scores with one; copy the tokenizer files from the exported "
                                  f"directory")
        limit = tokenizer.model_max_length  # compared with each text's length (a TypeError traceback at the first)
        if isinstance(limit, bool) or not isinstance(limit, (int, float)):
            raise CheckpointError(f"the tokenizer in {model_dir}: model_max_length={limit!r} in its "
                                  f"tokenizer_config.json is not a number of tokens; copy the tokenizer files from the "
                                  f"exported directory")
        # a request meeting an id past the vocabulary was a traceback from the model; the largest id, not the count of
        # tokens (a tokenizer.json whose ids leave gaps has fewer tokens than its largest id)
        top_id = max(tokenizer.get_vocab().values(), default=-1)
        if top_id >= model.config.vocab_size:
            raise CheckpointError(f"the tokenizer in {model_dir} has token ids up to {top_id:,}, past the model's "
                                  f"vocabulary of {model.config.vocab_size:,} (ids from {model.config.vocab_size:,} on "
                                  f"have no embedding): its tokenizer files do not belong to this model")
        check_tokenizer_is_the_exported_one(tokenizer, Path(model_dir), section, model.config.max_position_embeddings)
        harness_outputs(model, tokenizer)
        step, which = section.get("step", 0), exported_weights_label(section, model.model.state_dict())
        # as LoadedRun.seq_len reads it from the run's config.json (an export's gbattn section is that file's)
        trained = section.get("seq_len") or (section.get("train") or {}).get("seq_len")
        max_length = min(trained or model.config.max_position_embeddings - 1, model.config.max_position_embeddings)
    else:
        run = load_run(model_dir, checkpoint, "cpu")
        model, tokenizer = wrap_run(run)
        step, which, max_length = run.step, run.checkpoint, run.seq_len
    block_size = model.config.max_position_embeddings
    return model.to(device).eval(), tokenizer, block_size, max_length, step, which


# A task's generation_kwargs that change what generate() returns or how, not the answer: left out of its call.
ANSWER_NEUTRAL = frozenset({"return_dict_in_generate", "output_scores", "output_logits", "output_attentions",
                            "output_hidden_states", "use_cache"})

# What the harness reads of a forward (``.logits``) and of generate() (a tensor of ids), in the model's config and
# its generation config; a save_pretrained after `config.return_dict = False` or `output_hidden_states = True` kept
# other values, with which every request was a traceback (a tuple has no .logits), or held every layer's states for
# nothing.
HARNESS_OUTPUTS = {"return_dict": True, "output_attentions": False, "output_hidden_states": False}
HARNESS_GENERATE_OUTPUTS = {"return_dict_in_generate": False, "output_attentions": False, "output_hidden_states": False}


def harness_outputs(model, tokenizer) -> None:
    """The outputs the harness reads, whatever the loaded directory's configs asked for (they change no score), and
    generation as the harness asks for it: a generation config of the (checked) tokenizer's special tokens, as a run
    directory's is (:func:`gbattn.hf.export.wrap_run`). An export's generation_config.json with max_new_tokens=2 cut
    every answer to 2 tokens, transformers letting it win over the harness's max_gen_toks (with 100, past the
    positions, every request was a traceback); its config.json's eos_token_id edited to the id of "e" cut the answer
    "eeeeeeee" to "e", and suppress_tokens or repetition_penalty there changed answers under transformers 4.x."""
    from transformers import GenerationConfig

    from gbattn.hf.configuration import GbattnConfig
    from gbattn.hf.tokenization import model_token_ids

    for name, value in HARNESS_OUTPUTS.items():
        setattr(model.config, name, value)
    special = model_token_ids(tokenizer)  # as wrap_run's
    for name, value in special.items():
        setattr(model.config, name, value)
    model.generation_config = GenerationConfig.from_model_config(GbattnConfig(gbattn=model.config.gbattn, **special))
    for name, value in HARNESS_GENERATE_OUTPUTS.items():
        setattr(model.generation_config, name, value)
    # transformers 4.x rebuilds a generation config "from the model config" at generate() where config.json holds
    # generation settings (return_dict_in_generate, suppress_tokens, ...): this one is gbattn's, kept
    model.generation_config._from_model_config = False


def close_progress_bars() -> None:
    """Close the tqdm bars a failing harness call left open."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


class GbattnTaskManager(TaskManager):
    """The harness's task index, whose building of the tasks (``simple_evaluate``'s first step: each task's YAML
    made into a task, its data loaded, its first document rendered) turns a mistake of a task's own (an
    output_type, a metric, a split or a template: tracebacks before) into one line. Its data not found or
    not reachable is left to :func:`run_lm_eval`, which says where to look."""

    def load(self, tasks, *args, **kwargs):
        try:
            return super().load(tasks, *args, **kwargs)
        except (FileNotFoundError, ConnectionError):
            raise
        except Exception as e:
            close_progress_bars()
            if reason := full_disk_reason(e):  # (the harness's datasets cache on a full disk: the YAML was blamed)
                raise UserError(f"lm-eval could not build the task(s) {list(tasks)}: a write failed ({reason}); free "
                                f"space where it writes (the datasets cache under HF_HOME), then run again") from None
            raise UserError(f"lm-eval could not build the task(s) {list(tasks)} from their YAML "
                            f"({error_detail(e, 160, with_type=True)}): check the task's output_type, metric_list, "
                            f"splits and templates, and its first document, which the harness renders then (an "
                            f"empty choice: IndexError)") from None


def task_manager(tasks: list[str], include_path: str | None) -> TaskManager:
    """The harness's task index: the include path alone when it has every task (fast), else with the
    harness's own tasks; unknown names are a one-line error."""
    manager = None
    if include_path:
        if not Path(include_path).is_dir():
            raise UserError(f"--include-path {include_path} is not a directory")
        manager = GbattnTaskManager(include_path=include_path, include_defaults=False)
        if any(not manager.match_tasks([t]) for t in tasks):
            manager = None
    manager = manager or GbattnTaskManager(include_path=include_path)
    matches = {t: manager.match_tasks([t]) for t in tasks}
    unknown = [t for t, matched in matches.items() if not matched]
    if unknown:
        skipped = unparsed_task_files(include_path) if include_path else []
        verb = "does" if len(skipped) == 1 else "do"
        hint = f"; the harness skipped {', '.join(skipped[:3])}, which {verb} not parse" if skipped else ""
        raise UserError(f"unknown lm-eval task(s) {unknown}: see `lm-eval ls tasks`, or pass --include-path DIR "
                        f"with the task's YAML{hint}")
    # a glob ("mmlu_*") passed the check above and reached the harness unexpanded, which blamed the task's YAML
    patterns = {t: matched for t, matched in matches.items() if matched != [t]}
    if patterns:
        pattern, matched = next(iter(patterns.items()))
        raise UserError(f"--tasks {pattern!r} is a pattern; name the tasks it matches: "
                        f"{','.join(matched[:20])}{',...' if len(matched) > 20 else ''}")
    return manager


def unparsed_task_files(include_path: str) -> list[str]:
    """``name (reason)`` of each YAML file under ``include_path`` that the harness's task index skips, as it
    reads them (its loader, then its entry for the file), saying so only at debug level."""
    try:  # (private parts of the pinned harness, 0.4.13)
        from lm_eval.tasks._index import TaskIndex
        from lm_eval.tasks._yaml_loader import load_yaml

        files = list(TaskIndex._iter_yaml_files(Path(include_path)))
    except (ImportError, AttributeError):  # another version of the harness: no hint
        return []
    skipped = []
    for path in files:
        try:
            TaskIndex.process_cfg(load_yaml(path, resolve_func=False, recursive=True), path, {})
        except Exception as e:
            skipped.append(f"{path.relative_to(include_path)} ({error_detail(e, 80, with_type=True)})")
    return skipped


def run_lm_eval(model_dir: str | Path, tasks: list[str], include_path: str | None = None, limit: float | None = None,
                batch_size: int = 8, device: torch.device | str = "cpu", checkpoint: str | None = None,
                num_fewshot: int | None = None, log_samples: bool = False) -> dict:
    """The harness's results dict (``samples`` in it with ``log_samples``)."""
    manager = task_manager(tasks, include_path)
    model, tokenizer, block_size, max_length, step, which = load_model(model_dir, checkpoint, torch.device(device))
    # logits_cache=False: the harness's cache groups requests by context + continuation[:-1] tokens and scores each
    # group's longest once, reusing its logits for the rest even where their split between context and continuation
    # differs (a choice merged into the context's last token scored 0.0 as greedy; two documents' windows of a
    # rolling perplexity shared a group and scored each other's tokens: byte perplexity 27.00 at batch 8, 15.78 at 1).
    lm = GbattnLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size,
                  max_length=max_length, logits_cache=LOGITS_CACHE)
    # The harness encodes whole documents and cuts them into windows of max_length itself, so the
    # tokenizer's warning that a text is longer than the model takes (with "indexing errors") is untrue here.
    tokenizer_log = logging.getLogger("transformers.tokenization_utils_base")
    tokenizer_log.addFilter(_windowed_by_the_harness)
    try:
        # batch_size and device only go into the results' config record (null there without them)
        with hub_access(other_logs=True):  # (a hub task offline: 23-53 s of retries, each a line, before the error)
            results = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit,
                                      num_fewshot=num_fewshot, log_samples=log_samples, batch_size=batch_size,
                                      device=str(device))
    except AssertionError as e:  # the harness checks a task against the model so (max_gen_toks < block size)
        close_progress_bars()  # the harness's bar, left open by the failed check, would print after the error
        raise UserError(f"lm-eval refused the task for this model ({harness_refusal(e, max_length)})") from None
    except ConnectionError as e:  # `datasets` without the hub and with no cached copy of a task's data
        close_progress_bars()
        raise UserError(f"lm-eval could not load a task's data ({error_detail(e, 160)}): the harness's tasks download "
                        f"their data from the Hugging Face hub; run once where it is reachable (the datasets cache "
                        f"keeps it), or use local tasks (--include-path)") from None
    except FileNotFoundError as e:  # a task's data files (local paths are relative to the working directory)
        close_progress_bars()
        raise UserError(f"lm-eval could not find a task's data ({error_detail(e, 160)}); a task YAML's local data "
                        f"paths are read relative to the working directory") from None
    except UserError:  # (GbattnLM's: a task's generation settings)
        close_progress_bars()
        raise
    except Exception as e:
        if "Missing [UNK] token" not in str(e):
            raise
        # The tokenizers library's error for a character a character-level vocabulary lacks.
        close_progress_bars()
        raise UserError(f"a task's text (a prompt, an answer or a stop string) has a character this model's tokenizer "
                        f"cannot encode (a character-level tokenizer knows only the characters of the corpus it was "
                        f"built from; {error_detail(e, 120)})") from None
    finally:
        tokenizer_log.removeFilter(_windowed_by_the_harness)
    results["gbattn"] = {"step": step, "block_size": block_size, "max_length": max_length, "checkpoint": which,
                         "logits_cache": LOGITS_CACHE}
    not_applied = fewshot_not_applied(results, num_fewshot)
    if not_applied:  # (the results were named and labelled --num-fewshot's, silently)
        note(f"note: --num-fewshot {num_fewshot} does not apply to {'; '.join(not_applied.values())}: "
             f"{'its' if len(not_applied) == 1 else 'their'} results are 0-shot")
        results["gbattn"]["num_fewshot_not_applied"] = sorted(not_applied)
    return results


def fewshot_not_applied(results: dict, num_fewshot: int | None) -> dict[str, str]:
    """The tasks a ``num_fewshot`` of examples asked for did not go before, each with why: the harness keeps a task's
    YAML ``num_fewshot: 0`` (``n-shot`` 0 in the results), and a rolling log-likelihood scores each document alone
    (its ``n-shot`` says the number asked all the same)."""
    if not num_fewshot:
        return {}
    configs = results.get("configs", {})
    groups = set(results.get("group_subtasks", {})) - set(configs)  # (a group takes its tasks' count: no YAML of it)
    why = {}
    for task, shots in results.get("n-shot", {}).items():
        if task in groups:
            continue
        if shots != num_fewshot:
            why[task] = f"{task} (its YAML fixes num_fewshot: {shots})"
        elif configs.get(task, {}).get("output_type") == "loglikelihood_rolling":
            why[task] = f"{task} (a rolling log-likelihood scores each document alone)"
    return why


# The harness's checks of a log-likelihood request that it asserts without a message, by their source line: what
# each means for a task's answers.
HARNESS_CHECKS = {
    "len(continuation_enc) > 0": "an answer (continuation) encodes to no tokens of its own: it is empty, or its tokens "
                                 "merge with the end of the question's (a task's target_delimiter, such as ' ', keeps "
                                 "them apart)",
    "len(context_enc) > 0": "a question (context) encodes to no tokens: the harness moves a question's trailing "
                            "whitespace into its answer, so a question of whitespace only is empty (an empty one takes "
                            "the prefix token: leave it empty)",
    "len(continuation_enc) <= self.max_length": "an answer (continuation) is longer than the {max_length} input "
                                                "tokens the model trained on (its seq_len)",
}


def harness_refusal(e: AssertionError, max_length: int) -> str:
    """Why the harness refused a task: its assertion's message, or for a check it asserts without one, what that check
    means (the message was "malformed"), else the check's source line."""
    if str(e):
        return error_detail(e, 200)
    frames = traceback.extract_tb(e.__traceback__)
    check = (frames[-1].line or "").removeprefix("assert ").strip() if frames else ""
    if check in HARNESS_CHECKS:
        return HARNESS_CHECKS[check].format(max_length=max_length)
    return f"its check `{check}` failed" if check else "an assertion without a message"


IN_MEMORY_WARNINGS = ("`pretrained` model kwarg is not of type `str`", "Passed an already-initialized model")


def _not_in_memory_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(IN_MEMORY_WARNINGS)


def _windowed_by_the_harness(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Token indices sequence length is longer than")


def file_name_part(task: str) -> str:
    """A task's name safe as part of a file name (a task YAML may name it ``my/task``)."""
    return re.sub(r"[^\w.+-]", "_", task)


def results_stem(tasks: list[str], limit: float | None, num_fewshot: int | None, checkpoint: str | None = None) -> str:
    """``hellaswag+piqa[-limit100][-5shot][-last]``, safe as a file name: ``--checkpoint last`` has its own (it
    replaced the best weights' results file); ``best``, the default, none."""
    stem = "+".join(map(file_name_part, tasks))
    if limit is not None:  # exactly as given (":g" kept 6 digits: --limit 1234567 and 1234568 shared one file)
        stem += f"-limit{int(limit) if float(limit).is_integer() else repr(float(limit))}"
    if num_fewshot is not None:
        stem += f"-{num_fewshot}shot"
    if checkpoint == "last":
        stem += "-last"
    return stem


def is_machine_path(text: str) -> bool:
    """An absolute path of one line and two parts or more: without whitespace, or (``/home/A User/...``) one that
    exists. Document text that merely starts with ``/`` is neither, and neither is ``/`` or ``/usr`` (a task's answer
    "/" was written "."; a top-level folder names no machine's files)."""
    return (os.path.isabs(text) and "\n" not in text and len(Path(text).parts) > 2
            and (not any(c.isspace() for c in text) or os.path.exists(text)))


def portable(obj, roots: list[Path], existing_only: bool = False):
    """``obj`` as JSON values, with every string that is an absolute path made relative: to the
    parent of the first of ``roots`` holding it, else to the working directory, else its last two
    parts (results files hold no paths of the machine that wrote them). ``existing_only`` (the logged samples:
    documents, prompts and answers, where "/2" or "/wiki/Coriolanus" is text): only paths that exist here. A
    generation's stop sequences (``until``) are text, kept as they are. Values
    JSON has no type for (numpy numbers, sets, ...) become what lm-evaluation-harness writes for them."""
    if isinstance(obj, dict):  # a task's stop sequences are text ("/" and "/end" were written "." and "end")
        return {k: v if k == "until" else portable(v, roots, existing_only) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [portable(v, roots, existing_only) for v in obj]
    if isinstance(obj, str) and is_machine_path(obj) and (not existing_only or os.path.exists(obj)):
        resolved = Path(obj).resolve()  # through symlinks, as the roots are
        base = next((root.parent for root in roots if resolved.is_relative_to(root.resolve())), Path.cwd())
        return relative_path(resolved, base)
    if obj is None or isinstance(obj, (str, int, float)):
        return obj
    return portable(handle_non_serializable(obj), roots, existing_only)


NAME_MAX = 255  # bytes in a file name on the usual file systems (ext4, XFS, APFS, NTFS)


def samples_path(out: Path, task: str) -> Path:
    """Where a task's samples go beside the results file ``out``: ``samples-<task>-<stem>.jsonl``."""
    return out.with_name(f"samples-{file_name_part(task)}-{out.stem.removeprefix('results-')}.jsonl")


def check_file_names(out: Path, tasks: list[str], log_samples: bool) -> None:
    """A results file, or with ``--log-samples`` a task's samples file, whose name with atomic_write's temporary
    suffix is longer than a file system takes is refused before the evaluation: it failed after it, the results (or
    the samples) lost; so are two tasks whose samples files would have one name. (A group's subtasks, known only
    once it runs, can name longer samples files.)"""
    names = [out.name] + [samples_path(out, task).name for task in tasks if log_samples]
    same = next((name for name in names[1:] if names[1:].count(name) > 1), None)
    if same is not None:  # (toy/mc and toy_mc: the second's samples replaced the first's, both named written)
        clashing = [task for task in tasks if samples_path(out, task).name == same]
        raise UserError(f"--log-samples: tasks {', '.join(clashing)} would write one samples file, {same}; evaluate "
                        f"them in separate calls (or with separate --output names)")
    longest = max(names, key=lambda name: len(os.fsencode(name)))
    if len(os.fsencode(longest + building_suffix())) > NAME_MAX:
        raise UserError(f"lm-eval would write {longest[:40]}... ({len(os.fsencode(longest)):,} bytes, and "
                        f"{len(building_suffix())} more while it is written): longer than the {NAME_MAX} a file name "
                        f"may have; give --output a shorter name, or fewer tasks per call")


def write_results(results: dict, out: Path, roots: list[Path]) -> list[Path]:
    """``out`` (the results, without samples) and, with samples, ``samples-<task>.jsonl`` beside it."""
    samples = results.pop("samples", None)
    results.pop("pretty_env_info", None)  # the machine's description
    written = [out]
    out.parent.mkdir(parents=True, exist_ok=True)
    # An earlier call's samples of these tasks that this call does not log: they described other weights (a run
    # resumed since, re-exported) beside results that no longer hold them, and carry no step of their own (removed
    # once the new results are written: a failed write keeps the previous results with their samples)
    tasks = set(results.get("results") or {}) | set(results.get("configs") or {})
    stale = [path for task in tasks - set(samples or {}) if (path := samples_path(out, task)).is_file()]
    # the results and their samples replaced together: a full disk under a samples file left the new results beside
    # the previous samples, another model's
    files = [(out, json_text(portable(results, roots)))]
    for task, rows in (samples or {}).items():
        path = samples_path(out, task)
        lines = (json.dumps(finite(portable(r, roots, existing_only=True)), ensure_ascii=False) for r in rows)
        files.append((path, "".join(line + "\n" for line in lines)))
        written.append(path)
    atomic_write_all(files)
    for path in stale:
        path.unlink(missing_ok=True)
    if samples is not None:
        results["samples"] = samples
    return written


def print_tables(results: dict) -> None:
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
