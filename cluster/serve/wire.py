"""The Tinker SDK's protobuf wire format for `forward_backward` (requests) and its output (answers).

The SDK (tinker 0.38) sends `/api/v1/forward_backward` as `application/x-protobuf` (optionally zstd
compressed) and accepts a `ForwardBackwardOutput` and a `SampleResponse` only as protobuf from `/api/v1/retrieve_future`
(`Accept: application/x-protobuf`; a JSON answer for that type is an error in the SDK). The schema
below is written here from the field numbers the SDK's `tinker_public.proto` declares (package
`tinker_public`; only the messages this service reads or writes), built at import with protobuf's
descriptor API, so the service needs no `tinker` package. Protobuf matches by field number and wire
type, not by package or message names.

Decoded requests become named records (`FwdBwdRequest`, `WireDatum`); the answer is built from per-datum
float32 arrays (`encode_output`). Token ids travel as int32 bytes, tensors as dense or CSR bytes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F = descriptor_pb2.FieldDescriptorProto
_PKG = "rayppo_tinker_wire"

# (message, [(field, number, type, label, type name or None, oneof index or None)]), map entries nested.
_OPT, _REP = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED
_MESSAGES = {
    "SparseCsr": [("values", 1, _F.TYPE_BYTES, _OPT, None, None),
                  ("crow_indices", 2, _F.TYPE_BYTES, _OPT, None, None),
                  ("col_indices", 3, _F.TYPE_BYTES, _OPT, None, None)],
    "Tensor": [("dense", 1, _F.TYPE_BYTES, _OPT, None, 0),
               ("sparse_csr", 2, _F.TYPE_MESSAGE, _OPT, "SparseCsr", 0),
               ("dtype", 3, _F.TYPE_INT32, _OPT, None, None),  # an enum on the wire: same varint
               ("shape", 4, _F.TYPE_INT64, _REP, None, None)],
    "BatchedTensor": [("data", 1, _F.TYPE_BYTES, _OPT, None, None),
                      ("offsets", 2, _F.TYPE_BYTES, _OPT, None, None),
                      ("dtype", 3, _F.TYPE_INT32, _OPT, None, None),
                      ("trailing_shape", 4, _F.TYPE_INT64, _REP, None, None)],
    "EncodedTextChunk": [("tokens", 1, _F.TYPE_BYTES, _OPT, None, None)],
    "Chunk": [("encoded_text", 1, _F.TYPE_MESSAGE, _OPT, "EncodedTextChunk", 0),
              ("image", 2, _F.TYPE_BYTES, _OPT, None, 0),  # read only to refuse it
              ("dmel", 3, _F.TYPE_BYTES, _OPT, None, 0)],
    "LossConfigValue": [("number", 1, _F.TYPE_DOUBLE, _OPT, None, 0),
                        ("text", 2, _F.TYPE_STRING, _OPT, None, 0)],
}  # fmt: skip
_MAPS = {  # message: [(field, number, value type, value type name)]
    "Datum": [("loss_fn_inputs", 2, _F.TYPE_MESSAGE, "Tensor")],
    "ForwardBackwardRequest": [
        ("loss_fn_config", 5, _F.TYPE_DOUBLE, None),
        ("loss_fn_config_v2", 7, _F.TYPE_MESSAGE, "LossConfigValue"),
    ],
    "ArrayRecord": [("fields", 2, _F.TYPE_MESSAGE, "BatchedTensor")],
    "ForwardBackwardOutput": [("metrics", 3, _F.TYPE_DOUBLE, None)],
}
_MESSAGES |= {
    "Datum": [("model_input", 1, _F.TYPE_MESSAGE, _REP, "Chunk", None)],
    "ForwardBackwardRequest": [("model_id", 1, _F.TYPE_STRING, _OPT, None, None),
                               ("seq_id", 2, _F.TYPE_INT32, _OPT, None, None),
                               ("data", 3, _F.TYPE_MESSAGE, _REP, "Datum", None),
                               ("loss_fn", 4, _F.TYPE_STRING, _OPT, None, None),
                               ("forward_only", 6, _F.TYPE_BOOL, _OPT, None, None)],
    "ArrayRecord": [("type_tag", 1, _F.TYPE_STRING, _OPT, None, None),
                    ("num_datums", 3, _F.TYPE_INT64, _OPT, None, None)],
    "ForwardBackwardOutput": [("loss_fn_output_type", 1, _F.TYPE_STRING, _OPT, None, None),
                              ("loss_fn_outputs", 2, _F.TYPE_MESSAGE, _REP, "ArrayRecord", None)],
    "SampledSequence": [("stop_reason", 1, _F.TYPE_INT32, _OPT, None, None),  # enum: 0 stop, 1 length
                        ("tokens", 2, _F.TYPE_BYTES, _OPT, None, None),
                        ("logprobs", 3, _F.TYPE_BYTES, _OPT, None, None)],
    "SampleResponse": [("sequences", 1, _F.TYPE_MESSAGE, _REP, "SampledSequence", None),
                       ("prompt_logprobs", 2, _F.TYPE_BYTES, _OPT, None, None),
                       ("prompt_cache_hit_tokens", 4, _F.TYPE_INT32, _OPT, None, None)],
}  # fmt: skip
ONEOFS = {"Tensor": "encoding", "Chunk": "chunk", "LossConfigValue": "value"}

DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32 = 1, 2, 3
_NUMPY = {DTYPE_FLOAT32: np.float32, DTYPE_INT64: np.int64, DTYPE_INT32: np.int32}


def _type_name(name: str) -> str:
    return f".{_PKG}.{name}"


def _build() -> dict[str, type]:
    fd = descriptor_pb2.FileDescriptorProto(name="rayppo_tinker_wire.proto", package=_PKG, syntax="proto3")
    for name, fields in _MESSAGES.items():
        msg = fd.message_type.add(name=name)
        if name in ONEOFS:
            msg.oneof_decl.add(name=ONEOFS[name])
        for fname, number, ftype, label, tname, oneof in fields:
            f = msg.field.add(name=fname, number=number, type=ftype, label=label)
            if tname:
                f.type_name = _type_name(tname)
            if oneof is not None:
                f.oneof_index = oneof
        for fname, number, vtype, vname in _MAPS.get(name, []):
            entry = "".join(p.capitalize() for p in fname.split("_")) + "Entry"
            nested = msg.nested_type.add(name=entry)
            nested.options.map_entry = True
            nested.field.add(name="key", number=1, type=_F.TYPE_STRING, label=_OPT)
            v = nested.field.add(name="value", number=2, type=vtype, label=_OPT)
            if vname:
                v.type_name = _type_name(vname)
            msg.field.add(
                name=fname,
                number=number,
                type=_F.TYPE_MESSAGE,
                label=_REP,
                type_name=_type_name(f"{name}.{entry}"),
            )
    pool = descriptor_pool.DescriptorPool()
    file_desc = pool.Add(fd)
    return {n: message_factory.GetMessageClass(file_desc.message_types_by_name[n]) for n in _MESSAGES}


_CLASSES = _build()


class WireError(ValueError):
    """A request the wire format carries but this service does not take (named in the message)."""


@dataclasses.dataclass(frozen=True)
class WireDatum:
    """One datum: its input tokens and its loss inputs as flat numpy arrays (dense, in the sent dtype)."""

    tokens: np.ndarray  # int64 [N]
    inputs: dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class FwdBwdRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[WireDatum]


def _tensor(msg) -> np.ndarray:
    if msg.dtype not in _NUMPY:
        raise WireError(f"tensor dtype {msg.dtype} is not one of float32 (1), int64 (2), int32 (3)")
    dtype = _NUMPY[msg.dtype]
    shape = list(msg.shape)
    if msg.WhichOneof("encoding") == "sparse_csr":
        csr = msg.sparse_csr
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
        if len(shape) != 2:
            raise WireError(f"a sparse CSR tensor needs a 2-D shape (got {shape})")
        dense = np.zeros(shape, dtype=dtype)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        dense[rows, col] = values
        return dense
    arr = np.frombuffer(msg.dense, dtype=dtype).copy()
    return arr.reshape(shape) if shape else arr


def _chunk_tokens(chunk) -> np.ndarray:
    kind = chunk.WhichOneof("chunk")
    if kind != "encoded_text":
        raise WireError(f"model_input chunk {kind!r}: this service takes encoded_text chunks only")
    return np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).astype(np.int64)


def decode_forward_backward(body: bytes) -> FwdBwdRequest:
    """A protobuf `ForwardBackwardRequest` body (already decompressed) as a record. Config values:
    `loss_fn_config_v2` when set (numbers and text), else the legacy float map."""
    msg = _CLASSES["ForwardBackwardRequest"]()
    msg.ParseFromString(body)
    config: dict[str, float | str] = {}
    if len(msg.loss_fn_config_v2):
        for k, v in msg.loss_fn_config_v2.items():
            config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    else:
        config = {k: float(v) for k, v in msg.loss_fn_config.items()}
    data = []
    for d in msg.data:
        parts = [_chunk_tokens(c) for c in d.model_input]
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        data.append(WireDatum(tokens, {k: _tensor(t) for k, t in d.loss_fn_inputs.items()}))
    return FwdBwdRequest(msg.model_id, int(msg.seq_id), msg.loss_fn, config, bool(msg.forward_only), data)


def encode_forward_backward(req: FwdBwdRequest) -> bytes:
    """The inverse of `decode_forward_backward` for dense tensors (tests and tools build requests with it)."""
    msg = _CLASSES["ForwardBackwardRequest"](
        model_id=req.model_id, seq_id=req.seq_id, loss_fn=req.loss_fn, forward_only=req.forward_only
    )
    for k, v in req.loss_fn_config.items():
        if isinstance(v, str):
            msg.loss_fn_config_v2[k].text = v
        else:
            msg.loss_fn_config[k] = float(v)
            msg.loss_fn_config_v2[k].number = float(v)
    for datum in req.data:
        d = msg.data.add()
        d.model_input.add().encoded_text.tokens = np.asarray(datum.tokens, dtype=np.int32).tobytes()
        for k, arr in datum.inputs.items():
            dtype = DTYPE_INT64 if np.issubdtype(arr.dtype, np.integer) else DTYPE_FLOAT32
            t = d.loss_fn_inputs[k]
            t.dtype = dtype
            t.shape.extend(arr.shape)
            t.dense = np.asarray(arr, dtype=_NUMPY[dtype]).tobytes()
    return msg.SerializeToString()


def encode_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """A protobuf `ForwardBackwardOutput`: one `ArrayRecord` whose fields are the per-datum float32 arrays
    concatenated (`BatchedTensor.offsets`: n + 1 byte offsets, int64), with scalar metrics named
    `<name>:<reduction>` as the SDK reduces them across chunks (e.g. `loss:sum`)."""
    out = _CLASSES["ForwardBackwardOutput"](loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
    names = list(outputs[0]) if outputs else []
    for name in names:
        arrays = [np.asarray(o[name], dtype=np.float32).reshape(-1) for o in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        bt = record.fields[name]
        bt.data = b"".join(a.tobytes() for a in arrays)
        bt.offsets = offsets.tobytes()
        bt.dtype = DTYPE_FLOAT32
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    return out.SerializeToString()


def decode_output(body: bytes) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
    """The inverse of `encode_output` (for tests of this module)."""
    out = _CLASSES["ForwardBackwardOutput"]()
    out.ParseFromString(body)
    rows: list[dict[str, np.ndarray]] = []
    for record in out.loss_fn_outputs:
        n = int(record.num_datums)
        part: list[dict[str, np.ndarray]] = [{} for _ in range(n)]
        for name, bt in record.fields.items():
            offs = np.frombuffer(bt.offsets, dtype=np.int64)
            for i in range(n):
                part[i][name] = np.frombuffer(bt.data[offs[i] : offs[i + 1]], dtype=np.float32)
        rows += part
    return rows, dict(out.metrics)


STOP_REASONS = {"stop": 0, "length": 1}


def encode_sample_response(
    sequences: list[tuple[np.ndarray, np.ndarray, str]], prompt_logprobs: np.ndarray | None
) -> bytes:
    """A protobuf `SampleResponse`: per sequence (tokens as int32 bytes, logprobs as float32 bytes, stop
    reason 'stop' | 'length'), and the prompt's logprobs (float32, NaN at position 0) when asked for."""
    out = _CLASSES["SampleResponse"]()
    for tokens, logprobs, reason in sequences:
        out.sequences.add(
            stop_reason=STOP_REASONS[reason],
            tokens=np.asarray(tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(logprobs, dtype=np.float32).tobytes(),
        )
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return out.SerializeToString()
