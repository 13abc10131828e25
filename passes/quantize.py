"""Block quantizers for compressed collectives, written once for eager tensors and for graph nodes.

Every function takes `call(target, *args, **kwargs)`: `eager` runs the aten op on tensors (the references and numerics tests);
`passes.compress` hands in a node emitter, so the graph gets exactly these ops, which Inductor can fuse.

A packed row is one uint8 buffer per row of the input, so a collective moves values and scales together:
`[codes of nb * B elements | nb float32 scales as bytes]` with nb = ceil(n / B) blocks of B elements (the last one
zero-padded). Scheme:
- "int8": symmetric, scale = max|x| / 127 per block, codes round(x / scale) in [-127, 127]; error <= scale / 2;
- "int4": the same with 7 levels, codes + 8 two per byte (low nibble first); error <= scale / 2;
- "fp8": float8_e4m3fn codes of x / scale, scale = max|x| / 448; relative error <= 2^-4 per element (3 mantissa
  bits), subnormal codes below 2^-6 * scale.
A row can also be cut into segments with a block size each (`pack_segments`: fp8 weights in the rows layout, one
scale per row of every parameter); a segment is packed as above and the packed segments follow one another.
A block whose max is below 127 * 2^-126 (7 or 448 times, int4 and fp8; all zeros included) gets the scale 2^-126,
so nothing divides by 0: a zero block comes back as zeros, a tiny one within 2^-127. Huge finite values cannot
overflow: every code is |x| / scale <= the largest level. Scales are float32 whatever the input dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_aten, _prims = torch.ops.aten, torch.ops.prims

Call = Callable[..., Any]
SCHEMES = ("int8", "int4", "fp8")
_LEVELS = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}  # the largest code magnitude
_SMALLEST_SCALE = 2.0**-126  # float32's smallest normal: a zero block divides by this, not by 0


def eager(target: Any, *args: Any, **kwargs: Any) -> Any:
    """`call` for tensors: run the op."""
    return target(*args, **kwargs)


def check_scheme(scheme: str, block_size: int) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown compression scheme {scheme!r}; expected one of {SCHEMES}")
    if block_size < 2 or block_size % 4:
        raise ValueError(f"compression block_size must be a positive multiple of 4, got {block_size}")


def blocks_of(n: int, block_size: int) -> int:
    return -(-n // block_size)


def code_bytes(n: int, scheme: str, block_size: int) -> int:
    padded = blocks_of(n, block_size) * block_size
    return padded // 2 if scheme == "int4" else padded


def packed_bytes(n: int, scheme: str, block_size: int) -> int:
    """Bytes of one packed row of n elements: codes plus one float32 scale per block."""
    return code_bytes(n, scheme, block_size) + 4 * blocks_of(n, block_size)


def _clamp(call: Call, x: Any, level: float) -> Any:
    # clamp_min/clamp_max, not clamp: Inductor lowers these in a post-grad graph (it only decomposes `clamp`).
    return call(_aten.clamp_max.default, call(_aten.clamp_min.default, x, -level), level)


def pack_rows(x: Any, rows: int, n: int, scheme: str, block_size: int, call: Call = eager) -> Any:
    """`x` (a contiguous (rows, n) floating tensor) -> (rows, packed_bytes) uint8: each row quantized in blocks."""
    nb = blocks_of(n, block_size)
    padded = nb * block_size
    dtype = x.dtype if isinstance(x, torch.Tensor) else x.meta["val"].dtype  # a tensor, or a node (graph mode)
    values = x if dtype == torch.float32 else call(_prims.convert_element_type.default, x, torch.float32)
    if padded != n:
        values = call(_aten.constant_pad_nd.default, values, [0, padded - n], 0.0)
    blocks = call(_aten.view.default, values, [rows, nb, block_size])
    level = _LEVELS[scheme]
    amax = call(_aten.amax.default, call(_aten.abs.default, blocks), [2], True)
    scale = call(_aten.clamp_min.default, call(_aten.div.Tensor, amax, level), _SMALLEST_SCALE)
    scaled = call(_aten.div.Tensor, blocks, scale)
    if scheme == "fp8":
        clamped = _clamp(call, scaled, level)
        codes = call(_prims.convert_element_type.default, clamped, torch.float8_e4m3fn)
    else:
        rounded = _clamp(call, call(_aten.round.default, scaled), level)
        if scheme == "int4":  # codes + 8 in [1, 15]
            rounded = call(_aten.add.Tensor, rounded, 8.0)
        # int8 even for int4's [1, 15]: Inductor vectorizes float -> int8, not float -> uint8 (8x slower packing)
        codes = call(_prims.convert_element_type.default, rounded, torch.int8)
    if scheme == "int4":  # pairs of neighbours share a byte, low nibble first
        pairs = call(_aten.view.default, codes, [rows, padded // 2, 2])
        low = call(_aten.select.int, pairs, 2, 0)
        high = call(_aten.select.int, pairs, 2, 1)
        nibbles = call(_aten.add.Tensor, low, call(_aten.mul.Tensor, high, 16))  # wraps in int8: the same bits
        code_row = call(_aten.view.dtype, nibbles, torch.uint8)
    else:
        code_row = call(_aten.view.dtype, call(_aten.view.default, codes, [rows, padded]), torch.uint8)
    scale_row = _bytes_of_float32(call, call(_aten.view.default, scale, [rows, nb]), rows, nb)
    return call(_aten.cat.default, [code_row, scale_row], 1)


def _bytes_of_float32(call: Call, words: Any, rows: int, nb: int) -> Any:
    """(rows, nb) float32 -> (rows, 4 * nb) little-endian bytes, bit for bit: an equal-size bitcast to int32, then
    shifts and masks. Not `view.dtype(uint8)`: Inductor lowers a bitcast between sizes as an eager fallback, which
    torch 2.11 builds with stride 0 for a (1, 1) view of a reduction and rejects ('self.stride(-1) must be 1 to view
    Float as Byte'); this form is pointwise and fuses into the packing kernel."""
    as_int = call(_aten.view.dtype, words, torch.int32)
    parts = []
    for i in range(4):
        shifted = as_int if i == 0 else call(_aten.bitwise_right_shift.Tensor_Scalar, as_int, 8 * i)
        byte = call(_prims.convert_element_type.default, call(_aten.bitwise_and.Scalar, shifted, 255), torch.uint8)
        parts.append(call(_aten.unsqueeze.default, byte, 2))
    return call(_aten.view.default, call(_aten.cat.default, parts, 2), [rows, 4 * nb])


def _float32_of_bytes(call: Call, scale_bytes: Any, rows: int, nb: int) -> Any:
    """(rows, 4 * nb) little-endian bytes -> (rows, nb) float32, bit for bit. Built from int arithmetic and a bitcast
    of equal size: Inductor (torch 2.13, CPU) miscompiles a uint8 -> float32 `view.dtype` whose consumer is sliced
    (the padded last block: garbage scales), while int32 -> float32 bitcasts are plain loads."""
    as_int = call(
        _prims.convert_element_type.default, call(_aten.view.default, scale_bytes, [rows, nb, 4]), torch.int64
    )
    word = call(_aten.select.int, as_int, 2, 0)
    for i in (1, 2, 3):
        word = call(_aten.add.Tensor, word, call(_aten.mul.Tensor, call(_aten.select.int, as_int, 2, i), 256**i))
    return call(_aten.view.dtype, call(_prims.convert_element_type.default, word, torch.int32), torch.float32)


def unpack_rows(packed: Any, rows: int, n: int, dtype: torch.dtype, scheme: str, block_size: int, call: Call = eager):
    """(rows, packed_bytes) uint8 -> contiguous (rows, n) tensor of `dtype`: `pack_rows` undone (up to its error)."""
    nb = blocks_of(n, block_size)
    padded = nb * block_size
    coded = code_bytes(n, scheme, block_size)
    code_row = call(_aten.slice.Tensor, packed, 1, 0, coded)
    scale_bytes = call(_aten.slice.Tensor, packed, 1, coded, coded + 4 * nb)
    if padded != n:
        scale_words = _float32_of_bytes(call, scale_bytes, rows, nb)
    else:  # a plain bitcast: the fast path (the int arithmetic above costs ~1 ns per element under Inductor)
        scale_dense = call(_aten.clone.default, scale_bytes, memory_format=torch.contiguous_format)
        scale_words = call(_aten.view.dtype, scale_dense, torch.float32)
    scale = call(_aten.view.default, scale_words, [rows, nb, 1])
    if scheme == "int4":
        low = call(_aten.bitwise_and.Scalar, code_row, 15)
        high = call(_aten.bitwise_right_shift.Tensor_Scalar, code_row, 4)
        pairs = call(_aten.cat.default, [call(_aten.unsqueeze.default, t, 2) for t in (low, high)], 2)
        biased = call(_prims.convert_element_type.default, pairs, torch.float32)
        values = call(_aten.view.default, call(_aten.sub.Tensor, biased, 8.0), [rows, nb, block_size])
    else:
        code_type = torch.float8_e4m3fn if scheme == "fp8" else torch.int8
        codes = call(_aten.view.dtype, code_row, code_type)
        values = call(
            _aten.view.default, call(_prims.convert_element_type.default, codes, torch.float32), [rows, nb, block_size]
        )
    restored = call(_aten.view.default, call(_aten.mul.Tensor, values, scale), [rows, padded])
    if padded != n:
        restored = call(
            _aten.clone.default, call(_aten.slice.Tensor, restored, 1, 0, n), memory_format=torch.contiguous_format
        )
    return restored if dtype == torch.float32 else call(_prims.convert_element_type.default, restored, dtype)


Segments = tuple[tuple[int, int], ...]  # (elements, elements per scale), in order, covering the row


def segmented_bytes(segments: Segments, scheme: str) -> int:
    return sum(packed_bytes(n, scheme, block) for n, block in segments)


def pack_segments(x: Any, rows: int, segments: Segments, scheme: str, call: Call = eager) -> Any:
    """`pack_rows` of each segment of the (rows, n) tensor `x` with its own block size, concatenated along dim 1."""
    if len(segments) == 1:
        ((n, block),) = segments
        return pack_rows(x, rows, n, scheme, block, call)
    parts, lo = [], 0
    for n, block in segments:
        piece = call(_aten.slice.Tensor, x, 1, lo, lo + n)
        if rows > 1:  # a column range of several rows is strided: pack_rows views it as blocks
            piece = call(_aten.clone.default, piece, memory_format=torch.contiguous_format)
        parts.append(pack_rows(piece, rows, n, scheme, block, call))
        lo += n
    return call(_aten.cat.default, parts, 1)


def unpack_segments(packed: Any, rows: int, segments: Segments, dtype: torch.dtype, scheme: str, call: Call = eager):
    """(rows, segmented_bytes) uint8 -> contiguous (rows, n) tensor of `dtype`: `pack_segments` undone."""
    if len(segments) == 1:
        ((n, block),) = segments
        return unpack_rows(packed, rows, n, dtype, scheme, block, call)
    parts, lo = [], 0
    for n, block in segments:
        size = packed_bytes(n, scheme, block)
        parts.append(
            unpack_rows(call(_aten.slice.Tensor, packed, 1, lo, lo + size), rows, n, dtype, scheme, block, call)
        )
        lo += size
    return call(_aten.cat.default, parts, 1)


def round_trip(x: torch.Tensor, scheme: str, block_size: int, segments: Segments | None = None) -> torch.Tensor:
    """A 1-D tensor quantized and restored in one block row, as one rank's gathered shard is (eager); with
    `segments`, each segment with its own block size instead."""
    n = x.numel()
    segments = segments or ((n, block_size),)
    packed = pack_segments(x.reshape(1, n).contiguous(), 1, segments, scheme)
    return unpack_segments(packed, 1, segments, x.dtype, scheme).view(n)
