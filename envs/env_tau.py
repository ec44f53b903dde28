"""env_tau.py: "tau_lite", a retail customer-service world in the spirit of tau-bench (2406.12045).

The agent talks to a scripted customer and to a small shop database through eight tools:
find_user, get_order, list_orders, cancel_order, return_items, exchange_items, update_address and
transfer_to_human. A plain-text assistant message (no tool call) is a message to the customer; their
reply comes back as a "user" message (on_text). Everything is pure Python and deterministic.

World. Each task carries its own small database (task.meta["db"], JSON): three users (the customer,
a namesake with another zip code, a stranger), each with 1-3 orders of 1-2 items (product, colour,
price); every record prints as one short line. The database of an episode lives in its frozen
TauState and is replaced, never mutated, by the write tools.

Policy, enforced by the tools: a user must be verified with find_user(name, zip) before their orders
are read or anything of theirs is changed; only pending orders can be cancelled; only delivered
orders can be returned or exchanged. A call that breaks a rule is refused with an "Error: ..."
observation, counts as a policy violation and leaves the database unchanged.

Intents (task.meta["kind"]): cancel a pending order, return a delivered item, exchange an item for
another colour, update the address, ask for an order's status, and "impossible": cancel a delivered
or return from a pending order, where the right thing is to tell the customer why not (or to
transfer). The customer opens vaguely ("Hi, I want to return something.") and gives details only
when asked.

Customer simulator (user_reply), deterministic from the intent: the agent's message is cut into
lower-case words and each keyword gets its fixed answer, in this order: "name" -> the name; "zip" /
"zipcode" / "postal" -> the zip code; "order" -> the order id (or, for customers who do not know it,
the product the order contains); "item" / "product" -> the product; "color" / "colour" / "option" ->
the wanted colour; "address" -> the new address; "reason" / "why" -> why they cancel. A message that
matches no keyword gets "I'm not sure what you mean.".

Episode end. The customer leaves ("Thanks, bye!") as soon as the agent tells them the required
information (task.answer: the refund, the new status or address, or the order's status), but only
once that information has appeared in a tool observation: a guess before looking does not count.
When the information is a status word it must be the first status word of the message ("pending,
delivered, cancelled" is not an answer). The agent can end the episode itself by saying
"bye"/"goodbye" or with transfer_to_human; the agent loop's max_turns ends it otherwise.

Reward: 1.0 iff the final database equals the expected one (the intent's correct operation applied
to the initial database; unchanged for status and impossible requests) and the customer was told the
required information (for impossible requests, a transfer to a human after the order was read counts
as well); else 0.0.
info["metrics"] on every step (so an episode cut by max_turns still reports): success, db_match,
info_given, policy_violations, steps, invalid_actions.

Split: by a stable hash of the customer (name and zip code): held-out customers never occur in
training tasks; every user of a task's database is drawn from the task's split.

Expert (demonstration, use_tools=True): ask name and zip, find_user, ask for the order (and item,
colour or address), get_order (or list_orders when the customer does not know the id), the write (or
none), tell the required information; 5-6 turns. use_tools=False is a weaker habit, chosen by the
weaker_demo knob (WEAKER_DEMOS); both still succeed when played out without a turn limit:
  "careless" (default): for a cancel request with a known order id it calls cancel_order without
    reading the order first (one turn less on a pending order; on a delivered one the call is
    refused, a policy violation, and the error tells the status, which it then relays). The optional
    rule-based judge (judge="rules", training only) penalises exactly that habit.
  "one_question": it asks for one detail per message ("What is your name?", "What is your zip
    code?", "Which order id?", "Which item?", "Which new color?"): 6-9 turns where the expert needs
    5-6. Under a max_turns of 6 it fails every cancel, return and exchange (and the impossible
    returns), a choice RL can see in the reward.
Imports: tools.py, env.py, envs/worlds.py (and the standard library).
"""

import hashlib
import json
import random
import re
from dataclasses import dataclass, replace

from env import Action, Env, EnvState, Task, ToolCall, register_env, sample_distinct, split_of
from envs.worlds import replay
from tools import TOOLS, tool

# -----------------------------------------------------------------------------
# The database: frozen records, one printed line each

