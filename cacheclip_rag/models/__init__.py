"""Models: loading (embedded names, folders, GGUF) and prompt formats (`loading`), the PyPI-shipped
models (`embedded`, `sources`), and the CPU kernels and OpenMP pools their forwards use."""
