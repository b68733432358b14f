"""fastppo's kernels inside other trainers (``fastppo.integrations.trl``: TRL 1.x)."""
