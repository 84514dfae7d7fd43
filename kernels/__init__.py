"""Triton kernels, each with a pure-torch reference beside it."""
