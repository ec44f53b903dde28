"""Tests for env_tau.py (tau_lite): the tools and their policy rules on a hand-written database, the
customer simulator, rewards (and their partial credit in the metrics), invalid actions as
observations, step limits, determinism and the split, the expert and random baselines, the token
budget of the config, and the judge: training-only, so evaluate() gives the same metrics with or
without it."""

import random
from dataclasses import replace

import pytest

from agent import LocalRollouts, run_episodes
from chat import encode, render
from config import load_config
from env import Action, Task, ToolCall, make_env
from envs.env_tau import (
    DB,
    Item,
    Order,
    TauEnv,
    User,
    customer_split,
    db_from_json,
    db_to_json,
    expected_db,
    mentions,
    told,
    user_reply,
)
from envs.worlds import read_tasks, write_tasks
from eval import evaluate, play_scripted
from rollout import Generation, SamplingParams
from sft import tokenize_conversation, train_tokenizer

CFG = load_config("configs/tau_lite.yaml")

# A hand-written world: Ana Diaz (U101) has a pending order (lamp $30 + mug $12 = $42) and a
# delivered one; her namesake U102 lives at another zip code; Ben Fox (U103) is a stranger.
HAND_DB = DB(
    users=(
        User("U101", "Ana Diaz", "12345", "1 Oak St"),
        User("U102", "Ana Diaz", "54321", "2 Elm St"),
        User("U103", "Ben Fox", "11111", "3 Pine St"),
    ),
    orders=(
        Order(
            "O1001", "U101", "pending", (Item(1, "lamp", "white", 30), Item(2, "mug", "red", 12))
        ),
        Order("O1002", "U101", "delivered", (Item(1, "shirt", "blue", 25),)),
        Order("O1003", "U102", "pending", (Item(1, "hat", "black", 40),)),
        Order("O1004", "U103", "delivered", (Item(1, "bag", "red", 15),)),
    ),
)


def hand_task(kind: str, answer: str, **meta) -> Task:
    base = {
        "kind": kind,
        "wants": kind,
        "name": "Ana Diaz",
        "zip": "12345",
        "user_id": "U101",
        "order_id": "O1001",
        "knows_order_id": True,
        "product": "lamp",
        "item_id": None,
        "new_option": None,
        "new_address": None,
        "db": db_to_json(HAND_DB),
    }
    return Task(
        env="tau_lite",
        id=f"tau_lite/hand-{kind}",
        prompt="Hi.",
        answer=answer,
        meta={**base, **meta},
    )


def call(tool_name: str, **args) -> Action:
    return Action(text="", tool_calls=(ToolCall(tool_name, args),))


def play(env: TauEnv, task: Task, actions: list[Action]):
    """Step the actions; returns the last (state, obs, reward, done, info)."""
    state, _ = env.reset(task, seed=0)
    out = None
    for action in actions:
        out = env.step(state, action)
        state = out[0]
    return out


@pytest.fixture(scope="module")
def tau():
    return make_env("tau_lite")


# -----------------------------------------------------------------------------
# the world: tools, policy rules, transitions


