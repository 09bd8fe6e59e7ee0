"""torch.compile: compiled decoding gives the eager tokens for every variant (greedy and
sampled, inductor on CPU), compiled training gives the eager losses for every variant and residual
stream, and a compiled run resumes exactly."""

from __future__ import annotations

import pytest
import torch

from gbattn.model import decoding
from gbattn.model.decoding import cache_plan, compiled_decode_step, decoder_for, generate
from gbattn.train.trainer import train
from helpers import killed_at, left_pad, run_cli, tiny_configs, train_killed_at, train_losses, write_corpus
from test_model import tiny_model


@pytest.fixture(autouse=True)
def _fresh_compile_state():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_decoding_gives_the_eager_tokens(variant_case):
    """Inductor-compiled decode step (fixed-size cache, fixed shapes, no graph break: fullgraph) vs
    the eager one: the same tokens, greedy and sampled with the same seed, in float32."""
    model = tiny_model(variant_case).float()
    prompt = torch.randint(0, 37, (2, 5))
    step = compiled_decode_step(model)
    for kwargs in (dict(temperature=0), dict(temperature=1.0, top_k=10, top_p=0.9, seed=3)):
        eager = generate(model, prompt, 14, **kwargs)
        compiled = generate(model, prompt, 14, decode_step=step, **kwargs)
        assert torch.equal(compiled, eager), kwargs


@pytest.mark.parametrize("residual", ["attnres-full", "attnres-block"])
def test_compiled_decoding_inside_attention_residuals(residual):
    sizes = {"attnres_block": 3} if residual == "attnres-block" else {}  # attnres-full: blocks of one
    model = tiny_model(("boosted", {"rounds": 3, "gate": "mlp"}), residual=residual, **sizes).float()
    with torch.no_grad():
        model.residual.queries.normal_()
    prompt = torch.randint(0, 37, (1, 4))
    step = compiled_decode_step(model)
    assert torch.equal(generate(model, prompt, 12, temperature=0, decode_step=step),
                       generate(model, prompt, 12, temperature=0))


@pytest.mark.parametrize("block", ["gpt2", "llama"])
def test_compiled_decoding_of_a_left_padded_batch_gives_the_eager_tokens(block):
    """The compiled step with per-row positions and a key padding mask (its own graph): a left-padded
    GBA batch gets the eager tokens, with learned positions and with RoPE and grouped K/V."""
    from test_model import BLOCKS

    model = tiny_model(("boosted", {"rounds": 3}), **BLOCKS[block]).float()
    batch, mask = left_pad([torch.randint(0, 37, (n,)) for n in (6, 2, 4)])
    step = compiled_decode_step(model)
    for kwargs in (dict(temperature=0), dict(temperature=1.0, top_k=10, top_p=0.9, seed=3)):
        eager = generate(model, batch, 10, prompt_mask=mask, **kwargs)
        assert torch.equal(generate(model, batch, 10, prompt_mask=mask, decode_step=step, **kwargs), eager), kwargs


def test_decoding_between_compiled_training_steps_does_not_recompile_them():
    """Setting up and clearing a KV cache (as generation does between evaluations) leaves the
    compiled training forward's guards intact: no recompile afterwards."""
    model = tiny_model(("boosted", {})).float()
    forward = torch.compile(model, backend="eager")
    idx = torch.randint(0, 37, (2, 6))
    forward(idx, idx)
    generate(model, idx[:1, :3], 4, temperature=0)
    with torch.compiler.set_stance("fail_on_recompile"):
        forward(idx, idx)


