"""Where a model comes from (an embedded name, a Hugging Face folder, a `.gguf` file), checked before
anything loads: a folder that holds no weights, an encoder-only or encoder-decoder model, or a path
that does not exist is refused in one line naming it, instead of a traceback from deep in transformers.
Reads only files (no torch, no transformers), so the CLI can check its arguments at once."""

from __future__ import annotations

import json
from pathlib import Path

from .embedded import EMBEDDED, missing

_WEIGHTS = ("*.safetensors", "pytorch_model*.bin", "model*.safetensors.index.json", "pytorch_model.bin.index.json")
# architectures transformers loads as causal LMs but whose names do not end in ForCausalLM
_CAUSAL_NAMES = ("LMHeadModel", "ForCausalLM", "ForConditionalGeneration")


class ModelSourceError(ValueError):
    """A model source that cannot serve as a primary or aux model."""


def check_model_source(source: str | Path, role: str = "model") -> None:
    """`ModelSourceError` unless `source` is an embedded name, a `.gguf` file, or a folder with a
    decoder-only causal LM's config and weights."""
    name = str(source)
    if name in EMBEDDED:
        install = missing(name)
        if install is not None:
            raise ModelSourceError(f"{role} {name!r} ({EMBEDDED[name]}) is not installed: {install}")
        return
    path = Path(name)
    if not path.exists():
        raise ModelSourceError(f"{role} {name!r}: no such file or folder, and not an embedded model "
                               f"({', '.join(sorted(EMBEDDED))})")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelSourceError(f"{role} {path}: a file that is not .gguf; give a GGUF file or a Hugging Face "
                                   "model folder (config.json, weights, tokenizer)")
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelSourceError(f"{role} {path}: not a GGUF file (no GGUF header)")
        return
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelSourceError(f"{role} {path}: no config.json; not a Hugging Face model folder")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise ModelSourceError(f"{role} {path}: config.json is unreadable ({err})") from None
    if not isinstance(config, dict):
        raise ModelSourceError(f"{role} {path}: config.json is not an object")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    if config.get("is_encoder_decoder") or text.get("is_encoder_decoder"):
        raise ModelSourceError(f"{role} {path}: an encoder-decoder model ({config.get('model_type', '?')}), not a "
                               "decoder-only causal LM")
    architectures = config.get("architectures") or []
    if architectures and not any(a.endswith(_CAUSAL_NAMES) for a in architectures):
        raise ModelSourceError(f"{role} {path}: {', '.join(architectures)} is not a decoder-only causal LM "
                               "(an encoder such as BERT or MiniLM cannot generate)")
    if "num_key_value_heads" not in text and "num_attention_heads" not in text and "n_head" not in text:
        raise ModelSourceError(f"{role} {path}: its config has no attention heads; not a decoder-only causal LM")
    if not any(next(path.glob(pattern), None) for pattern in _WEIGHTS):
        raise ModelSourceError(f"{role} {path}: no weights in the folder (no *.safetensors or pytorch_model*.bin)")
