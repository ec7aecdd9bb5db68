"""The conversion job: MHA (or GQA) checkpoint -> GQA checkpoint with fewer K/V heads.

Modules, from facts to I/O:
- architectures: the registry (where each family keeps its K/V weights, as data)
- hfconfig: reading attention shapes from a config, writing the target config.json
- heads: pure head math on tensors (pool, repeat, split/merge fused layouts)
- tensors: which output tensor comes from which source tensors by which rule
- source: reading source checkpoints (local or Hub; safetensors headers, .bin)
- shards: the streaming safetensors shard writer; output_dir: the all-or-nothing output folder
- fit, grouping: the closed-form fit and head grouping (pure math); layerwise: a layer's attention
  tensors made together (`--method fit`, `--grouping similar`, `--refine`)
- calibrate, layer_stream: `--calib`, the original model run one decoder layer at a time
- refine, refine_layer: `--refine`, each converted attention layer tuned to the original's output
- plan, modelcard: what is printed and written about a conversion
- pipeline: prepare + write; __main__: the CLI

Python API: `from uptrain.convert import convert`.
"""

__all__ = ["RECORD_FILE", "convert", "prepare"]


def __getattr__(name: str):
    # Lazy: importing the package (e.g. for its registry, or `python -m uptrain.convert.X`) does
    # not pull in the whole pipeline.
    if name in __all__:
        from uptrain.convert import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'uptrain.convert' has no attribute {name!r}")
