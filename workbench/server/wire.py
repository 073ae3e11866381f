"""Between the SDK's wire format and workbench's types: protobuf (the SDK's own `tinker_public_pb2`)
and JSON.

Since SDK 0.25 a `forward_backward` body is a protobuf `ForwardBackwardRequest` (zstd-compressed when
the server's client config asks for it), and the SDK reads `ForwardBackwardOutput` and `SampleResponse`
results only as protobuf. The layouts, as the SDK's `proto/request_conv.py` and `response_conv.py`
write and read them:

* a text chunk's tokens are int32 little-endian bytes; a `Tensor` is dense bytes of its dtype
  (float32 or int64) with a shape, or sparse CSR (values, int64 row and column indices);
* a datum's provenance spans (`stable_reinforce` reads them) name a sampled sequence or a request's prompt;
* a result's per-datum outputs are one `ArrayRecord`: for each output name a `BatchedTensor` with every
  datum's array concatenated and `offsets`, the n+1 byte offsets of the datums' slices;
* sampled tokens are int32 bytes, logprobs float32 bytes, the prompt's logprobs float32 with NaN where
  nothing predicts the token (its first);
* top-k logprobs (of the prompt, of each sequence) are a `TopkLogprobs`: (length, k) int32 token ids and
  float32 logprobs, a position without any (None) filled with id 0 and logprob −99999;
* `target_prompt_logprobs` comes in as the SDK's JSON tensor (dense, or sparse CSR whose unlisted cells
  are −1) and goes back as a float32 `Tensor` of the same shape and layout; `prompt_alt_tokens` as two
  dense `Tensor`s.

Everything read from the wire is checked (sizes agree with dtypes and shapes, values are what the field
holds) and a `RequestError` names the datum and field that is wrong; nothing reaches the engine unread.
Clients that ask for JSON (SDKs before 0.25 did) get the JSON shapes instead.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from workbench.server.errors import BodyTooLarge, RequestError
from workbench.types import (
    Datum,
    ForwardBackwardOutput,
    ModelInput,
    PromptProvenanceSpan,
    ProvenanceSpan,
    SampledProvenanceSpan,
    SampleResponse,
    TensorData,
)

PROTOBUF = "application/x-protobuf"
MAX_TENSOR_ELEMENTS = 2**24
"""The most values one loss input may hold: a sparse tensor is expanded to its dense shape, so its shape,
not its size on the wire, is what it costs (2**24 is a [4096, 4096] tensor, 64 MiB of float32)."""
TOPK_MASK_LOGPROB = -99999.0  # the SDK's `MASK_LOGPROB`: a top-k row with nothing in it

_DTYPES: dict[int, tuple[np.dtype, str]] = {
    pb.DTYPE_FLOAT32: (np.dtype("<f4"), "float32"),
    pb.DTYPE_INT64: (np.dtype("<i8"), "int64"),
    pb.DTYPE_INT32: (np.dtype("<i4"), "int64"),
}
_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


@dataclass(frozen=True)
class ForwardBackwardCall:
    """A forward_backward request: its envelope read, its data read on demand (`data()`), so that bad
    data fails the operation that holds its seq_id rather than the HTTP request."""

    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    message: pb.ForwardBackwardRequest

    def data(self) -> list[Datum]:
        return [_datum(datum, index) for index, datum in enumerate(self.message.data)]

    def loss_fn_config(self) -> dict[str, float]:
        return _loss_fn_config(self.message)


def decompress(body: bytes, max_bytes: int) -> bytes:
    """Undo `Content-Encoding: zstd`, refusing output beyond `max_bytes` (a small body can expand a lot)."""
    try:
        with zstandard.ZstdDecompressor().stream_reader(body) as reader:
            data = reader.read(max_bytes + 1)
    except zstandard.ZstdError as error:
        raise RequestError(f"the request body is not valid zstd: {error}") from None
    if len(data) > max_bytes:
        raise BodyTooLarge(
            f"the decompressed request body exceeds the server's limit of {max_bytes} bytes", data
        )
    return data


def _varint(body: bytes, at: int) -> tuple[int, int]:
    """The protobuf varint at `at` and the position after it; IndexError past the end."""
    value = shift = 0
    while True:
        byte = body[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def envelope(body: bytes) -> tuple[str, int] | None:
    """The `(model_id, seq_id)` a request body names, read from as much of it as there is (a body over
    the size limit is cut short), or None when it names none. For a refused request, whose seq_id the
    client counted all the same: JSON as the SDK sends it, or a protobuf `ForwardBackwardRequest`
    (model_id is field 1 and seq_id field 2, which the SDK writes first)."""
    with contextlib.suppress(ValueError, RecursionError):
        data = json.loads(body)
        if isinstance(data, dict):
            model_id, seq_id = data.get("model_id"), data.get("seq_id")
            if isinstance(model_id, str) and isinstance(seq_id, int) and not isinstance(seq_id, bool):
                return model_id, seq_id
            return None
    model_id, seq_id, at = None, None, 0
    with contextlib.suppress(IndexError, ValueError, UnicodeDecodeError):
        while at < len(body) and (model_id is None or seq_id is None):
            tag, at = _varint(body, at)
            field, kind = tag >> 3, tag & 7
            if kind == 0:
                value, at = _varint(body, at)
                if field == 2:
                    seq_id = value
            elif kind == 2:
                size, at = _varint(body, at)
                if field == 1:
                    model_id = body[at : at + size].decode()
                at += size
            else:
                break
    return (model_id, seq_id) if model_id and seq_id is not None else None


def _array(raw: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise RequestError(f"{where}: {len(raw)} bytes is not a whole number of {dtype.name} values")
    return np.frombuffer(raw, dtype=dtype)


def _tensor(message: pb.Tensor, where: str) -> TensorData:
    if message.dtype not in _DTYPES:
        raise RequestError(f"{where}: unsupported dtype {message.dtype} (float32 or int64)")
    dtype, name = _DTYPES[message.dtype]
    shape = [int(n) for n in message.shape]
    if any(n < 0 for n in shape) or math.prod(shape) > MAX_TENSOR_ELEMENTS:
        raise RequestError(
            f"{where}: shape {shape} is not a tensor this server takes (sizes >= 0, at most "
            f"{MAX_TENSOR_ELEMENTS} values)"
        )
    if message.WhichOneof("encoding") == "sparse_csr":
        csr = message.sparse_csr
        values = _array(csr.values, dtype, where)
        rows = _array(csr.crow_indices, np.dtype("<i8"), where)
        columns = _array(csr.col_indices, np.dtype("<i8"), where)
        if len(shape) != 2 or len(rows) != shape[0] + 1 or len(columns) != len(values):
            raise RequestError(f"{where}: sparse tensor indices do not match its shape {shape}")
        if (
            rows[0] != 0
            or rows[-1] != len(values)
            or np.any(np.diff(rows) < 0)
            or np.any((columns < 0) | (columns >= shape[1]))
        ):
            raise RequestError(f"{where}: sparse tensor indices are out of range for shape {shape}")
        dense = np.zeros(shape, dtype=dtype)
        row_of_value = np.repeat(np.arange(shape[0]), np.diff(rows))
        dense[row_of_value, columns] = values
        return TensorData(dense, name)
    values = _array(message.dense, dtype, where)
    if shape and math.prod(shape) != len(values):
        raise RequestError(f"{where}: {len(values)} values do not fill shape {shape}")
    return TensorData(values.reshape(shape) if shape else values, name)


def _spans(spans: Any, where: str) -> tuple[ProvenanceSpan, ...]:
    """Provenance spans (which sampled sequence, or which request's prompt, a run of positions is from)."""
    out: list[ProvenanceSpan] = []
    for position, span in enumerate(spans):
        kind = span.WhichOneof("span")
        arm = span.sampled_tokens if kind == "sampled_tokens" else span.prompt_tokens
        make = SampledProvenanceSpan if kind == "sampled_tokens" else PromptProvenanceSpan
        if kind is None:
            raise RequestError(f"{where}[{position}] is an empty provenance span")
        try:
            out.append(make(sequence_id=arm.sequence_id, offset=int(arm.offset), length=int(arm.length)))
        except ValueError as error:
            raise RequestError(f"{where}[{position}]: {error}") from None
    return tuple(out)


def _datum(message: pb.Datum, index: int) -> Datum:
    tokens: list[np.ndarray] = []
    for position, chunk in enumerate(message.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise RequestError(
                f"data[{index}].model_input.chunks[{position}] is a {kind!r} chunk; this server reads text only"
            )
        tokens.append(_array(chunk.encoded_text.tokens, np.dtype("<i4"), f"data[{index}].model_input"))
    ids = np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int32)
    inputs = {
        name: _tensor(tensor, f"data[{index}].loss_fn_inputs[{name!r}]")
        for name, tensor in message.loss_fn_inputs.items()
    }
    has_spans = bool(len(message.model_input_spans) or len(message.loss_fn_input_spans))
    try:
        return Datum(
            model_input=ModelInput.from_ints(ids.tolist()),
            loss_fn_inputs=inputs,
            model_input_spans=_spans(message.model_input_spans, f"data[{index}].model_input_spans")
            if has_spans
            else None,
            loss_fn_input_spans=(
                _spans(message.loss_fn_input_spans, f"data[{index}].loss_fn_input_spans")
                if has_spans
                else None
            ),
        )
    except ValueError as error:
        raise RequestError(f"data[{index}]: {error}") from None


def _loss_fn_config(message: pb.ForwardBackwardRequest) -> dict[str, float]:
    """The loss settings: the v2 map when the SDK sent it (it mirrors numbers into the old one)."""
    config: dict[str, float] = {key: float(value) for key, value in message.loss_fn_config.items()}
    for key, value in message.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise RequestError(
                f"loss_fn_config[{key!r}] is text ({value.text!r}); this server's losses take numbers"
            )
        config[key] = float(value.number)
    return config


def parse_forward_backward(body: bytes) -> ForwardBackwardCall:
    """Decode a protobuf `ForwardBackwardRequest`."""
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except DecodeError as error:
        raise RequestError(
            f"the forward_backward body is not a valid ForwardBackwardRequest: {error}"
        ) from None
    if not message.model_id:
        raise RequestError("forward_backward: model_id is missing")
    return ForwardBackwardCall(
        model_id=message.model_id,
        seq_id=int(message.seq_id),
        loss_fn=message.loss_fn,
        forward_only=message.forward_only,
        message=message,
    )


# ---------------------------------------------------------------------------------------------- results


def _batched(arrays: list[np.ndarray]) -> pb.BatchedTensor:
    """Per-datum arrays of one output as a `BatchedTensor` (concatenated, with byte offsets)."""
    integer = all(array.dtype.kind in "iub" for array in arrays)
    dtype = np.dtype("<i8") if integer else np.dtype("<f4")
    flat = [np.ascontiguousarray(array, dtype=dtype) for array in arrays]
    trailing = list(flat[0].shape[1:]) if flat else []
    sizes = np.array([0] + [array.nbytes for array in flat], dtype=np.int64)
    return pb.BatchedTensor(
        data=b"".join(array.tobytes() for array in flat),
        offsets=np.cumsum(sizes).astype("<i8").tobytes(),
        dtype=pb.DTYPE_INT64 if integer else pb.DTYPE_FLOAT32,
        trailing_shape=trailing,
    )


def forward_backward_output_proto(output: ForwardBackwardOutput) -> bytes:
    names = list(output.loss_fn_outputs[0]) if output.loss_fn_outputs else []
    record = pb.ArrayRecord(
        type_tag=output.loss_fn_output_type,
        num_datums=len(output.loss_fn_outputs),
        fields={
            name: _batched([datum[name].to_numpy() for datum in output.loss_fn_outputs]) for name in names
        },
    )
    message = pb.ForwardBackwardOutput(
        loss_fn_output_type=output.loss_fn_output_type,
        loss_fn_outputs=[record],
        metrics={key: float(value) for key, value in output.metrics.items()},
    )
    return message.SerializeToString()


def forward_backward_output_json(output: ForwardBackwardOutput) -> dict[str, Any]:
    return {
        "loss_fn_output_type": output.loss_fn_output_type,
        "loss_fn_outputs": [
            {name: _tensor_json(tensor) for name, tensor in datum.items()} for datum in output.loss_fn_outputs
        ],
        "metrics": dict(output.metrics),
    }


def _tensor_json(tensor: TensorData) -> dict[str, Any]:
    return {"data": tensor.data, "dtype": tensor.dtype, "shape": tensor.shape}


def _prompt_logprobs_array(prompt_logprobs: list[float | None]) -> np.ndarray:
    return np.array([math.nan if lp is None else lp for lp in prompt_logprobs], dtype="<f4")


@dataclass(frozen=True)
class SparseLayout:
    """The CSR layout of a sparse `target_prompt_logprobs` request, which its answer keeps."""

    crow_indices: np.ndarray
    col_indices: np.ndarray


def target_ids(body: dict[str, Any]) -> tuple[np.ndarray, SparseLayout | None]:
    """A `target_prompt_logprobs` request tensor (the SDK's JSON `TensorData`) as dense int64 ids, −1 in
    every cell a sparse one leaves out, and its sparse layout (None when dense)."""
    where = "target_prompt_logprobs"
    if not isinstance(body, dict) or body.get("dtype") != "int64":
        raise RequestError(f"{where} must be an int64 tensor of token ids")
    shape = body.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) != 2
        or not all(isinstance(n, int) and n >= 0 for n in shape)
    ):
        raise RequestError(f"{where} must be 2-D, [len(prompt) - 1, K], got shape {shape!r}")
    try:
        values = np.asarray(body.get("data", []), dtype=np.int64).reshape(-1)
        crow, col = body.get("sparse_crow_indices"), body.get("sparse_col_indices")
        if (crow is None) != (col is None):
            raise RequestError(f"{where}: sparse_crow_indices and sparse_col_indices come together")
        if crow is None:
            if len(values) != shape[0] * shape[1]:
                raise RequestError(f"{where}: {len(values)} values do not fill shape {shape}")
            return values.reshape(shape), None
        rows = np.asarray(crow, dtype=np.int64).reshape(-1)
        columns = np.asarray(col, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError):
        raise RequestError(f"{where}: data and indices must be lists of integers") from None
    if (
        len(rows) != shape[0] + 1
        or len(columns) != len(values)
        or rows[0] != 0
        or rows[-1] != len(values)
        or np.any(np.diff(rows) < 0)
        or np.any((columns < 0) | (columns >= shape[1]))
    ):
        raise RequestError(f"{where}: sparse indices do not match shape {shape}")
    dense = np.full(shape, -1, dtype=np.int64)
    dense[np.repeat(np.arange(shape[0]), np.diff(rows)), columns] = values
    return dense, SparseLayout(rows, columns)


