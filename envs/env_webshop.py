"""env_webshop.py: "webshop_lite", a small generated online shop in the spirit of WebShop (Yao et
al. 2022, arXiv 2207.01206): search the catalog, open a product, pick its options, buy what the
instruction asks for.

The world. A catalog of a few hundred products, generated deterministically from `catalog_seed`:
each has a category (t-shirt, shoes, mug, backpack, lamp, ...), a color and a material (its title is
"red cotton t-shirt"), a whole-dollar price, a rating, and per-category options, each offered in a
subset of its values (size S M L; socks also come in packs of 2 3 6; lamps have a light: warm cool
daylight). About 80% of the color x material x category titles exist; 75% of those also have a
pricier "twin" with the same title. Products are numbered B000, B001, ... in shuffled order, so an
id says nothing. Session ids (session_ids=True, the default): each task's pages show the products
under ids of its own, a permutation of B000, B001, ... drawn from the task's id, as a catalog too
big to learn by heart would. A small catalog's fixed ids can be memorised instead of read: a tiny
model trained on fixed ids clicks the id it remembers for a title and fails on every title it was
not trained on. Shown ids are what shop_click takes; the purchase record keeps the catalog id.
session_ids=False shows the catalog ids themselves.

The task. "Buy: red cotton t-shirt, size M, under $20." The target is the cheaper product of a title
(never a twin), the options are values it offers, the limit is the next multiple of 5 above its
price or the one after. A twin costs at least $11 more than its target, so it is always over the
limit: the one fully correct purchase is the target with the asked options. Distractors come for
free: the twin (right title, wrong price) and the many products that share two of the three
title words.

Actions are tools (TOOLS names are global, hence the prefix):
  shop_search(query)  the 5 best products for the query, one line each: "[B017] red cotton t-shirt
                      $18". Ranking: how many distinct query words are title words, ties broken by
                      rating (best first), then id. No pagination: another search is how one sees
                      other products.
  shop_click(item)    open a listed product (the id the page shows, or a title shown, meaning the
                      first line with it): "[B017] red cotton t-shirt $18, rating 4.3" then one line
                      per option: "size: S M L".
  shop_select(option) choose an option value of the open product: "M" (or "size: M", "size M").
  shop_back()         show the page before again, as it was left (leaving a product page drops
                      its selections).
  shop_buy()          buy the open product with its selections; the episode ends.
Invalid actions (a click on something not listed, a value the product does not offer, buy with no
product open or an option unselected, back from the first page, an empty query, a message with no
readable tool call) come back as "Error: ..." observations and change nothing; they count as
invalid actions.

Reward, as in WebShop (paper, section 3.1): with U the instruction and Y the bought item,
    r = type_match * (|U_att & Y_att| + |U_opt & Y_opt| + 1[Y_price < U_price])
        / (|U_att| + |U_opt| + 1)
where the attributes are color and material, the options are the asked option values (1 or 2), and
type_match is 1 if the category is right, else 0 (WebShop grades it from title similarity; ours is
exact). So a right-category buy scores k/4 or k/5, and 1.0 only for the exact item. Buying is the
episode's terminal action: shop_buy sets state.done and writes the purchase record (JSON: id,
category, color, material, price, options) as state.answer, and Env.run_tool_calls scores it with
score(task, answer), as it does finish's answer; the record carries all the reward needs, so scoring
reads the task's meta, never the catalog. The step limit is `max_steps` (default 7, meant to equal
the agent loop's max_turns): at that turn without a purchase the env ends the episode itself with
reward 0, so that every episode, bought or not, reports its metrics (success, bought,
invalid_actions, steps) in info["metrics"].

Split: by a hash of the target's title, fixed for every catalog seed: 25% of titles are held out, so
a held-out instruction names a color x material x category never targeted in training; reading, not
memorizing, is what solves it.

The expert (demonstration with use_tools=True) searches for the title words, clicks the first listed
product with the asked title under the limit, selects the asked options, and buys: 4 or 5 turns, and
it raises unless the reward is 1.0. With use_tools=False it is the careless shopper: the same
search, then the first result whatever its price (the twin when the twin is rated higher), the asked
options where offered (else the first value), buy. Right about 60% of the time; the rest earns
partial credit, and RL has the price check to learn.
Imports: tools.py, env.py (and the standard library).
"""

