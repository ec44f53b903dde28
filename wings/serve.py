"""serve.py: an OpenAI- and Anthropic-compatible HTTP server over any of our engines that batches
the requests in flight and records, per session, every token it samples (a wing of rollout.py
and agent.py).

    # a run's checkpoint or a Hugging Face folder
    python -m wings.serve --checkpoint runs/toy_math/final --port 8000

Endpoints (https://platform.openai.com/docs/api-reference, vLLM's extensions of /v1/completions, and
https://docs.anthropic.com/en/api/messages):
  POST /v1/chat/completions  messages + tools in OpenAI's format, rendered with chat.render, sampled
                             by the engine, tool calls parsed by chat.make_action (parse_tool_calls)
                             and returned as `tool_calls`
  POST /v1/completions       prompts as text or token ids; token ids back (return_token_ids), as
                             `vllm serve` does, so engine_openai.OpenAIEngine is a client of
                             this server
  POST /v1/messages          Anthropic's Messages API, translated into a chat request by
                             serve_anthropic.py
  POST /v1/responses         OpenAI's Responses API, translated into a chat request by
                             serve_responses.py
  GET  /v1/models            the one served model, with the version of its weights
  POST /v1/weights           a trainer's push (safetensors bytes), authenticated by a bearer token
  GET  /v1/sessions/ID       a session's records (authenticated; ?pop=1 also forgets them)
OpenAI's request fields are checked, and its stream chunks written, by serve_openai.py.
The four sampling endpoints stream with stream=true: server-sent events in the dialect's own format
(OpenAI's chunks, tool calls as tool_call deltas, stream_options.include_usage; Anthropic's message
events; the Responses events). A streamed call is recorded exactly as the same call unstreamed: the
answer is built by the same code from the same samples, and only the text that can no longer change
is sent before the end (releasable).

How it runs. serve_http.py reads every connection on one asyncio event loop (a connection is a
coroutine, not a thread); this file's handlers parse and render there, hand the prompt to
batcher.py's Scheduler, and await the engine. The Scheduler's thread runs a plain TorchEngine as a
continuous batch (requests in flight share forward passes, each with its own seed: a seeded request
gives the same tokens whatever shares its batch), other engines one request at a time; pushes and
the weight-sync gate's probe run between batches, so every token's version is known. docs/serve.md
says what the server promises under load.

Thinking (the Messages and Responses dialects, a thinking chat format: Qwen3): the think block that
opens an answer is returned apart (split_thinking: Anthropic's thinking blocks, a Responses
reasoning item), and an answer that reaches Anthropic's thinking.budget_tokens goes on as a second
engine call after "</think>" is written for it (past_budget). What a dialect accepts and ignores
is counted per field in Server.ignored (GET /health); docs/serve.md has the table of every field
the agent harnesses (Claude Code, Codex, Qwen Code) send.

Capture: capture.py. A request names its session by the X-Session-Id header, OpenAI's `user` field
or Anthropic's metadata.user_id; its place in the session is reserved when the engine is given it
(serving order), and filled when its answer is complete (a client that left is not recorded,
counted). capture.session_trajectories turns a session into agent.Trajectory rows.

Weights. In-process (colocated with the trainer), Server.update_weights(state_dict, version) is the
engine's own update on the engine thread; remotely, a trainer sends the same to POST /v1/weights
(engine_openai.OpenAIEngine.push). The Server answers `generate` like an engine, so
rollout.sync_probe (through it, or through an OpenAIEngine over HTTP) and rollout.logprob_gap check
it after a push like any other engine. Docs: docs/serve.md.

Imports: tool_calls.py, chat.py, rollout.py, runs.py (the CLI's folder check), wings/capture.py,
wings/batcher.py, wings/serve_http.py, wings/serve_openai.py, wings/serve_anthropic.py,
wings/serve_responses.py (and torch,
safetensors, tokenizers, the standard library).
"""

import argparse
import asyncio
import dataclasses
import functools
import hmac
import inspect
import itertools
import json
import os
import threading
import time
import urllib.parse
from collections import Counter, OrderedDict
from dataclasses import dataclass, field, replace

import torch
from safetensors.torch import load as safetensors_load
from tokenizers import Tokenizer

from chat import (
    CHAT_FORMATS,
    encode,
    make_action,
    pad_token_id,
    parse_assistant_message,
    render,
    turn_ends,
)
from rollout import Generation, SamplingParams, make_engine, row_seeds
from runs import check_model_folder
from tool_calls import TOOL_CALL_OPEN
from wings import serve_anthropic, serve_responses
from wings.batcher import Job, Scheduler, batchable, default_memory_budget, job_bytes
from wings.capture import Call, Capture, Sample, Slot
from wings.serve_http import ClientGone, HTTPServer, Request, RequestError, Stream
from wings.serve_openai import (
    REFUSED,
    ChatChunks,
    CompletionChunks,
    chat_messages,
    number_field,
    valid_unicode,
)

# the env var holding the bearer token of /v1/weights and /v1/sessions
TOKEN_ENV = "NANO_SKYRL_SERVE_TOKEN"
# model names every server also answers to: the name the training server (external_agent.RunServer)
# and the example agents use
ALIASES = ("policy",)
SAMPLING = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
}
# the dialects translated into a chat request (serve_anthropic.py, serve_responses.py)
DIALECTS = {"messages": serve_anthropic, "responses": serve_responses}
# the chat formats whose model thinks in a <think> block that opens its answer
THINKING_FORMATS = ("qwen3",)
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
POLL_S = 0.25  # how often the watchdog looks for clients that left (Server.watch)


# -----------------------------------------------------------------------------
# requests, checked (serve_openai.py holds OpenAI's fields), and the pieces of their answers


@dataclass(frozen=True)
class Stops:
    """A request's `stop`: every string is looked for in the decoded text after sampling, and the
    completion is cut at the token that completes one; a string that is one token is also a stop id,
    so the engine stops there."""

    token_ids: tuple[int, ...]  # stop ids (the engine's stop_token_ids)
    texts: tuple[str, ...]  # every stop string


