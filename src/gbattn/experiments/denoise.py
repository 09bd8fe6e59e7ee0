"""``gbattn denoise``: the paper's synthetic pattern-denoising experiments (SPEC.md section 2).

K unit-norm patterns in R^d are stored (fixed, seed 42); a query is a pattern plus N(0, sigma^2 I)
noise; the model must return (something nearest to) the clean pattern. The model is gbattn's own
GBA layer (:class:`gbattn.attention.boosted.BoostedAttention`, ``kv_source="input"``, a learned
inverse temperature per round, no output projection); :class:`PatternDenoiser` only maps a query
and the patterns to that layer's inputs (query = x, patterns = memory = keys and values).

Experiments (each a Markdown table beside the paper's numbers, with chance and the Bayes-optimal
ceiling): ``rounds`` (M = 1..5), ``gates`` (the gate ablation at M = 2), ``difficulty`` (M = 2 vs
M = 1 at two harder settings) and ``deq`` (one trained attention step vs the same attention
iterated to its fixed point and trained as a deep-equilibrium model with implicit gradients).

Protocol (the authors' code, SPEC.md section 2): 512 fresh queries per step, loss
``(1 - cos(output, target)) + 0.5 * cross_entropy(round-0 attention WEIGHTS used as logits, target)``,
Adam lr 3e-3, cosine annealing over 150 steps, gradient clipping 1.0, evaluation on 5,000 fresh
queries at steps 50, 100 and 150, the best of the three reported. No dropout.

Initialisation: SPEC.md names none for this task, so the bare layer keeps PyTorch's default
``nn.Linear`` init (uniform, +-1/sqrt(fan_in)), which is what the authors' standalone code used as
far as SPEC.md says; SPEC.md's N(0, 0.02) is applied by gbattn's GPT model, not here. log beta
starts at log 2, the gates as ``boosted.py`` initialises them (scalar logit 0.5, vector 0).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gbattn.attention import AttnArgs, build_attention
from gbattn.config import command_line
from gbattn.errors import UserError
from gbattn.progress import Progress

EXPERIMENTS = ("rounds", "gates", "difficulty", "deq")
GATES = ("mlp", "linear", "vector", "scalar", "none")
DEFAULT_GATE = "mlp"  # the authors' standalone module (SPEC.md section 2)
FULL_SEEDS = (0, 1, 2)
QUICK_SEEDS = (0,)
SECONDS_PER_RUN = 2.5  # measured: one 150-step run, averaged over the full run's models, one CPU thread


@dataclass(frozen=True)
class Setting:
    """One task: K patterns in R^d, noise sigma."""

    d: int
    K: int
    sigma: float

    @property
    def label(self) -> str:
        return f"d={self.d}, K={self.K}, sigma={self.sigma}"

    @property
    def key(self) -> str:
        return f"d{self.d}-K{self.K}-s{self.sigma}"

    @property
    def chance(self) -> float:
        return 1.0 / self.K


ROUNDS_SETTING = Setting(64, 16, 0.5)
ROUNDS = (1, 2, 3, 4, 5)
DIFFICULTY_SETTINGS = (Setting(64, 16, 0.3), Setting(128, 32, 0.3))
DEQ_SETTINGS = tuple(Setting(d, K, s) for d, K in ((16, 4), (32, 8), (64, 16)) for s in (0.5, 0.8))

# The paper's published numbers (accuracy %, SPEC.md section 2).
PAPER = {
    "rounds_v1": {1: 41.3, 2: 53.3, 3: 54.8, 4: 56.3, 5: 55.8},
    "rounds_revision": {1: 46.0, 2: 55.5, 3: 57.6, 4: 58.1, 5: 57.0},
    "bayes_revision": 58.1,
    "gates_revision": {"baseline": 48.2, "mlp": 55.6, "scalar": 56.5, "none": 55.4},
    "difficulty_delta": {"d64-K16-s0.3": 18.7, "d128-K32-s0.3": 15.7},
    "deq_one_step": {"d16-K4-s0.5": 78.9, "d16-K4-s0.8": 59.7, "d32-K8-s0.5": 59.8, "d32-K8-s0.8": 39.5,
                     "d64-K16-s0.5": 39.2, "d64-K16-s0.8": 22.9},
    "deq_converged": {"d16-K4-s0.5": 25.6, "d16-K4-s0.8": 25.6, "d32-K8-s0.5": 11.9, "d32-K8-s0.8": 11.9,
                      "d64-K16-s0.5": 5.6, "d64-K16-s0.8": 5.6},
}


@dataclass(frozen=True)
class Protocol:
    """Training and evaluation settings (SPEC.md section 2 unless marked)."""

    steps: int = 150
    batch: int = 512
    lr: float = 3e-3
    grad_clip: float = 1.0
    ce_weight: float = 0.5
    eval_queries: int = 5000
    n_evals: int = 3  # at steps/3, 2 steps/3, steps (50, 100, 150); the best is reported
    pattern_seed: int = 42
    beta_init: float = 2.0
    bayes_queries: int = 200_000  # Monte Carlo queries for the Bayes-optimal ceiling (ours)
    deq_tol: float = 1e-5  # relative residual ||f(z) - z|| / ||f(z)|| per query (ours)
    deq_max_iter: int = 200  # (ours)

    @property
    def eval_steps(self) -> list[int]:
        return sorted({max(1, round(self.steps * i / self.n_evals)) for i in range(1, self.n_evals + 1)})


# --------------------------------------------------------------------------------------
# The task
# --------------------------------------------------------------------------------------


def make_patterns(setting: Setting, seed: int = 42) -> Tensor:
    """K unit-norm Gaussian patterns (K, d), the same for every run of a setting (seed 42)."""
    generator = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(setting.K, setting.d, generator=generator), dim=-1)


def sample_queries(patterns_KD: Tensor, sigma: float, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """n noisy queries: (query (n, d), target index (n,)), targets uniform over the patterns."""
    K, d = patterns_KD.shape
    target_B = torch.randint(K, (n,), generator=generator)
    noise_BD = sigma * torch.randn(n, d, generator=generator)
    return patterns_KD.cpu()[target_B] + noise_BD, target_B


def nearest_pattern(x_BD: Tensor, patterns_KD: Tensor) -> Tensor:
    """Index of the Euclidean-nearest pattern of each row, (B,)."""
    return torch.cdist(x_BD, patterns_KD).argmin(dim=-1)


def bayes_optimal_accuracy(patterns_KD: Tensor, sigma: float, n_queries: int, seed: int = 0,
                           chunk: int = 50_000) -> tuple[float, float]:
    """Monte Carlo accuracy of the Bayes-optimal decoder: with known patterns, equal priors and
    isotropic Gaussian noise it is the nearest pattern to the noisy query itself (SPEC.md section 2).
    Returns (accuracy, its Monte Carlo standard error)."""
    generator = torch.Generator().manual_seed(seed)
    correct = 0
    for start in range(0, n_queries, chunk):
        query_BD, target_B = sample_queries(patterns_KD, sigma, min(chunk, n_queries - start), generator)
        correct += (nearest_pattern(query_BD, patterns_KD.cpu()) == target_B).sum().item()
    accuracy = correct / n_queries
    return accuracy, math.sqrt(max(accuracy * (1 - accuracy), 1e-12) / n_queries)


# --------------------------------------------------------------------------------------
# Models: thin wrappers around gbattn's GBA layer
# --------------------------------------------------------------------------------------


def boosted_layer(d: int, rounds: int, gate: str, beta_init: float) -> nn.Module:
    """gbattn's GBA layer as the synthetic task uses it (SPEC.md section 2): one head, no biases,
    K/V of every round projected from the patterns, learned beta per round, output = F."""
    return build_attention("boosted", AttnArgs(d_model=d, n_heads=1, dropout=0.0, bias=False),
                           {"rounds": rounds, "gate": gate, "kv_source": "input", "learned_beta": beta_init,
                            "out_proj": False})


class PatternDenoiser(nn.Module):
    """M-round GBA: query -> x (B, 1, d), the K patterns -> memory (keys and values of every round).

    Returns (output (B, d), round-0 attention weights (B, K)). The patterns go in as a (1, K, d)
    memory that broadcasts over the batch (identical to expanding them to (B, K, d); a test
    checks it), so their K/V projections are computed once per step, not B times.
    """

    def __init__(self, d: int, rounds: int, gate: str = DEFAULT_GATE, beta_init: float = 2.0) -> None:
        super().__init__()
        self.attn = boosted_layer(d, rounds, gate, beta_init)

    def forward(self, query_BD: Tensor, patterns_KD: Tensor) -> tuple[Tensor, Tensor]:
        y_B1D, record = self.attn(query_BD[:, None, :], memory=patterns_KD[None], causal=False,
                                  return_intermediates=True)
        return y_B1D[:, 0], record.probs[0][:, 0, 0]


@dataclass
class FixedPointStats:
    iterations: int
    residual_mean: float  # ||f(z) - z|| per query, averaged
    residual_max: float
    converged: float  # fraction of queries whose relative residual is within tolerance


def fixed_point(f, z0_BD: Tensor, tol: float, max_iter: int) -> tuple[Tensor, FixedPointStats]:
    """Plain fixed-point iteration z <- f(z) from z0 until every row's relative residual
    ||f(z) - z|| / ||f(z)|| is at most ``tol`` (or ``max_iter``). Returns the last f(z)."""
    z_BD = z0_BD
    for iteration in range(1, max_iter + 1):
        fz_BD = f(z_BD)
        residual_B = (fz_BD - z_BD).norm(dim=-1)
        relative_B = residual_B / fz_BD.norm(dim=-1).clamp_min(1e-12)
        z_BD = fz_BD
        if relative_B.max().item() <= tol:
            break
    residual_B = (f(z_BD) - z_BD).norm(dim=-1)
    stats = FixedPointStats(iteration, residual_B.mean().item(), residual_B.max().item(),
                            (relative_B <= tol).float().mean().item())
    return z_BD, stats


def attach_implicit_gradient(f, z_star_BD: Tensor, tol: float, max_iter: int) -> Tensor:
    """The standard PyTorch-only DEQ backward (Bai et al.; the implicit-layers tutorial):
    z = f(z*) re-enters autograd; a hook replaces the incoming gradient v by the solution g of
    the adjoint fixed point g = J_f(z*)^T g + v, so gradients are (I - J)^-T v (implicit function
    theorem), with no backpropagation through the forward iterations."""
    z_BD = f(z_star_BD.detach())
    if not z_BD.requires_grad:
        return z_BD
    z_in_BD = z_BD.detach().requires_grad_()
    f_in_BD = f(z_in_BD)

    def adjoint(grad_BD: Tensor) -> Tensor:
        g_BD = grad_BD
        for _ in range(max_iter):
            g_next_BD = torch.autograd.grad(f_in_BD, z_in_BD, g_BD, retain_graph=True)[0] + grad_BD
            done = (g_next_BD - g_BD).norm() <= tol * g_next_BD.norm().clamp_min(1e-30)
            g_BD = g_next_BD
            if done:
                break
        return g_BD

    z_BD.register_hook(adjoint)
    return z_BD


class EquilibriumDenoiser(nn.Module):
    """The negative result's model (SPEC.md section 2): f(z) = the same one-round attention with
    query z (memory = the patterns), iterated from z0 = the noisy query to its fixed point z* = f(z*),
    trained as a deep-equilibrium model with implicit gradients (:func:`attach_implicit_gradient`).

    Returns (z* (B, d), attention weights at z* (B, K)); the loss uses the weights of the
    attention step that produces the answer (one more application at z*, which changes nothing
    at the fixed point and keeps the gradient exact)."""

    def __init__(self, d: int, beta_init: float = 2.0, tol: float = 1e-5, max_iter: int = 200) -> None:
        super().__init__()
        self.step = PatternDenoiser(d, rounds=1, beta_init=beta_init)
        self.tol, self.max_iter = tol, max_iter
        self.last_stats: FixedPointStats | None = None

    def forward(self, query_BD: Tensor, patterns_KD: Tensor) -> tuple[Tensor, Tensor]:
        f = lambda z_BD: self.step(z_BD, patterns_KD)[0]  # noqa: E731
        with torch.no_grad():
            z_star_BD, self.last_stats = fixed_point(f, query_BD, self.tol, self.max_iter)
        if torch.is_grad_enabled():
            z_star_BD = attach_implicit_gradient(f, z_star_BD, self.tol, self.max_iter)
        return self.step(z_star_BD, patterns_KD)


# --------------------------------------------------------------------------------------
# Training (SPEC.md section 2)
# --------------------------------------------------------------------------------------


def denoise_loss(output_BD: Tensor, probs_BK: Tensor, target_B: Tensor, patterns_KD: Tensor,
                 ce_weight: float = 0.5) -> Tensor:
    """(1 - cosine(output, target pattern)) + 0.5 * cross_entropy(probs, target).

    The authors' quirk, kept: the round-0 attention WEIGHTS (already a softmax) are passed as the
    logits of the cross-entropy, so that term is a weak, bounded push towards the right pattern."""
    cosine = F.cosine_similarity(output_BD, patterns_KD[target_B], dim=-1)
    return (1 - cosine).mean() + ce_weight * F.cross_entropy(probs_BK, target_B)


@dataclass(frozen=True)
class RunSpec:
    """One training run. ``kind``: "boosted" (M rounds) or "deq"."""

    setting: Setting
    rounds: int = 1
    gate: str | None = None  # None for M = 1 (no gate) and the DEQ
    kind: str = "boosted"
    seed: int = 0

    @property
    def key(self) -> str:
        model = "deq" if self.kind == "deq" else f"M{self.rounds}" + (f"-{self.gate}" if self.gate else "")
        return f"{self.setting.key}-{model}-seed{self.seed}"


def boosted_run(setting: Setting, rounds: int, gate: str, seed: int) -> RunSpec:
    return RunSpec(setting, rounds, gate if rounds > 1 else None, "boosted", seed)


def build_model(spec: RunSpec, protocol: Protocol) -> nn.Module:
    if spec.kind == "deq":
        return EquilibriumDenoiser(spec.setting.d, protocol.beta_init, protocol.deq_tol, protocol.deq_max_iter)
    return PatternDenoiser(spec.setting.d, spec.rounds, spec.gate or "none", protocol.beta_init)


@torch.no_grad()
def evaluate(model: nn.Module, patterns_KD: Tensor, sigma: float, n: int, generator: torch.Generator,
             device: torch.device) -> float:
    """Accuracy on n fresh noisy queries: the output's Euclidean-nearest pattern is the target."""
    model.eval()
    query_BD, target_B = sample_queries(patterns_KD, sigma, n, generator)
    output_BD, _ = model(query_BD.to(device), patterns_KD)
    model.train()
    return (nearest_pattern(output_BD, patterns_KD).cpu() == target_B).float().mean().item()