def test_decoding_compiles_only_where_it_pays(monkeypatch):

    model = tiny_model(("standard", {})).float()  # block_size 24
    monkeypatch.setitem(decoding.MIN_TOKENS_TO_COMPILE, "cpu", 20)
    # (the prefill predicts the first new token: n new tokens take n - 1 decode steps)
    assert decoder_for(model, compile=None, max_new_tokens=20)[0] is None  # compiling would cost more than it saves
    assert decoder_for(model, compile=False, max_new_tokens=10**6)[0] is None
    step, how = decoder_for(model, compile=None, max_new_tokens=21)
    assert step is not None and "compiled" in how
    # Only the steps before the sequence fills block_size use the cache (and so the compiled step):
    # from a 5-token prompt that is 19, however many tokens are asked for.
    assert decoder_for(model, compile=None, max_new_tokens=10**6, prompt_length=5)[0] is None
    assert decoder_for(model, compile=None, max_new_tokens=10**6, prompt_length=4)[0] is not None
    assert decoder_for(model, compile=True, max_new_tokens=1)[0] is not None  # asked for
    monkeypatch.setitem(decoding.MIN_TOKENS_TO_COMPILE, "cpu", None)  # not measured: only when asked
    assert decoder_for(model, compile=None, max_new_tokens=10**6)[0] is None


def test_each_compiled_generation_has_its_own_recompile_limit(monkeypatch):
    """Every generate(..., compile=True) compiles a decode step for its model and shapes, and dynamo keeps at most
    recompile_limit (8) compilations of one code object: the ninth such call in a process (a loop over prompts)
    failed with FailOnRecompileLimitHit. Here the limit is 1 and two calls with different prompt lengths (so other
    cache shapes) both decode, giving the eager tokens (dynamo's eager backend: the same guards, no code generation)."""
    original = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: original(fn, backend="eager", fullgraph=True,
                                                                          dynamic=False))
    model = tiny_model(("boosted", {})).float()
    # config.patch, not monkeypatch: monkeypatch's undo deletes the entry, which hides it from every later compile
    with torch._dynamo.config.patch(recompile_limit=1):
        for length in (3, 5):
            prompt = torch.randint(0, 37, (1, length))
            assert torch.equal(generate(model, prompt, 6, temperature=0, compile=True),
                               generate(model, prompt, 6, temperature=0, compile=False))


def _aot_eager(monkeypatch):
    """torch.compile with the aot_eager backend: the same graph capture and autograd as inductor
    (so graph breaks, guards and the training step are exercised) without its minutes of C++
    code generation per model on a CPU; test_compiled_run_resumes_exactly uses inductor."""
    original = torch.compile

    def compile_aot_eager(model, **kwargs):
        return original(model, backend="aot_eager", **kwargs)

    monkeypatch.setattr(torch, "compile", compile_aot_eager)


@pytest.mark.parametrize("residual", ["plain", "attnres-block"])
def test_compiled_training_gives_the_eager_losses(variant_case, residual, tmp_path, monkeypatch):
    name, opts = variant_case
    data = write_corpus(tmp_path / "c", lines_per_split=(200, 30, 30))
    sets = {"max_steps": 3, "eval_every": 3, "dropout": 0.0, "residual": residual, "threads": 1,
            **{f"attn.{k}": v for k, v in opts.items()}}
    eager = train(tmp_path / "eager", *tiny_configs(data, attn=name, compile=False, **sets), quiet=True)
    _aot_eager(monkeypatch)
    compiled = train(tmp_path / "compiled", *tiny_configs(data, attn=name, compile=True, **sets), quiet=True)
    assert compiled["test_loss"] == pytest.approx(eager["test_loss"], rel=1e-5)
    assert (compiled["compiled"], eager["compiled"]) == (True, False)  # (its tokens/s counts the compiling)


def test_compiled_run_resumes_exactly(tmp_path, monkeypatch):
    """Inductor, dropout on: a compiled run killed at step 5 (checkpoint at 4) and resumed ends with
    the weights and losses of an uninterrupted compiled run."""
    data = write_corpus(tmp_path / "c", lines_per_split=(200, 30, 30))
    configs = tiny_configs(data, compile=True, max_steps=8, eval_every=4, threads=1)
    ref = train(tmp_path / "ref", *configs, quiet=True)
    train_killed_at(5, tmp_path / "crashed", *configs, monkeypatch)
    resumed = train(tmp_path / "crashed", resume=True, quiet=True)
    assert resumed["test_loss"] == ref["test_loss"]
    assert train_losses(tmp_path / "crashed") == train_losses(tmp_path / "ref")


