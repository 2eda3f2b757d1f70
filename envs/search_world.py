"""The Search world: a seeded, made-up encyclopedia of cities and people, and the questions the Search
env asks about it (`python -m envs.search_world` rewrites envs/data/search-corpus.jsonl, search-train.jsonl
and search-val.jsonl identically; the sizes and seed are in `SHIPPED`).

Every name is a random string of syllables, so no model knows a fact without retrieving its passage,
and training and validation ask about disjoint parts of the world (each city, with the people born
there, belongs to one split, and every relation stays inside its split): memorising the training
questions transfers nothing, copying out of retrieved passages does. Each entity has one passage in
Search-R1's corpus form, `{"id", "contents": '"Name"\\ntext'}`:

    "Kaloter"  Kaloter is a city on the river Venmir, founded in 1204 by Orlo.
    "Orlo"     Orlo, a painter, was born in Sanimdor in 1168 and was taught by Quelba.

Questions are single-hop (one search for the subject, the answer is in its passage: "Who founded
Kaloter?") or two-hop (the answer of the first search is the subject of the second: "Who founded the
city where Orlo was born?", Orlo's passage names Sanimdor, Sanimdor's passage names the answer, and
Orlo's passage never holds it). Each task's metadata says how: `hops` (1 or 2), `relations` (the
relation each hop follows) and `queries` (the entity searched at each hop: the demonstrations' queries).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pacerl.envs.jsonl import write_jsonl
from pacerl.envs.tasks import DATA_DIR, Task, load_tasks

SYLLABLES = (
    "ka", "lo", "mir", "ven", "tor", "sa", "quel", "bri", "dan", "or", "pha", "zul", "nim", "ter", "wyn",
    "bel", "cor", "dra", "fen", "gal", "hal", "jor", "kel", "lin", "mor", "nes", "pol", "rath", "sil", "tam",
    "ul", "vor", "yth", "zen", "ard", "bex",
)  # fmt: skip
"""Names are two or three of these, capitalized (47,952 possible words)."""
OCCUPATIONS = ("painter", "poet", "sailor", "weaver", "mason", "healer", "scholar", "merchant")

PLACE_RELATIONS = ("founder", "founded", "river")
PERSON_RELATIONS = ("birthplace", "born", "teacher")
SINGLE_HOP = {
    "founder": "Who founded {}?",
    "founded": "In which year was {} founded?",
    "river": "On which river is {}?",
    "birthplace": "Where was {} born?",
    "born": "In which year was {} born?",
    "teacher": "Who taught {}?",
}
"""A question per relation; `{}` is the subject."""
BRIDGES = {
    "birthplace": "the city where {} was born",
    "founder": "the founder of {}",
    "teacher": "the teacher of {}",
}
"""How a two-hop question names its bridge entity (the first hop's answer); `{}` is the subject."""


@dataclass(frozen=True)
class Place:
    name: str
    river: str
    founded: int
    founder: str
    split: str


@dataclass(frozen=True)
class Person:
    name: str
    occupation: str
    birthplace: str
    born: int
    teacher: str
    split: str


@dataclass(frozen=True)
class World:
    """Every entity of the world, by name."""

    places: Mapping[str, Place]
    people: Mapping[str, Person]

    def passage(self, name: str) -> str:
        """The text of `name`'s passage (without its title line)."""
        if name in self.places:
            place = self.places[name]
            return (
                f"{name} is a city on the river {place.river}, founded in {place.founded} by {place.founder}."
            )
        person = self.people[name]
        return (
            f"{name}, a {person.occupation}, was born in {person.birthplace} in {person.born} "
            f"and was taught by {person.teacher}."
        )

    def documents(self) -> list[dict[str, str]]:
        """The corpus: one passage per entity, places then people, each in name order."""
        names = [*sorted(self.places), *sorted(self.people)]
        return [
            {"id": str(index), "contents": f'"{name}"\n{self.passage(name)}'}
            for index, name in enumerate(names)
        ]

    def fact(self, name: str, relation: str) -> str:
        """The value of `relation` for entity `name` (KeyError for a relation it does not have)."""
        entity: Place | Person = self.places[name] if name in self.places else self.people[name]
        return str(getattr(entity, relation))

    def relations(self, name: str) -> tuple[str, ...]:
        return PLACE_RELATIONS if name in self.places else PERSON_RELATIONS


def _names(rng: random.Random, count: int, taken: set[str]) -> list[str]:
    """`count` new names, none in `taken` (which grows by them)."""
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()
        if name not in taken:
            taken.add(name)
            names.append(name)
    return names


def build_world(places: int, people: int, rivers: int, seed: int, val_fraction: float = 0.1) -> World:
    """A world of `places` cities on `rivers` rivers and `people` people, deterministic in `seed`.
    A `val_fraction` share of the cities, with everyone born there, is the validation split; founders
    and teachers come from their city's or pupil's own split, so no relation crosses splits."""
    if places < 4 or people < 4 * places or rivers < 1 or not 0 < val_fraction < 1:
        raise ValueError("need places >= 4, people >= 4 * places, rivers >= 1 and 0 < val_fraction < 1")
    rng = random.Random(seed)
    taken: set[str] = set()
    river_names = _names(rng, rivers, taken)
    place_names = _names(rng, places, taken)
    person_names = _names(rng, people, taken)
    val_places = max(2, round(places * val_fraction))
    place_split = {name: "val" if index < val_places else "train" for index, name in enumerate(place_names)}
    by_split: dict[str, list[str]] = {"train": [], "val": []}
    births: dict[str, tuple[str, int]] = {}
    for index, name in enumerate(person_names):
        # Every city has someone born there: the first `places` people go round the cities once.
        birthplace = place_names[index] if index < places else rng.choice(place_names)
        births[name] = (birthplace, rng.randint(1100, 1900))
        by_split[place_split[birthplace]].append(name)
    people_map: dict[str, Person] = {}
    for name in person_names:
        birthplace, born = births[name]
        split = place_split[birthplace]
        teacher = name
        while teacher == name:
            teacher = rng.choice(by_split[split])
        occupation = rng.choice(OCCUPATIONS)
        people_map[name] = Person(name, occupation, birthplace, born, teacher, split)
    places_map: dict[str, Place] = {}
    for name in place_names:
        split = place_split[name]
        founder = rng.choice(by_split[split])
        while births[founder][0] == name:  # a founder born elsewhere: "where was the founder born" != it
            founder = rng.choice(by_split[split])
        founded = births[founder][1] + rng.randint(20, 60)
        places_map[name] = Place(name, rng.choice(river_names), founded, founder, split)
    return World(places_map, people_map)


def questions(world: World, split: str, single: int, double: int, seed: int, prefix: str) -> list[Task]:
    """`single` single-hop and `double` two-hop questions about the `split` entities, alternating
    (a task file's first n tasks hold both kinds), ids `<prefix>-NNNNN`. Two-hop questions whose
    answer already stands in the subject's passage are drawn again."""
    rng = random.Random(seed)
    subjects = sorted(
        [name for name, place in world.places.items() if place.split == split]
        + [name for name, person in world.people.items() if person.split == split]
    )
    ones = [_single(world, rng.choice(subjects), rng) for _ in range(single)]
    twos: list[tuple[str, str, dict[str, Any]]] = []
    while len(twos) < double:
        two = _double(world, rng.choice(subjects), rng)
        if two is not None:
            twos.append(two)
    ordered = [item for pair in zip(ones, twos, strict=False) for item in pair]
    ordered += ones[len(twos) :] + twos[len(ones) :]
    return [
        Task(f"{prefix}-{index:05d}", question, (answer,), metadata["hops"], metadata)
        for index, (question, answer, metadata) in enumerate(ordered)
    ]


def _single(world: World, subject: str, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    relation = rng.choice(world.relations(subject))
    metadata = {"hops": 1, "relations": [relation], "queries": [subject]}
    return SINGLE_HOP[relation].format(subject), world.fact(subject, relation), metadata


def _double(world: World, subject: str, rng: random.Random) -> tuple[str, str, dict[str, Any]] | None:
    first = rng.choice([r for r in world.relations(subject) if r in BRIDGES])
    bridge = world.fact(subject, first)
    second = rng.choice(world.relations(bridge))
    answer = world.fact(bridge, second)
    if answer in world.passage(subject):
        return None
    question = SINGLE_HOP[second].format(BRIDGES[first].format(subject))
    metadata = {"hops": 2, "relations": [first, second], "queries": [subject, bridge]}
    return question, answer, metadata


@dataclass(frozen=True)
class SearchWorldSet:
    """How the shipped Search files are made."""

    places: int
    people: int
    rivers: int
    seed: int
    train: tuple[int, int]
    """Single-hop and two-hop training questions."""
    val: tuple[int, int]
    """Single-hop and two-hop validation questions."""


SHIPPED = SearchWorldSet(places=4000, people=16000, rivers=600, seed=17, train=(8000, 8000), val=(200, 200))
"""The shipped world: 20,000 passages; 16,000 training and 400 validation questions, half of each two-hop."""


def write_shipped(directory: Path = DATA_DIR, spec: SearchWorldSet = SHIPPED) -> World:
    """Regenerate search-corpus.jsonl, search-train.jsonl and search-val.jsonl in `directory`."""
    world = build_world(spec.places, spec.people, spec.rivers, spec.seed)
    write_jsonl(directory / "search-corpus.jsonl", world.documents())
    for offset, (split, (single, double)) in enumerate((("train", spec.train), ("val", spec.val)), start=1):
        tasks = questions(world, split, single, double, spec.seed + offset, f"search-{split}")
        write_jsonl(directory / f"search-{split}.jsonl", (task.to_row() for task in tasks))
    return world


def shipped_world() -> World:
    """The world behind the shipped files (rebuilt from `SHIPPED`, about a second)."""
    return build_world(SHIPPED.places, SHIPPED.people, SHIPPED.rivers, SHIPPED.seed)


def answerable(world: World, task: Task) -> Sequence[str]:
    """The passages (texts) that answer `task`, one per hop, from its metadata; KeyError if they do not
    exist, ValueError if the last one lacks the answer."""
    passages = [world.passage(name) for name in task.metadata["queries"]]
    if task.answer not in passages[-1]:
        raise ValueError(
            f"{task.id}: {task.answer!r} is not in the passage of {task.metadata['queries'][-1]}"
        )
    return passages


def accuracy_by_hops(tasks: Sequence[Task], per_task: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """Hops -> the share of correct episodes, from an evaluation's `per_task` results (`{"task_id",
    "samples", "correct"}`, as `pacerl eval --out` writes them) on `tasks`."""
    hops = {task.id: int(task.metadata["hops"]) for task in tasks}
    correct: dict[int, list[int]] = {}
    for result in per_task:
        counts = correct.setdefault(hops[str(result["task_id"])], [0, 0])
        counts[0] += int(result["correct"])
        counts[1] += int(result["samples"])
    return {hop: right / total for hop, (right, total) in sorted(correct.items())}


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m envs.search_world` rewrites the shipped files; `--report EVAL.json` prints the
    single-hop and two-hop accuracy of a `pacerl eval --out` report on the shipped validation set."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m envs.search_world", description=main.__doc__)
    parser.add_argument("--report", metavar="EVAL.json", help="a pacerl eval report on search-val")
    args = parser.parse_args(argv)
    if args.report:
        report = json.loads(Path(args.report).read_text())
        by_hops = accuracy_by_hops(load_tasks("search-val"), report["per_task"])
        print(
            " ".join(f"{hop}-hop {value:.3f}" for hop, value in by_hops.items()),
            f"all {report['avg_at_k']:.3f}",
        )
        return
    write_shipped()
    print(f"wrote the Search world to {DATA_DIR}")


if __name__ == "__main__":
    main()
