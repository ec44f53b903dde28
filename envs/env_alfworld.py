"""env_alfworld.py: "alfworld_lite", a small text household in the spirit of ALFWorld (Shridhar et
al., 2021, arXiv:2010.03768), as a pure-Python world the agent plays through one tool,
house_act(command).

The world. One room: 3-5 storage receptacles (cabinets and drawers that open and close, countertops,
shelves, desks, sidetables) and four fixed places: fridge 1, microwave 1 (both start closed),
sinkbasin 1 and desklamp 1. 3-5 objects lie in the storage receptacles, some of them closed. The
agent stands at one place at a time and holds at most one object. Commands, as in ALFWorld:
    go to P | open R | close R | take O from R | put O in/on R | clean O with sinkbasin 1 |
    heat O with microwave 1 | cool O with fridge 1 | use desklamp 1 | examine O | look | inventory
Every observation is what happened plus the admissible commands, listed compactly as
"Admissible: <commands here>; go to: <places>". Anything else (not admissible, misspelled, plain
text without a tool call) is the observation "Nothing happens." and counts as an invalid action.
With restate_goal=True every observation also ends with the task line ("Task: put a cool tomato on
sidetable 1."), as some agent harnesses repeat the goal: a small model then need not find it ~500
tokens back, which it otherwise does poorly, replacing a held-out goal with one it trained on.

Six task types: pick_and_place ("put an apple in fridge 1"), clean ("put a clean mug on shelf 1":
clean it at the sink first), heat (microwave), cool (fridge), examine ("look at the book under
desklamp 1": hold it at the lamp with the lamp on) and two_object ("put two pencils in drawer 1").

Reward: 1.0 as soon as the goal holds after a command (the tool ends the episode with answer
"success", which `score` turns into 1.0); 0.0 when the agent loop's max_turns runs out first. With
subgoal_reward > 0 the sub-goals pay on the way, each once: an object of the goal's type in hand,
then (clean, heat, cool, examine) processed as the goal needs (subgoals_reached): intermediate
rewards for algo.credit=turn. info["metrics"] holds "success", "invalid_actions", "steps" (commands
tried) and "subgoals" (0-2) after every step, so an episode that max_turns cuts off still reports
its counts (the agent keeps the last info); info["state_key"] names the world's state (state_text)
for GiGPO's state baseline, since the observations ("Nothing happens.") do not.

Generation. A scene (layout, open/closed, object placement, goal) is drawn from random.Random(seed)
and stored in Task.meta as JSON; reset rebuilds the world from it. Objects to move never start in
the goal receptacle; scenes whose expert needs more than MAX_EXPERT_TURNS commands are drawn again.
Split: held-out combinations. The (task type, object type, goal receptacle type) triple decides the
split by a stable hash (TEST_PERCENT of triples are "test"), so a held-out task asks for a
combination never seen in training (e.g. a hot egg on a desk), made of words that are; each kind is
in both splits.

Expert. A planner over the true scene that searches like a careful person: it visits the storage
receptacles in the order the room lists them (skipping the goal receptacle), opens closed ones,
takes the object as soon as it sees it, processes it (sink, microwave, fridge or lamp) and puts it
in place; two_object fetches the second object the same way. 4 to 12 commands, 7.3 on average; ~400
tokens per episode with the BPE tokenizer sft.py trains on these demonstrations (~650 at 12
commands). The weaker path (demonstration with use_tools=False) searches every storage receptacle,
the goal's included, in a random order, and closes again each one it opened for nothing: it succeeds
too, in ~0.75 more commands on average (up to ~18), and its order is no rule a policy can read from
the observations, so RL has a systematic search to find.
Imports: tools.py, env.py, envs/worlds.py (and the standard library).
"""

import hashlib
import json
import random
from dataclasses import dataclass, replace

from env import (
    Action,
    Env,
    EnvState,
    Task,
    ToolCall,
    register_env,
    sample_distinct,
    split_of,
    tool_message,
)
from envs.worlds import replay_commands
from tools import tool

