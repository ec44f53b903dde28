"""serve.py: an OpenAI-compatible HTTP server over any of our engines that records, per session, every token it
samples (a wing of rollout.py and agent.py).

    python -m wings.serve --checkpoint runs/toy_math/final --port 8000  # a run's checkpoint or a Hugging Face folder

Endpoints (https://platform.openai.com/docs/api-reference, and vLLM's extensions of /v1/completions):
  POST /v1/chat/completions  messages + tools in OpenAI's format, rendered with chat.render, sampled by the engine,
                             tool calls parsed by chat.make_action (parse_tool_calls) and returned as `tool_calls`
  POST /v1/completions       prompts as text or token ids; token ids back (return_token_ids), as `vllm serve` does,
                             so engine_openai.OpenAIEngine is a client of this server
  GET  /v1/models            the one served model, with the version of its weights
  POST /v1/weights           a trainer's push (safetensors bytes), authenticated by a bearer token
  GET  /v1/sessions/ID       a session's records (authenticated; ?pop=1 also forgets them)
Standard library HTTP (ThreadingHTTPServer: one thread per connection) and one lock around the engine: calls are
served one at a time, in arrival order, so a push never lands mid-generation and each token's version is known.

Capture. A request names its session by the X-Session-Id header or OpenAI's `user` field. For every call the
Capture keeps the exact prompt ids, sampled ids, engine log-probs, kept-set sizes and the weight version of every
token (typed records: Call, Sample). session_trajectories turns a session into agent.Trajectory rows: one trajectory
when every turn's prompt extends the previous turn's prompt and one of its completions token for token (the new
tokens are observations, mask 0, as agent.play_episodes appends them); otherwise ("branching": the client dropped a
think block, edited a message, re-ordered tools) one row per turn, each its own prompt (mask 0) and completion
(mask 1), counted in serve/branched. Rows hold only ids the engine saw or sampled, never re-tokenized text.

Weights. In-process (colocated with the trainer), Server.update_weights(state_dict, version) is the engine's own
update under the lock; remotely, a trainer sends the same to POST /v1/weights (engine_openai.OpenAIEngine.push). The
Server answers `generate` like an engine, so rollout.sync_probe (through it, or through an OpenAIEngine over HTTP) and
rollout.logprob_gap check it after a push like any other engine. Docs: docs/serve.md.

Imports: env.py, tool_calls.py, chat.py, agent.py, rollout.py, runs.py (the CLI's folder check) (and torch,
safetensors, tokenizers, the standard library).
"""
import argparse
import dataclasses
import hmac
import inspect
import itertools
import json
import math
import os
import threading
import time
import urllib.parse
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from safetensors.torch import load as safetensors_load
from tokenizers import Tokenizer

from agent import Trajectory
from chat import CHAT_FORMATS, encode, make_action, pad_token_id, parse_assistant_message, render, turn_ends
from env import Task
from rollout import Generation, SamplingParams, make_engine
from runs import check_model_folder
from tool_calls import TOOL_CALL_OPEN

TOKEN_ENV = "NANO_SKYRL_SERVE_TOKEN"      # the env var holding the bearer token of /v1/weights and /v1/sessions
DRAIN_BYTES = 64 << 20                    # a refused body up to this size is read (and dropped) before the 413


# -----------------------------------------------------------------------------
# capture: what was sampled, per session

@dataclass
class Sample:
    """One completion of a call, exactly as the engine sampled it."""
    token_ids: list[int]               # (N,) sampled ids, the stop token included when one ended it
    logprobs: list[float]              # (N,) engine log-probs (rollout.Generation.logprobs)
    kept_sizes: list[int]              # (N,) top-k / top-p set sizes; empty: drawn from the whole vocabulary
    versions: list[int]                # (N,) weight version that sampled each token
    finish_reason: str                 # "stop" | "length" (the engine's)
    tool_calls: int = 0                # tool calls returned to the client (chat)
    parse_error: str | None = None     # chat.make_action's parse error: the call went back as text
    message: dict | None = None        # chat: the assistant message returned (OpenAI's format)


