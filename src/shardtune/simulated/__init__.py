"""The simulated GPU: what stands in for CUDA and NCCL on the meta device. The product calls the seam
(shardtune/accelerator.py), never this package; the seam decides when these pieces run.

  device.py          installs it into torch: the backend, `torch.meta` as a device module, the copy kernels
  rms_norm.py        torch's fused RMSNorm kernels, as CUDA dispatches F.rms_norm
  host.py            the simulated host: host tensors of any size that hold no bytes (`plan --simulate`, FSDP2)
  fsdp2_offload.py   FSDP2's offloaded shards on the simulated host
  process_group.py   the "simgpu" backend: NCCL's refusals, every collective matched across ranks in order
  allocator.py       CUDA's caching allocator and pinned host pool, modelled over a step's storages
  null_storage.py    DCP storage that moves no bytes (checkpoints of meta tensors)
"""