def _topk_proto(entries: list[list[tuple[int, float]] | None]) -> pb.TopkLogprobs:
    k = max((len(row) for row in entries if row is not None), default=0)
    ids = np.zeros((len(entries), k), dtype="<i4")
    logprobs = np.full((len(entries), k), TOPK_MASK_LOGPROB, dtype="<f4")
    for position, row in enumerate(entries):
        for column, (token, logprob) in enumerate(row or ()):
            ids[position, column] = token
            logprobs[position, column] = logprob
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=logprobs.tobytes(), k=k, length=len(entries))


def _tensor_proto(tensor: TensorData, layout: SparseLayout | None = None) -> pb.Tensor:
    integer = tensor.dtype == "int64"
    dtype = np.dtype("<i8") if integer else np.dtype("<f4")
    array = np.ascontiguousarray(tensor.to_numpy(), dtype=dtype)
    message = pb.Tensor(dtype=pb.DTYPE_INT64 if integer else pb.DTYPE_FLOAT32, shape=list(array.shape))
    if layout is None:
        message.dense = array.tobytes()
        return message
    rows = np.repeat(np.arange(array.shape[0]), np.diff(layout.crow_indices))
    message.sparse_csr.values = np.ascontiguousarray(array[rows, layout.col_indices]).tobytes()
    message.sparse_csr.crow_indices = layout.crow_indices.astype("<i8").tobytes()
    message.sparse_csr.col_indices = layout.col_indices.astype("<i8").tobytes()
    return message


