"""Tests for env_search.py ("tool_use"): the generated encyclopedia, BM25, the search and wiki
tools, the questions and their split, rewards, step(), the expert and the random floor.

Ground truth comes from outside the code under test: BM25 from a slow pure-Python reference and from
numbers worked out by hand; answers from regular expressions over the article texts an agent would
read (not from the generator's records); English words from the prose of the rest of this
repository.
"""

import glob
import json
import math
import random
import re

import pytest

from config import load_config
import env
from env import Action, ToolCall, make_env, split_of
from envs.env_search import BM25, KINDS, TEMPLATE_WORDS, TEST_PERCENT, tokenize
from envs.worlds import read_tasks, write_tasks
from eval import play_scripted, scripted_metrics
from tools import validate_arguments

CONFIG = load_config("configs/tool_use.yaml")


@pytest.fixture(scope="module")
def tu():
    return make_env("tool_use", **CONFIG.envs[0].kwargs)


def act(*calls, text="", parse_error=None):
    return Action(
        text=text,
        tool_calls=tuple(ToolCall(name, args) for name, args in calls),
        parse_error=parse_error,
    )


def run(tu, name, **arguments):
    """(observation text, error kind) of one tool call on a fresh episode."""
    state, _ = tu.reset(tu.sample_tasks("train", 1, seed=0)[0], seed=0)
    _, text, kind = tu.run_tool(state, ToolCall(name, arguments))
    return text, kind


# -----------------------------------------------------------------------------
# The encyclopedia, read back from its text

CITY = re.compile(
    r"(\w+)\n\1 is a city in (\w+)\. It was founded in (\d+)\. Its population is (\d+)\."
)
COMPANY = re.compile(
    r"(\w+)\n\1 is a company headquartered in (\w+)\. It was founded in (\d+) by (\w+ \w+)\. "
    r"It has (\d+) employees\."
)
PERSON = re.compile(r"(\w+ \w+)\n\1 is a (\w+)\. (?:He|She) was born in (\w+) in (\d+)\.")


def read_facts(tu) -> dict[str, dict]:
    """Every article parsed by the patterns above: title -> its facts. Fails on any other shape."""
    facts = {}
    for a in tu.corpus.articles:
        if m := CITY.fullmatch(a.text):
            facts[m[1]] = {"kind": "city", "founded": int(m[3]), "population": int(m[4])}
        elif m := COMPANY.fullmatch(a.text):
            facts[m[1]] = {"kind": "company", "city": m[2], "founded": int(m[3]), "founder": m[4]}
        elif m := PERSON.fullmatch(a.text):
            facts[m[1]] = {"kind": "person", "birthplace": m[3], "born": int(m[4])}
        else:
            raise AssertionError(f"article of unexpected shape: {a.text!r}")
    return facts


def test_encyclopedia_is_deterministic_and_linked(tu):
    assert make_env("tool_use").corpus == tu.corpus  # same seed, same world
    assert make_env("tool_use", corpus_seed=1).corpus.articles != tu.corpus.articles
    facts = read_facts(tu)
    assert len(facts) == len(tu.corpus.articles) == 1600  # titles are unique
    kinds = [f["kind"] for f in facts.values()]
    assert (kinds.count("city"), kinds.count("company"), kinds.count("person")) == (500, 400, 700)
    companies = [f for f in facts.values() if f["kind"] == "company"]
    assert len({f["city"] for f in companies}) == len(companies)  # one company per headquarters
    assert len({f["founder"] for f in companies}) == len(companies)  # one company per founder
    cities = [f for f in facts.values() if f["kind"] == "city"]
    assert len({f["founded"] for f in cities}) == len(cities)  # "which was first" is never a tie
    for title, f in facts.items():  # links stay inside a split
        for other in (f.get("city"), f.get("founder"), f.get("birthplace")):
            if other is not None:
                assert facts[other]["kind"] in ("city", "person") and split_of(
                    other, TEST_PERCENT
                ) == split_of(title, TEST_PERCENT)
    for f in companies:
        assert 25 <= f["founded"] - facts[f["founder"]]["born"] <= 60
    assert max(len(a.text.split()) for a in tu.corpus.articles) < 25  # short observations
    test_share = sum(split_of(t, TEST_PERCENT) == "test" for t in facts) / len(facts)
    assert 0.15 < test_share < 0.25


