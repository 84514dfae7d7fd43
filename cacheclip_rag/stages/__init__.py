"""The stages a method is built from: load (`load/`: precompute, fetch, blend, re-rotate), select
(`select/`: scores, selectors, token mapping), group (`group`), recompute (`recompute/`: the forward at true
positions and its attention), decode (`decode/`); the per-request state (`request`) and the blended cache
(`cache`)."""
