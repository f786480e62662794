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