def test_a_failing_compiler_is_one_line_naming_its_error_and_the_way_round(tmp_path, monkeypatch, capsys):
    """Inductor without a working C++ compiler (``CXX`` naming none): `train --compile` and `generate --compile`
    ended in a traceback of about 100 lines, exit status 1. One line now, naming the compiler's error and
    --no-compile; the run it left resumes without compiling."""
    original = torch.compile

    def no_compiler(gm, example_inputs):
        raise RuntimeError("No working C++ compiler found in torch._inductor.config.cpp.cxx\nmore detail")

    monkeypatch.setattr(torch, "compile", lambda model, **kw: original(
        model, backend=no_compiler, **{k: v for k, v in kw.items() if k not in ("options", "mode")}))
    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "c", lines_per_split=(200, 30, 30))
    run = tmp_path / "run"
    common = ["--data", data, "--tokenizer", "char", "--set", "n_layers=1", "--set", "d_model=32",
              "--set", "n_heads=2", "--set", "threads=1", "--set", "eval_every=2", "--quiet"]
    expected = ("gbattn: error: torch.compile failed: RuntimeError: No working C++ compiler found in "
                "torch._inductor.config.cpp.cxx: run without compiling (--no-compile{}); on a CPU it needs a working "
                "C++ compiler (README, \"Compiled vs eager\")\n")
    code, _, err = run_cli(capsys, ["train", "--preset", "cpu-char", "--out", run, "--set", "max_steps=2",
                                    "--compile", *common])
    assert (code, err.splitlines()[-1] + "\n") == (2, expected.format("; a comparison's: --set compile=false"))
    assert run_cli(capsys, ["train", "--resume", "--out", run, "--no-compile", "--quiet"])[0] == 0
    code, out, err = run_cli(capsys, ["generate", run, "--prompt", "ab", "--max-new-tokens", "4", "--compile"])
    assert (code, err) == (2, expected.format(""))


def test_a_comparisons_failing_compile_is_one_line_naming_its_set_and_under_gbattn_debug_a_traceback(
        tmp_path, monkeypatch, capsys):
    """torch.compile failing with an error of dynamo's own (InvalidBackend here), not a backend's wrapped in
    BackendCompilerFailed, is the one line too, and `gbattn compare` (whose runs take no --no-compile) names its own
    way round, --set compile=false. With GBATTN_DEBUG=1 it ends in the traceback, as every other error does."""
    from torch._dynamo.exc import InvalidBackend

    original = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: original(model, backend="no-such-backend"))
    data = write_corpus(tmp_path / "c", lines_per_split=(200, 30, 30))
    argv = ["compare", "--recipe", "cpu-char", "--only", "standard", "--seeds", "1", "--data", data, "--quiet",
            "--set", "compile=true", "--set", "max_steps=2", "--set", "n_layers=1", "--set", "d_model=32",
            "--set", "n_heads=2", "--set", "threads=1", "--set", "eval_every=2"]
    code, _, err = run_cli(capsys, [*argv, "--out", tmp_path / "cmp"])
    assert (code, err.splitlines()[-1]) == (2, (
        "gbattn: error: torch.compile failed: InvalidBackend: Invalid backend: 'no-such-backend', see "
        "`torch._dynamo.list_backends()` for available backends.: run without compiling (--set compile=false); on a "
        "CPU it needs a working C++ compiler (README, \"Compiled vs eager\")")), err
    monkeypatch.setenv("GBATTN_DEBUG", "1")
    with pytest.raises(InvalidBackend, match="no-such-backend"):
        run_cli(capsys, [*argv, "--out", tmp_path / "debug"])


