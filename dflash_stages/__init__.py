"""Built-in stage plugins, one module per stage kind; registered by :mod:`dflash_stages.plugin`."""