def train_run(spec: RunSpec, protocol: Protocol, device: str | torch.device = "cpu") -> dict:
    """Train one model with the authors' protocol; the best of the evaluations is its accuracy."""
    device = torch.device(device)
    started = time.perf_counter()
    torch.manual_seed(spec.seed)
    model = build_model(spec, protocol).to(device)
    patterns_KD = make_patterns(spec.setting, protocol.pattern_seed).to(device)
    data = torch.Generator().manual_seed(10_000 + spec.seed)  # training batches
    held_out = torch.Generator().manual_seed(20_000 + spec.seed)  # evaluation queries
    optimizer = torch.optim.Adam(model.parameters(), lr=protocol.lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=protocol.steps)
    evals = {}
    for step in range(1, protocol.steps + 1):
        query_BD, target_B = sample_queries(patterns_KD, spec.setting.sigma, protocol.batch, data)
        output_BD, probs_BK = model(query_BD.to(device), patterns_KD)
        loss = denoise_loss(output_BD, probs_BK, target_B.to(device), patterns_KD, protocol.ce_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), protocol.grad_clip)
        optimizer.step()
        schedule.step()
        if step in protocol.eval_steps:
            evals[step] = evaluate(model, patterns_KD, spec.setting.sigma, protocol.eval_queries, held_out, device)
    result = {"key": spec.key, "setting": asdict(spec.setting), "rounds": spec.rounds, "gate": spec.gate,
              "kind": spec.kind, "seed": spec.seed, "accuracy": max(evals.values()), "evals": evals,
              "final_loss": loss.item(), "seconds": time.perf_counter() - started}
    if spec.kind == "deq":
        result["fixed_point"] = asdict(model.last_stats)  # of the last evaluation (eval_queries queries)
    return result


