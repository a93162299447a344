"""A local Hugging Face checkpoint directory, read by one trainer rank.

Safetensors files are opened lazily (memory-mapped, header only), so a rank
reads only the slices of the tensors it owns: megatron its tensor-parallel
slices (``engines/megatron/hf_weights.tensor_parallel_shards``), fsdp its
rows along dim 0 (``engines/fsdp/loading.py``).
A checkpoint split into several files is located through
``model.safetensors.index.json``. Pickled ``pytorch_model*.bin`` files cannot
be read in part: they are loaded whole, on every rank, with a warning.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SAFETENSORS_INDEX = "model.safetensors.index.json"


class HFTensors(Mapping):
    """Hugging Face tensors by name, read whole or one slice at a time.

    This one serves tensors already in memory; a checkpoint reader
    (``SafetensorsCheckpoint`` below) overrides the reads so that
    only the requested slices leave the files. ``bytes_read`` counts the
    bytes handed out.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self._tensors = tensors
        self.bytes_read = 0

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._counted(self._tensors[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __contains__(self, name) -> bool:
        return name in self._tensors  # Mapping's default would read the tensor

    def shape_of(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def read_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Indices ``start:stop`` of dimension ``dim``."""
        return self._counted(self._tensors[name].narrow(dim, start, stop - start))

    def _counted(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def read_hf_config(path: str | Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def open_hf_weights(path: str | Path) -> HFTensors:
    """A checkpoint's tensors, read on demand from safetensors; a ``*.bin``
    checkpoint is read whole."""
    files = safetensors_files(path)
    if files:
        return SafetensorsCheckpoint(files)
    weights = read_bin_weights(path)
    size = sum(t.numel() * t.element_size() for t in weights.values())
    log.warning("%s has no safetensors files: this rank read the whole checkpoint (%.2f GB) into host memory "
                "to keep its shard; save it as safetensors to read only the shard", path, size / 1e9)
    return HFTensors(weights)


def read_hf_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a local checkpoint, in host memory (``*.safetensors``, else ``*.bin``)."""
    files = safetensors_files(path)
    if files:
        from safetensors.torch import load_file

        return {name: tensor for file in files for name, tensor in load_file(str(file)).items()}
    return read_bin_weights(path)


def safetensors_files(path: str | Path) -> list[Path]:
    """The files the index names, else every ``*.safetensors`` file (none: [])."""
    path = Path(path)
    index = path / SAFETENSORS_INDEX
    if index.exists():
        return sorted({path / file for file in json.loads(index.read_text())["weight_map"].values()})
    return sorted(path.glob("*.safetensors"))


def read_bin_weights(path: str | Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(path).glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors or pytorch_model*.bin weights")
    return {name: tensor for file in files
            for name, tensor in torch.load(file, map_location="cpu", weights_only=True).items()}


class SafetensorsCheckpoint(HFTensors):
    """Tensors of safetensors files, read whole or in slices (``get_slice``),
    never more than asked for. The files stay memory-mapped until this
    object is dropped."""

    def __init__(self, files: Iterable[Path]):
        from safetensors import safe_open

        self._file_of = {}
        for file in files:
            handle = safe_open(str(file), "pt")
            self._file_of.update(dict.fromkeys(handle.keys(), handle))
        self.bytes_read = 0

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._counted(self._file(name).get_tensor(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)

    def __contains__(self, name) -> bool:
        return name in self._file_of

    def shape_of(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def read_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, stop),)
        return self._counted(self._file(name).get_slice(name)[index])

    def _file(self, name: str):
        if name not in self._file_of:
            raise KeyError(f"no tensor {name!r} in the checkpoint's safetensors files")
        return self._file_of[name]
