# %% [markdown]
# # Tuning the recompute ratio
# CacheClip recomputes a `ratio` fraction of the chunk tokens. Higher ratios follow full attention
# more closely and cost more time. This sweeps the ratio on the handbook questions and plots TTFT
# and greedy agreement with full attention (the fraction of full's first answer tokens reproduced).
# Agreement with `full` is the measure here, not correctness: Gemma 3 270M, a tiny base model, gets
# some of these questions wrong under full attention too. Ratio 1 reproduces `full` exactly.

# %%
import statistics

import matplotlib.pyplot as plt  # inline in a notebook; a file-only backend in a script without a display

from cacheclip_rag import Engine, EngineConfig, RequestOptions
from cacheclip_rag.cli import DEMO_QUESTIONS, demo_chunks
from cacheclip_rag.evaluation.fidelity import first_token_kl, greedy_agreement

engine = Engine.from_config(EngineConfig())
chunks = demo_chunks()
engine.ingest(chunks)
RATIOS = (0.0, 0.1, 0.2, 0.4, 0.7, 1.0)

# %% Sweep
full = {q: engine.generate(q, chunks, RequestOptions(method="full", max_new_tokens=16)) for q, _ in DEMO_QUESTIONS}
rows = []
for ratio in RATIOS:
    answers = {q: engine.generate(q, chunks, RequestOptions(method="cacheclip", ratio=ratio, max_new_tokens=16))
               for q, _ in DEMO_QUESTIONS}
    rows.append({
        "ratio": ratio,
        "ttft_s": statistics.median(a.timings.ttft_s for a in answers.values()),
        "agreement": statistics.fmean(greedy_agreement(full[q].token_ids, a.token_ids) for q, a in answers.items()),
        "kl": statistics.fmean(first_token_kl(full[q].first_logits, a.first_logits) for q, a in answers.items()),
    })
full_ttft = statistics.median(a.timings.ttft_s for a in full.values())
print(f"full attention TTFT {full_ttft:.2f} s")
print(f"{'ratio':>5} {'TTFT s':>7} {'speedup':>7} {'agree':>6} {'KL':>6}")
for r in rows:
    print(f"{r['ratio']:>5.2f} {r['ttft_s']:>7.2f} {full_ttft / r['ttft_s']:>6.2f}x {r['agreement']:>6.2f} {r['kl']:>6.3f}")

# %% Plot
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot([r["ratio"] for r in rows], [r["ttft_s"] for r in rows], marker="o", label="CacheClip TTFT")
ax.axhline(full_ttft, linestyle="--", color="gray", label="full attention TTFT")
ax.set_xlabel("recompute ratio")
ax.set_ylabel("TTFT (s)")
twin = ax.twinx()
twin.plot([r["ratio"] for r in rows], [r["agreement"] for r in rows], marker="s", color="C2", label="agreement")
twin.set_ylabel("greedy agreement with full")
twin.set_ylim(0, 1.05)
fig.legend(loc="upper center", bbox_to_anchor=(0.5, 1.0), ncol=3, fontsize=8, frameon=False)  # above the axes
fig.tight_layout(rect=(0, 0, 1, 0.9))
fig.savefig("tune_ratio.png", dpi=120)
print("wrote tune_ratio.png")
plt.show()
