"""`gbattn denoise`: the synthetic pattern-denoising task (docs/method.md §9)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from gbattn.cli import main
from gbattn.errors import UserError
from gbattn.synthetic.models import EquilibriumDenoiser, FixedPointStats, PatternDenoiser, fixed_point
from gbattn.synthetic.tables import plot_rounds
from gbattn.synthetic.task import Protocol, Setting, bayes_optimal_accuracy, make_patterns, sample_queries
from gbattn.synthetic.training import EXPERIMENTS, RunSpec, boosted_run, denoise_loss, train_run

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bayes_optimal_antipodal_patterns_is_phi_of_one_over_sigma():
    # Patterns +e1 and -e1: the nearest one is right iff 1 + sigma * n_1 > 0, so accuracy = Phi(1 / sigma).
    patterns_KD = torch.tensor([[1.0, 0.0, 0.0], [-1.0, 0.0, 0.0]])
    for sigma in (0.5, 1.0, 2.0):
        accuracy, stderr = bayes_optimal_accuracy(patterns_KD, sigma, 200_000, seed=1)
        exact = 0.5 * (1 + math.erf(1 / sigma / math.sqrt(2)))
        assert abs(accuracy - exact) < 4 * stderr + 1e-4, (sigma, accuracy, exact)
        # the binomial standard error of a fraction of 200,000 queries (the tables' "± s.e." of the ceiling)
        assert stderr == pytest.approx(math.sqrt(accuracy * (1 - accuracy) / 200_000), rel=1e-9)


def test_bayes_optimal_limits():
    patterns_KD = make_patterns(Setting(16, 8, 0.0))
    assert bayes_optimal_accuracy(patterns_KD, 1e-3, 20_000)[0] == 1.0
    accuracy, stderr = bayes_optimal_accuracy(patterns_KD, 1e3, 100_000)
    assert abs(accuracy - 1 / 8) < 4 * stderr


def test_patterns_fixed_unit_norm():
    a, b = make_patterns(Setting(64, 16, 0.5)), make_patterns(Setting(64, 16, 0.8))
    assert torch.equal(a, b) and torch.allclose(a.norm(dim=-1), torch.ones(16))


def test_denoiser_equals_the_equations_written_out():
    """Three rounds with the mlp gate, against the task's equations written with explicit weights."""
    torch.manual_seed(0)
    d, K = 8, 5
    model = PatternDenoiser(d, rounds=3, gate="mlp").double()
    patterns_KD = make_patterns(Setting(d, K, 0.5)).double()
    query_BD = sample_queries(patterns_KD, 0.5, 4, torch.Generator().manual_seed(0))[0].double()
    W = model.qkv.weight
    beta = model.log_beta.exp()

    def attend(m, q_BD, k_KD, v_KD):
        probs = torch.softmax(beta[m] * q_BD @ k_KD.T, dim=-1)
        return probs @ v_KD, probs

    F, probs0 = attend(0, query_BD @ W[:d].T, patterns_KD @ W[d : 2 * d].T, patterns_KD @ W[2 * d : 3 * d].T)
    ent = -(probs0 * probs0.log()).sum(-1, keepdim=True)
    for m, corr in enumerate(model.corrections, start=1):
        lo = d + 2 * d * m
        c, _ = attend(m, (query_BD - F) @ corr.proj.weight.T, patterns_KD @ W[lo : lo + d].T,
                      patterns_KD @ W[lo + d : lo + 2 * d].T)
        net = corr.gate.net
        g = torch.sigmoid(net[2](torch.nn.functional.gelu(net[0](torch.cat([F, c, ent], -1)))))
        F = F + g * c
    out_BD, probs_BK = model(query_BD, patterns_KD)
    torch.testing.assert_close(out_BD, F)
    torch.testing.assert_close(probs_BK, probs0)
    # and the same gradients: every path of the equations (the gates' entropy input included) is trained
    params = list(model.parameters())
    for a, b in zip(torch.autograd.grad(out_BD.square().sum(), params), torch.autograd.grad(F.square().sum(), params)):
        torch.testing.assert_close(a, b)


def test_denoiser_initial_weights_are_the_published_tables_ones():
    """Seed 0's initial weights, pinned from the GBA layer the published denoise tables were measured
    with (before the task got its own model): the same draws in the same order."""
    torch.manual_seed(0)
    model = PatternDenoiser(16, rounds=2, gate="linear")
    sums = {n: round(float(p.detach().double().sum()), 9) for n, p in model.named_parameters()}
    assert sums == {"log_beta": 1.386294365, "qkv.weight": -3.061667293, "corrections.0.proj.weight": 0.478265882,
                    "corrections.0.gate.proj.weight": 1.320846456, "corrections.0.gate.proj.bias": 0.147056774}


def test_denoiser_gates_are_the_documented_ones():
    """docs/method.md §9's gates: mlp is Linear(2d+1 -> 32), GELU, Linear(32 -> d); scalar is sigmoid(a) with a
    at 0.5; none has no parameters. The synthetic model takes them from the GBA layer's defaults, which the
    equations test (any width, any activation of the same module) and the pinned linear-gate weights do not see."""
    mlp = PatternDenoiser(8, rounds=2, gate="mlp").corrections[0].gate.net
    assert {name: tuple(p.shape) for name, p in mlp.named_parameters()} == {
        "0.weight": (32, 17), "0.bias": (32,), "2.weight": (8, 32), "2.bias": (8,)}
    assert type(mlp[1]) is torch.nn.GELU and mlp[1].approximate == "none"
    scalar = PatternDenoiser(8, rounds=3, gate="scalar")
    assert [correction.gate.logit.tolist() for correction in scalar.corrections] == [[0.5], [0.5]]
    assert list(PatternDenoiser(8, rounds=2, gate="none").corrections[0].gate.parameters()) == []


def test_loss_uses_probabilities_as_logits():
    patterns_KD = torch.eye(3)
    probs_BK = torch.tensor([[1.0, 0.0, 0.0]])
    loss = denoise_loss(patterns_KD[:1], probs_BK, torch.tensor([0]), patterns_KD)
    # cosine term 0; cross-entropy of logits (1, 0, 0): log(e + 2) - 1
    assert loss.item() == pytest.approx(0.5 * (math.log(math.e + 2) - 1), rel=1e-6)


def test_two_rounds_beat_one_after_short_training():
    protocol = Protocol(steps=60, eval_queries=2000)
    setting = Setting(64, 16, 0.5)
    one = train_run(boosted_run(setting, 1, None, seed=0), protocol)
    two = train_run(boosted_run(setting, 2, "mlp", seed=0), protocol)
    assert two["accuracy"] > one["accuracy"] + 0.02, (one["accuracy"], two["accuracy"])
    assert sorted(two["evals"]) == [20, 40, 60]


def hopfield_deq(d: int, beta: float) -> EquilibriumDenoiser:
    """A DEQ whose fixed points depend on the query: W_Q = W_K = W_V = I (plus a little noise)
    and a sharp beta make f a Hopfield retrieval step with one attractor near each pattern."""
    model = EquilibriumDenoiser(d, beta_init=beta, tol=1e-12, max_iter=500).double()
    with torch.no_grad():
        weight = model.step.qkv.weight
        weight.copy_(torch.eye(d, dtype=weight.dtype).repeat(3, 1) + 0.05 * torch.randn_like(weight))
    return model


def deq_case(beta: float, n_queries: int, seed: int):
    """A float64 DEQ model on 3 patterns in R^8 and noisy queries of them."""
    torch.manual_seed(0)
    model = hopfield_deq(8, beta=beta)
    patterns_KD = make_patterns(Setting(8, 3, 0.3)).double()
    query_BD, target_B = sample_queries(patterns_KD, 0.3, n_queries, torch.Generator().manual_seed(seed))
    return model, patterns_KD, query_BD.double(), target_B


def test_deq_fixed_point_satisfies_its_equation():
    model, patterns_KD, query_BD, target_B = deq_case(beta=6.0, n_queries=64, seed=0)
    def f(z):
        return model.step(z, patterns_KD)[0]

    with torch.no_grad():
        z_star_BD, stats = fixed_point(f, query_BD, tol=1e-12, max_iter=500)
        residual_B = (f(z_star_BD) - z_star_BD).norm(dim=-1)
    assert stats.converged == 1.0 and stats.iterations < 500
    assert residual_B.max() <= 1e-10 * z_star_BD.norm(dim=-1).max()
    assert len({tuple(z.round(decimals=6).tolist()) for z in z_star_BD}) > 1  # not one global fixed point
    # the model's own forward returns the same fixed point
    model.eval()
    with torch.no_grad():
        out_BD, probs_BK = model(query_BD, patterns_KD)
    torch.testing.assert_close(out_BD, z_star_BD)
    assert model.last_stats.residual_max <= 1e-10


def test_the_fixed_point_statistics_describe_the_iterate_returned():
    """Stopped at max_iter, the fraction of queries within tolerance was the previous iterate's, beside the returned
    iterate's residuals (0% where 83% of the returned queries were within it): both describe the one returned."""
    model, patterns_KD, query_BD, _ = deq_case(beta=1.0, n_queries=200, seed=1)

    def f(z):
        return model.step(z, patterns_KD)[0]

    with torch.no_grad():
        for max_iter in (1, 2, 3):
            z_BD, stats = fixed_point(f, query_BD, tol=0.05, max_iter=max_iter)
            fz_BD = f(z_BD)
            residual_B = (fz_BD - z_BD).norm(dim=-1)
            within = (residual_B / fz_BD.norm(dim=-1) <= 0.05).float().mean().item()
            assert stats.converged == pytest.approx(within) and stats.residual_max == pytest.approx(
                residual_B.max().item()), max_iter
    assert 0 < fixed_point(f, query_BD, tol=0.05, max_iter=1)[1].converged < 1  # (a case where the two differ)


def test_implicit_gradient_matches_unrolled_iteration():
    model, patterns_KD, query_BD, target_B = deq_case(beta=4.0, n_queries=32, seed=1)

    out_BD, probs_BK = model(query_BD, patterns_KD)  # implicit gradient through the hook
    implicit = torch.autograd.grad(denoise_loss(out_BD, probs_BK, target_B, patterns_KD), list(model.parameters()))

    z_BD = query_BD  # unrolled: backpropagate through 300 plain iterations
    for _ in range(300):
        z_BD = model.step(z_BD, patterns_KD)[0]
    out_BD, probs_BK = model.step(z_BD, patterns_KD)
    unrolled = torch.autograd.grad(denoise_loss(out_BD, probs_BK, target_B, patterns_KD), list(model.parameters()))
    for a, b in zip(implicit, unrolled):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    assert any(g.abs().max() > 1e-4 for g in implicit)
    model.eval()  # gradients in eval mode (no dropout here) are the same implicit ones
    out_BD, probs_BK = model(query_BD, patterns_KD)
    in_eval = torch.autograd.grad(denoise_loss(out_BD, probs_BK, target_B, patterns_KD), list(model.parameters()))
    for a, b in zip(in_eval, implicit):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_implicit_gradient_solves_the_adjoint_to_its_tolerance():
    """f(z) = 0.9 z + b has z* = 10 b, so dz*/db = 10: the adjoint fixed point g = 0.9 g + v converges by only
    10% an iteration, and iterated until its step is within tol = 1e-6 of g its relative error is about 1e-5
    (the Hopfield case above contracts so fast that a 1,000 times looser tolerance gave the same gradients)."""
    from gbattn.synthetic.models import attach_implicit_gradient

    b_BD = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
    for loss_scale in (1.0, 1e-4):  # the tolerance is relative: a small loss (or loss scale) is solved as well
        z_BD = attach_implicit_gradient(lambda z_BD: 0.9 * z_BD + b_BD, (10 * b_BD).detach(), tol=1e-6,
                                        max_iter=1000)
        (grad_BD,) = torch.autograd.grad(loss_scale * z_BD.sum(), b_BD)
        torch.testing.assert_close(grad_BD / loss_scale, torch.full_like(grad_BD, 10.0), rtol=1e-4, atol=0)


