"""What a run shows and leaves: the loss plot, the final model folder (report.py),
the ETA on the progress line (eta.py) and model FLOPs utilisation (mfu.py). Reads parallel/ (a
sharded model is gathered for the final folder)."""
