"""Tests for env_alfworld.py ("alfworld_lite"): transitions and observations on a hand-built room,
the goal of each of the six task types, invalid commands as observations, step limits, determinism
from the seed, the held-out split, demonstrations replayed through step(), and the expert and random
policies played by eval.play_scripted. Expected strings are written by hand, not produced by the
code under test."""

import json
import random
from dataclasses import replace

import pytest

import agent
import chat
import rollout

from config import load_config
from env import Action, ToolCall, make_env
from envs import env_alfworld as alf
from envs.worlds import read_tasks, write_tasks
from eval import play_scripted, scripted_metrics
from tools import TOOLS

DEVICES = ["fridge 1", "microwave 1", "sinkbasin 1", "desklamp 1"]


@pytest.fixture(scope="module")
def house():
    return make_env("alfworld_lite")


def room(
    house,
    kind="clean",
    obj="mug",
    count=1,
    target="shelf 1",
    objects=(("mug 2", "drawer 1"), ("apple 1", "countertop 1"), ("book 3", "shelf 1")),
):
    """A hand-built room: drawer 1 (closed), shelf 1, countertop 1 and the four devices."""
    scene = alf.Scene(
        kind,
        obj,
        count,
        target,
        ("drawer 1", "shelf 1", "countertop 1", *DEVICES),
        ("drawer 1", "fridge 1", "microwave 1"),
        tuple(objects),
    )
    task = house.make_task(scene)
    return task, house.reset(task, seed=0)[0]


def do(house, state, *commands):
    """Play commands one turn each -> (state, last observation text or None, reward, done, info)."""
    text, reward, done, info = None, 0.0, False, {}
    for c in commands:
        state, obs, reward, done, info = house.step(
            state, Action("", (ToolCall("house_act", {"command": c}),))
        )
        text = obs[0]["content"] if obs else None
    return state, text, reward, done, info


GO_ALL = "go to: drawer 1, shelf 1, countertop 1, fridge 1, microwave 1, sinkbasin 1, desklamp 1"


# -----------------------------------------------------------------------------
# Transitions and observations


def test_prompt_is_goal_and_first_observation(house):
    task, _ = room(house)
    assert task.prompt == (
        "Task: put a clean mug on shelf 1.\nYou are in the middle of the room.\n"
        f"Admissible: look, inventory; {GO_ALL}"
    )
    assert task.answer == "success" and task.id.startswith("alfworld_lite/")
    assert house.system_prompt() in house.reset(task, seed=0)[1][0]["content"]


def test_transitions_by_hand(house):
    _, s = room(house)
    s, text, *_ = do(house, s, "go to drawer 1")
    assert text == (
        "You arrive at drawer 1. It is closed.\nAdmissible: open drawer 1, look, inventory; "
        "go to: shelf 1, countertop 1, fridge 1, microwave 1, sinkbasin 1, desklamp 1"
    )
    s, text, *_ = do(house, s, "open drawer 1")
    assert text.startswith(
        "You open drawer 1. You see: mug 2.\nAdmissible: close drawer 1, take mug 2 from drawer 1, "
        "look, inventory; go to: shelf 1,"
    )
    s, text, *_ = do(house, s, "take mug 2 from drawer 1")
    assert text.startswith(
        "You take mug 2 from drawer 1.\nAdmissible: close drawer 1, put mug 2 in/on drawer 1, "
        "examine mug 2, look, inventory;"
    )
    assert (s.holding, dict(s.where)["mug 2"], s.location) == ("mug 2", "", "drawer 1")
    s, text, *_ = do(house, s, "go to sinkbasin 1")
    assert text.startswith(
        "You arrive at sinkbasin 1. It is empty.\nAdmissible: put mug 2 in/on sinkbasin 1, "
        "clean mug 2 with sinkbasin 1, examine mug 2,"
    )
    s, text, *_ = do(house, s, "clean mug 2 with sinkbasin 1", "examine mug 2")
    assert text.startswith("mug 2 is clean.\n") and s.clean == {"mug 2"}
    s, text, *_ = do(house, s, "inventory")
    assert text.startswith("You carry mug 2.\n")
    s, text, *_ = do(house, s, "go to microwave 1")
    assert "open microwave 1, heat mug 2 with microwave 1," in text  # heating needs no open door
    s, text, *_ = do(
        house,
        s,
        "heat mug 2 with microwave 1",
        "go to fridge 1",
        "cool mug 2 with fridge 1",
        "examine mug 2",
    )
    # cooling ends hot
    assert text.startswith("mug 2 is clean and cold.\n") and s.hot == frozenset()
    s, text, *_ = do(house, s, "go to desklamp 1", "look")
    assert text.startswith(
        "You are at desklamp 1. It is off.\nAdmissible: use desklamp 1, examine mug 2, look,"
    )
    assert "put" not in text  # a lamp holds nothing
    s, text, *_ = do(house, s, "use desklamp 1")
    assert text.startswith("You turn on desklamp 1.\n") and s.lamp_on
    assert s.steps == 15 and s.invalid_actions == 0 and not s.done


