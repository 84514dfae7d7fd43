"""RULER's eight needle-in-a-haystack retrieval tasks, generated here (no downloads), and its scorer.

Tasks (as RULER defines them):

| task        | haystack | keys  | values  | needles                                  |
| ----------- | -------- | ----- | ------- | ---------------------------------------- |
| single1     | noise    | words | numbers | 1                                        |
| single2     | prose    | words | numbers | 1                                        |
| single3     | prose    | words | uuids   | 1                                        |
| multikey1   | prose    | words | numbers | 1 asked + 3 distractors (other keys)     |
| multikey2   | needles  | words | numbers | the whole haystack is distractor needles |
| multikey3   | needles  | uuids | uuids   | the whole haystack is distractor needles |
| multivalue  | prose    | words | numbers | 4 values for the one key asked           |
| multiquery  | prose    | words | numbers | 4 keys, all asked                        |

The noise haystack is RULER's repeated filler; the prose haystack is written from a seeded grammar
about an imaginary coastal town (its sentences vary, so attention cannot lock onto a repetition).
Needles are whole sentences placed at random sentence boundaries. Chunks are groups of whole
sentences of about `chunk_tokens` tokens that overlap by about `overlap_tokens` (the paper's
1000/50, scaled to the context), so a needle is never cut in two.

Wording is RULER's own (its `niah` template): the preamble "Some special magic numbers are hidden
within the following text. Make sure to memorize it. I will quiz you about the numbers afterwards."
(the shared prefix), the context, the question "What are all the special magic numbers for X
mentioned in the provided text?" and RULER's answer prefix "The special magic numbers for X
mentioned in the provided text are" (keys joined "a, b, c, and d" for multiquery); "uuids" for
UUID values.

Score (RULER `string_match_all`): the fraction of a sample's reference values found in the output.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

TASKS = ("single1", "single2", "single3", "multikey1", "multikey2", "multikey3", "multivalue", "multiquery")
# answers spread over chunks (not RULER's; see `generate`): all the values of one key, each in its own part of
# the context (2, 3, 4 values), and comparisons of two keys' values, which need both: of 7-digit numbers
# ("compare", which Qwen2.5-0.5B answers in none of 13 cases even with full attention) and of ages ("older")
MULTICHUNK_TASKS = ("spread2", "spread3", "spread4", "compare", "older")

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

_ADJECTIVES = (
    "amber", "brave", "calm", "dusty", "eager", "fancy", "gentle", "hollow", "icy", "jolly", "keen",
    "lively", "misty", "noble", "odd", "proud", "quiet", "rapid", "silent", "tidy", "upbeat", "vivid",
    "wary", "young", "zesty", "bitter", "cheerful", "distant", "elegant", "fragile", "golden", "humble",
)
_NOUNS = (
    "anchor", "badger", "candle", "dolphin", "engine", "falcon", "garden", "harbor", "island", "jacket",
    "kettle", "lantern", "meadow", "needle", "orchard", "pebble", "quarry", "river", "saddle", "tiger",
    "umbrella", "violin", "walrus", "yarrow", "zeppelin", "beacon", "compass", "drum", "ember", "fern",
)

# The prose grammar: subject, verb phrase, object, and a trailing clause, drawn per sentence.
_SUBJECTS = (
    "The harbour master", "An old fisherman", "The town council", "A travelling merchant", "The baker on Mill Street",
    "Most of the villagers", "The lighthouse keeper", "A group of students", "The mayor's assistant",
    "The weaving guild", "A retired sailor", "The schoolteacher", "The ferry crew", "Two carpenters",
)
_VERBS = (
    "repaired", "described", "painted", "counted", "carried", "argued about", "visited", "measured",
    "photographed", "sold", "inspected", "remembered", "collected", "mapped", "cleaned", "celebrated",
)
_OBJECTS = (
    "the stone bridge", "the northern pier", "a crate of apples", "the weather records", "the chapel bell",
    "the tide tables", "a wooden rowing boat", "the market stalls", "the old salt warehouse", "the fishing nets",
    "the hillside vineyard", "the library roof", "the lantern festival", "the road to the quarry",
)
_CLAUSES = (
    "before the autumn storms arrived", "while the tide was going out", "during the long winter evenings",
    "because the ledger required it", "after the spring market closed", "as the gulls circled overhead",
    "although nobody had asked them to", "on a grey and windy morning", "with the help of a borrowed ladder",
    "to the surprise of the neighbours", "for the first time in a decade", "without writing anything down",
)


@dataclass(frozen=True)
class TaskSpec:
    haystack: str  # "noise" | "prose" | "needles"
    key_kind: str  # "words" | "uuids"
    value_kind: str  # "numbers" | "uuids"
    distractors: int = 0  # needles with other keys (multikey1)
    values_per_key: int = 1  # multivalue
    queries: int = 1  # multiquery
    spread: bool = False  # each value of the asked key in its own 1/values_per_key of the context
    compare: bool = False  # two keys asked: which has the larger value


SPECS: dict[str, TaskSpec] = {
    "single1": TaskSpec("noise", "words", "numbers"),
    "single2": TaskSpec("prose", "words", "numbers"),
    "single3": TaskSpec("prose", "words", "uuids"),
    "multikey1": TaskSpec("prose", "words", "numbers", distractors=3),
    "multikey2": TaskSpec("needles", "words", "numbers"),
    "multikey3": TaskSpec("needles", "uuids", "uuids"),
    "multivalue": TaskSpec("prose", "words", "numbers", values_per_key=4),
    "multiquery": TaskSpec("prose", "words", "numbers", queries=4),
    "spread2": TaskSpec("prose", "words", "numbers", values_per_key=2, spread=True),
    "spread3": TaskSpec("prose", "words", "numbers", values_per_key=3, spread=True),
    "spread4": TaskSpec("prose", "words", "numbers", values_per_key=4, spread=True),
    "compare": TaskSpec("prose", "words", "numbers", queries=2, spread=True, compare=True),
    "older": TaskSpec("prose", "words", "ages", queries=2, spread=True, compare=True),
}


@dataclass(frozen=True)
class Needle:
    key: str
    value: str
    sentence: str


@dataclass(frozen=True)
class Sample:
    """One generated sample: haystack sentences with needles inside, the question and the answers."""

    task: str
    seed: int
    target_tokens: int
    sentences: tuple[str, ...]
    needles: tuple[Needle, ...]  # every needle in the text, distractors included
    question: str
    answer_prefix: str
    references: tuple[str, ...]  # values the answer must contain
    preamble: str = ""  # RULER's instruction before the context: the shared prefix
    wrong: tuple[str, ...] = ()  # answers that make the output wrong if they come before the reference (compare)

    @property
    def context(self) -> str:
        return " ".join(self.sentences)


def _noun_for(kind: str, plural: bool) -> str:
    noun = "number" if kind == "numbers" else "uuid"
    return noun + "s" if plural else noun


def needle_sentence(key: str, value: str, value_kind: str) -> str:
    if value_kind == "ages":
        return f"The captain of the {key} is {value} years old."
    return f"One of the special magic {_noun_for(value_kind, True)} for {key} is: {value}."


class _Draw:
    """Seeded draws of unique keys and values."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()

    def _unique(self, make: Callable[[], str]) -> str:
        for _ in range(10_000):
            value = make()
            if value not in self.used:
                self.used.add(value)
                return value
        raise RuntimeError("ran out of unique keys or values")

    def key(self, kind: str) -> str:
        if kind == "uuids":
            return self._uuid()
        return self._unique(lambda: f"{self.rng.choice(_ADJECTIVES)}-{self.rng.choice(_NOUNS)}")

    def value(self, kind: str) -> str:
        if kind == "uuids":
            return self._uuid()
        if kind == "ages":
            return self._unique(lambda: str(self.rng.randint(21, 89)))
        return self._unique(lambda: str(self.rng.randint(1_000_000, 9_999_999)))

    def _uuid(self) -> str:
        return self._unique(lambda: str(uuid.UUID(int=self.rng.getrandbits(128), version=4)))


