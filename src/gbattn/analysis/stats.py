"""Statistics of a trained model's attention (docs/paper.md, "Analysis").

Everything here reads what the attention modules themselves record (the
:class:`gbattn.attention.core.Record` of each layer, via ``model(x, return_intermediates=True)``),
by the kind of each round; nothing re-implements attention. :func:`layer_sample` reduces one
layer's record to what the statistics need, :class:`IntermediateStats` accumulates it over
batches of held-out rows, and :func:`collect` is the loop that feeds it (and, with a second
model, the per-token loss difference).

Shapes: B rows, T positions (queries), S keys, H heads, D model width, L layers,
M attention rounds (round 0 = ordinary attention, rounds >= 1 = GBA corrections).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from gbattn.attention.core import Record
from gbattn.data.tokens import rows_batch
from gbattn.model.decoding import restore_modes, set_eval
from gbattn.model.gpt import lm_loss

# The paper's numbers (docs/paper.md), printed and stored beside ours.
PAPER_SEQ_LEN = 256  # the length of the rows its statistics were measured on
PAPER = {
    "source": f"arXiv 2604.03190, trained GBA (M=2) paper-small model on WikiText-103, seq_len {PAPER_SEQ_LEN}",
    "seq_len": PAPER_SEQ_LEN,
    "gate_mean_per_layer": [0.35, 0.48, 0.41, 0.43],
    "gate_mean_per_layer_revised": [0.33, 0.49, 0.39, 0.36],
    "entropy_round0_nats": 3.31,
    "entropy_correction_nats": 2.58,
    "entropy_relative_drop": 0.22,
    "entropy_note": "average over layers; layer 0 is the exception (its correction round is not sharper)",
}

ENTROPY_BINS = 60


# --------------------------------------------------------------------------------------
# Pure functions on one layer's record
# --------------------------------------------------------------------------------------


@dataclass
class LayerSample:
    """One layer's record reduced to what the statistics need, on the CPU in float64.

    ``entropies``: (B, H, T) per analysed map: the ``attention`` round and, for GBA, every
    ``correction`` round (Twicing's second pass reuses A; differential's negative map is not a
    boosting round). ``corrections``: (c_m, r_m, g_m expanded to (B, T, D)) of each correction.
    """

    entropies: list[Tensor]
    attention_output: Tensor
    corrections: list[tuple[Tensor, Tensor, Tensor]]

    @property
    def boosted(self) -> bool:
        return bool(self.corrections)


def layer_sample(record: Record) -> LayerSample:
    corrections = record.of_kind("correction")
    maps = record.of_kind("attention")[:1] + corrections
    def cpu(t: Tensor) -> Tensor:
        return t.detach().double().cpu()

    return LayerSample(entropies=[cpu(r.entropy_BHT) for r in maps],
                       attention_output=cpu(record.of_kind("attention")[0].output_BTD),
                       corrections=[(cpu(r.output_BTD), cpu(r.residual_BTD), cpu(r.gate.expand_as(r.output_BTD)))
                                    for r in corrections])


def entropy_bound(T: int, device=None) -> Tensor:
    """Largest possible entropy of a causal attention row at each position, log(t + 1), (T,).
    The bound depends on the position: the query at t sees t + 1 keys."""
    return torch.log(torch.arange(1, T + 1, device=device, dtype=torch.float64))


def normalised_entropy(entropy_BHT: Tensor) -> Tensor:
    """Entropy divided by its position's bound log(t + 1), in [0, 1]; position 0 (a single
    visible key, bound 0) is NaN. Shape as the input (last dim = T)."""
    bound_T = entropy_bound(entropy_BHT.shape[-1], entropy_BHT.device).to(entropy_BHT.dtype)
    return entropy_BHT / bound_T.where(bound_T > 0, torch.full_like(bound_T, float("nan")))


def token_norms(v_BTD: Tensor) -> Tensor:
    """L2 norm of every token's vector, (B, T)."""
    return torch.linalg.vector_norm(v_BTD.double(), dim=-1)


# Per-token loss differences within this many nats are ties: two evaluations of the same weights on
# different code paths (the analysis record's explicit path, SDPA) differ by float32 rounding, about 1e-6.
TIE_NATS = 1e-4


