"""env_textworld.py: "textworld", Microsoft's TextWorld text games (Côté et al., 2018,
arXiv:1806.11532) as a world the agent plays through one tool, tw_act(command). A real benchmark:
the games, their parser and their walkthroughs are TextWorld's own (pip install textworld==1.7.0, an
optional dependency), not ours.

Tasks are games: (challenge, level, seed). Four of TextWorld's challenge families, each with a
difficulty level:
    tw-coin_collector   level 1-150 and 201-233: find the coin at the end of a chain of
                        `(level - 1) % 100 + 1` rooms (1-100: no distractor rooms; 101-150 and
                        201-233 add dead ends; the other levels of tw-make need more than 100
                        rooms, which TextWorld 1.7 cannot build). The objective spells out the path.
    tw-treasure_hunter  level 1-30: fetch the named object among distractors (picking up the wrong
                        one loses); levels 11-20 (10 rooms) add closed doors and containers, 21-30
                        (20 rooms) locked ones.
    tw-simple           level 1-3: a fixed house, put an object somewhere; rewards dense, balanced,
                        sparse.
    tw-cooking          level 1-4: the "First TextWorld Problems" recipes (see COOKING_LEVELS).
A game is generated on first use with TextWorld's own generator (textworld.challenges, what
`tw-make` runs: the Inform 7 compiler ships in the package) into `cache_dir`, from (challenge,
level, seed), and reused: the same seed gives the same game as played (every screen, admissible
command, score and walkthrough) on every machine with the same textworld version, which names the
cache's subfolder. Not the same bytes: TextWorld's generator iterates Python sets of names, whose
order follows the process's string-hash seed (PYTHONHASHSEED), so game.json (and for cooking
game.z8, the same rules declared in another order) differs between processes. Several processes may
share a cache: each game is written to a temporary folder and renamed into place. In a process, one
game is generated at a time (GENERATOR_LOCK: TextWorld's generator keeps global state, and fails
when threads share it).

Split: seed ranges. Train games have seeds 0 .. train_games - 1; held-out games TEST_SEED + 0 ..
test_games - 1 for every (challenge, level) of the mix, so no held-out game is a training game. (At
the lowest levels the generator has few distinct games to give, e.g. coin_collector level 1 is "take
the coin in room X" for a few dozen room names, so a held-out game there may read like a training
one; from level 2 up, room chains rarely repeat.)

The episode. The prompt and every observation show the game's text, the score, the admissible
commands (as TextWorld computes them) and the objective, which stays visible every turn (the lesson
of alfworld_lite's restate_goal: a small model loses a goal stated once, ~500 tokens back). A
command outside the admissible list (spacing forgiven, and case: a command that matches an
admissible one but for case runs as TextWorld wrote it, capitals in names kept) is not sent to the
game: the observation says so, and it counts as an invalid action.
Reward: 1.0 when the game is won, else its score / max score (paid out as it changes, so the rewards
of an episode sum to that value, also for an episode max_turns cuts off). A lost game (the wrong
object taken) ends the episode. info["metrics"] after every step: "success", "score" (score / max
score), "invalid_actions", "steps".

State is explicit: the frozen TWState holds the game's key and the admissible commands played since
the start; nothing else decides where the game is. The live game behind it (a Z-machine interpreter,
jericho's frotz, loaded in this process) is an implementation detail kept in a GamePool: at most
`pool_size` live games, each at a known position (game, commands played). A step takes an idle live
game of that game at the state's position, or on the way to it (only the missing commands are
played), so an episode finds its own live game where its last step left it and nothing is replayed
while pool_size covers the episodes in flight; else it starts one, or past pool_size resets the
least recently used one (restarted, never re-loaded, when it held another game: a re-load leaks) and
replays the commands. So any state can be stepped any number of times, in any order, by any process,
with the same result. Live games beyond the pool are closed (their interpreter library unloaded);
env.close() closes them all. A copy of the env (pickled to a Ray worker) starts with no live games.
A game whose interpreter raises ends its episode: step() raises, which the agent loop reports as
finish_reason "env_error".

Expert (demonstration, eval.py --policy expert): TextWorld's walkthrough, the winning policy it
computes from the game's logic (policy_commands at the start; where it has none, the walkthrough in
the game's metadata), played through step(); it must win. Random (the floor): a random admissible
command, and one time in ten a misspelled one.
Imports: tools.py, env.py, envs/worlds.py (and textworld, the standard library).
"""

