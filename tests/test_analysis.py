"""`gbattn analyze` and `gbattn plot` (docs/paper.md, "Analysis"): every figure written, JSON values in
range, entropy from the intermediates equal to a direct computation with the layer's own weights,
clear errors."""

from __future__ import annotations

import copy
import json
import math
import shutil
import warnings

import numpy as np
import pytest
import torch

from gbattn.analysis import stats
from gbattn.analysis.cli import analyze_run, plot_compare, select_rows
from gbattn.analysis.figures import require_matplotlib
from gbattn.attention.core import AttnContext
from gbattn.cli import main as cli_main
from gbattn.data.prepare import prepare_data
from gbattn.data.tokens import rows_batch
from gbattn.errors import UserError
from gbattn.rundir import load_run
from gbattn.train.trainer import train
from helpers import TINY, bpe_with_unknown_words, give_run_tokenizer, hold_lock, in_use, tiny_configs, write_corpus

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SEQ_LEN = TINY["block_size"] - 1


# The analysed runs: tiny_configs' run, 8 steps, one thread.
SHORT = {"max_steps": 8, "warmup_steps": 2, "threads": 1}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny GBA run and a tiny standard run on the same corpus, trained once for the module."""
    root = tmp_path_factory.mktemp("analysis-runs")
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GBATTN_CACHE", str(root / "cache"))
        torch.manual_seed(0)
        data = write_corpus(root / "corpus")
        train(root / "gba", *tiny_configs(data, "boosted", **SHORT), quiet=True)
        train(root / "std", *tiny_configs(data, "standard", **SHORT), quiet=True)
    torch.set_num_threads(threads)
    return {"gba": root / "gba", "std": root / "std", "data": data}


def split_rows(run, row_ids):
    """(inputs, targets) of the given rows of a loaded run's test split, as analyze reads them."""
    data = prepare_data(run.train_cfg, run.model_cfg.vocab_size, run.tokenizer, progress=False)
    return rows_batch(data.splits["test"], run.seq_len, np.asarray(row_ids))


def token_losses(run_dir, row_ids) -> torch.Tensor:
    """Per-token next-token loss (N, T) of a run on the given test rows, computed here."""
    run = load_run(run_dir)
    x_BT, y_BT = split_rows(run, row_ids)
    with torch.no_grad():
        logits_BTV = run.model(x_BT).double()
    return -torch.log_softmax(logits_BTV, -1).gather(-1, y_BT[..., None])[..., 0]


def standard_entropy_by_hand(run_dir, row_ids) -> float:
    """Mean attention entropy (nats) of a standard run over layers, heads and queries, from each
    layer's own q/k weights (causal softmax rows)."""
    run = load_run(run_dir)
    model = run.model
    x_BT, _ = split_rows(run, row_ids)
    B, T = x_BT.shape
    d, H = model.cfg.d_model, model.cfg.n_heads
    E = d // H
    causal_TT = torch.ones(T, T, dtype=torch.bool).tril()
    per_layer = []
    with torch.no_grad():
        h_BTD = model.wte(x_BT) + model.wpe(torch.arange(T))
        for block in model.blocks:
            q_BTD, k_BTD, _ = block.attn.qkv(block.ln1(h_BTD)).split(d, dim=-1)
            q_BHTE, k_BHTE = (t.view(B, T, H, E).transpose(1, 2).double() for t in (q_BTD, k_BTD))
            scores_BHTT = (q_BHTE @ k_BHTE.transpose(-1, -2) / math.sqrt(E)).masked_fill(~causal_TT, float("-inf"))
            log_p = torch.log_softmax(scores_BHTT, -1)
            per_layer.append(-(log_p.exp() * log_p.nan_to_num(neginf=0.0)).sum(-1).mean().item())
            h_BTD = block(h_BTD, AttnContext(T=T, S=T, device=h_BTD.device))
    return sum(per_layer) / len(per_layer)


@pytest.fixture
def drawn(monkeypatch):
    """The figures analyze saves, by name (each is still written to its file)."""
    from gbattn.analysis import figures

    saved, save = {}, figures.save

    def capture(fig, out_dir, name, pdf=False):
        saved[name] = fig
        return save(fig, out_dir, name, pdf)

    monkeypatch.setattr(figures, "save", capture)
    return saved


def assert_png(path):
    assert path.is_file(), path
    blob = path.read_bytes()
    assert len(blob) > 1000 and blob[:8] == PNG_MAGIC, path


# ---- gbattn analyze ----------------------------------------------------------------------


def test_relative_drop_is_none_where_round0_entropy_is_zero():
    """At sequence length 1 every row attends to one key: both rounds' entropies are 0 and the ratio
    has no meaning, so the summary says null instead of writing NaN into summary.json."""
    assert stats.relative_drop(0.0, 0.0) is None
    assert stats.relative_drop(1.5, 2.0) == pytest.approx(0.25)
    assert stats.relative_drop(2.5, 2.0) == pytest.approx(-0.25)


def test_analyze_against_writes_every_figure_and_values_in_range(runs, tmp_path, capsys):
    out = tmp_path / "analysis"
    code = cli_main(["analyze", str(runs["gba"]), "--against", str(runs["std"]), "--out", str(out),
                     "--max-rows", "8", "--top", "5", "--examples", "2", "--pdf", "--quiet", "--device", "cpu"])
    printed = capsys.readouterr().out
    assert code == 0
    for name in ("gates", "entropy", "norms", "loss_diff", "examples"):
        assert_png(out / f"{name}.png")
        assert (out / f"{name}.pdf").stat().st_size > 0
    # (a 2-layer model: the paper's per-layer gates are its own 4-layer model's, said so)
    assert "paper (its 4-layer M=2 model): 0.35 / 0.48 / 0.41 / 0.43 (revision 0.33 / 0.49 / 0.39 / 0.36)" in printed
    assert "figures:" in printed
    assert "paper: 3.31 -> 2.58 (22% lower, layer 0 the exception, T=256)" in printed

    s = json.loads((out / "summary.json").read_text())
    L, H, rounds = TINY["n_layers"], TINY["n_heads"], 2
    assert s["rounds"] == rounds and s["seq_len"] == SEQ_LEN and s["tokens"] == s["rows"] * SEQ_LEN
    # Shapes and counts (the values themselves are checked against a hand computation below).
    g = s["gates"]
    per_dim = np.asarray([r["per_dimension"] for r in g["per_layer"]])
    assert g["available"] and per_dim.shape == (L * (rounds - 1), TINY["d_model"]) and len(g["per_layer"]) == L
    assert g["mean_per_layer"] == pytest.approx(per_dim.mean(-1).tolist())
    assert g["paper_mean_per_layer"] == [0.35, 0.48, 0.41, 0.43]
    e = s["entropy"]
    assert e["max_possible"] == pytest.approx(math.log(SEQ_LEN))
    for row in e["per_layer"]:
        assert np.asarray(row["per_head"]).shape == (rounds, H)
        assert row["mean_per_round"] == pytest.approx(np.asarray(row["per_head"]).mean(1).tolist())
    counts = np.asarray(e["histogram"]["counts_per_round"])
    assert counts.shape[0] == rounds and (counts.sum(1) == s["rows"] * SEQ_LEN * H * L).all()  # every query once
    assert e["relative_drop"] == pytest.approx(1 - e["mean_per_round"][1] / e["mean_per_round"][0])
    assert e["paper"]["entropy_round0_nats"] == 3.31 and e["paper"]["entropy_correction_nats"] == 2.58
    assert len(s["norms"]["per_layer"]) == L
    # Per-token loss difference against the standard run.
    d = s["loss_diff"]
    assert d["mean"] == pytest.approx(d["against_loss"] - d["loss"], abs=1e-5)
    assert sum(d["histogram"]["counts"]) == s["tokens"]
    this_NT, that_NT = (token_losses(runs[k], s["row_ids"]) for k in ("gba", "std"))
    assert d["fraction_positive"] == pytest.approx((that_NT - this_NT > 1e-4).double().mean().item(), abs=1e-9)
    assert d["fraction_negative"] == pytest.approx((that_NT - this_NT < -1e-4).double().mean().item(), abs=1e-9)
    assert d["median"] == pytest.approx((that_NT - this_NT).median().item(), abs=1e-4)
    assert len(d["top_tokens"]) == 5 and d["top_tokens"][0]["diff"] == pytest.approx(
        max(t["diff"] for t in d["top_tokens"])
    )
    assert all(isinstance(t["token"], str) and t["context"] for t in d["top_tokens"])
    examples = d["examples"]["positions"]
    assert len(examples) == 2 and d["examples"]["layer"] == L - 1
    for ex in examples:
        att = np.asarray(ex["attention_per_round"])
        assert att.shape == (rounds, ex["position"] + 1)
        np.testing.assert_allclose(att.sum(1), 1.0, atol=1e-5)  # head mean of probability rows


