"""The reuse methods, each a prefill built from the stages (`prefills`: full, direct, shared_prefix, ape,
cacheblend, cacheclip, oracle), and the budget policy for answers spread over chunks (`spread`)."""
