"""Continue pre-training (uptrain) a Hugging Face causal LM, e.g. a model converted to GQA.

    python -m uptrain.train configs/demo-cpu.yaml model=path/to/model optim.lr=1e-3
    accelerate launch -m uptrain.train CONFIG.yaml [key=value ...]

See uptrain/train/config.py for every config field.
"""

from __future__ import annotations

import dataclasses
import sys
import typing

from uptrain.cli import ArgParser, prog_name
from uptrain.errors import exit_on_usage_error
from uptrain.train.config import TrainConfig, load_config


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    hints = typing.get_type_hints(TrainConfig)
    sections = [name for name, hint in hints.items() if dataclasses.is_dataclass(hint)]
    top = [name for name in hints if name not in sections]
    parser = ArgParser(
        prog=prog_name("uptrain.train"), description=__doc__.split("\n\n")[0],
        epilog=f"config sections: {', '.join(sections)}; top-level keys: {', '.join(top)}. Every key and its meaning: the "
               "trainer's key table in README.md (## Uptrain) and uptrain/train/config.py.")
    parser.add_argument("config", help="YAML run config (see configs/)")
    parser.add_argument("overrides", nargs="*", default=[], help="key=value overrides, dotted for nested fields (optim.lr=1e-3)")
    args = parser.parse_args(argv)
    from uptrain.train.loop import TrainingDiverged, train  # after --help: torch & co. take seconds

    try:
        train(load_config(args.config, args.overrides))
    except TrainingDiverged as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
