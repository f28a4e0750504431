"""torch DCP (``torch.distributed.checkpoint``), the format torchtitan's checkpoints are in: written on the commit
protocol, read into an exemplar.

A DCP checkpoint is a directory of ``.metadata`` (a pickled ``Metadata``: every key's global shape, dtype and
chunks, and where each chunk's bytes are) and one ``__<rank>_0.distcp`` per writing rank (each chunk as
``torch.save`` bytes). ``DcpFormat`` writes exactly that with DCP's own ``FileSystemWriter`` and metadata
classes, each rank its own blocks (replicas written once), the leader the ``.metadata``; the commit protocol
around it (``_save``) adds ``_COMMIT`` and the atomic rename, which DCP's readers ignore. So
``torch.distributed.checkpoint.load`` and torchtitan's loader read what ``functitan export dcp`` writes.

Reading uses DCP's ``FileSystemReader`` without collectives: each rank reads every wanted key whole (one
batch of keys at a time), converts it (``TensorKey.from_theirs``: torchtitan's rotary row order) and keeps its
own block of the exemplar's placement. The ``.metadata`` file is a pickle, so a load path is trusted like a
``torch.load`` file: point it only at checkpoints you (or torchtitan runs you trust) wrote.
"""

from __future__ import annotations

import os
import typing
import warnings
from collections.abc import Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np
import optree
import torch

from . import _layout as L
from ._restore import CheckpointError, _start_read

if TYPE_CHECKING:
    from functitan.model import Model, TensorKey

    from ._format import Leaf

__all__ = ["DcpFormat", "is_dcp_dir", "read_dcp", "torchtitan_keys", "DCP_METADATA"]

DCP_METADATA = ".metadata"
_BATCH_BYTES = 1 << 30  # whole tensors read per DCP load: the peak a load adds (or the largest tensor)


def is_dcp_dir(path: str | os.PathLike) -> bool:
    """A directory holding a DCP checkpoint (its ``.metadata``): torchtitan's ``step-<N>``, ``export dcp``'s."""
    return os.path.isfile(os.path.join(os.fspath(path), DCP_METADATA))


class _Sources:
    """The one part of a ``SavePlanner`` that DCP's writer calls: the tensor of each write item."""

    def __init__(self, tensors: dict) -> None:
        self._tensors = tensors

    def resolve_data(self, item: Any) -> torch.Tensor:
        return self._tensors[item.index]


def _torch_value(source: Any) -> torch.Tensor:
    return source if isinstance(source, torch.Tensor) else L.from_numpy(np.array(source, order="C"))  # 0-d stays 0-d


class DcpFormat:
    """torch DCP on the commit protocol: ``.metadata`` plus one ``__<rank>_0.distcp`` per writing rank.

    Keys are the leaves' dotted names (``params.layers.0.attn.wq``, as DCP flattens a nested state dict), and the
    metadata records them as flat keys, as torchtitan's model keys are (``export dcp`` writes
    ``layers.0.attention.wo.weight``). Scalars are 0-d tensors.
    """

    name = "torch.distributed.checkpoint"

    def layout(self, boxes: L.Boxes, dtype: np.dtype) -> None:
        return None  # a chunk is a writer's block: nothing to decide beyond the boxes

    def write(self, item: str, plan: list[Leaf], rank: int, *, background: bool = False) -> tuple[dict, list]:
        """Write this rank's blocks to ``__<rank>_0.distcp`` with DCP's writer; the part for ``finish`` is every
        block's ``[key, dtype, global shape, offsets, sizes, file, byte offset, length]``."""
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.filesystem import _StoragePrefix
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

        items, tensors, blocks = [], {}, {}
        for leaf in plan:
            for p in leaf.pieces:
                value = _torch_value(p.source)
                index = MetadataIndex(leaf.name, torch.Size(p.box[0]))
                chunk = ChunkStorageMetadata(offsets=torch.Size(p.box[0]), sizes=torch.Size(p.box[1]))
                data = TensorWriteData(chunk, TensorProperties(dtype=value.dtype), torch.Size(leaf.shape))
                items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data))
                tensors[index] = value
                blocks[index] = (list(leaf.shape), list(p.box[1]))  # global shape, block sizes
        if not items:
            return {}, []
        writer = FileSystemWriter(item, single_file_per_rank=True, sync_files=True, thread_count=1)
        writer.set_up_storage_writer(False, rank=rank)
        planner = typing.cast(Any, _Sources(tensors))  # DCP's writer only calls resolve_data
        results = writer.write_data(SavePlan(items, storage_data=_StoragePrefix(f"__{rank}_")), planner)
        part, files = [], set()
        for r in results.wait():
            info = r.storage_data
            dtype = str(tensors[r.index].dtype).removeprefix("torch.")
            shape, sizes = blocks[r.index]
            part.append(
                [r.index.fqn, dtype, shape, list(r.index.offset or ()), sizes]
                + [info.relative_path, info.offset, info.length]
            )
            files.add(info.relative_path)
        return {f: os.path.getsize(os.path.join(item, f)) for f in files}, part

    def finish(self, item: str, plan: list[Leaf], empty: list, parts: list) -> tuple[dict, dict]:
        """On the leader: every rank's blocks as DCP's ``Metadata``, written by DCP's own ``finish``."""
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            Metadata,
            MetadataIndex,
            TensorProperties,
            TensorStorageMetadata,
        )
        from torch.distributed.checkpoint.storage import WriteResult

        state: dict[str, TensorStorageMetadata] = {}
        results = []
        for part in parts:
            for key, dtype, shape, offsets, sizes, rel, offset, length in part:
                if key not in state:
                    props = TensorProperties(dtype=getattr(torch, dtype))
                    state[key] = TensorStorageMetadata(properties=props, size=torch.Size(shape), chunks=[])
                state[key].chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
                index = MetadataIndex(key, torch.Size(offsets))
                results.append(
                    WriteResult(index=index, size_in_bytes=length, storage_data=_StorageInfo(rel, offset, length))
                )
        # planner_data: each key's path in the saved state dict, as DCP's planner records it (a flat dict's keys)
        meta = Metadata(state_dict_metadata=dict(state), planner_data={k: (k,) for k in state})
        writer = FileSystemWriter(item, sync_files=True)
        writer.set_up_storage_writer(True, rank=0)
        writer.finish(meta, [results])
        arrays = {k: list(v.size) for k, v in state.items()}
        return {DCP_METADATA: os.path.getsize(os.path.join(item, DCP_METADATA))}, arrays

    def checksummed(self, rel: str) -> bool:
        return rel == DCP_METADATA  # the chunks are torch.save zip records: a reader checks their sizes