@dataclass
class Prepared:
    """A checked request, ready for the engine: its prompts (chat: one) and how its answer
    is built."""

    # "chat" | "completions" | "messages" | "responses" (Anthropic's and OpenAI's Responses, served
    # as chat)
    endpoint: str
    prompts: list[list[int]]  # (k, P) the ids the engine is given
    # seed: the request's (each of k > 1 prompts gets its rollout.row_seeds seed)
    params: SamplingParams
    stops: Stops
    messages: list = field(default_factory=list)  # chat: the conversation
    logprobs: object = None  # chat: bool; completions: 0 or None
    skip_special: bool = False  # completions: decode without special tokens
    as_ids: bool = False  # completions: return_tokens_as_token_ids
    token_ids: bool = False  # completions: return_token_ids
    # streaming: text held back until it cannot change (None: all of it)
    holds: tuple[str, ...] | None = ()
    include_usage: bool = False  # streaming: stream_options.include_usage
    # messages, responses: the think block answered apart, as thinking / reasoning (split_thinking)
    think: bool = False
    # responses: the request as sent (its answer echoes its settings)
    request: dict | None = None
    # a thinking budget (Anthropic's budget_tokens): params.max_tokens is the budget, and an answer
    # that reaches it goes on, as a second job, to this many tokens in all (Server.past_budget)
    max_tokens: int | None = None

    @property
    def chat(self) -> bool:
        return self.endpoint != "completions"


def releasable(text: str, holds: tuple[str, ...] | None) -> str:
    """The part of a partial completion's text that its final answer will start with whatever is
    sampled next: cut before any `holds` string (a tool call's opening tag, a stop string) or a
    beginning of one at the end, and without trailing whitespace or an incomplete character
    (U+FFFD). None: nothing is released before the end."""
    if holds is None:
        return ""
    cut = len(text)
    for h in holds:
        at = text.find(h)
        cut = min(cut, at) if at >= 0 else cut
        for k in range(min(len(h) - 1, len(text)), 0, -1):
            if text.endswith(h[:k]):
                cut = min(cut, len(text) - k)
                break
    return text[:cut].rstrip().rstrip("\ufffd").rstrip()


def split_thinking(text: str, final: bool = True) -> tuple[str | None, str]:
    """A thinking format's answer -> (its reasoning, the text after it), as the Messages and
    Responses dialects return them: the text of the <think> block that opens the answer without the
    newlines around it, and the rest without the newlines that begin it (chat.render writes both
    back so). None: the answer opens no think block. A partial answer (final=False) keeps back what
    may still change: a beginning of <think> or </think> at its end."""
    if not text.startswith(THINK_OPEN):
        if not final and THINK_OPEN.startswith(text):
            return None, ""
        return None, text
    close = text.find(THINK_CLOSE)
    if close >= 0:
        after = text[close + len(THINK_CLOSE) :]
        return text[len(THINK_OPEN) : close].strip("\n"), after.lstrip("\n")
    reasoning = text[len(THINK_OPEN) :]
    if not final:
        reasoning = releasable(reasoning, (THINK_CLOSE,))
    return reasoning.strip("\n"), ""


class PrefixEncoder:
    """chat.encode for the prompts a server renders, reusing the ids of the longest prefix seen
    before that ends with a turn end (<|im_end|>). The tokenizer matches special tokens before it
    splits and merges the text between them, so the ids after one do not depend on the text before
    it: encode(a + b) = encode(a) + encode(b) when `a` ends with one (a test compares the two on
    many conversations). An agent sends its whole conversation with every request; a request then
    encodes its new turns, and a session's first request its own turns after the system prompt and
    tool schemas its agent shares with every other session."""

    def __init__(self, tokenizer, boundary: str, size: int = 512, candidates: int = 4):
        self.tokenizer, self.boundary, self.id = (
            tokenizer,
            boundary,
            tokenizer.token_to_id(boundary),
        )
        # prefixes kept (least recently used dropped); ends tried
        self.size, self.candidates = size, candidates
        self.cache: OrderedDict[str, list[int]] = OrderedDict()

    def _cached(self, text: str) -> tuple[int, list[int]]:
        """(length, ids) of the longest cached prefix among the last `candidates` turn ends and
        the first."""
        ends, at = [], text.rfind(self.boundary)
        while at >= 0 and len(ends) < self.candidates:
            ends.append(at)
            at = text.rfind(self.boundary, 0, at)
        first = text.find(self.boundary)
        for at in ends + ([first] if first >= 0 and first not in ends else []):
            ids = self.cache.get(text[: at + len(self.boundary)])
            if ids is not None:
                self.cache.move_to_end(text[: at + len(self.boundary)])
                return at + len(self.boundary), ids
        return 0, []

    def __call__(self, text: str) -> list[int]:
        cut, cached = self._cached(text)
        # chat.encode, with its offsets
        rest = self.tokenizer.encode(text[cut:], add_special_tokens=False)
        ids = cached + rest.ids
        ends = [k for k, t in enumerate(rest.ids) if t == self.id]
        for k in ends[:1] + ends[-1:]:  # the system turn's end and the last one: what comes again
            self.cache[text[: cut + rest.offsets[k][1]]] = ids[: len(cached) + k + 1]
        while len(self.cache) > self.size:
            self.cache.popitem(last=False)
        return ids


# -----------------------------------------------------------------------------
# the server