# -----------------------------------------------------------------------------
# The vocabulary of the world

STORAGE_TYPES = ("cabinet", "drawer", "countertop", "shelf", "desk", "sidetable")
OPENABLE = ("cabinet", "drawer", "fridge", "microwave")  # receptacles that open and close
# "in" in goal text; the rest are "on"
IN_TYPES = ("cabinet", "drawer", "fridge", "microwave", "sinkbasin")
# in every room, listed after storage
DEVICES = ("fridge 1", "microwave 1", "sinkbasin 1", "desklamp 1")
PROCESS = {
    "clean": ("clean", "sinkbasin 1"),
    "heat": ("heat", "microwave 1"),
    "cool": ("cool", "fridge 1"),
}
DEVICE_VERB = {device: verb for verb, device in PROCESS.values()}  # "sinkbasin 1" -> "clean"
MAX_PER_TYPE = 2  # at most drawer 1 and drawer 2
CLOSED_PROB = 0.6  # chance that a cabinet or drawer starts closed
MAX_EXPERT_TURNS = 12  # scenes whose expert needs more commands are drawn again
# share of (kind, object, receptacle type) triples held out; fixed for every config
TEST_PERCENT = 20
SUCCESS = "success"  # the answer house_act records when the goal holds

FOOD = ("apple", "bread", "egg", "lettuce", "potato", "tomato")
WARE = ("bowl", "cup", "knife", "mug", "plate", "spoon")
SMALL = ("book", "cd", "creditcard", "keychain", "pen", "pencil", "vase", "watch")
# the object types each task type asks for (as in ALFWorld: you heat a mug, not a book)
KIND_OBJECTS = {
    "pick_and_place": FOOD + WARE + SMALL,
    "clean": ("apple", "lettuce", "potato", "tomato") + WARE,
    "heat": ("apple", "bread", "egg", "potato", "tomato", "cup", "mug", "plate"),
    "cool": FOOD + ("bowl", "cup", "mug", "plate"),
    "examine": SMALL,
    "two_object": (
        "apple",
        "egg",
        "potato",
        "cup",
        "mug",
        "plate",
        "spoon",
        "book",
        "cd",
        "keychain",
        "pen",
        "pencil",
    ),
}
KINDS = tuple(KIND_OBJECTS)


def type_of(name: str) -> str:
    """'drawer 2' -> 'drawer' (every place and object is '<type> <number>')."""
    return name.rsplit(" ", 1)[0]


# -----------------------------------------------------------------------------
# Scene (fixed for a task) and state (changed by every command)


@dataclass(frozen=True)
class Scene:
    """The static part of a task, stored as JSON in Task.meta."""

    kind: str  # task type, one of KINDS
    obj: str  # the object type the goal asks for, e.g. "mug"
    count: int  # how many of them (2 for two_object, else 1)
    target: str  # goal receptacle ("desklamp 1" for examine)
    places: tuple[str, ...]  # every place, in the order the room lists them (storage first)
    closed: tuple[str, ...]  # openable receptacles that start closed
    objects: tuple[tuple[str, str], ...]  # (object, receptacle it starts in), in listing order

    def to_meta(self) -> dict:
        return {
            "kind": self.kind,
            "obj": self.obj,
            "count": self.count,
            "target": self.target,
            "places": list(self.places),
            "closed": list(self.closed),
            "objects": [list(p) for p in self.objects],
        }

    @staticmethod
    def from_meta(meta: dict) -> "Scene":
        return Scene(
            meta["kind"],
            meta["obj"],
            meta["count"],
            meta["target"],
            tuple(meta["places"]),
            tuple(meta["closed"]),
            tuple((o, p) for o, p in meta["objects"]),
        )


