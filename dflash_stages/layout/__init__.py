"""Multi-GPU layouts: the planner (pure arithmetic), measuring one-GPU rates, ``dflash-pipe plan``."""