def tie_fractions(diff: np.ndarray) -> tuple[float, float, float]:
    """The fractions of ``diff`` above :data:`TIE_NATS`, below ``-TIE_NATS`` and within it, each counted (the
    third as ``1 - first - second`` was a rounding error, as low as -1e-16, where no difference was a tie)."""
    better, worse = diff > TIE_NATS, diff < -TIE_NATS
    return float(better.mean()), float(worse.mean()), float((~better & ~worse).mean())


def top_gains(diff_NT: np.ndarray, k: int, min_position: int = 0, one_per_row: bool = False) -> list[tuple[int, int]]:
    """(row, position) of the ``k`` largest values of ``diff_NT`` at positions >= ``min_position``,
    largest first; with ``one_per_row`` at most one position from each row."""
    masked = np.array(diff_NT, dtype=np.float64, copy=True)
    masked[:, :min_position] = -np.inf
    picked, rows = [], set()
    for j in np.argsort(-masked, axis=None, kind="stable"):
        if len(picked) == k or not np.isfinite(masked.flat[j]):
            break
        row, t = (int(i) for i in np.unravel_index(j, masked.shape))
        if one_per_row and row in rows:
            continue
        picked.append((row, t))
        rows.add(row)
    return picked


def relative_drop(round1: float, round0: float) -> float | None:
    """1 - round1 / round0, the correction's relative entropy drop; None where round 0's entropy is
    0 (every row attends to one key, as at sequence length 1), where the ratio has no meaning."""
    round0 = float(round0)
    return None if round0 <= 0 else float(1 - float(round1) / round0)


def _mean_std(total: float, total_sq: float, count: float) -> tuple[float, float]:
    mean = total / max(count, 1)
    return mean, math.sqrt(max(total_sq / max(count, 1) - mean * mean, 0.0))


# --------------------------------------------------------------------------------------
# Accumulating over batches
# --------------------------------------------------------------------------------------


