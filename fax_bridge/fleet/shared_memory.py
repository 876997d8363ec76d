"""Large payloads through shared memory between a coordinator and the devices it started.

A `LocalFleet` makes one directory for its fleet (`SharedDir`, under /dev/shm: memory,
not disk) and starts its devices with `--shared-memory DIR`; a device reports the
directory in Health, and the coordinator passes a round's large payloads through it
only to devices that report its own directory (`pool.DevicePool.shares_memory`). A
round's broadcast goes in one segment the coordinator writes for all its devices; each
device writes its partials' large bytes in a segment the coordinator named, and the
answer carries spans (`SharedSpan`: offset, length) where it would carry bytes. Readers
copy a segment into memory of their own with bounded reads (`open_segment`, `Segment`)
and read arrays straight from that copy: no gRPC transfer, no protobuf copy. They never
map the file: a mapped file that shrinks under its reader (any process of this user may
truncate it) kills the reader with SIGBUS, while a read only comes back short, which is
refused naming the segment. Every other device (`RemoteFleet`'s, or one started without the
directory) gets the same payloads in bytes fields, unchanged.

A segment is a file: a 64-byte header (magic, the generation the coordinator picked,
the data's length) and the data, each region 64-byte aligned. A segment that vanished,
is truncated, or whose header does not repeat the expected generation and length is
refused with a `FleetError` naming it, as is any span outside it; what the payloads
hold is checked as wire bytes are (`validate`). The content carries no checksum: the
directory is the coordinator's (mode 0700, same user) and its devices' alone.

Answer segments are written over, round after round: once a round has ended well (its
answers were copied out when read: `Segment.close`), the coordinator keeps the file
(`SharedDir.keep`) and names it again in that device's next request, with a new
generation; the device writes over it in place. Its pages are then neither freed nor
faulted in and zeroed again: at 10M parameters a device wrote its 80 MB answer into a
new segment in 30 ms, and freeing a 32 MB segment took the coordinator 5 ms. The kept
files are memory this process keeps for reuse, so `runtime/buffers.py` holds them (kind
`SEGMENTS`) and counts their bytes against the process's one cap with everything else
kept: past it, the least recently used kept memory of any kind goes first (a segment
pushed out is removed, and that device's next answer gets a new one). The copies
readers make land in memory `buffers.empty` hands out again round after round, for the
same reason.

Clean-up: every other segment name the coordinator handed out is removed when the round
ends (answered, failed, device killed), whatever is under the name, as is a kept answer
segment whose round failed or whose device is gone; `SharedDir.remove` deletes
the directory when the fleet closes; a device whose launcher is gone removes it too;
and a new `SharedDir` first removes directories left by coordinators that no longer run
(killed before they could).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import secrets
import shutil
import stat
import struct
from typing import Optional, Sequence

import numpy as np

from fax_bridge.errors import FleetError
from fax_bridge.rounds import wire
from fax_bridge.runtime import buffers
from fax_bridge.v1 import device_pb2 as pb

MAGIC = b"FAXSHM01"
HEADER_BYTES = 64
ALIGN = 64
MIN_SHARED_BYTES = 64 << 10  # smaller payloads stay in the message: a span costs more
ROOT = "/dev/shm"
PREFIX = "fax-bridge-shm-"
_HEADER = struct.Struct("<8sQQ")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
_IOV_MAX = 512


def available() -> bool:
    """Whether this host has a memory file system for segments (Linux's /dev/shm)."""
    return os.path.isdir(ROOT) and os.access(ROOT, os.W_OK | os.X_OK)


def check_name(name: str, what: str) -> str:
    """`name` if it is a plain segment file name (no path), else FleetError."""
    if not _NAME.match(name or ""):
        raise FleetError(f"{what}: shared-memory segment name {name[:40]!r} is not a plain "
                         "file name (letters, digits, '_', '.', '-')")
    return name


class SharedDir:
    """A fleet's directory of segments (mode 0700), removed by `remove()`.

    `SharedDir.create()` makes a new one under /dev/shm (first removing those of
    coordinators that no longer run); `SharedDir(path)` names an existing one (a
    device's `--shared-memory`), which must be a directory this user owns, closed to
    others."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        try:
            info = os.stat(self.path, follow_symlinks=False)
        except OSError as e:
            raise FleetError(f"shared-memory directory {path}: {e.strerror}; pass a "
                             "directory made by the coordinator (LocalFleet does)") from None
        if not os.path.isdir(self.path) or os.path.islink(self.path):
            raise FleetError(f"shared-memory directory {path} is not a directory")
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise FleetError(f"shared-memory directory {path} must belong to this user "
                             f"and be closed to others (mode 0700; it is "
                             f"{info.st_mode & 0o777:o})")

    @classmethod
    def create(cls) -> "SharedDir":
        sweep_stale()
        path = os.path.join(ROOT, f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
        os.mkdir(path, 0o700)
        return cls(path)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def new_name(self, kind: str) -> tuple[str, int]:
        """A fresh segment name and generation for a `kind` ('b', 'a') segment."""
        return f"{kind}-{secrets.token_hex(8)}", secrets.randbits(64)

    def unlink(self, name: str) -> None:
        """Removes segment `name` if it is there (whatever is under the name: a directory
        planted there goes too; the directory is this fleet's alone)."""
        path = self.file(name)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            shutil.rmtree(path, ignore_errors=True)

    def keep(self, address: str, name: str) -> bool:
        """Keeps answer segment `name` for the next answer of the device at `address`
        (removing one kept for it before), counted in `buffers` with the rest of what
        this process keeps; True if kept, else (over the cap, or its file is gone) the
        segment is removed."""
        try:
            nbytes = os.stat(self.file(name), follow_symlinks=False).st_size
        except OSError:
            self.unlink(name)
            buffers.drop(buffers.SEGMENTS, lambda key: key != (self.path, address))
            return False
        return buffers.give(buffers.SEGMENTS, (self.path, address), name, nbytes,
                            release=self.unlink, per_key=1)

    def kept(self, address: str) -> Optional[str]:
        """Takes the answer segment kept for the device at `address`, if any."""
        return buffers.take(buffers.SEGMENTS, (self.path, address))

    def drop_kept(self, keep_addresses: Sequence[str] = ()) -> None:
        """Removes the answer segments kept for devices not at `keep_addresses`."""
        staying = {(self.path, a) for a in keep_addresses}
        buffers.drop(buffers.SEGMENTS,
                     lambda key: key[0] != self.path or key in staying)

    def remove(self) -> None:
        """Deletes the directory and every segment in it (idempotent)."""
        buffers.drop(buffers.SEGMENTS, lambda key: key[0] != self.path)
        shutil.rmtree(self.path, ignore_errors=True)


def sweep_stale(root: str = ROOT) -> list[str]:
    """Removes directories of segments whose coordinator process no longer runs; returns
    their paths."""
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        path = os.path.join(root, name)
        try:
            if os.stat(path, follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Writer:
    """Gathers the arrays of one segment (`span` for each), then writes them (`write`)."""

    def __init__(self, min_bytes: int = MIN_SHARED_BYTES):
        self.min_bytes = int(min_bytes)
        self._arrays: list = []
        self.length = 0

    def takes(self, nbytes: int) -> bool:
        """Whether a payload of `nbytes` goes in the segment (large enough to gain)."""
        return nbytes >= self.min_bytes

    def span(self, array: np.ndarray, out: pb.SharedSpan) -> None:
        """Places `array`'s bytes (C order, as they are) in the segment; fills `out`."""
        array = np.ascontiguousarray(array)
        offset = -(-self.length // ALIGN) * ALIGN
        out.offset, out.length = offset, array.nbytes
        self._arrays.append((offset, array))
        self.length = offset + array.nbytes

    def write(self, directory: SharedDir, name: str, generation: int,
              over: bool = False) -> pb.SharedSegment:
        """Creates segment `name` holding the arrays (`over`: or writes over the file of
        that name, a regular one, in place: its pages are reused); removes it if writing
        fails. Returns its reference."""
        check_name(name, "writing a segment")
        path = directory.file(name)
        flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
        # O_NONBLOCK: opening a FIFO planted under the name fails instead of waiting
        flags |= os.O_NONBLOCK if over else os.O_EXCL
        fd = os.open(path, flags, 0o600)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, f"{path} is not a regular file")
            parts = [_HEADER.pack(MAGIC, generation, self.length).ljust(HEADER_BYTES, b"\0")]
            at = 0
            for offset, array in self._arrays:
                if offset > at:
                    parts.append(bytes(offset - at))
                parts.append(memoryview(array.reshape(-1).view(np.uint8)))  # any dtype
                at = offset + array.nbytes
            _write_all(fd, parts)
            if over:  # an older answer may have been longer
                os.ftruncate(fd, HEADER_BYTES + self.length)
        except BaseException:
            os.close(fd)
            directory.unlink(name)
            raise
        os.close(fd)
        self._arrays = []
        return pb.SharedSegment(name=name, generation=generation, length=self.length)


def _write_all(fd: int, parts: list) -> None:
    """Writes every buffer of `parts` in order (a large write may be cut short)."""
    parts = [p for p in parts if len(p)]
    while parts:
        done = os.writev(fd, parts[:_IOV_MAX])
        while parts and done >= len(parts[0]):
            done -= len(parts[0])
            parts.pop(0)
        if done:
            parts[0] = memoryview(parts[0])[done:]


@dataclasses.dataclass
class Segment:
    """A segment's data, read into this process's memory: `bytes_of(span)` gives a
    span's bytes (no further copy). The memory lives as long as any array read from it
    (`buffers.empty` hands it out again only then)."""

    name: str
    length: int
    data: memoryview

    def close(self) -> bool:
        """Lets the segment's file go: True, as nothing reads the file after
        `open_segment` (the data was copied out of it), so it may be written over."""
        return True

    def bytes_of(self, span: pb.SharedSpan, where: str) -> memoryview:
        offset, length = span.offset, span.length
        if offset < 0 or length < 0 or offset + length > self.length:
            raise FleetError(f"{where}: a span of {length} bytes at offset {offset} lies "
                             f"outside shared-memory segment {self.name} of {self.length} "
                             "bytes; the sender and this process disagree on the segment")
        return self.data[offset:offset + length]


def open_segment(directory: SharedDir, ref: pb.SharedSegment, where: str,
                 unlink: bool = False, expect: Optional[tuple] = None) -> Segment:
    """Reads segment `ref` of `directory` once its file and header match `ref` (and its
    name and generation `expect`, when given); `unlink` removes its file once read.
    Raises FleetError naming what is wrong: a vanished, truncated or foreign segment,
    something other than a file under its name, or a file that shrank while read.

    The data is copied out with bounded reads (`os.preadv`) into memory of this
    process's own (`buffers.empty`, reused round after round), never read through a
    mapping: a mapped file that shrinks under its reader kills the reader with SIGBUS
    at the first page past its end, and nothing stops another process of this user
    from truncating it after any check. A read past the end returns short instead."""
    name = check_name(ref.name, where)
    if expect is not None and (name, ref.generation) != expect:
        raise FleetError(f"{where}: names shared-memory segment {name} (generation "
                         f"{ref.generation:x}); it was asked for {expect[0]} (generation "
                         f"{expect[1]:x})")
    path = directory.file(name)
    try:  # O_NONBLOCK: opening a FIFO planted under the name fails instead of waiting
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise FleetError(f"{where}: shared-memory segment {path} vanished before it was "
                         "read (removed, or its writer failed)") from None
    except OSError as e:
        raise FleetError(f"{where}: cannot open shared-memory segment {path}: "
                         f"{e.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FleetError(f"{where}: shared-memory segment {path} is not a file (a "
                             f"{_file_kind(info.st_mode)} is under its name); something "
                             "other than the fleet wrote in its directory")
        if ref.length < 0 or info.st_size != HEADER_BYTES + ref.length:
            raise FleetError(f"{where}: shared-memory segment {path} holds {info.st_size} "
                             f"bytes; its reference says {HEADER_BYTES} + {ref.length} "
                             "(truncated or rewritten)")
        header = _read_exact(fd, memoryview(bytearray(HEADER_BYTES)), 0, where, path)
        magic, generation, length = _HEADER.unpack_from(header, 0)
        if magic != MAGIC or generation != ref.generation or length != ref.length:
            raise FleetError(f"{where}: shared-memory segment {path} has header ("
                             f"{magic!r}, generation {generation:x}, {length} bytes); its "
                             f"reference says generation {ref.generation:x}, {ref.length} "
                             "bytes (a stale or foreign segment)")
        data = _read_exact(fd, memoryview(buffers.empty(length, np.uint8)), HEADER_BYTES,
                           where, path)
    finally:
        os.close(fd)
        if unlink:
            directory.unlink(name)
    return Segment(name, length, data)


_READ_CHUNK = 1 << 30  # Linux reads at most 2 GiB - 4 KiB in one call


def _read_exact(fd: int, out: memoryview, offset: int, where: str, path: str) -> memoryview:
    """Fills `out` from `fd` at `offset` with bounded reads; FleetError if the file ends
    first (it shrank after its size was checked)."""
    done = 0
    while done < len(out):
        got = os.preadv(fd, [out[done:done + _READ_CHUNK]], offset + done)
        if got <= 0:
            raise FleetError(f"{where}: shared-memory segment {path} shrank to "
                             f"{offset + done} bytes while it was read ({offset + len(out)} "
                             "expected): something truncated it; the round's answer from "
                             "it is refused")
        done += got
    return out


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISLNK, "symbolic link")):
        if test(mode):
            return kind
    return "special file"


# ---------------------------------------------------------------------------------------
# Answers read through a segment


class TensorView:
    """A `Tensor` message's fields with its data read from a segment (what
    `wire.decode_tensor` reads)."""

    def __init__(self, message: pb.Tensor, segment: Optional[Segment], where: str):
        self.dtype = message.dtype
        self.shape = list(message.shape)
        self.data = wire.field_bytes(message, "data", segment, where)

    def HasField(self, name: str) -> bool:  # noqa: N802 (protobuf's name)
        return False  # its data is resolved already


class LeafView:
    """A `LeafPartial` with its bytes fields read from a segment (what
    `validate.check_partial` and `partials.leaf_from_message` read)."""

    def __init__(self, message: pb.LeafPartial, segment: Optional[Segment], where: str):
        self.dtype = message.dtype
        self.shape = list(message.shape)
        self.base_limb = message.base_limb
        self.num_limbs = message.num_limbs
        self.extreme = TensorView(message.extreme, segment, where)
        self.addend = TensorView(message.addend, segment, where)
        for field in ("limbs", "nonfinite", "doubles", "spilled"):
            setattr(self, field, wire.field_bytes(message, field, segment, where))


@dataclasses.dataclass
class PartialView:
    """An `AggregateResponse` whose leaves are `LeafView`s."""

    leaves: list
    weight_leaves: list
    num_clients: int


def view_partial(message: pb.AggregateResponse, segment: Optional[Segment],
                 where: str) -> PartialView:
    """`message` with every payload read from `segment` where its spans say."""
    return PartialView([LeafView(m, segment, where) for m in message.leaves],
                       [LeafView(m, segment, where) for m in message.weight_leaves],
                       message.num_clients)