def test_deq_max_iter_bounds_the_adjoint_solve_too(monkeypatch):
    """--deq-max-iter is the most fixed-point iterations "forward and adjoint": with max_iter = 2 and tol = 0 the
    backward pass runs exactly two vector-Jacobian products (one autograd.grad call each)."""
    import gbattn.synthetic.models as models

    model, patterns_KD, query_BD, target_B = deq_case(beta=4.0, n_queries=8, seed=3)
    model.tol, model.max_iter = 0.0, 2
    calls, real_grad = [], torch.autograd.grad
    monkeypatch.setattr(models.torch.autograd, "grad", lambda *a, **k: calls.append(1) or real_grad(*a, **k))
    out_BD, probs_BK = model(query_BD, patterns_KD)
    denoise_loss(out_BD, probs_BK, target_B, patterns_KD).backward()
    assert model.last_stats.iterations == 2 and len(calls) == 2


def test_deq_answers_one_step_past_its_fixed_point_search_and_runs_frozen():
    """docs/method.md §9: the output is one more application of f, to z* in evaluation and to the re-entered
    f(z*) in training (here max_iter = 2, so z* = f(f(q))); a DEQ with frozen weights, called with gradients
    on, answers as in training (a hook on an output that needs no gradient raised a RuntimeError)."""
    model, patterns_KD, query_BD, _ = deq_case(beta=4.0, n_queries=5, seed=2)
    model.tol, model.max_iter = 0.0, 2

    def f_times(n):
        z_BD = query_BD
        with torch.no_grad():
            for _ in range(n):
                z_BD = model.step(z_BD, patterns_KD)[0]
        return z_BD

    model.eval()
    with torch.no_grad():
        evaluated_BD, _ = model(query_BD, patterns_KD)
    torch.testing.assert_close(evaluated_BD, f_times(3), rtol=0, atol=0)
    model.train()
    trained_BD, _ = model(query_BD, patterns_KD)
    torch.testing.assert_close(trained_BD.detach(), f_times(4), rtol=0, atol=0)
    model.requires_grad_(False)
    frozen_BD, _ = model(query_BD, patterns_KD)
    torch.testing.assert_close(frozen_BD, f_times(4), rtol=0, atol=0)


def test_cli_tiny_run_writes_tables_and_figure(tmp_path, capsys):
    out = tmp_path / "denoise"
    code = main(["denoise", "--quick", "--out", str(out), "--steps", "2", "--seeds", "0", "1",
                 "--eval-queries", "100", "--quiet"])
    assert code == 0
    printed = capsys.readouterr().out
    for heading in ("Accuracy vs rounds", "Gate ablation", "Difficulty scaling", "fixed point (DEQ)", "wall-clock"):
        assert heading.lower() in printed.lower()
    report = json.loads((out / "results.json").read_text())
    assert set(report["tables"]) == {"rounds", "gates", "difficulty", "deq"}
    rows = report["tables"]["rounds"]["rows"]
    assert [r["rounds"] for r in rows] == [1, 2, 3, 4, 5] and rows[0]["ours"]["n"] == 2
    assert report["tables"]["rounds"]["bayes"] == pytest.approx(58.1, abs=1.5)  # the paper's ceiling
    markdown = (out / "results.md").read_text()
    assert "| Bayes-optimal" in markdown and "| chance (1/K)" in markdown
    assert "41.3" not in markdown and "trained for 2 steps, not the 150" in markdown  # 2 steps: no paper numbers
    assert (out / "rounds.png").stat().st_size > 10_000


