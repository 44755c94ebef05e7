"""Read tensors from a safetensors checkpoint by key, lazily, counting what was read.

``CheckpointReader(path)`` takes a checkpoint directory (one ``model.safetensors``, or
shards listed by ``model.safetensors.index.json``) or a single ``.safetensors`` file. It
lists the keys without reading any tensor, and ``get(key)`` reads one tensor (only that
tensor's bytes) through ``safetensors.safe_open``. ``reads`` counts the tensors read, so a
caller can check that a rank read only its own experts. FP8 weights stored with scales
(DeepSeek-V3: ``<name>.weight`` float8_e4m3fn plus ``<name>.weight_scale_inv``, one scale
per block of the config's ``quantization_config.weight_block_size`` (128×128), or one per
tensor) are dequantised by ``get_weight``.

``safetensors`` is imported when a reader opens a file, never when this module is imported.
"""

from __future__ import annotations

import importlib
import json
import os
from collections import Counter

import torch

__all__ = ["CheckpointReader", "dequantize_fp8", "SCALE_SUFFIX"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"  # "<...>.weight" → "<...>.weight_scale_inv"


def _safetensors():
    try:
        return importlib.import_module("safetensors")
    except ImportError as exc:
        raise ImportError(
            "loading safetensors checkpoints needs the safetensors package: "
            'pip install "epmoe[hf]" (or pip install safetensors)'
        ) from exc


def dequantize_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """FP8 ``weight [N, K]`` times its scales → float32 ``[N, K]``.

    ``scale_inv`` is one scale (``[]`` or ``[1]``), or one per ``block`` of the weight:
    ``[ceil(N/bN), ceil(K/bK)]`` (DeepSeek-V3's ``weight_block_size``: 128×128; the last
    blocks may be partial). The name follows DeepSeek's checkpoints: ``weight_scale_inv``
    multiplies (it is the inverse of the quantisation scale)."""
    w = weight.to(torch.float32)
    s = scale_inv.to(torch.float32)
    if s.numel() == 1:
        return w * s.reshape(())
    bN, bK = block
    if w.dim() != 2 or s.dim() != 2:
        raise ValueError(
            f"block scales need a 2-D weight and 2-D scales, got {list(w.shape)} and "
            f"{list(s.shape)}"
        )
    N, K = w.shape
    if (-(-N // bN), -(-K // bK)) != tuple(s.shape):
        raise ValueError(
            f"scales {list(s.shape)} do not tile a weight {list(w.shape)} in {bN}x{bK} blocks "
            f"(that would take {[-(-N // bN), -(-K // bK)]}); the block size comes from the "
            "config's quantization_config.weight_block_size (default 128x128): is it the "
            "checkpoint's?"
        )
    s_NK = s.repeat_interleave(bN, 0)[:N].repeat_interleave(bK, 1)[:, :K]
    return w * s_NK


class CheckpointReader:
    """Lazy, counted access to the tensors of a safetensors checkpoint.

    Args:
        path: a directory holding ``model.safetensors`` or ``model.safetensors.index.json``
            (with the shards it names), or one ``.safetensors`` file.

    ``tensor_names()`` lists every tensor name (from the index or the files' headers; no tensor is
    read). ``get(key)`` reads one tensor onto the CPU; ``reads`` counts them per key
    (``total_reads`` in all). Use as a context manager (or call ``close``) to close the files.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        path = os.fspath(path)
        if os.path.isdir(path):
            index = os.path.join(path, INDEX_NAME)
            single = os.path.join(path, SINGLE_NAME)
            if os.path.isfile(index):
                with open(index) as f:
                    weight_map = json.load(f).get("weight_map")
                if not isinstance(weight_map, dict):
                    raise ValueError(f"{index} has no weight_map; is it a safetensors index?")
                self._file_of = {k: os.path.join(path, v) for k, v in weight_map.items()}
            elif os.path.isfile(single):
                self._file_of = None
                files = [single]
            else:
                raise FileNotFoundError(
                    f"{path} holds neither {SINGLE_NAME} nor {INDEX_NAME}: not a safetensors "
                    "checkpoint directory (save it with save_pretrained(..., "
                    "safe_serialization=True))"
                )
        elif os.path.isfile(path) and path.endswith(".safetensors"):
            self._file_of = None
            files = [path]
        else:
            raise FileNotFoundError(f"no safetensors checkpoint at {path}")
        self.path = path
        self._open: dict[str, object] = {}
        if self._file_of is None:
            (only,) = files
            self._file_of = dict.fromkeys(self._handle(only).keys(), only)
        self.reads: Counter[str] = Counter()

    def _handle(self, file: str):
        handle = self._open.get(file)
        if handle is None:
            if not os.path.isfile(file):
                raise FileNotFoundError(f"the checkpoint index names {file}, which is missing")
            handle = _safetensors().safe_open(file, framework="pt", device="cpu")
            self._open[file] = handle
        return handle

    def tensor_names(self) -> list[str]:
        """Every tensor name in the checkpoint, sorted; reads no tensor."""
        return sorted(self._file_of)

    def __contains__(self, key: str) -> bool:
        return key in self._file_of

    @property
    def total_reads(self) -> int:
        return sum(self.reads.values())

    def get(self, key: str) -> torch.Tensor:
        """Read one tensor (its bytes only) onto the CPU, as stored."""
        if key not in self._file_of:
            raise KeyError(f"{key!r} is not in the checkpoint at {self.path}")
        self.reads[key] += 1
        return self._handle(self._file_of[key]).get_tensor(key)

    def slice(self, key: str):
        """A lazy view of one tensor (safetensors' ``get_slice``): indexing it reads only the
        rows asked for. Counts one read of ``key``."""
        if key not in self._file_of:
            raise KeyError(f"{key!r} is not in the checkpoint at {self.path}")
        self.reads[key] += 1
        return self._handle(self._file_of[key]).get_slice(key)

    def get_weight(
        self, key: str, block: tuple[int, int] = (128, 128), device: torch.device | None = None
    ) -> torch.Tensor:
        """Read a weight; an FP8 one with a ``<key>_scale_inv`` partner is dequantised to
        float32 with scales per ``block`` (the config's
        ``quantization_config.weight_block_size``); both tensors count as read. ``device``:
        moved there as stored, before dequantising (on a GPU: milliseconds, where the CPU
        takes a quarter of a second per DeepSeek-V3 expert)."""
        w = self.get(key)
        if device is not None:
            w = w.to(device)
        scale = key + SCALE_SUFFIX
        if scale in self._file_of:
            try:
                s = self.get(scale)
                return dequantize_fp8(w, s if device is None else s.to(device), tuple(block))
            except ValueError as exc:
                raise ValueError(f"{key}: {exc}") from None
        if w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(
                f"{key} is stored in {w.dtype} without a {scale} scale; epmoe dequantises FP8 "
                "weights only with their scales"
            )
        return w

    def close(self) -> None:
        self._open.clear()  # safe_open handles close when released

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
