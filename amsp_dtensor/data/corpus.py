"""A deterministic, generated English-like corpus with structure a small LM can learn.

Nothing is downloaded: documents are built from templates with a seeded RNG, so the same
seed gives byte-identical files on every machine. The structure is chosen so the loss has
somewhere to go in 20 steps (frequent function words, agreement, fixed phrases) and keeps
falling after that (counting, arithmetic facts, subject-verb-object consistency).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Ada", "Alan", "Grace", "Edsger", "Barbara", "Ken", "Dennis", "Donald", "Frances",
         "John", "Leslie", "Margaret", "Niklaus", "Radia", "Tony", "Whitfield"]
ANIMALS = ["cat", "dog", "fox", "owl", "horse", "rabbit", "mouse", "bear", "wolf", "duck"]
PLACES = ["the garden", "the river", "the old mill", "the market", "the library",
          "the hill", "the harbor", "the forest", "the station", "the bridge"]
OBJECTS = ["a red apple", "a small key", "an old map", "a blue box", "a heavy stone",
           "a paper boat", "a silver coin", "a wooden spoon", "a green lamp", "a long rope"]
VERBS = [("sees", "saw"), ("finds", "found"), ("carries", "carried"), ("drops", "dropped"),
         ("paints", "painted"), ("hides", "hid"), ("sells", "sold"), ("buys", "bought")]
ADJ = ["quick", "lazy", "quiet", "brave", "clever", "sleepy", "happy", "curious"]
TIMES = ["In the morning", "At noon", "In the evening", "At night", "On Monday", "On Friday"]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
           "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
           "seventeen", "eighteen"]


def _story(rng: random.Random) -> list[str]:
    name, animal, place = rng.choice(NAMES), rng.choice(ANIMALS), rng.choice(PLACES)
    thing = rng.choice(OBJECTS)
    present, past = rng.choice(VERBS)
    adj = rng.choice(ADJ)
    return [
        f"{rng.choice(TIMES)}, {name} walks to {place}.",
        f"There {name} {present} the {adj} {animal}.",
        f"The {adj} {animal} {present} {thing}.",
        f"Yesterday {name} {past} {thing} near {place}, and the {animal} {past} it too.",
        f"{name} says: the {animal} is {adj}, and {thing} belongs in {place}.",
    ]


def _arithmetic(rng: random.Random) -> list[str]:
    a, b = rng.randrange(10), rng.randrange(9)
    c = rng.randrange(1, 10)
    return [
        f"{NUMBERS[a].capitalize()} plus {NUMBERS[b]} is {NUMBERS[a + b]}.",
        f"{NUMBERS[a + b].capitalize()} minus {NUMBERS[b]} is {NUMBERS[a]}.",
        f"{NUMBERS[c].capitalize()} plus {NUMBERS[c]} is {NUMBERS[2 * c]}.",
    ]


def _counting(rng: random.Random) -> list[str]:
    start = rng.randrange(0, 10)
    n = rng.randrange(4, 9)
    seq = ", ".join(NUMBERS[start + i] for i in range(min(n, len(NUMBERS) - start)))
    return [f"Count with me: {seq}."]


def _inventory(rng: random.Random) -> list[str]:
    name = rng.choice(NAMES)
    k = rng.randrange(1, 10)
    animal = rng.choice(ANIMALS)
    plural = animal + ("es" if animal.endswith(("x", "s")) else "s")
    noun = animal if k == 1 else plural
    verb = "is" if k == 1 else "are"
    return [f"{name} has {NUMBERS[k]} {noun}. There {verb} {NUMBERS[k]} {noun} in {rng.choice(PLACES)}."]


KINDS = (_story, _arithmetic, _counting, _inventory)


def document(rng: random.Random) -> str:
    sentences: list[str] = []
    for _ in range(rng.randrange(3, 7)):
        sentences.extend(rng.choice(KINDS)(rng))
    return " ".join(sentences)


def write_corpus(folder: Path, num_docs: int = 4000, seed: int = 0) -> Path:
    """Write ``folder/train.jsonl`` (one {"text": ...} per line); returns the file path."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "train.jsonl"
    tmp = path.with_suffix(".jsonl.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for _ in range(num_docs):
            f.write(json.dumps({"text": document(rng)}) + "\n")
    tmp.replace(path)
    return path


def iter_texts(path: Path):
    with path.open(encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]
