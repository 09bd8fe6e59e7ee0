"""The paper's synthetic pattern-denoising experiments (docs/method.md §9)."""
