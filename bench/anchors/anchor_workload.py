"""The anchors' requests, and how their answers are scored.

Every request holds the chunk its question is answered in, as a retriever's top-k would: a record of the
handbook section that states the fact (the corpus's record i repeats section i mod 6), put in place of one of
the Zipf picks where none of them is such a record. An answer is right when it contains the handbook's value,
case-folded: the strict test a user applies (an answer that names another number is wrong).

Two workloads:
  fresh     every request draws its chunks anew, in a new order: the RAG case, where a prompt-prefix cache
            finds only the system prompt in common;
  repeated  REPEATED_LISTS chunk lists, drawn once per prompt size, every request one of them in the same
            order (the questions vary): the best case of a prefix cache, which then holds all but the question
            once each list has been sent (run_anchors sends each once before timing).
"""

from __future__ import annotations

import random

from bench_serve import zipf_pick

SECTIONS = 6  # corpus record i repeats the handbook's section i mod SECTIONS (bench_serve.corpus)
PROMPTS = {"600": 2, "2k": 7, "4k": 14}  # chunks per request, ~300 tokens each (1,200 characters)
REPEATED_LISTS = 4
WORKLOADS = ("fresh", "repeated")

# the questions, the handbook section that answers each, and the value a right answer contains
QUESTIONS: dict[str, tuple[int, str]] = {
    "How many pistons support the mirror?": (1, "96"),
    "Who directs the observatory?": (4, "Lindqvist-Oduya"),
    "When was the planet found?": (3, "2016"),
    "What is the archive server called?": (3, "Gull"),
    "How far is the hospital?": (5, "34"),
}


def right(question: str, answer: str) -> bool:
    """Whether `answer` states the handbook's value for `question`."""
    return QUESTIONS[question][1].lower() in answer.lower()


def with_section(picks: list[int], section: int, pool: int, rng: random.Random,
                 spare: list[int] | None = None) -> list[int]:
    """`picks` holding a record of `section`: unchanged where one does, else the most popular record of it
    (the lowest index) in place of a random pick (one of the positions `spare`, default any)."""
    if any(i % SECTIONS == section for i in picks):
        return picks
    out = list(picks)
    out[rng.choice(spare if spare is not None else range(len(out)))] = next(
        i for i in range(section, pool, SECTIONS) if i not in picks)
    return out


def requests_for(workload: str, prompt: str, clients: int, count: int, pool: list[str]) -> list[tuple[list[str], str]]:
    """`count` (chunks, question) requests; the same for every engine at one (workload, prompt, clients)."""
    rng = random.Random(f"{workload}/{prompt}/{clients}")
    names = list(QUESTIONS)
    if workload == "fresh":
        out = []
        for _ in range(count):
            question = rng.choice(names)
            picks = with_section(zipf_pick(rng, len(pool), PROMPTS[prompt]), QUESTIONS[question][0], len(pool), rng)
            out.append(([pool[i] for i in picks], question))
        return out
    if workload == "repeated":
        lists = repeated_lists(prompt, len(pool))
        return [([pool[i] for i in lists[k % len(lists)]], rng.choice(names)) for k in range(count)]
    raise ValueError(f"unknown workload {workload!r}: {', '.join(WORKLOADS)}")


def repeated_lists(prompt: str, pool: int) -> list[list[int]]:
    """The repeated workload's chunk lists, each holding a record of every section a question needs, so a
    list answers whatever is asked over it and its prompt prefix is the same for every request."""
    needed = sorted({section for section, _ in QUESTIONS.values()})
    if PROMPTS[prompt] < len(needed):
        raise ValueError(f"the repeated workload needs >= {len(needed)} chunks a request; ~{prompt} has {PROMPTS[prompt]}")
    rng = random.Random(f"repeated-lists/{prompt}")
    lists = []
    for _ in range(REPEATED_LISTS):
        picks = zipf_pick(rng, pool, PROMPTS[prompt])
        for section in needed:
            # in place of a pick that no question needs, or one of two records of the same section
            spare = [k for k, i in enumerate(picks)
                     if i % SECTIONS not in needed or sum(j % SECTIONS == i % SECTIONS for j in picks) > 1]
            picks = with_section(picks, section, pool, rng, spare)
        lists.append(picks)
    return lists
