"""Large safetensors files written around the page cache (llmc.storage.direct_io): the library's bytes exactly,
hashed as written, the store's record taking that hash, and the ordinary path wherever direct I/O is refused."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save

from llmc.errors import ResourceError
from llmc.storage import direct_io, store
from llmc.storage.store import atomic_save_safetensors, record_files

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")


def mixed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.layers.0.w": torch.randn(300, 70, generator=g).to(torch.bfloat16),
        "a": torch.randn(5, 3, generator=g),
        "codes": torch.randint(0, 255, (1000,), dtype=torch.uint8, generator=g),
        "fp8": torch.randn(33, 7, generator=g).to(torch.float8_e4m3fn),
        "ids": torch.arange(10, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
        "mask": torch.ones(3, dtype=torch.bool),
        "half": torch.randn(17, generator=g).half(),
    }


def direct_or_skip(path: Path, tensors: dict, metadata=None) -> str:
    digest = direct_io.write_safetensors(path, tensors, metadata)
    if digest is None:
        pytest.skip(f"{path.parent}'s filesystem refuses O_DIRECT")
    return digest


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
@pytest.mark.parametrize("chunk", [direct_io.ALIGNMENT * 2, direct_io.CHUNK_BYTES])
def test_the_file_is_byte_for_byte_what_safetensors_writes_and_its_hash_is_of_those_bytes(
        tmp_path: Path, monkeypatch, metadata, chunk: int) -> None:
    """Chunks of two blocks make the data cross many bounce-buffer boundaries, mid-tensor and mid-header."""
    monkeypatch.setattr(direct_io, "CHUNK_BYTES", chunk)
    tensors = mixed_tensors()
    digest = direct_or_skip(tmp_path / "x.safetensors", tensors, metadata)
    expected = save(tensors, metadata=metadata)
    assert (tmp_path / "x.safetensors").read_bytes() == expected
    assert digest == hashlib.sha256(expected).hexdigest()
    loaded = load_file(tmp_path / "x.safetensors")
    assert all(torch.equal(loaded[n].view(torch.uint8), t.view(torch.uint8)) for n, t in tensors.items() if t.numel())


def test_a_file_of_whole_chunks_has_no_padding(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(direct_io, "CHUNK_BYTES", direct_io.ALIGNMENT)
    size = 3 * direct_io.ALIGNMENT
    for _ in range(3):  # the header's length depends on the tensor's shape: settle it
        size = 3 * direct_io.ALIGNMENT - len(direct_io.header({"t": torch.zeros(size, dtype=torch.uint8)}, None)[0])
    tensors = {"t": torch.arange(size, dtype=torch.int32).to(torch.uint8)}
    direct_or_skip(tmp_path / "x.safetensors", tensors)
    assert (tmp_path / "x.safetensors").stat().st_size == 3 * direct_io.ALIGNMENT
    assert (tmp_path / "x.safetensors").read_bytes() == save(tensors)


def test_the_store_records_a_direct_file_by_the_hash_it_was_written_with(tmp_path: Path, monkeypatch) -> None:
    """No read-back (it would put the file through the page cache after all); a file changed since is hashed again."""
    monkeypatch.setattr(direct_io, "DIRECT_MIN_BYTES", 0)
    tensors = mixed_tensors()
    atomic_save_safetensors(tmp_path / "out" / "model.safetensors", tensors)
    if direct_io.written_digest(os.stat(tmp_path / "out" / "model.safetensors")) is None:
        pytest.skip("this filesystem refuses O_DIRECT")

    def no_read_back(path, *a, **k):
        raise AssertionError(f"{path} read back")

    monkeypatch.setattr(store, "sha256_file", no_read_back)
    recorded = record_files(tmp_path / "out")
    assert recorded["model.safetensors"]["sha256"] == hashlib.sha256(save(tensors)).hexdigest()
    monkeypatch.undo()
    path = tmp_path / "out" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))  # the same size, a new modification time
    assert record_files(tmp_path / "out")["model.safetensors"]["sha256"] == hashlib.sha256(bytes(data)).hexdigest()


def test_small_files_go_through_the_page_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(direct_io, "write_safetensors", lambda *a, **k: pytest.fail("small file written directly"))
    atomic_save_safetensors(tmp_path / "small.safetensors", {"w": torch.zeros(4)})
    assert torch.equal(load_file(tmp_path / "small.safetensors")["w"], torch.zeros(4))


def test_a_filesystem_refusing_direct_io_gets_the_ordinary_write(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(direct_io, "DIRECT_MIN_BYTES", 0)
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    tensors = mixed_tensors()
    atomic_save_safetensors(tmp_path / "m.safetensors", tensors, metadata={"format": "pt"})
    assert (tmp_path / "m.safetensors").read_bytes() == save(tensors, metadata={"format": "pt"})
    assert direct_io.written_digest(os.stat(tmp_path / "m.safetensors")) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_a_filesystem_refusing_the_first_direct_write_gets_the_ordinary_write(tmp_path: Path, monkeypatch) -> None:
    """Some FUSE and network filesystems accept O_DIRECT at open and refuse the I/O."""
    monkeypatch.setattr(direct_io, "DIRECT_MIN_BYTES", 0)
    real_write = os.write

    def refuses_direct(fd, data):
        if fcntl_flags(fd) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", refuses_direct)
    tensors = mixed_tensors()
    atomic_save_safetensors(tmp_path / "m.safetensors", tensors)
    assert (tmp_path / "m.safetensors").read_bytes() == save(tensors)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def fcntl_flags(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


def test_a_dtype_safetensors_does_not_name_or_a_device_tensor_takes_the_ordinary_path() -> None:
    assert direct_io.supported({"w": torch.zeros(4)})
    assert not direct_io.supported({"w": torch.zeros(4, device="meta")})
    assert not direct_io.supported({"w": torch.zeros(2, 2).to_sparse()})


def test_a_full_disk_during_a_direct_write_is_a_resource_error_and_leaves_no_file(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    monkeypatch.setattr(direct_io, "DIRECT_MIN_BYTES", 0)
    monkeypatch.setattr(direct_io, "CHUNK_BYTES", direct_io.ALIGNMENT)
    real_write, calls = os.write, [0]

    def fills_up(fd, data):
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", fills_up)
    with pytest.raises(ResourceError, match="disk full writing layer.safetensors"):
        atomic_save_safetensors(tmp_path / "layer.safetensors", mixed_tensors())
    if calls[0] < 3:
        pytest.skip("this filesystem refuses O_DIRECT")
    assert list(tmp_path.iterdir()) == []


def test_a_large_file_is_hashed_around_the_page_cache_to_the_same_digest(tmp_path, monkeypatch):
    """A file of DIRECT_MIN_BYTES and more is checked through O_DIRECT reads overlapped with hashing; its digest is
    hashlib's, whatever the tail (not a multiple of the block size, not of the chunk)."""
    path = tmp_path / "big.bin"
    data = os.urandom(1 << 20) * (direct_io.DIRECT_MIN_BYTES >> 20) + os.urandom(12_345)
    path.write_bytes(data)
    expected = hashlib.sha256(data).hexdigest()
    chunks = []
    direct = direct_io.sha256_around_cache(path, chunks.append)
    if direct is None:
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
    assert direct == expected and sum(chunks) == len(data) and len(chunks) > 1
    seen = []
    real = direct_io.sha256_around_cache
    monkeypatch.setattr(direct_io, "sha256_around_cache", lambda p, f=None: seen.append(p) or real(p, f))
    assert store.sha256_file(path) == expected and seen == [path]