def test_denoise_and_compare_leave_each_others_results_alone(tmp_path, capsys):
    """--out of denoise holding a comparison is refused before any training (its results.json and
    results.md were replaced), and compare's --out holding denoise's results too; nothing is written."""
    from gbattn.experiments.compare import run_compare

    comparison = tmp_path / "cmp"
    comparison.mkdir()
    for name, text in (("recipe.json", '{"recipe": "cpu-char"}'), ("results.json", '{"models": []}'),
                       ("results.md", "# cpu-char")):
        (comparison / name).write_text(text)
    assert main(["denoise", "--quick", "--out", str(comparison), "--steps", "2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"gbattn: error: --out {comparison} holds a `gbattn compare` comparison, "
                                        f"not a `gbattn denoise` output: choose another --out"], err
    assert sorted(p.name for p in comparison.iterdir()) == ["recipe.json", "results.json", "results.md"]
    assert (comparison / "results.json").read_text() == '{"models": []}'
    denoised = tmp_path / "denoise"
    denoised.mkdir()
    (denoised / "results.json").write_text('{"tables": {}}')
    with pytest.raises(UserError, match="holds a results.json that neither `gbattn compare` nor `gbattn denoise` "
                                        "wrote, not a comparison: choose another --out"):
        run_compare("cpu-char", denoised, sets={"max_steps": 2}, quiet=True)
    assert sorted(p.name for p in denoised.iterdir()) == ["results.json"]  # refused before its lock was taken
    assert (denoised / "results.json").read_text() == '{"tables": {}}'


def test_a_second_denoise_into_one_out_is_refused_while_the_first_runs(tmp_path, capsys):
    """Two `gbattn denoise` runs into one --out each wrote its results.json, results.md and rounds.png over the
    other's (no lock). Now each holds the folder's lock, as compare does: a second writer is refused with one line,
    exit 2, before any work and changing nothing; once the first is killed (-9) the folder is taken at once."""
    out = tmp_path / "d"
    quick = ["--quick", "--experiments", "deq", "--seeds", "0", "--quiet"]
    first = subprocess.Popen([sys.executable, "-m", "gbattn", "denoise", "--out", str(out), *quick, "--steps",
                              "1000000"], env=dict(os.environ, OMP_NUM_THREADS="1"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(1200):  # until it holds the lock (its pid is written once the lock is taken)
            if (out / ".lock").is_file() and (out / ".lock").read_text().split("\n")[0] == str(first.pid):
                break
            assert first.poll() is None, first.stderr.read()
            time.sleep(0.1)
        else:
            pytest.fail("the first denoise never took the lock")
        held = {p.name: p.read_bytes() for p in out.iterdir()}
        assert main(["denoise", "--out", str(out), *quick, "--steps", "1"]) == 2
        err = capsys.readouterr().err
        assert err.strip().splitlines() == [f"gbattn: error: {out} is in use by another gbattn process (its `gbattn "
                                            f"denoise` output is being written); wait for it to finish or choose "
                                            f"another --out"], err
        assert {p.name: p.read_bytes() for p in out.iterdir()} == held
    finally:
        first.kill()
        first.wait()
    assert main(["denoise", "--out", str(out), *quick, "--steps", "1", "--eval-queries", "10"]) == 0
    assert json.loads((out / "results.json").read_text())["protocol"]["steps"] == 1


def test_an_out_holding_results_denoise_did_not_write_is_refused_before_training(tmp_path, monkeypatch, capsys):
    """denoise refused a comparison's folder only: any other results.json or results.md in --out was replaced.
    Now a results.json that is not a denoise results file, or a results.md without one beside it, is refused
    with one line, exit 2, before training and touching nothing; a previous denoise's files (the committed
    ones too, written before results.json recorded its experiments) are replaced, and compare refuses them."""
    import shutil

    from gbattn.synthetic import tables

    monkeypatch.setattr(tables, "train_run", lambda *a: pytest.fail("trained"))
    not_denoise = "not a `gbattn denoise` output: choose another --out"
    cases = [("results.json", '{"models": []}', f"holds a `gbattn compare` comparison, {not_denoise}"),
             ("results.json", '{"tables": {}, "protocol": {}}', "holds a results.json that neither `gbattn compare` "
              f"nor `gbattn denoise` wrote, {not_denoise}"),
             ("results.json", "[1]", "holds a results.json that gbattn cannot read (it holds list, expected a JSON "
              f"object), {not_denoise}"),
             ("results.json", "{", "holds a results.json that gbattn cannot read (it is not valid JSON"),
             ("results.md", "# my notes", f"holds a results.md without the results.json gbattn writes beside it, "
              f"{not_denoise}")]
    for i, (name, text, expected) in enumerate(cases):
        out = tmp_path / f"foreign{i}"
        out.mkdir()
        (out / name).write_text(text)
        assert main(["denoise", "--out", str(out), "--experiments", "deq", "--quiet"]) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0] and err[0].startswith("gbattn: error: "), err
        assert [p.name for p in out.iterdir()] == [name] and (out / name).read_text() == text
    runs, _ = fake_runs((0,))
    monkeypatch.setattr(tables, "train_run", lambda spec, protocol, device: runs[spec.key])
    out = tmp_path / "committed"
    out.mkdir()
    for name in ("results.json", "results.md"):
        shutil.copy(RESULTS / name, out / name)
    assert main(["denoise", "--out", str(out), "--experiments", "deq", "--seeds", "0", "--quick", "--quiet"]) == 0
    assert json.loads((out / "results.json").read_text())["experiments"] == ["deq"]
    assert main(["denoise", "--out", str(out), "--experiments", "gates", "--seeds", "0", "--quick", "--quiet"]) == 0
    assert json.loads((out / "results.json").read_text())["experiments"] == ["gates"]
    capsys.readouterr()
    assert main(["compare", "--recipe", "cpu-char", "--out", str(out), "--quiet"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"gbattn: error: --out {out} holds a `gbattn denoise` "
                                                            f"output, not a comparison: choose another --out"]


def test_an_out_holding_a_figure_denoise_did_not_write_is_refused_before_training(tmp_path, monkeypatch, capsys):
    """A rounds.png in an --out that holds no denoise output (a user's folder of figures) was deleted by a run
    without the rounds table and replaced by one with it; now one line, exit 2, nothing trained or touched."""
    from gbattn.synthetic import tables

    monkeypatch.setattr(tables, "train_run", lambda *a: pytest.fail("trained"))
    out = tmp_path / "my figures"
    out.mkdir()
    (out / "rounds.png").write_bytes(b"my figure")
    for experiments in (["deq"], ["rounds"]):
        assert main(["denoise", "--out", str(out), "--experiments", *experiments, "--quiet"]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"gbattn: error: --out {out} holds a rounds.png without the results.json gbattn denoise writes beside "
            f"it, not a `gbattn denoise` output: choose another --out"]
        assert [p.name for p in out.iterdir()] == ["rounds.png"] and (out / "rounds.png").read_bytes() == b"my figure"


def test_deq_solver_options_without_the_deq_experiment_are_one_line(tmp_path, monkeypatch, capsys):
    """--deq-tol and --deq-max-iter set the deq experiment's solver: without it they were ignored, and results.md
    said "Not the defaults: DEQ solver to relative residual 0.001, at most 50 iterations" of no DEQ model."""
    from gbattn.synthetic import tables

    monkeypatch.setattr(tables, "train_run", lambda *a: pytest.fail("trained"))
    out = tmp_path / "d"
    assert main(["denoise", "--quick", "--experiments", "gates", "--deq-max-iter", "50", "--deq-tol", "1e-3",
                 "--out", str(out), "--quiet"]) == 2
    assert capsys.readouterr().err == ("gbattn: error: --deq-tol and --deq-max-iter set the DEQ solver of the deq "
                                       "experiment, which --experiments gates leaves out: add deq, or leave them "
                                       "out\n")
    assert main(["denoise", "--quick", "--experiments", "gates", "--deq-tol", "1e-3", "--out", str(out),
                 "--quiet"]) == 2
    assert capsys.readouterr().err.endswith("--deq-tol sets the DEQ solver of the deq experiment, which --experiments "
                                            "gates leaves out: add deq, or leave it out\n")
    assert not out.exists()


def test_rounds_figure_draws_error_bars_only_of_a_spread(tmp_path, monkeypatch):
    """One seed has no std: rounds.png drew zero-length error bars with caps at each mean, as if the spread were 0
    (results.png had been fixed for it). Two seeds draw a bar of each std."""
    from gbattn.synthetic import tables

    drawn = []
    monkeypatch.setattr(tables, "write_figure", lambda fig, path: drawn.append(fig))

    def table(std, n):
        rows = [{"rounds": m, "ours": {"mean": 20.0 + m, "std": std, "n": n}, "paper_revision": 30.0, "paper_v1": 31.0}
                for m in (1, 2, 3)]
        return {"rows": rows, "bayes": 58.0, "chance": 6.25}

    for std, n, bars in ((None, 1, 0), (0.5, 2, 3)):
        plot_rounds(table(std, n), tmp_path / "rounds.png", 150)
        (ax,) = drawn[-1].axes
        (ours,) = [c for c in ax.containers if c.get_label().startswith("ours")]
        _, caps, bar_lines = ours.lines
        assert len(caps) == (2 if bars else 0) and sum(len(b.get_segments()) for b in bar_lines) == bars


def test_missing_matplotlib_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    table = {"rows": [], "bayes": 58.0, "chance": 6.25}
    with pytest.raises(UserError, match="matplotlib"):
        plot_rounds(table, tmp_path / "rounds.png", 150)


def test_denoise_without_matplotlib_stops_before_training_with_the_install_line(tmp_path, monkeypatch, capsys):
    """The rounds table draws rounds.png: without matplotlib, `gbattn denoise` says how to install it in one line
    before any run trains, and writes nothing."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "denoise"
    assert main(["denoise", "--quick", "--experiments", "rounds", "--out", str(out), "--steps", "1", "--quiet"]) == 2
    captured = capsys.readouterr()
    assert captured.err == ("gbattn: error: figures need matplotlib, which is not installed: pip install "
                            "'gbattn[plot]'\n")
    assert captured.out == "" and not (out / "results.json").exists()


def test_a_run_reports_its_best_evaluation_on_held_out_queries(monkeypatch):
    """The protocol reports the best of its evaluations (not the last), each on queries of their own
    stream: never the queries the model was trained on, and fresh ones at each evaluation."""
    from gbattn.synthetic import training

    drawn = []
    real_sample = training.sample_queries
    monkeypatch.setattr(training, "sample_queries", lambda *a: drawn.append(real_sample(*a)) or drawn[-1])
    protocol = Protocol(steps=3, batch=8, eval_queries=8, n_evals=3)
    result = train_run(boosted_run(Setting(8, 4, 0.5), 1, None, 0), protocol)
    assert len(drawn) == 6  # step 1, eval, step 2, eval, step 3, eval
    train_queries = [drawn[i][0] for i in (0, 2, 4)]
    eval_queries = [drawn[i][0] for i in (1, 3, 5)]
    for q_eval in eval_queries:
        assert not any(torch.equal(q_eval, q) for q in train_queries)
    assert not any(torch.equal(a, b) for a, b in zip(eval_queries, eval_queries[1:]))
    assert result["accuracy"] == max(result["evals"].values())

    scores = iter([0.5, 0.4, 0.3])
    monkeypatch.setattr(training, "evaluate", lambda *a: next(scores))
    result = train_run(boosted_run(Setting(8, 4, 0.5), 1, None, 0), protocol)
    assert result["evals"] == {1: 0.5, 2: 0.4, 3: 0.3} and result["accuracy"] == 0.5

    # A DEQ's fixed-point statistics are those of the evaluation reported: the table prints them beside its
    # accuracy (it printed the last evaluation's "100% converged" beside an earlier one's accuracy, 88% converged).
    scores = iter([(0.5, 0.88), (0.4, 0.99), (0.3, 1.0)])

    def evaluate_deq(model, *a):
        accuracy, converged = next(scores)
        model.last_stats = FixedPointStats(iterations=6, residual_mean=0.1, residual_max=0.2, converged=converged)
        return accuracy

    monkeypatch.setattr(training, "evaluate", evaluate_deq)
    result = train_run(RunSpec(Setting(8, 4, 0.5), kind="deq", seed=0), protocol)
    assert result["accuracy"] == 0.5 and result["fixed_point"]["converged"] == 0.88


def test_difficulty_delta_is_paired_by_seed():
    """The gain of the second round is M=2 minus M=1 of the same seed: here +10 points for every
    seed, so its std is 0 (pairing across seeds would give a spread)."""
    from gbattn.synthetic.tables import summarise
    from gbattn.synthetic.task import DIFFICULTY_SETTINGS

    seeds = (0, 1, 2)
    runs, bayes = {}, {}
    for st in DIFFICULTY_SETTINGS:
        bayes[st.key] = {"accuracy": 0.9, "stderr": 0.001}
        for s, acc in zip(seeds, (0.1, 0.3, 0.6)):
            runs[boosted_run(st, 1, None, s).key] = {"accuracy": acc}
            runs[boosted_run(st, 2, "mlp", s).key] = {"accuracy": acc + 0.1}
    table = summarise("difficulty", runs, bayes, seeds)
    for column in table["columns"]:
        assert column["delta"]["mean"] == pytest.approx(10.0)
        assert column["delta"]["std"] == pytest.approx(0.0, abs=1e-9)
        assert column["m1"]["mean"] == pytest.approx(100 / 3)


def test_each_round_has_its_own_inverse_temperature():
    """Round m scales its scores by beta_m: moving log beta_1 changes the answer but not the
    round-0 weights, and moving log beta_0 changes those."""
    torch.manual_seed(0)
    model = PatternDenoiser(8, rounds=2, gate="none")
    patterns_KD = make_patterns(Setting(8, 4, 0.5))
    query_BD = sample_queries(patterns_KD, 0.5, 6, torch.Generator().manual_seed(0))[0]
    with torch.no_grad():
        out_BD, probs_BK = model(query_BD, patterns_KD)
        model.log_beta[1] += 1.0
        out1_BD, probs1_BK = model(query_BD, patterns_KD)
        model.log_beta[0] += 1.0
        _, probs2_BK = model(query_BD, patterns_KD)
    assert torch.equal(probs1_BK, probs_BK) and not torch.allclose(out1_BD, out_BD)
    assert not torch.allclose(probs2_BK, probs_BK)


def test_fixed_point_converges_by_the_relative_residual():
    """f(z) = z / 2 + b has the fixed point 2b; with |b| = 1e4 the tolerance 1e-3 is met relative to
    |f(z)| while the absolute residual is still about 10: every query has converged. Stopped early,
    none has, and the statistics report the absolute residual."""
    b_BD = 1e4 * torch.arange(1.0, 4.0, dtype=torch.float64)[:, None] * torch.ones(3, 4, dtype=torch.float64)
    def f(z):
        return 0.5 * z + b_BD

    z_BD, stats = fixed_point(f, torch.zeros_like(b_BD), tol=1e-3, max_iter=100)
    assert stats.converged == 1.0 and stats.iterations < 100
    assert 1.0 < stats.residual_max <= 1e-3 * (f(z_BD)).norm(dim=-1).max()
    torch.testing.assert_close(z_BD, 2 * b_BD, rtol=2e-3, atol=0)
    _, stats = fixed_point(f, torch.zeros_like(b_BD), tol=1e-3, max_iter=4)
    assert stats.iterations == 4 and stats.converged == 0.0
    # Near zero the tolerance is still relative: with |b| about 1e-4 every absolute residual is within 1e-3 from the
    # first iteration, but the relative one from z = 0 is 1 / (2^k - 1) after k iterations, within 1e-3 at k = 10.
    small_BD = 1e-8 * b_BD
    _, stats = fixed_point(lambda z: 0.5 * z + small_BD, torch.zeros_like(small_BD), tol=1e-3, max_iter=100)
    assert (stats.iterations, stats.converged) == (10, 1.0)
    # It returns the last f(z), the iterate within the tolerance (z = 1.5 after z = 0, 1), not the z before it.
    z_BD, stats = fixed_point(lambda z: 0.5 * z + 1.0, torch.zeros(2, 3, dtype=torch.float64), tol=0.5, max_iter=10)
    assert stats.iterations == 2 and torch.equal(z_BD, torch.full((2, 3), 1.5, dtype=torch.float64))
    # A relative residual exactly at the tolerance stops the iteration and counts as converged.
    _, stats = fixed_point(lambda z: torch.full_like(z, 2.0), torch.ones(3, 1), tol=0.5, max_iter=10)
    assert (stats.iterations, stats.converged) == (1, 1.0)
    # No iteration at all has no residual to report: refused by name (was an UnboundLocalError).
    with pytest.raises(ValueError, match="max_iter=0: the fixed point needs at least one iteration"):
        fixed_point(f, torch.zeros_like(b_BD), tol=1e-3, max_iter=0)


def test_fixed_point_statistics_are_per_query_max_mean_and_fraction():
    """Rows contracting at rates 0.1, 0.5, 0.9 (f(z) = a z + b, from z = 0): after 9 iterations the residual
    f(z) - z of each row is b a^9, and the two fastest rows' relative residuals (1e-9 and 9.8e-4; then 6.0e-2) are
    within 1e-3. The statistics are the max and the mean of the residuals, and the fraction within the
    tolerance, all of the iterate returned: the DEQ table's "max residual" row read the mean, a fraction with a
    looser tolerance passed, and the fraction was the previous iterate's (1/3 here: 9e-9, 2.0e-3 and 7.0e-2)."""
    a_B1 = torch.tensor([[0.1], [0.5], [0.9]], dtype=torch.float64)
    b_BD = torch.tensor([[1.0], [2.0], [3.0]], dtype=torch.float64) * torch.ones(3, 4, dtype=torch.float64)
    _, stats = fixed_point(lambda z: a_B1 * z + b_BD, torch.zeros_like(b_BD), tol=1e-3, max_iter=9)
    residual_B = (b_BD * a_B1**9).norm(dim=-1)
    assert stats.iterations == 9 and stats.converged == pytest.approx(2 / 3)
    assert stats.residual_max == pytest.approx(residual_B.max().item(), rel=1e-9)
    assert stats.residual_mean == pytest.approx(residual_B.mean().item(), rel=1e-9)


def test_loss_averages_over_the_batch():
    """Both terms are batch means: a batch of the same row twice has the loss of that row."""
    patterns_KD = torch.eye(3)
    output_BD = torch.tensor([[0.6, 0.8, 0.0]])  # cosine 0.6 with pattern 0
    probs_BK = torch.tensor([[0.7, 0.2, 0.1]])
    one = denoise_loss(output_BD, probs_BK, torch.tensor([0]), patterns_KD)
    two = denoise_loss(output_BD.repeat(2, 1), probs_BK.repeat(2, 1), torch.tensor([0, 0]), patterns_KD)
    ce = torch.nn.functional.cross_entropy(probs_BK, torch.tensor([0])).item()
    assert one.item() == pytest.approx(0.4 + 0.5 * ce, rel=1e-6)
    assert two.item() == pytest.approx(one.item(), rel=1e-6)


def test_a_run_anneals_its_learning_rate_to_zero_over_its_steps(monkeypatch):
    """The cosine schedule spans the whole run: the last step leaves the rate at 0, the midpoint at
    half the peak (a schedule of half the run would be back at the peak)."""
    optimizers, lrs = [], []
    real_adam = torch.optim.Adam

    class Recorded(real_adam):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            optimizers.append(self)

        def step(self, *args, **kwargs):
            lrs.append(self.param_groups[0]["lr"])
            return super().step(*args, **kwargs)

    monkeypatch.setattr(torch.optim, "Adam", Recorded)
    protocol = Protocol(steps=4, batch=8, eval_queries=8, lr=1e-2)
    train_run(boosted_run(Setting(8, 4, 0.5), 1, None, 0), protocol)
    assert lrs[0] == pytest.approx(1e-2) and lrs[2] == pytest.approx(0.5e-2)
    assert optimizers[0].param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)


def test_a_runs_initial_weights_come_from_its_own_seed(monkeypatch):
    """Seed s starts from the weights torch.manual_seed(s) draws (seeds differ in their
    initialisation, not only in their data), and its result records s."""
    from gbattn.synthetic import training

    initial = {}
    real_build = training.build_model

    def build(spec, protocol):
        model = real_build(spec, protocol)
        initial[spec.seed] = model.qkv.weight.detach().clone()
        return model

    monkeypatch.setattr(training, "build_model", build)
    protocol = Protocol(steps=1, batch=4, eval_queries=4)
    for seed in (0, 1):
        result = train_run(boosted_run(Setting(8, 4, 0.5), 1, None, seed), protocol)
        assert (result["seed"], result["key"]) == (seed, f"d8-K4-s0.5-M1-seed{seed}")
    torch.manual_seed(1)
    assert torch.equal(initial[1], PatternDenoiser(8, rounds=1, gate="none").qkv.weight)
    assert not torch.equal(initial[0], initial[1])


def test_deq_table_reports_the_worst_seed_and_ceilings_in_percent():
    """Over seeds, the DEQ column shows the largest residual and iteration count, the mean residual
    and the smallest converged fraction; chance and the Bayes ceiling (with its standard error) are
    in percent, chance printed to two decimals."""
    from gbattn.synthetic.tables import chance_cell, summarise
    from gbattn.synthetic.task import DEQ_SETTINGS
    from gbattn.synthetic.training import RunSpec

    seeds = (0, 1)
    runs, bayes = {}, {}
    for st in DEQ_SETTINGS:
        bayes[st.key] = {"accuracy": 0.5, "stderr": 0.002}
        for s in seeds:
            runs[boosted_run(st, 1, None, s).key] = {"accuracy": 0.4}
            runs[RunSpec(st, kind="deq", seed=s).key] = {"accuracy": 0.1, "fixed_point": {
                "residual_max": (1e-6, 3e-4)[s], "residual_mean": (1e-7, 3e-7)[s], "converged": (1.0, 0.25)[s],
                "iterations": (12, 200)[s]}}
    for column in summarise("deq", runs, bayes, seeds)["columns"]:
        assert column["residual_max"] == 3e-4 and column["iterations_max"] == 200
        assert column["converged_fraction"] == 0.25 and column["residual_mean"] == pytest.approx(2e-7)
        assert column["bayes"] == pytest.approx(50.0) and column["bayes_se"] == pytest.approx(0.2)
        assert column["chance"] == pytest.approx(100 / Setting(**column["setting"]).K)
    assert Setting(64, 16, 0.5).chance == 1 / 16
    assert [chance_cell(100 / k) for k in (4, 8, 16, 32)] == ["25", "12.5", "6.25", "3.12"]


def test_quick_and_explicit_options_reach_the_protocol(tmp_path, monkeypatch):
    """--quick: seed 0, 1,000 queries per evaluation and 20,000 Bayes queries; the defaults are the
    paper's protocol and seeds 0, 1, 2, into runs/denoise (the default --help names); --eval-queries and --steps
    override either."""
    from gbattn.cli import build_parser
    from gbattn.synthetic import tables

    calls, outs = [], []
    monkeypatch.setattr(tables, "run_denoise", lambda out, experiments, seeds, protocol, *rest:
                        outs.append(out) or calls.append((list(experiments), list(seeds), protocol)) or
                        {"tables": {}, "wall_seconds": 0.0})
    out = str(tmp_path / "d")
    monkeypatch.chdir(tmp_path)  # (nothing is written: run_denoise is stubbed)
    assert main(["denoise", "--quiet"]) == 0 and calls.pop()[0] == ["rounds", "gates", "difficulty", "deq"]
    assert outs == ["runs/denoise"]
    assert main(["denoise", "--out", out, "--quiet"]) == 0
    assert main(["denoise", "--quick", "--out", out, "--quiet"]) == 0
    assert main(["denoise", "--quick", "--out", out, "--eval-queries", "300", "--steps", "7",
                 "--experiments", "deq", "--quiet"]) == 0
    (full, full_seeds_protocol), quick, explicit = calls[0][1:], calls[1], calls[2]
    assert full == [0, 1, 2] and full_seeds_protocol == Protocol() and calls[0][0] == ["rounds", "gates",
                                                                                        "difficulty", "deq"]
    assert quick[1] == [0] and quick[2] == Protocol(eval_queries=1000, bayes_queries=20_000)
    assert explicit[0] == ["deq"] and explicit[2] == Protocol(steps=7, eval_queries=300, bayes_queries=20_000)
    # The default device is the CPU (the models are tiny), not auto, which would take a GPU unasked (both are the
    # CPU on a machine without one, so the parser's default is read).
    assert build_parser().parse_args(["denoise"]).device == "cpu"


def test_denoise_help_names_every_device_and_what_overrides_quick(tmp_path, monkeypatch, capsys):
    """--device's help said "cpu or cuda" where auto and cuda:N are taken too (the words of the other commands'
    --device now), and --quick's "seed 0 only" where --seeds (and --eval-queries) override it."""
    from gbattn.runtime import resolve_device
    from gbattn.synthetic import tables

    with pytest.raises(SystemExit):
        main(["denoise", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--device DEVICE cpu (default: the models are tiny), auto (CUDA if available), cuda or cuda:N" in help_text
    assert ("--quick seed 0 only unless --seeds is given, 1,000 queries per evaluation unless --eval-queries is, "
            "and 20,000 Bayes queries") in help_text
    calls = []
    monkeypatch.setattr(tables, "run_denoise", lambda out, experiments, seeds, protocol, device, *rest:
                        calls.append((list(seeds), protocol.eval_queries, device)) or
                        {"tables": {}, "wall_seconds": 0.0})
    assert main(["denoise", "--quick", "--seeds", "4", "5", "--eval-queries", "300", "--device", "auto",
                 "--out", str(tmp_path / "d"), "--quiet"]) == 0
    assert calls == [([4, 5], 300, str(resolve_device("auto")))]


def test_cli_passes_quiet_and_a_portable_command_to_the_run(tmp_path, monkeypatch, capsys):
    """--quiet reaches run_denoise (its plan line and progress display are left out), and only with --quiet; the
    command results.json records names --out by its last component, not this machine's path. The closing line
    is the run's wall-clock."""
    from gbattn.synthetic import tables

    quiets, commands = [], []
    monkeypatch.setattr(tables, "run_denoise", lambda out, experiments, seeds, protocol, device, quiet, command:
                        quiets.append(quiet) or commands.append(command) or {"tables": {}, "wall_seconds": 150.0})
    assert main(["denoise", "--out", str(tmp_path / "d"), "--quiet"]) == 0
    assert "Total wall-clock: 150 s (2.5 min)\n" in capsys.readouterr().out
    assert main(["denoise", "--out", str(tmp_path / "d")]) == 0
    assert quiets == [True, False]
    assert commands == ["gbattn denoise --out d --quiet", "gbattn denoise --out d"]


def test_the_clis_copies_of_the_experiments_and_seeds_are_the_tables_ones():
    """synthetic/cli.py keeps its own EXPERIMENTS and FULL_SEEDS so that every command's start-up (which registers
    denoise) imports no torch, as test_cli's test_help_imports_nothing_heavy checks; training.py and tables.py,
    which import torch, hold the ones run_denoise uses. A change to one copy alone would make --experiments'
    choices or the default seeds differ from what run_denoise and its defaults do."""
    from gbattn.synthetic import cli, tables, training

    assert cli.EXPERIMENTS == training.EXPERIMENTS == tables.EXPERIMENTS
    assert cli.FULL_SEEDS == tables.FULL_SEEDS
    assert cli.INITS == training.INITS == tuple(tables.INIT_WORDS) and cli.INITS[0] == Protocol().init


# ---- mutation sweep of the synthetic task: data, protocol, tables, outputs ----------------------------

RESULTS = Path(__file__).resolve().parent.parent / "results" / "denoise"


def test_settings_and_protocol_are_the_documented_ones():
    """docs/method.md §9: the rounds and gates setting, the two difficulty cells, the six DEQ cells
    and the authors' protocol (evaluations at steps 50, 100, 150)."""
    from gbattn.synthetic.task import DEQ_SETTINGS, DIFFICULTY_SETTINGS, ROUNDS, ROUNDS_SETTING

    assert Setting(64, 16, 0.5) == ROUNDS_SETTING and ROUNDS == (1, 2, 3, 4, 5)
    assert (Setting(64, 16, 0.3), Setting(128, 32, 0.3)) == DIFFICULTY_SETTINGS
    assert [(st.d, st.K, st.sigma) for st in DEQ_SETTINGS] == [(16, 4, 0.5), (16, 4, 0.8), (32, 8, 0.5),
                                                              (32, 8, 0.8), (64, 16, 0.5), (64, 16, 0.8)]
    p = Protocol()
    assert (p.steps, p.batch, p.lr, p.grad_clip, p.ce_weight, p.eval_queries) == (150, 512, 3e-3, 1.0, 0.5, 5000)
    assert (p.pattern_seed, p.beta_init, p.bayes_queries, p.deq_tol, p.deq_max_iter) == (42, 2.0, 200_000, 1e-5, 200)
    assert p.eval_steps == [50, 100, 150]
    # a third and two thirds of the run, rounded to the nearest step, never step 0
    assert Protocol(steps=4).eval_steps == [1, 3, 4] and Protocol(steps=2).eval_steps == [1, 2]
    assert Protocol(steps=1).eval_steps == [1]
    assert Protocol(steps=10).eval_steps == [3, 7, 10]  # in order (a set of them is not, for 10 steps)
    setting = Setting(128, 32, 0.3)
    assert (setting.label, setting.key) == ("d=128, K=32, sigma=0.3", "d128-K32-s0.3")


def test_published_numbers_are_docs_paper_md():
    """Every number in task.PAPER is the one docs/paper.md's synthetic tables print."""
    from gbattn.synthetic.task import DEQ_SETTINGS, PAPER

    text = (Path(__file__).resolve().parent.parent / "docs" / "paper.md").read_text()
    section = text.split("## Synthetic pattern denoising")[1].split("\n## ")[0]
    cells = {}
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("| ---"):
            label, *values = [c.strip() for c in line.strip("|").split("|")]
            cells[label] = values
    assert [float(v) for v in cells["v1"]] == [PAPER["rounds_v1"][m] for m in range(1, 6)]
    assert [float(v) for v in cells["revision (Bayes-optimal ceiling 58.1)"]] == [
        PAPER["rounds_revision"][m] for m in range(1, 6)]
    assert PAPER["bayes_revision"] == 58.1
    gates = {"baseline": "one-round baseline (M = 1)", "mlp": "MLP", "scalar": "scalar", "none": "none"}
    assert PAPER["gates_revision"] == {g: float(cells[label][0]) for g, label in gates.items()}
    assert PAPER["difficulty_delta"] == {"d64-K16-s0.3": float(cells["d = 64, K = 16, sigma = 0.3"][0]),
                                         "d128-K32-s0.3": float(cells["d = 128, K = 32, sigma = 0.3"][0])}
    assert [f"{st.d}, {st.K}" for st in DEQ_SETTINGS] == cells["d, K"]
    assert [str(st.sigma) for st in DEQ_SETTINGS] == cells["sigma"]
    assert [PAPER["deq_one_step"][st.key] for st in DEQ_SETTINGS] == [float(v) for v in cells["one step (trained)"]]
    assert [PAPER["deq_converged"][st.key] for st in DEQ_SETTINGS] == [
        float(v) for v in cells["converged (trained)"]]


def test_patterns_come_from_their_seed():
    """make_patterns(setting, seed) is seed's Gaussian (K, d) draw with each row scaled to length 1."""
    setting = Setting(6, 3, 0.5)
    raw = torch.randn(3, 6, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(make_patterns(setting, seed=7), raw / raw.norm(dim=1, keepdim=True))
    assert not torch.equal(make_patterns(setting, seed=7), make_patterns(setting))


def test_queries_are_patterns_plus_gaussian_noise_of_std_sigma():
    """Targets uniform over all K patterns; query - pattern[target] has mean 0 and std sigma per
    coordinate (sigma, not sigma^2)."""
    patterns_KD = make_patterns(Setting(16, 4, 0.0))
    query_BD, target_B = sample_queries(patterns_KD, 0.3, 40_000, torch.Generator().manual_seed(0))
    assert query_BD.shape == (40_000, 16) and target_B.shape == (40_000,)
    counts = torch.bincount(target_B, minlength=4)
    assert counts.numel() == 4 and (counts - 10_000).abs().max() < 400  # 4 binomial std
    noise = query_BD - patterns_KD[target_B]
    assert abs(noise.mean().item()) < 0.003 and noise.std().item() == pytest.approx(0.3, rel=0.01)


class Constant(torch.nn.Module):
    """A "model" answering one fixed vector for every query, recording its mode when called."""

    def __init__(self, answer_D):
        super().__init__()
        self.answer_D, self.modes = answer_D, []

    def forward(self, query_BD, patterns_KD):
        self.modes.append(self.training)
        return self.answer_D.expand_as(query_BD), None


def test_evaluate_scores_the_models_output_against_the_target():
    """Accuracy = the fraction of queries whose target is the pattern nearest the OUTPUT: a model
    always answering pattern 2 scores the share of targets equal to 2, computed in eval mode and
    left in training mode."""
    from gbattn.synthetic.training import evaluate

    patterns_KD = make_patterns(Setting(8, 4, 0.0))
    model = Constant(patterns_KD[2] * 0.9)
    accuracy = evaluate(model, patterns_KD, 0.2, 1000, torch.Generator().manual_seed(3), torch.device("cpu"))
    _, target_B = sample_queries(patterns_KD, 0.2, 1000, torch.Generator().manual_seed(3))
    assert accuracy == pytest.approx((target_B == 2).float().mean().item()) and 0.15 < accuracy < 0.35
    assert model.modes == [False] and model.training


def test_a_runs_first_loss_is_its_seeds_model_on_its_seeds_batch():
    """Step 1's loss (steps=1) is the loss of the model torch.manual_seed(s) builds, with the
    protocol's beta, on a batch of the run's sigma drawn from generator 10,000 + s from the protocol's
    patterns (its pattern_seed, which the Bayes ceiling uses too), weighted by the protocol's ce_weight."""
    setting = Setting(8, 4, 0.7)
    protocol = Protocol(steps=1, batch=16, eval_queries=4, ce_weight=0.2, beta_init=3.0, pattern_seed=7)
    result = train_run(boosted_run(setting, 1, None, seed=1), protocol)
    torch.manual_seed(1)
    model = PatternDenoiser(8, rounds=1, gate="none", beta_init=3.0)
    patterns_KD = make_patterns(setting, seed=7)
    query_BD, target_B = sample_queries(patterns_KD, 0.7, 16, torch.Generator().manual_seed(10_001))
    with torch.no_grad():
        output_BD, probs_BK = model(query_BD, patterns_KD)
        expected = denoise_loss(output_BD, probs_BK, target_B, patterns_KD, ce_weight=0.2).item()
        unweighted = denoise_loss(output_BD, probs_BK, target_B, patterns_KD).item()
    assert result["final_loss"] == pytest.approx(expected, rel=1e-6) and expected != pytest.approx(unweighted)
    assert denoise_loss(output_BD, probs_BK, target_B, patterns_KD, ce_weight=0.0).item() == pytest.approx(
        (1 - torch.nn.functional.cosine_similarity(output_BD, patterns_KD[target_B], dim=-1)).mean().item())


def test_a_short_run_is_the_training_loop_written_out():
    """Three steps, as docs/method.md §9 writes the loop: Adam, cosine annealing over the run, the
    gradient clipped (here at a norm small enough to bind) and zeroed before each backward pass."""
    setting, protocol = Setting(8, 4, 0.5), Protocol(steps=3, batch=16, eval_queries=4, grad_clip=0.05)
    result = train_run(boosted_run(setting, 2, "scalar", seed=2), protocol)
    assert (result["rounds"], result["gate"], result["kind"]) == (2, "scalar", "boosted")  # what results.json records
    assert result["setting"] == {"d": 8, "K": 4, "sigma": 0.5}  # the run's own setting, not the rounds table's
    torch.manual_seed(2)
    model = PatternDenoiser(8, rounds=2, gate="scalar")
    patterns_KD = make_patterns(setting)
    data = torch.Generator().manual_seed(10_002)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=3)
    for _ in range(3):
        query_BD, target_B = sample_queries(patterns_KD, 0.5, 16, data)
        loss = denoise_loss(*model(query_BD, patterns_KD), target_B, patterns_KD)
        optimizer.zero_grad()
        loss.backward()
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05) > 0.05
        optimizer.step()
        schedule.step()
    assert result["final_loss"] == pytest.approx(loss.item(), rel=1e-6)


def test_a_deq_run_records_its_kind_and_its_reported_evaluations_fixed_point(monkeypatch):
    """A DEQ run's result says kind "deq" (one round, no gate) and carries the fixed-point statistics of the
    evaluation whose accuracy it reports, which the DEQ table's residual and iteration rows show beside it."""
    from gbattn.synthetic import training

    stats = []
    real_evaluate = training.evaluate

    def evaluate(model, *args):
        accuracy = real_evaluate(model, *args)
        stats.append(asdict(model.last_stats))
        return accuracy

    monkeypatch.setattr(training, "evaluate", evaluate)
    protocol = Protocol(steps=2, batch=8, eval_queries=16, deq_max_iter=7)
    result = train_run(RunSpec(Setting(8, 4, 0.5), kind="deq", seed=1), protocol)
    assert (result["key"], result["kind"], result["rounds"], result["gate"]) == ("d8-K4-s0.5-deq-seed1", "deq", 1, None)
    best = list(result["evals"].values()).index(result["accuracy"])
    assert len(stats) == 2 and stats[0] != stats[1] and result["fixed_point"] == stats[best]


def test_denoise_count_options_refuse_zero_and_too_many_queries(tmp_path, monkeypatch):
    """--steps, --eval-queries and --threads take counts of at least 1: 0 is a usage error (exit 2)
    and nothing runs; so is more than 1,000,000 --eval-queries (drawn and run through the model at once)."""
    from gbattn.cli import build_parser
    from gbattn.synthetic import tables

    monkeypatch.setattr(tables, "run_denoise", lambda *a: pytest.fail("ran"))
    for option, count in (("--steps", "0"), ("--eval-queries", "0"), ("--threads", "0"), ("--eval-queries", "1000001")):
        with pytest.raises(SystemExit) as exit_info:
            main(["denoise", "--out", str(tmp_path / "d"), option, count, "--quiet"])
        assert exit_info.value.code == 2
    assert build_parser().parse_args(["denoise", "--eval-queries", "1000000"]).eval_queries == 1_000_000


def test_denoise_refuses_a_negative_seed_in_one_line(tmp_path, monkeypatch, capsys):
    """--seeds takes integers in [0, 2**63 - 1] (arguments.SEED, what torch.manual_seed takes): -1 is a usage error
    in one line, exit 2, before anything runs (read as a plain int, it passed every test and trained)."""
    from gbattn.synthetic import tables

    monkeypatch.setattr(tables, "run_denoise", lambda *a: pytest.fail("ran"))
    with pytest.raises(SystemExit) as exit_info:
        main(["denoise", "--out", str(tmp_path / "d"), "--seeds", "0", "-1", "--quiet"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "gbattn: error: argument --seeds: -1 must be >= 0 (see: gbattn denoise --help)"]


def test_a_run_evaluates_with_its_sigma_seed_and_clip(monkeypatch):
    """Evaluations draw eval_queries queries of the run's sigma from generator 20,000 + s, and the
    gradient is clipped at the protocol's norm."""
    from gbattn.synthetic import training

    evaluations, clips = [], []
    monkeypatch.setattr(training, "evaluate", lambda model, patterns, sigma, n, generator, device:
                        evaluations.append((sigma, n, generator.initial_seed())) or 0.5)
    real_clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, norm: clips.append(norm) or
                        real_clip(params, norm))
    train_run(boosted_run(Setting(8, 4, 0.7), 1, None, seed=3), Protocol(steps=2, batch=4, eval_queries=9,
                                                                         grad_clip=0.25, n_evals=1))
    assert evaluations == [(0.7, 9, 20_003)] and clips == [0.25, 0.25]


def test_models_get_the_protocols_beta_and_fixed_point_settings():
    from gbattn.synthetic.training import RunSpec, build_model

    protocol = Protocol(beta_init=3.0, deq_tol=1e-3, deq_max_iter=7)
    boosted = build_model(boosted_run(Setting(8, 4, 0.5), 2, "mlp", 0), protocol)
    torch.testing.assert_close(boosted.log_beta.exp(), torch.full((2,), 3.0))
    deq = build_model(RunSpec(Setting(8, 4, 0.5), kind="deq"), protocol)
    assert (deq.tol, deq.max_iter) == (1e-3, 7)
    torch.testing.assert_close(deq.step.log_beta.exp(), torch.full((1,), 3.0))


def test_the_normal_init_is_the_language_models_and_the_default_is_pytorchs():
    """--init normal (docs/deviations.md, entry 18): every Linear weight N(0, 0.02) and its bias 0, as the language
    model's init_weights; log beta and the gates' own constants as before. The default keeps nn.Linear's
    uniform +-1/sqrt(fan_in), whose std at fan_in 64 is 0.072."""
    from gbattn.synthetic.training import RunSpec, build_model

    spec = boosted_run(Setting(64, 16, 0.5), 2, "linear", 0)
    torch.manual_seed(0)
    normal = build_model(spec, Protocol(init="normal"))
    torch.manual_seed(0)
    default = build_model(spec, Protocol())
    for name, weight in normal.named_parameters():
        if name.endswith("weight"):
            assert abs(weight.std().item() - 0.02) < 0.002, name
            assert abs(dict(default.named_parameters())[name].std().item() - 0.02) > 0.02, name
        elif name.endswith("bias"):
            assert weight.abs().max().item() == 0.0
    torch.testing.assert_close(normal.log_beta, default.log_beta)
    deq = build_model(RunSpec(Setting(64, 16, 0.5), kind="deq"), Protocol(init="normal"))
    assert abs(deq.step.qkv.weight.std().item() - 0.02) < 0.002
    with pytest.raises(ValueError, match="init='xavier': expected one of pytorch, normal"):
        build_model(spec, Protocol(init="xavier"))


def test_init_and_deq_solver_options_reach_the_protocol_and_the_results(tmp_path, monkeypatch, capsys):
    """--init, --deq-tol and --deq-max-iter set the protocol; results.json's "init" and results.md say what differs
    from the defaults; a tolerance outside (0, 1) is a usage error in one line."""
    from gbattn.synthetic import tables

    runs, _ = fake_runs((0,))
    monkeypatch.setattr(tables, "train_run", lambda spec, protocol, device: runs[spec.key])
    seen = []
    real = tables.run_denoise
    monkeypatch.setattr(tables, "run_denoise", lambda out, exps, seeds, protocol, *rest: seen.append(protocol) or
                        real(out, exps, seeds, replace(protocol, bayes_queries=100), *rest))
    out = tmp_path / "d"
    assert main(["denoise", "--out", str(out), "--experiments", "deq", "--seeds", "0", "--init", "normal",
                 "--deq-tol", "1e-7", "--deq-max-iter", "900", "--quiet"]) == 0
    assert seen.pop() == Protocol(init="normal", deq_tol=1e-7, deq_max_iter=900)
    report = json.loads((out / "results.json").read_text())
    assert report["init"] == "N(0, 0.02) Linear weights, zero biases; log beta = log 2.0"
    assert report["protocol"]["init"] == "normal"
    assert ("Not the defaults: initialisation N(0, 0.02) Linear weights, zero biases; log beta = log 2.0; DEQ solver "
            "to relative residual 1e-07, at most 900 iterations") in (out / "results.md").read_text()
    for option, value, note in (("--deq-tol", "1e-7", "DEQ solver to relative residual 1e-07, at most 200"),
                                ("--deq-max-iter", "900", "DEQ solver to relative residual 1e-05, at most 900")):
        assert main(["denoise", "--out", str(out), "--experiments", "deq", "--seeds", "0", option, value,
                     "--quiet"]) == 0  # each solver option alone is named as not the default
        text = (out / "results.md").read_text()
        assert "Not the defaults: initialisation" in text and f"{note} iterations" in text
    assert main(["denoise", "--out", str(out), "--experiments", "deq", "--seeds", "0", "--quiet"]) == 0
    assert seen.pop() == Protocol() and "Not the defaults" not in (out / "results.md").read_text()
    capsys.readouterr()
    for value in ("0", "1", "nan"):
        with pytest.raises(SystemExit) as exit_info:
            main(["denoise", "--out", str(out), "--deq-tol", value, "--quiet"])
        assert exit_info.value.code == 2
        assert len(capsys.readouterr().err.splitlines()) == 1


def test_the_full_run_trains_24_distinct_models_per_seed():
    """3 seeds x 24 models (the help text's 72 runs): M = 1 is one model shared by the rounds, gates,
    difficulty and DEQ tables (its key carries no gate), not one per table."""
    from gbattn.synthetic.training import EXPERIMENTS, experiment_runs

    specs = [spec for name in EXPERIMENTS for spec in experiment_runs(name, (0, 1, 2))]
    assert len(set(specs)) == len({s.key for s in specs}) == 72
    assert boosted_run(Setting(8, 4, 0.5), 1, "mlp", 0) == boosted_run(Setting(8, 4, 0.5), 1, None, 0)
    assert {s.key for s in experiment_runs("rounds", (0,))} >= {"d64-K16-s0.5-M1-seed0", "d64-K16-s0.5-M2-mlp-seed0"}


def test_cells_format_mean_std_and_signed_gains():
    from gbattn.synthetic.tables import duration_words, fmt, percent_cell

    assert percent_cell([0.5, 0.6]) == {"mean": pytest.approx(55.0), "std": pytest.approx(10 * 2 ** -0.5),
                                        "n": 2}
    assert fmt(percent_cell([0.5, 0.6])) == "55.0 ± 7.1"
    assert fmt({"mean": 6.3, "std": 0.0}, sign=True) == "+6.3 ± 0.0"  # a zero spread is shown
    assert fmt({"mean": -1.26, "std": None}, sign=True) == "-1.3" and fmt(18.7, sign=True) == "+18.7"
    assert fmt(percent_cell([0.41])) == "41.0" and fmt(None) == "—"
    # ("about under 1 s" was printed: the estimate's words are whole now)
    assert [duration_words(s) for s in (0.7, 1.0, 89.4, 90, 180)] == ["under 1 s", "about 1 s", "about 89 s",
                                                                     "about 2 min", "about 3 min"]


def fake_runs(seeds) -> tuple[dict, dict]:
    """Every run of every experiment with an accuracy that encodes it: M/10 + gate index/100 +
    seed/1000 for boosted runs, 0.02 + seed/1000 for DEQ ones; Bayes 0.6 ± 0.001."""
    from gbattn.synthetic.task import DEQ_SETTINGS, DIFFICULTY_SETTINGS, ROUNDS_SETTING
    from gbattn.synthetic.training import EXPERIMENTS, GATES, experiment_runs

    runs = {}
    for spec in {spec for name in EXPERIMENTS for spec in experiment_runs(name, seeds)}:
        gate = GATES.index(spec.gate) + 1 if spec.gate else 0
        accuracy = 0.02 if spec.kind == "deq" else spec.rounds / 10 + gate / 100
        runs[spec.key] = {"accuracy": accuracy + spec.seed / 1000 + (spec.setting.K == 32) * 0.2, "fixed_point": {
            "residual_max": 1e-6, "residual_mean": 1e-7, "converged": 1.0, "iterations": 9}}
    bayes = {st.key: {"accuracy": 0.6, "stderr": 0.001}
             for st in (ROUNDS_SETTING, *DIFFICULTY_SETTINGS, *DEQ_SETTINGS)}
    return runs, bayes


def table_lines(name: str, seeds) -> list[str]:
    from gbattn.synthetic.tables import summarise, table_markdown

    runs, bayes = fake_runs(seeds)
    return table_markdown(name, summarise(name, runs, bayes, seeds), len(seeds)).splitlines()


def test_rounds_and_gates_tables_row_by_row():
    """Each row's cell is its own model's runs (mean ± std over the seeds, in %), beside the paper's
    numbers in their own columns; the baseline row is M = 1."""
    lines = table_lines("rounds", (0, 2))
    assert "| rounds M | ours (mean ± std, 2 seeds) | paper v1 | paper revision |" in lines
    assert "| 1 | 10.1 ± 0.1 | 41.3 | 46.0 |" in lines and "| 5 | 51.1 ± 0.1 | 55.8 | 57.0 |" in lines
    assert "| 2 | 21.1 ± 0.1 | 53.3 | 55.5 |" in lines  # the mlp gate (index 1)
    assert "| chance (1/K) | 6.25 | 6.25 | 6.25 |" in lines
    assert "| Bayes-optimal (nearest true pattern) | 60.0 ± 0.1 (MC s.e.) | — | 58.1 |" in lines
    lines = table_lines("gates", (0,))
    assert "| gate | ours (1 seed) | paper revision |" in lines  # one value, no spread
    assert lines[4:9] == ["| one-round baseline (M = 1) | 10.0 | 48.2 |", "| mlp | 21.0 | 55.6 |",
                          "| linear | 22.0 | — |", "| vector | 23.0 | — |", "| scalar | 24.0 | 56.5 |"]
    assert lines[9] == "| none | 25.0 | 55.4 |"


def test_difficulty_and_deq_tables_row_by_row():
    """Difficulty: M = 1 and M = 2 rows per setting and the signed gain; DEQ: the one-step row is the
    trained M = 1 model, the converged row the DEQ, with each column's sigma."""
    lines = table_lines("difficulty", (0, 2))
    assert lines[2] == "| | d=64, K=16, sigma=0.3 | d=128, K=32, sigma=0.3 |"
    assert "| M = 1, ours (mean ± std, 2 seeds) | 10.1 ± 0.1 | 30.1 ± 0.1 |" in lines
    assert "| M = 2, ours (mean ± std, 2 seeds) | 21.1 ± 0.1 | 41.1 ± 0.1 |" in lines
    assert "| gain M = 2 − M = 1, ours (points) | +11.0 ± 0.0 | +11.0 ± 0.0 |" in lines
    assert "| gain, paper (points) | +18.7 | +15.7 |" in lines
    assert "| Bayes-optimal (nearest true pattern) | 60.0 ± 0.1 (MC s.e.) | 60.0 ± 0.1 (MC s.e.) |" in lines
    lines = table_lines("deq", (0, 2))
    assert "| sigma | 0.5 | 0.8 | 0.5 | 0.8 | 0.5 | 0.8 |" in lines
    assert "| one step (trained), ours (mean ± std, 2 seeds) | " + " | ".join(["10.1 ± 0.1"] * 6) + " |" in lines
    assert "| converged (trained DEQ), ours (mean ± std, 2 seeds) | " + " | ".join(["2.1 ± 0.1"] * 6) + " |" in lines
    assert "| one step (trained), paper | 78.9 | 59.7 | 59.8 | 39.5 | 39.2 | 22.9 |" in lines
    converged = "| queries converged within tolerance (ours, fewest of any seed), % | "
    assert converged + " | ".join(["100"] * 6) + " |" in lines and "reach" not in lines[-1]


def test_the_deq_table_says_when_queries_did_not_converge():
    """A DEQ whose iteration stopped at --deq-max-iter before the tolerance (0% of queries converged at
    --deq-max-iter 2) was printed as "converged" beside the paper's converged row with nothing to tell:
    the table now gives each setting's fewest converged queries over the seeds and says what the row holds."""
    from gbattn.synthetic.tables import summarise, table_markdown

    runs, bayes = fake_runs((0, 2))
    stopped_early = {"d16-K4-s0.5-deq-seed0": 0.5, "d16-K4-s0.5-deq-seed2": 0.25, "d32-K8-s0.8-deq-seed0": 0.0}
    for key, converged in stopped_early.items():
        runs[key]["fixed_point"] = {**runs[key]["fixed_point"], "converged": converged}
    lines = table_markdown("deq", summarise("deq", runs, bayes, (0, 2)), 2).splitlines()
    assert "| queries converged within tolerance (ours, fewest of any seed), % | 25 | 100 | 100 | 0 | 100 | 100 |" in (
        lines)
    assert lines[-2:] == ["", "Not every query reached the fixed point's tolerance: the \"converged\" accuracies of "
                          "those settings are of the last iterate (raise --deq-max-iter)."]


@pytest.mark.parametrize("folder, protocol, experiments", [
    ("denoise", Protocol(), EXPERIMENTS),
    ("denoise-init-normal", Protocol(init="normal"), EXPERIMENTS),
    ("denoise-deq-tight", Protocol(deq_tol=1e-6, deq_max_iter=1000), ("deq",)),
])
def test_committed_results_are_what_the_tables_make_of_their_runs(folder, protocol, experiments):
    """results/denoise and the runs of docs/deviations.md entry 18: their tables, Markdown and results.md are
    summarise / table_markdown / results_markdown of their own runs, with their protocol (results/denoise was
    written before the protocol named its init: PyTorch's) and every run of seeds 0, 1, 2."""
    from gbattn.synthetic.tables import results_markdown, summarise, table_markdown
    from gbattn.synthetic.task import PAPER
    from gbattn.synthetic.training import experiment_runs

    results = RESULTS.parent / folder
    report = json.loads((results / "results.json").read_text())
    assert {"init": "pytorch", **report["protocol"]} == asdict(protocol) and report["seeds"] == [0, 1, 2]
    assert report["paper"] == json.loads(json.dumps(PAPER))
    assert report.get("experiments", list(EXPERIMENTS)) == list(experiments)  # (results/denoise: before it was kept)
    assert set(report["runs"]) == {spec.key for name in experiments for spec in experiment_runs(name, (0, 1, 2))}
    for name in experiments:
        table = summarise(name, report["runs"], report["bayes"], report["seeds"])
        assert json.loads(json.dumps(table)) == report["tables"][name]
        assert table_markdown(name, table, 3) == report["markdown"][name]
    assert results_markdown(report) == (results / "results.md").read_text()


def test_committed_bayes_ceilings_are_the_same_queries_drawn_again():
    """results/denoise's Bayes-optimal ceilings come back from bayes_optimal_accuracy with its default seed:
    the same queries (targets, then noise added to the pattern), so the same count up to a float tie or
    two. A changed draw (noise subtracted, the draws swapped, another seed) stays within the Monte Carlo
    error and passed the tests of the ceiling, while no committed ceiling could be made again."""
    from gbattn.synthetic.task import DEQ_SETTINGS

    report = json.loads((RESULTS / "results.json").read_text())
    for st in [st for st in DEQ_SETTINGS if st.d <= 32]:  # the small ones: well under a second in all
        recorded = report["bayes"][st.key]
        patterns_KD = make_patterns(st, report["protocol"]["pattern_seed"])
        accuracy, _ = bayes_optimal_accuracy(patterns_KD, st.sigma, recorded["queries"])
        assert abs(accuracy - recorded["accuracy"]) * recorded["queries"] <= 2, st.key


def test_run_denoise_trains_each_run_once_and_writes_after_each_table(tmp_path, monkeypatch):
    """With training stubbed: every distinct run trained once (runs shared by tables too),
    results.json rewritten after each experiment's table and marked unfinished (results.md says which
    tables are missing) until the last, the Bayes ceilings from the protocol's
    queries and pattern seed, and the seeds, steps, batch, device and query counts in results.md."""
    from gbattn.synthetic import tables
    from gbattn.synthetic.task import PAPER

    runs, _ = fake_runs((3, 5))
    trained, seen_tables = [], []

    def fake_train(spec, protocol, device):
        trained.append(spec.key)
        path = tmp_path / "results.json"
        seen_tables.append(sorted(json.loads(path.read_text())["tables"]) if path.exists() else [])
        # The first call (26 runs): what a run stopped now leaves says it is unfinished, and which tables are missing.
        if path.exists() and len(trained) <= 26:
            assert json.loads(path.read_text())["finished"] is False
            assert "wall_seconds" in json.loads(path.read_text())  # the time so far (results.md said 0.0 min)
            missing = sorted({"gates", "difficulty", "rounds"} - set(seen_tables[-1]), key=["gates", "difficulty",
                                                                                             "rounds"].index)
            assert (f"**Unfinished**: {3 - len(missing)} of 3 tables ({', '.join(missing)} not yet run)"
                    in (tmp_path / "results.md").read_text())
        return runs[spec.key]

    monkeypatch.setattr(tables, "train_run", fake_train)
    protocol = Protocol(bayes_queries=2000, pattern_seed=7, eval_queries=300, batch=64)
    report = tables.run_denoise(tmp_path, ["gates", "difficulty", "rounds"], (3, 5), protocol, "cpu:0", quiet=True)
    assert len(trained) == len(set(trained)) == 2 * (6 + 4 + 3)  # rounds' M = 1 and M = 2 come from the gates
    first = {name: trained.index(boosted_run(st, m, "mlp", 3).key)
             for name, st, m in (("difficulty", Setting(64, 16, 0.3), 1), ("rounds", Setting(64, 16, 0.5), 3))}
    assert seen_tables[first["difficulty"]] == ["gates"] and seen_tables[first["rounds"]] == ["difficulty", "gates"]
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["seeds"] == [3, 5] and set(written["tables"]) == {"difficulty", "gates", "rounds"}
    assert written["device"] == "cpu:0"  # the device the runs were given, not a default
    assert written["paper"] == json.loads(json.dumps(PAPER))  # the published numbers beside ours
    for st in (Setting(64, 16, 0.5), Setting(64, 16, 0.3), Setting(128, 32, 0.3)):
        accuracy, stderr = bayes_optimal_accuracy(make_patterns(st, 7), st.sigma, 2000)
        assert report["bayes"][st.key] == {"accuracy": accuracy, "stderr": stderr, "queries": 2000}
    markdown = (tmp_path / "results.md").read_text()
    assert written["finished"] is True and written["experiments"] == ["gates", "difficulty", "rounds"]
    assert "Unfinished" not in markdown
    assert "Seeds 3, 5 · 150 steps of 64 fresh queries ·" in markdown and "(Monte Carlo, 2,000 queries)" in markdown
    assert "· device cpu:0 ·" in markdown
    assert "· patterns seed 7 ·" in markdown  # the protocol's, not the default 42
    assert markdown.count("ours (mean ± std, 2 seeds)") == 4  # rounds, gates, difficulty M = 1 and M = 2
    assert "300 fresh queries" in markdown and (tmp_path / "rounds.png").stat().st_size > 10_000
    assert "(the best of three evaluations on fresh queries is reported, as the authors do)" in markdown
    # --steps 2 evaluates at steps 1 and 2 only: the footer said "the best of three evaluations" all the same.
    report = tables.run_denoise(tmp_path, ["rounds"], (3,), Protocol(steps=2, bayes_queries=100), quiet=True)
    assert "Seeds 3 · 2 steps of 512 fresh queries ·" in (tmp_path / "results.md").read_text()
    assert ("(the better of two evaluations on fresh queries is reported, where the authors report the best of "
            "three)") in (tmp_path / "results.md").read_text()
    report["eval_steps"] = Protocol(steps=1).eval_steps  # --steps 1: one evaluation
    assert ("(the one evaluation on fresh queries is reported, where the authors report the best of three)"
            in tables.results_markdown(report))


def test_a_seed_given_twice_counts_once(tmp_path, monkeypatch):
    """`--seeds 1 1` reported '1.0 ± 0.0 (2 seeds)': one run counted as two replicates with no spread."""
    from gbattn.synthetic import tables

    runs, _ = fake_runs((3, 5))
    monkeypatch.setattr(tables, "train_run", lambda spec, protocol, device: runs[spec.key])
    report = tables.run_denoise(tmp_path, ["rounds"], (5, 3, 5), Protocol(bayes_queries=100), quiet=True)
    assert report["seeds"] == [5, 3] and {row["ours"]["n"] for row in report["tables"]["rounds"]["rows"]} == {2}
    assert "Seeds 5, 3 ·" in (tmp_path / "results.md").read_text()
    assert main(["denoise", "--out", str(tmp_path / "cli"), "--experiments", "rounds", "--seeds", "3", "3",
                 "--steps", "1", "--quiet"]) == 0
    assert json.loads((tmp_path / "cli" / "results.json").read_text())["seeds"] == [3]

def test_a_call_stopped_between_its_tables_and_its_figure_leaves_no_figure_of_another_call(tmp_path, monkeypatch,
                                                                                              capsys):
    """A second call into one --out stopped after drawing its rounds.png and before writing its tables (SIGINT,
    SIGTERM or kill -9 at the results.json write) left its figure (30 steps, other accuracies) beside the first
    call's tables (20 steps), which nothing said. The earlier figure goes before the new tables, and the new one is
    drawn after them: stopped in between, the tables are one call's and no figure is another's."""
    from gbattn.synthetic import tables

    runs, _ = fake_runs((0,))
    monkeypatch.setattr(tables, "train_run", lambda spec, protocol, device: runs[spec.key])
    out = tmp_path / "d"
    first = ["denoise", "--out", str(out), "--experiments", "rounds", "--seeds", "0", "--quick", "--quiet"]
    assert main(first) == 0 and (out / "rounds.png").is_file()
    recorded = (out / "results.json").read_text()
    real_write_results, real_plot_rounds = tables.write_results, tables.plot_rounds

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    for stop_at in ("write_results", "plot_rounds"):
        monkeypatch.setattr(tables, stop_at, stopped)
        assert main([*first[:-2], "--steps", "30", "--quiet"]) == 130
        capsys.readouterr()
        if stop_at == "write_results":  # the first call's tables, its figure gone (drawn of them, but no longer
            assert (out / "results.json").read_text() == recorded  # known to be: the next call would replace it)
        else:  # this call's tables, its figure not drawn
            assert json.loads((out / "results.json").read_text())["protocol"]["steps"] == 30
        assert not (out / "rounds.png").exists()
        monkeypatch.setattr(tables, "write_results", real_write_results)
        monkeypatch.setattr(tables, "plot_rounds", real_plot_rounds)
        assert main(first) == 0 and (out / "rounds.png").is_file()
        recorded = (out / "results.json").read_text()


def test_cli_threads_output_checks_and_printed_files(tmp_path, monkeypatch, capsys):
    """--threads sets torch's thread count for the run, and results.json records it; an --out that is a file
    is refused before any training; the closing line names rounds.png only when the rounds table was made."""
    from gbattn.synthetic import tables

    threads, real_run_denoise = [], tables.run_denoise
    monkeypatch.setattr(tables, "run_denoise", lambda out, experiments, *rest: threads.append(
        torch.get_num_threads()) or {"tables": dict.fromkeys(experiments), "wall_seconds": 0.0})
    out = tmp_path / "d"
    assert main(["denoise", "--out", str(out), "--threads", "2", "--experiments", "deq", "--quiet"]) == 0
    assert threads == [2] and "rounds.png" not in capsys.readouterr().out
    assert main(["denoise", "--out", str(out), "--experiments", "rounds", "--quiet"]) == 0
    assert threads == [2, 1] and "results.md, rounds.png" in capsys.readouterr().out
    # For real (training stubbed): the rounds figure of an earlier call goes when the tables no longer hold it; a
    # rounds.pdf beside it stays (denoise writes none: a user's, deleted once with the figure's PDF).
    out.mkdir()
    (out / "rounds.pdf").write_bytes(b"my figure")
    runs, _ = fake_runs((0,))
    monkeypatch.setattr(tables, "run_denoise", real_run_denoise)
    monkeypatch.setattr(tables, "train_run", lambda spec, protocol, device: runs[spec.key])
    for experiments, figure in ((["rounds"], True), (["deq"], False)):
        assert main(["denoise", "--out", str(out), "--experiments", *experiments, "--seeds", "0", "--quick",
                     "--threads", "2"]) == 0
        assert (out / "rounds.png").exists() == figure
        assert json.loads((out / "results.json").read_text())["torch_threads"] == 2  # the run's, recorded
    assert (out / "rounds.pdf").read_bytes() == b"my figure"
    (tmp_path / "file").write_text("")
    assert main(["denoise", "--out", str(tmp_path / "file"), "--quiet"]) == 2 and len(threads) == 2
    assert "is a file" in capsys.readouterr().err


def test_rounds_figure_draws_each_rounds_mean_and_std(tmp_path, monkeypatch):
    """The error bars are each row's std over seeds (0 for one seed), at each row's mean; the title names the
    training steps (a 20-step run's figure, without the paper's lines, read like the paper's 150-step one)."""
    import matplotlib.axes

    calls, titles = [], []
    real_errorbar, real_set_title = matplotlib.axes.Axes.errorbar, matplotlib.axes.Axes.set_title
    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar", lambda self, x, y, **kw: calls.append((x, y, kw)) or
                        real_errorbar(self, x, y, **kw))
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", lambda self, text, **kw: titles.append(text) or
                        real_set_title(self, text, **kw))
    rows = [{"rounds": 1, "ours": {"mean": 40.0, "std": 1.5, "n": 2}, "paper_v1": 41.3, "paper_revision": 46.0},
            {"rounds": 2, "ours": {"mean": 50.0, "std": None, "n": 2}, "paper_v1": 53.3, "paper_revision": 55.5}]
    plot_rounds({"rows": rows, "bayes": 58.0, "chance": 6.25}, tmp_path / "rounds.png", 1500, published=False)
    [(x, y, kw)] = calls
    assert (x, y, kw["yerr"], kw["label"]) == ([1, 2], [40.0, 50.0], [1.5, 0.0], "ours (mean ± std, 2 seeds)")
    assert titles[-1].endswith("(d=64, K=16, σ=0.5; 1,500 training steps per run)"), titles
    assert (tmp_path / "rounds.png").stat().st_size > 10_000
    for r in rows:
        r["ours"]["n"] = 1
    plot_rounds({"rows": rows, "bayes": 58.0, "chance": 6.25}, tmp_path / "rounds.png", 150)
    assert calls[-1][2]["label"] == "ours (1 seed)"  # one value per row, not a mean and a spread


def test_rounds_figure_draws_each_reference_line_at_its_own_values(tmp_path, monkeypatch):
    """The paper's rows, the Bayes-optimal ceiling and chance are each drawn at their own numbers beside their
    own labels (a ceiling line drawn at chance's height kept the label that named the ceiling's value)."""
    from gbattn.synthetic import tables

    figures = []
    monkeypatch.setattr(tables, "write_figure", lambda fig, path: figures.append(fig))
    rows = [{"rounds": 1, "ours": {"mean": 40.0, "std": 1.5, "n": 2}, "paper_v1": 41.3, "paper_revision": 46.0},
            {"rounds": 2, "ours": {"mean": 50.0, "std": 0.5, "n": 2}, "paper_v1": 53.3, "paper_revision": 55.5}]
    plot_rounds({"rows": rows, "bayes": 58.0, "chance": 6.25}, tmp_path / "rounds.png", 150)
    [fig] = figures
    lines = {line.get_label(): [float(y) for y in line.get_ydata()] for line in fig.axes[0].get_lines()
             if not line.get_label().startswith("_")}
    assert lines == {"paper (revision)": [46.0, 55.5], "paper (v1)": [41.3, 53.3],
                     "Bayes-optimal (58.0%)": [58.0, 58.0], "chance 1/K (6.25%)": [6.25, 6.25]}
    # accuracy on the full 0-100% scale (a run's figure comparable with another's), a tick at each rounds count
    assert fig.axes[0].get_ylim() == (0.0, 100.0) and list(fig.axes[0].get_xticks()) == [1, 2]


def test_rounds_figure_legend_covers_no_point(tmp_path, monkeypatch):
    """The legend sat at the lower right, over the points of a short run (accuracies near 20-30%)."""
    import matplotlib.figure

    covered = []
    real_savefig = matplotlib.figure.Figure.savefig

    def savefig(fig, *args, **kwargs):
        fig.canvas.draw()
        ax = fig.axes[0]
        box = ax.get_legend().get_window_extent()
        points = [ax.transData.transform(xy) for line in ax.get_lines() for xy in line.get_xydata()
                  if line.get_transform() == ax.transData]  # (not chance and Bayes, lines across the axes)
        covered.extend(tuple(p) for p in points if box.contains(*p))
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    for accuracies in ([17.5, 27.0, 24.5, 26.5, 32.0], [50.0, 55.0, 56.0, 57.0, 57.5]):
        rows = [{"rounds": m, "ours": {"mean": a, "std": 1.0, "n": 2}, "paper_v1": 41.3 + m, "paper_revision": 46.0 + m}
                for m, a in enumerate(accuracies, 1)]
        plot_rounds({"rows": rows, "bayes": 58.2, "chance": 6.25}, tmp_path / "rounds.png", 150)
        assert covered == [], accuracies


def test_paper_numbers_only_beside_runs_of_the_papers_length(tmp_path, monkeypatch, capsys):
    """With training stubbed: 150 steps (the paper's) prints the paper's accuracies in every table and
    the figure; --steps 20 leaves them out of results.md, its tables and rounds.png, and says why
    (a 20-step run beside 41.3 / 46.0 / 78.9 read as a reproduction that failed)."""
    import matplotlib.figure

    from gbattn.synthetic import tables

    runs, _ = fake_runs((0,))
    monkeypatch.setattr(tables, "train_run", lambda spec, protocol, device: runs[spec.key])
    legends = []
    real_savefig = matplotlib.figure.Figure.savefig

    def savefig(fig, *args, **kwargs):
        legends.append([t.get_text() for t in fig.axes[0].get_legend().get_texts()])
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    published = ["41.3", "46.0", "48.2", "56.5", "+18.7", "+15.7", "78.9", "25.6", "| 58.1 |"]
    for steps, shown in ((150, True), (20, False), (200, False), (1, False)):  # a longer run is not the paper's either
        out = tmp_path / f"steps{steps}"
        tables.run_denoise(out, ["rounds", "gates", "difficulty", "deq"], (0,),
                           Protocol(steps=steps, bayes_queries=100), quiet=True)
        markdown = (out / "results.md").read_text()
        assert all((number in markdown) == shown for number in published), (steps, markdown)
        note = (f"Paper numbers omitted: these runs trained for {steps} step{'s' * (steps != 1)}, not the 150 the "
                f"paper's accuracies are for.")
        assert (note in markdown) == (not shown) == (note in capsys.readouterr().out)
        assert ("paper (revision)" in legends[-1] and "paper (v1)" in legends[-1]) == shown, legends[-1]
        assert any(label.startswith("Bayes-optimal") for label in legends[-1])


def test_an_experiment_asked_for_twice_is_one_table(tmp_path, monkeypatch):
    """--experiments gates gates: one table, recorded once (results.json listed gates twice); results.md
    written after the last table, before the end, said "1 of 2 tables ( not yet run)" (or "1 of 1") though every
    table was there."""
    from gbattn.synthetic import tables

    runs, _ = fake_runs((0,))
    monkeypatch.setattr(tables, "train_run", lambda spec, protocol, device: runs[spec.key])
    written, real_markdown = [], tables.results_markdown
    monkeypatch.setattr(tables, "results_markdown", lambda report: written.append(real_markdown(report)) or written[-1])
    report = tables.run_denoise(tmp_path, ["gates", "gates"], (0,), Protocol(bayes_queries=100), quiet=True)
    assert report["experiments"] == ["gates"] and list(report["tables"]) == ["gates"]
    assert json.loads((tmp_path / "results.json").read_text())["experiments"] == ["gates"]
    assert len(written) == 2 and not any("not yet run" in markdown for markdown in written)


def test_a_directory_where_a_result_file_goes_is_refused_before_training(tmp_path, monkeypatch, capsys):
    """A folder named results.json, results.md or (with the rounds table) rounds.png in --out: the run trained
    its first table, then stopped with an IsADirectoryError traceback (exit 1); now one line, exit 2, nothing
    trained."""
    from gbattn.synthetic import tables

    monkeypatch.setattr(tables, "train_run", lambda *a: pytest.fail("trained"))
    for name in ("results.json", "results.md", "rounds.png"):
        out = tmp_path / name.replace(".", "-")
        (out / name).mkdir(parents=True)
        assert main(["denoise", "--out", str(out), "--experiments", "rounds", "deq", "--quiet"]) == 2
        err = capsys.readouterr().err
        assert err.strip().splitlines() == [f"gbattn: error: --out {out}: {name} there is a directory, where "
                                            f"gbattn denoise writes its {name}; remove it or use another --out"], err
    # rounds.png is only written with the rounds table: without it, a folder of that name is left alone
    runs, _ = fake_runs((0,))
    monkeypatch.setattr(tables, "train_run", lambda spec, protocol, device: runs[spec.key])
    out = tmp_path / "rounds-png"
    assert main(["denoise", "--out", str(out), "--experiments", "deq", "--seeds", "0", "--quick", "--quiet"]) == 0
    assert (out / "rounds.png").is_dir() and (out / "results.json").is_file()
    # a link to a folder is replaced by the file, as every result file's link is (the folder is left alone)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "results.json").symlink_to(tmp_path / "results-json", target_is_directory=True)
    assert main(["denoise", "--out", str(linked), "--experiments", "deq", "--seeds", "0", "--quick", "--quiet"]) == 0
    assert (linked / "results.json").is_file() and not (linked / "results.json").is_symlink()
    assert (tmp_path / "results-json" / "results.json").is_dir()


def test_a_stopped_run_leaves_no_figure_of_an_earlier_call(tmp_path, monkeypatch):
    """The figure was drawn (and an earlier call's removed) only at the end: a run stopped after its rounds
    table left the earlier call's rounds.png (another --steps, other seeds) beside its own tables, and one
    stopped before its rounds table, or one without it, left that figure beside tables that did not hold it."""
    from gbattn.synthetic import tables

    runs, _ = fake_runs((0,))

    def train(spec, protocol, device):
        if spec.kind == "deq":
            raise KeyboardInterrupt  # the run stopped here
        return runs[spec.key]

    monkeypatch.setattr(tables, "train_run", train)
    tables.run_denoise(tmp_path, ["rounds"], (0,), Protocol(steps=1, bayes_queries=100), quiet=True)
    earlier = (tmp_path / "rounds.png").read_bytes()
    with pytest.raises(KeyboardInterrupt):  # stopped after the rounds table: its own figure is there
        tables.run_denoise(tmp_path, ["rounds", "deq"], (0,), Protocol(steps=20, bayes_queries=100), quiet=True)
    assert json.loads((tmp_path / "results.json").read_text())["protocol"]["steps"] == 20
    assert (tmp_path / "rounds.png").read_bytes() != earlier
    with pytest.raises(KeyboardInterrupt):  # stopped before the rounds table: no figure beside the gates table
        tables.run_denoise(tmp_path, ["gates", "deq", "rounds"], (0,), Protocol(steps=1, bayes_queries=100),
                           quiet=True)
    assert list(json.loads((tmp_path / "results.json").read_text())["tables"]) == ["gates"]
    assert not (tmp_path / "rounds.png").exists()


def test_a_run_stopped_while_drawing_leaves_its_tables_without_the_earlier_figure(tmp_path, monkeypatch):
    """The rounds table was written before its figure was drawn (a second or two, the first time matplotlib
    loads): a run killed meanwhile left its own 20-step rounds table beside the earlier call's 1-step figure. The
    earlier figure goes before the new tables are written: stopped while drawing, the call leaves its tables and no
    figure (test_a_call_stopped_between_its_tables_and_its_figure_leaves_no_figure_of_another_call)."""
    from gbattn.synthetic import tables

    runs, _ = fake_runs((0,))
    monkeypatch.setattr(tables, "train_run", lambda spec, protocol, device: runs[spec.key])
    tables.run_denoise(tmp_path, ["rounds"], (0,), Protocol(steps=1, bayes_queries=100), quiet=True)
    earlier = {name: (tmp_path / name).read_bytes() for name in ("results.json", "results.md", "rounds.png")}

    def stopped_while_drawing(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(tables, "plot_rounds", stopped_while_drawing)
    with pytest.raises(KeyboardInterrupt):
        tables.run_denoise(tmp_path, ["rounds"], (0,), Protocol(steps=20, bayes_queries=100), quiet=True)
    assert json.loads((tmp_path / "results.json").read_text())["protocol"]["steps"] == 20
    assert not (tmp_path / "rounds.png").exists() and (tmp_path / "results.md").read_bytes() != earlier["results.md"]


def test_denoise_announces_its_runs_and_their_time_unless_quiet(tmp_path, monkeypatch, capsys):
    """Before training, one line on stderr names the runs (a run two tables share counted once) and estimates their
    time (0.55 s per run of 150 steps, scaled by the steps); --quiet leaves it out, and every progress line."""
    from gbattn.synthetic import tables

    runs, _ = fake_runs((0,))
    monkeypatch.setattr(tables, "train_run", lambda spec, protocol, device: runs[spec.key])
    tables.run_denoise(tmp_path / "loud", ["gates", "deq"], (0,), Protocol(steps=300, bayes_queries=100), quiet=False)
    plan = capsys.readouterr().err.splitlines()[0]
    # 6 gates runs and 12 DEQ ones, the M = 1 model at d=64, K=16, sigma=0.5 in both: 17 runs, 17 x 0.55 s x 300 / 150
    assert plan == (f"gbattn denoise: 17 training runs (gates, deq; seeds [0]; 300 steps each; device cpu; torch "
                    f"threads {torch.get_num_threads()}); about 19 s on one idle CPU thread")
    tables.run_denoise(tmp_path / "quiet", ["gates"], (0,), Protocol(steps=300, bayes_queries=100), quiet=True)
    assert capsys.readouterr().err == ""


def test_results_record_the_protocols_initial_beta(tmp_path, monkeypatch):
    """results.json's "init" said "log beta = log 2.0" whatever Protocol.beta_init the models were built with."""
    from gbattn.synthetic import tables

    runs, _ = fake_runs((0,))
    monkeypatch.setattr(tables, "train_run", lambda spec, protocol, device: runs[spec.key])
    for beta in (2.0, 3.5):
        report = tables.run_denoise(tmp_path, ["gates"], (0,), Protocol(bayes_queries=100, beta_init=beta), quiet=True)
        assert report["init"] == f"PyTorch default nn.Linear init; log beta = log {beta}"
        assert json.loads((tmp_path / "results.json").read_text())["protocol"]["beta_init"] == beta


def test_results_say_which_software_and_hardware_made_them(tmp_path, monkeypatch):
    """results.json and results.md named the command and the protocol but not the gbattn, torch and Python
    versions nor the hardware, though the accuracies are those of one torch's random streams and kernels."""
    import platform

    import gbattn
    from gbattn.runtime import device_name
    from gbattn.synthetic import tables

    runs, _ = fake_runs((0,))
    monkeypatch.setattr(tables, "train_run", lambda spec, protocol, device: runs[spec.key])
    tables.run_denoise(tmp_path, ["gates"], (0,), Protocol(bayes_queries=100), quiet=True)
    report = json.loads((tmp_path / "results.json").read_text())
    versions = {"gbattn": gbattn.__version__, "torch": torch.__version__, "python": platform.python_version()}
    hardware = device_name(torch.device("cpu"))
    assert report["versions"] == versions and report["hardware"] == hardware
    assert (f" · gbattn {gbattn.__version__} · torch {torch.__version__} · Python {platform.python_version()} · "
            f"{hardware}\n") in (tmp_path / "results.md").read_text()
    # The command given and the hardware of the runs' device (not the CPU's whatever the device was) are recorded.
    monkeypatch.setattr(tables, "device_name", lambda device: f"hardware of {device}")
    tables.run_denoise(tmp_path, ["gates"], (0,), Protocol(bayes_queries=100), "cpu:0", True, "gbattn denoise --out d")
    report = json.loads((tmp_path / "results.json").read_text())
    assert (report["command"], report["hardware"]) == ("gbattn denoise --out d", "hardware of cpu:0")
    assert "Command: `gbattn denoise --out d`" in (tmp_path / "results.md").read_text()


def test_readme_denoise_section_names_every_option():
    """README's "Synthetic pattern denoising" listed --seeds, --experiments, --steps and --device but not
    --eval-queries, --threads or --quiet, which `gbattn denoise --help` offers."""
    import argparse

    from gbattn.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    options = {o for action in commands["denoise"]._actions for o in action.option_strings} - {"-h", "--help"}
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Synthetic pattern denoising\n")[1].split("\n## ")[0]
    assert sorted(o for o in options if f"`{o}" not in section) == []
