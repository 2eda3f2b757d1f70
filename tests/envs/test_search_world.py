"""The Search world generator (envs/search_world.py) and the shipped files it writes: deterministic,
train and validation about disjoint entities, every question answerable from the corpus hop by hop,
BM25 finds each hop's passage, and the warm start's demonstrations score 1 through the env."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from pacerl.envs.retriever import BM25Index, create_app
from pacerl.envs.search import SearchEnv, search_turns
from pacerl.envs.search_world import (
    SHIPPED,
    SearchWorldSet,
    World,
    accuracy_by_hops,
    build_world,
    main,
    questions,
    shipped_world,
    write_shipped,
)
from pacerl.envs.tasks import DATA_DIR, Task, load_tasks
from tests.helpers import ThreadServer

SMALL = SearchWorldSet(places=40, people=200, rivers=10, seed=3, train=(60, 60), val=(20, 20))


@pytest.fixture(scope="module")
def world() -> World:
    return shipped_world()


@pytest.fixture(scope="module")
def passages() -> dict[str, str]:
    """The shipped corpus's passage texts by title, read from the file itself."""
    rows = [json.loads(line) for line in (DATA_DIR / "search-corpus.jsonl").read_text().splitlines()]
    by_title = {}
    for row in rows:
        title, _, text = row["contents"].partition("\n")
        by_title[title.strip('"')] = text
    assert len(by_title) == len(rows)  # titles are unique
    return by_title


@pytest.fixture(scope="module")
def index() -> BM25Index:
    return BM25Index.from_jsonl(DATA_DIR / "search-corpus.jsonl")


def test_the_generator_is_deterministic_and_wrote_the_shipped_files(tmp_path: Path) -> None:
    write_shipped(tmp_path)
    for name in ("search-corpus", "search-train", "search-val"):
        assert (tmp_path / f"{name}.jsonl").read_bytes() == (DATA_DIR / f"{name}.jsonl").read_bytes(), name
    first = build_world(SMALL.places, SMALL.people, SMALL.rivers, SMALL.seed)
    again = build_world(SMALL.places, SMALL.people, SMALL.rivers, SMALL.seed)
    other = build_world(SMALL.places, SMALL.people, SMALL.rivers, SMALL.seed + 1)
    assert first == again and first.documents() == again.documents() and first != other
    assert questions(first, "train", 5, 5, 1, "t") == questions(again, "train", 5, 5, 1, "t")
    with pytest.raises(ValueError, match="people >= 4"):
        build_world(places=10, people=20, rivers=3, seed=0)


def test_the_shipped_world_size_and_question_mix(world: World, passages: dict[str, str]) -> None:
    assert (len(world.places), len(world.people), len(passages)) == (4000, 16000, 20000)
    assert len({place.river for place in world.places.values()}) > 500  # rivers: answers, not passages
    train, val = load_tasks("search-train"), load_tasks("search-val")
    assert Counter(t.metadata["hops"] for t in train) == {1: SHIPPED.train[0], 2: SHIPPED.train[1]}
    assert Counter(t.metadata["hops"] for t in val) == {1: 200, 2: 200}
    # Alternating: the first 200 (a run's default evaluation) hold 100 of each.
    assert Counter(t.metadata["hops"] for t in val[:200]) == {1: 100, 2: 100}
    assert all(t.level == t.metadata["hops"] == len(t.metadata["queries"]) for t in train + val)
    relations = Counter(tuple(t.metadata["relations"]) for t in train)
    assert len([r for r in relations if len(r) == 1]) == 6 and len([r for r in relations if len(r) == 2]) == 9
    assert len({t.question for t in train}) > 0.9 * len(train)  # measured: 15,066 distinct of 16,000
    # Small enough for the repository: measured 2.4 MB, 3.0 MB and 75 kB.
    assert sum((DATA_DIR / f"search-{n}.jsonl").stat().st_size for n in ("corpus", "train", "val")) < 7e6


def test_train_and_validation_ask_about_disjoint_entities(world: World) -> None:
    def entities(tasks: list[Task]) -> set[str]:
        names = {name for task in tasks for name in task.metadata["queries"]}
        return names | {
            task.answer for task in tasks if task.answer in world.places or task.answer in world.people
        }

    train, val = entities(load_tasks("search-train")), entities(load_tasks("search-val"))
    assert train and val and not train & val
    split = {name: entity.split for name, entity in [*world.places.items(), *world.people.items()]}
    assert {split[name] for name in train} == {"train"} and {split[name] for name in val} == {"val"}
    # No relation crosses the splits, so no passage links a validation entity to a training one.
    for person in world.people.values():
        assert split[person.birthplace] == split[person.teacher] == person.split
    for place in world.places.values():
        assert split[place.founder] == place.split and world.people[place.founder].birthplace != place.name