def test_tools_and_policy_rules_on_a_hand_world(tau):
    s0, _ = tau.reset(hand_task("cancel", "42"), seed=0)
    run = lambda s, tool_name, **a: tau.run_tool(s, ToolCall(tool_name, a))  # noqa: E731

    # identity first: reading or changing an order of an unverified user is a refused policy
    # violation
    s, text, kind = run(s0, "get_order", order_id="O1001")
    assert (text, kind, s.policy_violations) == (
        "Error: verify the user with find_user first.",
        "refused",
        1,
    )
    s, text, kind = run(s0, "list_orders", user_id="U101")
    assert kind == "refused" and s.policy_violations == 1
    s, text, kind = run(s0, "find_user", name="Ana Diaz", zip="99999")
    assert (text, kind, s.verified, s.policy_violations) == (
        "Error: no user with that name and zip.",
        "error",
        (),
        0,
    )
    # the namesake's zip verifies the namesake, not the customer
    s, text, kind = run(s0, "find_user", name="ana  diaz", zip="54321")
    assert (text, s.verified) == ("U102 Ana Diaz, zip 54321, 2 Elm St", ("U102",))
    assert run(s, "get_order", order_id="O1001")[2] == "refused"

    s, text, kind = run(s0, "find_user", name="Ana Diaz", zip=" 12345")
    assert (text, kind, s.verified) == ("U101 Ana Diaz, zip 12345, 1 Oak St", None, ("U101",))
    assert run(s, "get_order", order_id="O1001")[1:] == (
        "O1001 pending: #1 lamp white $30, #2 mug red $12",
        None,
    )
    assert run(s, "get_order", order_id="O9999")[1:] == ("Error: no order O9999.", "error")
    assert run(s, "list_orders", user_id="U101")[1] == (
        "O1001 pending: #1 lamp white $30, #2 mug red $12\nO1002 delivered: #1 shirt blue $25"
    )
    assert run(s, "get_order", order_id="O1004")[2] == "refused"  # Ben's order: not verified

    # status rules: refused calls leave the database alone
    for name, args, why in [
        (
            "cancel_order",
            {"order_id": "O1002", "reason": "x"},
            "O1002 is delivered; only pending orders can be cancelled.",
        ),
        (
            "return_items",
            {"order_id": "O1001", "item_ids": [1]},
            "O1001 is pending; only delivered orders can be returned.",
        ),
        (
            "exchange_items",
            {"order_id": "O1001", "item_id": 1, "new_option": "black"},
            "O1001 is pending; only delivered orders can be exchanged.",
        ),
    ]:
        s2, text, kind = run(s, name, **args)
        assert (text, kind, s2.policy_violations, s2.db) == (f"Error: {why}", "refused", 1, HAND_DB)
    # bad values are errors, not violations
    assert run(s, "return_items", order_id="O1002", item_ids=[2])[1:] == (
        "Error: item_ids must be item numbers of O1002: [1].",
        "error",
    )
    assert run(s, "exchange_items", order_id="O1002", item_id=1, new_option="blue")[1:] == (
        "Error: the shirt comes in red, green.",
        "error",
    )
    assert (
        run(s, "exchange_items", order_id="O1002", item_id=3, new_option="red")[1]
        == "Error: no item #3 in O1002."
    )

    # the writes, by hand
    s1, text, _ = run(s, "cancel_order", order_id="O1001", reason="no longer needed")
    assert text == "O1001 cancelled, refund $42"
    assert s1.db.orders == (replace(HAND_DB.orders[0], status="cancelled"),) + HAND_DB.orders[1:]
    assert run(s1, "cancel_order", order_id="O1001", reason="again")[1].startswith(
        "Error: O1001 is cancelled"
    )
    s2, text, _ = run(s1, "return_items", order_id="O1002", item_ids=[1])
    assert text == "O1002 returned #1, refund $25"
    assert s2.db.order("O1002") == Order(
        "O1002", "U101", "returned", (Item(1, "shirt", "blue", 25, True),)
    )
    assert run(s2, "exchange_items", order_id="O1002", item_id=1, new_option="red")[2] == "refused"
    s3, text, _ = run(s2, "update_address", user_id="U101", address=" 7  Lake St ")
    assert text == "U101 address is now 7 Lake St" and s3.db.user("U101").address == "7 Lake St"
    s4, text, _ = run(s, "exchange_items", order_id="O1002", item_id=1, new_option="Green")
    assert text == "O1002 exchanged #1 shirt blue->green"
    assert (
        s4.db.order("O1002").items == (Item(1, "shirt", "green", 25),)
        and s4.db.order("O1002").status == "exchanged"
    )
    assert s0.db == s.db == HAND_DB  # states are replaced, never mutated


