"""The messages between an engine's ranks, without pickle: JSON for their shape, safetensors for tensors.

What crosses a follower's control pipe is plain data: numbers, strings, lists, tuples, string-keyed
dicts, enums, dataclasses, tensors and arrays (and `TensorData`). A message is one buffer: the length
of its JSON header (8 bytes, little-endian), the header, and the tensors it names as one safetensors
blob. A receiver builds only the dataclasses and enums it is given by name (`decode`'s `types`), so a
message can make nothing else, as a checkpoint cannot (`workbench.storage.checkpoint_store`).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from workbench.types import TensorData

_HEADER_BYTES = 8


def encode(message: Any) -> bytes:
    """One buffer for `message` (raises TypeError naming what it cannot carry)."""
    tensors: dict[str, torch.Tensor] = {}

    def tensor_key(tensor: torch.Tensor) -> str:
        key = str(len(tensors))
        tensors[key] = tensor.detach().cpu().clone().contiguous()  # owns its memory, as safetensors asks
        return key

    def walk(value: Any) -> Any:
        if isinstance(value, enum.Enum):  # first: a StrEnum is a str too
            return {"$enum": type(value).__name__, "value": value.value}
        if value is None or isinstance(value, bool | int | float | str):
            return value
        if isinstance(value, torch.Tensor):
            return {"$tensor": tensor_key(value)}
        if isinstance(value, TensorData):
            return {"$tensor_data": tensor_key(torch.from_numpy(np.array(value.array))), "dtype": value.dtype}
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = {f.name: walk(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
            return {"$type": type(value).__name__, "fields": fields}
        if isinstance(value, tuple):
            return {"$tuple": [walk(item) for item in value]}
        if isinstance(value, list):
            return [walk(item) for item in value]
        if isinstance(value, Mapping) and all(isinstance(key, str) for key in value):
            return {"$dict": {key: walk(item) for key, item in value.items()}}
        raise TypeError(f"a rank message cannot carry {type(value).__name__}")

    header = json.dumps(walk(message)).encode()
    return (
        len(header).to_bytes(_HEADER_BYTES, "little") + header + (save_tensors(tensors) if tensors else b"")
    )


def decode(buffer: bytes, types: Mapping[str, type]) -> Any:
    """The message `encode` made, building only the dataclasses and enums of `types` (by class name)."""
    length = int.from_bytes(buffer[:_HEADER_BYTES], "little")
    tree = json.loads(buffer[_HEADER_BYTES : _HEADER_BYTES + length])
    rest = buffer[_HEADER_BYTES + length :]
    tensors = load_tensors(rest) if rest else {}

    def known(name: str) -> type:
        if name not in types:
            raise ValueError(f"a rank message names {name!r}, which this rank does not take")
        return types[name]

    def walk(value: Any) -> Any:
        if isinstance(value, list):
            return [walk(item) for item in value]
        if not isinstance(value, dict):
            return value
        if "$tensor" in value:
            return tensors[value["$tensor"]]
        if "$tensor_data" in value:
            return TensorData(tensors[value["$tensor_data"]].numpy(), value["dtype"])
        if "$enum" in value:
            return known(value["$enum"])(value["value"])
        if "$type" in value:
            return known(value["$type"])(**{name: walk(item) for name, item in value["fields"].items()})
        if "$tuple" in value:
            return tuple(walk(item) for item in value["$tuple"])
        return {key: walk(item) for key, item in value["$dict"].items()}

    return walk(tree)