import functools
import hashlib
import itertools
import json
import random
import re
from dataclasses import dataclass, field, replace

from env import (
    Action,
    Env,
    EnvState,
    Task,
    ToolCall,
    assistant_message,
    register_env,
    split_of,
    tool_message,
)
from tools import tool


# -----------------------------------------------------------------------------
# The catalog


@dataclass(frozen=True)
class Category:
    """What products of one category can be."""

    materials: tuple[str, ...]  # each product has one
    # (option name, all its values); values are distinct across a category's options,
    # so "M" alone is clear
    options: tuple[tuple[str, tuple[str, ...]], ...]
    prices: tuple[int, int]  # lowest and highest price of a non-twin, in dollars


COLORS = ("red", "blue", "green", "black", "white", "gray", "pink", "yellow", "brown", "purple")
CATEGORIES: dict[str, Category] = {
    "t-shirt": Category(
        ("cotton", "linen", "polyester"), (("size", ("XS", "S", "M", "L", "XL")),), (8, 30)
    ),
    "hoodie": Category(("cotton", "fleece", "wool"), (("size", ("S", "M", "L", "XL")),), (20, 60)),
    "jacket": Category(
        ("denim", "leather", "nylon"),
        (("size", ("S", "M", "L", "XL")), ("fit", ("slim", "regular"))),
        (40, 150),
    ),
    "shoes": Category(
        ("leather", "canvas", "suede"), (("size", ("6", "7", "8", "9", "10", "11")),), (30, 120)
    ),
    "socks": Category(
        ("cotton", "wool", "bamboo"),
        (("size", ("S", "M", "L")), ("pack", ("2", "3", "6"))),
        (5, 20),
    ),
    "hat": Category(("wool", "cotton", "straw"), (("size", ("S", "M", "L")),), (10, 35)),
    "scarf": Category(("wool", "silk", "cotton"), (("length", ("short", "long")),), (12, 45)),
    "mug": Category(("ceramic", "glass", "steel"), (("size", ("8oz", "12oz", "16oz")),), (6, 25)),
    "bottle": Category(
        ("steel", "glass", "plastic"), (("size", ("500ml", "750ml", "1L")),), (8, 30)
    ),
    "backpack": Category(
        ("nylon", "canvas", "leather"), (("size", ("15L", "20L", "30L")),), (25, 90)
    ),
    "lamp": Category(
        ("metal", "wood", "glass"), (("light", ("warm", "cool", "daylight")),), (15, 70)
    ),
}
TITLE_SHARE = 0.8  # share of the color x material x category titles that exist in a catalog
# share of existing titles that also have a pricier twin (a distractor, never a target)
TWIN_SHARE = 0.75
# a twin costs this much more (dollars): more than the highest limit (price + 10)
TWIN_EXTRA = (11, 30)
# share of titles (by hash) whose tasks are held out, the same for every catalog seed
TEST_PERCENT = 25
RESULTS_PER_PAGE = 5


@dataclass(frozen=True)
class Product:
    """One product of the catalog."""

    id: str  # "B017": what shop_click takes
    category: str  # a key of CATEGORIES
    color: str  # one of COLORS
    material: str  # one of its category's materials
    price: int  # whole dollars
    rating: float  # 3.0 .. 5.0, one decimal; breaks search ties
    # (option name, values offered, at least 2), category order
    options: tuple[tuple[str, tuple[str, ...]], ...]

    @property
    def title(self) -> str:
        return f"{self.color} {self.material} {self.category}"


