"""Entry point: `python -m uptrain.compare` runs uptrain.measure.compare (the code lives there)."""

import sys

from uptrain.measure.compare import main

if __name__ == "__main__":
    sys.exit(main())
