"""Entry point: `python -m uptrain.plots` runs uptrain.measure.plots (the code lives there)."""

import sys

from uptrain.measure.plots import main

if __name__ == "__main__":
    sys.exit(main())