@dataclass
class IntermediateStats:
    """Running sums over held-out rows of every statistic the analysis reports.

    ``update(samples)`` takes the :class:`LayerSample` of every layer of one batch; the
    ``*_summary`` methods give plain numbers (JSON-ready). Layers may differ in their number of
    rounds (GBA in some layers only, ``attn.layers``): a layer's entries list its own rounds, and
    the means over layers of a round are over the layers that have it. ``n_heads`` is the number of
    maps per round, set from the first batch (differential attention records H/2 maps).
    """

    n_layers: int
    n_heads: int
    d_model: int
    seq_len: int
    rounds: int = 0  # analysed rounds of the layer with the most (set by the first update)
    layer_rounds: list[int] = field(default_factory=list)  # analysed rounds of each layer
    rows: int = 0

    @property
    def boosted(self) -> bool:
        """Whether some layer has a correction round (gates and norms exist)."""
        return self.rounds > 1

    def _init(self, samples: list[LayerSample]) -> None:
        self.layer_rounds = [len(s.entropies) for s in samples]
        self.rounds = max(self.layer_rounds)
        self.n_heads = samples[0].entropies[0].shape[1]
        L, H, T, M, D = self.n_layers, self.n_heads, self.seq_len, self.rounds, self.d_model
        def z(*shape: int) -> Tensor:
            return torch.zeros(*shape, dtype=torch.float64)

        self.entropy_sum_LMH, self.entropy_sq_LM = z(L, M, H), z(L, M)
        self.entropy_pos_sum_LMT = z(L, M, T)
        self.norm_entropy_sum_LM, self.norm_entropy_count = z(L, M), 0
        self.entropy_hist_LMK = z(L, M, ENTROPY_BINS)
        self.entropy_max = 0.0
        if self.boosted:
            C = M - 1
            self.gate_sum_LCD, self.gate_sq_LC = z(L, C, D), z(L, C)
            self.gate_min, self.gate_max = float("inf"), float("-inf")
            self.norm_sums = {key: z(L, C) for key in ("x", "round0_output", "residual", "correction",
                                                       "gated_correction", "residual_after")}

    @property
    def entropy_edges(self) -> np.ndarray:
        """Histogram bin edges in nats: 0 .. log(T), the largest possible entropy (0 .. 1 at seq_len 1, where every
        entropy is 0: the range its counts were taken over; all-zero edges left the figure's bins no width)."""
        return np.linspace(0.0, math.log(self.seq_len) or 1.0, ENTROPY_BINS + 1)

    def _corrected(self) -> list[tuple[int, int]]:
        """(layer, correction index) of every correction round, in order."""
        return [(li, c) for li, m in enumerate(self.layer_rounds) for c in range(m - 1)]

    def update(self, samples: list[LayerSample]) -> None:
        if not self.rows:
            self._init(samples)
        if [len(s.entropies) for s in samples] != self.layer_rounds:
            raise ValueError(f"layers with {[len(s.entropies) for s in samples]} rounds, expected {self.layer_rounds}")
        B, T = samples[0].entropies[0].shape[0], samples[0].entropies[0].shape[-1]
        if self.seq_len != T:
            raise ValueError(f"rows of {T} positions, expected {self.seq_len}")
        self.rows += B
        hi = math.log(self.seq_len)
        for li, sample in enumerate(samples):
            ent_MBHT = torch.stack(sample.entropies)
            M = len(ent_MBHT)
            self.entropy_sum_LMH[li, :M] += ent_MBHT.sum(dim=(1, 3))
            self.entropy_sq_LM[li, :M] += (ent_MBHT**2).sum(dim=(1, 2, 3))
            self.entropy_pos_sum_LMT[li, :M] += ent_MBHT.sum(dim=(1, 2))
            self.norm_entropy_sum_LM[li, :M] += normalised_entropy(ent_MBHT)[..., 1:].sum(dim=(1, 2, 3))
            self.entropy_max = max(self.entropy_max, float(ent_MBHT.max()))
            for m in range(M):
                # (hi or 1.0: at seq_len 1 every entropy is 0, and histc over the range 0..0 would take the
                # data's own range instead, counting them in a middle bin, not the first)
                self.entropy_hist_LMK[li, m] += torch.histc(ent_MBHT[m].clamp(0, hi), ENTROPY_BINS, 0.0, hi or 1.0)
            if not sample.boosted:
                continue
            x_BTD = sample.corrections[0][1] + sample.attention_output  # r_1 + F_0
            for c, (c_BTD, r_BTD, g_BTD) in enumerate(sample.corrections):
                gc_BTD = g_BTD * c_BTD
                self.gate_sum_LCD[li, c] += g_BTD.sum(dim=(0, 1))
                self.gate_sq_LC[li, c] += (g_BTD**2).sum()
                self.gate_min, self.gate_max = (
                    min(self.gate_min, float(g_BTD.min())),
                    max(self.gate_max, float(g_BTD.max())),
                )
                sums = self.norm_sums
                sums["x"][li, c] += token_norms(x_BTD).sum()
                sums["round0_output"][li, c] += token_norms(sample.attention_output).sum()
                sums["residual"][li, c] += token_norms(r_BTD).sum()
                sums["correction"][li, c] += token_norms(c_BTD).sum()
                sums["gated_correction"][li, c] += token_norms(gc_BTD).sum()
                sums["residual_after"][li, c] += token_norms(r_BTD - gc_BTD).sum()
        self.norm_entropy_count += B * self.n_heads * (T - 1)

    # -- results -------------------------------------------------------------------
    def entropy_summary(self) -> dict:
        """Mean entropy (nats) per round, layer and head, normalised entropy, the position
        profile, the histogram, and the correction round's relative drop (paper: 22%) over the
        layers that have a correction."""
        tokens = self.rows * self.seq_len
        per_query = tokens * self.n_heads
        mean_LMH = self.entropy_sum_LMH / tokens
        mean_LM = self.entropy_sum_LMH.sum(-1) / per_query
        std_LM = (self.entropy_sq_LM / per_query - mean_LM**2).clamp_min(0).sqrt()
        # NaN (null in summary.json) with no position past the first, where normalised entropy is undefined
        norm_LM = self.norm_entropy_sum_LM / self.norm_entropy_count if self.norm_entropy_count else \
            torch.full_like(self.norm_entropy_sum_LM, math.nan)
        has_LM = torch.tensor([[m < rounds for m in range(self.rounds)] for rounds in self.layer_rounds])
        layers_M = has_LM.sum(0)  # layers that have round m

        def over_layers(v_LM: Tensor) -> Tensor:
            return (v_LM * has_LM).sum(0) / layers_M

        mean_M = over_layers(mean_LM)
        out = {
            "units": "nats",
            "bound": f"a causal row at position t has at most log(t+1) nats; largest log({self.seq_len}) = "
            f"{math.log(self.seq_len):.3f} at the last position",
            "max_possible": math.log(self.seq_len),
            "max_observed": self.entropy_max,
            "mean_per_round": mean_M.tolist(),
            "layers_per_round": layers_M.tolist(),
            "normalised_mean_per_round": over_layers(norm_LM).tolist(),
            "maps_per_round": self.n_heads,
            "per_head_definition": "per_head: each layer's mean entropy of each of its maps_per_round attention "
                                   "maps per round, one per head (differential attention: one per head pair, "
                                   "n_heads / 2: its first softmax map)",
            "per_layer": [],
            "per_position_mean": (
                self.entropy_pos_sum_LMT.sum(0) / (layers_M[:, None] * self.rows * self.n_heads)
            ).tolist(),
            "histogram": {
                "edges": self.entropy_edges.tolist(),
                "counts_per_round": self.entropy_hist_LMK.sum(0).tolist(),
            },
            "relative_drop": None,
        }
        for li, M in enumerate(self.layer_rounds):
            row = {"layer": li, "mean_per_round": mean_LM[li, :M].tolist(), "std_per_round": std_LM[li, :M].tolist(),
                   "normalised_mean_per_round": norm_LM[li, :M].tolist(), "per_head": mean_LMH[li, :M].tolist(),
                   "histogram_counts_per_round": self.entropy_hist_LMK[li, :M].tolist()}
            if M > 1:
                row["relative_drop"] = relative_drop(mean_LM[li, 1], mean_LM[li, 0])
            out["per_layer"].append(row)
        if self.boosted:
            corrected_L = has_LM[:, 1]
            out["relative_drop"] = relative_drop(mean_LM[corrected_L, 1].mean(), mean_LM[corrected_L, 0].mean())
            out["relative_drop_definition"] = ("1 - mean entropy of round 1 / mean entropy of round 0, over the "
                                               "layers with a correction (positive = correction sharper; "
                                               "null where round 0's entropy is 0, e.g. a sequence of length 1)")
        return out

    def gate_summary(self) -> dict | None:
        """Gate values per corrected layer and dimension (averaged over rows and positions) and each
        one's mean and std over every (token, dimension) entry; None without corrections."""
        if not self.boosted:
            return None
        count = self.rows * self.seq_len
        per_dim_LCD = self.gate_sum_LCD / count
        layers = []
        for li, c in self._corrected():
            mean, std = _mean_std(float(self.gate_sum_LCD[li, c].sum()), float(self.gate_sq_LC[li, c]),
                                  count * self.d_model)
            dims = per_dim_LCD[li, c]
            layers.append({"layer": li, "round": c + 1, "mean": mean, "std": std,
                           "std_of_dimension_means": float(dims.std()) if self.d_model > 1 else 0.0,
                           "dimension_mean_min": float(dims.min()), "dimension_mean_max": float(dims.max()),
                           "per_dimension": dims.tolist()})
        return {
            "per_layer": layers,
            "mean_per_layer": [r["mean"] for r in layers if r["round"] == 1],
            "mean_per_layer_layers": [r["layer"] for r in layers if r["round"] == 1],
            "mean_per_layer_definition": "the mean of g_1 (the first correction's gate) in each layer of "
                                         "mean_per_layer_layers: every layer unless GBA runs in some layers only",
            "min": self.gate_min,
            "max": self.gate_max,
            "std_definition": "std over every token and dimension of the layer's gate g_m (pooled over held-out rows)",
        }

    def norm_summary(self, norm: str = "pre") -> dict | None:
        """Mean per-token L2 norms of x, F_0, the residual r_m = x - F, the correction c_m, the
        gated correction g_m * c_m and the residual left after round m; None without corrections.
        ``norm`` (the model's, pre or post) says what x is: ln1 of the stream (Pre-LN) or the stream itself."""
        if not self.boosted:
            return None
        count = self.rows * self.seq_len
        layers = []
        for li, c in self._corrected():
            row = {"layer": li, "round": c + 1}
            row.update({key: float(total[li, c]) / count for key, total in self.norm_sums.items()})
            row["gated_over_residual"] = row["gated_correction"] / max(row["residual"], 1e-12)
            layers.append(row)
        if norm == "post":  # Post-LN normalises after the sublayer: its input is the stream itself
            units = "mean L2 norm per token (model units; Post-LN: layer 0's x is the embeddings, not normalised)"
            x = "attention sublayer input: the residual stream itself (Post-LN: the previous block's ln2 output, " \
                "the embeddings at layer 0)"
        else:
            units = "mean L2 norm per token (model units, LayerNorm-scale inputs)"
            x = "attention sublayer input (after ln1)"
        return {"units": units, "per_layer": layers,
                "definitions": {"x": x, "round0_output": "F_0",
                                "residual": "r = x - F before round m", "correction": "c_m",
                                "gated_correction": "g_m * c_m", "residual_after": "x - F after round m"}}


