"""env_search.py: "tool_use", multi-hop questions about a fictional encyclopedia, answered with
search + wiki.

The world. A small encyclopedia generated from `corpus_seed`: cities (region, founding year,
population), companies (headquarters city, founding year, founder, employees) and people
(occupation, birthplace, birth year), with made-up names from a syllable generator: every name word
is unique in the corpus and none is a word of the articles, questions or system prompt, so BM25
finds an entity by its name and nothing else (the shape of the syllables also keeps them away from
English words, though not surely). Facts are fictional, so no model can know them: it has to look
them up. Each article is a title line and two or three plain sentences (< 25 words):

    Velmora
    Velmora is a city in Drakun. It was founded in 1712. Its population is 48200.

Facts link articles (a company's founder and headquarters, a person's birthplace), so multi-hop
questions exist. Every company has its own headquarters city and its own founder, and cities have
distinct founding years, so every question below has exactly one answer.

Tools: `search(query)` ranks articles with a hand-written BM25 index (numpy; class BM25) and shows
the top 3 titles with their first sentence; `wiki(title)` returns one article (unknown titles: an
error that suggests the closest titles); plus tools.py's `calculator` and `finish`.

Questions. A kind's `hops` is the number of tool calls the expert makes before finish:
    1 hop   city_founded  "In what year was <city> founded?"                           wiki
            person_born   "In what year was <person> born?"                            wiki
            hq_company    "Which company is headquartered in <city>?"                  search
    2 hops  founder_born  "In what year was the founder of <company> born?"            wiki, wiki
            hq_founder    "Who founded the company headquartered in <city>?"           search, wiki
            earlier_city  "Which city was founded first, <A> or <B>?"                  wiki, wiki
    3 hops  founding_gap  "How many years passed between the founding of <A> and ..."  wiki, wiki,
                                                                                       calculator
            founder_age   "How old was the founder of <company> when it was founded?"  wiki, wiki,
                                                                                       calculator
            birthplace_population  "What is the population of the city where the founder of
                          <company> was born?"                                         wiki, wiki,
                                                                                       wiki
The city's article never names its company, so the hq_* questions need search (a reverse lookup).
Knobs: `hops` (1, 2 or 3: only the kinds with that many hops; None: all nine), or an explicit
`kinds` list, with `weights` (default equal). The default mix is a third of the questions at each
hop count. earlier_city answers are one of the two names in the question: a guess is right half
the time.

Split. Entities, not questions, are split: an entity is "test" when a hash of its name falls in the
lowest TEST_PERCENT (20%), whatever the seed. The generator links entities only within their split
(a test company has a test founder and a test headquarters; test people are born in test cities),
and a question draws its entities from one split, so a held-out question names and needs only
held-out entities: nothing a training question asks about (and no name it answers) recurs in a
held-out one, so memorized answers do not help (years and populations may coincide by chance).
The corpus holds every entity, so search works over everything.

Reward. 1.0 for the exact answer, else 0.0: numbers compared exactly (env.answers_match: "1712.0" is
1712), names case-insensitively after stripping spaces and punctuation at the ends. Optional
`format_bonus` (default 0): an episode that ends with finish, with no parse failure and no tool
error on the way, gets + format_bonus, right or wrong. The final step's info["metrics"] carries
"correct" (reward without the bonus) and "well_formed".

Expert (demonstration, use_tools=True): the shortest tool path of the table above, one call per
turn, then finish; every call's arguments and the answer are copied from the question or an earlier
observation (checked: the demonstration raises otherwise). use_tools=False: the same lookups without
the calculator, the difference computed "in the head" (finish with the number directly): shorter,
but hard for a tiny model, so RL has something to improve. Kinds without arithmetic have a
single path.
Imports: tools.py, env.py (and numpy, the standard library).
"""

import difflib
import hashlib
import math
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from env import (
    Action,
    Env,
    EnvState,
    Task,
    ToolCall,
    answers_match,
    assistant_message,
    extract_answer,
    register_env,
    split_of,
    tool_message,
)
from tools import calculate, format_exact, tool


