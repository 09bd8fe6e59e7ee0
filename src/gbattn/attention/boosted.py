"""Gradient-boosted attention (GBA, arXiv 2604.03190; docs/method.md).

M attention rounds inside one layer, each with its own projections::

    F = Attn_0(q=x, kv=x)
    for m in 1..M-1:
        r_m = x - F                      # negative gradient of 0.5 ||x - F||^2
        c_m = Attn_m(q=r_m, kv=KV_SOURCE)
        F   = F + g_m(F, c_m) * c_m      # gate = shrinkage
    y = W_out F

``kv_source``: ``residual`` (K/V from r_m; what the authors ran), ``input`` (K/V from x; the
first paper text) or ``shared`` (round 0's K/V reused, only a new W_Q). With M = 1 (or in a layer
outside ``layers``) the module is standard attention, with the same parameter names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from gbattn.attention.core import AttentionBase, AttnArgs, Call
from gbattn.checks import Typed, between, one_of, within
from gbattn.errors import ConfigError

# --------------------------------------------------------------------------------------
# Gates g_m(F, c_m): the shrinkage of the boosting step
# --------------------------------------------------------------------------------------


class Gate(nn.Module):
    """``forward(f_BTD, c_BTD, entropy_BT1) -> g`` broadcastable to (B, T, D)."""

    needs_entropy = False

    def init_own_parameters(self, init=nn.init) -> None:
        """Initialise the parameters the gate holds itself (its Linear layers are the model's to
        initialise): a gate with such parameters (vector, scalar) calls it from its constructor, and the Hugging
        Face wrapper calls it again; the others hold none."""


class LinearGate(Gate):
    """Paper gate: ``sigmoid(W_g [F ; c] + b)``, W_g: 2d -> d (near 0.5 at the model's init, N(0, 0.02)
    weights and zero bias; a module built alone has PyTorch's default init)."""

    def __init__(self, d: int, options: BoostedOptions) -> None:
        super().__init__()
        self.proj = nn.Linear(2 * d, d)

    def forward(self, f_BTD: Tensor, c_BTD: Tensor, entropy_BT1: Tensor | None) -> Tensor:
        return torch.sigmoid(self.proj(torch.cat([f_BTD, c_BTD], dim=-1)))


class TanhGate(LinearGate):
    """Flamingo-style ``tanh(W_g [F ; c] + b)`` in (-1, 1): exactly 0 with W_g = 0 and b = 0, the
    function-preserving start of an upcycled model (docs/method.md, "Upcycling")."""

    def forward(self, f_BTD: Tensor, c_BTD: Tensor, entropy_BT1: Tensor | None) -> Tensor:
        return torch.tanh(self.proj(torch.cat([f_BTD, c_BTD], dim=-1)))


class MLPGate(Gate):
    """The authors' standalone gate: ``sigmoid(MLP([F ; c ; entropy of round 0]))``."""

    needs_entropy = True

    def __init__(self, d: int, options: BoostedOptions) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(2 * d + 1, options.gate_hidden), nn.GELU(), nn.Linear(options.gate_hidden, d)
        )

    def forward(self, f_BTD: Tensor, c_BTD: Tensor, entropy_BT1: Tensor | None) -> Tensor:
        return torch.sigmoid(self.net(torch.cat([f_BTD, c_BTD, entropy_BT1.to(f_BTD.dtype)], dim=-1)))


class VectorGate(Gate):
    """A learned per-dimension constant, ``sigmoid(w)``, w initialised to 0 (gate 0.5)."""

    def __init__(self, d: int, options: BoostedOptions) -> None:
        super().__init__()
        self.logit = nn.Parameter(torch.empty(d))
        self.init_own_parameters()

    def init_own_parameters(self, init=nn.init) -> None:
        init.zeros_(self.logit)

    def forward(self, f_BTD: Tensor, c_BTD: Tensor, entropy_BT1: Tensor | None) -> Tensor:
        return torch.sigmoid(self.logit)


class ScalarGate(Gate):
    """One learned constant per round (MART's shrinkage eta_m): ``sigmoid(a)``, a initialised to
    ``scalar_gate_logit`` (0.5, the authors' value: a gate of 0.62; docs/deviations.md, entry 13)."""

    def __init__(self, d: int, options: BoostedOptions) -> None:
        super().__init__()
        self.logit = nn.Parameter(torch.empty(1))
        self.initial_logit = options.scalar_gate_logit
        self.init_own_parameters()

    def init_own_parameters(self, init=nn.init) -> None:
        init.constant_(self.logit, self.initial_logit)

    def forward(self, f_BTD: Tensor, c_BTD: Tensor, entropy_BT1: Tensor | None) -> Tensor:
        return torch.sigmoid(self.logit)


class NoGate(Gate):
    """g = 1: plain boosting without shrinkage."""

    def __init__(self, d: int, options: BoostedOptions) -> None:
        super().__init__()

    def forward(self, f_BTD: Tensor, c_BTD: Tensor, entropy_BT1: Tensor | None) -> Tensor:
        return f_BTD.new_ones(1)


