"""Writes story_openings.jsonl: templated story openings for self-distilling stories260K heads.

    python recipes/tiny/make_story_openings.py

Openings are combinations of simple templates, names, animals and places in
TinyStories' style, disjoint from ../shared/data/story_prompts_dev.jsonl (the
evaluation prompts), so heads are never trained on the prompts they are
measured on. The target writes the stories itself (`data.regenerate`).
"""

import itertools
import json
import random
from pathlib import Path

NAMES = ["Lily", "Tom", "Mia", "Ben", "Sue", "Max", "Anna", "Sam", "Lucy", "Jack", "Zoe", "Tim", "Emma", "Leo", "Amy", "Bob"]
ANIMALS = ["cat", "dog", "bird", "bunny", "frog", "duck", "fish", "bear", "mouse", "lion", "puppy", "kitten"]
PLACES = ["park", "garden", "beach", "forest", "farm", "zoo", "store", "pond", "hill", "school", "lake", "yard"]
THINGS = ["ball", "kite", "box", "toy car", "hat", "book", "cake", "flower", "doll", "boat", "rock", "drum"]
TEMPLATES = [
    "{name} and the {animal} went to the {place}.",
    "One sunny day, {name} found a {thing} in the {place}.",
    "There once was a little {animal} who lived near the {place}.",
    "{name} wanted to play with a {thing}, but",
    "In a small town, a {animal} named {name} loved the {place}.",
    "Every day, {name} took the {thing} to the {place}.",
    "{name} was sad because the {thing} was lost.",
    "A big {animal} came to the {place} and",
    "{name} said, \"Look at my new {thing}!\"",
    "At the {place}, {name} met a friendly {animal}.",
]


def main() -> None:
    rng = random.Random(0)
    combos = list(itertools.product(TEMPLATES, NAMES, ANIMALS, PLACES, THINGS))
    rng.shuffle(combos)
    seen, lines = set(), []
    for template, name, animal, place, thing in combos:
        text = template.format(name=name, animal=animal, place=place, thing=thing)
        if text not in seen:
            seen.add(text)
            lines.append(json.dumps({"id": f"opening-{len(lines)}", "text": text}))
        if len(lines) == 2000:
            break
    out = Path(__file__).with_name("story_openings.jsonl")
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} openings to {out}")


if __name__ == "__main__":
    main()