# -----------------------------------------------------------------------------
# 1. The encyclopedia

# share of entities (by hash of the name) held out; fixed, so a test entity is a test entity under
# every config and seed
TEST_PERCENT = 20

# Syllables of the made-up names: onset + vowel (+ coda), e.g. "vel" + "mo" + "ra".
_ONSETS = (
    "b",
    "d",
    "f",
    "g",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "z",
    "br",
    "dr",
    "kr",
    "tr",
    "vr",
    "th",
)
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("n", "r", "l", "k", "m", "sk")  # no plain "s": it makes plurals (rules, sizes)
OCCUPATIONS = (
    "painter",
    "poet",
    "merchant",
    "banker",
    "weaver",
    "sailor",
    "builder",
    "miller",
    "doctor",
    "teacher",
)
SYSTEM_PROMPT = (
    "Answer with facts from the encyclopedia: search finds titles, wiki reads an article, "
    "calculator computes. Give the answer with finish."
)
# Words of the articles, the questions and the system prompt: a name must not be one of them, or
# BM25 (and the model) would take the word for the name.
TEMPLATE_WORDS = (
    frozenset(
        "is a city in it was founded its population company headquartered "
        "by has employees he she born what year which who the of how many "
        "years passed between and old when first or where".split()
    )
    | frozenset(OCCUPATIONS)
    | frozenset(re.findall(r"[a-z]+", SYSTEM_PROMPT.lower()))
)


@dataclass(frozen=True)
class City:
    name: str  # e.g. "Velmora"
    region: str  # a made-up region name (regions have no article)
    founded: int  # founding year, distinct across cities
    population: int  # a multiple of 100


@dataclass(frozen=True)
class Company:
    name: str  # e.g. "Brasmuk"
    city: str  # headquarters: a City name, no other company has it
    founded: int  # founding year
    founder: str  # a Person name, who founded no other company
    employees: int  # a distractor number the questions never ask for


@dataclass(frozen=True)
class Person:
    name: str  # "First Last", e.g. "Dorin Kavel"
    occupation: str  # one of OCCUPATIONS
    pronoun: str  # "He" or "She"
    born: int  # birth year
    birthplace: str  # a City name


@dataclass(frozen=True)
class Article:
    title: str  # the entity's name
    kind: str  # "city", "company" or "person"
    sentences: tuple[str, ...]  # the plain fact sentences; the first one names the kind of entity

    @property
    def text(self) -> str:
        """What wiki returns: the title line, then the sentences."""
        return self.title + "\n" + " ".join(self.sentences)


@dataclass(frozen=True)
class Encyclopedia:
    seed: int  # corpus_seed it was generated from
    cities: dict[str, City]  # by name, in generation order
    companies: dict[str, Company]  # by name
    people: dict[str, Person]  # by name
    articles: tuple[Article, ...]  # one per entity: cities, companies, then people
    by_title: dict[str, int]  # normalized title (see title_key) -> index into articles

    def find(self, title: str) -> int | None:
        """The article index of a title, matched case-insensitively, or None."""
        return self.by_title.get(title_key(title))


def title_key(title: str) -> str:
    return " ".join(title.lower().split())


def _name_word(rng: random.Random, syllables: int) -> str:
    """One pronounceable made-up word: CV syllables, a coda now and then, e.g. 'Velmora',
    'Kavel'."""
    parts = [
        rng.choice(_ONSETS)
        + rng.choice(_VOWELS)
        + (rng.choice(_CODAS) if rng.random() < 0.3 else "")
        for _ in range(syllables)
    ]
    return "".join(parts).capitalize()


