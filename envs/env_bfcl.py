"""env_bfcl.py: "bfcl", the Berkeley Function Calling Leaderboard (BFCL v4) as a world, scored by
BFCL's own checkers.

Everything BFCL-specific comes from the installed `bfcl-eval` package (2026.3.23), never from a
copy: the question files and possible answers (bfcl_eval.utils.load_dataset_entry,
load_ground_truth_entry), the multi-turn function docs and the executable API classes (a file
system, a trading bot, a travel booker, vehicle control, messaging, ...), BFCL's conversion of the
function docs into an OpenAI-style tool list (model_handler.utils.convert_to_tool), its decoders of
a model's reply (the local FC handlers' decode_ast and decode_execute: QwenFCHandler for the Qwen
formats, LlamaHandler_3_1 for llama3) and its checkers (ast_checker; multi_turn_checker, which
replays the calls on fresh instances and compares state and responses). Install it without its
pinned dependencies, which would move numpy and pull every vendor's SDK (`bash setup.sh test` does
this):

    pip install --no-deps bfcl-eval==2026.3.23 && pip install -e .[bfcl]

Categories (CATEGORIES), one task per BFCL question, task id "bfcl/<BFCL id>":
  - single-turn, one assistant message scored by the AST checker: simple_python, simple_java,
    simple_javascript, multiple, parallel, parallel_multiple and their live versions (live_simple,
    live_multiple, live_parallel, live_parallel_multiple);
  - irrelevance, live_irrelevance: right when the reply decodes to no call; live_relevance: right
    when it decodes to at least one;
  - multi-turn (multi_turn_base, _miss_func, _miss_param, _long_context): the model's calls run
    against BFCL's API classes and their state, and their results come back as tool messages; a
    reply with no decodable call ends the user's turn and the next turn's user message comes back
    (for miss_func, the held-back functions are shown in it when BFCL adds them); after the last
    turn the episode is scored by multi_turn_checker, all-or-nothing as BFCL scores it. More than
    MAXIMUM_STEP_LIMIT (20) call steps in one turn end the episode as BFCL's force quit does.

What the model sees and does, and how that follows BFCL:
  - the tools are BFCL's: `tool_style="openai"` (default) is BFCL's conversion for OpenAI-style FC
    models (names with "." written "_", types mapped to JSON schema, the language hint appended), so
    the checker runs as for such a model (underscore_to_dot); "raw" sends the docs as BFCL's local
    FC handlers (Qwen, Llama 3.1) do. The questions' own system messages are kept;
  - the tool section is written into the first messages by this world, in `chat_format`'s words:
    `env.tools()` is one list per world, and BFCL's is one per question. For qwen2.5 and qwen3 the
    rendered prompt is byte-equal to the chat template's with those tools; for llama3 it lacks the
    system turn's "Environment: ipython" line (docs/bfcl.md);
  - a model's reply is read by BFCL's own decoder for the format (so a malformed call is dropped as
    BFCL drops it), not by the agent's lenient parser; a scripted action (no text: the expert, the
    random floor) is taken as its tool calls;
  - a call reaches BFCL's executor (which runs `eval` on it) only when it is a plain call of one of
    the question's API methods with literal arguments; anything else gets BFCL's error text without
    running. Such calls cannot change state, so the checker's verdict does not change.

Reward: BFCL's verdict, 1 or 0. With `partial_credit` (multi-turn, training only) the reward is the
share of turns checked before the first failing one instead: named `partial_credit`, it is never a
BFCL score; `success` and the per-category metrics stay BFCL's verdict. info["metrics"] on every
step: success, partial_credit (multi-turn), and {category: verdict}; `summary_metrics` turns an
evaluation's episodes into each category's accuracy and BFCL's summary columns (eval.py calls it).

BFCL is a test set. `train_percent` = 0 (default): "test" is every question of the categories and
"train" raises, so a score is a BFCL score. With train_percent > 0 the ids are split by a stable
hash (env.split_of) for training experiments, and a score on the held-out ids is not a BFCL score
(docs/bfcl.md).

Imports: env.py, chat.py, envs/worlds.py (and bfcl_eval, the standard library).
"""

import ast
import functools
import importlib
import inspect
import json
import random
import re
import sys
import types
import uuid
from dataclasses import dataclass, replace

from chat import render
from env import Action, Env, EnvState, Task, ToolCall, register_env, split_of, tool_message
from envs.worlds import replay

# the version whose data and checkers the agreement table of docs/bfcl.md was measured with
BFCL_VERSION = "2026.3.23"
INSTALL_HINT = (
    f"pip install --no-deps bfcl-eval=={BFCL_VERSION} && pip install -e .[bfcl] "
    "(or bash setup.sh test)"
)