@dataclass(frozen=True)
class HouseState(EnvState):
    """One episode of the household; every command returns a new one (dataclasses.replace)."""

    # the task's layout and goal, parsed once from Task.meta (the default only because EnvState's
    # fields have defaults)
    scene: Scene | None = None
    location: str = ""  # the place the agent stands at ("" = middle of the room)
    opened: frozenset[str] = frozenset()  # openable receptacles that are open now
    where: tuple[tuple[str, str], ...] = ()  # (object, receptacle) for every object; "" while held
    holding: str = ""  # the object in hand ("" = none)
    clean: frozenset[str] = frozenset()  # objects washed at the sink
    hot: frozenset[str] = frozenset()  # objects heated in the microwave (heating ends cold)
    cold: frozenset[str] = frozenset()  # objects cooled in the fridge (cooling ends hot)
    lamp_on: bool = False  # desklamp 1 has been switched on
    invalid_actions: int = 0  # commands that were not admissible (and text-only turns)
    steps: int = 0  # commands tried, valid or not (and text-only turns)
    subgoals: int = 0  # sub-goals reached so far (subgoal_reward pays each once)


def initial_state(task: Task) -> HouseState:
    scene = Scene.from_meta(task.meta)
    opened = frozenset(p for p in scene.places if type_of(p) in OPENABLE and p not in scene.closed)
    return HouseState(task=task, scene=scene, opened=opened, where=scene.objects)


# -----------------------------------------------------------------------------
# The rules: admissible commands, their effects, the goal


def is_open(state: HouseState, place: str) -> bool:
    return type_of(place) not in OPENABLE or place in state.opened


def contents(state: HouseState, place: str) -> list[str]:
    return [o for o, p in state.where if p == place]


def admissible(state: HouseState) -> list[str]:
    """Every command that does something now: those at the current place first, then look,
    inventory, then "go to" every other place. Nothing else is accepted."""
    here, held, commands = state.location, state.holding, []
    if here:
        kind = type_of(here)
        if kind in OPENABLE:
            commands.append(("close " if here in state.opened else "open ") + here)
        if is_open(state, here) and kind != "desklamp":
            if held:
                commands.append(f"put {held} in/on {here}")
            else:
                commands += [f"take {o} from {here}" for o in contents(state, here)]
        if held and here in DEVICE_VERB:
            commands.append(f"{DEVICE_VERB[here]} {held} with {here}")
        if kind == "desklamp":
            commands.append(f"use {here}")
    if held:
        commands.append(f"examine {held}")
    return (
        commands + ["look", "inventory"] + [f"go to {p}" for p in state.scene.places if p != here]
    )


def show_admissible(state: HouseState) -> str:
    """'Admissible: open drawer 2, look, inventory; go to: shelf 1, fridge 1' (the go-to
    list compact)."""
    commands = admissible(state)
    local = [c for c in commands if not c.startswith("go to ")]
    return (
        f"Admissible: {', '.join(local)}; go to: "
        f"{', '.join(c[6:] for c in commands if c.startswith('go to '))}"
    )


def describe(state: HouseState, place: str) -> str:
    """What one sees at a place: closed, the lamp, or its contents."""
    if not is_open(state, place):
        return "It is closed."
    if type_of(place) == "desklamp":
        return f"It is {'on' if state.lamp_on else 'off'}."
    things = contents(state, place)
    return f"You see: {', '.join(things)}." if things else "It is empty."


