"""rollout.py: the inference engines that produce RL rollouts.

Every engine speaks token ids in, token ids + log-probs out: `generate(prompts, SamplingParams)` takes a list of
token-id prompts and returns `len(prompts) * n` `Generation`s (prompt-major), each with the sampled ids and the
log-prob of every sampled id; trainable engines also take `update_weights(state_dict)` with Hugging Face names.
Text, chat templates and tools live in agent.py, so an engine never sees a string.

Here now: TorchEngine, a pure-PyTorch batched sampler with a KV cache (model.py's Transformer), and
OpenAIEngine, a standard-library HTTP client of an OpenAI-compatible completions server (`vllm serve`) for
evaluation or rollouts against a remote model. Later: a colocated vLLM engine and Ray workers.

Shapes: B rows in a batch (prompts x n), b rows still generating, L longest prompt, N max new tokens,
        V vocab, H hidden.
"""
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

from agent import Generation, SamplingParams
from model import KVCache, Transformer


def sample_tokens(logits, temperature: float, top_p: float, generator=None):
    """Pick one token per row. logits (B, V) -> (tokens (B,), logprobs (B,)).

    The log-prob reported is log softmax(logits / T) at the chosen token (T = 1 when greedy), taken *before*
    top-p truncation: it is exactly what the learner recomputes with Transformer.token_logprobs, so the
    importance ratio is 1 when the policy has not changed. (Truncation is part of the sampler, not the policy.)
    """
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)                                      # (B,)
        logp_all = torch.log_softmax(logits, dim=-1)                    # (B, V)
    else:
        logp_all = torch.log_softmax(logits / temperature, dim=-1)      # (B, V)
        probs = logp_all.exp()                                          # (B, V)
        if top_p < 1.0:
            # nucleus (Holtzman et al. 2019, https://arxiv.org/abs/1904.09751): keep the smallest top set whose
            # mass reaches top_p, i.e. drop a token once the mass ranked above it already reaches top_p; the
            # top token has nothing above it, so it always survives.
            sorted_probs, order = probs.sort(dim=-1, descending=True)   # (B, V)
            mass_above = sorted_probs.cumsum(-1) - sorted_probs         # (B, V)
            sorted_probs = sorted_probs.masked_fill(mass_above >= top_p, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)  # (B, V) back in vocab order
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)
    return tokens, logp_all.gather(-1, tokens[:, None]).squeeze(-1)