# --------------------------------------------------------------------------------------
# Experiments -> runs -> tables
# --------------------------------------------------------------------------------------


def experiment_runs(name: str, seeds) -> list[RunSpec]:
    """Every training run an experiment needs (runs shared between experiments are trained once)."""
    if name == "rounds":
        return [boosted_run(ROUNDS_SETTING, m, DEFAULT_GATE, s) for m in ROUNDS for s in seeds]
    if name == "gates":
        return [boosted_run(ROUNDS_SETTING, m, g, s) for m, g in [(1, None)] + [(2, g) for g in GATES] for s in seeds]
    if name == "difficulty":
        return [boosted_run(st, m, DEFAULT_GATE, s) for st in DIFFICULTY_SETTINGS for m in (1, 2) for s in seeds]
    if name == "deq":
        return [spec for st in DEQ_SETTINGS for s in seeds
                for spec in (boosted_run(st, 1, None, s), RunSpec(st, kind="deq", seed=s))]
    raise ValueError(name)


def experiment_settings(name: str) -> tuple[Setting, ...]:
    return {"rounds": (ROUNDS_SETTING,), "gates": (ROUNDS_SETTING,), "difficulty": DIFFICULTY_SETTINGS,
            "deq": DEQ_SETTINGS}[name]


def mean_std(values: list[float]) -> dict:
    """Mean and sample std (None with one value), in percent."""
    pct = [100 * v for v in values]
    return {"mean": statistics.fmean(pct), "std": statistics.stdev(pct) if len(pct) > 1 else None, "n": len(pct)}