def test_expected_db_by_hand():
    orders = list(HAND_DB.orders)
    assert expected_db(hand_task("cancel", "42").meta) == replace(
        HAND_DB, orders=tuple([replace(orders[0], status="cancelled")] + orders[1:])
    )
    assert expected_db(hand_task("return", "25", order_id="O1002", item_id=1).meta).order(
        "O1002"
    ) == Order("O1002", "U101", "returned", (Item(1, "shirt", "blue", 25, True),))
    assert expected_db(
        hand_task("exchange", "exchanged", order_id="O1002", item_id=1, new_option="red").meta
    ).order("O1002").items == (Item(1, "shirt", "red", 25),)
    assert (
        expected_db(hand_task("address", "9 Hill St", order_id=None, new_address="9 Hill St").meta)
        .user("U101")
        .address
        == "9 Hill St"
    )
    for kind in ("status", "impossible"):
        assert expected_db(hand_task(kind, "pending").meta) == HAND_DB
    assert db_from_json(db_to_json(HAND_DB)) == HAND_DB


# -----------------------------------------------------------------------------
# the customer


def test_user_simulator_answers_only_what_is_asked():
    cancel = hand_task("cancel", "42").meta
    assert (
        user_reply(cancel, "Please give me your name and zip code.")
        == "My name is Ana Diaz. My zip code is 12345."
    )
    assert user_reply(cancel, "Your ZIP?") == "My zip code is 12345."
    assert user_reply(cancel, "Which order id?") == "It is order O1001."
    assert user_reply(cancel, "Why?") == "I don't need it anymore."
    assert user_reply({**cancel, "knows_order_id": False}, "Which order?") == (
        "I don't know the id. It is the order with the lamp."
    )
    for text in ("Which item?", "What is the new address?", "Reordering?", "How are you?", ""):
        # not this intent, or not a keyword
        assert user_reply(cancel, text) == "I'm not sure what you mean."
    ret = hand_task("return", "25", order_id="O1002", product="shirt", item_id=1).meta
    assert user_reply(ret, "Which order id and item?") == "It is order O1002. The shirt."
    exch = hand_task(
        "exchange", "exchanged", order_id="O1002", product="shirt", item_id=1, new_option="red"
    ).meta
    assert (
        user_reply(exch, "Which order id, item and new color?")
        == "It is order O1002. The shirt. I want it in red."
    )
    addr = hand_task("address", "9 Hill St", order_id=None, new_address="9 Hill St").meta
    assert user_reply(addr, "What is the new address?") == "My new address is 9 Hill St."
    assert user_reply(addr, "Which order?") == "I'm not sure what you mean."


def test_information_matching():
    assert (
        mentions("Refund: $42.", "42")
        and not mentions("Order O4200", "42")
        and not mentions("142", "42")
    )
    assert mentions("Your address is now 7 lake st.", "7 Lake St") and not mentions(
        "7 Lake", "7 Lake St"
    )
    assert told("Order O1 is delivered, so it cannot be cancelled.", "delivered")
    # listing every status is no answer
    assert not told("It is pending, delivered or cancelled.", "delivered")
    assert not told("No idea.", "delivered")


def test_customer_leaves_once_told_what_was_seen(tau):
    task = hand_task("cancel", "42")
    state, _ = tau.reset(task, seed=0)
    # a guess before any tool showed it
    state, obs, reward, done, _ = tau.step(state, Action(text="Refund $42."))
    assert (obs, reward, done) == (
        [{"role": "user", "content": "I'm not sure what you mean."}],
        0.0,
        False,
    )
    state, obs, *_ = tau.step(state, Action(text="Please give me your name and zip code."))
    assert obs == [{"role": "user", "content": "My name is Ana Diaz. My zip code is 12345."}]
    state, *_ = tau.step(state, call("find_user", name="Ana Diaz", zip="12345"))
    state, obs, *_ = tau.step(
        state, call("cancel_order", order_id="O1001", reason="no longer needed")
    )
    assert obs == [
        {"role": "tool", "name": "cancel_order", "content": "O1001 cancelled, refund $42"}
    ]
    assert state.info_seen and not state.done
    state, obs, reward, done, info = tau.step(state, Action(text="Done. Refund $42."))
    assert (obs, reward, done) == ([{"role": "user", "content": "Thanks, bye!"}], 1.0, True)
    assert info["metrics"] == {
        "success": 1.0,
        "db_match": 1.0,
        "info_given": 1.0,
        "policy_violations": 0.0,
        "steps": 5.0,
        "invalid_actions": 0.0,
    }
    with pytest.raises(ValueError):
        tau.step(state, Action(text="hello?"))


