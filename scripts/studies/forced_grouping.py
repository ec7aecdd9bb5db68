"""A conversion with one layer's head grouping forced (issue 61's experiment: which start trains best).

    OMP_NUM_THREADS=1 python scripts/studies/forced_grouping.py --layer 4 --order 0,1,6,7,2,3,4,5 -- \\
        examples/stories260K-mha8 --kv-heads 2 --method fit --grouping similar \\
        --calib runs/demo-nodata-t12/data/samples.jsonl --calib-tokens 16384 --refine --threads 1 --force \\
        --out runs/quality-curve/start-demo-forced4

Runs `python -m uptrain.convert` with the arguments after `--` and `--group-candidates 1` (the
similarity's grouping alone, as the converter made it when this ran; the measured choice among
candidates does not call `group_permutation`), except that layer `--layer`'s `--grouping similar`
permutation (new position -> source head) is replaced by `--order`: every other layer, the
calibration and the refinement as the converter makes them. An experiment, not a feature
(results/quality-curve.md: the no-data start's gap after training was this one layer's grouping).
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layer", type=int, required=True, help="the decoder layer whose grouping is forced (from 0)")
    p.add_argument("--order", required=True, help="the head order for that layer, e.g. 0,1,6,7,2,3,4,5")
    p.add_argument("convert", nargs=argparse.REMAINDER, help="-- then uptrain.convert's arguments")
    args = p.parse_args()
    order = [int(h) for h in args.order.split(",")]

    import uptrain.convert.layers.layerwise as layerwise

    chosen = layerwise.group_permutation
    calls: list[int] = []

    def forced(similarity, groups):  # called once per layer, in layer order (the layer stream)
        calls.append(len(calls))
        perm = chosen(similarity, groups)
        if calls[-1] == args.layer:
            print(f"layer {args.layer}: similar grouping {perm} replaced by {order}", flush=True)
            return order
        return perm

    layerwise.group_permutation = forced
    from uptrain.convert.__main__ import main as convert

    return convert([*(a for a in args.convert if a != "--"), "--group-candidates", "1"])


if __name__ == "__main__":
    sys.exit(main())