def test_a_run_with_any_compiled_leg_says_it_compiled(tmp_path, monkeypatch):
    """result.json's `compiled` (its time and tokens/s count the compiling: results.md says so) said the last leg's:
    false of a run trained compiled, stopped, and finished eager. Any leg's now, kept in the checkpoint."""
    from gbattn import rundir
    from gbattn.errors import CheckpointError

    _aot_eager(monkeypatch)
    data = write_corpus(tmp_path / "c", lines_per_split=(200, 30, 30))
    configs = tiny_configs(data, compile=True, max_steps=12, eval_every=4, threads=1, dropout=0.0)  # (may switch)
    train_killed_at(5, tmp_path / "run", *configs, monkeypatch)
    path = tmp_path / "run" / rundir.CHECKPOINT
    state = rundir.load_checkpoint(path)
    assert state["ever_compiled"] is True
    torch.save({**state, "ever_compiled": "yes"}, path)
    with pytest.raises(CheckpointError, match="its record of a compiled leg is malformed: 'yes'"):
        train(tmp_path / "run", resume=True, quiet=True, overrides={"compile": False})
    torch.save(state, path)
    # a second leg, eager, killed too: its checkpoint keeps the first leg's compiling (trained_on says eager)
    with killed_at(9, monkeypatch), pytest.raises(RuntimeError, match="simulated kill"):
        train(tmp_path / "run", resume=True, quiet=True, overrides={"compile": False})
    state = rundir.load_checkpoint(path)
    assert state["trained_on"]["compiled"] is False and state["ever_compiled"] is True
    assert train(tmp_path / "run", resume=True, quiet=True, overrides={"compile": False})["compiled"] is True


def test_a_checkpoint_from_before_ever_compiled_was_kept_remembers_a_compiled_leg(tmp_path, monkeypatch, capsys):
    """A checkpoint of a gbattn from before `ever_compiled` was kept records its leg's compiling in trained_on alone:
    one trained compiled and resumed eager has a compiled leg, so result.json says "compiled": true (its time and
    tokens/s count the compiling). The resume's warning tells a comparison's run the --set compile= that resumes it
    as it ran: true, as it trained."""
    from gbattn import rundir

    data = write_corpus(tmp_path / "c", lines_per_split=(200, 30, 30))
    run = tmp_path / "run"
    with killed_at(5, monkeypatch), pytest.raises(RuntimeError, match="simulated kill"):
        train(run, *tiny_configs(data, compile=False, max_steps=8, eval_every=4, threads=1, dropout=0.0), quiet=True,
              extra={"label": "gba-m2"})
    path = run / rundir.CHECKPOINT
    state = rundir.load_checkpoint(path)
    del state["ever_compiled"]
    state["trained_on"]["compiled"] = True  # (its first leg trained compiled)
    torch.save(state, path)
    capsys.readouterr()
    result = train(run, resume=True, quiet=True, overrides={"compile": False})
    assert result["compiled"] is True
    assert rundir.read_result(run / rundir.RESULT)["compiled"] is True
    assert ("was trained compiled and this run trains eager (resume with --compile; a comparison's: --set "
            "compile=true): it goes on, but not exactly") in capsys.readouterr().err


def test_a_runs_folder_name_reaches_the_terminal_escaped_in_its_training_lines(tmp_path, capsys):
    """An escape sequence in a run's folder name (a received or scripted name) went raw into the progress line, the
    final summary line and a finished run's "nothing to resume" line: a terminal took it as a command. Each is
    written as text, ``\\x1b``, as every other line naming the folder is."""
    data = write_corpus(tmp_path / "c", lines_per_split=(200, 30, 30))
    run = tmp_path / "run\x1b[31m"
    train(run, *tiny_configs(data, compile=False, max_steps=4, eval_every=4, threads=1))
    printed = capsys.readouterr()
    assert "\x1b" not in printed.out + printed.err
    assert "train run\\x1b[31m: 4/4 steps" in printed.err, printed.err
    assert f"{tmp_path}/run\\x1b[31m: best valid ppl " in printed.out, printed.out
    train(run, resume=True)
    printed = capsys.readouterr()
    assert "\x1b" not in printed.out + printed.err
    assert (f"{tmp_path}/run\\x1b[31m finished at step 4 (its result.json): nothing to resume; --restart trains it "
            f"again\n") in printed.out


def test_a_prompt_that_fills_the_block_gets_no_decode_step():
    model = tiny_model(("standard", {})).float()  # block_size 24
    step, how = decoder_for(model, compile=True, max_new_tokens=5, prompt_length=24)
    assert step is None and "no cache" in how
    step, how = decoder_for(model, compile=False, max_new_tokens=1, prompt_length=23)
    assert step is None and how == "KV cache"
    # `generate`'s summary said "KV cache" for 2,000 tokens at block_size 64, nearly all decoded without it.
    step, how = decoder_for(model, compile=False, max_new_tokens=5, prompt_length=23)
    assert step is None and how == "KV cache; no cache past block_size=24"
    # a prompt of block_size tokens: the prefill predicts the first new token, the second has no position left
    assert cache_plan(24, 2, 24) == (0, "; no cache past block_size=24") and cache_plan(24, 1, 24) == (0, "")


