"""Built-in stage plugins, one module or folder per stage kind, thin adapters over :mod:`dflash_model`;
registered by :mod:`dflash_stages.plugin`."""
