"""Megatron's tokenized corpus on disk: a ``.bin`` file of raw token ids and an ``.idx`` file that
says where each sequence starts and which sequences make a document. The files are
Megatron-core's, byte for byte:

``.idx``: the magic ``b"MMIDIDX\\x00\\x00"``, version 1 (uint64), the token dtype code (uint8,
:class:`DType`), the sequence count and the document count (uint64 each), then the sequence
lengths (int32), the sequences' byte offsets in ``.bin`` (int64), the document indices (int64:
document d is sequences ``[document_indices[d], document_indices[d + 1])``, the first entry 0), and
for multimodal corpora one mode (int8) per sequence. All little-endian.

Both files are read through memory maps, so a corpus larger than memory never loads whole."""

from __future__ import annotations

import gc
import logging
import os
import shutil
import struct
from enum import Enum
from functools import lru_cache
from itertools import accumulate
from typing import Iterable

import numpy
import torch

from megatron_ext.datasets.utils import log_single_rank

logger = logging.getLogger(__name__)

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_INDEX_VERSION = 1
# magic, version, dtype code, sequence count, document count
_HEADER_BYTES = len(_INDEX_HEADER) + 8 + 1 + 8 + 8


class DType(Enum):
    """The token dtypes of an index and their codes in its header."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, value: type[numpy.number]) -> int:
        return cls[numpy.dtype(value).name].value

    @classmethod
    def dtype_from_code(cls, value: int) -> type[numpy.number]:
        return getattr(numpy, cls(value).name)

    @staticmethod
    def size(key: int | type[numpy.number]) -> int:
        """The size in bytes of a dtype, given as a code or a NumPy type."""
        if isinstance(key, int):
            return DType.dtype_from_code(key)().itemsize
        if isinstance(key, type) and issubclass(key, numpy.number):
            return key().itemsize
        raise ValueError(f"expected a dtype code or a numpy number type, got {key!r}")

    @staticmethod
    def optimal_dtype(cardinality: int | None) -> type[numpy.number]:
        """uint16 for a vocabulary of fewer than 65,500 tokens, int32 otherwise."""
        if cardinality is not None and cardinality < 65500:
            return numpy.uint16
        return numpy.int32


def get_idx_path(path_prefix: str) -> str:
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    return path_prefix + ".bin"


class _IndexWriter:
    """Writes an ``.idx`` file: the header on entering, the arrays with :meth:`write`."""

    def __init__(self, idx_path: str, dtype: type[numpy.number]) -> None:
        self.idx_path = idx_path
        self.dtype = dtype

    def __enter__(self) -> "_IndexWriter":
        self.idx_writer = open(self.idx_path, "wb")
        self.idx_writer.write(_INDEX_HEADER)
        self.idx_writer.write(struct.pack("<Q", _INDEX_VERSION))
        self.idx_writer.write(struct.pack("<B", DType.code_from_dtype(self.dtype)))
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        self.idx_writer.close()

    def write(
        self,
        sequence_lengths: Iterable[int],
        sequence_modes: Iterable[int] | None,
        document_indices: Iterable[int],
    ) -> None:
        lengths = numpy.asarray(sequence_lengths, dtype=numpy.int32)
        documents = numpy.asarray(document_indices, dtype=numpy.int64)
        self.idx_writer.write(struct.pack("<Q", len(lengths)))
        self.idx_writer.write(struct.pack("<Q", len(documents)))
        self.idx_writer.write(lengths.tobytes(order="C"))
        self.idx_writer.write(self._sequence_pointers(lengths).tobytes(order="C"))
        self.idx_writer.write(documents.tobytes(order="C"))
        if sequence_modes is not None:
            self.idx_writer.write(numpy.asarray(sequence_modes, dtype=numpy.int8).tobytes(order="C"))

    def _sequence_pointers(self, sequence_lengths: numpy.ndarray) -> numpy.ndarray:
        """The byte offset of each sequence in ``.bin``: the exclusive running sum of the lengths."""
        pointers = numpy.zeros(len(sequence_lengths), dtype=numpy.int64)
        numpy.cumsum(sequence_lengths[:-1], dtype=numpy.int64, out=pointers[1:])
        return pointers * DType.size(self.dtype)


class _IndexReader:
    """Reads an ``.idx`` file through a memory map, checking its header and size first.

    ``sequences_per_dataset`` (sequence and document counts) with ``dtype_code`` skip reading the
    header, as Megatron-core's fast path does."""

    def __init__(
        self,
        idx_path: str,
        multimodal: bool,
        sequences_per_dataset: tuple[int, int] | None = None,
        dtype_code: int | None = None,
    ) -> None:
        log_single_rank(logger, logging.INFO, f"Load the {type(self).__name__} from {idx_path}")
        if not os.path.isfile(idx_path):
            raise ValueError(f"the index file {idx_path!r} does not exist")
        file_size = os.path.getsize(idx_path)
        if sequences_per_dataset:
            code = dtype_code
            self.sequence_count, self.document_count = sequences_per_dataset
        else:
            if file_size < _HEADER_BYTES:
                raise ValueError(
                    f"the index file {idx_path!r} is truncated: {file_size} bytes, shorter than its "
                    f"{_HEADER_BYTES}-byte header"
                )
            with open(idx_path, "rb") as stream:
                header = stream.read(len(_INDEX_HEADER))
                if header != _INDEX_HEADER:
                    raise ValueError(
                        f"{idx_path!r} is not a Megatron index file: it starts with {header!r}, "
                        f"expected {_INDEX_HEADER!r}"
                    )
                version = struct.unpack("<Q", stream.read(8))[0]
                if version != _INDEX_VERSION:
                    raise ValueError(
                        f"the index file {idx_path!r} has version {version}; only version "
                        f"{_INDEX_VERSION} exists"
                    )
                code = struct.unpack("<B", stream.read(1))[0]
                self.sequence_count = struct.unpack("<Q", stream.read(8))[0]
                self.document_count = struct.unpack("<Q", stream.read(8))[0]
        codes = [d.value for d in DType]
        if code not in codes:
            raise ValueError(
                f"the index file {idx_path!r} has token dtype code {code}; expected one of {codes} "
                f"({', '.join(f'{d.value}: {d.name}' for d in DType)})"
            )
        self.dtype = DType.dtype_from_code(code)
        self.dtype_size = DType.size(self.dtype)

        offset = _HEADER_BYTES
        needed = offset + self.sequence_count * (4 + 8 + (1 if multimodal else 0)) + self.document_count * 8
        if file_size < needed:
            raise ValueError(
                f"the index file {idx_path!r} is truncated: {file_size} bytes, but its header announces "
                f"{self.sequence_count} sequences and {self.document_count} document indices "
                f"({needed} bytes)"
            )
        self.bin_buffer_mmap = numpy.memmap(idx_path, mode="r", order="C")
        self.bin_buffer = memoryview(self.bin_buffer_mmap)
        self.sequence_lengths = numpy.frombuffer(
            self.bin_buffer, dtype=numpy.int32, count=self.sequence_count, offset=offset
        )
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = numpy.frombuffer(
            self.bin_buffer, dtype=numpy.int64, count=self.sequence_count, offset=offset
        )
        offset += self.sequence_pointers.nbytes
        self.document_indices = numpy.frombuffer(
            self.bin_buffer, dtype=numpy.int64, count=self.document_count, offset=offset
        )
        offset += self.document_indices.nbytes
        self.sequence_modes = None
        if multimodal:
            self.sequence_modes = numpy.frombuffer(
                self.bin_buffer, dtype=numpy.int8, count=self.sequence_count, offset=offset
            )
        documents = self.document_indices
        if len(documents) == 0 or documents[0] != 0 or documents[-1] != self.sequence_count:
            ends = f"[{documents[0]}, ..., {documents[-1]}]" if len(documents) else "[]"
            raise ValueError(
                f"the index file {idx_path!r} is inconsistent: its document indices {ends} must run "
                f"from 0 to its sequence count {self.sequence_count}"
            )
        log_single_rank(logger, logging.INFO, f"> total number of sequences: {len(self)}")
        log_single_rank(logger, logging.INFO, f"> total number of documents: {len(documents) - 1}")

    def __del__(self) -> None:
        if hasattr(self, "bin_buffer_mmap"):
            self.bin_buffer_mmap._mmap.close()
            del self.bin_buffer_mmap

    def __len__(self) -> int:
        return self.sequence_count

    @lru_cache(maxsize=8)
    def __getitem__(self, idx: int) -> tuple[numpy.int64, numpy.int32, numpy.int8 | None]:
        """The byte offset, the length and the mode (or None) of sequence ``idx``."""
        return (
            self.sequence_pointers[idx],
            self.sequence_lengths[idx],
            self.sequence_modes[idx] if self.sequence_modes is not None else None,
        )

    def data_bytes(self) -> int:
        """The size the ``.bin`` file must have at least: where its last sequence ends."""
        if self.sequence_count == 0:
            return 0
        return int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype_size


