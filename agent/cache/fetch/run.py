"""``spotdrain cache fetch``: one model, whole, at ``<cache>/models/NAME``; exit 0 once it is there.

Under the model's lock: a published model whose files match its manifest is returned at once; otherwise the source
is listed, the files land in a staging directory (resuming what a killed fetch of the same left), each is checked,
and the directory is published with one rename. With ``--wait`` a failure that may pass (the source failing for
longer than the retries) is tried again until the model is complete; a permanent one (a 404, a checksum that fails
twice, a full disk, access denied) ends the command with an error naming the file.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import structlog

from agent.cache.fetch.download import Transfers
from agent.cache.fetch.listing import MirrorListing, S3Listing
from agent.cache.fetch.parts import manifest, resumable
from agent.cache.fetch.progress import Progress, reporter
from agent.cache.fetch.settings import FetchSettings, from_arguments
from agent.cache.fetch.sources import RemoteFile, S3Source
from agent.cache.fetch.staging import model_lock, publish, published, remove, staging_dir
from agent.cache.fetch.transfer import FetchError, Limits, disk_error
from spotdrain.settings import log_effective

log = structlog.get_logger()


async def fetch(settings: FetchSettings, *, watch: Callable[[Progress], None] | None = None) -> Path:
    """The model's directory once it is complete there; raises FetchError. ``watch`` is given the download's
    progress once the source is listed (a model already present has none)."""
    if not settings.cache_path.is_dir():
        raise FetchError(f"{settings.cache_path}: no such directory (is the cache mounted?)", reason="disk")
    settings.models.mkdir(exist_ok=True)

    def on_wait(holder: str) -> None:
        log.info("cache.fetch_waiting", name=settings.name, holder_pid=holder or None)

    async with model_lock(settings.models, settings.name, on_wait=on_wait):
        record, problems = published(settings.target)
        if not problems and record.get("source") == str(settings.source):
            log.info("cache.model_present", name=settings.name, path=str(settings.target), files=len(record["files"]))
            return settings.target
        if record is not None:
            log.warning("cache.model_replaced", name=settings.name, source=record.get("source"), problems=problems[:5])
        await _fetch_locked(settings, watch)
    return settings.target


async def _fetch_locked(settings: FetchSettings, watch: Callable[[Progress], None] | None) -> None:
    """List, download into staging (resuming what is there), check and publish; under the model's lock."""
    limits = Limits(
        connect_s=settings.request_timeout_s,
        read_s=settings.request_timeout_s,
        total_s=settings.request_timeout_s * 10,
    )
    listing = _listing(settings, limits)
    files = _checked_listing(await listing.files(), settings)
    staging, record = staging_dir(settings.models, settings.name, str(settings.source))
    done = resumable(record, files, settings.part_size_bytes) if record is not None else {}
    progress = Progress(
        total_bytes=sum(f.size for f in files), resumed_bytes=_resumed(files, done, settings), files=len(files)
    )
    log.info(
        "cache.fetch_started",
        name=settings.name,
        source=str(settings.source),
        staging=str(staging),
        files=len(files),
        total_bytes=progress.total_bytes,
        resumed_bytes=progress.resumed_bytes,
    )
    transfers = Transfers(
        name=settings.name,
        source=str(settings.source),
        staging=staging,
        files=files,
        part_size=settings.part_size_bytes,
        url=listing.url,
        limits=limits,
        concurrency=settings.concurrency,
        progress=progress,
        backoff_s=settings.backoff_s,
        commit=listing.commit,
    )
    await _download_and_publish(settings, transfers, done)
    log.info("cache.fetched", name=settings.name, path=str(settings.target), **progress.fields(progress.clock()))


async def _download_and_publish(settings: FetchSettings, transfers: Transfers, done: dict[str, frozenset[int]]) -> None:
    progress, staging = transfers.progress, transfers.staging
    shown = asyncio.create_task(reporter(progress, name=settings.name, interval_s=settings.progress_interval_s))
    try:
        verified = await transfers.run(done)
        at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        model_manifest = manifest(
            source=str(settings.source),
            revision=settings.source.revision,
            commit=transfers.commit,
            files=transfers.files,
            verified=verified,
            at=at,
        )
        publish(staging, settings.target, model_manifest)
    except OSError as error:
        raise _cleaned(disk_error(error, str(staging)), staging) from None
    except FetchError as error:
        raise _cleaned(error, staging) from None
    finally:
        shown.cancel()
        await asyncio.gather(shown, return_exceptions=True)


def _cleaned(error: FetchError, staging: Path) -> FetchError:
    """A full disk takes its staging directory with it (nothing else could land); other failures keep theirs to
    resume from."""
    if error.reason == "disk_full":
        remove(staging)
    return error


def _listing(settings: FetchSettings, limits: Limits) -> S3Listing | MirrorListing:
    if isinstance(settings.source, S3Source):
        return S3Listing(
            settings.source,
            region=settings.aws_region,
            endpoint_url=settings.aws_endpoint_url,
            limits=limits,
            backoff_s=settings.backoff_s,
        )
    return MirrorListing(settings.source, limits=limits, backoff_s=settings.backoff_s)


def _checked_listing(files: list[RemoteFile], settings: FetchSettings) -> list[RemoteFile]:
    if not files:
        raise FetchError(f"{settings.source} lists no files", reason="listing")
    paths = [f.path for f in files]
    clash = next((p for p in paths if any(q.startswith(p + "/") for q in paths)), None)
    if clash is not None:
        raise FetchError(f"{settings.source}: {clash!r} is both a file and a directory", reason="listing")
    return sorted(files, key=lambda f: f.path)


def _resumed(files: list[RemoteFile], done: dict[str, frozenset[int]], settings: FetchSettings) -> int:
    size = settings.part_size_bytes
    total = 0
    for file in files:
        for index in done.get(file.path, ()):
            total += min(file.size, (index + 1) * size) - index * size
    return total


async def fetch_until_done(settings: FetchSettings) -> Path:
    """``fetch``, tried again after failures that may pass when ``--wait`` asks for it; ends on success or on a
    permanent failure."""
    attempt = 0
    while True:
        try:
            return await fetch(settings)
        except FetchError as error:
            if not (settings.wait and error.transient):
                raise
            delay = settings.wait_backoff_s[min(attempt, len(settings.wait_backoff_s) - 1)]
            attempt += 1
            log.warning(
                "cache.fetch_retry", name=settings.name, error=str(error), reason=error.reason, retry_in_s=delay
            )
            await asyncio.sleep(delay)


def main(args: argparse.Namespace) -> int:
    settings = from_arguments(args)
    log_effective("cache fetch", settings)
    try:
        asyncio.run(fetch_until_done(settings))
    except FetchError as error:
        log.error("cache.fetch_failed", name=settings.name, reason=error.reason, error=str(error))
        print(f"spotdrain cache fetch: error: {error}", file=sys.stderr)
        return 1
    return 0
