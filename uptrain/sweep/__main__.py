"""Entry point: `python -m uptrain.sweep` (the command: `run.py`; what it does: the package's doc)."""

if __name__ == "__main__":  # first act: Ctrl-C / SIGTERM during the imports below end the run cleanly too
    from uptrain.stopping import at_once
    from uptrain.sweep import AS_IT_WAS

    at_once.install("uptrain.sweep", AS_IT_WAS)

from uptrain.stopping import at_once
from uptrain.sweep.run import main

if __name__ == "__main__":
    code = main()
    at_once.finish(code)  # after a signal held while folders were put in place: at once
