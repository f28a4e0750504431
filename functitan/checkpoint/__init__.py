"""Sharded, asynchronous, atomic checkpoints in the Orbax layout (zarr3, tensorstore-compatible) or torch DCP
(torchtitan's); reshard on load.

    ckpt = CheckpointManager("runs/x/ckpt", interval=500, keep_last=3)
    state = ckpt.restore_latest(state) or state     # exemplar: the freshly initialised TrainState
    for ...:
        state, metrics = train_step(state, batch)
        ckpt.maybe_save(state)                       # blocks only while staging
    ckpt.close()

See docs/checkpoints.md for the on-disk layout, the commit protocol and the Orbax interop.
"""

from ._dcp import DcpFormat, is_dcp_dir, read_dcp
from ._export import export_dcp, export_hf, saved_params
from ._format import Format
from ._hf import (
    from_hf_state_dict,
    hf_model,
    import_hf,
    is_hf_dir,
    load_hf,
    recorded_model,
    recorded_model_config,
    recorded_run_config,
    save_hf,
    to_hf_state_dict,
    write_model_config,
)
from ._manager import CheckpointManager, check_checkpoint_path, restore_params
from ._orbax import OrbaxFormat
from ._restore import CheckpointError, restore, verify
from ._runlock import RunInUseError, RunLock, lock_run
from ._save import Checkpointer, SaveHandle, save, save_sync

__all__ = [
    "save",
    "save_sync",
    "SaveHandle",
    "Checkpointer",
    "Format",
    "OrbaxFormat",
    "DcpFormat",
    "read_dcp",
    "export_dcp",
    "is_dcp_dir",
    "restore",
    "verify",
    "CheckpointError",
    "CheckpointManager",
    "restore_params",
    "check_checkpoint_path",
    "export_hf",
    "saved_params",
    "import_hf",
    "save_hf",
    "load_hf",
    "is_hf_dir",
    "recorded_model_config",
    "recorded_model",
    "recorded_run_config",
    "hf_model",
    "to_hf_state_dict",
    "from_hf_state_dict",
    "write_model_config",
    "lock_run",
    "RunLock",
    "RunInUseError",
]