# -----------------------------------------------------------------------------
# rewards and partial credit

VERIFY = [Action(text="Name and zip?"), call("find_user", name="Ana Diaz", zip="12345")]


def test_reward_needs_both_the_database_and_the_information(tau):
    cancel = hand_task("cancel", "42")
    # right database, but the customer never heard the refund: the agent says goodbye
    _, obs, reward, done, info = play(
        tau,
        cancel,
        VERIFY
        + [call("cancel_order", order_id="O1001", reason="x"), Action(text="All set, goodbye!")],
    )
    assert (reward, done, obs) == (0.0, True, [{"role": "user", "content": "Bye."}])
    assert (info["metrics"]["db_match"], info["metrics"]["info_given"]) == (1.0, 0.0)
    # the refund told, but an extra write made the database wrong
    _, _, reward, done, info = play(
        tau,
        cancel,
        VERIFY
        + [
            call("cancel_order", order_id="O1001", reason="x"),
            call("update_address", user_id="U101", address="5 Elm St"),
            Action(text="Refund $42."),
        ],
    )
    assert (reward, done, info["metrics"]["db_match"], info["metrics"]["info_given"]) == (
        0.0,
        True,
        0.0,
        1.0,
    )
    # the wrong order: the customer hears a refund, not theirs
    _, _, reward, done, info = play(
        tau,
        cancel,
        VERIFY
        + [
            call("return_items", order_id="O1002", item_ids=[1]),
            Action(text="Refund $25. Goodbye."),
        ],
    )
    assert (reward, info["metrics"]["db_match"], info["metrics"]["info_given"]) == (0.0, 0.0, 0.0)


def test_status_must_be_read_before_it_counts(tau):
    status = hand_task("status", "pending")
    state, obs, reward, done, _ = play(tau, status, [Action(text="Your order is pending.")])
    assert (reward, done) == (0.0, False)  # a guess: the customer just asks about the order
    assert obs == [{"role": "user", "content": "It is order O1001."}]
    looked = VERIFY + [call("get_order", order_id="O1001")]
    assert play(tau, status, looked + [Action(text="It is delivered, no, pending.")])[3] is False
    assert play(tau, status, looked + [Action(text="Order O1001 is pending.")])[2:4] == (1.0, True)


def test_impossible_request_refuse_or_transfer(tau):
    imp = hand_task("impossible", "delivered", wants="cancel", order_id="O1002", product="shirt")
    look = VERIFY + [call("get_order", order_id="O1002")]
    transfer = call("transfer_to_human", summary="wants to cancel a delivered order")
    assert play(tau, imp, [transfer])[2:4] == (0.0, True)  # handed over without looking
    state, obs, reward, done, info = play(tau, imp, look + [transfer])
    assert (reward, done, obs, state.transferred) == (1.0, True, [], True)
    assert (
        play(
            tau, imp, look + [Action(text="Order O1002 is delivered, so it cannot be cancelled.")]
        )[2]
        == 1.0
    )
    # cancelling anyway is refused: the database is unchanged, the refusal tells the status, a
    # violation is counted
    state, obs, reward, done, info = play(
        tau,
        imp,
        VERIFY
        + [
            call("cancel_order", order_id="O1002", reason="x"),
            Action(text="Sorry, it is delivered already."),
        ],
    )
    assert (reward, info["metrics"]["policy_violations"], state.db) == (1.0, 1.0, HAND_DB)