def test_states_are_replaced_never_mutated(house):
    _, s0 = room(house)
    s1, *_ = do(house, s0, "go to drawer 1", "open drawer 1", "take mug 2 from drawer 1")
    assert (s0.location, s0.holding, s0.opened, s0.steps) == ("", "", frozenset(), 0)
    assert (s1.location, s1.holding, s1.opened, s1.steps) == ("drawer 1", "mug 2", {"drawer 1"}, 3)


def test_closed_receptacle_hides_and_refuses(house):
    _, s = room(house, kind="pick_and_place", target="fridge 1")
    s, text, *_ = do(house, s, "go to drawer 1", "take mug 2 from drawer 1")
    assert text.startswith("Nothing happens.\nAdmissible: open drawer 1,")
    s, *_ = do(house, s, "open drawer 1", "take mug 2 from drawer 1", "go to fridge 1")
    s, text, reward, done, _ = do(house, s, "put mug 2 in/on fridge 1")
    assert text.startswith("Nothing happens.") and not done  # the fridge is closed
    s, text, reward, done, info = do(house, s, "open fridge 1", "put mug 2 in/on fridge 1")
    # the winning command has no observation
    assert (text, reward, done, s.answer) == (None, 1.0, True, "success")
    assert info["metrics"] == {
        "success": 1.0,
        "invalid_actions": 2.0,
        "steps": 8.0,
        "subgoals": 1.0,
    }


# -----------------------------------------------------------------------------
# Goals and rewards, one per task type


def test_clean_needs_a_clean_object(house):
    _, s = room(house)
    s, text, reward, done, _ = do(
        house,
        s,
        "go to drawer 1",
        "open drawer 1",
        "take mug 2 from drawer 1",
        "go to shelf 1",
        "put mug 2 in/on shelf 1",
    )
    assert (reward, done) == (0.0, False) and text.startswith("You put mug 2 in/on shelf 1.\n")
    s, _, reward, done, _ = do(
        house,
        s,
        "take mug 2 from shelf 1",
        "go to sinkbasin 1",
        "clean mug 2 with sinkbasin 1",
        "go to shelf 1",
        "put mug 2 in/on shelf 1",
    )
    assert (reward, done, s.reward) == (1.0, True, 1.0)


@pytest.mark.parametrize(
    "kind,device,wrong", [("heat", "microwave 1", "cool"), ("cool", "fridge 1", "heat")]
)
def test_heat_and_cool(house, kind, device, wrong):
    _, s = room(house, kind=kind, obj="apple", target="drawer 1")
    s, *_ = do(
        house,
        s,
        "go to countertop 1",
        "take apple 1 from countertop 1",
        "go to " + device,
        f"{kind} apple 1 with {device}",
    )
    other = "fridge 1" if device == "microwave 1" else "microwave 1"
    # undoes it
    s, _, reward, done, _ = do(
        house,
        s,
        "go to " + other,
        f"{wrong} apple 1 with {other}",
        "go to drawer 1",
        "open drawer 1",
        "put apple 1 in/on drawer 1",
    )
    assert (reward, done) == (0.0, False)
    s, _, reward, done, _ = do(
        house,
        s,
        "take apple 1 from drawer 1",
        "go to " + device,
        f"{kind} apple 1 with {device}",
        "go to drawer 1",
        "put apple 1 in/on drawer 1",
    )
    assert (reward, done) == (1.0, True)


