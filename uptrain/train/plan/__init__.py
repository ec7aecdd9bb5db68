"""The run plan: one immutable `Plan` made from the config, the launch and the run folder's state,
every check of a run made in it (checked.py), with the model's facts read once (models.py) and
the token budget as steps (budget.py). The rest of the trainer reads the plan."""