@pytest.mark.parametrize("corpus_seed", [0, 3, 4])
def test_names_are_unique_made_up_words(corpus_seed):
    corpus = make_env("tool_use", corpus_seed=corpus_seed).corpus
    name_words = [w for a in corpus.articles for w in tokenize(a.title)]
    regions = {c.region.lower() for c in corpus.cities.values()}
    assert (
        len(name_words) == len(set(name_words))
        and len(regions) == 8
        and not regions & set(name_words)
    )
    names = set(name_words) | regions
    english = set()  # the prose of the rest of the repo
    for path in glob.glob("**/*.py", recursive=True) + glob.glob("**/*.md", recursive=True):
        if "env_search" not in path:
            english |= set(re.findall(r"[a-z]+", open(path).read().lower()))
    assert len(english) > 2000
    assert not names & english
    # Every other word of the articles is a template word, which no name may be.
    other = set(tokenize(" ".join(s for a in corpus.articles for s in a.sentences))) - names
    assert {w for w in other if not w.isdigit()} <= TEMPLATE_WORDS
    assert not names & TEMPLATE_WORDS


# -----------------------------------------------------------------------------
# BM25


def slow_bm25(documents: list[str], query: str, k1: float = 1.2, b: float = 0.75) -> list[float]:
    """The formula of BM25's docstring, term by term, in plain Python."""
    docs = [re.findall(r"[a-z0-9]+", d.lower()) for d in documents]
    avgdl = sum(len(d) for d in docs) / len(docs)
    terms = []
    for word in re.findall(r"[a-z0-9]+", query.lower()):
        if word not in terms:
            terms.append(word)
    scores = [0.0] * len(docs)
    for term in terms:
        n = sum(term in d for d in docs)
        if n == 0:
            continue
        idf = math.log(1 + (len(docs) - n + 0.5) / (n + 0.5))
        for i, d in enumerate(docs):
            tf = d.count(term)
            scores[i] += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len(d) / avgdl))
    return scores


def test_bm25_hand_computed():
    index = BM25(["apple banana", "Apple cherry, cherry!", "date"])  # lengths 2, 3, 1: avgdl 2
    # cherry: n = 1, idf = ln(1 + 2.5 / 1.5) = ln(8/3); doc 1: tf 2, k1 * (0.25 + 0.75 * 3/2) = 1.65
    assert index.scores("cherry").tolist() == pytest.approx(
        [0, math.log(8 / 3) * 2 * 2.2 / (2 + 1.65), 0], abs=1e-12
    )
    # apple: n = 2, idf = ln(1 + 1.5 / 2.5) = ln(1.6); doc 0: tf 1, norm 1.2 -> 2.2 / 2.2; doc 1:
    # 2.2 / 2.65
    assert index.scores("APPLE apple").tolist() == pytest.approx(
        [math.log(1.6), math.log(1.6) * 2.2 / 2.65, 0], abs=1e-12
    )
    assert index.top("apple", 3) == [0, 1]  # only documents that match
    # doc 1: 1.18 + 0.39 = 1.57; doc 2: date, ln(8/3) * 2.2 / (1 + 1.2 * (0.25 + 0.75 / 2)) = 1.23;
    # doc 0: 0.47
    assert index.top("cherry date apple", 3) == [1, 2, 0]
    assert index.scores("cherry date apple")[2] == pytest.approx(
        math.log(8 / 3) * 2.2 / 1.75, abs=1e-12
    )
    assert index.top("fig", 3) == [] and index.top("", 3) == []


def test_bm25_ties_go_to_the_lower_index():
    index = BM25(["x y", "q", "y x", "x y", "x  y"])
    assert index.top("x", 5) == [0, 2, 3, 4]
    assert index.top("y x y", 2) == [0, 2]
    # enough ties for an unstable sort to shuffle
    many = BM25(["x x"] * 40 + ["x"] * 40 + ["x x"] * 40)
    assert many.top("x", 120) == list(range(40)) + list(range(80, 120)) + list(range(40, 80))


def test_bm25_matches_the_slow_reference(tu):
    rng = random.Random(0)
    words = list(tu.index.vocab) + ["unknownword", "zz9"]
    small = [
        " ".join(rng.choice(["a", "b", "c", "d", "e"]) for _ in range(rng.randint(1, 12)))
        for _ in range(30)
    ]
    for documents, pool, k1, b, queries in (
        (small, ["a", "b", "c", "d", "e", "f"], 1.2, 0.75, 30),
        (small, ["a", "b", "c", "d", "e", "f"], 2.0, 0.3, 30),
        ([" ".join(a.sentences) for a in tu.corpus.articles], words, 1.2, 0.75, 8),
    ):
        index = tu.index if documents is not small else BM25(documents, k1=k1, b=b)
        for _ in range(queries):
            query = " ".join(rng.choice(pool) for _ in range(rng.randint(1, 6)))
            assert index.scores(query).tolist() == pytest.approx(
                slow_bm25(documents, query, k1, b), abs=1e-9, rel=0
            )