class _BinReader:
    """Reads ``count`` tokens of a dtype from the ``.bin`` file at a byte offset."""

    def read(self, dtype: type[numpy.number], count: int, offset: int) -> numpy.ndarray:
        raise NotImplementedError


class _MMapBinReader(_BinReader):
    """Reads ``.bin`` through a memory map: the pages a sample touches are all that load."""

    def __init__(self, bin_path: str) -> None:
        self._bin_file_reader = open(bin_path, mode="rb")
        self._bin_buffer_mmap = (
            numpy.memmap(self._bin_file_reader, mode="r", order="C")
            if os.path.getsize(bin_path) > 0
            else numpy.zeros(0, dtype=numpy.uint8)  # mmap refuses an empty file
        )
        self._bin_buffer = memoryview(self._bin_buffer_mmap.data)

    def read(self, dtype: type[numpy.number], count: int, offset: int) -> numpy.ndarray:
        return numpy.frombuffer(self._bin_buffer, dtype=dtype, count=count, offset=offset)

    def __del__(self) -> None:
        mapped = getattr(self, "_bin_buffer_mmap", None)
        if isinstance(mapped, numpy.memmap):
            mapped._mmap.close()
        if getattr(self, "_bin_file_reader", None) is not None:
            self._bin_file_reader.close()


