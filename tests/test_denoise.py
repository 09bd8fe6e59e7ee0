"""`gbattn denoise`: the synthetic pattern-denoising task (docs/method.md §9)."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from gbattn.cli import main
from gbattn.errors import UserError
from gbattn.synthetic.models import EquilibriumDenoiser, PatternDenoiser, fixed_point
from gbattn.synthetic.tables import plot_rounds
from gbattn.synthetic.task import Protocol, Setting, bayes_optimal_accuracy, make_patterns, sample_queries
from gbattn.synthetic.training import boosted_run, denoise_loss, train_run

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bayes_optimal_antipodal_patterns_is_phi_of_one_over_sigma():
    # Patterns +e1 and -e1: the nearest one is right iff 1 + sigma * n_1 > 0, so accuracy = Phi(1 / sigma).
    patterns_KD = torch.tensor([[1.0, 0.0, 0.0], [-1.0, 0.0, 0.0]])
    for sigma in (0.5, 1.0, 2.0):
        accuracy, stderr = bayes_optimal_accuracy(patterns_KD, sigma, 200_000, seed=1)
        exact = 0.5 * (1 + math.erf(1 / sigma / math.sqrt(2)))
        assert abs(accuracy - exact) < 4 * stderr + 1e-4, (sigma, accuracy, exact)


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
    assert "| Bayes-optimal" in markdown and "| chance (1/K)" in markdown and "41.3" in markdown
    assert (out / "rounds.png").stat().st_size > 10_000


def test_missing_matplotlib_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    table = {"rows": [], "bayes": 58.0, "chance": 6.25}
    with pytest.raises(UserError, match="matplotlib"):
        plot_rounds(table, tmp_path / "rounds.png")


def test_a_run_reports_its_best_evaluation_on_held_out_queries(monkeypatch):
    """The protocol reports the best of its evaluations (not the last), each on queries of their own
    stream: never the queries the model was trained on."""
    from gbattn.synthetic import training

    drawn = []
    real_sample = training.sample_queries
    monkeypatch.setattr(training, "sample_queries", lambda *a: drawn.append(real_sample(*a)) or drawn[-1])
    protocol = Protocol(steps=3, batch=8, eval_queries=8, n_evals=3)
    result = train_run(boosted_run(Setting(8, 4, 0.5), 1, None, 0), protocol)
    assert len(drawn) == 6  # step 1, eval, step 2, eval, step 3, eval
    train_queries = [drawn[i][0] for i in (0, 2, 4)]
    for q_eval in (drawn[i][0] for i in (1, 3, 5)):
        assert not any(torch.equal(q_eval, q) for q in train_queries)
    assert result["accuracy"] == max(result["evals"].values())

    scores = iter([0.5, 0.4, 0.3])
    monkeypatch.setattr(training, "evaluate", lambda *a: next(scores))
    result = train_run(boosted_run(Setting(8, 4, 0.5), 1, None, 0), protocol)
    assert result["evals"] == {1: 0.5, 2: 0.4, 3: 0.3} and result["accuracy"] == 0.5


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
    # A relative residual exactly at the tolerance stops the iteration and counts as converged.
    _, stats = fixed_point(lambda z: torch.full_like(z, 2.0), torch.ones(3, 1), tol=0.5, max_iter=10)
    assert (stats.iterations, stats.converged) == (1, 1.0)


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
    initialisation, not only in their data)."""
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
        train_run(boosted_run(Setting(8, 4, 0.5), 1, None, seed), protocol)
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
    paper's protocol and seeds 0, 1, 2; --eval-queries and --steps override either."""
    from gbattn.synthetic import tables

    calls = []
    monkeypatch.setattr(tables, "run_denoise", lambda out, experiments, seeds, protocol, *rest:
                        calls.append((list(experiments), list(seeds), protocol)) or
                        {"tables": {}, "wall_seconds": 0.0})
    out = str(tmp_path / "d")
    assert main(["denoise", "--out", out, "--quiet"]) == 0
    assert main(["denoise", "--quick", "--out", out, "--quiet"]) == 0
    assert main(["denoise", "--quick", "--out", out, "--eval-queries", "300", "--steps", "7",
                 "--experiments", "deq", "--quiet"]) == 0
    (full, full_seeds_protocol), quick, explicit = calls[0][1:], calls[1], calls[2]
    assert full == [0, 1, 2] and full_seeds_protocol == Protocol() and calls[0][0] == ["rounds", "gates",
                                                                                        "difficulty", "deq"]
    assert quick[1] == [0] and quick[2] == Protocol(eval_queries=1000, bayes_queries=20_000)
    assert explicit[0] == ["deq"] and explicit[2] == Protocol(steps=7, eval_queries=300, bayes_queries=20_000)