@dataclass
class Call:
    """One request: its prompt ids and its n samples, with how it continues the session's previous call."""
    endpoint: str                      # "chat" | "completions"
    prompt_ids: list[int]              # (P,) the ids the engine was given
    samples: list[Sample]              # (n,) its completions
    parent: int | None = None          # the sample of the previous call that prompt_ids extend, None: not extended
    messages: list = field(default_factory=list)  # chat: the request's messages (the conversation so far)

    @classmethod
    def from_dict(cls, d: dict) -> "Call":
        """A Call from its JSON (GET /v1/sessions/ID), for a trainer reading a remote server's capture."""
        return cls(**{**d, "samples": [Sample(**s) for s in d["samples"]]})


def continued_sample(prev: Call, prompt: list[int]) -> int | None:
    """The index of the first sample s of `prev` such that prev.prompt_ids + s.token_ids is a prefix of `prompt`
    (the prefix invariant), or None."""
    P = len(prev.prompt_ids)
    if prompt[:P] != prev.prompt_ids:
        return None
    for i, s in enumerate(prev.samples):
        if prompt[P:P + len(s.token_ids)] == s.token_ids:
            return i
    return None


class Capture:
    """Per-session records of every call, safe to use from the server's threads. A session's calls are kept in
    the order the engine served them; sessions never share a record."""

    def __init__(self):
        self.lock = threading.Lock()
        self.sessions: dict[str, list[Call]] = {}
        self.unsessioned_calls = 0     # calls that named no session (served, not recorded)

    def record(self, session: str | None, call: Call) -> Call:
        """Append `call` to `session`, its parent (the prefix invariant against the previous call) filled in."""
        with self.lock:
            if session is None:
                self.unsessioned_calls += 1
                return call
            calls = self.sessions.setdefault(session, [])
            if calls:
                call.parent = continued_sample(calls[-1], call.prompt_ids)
            calls.append(call)
            return call

    def calls(self, session: str) -> list[Call]:
        with self.lock:
            return list(self.sessions.get(session, []))

    def pop(self, session: str) -> list[Call]:
        """A session's calls, forgotten here (what a trainer does once it has taken them)."""
        with self.lock:
            return self.sessions.pop(session, [])


def session_trajectories(calls: list[Call], session: str = "") -> tuple[list[Trajectory], dict[str, float]]:
    """A session's calls -> (agent.Trajectory rows, metrics).

    One trajectory per sample of the last call when every later call extends the one before (Call.parent set): the
    first prompt (mask 0), then each continued completion (mask 1, with its log-probs, kept sizes, versions) and the
    tokens the next prompt adds (mask 0: tool results, user turns, the closing <|im_end|> of a cut turn), as
    agent.play_episodes appends them; the other samples of an earlier call (n > 1) are left out (counted). Otherwise
    one row per sample of every call (branching). messages: the last request's messages and the reply. Rewards are
    0: the server does not know them. Metrics: serve/branched (1 when the session fell back to rows per turn),
    serve/turns (calls), serve/rows, serve/unused_samples (samples of earlier calls that no row holds)."""
    if not calls:
        return [], {}
    task = Task(env="serve", id=session, prompt="", answer="")
    linear = all(c.parent is not None for c in calls[1:])

    def start(prompt: list[int], messages: list, sample: int) -> Trajectory:
        traj = Trajectory(task=task, group=0, sample=sample, token_ids=[], loss_mask=[], logprobs=[],
                          prompt_len=len(prompt), messages=list(messages))
        traj.extend(list(prompt))
        return traj

    def add(traj: Trajectory, s: Sample):
        traj.turn_starts.append(len(traj.token_ids))
        traj.extend(s.token_ids, sampled=True, logprobs=s.logprobs, versions=s.versions, kept_sizes=s.kept_sizes)
        traj.num_turns += 1
        traj.num_tool_calls += s.tool_calls
        traj.parse_failures += s.parse_error is not None
        traj.finish_reason = "done" if s.finish_reason == "stop" else "max_tokens"

    rows = []
    if linear:
        for j, last in enumerate(calls[-1].samples):
            traj = start(calls[0].prompt_ids, calls[-1].messages + ([last.message] if last.message else []), j)
            for prev, call in zip(calls, calls[1:]):
                add(traj, prev.samples[call.parent])
                traj.extend(call.prompt_ids[len(traj.token_ids):])      # observations: mask 0
            add(traj, last)
            rows.append(traj)
    else:
        for call in calls:
            for j, s in enumerate(call.samples):
                traj = start(call.prompt_ids, call.messages + ([s.message] if s.message else []), len(rows))
                add(traj, s)
                rows.append(traj)
    unused = sum(len(c.samples) - 1 for c in calls[:-1]) if linear else 0
    return rows, {"serve/branched": float(not linear), "serve/turns": float(len(calls)),
                  "serve/rows": float(len(rows)), "serve/unused_samples": float(unused)}


