import dataclasses

import pytest
import torch

from cacheclip_rag.models import half_gemv
from cacheclip_rag.models.loading import PromptFormat, fingerprint, load_model
from cacheclip_rag.testing import tiny_model


def test_load_from_a_local_folder_keeps_the_fingerprint(tmp_path):
    lm = tiny_model("qwen2")
    lm.model.save_pretrained(tmp_path)
    lm.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, prompt=lm.prompt, dtype="float32")
    assert loaded.fingerprint == lm.fingerprint
    ids = torch.tensor([lm.encode("hello there")])
    assert loaded.model.lm_head.half_weight.dtype == torch.float16 if half_gemv.available() else True
    half_gemv.set_enabled(False)  # the float32 weights themselves (8 rows would read the float16 copies)
    try:
        with torch.no_grad():
            assert torch.allclose(loaded.model(ids).logits, lm.model(ids).logits, atol=1e-5)
    finally:
        half_gemv.set_enabled(True)


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

    from cacheclip_rag.models.loading import GEMMA_CHAT_TEMPLATE
    from cacheclip_rag.testing import tiny_tokenizer

    tok: PreTrainedTokenizerFast = tiny_tokenizer()
    tok.chat_template = GEMMA_CHAT_TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n")


@pytest.mark.parametrize("arch,template", [("llama", "llama3"), ("qwen2", "qwen2"), ("gemma3", "gemma3")])
def test_a_local_model_folder_gets_its_own_chat_template(tmp_path, arch, template):
    """A user's model with a real chat template: the engine's prompt (prefix, chunks, question) is exactly
    what the template renders for a system turn and a user turn with the documents and the question,
    and the template's end-of-turn token ends decoding."""
    from cacheclip_rag.config import EngineConfig, RequestOptions
    from cacheclip_rag.engine.core import Engine
    from cacheclip_rag.models.loading import load_model
    from cacheclip_rag.store import LMDBStore
    from cacheclip_rag.testing import save_tiny_chat_model
    from tests.conftest import CHUNKS, QUESTION

    folder = save_tiny_chat_model(tmp_path / "model", arch, template)
    lm = load_model(folder, dtype="float32")  # exactness below: float32, whatever "auto" picks on this CPU
    engine = Engine(primary=lm, store=LMDBStore(tmp_path / "store"), aux=None,
                    config=EngineConfig(store_path=tmp_path / "store", aux=None, system_prompt="Be brief.",
                                        store_dtype="float32"))
    plan = engine.plan(QUESTION, CHUNKS, RequestOptions(method="full"))
    user = "".join(c + lm.prompt.chunk_separator for c in CHUNKS) + "Question: " + QUESTION
    expected = lm.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": user}],
        tokenize=False, add_generation_prompt=True)
    if template == "llama3":
        expected = expected.replace(user, user.strip())  # the template trims; the chunks' text is unchanged
    assert lm.tokenizer.decode(plan.all_ids()) == expected
    end = {"llama3": "<|eot_id|>", "qwen2": "<|im_end|>", "gemma3": "<end_of_turn>"}[template]
    assert lm.tokenizer.convert_tokens_to_ids(end) in lm.eos_token_ids
    one = CHUNKS[:1]  # and reuse still reproduces full attention behind this prefix
    full = engine.generate(QUESTION, one, RequestOptions(method="full", max_new_tokens=1)).first_logits
    shared = engine.generate(QUESTION, one, RequestOptions(method="shared_prefix", max_new_tokens=1)).first_logits
    assert (full - shared).abs().max() < 1e-4


def test_a_model_without_a_chat_template_gets_plain_completion(tmp_path):
    from cacheclip_rag.models.loading import PromptFormat, load_model
    from cacheclip_rag.testing import tiny_model

    lm = tiny_model("llama")
    lm.model.save_pretrained(tmp_path)
    lm.tokenizer.save_pretrained(tmp_path)
    assert load_model(tmp_path).prompt == PromptFormat.completion()


def test_dtype_is_chosen_per_device_and_checked(tmp_path):
    import torch

    from cacheclip_rag.config import EngineConfig
    from cacheclip_rag.models.loading import cpu_has_native_bf16, load_model, resolve_dtype
    from cacheclip_rag.testing import tiny_model

    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be"):
        EngineConfig(dtype="fp8")
    lm = tiny_model("qwen2")
    lm.model.save_pretrained(tmp_path)
    lm.tokenizer.save_pretrained(tmp_path)
    assert load_model(tmp_path, dtype="bfloat16").dtype == torch.bfloat16


def test_auto_dtype_on_the_cpu_is_bf16_exactly_where_the_cpu_has_it(monkeypatch):
    """bf16 where the CPU multiplies it natively (~2.5x float32's matmuls), float32 where it would be
    emulated; the probes are torch's own, so a CPU without them answers float32."""
    import torch

    from cacheclip_rag.models.loading import cpu_has_native_bf16, resolve_dtype

    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    for avx512_bf16, amx, expected in ((True, False, torch.bfloat16), (False, True, torch.bfloat16),
                                       (False, False, torch.float32)):
        # such a CPU's torch runs its AVX-512 kernels (on an AVX2 host torch's own capability says AVX2)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability",
                            lambda v=expected: "AVX512" if v == torch.bfloat16 else "AVX2")
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert cpu_has_native_bf16() == (expected == torch.bfloat16)
        assert resolve_dtype("auto", "cpu") == expected
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    assert resolve_dtype("auto", "cpu") == torch.float32


def test_auto_storage_keeps_a_16_bit_model_s_dtype():
    """A bf16 model's chunk caches are stored in bf16 (float16 would clip its range), a float32 model's
    in float16 on the CPU."""
    import torch

    from cacheclip_rag.stages.load.ingest import storage_dtype
    from cacheclip_rag.testing import tiny_model

    lm = tiny_model("qwen2")
    assert storage_dtype("auto", lm) == torch.float16
    lm.model.to(torch.bfloat16)
    assert storage_dtype("auto", lm) == torch.bfloat16
    assert storage_dtype("float32", lm) == torch.float32


def test_threads_never_exceed_the_cpus_this_process_may_use(monkeypatch):
    import os

    import torch

    from cacheclip_rag.models.loading import fit_threads_to_cores

    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
        torch.set_num_threads(2)
        assert fit_threads_to_cores() == 1 and torch.get_num_threads() == 1
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
        assert fit_threads_to_cores() == 1  # never raised: fewer threads may be the user's choice
    finally:
        torch.set_num_threads(before)