def test_the_decode_summary_says_no_cache_exactly_when_generate_runs_without_it():
    """The prefill predicts the first new token, so a prompt of T tokens gets block_size - T + 1 from the cache:
    the summary said "no cache past block_size" for one token fewer (23 + 2 at block_size 24), all cached."""
    model = tiny_model(("standard", {})).float()  # block_size 24
    forward, uncached = model.forward, []

    def counting_forward(idx, *args, **kwargs):
        uncached[-1] += kwargs.get("input_pos") is None
        return forward(idx, *args, **kwargs)

    model.forward = counting_forward
    # A prompt that fills block_size (24) is never cached, not even its prefill.
    for prompt_length, new_tokens in ((23, 1), (23, 2), (23, 3), (20, 5), (20, 6), (1, 24), (1, 25), (5, 0), (24, 1),
                                      (24, 3)):
        uncached.append(0)
        generate(model, torch.randint(0, 37, (1, prompt_length)), new_tokens, temperature=0)
        how = decoder_for(model, compile=False, max_new_tokens=new_tokens, prompt_length=prompt_length)[1]
        assert ("no cache" in how) == (uncached[-1] > 0), (prompt_length, new_tokens, how)


def test_compiled_twicing_draws_one_dropout_mask_for_both_products():
    """Twicing shares one dropout mask between A V and A (A V) by replaying the RNG state
    (Call.shared_dropout), which torch.compile graph-breaks around; compiled by inductor, with gradients on as in
    training, the fast path's output must still be W_out (2 A'V - A'(A'V)) for one mask A' = A * M / (1 - p).
    With W_out = I and V invertible (T = head width), Y = output V^-1 = 2 A' - A'^2, and a search over every causal
    mask finds the one that gives it (planted two independent masks: 3 of 4 heads had none)."""
    import itertools

    from gbattn.attention.core import AttnArgs
    from gbattn.attention.registry import build_attention

    torch.manual_seed(0)
    D, H, T, p = 16, 4, 4, 0.5
    E = D // H
    attn = build_attention("twicing", AttnArgs(d_model=D, n_heads=H, dropout=p), {}).double().train()
    with torch.no_grad():
        attn.out.weight.copy_(torch.eye(D))
        attn.out.bias.zero_()
    x_BTD = torch.randn(1, T, D, dtype=torch.float64, requires_grad=True)
    q_BHTE, k_BHTE, v_BHTE = (part.view(1, T, H, E).transpose(1, 2) for part in attn.qkv(x_BTD).detach().split(D, -1))
    future_TT = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)
    A_HTT = torch.softmax(q_BHTE @ k_BHTE.transpose(-1, -2) / E**0.5 + future_TT, -1)[0]
    below = [(i, j) for i in range(T) for j in range(i + 1)]
    masks_NTT = torch.zeros(2 ** len(below), T, T, dtype=torch.float64)
    for n, bits in enumerate(itertools.product([0.0, 1.0], repeat=len(below))):
        for (i, j), bit in zip(below, bits):
            masks_NTT[n, i, j] = bit / (1 - p)
    compiled = torch.compile(attn)
    for seed in range(2):
        torch.manual_seed(seed)
        y_HTE = compiled(x_BTD).detach().view(T, H, E).transpose(0, 1)
        assert (y_HTE - attn.eval()(x_BTD).detach().view(T, H, E).transpose(0, 1)).abs().max() > 1e-3  # dropout ran
        attn.train()
        Y_HTT = y_HTE @ torch.linalg.inv(v_BHTE[0])
        for h in range(H):
            dropped_NTT = A_HTT[h] * masks_NTT
            explained = (2 * dropped_NTT - dropped_NTT @ dropped_NTT - Y_HTT[h]).abs().amax((1, 2)) < 1e-9
            assert explained.any(), f"seed {seed}, head {h}: no single dropout mask gives the compiled output"
