"""Made-up words and the fixed fact table of the task mix (lib/evaluation/tasks.py).

Every word is built from syllables by a generator with a fixed seed, so the table is the same on every
machine and in every run: a model trained on it is asked about facts nothing else in the world states.
Must not know tokenizers, models or the chat encoding.
"""
from __future__ import annotations

import functools
import random
from typing import NamedTuple

FACT_SEED = 20260731
PLACES = 48                     # made-up countries in the fact table
ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "tr", "vl")
VOWELS = ("a", "e", "i", "o", "u", "ai", "eo")
CODAS = ("", "", "", "n", "r", "s", "l", "th", "m")


def made_up_word(rng: random.Random, syllables: tuple[int, int] = (2, 3)) -> str:
    """A pronounceable word that is no real one (capitalised by the caller where it names something)."""
    n = rng.randint(*syllables)
    return "".join(rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(n - 1)) + \
        rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)


def distinct_words(rng: random.Random, n: int, taken: set[str] | None = None,
                   syllables: tuple[int, int] = (2, 3)) -> list[str]:
    """`n` different made-up words, none of them in `taken` (which gains them)."""
    taken = set() if taken is None else taken
    out = []
    while len(out) < n:
        w = made_up_word(rng, syllables).capitalize()
        if w not in taken:
            taken.add(w)
            out.append(w)
    return out


class Fact(NamedTuple):
    place: str         # a made-up country
    relation: str      # "capital" | "language" | "animal"
    value: str


# The national animals are real words: a relation whose answers the tokenizer has seen as English.
ANIMALS = ("otter", "heron", "lynx", "badger", "falcon", "beaver", "ibex", "marten", "crane", "viper",
           "walrus", "condor", "gecko", "puffin", "bison", "jackal")


@functools.lru_cache(maxsize=1)
def fact_table() -> tuple[Fact, ...]:
    """The fixed table: for each of PLACES countries its capital, its language and its national animal."""
    rng = random.Random(FACT_SEED)
    taken: set[str] = set()
    places = distinct_words(rng, PLACES, taken)
    capitals = distinct_words(rng, PLACES, taken)
    languages = [w + "ic" for w in distinct_words(rng, PLACES, taken, syllables=(2, 2))]
    facts = []
    for place, capital, language in zip(places, capitals, languages):
        facts += [Fact(place, "capital", capital), Fact(place, "language", language),
                  Fact(place, "animal", rng.choice(ANIMALS))]
    return tuple(facts)