# category -> how a reply is scored, and the language the AST checker reads it in
AST = "ast"
IRRELEVANCE = "irrelevance"
RELEVANCE = "relevance"
MULTI_TURN = "multi_turn"
CATEGORIES = {
    "simple_python": AST,
    "simple_java": AST,
    "simple_javascript": AST,
    "multiple": AST,
    "parallel": AST,
    "parallel_multiple": AST,
    "live_simple": AST,
    "live_multiple": AST,
    "live_parallel": AST,
    "live_parallel_multiple": AST,
    "irrelevance": IRRELEVANCE,
    "live_irrelevance": IRRELEVANCE,
    "live_relevance": RELEVANCE,
    "multi_turn_base": MULTI_TURN,
    "multi_turn_miss_func": MULTI_TURN,
    "multi_turn_miss_param": MULTI_TURN,
    "multi_turn_long_context": MULTI_TURN,
}
# The model BFCL's AST checker is told it scores (it reads one flag of BFCL's model registry,
# underscore_to_dot): a registry entry whose tools are sent as tool_style's.
CHECKER_MODELS = {
    "openai": ("gpt-4o-2024-11-20-FC", True),
    "raw": ("Qwen/Qwen3-8B-FC", False),
}
# BFCL's FC handler whose decoder reads a reply of each chat format: (module, class, model)
DECODERS = {
    "qwen2.5": ("qwen_fc", "QwenFCHandler", "Qwen/Qwen2.5-7B-Instruct"),
    "qwen3": ("qwen_fc", "QwenFCHandler", "Qwen/Qwen3-8B"),
    "llama3": ("llama_3_1", "LlamaHandler_3_1", "meta-llama/Llama-3.1-8B-Instruct"),
}
# BFCL's leaderboard columns (eval_runner_helper.generate_leaderboard_csv): how each is averaged
# over which categories, and the overall score's weights (agentic, 40 of them, is not in this
# world: BFCL counts a category it did not run as 0)
SIMPLE = ("simple_python", "simple_java", "simple_javascript")
NON_LIVE = ("simple", "multiple", "parallel", "parallel_multiple")
LIVE = ("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")
MULTI_TURN_CATEGORIES = tuple(c for c, kind in CATEGORIES.items() if kind == MULTI_TURN)
IRRELEVANCE_CATEGORIES = ("irrelevance", "live_irrelevance")
OVERALL_WEIGHTS = {"non_live": 10, "live": 10, "irrelevance": 10, "multi_turn": 30, "agentic": 40}
# the text that ends a turn in the expert's and the random policy's episodes
END_OF_TURN = "Done."


# -----------------------------------------------------------------------------
# BFCL, imported without its model registry


def _registry_stub() -> types.ModuleType:
    """What the AST checker reads of bfcl_eval.constants.model_config: MODEL_CONFIG_MAPPING[name]
    .underscore_to_dot, for the CHECKER_MODELS entries, with the values the real registry gives
    them. The real module imports every vendor's SDK (the reason users copy the checker out)."""
    stub = types.ModuleType("bfcl_eval.constants.model_config")
    stub.MODEL_CONFIG_MAPPING = {
        name: types.SimpleNamespace(underscore_to_dot=flag)
        for name, flag in CHECKER_MODELS.values()
    }
    return stub


@functools.cache
def bfcl() -> types.SimpleNamespace:
    """The parts of bfcl_eval this world uses, imported once. A process that imported BFCL's real
    model registry first keeps it; otherwise the checker gets _registry_stub's. ImportError, with
    how to install it, when the package is missing."""
    try:
        importlib.import_module("bfcl_eval")
    except ImportError as e:
        raise ImportError(f"the bfcl world needs bfcl-eval: {INSTALL_HINT} ({e})") from e
    sys.modules.setdefault("bfcl_eval.constants.model_config", _registry_stub())
    parts = {
        "utils": "bfcl_eval.utils",
        "prompts": "bfcl_eval.constants.default_prompts",
        "enums": "bfcl_eval.constants.enums",
        "types": "bfcl_eval.constants.type_mappings",
        "backend": "bfcl_eval.constants.executable_backend_config",
        "handler_utils": "bfcl_eval.model_handler.utils",
        "ast_checker": "bfcl_eval.eval_checker.ast_eval.ast_checker",
        "multi_turn": "bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker",
        "executor": "bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils",
    }
    return types.SimpleNamespace(**{k: importlib.import_module(m) for k, m in parts.items()})


