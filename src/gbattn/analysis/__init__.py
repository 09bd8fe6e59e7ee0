"""Analysis of trained runs (gates, entropies, norms, per-token gains) and figures."""

from gbattn.analysis.cli import analyze_run, plot_compare

__all__ = ["analyze_run", "plot_compare"]
