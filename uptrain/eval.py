"""Entry point: `python -m uptrain.eval` runs uptrain.measure.eval (the code lives there)."""

import sys

from uptrain.measure.eval import main

if __name__ == "__main__":
    sys.exit(main())
