"""Cross-model KV cache transfer (`features`, `fit`, `mapper`, `uses`): a closed-form ridge map from one model's KV cache to another's.

When a deployment switches model (cascade, escalation, an upgraded primary), the new model would
re-prefill everything. Instead (Heo et al. 2026, `../shared/seeds/kv-transfer-post.txt`):

1. Calibrate: both models prefill the same texts; keys are stripped of RoPE (rotated back to
   position 0), so the map is position-free; tokens are aligned 1:1 for a shared tokenizer, else
   through character offsets (each target token takes the source token holding its last character).
2. Select layers: for each target layer, R² of every single source layer (on a selection subset);
   keep the top-k.
3. Fit: per target layer, ridge `W = (XᵀX + λI)⁻¹ XᵀY` from the chosen source layers' features
   (all KV heads concatenated, plus a bias) to the target layer's features. Each output column is
   its own ridge problem, so this equals one fit per target KV head; head counts and head dims may
   differ. XᵀX and XᵀY are summed in float64 over calibration texts (no activations held).
   λ is relative: λ · mean(diag XᵀX), so one setting fits every scale.
4. Optionally (`mlp_hidden > 0`), a small residual MLP per target layer learns what the linear map
   leaves (the post reports it recovers pairs where linear fails).
5. Validate: held-out R² per layer for keys and values, saved with the mapper; applying a mapper
   whose mean R² (of keys, or of values) is below the threshold is refused unless forced.
6. Apply: strip the source RoPE at the source positions, align, map, re-apply the target's RoPE at
   the target positions. The first position (BOS, the attention sink) is computed by the target.
"""

from .features import KVText, align, apply_rope, flat, prefill_kv, stacked, strip_rope, text_kv, unflat
from .fit import RidgeAccumulator, apply_mlp, fit_all_at_once, fit_mlp, r_squared, select_layers
from .mapper import MAPPER_VERSION, Mapper, MapperError, TransferConfig, calibrate, transfer_kv, validate
from .uses import Conversation, MigrationReport, migrate, same_tokenizer

__all__ = ["MAPPER_VERSION", "Conversation", "KVText", "Mapper", "MapperError", "MigrationReport", "RidgeAccumulator",
           "TransferConfig", "align", "apply_mlp", "apply_rope", "calibrate", "fit_all_at_once", "fit_mlp", "flat",
           "migrate", "prefill_kv", "r_squared", "same_tokenizer", "select_layers", "stacked", "strip_rope", "text_kv",
           "transfer_kv", "unflat", "validate"]