PRODUCTS = {
    "lamp": ("white", "black", "gray"),
    "mug": ("red", "blue", "white"),
    "shirt": ("red", "blue", "green"),
    "hat": ("black", "gray", "green"),
    "bag": ("black", "blue", "red"),
    "scarf": ("red", "gray", "white"),
    "kettle": ("white", "black", "red"),
    "clock": ("black", "white", "blue"),
    "pillow": ("gray", "blue", "green"),
    "towel": ("white", "blue", "green"),
    "chair": ("black", "gray", "white"),
    "vase": ("blue", "green", "white"),
}
FIRST = (
    "Ana",
    "Ben",
    "Cara",
    "Dan",
    "Eva",
    "Finn",
    "Gia",
    "Hugo",
    "Ida",
    "Jon",
    "Kim",
    "Liam",
    "Mia",
    "Noah",
    "Omar",
    "Pia",
    "Rosa",
    "Sam",
    "Tara",
    "Uma",
    "Vic",
    "Wes",
    "Yara",
    "Zoe",
)
LAST = (
    "Diaz",
    "Berg",
    "Chen",
    "Doyle",
    "Ernst",
    "Fox",
    "Gray",
    "Hale",
    "Ito",
    "Jones",
    "Khan",
    "Lund",
    "Moss",
    "Novak",
    "Ortiz",
    "Park",
    "Quinn",
    "Reyes",
    "Shah",
    "Tran",
    "Vega",
    "Wolf",
    "Young",
    "Zhou",
)
STREETS = ("Oak", "Elm", "Pine", "Maple", "Cedar", "Birch", "Lake", "Hill", "Park", "River")
STATUSES = ("pending", "delivered", "cancelled", "returned", "exchanged")


@dataclass(frozen=True)
class Item:
    item_id: int  # position in its order, 1-based: what return_items / exchange_items name
    product: str  # a key of PRODUCTS
    option: str  # its colour, one of PRODUCTS[product]
    price: int  # dollars
    returned: bool = False  # set by return_items


@dataclass(frozen=True)
class Order:
    order_id: str  # "O" + 4 digits
    user_id: str  # the owner
    status: str  # one of STATUSES
    items: tuple[Item, ...]  # 1-2 items

    def line(self) -> str:
        """'O4821 delivered: #1 lamp white $30, #2 mug red $12' (returned items are marked)."""
        items = ", ".join(
            f"#{i.item_id} {i.product} {i.option} ${i.price}"
            + (" (returned)" if i.returned else "")
            for i in self.items
        )
        return f"{self.order_id} {self.status}: {items}"


@dataclass(frozen=True)
class User:
    user_id: str  # "U" + 3 digits
    name: str  # "Ana Diaz"
    zip: str  # 5 digits
    address: str  # "12 Oak St"

    def line(self) -> str:
        return f"{self.user_id} {self.name}, zip {self.zip}, {self.address}"


@dataclass(frozen=True)
class DB:
    users: tuple[User, ...]  # in generation order
    orders: tuple[Order, ...]  # in generation order (list_orders prints them so)

    def user(self, user_id: str) -> User | None:
        return next((u for u in self.users if u.user_id == user_id), None)

    def order(self, order_id: str) -> Order | None:
        return next((o for o in self.orders if o.order_id == order_id), None)

    def with_order(self, order: Order) -> "DB":
        return replace(
            self, orders=tuple(order if o.order_id == order.order_id else o for o in self.orders)
        )

    def with_user(self, user: User) -> "DB":
        return replace(
            self, users=tuple(user if u.user_id == user.user_id else u for u in self.users)
        )


def db_to_json(db: DB) -> dict:
    """Lists and str keys only, so a task survives worlds.write_tasks / read_tasks unchanged."""
    return {
        "users": [[u.user_id, u.name, u.zip, u.address] for u in db.users],
        "orders": [
            [
                o.order_id,
                o.user_id,
                o.status,
                [[i.item_id, i.product, i.option, i.price, i.returned] for i in o.items],
            ]
            for o in db.orders
        ],
    }


def db_from_json(d: dict) -> DB:
    return DB(
        users=tuple(User(*u) for u in d["users"]),
        orders=tuple(Order(o[0], o[1], o[2], tuple(Item(*i) for i in o[3])) for o in d["orders"]),
    )