@functools.cache
def decoder(chat_format: str):
    """BFCL's FC handler for `chat_format` (DECODERS): its decode_ast and decode_execute read a
    reply as BFCL reads that model's."""
    module, name, model = DECODERS[chat_format]
    cls = getattr(
        importlib.import_module(f"bfcl_eval.model_handler.local_inference.{module}"), name
    )
    return cls(model_name=model, temperature=0, registry_name=model + "-FC", is_fc_model=True)


@functools.cache
def load_category(category: str) -> tuple[tuple[dict, dict, dict | None], ...]:
    """(question as sent, with BFCL's language hint; question as BFCL's evaluation reads it,
    without; its ground truth or None) of every question of `category`, in file order. Ground
    truth is aligned with the questions by position, as BFCL's evaluation aligns it."""
    utils = bfcl().utils
    sent = utils.load_dataset_entry(category)
    checked = utils.load_dataset_entry(
        category, include_prereq=False, include_language_specific_hint=False
    )
    truth = [None] * len(sent)
    if CATEGORIES[category] in (AST, MULTI_TURN):
        truth = utils.load_ground_truth_entry(category)
    return tuple(zip(sent, checked, truth))


def category_of(task_id: str) -> str:
    """ "bfcl/live_simple_3-2-1" -> "live_simple" (BFCL's own extract_test_category_from_id)."""
    return bfcl().utils.extract_test_category_from_id(task_id.removeprefix("bfcl/"))


def method_names(class_name: str) -> frozenset[str]:
    """The public methods of one of BFCL's API classes: what its executor lets a call name."""
    module = importlib.import_module(bfcl().backend.CLASS_FILE_PATH_MAPPING[class_name])
    cls = getattr(module, class_name)
    return frozenset(n for n, _ in inspect.getmembers(cls, inspect.isfunction) if n[0] != "_")


def execute(entry: dict, calls: list[str], eval_run: bool = False) -> list[str]:
    """BFCL's executor on fresh instances of the question's API classes (initial_config): every
    call of `calls` in order -> each one's result text. BFCL keeps instances in its executor
    module's globals under the model's name; this world plays many episodes of one question, so
    each run takes a name of its own and drops its instances after."""
    executor = bfcl().executor
    name = f"nano_skyrl_{uuid.uuid4().hex}"
    category = entry["id"].rsplit("_", 1)[0]
    try:
        results, _ = executor.execute_multi_turn_func_call(
            calls,
            entry["initial_config"],
            entry["involved_classes"],
            name,
            entry["id"],
            long_context="long_context" in category,
            is_evaL_run=eval_run,
        )
    finally:
        _drop_instances(name, entry)
    return results


def _drop_instances(name: str, entry: dict) -> None:
    """Remove what BFCL's executor kept for model `name` (as it runs, as checked, and the ground
    truth the checker runs beside it) from its module globals."""
    found = vars(bfcl().executor)
    for prefix in (name, name + "_eval", name + "_ground_truth_eval"):
        for class_name in entry["involved_classes"]:
            key = f"{prefix}_{entry['id']}_{class_name}_instance"
            found.pop(re.sub(r"[-./:]", "_", key), None)


def multi_turn_verdict(entry: dict, truth: list, calls: list[list[list[str]]]) -> bool:
    """BFCL's multi_turn_checker on a model's decoded calls (per turn, per step, call strings):
    valid or not. The checker needs one result per turn (BFCL fails a force-quit episode before
    checking)."""
    if len(calls) != len(truth):
        return False
    name = f"nano_skyrl_{uuid.uuid4().hex}"
    try:
        result = bfcl().multi_turn.multi_turn_checker(
            calls, truth, entry, entry["id"].rsplit("_", 1)[0], name
        )
    finally:
        _drop_instances(name, entry)
    return bool(result["valid"])


# -----------------------------------------------------------------------------
# reading a reply as BFCL reads it


def call_dicts(action: Action, chat_format: str, language) -> list | None:
    """The reply as BFCL's decode_ast gives it ([{name: {argument: value}}]), or None where BFCL's
    decoder raises. A scripted action (no text) is read from its tool calls."""
    if not action.text.strip():
        return [{c.name: dict(c.arguments)} for c in action.tool_calls]
    try:
        return decoder(chat_format).decode_ast(_answer_text(action.text), language, False)
    except Exception:
        return None


