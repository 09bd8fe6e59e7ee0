"""The synthetic pattern-denoising task (docs/method.md §9): K unit-norm patterns
in R^d (fixed, seed 42), a query is a pattern plus N(0, sigma^2 I) noise, and a model must return
(something nearest to) the clean pattern; the Bayes-optimal decoder is the ceiling."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


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

# The paper's published numbers (accuracy %, docs/paper.md).
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
    """Training and evaluation settings (docs/method.md §9 unless marked)."""

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
    # "pytorch": nn.Linear's default uniform +-1/sqrt(fan_in) (no init is given for this task); "normal": the
    # language model's N(0, 0.02) weights and zero biases (docs/deviations.md, entry 18)
    init: str = "pytorch"

    @property
    def eval_steps(self) -> list[int]:
        return sorted({max(1, round(self.steps * i / self.n_evals)) for i in range(1, self.n_evals + 1)})


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
    isotropic Gaussian noise it is the nearest pattern to the noisy query itself (docs/method.md §9).
    Returns (accuracy, its Monte Carlo standard error)."""
    generator = torch.Generator().manual_seed(seed)
    correct = 0
    for start in range(0, n_queries, chunk):
        query_BD, target_B = sample_queries(patterns_KD, sigma, min(chunk, n_queries - start), generator)
        correct += (nearest_pattern(query_BD, patterns_KD.cpu()) == target_B).sum().item()
    accuracy = correct / n_queries
    return accuracy, math.sqrt(max(accuracy * (1 - accuracy), 1e-12) / n_queries)