def test_examples_of_a_layer_without_a_correction_round_say_so(runs, tmp_path):
    """GBA in layer 0 only: the default --layer -1 drew layer 1's "round 0 vs round 1" examples with round 0 alone,
    unsaid. A note names the layer and the one to ask for; a corrected layer's examples get none."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GBATTN_CACHE", str(tmp_path / "cache"))
        train(tmp_path / "first", *tiny_configs(runs["data"], "boosted", **SHORT, **{"attn.layers": [0]}), quiet=True)
        note = ("the examples show layer 1, which has no correction round (attn.layers): round 0 only; --layer 0 "
                "shows the last layer that has one")
        summary = analyze_run(tmp_path / "first", against=runs["std"], out=tmp_path / "a", max_rows=2, quiet=True)
        assert note in summary["notes"]
        assert {len(p["attention_per_round"]) for p in summary["loss_diff"]["examples"]["positions"]} == {1}
        summary = analyze_run(tmp_path / "first", against=runs["std"], out=tmp_path / "b", max_rows=2, layer=0,
                              quiet=True)
        assert not [n for n in summary["notes"] if "no correction round" in n]


def test_a_run_against_itself_ties_on_every_token(runs, tmp_path, capsys, drawn):
    """The same weights evaluated on two code paths differ by float32 rounding (about 1e-6 nats):
    ties, not gains. The two models share a name, so the other one is "(against)" on the figure, and
    --layer 0 is the layer of the examples."""
    out = tmp_path / "self"
    assert cli_main(["analyze", str(runs["std"]), "--against", str(runs["std"]), "--out", str(out), "--max-rows", "4",
                     "--examples", "1", "--layer", "0", "--quiet", "--device", "cpu"]) == 0
    d = json.loads((out / "summary.json").read_text())["loss_diff"]
    assert d["fraction_tied"] == 1.0 and d["fraction_positive"] == d["fraction_negative"] == 0.0
    assert d["top_tokens"] == []
    assert "better on 0% of tokens, worse on 0%, within 0.0001 nats on 100%" in capsys.readouterr().out
    assert d["examples"]["layer"] == 0
    assert drawn["loss_diff"].axes[0].get_xlabel() == "loss(standard (against)) − loss(standard)  (nats per token)"


def test_statistics_match_a_computation_by_hand(runs):
    """Entropy per round, gates, norms and the example figure's head-averaged maps as stats.py reports them ==
    the same quantities computed here by hand from each layer's own weights (round 0 from x, round 1 from the
    residual r = x - F_0)."""
    run = load_run(runs["gba"])
    model = run.model
    x_BT, _ = split_rows(run, np.arange(3))
    test_tokens = prepare_data(run.train_cfg, run.model_cfg.vocab_size, run.tokenizer, progress=False).splits["test"]
    with torch.no_grad():
        _, record = model(x_BT, return_intermediates=True)
        B, T = x_BT.shape
        d, H = model.cfg.d_model, model.cfg.n_heads
        E = d // H
        causal_TT = torch.ones(T, T, dtype=torch.bool).tril()

        def heads(t_BTD):
            return t_BTD.view(B, T, H, E).transpose(1, 2)

        def attention(q_BTD, k_BTD, v_BTD):
            scores = heads(q_BTD) @ heads(k_BTD).transpose(-1, -2) / math.sqrt(E)
            p_BHTS = torch.softmax(scores.masked_fill(~causal_TT, float("-inf")), dim=-1)
            ent_BHT = -(p_BHTS * torch.log(p_BHTS.clamp_min(1e-30))).sum(-1)
            out_BTD = (p_BHTS @ heads(v_BTD)).transpose(1, 2).reshape(B, T, d)
            return ent_BHT, out_BTD, p_BHTS

        h_BTD = model.wte(x_BT) + model.wpe(torch.arange(T))
        acc = stats.IntermediateStats(model.cfg.n_layers, H, d, T)
        acc.update([stats.layer_sample(r) for r in record])
        summary, gates, norms = acc.entropy_summary(), acc.gate_summary(), acc.norm_summary()
        for li, block in enumerate(model.blocks):
            attn = block.attn
            x_BTD = block.ln1(h_BTD)
            q, k, v = attn.qkv(x_BTD).split(d, dim=-1)
            ent0_BHT, f0_BTD, p0_BHTS = attention(q, k, v)
            r_BTD = x_BTD - f0_BTD
            q1, k1, v1 = attn.corrections[0].proj(r_BTD).split(d, dim=-1)
            ent1_BHT, c_BTD, p1_BHTS = attention(q1, k1, v1)
            gate = attn.corrections[0].gate.proj
            g_BTD = torch.sigmoid(torch.cat([f0_BTD, c_BTD], -1) @ gate.weight.T + gate.bias)
            assert gates["per_layer"][li]["mean"] == pytest.approx(g_BTD.mean().item(), rel=1e-4)
            assert gates["per_layer"][li]["std"] == pytest.approx(g_BTD.std(unbiased=False).item(), rel=1e-3)
            row = norms["per_layer"][li]
            assert row["residual"] == pytest.approx(r_BTD.norm(dim=-1).mean().item(), rel=1e-4)
            assert row["gated_correction"] == pytest.approx((g_BTD * c_BTD).norm(dim=-1).mean().item(), rel=1e-4)
            assert row["residual_after"] == pytest.approx((r_BTD - g_BTD * c_BTD).norm(dim=-1).mean().item(), rel=1e-4)
            from_stats_MBHT = torch.stack(stats.layer_sample(record[li]).entropies).float()
            torch.testing.assert_close(from_stats_MBHT[0], ent0_BHT, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(from_stats_MBHT[1], ent1_BHT, rtol=1e-4, atol=1e-5)
            assert summary["per_layer"][li]["mean_per_round"] == pytest.approx(
                [ent0_BHT.mean().item(), ent1_BHT.mean().item()], rel=1e-5)
            # the example figure's maps: each round's attention of one query, averaged over the heads
            (example,) = stats.attention_examples(model, test_tokens, T, np.arange(B), [(B - 1, T - 1)], li)
            by_hand_RS = torch.stack([p[B - 1, :, T - 1].mean(0) for p in (p0_BHTS, p1_BHTS)])
            np.testing.assert_allclose(example["attention"], by_hand_RS.numpy(), rtol=1e-4, atol=1e-6)
            h_BTD = block(h_BTD, AttnContext(T=T, S=T, device=h_BTD.device))


def test_figures_of_a_run_given_as_dot_name_its_folder(runs, tmp_path, monkeypatch, drawn):
    """`gbattn analyze .` inside a run titled every figure "GBA M=2 (, test, ...)": the folder's own name now."""
    monkeypatch.chdir(runs["gba"])

    def titles(max_rows: int, out) -> list[str]:
        assert cli_main(["analyze", ".", "--out", str(out), "--max-rows", str(max_rows), "--quiet", "--device",
                         "cpu"]) == 0
        return [drawn["gates"].get_suptitle(), drawn["entropy"].get_suptitle(), drawn["norms"].axes[0].get_title()]

    drawn_titles = titles(2, tmp_path / "a")
    assert all("(gba, test, 2 rows" in title for title in drawn_titles), drawn_titles
    # a --max-rows above the split's rows: the titles state the rows analysed, not the cap
    drawn_titles = titles(100_000, tmp_path / "b")
    rows = json.loads((tmp_path / "b" / "summary.json").read_text())["rows"]
    assert rows < 100_000 and all(f"(gba, test, {rows} rows" in title for title in drawn_titles), drawn_titles


def test_analyze_standard_run_reports_entropy_and_says_gates_do_not_exist(runs, tmp_path, capsys):
    out = tmp_path / "std-analysis"
    summary = analyze_run(runs["std"], out=out, max_rows=4, device="cpu", quiet=True)
    printed = capsys.readouterr().out
    assert summary["rounds"] == 1 and not summary["gates"]["available"] and not summary["norms"]["available"]
    assert (summary["residual"], summary["norm"]) == ("plain", "pre")
    assert summary["attention"] == "standard"  # no options: no empty "()"
    assert "gates and corrections do not exist" in printed and "softmax(Q1 K1^T)" not in printed
    # said once, on the gates line, not again as a note
    assert "  gates: standard attention has no boosting rounds" in printed and "note: standard attention" not in printed
    assert_png(out / "entropy.png")
    assert not (out / "gates.png").exists() and not (out / "norms.png").exists()
    assert summary["entropy"]["mean_per_round"][0] == pytest.approx(
        standard_entropy_by_hand(runs["std"], summary["row_ids"]), rel=1e-4)
    assert summary["entropy"]["relative_drop"] is None


def test_a_figure_is_never_written_through_a_link_in_its_folder(tmp_path):
    """analyze writes into RUN/analysis by default: a shared run directory's analysis/gates.png that linked to a
    file elsewhere had that file overwritten with the figure; the link is now replaced by the figure."""
    import matplotlib.pyplot as plt

    from gbattn.analysis import figures

    victim = tmp_path / "victim"
    victim.write_text("not gbattn's")
    out = tmp_path / "run" / "analysis"
    out.mkdir(parents=True)
    for suffix in (".png", ".pdf"):
        (out / f"gates{suffix}").symlink_to(victim)
    fig = plt.figure()
    try:
        written = figures.save(fig, out, "gates", pdf=True)
    finally:
        plt.close(fig)
    assert victim.read_bytes() == b"not gbattn's"
    assert [p.is_symlink() for p in written] == [False, False]
    assert written[0].read_bytes()[:4] == b"\x89PNG" and written[1].read_bytes()[:4] == b"%PDF"


def test_an_analysis_into_a_folder_another_process_writes_is_one_line_and_writes_nothing(runs, tmp_path, capsys,
                                                                                          monkeypatch):
    """Two analyses into one folder at once could leave one's figures beside the other's summary.json: the folder's
    lock, as a run's, refuses the second writer, before any work (it was refused only when its figures were drawn,
    after its minutes of scoring: here loading the run would fail the test)."""
    import gbattn.rundir

    def no_work(*args, **kwargs):
        raise AssertionError("the analysis loaded its run before taking its folder's lock")

    monkeypatch.setattr(gbattn.rundir, "load_run", no_work)
    out = tmp_path / "analysis"
    holder = hold_lock(out, "analysis")
    try:
        assert cli_main(["analyze", str(runs["std"]), "--out", str(out), "--max-rows", "2", "--threads", "1",
                        "--quiet"]) == 2
        assert capsys.readouterr().err.strip().splitlines() == in_use(out, "analysis")
        assert sorted(p.name for p in out.iterdir()) == [".lock"]
    finally:
        holder.kill()
        holder.wait()


