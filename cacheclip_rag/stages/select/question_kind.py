"""Does a question's answer combine several passages? A linear probe of the primary's own hidden state (issue 67).

The question is asked as deployed but with no chunk (the probe's system prompt, the question as the user turn,
the assistant turn opened); the last position's hidden state after `layer` decoder layers, L2-normalised, is
scored by a logistic regression fitted on `bench/data/router_train.jsonl` (`bench/question_probe.py --export`,
held-out AUC 0.92). Probes ship per embedded model in `data/question_probes.json`; any other model has none
(`probe_for` gives None: no opinion). The layers above `layer` are not run.

The probe knows lists, comparisons and totals (it flagged every such question of the deployed families and 31 of
32 held-out ones) and does not know links through an unnamed entity (0 of 20). So it confirms the lexical
spread trigger (`methods.budget`) rather than replacing it: on single-fact questions over topical retrieval
the trigger fired on 20 and 17 of 52 requests (2K, 4K) and the probe vetoed all of them.
"""

from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass
from importlib import resources

import torch

from ...models.loading import LoadedModel, text_config

PROBES_FILE = "question_probes.json"


@dataclass(frozen=True)
class QuestionProbe:
    """A logistic regression over the normalised hidden state after `layer` decoder layers."""

    layer: int
    weight: torch.Tensor  # [hidden], float32
    bias: float
    system_prompt: str

    def prompt_ids(self, lm: LoadedModel, question: str) -> list[int]:
        """The question asked with no chunk, through the model's chat template, the assistant turn opened."""
        chat = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": question}]
        text = lm.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        return list(lm.tokenizer(text)["input_ids"])

    def score(self, lm: LoadedModel, question: str) -> float:
        """The probe's decision value: > 0 reads as an answer drawn from several passages."""
        state = hidden_state(lm, self.prompt_ids(lm, question), self.layer).float()
        return float(state @ self.weight / state.norm().clamp_min(1e-12) + self.bias)

    def several(self, lm: LoadedModel, question: str) -> bool:
        return self.score(lm, question) > 0.0


def probe_for(lm: LoadedModel) -> QuestionProbe | None:
    """The shipped probe of `lm` (by its embedded name), or None: no probe for this model, or one whose width or
    layer does not fit it (a probe reads a layer below the last, whose state a whole forward gives un-normed)."""
    entry = _shipped().get(lm.name)
    if entry is None:
        return None
    config = text_config(lm.model)
    if len(entry["weight"]) != config.hidden_size or not 0 < entry["layer"] < config.num_hidden_layers:
        return None
    return QuestionProbe(layer=int(entry["layer"]), weight=torch.tensor(entry["weight"], dtype=torch.float32),
                         bias=float(entry["bias"]), system_prompt=str(entry["system_prompt"]))


@functools.cache
def _shipped() -> dict[str, dict]:
    return json.loads(resources.files("cacheclip_rag").joinpath("data", PROBES_FILE).read_text())


class _Reached(Exception):
    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden


_stopping = threading.local()  # this thread's forward stops after the hooked layer (other threads' run on)


def _stop_here(module: torch.nn.Module, args: tuple, output: object) -> None:
    if getattr(_stopping, "layer", None) is module:
        raise _Reached(output[0] if isinstance(output, tuple) else output)


def hidden_state(lm: LoadedModel, ids: list[int], layer: int) -> torch.Tensor:
    """The last position's hidden state after `layer` decoder layers: `output_hidden_states[layer]` of a whole
    forward, with the layers above not run (so below the last layer, whose `output_hidden_states` entry is
    normed). The hook that stops there is registered once per model and acts only in the calling thread, so
    concurrent requests on the same model are untouched."""
    if not 0 < layer < text_config(lm.model).num_hidden_layers:
        raise ValueError(f"a probe reads a layer in [1, {text_config(lm.model).num_hidden_layers - 1}], got {layer}")
    block = lm.model.get_decoder().layers[layer - 1]
    if not getattr(block, "_cacheclip_stop_hook", False):
        block.register_forward_hook(_stop_here)
        block._cacheclip_stop_hook = True
    _stopping.layer = block
    try:
        with torch.inference_mode():
            lm.model(torch.tensor([ids], device=lm.device), use_cache=False)
    except _Reached as reached:
        return reached.hidden[0, -1].detach().cpu()
    finally:
        _stopping.layer = None
    raise RuntimeError(f"decoder layer {layer} of {lm.name} never ran")