def make_catalog(seed: int) -> tuple[Product, ...]:
    """The products of catalog `seed`, ordered by id; the same seed always gives the
    same catalog."""
    rng = random.Random(seed)
    drafts = []  # Product fields but the id, in generation order
    for name, cat in CATEGORIES.items():
        for color, material in itertools.product(COLORS, cat.materials):
            if rng.random() >= TITLE_SHARE:
                continue
            price = rng.randint(*cat.prices)
            prices = [price] + (
                [price + rng.randint(*TWIN_EXTRA)] if rng.random() < TWIN_SHARE else []
            )
            for cost in prices:
                kept = [
                    set(rng.sample(values, rng.randint(2, len(values))))
                    for _, values in cat.options
                ]
                # in the category's order
                offered = tuple(
                    (opt, tuple(v for v in values if v in keep))
                    for (opt, values), keep in zip(cat.options, kept)
                )
                drafts.append(
                    (name, color, material, cost, round(rng.uniform(3.0, 5.0), 1), offered)
                )
    order = list(range(len(drafts)))
    rng.shuffle(order)  # ids in shuffled order: a twin is not its target's neighbour
    ids = {k: f"B{i:03d}" for i, k in enumerate(order)}
    return tuple(sorted((Product(ids[k], *d) for k, d in enumerate(drafts)), key=lambda p: p.id))


# -----------------------------------------------------------------------------
# Search, pages and the reward

_WORD = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")  # "t-shirt" is one word; "$20" is "20"


# every search reads every title's words: cache them (and recent queries)
@functools.lru_cache(maxsize=4096)
def words(text: str) -> frozenset[str]:
    return frozenset(_WORD.findall(text.lower()))


def search(catalog: tuple[Product, ...], query: str) -> list[Product]:
    """The RESULTS_PER_PAGE best products: most distinct query words among title words, then best
    rated, then lowest id (so the order is total and deterministic). Products sharing no word are
    never listed."""
    q = words(query)
    scored = [(len(q & words(p.title)), p) for p in catalog]
    ranked = sorted(
        (sp for sp in scored if sp[0] > 0), key=lambda sp: (-sp[0], -sp[1].rating, sp[1].id)
    )
    return [p for _, p in ranked[:RESULTS_PER_PAGE]]


def session_ids(n: int, key: str) -> tuple[str, ...]:
    """The ids a session shows for the n products of a catalog (in catalog order): B000 .. shuffled
    by `key`."""
    ids = [f"B{i:03d}" for i in range(n)]
    # a str seed: the same in every process
    random.Random(f"webshop_lite/session/{key}").shuffle(ids)
    return tuple(ids)


def result_line(p: Product, shown: str) -> str:
    return f"[{shown}] {p.title} ${p.price}"


def product_page(p: Product, shown: str, selected: tuple[tuple[str, str], ...]) -> str:
    lines = [f"{result_line(p, shown)}, rating {p.rating:.1f}"] + [
        f"{opt}: {' '.join(vs)}" for opt, vs in p.options
    ]
    if selected:
        lines.append("selected: " + ", ".join(f"{opt} {v}" for opt, v in selected))
    return "\n".join(lines)


def purchase_record(p: Product, selected: tuple[tuple[str, str], ...]) -> str:
    """What was bought, as canonical JSON: the answer of an episode (and, for the target, of
    a task)."""
    return json.dumps(
        {
            "id": p.id,
            "category": p.category,
            "color": p.color,
            "material": p.material,
            "price": p.price,
            "options": dict(selected),
        },
        sort_keys=True,
    )


def parse_purchase(answer: str | None) -> dict | None:
    """The purchase record written by purchase_record, or None for anything else."""
    try:
        record = json.loads(answer)
    except (TypeError, ValueError):
        return None
    keys = {
        "id": str,
        "category": str,
        "color": str,
        "material": str,
        "price": int,
        "options": dict,
    }
    if not isinstance(record, dict) or any(
        not isinstance(record.get(k), t) for k, t in keys.items()
    ):
        return None
    return record


def shop_reward(goal: dict, bought: dict) -> float:
    """WebShop's reward (module docstring): type_match * (attributes + options + price ok) / their
    count. `goal` is a task's meta (category, color, material, options, max_price); `bought` a
    purchase record."""
    if bought["category"] != goal["category"]:
        return 0.0
    attributes = sum(bought[a] == goal[a] for a in ("color", "material"))
    options = sum(bought["options"].get(opt) == v for opt, v in goal["options"].items())
    price_ok = bought["price"] < goal["max_price"]
    return (attributes + options + price_ok) / (2 + len(goal["options"]) + 1)


# -----------------------------------------------------------------------------
# State


