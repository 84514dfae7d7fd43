"""Load: chunk caches precomputed at ingest and fetched (or computed on a miss) for a request (`ingest`),
blended behind one prefix copy (`blend`), re-rotated to their positions (`rope`), layer by layer on CUDA
(`layerwise`); chunk splitting (`chunking`)."""
