"""examples/harness_agent.py: the agent harnesses people use, run unchanged, as the external agent
of a training run (rollout.external_agent=examples/harness_agent.py:claude_code, :codex or
:qwen_code; docs/external_agent.md).

    python train.py --config configs/toy_math.yaml \
        rollout.external_agent=examples/harness_agent.py:claude_code

Each episode launches one harness headless (Claude Code `claude -p`, Codex `codex exec`, Qwen Code
`qwen -p`) in a fresh working folder with a fresh HOME, pointed at the run's server, with the task's
prompt as its only instruction. The harness plays its own session: its own system prompt, its own
tools (its shell tool runs commands in the working folder without asking), as many turns as it
likes. The server's session id reaches it as the X-Session-Id header of every request (each harness
has a documented way to add a header), so the server records the session token for token. What the
harness prints last is the episode's answer, graded by the env's own grader.

The harnesses are the versions harnesses/package.json pins, installed by `bash setup.sh test` into
harnesses/node_modules (Node.js 20). Each is kept off the network but for the server by its own
documented switches: telemetry, error reports, update checks and plugin syncs off (CLAUDE_ENV,
CODEX_CONFIG, QWEN_SETTINGS).

Which wire each speaks: Claude Code Anthropic's Messages API (POST /v1/messages?beta=true), Codex
OpenAI's Responses API (POST /v1/responses), Qwen Code OpenAI's chat completions; all streamed.

Nothing here imports this repository: the file is what a user's agent looks like.
"""

import json
import os
import shutil
import signal
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "harnesses", "node_modules", ".bin")
MODEL = "policy"  # a name every serve.Server answers to
timeout_s = 600.0  # seconds an episode may take; train.py reads this attribute of each agent

# Claude Code (https://code.claude.com/docs/en/env-vars): no telemetry, error reports, feedback
# command or auto-updater; NONESSENTIAL_TRAFFIC switches all four off, and the rest of its
# non-essential requests
CLAUDE_ENV = {
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_BUG_COMMAND": "1",
    "DISABLE_AUTOUPDATER": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
}

# Codex (https://developers.openai.com/codex/config-reference): the server as a Responses API
# provider, the session id as a header read from an environment variable, commands run without a
# sandbox or a question, no update check, analytics or feedback, and no plugin sync (its
# startup sync reaches github.com and chatgpt.com)
CODEX_CONFIG = """\
model = "{model}"
model_provider = "serve"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false

[analytics]
enabled = false

[feedback]
enabled = false

[features]
plugins = false
remote_plugin = false
apps = false
in_app_updates = false

[model_providers.serve]
name = "wings.serve"
base_url = "{base_url}"
wire_api = "responses"
env_key = "SERVE_API_KEY"
env_http_headers = {{ "X-Session-Id" = "SERVE_SESSION_ID" }}
"""

# Qwen Code (https://qwenlm.github.io/qwen-code-docs/en/users/configuration/settings): the
# OpenAI-compatible provider, no usage statistics, telemetry or auto-update; customHeaders is its
# documented way to add a header
QWEN_SETTINGS = {
    "security": {"auth": {"selectedType": "openai"}},
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
    "general": {"enableAutoUpdate": False},
}


def claude_command(prompt, base_url, session, home, max_tokens):
    """Claude Code: `claude -p`, its Bash tool allowed without asking (--allowedTools; the
    broader --dangerously-skip-permissions is refused to root)."""
    env = {
        **CLAUDE_ENV,
        "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"),
        "ANTHROPIC_API_KEY": "unused",
        "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_CUSTOM_HEADERS": f"X-Session-Id: {session}",
    }
    if max_tokens is not None:
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(max_tokens)
    return [os.path.join(BIN, "claude"), "-p", prompt, "--allowedTools", "Bash"], env