def test_a_filesystem_refusing_o_direct_is_hashed_through_the_page_cache(tmp_path, monkeypatch):
    path = tmp_path / "big.bin"
    data = os.urandom(direct_io.DIRECT_MIN_BYTES + 1)
    path.write_bytes(data)
    real_open = os.open

    def refuse_direct(p, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(p, flags, *args)

    monkeypatch.setattr(os, "open", refuse_direct)
    assert direct_io.sha256_around_cache(path) is None
    assert store.sha256_file(path) == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("direct", [True, False])
def test_a_streamed_file_is_the_same_bytes_and_holds_one_tensor_at_a_time(tmp_path: Path, monkeypatch,
                                                                          direct: bool) -> None:
    """atomic_save_safetensors_streamed (the canonical form's rest.safetensors: a large vocabulary's embedding and
    head) reads each tensor as its bytes are written: the file is the library's bytes, and every tensor the loader
    handed out before is freed when it is asked for the next one."""
    import weakref

    from llmc.storage.store import atomic_save_safetensors_streamed

    monkeypatch.setattr(direct_io, "DIRECT_MIN_BYTES", 0 if direct else 1 << 40)
    monkeypatch.setattr(direct_io, "CHUNK_BYTES", direct_io.ALIGNMENT * 2)  # tensors cross bounce buffers
    tensors = mixed_tensors()
    handed: list[weakref.ref] = []

    def load(name: str) -> torch.Tensor:
        assert all(r() is None for r in handed), "an earlier tensor is still held"
        t = tensors[name].clone()
        handed.append(weakref.ref(t))
        return t

    like = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in tensors.items()}
    atomic_save_safetensors_streamed(tmp_path / "rest.safetensors", like, load, {"format": "pt"})
    written = (tmp_path / "rest.safetensors").read_bytes()
    assert written == save(tensors, metadata={"format": "pt"})
    assert len(handed) == len(tensors)
    assert direct_io.written_digest((tmp_path / "rest.safetensors").stat()) == hashlib.sha256(written).hexdigest()
    assert not list(tmp_path.glob(".*.tmp"))
