"""Held-out tuning of APE's temperature and scale (seeds 1000+, not in the evaluation), first-token KL to full."""
import tempfile, statistics, itertools
from cacheclip_rag.config import EngineConfig, RequestOptions
from cacheclip_rag.engine import Engine
from cacheclip_rag.evaluation import ruler
from cacheclip_rag.evaluation.fidelity import first_token_kl
from cacheclip_rag.evaluation.runner import token_counter, ruler_prompt
from cacheclip_rag.models import load_model
from cacheclip_rag.store import LMDBStore
p = tempfile.mkdtemp()
e = Engine(primary=load_model("gemma3-270m"), store=LMDBStore(p), config=EngineConfig(store_path=p, aux=None), aux=None)
count = token_counter(e)
grid = list(itertools.product((0.4, 0.5, 0.6, 0.7), (1.0, 1.05)))
kls = {g: [] for g in grid}
for task in ruler.TASKS:
    s = ruler.generate(task, 1024, 1000, count)
    chunks = ruler.sample_chunks(s, count)
    with ruler_prompt(e, s):
        e.ingest(chunks, progress=False, direct=False)
        base = dict(max_new_tokens=1, answer_prefix=s.answer_prefix, prompt_stops=False)
        full = e.generate(s.question, chunks, RequestOptions(method="full", **base))
        for t, sc in grid:
            a = e.generate(s.question, chunks, RequestOptions(method="ape", ape_temperature=t, ape_scale=sc, **base))
            kls[(t, sc)].append(first_token_kl(full.first_logits, a.first_logits))
for g in sorted(grid, key=lambda g: statistics.mean(kls[g])):
    print(g, round(statistics.mean(kls[g]), 3), [round(x, 2) for x in kls[g]])
