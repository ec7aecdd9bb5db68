"""Entry point: `python -m uptrain.demo` (the command: `run.py`; what it does: the package's doc)."""

from uptrain.stopping import is_command

if is_command(__name__, "uptrain-demo"):  # first act: Ctrl-C / SIGTERM during the imports below end the demo cleanly too
    from uptrain.demo import AS_IT_WAS
    from uptrain.stopping import at_once

    at_once.install("uptrain.demo", AS_IT_WAS)

from uptrain.demo.run import main

main()