def article_of(entity: City | Company | Person) -> Article:
    """The article text of an entity: its facts in fixed plain sentences."""
    if isinstance(entity, City):
        return Article(
            entity.name,
            "city",
            (
                f"{entity.name} is a city in {entity.region}.",
                f"It was founded in {entity.founded}.",
                f"Its population is {entity.population}.",
            ),
        )
    if isinstance(entity, Company):
        return Article(
            entity.name,
            "company",
            (
                f"{entity.name} is a company headquartered in {entity.city}.",
                f"It was founded in {entity.founded} by {entity.founder}.",
                f"It has {entity.employees} employees.",
            ),
        )
    return Article(
        entity.name,
        "person",
        (
            f"{entity.name} is a {entity.occupation}.",
            f"{entity.pronoun} was born in {entity.birthplace} in {entity.born}.",
        ),
    )


def build_encyclopedia(
    seed: int, num_cities: int, num_companies: int, num_people: int, num_regions: int = 8
) -> Encyclopedia:
    """Generate the world, deterministically from `seed`. Links stay inside a split (see the
    docstring); a split gets as many companies as it has cities and people to give them (a few fewer
    than asked at most, when the hash split is uneven)."""
    rng = random.Random(seed)
    used = set(TEMPLATE_WORDS)  # lowercase words taken: every name word is unique in the corpus

    def fresh(syllables: tuple[int, ...]) -> str:
        while True:
            word = _name_word(rng, rng.choice(syllables))
            # Five letters or more, no final e: short words and silent-e words (meta, solo, note,
            # time) are where made-up syllables meet English words most often.
            if word.lower() not in used and len(word) >= 5 and not word.endswith("e"):
                used.add(word.lower())
                return word

    regions = [fresh((2,)) for _ in range(num_regions)]
    city_names = [fresh((2, 2, 3)) for _ in range(num_cities)]
    company_names = [fresh((2, 2, 3)) for _ in range(num_companies)]
    person_names = [f"{fresh((2,))} {fresh((2, 3))}" for _ in range(num_people)]
    # distinct: "which was founded first" has one answer
    city_years = rng.sample(range(1100, 1800), num_cities)
    cities = {
        name: City(name, rng.choice(regions), year, 100 * rng.randint(12, 999))
        for name, year in zip(city_names, city_years)
    }
    companies, people = {}, {}
    for split in ("train", "test"):
        home = [c for c in city_names if split_of(c, TEST_PERCENT) == split]
        firms = [k for k in company_names if split_of(k, TEST_PERCENT) == split]
        folk = [p for p in person_names if split_of(p, TEST_PERCENT) == split]
        if folk and not home:
            raise ValueError(
                f"no {split} city for the {split} people to be born in: raise num_cities"
            )
        n = min(len(firms), len(home), len(folk))
        for firm, hq, founder in zip(firms[:n], rng.sample(home, n), folk[:n]):
            year = rng.randint(1860, 1990)
            companies[firm] = Company(firm, hq, year, founder, 10 * rng.randint(5, 990))
            people[founder] = Person(
                founder,
                rng.choice(OCCUPATIONS),
                rng.choice(("He", "She")),
                year - rng.randint(25, 60),
                rng.choice(home),
            )
        for person in folk[n:]:
            people[person] = Person(
                person,
                rng.choice(OCCUPATIONS),
                rng.choice(("He", "She")),
                rng.randint(1800, 1990),
                rng.choice(home),
            )
    # generation order, not split order
    companies = {k: companies[k] for k in company_names if k in companies}
    people = {p: people[p] for p in person_names}
    articles = tuple(article_of(e) for group in (cities, companies, people) for e in group.values())
    return Encyclopedia(
        seed,
        cities,
        companies,
        people,
        articles,
        {title_key(a.title): i for i, a in enumerate(articles)},
    )


# -----------------------------------------------------------------------------
# 2. BM25


def tokenize(text: str) -> list[str]:
    """Lowercase words and numbers: 'Velmora, 1712!' -> ['velmora', '1712']."""
    return re.findall(r"[a-z0-9]+", text.lower())


