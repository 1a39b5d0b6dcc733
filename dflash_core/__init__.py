"""dflash-pipe engine: pipeline files, stage plugins, the DAG runner and the CLI.

The public plugin API is exactly what this module exports.
"""

from dflash_core.hookspecs import hookimpl
from dflash_core.stage import NoConfig, Stage, StageContext

__version__ = "0.1.0"
__all__ = ["Stage", "StageContext", "NoConfig", "hookimpl", "__version__"]