# -----------------------------------------------------------------------------
# requests: parsed and checked before the engine sees them

class RequestError(Exception):
    """A bad request: answered with `status` and OpenAI's error object, the server goes on serving."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


# fields that would change the result and that this server does not implement: refused unless at their default
REFUSED = {"stream": (False, None), "logit_bias": (None, {}), "presence_penalty": (0, 0.0, None),
           "frequency_penalty": (0, 0.0, None), "repetition_penalty": (1, 1.0, None), "echo": (False, None),
           "suffix": (None,), "best_of": (None, 1), "tool_choice": (None, "auto"), "functions": (None,),
           "function_call": (None,), "response_format": (None, {"type": "text"}), "top_logprobs": (None, 0),
           "min_tokens": (None, 0), "min_p": (None, 0, 0.0), "prompt_logprobs": (None,)}


def _number(body: dict, key: str, default, lo: float, hi: float, integer: bool = False):
    x = body.get(key)
    if x is None:
        return default
    ok = isinstance(x, int) if integer else isinstance(x, (int, float))
    if isinstance(x, bool) or not ok or not (lo <= x <= hi) or (isinstance(x, float) and math.isnan(x)):
        kind = "an integer" if integer else "a number"
        raise RequestError(400, f"{key} must be {kind} in [{lo}, {hi}], got {x!r}", key)
    return x


def _text(content, where: str, optional: bool = False) -> str:
    """A message's content: a string, or OpenAI's list of {"type": "text", "text": ...} parts joined."""
    if content is None and optional:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(400, f"{where} must be a string or a list of text parts (no images, audio or files)", where)


def chat_messages(body: dict) -> tuple[list[dict], list[dict] | None]:
    """The request's messages and tools, checked and reduced to what chat.render reads (OpenAI's chat schema:
    roles system / user / assistant / tool; assistant tool_calls [{"type": "function", "function": {"name",
    "arguments"}}]; tools [{"type": "function", "function": {"name", ...}}])."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            role = m.get("role") if isinstance(m, dict) else m
            raise RequestError(400, f"{where}.role must be system, user, assistant or tool, got {role!r}", where)
        role = m["role"]
        msg = {"role": role, "content": _text(m.get("content"), where + ".content", optional=role == "assistant")}
        if role == "assistant":
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise RequestError(400, f"{where}.tool_calls must be a list", where + ".tool_calls")
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                        and isinstance(fn.get("arguments"), (str, dict))):
                    raise RequestError(400, f"{where}.tool_calls[{j}] must be {{'type': 'function', 'function': "
                                            f"{{'name': str, 'arguments': str}}}}", f"{where}.tool_calls")
            if calls:
                msg["tool_calls"] = [{"type": "function", "function": {"name": c["function"]["name"],
                                                                       "arguments": c["function"]["arguments"]}}
                                     for c in calls]
            if isinstance(m.get("reasoning_content"), str):
                msg["reasoning_content"] = m["reasoning_content"]
        out.append(msg)
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools)):
        raise RequestError(400, "tools must be a list of {'type': 'function', 'function': {'name': str, ...}}", "tools")
    return out, tools or None


@dataclass(frozen=True)
class Stops:
    """A request's `stop`: every string is looked for in the decoded text after sampling, and the completion is cut
    at the token that completes one; a string that is one token is also a stop id, so the engine stops there."""
    token_ids: tuple[int, ...]         # stop ids (the engine's stop_token_ids)
    texts: tuple[str, ...]             # every stop string


# -----------------------------------------------------------------------------
# the server