def apply(state: HouseState, command: str) -> tuple[HouseState, str]:
    """The effect of an admissible command -> (new state, what happened). Names are '<type> <n>', so
    the words of a command sit at fixed positions: 'take apple 1 from drawer 2'."""
    w = command.split()
    if command.startswith("go to "):
        place = " ".join(w[2:])
        state = replace(state, location=place)
        return state, f"You arrive at {place}. {describe(state, place)}"
    if w[0] in ("open", "close"):
        place = " ".join(w[1:])
        if w[0] == "close":
            return replace(state, opened=state.opened - {place}), f"You close {place}."
        state = replace(state, opened=state.opened | {place})
        return state, f"You open {place}. {describe(state, place)}"
    if w[0] == "take":
        obj, place = " ".join(w[1:3]), " ".join(w[4:6])
        where = tuple((o, "" if o == obj else p) for o, p in state.where)
        return replace(state, holding=obj, where=where), f"You take {obj} from {place}."
    if w[0] == "put":
        obj, place = " ".join(w[1:3]), " ".join(w[4:6])
        where = tuple((o, place if o == obj else p) for o, p in state.where)
        return replace(state, holding="", where=where), f"You put {obj} in/on {place}."
    if w[0] in ("clean", "heat", "cool"):
        obj, place = " ".join(w[1:3]), " ".join(w[4:6])
        if w[0] == "clean":
            state = replace(state, clean=state.clean | {obj})
        elif w[0] == "heat":
            state = replace(state, hot=state.hot | {obj}, cold=state.cold - {obj})
        else:
            state = replace(state, cold=state.cold | {obj}, hot=state.hot - {obj})
        return state, f"You {w[0]} {obj} with {place}."
    if w[0] == "use":
        return replace(state, lamp_on=True), f"You turn on {' '.join(w[1:])}."
    if w[0] == "examine":
        obj = " ".join(w[1:])
        props = [
            name
            for name, s in (("clean", state.clean), ("hot", state.hot), ("cold", state.cold))
            if obj in s
        ]
        return state, f"{obj} is {' and '.join(props)}." if props else f"{obj} looks ordinary."
    if command == "inventory":
        return state, f"You carry {state.holding}." if state.holding else "You carry nothing."
    if command == "look":
        here = state.location
        return (
            state,
            f"You are at {here}. {describe(state, here)}"
            if here
            else "You are in the middle of the room.",
        )
    # admissible() and apply() disagree
    raise ValueError(f"not a command of this world: {command!r}")


def goal_met(state: HouseState) -> bool:
    """Whether the task's goal holds in this state."""
    scene = state.scene
    if scene.kind == "examine":
        return (
            state.lamp_on
            and state.location == scene.target
            and bool(state.holding)
            and type_of(state.holding) == scene.obj
        )
    needed = {"clean": state.clean, "heat": state.hot, "cool": state.cold}.get(scene.kind)
    placed = [
        o
        for o, p in state.where
        if p == scene.target and type_of(o) == scene.obj and (needed is None or o in needed)
    ]
    return len(placed) >= scene.count


def subgoals_reached(state: HouseState) -> int:
    """How far toward the goal the episode has come, 0-2: 1 once an object of the goal's type is in
    hand (or placed at the target), 2 once one is also processed as the goal needs (clean, hot,
    cold; examine: the lamp is on while holding one). pick_and_place and two_object have only
    the first."""
    scene = state.scene
    mine = [o for o, _ in state.where if type_of(o) == scene.obj]
    reached = int(any(o == state.holding or p == scene.target for o, p in state.where if o in mine))
    needed = {"clean": state.clean, "heat": state.hot, "cool": state.cold}.get(scene.kind)
    if needed is not None:
        reached += int(any(o in needed for o in mine))
    elif scene.kind == "examine":
        reached += int(
            state.lamp_on and bool(state.holding) and type_of(state.holding) == scene.obj
        )
    return reached


def state_text(state: HouseState) -> str:
    """The world as it is (where the agent stands, what it holds, what is open, where everything is,
    what was processed), without the counters: equal texts are the same state (info["state_key"],
    GiGPO's anchor states)."""
    return (
        f"{state.location}|{state.holding}|{sorted(state.opened)}|{state.where}|{sorted(state.clean)}|"
        f"{sorted(state.hot)}|{sorted(state.cold)}|{state.lamp_on}"
    )