class _FileBinReader(_BinReader):
    """Reads ``.bin`` with a seek and a read per sample (``mmap=False``)."""

    def __init__(self, bin_path: str) -> None:
        self._bin_path = bin_path

    def read(self, dtype: type[numpy.number], count: int, offset: int) -> numpy.ndarray:
        sequence = numpy.empty(count, dtype=dtype)
        with open(self._bin_path, mode="rb", buffering=0) as f:
            f.seek(offset)
            f.readinto(sequence)
        return sequence


class IndexedDataset(torch.utils.data.Dataset):
    """The sequences of a ``.bin``/``.idx`` pair, indexable by sequence (an int or a contiguous
    slice); :meth:`get` reads part of one. Megatron-core's signature; object storage
    (``object_storage_config``, ``s3_config``) is not supported."""

    def __init__(
        self,
        path_prefix: str,
        multimodal: bool = False,
        mmap: bool = True,
        object_storage_config=None,
        s3_config=None,
        fast_cache_load: bool = False,
        sequences_per_dataset: tuple[int, int] | None = None,
        dtype_code: int | None = None,
    ) -> None:
        super().__init__()
        if object_storage_config is not None or s3_config is not None:
            raise ValueError("IndexedDataset reads local files; object storage is not supported")
        self.initialize(
            path_prefix, multimodal, mmap, None, fast_cache_load, sequences_per_dataset, dtype_code
        )

    def initialize(
        self,
        path_prefix: str,
        multimodal: bool,
        mmap: bool,
        object_storage_config=None,
        fast_cache_load: bool = False,
        sequences_per_dataset: tuple[int, int] | None = None,
        dtype_code: int | None = None,
    ) -> None:
        idx_path, bin_path = get_idx_path(path_prefix), get_bin_path(path_prefix)
        missing = [p for p in (idx_path, bin_path) if not os.path.isfile(p)]
        if missing:
            raise ValueError(
                f"the dataset {path_prefix!r} is missing {' and '.join(repr(p) for p in missing)}: a "
                "tokenized corpus is a PREFIX.bin and a PREFIX.idx file"
            )
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self.mmap = mmap
        self.object_storage_config = object_storage_config
        self.fast_cache_load = fast_cache_load
        self.sequences_per_dataset = sequences_per_dataset
        self.dtype_code = dtype_code
        self.index = _IndexReader(idx_path, multimodal, sequences_per_dataset, dtype_code)
        have, need = os.path.getsize(bin_path), self.index.data_bytes()
        if have < need:
            raise ValueError(
                f"the data file {bin_path!r} is truncated: {have} bytes, but its index places tokens up "
                f"to byte {need}"
            )
        self.bin_reader = _MMapBinReader(bin_path) if mmap else _FileBinReader(bin_path)

    def __getstate__(self) -> tuple:
        return (
            self.path_prefix,
            self.multimodal,
            self.mmap,
            self.object_storage_config,
            self.fast_cache_load,
            self.sequences_per_dataset,
            self.dtype_code,
        )

    def __setstate__(self, state: tuple) -> None:
        self.initialize(*state)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, idx: int | numpy.integer | slice):
        """Sequence ``idx`` (with its mode when multimodal), or the list of a contiguous slice's."""
        if isinstance(idx, (int, numpy.integer)):
            pointer, length, mode = self.index[idx]
            sequence = self.bin_reader.read(dtype=self.index.dtype, count=length, offset=pointer)
            return (sequence, mode) if mode is not None else sequence
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("Slices into indexed_dataset must be contiguous")
            lengths = self.index.sequence_lengths[idx]
            modes = self.index.sequence_modes[idx] if self.multimodal else None
            if len(lengths) == 0:
                return ([], modes) if modes is not None else []
            sequences = numpy.split(
                self.bin_reader.read(
                    dtype=self.index.dtype,
                    count=int(sum(lengths)),
                    offset=self.index.sequence_pointers[start],
                ),
                list(accumulate(lengths))[:-1],
            )
            return (sequences, modes) if modes is not None else sequences
        raise TypeError("Unexpected type received for idx: {}".format(type(idx)))

    def get(self, idx: int, offset: int = 0, length: int | None = None):
        """``length`` tokens (default: to the end) of sequence ``idx`` from token ``offset``."""
        pointer, sequence_length, mode = self.index[idx]
        if length is None:
            length = sequence_length - offset
        pointer += offset * DType.size(self.index.dtype)
        sequence = self.bin_reader.read(dtype=self.index.dtype, count=length, offset=pointer)
        return (sequence, mode) if mode is not None else sequence

    @property
    def sequence_lengths(self) -> numpy.ndarray:
        return self.index.sequence_lengths

    @property
    def document_indices(self) -> numpy.ndarray:
        return self.index.document_indices

    def get_document_indices(self) -> numpy.ndarray:
        return self.index.document_indices

    def set_document_indices(self, document_indices: numpy.ndarray) -> None:
        self.index.document_indices = document_indices

    @property
    def sequence_modes(self) -> numpy.ndarray:
        if self.index.sequence_modes is None:
            raise ValueError(f"the dataset {self.path_prefix!r} is not multimodal: it has no modes")
        return self.index.sequence_modes

    @staticmethod
    def exists(path_prefix: str) -> bool:
        return os.path.exists(get_idx_path(path_prefix)) and os.path.exists(get_bin_path(path_prefix))