class BM25:
    """Okapi BM25 (Robertson & Sparck Jones; Robertson & Zaragoza, "The Probabilistic Relevance
    Framework: BM25 and Beyond", 2009) over a fixed list of documents:

        score(D, Q) = sum over distinct terms t of Q of
                      idf(t) * tf(t,D) * (k1 + 1) / (tf(t,D) + k1 * (1 - b + b * |D| / avgdl))
        idf(t)      = ln(1 + (N - n(t) + 0.5) / (n(t) + 0.5))

    tf(t,D): count of t in D; |D|: D's length in tokens; avgdl: mean length; N: documents; n(t):
    documents that contain t. The idf is the "+1" variant of Lucene, which is positive for every
    term (the classic ln((N - n + 0.5) / (n + 0.5)) goes negative for terms in more than half the
    documents). A term repeated in the query counts once (k3 = 0). Defaults k1 = 1.2, b = 0.75.

    Storage is sparse by hand: the per-(term, document) weights, sorted by term, with `start[t]`
    where the postings of term t begin, so a query touches only the postings of its own terms.
    """

    def __init__(self, documents: list[str], k1: float = 1.2, b: float = 0.75):
        docs = [tokenize(d) for d in documents]
        self.vocab: dict[str, int] = {}  # term -> id, in order of first appearance
        triples = []  # (term id, document, count)
        for d, words in enumerate(docs):
            for word, count in Counter(words).items():
                triples.append((self.vocab.setdefault(word, len(self.vocab)), d, count))
        triples.sort()
        # (P,) postings, by term then document
        term = np.array([t for t, _, _ in triples], dtype=np.int64)
        # (P,) the document of each posting
        self.doc = np.array([d for _, d, _ in triples], dtype=np.int64)
        tf = np.array([c for _, _, c in triples], dtype=np.float64)  # (P,)
        length = np.array([len(w) for w in docs], dtype=np.float64)  # (N,)
        self.num_docs = len(docs)
        df = np.bincount(term, minlength=len(self.vocab))  # (V,) documents containing each term
        self.idf = np.log(1.0 + (self.num_docs - df + 0.5) / (df + 0.5))  # (V,)
        norm = k1 * (1.0 - b + b * length / length.mean())  # (N,) k1 * length normalization
        # (P,) each term's score in its docs
        self.weight = self.idf[term] * tf * (k1 + 1.0) / (tf + norm[self.doc])
        # (V+1,) t's: start[t]:start[t+1]
        self.start = np.searchsorted(term, np.arange(len(self.vocab) + 1))

    def scores(self, query: str) -> np.ndarray:
        """(N,) the BM25 score of every document; 0 where no query term occurs."""
        scores = np.zeros(self.num_docs)
        for word in dict.fromkeys(tokenize(query)):
            # distinct terms, in query order: a fixed summation order
            t = self.vocab.get(word)
            if t is not None:
                lo, hi = self.start[t], self.start[t + 1]
                # a document appears once in a term's postings
                scores[self.doc[lo:hi]] += self.weight[lo:hi]
        return scores

    def top(self, query: str, k: int) -> list[int]:
        """The k best documents that match at least one term: highest score first, ties by
        lower index."""
        scores = self.scores(query)
        hits = np.flatnonzero(scores > 0)
        return hits[np.lexsort((hits, -scores[hits]))][:k].tolist()


# -----------------------------------------------------------------------------
# 3. Tools (they read the encyclopedia and the index from the env they are called with)

MAX_QUERY_CHARS = 200  # longer search queries and wiki titles are refused
SEARCH_RESULTS = 3  # articles shown per search


