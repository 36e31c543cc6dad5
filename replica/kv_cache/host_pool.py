"""HostPool: a node's second KV tier, one file of fixed-size block slots that every engine on the node maps.

Slots are keyed by the chained block hashes and evicted least recently used; the file never grows past the
size it was created with. Writers take an exclusive flock (the kernel drops it if the writer dies); readers
take no lock: each slot carries a version that is odd while its slot is written (a seqlock), and a reader
keeps a block only if it saw the same even version and the expected hash before and after copying it. A slot
left odd by a writer that died is torn: the next writer takes it first.
"""
import fcntl
import mmap
import os
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import xxhash

from replica.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from replica.kv_cache.hashing import BlockHash

_MAGIC = b"PSKVPOOL1"
_HEADER_BYTES = 4096
_SLOT = np.dtype([("version", "<u8"), ("key", "<u8"), ("check", "<u8"), ("last_used", "<f8")])
_TORN = -1.0  # last_used of a torn slot, so that it goes first


@dataclass(frozen=True)
class HostPoolSpec:
    """Where a node's pool lives and what its slots hold; plain values, so that it travels to a runner."""
    path: str
    num_slots: int
    slot_bytes: int
    layout: str  # the model, dtype and block geometry: engines sharing a file must agree on it

    def __post_init__(self):
        if self.num_slots < 1:
            raise ValueError(f"a host KV pool needs at least one slot of {self.slot_bytes} bytes, got {self.num_slots}")

    @property
    def file_bytes(self) -> int:
        return _data_offset(self.num_slots) + self.num_slots * self.slot_bytes


@dataclass(frozen=True, slots=True)
class KVLoad:
    """The pool's slots a waiting request's blocks are copied from, into the device blocks a load holds."""
    request_id: str
    block_ids: list[int]
    slots: list[int]
    block_hashes: list[BlockHash]


@dataclass(frozen=True, slots=True)
class KVSave:
    """Device blocks that a step fills and the pool should hold (written through after the step)."""
    block_ids: list[int]
    block_hashes: list[BlockHash]


def default_pool_path(layout: str) -> str:
    """One file per model and layout in the node's shared memory."""
    return f"/dev/shm/prefixserve-kv-{xxhash.xxh64_hexdigest(layout.encode())}"


