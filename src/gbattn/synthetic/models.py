"""Models of the synthetic task (docs/method.md §9), built from gbattn's public
pieces: the GBA gates of :mod:`gbattn.attention.boosted`. The task's attention is single-head
cross-attention from the query to the K patterns, with bias-free W_Q, W_K, W_V per round, a learned
inverse temperature beta per round instead of 1/sqrt(d), and no output projection; K/V of every round
are projected from the patterns (``kv_source="input"``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gbattn.attention.boosted import GATE_CLASSES, BoostedOptions
from gbattn.attention.core import entropy


class PatternDenoiser(nn.Module):
    """M-round GBA on the task::

        F = softmax(beta_0 (x W_Q0)(P W_K0)^T) P W_V0
        for m in 1..M-1:
            c_m = softmax(beta_m ((x - F) W_Qm)(P W_Km)^T) P W_Vm
            F = F + g_m(F, c_m) * c_m

    ``forward(query_BD, patterns_KD) -> (F (B, d), round-0 attention weights (B, K))``. Parameters
    are laid out (and initialised, PyTorch's default ``nn.Linear`` init) in the order gbattn's GBA
    layer creates them: one fused projection of the patterns ``[W_Q0; W_K0; W_V0; W_K1; W_V1; ...]``
    (its W_Q0 rows project the query), then each round's query projection and gate, then log beta.
    """

    def __init__(self, d: int, rounds: int, gate: str = "mlp", beta_init: float = 2.0) -> None:
        super().__init__()
        self.d, self.rounds = d, rounds
        self.qkv = nn.Linear(d, 3 * d + 2 * d * (rounds - 1), bias=False)
        options = BoostedOptions(rounds=rounds, gate=gate, kv_source="input")
        self.corrections = nn.ModuleList(_Correction(d, options) for _ in range(rounds - 1))
        self.log_beta = nn.Parameter(torch.full((rounds,), math.log(beta_init)))

    def attend(self, m: int, q_BD: Tensor, k_KD: Tensor, v_KD: Tensor) -> tuple[Tensor, Tensor]:
        """Round m's attention: (output (B, d), weights (B, K))."""
        probs_BK = torch.softmax((q_BD * self.log_beta[m].exp()) @ k_KD.T, dim=-1)
        return probs_BK @ v_KD, probs_BK

    def forward(self, query_BD: Tensor, patterns_KD: Tensor) -> tuple[Tensor, Tensor]:
        d, w = self.d, self.qkv.weight
        q_BD = query_BD @ w[:d].T
        kv_KX = patterns_KD @ w[d:].T  # [K0, V0, K1, V1, ...] of the patterns
        f_BD, probs0_BK = self.attend(0, q_BD, kv_KX[:, :d], kv_KX[:, d : 2 * d])
        entropy_B1 = entropy(probs0_BK).unsqueeze(-1)
        for m, correction in enumerate(self.corrections, start=1):
            lo = 2 * d * m
            c_BD, _ = self.attend(
                m, correction.proj(query_BD - f_BD), kv_KX[:, lo : lo + d], kv_KX[:, lo + d : lo + 2 * d]
            )
            f_BD = f_BD + correction.gate(f_BD, c_BD, entropy_B1) * c_BD
        return f_BD, probs0_BK


class _Correction(nn.Module):
    def __init__(self, d: int, options: BoostedOptions) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d, bias=False)
        self.gate = GATE_CLASSES[options.gate](d, options)


@dataclass
class FixedPointStats:
    iterations: int
    residual_mean: float  # ||f(z) - z|| per query, averaged
    residual_max: float
    converged: float  # fraction of queries whose relative residual is within tolerance


def fixed_point(f, z0_BD: Tensor, tol: float, max_iter: int) -> tuple[Tensor, FixedPointStats]:
    """Plain fixed-point iteration z <- f(z) from z0 until every row's relative residual
    ||f(z) - z|| / ||f(z)|| is at most ``tol`` (or ``max_iter``, at least 1). Returns the last f(z)."""
    if max_iter < 1:
        raise ValueError(f"max_iter={max_iter}: the fixed point needs at least one iteration")
    z_BD = z0_BD
    iteration = 0
    while iteration < max_iter:
        iteration += 1
        fz_BD = f(z_BD)
        residual_B = (fz_BD - z_BD).norm(dim=-1)
        relative_B = residual_B / fz_BD.norm(dim=-1).clamp_min(1e-12)
        z_BD = fz_BD
        if relative_B.max().item() <= tol:
            break
    # the returned iterate's residual, and whether each query is within tolerance there: the fraction converged was
    # the previous iterate's (stopped at max_iter, 0% where 83% of the returned queries were within tolerance)
    fz_BD = f(z_BD)
    residual_B = (fz_BD - z_BD).norm(dim=-1)
    relative_B = residual_B / fz_BD.norm(dim=-1).clamp_min(1e-12)
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
    """The negative result's model (docs/method.md §9): f(z) = the same one-round attention with
    query z (memory = the patterns), iterated from z0 = the noisy query to its fixed point z* = f(z*),
    trained as a deep-equilibrium model with implicit gradients (:func:`attach_implicit_gradient`).

    Returns (z* (B, d), attention weights at z* (B, K)); the loss uses the weights of the
    attention step that produces the answer (one more application: at z* in evaluation, at the
    re-entered f(z*) that carries the implicit gradient in training; either changes nothing at the
    fixed point, and the gradient stays exact)."""

    def __init__(self, d: int, beta_init: float = 2.0, tol: float = 1e-5, max_iter: int = 200) -> None:
        super().__init__()
        self.step = PatternDenoiser(d, rounds=1, beta_init=beta_init)
        self.tol, self.max_iter = tol, max_iter
        self.last_stats: FixedPointStats | None = None

    def forward(self, query_BD: Tensor, patterns_KD: Tensor) -> tuple[Tensor, Tensor]:
        def f(z_BD: Tensor) -> Tensor:
            return self.step(z_BD, patterns_KD)[0]

        with torch.no_grad():
            z_star_BD, self.last_stats = fixed_point(f, query_BD, self.tol, self.max_iter)
        if torch.is_grad_enabled():
            z_star_BD = attach_implicit_gradient(f, z_star_BD, self.tol, self.max_iter)
        return self.step(z_star_BD, patterns_KD)
