"""wings/: the optional features, each a file of its own with a page in docs/, off unless a run's
config turns it on.

The core (the files at the repository's root) never imports a wing by statement: it reaches one by
name, through a registry, when the config asks for it (docs/layout.md). A wing imports the core,
with the repository's root on sys.path (`python train.py` puts it there; so does `pip install -e
.`).
"""
