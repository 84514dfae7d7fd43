"""Recompute: the forward of scattered rows at their true positions over the blended cache (`forward`),
its attention (`attention`; on the CPU by blocks: `blocked_attention`)."""