def test_examine_needs_lamp_object_and_place(house):
    _, s = room(house, kind="examine", obj="book", target="desklamp 1")
    s, _, reward, done, _ = do(
        house, s, "go to desklamp 1", "use desklamp 1", "go to shelf 1", "take book 3 from shelf 1"
    )
    assert (reward, done) == (0.0, False)  # lamp on and book in hand, but not at the lamp
    s, _, reward, done, _ = do(house, s, "go to desklamp 1")
    assert (reward, done) == (1.0, True)


def test_two_objects_need_both(house):
    objects = (("pen 1", "drawer 1"), ("pen 3", "countertop 1"), ("cup 2", "countertop 1"))
    _, s = room(house, kind="two_object", obj="pen", count=2, target="shelf 1", objects=objects)
    assert s.task.prompt.startswith("Task: put two pens on shelf 1.\n")
    s, _, reward, done, _ = do(
        house,
        s,
        "go to countertop 1",
        "take pen 3 from countertop 1",
        "go to shelf 1",
        "put pen 3 in/on shelf 1",
        "go to countertop 1",
        "take cup 2 from countertop 1",
        "go to shelf 1",
        "put cup 2 in/on shelf 1",
    )
    assert (reward, done) == (0.0, False)  # one pen and a cup are not two pens
    s, _, reward, done, _ = do(
        house,
        s,
        "go to drawer 1",
        "open drawer 1",
        "take pen 1 from drawer 1",
        "go to shelf 1",
        "put pen 1 in/on shelf 1",
    )
    assert (reward, done) == (1.0, True)


@pytest.mark.parametrize(
    "answer,reward", [("success", 1.0), ("Success", 0.0), ("", 0.0), (None, 0.0)]
)
def test_score(house, answer, reward):
    task, _ = room(house)
    assert house.score(task, answer) == reward


# -----------------------------------------------------------------------------
# Invalid input is an observation


@pytest.mark.parametrize(
    "command",
    [
        "go to drawer 9",
        "open the drawer",
        "take mug 2 from drawer 1",
        "",
        "dance",
        "put mug 2 on shelf 1",
    ],
)
def test_invalid_commands_are_observations(house, command):
    _, s0 = room(house)
    s, text, reward, done, info = do(house, s0, command)
    assert text == f"Nothing happens.\nAdmissible: look, inventory; {GO_ALL}"
    assert (reward, done, info["tool_errors"], s.tool_errors) == (0.0, False, 0, 0)
    assert replace_counters(s) == replace_counters(s0) and (s.invalid_actions, s.steps) == (1, 1)
    assert info["metrics"] == {
        "success": 0.0,
        "invalid_actions": 1.0,
        "steps": 1.0,
        "subgoals": 0.0,
    }


def replace_counters(state):
    """The world part of a state: everything but the counters a step updates."""
    return replace(state, turn=0, tool_calls=0, invalid_actions=0, steps=0)


def test_case_and_spacing_are_forgiven(house):
    _, s = room(house)
    s, text, *_ = do(house, s, "  Go To   DRAWER 1 ")
    assert text.startswith("You arrive at drawer 1.") and s.invalid_actions == 0


def test_text_without_tool_call_is_invalid_not_final(house):
    _, s = room(house)
    s, obs, reward, done, info = house.step(s, Action("go to drawer 1"))
    assert (reward, done, s.invalid_actions) == (0.0, False, 1)
    assert obs[0]["role"] == "tool" and obs[0]["content"].startswith(
        "Nothing happens. Use house_act.\nAdmissible: "
    )


