"""Example dflash-pipe plugin (see plugin.py)."""