class Server:
    """An engine served over HTTP, with its Capture. start() / stop() run it (port 0: a free one);
    generate / update_weights make the Server itself an engine (rollout.py's interface) for an
    in-process trainer and the weight-sync gate.

    engine: anything with generate(prompts, SamplingParams) and update_weights(state_dict)
    (rollout.py);
    tokenizer: a tokenizers.Tokenizer; model_name: the `model` clients ask for (ALIASES too);
    max_model_len: prompt + completion tokens at most (None: the engine's model's
    max_position_embeddings, if it has one); token: the bearer token of /v1/weights and /v1/sessions
    (None: those endpoints are off); session_ttl_s: a session unused for this long is forgotten;
    body_timeout_s: a request body that stops arriving is dropped after this long; threads: torch's
    CPU threads on the engine thread (None: the caller's; batcher.Scheduler says why);
    memory_budget_bytes: what the requests served together may hold at most, by batcher.job_bytes
    (a torch engine's; None: half the memory free at start, batcher.default_memory_budget): a
    request that alone needs more is refused before any tensor is made, and one that does not fit
    beside the running ones waits for them."""

    def __init__(
        self,
        engine,
        tokenizer,
        model_name: str = "default",
        chat_format: str = "qwen2.5",
        max_model_len: int | None = None,
        token: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_body_bytes: int = 4 << 20,
        max_weight_bytes: int = 16 << 30,
        default_max_tokens: int = 512,
        max_n: int = 64,
        version: int = 0,
        aliases: tuple = ALIASES,
        session_ttl_s: float = 3600.0,
        body_timeout_s: float = 5.0,
        threads: int | None = None,
        memory_budget_bytes: int | None = None,
    ):
        if chat_format not in CHAT_FORMATS:
            raise ValueError(f"unknown chat_format {chat_format!r}, expected one of {CHAT_FORMATS}")
        self.engine, self.tokenizer, self.model_name, self.chat_format = (
            engine,
            tokenizer,
            model_name,
            chat_format,
        )
        self.aliases = tuple(aliases)
        model_cfg = getattr(getattr(engine, "model", None), "cfg", None)
        self.max_model_len = max_model_len or getattr(model_cfg, "max_position_embeddings", None)
        self.vocab = getattr(model_cfg, "vocab_size", None) or tokenizer.get_vocab_size(
            with_added_tokens=True
        )
        # <|im_end|>; llama3's
        self.turn_ends = tuple(tokenizer.token_to_id(t) for t in turn_ends(chat_format))
        if None in self.turn_ends:
            raise ValueError(
                f"the tokenizer lacks the tokens that end a turn in {chat_format}: "
                f"{turn_ends(chat_format)}"
            )
        self.token, self.host, self.port = token, host, port
        self.max_body_bytes, self.max_weight_bytes = max_body_bytes, max_weight_bytes
        self.default_max_tokens, self.max_n, self.body_timeout_s = (
            default_max_tokens,
            max_n,
            body_timeout_s,
        )
        self.capture = Capture(session_ttl_s)
        # "dialect:field" -> the requests that sent a field this server ignores (GET /health)
        self.ignored: Counter[str] = Counter()
        # only a torch engine's memory is this process's to count
        torch_model = getattr(engine, "model", None) if batchable(engine) else None
        self.memory_budget = (
            None
            if torch_model is None
            else memory_budget_bytes or default_memory_budget(next(torch_model.parameters()).device)
        )
        self.scheduler = Scheduler(engine, threads, memory_budget=self.memory_budget)
        # the weights' version, stamped on every token an engine does not stamp
        self.version = version
        # numbers the tool calls returned (next() is atomic under the GIL)
        self.call_ids = itertools.count()
        # the rendered prompts' ids
        self.encode = PrefixEncoder(tokenizer, turn_ends(chat_format)[0])
        self.http: HTTPServer | None = None
        # requests waiting for the engine (the watchdog's)
        self.inflight: dict[Request, list[Job]] = {}

    # -- the engine interface (the in-process trainer's side)
    # -------------------------------------------------------

    @property
    def version(self) -> int:
        return self.scheduler.version

    @version.setter
    def version(self, value: int):
        self.scheduler.version = value

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """The engine's generate, between batches, every token stamped with the weight version that
        sampled it."""
        return self.scheduler.call(
            lambda: self.scheduler.stamp(self.engine.generate(prompts, params))
        )

    def update_weights(
        self, state_dict: dict[str, torch.Tensor], version: int | None = None
    ) -> int:
        """Push weights into the engine (names and shapes checked first: a bad dict changes nothing)
        -> the new version (default: the old one + 1). Waits for the requests being served; later
        ones sample the new weights."""

        def push():
            new = self.version + 1 if version is None else int(version)
            if "version" in inspect.signature(self.engine.update_weights).parameters:
                # it stamps its tokens (async_rollouts)
                self.engine.update_weights(state_dict, version=new)
            else:
                self.engine.update_weights(state_dict)
            self.version = new
            return new

        return self.scheduler.call(push)

    def sleep(self):  # around a colocated learner's update, as agent.LocalRollouts calls it
        self.scheduler.call(getattr(self.engine, "sleep", lambda: None))

    def wake_up(self):
        self.scheduler.call(getattr(self.engine, "wake_up", lambda: None))

    # -- requests -> Prepared
    # ---------------------------------------------------------------------------------------

    def sampling(self, body: dict, prompt_len: int, stops: Stops) -> SamplingParams:
        """OpenAI's sampling fields (and vLLM's top_k, stop_token_ids) -> SamplingParams,
        checked."""
        for key, defaults in REFUSED.items():
            if key in body and body[key] not in defaults:
                raise RequestError(400, f"{key}={body[key]!r} is not supported by this server", key)
        room = (self.max_model_len - prompt_len) if self.max_model_len else 1 << 30
        if room < 1:
            raise RequestError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {prompt_len}",
                None,
                code="context_length_exceeded",
            )
        key = (
            "max_completion_tokens"
            if body.get("max_completion_tokens") is not None
            else "max_tokens"
        )
        max_tokens = number_field(
            body, key, min(room, self.default_max_tokens), 1, 1 << 30, integer=True
        )
        if max_tokens > room:
            raise RequestError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                f"{max_tokens} in the completion)",
                key,
                code="context_length_exceeded",
            )
        top_k = number_field(body, "top_k", 0, -1, self.vocab, integer=True)
        extra = body.get("stop_token_ids") or []
        if not (
            isinstance(extra, list)
            and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab
                for t in extra
            )
        ):
            raise RequestError(
                400,
                f"stop_token_ids must be a list of token ids in [0, {self.vocab})",
                "stop_token_ids",
            )
        top_p = number_field(body, "top_p", 1.0, 0.0, 1.0)
        if top_p <= 0:
            raise RequestError(400, "top_p must be in (0, 1]", "top_p")
        params = SamplingParams(
            n=number_field(body, "n", 1, 1, self.max_n, integer=True),
            temperature=float(number_field(body, "temperature", 1.0, 0.0, 100.0)),
            top_p=float(top_p),
            top_k=max(top_k, 0),
            max_tokens=max_tokens,
            stop_token_ids=tuple(dict.fromkeys([*stops.token_ids, *extra])),
            seed=number_field(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True),
        )
        if self.memory_budget is not None:
            need = job_bytes(
                self.engine.model, prompt_len, params, self.engine.prefill_chunk_tokens
            )
            if need > self.memory_budget:
                raise RequestError(
                    400,
                    f"This request needs about {need / 2**30:.2f} GiB to serve ({params.n} x "
                    f"{prompt_len + max_tokens} tokens of keys and values, {prompt_len} in the "
                    f"prompt and {max_tokens} in the completion), more than this server's memory "
                    f"budget of {self.memory_budget / 2**30:.2f} GiB: ask for fewer tokens",
                    key,
                    code="context_length_exceeded",
                )
        return params

    def check_model(self, body: dict):
        if body.get("model") != self.model_name and body.get("model") not in self.aliases:
            raise RequestError(
                404,
                f"the model {body.get('model')!r} does not exist: this server serves "
                f"{self.model_name!r}",
                "model",
                code="model_not_found",
            )

    def session_body(self, body: dict, session: str | None) -> dict:
        """The request as it is served: here unchanged (external_agent.RunServer gives it the
        session's seed)."""
        return body

    def stops(self, body: dict) -> Stops:
        stop = body.get("stop")
        stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not (
            isinstance(stop, list)
            and len(stop) <= 16
            and all(isinstance(s, str) and s for s in stop)
        ):
            raise RequestError(
                400, "stop must be a non-empty string or a list of at most 16 of them", "stop"
            )
        ids = [encode(self.tokenizer, valid_unicode(s, "stop")) for s in stop]
        return Stops(tuple(i[0] for i in ids if len(i) == 1), tuple(stop))

    def _options(self, body: dict) -> dict:
        stream, options = body.get("stream"), body.get("stream_options") or {}
        if stream not in (None, False, True) or not isinstance(options, dict):
            raise RequestError(
                400, "stream must be true or false, stream_options an object", "stream"
            )
        return {"include_usage": bool(options.get("include_usage"))}

    def prepare_chat(self, body: dict, endpoint: str = "chat") -> Prepared:
        """POST /v1/chat/completions (https://platform.openai.com/docs/api-reference/chat/create),
        checked and rendered (and /v1/messages, translated into one)."""
        self.check_model(body)
        messages, tools = chat_messages(body)
        # vLLM's extension: {"enable_thinking": false} (qwen3)
        kwargs = body.get("chat_template_kwargs") or {}
        thinking = kwargs.get("enable_thinking") if isinstance(kwargs, dict) else "?"
        if thinking not in (None, True, False) or set(kwargs) - {"enable_thinking"}:
            raise RequestError(
                400,
                "chat_template_kwargs may hold only enable_thinking (true or false)",
                "chat_template_kwargs",
            )
        try:
            text = render(
                messages,
                tools,
                add_generation_prompt=True,
                chat_format=self.chat_format,
                enable_thinking=thinking,
            )
        except (ValueError, KeyError, TypeError) as e:
            raise RequestError(400, f"messages cannot be rendered: {e}", "messages") from None
        prompt = self.encode(valid_unicode(text, "messages"))
        stops = self.stops(body)
        params = self.sampling(
            body, len(prompt), replace(stops, token_ids=(*self.turn_ends, *stops.token_ids))
        )
        logprobs = body.get("logprobs") or False
        if not isinstance(logprobs, bool):
            raise RequestError(400, "logprobs must be true or false", "logprobs")
        holds = (TOOL_CALL_OPEN, *stops.texts) if self.chat_format.startswith("qwen") else None
        return Prepared(
            endpoint,
            [prompt],
            params,
            stops,
            messages,
            logprobs,
            holds=holds,
            **self._options(body),
        )

    def prepare_completions(self, body: dict) -> Prepared:
        """POST /v1/completions (https://platform.openai.com/docs/api-reference/completions/create)
        with vLLM's
        extensions: a prompt of token ids, top_k, stop_token_ids, return_token_ids,
        return_tokens_as_token_ids, skip_special_tokens; ignore_eos is accepted either way (our
        engines stop only at the stop ids given)."""
        self.check_model(body)
        prompts = body.get("prompt")
        if isinstance(prompts, str) or (
            isinstance(prompts, list)
            and prompts
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts)
        ):
            prompts = [prompts]
        if not (
            isinstance(prompts, list)
            and prompts
            and all(
                isinstance(p, str)
                or (
                    isinstance(p, list)
                    and p
                    and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                )
                for p in prompts
            )
        ):
            raise RequestError(
                400,
                "prompt must be a string, a non-empty list of token ids, or a list of either",
                "prompt",
            )
        prompts = [
            encode(self.tokenizer, valid_unicode(p, "prompt")) if isinstance(p, str) else p
            for p in prompts
        ]
        if any(not p or min(p) < 0 or max(p) >= self.vocab for p in prompts):
            raise RequestError(
                400,
                f"prompt token ids must be in [0, {self.vocab}) (and a prompt not empty)",
                "prompt",
            )
        logprobs = body.get("logprobs")
        if logprobs not in (None, 0) or isinstance(logprobs, bool):
            raise RequestError(
                400,
                f"logprobs={logprobs!r}: only 0 (the sampled token's log-prob) or null is "
                "supported; the engine reports no alternatives",
                "logprobs",
            )
        stops = self.stops(body)
        params = self.sampling(body, max(len(p) for p in prompts), stops)
        if len(prompts) * params.n > self.max_n:
            raise RequestError(
                400,
                f"{len(prompts)} prompts x n={params.n} samples: at most {self.max_n} per request",
                "prompt",
            )
        return Prepared(
            "completions",
            prompts,
            params,
            stops,
            logprobs=logprobs,
            skip_special=body.get("skip_special_tokens", True) is not False,
            as_ids=bool(body.get("return_tokens_as_token_ids")),
            token_ids=bool(body.get("return_token_ids")),
            holds=stops.texts,
            **self._options(body),
        )

    # -- samples -> answers
    # ----------------------------------------------------------------------------------------

    def text_of(self, prep: Prepared, ids: list[int]) -> str:
        """The text a (partial) sample gives: chat, without its stop token; completions, as they
        return it."""
        if prep.chat:
            ids = ids[:-1] if ids and ids[-1] in prep.params.stop_token_ids else ids
        return self.tokenizer.decode(ids, skip_special_tokens=prep.skip_special)

    def cut_at_text_stop(
        self, g: Generation, stops: Stops, skip_special: bool
    ) -> tuple[Generation, str | None, str | None]:
        """The generation cut after the first token whose decoded prefix holds a stop string ->
        (that generation, its text before the string, the string), or (g, None, None) when no stop
        string occurs. Causal sampling: a prefix of a sample is a sample, so the cut one is what the
        engine would have returned had it stopped there."""

        def decode(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

        if not any(s in decode(g.token_ids) for s in stops.texts):
            return g, None, None
        for k in range(len(g.token_ids)):
            text = decode(g.token_ids[: k + 1])
            found = sorted((text.index(s), s) for s in stops.texts if s in text)
            if found:
                return (
                    replace(
                        g,
                        token_ids=g.token_ids[: k + 1],
                        logprobs=g.logprobs[: k + 1],
                        finish_reason="stop",
                        kept_sizes=g.kept_sizes[: k + 1],
                        versions=g.versions[: k + 1],
                    ),
                    text[: found[0][0]],
                    found[0][1],
                )
        raise AssertionError("unreachable: the whole text holds a stop string")

    def assistant_reply(self, text: str) -> tuple[dict, str | None]:
        """A sampled assistant text -> (OpenAI's assistant message, the parse error). Well-formed
        calls become tool_calls with their arguments as JSON strings written as chat.render writes
        them, so a client that sends the message back re-renders the very text sampled; a malformed
        call stays in the content, as text."""
        # tool_calls.parse_tool_calls for the Qwen formats
        action = make_action(text, self.chat_format)
        calls, error = action.tool_calls, action.parse_error
        message = {"role": "assistant", "content": text}
        if calls and error is None:
            # content: the text before the calls
            canonical = parse_assistant_message(text, self.chat_format)
            content = canonical["content"]
            # not as render() writes them: the next turn branches
            if len(canonical.get("tool_calls", [])) != len(calls):
                content = (
                    text.split(TOOL_CALL_OPEN)[0].rstrip("\n") if TOOL_CALL_OPEN in text else ""
                )
            number = next(self.call_ids)
            message = {
                "role": "assistant",
                "content": content or None,
                "tool_calls": [
                    {
                        "id": f"call_{number}_{j}",
                        "type": "function",
                        "function": {
                            "name": c.name,
                            "arguments": json.dumps(c.arguments, ensure_ascii=False),
                        },
                    }
                    for j, c in enumerate(calls)
                ],
            }
        return message, error

    def chat_choice(self, prep: Prepared, i: int, g: Generation) -> tuple[dict, Sample, str | None]:
        """One chat sample -> (its choice, its Sample, the stop string that cut it)."""
        g, content, stop_text = self.cut_at_text_stop(g, prep.stops, skip_special=False)
        if content is None:  # the stop token (<|im_end|>, a stop id) is not part of the message
            content = self.text_of(prep, g.token_ids)
        message, error = self.assistant_reply(content)
        sample = Sample(
            list(g.token_ids),
            list(g.logprobs),
            list(g.kept_sizes),
            list(g.versions),
            g.finish_reason,
            len(message.get("tool_calls", [])),
            error,
            message,
        )
        finish = (
            "length"
            if g.finish_reason == "length"
            else "tool_calls"
            if "tool_calls" in message
            else "stop"
        )
        return (
            {
                "index": i,
                "message": message,
                "finish_reason": finish,
                "logprobs": {"content": self.token_logprobs(g, False)} if prep.logprobs else None,
            },
            sample,
            stop_text,
        )

    def completion_choice(
        self, prep: Prepared, i: int, g: Generation
    ) -> tuple[dict, Sample, str | None]:
        g, text, stop_text = self.cut_at_text_stop(g, prep.stops, skip_special=prep.skip_special)
        stop_reason = g.token_ids[-1] if g.finish_reason == "stop" and text is None else None
        text = self.text_of(prep, g.token_ids) if text is None else text
        choice = {
            "index": i,
            "text": text,
            "finish_reason": g.finish_reason,
            "stop_reason": stop_reason,
            "logprobs": None
            if prep.logprobs is None
            else {
                "tokens": [t["token"] for t in self.token_logprobs(g, prep.as_ids)],
                "token_logprobs": list(g.logprobs),
                "top_logprobs": None,
                "text_offset": None,
            },
            **({"token_ids": list(g.token_ids)} if prep.token_ids else {}),
            # ours (vLLM has no such field): the top-k / top-p set sizes, so that a trainer's
            # OpenAIEngine scores the very sets sampled (empty: nothing was truncated)
            **({"kept_sizes": list(g.kept_sizes)} if g.kept_sizes else {}),
        }
        return (
            choice,
            Sample(
                list(g.token_ids),
                list(g.logprobs),
                list(g.kept_sizes),
                list(g.versions),
                g.finish_reason,
            ),
            stop_text,
        )

    def answer(
        self,
        prep: Prepared,
        gens: list[list[Generation]],
        before: tuple[Generation, list[int]] | None = None,
    ) -> tuple[dict, list[Call], list[str | None]]:
        """The engine's samples (per prompt) -> (the OpenAI reply, one Call per prompt, each
        choice's stop string). before: an answer that went on past its thinking budget (its first
        job's generation, the ids that closed its think block), its second job's in `gens`."""
        if before is not None:
            return self.answer_past_budget(prep, gens[0][0], *before)
        build = self.chat_choice if prep.chat else self.completion_choice
        choices, calls, stop_texts = [], [], []
        for prompt, per_prompt in zip(prep.prompts, gens):
            samples = []
            for g in per_prompt:
                choice, sample, stop_text = build(prep, len(choices), g)
                choices.append(choice)
                samples.append(sample)
                stop_texts.append(stop_text)
            calls.append(Call(prep.endpoint, list(prompt), samples, messages=prep.messages))
        for choice in choices if prep.think else []:
            # a copy: the Sample records the message as a chat completion returns it
            reasoning, content = split_thinking(choice["message"]["content"] or "")
            choice["message"] = {
                **choice["message"],
                "content": content or None,
                "reasoning_content": reasoning,
            }
        kind = "chat.completion" if prep.chat else "text_completion"
        return (
            self.reply(kind, choices, sum(len(p) for p in prep.prompts), calls),
            calls,
            stop_texts,
        )

    def answer_past_budget(
        self, prep: Prepared, g: Generation, first: Generation, added: list[int]
    ) -> tuple[dict, list[Call], list[str | None]]:
        """An answer sampled by two jobs (past_budget): the reply of the whole text, and two Calls,
        each with what its job sampled, so the ids that closed the think block are recorded as
        prompt ids (the second call's), never as sampled ones."""
        pad = len(added)
        joined = Generation(
            first.token_ids + added + g.token_ids,
            first.logprobs + [0.0] * pad + g.logprobs,
            g.finish_reason,
            versions=first.versions + first.versions[-1:] * pad + g.versions,
            kept_sizes=first.kept_sizes + [0] * pad + g.kept_sizes if first.kept_sizes else [],
        )
        reply, (call,), stop_texts = self.answer(prep, [[joined]])
        whole, at = call.samples[0], len(first.token_ids) + pad
        cut = {
            k: getattr(whole, k)[at:] for k in ("token_ids", "logprobs", "kept_sizes", "versions")
        }
        head = Sample(
            list(first.token_ids),
            list(first.logprobs),
            list(first.kept_sizes),
            list(first.versions),
            first.finish_reason,
        )
        rest = replace(call, prompt_ids=call.prompt_ids + head.token_ids + added)
        calls = [replace(call, samples=[head]), replace(rest, samples=[replace(whole, **cut)])]
        sampled = len(head.token_ids) + len(cut["token_ids"])
        usage = reply["usage"]
        usage.update(completion_tokens=sampled, total_tokens=usage["prompt_tokens"] + sampled)
        return reply, calls, stop_texts

    def token_logprobs(self, g: Generation, as_ids: bool) -> list[dict]:
        tokens = [
            f"token_id:{t}" if as_ids else self.tokenizer.decode([t], skip_special_tokens=False)
            for t in g.token_ids
        ]
        return [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(tokens, g.logprobs)
        ]

    def reply(self, kind: str, choices: list, prompt_tokens: int, calls: list[Call]) -> dict:
        completion = sum(len(s.token_ids) for c in calls for s in c.samples)
        return {
            "id": f"{kind.split('.')[0]}-{time.time_ns()}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
            },
        }

    # -- the sampling endpoints
    # ------------------------------------------------------------------------------------

    def translate(self, endpoint: str, body: dict) -> tuple[dict, str | None, dict]:
        """A Messages or Responses request -> (the chat request it stands for, the session it names,
        how its answer is built: Prepared's think and request). Whether the model thinks: a thinking
        format (Qwen3) as the request says; another format serves a request that asks for thinking
        without it, counted. Every field ignored is counted in self.ignored."""
        chat, session, ignored, think = DIALECTS[endpoint].to_chat(body)
        thinks = self.chat_format in THINKING_FORMATS
        if think and not thinks:
            ignored.append("thinking")
        if thinks and think is not None:
            chat["chat_template_kwargs"] = {"enable_thinking": think is not False}
        for name in ignored:
            self.ignored[f"{endpoint}:{name}"] += 1
        answer = {
            "think": thinks and think is not False,
            "request": body if endpoint == "responses" else None,
        }
        # True is an int too: only a number of tokens is a budget
        if thinks and type(think) is int:
            answer["max_tokens"] = think
        return chat, session, answer

    async def sample(self, request: Request, endpoint: str) -> dict | Stream:
        """POST /v1/chat/completions, /v1/completions, /v1/messages or /v1/responses: checked,
        reserved in its session (serving order), handed to the engine, answered (or streamed) and
        recorded once its answer is complete."""
        body = await request.json(self.max_body_bytes)
        session = request.header("x-session-id")
        answer = {}
        if endpoint in DIALECTS:
            body, user, answer = self.translate(endpoint, body)
            session = session or user
        session = session or body.get("user")
        if session is not None and not isinstance(session, str):
            raise RequestError(400, "user (the session id) must be a string", "user")
        body = self.session_body(body, session)
        prep = (
            self.prepare_completions(body)
            if endpoint == "completions"
            else replace(self.prepare_chat(body, endpoint), **answer)
        )
        if endpoint in DIALECTS and prep.params.n != 1:
            raise RequestError(400, "n: one message per request", "n")
        if prep.max_tokens is not None:
            # the first job samples the thinking budget; the answer may go on to max_tokens
            budget = replace(prep.params, max_tokens=min(prep.max_tokens, prep.params.max_tokens))
            prep = replace(prep, params=budget, max_tokens=prep.params.max_tokens)
        slots = [self.capture.reserve(session) for _ in prep.prompts]
        queue = asyncio.Queue() if body.get("stream") else None
        jobs = self.submit(prep, queue)
        if queue is not None:
            return Stream(self.stream(request, prep, jobs, slots, queue))
        try:
            gens = await self.wait(request, jobs)
            more, before = self.past_budget(prep, gens[0][0]), None
            if more is not None:  # the answer goes on past its thinking budget
                before = gens[0][0], more[1]
                slots.append(self.capture.reserve(session))
                jobs += self.submit(replace(prep, prompts=[more[0]], params=more[2]), None)
                gens = await self.wait(request, jobs[1:])
            if request.gone():  # its answer would reach nobody: not recorded (a resend will be)
                raise ClientGone()
        except BaseException as e:
            self.drop(jobs, slots, disconnected=isinstance(e, ClientGone))
            raise
        reply, calls, stop_texts = self.answer(prep, gens, before)
        for slot, call in zip(slots, calls):
            self.capture.record(slot, call)
        if endpoint == "messages":
            return serve_anthropic.message(reply, stop_texts[0])
        if endpoint == "responses":
            return serve_responses.response(reply, prep.request)
        return reply

    def past_budget(
        self, prep: Prepared, g: Generation
    ) -> tuple[list[int], list[int], SamplingParams] | None:
        """A thinking answer whose first job used up the thinking budget goes on as a second job:
        from the prompt, the answer so far and, when its think block is still open, the ids of
        "\n</think>\n\n", which close it (not sampled, so never trained) -> (that prompt, the ids
        added, its params: the tokens left of max_tokens), or None when the answer is complete."""
        if prep.max_tokens is None or g.finish_reason != "length":
            return None
        text = self.tokenizer.decode(g.token_ids, skip_special_tokens=False)
        if any(stop in text for stop in prep.stops.texts):
            return None
        close = "" if THINK_CLOSE in text else "\n" + THINK_CLOSE + "\n\n"
        added = encode(self.tokenizer, close) if close else []
        left = prep.max_tokens - len(g.token_ids) - len(added)
        if left < 1:
            return None
        seed = None if prep.params.seed is None else prep.params.seed + 1
        params = replace(prep.params, max_tokens=left, seed=seed)
        return prep.prompts[0] + list(g.token_ids) + added, added, params

    def submit(self, prep: Prepared, queue: asyncio.Queue | None) -> list[Job]:
        """A Job per prompt (one prompt: the request's seed; k > 1: rollout.row_seeds). With a
        queue, every step's new tokens and each job's end are put on it, from the engine thread:
        (prompt index, {sample: ids} | None)."""
        seeds = (
            [prep.params.seed]
            if len(prep.prompts) == 1
            else row_seeds(prep.params.seed, len(prep.prompts))
        )
        jobs = []
        for i, (prompt, seed) in enumerate(zip(prep.prompts, seeds)):
            put = functools.partial(self.http.run, queue.put_nowait) if queue is not None else None
            job = self.scheduler.submit(
                prompt,
                replace(prep.params, seed=seed),
                (lambda new, i=i: put((i, new))) if put else None,
            )
            if put:
                job.future.add_done_callback(lambda _, i=i: put((i, None)))
            jobs.append(job)
        return jobs

    async def wait(self, request: Request, jobs: list[Job]) -> list[list[Generation]]:
        """The jobs' generations, or ClientGone when the watchdog cancelled them (their
        client left)."""
        self.inflight[request] = jobs
        try:
            results = await asyncio.gather(
                *(asyncio.wrap_future(j.future) for j in jobs), return_exceptions=True
            )
        finally:
            del self.inflight[request]
        if any(isinstance(r, asyncio.CancelledError) for r in results):
            raise ClientGone()
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    async def watch(self):
        """The watchdog, on the event loop: every POLL_S, the jobs of a request whose client left
        are cancelled (one timer for the whole server rather than one per waiting request)."""
        while True:
            await asyncio.sleep(POLL_S)
            for request, jobs in list(self.inflight.items()):
                if request.gone():
                    for job in jobs:
                        self.scheduler.cancel(job)

    def drop(self, jobs: list[Job], slots: list[Slot], disconnected: bool):
        """A call that will not be recorded: its jobs cancelled (they leave the batch), its places
        left empty."""
        for job in jobs:
            self.scheduler.cancel(job)
        for slot in slots:
            self.capture.abandon(slot, disconnected)

    async def stream(
        self,
        request: Request,
        prep: Prepared,
        jobs: list[Job],
        slots: list[Slot],
        queue: asyncio.Queue,
    ):
        """The events of a streamed answer: text as it becomes releasable, then the rest of the
        answer built exactly as unstreamed; recorded just before its last event ([DONE],
        message_stop), and taken back if that event cannot be written. A client that leaves first is
        not recorded."""
        reply_id, n = f"chatcmpl-{time.time_ns()}", prep.params.n
        if prep.endpoint == "messages":
            fmt = serve_anthropic.Events(reply_id, self.model_name, len(prep.prompts[0]))
        elif prep.endpoint == "responses":
            fmt = serve_responses.Events(reply_id, self.model_name, prep.request)
        else:
            chunks = ChatChunks if prep.chat else CompletionChunks
            fmt = chunks(reply_id, self.model_name, prep.include_usage)
        ids = [[] for _ in range(len(jobs) * n)]
        # per choice, what was sent: [its reasoning (None: none yet), its text]
        sent = [[None, ""] for _ in range(len(jobs) * n)]
        outcome = "gone"
        try:
            for event in fmt.start(len(ids)):
                yield event
            ended, self.inflight[request], before = 0, jobs, None
            while ended < len(jobs):
                # a step's tokens, or a job's end (the watchdog's cancel included)
                i, new = await queue.get()
                if request.gone() or any(job.future.cancelled() for job in jobs):
                    raise ClientGone()
                ended += new is None
                first = jobs[0].future
                if new is None and len(jobs) == 1 and first.exception() is None:
                    more = self.past_budget(prep, first.result()[0])
                    if more is not None:  # the answer goes on past its thinking budget
                        before = first.result()[0], more[1]
                        slots.append(self.capture.reserve(slots[0].session))
                        jobs += self.submit(replace(prep, prompts=[more[0]], params=more[2]), queue)
                        new = {0: more[1]}
                for s, tokens in (new or {}).items():
                    c = i * n + s
                    ids[c] += tokens
                    text = releasable(self.text_of(prep, ids[c]), prep.holds)
                    pieces = split_thinking(text, final=False) if prep.think else (None, text)
                    for event in self.deltas(fmt, c, sent[c], *pieces):
                        yield event
            try:
                gens = [job.future.result() for job in jobs]
                reply, calls, stop_texts = self.answer(prep, gens[-1:] if before else gens, before)
            except Exception as e:  # the engine failed: an error event, nothing recorded
                outcome = "error"
                for event in fmt.error(
                    RequestError(500, f"{type(e).__name__}: {e}", kind="server_error")
                ):
                    yield event
                return
            for c, choice in enumerate(reply["choices"]):
                if prep.chat:
                    message = choice["message"]
                    pieces = message.get("reasoning_content"), message["content"] or ""
                else:
                    pieces = None, choice["text"]
                for event in self.deltas(fmt, c, sent[c], *pieces) + fmt.end(
                    c, choice, stop_texts[c]
                ):
                    yield event
            for slot, call in zip(slots, calls):
                # recorded before the last event: a client that reads its session
                self.capture.record(slot, call)  # as soon as the stream ends finds the call there
            outcome = "recorded"
            for event in fmt.done(reply["usage"]):
                yield event
            outcome = "done"
        finally:
            self.inflight.pop(request, None)
            if outcome != "done":
                # "recorded": the client left during the last event, taken back here
                self.drop(jobs, slots, disconnected=outcome in ("gone", "recorded"))

    @staticmethod
    def deltas(fmt, c: int, sent: list, reasoning: str | None, text: str) -> list[bytes]:
        """The events that bring choice c's stream from what it sent (sent = [reasoning, text],
        updated) to these pieces of its answer: the reasoning's new part (fmt.thinking), then the
        text's (fmt.text). What was sent is a prefix of the pieces: releasable() and
        split_thinking(final=False) send only what stays."""
        out = []
        if reasoning is not None and (sent[0] is None or len(reasoning) > len(sent[0])):
            assert reasoning.startswith(sent[0] or ""), (reasoning, sent[0])
            out += fmt.thinking(c, reasoning[len(sent[0] or "") :])
            sent[0] = reasoning
        if len(text) > len(sent[1]):
            assert text.startswith(sent[1]), (text, sent[1])
            out += fmt.text(c, text[len(sent[1]) :])
            sent[1] = text
        return out

    # -- the other endpoints
    # ---------------------------------------------------------------------------------------

    def models(self) -> dict:
        """GET /v1/models (https://platform.openai.com/docs/api-reference/models/list), plus the
        weights' version."""
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "nano-skyrl",
                    "weight_version": self.version,
                    "max_model_len": self.max_model_len,
                }
            ],
        }

    def push(self, headers: dict, data: bytes) -> dict:
        """POST /v1/weights: safetensors bytes of a state dict (Hugging Face names), the version in
        the X-Weight-Version header."""
        version = headers.get("x-weight-version")
        try:
            version = None if version is None else int(version)
            state_dict = safetensors_load(data)
        except Exception as e:  # not an int, not safetensors
            raise RequestError(
                400, f"the body must be safetensors bytes and X-Weight-Version an integer: {e}"
            )
        try:
            return {"version": self.update_weights(state_dict, version), "tensors": len(state_dict)}
        except (KeyError, ValueError) as e:  # rollout.check_state_dict: nothing was copied
            raise RequestError(400, str(e).strip("'\"")) from None

    def authorize(self, request: Request):
        if self.token is None:
            raise RequestError(
                403,
                f"this endpoint is off: start the server with a token ({TOKEN_ENV})",
                kind="permission_error",
            )
        given = request.header("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            raise RequestError(
                401,
                "a valid 'Authorization: Bearer <token>' header is required",
                kind="authentication_error",
            )

    async def handle(self, request: Request) -> dict | Stream:
        """Route one request (serve_http.HTTPServer calls this for each); a known path with another
        method is a 405, an unknown one a 404, both as JSON."""
        path = request.path.rstrip("/")
        # HEAD is answered as GET, without the body (serve_http)
        method = "GET" if request.method == "HEAD" else request.method
        try:
            if path in SAMPLING and method == "POST":
                return await self.sample(request, SAMPLING[path])
            if path == "/v1/models" and method == "GET":
                return self.models()
            if path in ("", "/health") and method == "GET":
                ignored = dict(self.ignored)
                return {"status": "ok", "weight_version": self.version, "ignored": ignored}
            if path == "/v1/weights" and method == "POST":
                self.authorize(request)  # before the body: a refused push is not read
                data = await request.body(self.max_weight_bytes)
                return await asyncio.get_running_loop().run_in_executor(
                    None, self.push, request.headers, data
                )
            if path.startswith("/v1/sessions/") and method == "GET":
                self.authorize(request)
                session = urllib.parse.unquote(path[len("/v1/sessions/") :])
                calls = (
                    self.capture.pop(session)
                    if request.query.get("pop") in (["1"], ["true"])
                    else self.capture.calls(session)
                )
                return {"session": session, "calls": [dataclasses.asdict(c) for c in calls]}
            known = path in (
                *SAMPLING,
                "",
                "/v1/models",
                "/health",
                "/v1/weights",
            ) or path.startswith("/v1/sessions/")
            raise RequestError(405 if known else 404, f"{method} {request.path} is not served here")
        except RequestError as e:
            e.dialect = "anthropic" if path == "/v1/messages" else "openai"
            raise

    # -- running
    # -------------------------------------------------------------------------

    def start(self) -> str:
        """Serve from background threads (the event loop's and the engine's) -> the base URL (ending
        in /v1, as OpenAI clients expect; Anthropic's client takes it without the /v1)."""
        self.scheduler.start()
        self.http = HTTPServer(
            self.handle, self.host, self.port, body_timeout_s=self.body_timeout_s
        )
        self.address = self.http.start()
        self.watchdog = asyncio.run_coroutine_threadsafe(self.watch(), self.http.loop)
        return self.url

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}/v1"

    def stop(self):
        if self.http is not None:
            self.watchdog.cancel()
            self.http.stop()
            self.http = None
        self.scheduler.stop()