# The writes, as pure functions: the tools call them after their policy checks, and expected_db
# calls them on the initial database to get the state a correct agent leaves behind.


def cancel(db: DB, order_id: str) -> DB:
    return db.with_order(replace(db.order(order_id), status="cancelled"))


def return_items(db: DB, order_id: str, item_ids: list[int]) -> DB:
    o = db.order(order_id)
    items = tuple(replace(i, returned=True) if i.item_id in item_ids else i for i in o.items)
    return db.with_order(replace(o, status="returned", items=items))


def exchange(db: DB, order_id: str, item_id: int, option: str) -> DB:
    o = db.order(order_id)
    items = tuple(replace(i, option=option) if i.item_id == item_id else i for i in o.items)
    return db.with_order(replace(o, status="exchanged", items=items))


def set_address(db: DB, user_id: str, address: str) -> DB:
    return db.with_user(replace(db.user(user_id), address=address))


def expected_db(meta: dict) -> DB:
    """The initial database with the intent's correct operation applied (none for
    status / impossible)."""
    db, kind = db_from_json(meta["db"]), meta["kind"]
    if kind == "cancel":
        return cancel(db, meta["order_id"])
    if kind == "return":
        return return_items(db, meta["order_id"], [meta["item_id"]])
    if kind == "exchange":
        return exchange(db, meta["order_id"], meta["item_id"], meta["new_option"])
    if kind == "address":
        return set_address(db, meta["user_id"], meta["new_address"])
    return db


@dataclass(frozen=True)
class TauState(EnvState):
    db: DB | None = None  # the shop database now (set by reset from task.meta["db"])
    verified: tuple[str, ...] = ()  # user ids verified by find_user, in order
    policy_violations: int = 0  # tool calls refused by a policy rule
    info_seen: bool = False  # the required information has appeared in a tool observation
    info_given: bool = False  # ... and the agent then told it to the customer
    transferred: bool = False  # the agent called transfer_to_human (which ends the episode)


# -----------------------------------------------------------------------------
# Tools (schemas are rendered into every prompt: short descriptions)


def _schema(**props: str | dict) -> dict:
    """The JSON schema of an arguments object whose properties are all required: name="type" or
    name={schema}."""
    return {
        "type": "object",
        "properties": {k: v if isinstance(v, dict) else {"type": v} for k, v in props.items()},
        "required": list(props),
    }


def _refuse(state: TauState, why: str) -> tuple[TauState, str, str]:
    """A policy violation: counted, the database untouched."""
    return replace(state, policy_violations=state.policy_violations + 1), f"Error: {why}", "refused"


def _owned_order(state: TauState, order_id: str) -> tuple[Order | None, tuple | None]:
    """(order, None) if it exists and its owner is verified, else (None, the tool's
    error result)."""
    order = state.db.order(order_id.strip())
    if order is None:
        return None, (state, f"Error: no order {order_id.strip()[:20]}.", "error")
    if order.user_id not in state.verified:
        return None, _refuse(state, "verify the user with find_user first.")
    return order, None


@tool(
    "find_user",
    "Verify a user by name and zip.",
    _schema(name="string", zip="string"),
    bounded=True,
)
def tool_find_user(env, state, name, zip):
    key = (" ".join(name.split()).lower(), zip.strip())
    user = next((u for u in state.db.users if (u.name.lower(), u.zip) == key), None)
    if user is None:
        return state, "Error: no user with that name and zip.", "error"
    verified = state.verified + (user.user_id,) * (user.user_id not in state.verified)
    return replace(state, verified=verified), user.line(), None


@tool("get_order", "Show an order.", _schema(order_id="string"), bounded=True)
def tool_get_order(env, state, order_id):
    order, error = _owned_order(state, order_id)
    return error or (state, order.line(), None)


@tool("list_orders", "List a user's orders.", _schema(user_id="string"), bounded=True)
def tool_list_orders(env, state, user_id):
    if state.db.user(user_id.strip()) is None:
        return state, f"Error: no user {user_id.strip()[:20]}.", "error"
    if user_id.strip() not in state.verified:
        return _refuse(state, "verify the user with find_user first.")
    return (
        state,
        "\n".join(o.line() for o in state.db.orders if o.user_id == user_id.strip())
        or "No orders.",
        None,
    )