class TorchEngine:
    """Batched generation with the pure-torch model: left-pad, one prefill, then one token per step from a KV cache.

    Deterministic for a fixed (prompts, params, max_batch_size) when params.seed is set: one torch.Generator
    drives the whole call. Finished rows ride along (their extra tokens are dropped) until a quarter of the
    batch has finished; then they are removed from the batch and the KV cache.
    """

    def __init__(self, model: Transformer, pad_id: int, max_batch_size: int = 256):
        self.model = model
        self.pad_id = pad_id
        self.max_batch_size = max_batch_size

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        rows = [p for p in prompts for _ in range(params.n)]  # prompt-major: n samples of prompt 0, then 1, ...
        device = next(self.model.parameters()).device
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device).manual_seed(params.seed)
        was_training = self.model.training
        self.model.eval()
        try:
            out = []
            for s in range(0, len(rows), self.max_batch_size):
                out += self._generate_batch(rows[s:s + self.max_batch_size], params, generator, device)
        finally:
            self.model.train(was_training)  # the learner may share this model
        return out

    def _generate_batch(self, prompts, params, generator, device) -> list[Generation]:
        B, L, N = len(prompts), max(len(p) for p in prompts), params.max_tokens
        if N == 0:
            return [Generation([], [], "length") for _ in prompts]
        # Prefill each distinct prompt once (the n samples of a prompt share it), then copy its cache rows.
        distinct = {tuple(p): None for p in prompts}                       # insertion-ordered set
        index = {p: i for i, p in enumerate(distinct)}
        source = torch.tensor([index[tuple(p)] for p in prompts], device=device)  # (B,) row -> distinct prompt
        # left padding keeps every row's next token in the same column
        ids = torch.full((len(distinct), L), self.pad_id, dtype=torch.long)
        real = torch.zeros(len(distinct), L + N, dtype=torch.bool)  # key padding mask over the cache; generated = real
        for i, p in enumerate(distinct):
            ids[i, L - len(p):] = torch.tensor(p, dtype=torch.long)
            real[i, L - len(p):] = True
        ids, real = ids.to(device), real.to(device)
        positions = (real[:, :L].long().cumsum(-1) - 1).clamp(min=0)  # each row counts from its first real token
        cache = KVCache(self.model.cfg, len(distinct), L + N, dtype=self.model.lm_head.weight.dtype, device=device)
        # only the last position's logits are needed, so the lm_head skips the rest
        h = self.model.hidden_states(ids, positions, real, cache)[source, -1:]  # (B, 1, H)
        cache.keep_rows(source)
        real, next_pos = real[source], positions[source, -1:] + 1      # (B, L + N), (B, 1)

        stop_ids = torch.tensor(list(params.stop_token_ids), dtype=torch.long, device=device)
        tokens = torch.full((B, N), self.pad_id, dtype=torch.long, device=device)  # (B, N)
        logprobs = torch.zeros(B, N, device=device)                                 # (B, N)
        lengths = torch.full((B,), N, dtype=torch.long, device=device)              # (B,)
        stopped = torch.zeros(B, dtype=torch.bool, device=device)                   # (B,)
        rows = torch.arange(B, device=device)  # (b,) the original row of each row still in the batch
        for t in range(N):
            logits = self.model.lm_head(h[:, -1])                     # (b, V)
            tok, lp = sample_tokens(logits, params.temperature, params.top_p, generator)  # (b,), (b,)
            # a finished row still in the batch writes past its length; those entries are cut off below
            tokens[rows, t], logprobs[rows, t] = tok, lp
            hit = torch.isin(tok, stop_ids) & ~stopped[rows]          # (b,) rows that stop at this step
            lengths[rows[hit]] = t + 1
            stopped[rows[hit]] = True
            live = ~stopped[rows]                                     # (b,)
            if t == N - 1 or not bool(live.any()):
                break
            if 4 * int(live.sum()) <= 3 * len(rows):
                # a quarter of the batch has finished: drop those rows, so a few long samples do not
                # drag the whole batch (and its KV cache) through every remaining step
                keep = live.nonzero().squeeze(1)                      # (b',)
                rows, tok, real, next_pos = rows[keep], tok[keep], real[keep], next_pos[keep]
                cache.keep_rows(keep)
            h = self.model.hidden_states(tok[:, None], next_pos + t, real, cache)  # (b, 1, H)

        lengths, stopped = lengths.tolist(), stopped.tolist()
        tokens, logprobs = tokens.tolist(), logprobs.tolist()
        return [Generation(tokens[i][:lengths[i]], logprobs[i][:lengths[i]], "stop" if stopped[i] else "length")
                for i in range(B)]

    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, torch.Tensor]):
        """Copy a full state dict (Hugging Face names) into the model's parameters in place.

        All names and shapes are checked before anything is copied, so a bad dict leaves the model untouched.
        A tied lm_head.weight may be present or absent.
        """
        required = dict(self.model.named_parameters())                       # tied names appear once
        known = dict(self.model.named_parameters(remove_duplicate=False))   # ... and here under both names
        unknown = sorted(set(state_dict) - set(known))
        missing = sorted(set(required) - set(state_dict))
        if unknown or missing:
            raise KeyError(f"update_weights: unknown names {unknown}, missing names {missing}")
        bad = [f"{k}: {tuple(v.shape)} != {tuple(known[k].shape)}"
               for k, v in state_dict.items() if v.shape != known[k].shape]
        if bad:
            raise ValueError(f"update_weights: shape mismatch {bad}")
        for k, v in state_dict.items():
            known[k].copy_(v)


class OpenAIEngine:
    """A client of an OpenAI-compatible `/v1/completions` endpoint, token ids in and token ids out.

    Written for `vllm serve MODEL` (whose completions API takes a prompt as a list of token ids and can
    return the sampled ids); any server with the same extensions works. One HTTP request per prompt, up
    to `max_concurrency` at a time, with `n` samples each; a request that fails is retried `retries` times
    with a growing pause, then raises RuntimeError with the server's message. Standard library only.

    Request fields: prompt (ids), n, temperature, top_p, max_tokens, seed, stop_token_ids, logprobs=0 (the
    sampled token's log-prob), return_token_ids and return_tokens_as_token_ids (ids, never text), and
    skip_special_tokens=false. The seed of prompt i is derived from (params.seed, i), so a call is
    reproducible when the server honours seeds.

    Log-probs: vLLM reports raw log-probs (before temperature) unless started with
    `--logprobs-mode processed_logprobs`; at temperature 1 the two are the same. Weights cannot be pushed
    to a remote server: update_weights raises, so training must use an engine it owns.
    """

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
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrency, len(prompts)))) as pool:
            per_prompt = list(pool.map(lambda ip: self._complete(ip[1], params, ip[0]), enumerate(prompts)))
        return [g for gens in per_prompt for g in gens]      # prompt-major, like every engine

    def _complete(self, prompt: list[int], params: SamplingParams, index: int) -> list[Generation]:
        body = {"model": self.model, "prompt": list(prompt), "n": params.n, "temperature": params.temperature,
                "top_p": params.top_p, "max_tokens": params.max_tokens, "logprobs": 0,
                "stop_token_ids": list(params.stop_token_ids), "skip_special_tokens": False,
                "return_token_ids": True, "return_tokens_as_token_ids": True}
        if params.seed is not None:
            body["seed"] = (params.seed * 1_000_003 + index) % (2**31 - 1)
        reply = self._post(body)
        choices = sorted(reply.get("choices", []), key=lambda c: c.get("index", 0))
        if len(choices) != params.n:
            raise RuntimeError(f"{self.url} returned {len(choices)} choices for n={params.n}")
        return [self._generation(c, params) for c in choices]

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
