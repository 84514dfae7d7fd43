import pytest
import torch

from cacheclip_rag.stages.select.align import map_selection, selected_characters
from cacheclip_rag.testing import tiny_tokenizer
from tests.conftest import has_embedded_models

TEXTS = [
    "The special magic number for Lantern-7b is: 4821937.\n\n",
    "uuid 9b2e41aa-0c3d-4f6e-8a1b-2c3d4e5f6a7b   and\t\ttabs  ünïcode café — naïve 日本語 emoji 🚀!\n\n",
    "   leading spaces, 1234567 digits 0.000001 and trailing   \n\n",
]


def encode(tok, text):
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]]


def check_cover(src_offsets, src_sel, dst_offsets, text):
    dst_sel = map_selection(src_offsets, src_sel, dst_offsets, len(text))
    src_chars = selected_characters(src_offsets, src_sel, len(text))
    dst_chars = selected_characters(dst_offsets, dst_sel, len(text))
    # every character a selected source token owns is owned by some selected target token
    assert not (src_chars & ~dst_chars).any()
    return dst_sel


def test_same_tokenizer_maps_one_to_one():
    tok = tiny_tokenizer()
    _, offsets = encode(tok, TEXTS[0])
    sel = torch.rand(len(offsets)) > 0.5
    assert torch.equal(map_selection(offsets, sel, offsets, len(TEXTS[0])), sel)


@pytest.mark.parametrize("text", TEXTS)
def test_cover_between_different_tokenizations(text):
    a = tiny_tokenizer(300)
    b = tiny_tokenizer(384)
    _, oa = encode(a, text)
    _, ob = encode(b, text)
    torch.manual_seed(0)
    for _ in range(20):
        check_cover(oa, torch.rand(len(oa)) > 0.7, ob, text)


def test_nothing_selected_maps_to_nothing_and_all_to_all():
    a, b = tiny_tokenizer(300), tiny_tokenizer(384)
    _, oa = encode(a, TEXTS[1])
    _, ob = encode(b, TEXTS[1])
    assert not map_selection(oa, torch.zeros(len(oa), dtype=torch.bool), ob, len(TEXTS[1])).any()
    assert map_selection(oa, torch.ones(len(oa), dtype=torch.bool), ob, len(TEXTS[1])).all()


@pytest.mark.slow
@pytest.mark.skipif(not has_embedded_models(), reason="embedded models not installed")
@pytest.mark.parametrize("text", TEXTS)
def test_cover_between_real_smollm2_and_gemma3_tokenizers(text):
    from transformers import AutoTokenizer

    from cacheclip_rag.models.loading import convert_gguf, default_cache_dir, embedded_gguf

    cache = default_cache_dir()
    smol = AutoTokenizer.from_pretrained(convert_gguf(embedded_gguf("smollm2-135m", cache), cache))
    gemma = AutoTokenizer.from_pretrained(convert_gguf(embedded_gguf("gemma3-270m", cache), cache))
    _, os_ = encode(smol, text)
    _, og = encode(gemma, text)
    assert os_ != og  # really different tokenizations
    torch.manual_seed(1)
    for _ in range(30):
        sel = torch.rand(len(os_)) > 0.6
        check_cover(os_, sel, og, text)
        check_cover(og, torch.rand(len(og)) > 0.6, os_, text)