@tool(
    "cancel_order",
    "Cancel a pending order.",
    _schema(order_id="string", reason="string"),
    bounded=True,
)
def tool_cancel_order(env, state, order_id, reason):
    order, error = _owned_order(state, order_id)
    if error:
        return error
    if order.status != "pending":
        return _refuse(
            state, f"{order.order_id} is {order.status}; only pending orders can be cancelled."
        )
    refund = sum(i.price for i in order.items)
    return (
        replace(state, db=cancel(state.db, order.order_id)),
        f"{order.order_id} cancelled, refund ${refund}",
        None,
    )


@tool(
    "return_items",
    "Return items of a delivered order.",
    _schema(order_id="string", item_ids={"type": "array", "items": {"type": "integer"}}),
    bounded=True,
)
def tool_return_items(env, state, order_id, item_ids):
    order, error = _owned_order(state, order_id)
    if error:
        return error
    known = {i.item_id for i in order.items}
    if not item_ids or not all(type(i) is int and i in known for i in item_ids):
        return (
            state,
            f"Error: item_ids must be item numbers of {order.order_id}: {sorted(known)}.",
            "error",
        )
    if order.status != "delivered":
        return _refuse(
            state, f"{order.order_id} is {order.status}; only delivered orders can be returned."
        )
    refund = sum(i.price for i in order.items if i.item_id in item_ids)
    ids = " ".join(f"#{i}" for i in sorted(set(item_ids)))
    return (
        replace(state, db=return_items(state.db, order.order_id, item_ids)),
        f"{order.order_id} returned {ids}, refund ${refund}",
        None,
    )


@tool(
    "exchange_items",
    "Exchange an item for another color.",
    _schema(order_id="string", item_id="integer", new_option="string"),
    bounded=True,
)
def tool_exchange_items(env, state, order_id, item_id, new_option):
    order, error = _owned_order(state, order_id)
    if error:
        return error
    item = next((i for i in order.items if i.item_id == item_id), None)
    if item is None:
        return state, f"Error: no item #{item_id} in {order.order_id}.", "error"
    option = new_option.strip().lower()
    if option not in PRODUCTS[item.product] or option == item.option:
        others = [c for c in PRODUCTS[item.product] if c != item.option]
        return state, f"Error: the {item.product} comes in {', '.join(others)}.", "error"
    if order.status != "delivered":
        return _refuse(
            state, f"{order.order_id} is {order.status}; only delivered orders can be exchanged."
        )
    return (
        replace(state, db=exchange(state.db, order.order_id, item_id, option)),
        f"{order.order_id} exchanged #{item_id} {item.product} {item.option}->{option}",
        None,
    )


@tool(
    "update_address",
    "Change a user's address.",
    _schema(user_id="string", address="string"),
    bounded=True,
)
def tool_update_address(env, state, user_id, address):
    user_id, address = user_id.strip(), " ".join(address.split())
    if state.db.user(user_id) is None:
        return state, f"Error: no user {user_id[:20]}.", "error"
    if user_id not in state.verified:
        return _refuse(state, "verify the user with find_user first.")
    if not address or len(address) > 60:
        return state, "Error: give the address as '12 Oak St'.", "error"
    return (
        replace(state, db=set_address(state.db, user_id, address)),
        f"{user_id} address is now {address}",
        None,
    )


@tool(
    "transfer_to_human", "Hand the case to a human agent.", _schema(summary="string"), bounded=True
)
def tool_transfer_to_human(env, state, summary):
    """Ends the episode (Env.run_tool_calls stops at a done state); TauEnv.step scores it."""
    return replace(state, done=True, answer=summary, transferred=True), "Transferred.", None


TOOL_NAMES = (
    "find_user",
    "get_order",
    "list_orders",
    "cancel_order",
    "return_items",
    "exchange_items",
    "update_address",
    "transfer_to_human",
)
ORDER_WRITES = ("cancel_order", "return_items", "exchange_items")


# -----------------------------------------------------------------------------
# The customer simulator and the information check


def words(text: str) -> list[str]:
    """Lower-case runs of letters and digits: '$53.' -> ['53'], 'Order O4821?' -> ['order',
    'o4821']."""
    return re.findall(r"[a-z0-9]+", text.lower())


