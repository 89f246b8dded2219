"""The step channel between a tensor-parallel replica and its ranks: shared memory and doorbells.

A step's plan goes from the replica to every rank, and rank 0's answer back, with no Ray call and
no pickling: the message is a few numpy arrays written into one shared-memory slot (a fixed
header describing each array, then the arrays, 8-byte aligned), and each reader is woken by one
byte on a FIFO of its own -- a blocking ``read`` that costs no CPU while it waits, which matters
where the ranks share cores with the replica. vLLM's ``MessageQueue`` gives its TP workers their
step the same way (a shared-memory ring, readers polling); here one slot is enough because the
replica sends a plan only after the previous step's answer, and every rank has read its plan
before the step's first collective. A message larger than the slot goes in a one-off segment
named in the header (a sampled sequence's full logits rows, a long prefill's block tables).

Shared memory and FIFOs are of one machine: the ranks run on the replica's node (the placement
group is STRICT_PACK).
"""

from __future__ import annotations

import os
import select
import struct
import tempfile
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np

DTYPES = (np.int64, np.float32, np.uint8, np.float64)
HEADER = 64  # seq, payload bytes, overflow name length, overflow name (up to 40 bytes)
MAX_DIMS = 3
SLOT_BYTES = 8 << 20


_created: set[str] = set()  # segments this process made (and unlinks)


def _create(size: int) -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(create=True, size=size)
    _created.add(shm.name)
    return shm


def _attach(name: str) -> shared_memory.SharedMemory:
    """An existing segment, not tracked by this process's resource tracker unless this process made
    it (its creator unlinks it)."""
    if name in _created:  # a rank in the replica's own process
        return shared_memory.SharedMemory(name=name)
    try:
        return shared_memory.SharedMemory(name=name, track=False)
    except TypeError:  # Python < 3.13
        from multiprocessing import resource_tracker

        shm = shared_memory.SharedMemory(name=name)
        resource_tracker.unregister(shm._name, "shared_memory")
        return shm


def packed_size(arrays: list[np.ndarray]) -> int:
    return 8 + len(arrays) * 8 * (2 + MAX_DIMS) + sum(-(-a.nbytes // 8) * 8 for a in arrays)


def pack_into(buf: memoryview, arrays: list[np.ndarray]) -> int:
    """Write ``arrays`` (each of :data:`DTYPES`, at most :data:`MAX_DIMS` dims) into ``buf``; bytes written."""
    n = len(arrays)
    desc = np.zeros((n, 2 + MAX_DIMS), dtype=np.int64)
    for i, a in enumerate(arrays):
        desc[i, 0] = DTYPES.index(a.dtype.type)
        desc[i, 1] = a.ndim
        desc[i, 2 : 2 + a.ndim] = a.shape
    struct.pack_into("<q", buf, 0, n)
    o = 8
    buf[o : o + desc.nbytes] = desc.tobytes()
    o += desc.nbytes
    for a in arrays:
        nb = a.nbytes
        if nb:
            np.frombuffer(buf, dtype=np.uint8, count=nb, offset=o)[:] = (
                np.ascontiguousarray(a).view(np.uint8).reshape(-1)
            )
        o += -(-nb // 8) * 8
    return o


def unpack(buf: memoryview) -> list[np.ndarray]:
    """The arrays :func:`pack_into` wrote, copied out of ``buf``."""
    (n,) = struct.unpack_from("<q", buf, 0)
    desc = np.frombuffer(buf, dtype=np.int64, count=n * (2 + MAX_DIMS), offset=8).reshape(n, 2 + MAX_DIMS)
    o = 8 + desc.nbytes
    out = []
    for code, ndim, *shape in desc.tolist():
        dt = np.dtype(DTYPES[code])
        shape = tuple(shape[:ndim])
        count = int(np.prod(shape, dtype=np.int64)) if ndim else 1
        out.append(np.frombuffer(buf, dtype=dt, count=count, offset=o).reshape(shape).copy())
        o += -(-count * dt.itemsize // 8) * 8
    return out


class Mailbox:
    """One message slot in shared memory: :meth:`send` (the one writer), :meth:`receive` (any reader
    woken for it). Made by the replica (``create``), attached by name on the ranks."""

    def __init__(self, name: str | None = None, size: int = SLOT_BYTES):
        self.own = name is None
        self.shm = _create(size) if self.own else _attach(name)
        self.name = self.shm.name
        self.seq = 0
        self._overflow: shared_memory.SharedMemory | None = None  # the last one-off segment this side wrote

    def send(self, arrays: list[np.ndarray]) -> int:
        """Write one message; its bytes. The previous message's one-off segment is dropped here (its
        reader has read it: the protocol is one message in flight)."""
        self._drop_overflow()
        size = packed_size(arrays)
        buf = self.shm.buf
        name = b""
        if size > len(buf) - HEADER:
            self._overflow = _create(size)
            pack_into(self._overflow.buf, arrays)
            name = self._overflow.name.encode()
        else:
            pack_into(buf[HEADER:], arrays)
        self.seq += 1
        struct.pack_into("<qqq40s", buf, 0, self.seq, size, len(name), name)
        return size

    def receive(self) -> list[np.ndarray]:
        seq, size, k, name = struct.unpack_from("<qqq40s", self.shm.buf, 0)
        self.seq = seq
        if not k:
            return unpack(self.shm.buf[HEADER : HEADER + size])
        other = _attach(name[:k].decode())
        try:
            return unpack(other.buf[:size])
        finally:
            other.close()

    def _drop_overflow(self) -> None:
        if self._overflow is not None:
            self._overflow.close()
            self._overflow.unlink()
            self._overflow = None

    def close(self) -> None:
        self._drop_overflow()
        try:
            self.shm.close()
        except BufferError:  # a view still alive (interpreter shutdown): the unlink below frees the name
            pass
        if self.own:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass


class Bell:
    """A FIFO one reader waits on (:meth:`wait`) and one writer rings (:meth:`ring`). Both ends open
    it read-write, so neither blocks at open and a reader that went away never stops the writer."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDWR)

    @staticmethod
    def make(directory: str, name: str) -> str:
        path = os.path.join(directory, name)
        os.mkfifo(path, 0o600)
        return path

    def ring(self) -> None:
        os.write(self.fd, b"\x01")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until rung (True), or ``timeout`` seconds passed (False)."""
        if timeout is not None:
            ready, _, _ = select.select([self.fd], [], [], timeout)
            if not ready:
                return False
        os.read(self.fd, 1)
        return True

    def close(self) -> None:
        os.close(self.fd)


class Stamps:
    """One float64 per rank in shared memory: when each rank had the step's plan decoded
    (``time.perf_counter``, one clock for every process of the machine)."""

    def __init__(self, world: int, name: str | None = None):
        self.own = name is None
        self.shm = _create(8 * max(world, 1)) if self.own else _attach(name)
        self.name = self.shm.name
        self.values = np.ndarray((world,), dtype=np.float64, buffer=self.shm.buf)

    def close(self) -> None:
        del self.values
        self.shm.close()
        if self.own:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass


def channel_dir() -> str:
    """A private directory for one replica's FIFOs."""
    return tempfile.mkdtemp(prefix="toolspec-tp-")


def remove_dir(path: str) -> None:
    for p in Path(path).glob("*"):
        p.unlink(missing_ok=True)
    Path(path).rmdir()