def test_restate_goal_ends_every_observation_but_the_last_with_the_task():
    goals = make_env("alfworld_lite", restate_goal=True)
    task, s = room(goals)
    assert task.prompt == room(make_env("alfworld_lite"))[0].prompt  # the prompt states it already
    s, text, *_ = do(goals, s, "go to drawer 1")
    assert text == (
        "You arrive at drawer 1. It is closed.\nAdmissible: open drawer 1, look, inventory; go to: "
        "shelf 1, countertop 1, fridge 1, microwave 1, sinkbasin 1, desklamp 1\n"
        "Task: put a clean mug on shelf 1."
    )
    s, text, *_ = do(goals, s, "fly away")
    assert text.startswith("Nothing happens.\n") and text.endswith(
        "\nTask: put a clean mug on shelf 1."
    )
    s, obs, *_ = goals.step(s, Action("I give up."))
    assert obs[0]["content"].endswith("\nTask: put a clean mug on shelf 1.")
    s, text, reward, done, _ = do(
        goals,
        s,
        "open drawer 1",
        "take mug 2 from drawer 1",
        "go to sinkbasin 1",
        "clean mug 2 with sinkbasin 1",
        "go to shelf 1",
        "put mug 2 in/on shelf 1",
    )
    assert (reward, done) == (1.0, True) and goals.with_goal(
        s, "You put mug 2 in/on shelf 1."
    ) == "You put mug 2 in/on shelf 1."


def test_bad_tool_calls_are_tool_errors(house):
    _, s = room(house)
    s, obs, reward, done, info = house.step(
        s, Action("", (ToolCall("finish", {"answer": "success"}),))
    )
    assert (done, info["tool_errors"]) == (False, 1) and "unknown tool" in obs[0]["content"]
    s, obs, reward, done, info = house.step(
        s, Action("", (ToolCall("house_act", {"cmd": "look"}),))
    )
    assert (done, info["tool_errors"]) == (False, 1) and "bad arguments" in obs[0]["content"]
    assert s.invalid_actions == 0  # the world never saw these


def test_several_commands_in_one_turn_stop_at_the_goal(house):
    _, s = room(house, kind="pick_and_place", obj="apple", target="shelf 1")
    calls = tuple(
        ToolCall("house_act", {"command": c})
        for c in (
            "go to countertop 1",
            "take apple 1 from countertop 1",
            "go to shelf 1",
            "put apple 1 in/on shelf 1",
            "look",
        )
    )
    s, obs, reward, done, info = house.step(s, Action("", calls))
    assert (reward, done, len(obs), s.steps, s.turn) == (1.0, True, 3, 4, 1)  # "look" never ran


# -----------------------------------------------------------------------------
# Step limits, determinism, split


def test_step_limit_ends_with_zero_reward(house):
    task = house.sample_tasks("test", 1, seed=3)[0]
    need = sum(m["role"] == "assistant" for m in house.demonstration(task, random.Random(0), True))
    (short,) = play_scripted(house, [task], "expert", seed=0, max_turns=need - 1)
    (enough,) = play_scripted(house, [task], "expert", seed=0, max_turns=need)
    assert (short["reward"], short["done"], short["turns"]) == (0.0, False, need - 1)
    # counts of a cut
    assert short["metrics"] == {
        "success": 0.0,
        "invalid_actions": 0.0,
        "steps": need - 1.0,
        "subgoals": short["metrics"]["subgoals"],
    }  # episode
    assert short["metrics"]["subgoals"] >= 1  # the expert holds the object before its last command
    assert (enough["reward"], enough["done"]) == (1.0, True)


def test_tasks_are_deterministic_distinct_and_json(house, tmp_path):
    a, b = house.sample_tasks("train", 60, seed=7), house.sample_tasks("train", 60, seed=7)
    assert a == b and len({t.id for t in a}) == 60
    assert {t.id for t in house.sample_tasks("train", 60, seed=8)} != {t.id for t in a}
    write_tasks(a, tmp_path / "tasks.jsonl")
    again = read_tasks(tmp_path / "tasks.jsonl")
    assert [t.id for t in again] == [t.id for t in a]
    assert house.demonstration(again[0], random.Random(1), False) == house.demonstration(
        a[0], random.Random(1), False
    )
    assert json.loads(json.dumps(a[0].meta)) == a[0].meta


