"""Finding stored chunks in prompts: exactly what a brute-force search finds, in work linear in the prompt
whatever the stored chunks share (counted operations, not wall time)."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from cacheclip_rag.engine.recognize import ANCHOR, MAX_LENGTHS, MIN_CHUNK, SHORT_ANCHOR, ChunkIndex


def brute_force(chunks: list[str], prompt: str) -> list[tuple[int, int]]:
    """Leftmost first, the longest stored chunk at a position, never overlapping."""
    stored = {c for c in chunks if len(c) >= MIN_CHUNK}
    found, at = [], 0
    while at < len(prompt):
        best = max((len(c) for c in stored if prompt.startswith(c, at)), default=0)
        if best:
            found.append((at, at + best))
            at += best
        else:
            at += 1
    return found


WORDS = ["tide ", "ferry ", "gull ", "ferry gull ", "=", "==", "\u00e9t\u00e9 ", "\U0001f30a "]


@st.composite
def chunks_and_prompt(draw):
    words = st.lists(st.sampled_from(WORDS), min_size=2, max_size=40).map("".join)
    chunks = draw(st.lists(words, min_size=1, max_size=8))
    pieces = draw(st.lists(st.one_of(st.sampled_from(chunks), words), max_size=10))
    return chunks, "".join(pieces)


@settings(max_examples=150, deadline=None)
@given(chunks_and_prompt())
def test_the_scan_finds_exactly_what_a_brute_force_search_finds(case):
    chunks, prompt = case
    index = ChunkIndex(chunks)
    assert [(m.start, m.stop) for m in index.find(prompt)] == brute_force(chunks, prompt)


def test_crafted_prompts_cost_work_linear_in_their_length():
    """The published attack: a prompt of one repeated character against chunks that share its start.
    Every position is a candidate for every chunk, yet the work stays a fixed multiple of the prompt's
    length (the old scan hashed each chunk's length at each position: quadratic)."""
    shared = [("=" * ANCHOR) + f" chunk {i} " + "=" * (40 + i) for i in range(3 * MAX_LENGTHS)]
    short = [("=" * SHORT_ANCHOR) + f"{i:>3}" for i in range(3 * MAX_LENGTHS)]
    index = ChunkIndex(shared + short)
    per_char = []
    for size in (4096, 32768, 131072):
        assert index.find("=" * size) == []
        per_char.append(index.last_work / size)
    # one pass for the prefix sums, one per anchor width, then at most MAX_LENGTHS checks per candidate
    assert max(per_char) <= 3 + 2 * (1 + MAX_LENGTHS), per_char


def test_ordinary_prompts_over_many_chunks_find_theirs():
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    chunks = [" ".join("".join(rng.choices(letters, k=rng.randint(2, 8))) for _ in range(rng.randint(12, 60)))
              for _ in range(20000)]
    index = ChunkIndex(chunks)
    picked = rng.sample(range(len(chunks)), 6)
    prompt = "Answer from the context.\n\n" + "\n\n".join(chunks[i] for i in picked) + "\n\nQuestion: which?"
    assert [prompt[m.start:m.stop] for m in index.find(prompt)] == [chunks[i] for i in picked]
    assert index.last_work <= 4 * len(prompt)
