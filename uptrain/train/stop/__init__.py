"""Why a run stops before its last step: stop signals, stops during set-up, the grace and the exit
codes (preempt.py); a loss or gradient that is no longer finite (health.py). The ground of the
trainer's rooms: it imports nothing of the trainer."""