# -----------------------------------------------------------------------------
# Tools


def test_search(tu):
    company = next(iter(tu.corpus.companies.values()))
    text, kind = run(tu, "search", query=f"company headquartered in {company.city}")
    lines = text.split("\n")
    assert kind is None and len(lines) == 3
    assert (
        lines[0] == f"{company.name}: {company.name} is a company headquartered in {company.city}."
    )
    for line in lines[1:]:  # then articles that name the city
        assert company.city in tu.corpus.articles[tu.corpus.find(line.split(":")[0])].text
    assert run(tu, "search", query="Quixotic zebras?") == ("No results.", None)
    assert run(tu, "search", query="x" * 201)[1] == "error"


def test_search_finds_every_company_by_its_headquarters(tu):
    for company in tu.corpus.companies.values():
        first = tu.index.top(f"company headquartered in {company.city}", 1)[0]
        assert tu.corpus.articles[first].title == company.name


def test_wiki(tu):
    city = next(iter(tu.corpus.cities.values()))
    text, kind = run(tu, "wiki", title=f"  {city.name.upper()} ")
    assert kind is None and text == (
        f"{city.name}\n{city.name} is a city in {city.region}. It was founded in "
        f"{city.founded}. Its population is {city.population}."
    )
    person = next(iter(tu.corpus.people))
    text, kind = run(tu, "wiki", title=person.split()[0])  # half a name: BM25 suggests the person
    assert kind == "error" and text.startswith(
        f"Error: no article titled {person.split()[0]!r}. Closest titles: "
    )
    assert person in text
    text, kind = run(tu, "wiki", title=city.name[:-1])  # a typo: no word in common, close spelling
    assert kind == "error" and city.name in text
    assert run(tu, "wiki", title="Qqqqqqq") == (
        "Error: no article titled 'Qqqqqqq'. Use search to find titles.",
        "error",
    )
    assert run(tu, "wiki", title="x" * 201)[1] == "error"


def test_tool_schemas(tu):
    assert tu.tool_names == ("search", "wiki", "calculator", "finish")
    assert [s["function"]["name"] for s in tu.tools()] == list(tu.tool_names)
    assert all(env.TOOLS[name].bounded for name in tu.tool_names)
    assert len(json.dumps(tu.tools()).split()) < 110  # schemas go into every prompt


# -----------------------------------------------------------------------------
# Questions and the split


def expected_answer(task, facts) -> str:
    """The answer worked out from the prompt and the article texts alone."""
    names = task.meta["entities"]
    kind = task.meta["kind"]
    assert all(name in task.prompt for name in names)
    if kind in ("city_founded", "person_born"):
        return str(facts[names[0]]["founded" if kind == "city_founded" else "born"])
    if kind in ("earlier_city", "founding_gap"):
        a, b = (facts[n]["founded"] for n in names)
        return (names[0] if a < b else names[1]) if kind == "earlier_city" else str(abs(a - b))
    if kind in ("hq_company", "hq_founder"):
        (company,) = [
            t for t, f in facts.items() if f["kind"] == "company" and f["city"] == names[0]
        ]
        return company if kind == "hq_company" else facts[company]["founder"]
    company = facts[names[0]]
    founder = facts[company["founder"]]
    return str(
        {
            "founder_born": founder["born"],
            "founder_age": company["founded"] - founder["born"],
            "birthplace_population": facts[founder["birthplace"]].get("population"),
        }[kind]
    )


def test_answers_follow_from_the_articles(tu):
    facts = read_facts(tu)
    for split in ("train", "test"):
        tasks = tu.sample_tasks(split, 600, seed=1)
        assert {t.meta["kind"] for t in tasks} == set(KINDS)
        for t in tasks:
            assert t.answer == expected_answer(t, facts), t
            assert t.meta["answer_type"] == ("number" if t.answer.isdigit() else "name")
            assert t.meta["hops"] == KINDS[t.meta["kind"]].hops == len(t.meta["calls"])
        first = [
            t.answer == t.meta["entities"][0] for t in tasks if t.meta["kind"] == "earlier_city"
        ]
        assert 0.3 < sum(first) / len(first) < 0.7  # naming the first city is a coin flip