def test_train_and_test_never_overlap_and_cover_every_kind(house):
    train, test = house.sample_tasks("train", 300, seed=0), house.sample_tasks("test", 300, seed=0)
    triple = lambda t: (t.meta["kind"], t.meta["obj"], alf.type_of(t.meta["target"]))  # noqa: E731
    assert not {triple(t) for t in train} & {triple(t) for t in test}
    assert {t.meta["kind"] for t in train} == {t.meta["kind"] for t in test} == set(alf.KINDS)
    for t in train + test:  # objects to move never start in the goal receptacle
        assert all(
            p != t.meta["target"] for o, p in t.meta["objects"] if alf.type_of(o) == t.meta["obj"]
        )


def test_kinds_and_sizes_are_knobs():
    small = make_env("alfworld_lite", kinds=["examine"], min_storage=2, max_storage=2)
    for t in small.sample_tasks("train", 20, seed=0):
        assert t.meta["kind"] == "examine" and len(t.meta["places"]) == 2 + 4
    with pytest.raises(ValueError, match="unknown kinds"):
        make_env("alfworld_lite", kinds=["juggle"])
    with pytest.raises(ValueError, match="min_storage"):
        make_env("alfworld_lite", min_storage=1)


# -----------------------------------------------------------------------------
# Demonstrations, expert and random policies


@pytest.mark.parametrize("use_tools", [True, False])
def test_demonstrations_replay_to_reward_one(house, use_tools):
    rng = random.Random(0)
    for task in house.sample_tasks("train", 40, seed=5):
        demo = house.demonstration(task, rng, use_tools)
        state, messages = house.reset(task, seed=0)
        assert demo[:2] == messages and demo[-1]["role"] == "assistant"
        seen = []
        for m in demo[2:]:
            if m["role"] == "assistant":
                calls = tuple(
                    ToolCall(c["function"]["name"], c["function"]["arguments"])
                    for c in m["tool_calls"]
                )
                state, obs, reward, done, info = house.step(state, Action("", calls))
                seen += obs
        assert seen == [m for m in demo[2:] if m["role"] == "tool"]
        assert (reward, done, state.invalid_actions) == (1.0, True, 0)
        assert all(len(m["content"]) < 300 for m in seen)  # observations stay short


def test_weaker_demonstration_is_longer_on_average(house):
    tasks, rng = house.sample_tasks("train", 150, seed=2), random.Random(0)
    turns = {u: sum(len(house.demonstration(t, rng, u)) for t in tasks) for u in (True, False)}
    assert turns[False] > turns[True]


def test_expert_and_random_through_play_scripted(house):
    max_turns = load_config("configs/alfworld_lite.yaml").rollout.agent.max_turns
    tasks = house.sample_tasks("test", 120, seed=1234)
    expert = scripted_metrics(
        play_scripted(house, tasks, "expert", seed=0, max_turns=max_turns), "e"
    )
    rand = scripted_metrics(play_scripted(house, tasks, "random", seed=0, max_turns=max_turns), "r")
    assert expert["e/accuracy"] >= 0.95 and expert["e/success"] == pytest.approx(
        expert["e/accuracy"]
    )
    assert expert["e/invalid_actions"] == 0.0 and expert["e/mean_turns"] <= alf.MAX_EXPERT_TURNS
    assert rand["r/accuracy"] <= 0.1 and rand["r/invalid_actions"] > 0.0


def test_tool_is_registered_with_a_short_schema(house):
    schema = house.tools()
    assert [s["function"]["name"] for s in schema] == ["house_act"] and TOOLS["house_act"].bounded
    assert schema[0]["function"]["parameters"]["required"] == ["command"]
    assert len(schema[0]["function"]["description"]) <= 60


