"""sft.py: the embedded default model: our own tokenizer, a tiny Qwen2 model, and its SFT warm
start.

No weights can be downloaded on the machines this project is built on, so the default run makes its
own policy, in four steps, deterministic from `sft.seed`:
  1. expert demonstrations from the training split of each env in the run (env.demonstration):
     some call python_eval before finish, some answer directly (`sft.tool_use_prob`);
  2. a byte-level BPE tokenizer trained with `tokenizers` on those conversations, with Qwen's chat
     special tokens and one token per digit. Unlike Qwen's, its pre-tokenizer splits only at digits
     and newlines, so BPE may merge across spaces: the fixed text of the prompt (the tool list
     alone is ~200 words) becomes a handful of tokens, and a trajectory ~100 tokens instead of
     ~300. On a 2-core CPU that is the difference between minutes and a quarter of an hour; the
     chat format itself is unchanged;
  3. a tiny Qwen2-architecture model (model.init_model);
  4. supervised fine-tuning on the demonstrations (learner.sft_step: loss on assistant tokens only),
     stopped from the held-out curve, not after a fixed count: SFT accuracy jumps abruptly and the
     step at which it does varies by seed, so we check sampled held-out accuracy every `eval_every`
     steps and stop once it reaches `target_accuracy` (a minority of problems: RL needs groups with
     mixed rewards, and room to improve). With `sft.short_context_steps`, the first steps train each
     row's last `short_context_tokens` only: a warm-up for long prompts whose answer hangs on their
     last lines (a memory policy's segments, docs/memory.md), where attention spread over the whole
     prompt learns too slowly.
The result is a Hugging Face-layout folder (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with the chat template, generation_config.json) that transformers and vLLM
load. It is cached under `model.cache_dir` by a hash of everything that determines it.

Shapes: B sequences, T tokens.
Imports: model.py, distributed.py, env.py, chat.py, agent.py, batch.py, rollout.py, learner.py (and
tokenizers, torch, the standard library).
"""

import dataclasses
import hashlib
import json
import os
import random
import shutil
import time

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from agent import run_episodes
from batch import pad_right
from chat import encode, render, turn_ends
from distributed import alone, barrier, is_main
from env import make_env
from learner import LearnerConfig, make_learner, sft_step
from model import ModelConfig, init_model, save_model
from rollout import SamplingParams, make_engine, wing

# Qwen2's special tokens, in Qwen's order, so that ids line up with the family's conventions.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
# Pre-tokens: each digit alone (arithmetic is learned digit by digit), each newline alone, and the
# runs of anything else between them, which BPE is free to merge whole (the file docstring, step 2).
PRETOKENIZE = r"\p{N}|\n"


# -----------------------------------------------------------------------------
# tokenizer


def train_tokenizer(
    texts: list[str], vocab_size: int, special_tokens: list[str] = SPECIAL_TOKENS
) -> Tokenizer:
    """Byte-level BPE over the texts, special tokens first (ids 0..8 for Qwen's;
    chat_llama3.SPECIAL_TOKENS for a llama3 tokenizer), never split or merged."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def demonstration_rows(
    env, task, messages: list[dict], tokenizer: Tokenizer, cfg, max_tokens: int
) -> list[tuple[list[int], list[int]]]:
    """The (token ids, loss mask) rows a demonstration trains as: the whole conversation
    (tokenize_conversation), or under a memory policy (rollout.agent.memory, cfg an
    agent.AgentConfig; max_tokens: rollout.max_tokens) the segments it plays as, the expert's turns
    replayed through the agent loop (wings/memory.py, reached by name)."""
    if cfg.memory == "full":
        return [tokenize_conversation(messages, env.tools(), tokenizer, cfg.chat_format)]
    return wing("wings.memory.demonstration_rows")(env, task, messages, tokenizer, cfg, max_tokens)


def tokenize_conversation(
    messages: list[dict], tools: list[dict], tokenizer: Tokenizer, chat_format: str
) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of a demonstration, cut into spans exactly where the agent loop cuts
    a rollout: prompt / assistant turn (content + its end token, <|im_end|> or <|eot_id|>, mask 1)
    / observations + next prompt (mask 0). So SFT trains on the very token sequences the policy
    will later be asked to produce."""
    full = render(messages, tools, chat_format=chat_format)
    bounds = []  # (start, end) character span of each assistant turn
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = render(messages[:i], tools, add_generation_prompt=True, chat_format=chat_format)
        after = render(messages[: i + 1], tools, chat_format=chat_format)
        end = len(after.rstrip("\n"))  # the turn ends at its end token, before any "\n"
        if not (
            full.startswith(before)
            and full.startswith(after)
            and after[:end].endswith(turn_ends(chat_format))
        ):
            raise ValueError(
                f"chat format {chat_format!r} re-renders earlier turns; cannot cut turn {i}"
            )
        bounds.append((len(before), end))
    ids = []
    mask = []
    pos = 0  # characters of `full` encoded so far
    for start, end in bounds:
        for text, m in ((full[pos:start], 0), (full[start:end], 1)):
            piece = encode(tokenizer, text)
            ids += piece
            mask += [m] * len(piece)
        pos = end
    return ids, mask  # the trailing "\n" is never seen by the policy


