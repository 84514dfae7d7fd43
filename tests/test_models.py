import dataclasses

import pytest
import torch

from cacheclip_rag.models import PromptFormat, fingerprint, load_model
from cacheclip_rag.testing import tiny_model


def test_load_from_a_local_folder_keeps_the_fingerprint(tmp_path):
    lm = tiny_model("qwen2")
    lm.model.save_pretrained(tmp_path)
    lm.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, prompt=lm.prompt)
    assert loaded.fingerprint == lm.fingerprint
    ids = torch.tensor([lm.encode("hello there")])
    with torch.no_grad():
        assert torch.allclose(loaded.model(ids).logits, lm.model(ids).logits, atol=1e-5)


def test_fingerprint_changes_with_weights_and_kv_shape():
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    assert a.fingerprint.digest != b.fingerprint.digest
    scaled = tiny_model("llama3_scaled", seed=0)
    assert a.fingerprint.weights == scaled.fingerprint.weights  # same weights ...
    assert a.fingerprint.digest != scaled.fingerprint.digest  # ... but another RoPE: another cache
    half = tiny_model("llama", seed=0)
    half.model.to(torch.float16)
    assert fingerprint(half.model).digest != a.fingerprint.digest


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither an embedded default"):
        load_model(tmp_path / "nope")


def test_prompt_formats_place_chunks_between_prefix_and_question():
    for fmt in (PromptFormat.chatml(), PromptFormat.gemma_turns(), PromptFormat.completion()):
        prefix, question = fmt.prefix("SYS"), fmt.question("Q?", "A:")
        assert "SYS" in prefix and "Q?" in question and question.endswith("A:")
        assert dataclasses.is_dataclass(fmt)


def test_gemma_chat_template_renders_turns():
    from transformers import PreTrainedTokenizerFast

    from cacheclip_rag.models import GEMMA_CHAT_TEMPLATE
    from cacheclip_rag.testing import tiny_tokenizer

    tok: PreTrainedTokenizerFast = tiny_tokenizer()
    tok.chat_template = GEMMA_CHAT_TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n")
