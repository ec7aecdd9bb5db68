"""Entry point: `python -m uptrain.sweep` and `uptrain-sweep` (the command: `run.py`; what it does: the package's doc)."""

from uptrain.stopping import is_command

if is_command(__name__, "uptrain-sweep"):  # first act: Ctrl-C / SIGTERM during the imports below end the run cleanly too
    from uptrain.stopping import at_once
    from uptrain.sweep import AS_IT_WAS

    at_once.install("uptrain.sweep", AS_IT_WAS)

from uptrain.stopping import at_once
from uptrain.sweep import run


def main(argv: list[str] | None = None) -> int:
    """The command (`argv` None: this process's arguments, with at_once's stop handling and its exit;
    a list: `run.main` as a function, the process's handlers left alone)."""
    if argv is not None:
        return run.main(argv)
    at_once.finish(run.main(None))  # after a signal held while folders were put in place: at once
    return 0  # not reached


if __name__ == "__main__":
    main()