def _data_offset(num_slots: int) -> int:
    table_end = _HEADER_BYTES + num_slots * _SLOT.itemsize
    return -(-table_end // mmap.PAGESIZE) * mmap.PAGESIZE


def _split(block_hash: BlockHash) -> tuple[int, int]:
    return int.from_bytes(block_hash[:8], "little"), int.from_bytes(block_hash[8:16], "little")


def _joined(key: int, check: int) -> BlockHash:
    return int(key).to_bytes(8, "little") + int(check).to_bytes(8, "little")


class HostPool:
    def __init__(self, spec: HostPoolSpec, clock: Callable[[], float] = time.time):
        """clock: wall time, the same in every process of the node (it orders the slots for eviction)."""
        self.spec = spec
        self._clock = clock
        self._fd = os.open(spec.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            with self._locked():
                self._create_or_check()
            self._mmap = mmap.mmap(self._fd, spec.file_bytes)
        except BaseException:
            os.close(self._fd)
            raise
        self._table = np.frombuffer(self._mmap, _SLOT, spec.num_slots, _HEADER_BYTES)
        self._last_seen: dict[int, int] = {}  # key -> the slot this process last found its block in
        self.data = np.frombuffer(self._mmap, np.uint8, spec.num_slots * spec.slot_bytes,
                                  _data_offset(spec.num_slots)).reshape(spec.num_slots, spec.slot_bytes)

    def _create_or_check(self) -> None:
        spec = self.spec
        header = _MAGIC + f"|{spec.num_slots}|{spec.slot_bytes}|{spec.layout}".encode()
        if len(header) > _HEADER_BYTES:
            raise ValueError(f"host KV pool layout too long: {spec.layout!r}")
        size = os.fstat(self._fd).st_size
        if size == 0:
            self._reserve()
            os.pwrite(self._fd, header, 0)
            return
        found = os.pread(self._fd, len(header) + 1, 0)
        if found != header + b"\x00" or size != spec.file_bytes:
            made_for = found.partition(b"\x00")[0]
            raise ValueError(f"the host KV pool {spec.path} was made for other blocks ({made_for!r}, "
                             f"{size} bytes); this engine's is {header!r}, {spec.file_bytes} bytes: give it another "
                             "path or the same pool size, model and block size")

    def _reserve(self) -> None:
        """Take the file's memory now: a sparse file on a full /dev/shm would crash its first writer (SIGBUS)."""
        try:
            os.posix_fallocate(self._fd, 0, self.spec.file_bytes)
        except OSError as exc:
            os.unlink(self.spec.path)
            raise ValueError(f"cannot reserve {self.spec.file_bytes / 2**30:.2f} GiB for the host KV pool at "
                             f"{self.spec.path} ({exc.strerror}): make the pool smaller or its file system "
                             "larger (a container's /dev/shm, the chart's shmSizeLimit)") from exc

    @contextmanager
    def _locked(self):
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        del self._table, self.data
        self._mmap.close()
        os.close(self._fd)

    def find(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """The slots of the longest leading run of block_hashes the pool holds now."""
        slots = []
        for block_hash in block_hashes:
            slot = self._slot_of(block_hash)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def _slot_of(self, block_hash: BlockHash) -> int | None:
        """Where the block was last found here, if it is still there; else a scan of the whole table."""
        key, check = _split(block_hash)
        slot = self._last_seen.get(key)
        if slot is not None and self._holds(slot, key, check):
            return slot
        for slot in np.flatnonzero(self._table["key"] == key):
            if self._holds(slot, key, check):
                if len(self._last_seen) >= 2 * self.spec.num_slots:  # mostly blocks evicted since
                    self._last_seen.clear()
                self._last_seen[key] = slot = int(slot)
                return slot
        return None

    def _holds(self, slot: int, key: int, check: int) -> bool:
        entry = self._table[slot]
        return entry["key"] == key and entry["check"] == check and entry["version"] and not entry["version"] % 2

    def contents(self) -> set[BlockHash]:
        """Every complete block's hash."""
        return set(_whole_hashes(self._table.copy()))

    def store(self, block_hashes: Sequence[BlockHash],
              write: Callable[[list[int], list[int]], None]) -> list[BlockHash]:
        """Store the blocks whose hash the pool lacks (the others count as used now): write(indices into
        block_hashes, slots) copies them in. At most num_slots of them, the first ones if more; those it wrote."""
        with self._locked():
            table, now = self._table, self._clock()
            missing = []
            for index, block_hash in enumerate(block_hashes):
                slot = self._slot_of(block_hash)
                if slot is None:
                    missing.append(index)
                else:
                    table["last_used"][slot] = now
            missing = missing[:self.spec.num_slots]
            if not missing:
                return []
            slots = self._victims(len(missing))
            table["version"][slots] += 1  # odd: being written
            for index, slot in zip(missing, slots):
                table["key"][slot], table["check"][slot] = _split(block_hashes[index])
            write(missing, slots)
            table["version"][slots] += 1
            table["last_used"][slots] = now
            return [block_hashes[index] for index in missing]

    def _victims(self, count: int) -> list[int]:
        """The count least recently used slots, empty and torn ones first (called under the lock, so an odd
        version is a writer that died)."""
        versions = self._table["version"]
        last_used = np.where(versions % 2 == 1, _TORN, self._table["last_used"])
        last_used[versions == 0] = _TORN - 1
        slots = np.argpartition(last_used, count - 1)[:count] if count < len(last_used) else np.arange(count)
        versions[slots] += versions[slots] % 2  # a torn slot's next write starts from an even version
        return [int(slot) for slot in slots]

    def load(self, slots: Sequence[int], block_hashes: Sequence[BlockHash],
             read: Callable[[list[int]], None]) -> int:
        """Copy the slots out with read(slots); how many leading ones held their expected block throughout."""
        table = self._table
        slots = list(slots)
        before = table[slots].copy()
        read(slots)
        after = table["version"][slots]
        num_valid = 0
        for block_hash, entry, version in zip(block_hashes, before, after):
            key, check = _split(block_hash)
            if not (entry["version"] and entry["version"] % 2 == 0 and version == entry["version"]
                    and entry["key"] == key and entry["check"] == check):
                break
            num_valid += 1
        table["last_used"][slots[:num_valid]] = self._clock()
        return num_valid


class HostPoolWatcher:
    """The pool's changes, as one engine sees them, in KV events of medium "host": each take_events() compares
    the slot table with what the last one saw (removals first, so a block that moved slots stays stored)."""

    def __init__(self, pool: HostPool, block_size: int):
        self._pool = pool
        self._block_size = block_size
        self._seen = np.zeros(pool.spec.num_slots, _SLOT)
        self._report_all = True

    def report_all(self) -> None:
        """The next take_events() starts over: every block the pool holds, after an AllBlocksCleared."""
        self._report_all = True

    def take_events(self) -> list[KVEvent]:
        table = self._pool._table.copy()
        if self._report_all:
            self._report_all = False
            self._seen = table
            return [AllBlocksCleared("host"), BlockStored(_whole_hashes(table), None, [], self._block_size, "host")]
        changed = np.flatnonzero(table["version"] != self._seen["version"])
        if not len(changed):
            return []
        removed, stored = _whole_hashes(self._seen[changed]), _whole_hashes(table[changed])
        self._seen[changed] = table[changed]
        events: list[KVEvent] = []
        if removed:
            events.append(BlockRemoved(removed, "host"))
        if stored:
            events.append(BlockStored(stored, None, [], self._block_size, "host"))
        return events


def _whole_hashes(entries: np.ndarray) -> list[BlockHash]:
    whole = entries[(entries["version"] > 0) & (entries["version"] % 2 == 0)]
    return [_joined(key, check) for key, check in zip(whole["key"], whole["check"])]
