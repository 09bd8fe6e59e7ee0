"""Speed, memory and FLOPs of each attention variant next to standard (``gbattn bench``)."""

# Timed when no --attn is given (here, so that the CLI's help names them without importing torch).
DEFAULT_VARIANTS = ["standard", "boosted", "boosted:kv_source=shared", "twicing", "gated", "differential"]
