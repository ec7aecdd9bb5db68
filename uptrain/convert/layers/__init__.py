"""The layer-at-a-time machinery: the original model run one decoder layer at a time
(`layer_stream`, whose `Layer` owns one layer's life), `--calib` statistics over it (`calibrate`),
a layer's attention tensors made together (`layerwise`) and each layer refined as it is made
(`refine_layer`). Imports `registry`, `io` and `math`; nothing below imports it."""
