"""Re-rotating cached keys from offset a to offset b equals computing them at b (layer 0)."""

import pytest
import torch

from cacheclip_rag.stages.load.ingest import new_cache
from cacheclip_rag.stages.recompute.forward import forward_at
from cacheclip_rag.stages.load.rope import rotate_keys
from tests.conftest import max_diff


def layer0_keys(lm, ids, start):
    cache = new_cache(lm, start + len(ids))
    forward_at(lm.model, cache, torch.tensor([ids]), torch.arange(start, start + len(ids))[None])
    keys, _ = cache.rows(start, start + len(ids))
    return keys


@pytest.mark.parametrize("a,b", [(0, 37), (5, 300), (900, 3), (17, 17)])
def test_rotation_moves_keys_exactly(tiny, a, b):
    ids = tiny.encode("The quick brown fox jumps over the lazy dog 1234567.")
    at_a, at_b = layer0_keys(tiny, ids, a), layer0_keys(tiny, ids, b)
    moved = rotate_keys(tiny.model, at_a, b - a)
    # layer 0 keys depend only on the token and its position: equal up to float32 rounding of the
    # angles (position x inv_freq carries ~|position| x 6e-8 rad of error, ~1e-4 at position 900)
    assert max_diff(moved[0], at_b[0]) < 1e-4
    if a != b:
        assert max_diff(at_a[0], at_b[0]) > 1e-3  # the check is not vacuous


def test_rotation_uses_each_layer_types_base():
    """Gemma 3: sliding layers rotate with the local base, full layers with the global one."""
    from cacheclip_rag.testing import tiny_model

    lm = tiny_model("gemma3")
    keys = torch.randn(4, 2, 5, 16)
    moved = rotate_keys(lm.model, keys, 50)
    local = moved[0]
    same_input = keys.clone()
    same_input[2] = keys[0]
    moved2 = rotate_keys(lm.model, same_input, 50)
    assert max_diff(moved2[2], local) > 1e-3  # same key, different base -> different rotation
    assert max_diff(moved2[0], local) == 0
    assert max_diff(rotate_keys(lm.model, moved, -50), keys) < 1e-5