import argparse
import json
import os
import random
import shutil
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

from env import Action, Env, EnvState, Task, ToolCall, register_env, sample_distinct, tool_message
from envs.worlds import replay_commands
from tools import tool

PIP_INSTALL = "pip install textworld==1.7.0"
# held-out games have seeds TEST_SEED + 0, 1, ...; train games 0, 1, ...: disjoint
TEST_SEED = 1_000_000
WON = "won"  # the answer tw_act records when the game is won
LOST = "lost"  # ... and when it is lost

# The tw-make arguments of each challenge's levels (beyond --seed). coin_collector and
# treasure_hunter have a level of their own; simple and cooking have knobs, which these tables order
# by difficulty.
SIMPLE_LEVELS = {
    1: "--rewards dense --goal detailed",
    2: "--rewards balanced --goal detailed",
    3: "--rewards sparse --goal detailed",
}
COOKING_LEVELS = {
    1: "--recipe 1 --take 1 --go 1",  # one ingredient, in the kitchen
    2: "--recipe 1 --take 1 --go 6 --open",  # ... in one of 6 rooms with doors
    3: "--recipe 2 --take 2 --go 6 --open --cook --cut",  # two, to cook and cut
    # three, 9 rooms, small inventory
    4: "--recipe 3 --take 3 --go 9 --open --cook --cut --drop",
}
CHALLENGES = {  # challenge -> (its levels, level -> tw-make arguments)
    # coin_collector's levels 151-200 and 234-300 need more than 100 rooms, which TextWorld 1.7
    # (no Glulx) cannot build: only what can be built is offered
    "tw-coin_collector": (
        (*range(1, 151), *range(201, 234)),
        lambda level, seed: f"--level {level}",
    ),
    "tw-treasure_hunter": (range(1, 31), lambda level, seed: f"--level {level}"),
    "tw-simple": (tuple(SIMPLE_LEVELS), lambda level, seed: SIMPLE_LEVELS[level]),
    "tw-cooking": (
        tuple(COOKING_LEVELS),
        lambda level, seed: f"{COOKING_LEVELS[level]} --recipe-seed {seed}",
    ),
}


def spans(levels) -> str:
    """(1, 2, 3, 7) -> '1-3, 7': a challenge's levels, readable in an error."""
    out, start = [], None
    for i, lv in enumerate(levels):
        start = lv if start is None else start
        if i + 1 == len(levels) or levels[i + 1] != lv + 1:
            out.append(str(lv) if lv == start else f"{start}-{lv}")
            start = None
    return ", ".join(out)


class GameGenerationError(ValueError):
    """TextWorld's generator cannot build this (challenge, level, seed): e.g. treasure_hunter's
    quest too long for the map it drew. sample_tasks draws another seed in its place."""


def import_textworld():
    """The textworld package, or ImportError naming the pip command."""
    try:
        import textworld
        import textworld.challenges  # noqa: F401 (registers the four challenges)
        import textworld.generator  # noqa: F401
    except ModuleNotFoundError as e:
        raise ImportError(
            f"the textworld env needs the textworld package ({e}): {PIP_INSTALL}"
        ) from None
    return textworld


# -----------------------------------------------------------------------------
# Games: generated once into the cache, deterministically from (challenge, level, seed)


def game_key(challenge: str, level: int, seed: int) -> str:
    """'tw-coin_collector-L3-s17': a game's id, and its folder name in the cache."""
    return f"{challenge}-L{level}-s{seed}"


