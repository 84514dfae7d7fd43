"""Cases written unlike RULER, asked as a deployment asks: the families of issue 67.

A deployment ingests chunks once, behind the engine's generic system prompt, before any question exists,
and asks through the chat template (`Engine.generate`, the server, the frameworks). RULER's harness
instead puts its task preamble ("numbers are hidden ... I will quiz you") in front of every chunk, which
primes each cache for the question. These cases carry no preamble and no RULER wording: another
generator (a seeded grammar of everyday prose about inland towns, no digits in it), varied phrasing,
facts of ordinary kinds (times, years, lengths, codes, rooms). Families:

| family   | chunks | what is asked                                                              | strict score |
| -------- | ------ | -------------------------------------------------------------------------- | ------------ |
| short    | 2-4 of a sentence or two, no filler | one place's fact; the others hold the same kind of fact with other values | the value, no other |
| values   | filler | every code one person logged, in 2-4 chunks, the person named its own way in each | all values, no distractor |
| compare  | filler | which of 2-3 items (each in its own chunk) is the largest; the question names none | the item, no other item |
| link     | filler | a fact reached through something the question does not name (who built what, where it is kept) | the value, no distractor |
| topical  | filler | one fact of one entity that every chunk is about (other facts of it, other numbers) | the value, no other |

Every case is a function of (family, target words, seed) alone: `cases` is the frozen set, and
`tests/test_deployed_cases.py` pins its digest, so a tuned method is judged on the set written before.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass

FAMILIES = ("short", "values", "compare", "link", "topical")
WORDS_PER_CHUNK = 190  # ~250 Qwen tokens of this prose
# target sizes in words of the whole context: ~2K and ~4K Qwen tokens
WORDS_FOR = {2048: 1500, 4096: 3000}

_PEOPLE = ("Amara Okafor", "Elin Lindqvist", "Jules Moreau", "Kenji Tanaka", "Rita Ferreira", "Pavel Novak",
           "Samira Haddad", "Owen Brennan", "Ilse Vogel", "Tomas Ruiz", "Neha Kapoor", "Greta Holm")
_TITLES = ("Dr.", "Professor", "Captain", "Engineer")
_ROLES = ("the survey's chief geologist", "the station's senior archivist", "the harbour's lead engineer",
          "the valley's head botanist", "the museum's chief curator", "the expedition's field surveyor")
_PLACES = ("Marrow Island", "Gull Point", "Ashford", "Kelby", "Linden Cross", "Tarnwick", "Orrin Bay", "Westerholm",
           "Brackwater", "Fenmoor", "Caldry", "Hollin Vale", "Redmarsh", "Skelton Reach")
_ITEMS = {  # kind: (noun, measure phrase, unit, question)
    "bridge": ("bridge", "spans", "metres", "Which of the bridges described is the longest?"),
    "tower": ("tower", "rises", "metres", "Which of the towers described is the tallest?"),
    "tunnel": ("tunnel", "runs", "metres", "Which of the tunnels described is the longest?"),
    "dam": ("dam", "holds back a lake of", "hectares", "Which of the dams described holds back the largest lake?"),
}
_INSTRUMENTS = ("Meridian spectrograph", "Halden seismometer", "Corvel astrolabe", "Brightwater tide gauge",
                "Osprey barometer", "Kestrel chronometer", "Lowen theodolite", "Ember magnetometer")
_SHORT_FACTS = (  # (sentence with {place} and {value}, question with {place}, value maker)
    ("The ferry to {place} leaves at {value} every morning from the north pier.",
     "When does the ferry to {place} leave?", "time"),
    ("The lighthouse at {place} was built in {value}.", "When was the lighthouse at {place} built?", "year"),
    ("The library in {place} opens at {value} on weekdays.", "What time does the library in {place} open?", "time"),
    ("The old bridge at {place} is {value} metres long.", "How long is the old bridge at {place}?", "length"),
    ("{place} has a population of {value} people.", "What is the population of {place}?", "count"),
    ("The market hall in {place} was finished in {value}.", "When was the market hall in {place} finished?", "year"),
)
_SECOND = ("It is a short walk from the station.", "Visitors often stop there on the way to the coast.",
           "The building was repainted last spring.", "Locals recommend arriving early.",
           "The path to it is steep in places.", "Guides point it out on every tour.")

# the filler grammar: everyday prose about inland towns; no digits, so no value can be confused with it
_F_SUBJECTS = ("The miller", "A schoolteacher", "The parish council", "Two carpenters", "The woman at the post office",
               "An apprentice", "The stationmaster", "A group of walkers", "The innkeeper", "Most farmers",
               "The choir", "A retired sailor", "The grocer", "Visiting students", "The blacksmith's son")
_F_VERBS = ("repaired", "talked about", "walked past", "painted", "argued over", "cleaned", "photographed",
            "measured", "planted flowers beside", "wrote a letter about", "sold bread near", "waited outside")
_F_OBJECTS = ("the chapel gate", "the long wall by the river", "the grain store", "the village green",
              "the old toll house", "the orchard fence", "the water mill", "the cattle market", "the reading room",
              "the stone well", "the footbridge", "the clock above the square", "the empty barn")
_F_TAILS = ("before the rain came", "while the bells rang", "as the light faded over the hills",
            "because nobody else had time", "on a cold and windy afternoon", "after the harvest fair",
            "without saying much to anyone", "as they had done for years", "when the road was finally dry",
            "in spite of the late frost")
_F_EXTRA = ("Nobody could remember when the custom began.", "The smell of cut grass hung over the lanes.",
            "Children chased each other between the hedges.", "Smoke rose slowly from the chimneys.",
            "A cart rattled along the lane towards the ford.", "The evening was quiet except for the geese.",
            "Some said the weather would turn by the weekend.", "The river ran high and brown after the storms.")


@dataclass(frozen=True)
class Case:
    """One request: its chunks (as a retriever returns them), the question, and what a right answer holds."""

    family: str
    words: int  # target context size in words (0: no filler)
    seed: int
    chunks: tuple[str, ...]
    question: str
    references: tuple[str, ...]  # every one must be in the answer
    wrong: tuple[str, ...] = ()  # none may be
    fact_chunks: tuple[int, ...] = ()  # the chunks that hold what the answer needs


def strict_score(output: str, case: Case) -> bool:
    """Right as a user sees it: every reference present, no wrong value or item (case-insensitive, whole
    tokens: "7:40" does not match inside "17:40")."""
    text = output.lower()

    def present(value: str) -> bool:
        return re.search(rf"(?<![\w:]){re.escape(value.lower())}(?![\w:])", text) is not None

    return all(present(r) for r in case.references) and not any(present(w) for w in case.wrong)


def _capital(text: str) -> str:
    return text[0].upper() + text[1:]


def _filler_sentence(rng: random.Random) -> str:
    if rng.random() < 0.25:
        return rng.choice(_F_EXTRA)
    return f"{rng.choice(_F_SUBJECTS)} {rng.choice(_F_VERBS)} {rng.choice(_F_OBJECTS)} {rng.choice(_F_TAILS)}."


def _value(rng: random.Random, kind: str, taken: set[str]) -> str:
    while True:
        value = {"time": lambda: f"{rng.randint(5, 11)}:{rng.choice(('05', '15', '20', '35', '40', '50'))}",
                 "year": lambda: str(rng.randint(1780, 1960)),
                 "length": lambda: str(rng.randint(120, 980)),
                 "count": lambda: str(rng.randint(1200, 48000)),
                 "code": lambda: str(rng.randint(1000, 9999)),
                 "room": lambda: str(rng.randint(100, 699))}[kind]()
        if value not in taken:
            taken.add(value)
            return value


def _with_filler(rng: random.Random, words: int, facts: Sequence[tuple[int, str]], n_chunks: int) -> tuple[str, ...]:
    """`n_chunks` chunks of filler, about `words` words in all, each fact sentence (chunk, sentence) at a
    random sentence boundary of its chunk."""
    per = max(1, words // n_chunks)
    chunks = []
    for c in range(n_chunks):
        sentences: list[str] = []
        while sum(len(s.split()) for s in sentences) < per:
            sentences.append(_filler_sentence(rng))
        for chunk, sentence in facts:
            if chunk == c:
                sentences.insert(rng.randint(0, len(sentences)), sentence)
        chunks.append(" ".join(sentences))
    return tuple(chunks)


def _short(rng: random.Random, seed: int) -> Case:
    sentence, question, kind = rng.choice(_SHORT_FACTS)
    n = rng.randint(2, 4)
    places, taken = rng.sample(_PLACES, n), set()
    values = [_value(rng, kind, taken) for _ in places]
    chunks = tuple(sentence.format(place=p, value=v) + (" " + rng.choice(_SECOND) if rng.random() < 0.5 else "")
                   for p, v in zip(places, values))
    asked = rng.randrange(n)
    return Case("short", 0, seed, chunks, question.format(place=places[asked]), (values[asked],),
                tuple(v for i, v in enumerate(values) if i != asked), (asked,))


def _names(rng: random.Random, person: str, role: str, count: int) -> list[str]:
    """The person named its own way in each chunk: full name with title, surname, initial, description."""
    first, last = person.split()
    title = rng.choice(_TITLES)
    ways = [f"{title} {person}", f"{last}", f"{title} {first[0]}. {last}", f"{role} ({last})"]
    rng.shuffle(ways)
    return ways[:count]


def _values(rng: random.Random, words: int, seed: int) -> Case:
    n_chunks = max(4, words // WORDS_PER_CHUNK)
    person, other = rng.sample(_PEOPLE, 2)
    role = rng.choice(_ROLES)
    k = rng.randint(2, 4)
    taken: set[str] = set()
    codes = [_value(rng, "code", taken) for _ in range(k)]
    distractor = _value(rng, "code", taken)
    where = sorted(rng.sample(range(n_chunks), k + 1))
    rng.shuffle(where)
    shapes = ("{who} logged sample code {code} at the northern trench.", "Among the entries by {who} is sample code {code}.",
              "A later page shows that {who} recorded sample code {code}.", "Sample code {code} was logged by {who} after the storm.")
    facts = [(c, _capital(rng.choice(shapes).format(who=who, code=code)))
             for c, who, code in zip(where, _names(rng, person, role, k), codes)]
    facts.append((where[k], f"{other} logged sample code {distractor} at the southern trench."))
    question = f"List every sample code that {person} logged."
    return Case("values", words, seed, _with_filler(rng, words, facts, n_chunks), question, tuple(codes),
                (distractor,), tuple(sorted(where[:k])))


def _compare(rng: random.Random, words: int, seed: int) -> Case:
    n_chunks = max(4, words // WORDS_PER_CHUNK)
    kind = rng.choice(tuple(_ITEMS))
    noun, measure, unit, question = _ITEMS[kind]
    k = rng.randint(2, 3)
    names = [f"the {p} {noun}" for p in rng.sample(_PLACES, k)]
    taken: set[str] = set()
    sizes = [int(_value(rng, "length", taken)) for _ in names]
    where = rng.sample(range(n_chunks), k)
    shapes = ("{Name} {measure} {size} {unit}.", "Built long ago, {name} {measure} {size} {unit}.",
              "According to the county records, {name} {measure} {size} {unit}.")
    facts = []
    for c, name, size in zip(where, names, sizes):
        text = rng.choice(shapes).format(Name=_capital(name), name=name, measure=measure, size=size, unit=unit)
        facts.append((c, text))
    best = names[sizes.index(max(sizes))]
    place = lambda name: name.split(" ", 1)[1].rsplit(" ", 1)[0]  # noqa: E731  "the Gull Point bridge" -> "Gull Point"
    return Case("compare", words, seed, _with_filler(rng, words, facts, n_chunks), question, (place(best),),
                tuple(place(n) for n in names if n != best), tuple(sorted(where)))


def _link(rng: random.Random, words: int, seed: int) -> Case:
    n_chunks = max(4, words // WORDS_PER_CHUNK)
    builder, other = rng.sample(_PEOPLE, 2)
    instrument, second = rng.sample(_INSTRUMENTS, 2)
    taken: set[str] = set()
    room, other_room = _value(rng, "room", taken), _value(rng, "room", taken)
    where = rng.sample(range(n_chunks), 4)
    facts = [(where[0], f"The {instrument} was built by {builder} in a rented workshop."),
             (where[1], f"These days the {instrument} is kept in room {room} of the county museum."),
             (where[2], f"{other} built the {second} for the harbour office."),
             (where[3], f"The {second} is kept in room {other_room}.")]
    question = f"In which room is the instrument that {builder} built kept?"
    return Case("link", words, seed, _with_filler(rng, words, facts, n_chunks), question, (room,), (other_room,),
                tuple(sorted(where[:2])))


def _topical(rng: random.Random, words: int, seed: int) -> Case:
    n_chunks = max(4, words // WORDS_PER_CHUNK)
    place = rng.choice(_PLACES)
    entity = f"the {place} railway"
    taken: set[str] = set()
    facts_of = [("opened in {v}", "year", "When did {e} open?"),
                ("carried {v} passengers in its busiest year", "count", "How many passengers did {e} carry in its busiest year?"),
                ("has a main line {v} metres long", "length", "How long is the main line of {e}?"),
                ("keeps its oldest engine in shed {v}", "room", "In which shed does {e} keep its oldest engine?")]
    chosen = rng.sample(facts_of, 3)
    values = [_value(rng, kind, taken) for _, kind, _ in chosen]
    where = rng.sample(range(n_chunks), 3)
    facts = [(c, f"{_capital(entity)} {phrase.format(v=v)}.") for c, (phrase, _, _), v in zip(where, chosen, values)]
    # every chunk is about the railway: its name in each, without another number
    facts += [(c, f"Many people in {place} still talk about {entity}.") for c in range(n_chunks) if c not in where]
    asked = rng.randrange(3)
    return Case("topical", words, seed, _with_filler(rng, words, facts, n_chunks),
                chosen[asked][2].format(e=entity), (values[asked],), tuple(v for i, v in enumerate(values) if i != asked),
                (where[asked],))


def case(family: str, words: int, seed: int) -> Case:
    """The case `seed` of `family` at `words` words of context (ignored by "short")."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    rng = random.Random(f"deployed/{family}/{words}/{seed}")
    if family == "short":
        return _short(rng, seed)
    return {"values": _values, "compare": _compare, "link": _link, "topical": _topical}[family](rng, words, seed)


def cases(family: str, words: int, n: int) -> list[Case]:
    return [case(family, words, seed) for seed in range(n)]


def digest(items: Sequence[Case]) -> str:
    """A short hash of the cases' content: the set's identity, pinned by the tests."""
    return hashlib.sha256(json.dumps([asdict(c) for c in items]).encode()).hexdigest()[:16]