def call_strings(action: Action, chat_format: str) -> list[str]:
    """The reply as BFCL's decode_execute gives it: the calls as Python call strings, [] where it
    has none or the decoder raises (both end BFCL's turn)."""
    try:
        if not action.text.strip():
            return bfcl().handler_utils.convert_to_function_call(
                [{c.name: dict(c.arguments)} for c in action.tool_calls]
            )
        return decoder(chat_format).decode_execute(_answer_text(action.text), False)
    except Exception:
        return []


def _answer_text(text: str) -> str:
    # what BFCL's handlers decode: the reply after a reasoning block
    return text.split("</think>")[-1].lstrip("\n")


def safe_call(call: str, allowed: frozenset[str]) -> str | None:
    """None when `call` may reach BFCL's executor (which evals it): one call of an allowed method,
    literal arguments, keywords only. Otherwise the result text it gets instead, BFCL's own for an
    unknown name."""
    try:
        node = ast.parse(call, mode="eval").body
        args = node.args + [k.value for k in node.keywords]
        for value in args:
            ast.literal_eval(value)
    except Exception:
        return f"Error during execution: not a function call with literal arguments: {call[:200]}"
    if not isinstance(node.func, ast.Name) or any(k.arg is None for k in node.keywords):
        return f"Error during execution: not a function call with literal arguments: {call[:200]}"
    if node.func.id not in allowed:
        return f"Error during execution: name '{node.func.id}' is not defined"
    return None


# -----------------------------------------------------------------------------
# the world


@dataclass(frozen=True)
class BFCLState(EnvState):
    bfcl_turn: int = 0  # the user turn the episode is in (multi-turn)
    steps: int = 0  # replies with calls in this turn (BFCL's step count)
    # the calls run so far, as BFCL's checker takes them: per turn, per step, call strings
    calls: tuple = ((),)
    success: bool = False  # BFCL's verdict, once done
    partial: float = 0.0  # the share of turns checked before the first failure (multi-turn)


