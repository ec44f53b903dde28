"""envs/: the worlds beyond toy_math (env_*.py), each registered with env.py's registry and imported
by name on first use (env.ENTRY_POINTS), and what only they share: worlds.py (expert replay,
JSON-lines files) and sandbox_exec.py (the python_exec sandbox of the code worlds). The files keep
their env_ prefix so that none shadows a module of the standard library or of a benchmark's package
(code, textworld).
"""
