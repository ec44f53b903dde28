"""engine_openai.py: OpenAIEngine, a standard-library client of an OpenAI-compatible completions
server that can also push the learner's weights into it (a wing of rollout.py).

rollout.make_engine builds it by name (rollout.engine=openai). It speaks rollout.py's engine
interface (token ids in, token ids and log-probs out, update_weights(state_dict)) against a server
in another process or on another machine: it evaluates (eval.py) any server, and trains (train.py)
through a server that takes new weights:
  serve.py          POST /v1/weights with the state dict as safetensors bytes (bearer token:
                    rollout.api_key_env)
  `vllm serve`      started with VLLM_SERVER_DEV_MODE=1: the weights are written to
                    rollout.weights_dir, a folder the server reads, and the server reloads them in
                    place (its /collective_rpc reload_weights)
After every push the server's weight version must be the one pushed, or update_weights raises; then
train.py's weight-sync gate samples through the server like through any engine. Docs:
docs/engines.md.

Imports: rollout.py, wings/engine_vllm.py (what a push holds) (and torch, safetensors, the
standard library).
"""

import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors.torch import save as safetensors_save, save_file

from rollout import Generation, SamplingParams, check_state_dict, row_seeds
from wings.engine_vllm import folder_push, with_tied_head


def check_config(cfg) -> list:
    """config.WING_CHECKS' hook: rollout.api_key_env and rollout.weights_dir belong to the openai
    engine, and the token's variable must be set now, not at the first request or push. No choices
    of its own ([])."""
    rollout = cfg.rollout
    for leaf in ("api_key_env", "weights_dir"):
        if getattr(rollout, leaf) and rollout.engine != "openai":
            raise ValueError(
                f"rollout.{leaf} is for rollout.engine=openai (a server), not {rollout.engine!r}"
            )
    if rollout.api_key_env and not os.environ.get(rollout.api_key_env):
        raise ValueError(
            f"rollout.api_key_env={rollout.api_key_env!r}: that environment variable is not set "
            "(it holds the server's bearer token, e.g. wings/serve.py's NANO_SKYRL_SERVE_TOKEN)"
        )
    return []