GATE_CLASSES = {"linear": LinearGate, "mlp": MLPGate, "vector": VectorGate, "scalar": ScalarGate,
                "tanh": TanhGate, "none": NoGate}

KV_SOURCES = ("residual", "input", "shared")


@dataclass
class BoostedOptions(Typed):
    prefix = "attn."

    rounds: int = field(default=2, metadata=between(1, 1024))  # M; M = 1 is standard attention
    gate: str = field(default="linear", metadata=one_of(*GATE_CLASSES))
    kv_source: str = field(default="residual", metadata=one_of(*KV_SOURCES))
    gate_hidden: int = field(default=32, metadata=between(1, 2**24))  # hidden width of the mlp gate (as ffn_hidden)
    layers: list[int] | None = None  # layer indices with correction rounds (negative from the end); None = all
    # the scalar gate's a at init: sigmoid(0.5) = 0.62; 0 starts it at 0.5 (sigmoid(±100) is 0 or 1 in float32)
    scalar_gate_logit: float = field(default=0.5, metadata=within(100.0))

    def validate(self) -> None:
        if self.gate != "mlp" and self.gate_hidden != 32:  # (it was accepted and changed nothing)
            raise ConfigError(f"attn.gate_hidden={self.gate_hidden} is the mlp gate's width; attn.gate="
                              f"{self.gate!r} has none (set attn.gate=mlp, or drop attn.gate_hidden)")
        if self.gate != "scalar" and self.scalar_gate_logit != 0.5:
            raise ConfigError(f"attn.scalar_gate_logit={self.scalar_gate_logit} starts the scalar gate; attn.gate="
                              f"{self.gate!r} is another (set attn.gate=scalar, or drop attn.scalar_gate_logit)")


class CorrectionRound(nn.Module):
    """Round m >= 1: its own projection of the residual (Q, and K/V with kv_source=residual) and its gate."""

    def __init__(self, args: AttnArgs, options: BoostedOptions, q_width: int, kv_width: int) -> None:
        super().__init__()
        width = q_width + 2 * kv_width if options.kv_source == "residual" else q_width
        self.proj = nn.Linear(args.d_model, width, bias=args.bias)
        self.gate = GATE_CLASSES[options.gate](args.d_model, options)


class BoostedAttention(AttentionBase):
    """Gradient-boosted attention; see the module docstring for the equations."""

    Options = BoostedOptions

    def __init__(self, args: AttnArgs, options: BoostedOptions) -> None:
        super().__init__(args, options)
        self.rounds = options.rounds if args.in_layers(options.layers) else 1
        # One fused projection of x: round-0 Q/K/V, plus every round's K/V when they come from x.
        self.input_kv_width = 2 * self.kv_width * (self.rounds - 1) if options.kv_source == "input" else 0
        self.qkv = nn.Linear(args.d_model, self.q_width + 2 * self.kv_width + self.input_kv_width, bias=args.bias)
        self.corrections = nn.ModuleList(
            CorrectionRound(args, options, self.q_width, self.kv_width) for _ in range(self.rounds - 1)
        )
        self.out = nn.Linear(self.q_width, args.d_model, bias=args.bias)
        self.needs_entropy = any(c.gate.needs_entropy for c in self.corrections)

    def compute(self, x_BTD: Tensor, call: Call) -> Tensor:
        widths = [self.q_width, self.kv_width, self.kv_width, self.input_kv_width]
        q_BTX, k_BTX, v_BTX, input_kv_BTX = self.qkv(x_BTD).split(widths, dim=-1)
        q0_BHTE = call.queries(q_BTX)
        k0_BGSE, v0_BGSE = call.keys_values("kv0", k_BTX, v_BTX)
        f_BTD = call.merge(call.attend(q0_BHTE, k0_BGSE, v0_BGSE))
        entropy_BT1 = call.entropy(q0_BHTE, k0_BGSE).mean(dim=1).unsqueeze(-1) if self.needs_entropy else None
        kv_source = self.options.kv_source
        for m, correction in enumerate(self.corrections, start=1):
            r_BTD = x_BTD - f_BTD
            proj_BTX = correction.proj(r_BTD)
            q_BHTE = call.queries(proj_BTX[..., : self.q_width])
            if kv_source == "residual":
                k_BGSE, v_BGSE = call.keys_values(f"kv{m}", *proj_BTX[..., self.q_width :].split(self.kv_width, dim=-1))
            elif kv_source == "input":
                lo = 2 * self.kv_width * (m - 1)
                k_BTX, v_BTX = input_kv_BTX[..., lo : lo + 2 * self.kv_width].split(self.kv_width, dim=-1)
                k_BGSE, v_BGSE = call.keys_values(f"kv{m}", k_BTX, v_BTX)
            else:  # shared: round 0's keys and values, exactly
                k_BGSE, v_BGSE = k0_BGSE, v0_BGSE
            c_BTD = call.merge(call.attend(q_BHTE, k_BGSE, v_BGSE, kind="correction"))
            gate = correction.gate(f_BTD, c_BTD, entropy_BT1)  # broadcasts to (B, T, D)
            call.note(residual_BTD=r_BTD, gate=gate)
            f_BTD = f_BTD + gate * c_BTD
        return self.out(f_BTD)
