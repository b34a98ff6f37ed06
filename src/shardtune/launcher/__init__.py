"""The commands: the CLI, the launcher that starts torchrun, SLURM scripts, prepare, export, generate.

Torch-free at import (tests/integration/test_launcher_imports.py): a typo or `--help` answers as fast as Python
starts, and the launcher process never pays for torch; a command imports what it needs when it runs."""