class Server:
    """An engine served over HTTP, with its Capture. start() / stop() run it in a background thread (port 0: a free
    one); generate / update_weights make the Server itself an engine (rollout.py's interface) for an in-process
    trainer and the weight-sync gate.

    engine: anything with generate(prompts, SamplingParams) and update_weights(state_dict) (rollout.py);
    tokenizer: a tokenizers.Tokenizer; max_model_len: prompt + completion tokens at most (None: the engine's
    model's max_position_embeddings, if it has one); token: the bearer token of /v1/weights and /v1/sessions
    (None: those endpoints are off)."""

    def __init__(self, engine, tokenizer, model_name: str = "default", chat_format: str = "qwen2.5",
                 max_model_len: int | None = None, token: str | None = None, host: str = "127.0.0.1",
                 port: int = 0, max_body_bytes: int = 4 << 20, max_weight_bytes: int = 16 << 30,
                 default_max_tokens: int = 512, max_n: int = 64, version: int = 0):
        if chat_format not in CHAT_FORMATS:
            raise ValueError(f"unknown chat_format {chat_format!r}, expected one of {CHAT_FORMATS}")
        self.engine, self.tokenizer, self.model_name, self.chat_format = engine, tokenizer, model_name, chat_format
        model_cfg = getattr(getattr(engine, "model", None), "cfg", None)
        self.max_model_len = max_model_len or getattr(model_cfg, "max_position_embeddings", None)
        self.vocab = getattr(model_cfg, "vocab_size", None) or tokenizer.get_vocab_size(with_added_tokens=True)
        self.turn_ends = tuple(tokenizer.token_to_id(t) for t in turn_ends(chat_format))   # <|im_end|>; llama3's
        if None in self.turn_ends:
            raise ValueError(f"the tokenizer lacks the tokens that end a turn in {chat_format}: "
                             f"{turn_ends(chat_format)}")
        self.token, self.host, self.port = token, host, port
        self.max_body_bytes, self.max_weight_bytes = max_body_bytes, max_weight_bytes
        self.default_max_tokens, self.max_n = default_max_tokens, max_n
        self.version = version         # the weights' version, stamped on every token an engine does not stamp
        self.capture = Capture()
        self.engine_lock = threading.Lock()
        self.call_ids = itertools.count()  # numbers the tool calls returned (next() is atomic under the GIL)
        self.httpd: ThreadingHTTPServer | None = None

    # -- the engine interface (the in-process trainer's side) -------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """The engine's generate, under the lock, every token stamped with the weight version that sampled it."""
        with self.engine_lock:
            gens = self.engine.generate(prompts, params)
            return [replace(g, versions=list(g.versions) if g.versions else [self.version] * len(g.token_ids))
                    for g in gens]

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int | None = None) -> int:
        """Push weights into the engine (names and shapes checked first: a bad dict changes nothing) -> the new
        version (default: the old one + 1). Waits for the call being served; later calls sample the new weights."""
        new = self.version + 1 if version is None else int(version)
        with self.engine_lock:
            if "version" in inspect.signature(self.engine.update_weights).parameters:
                self.engine.update_weights(state_dict, version=new)   # it stamps its tokens (async_rollouts)
            else:
                self.engine.update_weights(state_dict)
            self.version = new
            return new

    def sleep(self):
        with self.engine_lock:         # around a colocated learner's update, as agent.LocalRollouts calls it
            getattr(self.engine, "sleep", lambda: None)()

    def wake_up(self):
        with self.engine_lock:
            getattr(self.engine, "wake_up", lambda: None)()

    # -- the endpoints --------------------------------------------------------------------------------------------

    def sampling(self, body: dict, prompt_len: int, stops: Stops) -> SamplingParams:
        """OpenAI's sampling fields (and vLLM's top_k, stop_token_ids) -> SamplingParams, checked."""
        for key, defaults in REFUSED.items():
            if key in body and body[key] not in defaults:
                raise RequestError(400, f"{key}={body[key]!r} is not supported by this server", key)
        room = (self.max_model_len - prompt_len) if self.max_model_len else 1 << 30
        if room < 1:
            raise RequestError(400, f"This model's maximum context length is {self.max_model_len} tokens; the "
                                    f"prompt has {prompt_len}", None, "context_length_exceeded")
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _number(body, key, min(room, self.default_max_tokens), 1, 1 << 30, integer=True)
        if max_tokens > room:
            raise RequestError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                    f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                                    f"{max_tokens} in the completion)", key, "context_length_exceeded")
        top_k = _number(body, "top_k", 0, -1, self.vocab, integer=True)
        extra = body.get("stop_token_ids") or []
        if not (isinstance(extra, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                and 0 <= t < self.vocab for t in extra)):
            raise RequestError(400, f"stop_token_ids must be a list of token ids in [0, {self.vocab})",
                               "stop_token_ids")
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
        if top_p <= 0:
            raise RequestError(400, "top_p must be in (0, 1]", "top_p")
        return SamplingParams(n=_number(body, "n", 1, 1, self.max_n, integer=True),
                              temperature=float(_number(body, "temperature", 1.0, 0.0, 100.0)),
                              top_p=float(top_p), top_k=max(top_k, 0), max_tokens=max_tokens,
                              stop_token_ids=tuple(dict.fromkeys([*stops.token_ids, *extra])),
                              seed=_number(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True))

    def check_model(self, body: dict):
        if body.get("model") != self.model_name:
            raise RequestError(404, f"the model {body.get('model')!r} does not exist: this server serves "
                                    f"{self.model_name!r}", "model", "model_not_found")

    def stops(self, body: dict) -> Stops:
        stop = body.get("stop")
        stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not (isinstance(stop, list) and len(stop) <= 16 and all(isinstance(s, str) and s for s in stop)):
            raise RequestError(400, "stop must be a non-empty string or a list of at most 16 of them", "stop")
        ids = [encode(self.tokenizer, s) for s in stop]
        return Stops(tuple(i[0] for i in ids if len(i) == 1), tuple(stop))

    def cut_at_text_stop(self, g: Generation, stops: Stops, skip_special: bool) -> tuple[Generation, str | None]:
        """The generation cut after the first token whose decoded prefix holds a stop string -> (that generation,
        its text before the string), or (g, None) when no stop string occurs. Causal sampling: a prefix of a
        sample is a sample, so the cut one is what the engine would have returned had it stopped there."""
        def decode(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special)
        if not any(s in decode(g.token_ids) for s in stops.texts):
            return g, None
        for k in range(len(g.token_ids)):
            text = decode(g.token_ids[:k + 1])
            found = [text.index(s) for s in stops.texts if s in text]
            if found:
                return replace(g, token_ids=g.token_ids[:k + 1], logprobs=g.logprobs[:k + 1], finish_reason="stop",
                               kept_sizes=g.kept_sizes[:k + 1], versions=g.versions[:k + 1]), text[:min(found)]
        raise AssertionError("unreachable: the whole text holds a stop string")

    def chat(self, body: dict, session: str | None) -> dict:
        """POST /v1/chat/completions (https://platform.openai.com/docs/api-reference/chat/create)."""
        self.check_model(body)
        messages, tools = chat_messages(body)
        kwargs = body.get("chat_template_kwargs") or {}     # vLLM's extension: {"enable_thinking": false} (qwen3)
        thinking = kwargs.get("enable_thinking") if isinstance(kwargs, dict) else "?"
        if thinking not in (None, True, False) or set(kwargs) - {"enable_thinking"}:
            raise RequestError(400, "chat_template_kwargs may hold only enable_thinking (true or false)",
                               "chat_template_kwargs")
        try:
            text = render(messages, tools, add_generation_prompt=True, chat_format=self.chat_format,
                          enable_thinking=thinking)
        except (ValueError, KeyError, TypeError) as e:
            raise RequestError(400, f"messages cannot be rendered: {e}", "messages") from None
        prompt = encode(self.tokenizer, text)
        stops = self.stops(body)
        params = self.sampling(body, len(prompt), replace(stops, token_ids=(*self.turn_ends, *stops.token_ids)))
        logprobs = body.get("logprobs") or False
        if not isinstance(logprobs, bool):
            raise RequestError(400, "logprobs must be true or false", "logprobs")
        choices, samples = [], []
        for i, g in enumerate(self.generate([prompt], params)):
            g, content = self.cut_at_text_stop(g, stops, skip_special=False)
            if content is None:        # the stop token (<|im_end|>, a stop id) is not part of the message
                ids = g.token_ids[:-1] if g.finish_reason == "stop" else g.token_ids
                content = self.tokenizer.decode(ids, skip_special_tokens=False)
            message, error = self.assistant_reply(content)
            samples.append(Sample(list(g.token_ids), list(g.logprobs), list(g.kept_sizes), list(g.versions),
                                  g.finish_reason, len(message.get("tool_calls", [])), error, message))
            finish = "length" if g.finish_reason == "length" else "tool_calls" if "tool_calls" in message else "stop"
            choices.append({"index": i, "message": message, "finish_reason": finish,
                            "logprobs": {"content": self.token_logprobs(g, False)} if logprobs else None})
        self.capture.record(session, Call("chat", prompt, samples, messages=messages))
        return self.reply("chat.completion", choices, len(prompt), samples)

    def assistant_reply(self, text: str) -> tuple[dict, str | None]:
        """A sampled assistant text -> (OpenAI's assistant message, the parse error). Well-formed calls become
        tool_calls with their arguments as JSON strings written as chat.render writes them, so a client that sends
        the message back re-renders the very text sampled; a malformed call stays in the content, as text."""
        action = make_action(text, self.chat_format)          # tool_calls.parse_tool_calls for the Qwen formats
        calls, error = action.tool_calls, action.parse_error
        message = {"role": "assistant", "content": text}
        if calls and error is None:
            canonical = parse_assistant_message(text, self.chat_format)   # content: the text before the calls
            content = canonical["content"]
            if len(canonical.get("tool_calls", [])) != len(calls):   # not as render() writes them: the next
                content = text.split(TOOL_CALL_OPEN)[0].rstrip("\n") if TOOL_CALL_OPEN in text else ""  # turn branches
            number = next(self.call_ids)
            message = {"role": "assistant", "content": content or None, "tool_calls": [
                {"id": f"call_{number}_{j}", "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                for j, c in enumerate(calls)]}
        return message, error

    def completions(self, body: dict, session: str | None) -> dict:
        """POST /v1/completions (https://platform.openai.com/docs/api-reference/completions/create) with vLLM's
        extensions: a prompt of token ids, top_k, stop_token_ids, return_token_ids, return_tokens_as_token_ids,
        skip_special_tokens; ignore_eos is accepted either way (our engines stop only at the stop ids given)."""
        self.check_model(body)
        prompts = body.get("prompt")
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompts)):
            prompts = [prompts]
        if not (isinstance(prompts, list) and prompts and all(
                isinstance(p, str) or (isinstance(p, list) and p and all(
                    isinstance(t, int) and not isinstance(t, bool) for t in p)) for p in prompts)):
            raise RequestError(400, "prompt must be a string, a non-empty list of token ids, or a list of either",
                               "prompt")
        prompts = [encode(self.tokenizer, p) if isinstance(p, str) else p for p in prompts]
        if any(not p or min(p) < 0 or max(p) >= self.vocab for p in prompts):
            raise RequestError(400, f"prompt token ids must be in [0, {self.vocab}) (and a prompt not empty)", "prompt")
        logprobs = body.get("logprobs")
        if logprobs not in (None, 0) or isinstance(logprobs, bool):
            raise RequestError(400, f"logprobs={logprobs!r}: only 0 (the sampled token's log-prob) or null is "
                                    "supported; the engine reports no alternatives", "logprobs")
        stops = self.stops(body)
        params = self.sampling(body, max(len(p) for p in prompts), stops)
        if len(prompts) * params.n > self.max_n:
            raise RequestError(400, f"{len(prompts)} prompts x n={params.n} samples: at most {self.max_n} per "
                                    "request", "prompt")
        as_ids, skip = bool(body.get("return_tokens_as_token_ids")), body.get("skip_special_tokens", True) is not False
        choices, samples = [], []
        for i, g in enumerate(self.generate(prompts, params)):
            g, text = self.cut_at_text_stop(g, stops, skip_special=skip)
            stop_reason = g.token_ids[-1] if g.finish_reason == "stop" and text is None else None
            text = self.tokenizer.decode(g.token_ids, skip_special_tokens=skip) if text is None else text
            choices.append({"index": i, "text": text,
                            "finish_reason": g.finish_reason, "stop_reason": stop_reason,
                            "logprobs": None if logprobs is None else {
                                "tokens": [t["token"] for t in self.token_logprobs(g, as_ids)],
                                "token_logprobs": list(g.logprobs), "top_logprobs": None, "text_offset": None},
                            **({"token_ids": list(g.token_ids)} if body.get("return_token_ids") else {}),
                            # ours (vLLM has no such field): the top-k / top-p set sizes, so that a trainer's
                            # OpenAIEngine scores the very sets sampled (empty: nothing was truncated)
                            **({"kept_sizes": list(g.kept_sizes)} if g.kept_sizes else {})})
            samples.append(Sample(list(g.token_ids), list(g.logprobs), list(g.kept_sizes), list(g.versions),
                                  g.finish_reason))
        n = params.n
        for p, prompt in enumerate(prompts):       # each prompt is its own call of the session
            self.capture.record(session, Call("completions", list(prompt), samples[p * n:(p + 1) * n]))
        return self.reply("text_completion", choices, sum(len(p) for p in prompts), samples)

    def token_logprobs(self, g: Generation, as_ids: bool) -> list[dict]:
        tokens = [f"token_id:{t}" if as_ids else self.tokenizer.decode([t], skip_special_tokens=False)
                  for t in g.token_ids]
        return [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(tokens, g.logprobs)]

    def reply(self, kind: str, choices: list, prompt_tokens: int, samples: list[Sample]) -> dict:
        completion = sum(len(s.token_ids) for s in samples)
        return {"id": f"{kind.split('.')[0]}-{time.time_ns()}", "object": kind, "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                          "total_tokens": prompt_tokens + completion}}

    def models(self) -> dict:
        """GET /v1/models (https://platform.openai.com/docs/api-reference/models/list), plus the weights' version."""
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "nano-skyrl", "weight_version": self.version,
                                            "max_model_len": self.max_model_len}]}

    def push(self, headers, data: bytes) -> dict:
        """POST /v1/weights: safetensors bytes of a state dict (Hugging Face names), the version in the
        X-Weight-Version header."""
        version = headers.get("X-Weight-Version")
        try:
            version = None if version is None else int(version)
            state_dict = safetensors_load(data)
        except Exception as e:                                 # not an int, not safetensors
            raise RequestError(400, f"the body must be safetensors bytes and X-Weight-Version an integer: {e}")
        try:
            return {"version": self.update_weights(state_dict, version), "tensors": len(state_dict)}
        except (KeyError, ValueError) as e:                    # rollout.check_state_dict: nothing was copied
            raise RequestError(400, str(e).strip("'\"")) from None

    def authorize(self, headers):
        if self.token is None:
            raise RequestError(403, f"this endpoint is off: start the server with a token ({TOKEN_ENV})",
                               kind="permission_error")
        given = headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            raise RequestError(401, "a valid 'Authorization: Bearer <token>' header is required",
                               kind="authentication_error")

    # -- running ----------------------------------------------------------------------------------------------------

    def start(self) -> str:
        """Serve in a background thread -> the base URL (ending in /v1, as OpenAI clients expect)."""
        self.httpd = ThreadingHTTPServer((self.host, self.port), _handler(self))
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self.url

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def stop(self):
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None