def test_sample_tasks_deterministic_distinct_and_serializable(tu, tmp_path):
    a = tu.sample_tasks("train", 500, seed=3)
    # nothing hidden in the object
    assert a == make_env("tool_use").sample_tasks("train", 500, seed=3)
    assert a != tu.sample_tasks("train", 500, seed=4)
    assert tu.sample_tasks("train", 100, seed=3) == a[:100]  # a prefix of a longer draw
    assert len({t.id for t in a}) == len({t.prompt for t in a}) == 500
    write_tasks(a, tmp_path / "tasks.jsonl")
    assert read_tasks(tmp_path / "tasks.jsonl") == a  # meta is plain JSON


def test_train_and_test_share_no_entity(tu):
    train = [t for seed in range(3) for t in tu.sample_tasks("train", 1000, seed=seed)]
    test = [t for seed in range(3) for t in tu.sample_tasks("test", 600, seed=seed)]
    train_names = {n for t in train for n in t.meta["needs"]}
    test_names = {n for t in test for n in t.meta["needs"]}
    assert not train_names & test_names
    assert all(split_of(n, TEST_PERCENT) == "train" for n in train_names)
    assert all(split_of(n, TEST_PERCENT) == "test" for n in test_names)
    assert not {t.prompt for t in train} & {t.prompt for t in test}
    name_answers = {t.answer for t in train if t.meta["answer_type"] == "name"}
    assert not name_answers & {t.answer for t in test if t.meta["answer_type"] == "name"}
    for t in test:  # everything the expert reads is held out
        args = " ".join(str(v) for _, a in t.meta["calls"] for v in a.values())
        assert {w for w in re.findall(r"[A-Z]\w+", args)} <= {
            w for n in t.meta["needs"] for w in n.split()
        }


@pytest.mark.parametrize("hops", [None, 1, 2, 3])
def test_enough_held_out_questions(hops):
    tu = make_env("tool_use", hops=hops)
    tasks = tu.sample_tasks("test", 256, seed=CONFIG.eval_seed)
    assert len({t.prompt for t in tasks}) == 256
    assert {t.meta["kind"] for t in tasks} == {
        k for k, spec in KINDS.items() if hops in (None, spec.hops)
    }
    counts = [sum(t.meta["kind"] == k for t in tasks) for k in tu.kinds]
    assert min(counts) > 256 / len(tu.kinds) / 2  # no kind crowded out


def test_difficulty_kwargs():
    tu = make_env("tool_use", kinds=("city_founded", "founding_gap"), weights=(0.0, 1.0))
    assert {t.meta["kind"] for t in tu.sample_tasks("train", 50, seed=0)} == {"founding_gap"}
    for bad, match in (
        ({"hops": 4}, "hops"),
        ({"kinds": ("poems",)}, "unknown kinds"),
        ({"hops": 1, "kinds": ("founding_gap",)}, "hops"),
        ({"weights": (1.0,)}, "weights"),
        ({"num_cities": 1}, "no (train|test) city"),
    ):
        with pytest.raises(ValueError, match=match):
            make_env("tool_use", **bad)
    tiny = make_env(
        "tool_use", kinds=("city_founded",), num_cities=20, num_companies=5, num_people=10
    )
    with pytest.raises(ValueError, match="only"):  # a world too small fails loudly
        tiny.sample_tasks("test", 50, seed=0)
    with pytest.raises(ValueError, match="split"):
        tu.sample_tasks("validation", 1, seed=0)


# -----------------------------------------------------------------------------
# Rewards and step()


def task_of(tu, kind, split="test"):
    return next(t for t in tu.sample_tasks(split, 200, seed=0) if t.meta["kind"] == kind)


@pytest.mark.parametrize(
    "kind, answer, reward",
    [
        ("city_founded", "{a}", 1.0),
        ("city_founded", " {a}.0 ", 1.0),
        ("city_founded", "{a}.", 1.0),
        ("city_founded", "{a}1", 0.0),
        ("city_founded", "in {a}", 0.0),
        ("city_founded", None, 0.0),
        ("hq_founder", "{a}", 1.0),
        ("hq_founder", "  {lower}. ", 1.0),
        ("hq_founder", '"{a}"', 1.0),
        ("hq_founder", "{first}", 0.0),
        ("hq_founder", "It was {a}", 0.0),
        ("hq_founder", "", 0.0),
    ],
)
def test_score(tu, kind, answer, reward):
    task = task_of(tu, kind)
    if answer is not None:
        answer = answer.format(
            a=task.answer, lower=task.answer.lower(), first=task.answer.split()[0]
        )
    assert tu.score(task, answer) == reward


