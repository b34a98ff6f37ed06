from shardtune.data.batches import GlobalBatches, MicroBatch
from shardtune.data.pipeline import TokenizedData, build_data

__all__ = ["GlobalBatches", "MicroBatch", "TokenizedData", "build_data"]