def parse_key(key: str) -> tuple[str, int, int]:
    """game_key's inverse: 'tw-coin_collector-L3-s17' -> ('tw-coin_collector', 3, 17)."""
    challenge, level, seed = key.rsplit("-", 2)
    return challenge, int(level[1:]), int(seed[1:])


# TextWorld's generator keeps global state (its logic parser): one game at a time
GENERATOR_LOCK = threading.Lock()


def generate_game(challenge: str, level: int, seed: int, folder: str) -> None:
    """Write game.z8 and game.json (what textworld.start plays) into `folder`, as `tw-make
    <challenge> <args>
    --seed <seed>` would: the challenge's own argument parser fills in its defaults. One thread at a
    time in a process (GENERATOR_LOCK): from 4 threads at once, TextWorld's generator failed 38 of
    40 times."""
    textworld = import_textworld()
    _, make, add_arguments = textworld.challenges.CHALLENGES[challenge]
    parser = argparse.ArgumentParser(prog=challenge)
    add_arguments(parser)
    settings = vars(parser.parse_args(CHALLENGES[challenge][1](level, seed).split()))
    options = textworld.GameOptions()
    options.seeds = seed
    options.path = os.path.join(folder, "game.z8")
    options.file_ext = ".z8"
    options.force_recompile = True
    with GENERATOR_LOCK:
        game = make(settings=settings, options=options)
        # game.z8 (Inform 7 -> Z-machine) and game.json beside it
        textworld.generator.compile_game(game, options)