@tool(
    "search",
    "Search the encyclopedia; top 3 titles.",
    {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    bounded=True,
)
def search(env, state, query):
    """The best SEARCH_RESULTS articles for `query`, one 'Title: first sentence' line each."""
    if len(query) > MAX_QUERY_CHARS:
        return state, f"Error: the query is longer than {MAX_QUERY_CHARS} characters.", "error"
    hits = env.index.top(query, SEARCH_RESULTS)
    if not hits:
        return state, "No results.", None
    return (
        state,
        "\n".join(f"{a.title}: {a.sentences[0]}" for a in (env.corpus.articles[i] for i in hits)),
        None,
    )


@tool(
    "wiki",
    "Read the article with this title.",
    {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]},
    bounded=True,
)
def wiki(env, state, title):
    """The article titled `title` (any case); else an error naming the closest titles, so the agent
    can retry."""
    if len(title) > MAX_QUERY_CHARS:
        return state, f"Error: the title is longer than {MAX_QUERY_CHARS} characters.", "error"
    i = env.corpus.find(title)
    if i is not None:
        return state, env.corpus.articles[i].text, None
    close = [env.corpus.articles[j].title for j in env.index.top(title, SEARCH_RESULTS)]
    if not close:  # no word in common with any article (a misspelling): closest by spelling instead
        close = difflib.get_close_matches(
            title, [a.title for a in env.corpus.articles], SEARCH_RESULTS, 0.6
        )
    hint = f"Closest titles: {', '.join(close)}." if close else "Use search to find titles."
    return state, f"Error: no article titled {title!r}. {hint}", "error"


# -----------------------------------------------------------------------------
# 4. Questions


@dataclass(frozen=True)
class Question:
    prompt: str  # the user message
    answer: str  # ground truth: a number as digits, or a name
    answer_type: str  # "number" or "name" (how score compares)
    named: list[str]  # the entities the prompt names
    needs: list[str]  # every entity whose article the answer depends on (the named ones included)
    calls: list[list]  # the expert's tool calls before finish: [[tool name, arguments], ...]


def _wiki(title: str) -> list:
    return ["wiki", {"title": title}]


def _city_founded(enc: Encyclopedia, a: str) -> Question:
    return Question(
        f"In what year was {a} founded?", str(enc.cities[a].founded), "number", [a], [a], [_wiki(a)]
    )


def _person_born(enc: Encyclopedia, p: str) -> Question:
    return Question(
        f"In what year was {p} born?", str(enc.people[p].born), "number", [p], [p], [_wiki(p)]
    )


def _hq_search(city: str) -> list:
    return ["search", {"query": f"company headquartered in {city}"}]


def _hq_company(enc: Encyclopedia, k: str) -> Question:
    city = enc.companies[k].city
    return Question(
        f"Which company is headquartered in {city}?",
        k,
        "name",
        [city],
        [city, k],
        [_hq_search(city)],
    )


def _founder_born(enc: Encyclopedia, k: str) -> Question:
    f = enc.companies[k].founder
    return Question(
        f"In what year was the founder of {k} born?",
        str(enc.people[f].born),
        "number",
        [k],
        [k, f],
        [_wiki(k), _wiki(f)],
    )


def _hq_founder(enc: Encyclopedia, k: str) -> Question:
    company = enc.companies[k]
    return Question(
        f"Who founded the company headquartered in {company.city}?",
        company.founder,
        "name",
        [company.city],
        [company.city, k, company.founder],
        [_hq_search(company.city), _wiki(k)],
    )


def _earlier_city(enc: Encyclopedia, a: str, b: str) -> Question:
    first = min((a, b), key=lambda c: enc.cities[c].founded)
    return Question(
        f"Which city was founded first, {a} or {b}?",
        first,
        "name",
        [a, b],
        [a, b],
        [_wiki(a), _wiki(b)],
    )


def _founding_gap(enc: Encyclopedia, a: str, b: str) -> Question:
    early, late = sorted((enc.cities[a].founded, enc.cities[b].founded))
    return Question(
        f"How many years passed between the founding of {a} and the founding of {b}?",
        str(late - early),
        "number",
        [a, b],
        [a, b],
        [_wiki(a), _wiki(b), ["calculator", {"expression": f"{late} - {early}"}]],
    )


