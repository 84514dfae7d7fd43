"""Tiny random-weight models of each supported architecture, for tests and CPU smoke runs.

A small byte-level BPE tokenizer is trained in memory (offsets included), so nothing is downloaded.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from .models import LoadedModel, PromptFormat

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