def fmt(cell: dict | float | None, digits: int = 1, sign: bool = False) -> str:
    if cell is None:
        return "—"
    if not isinstance(cell, dict):
        return f"{cell:{'+' if sign else ''}.{digits}f}"
    text = f"{cell['mean']:{'+' if sign else ''}.{digits}f}"
    return text + (f" ± {cell['std']:.{digits}f}" if cell.get("std") is not None else "")


def summarise(name: str, runs: dict, bayes: dict, seeds) -> dict:
    """One experiment's table data from the finished runs."""
    acc = lambda spec_list: mean_std([runs[s.key]["accuracy"] for s in spec_list])  # noqa: E731

    def ceiling(st: Setting) -> dict:
        return {"chance": 100 * st.chance, "bayes": 100 * bayes[st.key]["accuracy"],
                "bayes_se": 100 * bayes[st.key]["stderr"]}

    if name == "rounds":
        rows = [{"rounds": m, "ours": acc([boosted_run(ROUNDS_SETTING, m, DEFAULT_GATE, s) for s in seeds]),
                 "paper_v1": PAPER["rounds_v1"][m], "paper_revision": PAPER["rounds_revision"][m]} for m in ROUNDS]
        return {"setting": asdict(ROUNDS_SETTING), "gate": DEFAULT_GATE, "rows": rows, **ceiling(ROUNDS_SETTING)}
    if name == "gates":
        rows = [{"gate": "baseline", "ours": acc([boosted_run(ROUNDS_SETTING, 1, None, s) for s in seeds]),
                 "paper_revision": PAPER["gates_revision"]["baseline"]}]
        rows += [{"gate": g, "ours": acc([boosted_run(ROUNDS_SETTING, 2, g, s) for s in seeds]),
                  "paper_revision": PAPER["gates_revision"].get(g)} for g in GATES]
        return {"setting": asdict(ROUNDS_SETTING), "rows": rows, **ceiling(ROUNDS_SETTING)}
    if name == "difficulty":
        columns = []
        for st in DIFFICULTY_SETTINGS:
            one = [runs[boosted_run(st, 1, None, s).key]["accuracy"] for s in seeds]
            two = [runs[boosted_run(st, 2, DEFAULT_GATE, s).key]["accuracy"] for s in seeds]
            columns.append({"setting": asdict(st), "key": st.key, "m1": mean_std(one), "m2": mean_std(two),
                            "delta": mean_std([b - a for a, b in zip(one, two)]),  # paired by seed
                            "paper_delta": PAPER["difficulty_delta"][st.key], **ceiling(st)})
        return {"gate": DEFAULT_GATE, "columns": columns}
    if name == "deq":
        columns = []
        for st in DEQ_SETTINGS:
            deq = [runs[RunSpec(st, kind="deq", seed=s).key] for s in seeds]
            columns.append({"setting": asdict(st), "key": st.key,
                            "one_step": acc([boosted_run(st, 1, None, s) for s in seeds]),
                            "converged": mean_std([r["accuracy"] for r in deq]),
                            "paper_one_step": PAPER["deq_one_step"][st.key],
                            "paper_converged": PAPER["deq_converged"][st.key],
                            "residual_max": max(r["fixed_point"]["residual_max"] for r in deq),
                            "residual_mean": statistics.fmean(r["fixed_point"]["residual_mean"] for r in deq),
                            "converged_fraction": min(r["fixed_point"]["converged"] for r in deq),
                            "iterations_max": max(r["fixed_point"]["iterations"] for r in deq), **ceiling(st)})
        return {"columns": columns}
    raise ValueError(name)