def _founder_age(enc: Encyclopedia, k: str) -> Question:
    company = enc.companies[k]
    born = enc.people[company.founder].born
    return Question(
        f"How old was the founder of {k} when it was founded?",
        str(company.founded - born),
        "number",
        [k],
        [k, company.founder],
        [
            _wiki(k),
            _wiki(company.founder),
            ["calculator", {"expression": f"{company.founded} - {born}"}],
        ],
    )


def _birthplace_population(enc: Encyclopedia, k: str) -> Question:
    founder = enc.people[enc.companies[k].founder]
    return Question(
        f"What is the population of the city where the founder of {k} was born?",
        str(enc.cities[founder.birthplace].population),
        "number",
        [k],
        [k, founder.name, founder.birthplace],
        [_wiki(k), _wiki(founder.name), _wiki(founder.birthplace)],
    )


@dataclass(frozen=True)
class Kind:
    hops: int  # tool calls the expert makes before finish
    pool: str  # what the question is about: "city", "company" or "person"
    pairs: bool  # about two distinct entities of the pool (unordered), not one
    ask: Callable[..., Question]  # (encyclopedia, *names) -> Question


KINDS: dict[str, Kind] = {
    "city_founded": Kind(1, "city", False, _city_founded),
    "person_born": Kind(1, "person", False, _person_born),
    "hq_company": Kind(1, "company", False, _hq_company),
    "founder_born": Kind(2, "company", False, _founder_born),
    "hq_founder": Kind(2, "company", False, _hq_founder),
    "earlier_city": Kind(2, "city", True, _earlier_city),
    "founding_gap": Kind(3, "city", True, _founding_gap),
    "founder_age": Kind(3, "company", False, _founder_age),
    "birthplace_population": Kind(3, "company", False, _birthplace_population),
}


def _pair(t: int) -> tuple[int, int]:
    """The t-th unordered pair (i, j), j < i, in the order (1,0), (2,0), (2,1), (3,0), ...: t =
    i(i-1)/2 + j."""
    i = (1 + math.isqrt(1 + 8 * t)) // 2
    return i, t - i * (i - 1) // 2


class _Draws:
    """Draw from range(size) without replacement, one at a time: a Fisher-Yates shuffle over a
    virtual array whose moved entries live in a dict, so a pool of 100k pairs costs nothing
    until drawn."""

    def __init__(self, size: int):
        self.left = size  # items not drawn yet
        self.moved = {}  # position -> item, where the shuffle swapped a drawn item out

    def draw(self, rng: random.Random) -> int:
        j = rng.randrange(self.left)
        self.left -= 1
        item = self.moved.get(j, j)
        # the last live item takes the drawn one's place
        self.moved[j] = self.moved.pop(self.left, self.left)
        return item


def _normalize_name(text: str) -> str:
    return " ".join(text.strip(" \t\n.,;:!?\"'()[]").lower().split())


def _grounded(value: str, context: str) -> bool:
    """Every word and number of `value` occurs in `context`: it can be copied, not recalled."""
    return set(tokenize(value)) <= set(tokenize(context))


# -----------------------------------------------------------------------------
# 5. The env