class IndexedDatasetBuilder:
    """Writes a ``.bin`` file as sequences are added, and its ``.idx`` on :meth:`finalize`."""

    def __init__(
        self, bin_path: str, dtype: type[numpy.number] = numpy.int32, multimodal: bool = False
    ) -> None:
        self.data_file = open(bin_path, "wb")
        self.dtype = dtype
        self.multimodal = multimodal
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]
        self.sequence_modes: list[int] | None = [] if multimodal else None

    def _tokens(self, values) -> numpy.ndarray:
        """``values`` as this dataset's dtype; ValueError for an id the dtype cannot hold."""
        if isinstance(values, torch.Tensor):
            values = values.detach().cpu().numpy()
        array = numpy.asarray(values)
        integer = numpy.issubdtype(self.dtype, numpy.integer)
        if array.dtype.kind in "USO":  # token ids as numeric strings: numpy converts them, as Megatron-core
            array = numpy.array(array, dtype=numpy.int64 if integer else self.dtype)
        if array.size and integer:
            info = numpy.iinfo(self.dtype)
            low, high = array.min(), array.max()
            if low < info.min or high > info.max:
                raise ValueError(
                    f"token ids in [{low}, {high}] do not fit the dataset's dtype "
                    f"{numpy.dtype(self.dtype).name} ([{info.min}, {info.max}])"
                )
        return array.astype(self.dtype, copy=False).reshape(-1)

    def add_item(self, tensor, mode: int = 0) -> None:
        """Appends one sequence (call :meth:`end_document` after a document's last)."""
        tokens = self._tokens(tensor)
        self.data_file.write(tokens.tobytes(order="C"))
        self.sequence_lengths.append(tokens.size)
        if self.multimodal:
            self.sequence_modes.append(mode)

    def add_document(self, tensor, lengths: list[int], modes: list[int] | None = None) -> None:
        """Appends a document: its tokens, cut into sequences of ``lengths``."""
        tokens = self._tokens(tensor)
        if sum(lengths) != tokens.size:
            raise ValueError(
                f"the sequence lengths {list(lengths)} sum to {sum(lengths)}, not to the "
                f"document's {tokens.size} tokens"
            )
        self.data_file.write(tokens.tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))
        if self.multimodal:
            self.sequence_modes.extend(modes if modes is not None else [0] * len(lengths))

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix: str) -> None:
        """Appends every document of another dataset (of the same dtype)."""
        index = _IndexReader(get_idx_path(path_prefix), multimodal=self.multimodal)
        if index.dtype != self.dtype:
            raise ValueError(
                f"{path_prefix!r} holds {numpy.dtype(index.dtype).name} tokens; this "
                f"dataset is {numpy.dtype(self.dtype).name}"
            )
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(index.sequence_lengths.tolist())
        self.document_indices.extend((offset + index.document_indices)[1:].tolist())
        if self.multimodal:
            self.sequence_modes.extend(index.sequence_modes.tolist())
        del index
        gc.collect()
        with open(get_bin_path(path_prefix), "rb") as f:
            shutil.copyfileobj(f, self.data_file)

    def finalize(self, idx_path: str) -> None:
        """Closes ``.bin`` and writes ``.idx``."""
        self.data_file.close()
        with _IndexWriter(idx_path, self.dtype) as writer:
            writer.write(self.sequence_lengths, self.sequence_modes, self.document_indices)
