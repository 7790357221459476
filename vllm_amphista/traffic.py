"""Recording served traffic, so the heads can learn from it: each finished request's prompt and
output token ids (no text, no hidden states), written off the serving path. Imports no vLLM.

A recording is a directory of shards `traffic-<start>-<pid>-<random>-<n>.jsonl`, one request per line
({"prompt_ids", "output_ids"}), readable by the owner only (0600, in a 0700 directory when it is
created here). A shard is flushed after every request and rotated at `shard_bytes`; a restarted
server adds new shards and counts the old ones against the budget (so do servers sharing the
directory, each time one rotates a shard). Serving never waits on the
recording or fails by it: requests are handed to a writer thread through a bounded queue (when it
is full, requests go unrecorded and one warning says so), and when the directory's recordings reach
`max_bytes`, or a write fails (unwritable directory, full disk), recording stops with one warning.
Token ids of users' prompts are user data: recording is off unless asked for.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import uuid
from array import array
from pathlib import Path

logger = logging.getLogger(__name__)

SHARD_GLOB = "traffic-*.jsonl"
DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_SHARD_BYTES = 64 << 20
# Requests waiting for the writer, as int32 arrays: at most a few hundred MB for long requests.
QUEUE_REQUESTS = 1024


def recording_bytes(directory: str | os.PathLike) -> int:
    return sum(path.stat().st_size for path in Path(directory).glob(SHARD_GLOB))


class TrafficRecorder:
    def __init__(self, directory: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES,
                 shard_bytes: int = DEFAULT_SHARD_BYTES):
        self.directory = Path(directory)
        self.max_bytes, self.shard_bytes = max_bytes, shard_bytes
        self.recorded = self.dropped = 0
        self.stopped_because: str | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_REQUESTS)
        self._prefix = f"traffic-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._warned_full_queue = False
        self._thread = threading.Thread(target=self._write_all, name="vllm-amphista-traffic", daemon=True)
        self._thread.start()

    def record(self, prompt_ids, output_ids) -> None:
        """Hand one finished request to the writer; never blocks."""
        if self.stopped_because is not None:
            return
        try:
            self._queue.put_nowait((array("i", prompt_ids), array("i", output_ids)))
        except queue.Full:
            self.dropped += 1
            if not self._warned_full_queue:
                self._warned_full_queue = True
                logger.warning("traffic recording in %s falls behind: requests go unrecorded until it catches up",
                               self.directory)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued and stop."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def _stop(self, reason: str) -> None:
        self.stopped_because = reason
        logger.warning("traffic recording stopped: %s; serving goes on without it", reason)

    def _write_all(self) -> None:
        shard, shard_size, shard_index = None, 0, 0
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            total = recording_bytes(self.directory)
            while (item := self._queue.get()) is not None:
                if self.stopped_because is not None:
                    continue  # drain, so close() returns
                line = (json.dumps({"prompt_ids": item[0].tolist(), "output_ids": item[1].tolist()},
                                   separators=(",", ":")) + "\n").encode()
                if total + len(line) > self.max_bytes:
                    self._stop(f"{self.directory} holds its budget of {self.max_bytes} bytes (record_max_bytes)")
                    continue
                if shard is None or shard_size + len(line) > self.shard_bytes:
                    if shard is not None:
                        os.close(shard)
                        # Other servers may record into the same directory: count theirs too.
                        total = recording_bytes(self.directory)
                    path = self.directory / f"{self._prefix}-{shard_index:05d}.jsonl"
                    shard = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
                    shard_size, shard_index = 0, shard_index + 1
                written = os.write(shard, line)
                if written != len(line):
                    raise OSError(f"short write to {self.directory} ({written} of {len(line)} bytes)")
                shard_size += written
                total += written
                self.recorded += 1
        except Exception as error:  # noqa: BLE001 - whatever fails, serving must not
            self._stop(f"cannot write to {self.directory}: {error}")
            while self._queue.get() is not None:
                pass
        finally:
            if shard is not None:
                os.close(shard)


def read_recording(directory: str | os.PathLike) -> list[dict]:
    """The recorded requests ({"prompt_ids", "output_ids"}) of a recording directory, oldest shard
    first; a last line cut short by a crash is skipped. ValueError if there are none."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{directory}: no such recording directory")
    records = []
    for path in sorted(directory.glob(SHARD_GLOB)):
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if number == len(lines) - 1:
                    continue
                raise ValueError(f"{path}: line {number + 1} is not JSON") from None
            if not (isinstance(record, dict) and isinstance(record.get("prompt_ids"), list)
                    and isinstance(record.get("output_ids"), list)):
                raise ValueError(f"{path}: line {number + 1} is not a recorded request "
                                 "({\"prompt_ids\": [...], \"output_ids\": [...]})")
            records.append(record)
    if not records:
        raise ValueError(f"{directory}: the recording is empty (no requests in {SHARD_GLOB})")
    return records