@register_env("bfcl")
class BFCLEnv(Env):
    """The Berkeley Function Calling Leaderboard; see the module docstring."""

    def __init__(
        self,
        categories: tuple[str, ...] = tuple(CATEGORIES),
        chat_format: str = "qwen2.5",
        tool_style: str = "openai",
        train_percent: int = 0,
        partial_credit: bool = False,
        max_prompt_chars: int = 0,
    ):
        unknown = [c for c in categories if c not in CATEGORIES]
        if unknown or not categories:
            raise ValueError(f"unknown categories {unknown}; choose from {list(CATEGORIES)}")
        if chat_format not in DECODERS:
            raise ValueError(f"chat_format must be one of {list(DECODERS)}, not {chat_format!r}")
        if tool_style not in CHECKER_MODELS:
            raise ValueError(f"tool_style must be one of {list(CHECKER_MODELS)}")
        if not 0 <= train_percent < 100:
            raise ValueError("train_percent must be in [0, 100)")
        self.categories = tuple(categories)  # the BFCL categories offered
        # the rollout's chat format: the tool section's words and BFCL's decoder
        self.chat_format = chat_format
        self.tool_style = tool_style  # openai (BFCL's conversion for FC models) | raw
        # share of ids held out for training experiments (0: no training split; every question
        # is a test question and a score is a BFCL score)
        self.train_percent = train_percent
        # reward = the share of turns before the first failing one (multi-turn; training only)
        self.partial_credit = partial_credit
        # only questions whose first prompt (tools included) is at most this long (0: all): a
        # small model's context window
        self.max_prompt_chars = max_prompt_chars
        self.entries = {}  # task id -> (question as sent, as checked, ground truth)
        for category in self.categories:
            for sent, checked, truth in load_category(category):
                self.entries["bfcl/" + sent["id"]] = (sent, checked, truth)

    def system_prompt(self) -> str:
        return ""

    def tools(self) -> list[dict]:
        # each question's own tools are written into its first messages (reset)
        return []

    def question_tools(self, functions: list[dict], category: str) -> list[dict]:
        """BFCL's function docs as this world sends them (tool_style)."""
        if self.tool_style == "raw":
            return functions
        b = bfcl()
        style = b.enums.ModelStyle.OPENAI_COMPLETIONS
        tools = b.handler_utils.convert_to_tool(functions, b.types.GORILLA_TO_OPENAPI, style)
        return [{"type": "function", "function": t} for t in tools]

    # --- tasks

    def split(self, task_id: str) -> str:
        """ "test" or "train": every id is a test id unless train_percent > 0."""
        return split_of(task_id, 100 - self.train_percent) if self.train_percent else "test"

    def sample_tasks(self, split: str, n: int, seed: int) -> list[Task]:
        """n distinct questions of `split`, drawn without replacement, the same for the same seed
        (all of them, shuffled, when n is the split's size)."""
        if split == "train" and not self.train_percent:
            raise ValueError(
                "bfcl is a test set: it has no training split unless envs[i].kwargs.train_percent "
                "> 0, and scores on trained ids are not BFCL scores (docs/bfcl.md)"
            )
        ids = [i for i in self.entries if self.split(i) == split and self._fits(i)]
        if n > len(ids):
            raise ValueError(f"bfcl has {len(ids)} {split} questions in {self.categories}, not {n}")
        return [self.make_task(i) for i in random.Random(seed).sample(ids, n)]

    def _fits(self, task_id: str) -> bool:
        if not self.max_prompt_chars:
            return True
        messages = self.first_messages(self.entries[task_id][0])
        return sum(len(m["content"]) for m in messages) <= self.max_prompt_chars

    def make_task(self, task_id: str) -> Task:
        sent, _, truth = self.entries[task_id]
        first = [m["content"] for m in sent["question"][0] if m["role"] == "user"]
        return Task(
            env=self.name,
            id=task_id,
            prompt=first[0] if first else "",
            answer=json.dumps(None if truth is None else truth["ground_truth"]),
            meta={"category": category_of(task_id)},
        )

    # --- the episode

    def first_messages(self, sent: dict) -> list[dict]:
        """The first turn's messages with the question's tools written in, in chat_format's words:
        render() with the tools gives the same text as render() of these without."""
        question = [dict(m) for m in sent["question"][0]]
        tools = self.question_tools(sent["function"], category_of(sent["id"]))
        if self.chat_format == "llama3":
            text = render(question, tools, chat_format="llama3")
            start = text.index("<|start_header_id|>user<|end_header_id|>\n\n") + 42
            users = [i for i, m in enumerate(question) if m["role"] == "user"]
            question[users[0]]["content"] = text[start : text.index("<|eot_id|>", start)]
            return question
        text = render(question[:1], tools, chat_format=self.chat_format)
        system = text[len("<|im_start|>system\n") : text.index("<|im_end|>")]
        rest = question[1:] if question[0]["role"] == "system" else question
        return [{"role": "system", "content": system}] + rest

    def reset(self, task: Task, seed: int) -> tuple[BFCLState, list[dict]]:
        """A new episode of the question (`seed` unused: BFCL's worlds are deterministic)."""
        if task.env != self.name:
            raise ValueError(f"task {task.id!r} belongs to env {task.env!r}, not {self.name!r}")
        return BFCLState(task=task), self.first_messages(self.entries[task.id][0])

    def step(
        self, state: BFCLState, action: Action
    ) -> tuple[BFCLState, list[dict], float, bool, dict]:
        """One reply: scored at once in a single-turn category; run against BFCL's API classes,
        or the turn ended, in a multi-turn one."""
        if state.done:
            raise ValueError("step() called on a finished episode")
        # a reply the agent's parser had to repair counts as a parse failure (BFCL's decoder reads
        # the text itself)
        failed = action.parse_error is not None
        start = replace(state, turn=state.turn + 1, parse_failures=state.parse_failures + failed)
        category = state.task.meta["category"]
        if CATEGORIES[category] == MULTI_TURN:
            state, obs = self.multi_turn_step(start, action)
        else:
            state, obs = self.single_turn_step(start, action, category), []
        reward = state.reward if state.done else 0.0
        metrics = {"success": float(state.success), category: float(state.success)}
        if CATEGORIES[category] == MULTI_TURN:
            metrics["partial_credit"] = state.partial
        info = {
            "format_ok": not failed,
            "answer": None,
            "metrics": metrics,
            "tool_calls": state.tool_calls - start.tool_calls,
            "tool_errors": state.tool_errors - start.tool_errors,
            "tool_timeouts": 0,
            "parse_failures": int(failed),
        }
        return state, obs, reward, state.done, info

    def single_turn_step(self, state: BFCLState, action: Action, category: str) -> BFCLState:
        """BFCL's evaluation of one reply (eval_runner's _evaluate_single_ast_entry and
        _evaluate_single_relevance_entry): decode, check the format, then the AST checker, or for
        (ir)relevance whether a call was decoded."""
        b = bfcl()
        _, checked, truth = self.entries[state.task.id]
        language = b.enums.Language.PYTHON
        if category == "simple_java":
            language = b.enums.Language.JAVA
        elif category == "simple_javascript":
            language = b.enums.Language.JAVASCRIPT
        calls = call_dicts(action, self.chat_format, b.enums.ReturnFormat(language.value))
        if CATEGORIES[category] != AST:
            called = calls is not None and not b.utils.is_empty_output(calls)
            success = called == (CATEGORIES[category] == RELEVANCE)
        elif calls is None or not b.utils.is_function_calling_format_output(calls):
            success = False
        else:
            model = CHECKER_MODELS[self.tool_style][0].replace("/", "_")
            result = b.ast_checker.ast_checker(
                checked["function"], calls, truth["ground_truth"], language, category, model
            )
            success = bool(result["valid"])
        n = len(calls or [])
        return replace(state, done=True, success=success, reward=float(success), tool_calls=n)

    def multi_turn_step(self, state: BFCLState, action: Action) -> tuple[BFCLState, list[dict]]:
        """BFCL's inference loop, one reply at a time (base_handler.inference_multi_turn_*): calls
        run and their results come back; a reply without calls ends the turn."""
        sent, checked, truth = self.entries[state.task.id]
        calls = call_strings(action, self.chat_format)
        if not calls:
            return self.end_turn(state)
        allowed = frozenset().union(*(method_names(c) for c in sent["involved_classes"]))
        refusals = [safe_call(c, allowed) for c in calls]
        runnable = [c for c, r in zip(calls, refusals) if r is None]
        done_before = [c for turn in state.calls for step in turn for c in step]
        results = execute(sent, done_before + runnable)[len(done_before) :]
        obs = []
        for call, refusal in zip(calls, refusals):
            text = refusal if refusal is not None else results.pop(0)
            obs.append(tool_message(call.split("(")[0], text))
        turns = state.calls[:-1] + (state.calls[-1] + (tuple(runnable),),)
        state = replace(
            state,
            calls=turns,
            steps=state.steps + 1,
            tool_calls=state.tool_calls + len(calls),
            tool_errors=state.tool_errors
            + sum(m["content"].startswith("Error during execution") for m in obs),
        )
        if state.steps > bfcl().prompts.MAXIMUM_STEP_LIMIT:
            # BFCL's force quit: the whole question fails
            return self.finish(replace(state, calls=state.calls + ((),))), obs
        return state, obs

    def end_turn(self, state: BFCLState) -> tuple[BFCLState, list[dict]]:
        """The next user turn, or the verdict after the last one."""
        sent = self.entries[state.task.id][0]
        turn = state.bfcl_turn + 1
        if turn == len(sent["question"]):
            return self.finish(state), []
        messages = [dict(m) for m in sent["question"][turn]]
        held_back = sent.get("missed_function", {}).get(str(turn))
        if held_back:
            # BFCL adds the held-back functions here; a prompt already rendered cannot take tools,
            # so they come as BFCL's prompting handlers show them: in the user message
            tools = self.question_tools(held_back, state.task.meta["category"])
            text = bfcl().prompts.DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING
            messages = [{"role": "user", "content": text.format(functions=json.dumps(tools))}]
        state = replace(state, bfcl_turn=turn, steps=0, calls=state.calls + ((),))
        return state, messages

    def finish(self, state: BFCLState) -> BFCLState:
        """The episode's end: BFCL's verdict on every turn, and the share of turns that pass
        before the first failing one (each prefix of the turns checked alone)."""
        _, checked, truth = self.entries[state.task.id]
        turns = [[list(step) for step in turn] for turn in state.calls]
        gt = truth["ground_truth"]
        success = multi_turn_verdict(checked, gt, turns)
        passed = len(gt) if success else 0
        if self.partial_credit and not success:
            while passed < min(len(turns), len(gt)) and multi_turn_verdict(
                checked, gt[: passed + 1], turns[: passed + 1]
            ):
                passed += 1
        partial = passed / len(gt)
        reward = partial if self.partial_credit else float(success)
        return replace(state, done=True, success=success, partial=partial, reward=reward)

    def score(self, task: Task, answer: str | None) -> float:
        """An answer alone earns nothing: step() scores replies with BFCL's checkers."""
        return 0.0

    # --- scripted policies

    def expert_actions(self, task: Task) -> list[Action]:
        """BFCL's ground truth as replies: one possible answer (_possible) for single-turn
        questions; for multi-turn ones each turn's calls in one reply (positional arguments named by
        the API method's signature), then END_OF_TURN. Irrelevance: END_OF_TURN. live_relevance has
        no answer: a call of its first function with each required argument "1" (only that a call is
        made is checked)."""
        sent, _, truth = self.entries[task.id]
        kind = CATEGORIES[task.meta["category"]]
        rename = self.tool_style == "openai"
        if kind == IRRELEVANCE:
            return [Action(text=END_OF_TURN)]
        if kind == RELEVANCE:
            function = sent["function"][0]
            args = {k: "1" for k in function["parameters"].get("required", [])}
            return [_reply([ToolCall(_name(function["name"], rename), args)])]
        if kind == AST:
            _, checked, _ = self.entries[task.id]
            docs = {f["name"]: f for f in checked["function"]}
            calls = []
            for answer in truth["ground_truth"]:
                for name, options in answer.items():
                    doc = docs.get(name, {"parameters": {"properties": {}}})
                    args = _possible(options, doc["parameters"].get("required", ()))
                    if task.meta["category"] in ("simple_java", "simple_javascript"):
                        specs = doc["parameters"]["properties"]
                        java = task.meta["category"] == "simple_java"
                        args = {k: _source(v, specs.get(k, {}), java) for k, v in args.items()}
                    calls.append(ToolCall(_name(name, rename), args))
            return [_reply(calls)]
        methods = {}
        for class_name in sent["involved_classes"]:
            module = importlib.import_module(bfcl().backend.CLASS_FILE_PATH_MAPPING[class_name])
            cls = getattr(module, class_name)
            methods.update({n: f for n, f in inspect.getmembers(cls, inspect.isfunction)})
        actions = []
        for turn in truth["ground_truth"]:
            if turn:
                actions.append(_reply([_named_call(c, methods) for c in turn]))
            actions.append(Action(text=END_OF_TURN))
        return actions

    def demonstration(self, task: Task, rng: random.Random, use_tools: bool) -> list[dict]:
        """The expert's episode through reset/step (worlds.replay); raises unless BFCL's checker
        passes it. `rng` and `use_tools` are unused: one path per question."""
        state, messages, _, done = replay(self, task, self.expert_actions(task))
        if not done or not state.success:
            raise RuntimeError(f"the expert episode of {task.id} did not pass BFCL's checker")
        return messages

    def random_action(self, state: BFCLState, rng: random.Random) -> Action:
        """The floor: a third of replies end the turn; the rest call one of the question's tools
        (a multi-turn question's held-back ones included) with each required argument drawn from
        the question's words or small numbers."""
        sent = self.entries[state.task.id][0]
        if rng.random() < 1 / 3:
            return Action(text=END_OF_TURN)
        functions = list(sent["function"])
        for held_back in sent.get("missed_function", {}).values():
            functions += held_back
        function = rng.choice(functions)
        words = re.findall(r"[A-Za-z0-9_.-]+", state.task.prompt) or ["0"]
        args = {}
        for key in function["parameters"].get("required", []):
            spec = function["parameters"]["properties"].get(key, {})
            if spec.get("type") in ("integer", "float", "number"):
                args[key] = rng.randint(0, 100)
            else:
                args[key] = rng.choice(spec.get("enum") or words)
        return _reply([ToolCall(_name(function["name"], self.tool_style == "openai"), args)])

    # --- evaluation in BFCL's terms

    @staticmethod
    def summary_metrics(per_episode: list[dict]) -> dict[str, float]:
        """Each category's accuracy over the episodes that played it (eval.py averages a metric
        over all episodes), and BFCL's leaderboard columns (eval_runner_helper): non_live (the
        unweighted mean of simple, itself the mean of python, java and javascript, multiple,
        parallel, parallel_multiple), live (weighted by question count), multi_turn (unweighted),
        irrelevance (irrelevance and live_irrelevance, unweighted), relevance (live_relevance),
        overall (10 non_live, 10 live, 10 irrelevance, 30 multi_turn, 40 agentic). As in BFCL a
        category not played counts 0 in a column; a column none of whose categories was played is
        left out, and agentic is never played here, so overall is 0.6 at most."""
        outcomes = {}
        for metrics in per_episode:
            for category in CATEGORIES:
                if category in metrics:
                    outcomes.setdefault(category, []).append(float(metrics[category]))
        accuracy = {c: sum(v) / len(v) for c, v in outcomes.items()}
        # by the category's own key: eval.py's mean over every episode is replaced
        out = dict(accuracy)
        counts = {c: len(v) for c, v in outcomes.items()}
        simple = _mean([accuracy.get(c, 0.0) for c in SIMPLE])
        non_live = [simple] + [accuracy.get(c, 0.0) for c in NON_LIVE[1:]]
        live_questions = max(1, sum(counts.get(c, 0) for c in LIVE))
        columns = {
            "non_live": (SIMPLE + NON_LIVE, _mean(non_live)),
            "live": (
                LIVE,
                sum(accuracy.get(c, 0.0) * counts.get(c, 0) for c in LIVE) / live_questions,
            ),
            "multi_turn": (
                MULTI_TURN_CATEGORIES,
                _mean([accuracy.get(c, 0.0) for c in MULTI_TURN_CATEGORIES]),
            ),
            "irrelevance": (
                IRRELEVANCE_CATEGORIES,
                _mean([accuracy.get(c, 0.0) for c in IRRELEVANCE_CATEGORIES]),
            ),
            "relevance": (("live_relevance",), accuracy.get("live_relevance", 0.0)),
        }
        for column, (members, value) in columns.items():
            if any(c in accuracy for c in members):
                out[f"summary_{column}"] = value
        weights = sum(OVERALL_WEIGHTS.values())
        out["summary_overall"] = sum(
            out.get(f"summary_{c}", 0.0) * w / weights for c, w in OVERALL_WEIGHTS.items()
        )
        return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _name(name: str, rename: bool) -> str:
    # BFCL's conversion for OpenAI-style models writes "." as "_" (convert_to_tool)
    return name.replace(".", "_") if rename else name


