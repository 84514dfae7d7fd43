"""The engine: its public class (`core.Engine`), where each token of a request sits (`planning`), and
the stored chunks found in ordinary prompts (`recognize`)."""

from .core import Answer, Engine, Plan, Prefill, Stream, Timings, default_kernel

__all__ = ["Answer", "Engine", "Plan", "Prefill", "Stream", "Timings", "default_kernel"]