def test_every_question_is_answerable_from_the_corpus_hop_by_hop(passages: dict[str, str]) -> None:
    for task in load_tasks("search-train") + load_tasks("search-val"):
        first = passages[task.metadata["queries"][0]]
        assert task.metadata["queries"][0] in task.question
        if task.metadata["hops"] == 1:
            assert task.answer in first, task
        else:
            bridge = task.metadata["queries"][1]
            assert bridge in first and bridge not in task.question, task  # the first passage names it
            assert task.answer in passages[bridge], task  # the second holds the answer
            assert task.answer not in first, task  # one search is not enough


def test_bm25_ranks_each_hops_passage_first(index: BM25Index) -> None:
    tasks = load_tasks("search-val") + load_tasks("search-train")[:3000]
    queries = [query for task in tasks for query in task.metadata["queries"]]
    results = index.search(queries, topk=3)
    first = sum(
        bool(hits) and hits[0][0]["contents"].startswith(f'"{q}"\n')
        for q, hits in zip(queries, results, strict=True)
    )
    top3 = sum(
        any(d["contents"].startswith(f'"{q}"\n') for d, _ in hits)
        for q, hits in zip(queries, results, strict=True)
    )
    # Measured: every one of the 4,900 queries (400 val + 3,000 train tasks) has its passage first.
    assert first / len(queries) >= 0.99 and top3 / len(queries) >= 0.995, (first, top3, len(queries))


@pytest.fixture(scope="module")
def url(index: BM25Index) -> Iterator[str]:
    with ThreadServer(create_app(index)) as server:
        yield server.url


@pytest.mark.parametrize("hops", [1, 2])
def test_demonstrations_score_one_through_the_env(url: str, hops: int) -> None:
    tasks = [task for task in load_tasks("search-val") if task.metadata["hops"] == hops][:30]
    env = SearchEnv(tasks=tasks, retriever_url=url)
    for task in tasks:
        turns = search_turns(task)
        assert [m["role"] for m in turns] == ["assistant", "tool"] * hops + ["assistant"]
        env.reset(options={"task": task})
        for action, expected in zip(turns[0::2], [*turns[1::2], None], strict=True):
            observation, reward, terminated, truncated, info = env.step(action["content"])
            if expected is None:
                assert (observation, reward, terminated, truncated) == ((), 1.0, True, False), task
            else:
                # The env's own search returns exactly the passage the demonstration shows.
                (message,) = observation
                assert message["content"] == expected["content"] and not info["error"]
                assert (reward, terminated, truncated) == (0.0, False, False)
        assert info["tool_calls"] == hops
    env.close()


def test_a_two_hop_demonstration_searches_the_entity_the_first_passage_names() -> None:
    task = next(task for task in load_tasks("search-val") if task.metadata["hops"] == 2)
    first_call, first_passage, second_call, second_passage, answer = search_turns(task)
    subject, bridge = task.metadata["queries"]
    assert json.loads(first_call["content"].removeprefix("<tool_call>").removesuffix("</tool_call>")) == {
        "name": "search",
        "arguments": {"query": subject, "topk": 1},
    }
    assert (
        first_passage["content"].startswith(f"Doc 1(Title: {subject}) ")
        and bridge in first_passage["content"]
    )
    assert f'"query": "{bridge}"' in second_call["content"]
    assert second_passage["content"].startswith(f"Doc 1(Title: {bridge}) ")
    assert task.answer in second_passage["content"] and task.answer not in first_passage["content"]
    assert answer["content"] == f"<answer> {task.answer} </answer>"
    # A task from elsewhere (no queries in its metadata) searches its whole question once.
    plain = search_turns(Task("x", "Who founded Ardbridan?", ("Galphadra",)))
    assert '"query": "Who founded Ardbridan?"' in plain[0]["content"] and len(plain) == 3


def test_accuracy_by_hops_reads_an_eval_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    val = load_tasks("search-val")[:4]  # one-hop, two-hop, one-hop, two-hop
    per_task = [
        {"task_id": val[0].id, "samples": 2, "correct": 2},
        {"task_id": val[1].id, "samples": 2, "correct": 0},
        {"task_id": val[2].id, "samples": 2, "correct": 1},
        {"task_id": val[3].id, "samples": 2, "correct": 1},
    ]
    assert accuracy_by_hops(val, per_task) == {1: 0.75, 2: 0.25}
    report = tmp_path / "eval.json"
    report.write_text(json.dumps({"per_task": per_task, "avg_at_k": 0.5}))
    main(["--report", str(report)])
    assert capsys.readouterr().out == "1-hop 0.750 2-hop 0.250 all 0.500\n"