def prose_sentence(rng: random.Random) -> str:
    return f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_CLAUSES)}."


def _filler(spec: TaskSpec, rng: random.Random, draw: _Draw) -> Callable[[], str]:
    if spec.haystack == "noise":
        return lambda: NOISE
    if spec.haystack == "prose":
        return lambda: prose_sentence(rng)
    return lambda: needle_sentence(draw.key(spec.key_kind), draw.value(spec.value_kind), spec.value_kind)


def generate(task: str, target_tokens: int, seed: int, count_tokens: Callable[[str], int]) -> Sample:
    """A sample whose context is about `target_tokens` tokens long as `count_tokens` counts them."""
    if task not in SPECS:
        raise ValueError(f"unknown RULER task {task!r}; choose one of {', '.join(TASKS + MULTICHUNK_TASKS)}")
    if target_tokens < 64:
        raise ValueError(f"target_tokens must be >= 64, got {target_tokens}")
    spec = SPECS[task]
    rng = random.Random(f"{task}/{seed}/{target_tokens}")
    draw = _Draw(rng)
    asked = [draw.key(spec.key_kind) for _ in range(spec.queries)]
    needles = [
        Needle(key, value, needle_sentence(key, value, spec.value_kind))
        for key in asked
        for value in (draw.value(spec.value_kind) for _ in range(spec.values_per_key))
    ]
    if spec.value_kind == "ages":
        # the older captain comes first in the context for even seeds, second for odd: a method that picks by
        # position is right half the time, not always
        ages = sorted((n.value for n in needles[:2]), key=int, reverse=seed % 2 == 0)
        needles[:2] = [Needle(n.key, age, needle_sentence(n.key, age, "ages")) for n, age in zip(needles[:2], ages)]
    for _ in range(spec.distractors):
        key, value = draw.key(spec.key_kind), draw.value(spec.value_kind)
        needles.append(Needle(key, value, needle_sentence(key, value, spec.value_kind)))
    budget = target_tokens - sum(count_tokens(n.sentence) + 1 for n in needles)
    make = _filler(spec, rng, draw)
    haystack: list[str] = []
    while budget > 0:
        sentence = make()
        haystack.append(sentence)
        budget -= count_tokens(sentence) + 1
    if spec.haystack == "needles":  # filler sentences are needles too: distractors to report
        needles += [_parse_needle(s) for s in haystack]
    sentences = list(haystack)
    placed = needles[: spec.queries * spec.values_per_key + spec.distractors]
    if spec.spread:  # needle i in the i-th of len(placed) equal parts, at a random place inside it
        parts = len(placed)
        for i in reversed(range(parts)):
            low, high = (i * len(sentences)) // parts, ((i + 1) * len(sentences)) // parts
            sentences.insert(rng.randint(low, max(low, high - 1)), placed[i].sentence)
    else:
        for needle in placed:
            sentences.insert(rng.randint(0, len(sentences)), needle.sentence)
    if spec.compare:
        larger = max(needles[:2], key=lambda n: int(n.value))
        smaller = needles[1] if larger is needles[0] else needles[0]
        if spec.value_kind == "ages":
            return Sample(task=task, seed=seed, target_tokens=target_tokens, sentences=tuple(sentences),
                          needles=tuple(needles), question=f"Whose captain is older, the {asked[0]}'s or the "
                          f"{asked[1]}'s?", answer_prefix=" The older captain is the captain of the",
                          references=(larger.key,), wrong=(smaller.key,),
                          preamble="Some facts about ships' captains are hidden within the following text. Make "
                                   "sure to memorize them. I will quiz you about them afterwards.")
        values = _noun_for(spec.value_kind, plural=True)
        preamble = ruler_wording(asked, spec.value_kind)[0]
        question = (f"Which has the larger special magic number, {asked[0]} or {asked[1]}? Compare the special "
                    f"magic {values} for the two mentioned in the provided text.")
        return Sample(task=task, seed=seed, target_tokens=target_tokens, sentences=tuple(sentences),
                      needles=tuple(needles), question=question,
                      answer_prefix=" The one with the larger special magic number is", references=(larger.key,),
                      preamble=preamble, wrong=(smaller.key,))
    preamble, question, prefix = ruler_wording(asked, spec.value_kind)
    references = tuple(n.value for n in needles if n.key in asked)
    return Sample(task=task, seed=seed, target_tokens=target_tokens, sentences=tuple(sentences), needles=tuple(needles),
                  question=question, answer_prefix=prefix, references=references, preamble=preamble)