def mentions(text: str, phrase: str) -> bool:
    """The words of `phrase` occur consecutively among the words of `text`
    (normalized substring)."""
    w, p = words(text), words(phrase)
    return bool(p) and any(w[k : k + len(p)] == p for k in range(len(w) - len(p) + 1))


def told(text: str, phrase: str) -> bool:
    """An agent message gives `phrase`: it mentions it, and if it is a status word, it is the first
    one named."""
    if phrase in STATUSES:
        named = [w for w in words(text) if w in STATUSES]
        return bool(named) and named[0] == phrase
    return mentions(text, phrase)


def _user(content: str) -> dict:
    """An observation from the customer (the agent loop appends it as a user turn)."""
    return {"role": "user", "content": content}


def user_reply(meta: dict, text: str) -> str:
    """The customer's answer to an agent message (see the module docstring for the keywords)."""
    w = set(words(text))
    kind = meta["wants"] if meta["kind"] == "impossible" else meta["kind"]
    parts = []
    if "name" in w:
        parts.append(f"My name is {meta['name']}.")
    if w & {"zip", "zipcode", "postal"}:
        parts.append(f"My zip code is {meta['zip']}.")
    if "order" in w and meta["order_id"]:
        parts.append(
            f"It is order {meta['order_id']}."
            if meta["knows_order_id"]
            else f"I don't know the id. It is the order with the {meta['product']}."
        )
    if w & {"item", "product"} and meta["item_id"] is not None:
        parts.append(f"The {meta['product']}.")
    if w & {"color", "colour", "option"} and meta["new_option"]:
        parts.append(f"I want it in {meta['new_option']}.")
    if "address" in w and meta["new_address"]:
        parts.append(f"My new address is {meta['new_address']}.")
    if w & {"reason", "why"} and kind == "cancel":
        parts.append("I don't need it anymore.")
    return " ".join(parts) or "I'm not sure what you mean."


# -----------------------------------------------------------------------------
# Task generation

PROMPTS = {
    "cancel": "Hi, I want to cancel an order.",
    "return": "Hi, I want to return something.",
    "exchange": "Hi, I want to exchange an item.",
    "address": "Hi, I need to change my address.",
    "status": "Hi, what is the status of my order?",
}
KINDS = ("cancel", "return", "exchange", "address", "status", "impossible")


def customer_split(name: str, zip_code: str) -> str:
    """ "train" or "test" from a stable hash of the customer: no seed can put one in both splits."""
    return split_of(f"tau_lite|{name}|{zip_code}")


def _fresh_id(rng: random.Random, prefix: str, digits: int, taken: set) -> str:
    """'U482', 'O4821': a random id not in `taken` (which it joins)."""
    while (new := f"{prefix}{rng.randint(10 ** (digits - 1), 10**digits - 1)}") in taken:
        pass
    taken.add(new)
    return new


def _new_user(rng: random.Random, split: str, taken: set, name: str | None = None) -> User:
    """A user of `split` (redrawn until the hash agrees); `name` is given for a namesake."""
    while True:
        full = name or f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        zip_code = str(rng.randint(10000, 99999))
        if customer_split(full, zip_code) == split and zip_code not in taken:
            break
    taken.add(zip_code)
    return User(
        _fresh_id(rng, "U", 3, taken),
        full,
        zip_code,
        f"{rng.randint(1, 99)} {rng.choice(STREETS)} St",
    )


def _new_orders(
    rng: random.Random, user: User, n: int, taken: set, statuses: list[str]
) -> list[Order]:
    """n orders of 1-2 items; no product occurs twice among them, so a product names its order."""
    products = rng.sample(sorted(PRODUCTS), 2 * n)
    orders = []
    for k in range(n):
        order_id = _fresh_id(rng, "O", 4, taken)
        items = tuple(
            Item(j + 1, p, rng.choice(PRODUCTS[p]), rng.randint(5, 99))
            for j, p in enumerate(products[2 * k : 2 * k + rng.randint(1, 2)])
        )
        orders.append(Order(order_id, user.user_id, statuses[k], items))
    return orders