def test_step_lookup_then_finish(tu):
    task = task_of(tu, "founder_born")
    company = task.meta["entities"][0]
    state, _ = tu.reset(task, seed=0)
    state, obs, reward, done, info = tu.step(state, act(("wiki", {"title": company})))
    assert obs == [
        {
            "role": "tool",
            "name": "wiki",
            "content": tu.corpus.articles[tu.corpus.find(company)].text,
        }
    ]
    assert (reward, done, state.turn, state.tool_calls, state.tool_errors) == (0.0, False, 1, 1, 0)
    state, obs, reward, done, info = tu.step(state, act(("finish", {"answer": task.answer})))
    assert (obs, reward, done, state.reward, info["format_ok"]) == ([], 1.0, True, 1.0, True)
    assert info["metrics"] == {"correct": 1.0, "well_formed": 1.0}
    with pytest.raises(ValueError, match="finished"):
        tu.step(state, act(("finish", {"answer": task.answer})))


def test_invalid_input_is_an_observation(tu):
    state, _ = tu.reset(task_of(tu, "city_founded"), seed=0)
    for action, error in (
        (act(("python_eval", {"code": "1"})), "unknown tool"),
        (act(("wiki", {"name": "x"})), "bad arguments"),
        (act(("search", {"query": ["x"]})), "must be a string"),
        (act(("wiki", {"title": "Nowhere"})), "no article titled"),
        (act(text="<tool_call>{", parse_error="invalid JSON"), "invalid JSON"),
    ):
        state, obs, reward, done, info = tu.step(state, action)
        assert (
            not done
            and reward == 0.0
            and obs[-1]["content"].startswith("Error:")
            and error in obs[-1]["content"]
        )
    assert (state.turn, state.tool_errors, state.parse_failures) == (5, 4, 1)


@pytest.mark.parametrize("bonus", [0.0, 0.1])
def test_format_bonus(bonus):
    tu = make_env("tool_use", format_bonus=bonus)
    task = task_of(tu, "city_founded")
    finish = lambda answer: act(("finish", {"answer": answer}))  # noqa: E731
    wiki = act(("wiki", {"title": task.meta["entities"][0]}))
    cases = [
        ([wiki, finish(task.answer)], 1.0 + bonus, 1.0),  # clean and right
        ([wiki, finish("1")], bonus, 1.0),  # clean and wrong: the bonus still
        ([act(("wiki", {"title": "Nowhere"})), finish(task.answer)], 1.0, 0.0),  # a tool error
        ([act(text="{", parse_error="bad"), finish(task.answer)], 1.0, 0.0),  # a parse failure
        ([act(text=f"It is {task.answer}.")], 1.0, 0.0),  # no finish call
        ([finish("   ")], 0.0, 0.0),
    ]  # an empty answer is not well formed
    for actions, reward, well_formed in cases:
        state, _ = tu.reset(task, seed=0)
        for a in actions:
            state, obs, r, done, info = tu.step(state, a)
        assert done and (r, state.reward) == (reward, reward), actions
        assert info["metrics"] == {"correct": float(reward >= 1.0), "well_formed": well_formed}


def test_plain_text_answers(tu):
    for kind, text, reward in (
        ("hq_company", "{a}", 1.0),
        ("hq_company", "{a} Works", 0.0),
        ("city_founded", "It was founded in {a}.", 1.0),
        ("city_founded", "soon", 0.0),
    ):
        task = task_of(tu, kind)
        state, _ = tu.reset(task, seed=0)
        state, obs, r, done, info = tu.step(state, act(text=text.format(a=task.answer)))
        assert (obs, r, done, info["format_ok"]) == ([], reward, True, False)


def test_reset_refuses_tasks_of_another_corpus(tu):
    task = make_env("tool_use", corpus_seed=1).sample_tasks("test", 1, seed=0)[0]
    with pytest.raises(ValueError, match="corpus_seed"):
        tu.reset(task, seed=0)


# -----------------------------------------------------------------------------
# Expert, random floor, budgets