def _parse_needle(sentence: str) -> Needle:
    head, value = sentence[:-1].rsplit(" is: ", 1)
    return Needle(head.split(" for ", 1)[1], value, sentence)


def ruler_wording(keys: Sequence[str], value_kind: str) -> tuple[str, str, str]:
    """RULER's niah preamble, question and answer prefix for the asked keys."""
    values = _noun_for(value_kind, plural=True)
    query = keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]
    return (
        f"Some special magic {values} are hidden within the following text. Make sure to memorize it. "
        f"I will quiz you about the {values} afterwards.",
        f"What are all the special magic {values} for {query} mentioned in the provided text?",
        f" The special magic {values} for {query} mentioned in the provided text are",
    )


def chunk_sizes(context_tokens: int) -> tuple[int, int]:
    """The paper's 1000-token chunks with 50 overlap at long contexts, scaled down to ~8 chunks."""
    size = max(96, min(1000, context_tokens // 8))
    return size, max(8, size // 20)


def chunk_sentences(sentences: Sequence[str], count_tokens: Callable[[str], int], size: int, overlap: int) -> list[str]:
    """Whole sentences grouped to about `size` tokens; each chunk repeats ~`overlap` tokens of the last."""
    lengths = [count_tokens(s) + 1 for s in sentences]
    chunks, start = [], 0
    while start < len(sentences):
        stop, total = start, 0
        while stop < len(sentences) and (stop == start or total + lengths[stop] <= size):
            total += lengths[stop]
            stop += 1
        chunks.append(" ".join(sentences[start:stop]))
        if stop == len(sentences):
            break
        back, carried = stop, 0
        while back - 1 > start and carried + lengths[back - 1] <= overlap:
            back -= 1
            carried += lengths[back]
        start = back
    return chunks


def sample_chunks(sample: Sample, count_tokens: Callable[[str], int]) -> list[str]:
    size, overlap = chunk_sizes(sample.target_tokens)
    return chunk_sentences(sample.sentences, count_tokens, size, overlap)


def score(output: str, references: Sequence[str], wrong: Sequence[str] = ()) -> float:
    """RULER string_match_all: the fraction of references found in the output (case-insensitive). A
    reference that a `wrong` answer precedes does not count (the comparison: naming the other key first)."""
    if not references:
        raise ValueError("a sample needs at least one reference value")
    text = output.lower()

    def found(ref: str) -> bool:
        at = text.find(ref.lower())
        return at >= 0 and not any(0 <= text.find(w.lower()) < at for w in wrong)

    return sum(found(ref) for ref in references) / len(references)
