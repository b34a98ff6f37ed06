"""The simulated GPU: the pieces that stand in for CUDA and NCCL on the meta device (see shardtune/accelerator.py,
the seam the product calls)."""
