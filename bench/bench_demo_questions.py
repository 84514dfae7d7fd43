"""Which handbook questions show the demo's trade-off: candidate questions answered by full, shared_prefix
and cacheclip (default selection, ratio 0.2) on the default primary; one JSON line per question (resumable:
a rerun skips the questions the file holds). The demo's DEMO_SET was chosen from this file.

    python bench/bench_demo_questions.py --out bench/results/demo_candidates.jsonl
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cacheclip_rag import Engine, EngineConfig, RequestOptions  # noqa: E402
from cacheclip_rag.cli.demo import demo_chunks  # noqa: E402

CANDIDATES = [
    ("How many pistons support the Halvorsen mirror?", "96"),
    ("What is the name of the archive server that releases the data?", "Gull"),
    ("In which year did the Lantern programme announce its first confirmed planet?", "2016"),
    ("Who is the present director of the observatory?", "Amara Lindqvist-Oduya"),
    ("The autumn lecture is named after a former director. In which year did he reopen the observatory?", "1948"),
    ("The cafe's rye cake is named after a person. In which year did that person found the observatory?", "1931"),
    ("What frequency, in megahertz, does the instrument added by the second director observe?", "1420"),
    ("Which research programme uses the instrument that Tomas Ekwueme added?", "Saltmarsh"),
    ("What is kept in a yellow cabinet next to the retired refractor?", "defibrillator"),
    ("How many people may join one night tour?", "fourteen"),
    ("What do the staff call the radio dish's position during thunderstorms?", "stow"),
    ("In which town is the nearest hospital?", "Keel"),
    ("What is the name of the first planet the Lantern programme confirmed?", "Lantern-7b"),
    ("How many council members are elected by the people of Marrow?", "three"),
    ("What is the name of the path to the summit on foot?", "Shepherd"),
    ("Which volume number is the current night logbook?", "212"),
]
parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--out", default="bench/results/demo_candidates.jsonl")
out = Path(parser.parse_args().out)
done = {json.loads(l)["q"] for l in out.read_text().splitlines()} if out.exists() else set()
engine = Engine.from_config(EngineConfig(aux=None))
chunks = demo_chunks()
engine.ingest(chunks)
engine.generate(CANDIDATES[0][0], chunks, RequestOptions(method="full", max_new_tokens=1))
for q, expected in CANDIDATES:
    if q in done:
        continue
    row = {"q": q, "expected": expected}
    for method in ("full", "shared_prefix", "cacheclip"):
        a = engine.generate(q, chunks, RequestOptions(method=method, ratio=0.2, max_new_tokens=24))
        row[method] = {"right": expected.lower() in a.text.lower(), "ttft": a.timings.ttft_s, "text": a.text.strip()[:90]}
    print(json.dumps(row), flush=True)
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")
