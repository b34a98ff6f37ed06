from shardtune.checkpoint.manager import CheckpointManager, find_resume_dir

__all__ = ["CheckpointManager", "find_resume_dir"]