# -----------------------------------------------------------------------------
# the command line


def main(argv: list[str] | None = None):
    """python -m wings.serve --checkpoint DIR: serve a run's checkpoint (or any Hugging Face folder)
    with the torch engine until interrupted."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        help="a Hugging Face folder: config.json, tokenizer.json, weights",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: a free port (printed)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help=(
            "the `model` clients ask for (default: the folder); "
            f"more names are aliases, as are {ALIASES}"
        ),
    )
    p.add_argument("--chat-format", default="qwen2.5", choices=CHAT_FORMATS)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="default: the model's max_position_embeddings",
    )
    p.add_argument("--max-batch-size", type=int, default=256, help="rows sampled together at most")
    p.add_argument(
        "--memory-budget-gb",
        type=float,
        default=None,
        help="memory the requests served together may hold (default: half of what is free)",
    )
    p.add_argument(
        "--session-ttl", type=float, default=3600.0, help="seconds an unused session is kept"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads of the engine (default: torch's)",
    )
    args = p.parse_args(argv)
    try:
        check_model_folder(args.checkpoint, "--checkpoint")
    except ValueError as e:
        p.error(str(e))
    tokenizer = Tokenizer.from_file(os.path.join(args.checkpoint, "tokenizer.json"))
    engine = make_engine(
        "torch",
        args.checkpoint,
        pad_id=pad_token_id(tokenizer),
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
    )
    names = args.served_model_name or [args.checkpoint]
    server = Server(
        engine,
        tokenizer,
        names[0],
        args.chat_format,
        args.max_model_len,
        token=os.environ.get(TOKEN_ENV) or None,
        host=args.host,
        port=args.port,
        aliases=(*names[1:], *ALIASES),
        session_ttl_s=args.session_ttl,
        threads=args.threads,
        memory_budget_bytes=int(args.memory_budget_gb * 2**30) if args.memory_budget_gb else None,
    )
    print(f"serving {server.model_name!r} on {server.start()}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
