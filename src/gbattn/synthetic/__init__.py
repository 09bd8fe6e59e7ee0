"""The paper's synthetic pattern-denoising experiments (docs/method.md, "The synthetic task")."""
