"""`python -m uptrain.sweep`: the quality / KV-cache trade curve over K/V head counts, one command.

    python -m uptrain.sweep CKPT --data HELD_OUT [--calib FILE] [--method fit] [--refine]
                            [--kv-heads 4,2,1 | all] [--baseline mean] --out DIR
                            [--bench [--runtime llama.cpp]] [--uptrain-tokens N [--train-data FILE]]

Converts CKPT to each K/V head count (default: every count below the source's that it can take),
scores each on held-out text within the model's context with `uptrain.eval`'s own code, and
measures the KV cache per token and at the model's full context for `--batch` sequences. Writes:

  DIR/kv{N}/        each converted folder, as `uptrain.convert` writes it (DIR/mean-kv{N}/: --baseline)
  DIR/sweep.json    one record per count and the source: kv_heads, loss, perplexity,
                    kv_bytes_per_token, kv_bytes_at_context, the conversion settings, seconds
  DIR/sweep.png     loss against KV bytes per token, the source as the reference line
  DIR/kv{N}-uptrained/  with --uptrain-tokens N: the uptraining run of each count (model/ inside)

and prints the table and a recommendation: the smallest count whose loss is within
`--max-loss-increase` (default 1%) of the source's, or a plain statement that none is.

`--bench` adds each folder's decode tokens/s (uptrain.bench's timer), `--uptrain-tokens N` a short
uptraining of each converted folder with the project's recipe and its loss after it (a second
curve on sweep.png, a second recommendation): `extras.py`.

The conversion options are uptrain.convert's (`uptrain.convert.options`: the same flags, the same
rule for when --calib is used, the same refusals), so each DIR/kv{N} is what `uptrain.convert`
writes with them. The counts of a method are converted together (`convert.several`: one read of
the source, one calibration pass) and appear all at once or not at all.

A rerun continues: sweep.json records what every number depends on (`record.py`: the
checkpoint's and the texts' content fingerprints, every setting); a count is kept only when its
record matches and its folder is one this sweep wrote (its mark), scored again when only the
held-out text changed, done again otherwise, each with a line saying what changed. A folder at one
of the sweep's paths that it did not write is refused, never replaced.

Inside this room, from the bottom: `record.py` (what every number depends on: content
fingerprints, the folders the sweep owns, stdlib only), `extras.py` (`--bench` and
`--uptrain-tokens`), `precision.py` (`--kv-cache`: K/V heads x cache precision), `report.py` (the table, warnings, plots and recommendation), `run.py` (the
command: arguments, counts, conversions kept or redone, scoring), `__main__.py` (the entry point).
Nothing here is imported by convert, train or measure.
"""

# What a stop leaves (the stop's one line; `__main__.py` says it from the first instruction).
AS_IT_WAS = "every folder is whole (a count's folders appear all at once); sweep.json keeps the counts scored: rerun to continue"