def _reply(calls: list[ToolCall]) -> Action:
    return Action(text="", tool_calls=tuple(calls))


def _possible(answer, required=()):
    """One value that a possible answer allows: for each argument its first possibility other than
    "" ("" marks an argument that may be left out, and it is, unless `required` names it), nested
    dictionaries the same way."""
    if isinstance(answer, list):
        return [_possible(item) for item in answer]
    if not isinstance(answer, dict):
        return answer
    out = {}
    for key, options in answer.items():
        # a value that is not a list of possibilities is the value itself
        options = options if isinstance(options, list) else [options]
        given = [o for o in options if o != ""]
        if given and (len(given) == len(options) or key in required):
            out[key] = _possible(given[0])
    return out


def _source(value, spec: dict, java: bool) -> str:
    """A ground-truth value as the Java (`java`) or JavaScript source text that BFCL's type
    converters (ast_eval/type_convertor) read back to that value: the tools ask for every Java and
    JavaScript argument "in string representation", and the AST checker converts it by the
    parameter's type before comparing. The text is written for those converters, which are regular
    expressions, not for a compiler (_java_list says where the two differ)."""
    kind = spec.get("type")
    if isinstance(value, str):
        # a String, char or `any` is read as written; a string where a collection is due is a
        # variable's name, and the checker compares it as text
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        # a Java float or long, or a JavaScript BigInt, is read only with its suffix; a JavaScript
        # number never has one
        suffixes = {"float": "f", "long": "L"} if java else {"Bigint": "n"}
        return f"{value}{suffixes.get(kind, '')}"
    if java and kind in ("Array", "ArrayList"):
        return _java_list(value, spec["items"]["type"], kind)
    if java and kind == "HashMap":
        # parse_hashmap reads each put("key", value) and each value as a Java literal
        puts = [f"put({json.dumps(k)}, {json.dumps(v)}); " for k, v in value.items()]
        return "new HashMap<String, Object>() {{ " + "".join(puts) + "}}"
    # JavaScript arrays and objects: JSON is their literal syntax, and what the converter reads
    return json.dumps(value)


