"""Continue pre-training (uptrain) a Hugging Face causal LM, e.g. a model converted to GQA.

    python -m uptrain.train configs/demo-cpu.yaml model=path/to/model optim.lr=1e-3
    accelerate launch -m uptrain.train CONFIG.yaml [key=value ...]

See uptrain/train/config.py for every config field. Exit codes: 0 done, 1 diverged, 2 bad input,
75 stopped by SIGTERM/SIGUSR1/Ctrl-C with a checkpoint, or during set-up before the first step (the last
line says how to continue; run_dir/preempted.json says it too, for launch scripts that requeue), 130
stopped at once by a second Ctrl-C (the last complete checkpoint is kept).
"""

from __future__ import annotations

import os
import sys

# First act of `python -m uptrain.train` and of the `uptrain-train` command (which imports this
# module, then calls main), before the imports below (seconds: torch & co.): a stop meanwhile is kept.
from uptrain.stopping import is_command  # stdlib only

if is_command(__name__, "uptrain-train"):
    from uptrain.stopping import safe_point as _early

    _early.install("imports")

import dataclasses
import json
import shlex
import typing
from pathlib import Path

from uptrain.cli import ArgParser, prog_name
from uptrain.errors import exit_on_usage_error
from uptrain.stopping import safe_point
from uptrain.stopping.codes import EXIT_INTERRUPTED, EXIT_PREEMPTED
from uptrain.train.config import TrainConfig, load_config
from uptrain.train.state.run_files import PREEMPTED_FILE, complete_checkpoints

KEYS_DOC = "docs/uptrain.md (## Config keys)"  # where --help sends the user for every config key


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    hints = typing.get_type_hints(TrainConfig)
    sections = [name for name, hint in hints.items() if dataclasses.is_dataclass(hint)]
    top = [name for name in hints if name not in sections]
    parser = ArgParser(
        prog=prog_name("uptrain.train"), description=__doc__.split("\n\n")[0],
        epilog=f"config sections: {', '.join(sections)}; top-level keys: {', '.join(top)}. Every key and its meaning: the "
               f"trainer's key table in {KEYS_DOC} and uptrain/train/config.py.")
    parser.add_argument("config", help="YAML run config (see configs/)")
    parser.add_argument("overrides", nargs="*", default=[], help="key=value overrides, dotted for nested fields (optim.lr=1e-3)")
    args = parser.parse_args(argv)
    config = load_config(args.config, args.overrides)
    return _run(config, resume_command(args.config, args.overrides))


def _run(config: TrainConfig, resume: str) -> int:
    """Train `config`; the exit code, with one line and preempted.json when a stop signal ended it."""
    try:
        # From here a stop can be acted on (run_dir is known): one that came during the imports
        # stops now, later ones at once, until the trainer's own handling takes over in train().
        safe_point.raise_now()
        from uptrain.train.loop import train  # torch & co.: seconds

        train(config)
    except safe_point.Stopped as stop:  # before the first step (StoppedInSetup): nothing new to checkpoint
        done = complete_checkpoints(Path(config.run_dir))
        kept = f"last complete checkpoint {done[-1]} kept" if done else "no checkpoint yet"
        _say(f"stopped by {stop.signal_name} during set-up ({stop.phase}), before the first step: {kept}; "
             f"continue with: {resume}")
        write_preempted_mark(Path(config.run_dir), {"signal": stop.signal_name, "phase": stop.phase,
                                                    "checkpoint": str(done[-1]) if done else None})
        return EXIT_PREEMPTED
    except KeyboardInterrupt:  # a second Ctrl-C: no new checkpoint
        done = complete_checkpoints(Path(config.run_dir))
        kept = f"last complete checkpoint {done[-1]} kept" if done else "no checkpoint yet (resume starts over)"
        _say(f"interrupted: {kept}; continue with: {resume}")
        return EXIT_INTERRUPTED
    except Exception as err:
        return _after_training(err, config, resume)
    finally:
        safe_point.ignore()  # (the `uptrain-train` / `python -m` process only) its exit code is decided
    return 0


def _after_training(err: Exception, config: TrainConfig, resume: str) -> int:
    """The exit code of a run that ended in `err`: diverged (1) or stopped after a step (75); else re-raised."""
    from uptrain.train.loop import TrainingDiverged
    from uptrain.train.stop.preempt import Preempted

    if isinstance(err, TrainingDiverged):
        print(f"error: {err}", file=sys.stderr)
        return 1
    if isinstance(err, Preempted):
        kept = f"checkpoint {err.checkpoint} kept" if err.checkpoint else "no checkpoint yet (resume starts over)"
        _say(f"{err}: {kept}; continue with: {resume}")
        write_preempted_mark(Path(config.run_dir), {"signal": err.signal_name, "step": err.step,
                                                    "checkpoint": str(err.checkpoint) if err.checkpoint else None})
        return EXIT_PREEMPTED
    raise err


def resume_command(config: str, overrides: list[str]) -> str:
    """The command that continues this run: the same config and overrides, plus resume=latest."""
    kept = [o for o in overrides if o.split("=", 1)[0] not in ("resume", "overwrite")]
    launched = "RANK" in os.environ  # by accelerate launch / torchrun, whatever the process count
    launcher = "accelerate launch [the same launch options] -m uptrain.train" if launched else "python -m uptrain.train"
    return f"{launcher} {shlex.join([config, *kept, 'resume=latest'])}"


def write_preempted_mark(run_dir: Path, record: dict) -> None:
    """run_dir/preempted.json (first process only): the run stopped on a signal and wants to be
    continued (a launcher's own exit code hides the workers' 75: scripts/slurm/uptrain.sbatch reads
    this file to requeue). Written atomically; a launch script removes it before each start."""
    if os.environ.get("RANK", "0") != "0":
        return
    run_dir.mkdir(parents=True, exist_ok=True)  # a stop during a fresh run's set-up comes before the folder
    tmp = run_dir / f".{PREEMPTED_FILE}.tmp"
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, run_dir / PREEMPTED_FILE)


def _say(line: str) -> None:
    """One line on stderr, from the first process only (every process stops the same way)."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
