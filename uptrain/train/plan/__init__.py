"""The run plan: one immutable `Plan` made from the config, the launch and the run folder's state,
every check of a run made in it, with the token budget as steps (checked.py), the launch's checks
(launch.py), the run folder, resume and a checkpoint's identity (resume.py) and the model's facts
read once (models.py). The rest of the trainer reads the plan."""
