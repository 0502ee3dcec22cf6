"""The run's surroundings: tracking (the one door to MLflow), progress (the progress lines on the
terminal and in the flow run's logs), memory (what a process holds, from /proc)."""