@dataclass(frozen=True)
class View:
    """One page of the shop, as the agent last saw it."""

    page: str = "home"  # "home" | "results" | "product"
    results: tuple[str, ...] = ()  # results page: the ids listed, best first
    product: str = ""  # product page: the id of the open product
    # product page: (option, value) chosen, in the product's order
    selected: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ShopState(EnvState):
    """EnvState plus where the agent is in the shop; replaced by every tool, never mutated."""

    view: View = field(default_factory=View)  # the page shown now
    history: tuple[View, ...] = ()  # the pages before it, oldest first (what shop_back pops)
    # messages with no readable tool call (plain text, or a call too broken to parse): each an
    # invalid action
    idle_turns: int = 0
    shown: tuple[str, ...] = ()  # the id shown for each product (catalog order); (): its own


def _goto(state: ShopState, view: View) -> ShopState:
    return replace(state, view=view, history=state.history + (state.view,))


def _error(state: ShopState, text: str) -> tuple[ShopState, str, str]:
    return state, f"Error: {text}", "error"


# -----------------------------------------------------------------------------
# Tools: fn(env, state, **arguments) -> (state, observation, error kind or None)

_QUERY = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
_ITEM = {"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}
_OPTION = {"type": "object", "properties": {"option": {"type": "string"}}, "required": ["option"]}
_NONE = {"type": "object", "properties": {}}


@tool("shop_search", "Search products.", _QUERY, bounded=True)
def shop_search(env, state, query):
    """Show the results page of `query`, from any page."""
    if not words(query):
        return _error(state, "the query has no words.")
    view = View("results", tuple(p.id for p in search(env.catalog, query)))
    return _goto(state, view), env.page_text(view, state.shown), None


@tool("shop_click", "Open a listed product.", _ITEM, bounded=True)
def shop_click(env, state, item):
    """Open the product `item` (a shown id, with or without brackets, or a title) listed on the
    results page."""
    if state.view.page != "results":
        return _error(state, "no results here: search first.")
    key = item.strip().strip("[]").strip().lower()
    listed = [env.products[i] for i in state.view.results]
    hit = next(
        (p for p in listed if key in (env.shown_id(state.shown, p.id).lower(), p.title)), None
    )
    if hit is None:
        return _error(state, f"{item[:40]!r} is not listed here.")
    view = View("product", product=hit.id)
    return _goto(state, view), env.page_text(view, state.shown), None


@tool("shop_select", "Choose an option.", _OPTION, bounded=True)
def shop_select(env, state, option):
    """Choose a value of the open product's options ("M", "size: M" or "size M"); choosing
    again replaces."""
    if state.view.page != "product":
        return _error(state, "open a product first.")
    product = env.products[state.view.product]
    key = " ".join(option.lower().replace(":", " ").split())
    match = next(
        (
            (opt, v)
            for opt, values in product.options
            for v in values
            if key in (v.lower(), f"{opt} {v.lower()}")
        ),
        None,
    )
    if match is None:
        return _error(state, f"this product has no option {option[:40]!r}.")
    chosen = dict(state.view.selected) | dict([match])
    selected = tuple((opt, chosen[opt]) for opt, _ in product.options if opt in chosen)
    return (
        replace(state, view=replace(state.view, selected=selected)),
        f"Selected {match[0]} {match[1]}.",
        None,
    )


@tool("shop_back", "Go to the previous page.", _NONE, bounded=True)
def shop_back(env, state):
    """Show the page before this one again."""
    if not state.history:
        return _error(state, "there is no previous page.")
    view = state.history[-1]
    return (
        replace(state, view=view, history=state.history[:-1]),
        env.page_text(view, state.shown),
        None,
    )


@tool("shop_buy", "Buy the open product.", _NONE, bounded=True)
def shop_buy(env, state):
    """End the episode with the open product and its selections as the answer (Env.step
    scores it)."""
    if state.view.page != "product":
        return _error(state, "open a product first.")
    product = env.products[state.view.product]
    missing = [opt for opt, _ in product.options if opt not in dict(state.view.selected)]
    if missing:
        return _error(state, f"select {' and '.join(missing)} first.")
    return replace(state, done=True, answer=purchase_record(product, state.view.selected)), "", None


# -----------------------------------------------------------------------------
# The env


@register_env("webshop_lite")
class WebShopLiteEnv(Env):
    """Find and buy the product an instruction describes (module docstring: world, reward, split,
    expert)."""

    tool_names = ("shop_search", "shop_click", "shop_select", "shop_back", "shop_buy")

    def __init__(self, catalog_seed: int = 0, max_steps: int = 7, session_ids: bool = True):
        if max_steps < 1:
            raise ValueError("max_steps must be at least 1")
        self.catalog_seed = catalog_seed  # which generated catalog (tasks name it in their meta)
        # turns per episode; at this one, nothing bought ends it (the expert needs 5 where a product
        # has two options)
        self.max_steps = max_steps
        self.session_ids = session_ids  # each task shows its own ids (module docstring)
        self.catalog = make_catalog(catalog_seed)  # every product, by id
        self.products = {p.id: p for p in self.catalog}  # id -> product
        # id -> its place in the catalog (and in shown)
        self.index = {p.id: i for i, p in enumerate(self.catalog)}
        self._tasks = {"train": [], "test": []}  # every task of each split, in catalog order
        cheapest = {}  # title -> its target: the cheaper of a title's products
        for p in self.catalog:
            if p.title not in cheapest or p.price < cheapest[p.title].price:
                cheapest[p.title] = p
        for target in sorted(cheapest.values(), key=lambda p: p.id):
            for values in itertools.product(*(vs for _, vs in target.options)):
                for limit in (target.price // 5 * 5 + 5, target.price // 5 * 5 + 10):
                    chosen = tuple(zip((opt for opt, _ in target.options), values))
                    # the same under every catalog
                    split = split_of(f"webshop_lite/{target.title}", TEST_PERCENT)
                    self._tasks[split].append(self.make_task(target, chosen, limit))

    def make_task(self, target: Product, chosen: tuple[tuple[str, str], ...], limit: int) -> Task:
        """The instruction to buy `target` with options `chosen` for less than `limit` dollars."""
        asked = "".join(f", {opt} {v}" for opt, v in chosen)
        prompt = f"Buy: {target.title}{asked}, under ${limit}."
        digest = hashlib.sha256(f"{self.catalog_seed}/{prompt}".encode()).hexdigest()
        meta = {
            "catalog_seed": self.catalog_seed,
            "target": target.id,
            "category": target.category,
            "color": target.color,
            "material": target.material,
            "options": dict(chosen),
            "max_price": limit,
        }
        return Task(
            env=self.name,
            id=f"{self.name}/{digest[:16]}",
            prompt=prompt,
            answer=purchase_record(target, chosen),
            meta=meta,
        )

    def system_prompt(self) -> str:
        return (
            "Buy what is asked: search, click the listed match under the price, "
            "select the asked options, buy."
        )

    def sample_tasks(self, split: str, n: int, seed: int) -> list[Task]:
        """n distinct tasks of `split`, the same for the same (seed, catalog_seed); a smaller n
        gives a prefix."""
        if split not in self._tasks:
            raise ValueError(f"split must be 'train' or 'test', not {split!r}")
        space = list(self._tasks[split])
        if n > len(space):
            raise ValueError(f"{split} has {len(space)} distinct tasks, fewer than {n}")
        random.Random(seed).shuffle(space)
        return space[:n]

    def shown_id(self, shown: tuple[str, ...], product_id: str) -> str:
        """The id a session (`shown`, ShopState.shown) shows for a product; () shows the
        catalog id."""
        return shown[self.index[product_id]] if shown else product_id

    def page_text(self, view: View, shown: tuple[str, ...] = ()) -> str:
        """The observation of a page, with the ids of a session (`shown`, ShopState.shown)."""
        if view.page == "results":
            lines = [result_line(self.products[i], self.shown_id(shown, i)) for i in view.results]
            return "\n".join(lines) or "No results."
        if view.page == "product":
            return product_page(
                self.products[view.product], self.shown_id(shown, view.product), view.selected
            )
        return "Home page: search for products."

    def reset(self, task: Task, seed: int) -> tuple[ShopState, list[dict]]:
        if task.meta.get("catalog_seed") != self.catalog_seed:
            raise ValueError(
                f"task {task.id!r} is for catalog {task.meta.get('catalog_seed')!r}, "
                f"not {self.catalog_seed}"
            )
        _, messages = super().reset(task, seed)
        shown = session_ids(len(self.catalog), task.id) if self.session_ids else ()
        return ShopState(task=task, shown=shown), messages

    def step(
        self, state: ShopState, action: Action
    ) -> tuple[ShopState, list[dict], float, bool, dict]:
        """Env.step, plus the step limit (reward 0) and the episode's metrics on its final step."""
        state, obs, reward, done, info = super().step(state, action)
        if not action.tool_calls:  # Env.step answered it with an error (on_text or parse)
            state = replace(state, idle_turns=state.idle_turns + 1)
        if not done and state.turn >= self.max_steps:
            state, obs, done = replace(state, done=True), [], True
        if done:
            info = {
                **info,
                "metrics": {
                    "success": float(reward == 1.0),
                    "bought": float(state.answer is not None),
                    "invalid_actions": float(state.tool_errors + state.idle_turns),
                    "steps": float(state.turn),
                },
            }
        return state, obs, reward, done, info

    def on_text(
        self, state: ShopState, text: str
    ) -> tuple[ShopState, list[dict], float, bool, dict]:
        """Plain text buys nothing: an invalid action (step counts it), answered with an error; the
        episode goes on."""
        error = (
            "Error: no tool call. Use shop_search, shop_click, shop_select, shop_back or shop_buy."
        )
        return state, [tool_message("error", error)], 0.0, False, {}

    def score(self, task: Task, answer: str | None) -> float:
        bought = parse_purchase(answer)
        return 0.0 if bought is None else shop_reward(task.meta, bought)

    def format_ok(self, answer: str) -> bool:
        return parse_purchase(answer) is not None

    def demonstration(self, task: Task, rng: random.Random, use_tools: bool) -> list[dict]:
        """The expert (use_tools=True) or careless (False) episode, played through step() (module
        docstring). `rng` is unused: each has one path. Raises if the expert does not earn 1.0."""
        goal = task.meta
        state, messages = self.reset(task, seed=0)

        def act(state: ShopState, name: str, **arguments) -> ShopState:
            call = ToolCall(name, arguments)
            state, obs, _, _, _ = self.step(state, Action("", (call,)))
            messages.append(assistant_message("", [call]))
            messages.extend(obs)
            return state

        title = f"{goal['color']} {goal['material']} {goal['category']}"
        state = act(state, "shop_search", query=title)
        listed = [self.products[i] for i in state.view.results]
        if use_tools:
            pick = next(
                (p for p in listed if p.title == title and p.price < goal["max_price"]), None
            )
        else:
            pick = listed[0] if listed else None
        if pick is None:
            raise RuntimeError(f"no listed product fits {task.id}: {task.prompt!r}")
        state = act(state, "shop_click", item=self.shown_id(state.shown, pick.id))
        for opt, values in pick.options:
            # the careless pick may lack the asked value: it takes the first
            asked = goal["options"][opt]
            state = act(state, "shop_select", option=asked if asked in values else values[0])
        state = act(state, "shop_buy")
        if use_tools and not (state.done and state.reward == 1.0):
            # never train on an expert that is wrong
            raise RuntimeError(f"the expert earned {state.reward} on {task.id}: {task.prompt!r}")
        return messages

    def random_action(self, state: ShopState, rng: random.Random) -> Action:
        """The floor: a uniformly random tool with plausible arguments: 1-3 words of the instruction
        as a query, a listed item (an arbitrary id when none is listed), a value of the open product
        (a word of the instruction when none is open)."""
        name = rng.choice(self.tool_names)
        prompt_words = sorted(words(state.task.prompt))
        view = state.view
        if name == "shop_search":
            arguments = {"query": " ".join(rng.sample(prompt_words, rng.randint(1, 3)))}
        elif name == "shop_click":
            arguments = {
                "item": self.shown_id(state.shown, rng.choice(view.results or tuple(self.products)))
            }
        elif name == "shop_select":
            values = (
                [v for _, vs in self.products[view.product].options for v in vs]
                if view.page == "product"
                else []
            )
            arguments = {"option": rng.choice(values or prompt_words)}
        else:
            arguments = {}
        return Action(text="", tool_calls=(ToolCall(name, arguments),))