def test_a_new_analysis_removes_the_figures_an_earlier_one_left_in_its_folder(runs, tmp_path, capsys):
    """Analysing a standard run into the folder of a GBA run's analysis (or rerunning without --pdf)
    left the GBA run's gates, norms, loss difference and examples and every PDF beside the new
    summary.json, as if they described the new analysis."""
    out = tmp_path / "analysis"
    analyze_run(runs["gba"], against=runs["std"], out=out, max_rows=2, pdf=True, quiet=True, device="cpu")
    assert len(list(out.glob("*.p*"))) == 10
    (out / "mine.png").write_bytes(b"x")  # a file analyze does not draw stays
    summary = analyze_run(runs["std"], out=out, max_rows=2, quiet=True, device="cpu")
    assert sorted(p.name for p in out.iterdir()) == [".lock", "entropy.png", "mine.png", "summary.json"]
    note = summary["notes"][-1]
    assert note.startswith("removed gates.png, gates.pdf, entropy.pdf, norms.png, norms.pdf, loss_diff.png, "
                           "loss_diff.pdf, examples.png, examples.pdf: figures an earlier analysis left")
    assert f"note: {note}" in capsys.readouterr().out


def test_an_analysis_removes_no_figure_nor_summary_it_did_not_write(runs, tmp_path, capsys):
    """A folder of the user's own figures named as analyze's (gates.png, examples.pdf): they were deleted as "figures
    an earlier analysis left"; and a summary.json of the user's own was replaced. Figures are removed only from an
    earlier analysis's folder (its summary.json), and a summary.json analyze did not write is refused."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "gates.png").write_bytes(b"my figure")
    (mine / "examples.pdf").write_bytes(b"my paper's figure")
    summary = analyze_run(runs["std"], out=mine, max_rows=2, quiet=True, device="cpu")
    assert sorted(p.name for p in mine.iterdir()) == [".lock", "entropy.png", "examples.pdf", "gates.png",
                                                      "summary.json"]
    assert not any(note.startswith("removed ") for note in summary["notes"])
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "summary.json").write_text('{"my": "experiment results"}')
    capsys.readouterr()
    assert cli_main(["analyze", str(runs["std"]), "--out", str(theirs), "--max-rows", "2", "--threads", "1",
                     "--quiet"]) == 2
    assert capsys.readouterr().err == (f"gbattn: error: --out {theirs} holds a summary.json that `gbattn analyze` did "
                                       f"not write, not a folder of figures: choose another --out\n")
    assert (theirs / "summary.json").read_text() == '{"my": "experiment results"}'


def test_analyze_against_records_each_top_token_and_example_where_it_is(runs, tmp_path, drawn):
    """Each top token is the target at its (row id, position) with both models' losses and its context there, each
    example names its target and is drawn with its own gain; the perplexities are exp of the mean losses, the
    mean by position is over rows, ties are what is neither better nor worse, and the entropy figure of
    a GBA run shows the paper's values."""
    s = analyze_run(runs["gba"], against=runs["std"], out=tmp_path / "a", max_rows=4, top=3, examples=2,
                    device="cpu", quiet=True)
    run = load_run(runs["gba"])
    x_BT, y_BT = split_rows(run, s["row_ids"])
    this_NT, that_NT = (token_losses(runs[k], s["row_ids"]) for k in ("gba", "std"))
    index = {r: i for i, r in enumerate(s["row_ids"])}
    d = s["loss_diff"]
    assert len(d["top_tokens"]) == 3
    for top in d["top_tokens"]:
        i, t = index[top["row"]], top["position"]
        assert top["token"] == run.tokenizer.decode([int(y_BT[i, t])])
        # its context: the last 24 inputs up to and including position t's, the one that predicts the token
        assert top["context"] == run.tokenizer.decode(x_BT[i, max(0, t - 23) : t + 1].tolist(), skip_special=False)
        assert top["loss"] == pytest.approx(this_NT[i, t].item(), abs=1e-5)
        assert top["against_loss"] == pytest.approx(that_NT[i, t].item(), abs=1e-5)
        assert top["diff"] == pytest.approx(top["against_loss"] - top["loss"], abs=1e-9)
    titles = [ax.get_title() for ax in drawn["examples"].axes]
    for ex, title in zip(d["examples"]["positions"], titles, strict=True):
        i, t = index[ex["row"]], ex["position"]
        assert ex["target"] == run.tokenizer.decode([int(y_BT[i, t])])
        gain = (that_NT - this_NT)[i, t].item()
        assert f"loss {this_NT[i, t].item():.2f} vs {that_NT[i, t].item():.2f} nats" in title
        assert title.endswith(f"(gain {gain:+.2f})")
    assert s["loss"]["ppl"] == pytest.approx(math.exp(s["loss"]["mean_nats"]))
    assert d["against_ppl"] == pytest.approx(math.exp(d["against_loss"]))
    assert d["fraction_tied"] == pytest.approx(1.0 - d["fraction_positive"] - d["fraction_negative"], abs=1e-12)
    assert d["fraction_tied"] >= 0
    np.testing.assert_allclose(d["mean_by_position"], (that_NT - this_NT).mean(0).numpy(), atol=1e-5)
    assert s["attention"] == "boosted" and s["n_heads"] == TINY["n_heads"] and s["notes"] == []
    layer_legend = [t.get_text() for t in drawn["entropy"].axes[1].get_legend().get_texts()]
    assert "paper round 0 (3.31, T=256)" in layer_legend and "paper correction (2.58, T=256)" in layer_legend
    assert s["entropy"]["paper"]["seq_len"] == s["paper"]["seq_len"] == 256  # the paper's rows (docs/paper.md)


def test_top_and_examples_of_0_list_no_token_and_draw_no_example_figure(runs, tmp_path):
    """--top 0 and --examples 0 are allowed (>= 0): no token listed, and no examples.png rather than an empty one."""
    out = tmp_path / "a"
    summary = analyze_run(runs["gba"], against=runs["std"], out=out, max_rows=1, top=0, examples=0, device="cpu",
                          quiet=True)
    assert summary["loss_diff"]["top_tokens"] == [] and summary["loss_diff"]["examples"]["positions"] == []
    assert "examples.png" not in summary["figures"] and not (out / "examples.png").exists()
    assert "loss_diff.png" in summary["figures"]


def test_against_a_run_of_another_corpus_is_a_note_and_one_without_a_fingerprint_is_not(runs, tmp_path, capsys):
    """--against a run whose recorded data fingerprint differs: a printed note (both are evaluated on this
    run's rows); one that recorded no fingerprint (an older run) is not said to be of another corpus."""
    other = tmp_path / "other"
    shutil.copytree(runs["std"], other)
    config = json.loads((other / "config.json").read_text())
    for fingerprint, noted in (("0" * 64, True), (None, False)):
        config["data"]["fingerprint"] = fingerprint
        (other / "config.json").write_text(json.dumps(config))
        s = analyze_run(runs["gba"], against=other, out=tmp_path / "a", max_rows=2, top=1, examples=1, device="cpu",
                        quiet=True)
        note = f"{other} was trained on another corpus; both models are evaluated on {runs['gba']}'s rows"
        assert s["notes"] == ([note] if noted else [])
        assert (f"  note: {note}" in capsys.readouterr().out) is noted


def test_against_records_which_weights_of_the_other_run_it_compared(runs, tmp_path, capsys):
    """summary.json and the printed line named this run's checkpoint and step but not the --against run's: one
    with no best.pt yet (stopped before its first evaluation) was compared on its last weights unsaid."""
    s = analyze_run(runs["gba"], against=runs["std"], out=tmp_path / "a", max_rows=2, top=1, examples=0,
                    device="cpu", quiet=True)
    best_step = load_run(runs["std"]).step
    assert (s["loss_diff"]["against_checkpoint"], s["loss_diff"]["against_step"]) == ("best", best_step)
    assert f"(standard, best weights at step {best_step}): loss" in capsys.readouterr().out
    other = tmp_path / "no-best"
    shutil.copytree(runs["std"], other)
    (other / "best.pt").unlink()
    last_step = load_run(other).step
    s = analyze_run(runs["gba"], against=other, out=tmp_path / "b", max_rows=2, top=1, examples=0, device="cpu",
                    quiet=True)
    assert (s["loss_diff"]["against_checkpoint"], s["loss_diff"]["against_step"]) == ("last", last_step)
    assert f"(standard, last weights at step {last_step}): loss" in capsys.readouterr().out


