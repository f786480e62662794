"""engine/models/gguf.reuse_readers: one parse of a GGUF file's metadata per file version while
it is active (the conversion and the real-checkpoint tests rely on it for their load times)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from pdserve.engine.models import gguf as gguf_source


def tiny_gguf(path: Path, rows: int) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((rows, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_one_reader_per_file_and_version_while_active(tmp_path: Path) -> None:
    original = gguf.GGUFReader
    a, b = tiny_gguf(tmp_path / "a.gguf", 4), tiny_gguf(tmp_path / "b.gguf", 4)
    assert gguf.GGUFReader(str(a)) is not gguf.GGUFReader(str(a))  # outside: a parse each
    with gguf_source.reuse_readers():
        first = gguf.GGUFReader(str(a))
        with gguf_source.reuse_readers():  # re-entrant: the same readers
            assert gguf.GGUFReader(str(tmp_path / "." / "a.gguf")) is first
        assert gguf.GGUFReader(str(a)) is first  # the inner exit kept the sharing on
        assert gguf.GGUFReader(str(b)) is not first
        tiny_gguf(a, 6)  # a new version of the file (size and mtime): parsed again
        second = gguf.GGUFReader(str(a))
        assert second is not first
        assert second.tensors[0].shape.tolist() == [8, 6]
    assert gguf.GGUFReader is original


def test_a_bad_file_raises_as_without_sharing_and_is_not_kept(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"junk" * 64)
    with gguf_source.reuse_readers():
        for _ in range(2):
            with pytest.raises(ValueError, match="magic"):
                gguf.GGUFReader(str(junk))
        tiny_gguf(junk, 4)  # mended in place: read, not a remembered failure
        assert gguf.GGUFReader(str(junk)).tensors[0].shape.tolist() == [8, 4]


def test_the_shared_reader_reads_what_gguf_reads(tmp_path: Path) -> None:
    """The shared reader slices a plain ndarray of the mapping instead of the memmap: every
    field (parts, their dtypes and byte orders, data indices, types) and every tensor of a real
    checkpoint (SmolLM2's GGUF: 49k-entry string arrays, Q4_1 and F32 tensors) and of a file
    with strings, arrays and scalars of every kind equals the original reader's."""
    from tests.engine.models.test_gguf import smollm2_gguf

    mixed = tmp_path / "mixed.gguf"
    writer = gguf.GGUFWriter(str(mixed), "llama")
    writer.add_string("x.s", "héllo")
    writer.add_array("x.strings", ["a", "", "ü" * 300])
    writer.add_array("x.ints", [1, -2, 3])
    writer.add_array("x.floats", [0.5, 1.5])
    writer.add_bool("x.b", True)
    writer.add_uint64("x.u64", 2**40 + 3)
    writer.add_float64("x.f64", 1e-300)
    writer.add_tensor("t.weight", np.arange(24, dtype=np.float16).reshape(4, 6))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for path in (mixed, smollm2_gguf()):
        original = gguf.GGUFReader(str(path))
        with gguf_source.reuse_readers():
            shared = gguf.GGUFReader(str(path))
        assert type(shared) is not type(original)  # the plain-array reader, not the original
        assert list(shared.fields) == list(original.fields)
        for name, want in original.fields.items():
            got = shared.fields[name]
            assert (got.offset, got.data, got.types) == (want.offset, want.data, want.types), name
            assert len(got.parts) == len(want.parts), name
            for a, b in zip(got.parts, want.parts, strict=True):
                assert type(a) is np.ndarray and a.dtype.str == b.dtype.str, name
                assert a.tobytes() == b.tobytes(), name
        assert len(shared.tensors) == len(original.tensors)
        for got, want in zip(shared.tensors, original.tensors, strict=True):
            assert (got.name, got.tensor_type, got.n_elements) == (
                want.name, want.tensor_type, want.n_elements
            )  # fmt: skip
            assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape
            assert np.array_equal(got.data, want.data), got.name


def test_one_tensor_name_map_per_arguments_while_active() -> None:
    """transformers builds gguf's TensorNameMap once per module of the model it maps; while
    active there is one per (architecture, block count), equal to a fresh one."""
    original = gguf.get_tensor_name_map
    with gguf_source.reuse_readers():
        shared = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30) is shared
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is not shared
        assert shared.mapping == original(gguf.MODEL_ARCH.LLAMA, 30).mapping
    assert gguf.get_tensor_name_map is original
