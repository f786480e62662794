"""GGUF as a model source, as vLLM offers it: `--model path/to/file.gguf` (or a directory
holding one .gguf and no config.json).

A GGUF file is turned once into an ordinary Hugging Face directory — config.json,
generation_config.json, the tokenizer (tokenizer.json, tokenizer_config.json, the chat template)
and model.safetensors with every tensor dequantized to float32 — by transformers' own GGUF
integration (the `gguf` package reads and dequantizes; transformers maps names, un-permutes q/k
and builds the tokenizer from the metadata), so the weights are exactly what
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` computes with. The directory is
cached (keyed by the file's path, size and mtime) and shared by every process that loads the
same file: `pdserve serve` starts several at once, and the first converts while the others wait
on a lock. Everything else then loads it as any HF directory.

A conversion reads the file's metadata once (`reuse_readers`): transformers builds a new
`gguf.GGUFReader` for the config, the tokenizer and the weights, and each one parses every
metadata entry in Python — for Gemma 3's 262k-token vocabulary ~16 s a time on a 2-core VM, of
which ~13 s are numpy's memmap subclass (a Python `__getitem__` and `__array_finalize__` for each
of the ~800k slices the reader takes). The shared reader slices a plain ndarray view of the same
mapping instead (`_plain_array_reader`): the same fields and tensors, 3-4 s.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from pdserve.kernels.cache import cache_dir

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 1
"""Part of the cache key: bump when what a conversion writes changes."""


def find_gguf(model: str) -> Path | None:
    """The GGUF file model names (the file, or the only .gguf in a directory without a
    config.json); None for an HF directory. ValueError for a path that is neither."""
    path = Path(model)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{model}: not a model directory or a .gguf file")
        return path
    if not path.is_dir():
        raise ValueError(f"model {model!r} does not exist (a model directory or a .gguf file)")
    if (path / "config.json").is_file():
        return None
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ValueError(f"{model}: {len(ggufs)} .gguf files ({names}); name one of them")
    return None  # neither: the HF loader says what is missing


def model_dir(model: str) -> str:
    """The HF directory to load `model` from: model itself, or its GGUF converted (cached)."""
    gguf = find_gguf(model)
    return model if gguf is None else str(converted_dir(gguf))


def converted_dir(gguf: Path) -> Path:
    """The cached HF directory of a GGUF file, converting it first if needed."""
    gguf = gguf.resolve()
    stat = gguf.stat()
    key = f"{gguf}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = cache_dir("gguf")
    out = root / f"{gguf.stem}-{digest}"
    if (out / "config.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting this file
        if not (out / "config.json").is_file():
            start = time.monotonic()
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=root))
            try:
                _convert(gguf, tmp)
                os.replace(tmp, out)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            logger.info(
                "converted %s to %s in %.1fs (once; later loads read it)",
                gguf,
                out,
                time.monotonic() - start,
            )
    return out


_readers_lock = threading.Lock()
_readers_depth = 0
_readers_original = None


@contextlib.contextmanager
def reuse_readers() -> Iterator[None]:
    """While active (re-entrant, process-wide), `gguf.GGUFReader(path)` returns one reader per
    file (path, size, mtime) instead of parsing the file's metadata again: transformers loads
    config, tokenizer and weights of one GGUF file through three readers. A reader is read-only
    once built (a memmap and the parsed fields), so sharing it changes nothing read through it.
    Likewise `gguf.get_tensor_name_map(arch, n_blocks)` returns one map per arguments:
    transformers asks for it once per module of the model while it maps the weights' names
    (397 times for SmolLM2, each a fresh TensorNameMap of ~9k formatted names: ~8 s of a ~19 s
    conversion), and nothing writes to it."""
    import gguf

    global _readers_depth, _readers_original
    with _readers_lock:
        if _readers_depth == 0:
            original = gguf.GGUFReader
            built: dict[tuple[str, str, int, int], object] = {}

            reader_class = _plain_array_reader(original)

            def shared(path, mode="r"):
                stat = os.stat(path)
                key = (os.path.realpath(path), mode, stat.st_size, stat.st_mtime_ns)
                with _readers_lock:
                    reader = built.get(key)
                if reader is None:
                    reader = reader_class(path, mode)
                    with _readers_lock:
                        reader = built.setdefault(key, reader)
                return reader

            _readers_original = original, gguf.get_tensor_name_map
            gguf.GGUFReader = shared
            gguf.get_tensor_name_map = functools.cache(gguf.get_tensor_name_map)
        _readers_depth += 1
    try:
        yield
    finally:
        with _readers_lock:
            _readers_depth -= 1
            if _readers_depth == 0:
                gguf.GGUFReader, gguf.get_tensor_name_map = _readers_original
                _readers_original = None


def _plain_array_reader(original: type) -> type:
    """original (gguf.GGUFReader) with `_get` slicing a plain ndarray view of its memmap: every
    field part and tensor is then an ndarray over the same mapped bytes instead of a memmap, and
    each slice costs C, not numpy's Python-level memmap hooks. original itself where its `_get`
    is not the one this was written against (gguf 0.x: self, offset, dtype, count,
    override_order)."""
    import inspect

    import numpy as np

    get = getattr(original, "_get", None)
    expected = ["self", "offset", "dtype", "count", "override_order"]
    if get is None or list(inspect.signature(get).parameters) != expected:
        return original

    class PlainArrayReader(original):  # type: ignore[misc, valid-type]
        def _get(self, offset, dtype, count=1, override_order=None):
            state = self.__dict__
            raw = state.get("_pdserve_raw")
            if raw is None:
                raw = state["_pdserve_raw"] = self.data.view(np.ndarray)
                state["_pdserve_dtypes"] = {}
            order = self.byte_order if override_order is None else override_order
            dtypes = state["_pdserve_dtypes"]
            typed = dtypes.get((dtype, order))
            if typed is None:
                typed = dtypes[(dtype, order)] = np.dtype(dtype).newbyteorder(order)
            return raw[offset : offset + typed.itemsize * int(count)].view(typed)

    PlainArrayReader.__name__ = PlainArrayReader.__qualname__ = original.__name__
    return PlainArrayReader


def _convert(gguf: Path, out: Path) -> None:
    """Write gguf's config, generation config, tokenizer and float32 weights into out.
    ValueError names the file and what is wrong with it."""
    with reuse_readers():  # one parse of the metadata for config, tokenizer and weights
        # a file that is no GGUF at all is refused before torch and transformers load (~4 s)
        architecture, has_tokenizer = _inspect(gguf)
        _convert_with(gguf, out, architecture, has_tokenizer)


def _convert_with(gguf: Path, out: Path, architecture: str, has_tokenizer: bool) -> None:
    import torch  # heavy imports only when converting
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf.parent), gguf.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        loaded = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name) if has_tokenizer else None
    except Exception as e:  # noqa: BLE001 - whatever the reader raises, the file is at fault
        raise ValueError(
            f"{gguf}: cannot load this GGUF file (architecture {architecture!r}): {_reason(e)}"
        ) from e
    tensors = loaded["tensors"]
    config.architectures = [type(skeleton).__name__]
    config.dtype = "float32"
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    expected = set(skeleton.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(tensors))
    if missing:
        raise ValueError(f"{gguf}: {len(missing)} tensors missing, e.g. {missing[:3]}")
    weights = {n: t.to(torch.float32).contiguous() for n, t in tensors.items() if n in expected}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf), "tokenizer": has_tokenizer}))


SOURCE_FILE = "pdserve_gguf_source.json"
"""Written into a converted directory: which file it came from, whether it had a tokenizer."""


def _inspect(gguf: Path) -> tuple[str, bool]:
    """(general.architecture, whether it has tokenizer metadata), read from the header without
    loading tensors; ValueError for a file that is not a (complete) GGUF file."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(gguf))
        field = reader.fields["general.architecture"]
        architecture = bytes(field.parts[field.data[0]]).decode()
    except Exception as e:  # noqa: BLE001 - truncated, corrupt, not GGUF at all
        raise ValueError(
            f"{gguf}: not a readable GGUF file (truncated or corrupt?): {_reason(e)}"
        ) from e
    return architecture, "tokenizer.ggml.tokens" in reader.fields


def tokenizer_missing_message(model_dir: str) -> str | None:
    """For a directory converted from a GGUF file without tokenizer metadata: what to say."""
    source = Path(model_dir) / SOURCE_FILE
    if not source.is_file():
        return None
    info = json.loads(source.read_text())
    if info.get("tokenizer", True):
        return None
    return f"{info['gguf']}: the GGUF file has no tokenizer metadata; pass --tokenizer DIR"


def _reason(error: BaseException) -> str:
    if isinstance(error, struct.error | EOFError | IndexError):
        return f"truncated or corrupt ({type(error).__name__}: {_first_line(error)})"
    return _first_line(error)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