def sample_response_proto(response: SampleResponse, target_layout: SparseLayout | None = None) -> bytes:
    """The SDK's `SampleResponse`; `target_layout` is the sparse layout its target ids came in."""
    sequences = []
    for sequence in response.sequences:
        item = pb.SampledSequence(
            stop_reason=_STOP_REASONS[sequence.stop_reason],
            tokens=np.asarray(sequence.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(sequence.logprobs, dtype="<f4").tobytes(),
        )
        if sequence.topk_logprobs is not None:
            item.topk_sampled_logprobs.CopyFrom(_topk_proto(sequence.topk_logprobs))
        sequences.append(item)
    message = pb.SampleResponse(sequences=sequences, prompt_cache_hit_tokens=0)
    if response.prompt_logprobs is not None:
        message.prompt_logprobs = _prompt_logprobs_array(response.prompt_logprobs).tobytes()
    if response.topk_prompt_logprobs is not None:
        message.topk_prompt_logprobs.CopyFrom(_topk_proto(response.topk_prompt_logprobs))
    if response.target_prompt_logprobs is not None:
        message.target_prompt_logprobs.CopyFrom(_tensor_proto(response.target_prompt_logprobs, target_layout))
    if response.prompt_alt_tokens is not None:
        message.prompt_alt_tokens.tokens.CopyFrom(_tensor_proto(response.prompt_alt_tokens.tokens))
        message.prompt_alt_tokens.logprobs.CopyFrom(_tensor_proto(response.prompt_alt_tokens.logprobs))
    return message.SerializeToString()


def sample_response_json(response: SampleResponse) -> dict[str, Any]:
    """The JSON shape older SDKs read (sampled tokens and logprobs, prompt logprobs, top-k lists)."""
    body: dict[str, Any] = {
        "type": "sample",
        "sequences": [
            {"tokens": list(s.tokens), "logprobs": list(s.logprobs), "stop_reason": s.stop_reason}
            | ({} if s.topk_logprobs is None else {"topk_logprobs": s.topk_logprobs})
            for s in response.sequences
        ],
        "prompt_logprobs": response.prompt_logprobs,
    }
    if response.topk_prompt_logprobs is not None:
        body["topk_prompt_logprobs"] = response.topk_prompt_logprobs
    return body