def ensure_game(cache: str, key: str) -> str:
    """The path of the game's .z8 file in `cache`, generated first if it is not there. Safe when
    processes share the
    cache: a game is generated in a temporary folder and renamed into place; the first
    rename wins."""
    folder = os.path.join(cache, key)
    path = os.path.join(folder, "game.z8")
    if os.path.exists(os.path.join(folder, "game.json")):
        return path
    os.makedirs(cache, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{key}.", dir=cache)
    try:
        try:
            generate_game(*parse_key(key), tmp)
        except Exception as e:  # the generator's own failure (its message says why)
            raise GameGenerationError(
                f"TextWorld cannot generate {key}: {type(e).__name__}: {e}"
            ) from e
        for name in os.listdir(tmp):
            # keep only what textworld.start reads (not the Inform 7 source)
            if name not in ("game.z8", "game.json"):
                os.remove(os.path.join(tmp, name))
        try:
            os.rename(tmp, folder)
        except OSError:  # another process renamed its copy first: the same game
            if not os.path.exists(os.path.join(folder, "game.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


# -----------------------------------------------------------------------------
# The pool of live games


@dataclass
class Live:
    """One live game (a textworld environment) and where it stands."""

    game: object  # textworld.core.Environment (TWInform7 over jericho's frotz)
    path: str  # the game file it has loaded
    commands: tuple[str, ...]  # commands played since its last reset
    last: object  # the textworld GameState those commands led to


class GamePool:
    """At most `size` live games (one more for each thread that finds none idle), each at a known
    position (path, commands since its reset). `play` checks out the live game best placed for the
    position asked for, brings it there, steps it, and checks it back in. Which one (checkout):
      1. an idle one of the same game at that position, or on the way to it (its commands a prefix
         of those asked for): only the missing commands are stepped. An episode finds its game where
         its last step left it, so while the pool holds a game per episode in flight (pool_size >= a
         rollout batch) nothing is replayed;
      2. else, while fewer than `size` live games exist, a new one (textworld.start), reset
         and replayed;
      3. else the least recently used idle one: reset and replayed if it holds the same game, else
         closed and a new one started in its place. A live game is never load()ed with another game:
         TextWorld 1.7 leaks the previous game's interpreter memory there (~0.4 MB a load, measured;
         a long run over more games than the pool grew past 1 GB), while a closed one is freed whole
         (its copy of the frotz library unloaded).
    Thread-safe: a live game is used by one call at a time. A copy (pickled to a Ray EnvWorker)
    starts empty."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"pool_size must be at least 1, not {size}")
        self.size = size
        self.idle: OrderedDict[int, Live] = OrderedDict()  # least recently used first
        self.lock = threading.Lock()
        self.count = 0  # live games open now, idle or checked out
        self.starts = 0  # live games started (textworld.start): the pool's misses
        # commands stepped to bring a live game to a position (after a reset or not)
        self.replays = 0

    def __getstate__(self) -> dict:
        return {"size": self.size}  # live games (ctypes handles) and the lock do not travel

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["size"])

    def play(self, path: str, commands: tuple[str, ...], command: str | None = None):
        """The textworld GameState at (path, commands), after `command` when one is given."""
        live = self.checkout(path, commands)
        try:
            if command is not None:
                live.last, _, _ = live.game.step(command)
                live.commands += (command,)
        except BaseException:
            self.discard(live)  # a game that raised is in no known state: never reused
            raise
        last = live.last
        self.checkin(live)
        return last

    def checkout(self, path: str, commands: tuple[str, ...]) -> Live:
        """A live game at (path, commands), taken out of the pool (see the class docstring
        for which)."""
        with self.lock:
            live = None
            for idle in self.idle.values():
                # 1. the furthest along the way, the most recently used on ties
                if (
                    idle.path == path
                    and commands[: len(idle.commands)] == idle.commands
                    and (live is None or len(idle.commands) >= len(live.commands))
                ):
                    live = idle
            if live is None and self.idle and self.count >= self.size:
                live = next(iter(self.idle.values()))  # 3. the least recently used
            if live is None:
                self.count += 1  # 2. (or every idle one busy) a new one, counted now
            else:
                del self.idle[id(live)]
        try:
            if live is not None and live.path != path:
                self.discard(live)  # closed, not load()ed with this game: that leaks
                with self.lock:
                    self.count += 1
                live = None
            if live is None:
                # (discard() closes and uncounts it if start raises)
                live = Live(None, path, (), None)
                textworld = import_textworld()
                infos = textworld.EnvInfos(
                    admissible_commands=True,
                    objective=True,
                    max_score=True,
                    score=True,
                    policy_commands=True,
                    won=True,
                    lost=True,
                    feedback=True,
                )
                live.game = textworld.start(path, request_infos=infos)
                self.starts += 1
            if live.last is None or commands[: len(live.commands)] != live.commands:
                live.last, live.commands = live.game.reset(), ()
            for c in commands[len(live.commands) :]:
                live.last, _, _ = live.game.step(c)
                live.commands += (c,)
                self.replays += 1
        except BaseException:
            self.discard(live)
            raise
        return live

    def checkin(self, live: Live) -> None:
        """Back into the pool as the most recently used; the least recently used idle ones closed
        while more than `size` are open."""
        with self.lock:
            self.idle[id(live)] = live
            extra = [
                self.idle.popitem(last=False)[1]
                for _ in range(min(self.count - self.size, len(self.idle)))
            ]
        for old in extra:
            self.discard(old)

    def discard(self, live: Live) -> None:
        """Close a live game taken out of the pool (frotz shuts down; its copy of the library is
        unloaded when the object is collected, at once in CPython) and stop counting it."""
        with self.lock:
            self.count -= 1
        try:
            if live.game is not None:
                live.game.close()
        except Exception:
            pass

    def close(self) -> None:
        """Close every idle live game."""
        with self.lock:
            idle, self.idle = list(self.idle.values()), OrderedDict()
        for live in idle:
            self.discard(live)


# -----------------------------------------------------------------------------
# Observations


def clean(text: str, objective: str = "") -> str:
    """The game's text without the parser's prompt line ('>' and the status bar), the banner and
    objective of the first screen (the objective is shown on its own line), and blank lines."""
    if objective and objective in text:
        text = text.split(objective, 1)[1]
    text = text.rsplit("\n>", 1)[0] if "\n>" in text else text
    return "\n".join(line.strip() for line in text.splitlines() if line.strip())


@dataclass(frozen=True)
class TWState(EnvState):
    """One episode of a TextWorld game; every command returns a new one (dataclasses.replace)."""

    # the admissible commands played since the start: with task.meta["key"] (the game),
    # the game's whole state
    commands: tuple[str, ...] = ()
    admissible: tuple[str, ...] = ()  # the admissible commands now, as TextWorld lists them
    score: int = 0  # the game's score now ...
    max_score: int = 1  # ... and the most it gives
    invalid_actions: int = 0  # commands that were not admissible (and text-only turns)
    steps: int = 0  # commands tried, valid or not (and text-only turns)
    error: str = ""  # why the game's interpreter failed ("" while it works): step() raises

    @property
    def value(self) -> float:
        """The episode's reward so far: 1.0 when won, else score / max score."""
        return 1.0 if self.answer == WON else self.score / max(self.max_score, 1)


def show(state: TWState, text: str) -> str:
    """An observation: the game's text, the score and admissible commands, and the objective,
    every turn."""
    return (
        f"{text}\nScore: {state.score}/{state.max_score}. "
        f"Admissible: {', '.join(state.admissible)}\n"
        f"Goal: {state.task.meta['objective']}"
    )


@tool(
    "tw_act",
    "Do one admissible command in the game.",
    {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    bounded=True,
)
def tw_act(env, state, command):
    """Play `command` (env.act); bad commands are observations, a failing game is recorded
    in state.error."""
    return env.act(state, command)


# -----------------------------------------------------------------------------
# The env


@register_env("textworld")
class TextWorldEnv(Env):
    """TextWorld games (see the module docstring); one tool, tw_act; reward 1.0 when won, else score
    / max."""

    tool_names = ("tw_act",)

    def __init__(
        self,
        challenges: dict | None = None,
        train_games: int = 200,
        test_games: int = 50,
        cache_dir: str = ".cache/textworld",
        pool_size: int = 64,
        tool_timeout: float = 10.0,
    ):
        textworld = import_textworld()
        challenges = {"tw-coin_collector": [1, 2, 3]} if challenges is None else challenges
        for name, levels in challenges.items():
            if name not in CHALLENGES:
                raise ValueError(f"unknown challenge {name!r}; choose from {list(CHALLENGES)}")
            bad = [lv for lv in levels if lv not in CHALLENGES[name][0]]
            if bad or not levels:
                raise ValueError(
                    f"{name} has no level {bad or levels}; "
                    f"its levels are {spans(CHALLENGES[name][0])}"
                )
        if not challenges:
            raise ValueError("challenges is empty: give e.g. {'tw-coin_collector': [1, 2]}")
        if not 1 <= train_games <= TEST_SEED or test_games < 1:
            raise ValueError(f"need 1 <= train_games <= {TEST_SEED} and test_games >= 1")
        # the mix
        self.challenges = {name: [int(lv) for lv in levels] for name, levels in challenges.items()}
        self.train_games = train_games  # train seeds per (challenge, level): 0 .. train_games - 1
        # held-out seeds per (challenge, level): TEST_SEED + 0 .. test_games - 1
        self.test_games = test_games
        # generated games, reused
        self.cache = os.path.join(cache_dir, f"textworld-{textworld.__version__}")
        # live games (~2 MB each); a rollout batch wider than this replays
        self.pool = GamePool(pool_size)
        # seconds per tool call (tw_act runs in the agent's thread: bounded)
        self.tool_timeout = tool_timeout

    def system_prompt(self) -> str:
        return (
            "You are playing a text game. "
            "Reach the goal with tw_act, one admissible command per turn."
        )

    def path(self, task: Task) -> str:
        return self.path_of(task.meta["key"])

    def path_of(self, key: str) -> str:
        return ensure_game(self.cache, key)

    def make_task(self, challenge: str, level: int, seed: int) -> Task:
        """The task of one game, generated (or found in the cache) and started to read its
        first screen."""
        key = game_key(challenge, level, seed)
        first = self.pool.play(ensure_game(self.cache, key), ())
        meta = {
            "key": key,
            "challenge": challenge,
            "level": level,
            "seed": seed,
            "objective": first.objective,
            "max_score": first.max_score,
            "walkthrough": self.walkthrough(self.path_of(key), first),
        }
        task = Task(env=self.name, id=f"{self.name}/{key}", prompt="", answer=WON, meta=meta)
        state = self.initial_state(task, first)
        return replace(task, prompt=show(state, clean(first.feedback, first.objective)))

    def walkthrough(self, path: str, first) -> list[str]:
        """The expert's commands: TextWorld's winning policy from the start (first.policy_commands,
        computed from the game's logic), or where it has none (cooking level 4: its quest search
        gives up) the walkthrough the generator wrote into the game's metadata (game.json beside the
        .z8), played here to keep it admissible: a command admissible but for case runs as TextWorld
        writes it ("BBQ"), and one that is not admissible at its point (a door the script opens
        twice) is a no-op in the game and left out. Played up to the win."""
        if first.policy_commands:
            return list(first.policy_commands)
        with open(os.path.splitext(path)[0] + ".json") as f:
            script = json.load(f).get("metadata", {}).get("walkthrough") or []
        commands, admissible = [], first.admissible_commands
        for command in script:
            match = {c.lower(): c for c in admissible}.get(" ".join(command.lower().split()))
            if match is None:
                continue
            after = self.pool.play(path, tuple(commands), match)
            commands.append(match)
            if after.won or after.lost:
                break
            admissible = after.admissible_commands
        return commands

    def initial_state(self, task: Task, first) -> TWState:
        return TWState(
            task=task, admissible=tuple(first.admissible_commands), max_score=first.max_score
        )

    def sample_tasks(self, split: str, n: int, seed: int) -> list[Task]:
        """n distinct games of `split`, the same for the same (seed, constructor arguments): a
        (challenge, level) pair of the mix, uniformly, then a seed of the split's range. Games are
        generated on first use; one that TextWorld cannot generate (GameGenerationError) is
        replaced, deterministically, by the next one drawn."""
        pairs = [(name, level) for name, levels in self.challenges.items() for level in levels]
        base, count = (0, self.train_games) if split == "train" else (TEST_SEED, self.test_games)

        # an id alone: sample_distinct rejects repeats before any generation
        def draw(rng: random.Random) -> Task:
            challenge, level = rng.choice(pairs)
            key = game_key(challenge, level, base + rng.randrange(count))
            return Task(env=self.name, id=f"{self.name}/{key}", prompt="", answer=WON)

        hint = (
            f": raise {'train' if split == 'train' else 'test'}_games "
            f"({count} per challenge and level)"
        )
        built, m = {}, n  # key -> its Task, or None when TextWorld cannot generate it
        # sample_distinct's first m draws do not depend on m: a game that cannot be generated is
        # replaced by the next one drawn
        while True:
            tasks = []
            for t in sample_distinct(draw, split, m, seed, hint):
                key = t.id.split("/", 1)[1]
                if key not in built:
                    try:
                        built[key] = self.make_task(*parse_key(key))
                    except GameGenerationError:
                        built[key] = None
                if built[key] is not None:
                    tasks.append(built[key])
                if len(tasks) == n:
                    return tasks
            m += n - len(tasks)

    def reset(self, task: Task, seed: int) -> tuple[TWState, list[dict]]:
        """The game at its start (the prompt is its first screen); `seed` is unused (the games are
        deterministic)."""
        _, messages = super().reset(task, seed)
        first = self.pool.play(self.path(task), ())
        return self.initial_state(task, first), messages

    def act(self, state: TWState, command: str) -> tuple[TWState, str, str | None]:
        """One command -> (state, observation, error kind). Not admissible: not sent to the game, an
        invalid action. Won or lost: the episode ends (answer WON or LOST). The interpreter raised:
        state.error, kind "error"."""
        command = " ".join(str(command).split())
        if command not in state.admissible:
            # case forgiven: TextWorld keeps capitals in names ("BBQ")
            command = {c.lower(): c for c in state.admissible}.get(command.lower(), command.lower())
        state = replace(state, steps=state.steps + 1)
        if command not in state.admissible:
            state = replace(state, invalid_actions=state.invalid_actions + 1)
            return (
                state,
                show(state, f"Nothing happens: {command[:80]!r} is not an admissible command."),
                None,
            )
        try:
            after = self.pool.play(self.path(state.task), state.commands, command)
        except Exception as e:
            return (
                replace(state, error=f"{type(e).__name__}: {e}"),
                f"Error: the game failed: {e}",
                "error",
            )
        state = replace(
            state,
            commands=state.commands + (command,),
            admissible=tuple(after.admissible_commands),
            score=after.score,
        )
        if after.won or after.lost:
            return (
                replace(state, done=True, answer=WON if after.won else LOST),
                clean(after.feedback),
                None,
            )
        return state, show(state, clean(after.feedback)), None

    def step(self, state: TWState, action: Action) -> tuple[TWState, list[dict], float, bool, dict]:
        """Env.step, with the reward paid out as the value (1 won, else score / max) changes, and
        info["metrics"] after every step. A game whose interpreter failed raises (the agent
        loop's env_error)."""
        before = state.value
        state, obs, _, done, info = super().step(state, action)
        if state.error:
            raise RuntimeError(f"TextWorld game {state.task.meta['key']} failed: {state.error}")
        state = replace(state, reward=state.value)
        info["metrics"] = {
            "success": float(state.answer == WON),
            "score": state.value,
            "invalid_actions": float(state.invalid_actions),
            "steps": float(state.steps),
        }
        return state, obs, state.value - before, done, info

    def state_line(self, state: TWState) -> str:
        """For a memory policy's compacted prompt (rollout.agent.memory): the score and every
        command played so far, what the last turns it keeps cannot show (how far along the goal's
        path the episode is), then the admissible commands now, one per line: the observation runs
        them together, which a BPE trained on the games merges into tokens that differ from room to
        room, so that a tiny model cannot read the exits off them (docs/memory.md)."""
        done = ", ".join(state.commands) or "none yet"
        return (
            f"Score: {state.score}/{state.max_score}. "
            f"Commands played so far ({len(state.commands)}): {done}.\n"
            "Admissible now:\n" + "\n".join(state.admissible)
        )

    def on_text(self, state: TWState, text: str) -> tuple[TWState, list[dict], float, bool, dict]:
        """A message without a tool call does nothing in the game: an invalid action, not
        an answer."""
        state = replace(state, invalid_actions=state.invalid_actions + 1, steps=state.steps + 1)
        return (
            state,
            [tool_message("tw_act", show(state, "Nothing happens. Use tw_act."))],
            0.0,
            False,
            {},
        )

    def score(self, task: Task, answer: str | None) -> float:
        # step() pays out the score; this is only Env.step's final grade
        return 1.0 if answer == WON else 0.0

    def format_ok(self, answer: str) -> bool:
        return answer == WON

    def demonstration(self, task: Task, rng: random.Random, use_tools: bool) -> list[dict]:
        """TextWorld's walkthrough, played through step() (worlds.replay_commands); raises unless it
        wins. `rng` and `use_tools` are unused: the walkthrough is the one expert path."""
        state, messages = replay_commands(
            self, task, "tw_act", task.meta["walkthrough"], "walkthrough command"
        )
        if state.answer != WON:
            raise RuntimeError(f"the walkthrough did not win {task.id}")
        return messages

    def random_action(self, state: TWState, rng: random.Random) -> Action:
        """The floor: a random admissible command, and one time in ten a misspelled one."""
        command = rng.choice(state.admissible)
        if rng.random() < 0.1:
            command = command[:-1]
        return Action(text="", tool_calls=(ToolCall("tw_act", {"command": command}),))

    def close(self) -> None:
        """Close every live game (their interpreters unloaded once collected)."""
        self.pool.close()