def test_invalid_actions_are_observations(tau):
    state, _ = tau.reset(hand_task("cancel", "42"), seed=0)
    for action, expected in [
        (call("delete_everything"), "Error: unknown tool 'delete_everything'"),
        (call("find_user", name="Ana Diaz"), "Error: bad arguments: missing ['zip']"),
        (
            call("return_items", order_id="O1002", item_ids="1"),
            "Error: bad arguments: 'item_ids' must be a array",
        ),
        (
            Action(text='<tool_call>{"name": "get_order"', parse_error="invalid JSON in tool call"),
            "Error: invalid JSON in tool call.",
        ),
    ]:
        state, obs, reward, done, info = tau.step(state, action)
        assert obs[-1]["role"] == "tool" and obs[-1]["content"].startswith(expected)
        assert (reward, done, state.db) == (0.0, False, HAND_DB)
    assert info["metrics"]["invalid_actions"] == 4.0 and info["metrics"]["steps"] == 4.0
    assert (state.tool_errors, state.parse_failures, state.policy_violations) == (3, 1, 0)


# -----------------------------------------------------------------------------
# generation, split, determinism


def test_tasks_are_deterministic_split_and_serializable(tau, tmp_path):
    train, test = tau.sample_tasks("train", 300, 0), tau.sample_tasks("test", 200, 0)
    assert train == tau.sample_tasks("train", 300, 0) and train != tau.sample_tasks("train", 300, 1)
    assert len({t.id for t in train}) == 300
    customers = lambda tasks: {(t.meta["name"], t.meta["zip"]) for t in tasks}  # noqa: E731
    assert not customers(train) & customers(test)
    for split, tasks in (("train", train), ("test", test)):
        for t in tasks:
            db = db_from_json(t.meta["db"])
            # no user leaks across splits
            assert all(customer_split(u.name, u.zip) == split for u in db.users)
            assert db.users[1].name == db.users[0].name and db.users[1].zip != db.users[0].zip
            products = [
                i.product for o in db.orders if o.user_id == t.meta["user_id"] for i in o.items
            ]
            assert len(products) == len(set(products))  # a product names its order
    assert {t.meta["kind"] for t in test} == {
        "cancel",
        "return",
        "exchange",
        "address",
        "status",
        "impossible",
    }
    write_tasks(test[:20], tmp_path / "tau.jsonl")
    again = read_tasks(tmp_path / "tau.jsonl")
    assert again == test[:20]
    assert tau.demonstration(again[0], random.Random(0), True) == tau.demonstration(
        test[0], random.Random(0), True
    )
    only = make_env("tau_lite", kinds=("address",)).sample_tasks("test", 5, 0)
    assert {t.meta["kind"] for t in only} == {"address"}
    with pytest.raises(ValueError):
        make_env("tau_lite", kinds=("refund",))
    with pytest.raises(ValueError):
        make_env("tau_lite", judge="gpt")


def test_random_policy_is_deterministic_from_the_seed(tau):
    tasks = tau.sample_tasks("test", 30, 3)
    assert play_scripted(tau, tasks, "random", 5, 10) == play_scripted(tau, tasks, "random", 5, 10)
    assert play_scripted(tau, tasks, "random", 5, 10) != play_scripted(tau, tasks, "random", 6, 10)


# -----------------------------------------------------------------------------
# baselines, step limits, the weaker demonstration path


def test_expert_solves_heldout_and_random_does_not(tau):
    tasks = tau.sample_tasks("test", 150, CFG.eval_seed)
    max_turns = CFG.rollout.agent.max_turns
    expert = play_scripted(tau, tasks, "expert", CFG.eval_seed, max_turns)
    assert sum(e["reward"] for e in expert) / len(expert) >= 0.95
    assert all(e["done"] and e["metrics"]["policy_violations"] == 0 for e in expert)
    assert max(e["turns"] for e in expert) <= 6 <= max_turns
    rand = play_scripted(tau, tasks, "random", CFG.eval_seed, max_turns)
    assert sum(e["reward"] for e in rand) / len(rand) <= 0.05