def make_task(rng: random.Random, split: str, kind: str, know_id_prob: float) -> Task:
    """One task of `kind`: a database of three users, the customer's hidden intent and
    the answer."""
    taken: set = set()
    customer = _new_user(rng, split, taken)
    namesake = _new_user(rng, split, taken, name=customer.name)
    stranger = _new_user(rng, split, taken)
    wants = rng.choice(("cancel", "return")) if kind == "impossible" else kind
    target_status = {
        "cancel": "pending",
        "return": "delivered",
        "exchange": "delivered",
        "status": rng.choice(("pending", "delivered", "cancelled")),
    }.get(kind)
    if kind == "impossible":
        target_status = "delivered" if wants == "cancel" else "pending"
    n = rng.randint(1, 3)
    statuses = [target_status or rng.choice(STATUSES[:3])] + [
        rng.choice(STATUSES[:3]) for _ in range(n - 1)
    ]
    orders = _new_orders(rng, customer, n, taken, statuses)
    target = orders[0]
    rng.shuffle(orders)
    for other in (namesake, stranger):
        orders += _new_orders(
            rng, other, rng.randint(1, 2), taken, [rng.choice(STATUSES[:3]) for _ in range(2)]
        )
    db = DB((customer, namesake, stranger), tuple(orders))
    item = rng.choice(target.items)
    new_option = rng.choice([c for c in PRODUCTS[item.product] if c != item.option])
    new_address = customer.address
    while new_address == customer.address:
        new_address = f"{rng.randint(1, 99)} {rng.choice(STREETS)} St"
    answer = {
        "cancel": str(sum(i.price for i in target.items)),
        "return": str(item.price),
        "exchange": "exchanged",
        "address": new_address,
    }.get(kind, target.status)
    with_item = wants in ("return", "exchange")
    meta = {
        "kind": kind,
        "wants": wants,
        "name": customer.name,
        "zip": customer.zip,
        "user_id": customer.user_id,
        "order_id": None if kind == "address" else target.order_id,
        "knows_order_id": rng.random() < know_id_prob,
        "product": (item if with_item else target.items[0]).product,
        "item_id": item.item_id if with_item else None,
        "new_option": new_option if kind == "exchange" else None,
        "new_address": new_address if kind == "address" else None,
        "db": db_to_json(db),
    }
    digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()
    return Task(
        env="tau_lite",
        id=f"tau_lite/{digest[:16]}",
        prompt=PROMPTS[wants],
        answer=answer,
        meta=meta,
    )


# -----------------------------------------------------------------------------
# The env

# The habits of the weaker demonstrations (demonstration(use_tools=False); sft.tool_use_prob sets
# their share), described in the module docstring.
WEAKER_DEMOS = ("careless", "one_question")
RANDOM_LINES = (
    "Please give me your name and zip code.",
    "Which order id?",
    "Which item?",
    "What is the new address?",
    "Your order is pending.",
    "Your order is delivered.",
    "Refund $20.",
    "Goodbye.",
)


