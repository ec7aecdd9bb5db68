"""Entry point: `python -m uptrain.bench` runs uptrain.measure.bench (the code lives there)."""

import sys

from uptrain.measure.bench import main

if __name__ == "__main__":
    sys.exit(main())