def seeds_text(n: int) -> str:
    return f"{n} seed{'s' if n > 1 else ''}"


def chance_cell(percent: float) -> str:
    return f"{round(percent, 2):g}"  # 6.25, 12.5, 25, 3.12


def bayes_cell(table: dict) -> str:
    return f"{table['bayes']:.1f} ± {table['bayes_se']:.1f} (MC s.e.)"


def table_markdown(name: str, table: dict, n_seeds: int) -> str:
    """The Markdown table of one experiment, ours beside the paper's."""
    ours = f"ours (mean ± std, {seeds_text(n_seeds)})"
    if name == "rounds":
        lines = [f"### Accuracy vs rounds M (d=64, K=16, sigma=0.5, gate {table['gate']}), accuracy %", "",
                 f"| rounds M | {ours} | paper v1 | paper revision |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| {r['rounds']} | {fmt(r['ours'])} | {fmt(r['paper_v1'])} | {fmt(r['paper_revision'])} |"
                  for r in table["rows"]]
        chance = chance_cell(table["chance"])
        lines += [f"| chance (1/K) | {chance} | {chance} | {chance} |",
                  f"| Bayes-optimal (nearest true pattern) | {bayes_cell(table)} | — | {PAPER['bayes_revision']:.1f} |"]
    elif name == "gates":
        lines = ["### Gate ablation at M = 2 (d=64, K=16, sigma=0.5), accuracy %", "",
                 f"| gate | {ours} | paper revision |", "| --- | ---: | ---: |"]
        for r in table["rows"]:
            label = "one-round baseline (M = 1)" if r["gate"] == "baseline" else r["gate"]
            lines.append(f"| {label} | {fmt(r['ours'])} | {fmt(r['paper_revision'])} |")
        lines += [f"| chance (1/K) | {chance_cell(table['chance'])} | {chance_cell(table['chance'])} |",
                  f"| Bayes-optimal (nearest true pattern) | {bayes_cell(table)} | {PAPER['bayes_revision']:.1f} |"]
    elif name == "difficulty":
        cols = table["columns"]
        head = " | ".join(Setting(**c["setting"]).label for c in cols)
        row = lambda label, cells: f"| {label} | " + " | ".join(cells) + " |"  # noqa: E731
        lines = [f"### Difficulty scaling: M = 2 (gate {table['gate']}) vs M = 1, accuracy %", "",
                 f"| | {head} |", "| --- |" + " ---: |" * len(cols),
                 row(f"M = 1, {ours}", [fmt(c["m1"]) for c in cols]),
                 row(f"M = 2, {ours}", [fmt(c["m2"]) for c in cols]),
                 row("gain M = 2 − M = 1, ours (points)", [fmt(c["delta"], sign=True) for c in cols]),
                 row("gain, paper (points)", [fmt(c["paper_delta"], sign=True) for c in cols]),
                 row("chance (1/K)", [chance_cell(c["chance"]) for c in cols]),
                 row("Bayes-optimal (nearest true pattern)", [bayes_cell(c) for c in cols])]
    elif name == "deq":
        cols = table["columns"]
        row = lambda label, cells: f"| {label} | " + " | ".join(cells) + " |"  # noqa: E731
        lines = ["### One trained attention step vs the same attention iterated to its fixed point (DEQ), accuracy %",
                 "", row("d, K", [f"{c['setting']['d']}, {c['setting']['K']}" for c in cols]),
                 "| --- |" + " ---: |" * len(cols),
                 row("sigma", [f"{c['setting']['sigma']}" for c in cols]),
                 row(f"one step (trained), {ours}", [fmt(c["one_step"]) for c in cols]),
                 row("one step (trained), paper", [fmt(c["paper_one_step"]) for c in cols]),
                 row(f"converged (trained DEQ), {ours}", [fmt(c["converged"]) for c in cols]),
                 row("converged (trained DEQ), paper", [fmt(c["paper_converged"]) for c in cols]),
                 row("max residual ‖f(z*) − z*‖ (ours)", [f"{c['residual_max']:.1e}" for c in cols]),
                 row("max forward iterations (ours)", [str(c["iterations_max"]) for c in cols]),
                 row("chance (1/K)", [chance_cell(c["chance"]) for c in cols]),
                 row("Bayes-optimal (nearest true pattern)", [bayes_cell(c) for c in cols])]
    else:
        raise ValueError(name)
    return "\n".join(lines)


