"""The evaluate stage and the ``dflash-pipe evaluate`` command: decode runs, checks, the report."""