def test_expert_and_random_on_held_out_tasks(tu):
    tasks = tu.sample_tasks("test", CONFIG.envs[0].eval_size, seed=CONFIG.eval_seed)
    max_turns = CONFIG.rollout.agent.max_turns
    expert = scripted_metrics(play_scripted(tu, tasks, "expert", 0, max_turns), "e")
    random_ = scripted_metrics(play_scripted(tu, tasks, "random", 0, max_turns), "r")
    assert expert["e/accuracy"] == 1.0 and expert["e/correct"] == 1.0
    assert expert["e/tool_calls"] == pytest.approx(sum(t.meta["hops"] for t in tasks) / len(tasks))
    assert max(t.meta["hops"] for t in tasks) + 1 < max_turns  # margin for a retry
    assert random_["r/accuracy"] < 0.1
    # Two turns: only the one-hop questions can be finished in time.
    short = scripted_metrics(play_scripted(tu, tasks, "expert", 0, 2), "s")
    assert short["s/accuracy"] == pytest.approx(
        sum(t.meta["hops"] == 1 for t in tasks) / len(tasks)
    )


def test_demonstrations(tu):
    rng = random.Random(0)
    for task in tu.sample_tasks("train", 90, seed=5):
        with_tools, in_head = tu.demonstration(task, rng, True), tu.demonstration(task, rng, False)
        calls = [
            c["function"] for m in with_tools if m["role"] == "assistant" for c in m["tool_calls"]
        ]
        assert [c["name"] for c in calls] == [n for n, _ in task.meta["calls"]] + ["finish"]
        assert calls[-1]["arguments"] == {"answer": task.answer}
        head_calls = [
            c["function"]["name"]
            for m in in_head
            if m["role"] == "assistant"
            for c in m["tool_calls"]
        ]
        assert head_calls == [c["name"] for c in calls if c["name"] != "calculator"]
        for demo in (with_tools, in_head):  # both replay to the right answer
            state, _ = tu.reset(task, seed=0)
            for m in demo[2::2]:
                call = m["tool_calls"][0]["function"]
                state, obs, reward, done, _ = tu.step(state, act((call["name"], call["arguments"])))
            assert done and reward == 1.0 and state.tool_errors == 0


def test_demonstration_refuses_what_it_cannot_copy(tu):
    task = task_of(tu, "founder_age", split="train")
    tampered = (
        env.Task(task.env, task.id, task.prompt, "99", task.meta),  # answer not observed
        env.Task(
            task.env,
            task.id,
            task.prompt,
            task.answer,  # a title never seen
            {**task.meta, "calls": [["wiki", {"title": tu.corpus.articles[0].title}]]},
        ),
    )
    for t in tampered:
        for use_tools in (True, False):  # the in-head result is checked too
            with pytest.raises(RuntimeError):
                tu.demonstration(t, random.Random(0), use_tools)


def test_random_action(tu):
    task = task_of(tu, "earlier_city")
    state, _ = tu.reset(task, seed=0)
    actions = [tu.random_action(state, random.Random(i)) for i in range(200)]
    assert actions == [tu.random_action(state, random.Random(i)) for i in range(200)]
    assert {a.tool_calls[0].name for a in actions} == set(tu.tool_names)
    for a in actions:
        (call,) = a.tool_calls
        assert validate_arguments(env.TOOLS[call.name].parameters, call.arguments)[1] is None
        if call.name == "calculator":
            assert re.fullmatch(r"\d{4} - \d{4}", call.arguments["expression"])
    args = [str(v) for a in actions for v in a.tool_calls[0].arguments.values()]
    assert set(task.meta["entities"]) <= set(args)  # names from the question ...
    assert len(set(args) - set(task.meta["entities"])) > 20  # ... and from the corpus


def test_expert_episodes_fit_the_token_budget(tu):
    from chat import render
    from sft import tokenize_conversation, train_tokenizer

    rng = random.Random(0)
    demos = [
        tu.demonstration(t, rng, rng.random() < 0.5) for t in tu.sample_tasks("train", 300, seed=0)
    ]
    tokenizer = train_tokenizer([render(m, tu.tools()) for m in demos], CONFIG.sft.vocab_size)
    lengths, turns = [], []
    for task in tu.sample_tasks("test", 60, seed=0):
        ids, mask = tokenize_conversation(
            tu.demonstration(task, rng, True), tu.tools(), tokenizer, "qwen2.5"
        )
        lengths.append(len(ids))
        turns += [len(run) for run in re.findall("1+", "".join(map(str, mask)))]
    assert max(lengths) < CONFIG.rollout.agent.max_total_tokens * 0.6
    assert max(turns) < CONFIG.rollout.max_tokens * 0.6