def read_body(headers, rfile, limit: int) -> bytes:
    """A request's body, at most `limit` bytes, or a RequestError (411: no Content-Length; 413: too long, the body
    read and dropped up to DRAIN_BYTES first, so that the client, done sending, reads the answer rather than a reset
    connection)."""
    if headers.get("Transfer-Encoding"):
        raise RequestError(411, "send the body with a Content-Length (chunked bodies are not read)")
    try:
        size = int(headers.get("Content-Length", ""))
    except ValueError:
        raise RequestError(411, "a Content-Length header is required") from None
    if size < 0 or size > limit:
        left = min(size, DRAIN_BYTES)
        while left > 0:
            chunk = rfile.read(min(left, 1 << 16))
            left = left - len(chunk) if chunk else 0
        raise RequestError(413, f"the body has {size} bytes; at most {limit} are read")
    return rfile.read(size)


def _handler(server: Server):
    """The request handler class of `server`: routing, body limits, and every error as a JSON answer."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"     # keep-alive, as OpenAI's client uses; every answer has a Content-Length
        timeout = 120                     # a client that stops sending mid-request frees its thread

        def log_message(self, *args):
            pass

        def answer(self, status: int, payload: dict):
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def body(self, limit: int) -> bytes:
            return read_body(self.headers, self.rfile, limit)

        def json_body(self) -> dict:
            try:
                body = json.loads(self.body(server.max_body_bytes))
            except (ValueError, RecursionError) as e:        # UnicodeDecodeError is a ValueError
                raise RequestError(400, f"the body is not valid JSON: {e}") from None
            if not isinstance(body, dict):
                raise RequestError(400, "the body must be a JSON object")
            return body

        def route(self, method: str):
            url = urllib.parse.urlsplit(self.path)
            path = url.path.rstrip("/")
            if method == "GET" and path == "/v1/models":
                return server.models()
            if method == "GET" and path == "/health":
                return {"status": "ok", "weight_version": server.version}
            if method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
                body = self.json_body()
                session = self.headers.get("X-Session-Id") or body.get("user")
                if session is not None and not isinstance(session, str):
                    raise RequestError(400, "user (the session id) must be a string", "user")
                run = server.chat if path == "/v1/chat/completions" else server.completions
                return run(body, session)
            if method == "POST" and path == "/v1/weights":
                server.authorize(self.headers)
                return server.push(self.headers, self.body(server.max_weight_bytes))
            if method == "GET" and path.startswith("/v1/sessions/"):
                server.authorize(self.headers)
                session = urllib.parse.unquote(path[len("/v1/sessions/"):])
                pop = urllib.parse.parse_qs(url.query).get("pop") in (["1"], ["true"])
                calls = server.capture.pop(session) if pop else server.capture.calls(session)
                return {"session": session, "calls": [dataclasses.asdict(c) for c in calls]}
            known = path in ("/v1/models", "/health", "/v1/chat/completions", "/v1/completions", "/v1/weights")
            raise RequestError(405 if known else 404, f"{method} {url.path} is not served here")

        def handle_method(self, method: str):
            try:
                self.answer(200, self.route(method))
            except RequestError as e:
                if e.status in (411, 413):                   # the body was not read: the connection cannot go on
                    self.close_connection = True
                self.answer(e.status, e.body())
            except ConnectionError:                          # the client left: nobody to answer
                self.close_connection = True
            except Exception as e:                           # a bug or an engine failure: say so, keep serving
                self.answer(500, RequestError(500, f"{type(e).__name__}: {e}", kind="server_error").body())

        def do_GET(self):
            self.handle_method("GET")

        def do_POST(self):
            self.handle_method("POST")

    return Handler


# -----------------------------------------------------------------------------
# the command line

def main(argv: list[str] | None = None):
    """python -m wings.serve --checkpoint DIR: serve a run's checkpoint (or any Hugging Face folder) with the torch
    engine until interrupted."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a Hugging Face folder: config.json, tokenizer.json, weights")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: a free port (printed)")
    p.add_argument("--served-model-name", default=None, help="the `model` clients ask for (default: the folder)")
    p.add_argument("--chat-format", default="qwen2.5", choices=CHAT_FORMATS)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's max_position_embeddings")
    args = p.parse_args(argv)
    try:
        check_model_folder(args.checkpoint, "--checkpoint")
    except ValueError as e:
        p.error(str(e))
    tokenizer = Tokenizer.from_file(os.path.join(args.checkpoint, "tokenizer.json"))
    engine = make_engine("torch", args.checkpoint, pad_id=pad_token_id(tokenizer), dtype=args.dtype)
    server = Server(engine, tokenizer, args.served_model_name or args.checkpoint, args.chat_format,
                    args.max_model_len, token=os.environ.get(TOKEN_ENV) or None, host=args.host, port=args.port)
    print(f"serving {server.model_name!r} on {server.start()}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
