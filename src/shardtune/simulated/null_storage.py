"""DCP storage for the simulated GPU (accelerator.py): the meta device holds no bytes, so nothing is written or read,
but DCP's planning runs for real (local plans, the coordinator's global plan and metadata, the load plan checked
against that metadata: a missing or mis-shaped key fails as it would on disk). The metadata is the one real file.
"""
from __future__ import annotations

import os
import pickle
from pathlib import Path

from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

METADATA = ".metadata"  # DCP's own file name: the directory reads as a checkpoint (paths.is_complete)


def _done(value: object) -> Future:
    f: Future = Future()
    f.set_result(value)  # type: ignore[arg-type]
    return f


class _AtPath:
    """The parts of DCP's storage interface a storage without bytes takes as they come."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.path = Path(path)
        self.num_items = 0  # items planned for this rank

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True


class NullWriter(_AtPath, StorageWriter):
    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        self.num_items += len(plan.items)
        return _done([WriteResult(index=item.index, size_in_bytes=0, storage_data=None) for item in plan.items])

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
        with open(self.path / METADATA, "wb") as f:
            pickle.dump(metadata, f)


class NullReader(_AtPath, StorageReader):
    def read_metadata(self, *args, **kwargs) -> Metadata:
        with open(self.path / METADATA, "rb") as f:
            return pickle.load(f)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """Every planned tensor is resolved and committed in place, as a real read would; no bytes move."""
        for req in plan.items:
            self.num_items += 1
            if req.type.name == "BYTE_IO":
                continue  # no non-tensor values in our state
            planner.commit_tensor(req, planner.resolve_tensor(req).detach())
        return _done(None)


class NullLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planning, except that meta tensors are taken as they are: DCP reads a meta tensor as a
    placeholder to allocate on the default group's device, but on the simulated GPU it is the state itself."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.original_state_dict = state_dict
        if self.flatten_sharded_tensors:
            state_dict = _flatten_sharded_tensors(state_dict)
        if self.flatten_state_dict:
            state_dict, self.mappings = flatten_state_dict(state_dict)
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator
