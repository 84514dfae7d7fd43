"""Select: which chunk tokens to recompute. Scores (`scores`), the selectors each returning a `Selection`
(`selection`), and token indices mapped across tokenizers (`align`)."""