@register_env("tau_lite")
class TauEnv(Env):
    """Retail customer service with a scripted customer; see the module docstring."""

    tool_names = TOOL_NAMES

    def __init__(
        self,
        kinds: tuple[str, ...] = KINDS,
        know_id_prob: float = 0.7,
        judge: str | None = None,
        weaker_demo: str = "careless",
    ):
        unknown = [k for k in kinds if k not in KINDS]
        if unknown or not kinds:
            raise ValueError(f"unknown kinds {unknown}; choose from {list(KINDS)}")
        if judge not in (None, "rules"):
            raise ValueError(f"judge must be None or 'rules', not {judge!r}")
        if not 0.0 <= know_id_prob <= 1.0:
            raise ValueError("know_id_prob must be in [0, 1]")
        if weaker_demo not in WEAKER_DEMOS:
            raise ValueError(
                f"weaker_demo must be one of {list(WEAKER_DEMOS)}, not {weaker_demo!r}"
            )
        self.kinds = tuple(kinds)  # intents drawn uniformly
        # share of customers who know their order id (others: list_orders)
        self.know_id_prob = know_id_prob
        self.judge_kind = judge  # None: no judge; "rules": the rule-based judge (training only)
        # the habit of demonstration(use_tools=False), one of WEAKER_DEMOS
        self.weaker_demo = weaker_demo

    def system_prompt(self) -> str:
        return (
            "You are a shop support agent. "
            "Verify the user with find_user before reading or changing anything. "
            "Only pending orders can be cancelled, only delivered ones returned or exchanged. "
            "Plain text goes to the user."
        )

    def sample_tasks(self, split: str, n: int, seed: int) -> list[Task]:
        """n distinct tasks of `split`, the same for the same (seed, constructor arguments)."""
        return sample_distinct(
            lambda rng: make_task(rng, split, rng.choice(self.kinds), self.know_id_prob),
            split,
            n,
            seed,
            f" for kinds {self.kinds}",
        )

    def reset(self, task: Task, seed: int) -> tuple[TauState, list[dict]]:
        """A new episode on the task's initial database (`seed` unused: the world is
        deterministic)."""
        _, messages = super().reset(task, seed)
        return TauState(task=task, db=db_from_json(task.meta["db"])), messages

    def score(self, task: Task, answer: str | None) -> float:
        """An answer alone earns nothing here: the reward is the final database and what the
        customer was told, which step() computes from the state (Env.run_tool_calls calls this on
        a transfer)."""
        return 0.0

    def outcome(self, state: TauState) -> tuple[bool, bool]:
        """(the database is the expected one, the required information was given)."""
        meta = state.task.meta
        info = state.info_given or (
            meta["kind"] == "impossible" and state.transferred and state.info_seen
        )
        return state.db == expected_db(meta), info

    def step(
        self, state: TauState, action: Action
    ) -> tuple[TauState, list[dict], float, bool, dict]:
        """Env.step, then: note whether a tool showed the required information, and score a
        finished episode."""
        state, obs, _, done, info = super().step(state, action)
        if any(m["role"] == "tool" and mentions(m["content"], state.task.answer) for m in obs):
            state = replace(state, info_seen=True)
        db_match, info_given = self.outcome(state)
        reward = float(done and db_match and info_given)
        state = replace(state, reward=reward)
        info["metrics"] = {
            "success": reward,
            "db_match": float(db_match),
            "info_given": float(info_given),
            "policy_violations": float(state.policy_violations),
            "steps": float(state.turn),
            "invalid_actions": float(state.tool_errors + state.parse_failures),
        }
        return state, obs, reward, done, info

    def on_text(self, state: TauState, text: str) -> tuple[TauState, list[dict], float, bool, dict]:
        """A message to the customer: they leave once told what they came for, the agent may say
        bye, and anything else gets the simulator's reply as a "user" observation."""
        if state.info_seen and told(text, state.task.answer):
            return (
                replace(state, done=True, info_given=True),
                [_user("Thanks, bye!")],
                0.0,
                True,
                {},
            )
        if {"bye", "goodbye"} & set(words(text)):
            return replace(state, done=True), [_user("Bye.")], 0.0, True, {}
        return state, [_user(user_reply(state.task.meta, text))], 0.0, False, {}

    def expert_script(self, task: Task, habit: str | None = None) -> list[Action]:
        """The expert's assistant turns, from the hidden intent (the model has to read the same
        facts off the customer's replies and the observations); `habit`: None, or one of
        WEAKER_DEMOS to play instead."""
        if habit is not None and habit not in WEAKER_DEMOS:
            raise ValueError(f"habit must be None or one of {list(WEAKER_DEMOS)}, not {habit!r}")
        one_question = habit == "one_question"
        meta = task.meta
        db, kind, oid = db_from_json(meta["db"]), meta["kind"], meta["order_id"]
        say = lambda text: Action(text=text)  # noqa: E731
        call = lambda tool_name, **args: Action(text="", tool_calls=(ToolCall(tool_name, args),))  # noqa: E731
        asks = (
            [say("What is your name?"), say("What is your zip code?")]
            if one_question
            else [say("Please give me your name and zip code.")]
        )
        script = asks + [call("find_user", name=meta["name"], zip=meta["zip"])]
        if kind == "address":
            return script + [
                say("What is the new address?"),
                call("update_address", user_id=meta["user_id"], address=meta["new_address"]),
                say(f"Your address is now {meta['new_address']}."),
            ]
        if one_question:
            script += [
                say(q)
                for q in {
                    "return": ("Which order id?", "Which item?"),
                    "exchange": ("Which order id?", "Which item?", "Which new color?"),
                }.get(meta["wants"], ("Which order id?",))
            ]
        else:
            question = {
                "return": "Which order id and item?",
                "exchange": "Which order id, item and new color?",
            }
            script.append(say(question.get(meta["wants"], "Which order id?")))
        order = db.order(oid)
        if meta["wants"] == "cancel" and meta["knows_order_id"] and habit == "careless":
            # the weaker habit
            script.append(call("cancel_order", order_id=oid, reason="no longer needed"))
        else:
            script.append(
                call("get_order", order_id=oid)
                if meta["knows_order_id"]
                else call("list_orders", user_id=meta["user_id"])
            )
            if kind == "cancel":
                script.append(call("cancel_order", order_id=oid, reason="no longer needed"))
            elif kind == "return":
                script.append(call("return_items", order_id=oid, item_ids=[meta["item_id"]]))
            elif kind == "exchange":
                script.append(
                    call(
                        "exchange_items",
                        order_id=oid,
                        item_id=meta["item_id"],
                        new_option=meta["new_option"],
                    )
                )
        verb = "cancelled" if meta["wants"] == "cancel" else "returned"
        final = {
            "cancel": f"Order {oid} is cancelled. Refund ${task.answer}.",
            "return": f"Item returned. Refund ${task.answer}.",
            "exchange": f"Order {oid} is exchanged: {meta['product']} now {meta['new_option']}.",
            "status": f"Order {oid} is {order.status}.",
            "impossible": f"Order {oid} is {order.status}, so it cannot be {verb}.",
        }
        return script + [say(final[kind])]

    def demonstration(self, task: Task, rng: random.Random, use_tools: bool) -> list[dict]:
        """The expert conversation, played through reset/step (worlds.replay; the customer's replies
        are real). use_tools=False: the weaker habit self.weaker_demo (WEAKER_DEMOS). `rng` is
        unused: one path per intent. Raises if the demonstration does not earn reward 1 (with no
        turn limit: the one_question habit may need more turns than a run's max_turns allows, which
        is the point of it)."""
        actions = self.expert_script(task, None if use_tools else self.weaker_demo)
        _, messages, reward, done = replay(self, task, actions)
        if not done or reward != 1.0:
            raise RuntimeError(
                f"the expert demonstration of {task.id} earned {reward} (done={done})"
            )
        return messages

    def random_action(self, state: TauState, rng: random.Random) -> Action:
        """The floor: a random line to the customer (30%), else a random tool with
        random arguments."""
        if rng.random() < 0.3:
            return Action(text=rng.choice(RANDOM_LINES))
        product = rng.choice(sorted(PRODUCTS))
        values = {
            "name": f"{rng.choice(FIRST)} {rng.choice(LAST)}",
            "zip": str(rng.randint(10000, 99999)),
            "order_id": f"O{rng.randint(1000, 9999)}",
            "user_id": f"U{rng.randint(100, 999)}",
            "item_ids": [rng.randint(1, 2)],
            "item_id": rng.randint(1, 2),
            "new_option": rng.choice(PRODUCTS[product]),
            "reason": "no longer needed",
            "address": f"{rng.randint(1, 99)} {rng.choice(STREETS)} St",
            "summary": "the user needs help",
        }
        name = rng.choice(TOOL_NAMES)
        args = {k: values[k] for k in TOOLS[name].parameters["required"]}
        return Action(text="", tool_calls=(ToolCall(name, args),))

    def judge(self, task: Task, messages: list[dict]) -> float | None:
        """Rule-based judge (judge="rules"; the agent loop applies it in training only): the mean of
        no tool error or refusal, a polite word ("please", "thank", "sorry") to the customer, and
        every order write preceded by a successful get_order / list_orders. None when no judge
        is configured."""
        if self.judge_kind is None:
            return None
        tool_msgs = [m for m in messages if m["role"] == "tool"]
        no_errors = not any(m["content"].startswith("Error") for m in tool_msgs)
        polite = any(
            m["role"] == "assistant"
            and re.search(r"\b(please|thank|sorry)", (m.get("content") or "").lower())
            for m in messages
        )
        looked, looked_first = False, True
        for m in tool_msgs:
            if m["name"] in ("get_order", "list_orders") and not m["content"].startswith("Error"):
                looked = True
            if m["name"] in ORDER_WRITES and not looked:
                looked_first = False
        return (no_errors + bool(polite) + looked_first) / 3.0