def test_analyze_out_holding_another_run_is_refused_unwritten(runs, tmp_path, capsys):
    """`analyze GBA --out STD_RUN` wrote summary.json and the figures into the other run's directory, where they
    read as that run's analysis; it is now one line, before any work, and nothing is written there."""
    other = tmp_path / "std"
    shutil.copytree(runs["std"], other)
    before = sorted(p.name for p in other.iterdir())
    assert cli_main(["analyze", str(runs["gba"]), "--out", str(other), "--quiet"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"gbattn: error: --out {other} holds a run, not a folder of figures: choose another --out"]
    assert sorted(p.name for p in other.iterdir()) == before


def test_analyze_of_a_file_names_the_file_not_an_out_never_given(tmp_path, capsys):
    """`analyze RUN/best.pt` (a file for the run directory) said "--out RUN/best.pt/analysis: RUN/best.pt is a
    file", blaming an --out the user never gave: the run directory is checked before its default --out is made."""
    weights = tmp_path / "best.pt"
    weights.write_bytes(b"x")
    assert cli_main(["analyze", str(weights), "--quiet"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"gbattn: error: {weights} is not a directory (a gbattn run directory or an exported one is expected)"]


def test_against_with_another_tokenizer_or_seq_len_is_one_line(runs, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(runs["std"], other)
    tok = json.loads((other / "tokenizer.json").read_text())
    payload = json.loads(tok["payload"])
    payload["chars"] = payload["chars"][::-1]  # same size, different tokenizer
    tok["payload"] = json.dumps(payload)
    give_run_tokenizer(other, tok)
    code = cli_main(["analyze", str(runs["gba"]), "--against", str(other), "--out", str(tmp_path / "a"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "tokenizer" in err and "--against" in err

    shutil.copy(runs["std"] / "tokenizer.json", other / "tokenizer.json")
    config = json.loads((runs["std"] / "config.json").read_text())
    config["seq_len"] = SEQ_LEN // 2
    (other / "config.json").write_text(json.dumps(config))
    code = cli_main(["analyze", str(runs["gba"]), "--against", str(other), "--out", str(tmp_path / "a"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "seq_len" in err
    assert not (tmp_path / "a").exists()


def test_bad_layer_is_one_line(runs, tmp_path, capsys):
    """The model has two layers: 0, 1 or -1, -2; 2 (one past the last) and -3 are refused like 7."""
    for layer in ("7", "2", "-3"):
        code = cli_main(["analyze", str(runs["gba"]), "--against", str(runs["std"]), "--layer", layer,
                         "--out", str(tmp_path / "a"), "--quiet"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and err.endswith(
            f"--layer {layer}: the model has 2 layers (use 0..1, or -1 for the last)"), err


def test_options_of_the_gains_over_against_are_refused_without_it(runs, tmp_path, capsys):
    """--layer, --top and --examples only shape the per-token gains over --against: without it they were taken
    and changed nothing. Now one line names them and --against, before anything is loaded or written."""
    for flags, expected in ((["--layer", "0"], "--layer goes with --against STANDARD_RUN_DIR"),
                            (["--top", "5", "--examples", "1"], "--top and --examples go with --against "),
                            (["--examples", "3"], "--examples goes with --against "),
                            (["--examples", "3", "--top", "1", "--layer", "1"], "--layer, --top and --examples go ")):
        code = cli_main(["analyze", str(runs["gba"]), *flags, "--out", str(tmp_path / "a"), "--quiet"])
        err = capsys.readouterr().err
        assert (code, len(err.splitlines())) == (2, 1) and err.startswith(f"gbattn: error: {expected}"), err
    assert not (tmp_path / "a").exists()


def test_no_rows_to_analyse_is_refused(runs, tmp_path, capsys):
    """max_rows 0 (the Python call; the command line refuses it itself) and a test split shorter than one
    row are UserErrors (the split: one line, exit status 2), not an empty analysis or a traceback."""
    with pytest.raises(UserError, match=r"--max-rows \(0\) and --batch-size \(8\) must be >= 1"):
        analyze_run(runs["std"], out=tmp_path / "a", max_rows=0, device="cpu", quiet=True)
    with pytest.raises(UserError, match=r"--max-rows \(64\) and --batch-size \(0\) must be >= 1"):
        analyze_run(runs["std"], out=tmp_path / "a", batch_size=0, device="cpu", quiet=True)
    # and, before any model is loaded, a negative --top or --examples (-1 listed every token that gained) and a
    # split other than valid or test (KeyError: 'bogus', after loading the run and its data)
    with pytest.raises(UserError, match=r"--top \(-1\) and --examples \(3\) must be >= 0"):
        analyze_run(runs["std"], out=tmp_path / "a", top=-1, device="cpu", quiet=True)
    with pytest.raises(UserError, match=r"--top \(20\) and --examples \(-1\) must be >= 0"):
        analyze_run(runs["std"], out=tmp_path / "a", examples=-1, device="cpu", quiet=True)
    with pytest.raises(UserError, match=r"split='bogus' is not allowed; choose one of valid, test"):
        analyze_run(runs["std"], out=tmp_path / "a", split="bogus", device="cpu", quiet=True)
    short = tmp_path / "short"
    shutil.copytree(runs["data"], short)
    (short / "wiki.test.tokens").write_text("the cat .\n")
    code = cli_main(["analyze", str(runs["std"]), "--data", str(short), "--allow-other-data", "--out",
                     str(tmp_path / "a"), "--quiet", "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    # the data it names is --data's (it named the run's folder, as if the run's own data were short)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert (f"the test split of --data {short} has 10 tokens: fewer than one row of 33, so there is nothing to "
            f"analyze") in err, err


def test_missing_matplotlib_says_how_to_install(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    with pytest.raises(UserError, match=r"pip install 'gbattn\[plot\]'"):
        require_matplotlib()


# ---- pure statistics ---------------------------------------------------------------------


def test_uniform_attention_has_normalised_entropy_one_and_bound_log_t_plus_1():
    T = 6
    p_BHTS = torch.ones(1, 1, T, T).tril()
    p_BHTS = p_BHTS / p_BHTS.sum(-1, keepdim=True)
    ent_BHT = -(p_BHTS * torch.log(p_BHTS.clamp_min(1e-30))).sum(-1)
    torch.testing.assert_close(ent_BHT[0, 0].double(), stats.entropy_bound(T))
    norm = stats.normalised_entropy(ent_BHT)
    assert torch.isnan(norm[..., 0]).all()
    torch.testing.assert_close(norm[..., 1:], torch.ones(1, 1, T - 1))
    # position 0 has no normalised entropy even where rounding leaves a trace of entropy there (not inf)
    assert torch.isnan(stats.normalised_entropy(torch.full((1, 1, 2), 1e-7))[..., 0]).all()


def test_tie_fractions_are_counted_so_none_is_negative():
    """75 tokens better and 213 worse of 288: no tie, exactly 0 (1 - 75/288 - 213/288 is -1.1e-16, which
    summary.json stored and the terminal printed as "-0%"); a difference of exactly TIE_NATS is a tie."""
    diff = np.array([1.0] * 75 + [-1.0] * 213)
    assert stats.tie_fractions(diff) == (75 / 288, 213 / 288, 0.0)
    diff[:3] = [stats.TIE_NATS, -stats.TIE_NATS, 0.0]
    assert stats.tie_fractions(diff) == (72 / 288, 213 / 288, 3 / 288)


def test_top_gains_and_row_selection():
    diff = np.array([[0.0, 5.0, 1.0], [4.0, 3.0, 2.0]])
    assert stats.top_gains(diff, 3) == [(0, 1), (1, 0), (1, 1)]
    assert stats.top_gains(diff, 3, min_position=1, one_per_row=True) == [(0, 1), (1, 1)]
    # more asked for than there are positions >= min_position: only those, never an excluded one
    assert stats.top_gains(diff, 5, min_position=2) == [(1, 2), (0, 2)]
    assert select_rows(10, 4).tolist() == [0, 3, 6, 9] and select_rows(3, 64).tolist() == [0, 1, 2]
    assert select_rows(11, 4).tolist() == [0, 3, 7, 10]  # 0, 3.33, 6.67, 10 to the nearest row


def test_top_gains_breaks_ties_by_row_then_position():
    """Equal gains are listed in reading order (earlier row, then earlier position), the same on every
    call: an unstable sort of a few dozen tied values put them in another order."""
    diff_NT = np.random.default_rng(0).integers(0, 3, size=(3, 20)).astype(np.float64)
    by_hand = sorted(np.ndindex(*diff_NT.shape), key=lambda rt: (-diff_NT[rt], rt))
    assert stats.top_gains(diff_NT, 25) == [(int(r), int(t)) for r, t in by_hand[:25]]


# ---- gbattn plot -------------------------------------------------------------------------


def test_plot_compare_dir_from_results_and_metrics_only(tmp_path, monkeypatch, capsys, one_thread):
    from gbattn import rundir as ckpt
    from gbattn.experiments.compare import run_compare

    data = write_corpus(tmp_path / "c")
    sets = dict(TINY, max_steps=4, eval_every=2, tokenizer="char", batch_size=8, seq_len=32, train_tokens=None,
                eval_tokens=None, warmup_steps=1, threads=1)
    cmp_dir = tmp_path / "cmp"
    run_compare("cpu-proxy", cmp_dir, data=str(data), seeds=[1, 2], sets=sets, only=["standard", "gba-m2"], quiet=True)

    # No model or checkpoint is read: only results.json and metrics.jsonl.
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("plot loaded a checkpoint"))
    monkeypatch.setattr(ckpt, "load_checkpoint", lambda *a, **k: pytest.fail("plot loaded a checkpoint"))
    assert cli_main(["plot", str(cmp_dir), "--pdf"]) == 0
    assert "figures:" in capsys.readouterr().out
    for name in ("results", "curves"):
        assert_png(cmp_dir / "figures" / f"{name}.png")
        assert (cmp_dir / "figures" / f"{name}.pdf").stat().st_size > 0

    # Published numbers (when results.json has them) are drawn as markers.
    report = json.loads((cmp_dir / "results.json").read_text())
    report["models"][0]["published"] = [report["models"][0]["test_ppl_mean"] * 1.01, 0.1]
    report["published_source"] = "a test"
    (cmp_dir / "results.json").write_text(json.dumps(report))
    written = plot_compare(cmp_dir, tmp_path / "figs")
    assert [p.name for p in written] == ["results.png", "curves.png"]
    for p in written:
        assert_png(p)


def test_plot_needs_a_compare_directory(tmp_path, capsys):
    assert cli_main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "results.json" in err


def test_analyze_handles_any_number_of_rounds(tmp_path, monkeypatch):
    """Six rounds (more than the eight colours' first four, where the old figures indexed past their
    colour list): every figure is drawn, with one entropy curve and one gate row per round."""
    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "corpus")
    sets = {**SHORT, "attn.rounds": 6, "max_steps": 2, "eval_every": 2}
    train(tmp_path / "m6", *tiny_configs(data, "boosted", **sets), quiet=True)
    summary = analyze_run(tmp_path / "m6", out=tmp_path / "a", max_rows=2, device="cpu", quiet=True)
    assert summary["rounds"] == 6 and len(summary["gates"]["per_layer"]) == TINY["n_layers"] * 5
    assert len(summary["entropy"]["mean_per_round"]) == 6
    for name in ("gates", "entropy", "norms"):
        assert_png(tmp_path / "a" / f"{name}.png")


@pytest.mark.parametrize("layers", [[0], [1]])
def test_analyze_gba_in_some_layers_only(tmp_path, monkeypatch, layers):
    """GBA in one of two layers (attn.layers): each layer lists its own rounds, gates and norms exist
    for the corrected layer only, and the round-1 means and the relative drop are that layer's
    (the accumulators were sized by layer 0 and broke either way)."""
    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "corpus")
    sets = {**SHORT, "attn.layers": layers, "max_steps": 2, "eval_every": 2}
    train(tmp_path / "run", *tiny_configs(data, "boosted", **sets), quiet=True)
    s = analyze_run(tmp_path / "run", out=tmp_path / "a", max_rows=2, device="cpu", quiet=True)
    (boosted,) = layers
    e = s["entropy"]
    assert [len(r["mean_per_round"]) for r in e["per_layer"]] == [2 if li == boosted else 1 for li in range(2)]
    assert e["layers_per_round"] == [2, 1]
    assert e["mean_per_round"][1] == pytest.approx(e["per_layer"][boosted]["mean_per_round"][1])
    assert e["mean_per_round"][0] == pytest.approx(np.mean([r["mean_per_round"][0] for r in e["per_layer"]]))
    assert e["relative_drop"] == pytest.approx(e["per_layer"][boosted]["relative_drop"])
    assert [r["layer"] for r in s["gates"]["per_layer"]] == [boosted] == [r["layer"] for r in s["norms"]["per_layer"]]
    # mean_per_layer lists the corrected layers only: it names them (its [0] read as layer 0's beside the paper's)
    assert s["gates"]["mean_per_layer_layers"] == [boosted] and len(s["gates"]["mean_per_layer"]) == 1
    for name in ("gates", "entropy", "norms"):
        assert_png(tmp_path / "a" / f"{name}.png")


def test_analyze_calls_the_paper_gates_its_own_models_beside_another_depth_or_gate(tmp_path, monkeypatch, capsys,
                                                                                     drawn):
    """GBA in the first 4 of 8 layers, or a 4-layer run with the scalar gate: the paper's per-layer gate means are
    its own 4-layer linear-gate model's, not this run's, and analyze's printout and gates figure call them so (given
    no depth, or no attention options, the label took such a run for the paper's shape: plain "paper")."""
    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "corpus")
    for name, sets in (("deep", {"n_layers": 8, "attn.layers": [0, 1, 2, 3]}),
                       ("scalar", {"n_layers": 4, "attn.gate": "scalar"})):
        train(tmp_path / name, *tiny_configs(data, "boosted", **{**SHORT, "max_steps": 2, "eval_every": 2, **sets}),
              quiet=True)
        out = tmp_path / f"{name}-analysis"
        assert cli_main(["analyze", str(tmp_path / name), "--out", str(out), "--max-rows", "2", "--quiet",
                         "--device", "cpu"]) == 0
        printed = capsys.readouterr().out
        assert "    paper (its 4-layer M=2 model): 0.35 / 0.48 / 0.41 / 0.43 (revision" in printed, (name, printed)
        labels = {line.get_label() for line in drawn["gates"].axes[1].get_lines()}
        assert "paper (its 4-layer M=2 model)" in labels and "paper" not in labels, (name, labels)


def test_analyze_differential_counts_its_half_as_many_maps(tmp_path, monkeypatch):
    """Differential attention records H/2 maps per round: per-head entropies come in H/2 (they were
    broadcast onto H, or failed for H > 2), and the mean is over those maps; the model still has H heads."""
    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "corpus")
    sets = {**SHORT, "n_heads": 4, "max_steps": 2, "eval_every": 2}
    train(tmp_path / "run", *tiny_configs(data, "differential", **sets), quiet=True)
    s = analyze_run(tmp_path / "run", out=tmp_path / "a", max_rows=2, device="cpu", quiet=True)
    for row in s["entropy"]["per_layer"]:
        assert np.asarray(row["per_head"]).shape == (1, 2)
        assert row["mean_per_round"][0] == pytest.approx(np.mean(row["per_head"][0]))
    assert not s["gates"]["available"] and s["n_heads"] == 4
    # The summary itself says per_head lists 2 maps, not the n_heads 4 beside it (it did not say so).
    assert s["entropy"]["maps_per_round"] == 2 and "one per head pair" in s["entropy"]["per_head_definition"]
    # Its round-0 entropy is of the first softmax map only: the reason says so (it read like any run's).
    assert "the entropy of each head's first map, softmax(Q1 K1^T)" in s["gates"]["reason"]


def test_a_short_run_draws_examples_from_a_quarter_of_its_row_into_its_own_analysis_folder(tmp_path, monkeypatch):
    """seq_len 16: the examples start at position 16 // 4 = 4 (fewer than 8), and without --out
    everything goes to RUN_DIR/analysis; --examples 0 writes no examples figure."""
    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "corpus")
    train(tmp_path / "run", *tiny_configs(data, "standard", **{**SHORT, "block_size": 17, "max_steps": 2,
                                                                "eval_every": 2}), quiet=True)
    s = analyze_run(tmp_path / "run", against=tmp_path / "run", max_rows=2, top=0, examples=1, device="cpu",
                    quiet=True)
    assert s["seq_len"] == 16 and s["loss_diff"]["examples"]["min_position"] == 4
    assert json.loads((tmp_path / "run" / "analysis" / "summary.json").read_text())["row_ids"] == s["row_ids"]
    assert_png(tmp_path / "run" / "analysis" / "examples.png")
    s = analyze_run(tmp_path / "run", against=tmp_path / "run", out=tmp_path / "none", max_rows=2, top=0, examples=0,
                    device="cpu", quiet=True)
    assert s["loss_diff"]["examples"]["positions"] == [] and (tmp_path / "none" / "loss_diff.png").is_file()
    assert not (tmp_path / "none" / "examples.png").exists()  # --examples 0 draws no empty figure


def test_example_positions_skip_the_first_tokens(runs, tmp_path):
    """The example figure draws positions with some context: at least min(8, seq_len // 4), one per row,
    the largest gains there."""
    summary = analyze_run(runs["gba"], against=runs["std"], out=tmp_path / "a", max_rows=8, examples=4,
                          device="cpu", quiet=True)
    examples = summary["loss_diff"]["examples"]
    assert examples["min_position"] == min(8, SEQ_LEN // 4) > 0
    rows = [ex["row"] for ex in examples["positions"]]
    assert len(rows) == len(set(rows)) == 4
    assert all(ex["position"] >= examples["min_position"] for ex in examples["positions"])
    diff_NT = np.asarray(token_losses(runs["std"], summary["row_ids"]) - token_losses(runs["gba"], summary["row_ids"]))
    index = {r: i for i, r in enumerate(summary["row_ids"])}
    picked = [(index[ex["row"]], ex["position"]) for ex in examples["positions"]]
    assert picked == stats.top_gains(diff_NT, 4, min_position=examples["min_position"], one_per_row=True)


def test_summaries_of_hand_made_records():
    """Uniform causal attention (entropy log(t+1) at position t) has normalised entropy exactly 1,
    the histogram spans 0 .. log(T) nats, and mean_per_layer (the paper's g_1 per layer) holds the
    first correction's gate of each layer even with three rounds."""
    B, H, T, D, L = 2, 3, 7, 4, 2
    uniform_BHT = stats.entropy_bound(T).expand(B, H, T).clone()
    zeros_BTD = torch.zeros(B, T, D, dtype=torch.float64)

    def correction(gate):
        return (torch.ones(B, T, D, dtype=torch.float64), zeros_BTD, torch.full((B, T, D), gate, dtype=torch.float64))

    samples = [stats.LayerSample(entropies=[uniform_BHT] * 3, attention_output=zeros_BTD,
                                 corrections=[correction(0.2 + li / 10), correction(0.9)]) for li in range(L)]
    acc = stats.IntermediateStats(L, H, D, T)
    acc.update(samples)
    e = acc.entropy_summary()
    assert e["normalised_mean_per_round"] == pytest.approx([1.0] * 3)
    # the fewest entries that have one: one row, one head, 2 positions (position 0 has no normalised entropy)
    single = stats.IntermediateStats(1, 1, D, 2)
    single.update([stats.LayerSample(entropies=[stats.entropy_bound(2).expand(1, 1, 2).clone()],
                                     attention_output=torch.zeros(1, 2, D, dtype=torch.float64), corrections=[])])
    assert single.entropy_summary()["normalised_mean_per_round"] == pytest.approx([1.0])
    assert e["histogram"]["edges"][0] == 0.0 and e["histogram"]["edges"][-1] == pytest.approx(math.log(T))
    # the edges bound every bin: one more than the counts of a round
    assert len(e["histogram"]["edges"]) == len(e["histogram"]["counts_per_round"][0]) + 1 == stats.ENTROPY_BINS + 1
    gates = acc.gate_summary()
    assert gates["mean_per_layer"] == pytest.approx([0.2, 0.3])
    assert [(r["layer"], r["round"]) for r in gates["per_layer"]] == [(0, 1), (0, 2), (1, 1), (1, 2)]


def test_hand_made_summaries_give_the_std_profile_gate_range_and_every_norm():
    """On random hand-made records: each layer's entropy std per round (over rows, heads and
    queries; not the variance), the per-position mean (over layers, rows and heads), the gates'
    min, max and the spread of their dimension means, and the norms of x = r_1 + F_0, F_0 and c."""
    B, H, T, D, L = 2, 3, 5, 4, 2
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, dtype=torch.float64)

    ent = [[rand(B, H, T) * math.log(T) for _ in range(2)] for _ in range(L)]
    f0 = [rand(B, T, D) for _ in range(L)]
    corr = [(rand(B, T, D) - 0.5, rand(B, T, D) - 0.5, rand(B, T, D)) for _ in range(L)]  # (c, r, g)
    acc = stats.IntermediateStats(L, H, D, T)
    acc.update([stats.LayerSample(entropies=ent[li], attention_output=f0[li], corrections=[corr[li]])
                for li in range(L)])
    e, gates, norms = acc.entropy_summary(), acc.gate_summary(), acc.norm_summary()
    for li in range(L):
        assert e["per_layer"][li]["std_per_round"] == pytest.approx([ent[li][m].std(unbiased=False).item()
                                                                    for m in range(2)])
    profile_MT = torch.stack([torch.stack(ent[li]) for li in range(L)]).mean(dim=(0, 2, 3))
    np.testing.assert_allclose(e["per_position_mean"], profile_MT.numpy())
    all_gates = torch.stack([g for _, _, g in corr])
    assert (gates["min"], gates["max"]) == (all_gates.min().item(), all_gates.max().item())
    for li, (c, r, g) in enumerate(corr):
        assert gates["per_layer"][li]["std_of_dimension_means"] == pytest.approx(g.mean(dim=(0, 1)).std().item())
        row = norms["per_layer"][li]
        assert row["x"] == pytest.approx((r + f0[li]).norm(dim=-1).mean().item())
        assert row["round0_output"] == pytest.approx(f0[li].norm(dim=-1).mean().item())
        assert row["correction"] == pytest.approx(c.norm(dim=-1).mean().item())


def test_every_round_of_a_three_round_layer_reports_the_same_input_x():
    """M = 3: x = r_1 + F_0 is the sublayer input, the same for both correction rounds; the second round's
    residual r_2 = r_1 - g_1 c_1 is another vector, so x taken from it (r_2 + F_0) would be wrong."""
    B, H, T, D = 2, 2, 4, 3
    gen = torch.Generator().manual_seed(1)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, dtype=torch.float64)

    f0, r1, c1, g1, c2, g2 = rand(B, T, D), rand(B, T, D), rand(B, T, D), rand(B, T, D), rand(B, T, D), rand(B, T, D)
    r2 = r1 - g1 * c1
    ent = [rand(B, H, T) for _ in range(3)]
    acc = stats.IntermediateStats(1, H, D, T)
    acc.update([stats.LayerSample(entropies=ent, attention_output=f0, corrections=[(c1, r1, g1), (c2, r2, g2)])])
    first, second = acc.norm_summary()["per_layer"]
    assert (first["round"], second["round"]) == (1, 2)
    x_norm = (r1 + f0).norm(dim=-1).mean().item()
    assert first["x"] == pytest.approx(x_norm) and second["x"] == pytest.approx(x_norm)
    assert second["residual"] == pytest.approx(r2.norm(dim=-1).mean().item())
    assert first["residual_after"] == pytest.approx(second["residual"])
    assert second["residual_after"] == pytest.approx((r2 - g2 * c2).norm(dim=-1).mean().item())


def test_a_round_only_some_layers_have_is_averaged_over_those_layers_and_counts_in_the_largest_entropy():
    """GBA in layer 0 only: the correction round's position profile is layer 0's own (not diluted by the
    layer without it), and the largest entropy observed may be a correction round's."""
    B, H, T, D = 1, 2, 4, 2
    round0_BHT = torch.full((B, H, T), 0.5, dtype=torch.float64)
    round1_BHT = torch.tensor([0.2, 0.4, 0.6, 0.8], dtype=torch.float64).expand(B, H, T).clone()
    ones_BTD = torch.ones(B, T, D, dtype=torch.float64)
    acc = stats.IntermediateStats(2, H, D, T)
    acc.update([stats.LayerSample(entropies=[round0_BHT, round1_BHT], attention_output=ones_BTD,
                                  corrections=[(ones_BTD, ones_BTD, 0.5 * ones_BTD)]),
                stats.LayerSample(entropies=[round0_BHT], attention_output=ones_BTD, corrections=[])])
    e = acc.entropy_summary()
    assert e["layers_per_round"] == [2, 1]
    assert e["mean_per_round"] == pytest.approx([0.5, 0.5])  # round 1: layer 0's mean, not halved by layer 1
    assert e["relative_drop"] == pytest.approx(0.0)  # over the layer with a correction only
    np.testing.assert_allclose(e["per_position_mean"], [[0.5] * T, [0.2, 0.4, 0.6, 0.8]])
    assert e["max_observed"] == pytest.approx(0.8)


def test_the_relative_drop_compares_round_1_with_round_0_of_the_corrected_layers_only():
    """Layer 0 corrected (round 0 at 0.5 nats, round 1 at 0.25), layer 1 not (round 0 at 1.5): the drop is
    1 - 0.25 / 0.5 = 0.5, not 1 - 0.25 / 1.0 over both layers' round 0."""
    B, H, T, D = 1, 2, 4, 2
    full = lambda value: torch.full((B, H, T), value, dtype=torch.float64)  # noqa: E731
    ones_BTD = torch.ones(B, T, D, dtype=torch.float64)
    acc = stats.IntermediateStats(2, H, D, T)
    acc.update([stats.LayerSample(entropies=[full(0.5), full(0.25)], attention_output=ones_BTD,
                                  corrections=[(ones_BTD, ones_BTD, 0.5 * ones_BTD)]),
                stats.LayerSample(entropies=[full(1.5)], attention_output=ones_BTD, corrections=[])])
    e = acc.entropy_summary()
    assert e["mean_per_round"] == pytest.approx([1.0, 0.25])
    assert e["relative_drop"] == pytest.approx(0.5) == e["per_layer"][0]["relative_drop"]


def test_gba_in_a_later_layer_only_sizes_the_rounds_by_the_layer_with_the_most():
    """GBA in layer 1 only, layer 0 without: the statistics have two rounds (the most any layer has, not layer 0's
    one), round 1 is over layer 1 alone, and the gates are layer 1's."""
    B, H, T, D = 1, 2, 4, 2
    round0_BHT = torch.full((B, H, T), 0.5, dtype=torch.float64)
    round1_BHT = torch.full((B, H, T), 0.25, dtype=torch.float64)
    ones_BTD = torch.ones(B, T, D, dtype=torch.float64)
    acc = stats.IntermediateStats(2, H, D, T)
    acc.update([stats.LayerSample(entropies=[round0_BHT], attention_output=ones_BTD, corrections=[]),
                stats.LayerSample(entropies=[round0_BHT, round1_BHT], attention_output=ones_BTD,
                                  corrections=[(ones_BTD, ones_BTD, 0.5 * ones_BTD)])])
    e = acc.entropy_summary()
    assert acc.rounds == 2 and e["layers_per_round"] == [2, 1]
    assert e["mean_per_round"] == pytest.approx([0.5, 0.25]) and e["relative_drop"] == pytest.approx(0.5)
    assert acc.gate_summary()["mean_per_layer_layers"] == [1]


def test_per_head_entropy_is_each_maps_own_mean_and_the_maps_are_counted_from_the_records():
    """per_head holds each map's mean entropy over rows and positions (not divided by the number of maps again),
    and the number of maps per round is what the records hold (differential attention records n_heads / 2), not
    the n_heads the statistics were built with."""
    B, T, D = 2, 3, 2
    ent_BHT = torch.tensor([[[0.1, 0.2, 0.3], [0.6, 0.8, 1.0]]] * B, dtype=torch.float64)  # 2 maps
    acc = stats.IntermediateStats(1, 4, D, T)  # built with 4 heads, recorded with 2 maps
    acc.update([stats.LayerSample(entropies=[ent_BHT], attention_output=torch.zeros(B, T, D, dtype=torch.float64),
                                  corrections=[])])
    e = acc.entropy_summary()
    assert e["maps_per_round"] == 2
    assert e["per_layer"][0]["per_head"] == [pytest.approx([0.2, 0.8])]
    assert e["mean_per_round"] == pytest.approx([0.5])


def test_each_corrected_layers_relative_drop_is_its_first_correction_against_round_0():
    """A layer's relative_drop is 1 - round 1 / round 0, also in a layer of three rounds (not its last round),
    and a layer with a single correction has one too."""
    B, H, T, D = 1, 1, 3, 2

    def ent(value):
        return torch.full((B, H, T), value, dtype=torch.float64)

    ones_BTD = torch.ones(B, T, D, dtype=torch.float64)
    correction = (ones_BTD, ones_BTD, 0.5 * ones_BTD)
    acc = stats.IntermediateStats(2, H, D, T)
    acc.update([stats.LayerSample(entropies=[ent(1.0), ent(0.5), ent(0.25)], attention_output=ones_BTD,
                                  corrections=[correction, correction]),
                stats.LayerSample(entropies=[ent(2.0), ent(1.5)], attention_output=ones_BTD, corrections=[correction])])
    per_layer = acc.entropy_summary()["per_layer"]
    assert [r.get("relative_drop") for r in per_layer] == [pytest.approx(0.5), pytest.approx(0.25)]


def test_statistics_add_up_over_batches_with_exact_histograms_and_gate_range():
    """Two batches of one row each (T = 4, bins of log(4) / 60 nats): round 0 at 1.2 nats then 1.0, round 1
    at 0.1, in both layers. Means, the largest entropy and the bin counts are over both batches (and
    each round's counts stay its own); the gate's minimum (0.1, layer 0's first batch) and each
    dimension's mean too, and |g*c| / |r| is the ratio of the norms (r = (3, 4), |r| = 5)."""
    L, H, D, T = 2, 2, 2, 4

    def sample(round0, low_gate):
        ent = [torch.full((1, H, T), round0, dtype=torch.float64), torch.full((1, H, T), 0.1, dtype=torch.float64)]
        r_BTD = torch.tensor([3.0, 4.0], dtype=torch.float64).expand(1, T, D)
        g_BTD = torch.tensor([low_gate, 0.5], dtype=torch.float64).expand(1, T, D)
        return stats.LayerSample(entropies=ent, attention_output=torch.zeros(1, T, D, dtype=torch.float64),
                                 corrections=[(torch.ones(1, T, D, dtype=torch.float64), r_BTD, g_BTD)])

    acc = stats.IntermediateStats(L, H, D, T)
    acc.update([sample(1.2, 0.1), sample(1.2, 0.3)])
    acc.update([sample(1.0, 0.3), sample(1.0, 0.3)])
    e = acc.entropy_summary()
    assert e["mean_per_round"] == pytest.approx([1.1, 0.1]) and e["max_observed"] == pytest.approx(1.2)
    for row in e["per_layer"]:
        assert row["mean_per_round"] == pytest.approx([1.1, 0.1])
    # 1.2 / (log(4) / 60) = 51.9, 1.0 -> 43.3, 0.1 -> 4.3: bins 51, 43 and 4.
    per_layer = np.zeros((2, 60))
    per_layer[0, 43] = per_layer[0, 51] = 8  # a batch's queries: 1 row x 2 heads x 4 positions
    per_layer[1, 4] = 16
    np.testing.assert_array_equal(e["histogram"]["counts_per_round"], 2 * per_layer)
    for row in e["per_layer"]:
        np.testing.assert_array_equal(row["histogram_counts_per_round"], per_layer)
    gates = acc.gate_summary()
    assert (gates["min"], gates["max"]) == (pytest.approx(0.1), 0.5)
    layer0, layer1 = gates["per_layer"]
    assert layer0["per_dimension"] == pytest.approx([0.2, 0.5]) and layer1["per_dimension"] == pytest.approx([0.3, 0.5])
    assert (layer0["dimension_mean_min"], layer0["dimension_mean_max"]) == pytest.approx((0.2, 0.5))
    assert layer0["mean"] == pytest.approx(0.35) and layer1["mean"] == pytest.approx(0.4)
    # the std over every (token, dimension) entry: layer 0's entries are 0.1, 0.5, 0.3, 0.5 equally often
    assert layer0["std"] == pytest.approx(torch.tensor([0.1, 0.5, 0.3, 0.5]).std(unbiased=False).item())
    with pytest.raises(ValueError, match="rows of 3 positions, expected 4"):
        acc.update([stats.LayerSample(entropies=[e[:, :, :3] for e in s.entropies], attention_output=s.attention_output,
                                      corrections=s.corrections) for s in [sample(1.0, 0.3)] * 2])
    norms = acc.norm_summary()["per_layer"][1]
    assert norms["residual"] == pytest.approx(5.0) and norms["gated_correction"] == pytest.approx(math.sqrt(0.34))
    assert norms["gated_over_residual"] == pytest.approx(math.sqrt(0.34) / 5)


@pytest.mark.parametrize("low, high", [(0.6, 0.8), (-0.4, -0.2)])
def test_the_gate_range_is_the_gates_own_wherever_they_lie(low, high):
    """The smallest and largest gate value are those of the gates seen, also when every gate lies above 0.5 or
    below 0 (a tanh gate): no starting value of the running minimum or maximum shows through."""
    T, D = 2, 2
    g_BTD = torch.tensor([low, high], dtype=torch.float64).expand(1, T, D)
    one_BTD = torch.ones(1, T, D, dtype=torch.float64)
    acc = stats.IntermediateStats(1, 1, D, T)
    ent_BHT = torch.full((1, 1, T), 0.5, dtype=torch.float64)
    acc.update([stats.LayerSample(entropies=[ent_BHT, ent_BHT], attention_output=one_BTD,
                                  corrections=[(one_BTD, one_BTD, g_BTD)])])
    gates = acc.gate_summary()
    assert (gates["min"], gates["max"]) == (low, high)


def test_a_three_round_layer_is_listed_once_among_the_first_gates_layers():
    """mean_per_layer holds each layer's first gate g_1, and mean_per_layer_layers names those layers: a layer
    with two corrections is one entry in each, not one per correction."""
    T, D = 2, 1
    one_BTD = torch.ones(1, T, D, dtype=torch.float64)
    ent_BHT = torch.full((1, 1, T), 0.5, dtype=torch.float64)
    acc = stats.IntermediateStats(1, 1, D, T)
    acc.update([stats.LayerSample(entropies=[ent_BHT] * 3, attention_output=one_BTD,
                                  corrections=[(one_BTD, one_BTD, 0.25 * one_BTD),
                                               (one_BTD, one_BTD, 0.75 * one_BTD)])])
    gates = acc.gate_summary()
    assert gates["mean_per_layer"] == [0.25] and gates["mean_per_layer_layers"] == [0]


def test_the_gated_correction_over_a_residual_below_1_is_their_ratio():
    """gated_over_residual is |g*c| / |r| whatever the scale of r: a residual of norm 0.5 doubles the ratio."""
    T, D = 2, 2
    r_BTD = torch.tensor([0.3, 0.4], dtype=torch.float64).expand(1, T, D)  # |r| = 0.5
    c_BTD = torch.tensor([0.2, 0.0], dtype=torch.float64).expand(1, T, D)
    one_BTD = torch.ones(1, T, D, dtype=torch.float64)
    ent_BHT = torch.full((1, 1, T), 0.5, dtype=torch.float64)
    acc = stats.IntermediateStats(1, 1, D, T)
    acc.update([stats.LayerSample(entropies=[ent_BHT] * 2, attention_output=one_BTD,
                                  corrections=[(c_BTD, r_BTD, 0.5 * one_BTD)])])
    (row,) = acc.norm_summary()["per_layer"]
    assert row["residual"] == pytest.approx(0.5) and row["gated_over_residual"] == pytest.approx(0.1 / 0.5)


def test_entropy_histogram_counts_rounding_past_its_ends_in_the_end_bins():
    """A uniform row's entropy computed in float may come out a hair above log(T), a one-hot row's a hair
    below 0: each still counts, in the last or the first bin, so every query is in the histogram."""
    H, T = 2, 4
    ent_BHT = torch.tensor([-1e-12, 0.5, 1.0, math.log(T) + 1e-9], dtype=torch.float64).expand(1, H, T).clone()
    acc = stats.IntermediateStats(1, H, 2, T)
    acc.update([stats.LayerSample(entropies=[ent_BHT], attention_output=torch.zeros(1, T, 2, dtype=torch.float64),
                                  corrections=[])])
    (counts,) = acc.entropy_summary()["histogram"]["counts_per_round"]
    assert sum(counts) == H * T and counts[0] == H and counts[-1] == H


def test_a_sequence_of_one_position_counts_its_entropy_of_0_in_the_first_bin():
    """At seq_len 1 every entropy is 0: each query counts in the first bin, as an entropy of 0 does at any length,
    not in a middle one; the edges are the 0 .. 1 the counts were taken over (they were all 0: the figure divided by
    bins of no width, warned twice and drew an empty panel), and the normalised entropy, undefined at position 0,
    is null (it was 0.0)."""
    ent_BHT = torch.zeros(3, 2, 1, dtype=torch.float64)
    acc = stats.IntermediateStats(1, 2, 2, 1)
    acc.update([stats.LayerSample(entropies=[ent_BHT], attention_output=torch.zeros(3, 1, 2, dtype=torch.float64),
                                  corrections=[])])
    summary = acc.entropy_summary()
    (counts,) = summary["histogram"]["counts_per_round"]
    assert counts == [6.0] + [0.0] * (stats.ENTROPY_BINS - 1)
    assert summary["histogram"]["edges"] == np.linspace(0, 1, stats.ENTROPY_BINS + 1).tolist()
    assert math.isnan(summary["normalised_mean_per_round"][0]) and summary["max_possible"] == 0.0
    assert all(math.isnan(x) for x in summary["per_layer"][0]["normalised_mean_per_round"])
    from gbattn.analysis import figures

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = figures.entropy_figure(summary, None)
    assert "max log T = 0.00" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_a_batch_whose_layers_have_other_rounds_than_the_first_is_refused():
    """The running sums are shaped by the first batch's rounds per layer: a batch with more or fewer is an
    error, not a silent mix."""
    T = 3
    ent_BHT = torch.ones(1, 1, T, dtype=torch.float64)
    one_BTD = torch.ones(1, T, 2, dtype=torch.float64)
    acc = stats.IntermediateStats(1, 1, 2, T)
    acc.update([stats.LayerSample(entropies=[ent_BHT, ent_BHT], attention_output=one_BTD,
                                  corrections=[(one_BTD, one_BTD, one_BTD)])])
    with pytest.raises(ValueError, match=r"layers with \[1\] rounds, expected \[2\]"):
        acc.update([stats.LayerSample(entropies=[ent_BHT], attention_output=one_BTD, corrections=[])])


def test_a_post_ln_runs_norms_say_x_is_the_stream_not_ln1_of_it(tmp_path, monkeypatch):
    """A Post-LN block normalises after its sublayer, so its attention input x is the stream itself (layer 0's:
    the embeddings); summary.json said "after ln1" and "LayerNorm-scale inputs" for every run."""
    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "corpus")
    train(tmp_path / "run", *tiny_configs(data, "boosted", **{**SHORT, "norm": "post", "max_steps": 2}), quiet=True)
    norms = analyze_run(tmp_path / "run", out=tmp_path / "a", max_rows=2, device="cpu", quiet=True)["norms"]
    assert "after ln1" not in norms["definitions"]["x"] and "the residual stream itself" in norms["definitions"]["x"]
    assert "LayerNorm-scale" not in norms["units"]
    acc = stats.IntermediateStats(1, 1, 2, 3)  # Pre-LN (the default): as before
    acc.update([stats.LayerSample([torch.ones(1, 1, 3)] * 2, torch.ones(1, 3, 2), [(torch.ones(1, 3, 2),) * 3])])
    assert acc.norm_summary()["definitions"]["x"] == "attention sublayer input (after ln1)"


def test_a_one_dimensional_gate_has_no_spread_of_dimension_means():
    """d_model 1: one dimension mean, whose spread is 0 (a sample std of one value would be NaN in
    summary.json); from d_model 2 on, the spread is the sample std of the dimension means."""
    T = 3
    ent_BHT = stats.entropy_bound(T).expand(1, 1, T).clone()

    def gate_row(gate_D: list[float]) -> dict:
        one_BTD = torch.ones(1, T, len(gate_D), dtype=torch.float64)
        acc = stats.IntermediateStats(1, 1, len(gate_D), T)
        acc.update([stats.LayerSample(entropies=[ent_BHT, ent_BHT], attention_output=one_BTD,
                                      corrections=[(one_BTD, one_BTD, one_BTD * torch.tensor(gate_D))])])
        (row,) = acc.gate_summary()["per_layer"]
        return row

    row = gate_row([0.25])
    assert row["std_of_dimension_means"] == 0.0 and row["per_dimension"] == [0.25]
    row = gate_row([0.25, 0.75])  # the smallest width with a spread: |0.75 - 0.25| / sqrt(2)
    assert row["std_of_dimension_means"] == pytest.approx(0.5 / math.sqrt(2)) and row["per_dimension"] == [0.25, 0.75]


def test_collect_analyses_a_model_left_in_training_mode_without_dropout_and_leaves_its_modes():
    """A model handed over in training mode (dropout 0.5) is analysed in eval mode: the losses are the
    eval-mode model's, the same on every call."""
    from gbattn.config import ModelConfig
    from gbattn.model.gpt import GPT, lm_loss

    model = GPT(ModelConfig(vocab_size=11, block_size=8, d_model=16, n_layers=1, n_heads=2, dropout=0.5,
                            attn="boosted"))
    tokens = np.random.default_rng(0).integers(0, 11, size=4 * 9).astype(np.uint16)
    rows = np.arange(4)
    model.eval()
    x, y = rows_batch(tokens, 8, rows)
    with torch.no_grad():
        want = lm_loss(model(x), y, reduction="none").numpy()
    other = copy.deepcopy(model)
    model.train(), other.train()
    got = stats.collect(model, tokens, 8, rows, batch_size=2, against=other)
    np.testing.assert_allclose(got.loss_NT, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.against_loss_NT, want, rtol=1e-5, atol=1e-6)
    # and handed back as it came: each module's training flag (one block kept in eval mode stays so)
    model.blocks[0].eval()
    flags = [m.training for m in model.modules()]
    assert True in flags and False in flags
    stats.collect(model, tokens, 8, rows, batch_size=2, against=other)
    stats.attention_examples(model, tokens, 8, rows, [(0, 3)], 0)
    assert [m.training for m in model.modules()] == flags and other.training
    stats.collect(model, tokens, 8, rows, batch_size=2, against=model)  # (the second record was restored last: eval)
    assert [m.training for m in model.modules()] == flags
    # attention_examples of a model in training mode: the eval-mode maps, the same on every call (dropout 0.5 on the
    # probabilities drew other maps each time)
    model.eval()
    want = stats.attention_examples(model, tokens, 8, rows, [(1, 6)], 0)[0]["attention"]
    model.train()
    for _ in range(2):
        np.testing.assert_array_equal(stats.attention_examples(model, tokens, 8, rows, [(1, 6)], 0)[0]["attention"],
                                      want)


def test_loss_difference_std_is_the_spread_of_the_per_token_differences(runs, tmp_path):
    s = analyze_run(runs["gba"], against=runs["std"], out=tmp_path / "a", max_rows=4, top=1, examples=1,
                    device="cpu", quiet=True)
    diff_NT = token_losses(runs["std"], s["row_ids"]) - token_losses(runs["gba"], s["row_ids"])
    assert s["loss_diff"]["std"] == pytest.approx(diff_NT.std(unbiased=False).item(), rel=1e-3)


def test_analysis_shows_special_tokens_by_name(tmp_path):
    """WikiText writes unknown words as ``<unk>``, which the BPE encodes as its ``<unk>`` token: analysis
    shows that token (as a target, an example's token and in a context) by name, as decoded text does, and
    ``<pad>`` too, which decoded text leaves out."""
    from gbattn.analysis.cli import _context_text, _token_text

    tok = bpe_with_unknown_words(tmp_path / "c")
    ids = tok.encode("the <unk> mat")
    unk = ids[1]
    assert tok.decode([unk]) == "<unk>" and tok.decode([0]) == ""  # text: <pad> left out, <unk> shown
    assert _token_text(tok, unk) == "<unk>" and _token_text(tok, 0) == "<pad>"
    assert _context_text(tok, ids) == "the <unk> mat"


def test_a_context_is_its_last_24_tokens(tmp_path):
    """The context shown beside a top token is the 24 tokens before it (one character each here)."""
    from gbattn.analysis.cli import _context_text
    from gbattn.data.corpus import load_corpus
    from gbattn.data.tokenizer import get_tokenizer

    data = tmp_path / "c"
    data.mkdir()
    for split in ("train", "valid", "test"):
        (data / f"{split}.txt").write_text("the cat sat on the mat\n" * (20 if split == "train" else 10))
    tok = get_tokenizer("char", load_corpus(str(data)), verbose=False)
    assert _context_text(tok, tok.encode("one cat sat on the hot mat at noon then ate")) == "hot mat at noon then ate"


def test_one_row_of_one_position_reports_its_gate_and_no_relative_drop():
    """A sequence of length 1 (one query, one key, entropy 0): the gate's mean and std are its one value's,
    and the relative drop has no meaning (None)."""
    ent_BHT = torch.zeros(1, 1, 1, dtype=torch.float64)
    one_BTD = torch.ones(1, 1, 1, dtype=torch.float64)
    acc = stats.IntermediateStats(1, 1, 1, 1)
    acc.update([stats.LayerSample(entropies=[ent_BHT, ent_BHT], attention_output=one_BTD,
                                  corrections=[(one_BTD, one_BTD, 0.25 * one_BTD)])])
    (row,) = acc.gate_summary()["per_layer"]
    assert (row["mean"], row["std"]) == (0.25, 0.0)
    assert acc.entropy_summary()["relative_drop"] is None


def test_analyze_of_a_run_trained_in_bfloat16_says_its_loss_is_in_float32(tmp_path, capsys):
    """analyze scores in float32; `gbattn eval` in the run's own precision. For a run trained in bf16 the two losses
    differed in the 4th decimal over the same rows and nothing said why; the summary now names its precision and a
    note says how the run's own differs (none for a run trained in float32)."""
    data = write_corpus(tmp_path / "c")
    train(tmp_path / "bf16", *tiny_configs(data, amp="bf16", max_steps=2), quiet=True)
    s = analyze_run(tmp_path / "bf16", out=tmp_path / "a", max_rows=2, device="cpu", quiet=True)
    # (it said "the run trained in bfloat16": a run trained on a CPU with amp=auto and analysed on a GPU did not)
    note = ("the loss is in float32; `gbattn eval` on cpu scores the run in bfloat16 (its amp=bf16), so the two "
            "differ in the last digits")
    assert s["loss"]["precision"] == "float32" and s["notes"] == [note]
    assert f"note: {note}" in capsys.readouterr().out


def test_examples_title_says_gains_only_where_a_drawn_position_gains():
    """The examples figure said "Where GBA gains most over standard" when every drawn position had GBA worse:
    a run that loses everywhere is drawn where it loses least, and the title says that."""
    from gbattn.analysis.cli import _examples_title

    assert _examples_title("GBA", "standard", 3, [0.4, -0.1]).startswith("Where GBA gains most over standard: layer 3")
    losing = _examples_title("GBA", "standard", 3, [-0.2, 0.0])
    assert "gains most" not in losing and losing.startswith("GBA gains over standard nowhere; where it loses least")