class OpenAIEngine:
    """A client of an OpenAI-compatible `/v1/completions` endpoint, token ids in and token ids out,
    that pushes new weights into servers that take them.

    Written for `vllm serve MODEL` (whose completions API takes a prompt as a list of token ids and
    can return the sampled ids) and for serve.py, which speaks the same API; any server with the
    same extensions works. One HTTP request per prompt, up to `max_concurrency` at a time, with `n`
    samples each; a request that fails is retried `retries` times with a growing pause, then raises
    RuntimeError with the server's message.

    Request fields: prompt (ids), n, temperature, top_p, top_k (only when > 0), max_tokens, seed,
    stop_token_ids, logprobs=0 (the sampled token's log-prob), return_token_ids and
    return_tokens_as_token_ids (ids, never text), skip_special_tokens=false, and ignore_eos=true:
    like every engine, generation stops only at the loop's stop tokens, never at the EOS ids of the
    folder's generation_config.json (which `vllm serve` stops at by default). Each prompt gets its
    own seed (row_seeds of params.seed), so a call is reproducible when the server honours seeds.
    `api_key` goes with every request as `Authorization: Bearer` (serve.py's token;
    `vllm serve --api-key`).

    Log-probs are the server's. vLLM reports raw log-probs (before temperature) unless started with
    `--logprobs-mode processed_logprobs`; at temperature 1 the two are the same, at any other
    temperature a trainer needs the processed ones (the weight-sync gate fails otherwise). With
    top-k / top-p, serve.py reports each token's kept-set size (its choices' `kept_sizes`), and
    `vllm serve` does not: -1 per token, for the learner to infer the set from the log-prob
    (learner.infer_kept_sizes).

    Weights (update_weights): with `weights_dir` empty, a push is POST {base_url}/weights (serve.py)
    with the state dict as safetensors bytes; with `weights_dir`, the vLLM path
    (_reload_from_folder). Either way the server's version is read back afterwards and must be the
    one pushed: a server that answered the push but did not take it fails here, and one that took
    the version but not the weights fails the trainer's weight-sync gate.
    """

    @classmethod
    def build(
        cls,
        model_dir: str,
        *,
        base_url: str = "",
        served_model: str = "",
        api_key_env: str = "",
        weights_dir: str = "",
        **_,
    ):
        """rollout.make_engine's entry: the server at base_url, serving `served_model` (default:
        model_dir); the bearer token read from the environment variable api_key_env ("": none)."""
        api_key = None
        if api_key_env:
            api_key = os.environ.get(api_key_env)
            if not api_key:
                raise ValueError(
                    f"rollout.api_key_env={api_key_env!r}: that environment variable is not set"
                )
        return cls(
            base_url,
            served_model or model_dir,
            api_key=api_key,
            weights_dir=weights_dir,
            model_dir=model_dir,
        )

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout_s: float = 300.0,
        max_concurrency: int = 8,
        retries: int = 2,
        weights_dir: str = "",
        model_dir: str = "",
    ):
        self.base_url = base_url.rstrip("/")  # ends in /v1, as OpenAI clients expect
        self.url = self.base_url + "/completions"
        # vLLM's own endpoints
        self.root = self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url
        self.model = model  # the served model name
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.retries = retries
        # the server resolves it, not our cwd
        self.weights_dir = os.path.abspath(weights_dir) if weights_dir else ""
        self.model_dir = model_dir  # the trainer's model folder: the names and shapes a push has
        self.version = 0  # the version of the last push (0: the server's own weights)

    # -- sampling
    # -------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        seeds = row_seeds(params.seed, len(prompts))
        with ThreadPoolExecutor(
            max_workers=max(1, min(self.max_concurrency, len(prompts)))
        ) as pool:
            per_prompt = list(
                pool.map(
                    lambda i: self._complete(prompts[i], params, seeds[i]), range(len(prompts))
                )
            )
        return [g for gens in per_prompt for g in gens]  # prompt-major, like every engine

    def _complete(
        self, prompt: list[int], params: SamplingParams, seed: int | None
    ) -> list[Generation]:
        body = {
            "model": self.model,
            "prompt": list(prompt),
            "n": params.n,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_tokens,
            "logprobs": 0,
            "stop_token_ids": list(params.stop_token_ids),
            "skip_special_tokens": False,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "ignore_eos": True,
        }
        if params.top_k > 0:
            body["top_k"] = params.top_k
        if seed is not None:
            body["seed"] = seed
        reply = self._post(body)
        choices = sorted(reply.get("choices", []), key=lambda c: c.get("index", 0))
        if len(choices) != params.n:
            raise RuntimeError(f"{self.url} returned {len(choices)} choices for n={params.n}")
        return [self._generation(c, params.truncates) for c in choices]

    @staticmethod
    def _generation(choice: dict, truncated: bool) -> Generation:
        lp = choice.get("logprobs") or {}
        ids = choice.get("token_ids")
        if ids is None:
            # older servers: ids only through return_tokens_as_token_ids ("token_id:123")
            tokens = lp.get("tokens")
            if tokens is None:
                raise RuntimeError(
                    "the server returned neither token_ids nor logprobs.tokens: is it vLLM?"
                )
            ids = [int(t.rsplit(":", 1)[1]) for t in tokens]
        logprobs = [float(x) if x is not None else 0.0 for x in (lp.get("token_logprobs") or [])]
        if len(logprobs) != len(ids):
            raise RuntimeError(
                f"the server returned {len(ids)} tokens but {len(logprobs)} log-probs"
            )
        finish = "stop" if choice.get("finish_reason") == "stop" else "length"
        stop_reason = choice.get("stop_reason")
        # serve.py's; vLLM reports no kept sets
        kept = choice.get("kept_sizes") if truncated else None
        if (
            finish == "stop"
            and isinstance(stop_reason, int)
            and (not ids or ids[-1] != stop_reason)
        ):
            # a server that leaves the stop token out: our contract keeps it
            # (its log-prob is not reported)
            ids, logprobs, kept = ids + [stop_reason], logprobs + [0.0], None
        if not truncated:
            return Generation(list(ids), logprobs, finish)
        if not (isinstance(kept, list) and len(kept) == len(ids)):
            kept = [-1] * len(ids)  # not reported: the learner infers each set's size
        return Generation(list(ids), logprobs, finish, kept_sizes=[int(k) for k in kept])

    # -- HTTP
    # -------------------------------------------------------------------------

    def _post(self, body: dict) -> dict:
        return self._request("POST", self.url, json.dumps(body).encode(), retries=self.retries)

    def _request(
        self,
        method: str,
        url: str,
        data: bytes | None = None,
        headers: dict | None = None,
        retries: int = 0,
    ) -> dict:
        """One request -> its JSON answer ({} for an empty body). 5xx and unreachable: retried
        `retries` times with a growing pause; a 4xx (our request's fault) at once; then RuntimeError
        with the server's message."""
        for attempt in range(retries + 1):
            try:
                request = urllib.request.Request(
                    url, data=data, headers={**self.headers, **(headers or {})}, method=method
                )
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    text = response.read()
                    return json.loads(text) if text.strip() else {}
            except urllib.error.HTTPError as e:
                message = e.read()[:500].decode(errors="replace")
                if e.code < 500 or attempt == retries:  # a 4xx is our request's fault: do not retry
                    raise RuntimeError(f"{url} answered HTTP {e.code}: {message}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                if attempt == retries:
                    raise RuntimeError(
                        f"cannot reach {url}: {e} (is the server that rollout.engine=openai, or "
                        "rollout.judge.engine=openai, samples from running?)"
                    ) from None
            time.sleep(0.5 * 2**attempt)
        raise AssertionError("unreachable")

    # -- weights
    # -------------------------------------------------------------------------

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int | None = None):
        """Push a full state dict (Hugging Face names) into the server as `version` (default: the
        last push's + 1), then read the server's version back: RuntimeError, with the server's
        message, when the push was refused or the server does not report the version pushed. No
        retries: a push either lands once or fails loudly."""
        new = self.version + 1 if version is None else int(version)
        if self.weights_dir:
            self._reload_from_folder(state_dict, new)
        else:
            self.push(state_dict, new)
        reported = self.server_version()
        if str(reported) != str(new):
            raise RuntimeError(
                f"the server at {self.base_url} reports weight version {reported!r} after a push "
                f"of version {new}: it did not take the weights"
            )
        self.version = new

    def server_version(self) -> str | int | None:
        """The weights' version the server reports: serve.py's GET /v1/models `weight_version`;
        vLLM's GET /weight_info (a development endpoint)."""
        if self.weights_dir:
            return self._request("GET", self.root + "/weight_info").get("weight_version")
        models = self._request("GET", self.base_url + "/models").get("data") or [{}]
        return models[0].get("weight_version")

    def push(self, state_dict: dict[str, torch.Tensor], version: int) -> dict:
        """serve.py's POST /v1/weights -> the server's answer ({"version", "tensors"}): the state
        dict as safetensors bytes (tensors, nothing that can run code on the server, unlike a
        pickle; tied tensors sent as copies, which safetensors needs), the version in a header, the
        bearer token of api_key. A remote trainer's push (the version is not read back:
        update_weights does that)."""
        data = safetensors_save(
            {k: v.detach().cpu().contiguous().clone() for k, v in state_dict.items()}
        )
        try:
            return self._request(
                "POST",
                self.base_url + "/weights",
                data,
                {"Content-Type": "application/octet-stream", "X-Weight-Version": str(version)},
            )
        except RuntimeError as e:
            if "HTTP 404" in str(e) or "HTTP 405" in str(e):
                raise RuntimeError(
                    f"{e}; the server at {self.base_url} takes no weight push at POST /v1/weights: "
                    "serve.py does; for `vllm serve` set rollout.weights_dir "
                    "(docs/engines.md)"
                ) from None
            raise

    def _reload_from_folder(self, state_dict: dict[str, torch.Tensor], version: int):
        """The `vllm serve` path (VLLM_SERVER_DEV_MODE=1): write weights_dir/model.safetensors, then
        POST /collective_rpc reload_weights(weights_path=weights_dir) (vLLM's in-place reload: each
        layer through the model's load_weights, repacked as on a first load), POST
        /reset_prefix_cache (a cached prefix would keep the old model's keys and values), POST
        /update_weight_version.

        The names and shapes are checked against the model folder first
        (engine_vllm.folder_push): vLLM loads a partial file without complaint. A tied
        lm_head.weight is always written (engine_vllm.with_tied_head)."""
        if not self.model_dir:
            raise ValueError(
                "the openai engine needs the model folder (model.path) to check a push to "
                "rollout.weights_dir"
            )
        required, optional = folder_push(self.model_dir)
        check_state_dict(state_dict, required, optional)
        state_dict = with_tied_head(state_dict, optional)
        os.makedirs(self.weights_dir, exist_ok=True)
        # not read as weights until renamed
        partial = os.path.join(self.weights_dir, "model.safetensors.partial")
        save_file(
            {k: v.detach().cpu().contiguous().clone() for k, v in state_dict.items()}, partial
        )
        os.replace(partial, os.path.join(self.weights_dir, "model.safetensors"))
        try:
            self._request(
                "POST",
                self.root + "/collective_rpc",
                json.dumps(
                    {"method": "reload_weights", "kwargs": {"weights_path": self.weights_dir}}
                ).encode(),
            )
        except RuntimeError as e:
            if "HTTP 404" in str(e):
                raise RuntimeError(
                    f"{e}; the server has no /collective_rpc: start `vllm serve` with "
                    "VLLM_SERVER_DEV_MODE=1 to train through it (docs/engines.md)"
                ) from None
            raise
        self._request("POST", self.root + "/reset_prefix_cache")
        self._request(
            "POST",
            self.root + "/update_weight_version",
            json.dumps({"new_version": str(version)}).encode(),
        )

    def sleep(self):
        pass  # the server's memory is its own process's: nothing here for the learner to take

    def wake_up(self):
        pass
