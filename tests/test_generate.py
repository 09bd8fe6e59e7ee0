"""Generation: reproducible with a seed, cache == no cache, and the CLI."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from gbattn.cli import main as cli_main
from gbattn.model import decoding
from gbattn.model.decoding import generate
from gbattn.train.trainer import train
from helpers import give_run_tokenizer, left_pad, tiny_configs, write_corpus
from test_model import tiny_model


@pytest.fixture(scope="module")
def four_step_run(tmp_path_factory):
    """A tiny run trained 4 steps, which the tests that only generate from it share (they leave it as it is)."""
    root = tmp_path_factory.mktemp("four-step")
    train(root / "run", *tiny_configs(write_corpus(root / "c"), max_steps=4, eval_every=4), quiet=True)
    return root / "run"


def test_greedy_cached_equals_uncached(variant_case):
    model = tiny_model(variant_case)
    prompt = torch.randint(0, 37, (2, 5))
    a = generate(model, prompt, 30, temperature=0, use_cache=True)  # runs past block_size=24
    b = generate(model, prompt, 30, temperature=0, use_cache=False)
    assert a.shape == (2, 35)
    assert torch.equal(a, b)
    assert not model.has_cache


def test_generate_runs_in_eval_mode_and_restores_the_mode():
    """A model in training mode with dropout generates what it generates in eval mode (no dropout while
    decoding) and is back in its own mode afterwards (eval stays eval, training stays training)."""
    model = tiny_model(("boosted", {}), dropout=0.5)
    prompt = torch.randint(0, 37, (2, 5))
    expected = generate(model, prompt, 12, temperature=0)
    assert not model.training
    model.train()
    for use_cache in (True, False):
        assert torch.equal(generate(model, prompt, 12, temperature=0, use_cache=use_cache), expected)
        assert model.training
    # each module's own mode: a block kept in eval mode while the rest trains stays so (model.train(was) set every
    # module: its dropout came back on)
    model.blocks[0].eval()
    modes = {name: module.training for name, module in model.named_modules()}
    generate(model, prompt, 3, temperature=0)
    assert {name: module.training for name, module in model.named_modules()} == modes


def test_generate_leaves_the_callers_kv_cache_as_it_was():
    """generate dropped a cache the caller had set up and filled: the caller's next decode step
    (model(token, input_pos=[t])) then ran without a cache and saw only its own token, silently; with
    use_cache=False it refused to run ("a KV cache is set up: pass input_pos")."""
    model = tiny_model(("boosted", {}))
    idx = torch.randint(0, 37, (1, 8))
    full = model(idx)
    model.setup_cache(batch=1, max_len=16)
    model(idx[:, :7], input_pos=torch.arange(7))
    for use_cache in (False, True):
        generate(model, torch.randint(0, 37, (2, 3)), 4, temperature=0, use_cache=use_cache)
    torch.testing.assert_close(model(idx[:, 7:], input_pos=torch.tensor([7]))[:, -1], full[:, -1])
    model.clear_cache()
    generate(model, idx, 2, temperature=0)
    assert not model.has_cache


def test_a_refused_generate_leaves_the_model_as_it_was():
    """A padded prompt longer than block_size was refused after generate had put the model in eval mode
    and dropped the caller's KV cache: the caller's model was left changed by a call that did nothing."""
    model = tiny_model(("boosted", {}))
    model.train()
    model.setup_cache(batch=1, max_len=8)
    callers_cache = model.kv_cache
    long_BT = torch.randint(0, 37, (1, model.cfg.block_size + 1))
    refused = [dict(prompt_mask=torch.arange(long_BT.shape[1]).unsqueeze(0) > 0), dict(temperature=-1.0)]
    for kwargs in refused:
        with pytest.raises(ValueError):
            generate(model, long_BT, 2, **kwargs)
        assert model.training and model.kv_cache is callers_cache
    with pytest.raises(ValueError, match="outside the vocabulary"):  # refused by the forward, inside generate
        generate(model, long_BT[:, :4] + 100, 2)
    assert model.training and model.kv_cache is callers_cache


def test_sampling_reproducible_with_seed():
    model = tiny_model(("boosted", {}))
    prompt = torch.randint(0, 37, (3, 4))
    a = generate(model, prompt, 12, temperature=1.0, top_k=10, seed=7)
    b = generate(model, prompt, 12, temperature=1.0, top_k=10, seed=7)
    c = generate(model, prompt, 12, temperature=1.0, top_k=10, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a[:, :4], prompt)


def test_generate_cli(four_step_run, capsys):
    """A seeded generation prints the prompt and its continuation, the same twice; --max-new-tokens 0 the prompt
    alone."""
    code = cli_main(["generate", str(four_step_run), "--prompt", "the cat", "--max-new-tokens", "10", "--seed", "1"])
    printed = capsys.readouterr()
    out = printed.out
    assert code == 0 and out.startswith("the cat") and "KV cache" in printed.err and "tokens/s" not in out
    cli_main(["generate", str(four_step_run), "--prompt", "the cat", "--max-new-tokens", "10", "--seed", "1"])
    assert capsys.readouterr().out.split("---")[0] == out.split("---")[0]
    assert cli_main(["generate", str(four_step_run), "--prompt", "the cat", "--max-new-tokens", "0"]) == 0
    printed = capsys.readouterr()
    assert printed.out == "the cat\n---\n" and printed.err == "1 x 0 tokens: the prompt alone, no decoding\n"


def test_run_generate_has_the_clis_defaults(four_step_run, capsys):
    """gbattn.load_run(...).generate(prompt, seed=1) is `gbattn generate --prompt ... --seed 1`'s text: the same
    number of tokens, temperature and top-k (it sampled at temperature 1 without a top-k, other text)."""
    import gbattn

    assert cli_main(["generate", str(four_step_run), "--prompt", "the cat", "--seed", "1"]) == 0
    printed = capsys.readouterr().out
    assert gbattn.load_run(four_step_run).generate("the cat", seed=1) + "\n---\n" == printed


def test_ctrl_c_during_generate_prints_the_text_made_so_far(four_step_run, capsys, monkeypatch):
    """Ctrl-C after 6 of 40 tokens: the prompt and those 6 tokens are printed (a seeded run's first 6), a note says
    how many were made, and the command ends as interrupted (130); a long generation stopped printed nothing."""
    from gbattn.progress import Progress

    command = ["generate", str(four_step_run), "--prompt", "the cat", "--seed", "1", "--max-new-tokens"]
    assert cli_main([*command, "6"]) == 0
    six = capsys.readouterr().out
    made = []

    def update(self, n=1):
        made.append(n)
        if len(made) == 6:
            raise KeyboardInterrupt

    monkeypatch.setattr(Progress, "update", update)
    assert cli_main([*command, "40"]) == 130
    printed = capsys.readouterr()
    assert printed.out == six and len(six) > len("the cat\n---\n")
    assert "note: stopped after 6 of 40 new tokens" in printed.err and printed.err.endswith("gbattn: interrupted\n")
    made.clear()  # two samples: the note counts the tokens of a sample (6), not of both (12)
    assert cli_main([*command, "40", "--num-samples", "2"]) == 130
    assert "note: stopped after 6 of 40 new tokens" in capsys.readouterr().err


def test_generate_continues_a_prompt_of_whitespace_and_refuses_an_empty_one(tmp_path, capsys):
    """A character-level model continues a newline or a space (nanoGPT's sample.py starts from "\\n"); `--prompt
    $'\\n'` was refused as "argument --prompt: is empty", as a blank path is. "" is still empty: one line, status 2."""
    data = write_corpus(tmp_path / "c")
    train(tmp_path / "run", *tiny_configs(data, max_steps=1, eval_every=1), quiet=True)
    for prompt in ("\n", " "):
        code = cli_main(["generate", str(tmp_path / "run"), "--prompt", prompt, "--max-new-tokens", "3", "--seed", "1"])
        printed = capsys.readouterr()
        assert code == 0 and printed.out.startswith(prompt) and printed.out.endswith("\n---\n"), printed.err
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["generate", str(tmp_path / "run"), "--prompt", ""])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "gbattn: error: argument --prompt: is empty (see: gbattn generate --help)\n"


def test_run_generate_passes_its_top_k_on(four_step_run):
    """run.generate(prompt, top_k=1) samples from the likeliest token alone: the greedy text, whatever the seed. The
    defaults test above cannot tell a top_k that is dropped: the CLI's default top-k, 200, is more than a char run's
    vocabulary."""
    import gbattn

    run = gbattn.load_run(four_step_run)
    greedy = run.generate("the cat", 20, temperature=0)
    assert [run.generate("the cat", 20, top_k=1, seed=seed) for seed in (1, 2, 3)] == [greedy] * 3


def test_a_prompt_that_starts_with_a_dash_is_shown_how_to_give(tmp_path, capsys):
    """`--prompt "-ROMEO"` was read by argparse as an option: "argument --prompt: expected one argument", with no word
    of how to give such a text; the line now says (--prompt=-ROMEO), and that form is the prompt."""
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["generate", str(tmp_path / "run"), "--prompt", "-ROMEO"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("gbattn: error: argument --prompt: expected one argument; a text that starts "
                                       "with '-' is given as --prompt=TEXT (see: gbattn generate --help)\n")
    from gbattn.cli import build_parser

    assert build_parser().parse_args(["generate", "run", "--prompt=-ROMEO"]).prompt == "-ROMEO"


def test_generate_shows_control_characters_escaped_on_a_terminal_and_as_decoded_when_piped(tmp_path, capsys,
                                                                                           monkeypatch):
    """A run whose tokenizer decodes to control characters (ESC, CSI, a carriage return): they were printed raw,
    so a hostile run's tokens could send escape sequences to the user's terminal. On a terminal every control
    character but newline and tab is now shown escaped; piped, the text is written as decoded."""
    import json
    import sys
    import unicodedata

    from gbattn.terminal import terminal_text

    data = write_corpus(tmp_path / "c")
    train(tmp_path / "run", *tiny_configs(data, max_steps=1, eval_every=1), quiet=True)
    record = json.loads((tmp_path / "run" / "tokenizer.json").read_text())
    controls = iter(c for c in map(chr, range(0xA0)) if unicodedata.category(c) == "Cc" and c not in "\n\t")
    chars = [c if c == "t" else next(controls) for c in json.loads(record["payload"])["chars"]]
    record["payload"] = json.dumps({"chars": chars})
    give_run_tokenizer(tmp_path / "run", record)
    printed = {}
    for on_terminal in (False, True):
        monkeypatch.setattr(sys.stdout, "isatty", lambda on_terminal=on_terminal: on_terminal, raising=False)
        assert cli_main(["generate", str(tmp_path / "run"), "--prompt", "t", "--max-new-tokens", "20",
                         "--temperature", "0"]) == 0
        printed[on_terminal] = capsys.readouterr().out
    text = printed[False].split("\n---\n")[0]
    assert text.startswith("t") and len(text) == 21 and any(unicodedata.category(c) == "Cc" for c in text)
    assert printed[True] == terminal_text(text) + "\n---\n" and "\\x" in printed[True]
    assert not any(unicodedata.category(c) == "Cc" and c != "\n" for c in printed[True])


def test_generate_says_when_bpe_prompt_tokens_are_unknown(tmp_path, capsys):
    """The BPE maps characters it never saw to <unk>, which decoding leaves out: `--prompt 'héllo 🙂'`
    was shown as 'h ll o' with no word that the model read something else than the prompt."""
    data = write_corpus(tmp_path / "c")
    train(tmp_path / "run", *tiny_configs(data, max_steps=1, eval_every=1, tokenizer="bpe"), quiet=True)
    for prompt, note in (("the cat", None), ("the 🙂 cat", "note: 1 of the prompt's 3 tokens is <unk>")):
        code = cli_main(["generate", str(tmp_path / "run"), "--prompt", prompt, "--max-new-tokens", "2", "--seed", "1"])
        printed = capsys.readouterr()
        assert code == 0 and ("<unk>" in printed.err) == bool(note) and (note is None or note in printed.err), printed
        assert printed.out.startswith("the <unk> cat " if note else "the cat ")  # the text the model read
        assert note is None or "the text shown has <unk> in their place" in printed.err


def test_the_unknown_token_note_spells_it_as_the_tokenizer_does(tmp_path, capsys):
    """A tokenizer whose unknown token is BERT's [UNK]: the prompt shown had [UNK], the note said <unk>."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    from helpers import WORDS

    data = write_corpus(tmp_path / "c")
    backend = Backend(models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(sorted({*WORDS, "."}))}},
                                       unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "tok.json").write_text(backend.to_str())
    train(tmp_path / "run", *tiny_configs(data, max_steps=1, eval_every=1, tokenizer=f"hf={tmp_path / 'tok.json'}"),
          quiet=True)
    prompt = f"{WORDS[0]} zebra"
    assert cli_main(["generate", str(tmp_path / "run"), "--prompt", prompt, "--max-new-tokens", "1"]) == 0
    printed = capsys.readouterr()
    assert printed.out.startswith(f"{WORDS[0]} [UNK]")
    assert ("note: 1 of the prompt's 2 tokens is [UNK] (text this tokenizer never saw in training, or [UNK] itself); "
            "the model reads them as [UNK], and the text shown has [UNK] in their place") in printed.err, printed.err


def test_generated_unknown_tokens_are_shown_as_unk_and_padding_is_left_out(tmp_path, capsys, monkeypatch):
    """WikiText v1 writes its rare words as <unk> (2.7% of WikiText-2's training words), which the BPE encodes as
    its unknown token, so a model trained on it generates that token: `gbattn generate` and run.generate left it
    out of the text, so words were silently missing from what the model wrote. Both now show it as <unk>, and
    still leave <pad> out."""
    from gbattn.model.gpt import GPT
    from gbattn.rundir import load_run

    data = write_corpus(tmp_path / "c")
    for split in ("train", "valid", "test"):
        path = data / f"wiki.{split}.tokens"
        path.write_text(path.read_text().replace(" dog ", " <unk> "))
    train(tmp_path / "run", *tiny_configs(data, max_steps=1, eval_every=1, tokenizer="bpe"), quiet=True)
    run = load_run(tmp_path / "run")
    unk, pad = run.tokenizer.encode("<unk>") + run.tokenizer.encode("<pad>")
    assert unk == run.tokenizer.unknown_id
    model_generate = GPT.generate

    def generating_unknown_and_padding(self, idx_BT, max_new_tokens, **kwargs):
        out_BT = model_generate(self, idx_BT, max_new_tokens, **kwargs)
        return torch.cat([out_BT, torch.tensor([[unk, pad, unk]] * len(out_BT))], dim=1)

    monkeypatch.setattr(GPT, "generate", generating_unknown_and_padding)
    assert run.generate("the cat", 2, seed=1).endswith(" <unk> <unk>")
    code = cli_main(["generate", str(tmp_path / "run"), "--prompt", "the cat", "--max-new-tokens", "2", "--seed", "1"])
    printed = capsys.readouterr()
    text = printed.out.split("\n---\n")[0]
    assert code == 0 and text.startswith("the cat ") and text.endswith(" <unk> <unk>") and "<pad>" not in text
    assert "<unk>" not in printed.err  # the prompt holds none


def test_generate_says_when_a_run_without_best_weights_generates_from_its_last_ones(tmp_path, capsys):
    """The default is the best-validation weights; a run with no best.pt (stopped before its first evaluation)
    generated from its last checkpoint without a word, where `eval` and `analyze` name the weights they used."""
    data = write_corpus(tmp_path / "c")
    train(tmp_path / "run", *tiny_configs(data, max_steps=2, eval_every=2), quiet=True)
    args = ["generate", str(tmp_path / "run"), "--prompt", "the cat", "--max-new-tokens", "2", "--seed", "1"]
    assert cli_main(args) == 0 and "last" not in capsys.readouterr().err
    (tmp_path / "run" / "best.pt").unlink()
    assert cli_main(args) == 0
    note = "no best-validation weights (best.pt): generating from the last checkpoint, step 2"
    assert note in capsys.readouterr().err
    assert cli_main(args + ["--checkpoint", "last"]) == 0 and "note" not in capsys.readouterr().err  # as asked


def test_a_prompt_longer_than_the_context_is_returned_whole(tmp_path, capsys):
    """The output keeps every prompt token (the model sees the last block_size) and the CLI prints the
    whole prompt and says no cache was used."""
    model = tiny_model(("boosted", {}))  # block_size 24
    prompt = torch.randint(0, 37, (2, 30))
    out = generate(model, prompt, 5, temperature=0)
    assert out.shape == (2, 35) and torch.equal(out[:, :30], prompt)
    assert torch.equal(out[:, 30:], generate(model, prompt[:, -24:], 5, temperature=0)[:, 24:])
    data = write_corpus(tmp_path / "c")
    train(tmp_path / "run", *tiny_configs(data, max_steps=2, eval_every=2), quiet=True)
    long_prompt = "the cat sat on the mat " * 4
    assert cli_main(["generate", str(tmp_path / "run"), "--prompt", long_prompt, "--max-new-tokens", "3"]) == 0
    printed = capsys.readouterr()
    assert printed.out.startswith(long_prompt) and "no cache: the prompt fills block_size" in printed.err
    # stopped early (every two tokens' text a stop string): the summary still says why no cache was used, and not
    # that it served the tokens up to block_size ("no cache: the prompt fills block_size; no cache past block_size=24")
    from gbattn import load_run

    run = load_run(tmp_path / "run")
    tokenizer, block = run.tokenizer, run.model.cfg.block_size
    texts = {tokenizer.decode([i]) for i in range(tokenizer.vocab_size)} - {""}
    stops = [flag for a in texts for b in texts for flag in ("--stop", a + b)]
    exact = tokenizer.decode(tokenizer.encode(long_prompt)[:block])  # a prompt of block_size tokens fills it too
    assert len(tokenizer.encode(exact)) == block < len(tokenizer.encode(long_prompt))
    for prompt in (long_prompt, exact):
        assert cli_main(["generate", str(tmp_path / "run"), "--prompt", prompt, "--max-new-tokens", "3", *stops]) == 0
        assert "s, no cache: the prompt fills block_size; stopped at --stop after 2 of 3)\n" in capsys.readouterr().err


def test_generate_says_what_greedy_decoding_leaves_unused(tmp_path, capsys):
    """--temperature 0 decodes greedily: --top-p and --seed changed nothing and --num-samples 3 printed the same text
    three times, without a word."""
    data = write_corpus(tmp_path / "c")
    train(tmp_path / "run", *tiny_configs(data, max_steps=2, eval_every=2), quiet=True)
    run = ["generate", str(tmp_path / "run"), "--prompt", "the", "--max-new-tokens", "3", "--temperature", "0"]
    for extra, note in ((["--top-p", "0.5", "--seed", "3", "--num-samples", "3"],
                         "note: --temperature 0 decodes greedily: --top-p and --seed change nothing; the 3 samples "
                         "are the same"),
                        (["--seed", "3"], "note: --temperature 0 decodes greedily: --seed changes nothing"),
                        (["--top-k", "3"], "note: --temperature 0 decodes greedily: --top-k changes nothing"),
                        (["--num-samples", "2"], "note: --temperature 0 decodes greedily: the 2 samples are the same"),
                        ([], None)):
        capsys.readouterr()
        assert cli_main(run + extra) == 0
        notes = [line for line in capsys.readouterr().err.splitlines() if "greedily" in line]
        assert notes == ([note] if note else []), notes
    # a refused command is one line: the note came before the run directory's check
    assert cli_main(["generate", str(tmp_path / "nothing"), "--prompt", "the", "--temperature", "0", "--seed",
                     "1"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize("flags, asked", [([], None), (["--compile"], True), (["--no-compile"], False),
                                          (["--no-cache"], False), (["--compile", "--no-cache"], "refused")])
def test_generate_cli_passes_the_compile_choice(tmp_path, capsys, monkeypatch, flags, asked):
    """`--compile` forces the compiled decode step, `--no-compile` and `--no-cache` never compile, and
    no flag leaves it to the measured threshold (tests/test_compiled.py checks the decisions). `--compile` with
    `--no-cache` is one line (the compiling was dropped, unsaid)."""
    seen = []

    def record(model, compile, max_new_tokens, prompt_length=0):
        seen.append(compile)
        return None, "KV cache"

    monkeypatch.setattr(decoding, "decoder_for", record)
    data = write_corpus(tmp_path / "c")
    train(tmp_path / "run", *tiny_configs(data, max_steps=2, eval_every=2), quiet=True)
    if asked == "refused":
        assert cli_main(["generate", str(tmp_path / "run"), "--prompt", "the", "--max-new-tokens", "3", *flags]) == 2
        assert capsys.readouterr().err.splitlines()[-1] == ("gbattn: error: --compile compiles the cached decode step, "
                                                            "and --no-cache recomputes the whole context at every "
                                                            "token: give one of them")
        assert seen == []  # (before the run is loaded)
        return
    assert cli_main(["generate", str(tmp_path / "run"), "--prompt", "the", "--max-new-tokens", "3", *flags]) == 0
    assert seen[0] == asked  # the command's own choice (generate() is then handed its decode step)
    assert "nothing is compiled" not in capsys.readouterr().err
    if flags == ["--compile"]:  # a prompt that fills block_size: no cached step to compile, said (it was unsaid)
        assert cli_main(["generate", str(tmp_path / "run"), "--prompt", "the " * 100, "--max-new-tokens", "3",
                         *flags]) == 0
        assert re.search(r"note: --compile compiles the cached decode step, and the prompt of \d+ tokens fills "
                         r"block_size=\d+, so every token recomputes the context: nothing is compiled\n",
                         capsys.readouterr().err)
        # ... and so does one new token (the prefill makes it: no cached step either)
        assert cli_main(["generate", str(tmp_path / "run"), "--prompt", "the", "--max-new-tokens", "1", *flags]) == 0
        assert ("note: --compile compiles the cached decode step, and 1 new token takes no cached step: nothing is "
                "compiled\n") in capsys.readouterr().err


@pytest.mark.parametrize("flags, compiles", [([], 1), (["--compile"], 1), (["--no-compile"], 0), (["--no-cache"], 0)])
def test_generate_cli_compiles_only_as_it_says_past_the_threshold(tmp_path, capsys, monkeypatch, flags, compiles):
    """With the measured threshold met, `--no-compile` decoded through a compiled step all the same
    (generate() made the default choice again) while the summary said "KV cache"."""
    compiled = []
    monkeypatch.setitem(decoding.MIN_TOKENS_TO_COMPILE, "cpu", 1)
    monkeypatch.setattr(decoding, "compiled_decode_step",
                        lambda model, mode=None: compiled.append(model) or decoding.eager_decode_step(model))
    data = write_corpus(tmp_path / "c")
    train(tmp_path / "run", *tiny_configs(data, max_steps=2, eval_every=2), quiet=True)
    assert cli_main(["generate", str(tmp_path / "run"), "--prompt", "the", "--max-new-tokens", "3", *flags]) == 0
    assert len(compiled) == compiles
    assert ("compiled" in capsys.readouterr().err) == bool(compiles)


def test_generate_cli_leaves_the_compiling_out_of_its_tokens_per_second(tmp_path, capsys, monkeypatch):
    """A compiled decode step compiles on its first call (seconds on a CPU): `generate --compile` divided the tokens
    by a time that held it (measured: 20 tokens in 15.76 s, "1 tokens/s"). Now the rate is of the tokens after the
    first two, and the line says how long those took, compiling included. (A fake clock: the compiling takes 100 s,
    every other reading of the clock 1 ms.)"""
    import time

    clock = [0.0]

    def tick() -> float:
        clock[0] += 0.001
        return clock[0]

    def compiling_step(model, mode=None):
        eager, calls = decoding.eager_decode_step(model), []

        def step(*args):
            clock[0] += 100.0 if not calls else 0.0
            calls.append(1)
            return eager(*args)

        return step

    data = write_corpus(tmp_path / "c")
    train(tmp_path / "run", *tiny_configs(data, max_steps=2, eval_every=2), quiet=True)
    monkeypatch.setattr(decoding, "compiled_decode_step", compiling_step)
    monkeypatch.setattr(time, "perf_counter", tick)
    for flags in (["--max-new-tokens", "12", "--compile"], ["--max-new-tokens", "2", "--compile"],
                  ["--max-new-tokens", "12", "--no-compile"], ["--max-new-tokens", "1", "--compile"]):
        assert cli_main(["generate", str(tmp_path / "run"), "--prompt", "the", "--num-samples", "2", *flags]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if " tokens in " in line]
    compiled = re.search(r"2 x 12 tokens in (\S+) s \(([\d,]+) tokens/s after the first 2 tokens, which took (\S+) s "
                         r"with compiling the decode step, KV cache, compiled decode step\)", lines[0])
    assert compiled and float(compiled[1]) >= 100 and float(compiled[3]) >= 100, lines[0]
    assert int(compiled[2].replace(",", "")) >= 100  # 20 tokens in the 1 ms clock readings after the compiling
    assert "2 x 2 tokens in " in lines[1] and "(compiling the decode step included, " in lines[1], lines[1]
    assert re.search(r"2 x 12 tokens in \S+ s \([\d,]+ tokens/s, KV cache\)$", lines[2]), lines[2]
    # one new token: the prefill's; no decode step ran (it said "compiled decode step")
    assert re.search(r"2 x 1 tokens in \S+ s \([\d,]+ tokens/s, KV cache\)$", lines[3]), lines[3]
    # The rates exactly, on a clock that moves only in the decode steps (the compiling 100 s, each later step
    # 0.01 s): compiled, 2 x 10 tokens after the first two in 10 steps; eager, 4 x 12 tokens (every sample's) in 11
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    real_eager_step = decoding.eager_decode_step

    def timed_step(model, mode=None):
        eager, calls = real_eager_step(model), []

        def step(*args):
            clock[0] += 100.0 if mode != "eager" and not calls else 0.01
            calls.append(1)
            return eager(*args)

        return step

    monkeypatch.setattr(decoding, "compiled_decode_step", timed_step)
    monkeypatch.setattr(decoding, "eager_decode_step", lambda model: timed_step(model, "eager"))
    for flags in (["--num-samples", "2", "--compile"], ["--num-samples", "4", "--no-compile"]):
        assert cli_main(["generate", str(tmp_path / "run"), "--prompt", "the", "--max-new-tokens", "12", *flags]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if " tokens in " in line]
    assert "(200 tokens/s after the first 2 tokens, which took 100.00 s with compiling" in lines[0], lines[0]
    assert "4 x 12 tokens in 0.11 s (436 tokens/s, KV cache)" in lines[1], lines[1]  # 48 tokens / 0.11 s


def test_generate_cli_passes_samples_and_the_cache_choice_and_shows_a_bar_for_long_runs(tmp_path, capsys,
                                                                                        monkeypatch):
    """`--num-samples 3` prints three continuations; `--no-cache`, `--temperature`, `--top-k` and `--seed`
    (and their defaults) reach generate(); the progress bar shows from 1,000 new tokens on."""
    from gbattn import progress
    from gbattn.model.gpt import GPT

    data = write_corpus(tmp_path / "c")
    train(tmp_path / "run", *tiny_configs(data, max_steps=2, eval_every=2), quiet=True)
    run = str(tmp_path / "run")
    assert cli_main(["generate", run, "--prompt", "the", "--max-new-tokens", "4", "--num-samples", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("---") == 3 and all(text.strip().startswith("the") for text in out.split("---")[:3])
    seen, bars, real_bar = [], [], progress.Progress

    def record(self, idx, n, **kw):
        seen.append((kw["use_cache"], kw["temperature"], kw["top_k"], kw["top_p"], kw["seed"]))
        return idx

    monkeypatch.setattr(GPT, "generate", record)
    monkeypatch.setattr(progress, "Progress", lambda *a, **kw: bars.append(kw["disable"]) or real_bar(*a, **kw))
    for flags in (["--max-new-tokens", "999"],
                  ["--max-new-tokens", "1000", "--no-cache", "--temperature", "0.3", "--top-k", "2", "--top-p", "0.9",
                   "--seed", "5"]):
        assert cli_main(["generate", run, "--prompt", "the", *flags]) == 0
    assert seen == [(True, 0.8, 200, None, None), (False, 0.3, 2, 0.9, 5)] and bars == [True, False]


@pytest.mark.parametrize("block", ["gpt2", "llama"])
def test_left_padded_cached_batch_equals_each_row_alone(variant_case, block):
    """fla's model test: a left-padded batch, decoded with the cache, gives every row the tokens it
    gets when decoded alone (greedy), for every variant, with learned positions and with RoPE."""
    from test_model import BLOCKS

    model = tiny_model(variant_case, **BLOCKS[block])
    prompts = [torch.randint(0, 37, (n,)) for n in (6, 3, 5)]
    batch, mask = left_pad(prompts)
    width = batch.shape[1]
    together = generate(model, batch, 9, temperature=0, prompt_mask=mask)
    for i, p in enumerate(prompts):
        alone = generate(model, p[None], 9, temperature=0)
        assert torch.equal(together[i, width - len(p):], alone[0]), f"row {i}"
    # and the padding matters: without the mask the padded rows' next-token logits change
    positions = (mask.long().cumsum(1) - 1).clamp_min(0)
    masked = model(batch, key_padding_mask=mask, position_ids=positions)[:, -1]
    assert (model(batch)[:2, -1] - masked[:2]).abs().max() > 1e-6


def test_generation_stopped_by_ctrl_c_carries_the_whole_prompt_and_the_tokens_made(monkeypatch):
    """A KeyboardInterrupt after two tokens carries the tokens so far as ``partial_BT``: the whole prompt, also one
    longer than block_size (whose first tokens the model never sees), then the two tokens, as the uninterrupted
    output begins. The test of the CLI's Ctrl-C used a short prompt, so a partial result that dropped the prompt's
    first tokens (the CLI then printed the text cut in the wrong place) passed."""
    def stopping_after_two_tokens():
        made = []

        def progress(n):
            made.append(n)
            if len(made) == 2:
                raise KeyboardInterrupt
        return progress

    model = tiny_model(("boosted", {}))  # block_size 24
    for length in (5, 30):
        prompt = torch.randint(0, 37, (2, length))
        whole = generate(model, prompt, 5, temperature=0)
        with pytest.raises(KeyboardInterrupt) as stopped:
            generate(model, prompt, 5, temperature=0, progress=stopping_after_two_tokens())
        assert torch.equal(stopped.value.partial_BT, whole[:, : length + 2]), length


def test_a_left_padded_batch_past_block_size_sees_each_windows_own_padding():
    """Past block_size a left-padded batch goes on uncached (nanoGPT's window), written out here: each
    new token is the argmax of a forward over the last block_size tokens with those tokens' padding
    mask and positions counting their real tokens; with the cache (until it is full) or without."""
    model = tiny_model(("standard", {}))  # block_size 24
    batch, mask = left_pad([torch.randint(0, 37, (n,)) for n in (20, 14, 17)])
    seq, keep = batch, mask
    for _ in range(12):
        window, window_keep = seq[:, -24:], keep[:, -24:]
        positions = (window_keep.long().cumsum(1) - 1).clamp_min(0)
        logits = model(window, key_padding_mask=window_keep, position_ids=positions)
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        keep = torch.cat([keep, torch.ones(3, 1, dtype=torch.bool)], dim=1)
    for use_cache in (False, True):
        assert torch.equal(generate(model, batch, 12, temperature=0, prompt_mask=mask, use_cache=use_cache), seq)


def test_generate_refuses_prompts_and_options_it_would_decode_wrongly():
    """Right padding would continue a row after its padding (a different continuation from the row
    alone, silently); a row of padding only, a mask of another shape, 1-D ids, a fractional token
    count and a NaN or infinite temperature (every token tied, top-k ignored) are refused with a
    message, not a torch error or garbage."""
    model = tiny_model(("standard", {}))
    ids = torch.tensor([[5, 6, 7], [5, 6, 0]])
    left, right = torch.tensor([[1, 1, 1], [0, 1, 1]]), torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert generate(model, ids, 2, temperature=0, prompt_mask=left).shape == (2, 5)
    full, full_mask = left_pad([torch.randint(0, 37, (24,)), torch.randint(0, 37, (20,))])  # exactly block_size
    assert generate(model, full, 2, temperature=0, prompt_mask=full_mask).shape == (2, 26)
    cases = [
        ({"idx_BT": ids, "prompt_mask": right}, "must be left padding"),
        ({"idx_BT": ids, "prompt_mask": torch.tensor([[1, 1, 1], [0, 0, 0]])}, "must be left padding"),
        ({"idx_BT": ids, "prompt_mask": left[:, 1:]}, "prompt_mask of shape (2, 2)"),
        ({"idx_BT": ids[0]}, "expected (batch, tokens)"),
        ({"idx_BT": ids, "max_new_tokens": 2.5}, "max_new_tokens=2.5 must be an integer"),
        ({"idx_BT": ids, "temperature": float("nan")}, "temperature=nan must be a finite number >= 0"),
        ({"idx_BT": ids, "temperature": float("inf")}, "temperature=inf must be a finite number >= 0"),
        ({"idx_BT": ids, "prompt_mask": torch.tensor([[1, 1, 1], [1, 0, 1]])}, "must be left padding"),  # a hole
        ({"idx_BT": ids, "max_new_tokens": True}, "max_new_tokens=True must be an integer"),
        ({"idx_BT": ids, "top_k": 0}, "top_k=0 must be an integer >= 1"),
        ({"idx_BT": ids, "top_k": 2.5}, "top_k=2.5 must be an integer >= 1"),  # was topk()'s TypeError
        ({"idx_BT": ids, "top_k": True}, "top_k=True must be an integer >= 1"),
        # past a 64-bit integer: said so (it said "must be an integer >= 1", a rule 2**63 meets)
        ({"idx_BT": ids, "top_k": 2**63}, "top_k=9223372036854775808 is out of range (at most 2**63 - 1)"),
        ({"idx_BT": ids, "max_new_tokens": 2**63}, "max_new_tokens=9223372036854775808 is out of range"),
        ({"idx_BT": ids, "top_p": 0}, "top_p=0 must be a number in (0, 1]"),
        ({"idx_BT": ids, "top_p": 1.5}, "top_p=1.5 must be a number in (0, 1]"),
        ({"idx_BT": ids, "top_p": float("nan")}, "top_p=nan must be a number in (0, 1]"),
        ({"idx_BT": ids[:, :0]}, "the prompt is empty"),
        ({"idx_BT": ids[:0]}, "the batch is empty: give at least one row"),  # was "setup_cache(batch=0): ..."
        ({"idx_BT": ids[:, :0], "prompt_mask": left[:, :0]}, "the prompt is empty"),  # was an IndexError
        ({"idx_BT": ids[:1].repeat(1, 9), "prompt_mask": torch.arange(27).unsqueeze(0) > 0},
         "padded prompt of 27 tokens is longer"),
        # a seed the CLI refuses was taken (-1) or a torch error (1.5, True: "manual_seed expected a long")
        ({"idx_BT": ids, "seed": -1}, "seed=-1 must be an integer in [0, 2**63 - 1]"),
        ({"idx_BT": ids, "seed": 1.5}, "seed=1.5 must be an integer in [0, 2**63 - 1]"),
        ({"idx_BT": ids, "seed": True}, "seed=True must be an integer in [0, 2**63 - 1]"),
        ({"idx_BT": ids, "temperature": None}, "temperature=None must be a finite number >= 0"),  # was a TypeError
        # a float mask, refused as a model's key_padding_mask is: an additive one (0 keep, -inf drop) read inverted
        # and was told "must be left padding"; a 0/1 one was taken
        ({"idx_BT": ids, "prompt_mask": torch.zeros(2, 3).masked_fill(left == 0, float("-inf"))},
         "prompt_mask of dtype torch.float32: give a bool (or integer) mask, True for real tokens"),
        ({"idx_BT": ids, "prompt_mask": left.double()},
         "prompt_mask of dtype torch.float64: give a bool (or integer) mask, True for real tokens"),
        # a string read as True (compile="no" compiled the decode step), None as False
        ({"idx_BT": ids, "compile": "no"}, "compile='no' must be True, False or None"),
        ({"idx_BT": ids, "use_cache": "no"}, "use_cache='no' must be True or False"),
        ({"idx_BT": ids, "use_cache": None}, "use_cache=None must be True or False"),
        ({"idx_BT": ids, "prompt_mask": left.to("meta")}, "prompt_mask on meta, token ids on cpu: put both on one"),
    ]
    for kwargs, message in cases:
        kwargs = {"max_new_tokens": 2, **kwargs}
        with pytest.raises(ValueError, match=re.escape(message)):
            generate(model, **kwargs)


def test_generate_takes_numpy_numbers_as_python_numbers():
    """numpy's integers (a count or seed from an array) were refused as max_new_tokens and top_k ("must be an
    integer") and a torch TypeError as the seed, while configs take them: now they give what Python's give."""
    import numpy as np

    model = tiny_model(("standard", {}))
    ids = torch.tensor([[5, 6, 7]])
    expected = generate(model, ids, 4, temperature=0.5, top_k=5, seed=3)
    assert torch.equal(generate(model, ids, np.int64(4), temperature=np.float32(0.5), top_k=np.int32(5),
                                seed=np.uint64(3)), expected)


def test_generate_returns_the_prompts_dtype_whatever_the_count():
    """int32 token ids (a forward takes them) came back int64 with new tokens and int32 without: the prompt's
    dtype now, its tokens and the new ones the same as an int64 prompt's, cached or not."""
    model = tiny_model(("standard", {}))
    ids = torch.tensor([[5, 6, 7], [1, 2, 3]])
    for use_cache in (True, False):
        expected = generate(model, ids, 4, temperature=0, use_cache=use_cache)
        for new in (0, 4):
            out = generate(model, ids.int(), new, temperature=0, use_cache=use_cache)
            assert out.dtype == torch.int32 and torch.equal(out.long(), expected[:, :3 + new]), (use_cache, new)
    assert model.generate(ids.int(), 2, temperature=0).dtype == torch.int32


def test_generate_takes_integral_floats_as_config_fields_do():
    """generate checked its counts by its own rule, which refused 4.0 where a config field (checks.coerce, as
    ``--set max_steps=4.0``) takes it as 4; one rule now: an integral float is its integer, 4.5 is refused."""
    model = tiny_model(("standard", {}))
    ids = torch.tensor([[5, 6, 7]])
    expected = generate(model, ids, 4, temperature=0.5, top_k=5, seed=3)
    assert torch.equal(generate(model, ids, 4.0, temperature=0.5, top_k=5.0, seed=3.0), expected)
    with pytest.raises(ValueError, match=re.escape("top_k=4.5 must be an integer >= 1")):
        generate(model, ids, 4, top_k=4.5)


def test_a_tiny_temperature_samples_the_largest_logit():
    """logits / 1e-45 overflows to inf (softmax of inf - inf is NaN, and multinomial failed); the row
    is then shifted by its largest logit first, which samples it."""
    from gbattn.model.decoding import sample_next

    logits = torch.randn(3, 20)
    for temperature in (1e-45, 2.0**-149, 2.0**-150, 1e-50):  # 2**-150 and below are 0 in float32: greedy
        assert torch.equal(sample_next(logits, temperature, None, torch.Generator().manual_seed(0)),
                           logits.argmax(-1, True))
    # A row in which only the largest logit overflows (100 / 1e-38 is inf in float32, -1 / 1e-38 is not) is shifted too.
    mixed = torch.tensor([[100.0, 0.0, -1.0], [-1.0, 100.0, 0.0]])
    assert torch.equal(sample_next(mixed, 1e-38, None, torch.Generator().manual_seed(0)), torch.tensor([[0], [1]]))


def test_a_tiny_temperature_samples_the_largest_logit_under_cudas_division_too():
    """CUDA divides a tensor by a number as a x float32(1 / b): below 2.9e-39 1 / b is inf, and the shifted row's
    largest logit, 0 x inf, was NaN (every probability NaN). That arithmetic, simulated here on the CPU, samples the
    largest logit too."""
    from torch.overrides import TorchFunctionMode

    from gbattn.model.decoding import sample_next

    class DivideByReciprocal(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.Tensor.div, torch.Tensor.__truediv__, torch.div) and isinstance(args[1], float):
                return args[0] * torch.tensor(1 / args[1], dtype=torch.float32)
            return func(*args, **(kwargs or {}))

    logits = torch.randn(3, 20)
    with DivideByReciprocal():
        for temperature in (1e-40, 2.0**-149, 1e-39):
            assert torch.equal(sample_next(logits, temperature, None, torch.Generator().manual_seed(0)),
                               logits.argmax(-1, True)), temperature


def test_sampling_draws_from_softmax_of_logits_over_temperature():
    """At temperature t (not 1) the draws are exactly multinomial(softmax(logits / t)) with the same
    generator: the temperature divides the logits once."""
    from gbattn.model.decoding import sample_next

    logits = torch.randn(64, 37, generator=torch.Generator().manual_seed(0)) * 3
    for temperature in (0.5, 2.0, 3.0):
        drawn = sample_next(logits, temperature, None, torch.Generator().manual_seed(1))
        probs = torch.softmax(logits / temperature, -1)
        expected = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(1))
        assert torch.equal(drawn, expected), temperature


def test_seed_zero_is_a_seed():
    """seed=0 fixes the draws like any other seed: the global RNG's state does not matter."""
    model = tiny_model(("standard", {}))
    prompt = torch.randint(0, 37, (2, 4))
    torch.manual_seed(1)
    a = generate(model, prompt, 12, temperature=1.0, seed=0)
    torch.manual_seed(2)
    b = generate(model, prompt, 12, temperature=1.0, seed=0)
    assert torch.equal(a, b)


def test_the_cache_is_used_up_to_its_last_slot():
    """Past block_size generation goes on uncached; until then every new token is one cached decode
    step, the last one filling slot block_size - 1 (no full-window forward before the cache is full)."""
    model = tiny_model(("standard", {}))  # block_size 24
    step = decoding.eager_decode_step(model)
    calls = []
    prompt = torch.randint(0, 37, (1, 5))
    out = generate(model, prompt, 30, temperature=0, decode_step=lambda *a: calls.append(int(a[1])) or step(*a))
    assert calls == list(range(5, 24))
    assert torch.equal(out, generate(model, prompt, 30, temperature=0, use_cache=False))


def test_no_decode_step_for_the_last_token_progress_per_token_and_zero_new_tokens():
    """The last new token's logits would go unused, so it gets no decode step; progress(1) follows each
    new token; max_new_tokens=0 returns the prompt, with the cache or without, running no forward."""
    model = tiny_model(("standard", {}))
    step = decoding.eager_decode_step(model)
    calls, ticks = [], []
    prompt = torch.randint(0, 37, (2, 5))
    out = generate(model, prompt, 3, temperature=0, progress=ticks.append,
                   decode_step=lambda *a: calls.append(int(a[1])) or step(*a))
    assert calls == [5, 6] and ticks == [1, 1, 1] and out.shape == (2, 8)
    forwards = []
    model.register_forward_hook(lambda *a: forwards.append(1))
    for use_cache in (True, False):
        assert torch.equal(generate(model, prompt, 0, temperature=0, use_cache=use_cache), prompt)
    assert forwards == []  # (no prefill whose logits would go unused)


def test_top_k_samples_only_the_k_largest_logits():
    """top_k=k: every draw is one of the row's k largest logits, and over many draws each of them
    appears (the logits are close, so without the cut every token would come up), up to k = V - 1."""
    from gbattn.model.decoding import sample_next

    logits = torch.tensor([[0.0, 0.3, 0.1, 0.2, -0.1, 0.25]]).repeat(4000, 1)
    for k in (1, 2, 3, 5):
        drawn = sample_next(logits, 1.0, k, torch.Generator().manual_seed(k)).flatten()
        allowed = set(torch.topk(logits[0], k).indices.tolist())
        assert set(drawn.tolist()) == allowed, (k, sorted(set(drawn.tolist())), sorted(allowed))
    # logits tied at the k-th value are all kept (which of them "the k largest" are is no choice the index should make)
    tied = torch.tensor([[1.0, 0.0, 1.0, 1.0]]).repeat(3000, 1)
    assert set(sample_next(tied, 1.0, 2, torch.Generator().manual_seed(0)).flatten().tolist()) == {0, 2, 3}


def test_top_p_samples_the_smallest_set_of_likeliest_tokens_holding_p_after_top_k(capsys):
    """Nucleus sampling: the draws are the likeliest tokens whose probabilities, ranked, first reach top_p (given
    out of rank order, so the cut is mapped back to the vocabulary), after top-k's cut and renormalisation; top_p=1
    is no cut; `gbattn generate --top-p 0` is one line."""
    from gbattn.model.decoding import sample_next

    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])  # ranked: 1 (0.5), 3 (0.3), 0 (0.15), 2 (0.05)
    logits = probs.log()[None].repeat(4000, 1)
    for top_k, top_p, allowed in ((None, 0.4, {1}), (None, 0.7, {1, 3}), (None, 0.85, {1, 3, 0}),
                                  (None, 0.97, {0, 1, 2, 3}), (2, 0.6, {1}), (2, 0.9, {1, 3}), (3, 0.9, {1, 3, 0})):
        drawn = sample_next(logits, 1.0, top_k, torch.Generator().manual_seed(0), top_p).flatten()
        assert set(drawn.tolist()) == allowed, (top_k, top_p, sorted(set(drawn.tolist())))
    # Ranked mass reaching top_p exactly is enough: four equal tokens (0.25 each, exact in float32) keep 1, 2, 3
    for top_p, kept in ((0.25, 1), (0.5, 2), (0.75, 3)):
        drawn = sample_next(torch.zeros(4000, 4), 1.0, None, torch.Generator().manual_seed(0), top_p)
        assert len(set(drawn.flatten().tolist())) == kept, top_p
    for top_k in (None, 3):
        assert torch.equal(sample_next(logits, 1.0, top_k, torch.Generator().manual_seed(1), 1.0),
                           sample_next(logits, 1.0, top_k, torch.Generator().manual_seed(1)))
    # A top_p that is 0 in float32 (1e-300 passes (0, 1]) keeps the likeliest token (it cut every token: an error)
    assert set(sample_next(logits, 1.0, None, torch.Generator().manual_seed(0), 1e-300).flatten().tolist()) == {1}
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["generate", "runs/none", "--prompt", "a", "--top-p", "0"])
    assert exit_info.value.code == 2
    assert "argument --top-p: 0.0 must be a number in (0, 1]" in capsys.readouterr().err


def test_a_top_k_of_the_vocabulary_size_or_more_keeps_every_token_and_the_help_says_so(capsys):
    """--top-k above the vocabulary (the default 200 for a character-level run's few dozen tokens) means no
    top-k: the draws are those of top_k=None, and `gbattn generate --help` said nothing of it."""
    from gbattn.model.decoding import sample_next

    logits = torch.randn(50, 6)
    for k in (6, 7, 200):
        drawn = sample_next(logits, 1.0, k, torch.Generator().manual_seed(0))
        assert torch.equal(drawn, sample_next(logits, 1.0, None, torch.Generator().manual_seed(0))), k
    with pytest.raises(SystemExit):
        cli_main(["generate", "--help"])
    assert "a k of the vocabulary's size or more keeps every token" in " ".join(capsys.readouterr().out.split())


def test_decoder_for_counts_the_cached_steps_it_compiles_for_and_says_where_the_cache_ends(monkeypatch):
    """The prefill predicts the first new token, each later one is a cached step while the sequence fits
    block_size: at a threshold of 5 cached steps, 6 new tokens after a 1-token prompt compile the step and
    5 do not. 24 new tokens after 1 are all predicted from the cache (the last from a full block); from
    25 on the note says where the cache ends. A prompt that fills block_size has no cache, so no step,
    even when compiling is asked for."""
    model = tiny_model(("standard", {}))  # block_size 24
    monkeypatch.setitem(decoding.MIN_TOKENS_TO_COMPILE, "cpu", 5)
    monkeypatch.setattr(decoding, "compiled_decode_step", lambda model, mode=None: "compiled step")
    assert decoding.decoder_for(model, None, 6, 1)[0] == "compiled step"
    assert decoding.decoder_for(model, None, 5, 1)[0] is None
    assert decoding.decoder_for(model, False, 24, 1) == (None, "KV cache")
    assert decoding.decoder_for(model, False, 25, 1) == (None, "KV cache; no cache past block_size=24")
    assert decoding.decoder_for(model, True, 5, 24) == (None, "no cache: the prompt fills block_size")


def test_use_cache_false_takes_no_cached_decode_step(monkeypatch):
    """use_cache=False predicts every token from a full forward: no decode step is made or called (while
    the greedy tokens, the same either way, could not tell a cached run from an uncached one). A decode_step or
    compile=True given with it is refused (each was dropped, unsaid)."""
    model = tiny_model(("standard", {}))
    calls = []
    monkeypatch.setattr(decoding, "eager_decode_step", lambda model: calls.append("made"))
    monkeypatch.setattr(decoding, "decoder_for", lambda *a, **k: calls.append("chosen"))
    prompt = torch.randint(0, 37, (2, 5))
    assert generate(model, prompt, 4, temperature=0, use_cache=False).shape == (2, 9) and calls == []
    for given, name in ((dict(decode_step=lambda *a: calls.append(a)), "decode_step"), (dict(compile=True),
                                                                                        "compile=True")):
        with pytest.raises(ValueError, match=f"^{re.escape(name)} is for the cached decode step, and use_cache=False "
                                             f"recomputes the whole context at every token: give one of them$"):
            generate(model, prompt, 4, temperature=0, use_cache=False, **given)
    assert calls == []


def test_a_prompt_mask_of_ones_on_a_prompt_past_block_size_is_no_padding():
    """A tokenizer's attention_mask of a prompt without padding is all ones: past block_size such a prompt was
    refused as "a padded prompt ... longer than block_size", where the same prompt without the mask runs (its end
    seen by the model). It runs as that one does."""
    model = tiny_model(("boosted", {}))
    prompt = torch.randint(0, 37, (2, model.cfg.block_size + 5))
    for use_cache in (True, False):
        assert torch.equal(generate(model, prompt, 3, temperature=0, use_cache=use_cache,
                                    prompt_mask=torch.ones_like(prompt, dtype=torch.bool)),
                           generate(model, prompt, 3, temperature=0, use_cache=use_cache))


def test_generate_computes_the_last_positions_logits_only(variant_case):
    """The prompt's forward and every uncached step past block_size made the logits of every position (B, T, V) and
    kept them alive through a view of the last row: 256 samples past block_size peaked at 1.38 GB (0.33 GB now).
    The LM head sees one position per row, cached or not, padded or not; the tokens are as before."""
    model = tiny_model(variant_case)
    seen = []
    model.lm_head.register_forward_hook(lambda module, args, output: seen.append(tuple(args[0].shape[:2])))
    prompt = torch.randint(0, 37, (3, 6))
    ids, mask = left_pad([prompt[0], prompt[1, :4], prompt[2, :2]])
    for kwargs in (dict(), dict(use_cache=False), dict(prompt_mask=mask)):
        tokens = ids if "prompt_mask" in kwargs else prompt
        seen.clear()
        out = generate(model, tokens, model.cfg.block_size + 3, temperature=0, **kwargs)  # past the block too
        assert seen and set(seen) == {(3, 1)}, (kwargs, set(seen))
        # the same tokens as from the whole window's logits
        reference = tokens
        with torch.no_grad():
            for _ in range(model.cfg.block_size + 3):
                window = reference[:, -model.cfg.block_size:]
                extra = decoding._padded_window(mask, reference.shape[1], window.shape[1], kwargs.get("prompt_mask"))
                reference = torch.cat([reference, model(window, **extra)[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert torch.equal(out, reference), kwargs
    full = model(prompt)
    torch.testing.assert_close(model(prompt, logits_to_keep=2), full[:, -2:], rtol=0, atol=0)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=rf"^logits_to_keep={bad!r}: give 0 \(every position's logits\) or a"):
            model(prompt, logits_to_keep=bad)
    with pytest.raises(ValueError, match="without targets"):
        model(prompt, prompt, logits_to_keep=1)


def test_a_model_with_non_finite_logits_is_one_error_and_the_cli_one_line(tmp_path, capsys):
    """Finite weights can give NaN logits (a diverged run's last update): sampling failed with torch's "probability
    tensor contains either inf, nan or element < 0" (a traceback from `gbattn generate`), and greedy decoding made
    tokens of NaN, unsaid. One error before the first token, cached or not, greedy or sampled."""
    from gbattn.model.decoding import NonFiniteLogits

    model = tiny_model(("boosted", {}))
    with torch.no_grad():
        model.lm_head.weight.mul_(1e308).mul_(1e308)  # (inf weights: the logits inf - inf, NaN)
    prompt = torch.randint(0, 37, (2, 5))
    for kwargs in (dict(temperature=0), dict(temperature=1.0, top_k=3), dict(use_cache=False, top_p=0.5)):
        with pytest.raises(NonFiniteLogits, match=r"^the model's logits for the prompt are not finite \(NaN or inf\): "
                                                  r"its weights are damaged or its training diverged$"):
            generate(model, prompt, 3, **kwargs)
    # ... and at a later token (the prompt's logits finite): checked at every token on a CPU
    model = tiny_model(("boosted", {}))
    calls = []

    def nan_from_the_third(module, args, output):
        calls.append(1)
        return output * float("nan") if len(calls) >= 3 else output

    model.register_forward_hook(nan_from_the_third)
    for kwargs in (dict(temperature=0), dict(temperature=1.0, top_k=3), dict(use_cache=False)):
        calls.clear()
        with pytest.raises(NonFiniteLogits, match=r"^the model's logits at new token 3 are not finite \(NaN or inf\)"):
            generate(model, prompt, 5, **kwargs)
    data = write_corpus(tmp_path / "c")
    train(tmp_path / "run", *tiny_configs(data, max_steps=2, eval_every=2), quiet=True)
    from gbattn import rundir

    state = rundir.load_checkpoint(tmp_path / "run" / "best.pt")
    state["model"]["blocks.0.ln1.weight"] = torch.full_like(state["model"]["blocks.0.ln1.weight"], 1e38)
    state["model"]["blocks.0.ln2.weight"] = torch.full_like(state["model"]["blocks.0.ln2.weight"], 1e38)
    torch.save(state, tmp_path / "run" / "best.pt")
    capsys.readouterr()
    assert cli_main(["generate", str(tmp_path / "run"), "--prompt", "the", "--max-new-tokens", "3"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "gbattn: error: the model's logits for the prompt are not finite (NaN or inf): its weights are damaged or "
        "its training diverged")


def test_no_seed_draws_from_the_global_rng():
    """seed=None draws from torch's global generator: it repeats after the same torch.manual_seed and
    changes with another (a fixed generator would give every call the same draws)."""
    model = tiny_model(("standard", {}))
    prompt = torch.randint(0, 37, (2, 4))
    draws = []
    for global_seed in (1, 1, 2):
        torch.manual_seed(global_seed)
        draws.append(generate(model, prompt, 12, temperature=2.0))
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])


def test_the_largest_seed_is_taken_and_one_more_is_refused():
    """seed takes 0 .. 2**63 - 1, the range torch.Generator.manual_seed and the CLI take, both ends included."""
    model = tiny_model(("standard", {}))
    ids = torch.tensor([[5, 6, 7]])
    assert generate(model, ids, 2, seed=2**63 - 1).shape == (1, 5)
    with pytest.raises(ValueError, match=re.escape("seed=9223372036854775808")):
        generate(model, ids, 2, seed=2**63)


def test_a_device_with_no_measured_threshold_compiles_only_when_asked(monkeypatch):
    """MIN_TOKENS_TO_COMPILE of None (a device where compiling was not measured, as MPS): the default
    (compile=None) never compiles, however many cached steps; compile=True still does."""
    model = tiny_model(("standard", {}))  # block_size 24
    monkeypatch.setitem(decoding.MIN_TOKENS_TO_COMPILE, "cpu", None)
    monkeypatch.setattr(decoding, "compiled_decode_step", lambda model: "compiled step")
    assert decoding.decoder_for(model, None, 24, 1) == (None, "KV cache")
    assert decoding.decoder_for(model, True, 24, 1)[0] == "compiled step"


def test_a_prompt_that_is_no_tensor_is_named():
    """A list or numpy array of token ids is a ValueError saying to give a tensor, not Python's "'list' object
    has no attribute 'dim'"."""
    import numpy as np

    model = tiny_model(("standard", {}))
    for prompt, kind in (([[5, 6, 7]], "list"), (np.array([[5, 6, 7]]), "ndarray")):
        with pytest.raises(ValueError, match=re.escape(f"token ids of type {kind}: give a torch tensor")):
            generate(model, prompt, 2)


def test_an_integer_prompt_mask_is_read_as_nonzero_for_real_tokens():
    """An integer prompt_mask marks real tokens by any nonzero entry, as a model's key_padding_mask does:
    a mask of 0s and 2s decodes as the bool mask, with the cache and without (its positions count real
    tokens, not the mask's sum)."""
    model = tiny_model(("standard", {}))
    batch, mask = left_pad([torch.randint(0, 37, (n,)) for n in (6, 3)])
    for use_cache in (True, False):
        expected = generate(model, batch, 4, temperature=0, prompt_mask=mask, use_cache=use_cache)
        assert torch.equal(generate(model, batch, 4, temperature=0, prompt_mask=mask.long() * 2,
                                    use_cache=use_cache), expected), use_cache


def test_generate_counts_the_cached_steps_after_its_own_prompt_to_decide_compiling(monkeypatch):
    """generate's default choice counts the cached steps its prompt leaves before block_size: at a threshold of
    5, 8 new tokens after a 20-token prompt take 4 cached steps (eager), after a 1-token prompt 7 (compiled)."""
    model = tiny_model(("standard", {}))  # block_size 24
    compiled = []
    monkeypatch.setitem(decoding.MIN_TOKENS_TO_COMPILE, "cpu", 5)
    monkeypatch.setattr(decoding, "compiled_decode_step",
                        lambda model: compiled.append(model) or decoding.eager_decode_step(model))
    generate(model, torch.randint(0, 37, (1, 20)), 8, temperature=0)
    assert compiled == []
    generate(model, torch.randint(0, 37, (1, 1)), 8, temperature=0)
    assert compiled == [model]


def test_decode_steps_take_their_cache_slots_from_one_device_tensor():
    """generate's cached steps (and the benchmark's) get their slot as a view of one tensor made on the device
    beforehand: a tensor made from a Python number per token is a host-to-device copy that waits for the GPU
    (a host sync per token, which CUDA graphs cannot hide). The slots run on from the prompt, one per token."""
    from gbattn.bench.speed import prefill_and_decode
    from gbattn.runtime import autocast

    model = tiny_model(("standard", {}))
    eager = decoding.eager_decode_step(model)
    seen = []

    def step(token_B1, slot_1, position_B1, key_padding_BS):
        seen.append(slot_1)
        return eager(token_B1, slot_1, position_B1, key_padding_BS)

    prompt = torch.randint(0, 37, (2, 5))
    out = generate(model, prompt, 7, temperature=0, decode_step=step)
    assert torch.equal(out, generate(model, prompt, 7, temperature=0, compile=False))
    assert [int(s) for s in seen] == list(range(5, 11))
    assert len({s.untyped_storage().data_ptr() for s in seen}) == 1
    seen.clear()
    prefill_and_decode(model, prompt, 4, torch.device("cpu"), autocast(torch.device("cpu"), "off"), step=step)
    assert [int(s) for s in seen] == list(range(5, 9))
    assert len({s.untyped_storage().data_ptr() for s in seen}) == 1


def test_stop_ends_decoding_after_the_token_it_returns_true_for(variant_case):
    """generate(..., stop=f) calls f with the new tokens so far after each token and ends where it returns True:
    the tokens are the start of the unstopped generation's, cached or not; a stop that is no function is refused."""
    model = tiny_model(variant_case)
    prompt_BT = torch.randint(0, 37, (2, 5))
    full_BT = generate(model, prompt_BT, 12, temperature=0)
    for use_cache in (True, False):
        seen = []

        def stop(new_BN, seen=seen):
            seen.append(new_BN.clone())
            return new_BN.shape[1] == 4

        out_BT = generate(model, prompt_BT, 12, temperature=0, use_cache=use_cache, stop=stop)
        assert torch.equal(out_BT, full_BT[:, :9])
        assert [new_BN.shape for new_BN in seen] == [(2, n) for n in range(1, 5)]
        assert torch.equal(seen[-1], full_BT[:, 5:9])
    with pytest.raises(ValueError, match="stop of type list: give a function stop"):
        generate(model, prompt_BT, 3, stop=["x"])
    # one answer per row (torch's "ambiguous" RuntimeError): refused; a one-element tensor is one answer
    for per_row in (lambda new_BN: new_BN[:, -1] >= 0, lambda new_BN: [False, False],
                    lambda new_BN: (new_BN[:, -1] >= 0).numpy()):  # (a list stopped after one token, numpy failed)
        with pytest.raises(ValueError, match=r"^stop returned 2 values \(\(2,\)\): it ends the whole batch"):
            generate(model, prompt_BT, 3, stop=per_row)
    assert generate(model, prompt_BT, 3, temperature=0, stop=lambda new_BN: [False]).shape == (2, 8)
    assert generate(model, prompt_BT, 12, temperature=0, stop=lambda new_BN: (new_BN >= 0).all()).shape == (2, 6)
    # a loaded run given as the model (it has its own generate): "no attribute 'cfg'" before
    with pytest.raises(ValueError, match=r"^model of type SimpleNamespace: give a GPT \(a loaded run's \.model"):
        generate(SimpleNamespace(cfg=None), prompt_BT, 3)
    # progress and decode_step that are no functions: refused up front (they failed after the first token)
    for name in ("progress", "decode_step"):
        with pytest.raises(ValueError, match=rf"^{name} of type int: give a function .*, or None$"):
            generate(model, prompt_BT, 3, **{name: 5})


def test_stop_strings_wait_for_every_row_and_cut_each_before_its_first_stop_string():
    """StopStrings: True once every row's new text has held a stop string (one that spans tokens is seen at the token
    that completes it; a row stays stopped after its match leaves the decoded window); cut ends a row's text before
    the first stop string of its new text, not one in the prompt."""
    letters = "abcdefghij\n"
    stop = decoding.StopStrings(lambda ids: "".join(letters[i] for i in ids), ["\n\n", "ji"])
    assert stop.window == 3
    rows = [[0, 10, 10, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 9, 8]]  # "a\n\nbcdef", "abcdefji"
    for _ in range(2):  # the same object for a second generation starts afresh
        answers = [stop(torch.tensor(rows)[:, :n]) for n in range(1, 9)]
        assert answers == [False] * 7 + [True]
        assert stop.stopped == [True, True]
    assert stop.cut("prompt: a\n\nbcdef", "a\n\nbcdef") == "prompt: a"
    assert stop.cut("ji: abcdefji", "abcdefji") == "ji: abcdef"  # the prompt's "ji" is not where it ends
    assert stop.cut("no stop here", "here") == "no stop here"
    assert stop.cut("\n\nabc", "\n\nabc") == ""  # no prompt text, and the new text begins with a stop string
    # a prompt ending inside a character: the new tokens alone decode longer ("\ufffd\ufffdabc") than the prompt and
    # them together ("€abc"), and the stop string is still found in the new text
    as_bytes = decoding.StopStrings(lambda ids: bytes(ids).decode("utf-8", errors="replace"), "a")
    assert as_bytes.text(list("€".encode()) + list(b"abc"), 1) == "€"
    # of two stop strings, the text ends at the first, whichever of them it is
    assert stop.cut("p: ab\n\ncdji", "ab\n\ncdji") == stop.cut("p: abjicd\n\n", "abjicd\n\n") == "p: ab"
    # four rows (the rows are counted, not the tokens): stopped at their 2nd, 4th, 3rd and 5th tokens, each staying
    # stopped once its match has left the window, so the generation is done at the 5th
    four = [[9, 8, 0, 1, 2, 3], [0, 1, 9, 8, 2, 3], [0, 9, 8, 1, 2, 3], [0, 1, 2, 9, 8, 3]]
    assert [stop(torch.tensor(four)[:, :n]) for n in range(1, 7)] == [False] * 4 + [True] * 2
    # stop strings of unlike lengths: the window fits the longest, so a long one is seen at its last token
    uneven = decoding.StopStrings(lambda ids: "".join(letters[i] for i in ids), ["j", "cdef"])
    assert uneven.window == 5
    assert [uneven(torch.tensor([[0, 1, 2, 3, 4, 5]])[:, :n]) for n in range(1, 7)] == [False] * 5 + [True]
    for bad in ([], [""], [1], ["ji", ""], ["ji", 1]):  # (every one checked, not the first alone)
        with pytest.raises(ValueError, match="give one or more non-empty strings"):
            decoding.StopStrings(str, bad)
    with pytest.raises(ValueError, match=r"^stop strings of type function: give a string or a list of strings"):
        decoding.StopStrings(str, lambda new_BN: False)  # (run.generate's stop: "'function' object is not iterable")


def test_stop_strings_spelled_in_more_tokens_than_characters_end_the_generation():
    """A byte-level tokenizer spells "€" in three tokens: the decoded window of len("€") + 1 = 2 tokens held half of
    it, so --stop "€" never ended a generation (its text was cut right, after max_new_tokens). The window counts UTF-8
    bytes, and tokens that decode to no text (special ones, 256 here) are not counted in it."""
    def decode(ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    for stops, text in ((["€"], "5€ and"), (["5€"], "5€ and"), (["ok", "€"], "it is 5€"), (["€"], "\u20ac")):
        stop = decoding.StopStrings(decode, stops)
        spelled = list(text.encode())
        end = len(text[:text.index("€") + 1].encode())  # the token that completes the "€"
        answers = [stop(torch.tensor([spelled])[:, :n]) for n in range(1, len(spelled) + 1)]
        assert answers == [False] * (end - 1) + [True] * (len(spelled) - end + 1), (stops, text)
        # with special tokens between the bytes (pads, an end-of-text token), decoded as no text
        spaced = [t for byte in spelled for t in (byte, *[256] * 9)]  # (more than the first tail read holds)
        stop = decoding.StopStrings(decode, stops)
        answers = [stop(torch.tensor([spaced])[:, :n]) for n in range(1, len(spaced) + 1)]
        assert answers.index(True) == 10 * (end - 1), (stops, text)
    # each call decodes the last tokens only, not the whole text again (besides each token once, alone)
    decoded = []
    stop = decoding.StopStrings(lambda ids: decoded.append(len(ids)) or decode(ids), ["€"])
    long = list(b"no stop string here " * 10)
    assert not any(stop(torch.tensor([long])[:, :n]) for n in range(1, len(long) + 1))
    assert max(decoded) == stop.window == 4


def test_a_stop_text_that_is_not_utf8_is_refused_naming_its_byte_not_a_traceback(four_step_run, capsys):
    """`gbattn generate RUN --stop $'\\xff'` (a byte of a shell argument in another encoding, which Python keeps as a
    surrogate) was a UnicodeEncodeError traceback, exit 1, and run.generate(..., stop="\\ud800") the same: a
    ValueError naming the byte from Python, and from the CLI one line, status 2, as --prompt $'\\xff' gives."""
    import gbattn

    byte = b"\xff".decode("utf-8", "surrogateescape")
    for option in ("--prompt", "--stop"):
        prompt, stop = (byte, "x") if option == "--prompt" else ("the cat", byte)
        assert cli_main(["generate", str(four_step_run), "--prompt", prompt, "--max-new-tokens", "3", "--stop",
                         stop]) == 2
        assert capsys.readouterr().err == (f"gbattn: error: {option}: the text is not UTF-8: byte 0xff at character 0 "
                                           f"(text typed or read in another encoding than UTF-8?)\n")
    run = gbattn.load_run(four_step_run)
    for stop, what in (("\ud800", r"a lone surrogate U\+D800 at character 0"), (["ok", "ok" + byte], "byte 0xff at "
                                                                                                 "character 2")):
        with pytest.raises(ValueError, match=f"^the text is not UTF-8: {what} "):
            run.generate("the cat", 3, stop=stop)


def test_generate_cli_stops_at_stop_text_and_prints_up_to_it(four_step_run, capsys):
    """--stop TEXT (repeatable): the greedy text is the unstopped one up to the first TEXT of its new text, the
    decoding ends at the token that completes it, and the summary says after how many tokens; the Python API's
    run.generate(..., stop=...) gives the same text."""
    import gbattn

    run_dir = str(four_step_run)
    assert cli_main(["generate", run_dir, "--prompt", "the cat", "--max-new-tokens", "40", "--temperature", "0"]) == 0
    new_text = capsys.readouterr().out.split("\n---\n")[0].removeprefix("the cat")
    stop_text = new_text[6:8]  # two characters made by the 7th and 8th new tokens (a char tokenizer)
    first = new_text.index(stop_text)
    assert cli_main(["generate", run_dir, "--prompt", "the cat", "--max-new-tokens", "40", "--temperature", "0",
                     "--stop", stop_text, "--stop", "never made"]) == 0
    printed = capsys.readouterr()
    assert printed.out == "the cat" + new_text[:first] + "\n---\n"
    assert f"stopped at --stop after {first + 2} of 40" in printed.err and f"1 x {first + 2} tokens" in printed.err
    # two samples (greedy, so alike): the summary counts each sample's tokens, not both samples' together
    assert cli_main(["generate", run_dir, "--prompt", "the cat", "--max-new-tokens", "40", "--temperature", "0",
                     "--stop", stop_text, "--num-samples", "2"]) == 0
    err = capsys.readouterr().err
    assert f"stopped at --stop after {first + 2} of 40" in err and f"2 x {first + 2} tokens" in err
    text = gbattn.load_run(four_step_run).generate("the cat", max_new_tokens=40, temperature=0, stop=stop_text)
    assert text == "the cat" + new_text[:first]
    # ended by --stop inside the block: not "no cache past block_size", as the 40 tokens planned would have been
    assert 7 + first + 2 <= gbattn.load_run(four_step_run).model.cfg.block_size < 7 + 40
    assert "no cache past block_size" not in printed.err
    # a stop text never made: the summary says nothing of --stop; one spanning the prompt's end and the first new
    # character is no stop text of the new text (it cut the prompt: "the ca")
    across = "t" + new_text[0]
    assert across not in new_text
    for stop in ("never made", across):
        assert cli_main(["generate", run_dir, "--prompt", "the cat", "--max-new-tokens", "40", "--temperature", "0",
                         "--stop", stop]) == 0
        printed = capsys.readouterr()
        assert printed.out == "the cat" + new_text + "\n---\n" and "stopped at --stop" not in printed.err, stop