def plot_rounds(table: dict, path: Path) -> None:
    """Accuracy vs rounds with error bars (std over seeds), the paper's rows, chance and Bayes-optimal."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise UserError("the figure needs matplotlib: pip install 'gbattn[plot]'") from e
    rows = table["rows"]
    rounds = [r["rounds"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.errorbar(rounds, [r["ours"]["mean"] for r in rows], yerr=[r["ours"]["std"] or 0.0 for r in rows],
                marker="o", capsize=4, label=f"ours (mean ± std, {seeds_text(rows[0]['ours']['n'])})")
    ax.plot(rounds, [r["paper_revision"] for r in rows], "s--", alpha=0.7, label="paper (revision)")
    ax.plot(rounds, [r["paper_v1"] for r in rows], "^:", alpha=0.7, label="paper (v1)")
    ax.axhline(table["bayes"], color="black", linestyle="-", linewidth=1,
               label=f"Bayes-optimal ({table['bayes']:.1f}%)")
    ax.axhline(table["chance"], color="grey", linestyle="--", linewidth=1,
               label=f"chance 1/K ({chance_cell(table['chance'])}%)")
    ax.set_xticks(rounds)
    ax.set_xlabel("attention rounds M (count)")
    ax.set_ylabel("denoising accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Pattern denoising: accuracy vs rounds (d=64, K=16, σ=0.5)")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------


def run_denoise(out_dir: str | Path, experiments=EXPERIMENTS, seeds=FULL_SEEDS, protocol: Protocol = Protocol(),
                device: str = "cpu", quiet: bool = False, command: str = "") -> dict:
    """Train every run the experiments need, print each table when its runs are done, and write
    ``results.json``, ``results.md`` and (with ``rounds``) ``rounds.png`` into ``out_dir``."""
    started = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if "rounds" in experiments:  # fail before training, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError as e:
            raise UserError("the rounds figure needs matplotlib: pip install 'gbattn[plot]'") from e
    plans = {name: experiment_runs(name, seeds) for name in experiments}
    todo = list(dict.fromkeys(spec for specs in plans.values() for spec in specs))
    settings = list(dict.fromkeys(st for name in experiments for st in experiment_settings(name)))
    bar = Progress(len(todo), desc="denoise", unit="run", disable=quiet, interval=10)
    bar.write(f"gbattn denoise: {len(todo)} training runs ({', '.join(experiments)}; seeds {list(seeds)}; "
              f"{protocol.steps} steps each; device {device}; torch threads {torch.get_num_threads()}); "
              f"about {len(todo) * SECONDS_PER_RUN * protocol.steps / 150 / 60:.0f} min on one CPU core")

    bayes = {}
    for st in settings:
        acc, se = bayes_optimal_accuracy(make_patterns(st, protocol.pattern_seed), st.sigma, protocol.bayes_queries)
        bayes[st.key] = {"accuracy": acc, "stderr": se, "queries": protocol.bayes_queries}

    report = {"command": command, "protocol": asdict(protocol), "eval_steps": protocol.eval_steps,
              "seeds": list(seeds), "device": device, "torch_threads": torch.get_num_threads(),
              "init": "PyTorch default nn.Linear init; log beta = log 2.0", "bayes": bayes, "paper": PAPER,
              "tables": {}, "markdown": {}, "runs": {}}
    runs = report["runs"]
    for name, specs in plans.items():
        for spec in specs:
            if spec.key in runs:
                continue
            runs[spec.key] = train_run(spec, protocol, device)
            bar.update(1, last=f"{spec.key} {100 * runs[spec.key]['accuracy']:.1f}%")
        report["tables"][name] = summarise(name, runs, bayes, seeds)
        report["markdown"][name] = table_markdown(name, report["tables"][name], len(seeds))
        bar.write("")
        print(report["markdown"][name] + "\n", flush=True)
        report["wall_seconds"] = time.perf_counter() - started
        write_results(out, report)
    bar.close()
    if "rounds" in report["tables"]:
        plot_rounds(report["tables"]["rounds"], out / "rounds.png")
    report["wall_seconds"] = time.perf_counter() - started
    write_results(out, report)
    return report


def write_results(out: Path, report: dict) -> None:
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
    tmp.replace(out / "results.json")
    (out / "results.md").write_text(results_markdown(report), encoding="utf-8")


def results_markdown(report: dict) -> str:
    p = report["protocol"]
    lines = ["# Synthetic pattern denoising (SPEC.md section 2)", "",
             f"Command: `{report['command']}`  ",
             f"Seeds {', '.join(map(str, report['seeds']))} · {p['steps']} steps of {p['batch']} fresh queries · "
             f"best of evaluations at steps {', '.join(map(str, report['eval_steps']))} on {p['eval_queries']:,} "
             f"fresh queries · patterns seed {p['pattern_seed']} · device {report['device']} · "
             f"wall-clock {report.get('wall_seconds', 0) / 60:.1f} min", ""]
    for text in report["markdown"].values():
        lines += [text, ""]
    lines += ["Bayes-optimal: the nearest true pattern to the noisy query (Monte Carlo, "
              f"{p['bayes_queries']:,} queries); no model can beat it except by evaluation noise "
              "(the best of three evaluations on fresh queries is reported, as the authors do).", ""]
    return "\n".join(lines)


def register(sub) -> None:
    p = sub.add_parser("denoise", help="the paper's synthetic pattern-denoising tables (SPEC.md section 2)",
                       description="Train gbattn's GBA layer on the synthetic pattern-denoising task and print "
                       "the paper's tables (rounds, gate ablation, difficulty, DEQ) with chance and the "
                       "Bayes-optimal ceiling. The full run (72 training runs: 3 seeds x 24 models) takes about "
                       "3 minutes on 2 shared CPU cores; --quick (1 seed, 24 runs) about 1-1.5 minutes.")
    p.add_argument("--quick", action="store_true",
                   help=f"seed {QUICK_SEEDS[0]} only, 1,000 queries per evaluation, 20,000 Bayes queries")
    p.add_argument("--out", default="runs/denoise", help="output directory (default runs/denoise)")
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help=f"default {list(FULL_SEEDS)} ({list(QUICK_SEEDS)} with --quick)")
    p.add_argument("--experiments", nargs="+", choices=EXPERIMENTS, default=None, help="default: all")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 150, the paper's)")
    p.add_argument("--eval-queries", type=int, default=None, help="fresh queries per evaluation (default 5000)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: the matrices are tiny, more threads only add overhead)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=cmd_denoise)


def cmd_denoise(args) -> None:
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {args.device}: CUDA is not available")
    if args.steps is not None and args.steps < 1:
        raise UserError(f"--steps {args.steps} must be >= 1")
    if args.eval_queries is not None and args.eval_queries < 1:
        raise UserError(f"--eval-queries {args.eval_queries} must be >= 1")
    if args.threads < 1:
        raise UserError(f"--threads {args.threads} must be >= 1")
    torch.set_num_threads(args.threads)
    protocol = Protocol()
    experiments = args.experiments or list(EXPERIMENTS)
    seeds = args.seeds or list(FULL_SEEDS)
    if args.quick:
        protocol = replace(protocol, eval_queries=1000, bayes_queries=20_000)
        seeds = args.seeds or list(QUICK_SEEDS)
    if args.steps is not None:
        protocol = replace(protocol, steps=args.steps)
    if args.eval_queries is not None:
        protocol = replace(protocol, eval_queries=args.eval_queries)
    command = command_line()
    report = run_denoise(args.out, experiments, seeds, protocol, args.device, args.quiet, command)
    print(f"Wrote {Path(args.out) / 'results.json'}, results.md"
          + (", rounds.png" if "rounds" in report["tables"] else ""))
    print(f"Total wall-clock: {report['wall_seconds']:.0f} s ({report['wall_seconds'] / 60:.1f} min)")
