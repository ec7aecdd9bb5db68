"""Pure tensor math: functions of tensors and ints, never paths or models on disk. Head pooling,
repeating and fused layouts (`heads`), the closed-form RoPE-safe fit (`fit`), similar-head
grouping (`grouping`) and the refinement's optimisation over pure modules (`refine`).
Imports only `registry`."""
