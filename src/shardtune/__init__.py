"""shardtune: config-driven LLM fine-tuning with its own FSDP engine."""
__version__ = "0.1.0"

from shardtune import quiet_imports as _quiet_imports

_quiet_imports.install()
