"""Evaluation: RULER retrieval tasks, fidelity to full attention, aux/primary attention alignment,
and the runner that sweeps methods x ratios x lengths x tasks into JSON, markdown and plots."""
