"""The run plan: one immutable `Plan` made from the config, the launch and the run folder's state,
every check of a run made in it, with the launch's checks and the token budget as steps
(checked.py), and what it reads from disk (folders.py): the run folder, resume and a checkpoint's
identity, and the model's facts read once. The rest of the trainer reads the plan."""