# -----------------------------------------------------------------------------
# the default model, built once and cached


def default_model_dir(cfg, sft) -> str:
    """Cache folder named by a hash of everything the build depends on (the SFT settings, the envs,
    the chat format and the sampling settings of the early-stopping evals)."""
    r = cfg.rollout
    settings = dataclasses.asdict(sft)
    if not sft.short_context_steps:  # off: the key a model had before the warm-up existed
        del settings["short_context_steps"], settings["short_context_tokens"]
    key = json.dumps(
        {
            "sft": settings,
            "envs": [dataclasses.asdict(e) for e in cfg.envs],
            "agent": dataclasses.asdict(r.agent),
            "sampling": [r.temperature, r.top_p, r.max_tokens] + ([r.top_k] if r.top_k else []),
            "version": 1,
        },
        sort_keys=True,
    )
    return "default_model_" + hashlib.sha1(key.encode()).hexdigest()[:10]


def model_folder(cfg) -> str:
    """model.path, or the embedded default model: rank 0 builds it (build_default_model) or finds it
    cached, then every other rank finds it (train.py's entry)."""
    if cfg.model.path != "default":
        return cfg.model.path
    if is_main():
        # the other ranks wait at the barrier: no collective, no rank split in the build
        with alone():
            build_default_model(cfg)
    barrier()
    return build_default_model(cfg)