def act(state: HouseState, command: str) -> tuple[HouseState, str]:
    """One command (case and spacing are forgiven, nothing else) -> (state, observation). Ends the
    episode with answer SUCCESS when the goal holds afterwards."""
    command = " ".join(str(command).lower().split())
    if command not in admissible(state):
        state = replace(state, invalid_actions=state.invalid_actions + 1, steps=state.steps + 1)
        return state, f"Nothing happens.\n{show_admissible(state)}"
    state, text = apply(state, command)
    state = replace(state, steps=state.steps + 1)
    if goal_met(state):
        return replace(state, done=True, answer=SUCCESS), text
    return state, f"{text}\n{show_admissible(state)}"


@tool(
    "house_act",
    "Do one admissible command.",
    {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    bounded=True,
)
def house_act(env, state, command):
    """Play `command` in the household (act); never an error kind: a bad command is
    an observation."""
    new_state, text = act(state, command)
    return new_state, env.with_goal(new_state, text), None


# -----------------------------------------------------------------------------
# Task generation and the split


def goal_text(scene: Scene) -> str:
    """'put a clean mug on shelf 1', 'look at the book under desklamp 1', 'put two pencils in
    drawer 1'."""
    if scene.kind == "examine":
        return f"look at the {scene.obj} under {scene.target}"
    prep = "in" if type_of(scene.target) in IN_TYPES else "on"
    if scene.kind == "two_object":
        return f"put two {scene.obj}s {prep} {scene.target}"
    adjective = {"clean": "clean ", "heat": "hot ", "cool": "cool "}.get(scene.kind, "")
    article = "an" if (adjective or scene.obj)[0] in "aeiou" else "a"
    return f"put {article} {adjective}{scene.obj} {prep} {scene.target}"


def draw_scene(rng: random.Random, kind: str, min_storage: int, max_storage: int) -> Scene:
    """A random room and goal of task type `kind` (the caller checks the split and the
    expert's length)."""
    storage, counts, size = [], {}, rng.randint(min_storage, max_storage)
    while len(storage) < size:
        rtype = rng.choice(STORAGE_TYPES)
        if counts.get(rtype, 0) < MAX_PER_TYPE:
            counts[rtype] = counts.get(rtype, 0) + 1
            storage.append(f"{rtype} {counts[rtype]}")
    rng.shuffle(storage)
    closed = [p for p in storage if type_of(p) in OPENABLE and rng.random() < CLOSED_PROB] + [
        "fridge 1",
        "microwave 1",
    ]
    obj = rng.choice(KIND_OBJECTS[kind])
    targets = list(storage) + (
        ["fridge 1"] if kind == "pick_and_place" and obj not in SMALL else []
    )
    target = "desklamp 1" if kind == "examine" else rng.choice(targets)
    count = 2 if kind == "two_object" else 1
    sources = [p for p in storage if p != target]
    objects = [(f"{obj} {n}", rng.choice(sources)) for n in sorted(rng.sample(range(1, 4), count))]
    others = [t for t in FOOD + WARE + SMALL if t != obj]
    objects += [
        (f"{t} {rng.randint(1, 3)}", rng.choice(storage))
        for t in rng.sample(others, rng.randint(2, 3))
    ]
    rng.shuffle(objects)
    return Scene(kind, obj, count, target, tuple(storage) + DEVICES, tuple(closed), tuple(objects))


# -----------------------------------------------------------------------------
# The expert


def search_order(scene: Scene) -> list[str]:
    """Where the expert looks, in order: the storage receptacles as listed, minus the goal
    receptacle (objects to move never start there)."""
    return [p for p in scene.places if p not in DEVICES and p != scene.target]


def expert_plan(scene: Scene, order: list[str], tidy: bool) -> list[str]:
    """The commands that solve `scene` when searching the receptacles in `order`. It reads the true
    placement, but acts only on what it has seen: it stops at the first receptacle showing the
    object.
    tidy: close every receptacle it opened that held nothing it needed (the weaker
    demonstration)."""
    start = dict(scene.objects)
    wanted = [o for o, _ in scene.objects if type_of(o) == scene.obj]
    closed, here, commands, delivered = set(scene.closed), "", [], 0

    def go(place):
        nonlocal here
        if here != place:
            commands.append(f"go to {place}")
            here = place

    def deliver(obj, source):
        go(source)
        commands.append(f"take {obj} from {source}")
        if scene.kind in PROCESS:
            verb, device = PROCESS[scene.kind]
            go(device)
            commands.append(f"{verb} {obj} with {device}")
        go(scene.target)
        if scene.kind == "examine":
            commands.append(f"use {scene.target}")
            return
        if scene.target in closed:
            commands.append(f"open {scene.target}")
            closed.discard(scene.target)
        commands.append(f"put {obj} in/on {scene.target}")

    for place in order:
        go(place)
        opened_now = place in closed
        if opened_now:
            commands.append(f"open {place}")
            closed.discard(place)
        found = [o for o in wanted if start[o] == place][: scene.count - delivered]
        if not found and tidy and opened_now:
            commands.append(f"close {place}")
            closed.add(place)
        for obj in found:
            deliver(obj, place)
            delivered += 1
        if delivered == scene.count:
            return commands
    raise RuntimeError(f"the expert found only {delivered} of {scene.count} {scene.obj} in {order}")


# -----------------------------------------------------------------------------
# The env


@register_env("alfworld_lite")
class AlfworldLiteEnv(Env):
    """A text household (see the module docstring); one tool, house_act; reward 1.0 when the
    goal holds."""

    tool_names = ("house_act",)

    def __init__(
        self,
        kinds: tuple[str, ...] = KINDS,
        min_storage: int = 3,
        max_storage: int = 5,
        restate_goal: bool = False,
        subgoal_reward: float = 0.0,
        tool_timeout: float = 2.0,
    ):
        unknown = [k for k in kinds if k not in KIND_OBJECTS]
        if unknown or not kinds:
            raise ValueError(f"unknown kinds {unknown}; choose from {list(KINDS)}")
        if not 2 <= min_storage <= max_storage <= MAX_PER_TYPE * len(STORAGE_TYPES):
            raise ValueError(
                f"need 2 <= min_storage <= max_storage <= {MAX_PER_TYPE * len(STORAGE_TYPES)}"
            )
        self.kinds = tuple(kinds)  # task types to draw from, uniformly
        self.min_storage = min_storage  # storage receptacles per room, at least ...
        self.max_storage = max_storage  # ... and at most (more means longer searches)
        # end every observation with the task line (the prompt's first line)
        self.restate_goal = restate_goal
        # paid once per sub-goal reached (subgoals_reached), on top of the goal's 1.0: intermediate
        # rewards, for algo.credit=turn
        self.subgoal_reward = subgoal_reward
        self.tool_timeout = tool_timeout  # seconds per tool call (house_act returns at once)

    def system_prompt(self) -> str:
        return "You are in a house. Do the task with house_act, one admissible command per turn."

    def make_task(self, scene: Scene) -> Task:
        meta = scene.to_meta()
        digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()
        task = Task(
            env=self.name, id=f"{self.name}/{digest[:16]}", prompt="", answer=SUCCESS, meta=meta
        )
        # the prompt is the goal and the first observation, rendered by the same code as every
        # other one
        prompt = (
            f"Task: {goal_text(scene)}.\nYou are in the middle of the room.\n"
            f"{show_admissible(initial_state(task))}"
        )
        return replace(task, prompt=prompt)

    def with_goal(self, state: HouseState, text: str) -> str:
        """restate_goal: the observation, then "Task: ...", so the goal sits next to the admissible
        commands the agent picks from (a small model loses it ~500 tokens back; a held-out goal then
        turns into one it saw in training). Nothing is added to the observation that ends
        the episode."""
        return (
            f"{text}\nTask: {goal_text(state.scene)}."
            if self.restate_goal and not state.done
            else text
        )

    def sample_tasks(self, split: str, n: int, seed: int) -> list[Task]:
        """n distinct tasks of `split`, the same for the same (seed, constructor arguments). The
        split is a stable hash of the (kind, object type, receptacle type) triple; the kind is drawn
        first, once per task."""

        def draw(rng: random.Random, kind: str) -> Task | None:
            scene = draw_scene(rng, kind, self.min_storage, self.max_storage)
            if split_of(f"{kind}/{scene.obj}/{type_of(scene.target)}", TEST_PERCENT) != split:
                return None
            if len(expert_plan(scene, search_order(scene), tidy=False)) > MAX_EXPERT_TURNS:
                return None
            return self.make_task(scene)

        return sample_distinct(
            draw,
            split,
            n,
            seed,
            f" for kinds {self.kinds}",
            per_task=lambda rng: rng.choice(self.kinds),
        )

    def reset(self, task: Task, seed: int) -> tuple[HouseState, list[dict]]:
        """The world as the task's scene sets it up; `seed` is unused (the world is
        deterministic)."""
        _, messages = super().reset(task, seed)
        return initial_state(task), messages

    def step(
        self, state: HouseState, action: Action
    ) -> tuple[HouseState, list[dict], float, bool, dict]:
        """Env.step, plus info["metrics"] after every step (the last one is the episode's),
        info["state_key"] (the world's state_text) and, with subgoal_reward, the sub-goals this step
        reached first."""
        state, obs, reward, done, info = super().step(state, action)
        reached = subgoals_reached(state)
        if reached > state.subgoals:  # each sub-goal counts (and pays) the first time only
            reward += self.subgoal_reward * (reached - state.subgoals)
            state = replace(state, subgoals=reached)
        info["metrics"] = {
            "success": float(state.answer == SUCCESS),
            "invalid_actions": float(state.invalid_actions),
            "steps": float(state.steps),
            "subgoals": float(state.subgoals),
        }
        info["state_key"] = state_text(state)
        return state, obs, reward, done, info

    def on_text(
        self, state: HouseState, text: str
    ) -> tuple[HouseState, list[dict], float, bool, dict]:
        """A message without a tool call does nothing in the world: an invalid action, not
        an answer."""
        state = replace(state, invalid_actions=state.invalid_actions + 1, steps=state.steps + 1)
        text = self.with_goal(state, f"Nothing happens. Use house_act.\n{show_admissible(state)}")
        return state, [tool_message("house_act", text)], 0.0, False, {}

    def score(self, task: Task, answer: str | None) -> float:
        return 1.0 if answer == SUCCESS else 0.0

    def demonstration(self, task: Task, rng: random.Random, use_tools: bool) -> list[dict]:
        """The expert conversation, played through step by worlds.replay_commands (it raises unless
        the last command earns 1.0). use_tools=True: the expert (search in listed order). False: the
        weaker path (random order, tidy); `rng` draws that order."""
        scene = Scene.from_meta(task.meta)
        if use_tools:
            order = search_order(scene)
        else:  # every storage receptacle, the goal receptacle included, in a random order
            order = rng.sample(
                [p for p in scene.places if p not in DEVICES], len(scene.places) - len(DEVICES)
            )
        commands = expert_plan(scene, order, tidy=not use_tools)
        state, messages = replay_commands(self, task, "house_act", commands, "expert command")
        if state.reward != 1.0:
            raise RuntimeError(f"the expert did not solve {task.id}")
        return messages

    def random_action(self, state: HouseState, rng: random.Random) -> Action:
        """The floor: a random admissible command, and one time in ten a misspelled one."""
        command = rng.choice(admissible(state))
        if rng.random() < 0.1:
            command = command[:-1]  # 'go to drawer 1' -> 'go to drawer ': not admissible
        return Action(text="", tool_calls=(ToolCall("house_act", {"command": command}),))
