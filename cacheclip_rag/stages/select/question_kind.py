"""Does a question's answer combine several passages? A linear probe of the primary's own hidden state (issue 67).

The question is asked as deployed but with no chunk (the probe's system prompt, the question as the user turn,
the assistant turn opened); the last position's hidden state after `layer` decoder layers, L2-normalised, is
scored by a logistic regression fitted on `bench/data/router_train.jsonl` (`bench/question_probe.py --export`,
held-out AUC 0.92 on the 0.5B, 0.96 on the 1.5B). Probes ship per embedded model in `data/question_probes.json`
(Qwen2.5-Coder 0.5B and 1.5B); any other model has none
(`probe_for` gives None: no opinion). The layers above `layer` are not run, and the prompt's head (system turn,
user turn's opening) is run once per model.

The probe knows lists, comparisons and totals (it flagged every such question of the deployed families and 31 of
32 held-out ones) and does not know links through an unnamed entity (0 of 20). So it confirms the lexical
spread trigger (`methods.budget`) rather than replacing it: on single-fact questions over topical retrieval
the trigger fired on 20 and 17 of 52 requests (2K, 4K) and the probe vetoed all of them.
"""

from __future__ import annotations

import copy
import functools
import json
import threading
from dataclasses import dataclass
from importlib import resources

import torch
from transformers import DynamicCache

from ...models.loading import LoadedModel, text_config
from ..recompute.forward import cache_argument

PROBES_FILE = "question_probes.json"


@dataclass(frozen=True)
class QuestionProbe:
    """A logistic regression over the normalised hidden state after `layer` decoder layers."""

    layer: int
    weight: torch.Tensor  # [hidden], float32
    bias: float
    system_prompt: str

    def prompt_ids(self, lm: LoadedModel, question: str) -> list[int]:
        return question_prompt_ids(lm, self.system_prompt, question)

    def state(self, lm: LoadedModel, question: str) -> torch.Tensor:
        """The hidden state the probe reads. The prompt's head (the system turn and the user turn's opening, the
        same for every question) is run once per model; each question runs only its own tokens over a copy of
        the head's keys and values (the whole prompt where its tokens do not start with the head's)."""
        ids = self.prompt_ids(lm, question)
        heads = head_caches(lm)
        key = (self.layer, self.system_prompt)
        if key not in heads:
            head = question_prompt_ids(lm, self.system_prompt, _MARKER, until_question=True)
            cache = DynamicCache(config=lm.model.config) if head else None
            if cache is not None:
                hidden_state(lm, head, self.layer, cache=cache)
            heads[key] = (head, cache)  # published once filled: a concurrent request copies a whole head or makes its own
        head, cache = heads[key]
        if cache is None or len(head) >= len(ids) or ids[:len(head)] != head:
            return hidden_state(lm, ids, self.layer)
        return hidden_state(lm, ids[len(head):], self.layer, cache=copy.deepcopy(cache))

    def score(self, lm: LoadedModel, question: str) -> float:
        """The probe's decision value: > 0 reads as an answer drawn from several passages."""
        state = self.state(lm, question).float()
        return float(state @ self.weight / state.norm().clamp_min(1e-12) + self.bias)

    def several(self, lm: LoadedModel, question: str) -> bool:
        return self.score(lm, question) > 0.0


_MARKER = "\x00"  # a question no template alters: the prompt's text before it is the head


def question_prompt_ids(lm: LoadedModel, system_prompt: str, question: str, *, until_question: bool = False) -> list[int]:
    """The question asked with no chunk, through the model's chat template, the assistant turn opened (what a
    probe is fitted on and reads); `until_question`: only the tokens of the text before the question."""
    chat = [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]
    text = lm.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    if until_question:
        text = text.split(question)[0]
    return list(lm.tokenizer(text)["input_ids"])


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


def head_caches(lm: LoadedModel) -> dict[tuple[int, str], tuple[list[int], DynamicCache]]:
    """(layer, system prompt) -> the prompt head's ids and their keys and values below that layer, kept on the
    model (they live and go with it)."""
    heads = getattr(lm.model, "_cacheclip_probe_heads", None)
    if heads is None:
        heads = lm.model._cacheclip_probe_heads = {}
    return heads


def hidden_state(lm: LoadedModel, ids: list[int], layer: int, cache: DynamicCache | None = None) -> torch.Tensor:
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
            if cache is None:
                lm.model(torch.tensor([ids], device=lm.device), use_cache=False)
            else:  # `ids` continue the tokens `cache` holds, which it is extended by (below `layer`)
                lm.model(torch.tensor([ids], device=lm.device), use_cache=True,
                         **{cache_argument(type(lm.model)): cache})
    except _Reached as reached:
        return reached.hidden[0, -1].detach().cpu()
    finally:
        _stopping.layer = None
    raise RuntimeError(f"decoder layer {layer} of {lm.name} never ran")