def test_step_limit_cuts_the_expert(tau):
    tasks = tau.sample_tasks("test", 20, 0)
    for e in play_scripted(tau, tasks, "expert", 0, max_turns=3):
        assert (e["reward"], e["done"], e["turns"]) == (0.0, False, 3)
        # metrics are reported when cut too
        assert e["metrics"]["steps"] == 3.0 and e["metrics"]["success"] == 0.0


def test_weaker_path_cancels_without_looking(tau):
    tasks = [
        t
        for t in tau.sample_tasks("train", 200, 0)
        if t.meta["wants"] == "cancel" and t.meta["knows_order_id"]
    ]
    kinds = set()
    for t in tasks:
        # both raise unless the episode earns reward 1
        strong = tau.demonstration(t, random.Random(0), True)
        weak = tau.demonstration(t, random.Random(0), False)
        errors = [m for m in weak if m["role"] == "tool" and m["content"].startswith("Error")]
        if t.meta["kind"] == "cancel":
            # get_order skipped: one assistant turn and its observation fewer
            assert len(weak) == len(strong) - 2 and not errors
        else:  # a refused cancel_order instead of get_order, whose error tells the status
            assert (
                len(weak) == len(strong)
                and len(errors) == 1
                and "is delivered" in errors[0]["content"]
            )
        kinds.add(t.meta["kind"])
    assert kinds == {"cancel", "impossible"}


def test_one_question_habit_asks_alone_and_needs_more_turns():
    tau1 = make_env("tau_lite", weaker_demo="one_question")
    # by what the customer wants
    extra = {"address": 1, "status": 1, "cancel": 1, "return": 2, "exchange": 3}
    seen = set()
    for t in tau1.sample_tasks("train", 120, 0):
        # both raise unless the episode earns reward 1
        strong = tau1.demonstration(t, random.Random(0), True)
        weak = tau1.demonstration(t, random.Random(0), False)
        turns = lambda demo: sum(m["role"] == "assistant" for m in demo)  # noqa: E731
        assert turns(weak) == turns(strong) + extra[t.meta["wants"]]
        assert (
            weak[2]["content"] == "What is your name?"
            and weak[3]["content"] == f"My name is {t.meta['name']}."
        )
        cut = t.meta["kind"] in ("cancel", "return", "exchange") or t.meta["wants"] == "return"
        assert (turns(weak) > 6) == cut and turns(strong) <= 6
        assert not any(m["role"] == "tool" and m["content"].startswith("Error") for m in weak)
        seen.add(t.meta["kind"])
    assert seen == set(extra) | {"impossible"}
    with pytest.raises(ValueError, match="weaker_demo"):
        make_env("tau_lite", weaker_demo="rude")
    with pytest.raises(ValueError, match="habit"):
        # a misspelt habit is refused, not played as the expert
        tau1.expert_script(t, "one-question")


# -----------------------------------------------------------------------------
# token budget of the config, and the judge


@pytest.fixture(scope="module")
def tokenizer(tau):
    rng = random.Random(0)
    demos = [
        tau.demonstration(t, rng, rng.random() < 0.5) for t in tau.sample_tasks("train", 400, 0)
    ]
    return train_tokenizer([render(d, tau.tools()) for d in demos], 1024)


def test_expert_episodes_fit_the_config_budget(tokenizer):
    # both demonstration habits of the config
    configured = make_env("tau_lite", **CFG.envs[0].kwargs)
    for t in configured.sample_tasks("test", 60, 0):
        for use_tools in (True, False):
            ids, mask = tokenize_conversation(
                configured.demonstration(t, random.Random(0), use_tools),
                configured.tools(),
                tokenizer,
                "qwen2.5",
            )
            # room for a wasted turn or two
            assert len(ids) + 60 <= CFG.rollout.agent.max_total_tokens
            longest_turn, run = 0, 0
            for m in mask:  # assistant turns are the runs of 1s
                run = run + 1 if m else 0
                longest_turn = max(longest_turn, run)
            assert longest_turn <= CFG.rollout.max_tokens


