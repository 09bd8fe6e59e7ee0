"""Training and evaluating one model of the synthetic task with the authors' protocol
(docs/method.md §9), and the runs each experiment needs."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gbattn.model.gpt import init_weights
from gbattn.synthetic.models import EquilibriumDenoiser, PatternDenoiser
from gbattn.synthetic.task import (
    DEQ_SETTINGS,
    DIFFICULTY_SETTINGS,
    ROUNDS,
    ROUNDS_SETTING,
    Protocol,
    Setting,
    make_patterns,
    nearest_pattern,
    sample_queries,
)

EXPERIMENTS = ("rounds", "gates", "difficulty", "deq")
GATES = ("mlp", "linear", "vector", "scalar", "none")
DEFAULT_GATE = "mlp"  # the authors' standalone module


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


def boosted_run(setting: Setting, rounds: int, gate: str | None, seed: int) -> RunSpec:
    return RunSpec(setting, rounds, gate if rounds > 1 else None, "boosted", seed)


INITS = ("pytorch", "normal")


def build_model(spec: RunSpec, protocol: Protocol) -> nn.Module:
    """The run's model, initialised as ``protocol.init`` says (log beta and the gates' own constants either way)."""
    if protocol.init not in INITS:
        raise ValueError(f"init={protocol.init!r}: expected one of {', '.join(INITS)}")
    if spec.kind == "deq":
        model = EquilibriumDenoiser(spec.setting.d, protocol.beta_init, protocol.deq_tol, protocol.deq_max_iter)
    else:
        model = PatternDenoiser(spec.setting.d, spec.rounds, spec.gate or "none", protocol.beta_init)
    if protocol.init == "normal":
        model.apply(init_weights)
    return model


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
    evals, fixed_points = {}, {}
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
            if spec.kind == "deq":
                fixed_points[step] = asdict(model.last_stats)
    best = max(evals, key=evals.get)  # the evaluation reported (the first of equal ones)
    result = {"key": spec.key, "setting": asdict(spec.setting), "rounds": spec.rounds, "gate": spec.gate,
              "kind": spec.kind, "seed": spec.seed, "accuracy": evals[best], "evals": evals,
              "final_loss": loss.item(), "seconds": time.perf_counter() - started}
    if spec.kind == "deq":  # of the evaluation whose accuracy is reported, which the table shows beside it (the
        result["fixed_point"] = fixed_points[best]  # last one's said "100% converged" of an accuracy that was not)
    return result


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