# --------------------------------------------------------------------------------------
# The loop over held-out rows
# --------------------------------------------------------------------------------------


@dataclass
class Collected:
    stats: IntermediateStats
    loss_NT: np.ndarray  # this model's per-token loss (nats) on the analysed rows
    against_loss_NT: np.ndarray | None = None  # the other model's, same rows


@torch.no_grad()
def collect(model, tokens: np.ndarray, seq_len: int, row_ids: np.ndarray, batch_size: int = 8,
            device="cpu", against=None, progress=None) -> Collected:
    """Run ``model`` (eval mode) over rows ``row_ids`` of ``tokens`` with intermediates and
    accumulate the statistics; with ``against`` (another model) also its per-token loss."""
    cfg = model.cfg
    stats = IntermediateStats(cfg.n_layers, cfg.n_heads, cfg.d_model, seq_len)
    # the per-token losses go into arrays made once (as perplexity's): each batch's own, kept, broke up the heap
    # between batches' logits (analyze of 2,400 WikiText-2 rows grew to 2.4 GB for a few MB of losses)
    losses = other = None

    def kept(buffer_NT: Tensor | None, start: int, loss_BT: Tensor) -> Tensor:
        """``loss_BT`` written into its rows of ``buffer_NT``, made at the first batch in the loss's dtype."""
        if buffer_NT is None:
            buffer_NT = torch.empty(len(row_ids), seq_len, dtype=loss_BT.dtype)
        buffer_NT[start : start + len(loss_BT)] = loss_BT
        return buffer_NT

    modes = set_eval(model) + (set_eval(against) if against is not None else [])
    try:
        for start in range(0, len(row_ids), batch_size):
            x, y = rows_batch(tokens, seq_len, row_ids[start : start + batch_size])
            x, y = x.to(device), y.to(device)
            logits, records = model(x, return_intermediates=True)
            stats.update([layer_sample(record) for record in records])
            losses = kept(losses, start, lm_loss(logits, y, reduction="none"))
            if against is not None:
                other = kept(other, start, lm_loss(against(x), y, reduction="none"))
            if progress is not None:
                progress.update(len(x))
    finally:  # each module's training flag as the caller had it (as generate and perplexity leave them)
        restore_modes(modes)
    return Collected(stats, losses.numpy(), other.numpy() if other is not None else None)


@torch.no_grad()
def attention_examples(model, tokens: np.ndarray, seq_len: int, row_ids: np.ndarray,
                       positions: list[tuple[int, int]], layer: int, device="cpu") -> list[dict]:
    """Round-by-round attention of layer ``layer`` at each (row index, position) of
    ``positions``, head-averaged, over the visible context 0..t (the paper's example figure).

    Returns one dict per position: ``attention`` (rounds, t + 1) and the input/target ids."""
    out, modes = [], set_eval(model)
    try:
        for row_index, t in positions:
            x, y = rows_batch(tokens, seq_len, row_ids[row_index : row_index + 1])
            _, records = model(x.to(device), return_intermediates=True)
            rounds = records[layer].of_kind("attention")[:1] + records[layer].of_kind("correction")
            maps = [r.probs_BHTS[0, :, t, : t + 1].mean(0).double().cpu().numpy() for r in rounds]
            out.append({"row": int(row_ids[row_index]), "position": int(t), "attention": np.stack(maps),
                        "input_ids": x[0, : t + 1].tolist(), "target_id": int(y[0, t])})
    finally:
        restore_modes(modes)
    return out
