"""The conversion job: MHA (or GQA) checkpoint -> GQA checkpoint with fewer K/V heads.

Rooms, from the ground up (each imports only the rooms above it in this list):
- registry/: families as data (architectures) and the options' vocabularies (choices)
- io/: checkpoint I/O: source, passthrough (tensors kept byte for byte), shards (the streaming
  writer), output_dir (all-or-nothing), hfconfig (attention shapes; the target config.json)
- math/: pure tensor math: heads (pool, repeat, fused layouts), fit, grouping, refine
- layers/: the model one decoder layer at a time: layer_stream (the stream and the `Layer` that
  owns a layer's life), calibrate (`--calib`), layerwise (a layer's attention tensors made
  together), refine_layer (`--refine` inside the stream)
On top, in this folder: tensors (which output tensor comes from which source tensors by which
rule), plan and modelcard (what is printed and written), pipeline (prepare + write), __main__ (the CLI).

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
