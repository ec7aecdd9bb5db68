"""Showing the trade: eval (per-document strided perplexity), bench (KV-cache bytes, decode
speed, batch in a memory budget), compare (both, side by side), plots.

Each module's `main(argv)` is a CLI: `uptrain-eval` etc., or `python -m uptrain.eval` etc.
through the thin entry modules at the package's top level.
"""