class ReplayEngine:
    """An engine that answers every prompt with the expert's next assistant turn for its task."""

    def __init__(self, tok, house, tasks):
        self.tok = tok
        self.turns = {
            t.prompt: [
                "<tool_call>\n" + json.dumps(m["tool_calls"][0]["function"]) + "\n</tool_call>"
                for m in house.demonstration(t, random.Random(0), True)
                if m["role"] == "assistant"
            ]
            for t in tasks
        }

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            text = self.tok.decode(p, skip_special_tokens=False)
            turns = next(v for k, v in self.turns.items() if k in text)
            reply = (
                turns[min(text.count("<|im_start|>assistant") - 1, len(turns) - 1)] + "<|im_end|>"
            )
            ids = self.tok.encode(reply, add_special_tokens=False).ids
            out.append(rollout.Generation(ids, [0.0] * len(ids), "stop"))
        return out


def test_expert_through_the_agent_loop():
    """The same loop as training (agent.run_episodes), with a BPE tokenizer trained like sft.py's,
    in the configured world and budgets."""
    from sft import train_tokenizer

    full = load_config("configs/alfworld_lite.yaml")
    cfg, house = full.rollout, make_env("alfworld_lite", **full.envs[0].kwargs)
    rng = random.Random(0)
    tok = train_tokenizer(
        [
            chat.render(house.demonstration(t, rng, True), house.tools())
            for t in house.sample_tasks("train", 100, seed=0)
        ],
        1024,
    )
    tasks = house.sample_tasks("test", 8, seed=0)
    params = rollout.SamplingParams(max_tokens=cfg.max_tokens)
    engine = ReplayEngine(tok, house, tasks)
    trajs = agent.run_episodes(
        engine,
        {"alfworld_lite": house},
        tasks,
        tok,
        replace(cfg.agent, n_samples=1),
        params,
        seed=0,
    )
    for t in trajs:
        assert (t.reward, t.done, t.finish_reason, t.tool_errors, t.parse_failures) == (
            1.0,
            True,
            "done",
            0,
            0,
        )
        # (a turn cut by rollout.max_tokens would not parse: every expert turn fits)
        assert (
            t.info["metrics"]["success"] == 1.0 and len(t.token_ids) <= cfg.agent.max_total_tokens
        )
    cut = agent.run_episodes(
        engine,
        {"alfworld_lite": house},
        tasks[:2],
        tok,
        replace(cfg.agent, n_samples=1, max_turns=2),
        params,
        seed=0,
    )
    assert [(t.reward, t.finish_reason, t.info["metrics"]["steps"]) for t in cut] == [
        (0.0, "max_turns", 2.0)
    ] * 2


def test_subgoal_reward_pays_each_subgoal_once_and_names_the_state(house):
    """subgoal_reward: an object of the goal's type in hand, then processed as the goal needs, each
    paid the first time only (putting it down and taking it again pays nothing); the goal still pays
    1.0. Without it every reward is as before. info["state_key"] is the world's state: equal after a
    command that changes nothing."""
    commands = [
        "go to drawer 1",
        "open drawer 1",
        "take mug 2 from drawer 1",
        "go to shelf 1",
        "put mug 2 in/on shelf 1",
        "take mug 2 from shelf 1",
        "go to sinkbasin 1",
        "clean mug 2 with sinkbasin 1",
        "go to shelf 1",
        "put mug 2 in/on shelf 1",
    ]
    for env, paid in ((make_env("alfworld_lite", subgoal_reward=0.1), 0.1), (house, 0.0)):
        _, s = room(env)
        rewards, keys = [], []
        for c in commands:
            s, _, reward, done, info = do(env, s, c)
            rewards.append(reward)
            keys.append(info["state_key"])
        assert rewards == [0.0, 0.0, paid, 0.0, 0.0, 0.0, 0.0, paid, 0.0, 1.0] and done
        assert info["metrics"]["subgoals"] == 2.0
        # taking the mug back from shelf 1: the state after "go to shelf 1"
        assert keys[5] == keys[3]
        assert len(set(keys)) == len(keys) - 1  # every other command changed the world
    _, s = room(house)
    s, _, _, _, info = do(house, s, "go to drawer 1")
    assert (
        do(house, s, "look")[4]["state_key"]
        == do(house, s, "inventory")[4]["state_key"]
        == info["state_key"]
    )
    assert do(house, s, "open drawer 1")[4]["state_key"] != info["state_key"]