class DemoEngine:
    """Continues each prompt with the next assistant turn of the demonstration it is a prefix of,
    else writes 'Goodbye.' (so tasks without a demonstration fail after the first turn)."""

    def __init__(self, tokenizer, rendered_demos: list[str]):
        self.tok, self.demos = tokenizer, rendered_demos

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            text = self.tok.decode(p, skip_special_tokens=False)
            demo = next((d for d in self.demos if d.startswith(text)), None)
            turn = (
                demo[len(text) : demo.index("<|im_end|>", len(text)) + len("<|im_end|>")]
                if demo
                else "Goodbye.<|im_end|>"
            )
            ids = encode(self.tok, turn)
            out.append(Generation(ids, [-0.5] * len(ids), "stop"))
        return out


class AlwaysOneJudge(TauEnv):
    """A judge that would give every finished episode the full bonus."""

    def judge(self, task, messages):
        return 1.0


def test_judge_rules(tau):
    judged = make_env("tau_lite", judge="rules")
    tasks = judged.sample_tasks("train", 200, 0)
    # off by default
    assert tau.judge(tasks[0], tau.demonstration(tasks[0], random.Random(0), True)) is None
    for t in tasks:
        assert judged.judge(t, judged.demonstration(t, random.Random(0), True)) == 1.0
    cancel = next(t for t in tasks if t.meta["kind"] == "cancel" and t.meta["knows_order_id"])
    impossible = next(
        t
        for t in tasks
        if t.meta["kind"] == "impossible"
        and t.meta["wants"] == "cancel"
        and t.meta["knows_order_id"]
    )
    assert judged.judge(
        cancel, judged.demonstration(cancel, random.Random(0), False)
    ) == pytest.approx(2 / 3)
    assert judged.judge(
        impossible, judged.demonstration(impossible, random.Random(0), False)
    ) == pytest.approx(1 / 3)


def test_eval_metrics_are_unaffected_by_the_judge(tau, tokenizer):
    tasks = tau.sample_tasks("test", 8, 0)
    demos = [render(tau.demonstration(t, random.Random(0), True), tau.tools()) for t in tasks[:5]]
    engine = DemoEngine(tokenizer, demos)  # solves the first five tasks, fails the other three
    cfg = replace(CFG.rollout.agent, n_samples=1)
    params = SamplingParams(temperature=1.0, max_tokens=CFG.rollout.max_tokens, seed=0)
    results = {}
    for name, env in (
        ("none", tau),
        ("rules", make_env("tau_lite", judge="rules")),
        ("one", AlwaysOneJudge()),
    ):
        rollouts = LocalRollouts(engine, {"tau_lite": env}, tokenizer, cfg)
        metrics, trajs = evaluate(rollouts, {"tau_lite": tasks}, cfg, params, seed=0)
        results[name] = metrics
        assert [t.reward for t in trajs] == [1.0] * 5 + [0.0] * 3 and all(
            "judge" not in t.info for t in trajs
        )
    assert results["none"] == results["rules"] == results["one"]
    assert (
        results["none"]["eval/tau_lite/accuracy"]
        == results["none"]["eval/tau_lite/success"]
        == 5 / 8
    )
    # ... while a training rollout with judge_weight > 0 does add the judge's score
    plain = run_episodes(
        engine, {"tau_lite": AlwaysOneJudge()}, tasks, tokenizer, cfg, params, seed=0
    )
    judged = run_episodes(
        engine,
        {"tau_lite": AlwaysOneJudge()},
        tasks,
        tokenizer,
        cfg,
        params,
        seed=0,
        judge_weight=0.5,
    )
    assert [t.reward for t in plain] == [1.0] * 5 + [0.0] * 3
    assert [t.reward for t in judged] == [1.5] * 5 + [0.5] * 3 and all(
        t.info["judge"] == 1.0 for t in judged
    )
