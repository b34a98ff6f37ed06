"""shardtune: config-driven LLM fine-tuning with its own FSDP engine."""
__version__ = "0.1.0"
