"""What the trainer asks of the model: which parameters train in which stage (trainable.py), the
loss sums (losses.py), the in-loop validation loss (validate.py) and the teacher's generated
documents for distillation (teacher_samples.py). Reads config.py; no other room of the trainer."""