class _Whole:
    """The part of a tensorstore array ``_restore._start_read`` uses, over a tensor already in memory."""

    def __init__(self, a: np.ndarray) -> None:
        self._a = a
        self.shape = a.shape
        self.dtype = type("DType", (), {"numpy_dtype": a.dtype})()

    def __getitem__(self, index: tuple[slice, ...]) -> _Whole:
        return _Whole(self._a[index])

    def read(self, out: np.ndarray | None = None) -> Future:
        fut: Future = Future()
        if out is not None:
            np.copyto(out, self._a)
        fut.set_result(out if out is not None else np.array(self._a, order="C"))
        return fut


def _metadata(path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(path).read_metadata()
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign pickle: one line naming the file
        raise CheckpointError(
            f"{os.path.join(path, DCP_METADATA)} cannot be read as DCP metadata ({type(exc).__name__}: {exc}); the "
            f"checkpoint is incomplete or not a torch DCP checkpoint"
        ) from None


def read_dcp(
    path: str | os.PathLike,
    exemplar: Any,
    keys: Mapping[str, Any] | None = None,
    *,
    cast: bool = False,
) -> Any:
    """Read the DCP checkpoint at ``path`` into a tree shaped like ``exemplar`` (leaves as ``restore`` takes).

    Args:
        keys: ``{exemplar leaf's dotted name: TensorKey}``: the DCP key of each leaf and how to convert it
            (a model's ``torchtitan`` map); None: the leaves' own dotted names, unconverted.
        cast: cast floating values to the exemplar's dtype (a foreign checkpoint in bf16 fine-tuned in fp32);
            else a dtype mismatch is an error naming both.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = os.path.abspath(os.fspath(path))
    md = _metadata(path)
    stored = md.state_dict_metadata
    named, _ = L.named_leaves(exemplar)
    want = [(name, keys[name] if keys is not None else None, x) for name, _, x in named]
    if keys is not None and (unmapped := [n for n, _, _ in named if n not in keys]):
        raise ValueError(f"{unmapped[0]}: the key map names no DCP key for it; map every parameter")
    key_of = {name: (k.key if k is not None else name) for name, k, _ in want}
    missing = [(n, key_of[n]) for n, _, _ in want if not isinstance(stored.get(key_of[n]), TensorStorageMetadata)]
    if missing:
        near = sorted(k for k in stored if not k.startswith("optimizer."))[:3]
        raise CheckpointError(
            f"{missing[0][1]} (for {missing[0][0]}): not in the DCP checkpoint {path} ({len(missing)} keys missing; "
            f"it holds e.g. {near}); is it this model's checkpoint (the model flags must match the one it was "
            f"trained with)?"
        )
    out: dict[str, Any] = {}
    batch: list = []
    size = 0

    def flush() -> None:
        sd = {
            key_of[n]: torch.empty(stored[key_of[n]].size, dtype=stored[key_of[n]].properties.dtype)
            for n, _, _ in batch
        }
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(sd, storage_reader=FileSystemReader(path), no_dist=True)
        for name, k, x in batch:
            value = sd[key_of[name]]
            if k is not None and k.from_theirs is not None:
                value = k.from_theirs(value)
            if cast and isinstance(x, torch.Tensor) and value.is_floating_point() and value.dtype != x.dtype:
                value = value.to(x.dtype)
            fut, finish = _start_read(name, x, typing.cast(Any, _Whole(L.as_numpy(value))), f"{path} ({key_of[name]})")
            out[name] = finish(fut.result() if fut is not None else None)
        batch.clear()

    for entry in want:
        meta = stored[key_of[entry[0]]]
        nbytes = meta.size.numel() * meta.properties.dtype.itemsize
        if batch and size + nbytes > _BATCH_BYTES:
            flush()
            size = 0
        batch.append(entry)
        size += nbytes
    if batch:
        flush()
    return optree.tree_unflatten(optree.tree_structure(exemplar), [out[n] for n, _, _ in named])


def torchtitan_keys(model: Model, cfg: Any) -> dict[str, TensorKey]:
    """The model's map to torchtitan's state-dict names, or a ValueError saying which model lacks one."""
    if model.torchtitan is None:
        raise ValueError(
            f"model {model.name!r} declares no torchtitan key map (Model.torchtitan), so it cannot read or write "
            f"torchtitan's DCP checkpoints; add one as models/llama.py does (torchtitan_tensors)"
        )
    return model.torchtitan(cfg)