def build_default_model(cfg, log=lambda msg: print(msg, flush=True)) -> str:
    """Return the folder of the embedded default model for this config, building it if it is not
    cached. `cfg` is config.Config; only cfg.sft, cfg.envs, cfg.rollout and cfg.model.cache_dir are
    read."""
    sft = cfg.sft
    agent_cfg = cfg.rollout.agent
    if agent_cfg.chat_format != "qwen2.5":  # refused before any work, not after the SFT
        raise ValueError(
            f"the embedded default model speaks chat_format 'qwen2.5' (Qwen's chat tokens), not "
            f"{agent_cfg.chat_format!r}: set model.path to a checkpoint of that family "
            f"(docs/chat_formats.md)"
        )
    if sft.seed is None:  # follow the run's seed
        sft = dataclasses.replace(sft, seed=cfg.seed)
    out = os.path.join(cfg.model.cache_dir, default_model_dir(cfg, sft))
    if os.path.exists(os.path.join(out, "sft_log.json")):
        return out
    t0 = time.time()
    rng = random.Random(sft.seed)
    torch.manual_seed(sft.seed)
    envs = {e.name: make_env(e.name, **e.kwargs) for e in cfg.envs}

    # --- 1. demonstrations, split across envs by their weights
    total_w = sum(e.weight for e in cfg.envs)
    demos = []  # (env, task, messages)
    for e in cfg.envs:
        n = max(1, round(sft.num_demos * e.weight / total_w))
        for task in envs[e.name].sample_tasks("train", n, sft.seed):
            demos.append(
                (
                    envs[e.name],
                    task,
                    envs[e.name].demonstration(task, rng, rng.random() < sft.tool_use_prob),
                )
            )
    rng.shuffle(demos)

    # --- 2. tokenizer; each demonstration as its training rows (one, or a memory policy's segments)
    texts = [
        render(m, env.tools(), chat_format=agent_cfg.chat_format) for env, _, m in demos[:5000]
    ]
    tokenizer = train_tokenizer(texts, sft.vocab_size)
    seqs = [
        row
        for env, task, m in demos
        for row in demonstration_rows(env, task, m, tokenizer, agent_cfg, cfg.rollout.max_tokens)
    ]
    log(
        f"[sft] {len(demos)} demonstrations, vocab {tokenizer.get_vocab_size()}, "
        f"mean length {sum(len(s[0]) for s in seqs) / len(seqs):.0f} tokens"
    )

    # --- 3. tiny Qwen2 model
    pad_id = tokenizer.token_to_id("<|endoftext|>")
    model = init_model(tiny_qwen2(sft, tokenizer), seed=sft.seed)
    lcfg = LearnerConfig(lr=sft.lr, warmup_steps=20, micro_batch_size=sft.batch_size)
    state = make_learner(model, lcfg, seed=sft.seed)
    engine = make_engine(
        "torch", out, pad_id=pad_id, model=model, max_batch_size=cfg.rollout.max_batch_size
    )
    eval_tasks = [
        t
        for e in cfg.envs
        for t in envs[e.name].sample_tasks("test", max(1, sft.eval_size // len(envs)), sft.seed + 1)
    ]
    params = SamplingParams.of(cfg.rollout, seed=sft.seed)

    # --- 4. SFT until a minority of held-out problems is solved at the rollout temperature
    history = []
    order = list(range(len(seqs)))
    for step in range(1, sft.max_steps + 1):
        if (step - 1) * sft.batch_size % len(order) < sft.batch_size:
            rng.shuffle(order)  # a new epoch
        start = (step - 1) * sft.batch_size % len(order)
        rows = [seqs[i] for i in order[start : start + sft.batch_size]]
        if step <= sft.short_context_steps:  # the short-context warm-up: each row's last tokens
            rows = [
                (ids[-sft.short_context_tokens :], m[-sft.short_context_tokens :])
                for ids, m in rows
            ]
        input_ids = pad_right([ids for ids, _ in rows], pad_id, torch.long)  # (B, T)
        loss_mask = pad_right([m for _, m in rows], 0.0, torch.float)  # (B, T)
        state, metrics = sft_step(state, input_ids, loss_mask, lcfg)
        if step % sft.eval_every == 0 or step == sft.max_steps:
            trajs = run_episodes(
                engine,
                envs,
                eval_tasks,
                tokenizer,
                dataclasses.replace(agent_cfg, n_samples=1),
                params,
                seed=sft.seed,
            )
            # a plain mean over episodes: every env holds out as many tasks
            accuracy = sum(t.reward for t in trajs) / len(trajs)
            history.append(
                {
                    "step": step,
                    "loss": metrics["sft/loss"],
                    "accuracy": accuracy,
                    "seconds": time.time() - t0,
                }
            )
            log(
                f"[sft] step {step} loss {metrics['sft/loss']:.3f} sampled held-out accuracy "
                f"{accuracy:.3f} ({time.time() - t0:.0f} s)"
            )
            if accuracy >= sft.target_accuracy:
                break

    # --- write the Hugging Face folder (atomically: build in a temp dir, then rename)
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tmp)
    write_tokenizer_files(tokenizer, tmp, agent_cfg.chat_format)
    with open(os.path.join(tmp, "sft_log.json"), "w") as f:
        json.dump(
            {"history": history, "seconds": time.time() - t0, "num_demos": len(demos)}, f, indent=2
        )
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    log(f"[sft] default model written to {out} in {time.time() - t0:.0f} s")
    return out


def tiny_qwen2(sft, tokenizer: Tokenizer) -> ModelConfig:
    """The embedded default model's architecture: a Qwen2 of cfg.sft's sizes over the tokenizer's
    vocabulary, its embeddings tied to the head, <|endoftext|> its padding and <|im_end|> its end of
    turn."""
    pad_id = tokenizer.token_to_id("<|endoftext|>")
    return ModelConfig(
        model_type="qwen2",
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=sft.hidden_size,
        intermediate_size=sft.intermediate_size,
        num_hidden_layers=sft.num_layers,
        num_attention_heads=sft.num_heads,
        num_key_value_heads=sft.num_kv_heads,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_bias=True,
        qk_norm=False,
        bos_token_id=pad_id,
        eos_token_id=tokenizer.token_to_id("<|im_end|>"),
        pad_token_id=pad_id,
    )


def write_tokenizer_files(tokenizer: Tokenizer, path: str, chat_format: str) -> None:
    """tokenizer.json, tokenizer_config.json (with the chat template) and generation_config.json, as
    Qwen2 checkpoints have them, so transformers and vLLM load the folder like any Qwen model."""
    if chat_format != "qwen2.5":
        raise ValueError(
            f"the embedded default model is written with chat_format 'qwen2.5' (its jinja template "
            f"is QWEN25_CHAT_TEMPLATE), not {chat_format!r}"
        )
    os.makedirs(path, exist_ok=True)
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    added = {
        str(tokenizer.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "Qwen2Tokenizer",
                "added_tokens_decoder": added,
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "model_max_length": 2048,
                "clean_up_tokenization_spaces": False,
                "split_special_tokens": False,
                "errors": "replace",
                "chat_template": QWEN25_CHAT_TEMPLATE,
            },
            f,
            indent=2,
            ensure_ascii=False,
        )
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(
            {
                "bos_token_id": tokenizer.token_to_id("<|endoftext|>"),
                "eos_token_id": [
                    tokenizer.token_to_id("<|im_end|>"),
                    tokenizer.token_to_id("<|endoftext|>"),
                ],
                "pad_token_id": tokenizer.token_to_id("<|endoftext|>"),
                "do_sample": True,
                "temperature": 1.0,
                "top_p": 1.0,
            },
            f,
            indent=2,
        )


# -----------------------------------------------------------------------------
# the chat template written with the default model

# Jinja template of chat.py's "qwen2.5" format, written to tokenizer_config.json ("chat_template")
# of the default model so that transformers' apply_chat_template gives the same string as
# chat.render(). It is Qwen2.5's ChatML tool template, with one change borrowed from Qwen3's:
# arguments given as a JSON string are written as they are (Qwen2.5 would JSON-encode the string
# a second time). Its long lines are cut across raw-string pieces, which Python joins into one.
QWEN25_CHAT_TEMPLATE = (
    r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"""
    r"""You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and """
    r"""arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": """
    r"""<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful """
    r"""assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content if message.content is string else '' %}
        {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
)