def _java_list(values: list, item: str, kind: str) -> str:
    """A Java Array (`new int[]{2, 7}`) or ArrayList (`new ArrayList<>(Arrays.asList(2L, 7L))`)
    of `item`-typed elements, as BFCL's parse_array and parse_arraylist read them."""
    # parse_arraylist takes the quotes off a String or char element and converts any other by its
    # type; parse_array converts every element by its type, and a String's conversion keeps the
    # quotes, so an Array's String elements are written bare (`new String[]{-v, -p}`)
    quote = ""
    if kind == "ArrayList":
        quote = {"String": '"', "char": "'"}.get(item, "")
    items = ", ".join(quote + _source(v, {"type": item}, java=True) + quote for v in values)
    if kind == "Array":
        name = {"integer": "int", "any": "Object"}.get(item, item)
        return f"new {name}[]{{{items}}}"
    # the Arrays.asList form needs at least one element
    if not values:
        return "new ArrayList<>()"
    return f"new ArrayList<>(Arrays.asList({items}))"


def _named_call(call: str, methods: dict) -> ToolCall:
    """A ground-truth call string ("sort('a.pdf')") as a ToolCall with every argument named by the
    method's signature ({"file_name": "a.pdf"})."""
    node = ast.parse(call, mode="eval").body
    args = [ast.literal_eval(a) for a in node.args]
    kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    bound = inspect.signature(methods[node.func.id]).bind(None, *args, **kwargs)
    named = dict(list(bound.arguments.items())[1:])
    return ToolCall(node.func.id, named)
