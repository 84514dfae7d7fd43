"""Whether a question's answer is spread over several chunks, read from the words alone.

Reusing chunk caches loses answers that draw on several chunks: each chunk's cache was computed without
the others, and at ratio 0.2 the default selection lists every value of a "list all the X" question in
0.74 of the cases full attention does at 4K (0.93 at ratio 0.5; bench/RESULTS.md, issue 54). Such a
question names something that several chunks mention. The signal here finds that thing as the question's
most informative phrase found in the chunks, and counts the chunks that hold it:

- words are lower-cased `\\w+` runs; a phrase is a run of consecutive question words that also occurs,
  in order, inside one sentence of a chunk;
- a word's information is -log of its share of the chunks' words, and a phrase's the sum over its words;
  a phrase made only of the chunks' common words (each at least `COMMON` of them and `COMMON_COUNT`
  times, "of the") or of English function words (`FUNCTION_WORDS`: "who", "is", "of the", however rare in
  the chunks) counts for nothing;
- the phrase (or phrases, tied) of the most information is the question's subject; the chunks holding it
  are those with a sentence that contains it, a sentence repeated word for word in a later chunk (the
  overlap between neighbouring chunks) counting for its first chunk only.

Measured on the evaluation sets (RULER's generator, the seeds of the runs in bench/RESULTS.md: 13 samples a
task at 2K and 4K, 7 at 8K; 18 at 4K for the spread tasks): the subject is in one chunk for every single-fact
sample (single1-3, multikey1-3 among distractor keys, multiquery: 0 of 231 flagged) and in two chunks or more
for 33 of 33 multivalue and 92 of 93 spread samples (the other holds both its values in one chunk). It reads the words only, so a question that bridges
two chunks through something it does not name ("the instrument that X added") is not flagged. On real
documents (bench_docs_qa's questions over their four nearest paragraphs) it flags 1 of 11 single-fact
questions ("build system", in two paragraphs; 3 before function words were left out, on "of the", "at meta"
and "from"): such a request pays the larger budget and loses nothing. The function words changed no flag of
the 674 RULER samples above (with the comparisons at 2K and 4K).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

WORD = re.compile(r"\w+")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
COMMON = 0.005  # a word this large a share of the chunks' words is common,
COMMON_COUNT = 8  # if it also occurs this often (a short context has no common words)
MAX_PHRASE = 16  # words; a longer question phrase is matched by its parts
# Words that carry no subject however rare they are in the chunks: a question's "who" once matched a relative
# "who" in three chunks of an otherwise unrelated context and sent a single-fact question to the larger budget
# (bench/RESULTS.md, issue 50's anchors: 2.4x its time to first token). The last line: the pieces `\w+` leaves
# of a clitic ("tqdm's" -> "tqdm", "s").
FUNCTION_WORDS = frozenset("""
a an the this that these those some any each every all both either neither no not nor only own same such
i me my we us our you your he him his she her it its they them their one ones there here
who whom whose what which when where why how whoever whatever whichever
is am are was were be been being do does did done doing has have had having
can could will would shall should may might must ought
of in on at to for from by with without about above below over under into onto out off up down
as than then so too very also just again further once until while during before after between through
and or but if because since though although unless whether
many much more most few less least other another
s t d ll m re ve
""".split())


def words(text: str) -> tuple[str, ...]:
    return tuple(WORD.findall(text.lower()))


@dataclass(frozen=True)
class Spread:
    """The question's subject (its most informative phrases found in the chunks) and the chunks holding it."""

    chunks: tuple[int, ...]
    phrases: tuple[str, ...]

    @property
    def spread(self) -> bool:
        """Whether the subject is in two chunks or more."""
        return len(self.chunks) >= 2


def answer_spread(question: str, texts: Sequence[str]) -> Spread:
    """The chunks of `texts` that hold the subject of `question` (see the module)."""
    sentences = [[s for part in SENTENCE_END.split(text) if (s := words(part))] for text in texts]
    counts = Counter(w for chunk in sentences for s in chunk for w in s)
    total = sum(counts.values())
    q = words(question)
    phrases = {q[i:i + n] for n in range(1, min(MAX_PHRASE, len(q)) + 1) for i in range(len(q) - n + 1)}
    held: dict[tuple[str, ...], set[tuple[int, tuple[str, ...]]]] = {}
    for c, chunk in enumerate(sentences):
        for s in chunk:
            for n in range(1, min(MAX_PHRASE, len(s)) + 1):
                for i in range(len(s) - n + 1):
                    if s[i:i + n] in phrases:
                        held.setdefault(s[i:i + n], set()).add((c, s))
    common = max(COMMON_COUNT, COMMON * total)
    held = {p: where for p, where in held.items() if any(counts[w] < common and w not in FUNCTION_WORDS for w in p)}
    if not held:
        return Spread((), ())
    info = {p: sum(math.log((total + 1) / (counts[w] + 1)) for w in p) for p in held}
    best = max(info.values())
    subject = sorted(p for p in held if info[p] >= best - 1e-9)
    first: dict[tuple[str, ...], int] = {}
    for c, s in sorted(set().union(*(held[p] for p in subject))):
        first.setdefault(s, c)
    return Spread(tuple(sorted(set(first.values()))), tuple(" ".join(p) for p in subject))
