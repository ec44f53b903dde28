"""engine_openai.py: OpenAIEngine, a standard-library client of an OpenAI-compatible completions server (a wing of
rollout.py).

rollout.make_engine builds it by name (rollout.engine=openai). It speaks rollout.py's engine interface (token ids
in, token ids and log-probs out) against a remote server such as `vllm serve`, whose weights it cannot change: it
evaluates (eval.py), and train.py refuses it. Docs: docs/engines.md.

Imports: rollout.py (and the standard library).
"""
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from rollout import Generation, SamplingParams, row_seeds


class OpenAIEngine:
    """A client of an OpenAI-compatible `/v1/completions` endpoint, token ids in and token ids out.

    Written for `vllm serve MODEL` (whose completions API takes a prompt as a list of token ids and can
    return the sampled ids); any server with the same extensions works. One HTTP request per prompt, up
    to `max_concurrency` at a time, with `n` samples each; a request that fails is retried `retries` times
    with a growing pause, then raises RuntimeError with the server's message. Standard library only.

    Request fields: prompt (ids), n, temperature, top_p, top_k (only when > 0), max_tokens, seed, stop_token_ids,
    logprobs=0 (the sampled token's log-prob), return_token_ids and return_tokens_as_token_ids (ids, never text),
    skip_special_tokens=false, and ignore_eos=true: like every engine, generation stops only at the loop's stop
    tokens, never at the EOS ids of the folder's generation_config.json (which `vllm serve` stops at by default).
    Each prompt gets its own seed (row_seeds of params.seed), so a call is reproducible when the server honours
    seeds.

    Log-probs: vLLM reports raw log-probs (before temperature) unless started with
    `--logprobs-mode processed_logprobs`; at temperature 1 the two are the same. With top-k / top-p the server
    samples from the truncated distribution and the kept sizes are -1 (not reported); whether the log-probs are
    of the truncated distribution depends on that same server flag, which a client cannot see. None of it
    reaches a learner: weights cannot be pushed to a remote server, update_weights raises, and train.py refuses
    this engine (evaluation only).
    """

    @classmethod
    def build(cls, model_dir: str, *, base_url: str = "", served_model: str = "", **_):
        """rollout.make_engine's entry: the server at base_url, serving `served_model` (default: model_dir)."""
        return cls(base_url, served_model or model_dir)

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout_s: float = 300.0,
                 max_concurrency: int = 8, retries: int = 2):
        self.url = base_url.rstrip("/") + "/completions"   # base_url ends in /v1, as OpenAI clients expect
        self.model = model                                 # the served model name
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.retries = retries

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        seeds = row_seeds(params.seed, len(prompts))
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrency, len(prompts)))) as pool:
            per_prompt = list(pool.map(lambda i: self._complete(prompts[i], params, seeds[i]), range(len(prompts))))
        return [g for gens in per_prompt for g in gens]      # prompt-major, like every engine

    def _complete(self, prompt: list[int], params: SamplingParams, seed: int | None) -> list[Generation]:
        body = {"model": self.model, "prompt": list(prompt), "n": params.n, "temperature": params.temperature,
                "top_p": params.top_p, "max_tokens": params.max_tokens, "logprobs": 0,
                "stop_token_ids": list(params.stop_token_ids), "skip_special_tokens": False,
                "return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True}
        if params.top_k > 0:
            body["top_k"] = params.top_k
        if seed is not None:
            body["seed"] = seed
        reply = self._post(body)
        choices = sorted(reply.get("choices", []), key=lambda c: c.get("index", 0))
        if len(choices) != params.n:
            raise RuntimeError(f"{self.url} returned {len(choices)} choices for n={params.n}")
        truncated = params.truncates
        return [replace(g, kept_sizes=[-1] * len(g.token_ids)) if truncated else g
                for g in (self._generation(c, params) for c in choices)]

    @staticmethod
    def _generation(choice: dict, params: SamplingParams) -> Generation:
        lp = choice.get("logprobs") or {}
        ids = choice.get("token_ids")
        if ids is None:   # older servers: ids only through return_tokens_as_token_ids ("token_id:123")
            tokens = lp.get("tokens")
            if tokens is None:
                raise RuntimeError("the server returned neither token_ids nor logprobs.tokens: is it vLLM?")
            ids = [int(t.rsplit(":", 1)[1]) for t in tokens]
        logprobs = [float(x) if x is not None else 0.0 for x in (lp.get("token_logprobs") or [])]
        if len(logprobs) != len(ids):
            raise RuntimeError(f"the server returned {len(ids)} tokens but {len(logprobs)} log-probs")
        finish = "stop" if choice.get("finish_reason") == "stop" else "length"
        stop_reason = choice.get("stop_reason")
        if finish == "stop" and isinstance(stop_reason, int) and (not ids or ids[-1] != stop_reason):
            # a server that leaves the stop token out: our contract keeps it (its log-prob is not reported)
            ids, logprobs = ids + [stop_reason], logprobs + [0.0]
        return Generation(list(ids), logprobs, finish)

    def _post(self, body: dict) -> dict:
        data = json.dumps(body).encode()
        for attempt in range(self.retries + 1):
            try:
                request = urllib.request.Request(self.url, data=data, headers=self.headers, method="POST")
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as e:
                message = e.read()[:500].decode(errors="replace")
                if e.code < 500 or attempt == self.retries:    # a 4xx is our request's fault: do not retry
                    raise RuntimeError(f"{self.url} answered HTTP {e.code}: {message}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                if attempt == self.retries:
                    raise RuntimeError(f"cannot reach {self.url}: {e}") from None
            time.sleep(0.5 * 2 ** attempt)
        raise AssertionError("unreachable")

    def update_weights(self, state_dict):
        raise NotImplementedError("the openai engine talks to a remote server whose weights it cannot change: "
                                  "use it for evaluation (eval.py), or train with rollout.engine=torch")
