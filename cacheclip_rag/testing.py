"""Tiny random-weight models of each supported architecture, for tests and CPU smoke runs.

A small byte-level BPE tokenizer is trained in memory (offsets included), so nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from .models.loading import LoadedModel, PromptFormat

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Question: what is the special magic number?",
    "Answer: 1234567 0x3f uuid 9b2e-41aa café naïve ünïcode — tabs\tand  double  spaces.",
    "Retrieval augmented generation reuses cached keys and values of documents and chunks.",
] * 20
ARCHITECTURES = ("llama", "qwen2", "gemma3", "llama3_scaled")


def tiny_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<eos>", "<bos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<bos>", pad_token="<pad>")
    fast.add_bos_token = False
    return fast


def tiny_config(arch: str, vocab_size: int):
    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        eos_token_id=0, bos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
    )
    if arch == "llama":
        return LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if arch == "llama3_scaled":
        return LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
        })
    if arch == "qwen2":
        return Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if arch == "gemma3":
        return Gemma3TextConfig(
            **{**common, "num_hidden_layers": 4}, head_dim=16, sliding_window=12, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        )
    raise ValueError(f"unknown tiny architecture {arch!r}; known: {ARCHITECTURES}")


def tiny_model(arch: str = "llama", seed: int = 0, tokenizer: PreTrainedTokenizerFast | None = None) -> LoadedModel:
    """A random-weight model of architecture `arch` in float32 with a tiny tokenizer."""
    tokenizer = tokenizer or tiny_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, len(tokenizer)), dtype=torch.float32)
    with torch.no_grad():  # larger random weights give peaky attention, closer to a trained model
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    prompt = PromptFormat(
        prefix_template="System: {system}\nDocuments:\n", question_template="Question: {question}\nAnswer:",
    )
    return LoadedModel(name=f"tiny-{arch}-{seed}", model=model, tokenizer=tokenizer, prompt=prompt)


# Real chat templates (string content), as their models ship them: Meta-Llama-3-Instruct, Qwen2-Instruct,
# Gemma 3 instruction-tuned (system folded into the first user turn).
CHAT_TEMPLATES = {
    "llama3": (
        "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' "
        "+ message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
        "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    "qwen2": (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
        "You are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
        "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
        "{% endif %}"
    ),
    "gemma3": (
        "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + "
        "'\n\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = \"\" -%}{%- set "
        "loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}{%- if (message['role'] == 'user') "
        "!= (loop.index0 % 2 == 0) -%}{{ raise_exception(\"Conversation roles must alternate user/assistant/user/"
        "assistant/...\") }}{%- endif -%}{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}"
        "{%- set role = message['role'] -%}{%- endif -%}{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if "
        "loop.first else \"\") }}{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}{%- if "
        "add_generation_prompt -%}{{'<start_of_turn>model\n'}}{%- endif -%}"
    ),
}
_TEMPLATE_TOKENS = {
    "llama3": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|begin_of_text|>"),
    "qwen2": (["<|im_start|>", "<|im_end|>"], None),
    "gemma3": (["<start_of_turn>", "<end_of_turn>"], "<bos>"),
}


def save_tiny_chat_model(folder: Path, arch: str, template: str, seed: int = 0) -> Path:
    """A local Hugging Face folder (config, weights, tokenizer with a real chat template and its special
    tokens) of a tiny random `arch` model: what a user brings."""
    tokenizer = tiny_tokenizer()
    specials, bos = _TEMPLATE_TOKENS[template]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.bos_token = bos
    tokenizer.eos_token = "<eos>"
    tokenizer.chat_template = CHAT_TEMPLATES[template]
    lm = tiny_model(arch, seed, tokenizer)
    folder.mkdir(parents=True, exist_ok=True)
    lm.model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@dataclass
class TinyReplica:
    """Builds one server replica over a tiny model (`serve.replicas.application`'s `build`): its own LMDB folder
    under `folder`, the shared tier `shared`; `environment` set first (the S3 server's address, in a Ray actor)."""

    folder: str
    shared: str
    keys: dict
    environment: dict
    host_bytes: int = 0  # > 0: a host-memory tier of this size in front (the replica's fast tier)
    local_bytes: int | None = None  # a cap on the replica's local LMDB (past it, shared entries are not copied)

    def __call__(self, name: str):
        import os

        from .config import EngineConfig
        from .engine.core import Engine
        from .serve.app import ServerSettings
        from .store.factory import open_store

        os.environ.update(self.environment)
        path = Path(self.folder) / name.replace("#", "_")
        lm = tiny_model("llama")
        if self.local_bytes is None:
            store = open_store(path, self.shared, host_bytes=self.host_bytes)
        else:
            from .store import LMDBStore
            from .store.factory import open_shared
            from .store.tiered_store import TieredStore
            from .store.tiers import HostTier

            store = TieredStore(LMDBStore(path, max_bytes=self.local_bytes, map_size=self.local_bytes),
                                open_shared(self.shared))
            store = HostTier(store, self.host_bytes) if self.host_bytes else store
        engine = Engine(primary=lm, aux=lm, store=store,
                        config=EngineConfig(store_path=path, system_prompt="Be brief.", store_dtype="float32"))
        return engine, ServerSettings(tenant_keys=dict(self.keys), min_recompute_tokens=0, index_refresh_s=0.2)
