"""The evaluate stage and the ``dflash-pipe evaluate`` command: ``drafter`` (the report of one drafter
on token ids), ``export`` (loading an export, its target and prompts), ``runs`` (decode runs and the
lossless check), ``report`` (tables and the PNG), ``stage``, ``cli``."""
