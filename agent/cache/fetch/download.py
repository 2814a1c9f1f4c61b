"""The transfers of one fetch: every missing part of every file, N at a time, each file checked once whole.

Workers take parts from one queue across the files, in turn, so a model of a few large files keeps N requests
open. The kernel is asked to start writing each part to the disk as soon as it is written (``sync_file_range``), so
the disk is busy from the first part on, not from the first fsync: where the disk is slower than the source, the
fetch ends about when the disk has taken the last part. Written parts are fsynced and recorded as done at every
checkpoint (about twice a second, and at the end), so a fetch killed at any moment leaves a record of only parts
whose bytes are on disk. Each file's checksum is fed, in a thread, as far as the file is written from its start while
its other parts arrive; once its last part is written, what is left is hashed and the file checked. A file whose
check fails is fetched again once; a second failure removes it from staging and ends the fetch with an error naming
it (the other files' parts stay, to be resumed).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import itertools
import os
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from agent.cache.fetch.parts import PROGRESS, Part, part_count, parts_of, progress_record
from agent.cache.fetch.progress import Progress
from agent.cache.fetch.sources import Checksum, RemoteFile
from agent.cache.fetch.staging import write_json
from agent.cache.fetch.transfer import FetchError, Limits, disk_error, get_part
from agent.cache.fetch.verify import Digest, crc_of
from spotdrain.retry import BACKOFF_S, ApiError, retrying

log = structlog.get_logger()
CHECKPOINT_S = 0.5
HASH_STEP = 64 * 1024 * 1024  # bytes hashed per thread call, so that a cancelled fetch stops soon


@dataclass
class FileState:
    file: RemoteFile
    fd: int
    done: set[int]  # fsynced and recorded
    written: set[int] = field(default_factory=set)  # on disk, not yet fsynced
    left: int = 0  # parts of this round not yet written
    problem: str | None = None
    verified: Checksum | None = None
    digest: Digest | None = None  # this round's
    frontier: int = 0  # the first part not yet written: the file is whole before it
    crcs: dict[int, int] = field(default_factory=dict)  # this round's parts' CRCs, taken as they arrived, by index
    advanced: asyncio.Event = field(default_factory=asyncio.Event)  # a part of this file was written


@dataclass
class Transfers:
    name: str
    source: str
    staging: Path
    files: list[RemoteFile]
    part_size: int
    url: Callable[[RemoteFile], Awaitable[str]]
    limits: Limits
    concurrency: int
    progress: Progress
    backoff_s: Sequence[float] = BACKOFF_S
    commit: str | None = None  # the listing's, for the manifest
    states: dict[str, FileState] = field(default_factory=dict)

    async def run(self, done: dict[str, frozenset[int]]) -> dict[str, Checksum | None]:
        """Fetch and check every file; the checksum each was checked against, by path. Raises FetchError."""
        try:
            for file in self.files:
                self.states[file.path] = FileState(file, await self._open(file), set(done.get(file.path, ())))
            await self._record()
            todo = list(self.states.values())
            for attempt in (1, 2):
                await self._round(todo)
                todo = [state for state in todo if state.problem is not None]
                if not todo:
                    return {path: state.verified for path, state in self.states.items()}
                for state in todo:
                    log.warning("cache.fetch_check_failed", name=self.name, problem=state.problem, attempt=attempt)
                    self.progress.add(-state.file.size)
                    state.done.clear()
            await self._discard(todo)
            raise FetchError(f"{todo[0].problem} (fetched twice)", reason="checksum")
        except OSError as error:
            raise disk_error(error, str(self.staging)) from None
        finally:
            for state in self.states.values():
                os.close(state.fd)

    async def _discard(self, states: list[FileState]) -> None:
        """Remove files that failed their check twice, and record that none of their parts is done: nothing of them
        can be resumed, and left in staging they would hold their size of the cache from the next fetch of any
        model. Their descriptors are closed by ``run``, which frees the blocks."""
        for state in states:
            (self.staging / state.file.path).unlink(missing_ok=True)
        await self._record()

    async def _open(self, file: RemoteFile) -> int:
        path = self.staging / file.path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if file.size:
                await asyncio.to_thread(_preallocate, fd, file.size)
            os.ftruncate(fd, file.size)
        except OSError as error:
            os.close(fd)
            raise disk_error(error, file.path) from None
        return fd

    async def _round(self, states: list[FileState]) -> None:
        missing = []
        for state in states:
            state.problem, state.digest, state.frontier, state.crcs = None, Digest(state.file), 0, {}
            missing.append(parts_of(state.file, self.part_size, skip=frozenset(state.done)))
            state.left = len(missing[-1])
        # The files' parts in turn: every file is written from its start at once, so each is hashed in a thread of
        # its own while it arrives (an MD5 is one core's work, about 0.7 GB/s, however many parts are in flight).
        queue = deque(part for parts in itertools.zip_longest(*missing) for part in parts if part is not None)
        try:
            await self._transfer(states, queue)
        except BaseException:
            # What is on disk is kept for the next fetch, if it can be recorded; the failure is what is reported.
            with contextlib.suppress(OSError):
                await asyncio.shield(self._checkpoint())
            raise
        await self._checkpoint()

    async def _transfer(self, states: list[FileState], queue: deque[Part]) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                for state in states:
                    group.create_task(self._verify(state))
                workers = [group.create_task(self._worker(queue)) for _ in range(self.concurrency)]
                group.create_task(self._checkpoints(workers))
        except* FetchError as errors:
            raise errors.exceptions[0] from None
        except* OSError as errors:
            raise errors.exceptions[0] from None

    async def _worker(self, queue: deque[Part]) -> None:
        """Takes parts until the queue is empty; raises FetchError for a part that cannot be had."""
        while queue:
            part = queue.popleft()
            state = self.states[part.file.path]
            await self._fetch(part, state)
            await asyncio.to_thread(_start_writeback, state.fd, part.start, part.size)
            state.written.add(part.index)
            state.left -= 1
            state.advanced.set()

    async def _fetch(self, part: Part, state: FileState) -> None:
        path = part.file.path

        async def attempt() -> int | None:
            return await get_part(
                await self.url(part.file), part, state.fd, limits=self.limits, on_bytes=self.progress.add, crc=crc
            )

        crc = crc_of(part.file, self.part_size)
        try:
            value = await retrying(
                attempt, what=f"GET {path} bytes {part.start}-{part.end - 1}", backoff_s=self.backoff_s
            )
        except ApiError as error:
            if error.status == 404:
                raise FetchError(
                    f"{path}: listed by the source, but not found there (HTTP 404)", reason="not_found"
                ) from None
            reason = "denied" if error.status in (401, 403) else "source"
            raise FetchError(f"{path}: {error}", reason=reason, transient=error.transient) from None
        except OSError as error:
            raise disk_error(error, path) from None
        if value is not None:
            state.crcs[part.index] = value  # before the part counts as written, so the digest finds it

    async def _verify(self, state: FileState) -> None:
        """Hashes the file as far as it is written from its start, until all of it is; then checks it."""
        digest = state.digest
        assert digest is not None
        while True:
            state.advanced.clear()
            upto = self._whole_to(state)
            if upto > digest.offset:
                upto = min(upto, digest.offset + max(1, HASH_STEP // self.part_size) * self.part_size)  # whole parts
                await asyncio.to_thread(digest.feed, state.fd, upto, dict(state.crcs), self.part_size)
            elif state.left == 0:
                break
            else:
                await state.advanced.wait()

        def check() -> tuple[str | None, Checksum | None]:
            os.fsync(state.fd)
            return digest.check(state.fd)

        state.problem, state.verified = await asyncio.to_thread(check)

    def _whole_to(self, state: FileState) -> int:
        """The offset up to which every part of the file is written."""
        count = part_count(state.file.size, self.part_size)
        while state.frontier < count and (state.frontier in state.done or state.frontier in state.written):
            state.frontier += 1
        return min(state.file.size, state.frontier * self.part_size)

    async def _checkpoints(self, workers: list[asyncio.Task[None]]) -> None:
        """Fsyncs and records the written parts every CHECKPOINT_S; returns once the workers are done."""
        while not all(worker.done() for worker in workers):
            await asyncio.wait(workers, timeout=CHECKPOINT_S)
            await self._checkpoint()

    async def _checkpoint(self) -> None:
        """Parts written before the fsync become done; the record then says so. The sets change only on the loop."""
        batch = [(state, frozenset(state.written)) for state in self.states.values() if state.written]
        if not batch:
            return
        await asyncio.to_thread(_fdatasync, [state.fd for state, _ in batch])
        for state, indices in batch:
            state.done |= indices
            state.written -= indices
        await self._record()

    async def _record(self) -> None:
        done = {path: frozenset(state.done) for path, state in self.states.items()}
        record = progress_record(
            name=self.name, source=self.source, files=self.files, part_size=self.part_size, done=done
        )
        await asyncio.to_thread(write_json, self.staging / PROGRESS, record)


def _preallocate(fd: int, size: int) -> None:
    """Reserve the file's blocks, so that a full disk fails here, at once; a filesystem that cannot is written
    into as it is."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writing the range's dirty pages, wait for none
_sync_file_range = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)  # Linux; None elsewhere


def _start_writeback(fd: int, offset: int, size: int) -> None:
    """Start writing the range to the disk, where the system can be asked to; a refusal changes nothing, since the
    checkpoint's fsync writes it in any case."""
    if _sync_file_range is not None:
        _sync_file_range(fd, ctypes.c_int64(offset), ctypes.c_int64(size), _SYNC_FILE_RANGE_WRITE)


def _fdatasync(fds: list[int]) -> None:
    for fd in fds:
        os.fdatasync(fd)