def codex_command(prompt, base_url, session, home, max_tokens):
    """Codex: `codex exec` with CODEX_HOME holding CODEX_CONFIG. It has no output-token cap of its
    own: the server's cap applies."""
    codex_home = os.path.join(home, ".codex")
    os.makedirs(codex_home, exist_ok=True)
    with open(os.path.join(codex_home, "config.toml"), "w") as f:
        f.write(CODEX_CONFIG.format(model=MODEL, base_url=base_url))
    env = {"CODEX_HOME": codex_home, "SERVE_API_KEY": "unused", "SERVE_SESSION_ID": session}
    return [os.path.join(BIN, "codex"), "exec", "--skip-git-repo-check", prompt], env


def qwen_command(prompt, base_url, session, home, max_tokens):
    """Qwen Code: `qwen -p --yolo` (every tool call approved), no sandbox (yolo would start its
    Docker one)."""
    settings = {
        **QWEN_SETTINGS,
        "model": {"name": MODEL, "generationConfig": {"customHeaders": {"X-Session-Id": session}}},
    }
    os.makedirs(os.path.join(home, ".qwen"), exist_ok=True)
    with open(os.path.join(home, ".qwen", "settings.json"), "w") as f:
        json.dump(settings, f)
    env = {
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": "unused",
        "OPENAI_MODEL": MODEL,
        "QWEN_SANDBOX": "false",
        "QWEN_TELEMETRY_ENABLED": "false",
    }
    if max_tokens is not None:
        env["QWEN_CODE_MAX_OUTPUT_TOKENS"] = str(max_tokens)
    return [os.path.join(BIN, "qwen"), "-p", prompt, "--yolo"], env


COMMANDS = {"claude_code": claude_command, "codex": codex_command, "qwen_code": qwen_command}


def launch(
    harness: str,
    prompt: str,
    base_url: str,
    session: str,
    workdir: str,
    max_tokens: int | None = None,
    timeout: float = timeout_s,
) -> subprocess.CompletedProcess:
    """Run one harness headless on `prompt` in `workdir` against the server at base_url (ending in
    /v1), every request naming `session` -> the finished process (stdout: what it printed).
    HOME is a folder of its own under workdir, and nothing of this process's environment
    reaches the harness but PATH (no proxy, no API key of the user's). max_tokens caps each
    reply where the harness has a switch for it (Claude Code, Qwen Code)."""
    home = os.path.join(workdir, ".home")
    os.makedirs(home, exist_ok=True)
    argv, env = COMMANDS[harness](prompt, base_url, session, home, max_tokens)
    if not os.path.exists(argv[0]):
        raise FileNotFoundError(f"{argv[0]} is not installed: bash setup.sh test installs it")
    base = {"PATH": os.environ.get("PATH", ""), "HOME": home, "TERM": "dumb", "LANG": "C.UTF-8"}
    # a session of its own, so that a timeout ends the harness and every command it started
    proc = subprocess.Popen(
        argv,
        cwd=workdir,
        env={**base, **env},
        stdin=subprocess.DEVNULL,  # codex exec would wait for more input
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def play(harness: str, task: dict, base_url: str, session: str) -> str:
    """One episode: the harness in a fresh folder, the task's prompt its instruction -> what it
    printed last. A harness that gave up (it exits non-zero: a reply cut by max_tokens, which
    Claude Code and Codex refuse to go on from) answers "": the policy's failure, graded 0 like a
    wrong answer. One the server never answered is not graded: its session has no request, and
    external_agent.py counts the episode as failed."""
    workdir = tempfile.mkdtemp(prefix=f"{harness}-")
    try:
        out = launch(harness, task["prompt"], base_url, session, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return out.stdout.strip() if out.returncode == 0 else ""


def claude_code(task: dict, base_url: str, session: str) -> str:
    return play("claude_code", task, base_url, session)


def codex(task: dict, base_url: str, session: str) -> str:
    return play("codex", task, base_url, session)


def qwen_code(task: dict, base_url: str, session: str) -> str:
    return play("qwen_code", task, base_url, session)


for agent in (claude_code, codex, qwen_code):
    agent.timeout_s = timeout_s