@register_env("tool_use")
class ToolUseEnv(Env):
    """Multi-hop questions over a generated encyclopedia; reward 1.0 for the exact answer (see the
    module docstring), + format_bonus for a clean episode."""

    tool_names = ("search", "wiki", "calculator", "finish")

    def __init__(
        self,
        corpus_seed: int = 0,
        hops: int | None = None,
        kinds: tuple[str, ...] | None = None,
        weights: tuple[float, ...] | None = None,
        format_bonus: float = 0.0,
        num_cities: int = 500,
        num_companies: int = 400,
        num_people: int = 700,
        tool_timeout: float = 2.0,
    ):
        if hops is not None and hops not in (1, 2, 3):
            raise ValueError(f"hops must be 1, 2, 3 or None, not {hops!r}")
        if kinds is None:
            kinds = tuple(k for k, spec in KINDS.items() if hops is None or spec.hops == hops)
        unknown = [k for k in kinds if k not in KINDS]
        if unknown or not kinds:
            raise ValueError(f"unknown kinds {unknown}; choose from {list(KINDS)}")
        if hops is not None and any(KINDS[k].hops != hops for k in kinds):
            raise ValueError(f"kinds {list(kinds)} do not all take {hops} hops")
        if weights is not None and (
            len(weights) != len(kinds) or min(weights) < 0 or sum(weights) <= 0
        ):
            raise ValueError(f"weights {weights} must be one non-negative number per kind {kinds}")
        # the encyclopedia's seed (tasks of another seed are refused)
        self.corpus_seed = corpus_seed
        self.kinds = tuple(kinds)  # which question kinds to draw from
        # their relative odds
        self.weights = tuple(weights) if weights is not None else (1.0,) * len(kinds)
        self.format_bonus = format_bonus  # added to the reward of a clean episode (0: off)
        self.tool_timeout = tool_timeout  # seconds per tool call (all four tools are bounded)
        self.corpus = build_encyclopedia(corpus_seed, num_cities, num_companies, num_people)
        # the title line repeats the first words of the body; indexing it twice would rank a city
        # above its company for "in <city>"
        self.index = BM25([" ".join(a.sentences) for a in self.corpus.articles])
        by_pool = {
            "city": self.corpus.cities,
            "company": self.corpus.companies,
            "person": self.corpus.people,
        }
        # names per pool, split
        self.pools = {
            (pool, split): [n for n in names if split_of(n, TEST_PERCENT) == split]
            for pool, names in by_pool.items()
            for split in ("train", "test")
        }

    def system_prompt(self) -> str:
        return SYSTEM_PROMPT

    def supply(self, kind: str, split: str) -> int:
        """How many distinct questions of this kind the split holds."""
        n = len(self.pools[KINDS[kind].pool, split])
        return n * (n - 1) // 2 if KINDS[kind].pairs else n

    def question(self, kind: str, split: str, index: int) -> Question:
        """The index-th question of a kind in a split (0 <= index < supply)."""
        spec, pool = KINDS[kind], self.pools[KINDS[kind].pool, split]
        if not spec.pairs:
            return spec.ask(self.corpus, pool[index])
        i, j = _pair(index)
        return spec.ask(self.corpus, pool[i], pool[j])

    def make_task(self, kind: str, q: Question) -> Task:
        digest = hashlib.sha256(f"{self.corpus_seed}|{q.prompt}".encode()).hexdigest()
        return Task(
            env=self.name,
            id=f"{self.name}/{digest[:16]}",
            prompt=q.prompt,
            answer=q.answer,
            meta={
                "kind": kind,
                "hops": KINDS[kind].hops,
                "answer_type": q.answer_type,
                "entities": q.named,
                "needs": q.needs,
                "calls": q.calls,
                "corpus_seed": self.corpus_seed,
            },
        )

    def sample_tasks(self, split: str, n: int, seed: int) -> list[Task]:
        """n distinct tasks of `split`, the same for the same (seed, constructor arguments); a
        prefix of a longer draw. Kinds come by `weights`; a kind whose questions are used up drops
        out of the draw."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', not {split!r}")
        rng = random.Random(seed)
        draws = {k: _Draws(self.supply(k, split)) for k in self.kinds}
        tasks = []
        while len(tasks) < n:
            live = [(k, w) for k, w in zip(self.kinds, self.weights) if draws[k].left and w > 0]
            if not live:
                raise ValueError(
                    f"only {len(tasks)} distinct {split} questions of kinds {list(self.kinds)} "
                    f"exist, not {n}: raise num_cities / num_companies / num_people"
                )
            kind = rng.choices([k for k, _ in live], [w for _, w in live])[0]
            tasks.append(self.make_task(kind, self.question(kind, split, draws[kind].draw(rng))))
        return tasks

    def reset(self, task: Task, seed: int) -> tuple[EnvState, list[dict]]:
        if task.meta.get("corpus_seed") != self.corpus_seed:
            raise ValueError(
                f"task {task.id} is about corpus_seed {task.meta.get('corpus_seed')}, "
                f"this env holds corpus_seed {self.corpus_seed}"
            )
        return super().reset(task, seed)

    def score(self, task: Task, answer: str | None) -> float:
        if answer is None:
            return 0.0
        if task.meta["answer_type"] == "number":
            return 1.0 if answers_match(answer, task.answer) else 0.0
        return 1.0 if _normalize_name(answer) == _normalize_name(task.answer) else 0.0

    def step(
        self, state: EnvState, action: Action
    ) -> tuple[EnvState, list[dict], float, bool, dict]:
        """Env.step, plus on the final step the format bonus and info["metrics"] (correct,
        well_formed)."""
        state, obs, reward, done, info = super().step(state, action)
        if not done:
            return state, obs, reward, done, info
        well_formed = (
            bool(info["format_ok"]) and state.parse_failures == 0 and state.tool_errors == 0
        )
        total = reward + (self.format_bonus if well_formed else 0.0)
        info = {**info, "metrics": {"correct": reward, "well_formed": float(well_formed)}}
        return replace(state, reward=total), obs, total, done, info

    def on_text(self, state: EnvState, text: str) -> tuple[EnvState, list[dict], float, bool, dict]:
        """A message without a tool call is the final answer: the whole text for a name, the last
        number else."""
        answer = text.strip() if state.task.meta["answer_type"] == "name" else extract_answer(text)
        reward = self.score(state.task, answer)
        return (
            replace(state, done=True, answer=answer, reward=reward),
            [],
            reward,
            True,
            {"format_ok": False},
        )

    def demonstration(self, task: Task, rng: random.Random, use_tools: bool) -> list[dict]:
        """The expert conversation: the task's tool calls (meta["calls"]) run through run_tool one
        per turn, then finish(answer); use_tools=False leaves out the calculator (arithmetic in the
        head). Raises if a call fails or copies anything that is not in the question or an earlier
        observation, or if the answer cannot be read off them (or the in-head result). `rng` is
        unused: each question has one expert path."""
        state, messages = self.reset(task, seed=0)
        context = task.prompt
        for name, arguments in task.meta["calls"]:
            call = ToolCall(name, arguments)
            if not all(_grounded(str(v), context) for v in arguments.values()):
                raise RuntimeError(f"expert call {call} of {task.id} uses words it has not seen")
            if name == "calculator" and not use_tools:
                # the same arithmetic, in the head: no turn, no observation
                context += "\n" + format_exact(calculate(arguments["expression"]))
                continue
            state, text, kind = self.run_tool(state, call)
            if kind is not None:
                raise RuntimeError(f"expert call {call} of {task.id} failed: {text}")
            messages += [assistant_message("", [call]), tool_message(name, text)]
            context += "\n" + text
        if not _grounded(task.answer, context):
            raise RuntimeError(
                f"the answer {task.answer!r} of {task.id} is not in the expert's observations"
            )
        messages.append(assistant_message("", [ToolCall("finish", {"answer": task.answer})]))
        return messages

    def random_action(self, state: EnvState, rng: random.Random) -> Action:
        """One uniformly random tool with plausible arguments: an entity of the question or a random
        title (search, wiki, and half of the finish answers), a year difference (calculator) or a
        year (finish)."""
        name = rng.choice(self.tool_names)
        entity = rng.choice(state.task.meta["entities"] + [rng.choice(self.corpus.articles).title])
        year = str(rng.randint(1100, 1999))
        arguments = {
            "search": {"query": entity},
            "wiki": {"title": entity},
            "calculator": {"expression": f"{year} - {rng.randint(1100, 1999)}"},
            "finish": {"answer": rng.choice((year, entity))},
        }[name]
        return Action(text="", tool_calls=(ToolCall(name, arguments),))
