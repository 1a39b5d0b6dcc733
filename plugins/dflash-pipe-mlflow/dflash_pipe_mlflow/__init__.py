"""dflash-pipe plugin that logs metrics to MLflow (see plugin.py)."""
