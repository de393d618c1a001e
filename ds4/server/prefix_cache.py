"""The server's disk prefix cache (`--kv-disk-dir DIR --kv-disk-space-mb N`): session files of long prompts that
outlive the process, so a conversation's next turn, even in a new server, prefills only what is new.

Entries are keyed by the token ids they hold, not the rendered text: a stored session is valid exactly for
prompts whose ids start with its ids, while a text prefix can tokenize differently once more text follows it
(a BPE merge across the cut). The key is a SHA-256 of the model id and the ids; the file name is the model
id's first 16 hex digits, a dash and the key, so models sharing a directory never collide, and a load still
checks the file's model and layout (ds4/session_file.py). A lookup tries each stored length, longest first.

Save policy, after a prompt (minus its last token) is prefilled: the first prompt of a conversation once it
holds `min_tokens`, then again each time it has grown `interval` tokens past its longest stored prefix. The
session's state is copied to the host at once and written by a background thread. After each write the entries
with the lowest (1 + hits) / ((1 + age / AGE_UNIT_S) * bytes) go until the directory's entries fit the space
limit. Any disk trouble (an unwritable directory, a full disk) logs one warning and turns the cache off; a
request never fails because of it.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ds4 import session_file
from ds4.engine import Engine
from ds4.errors import SessionFileError, UsageError
from ds4.session import Session

SUFFIX = ".ds4session"
MIN_TOKENS = 512     # a conversation's first prompt is saved once it holds this many tokens
INTERVAL = 2048      # and again each time it grows this many tokens past its longest stored prefix
AGE_UNIT_S = 600.0   # an entry unused this long counts half as much in eviction

log = logging.getLogger("ds4.server")


@dataclass
class Entry:
    """One file in the cache directory: its key (None: another model's or unreadable), tokens, bytes, use."""

    path: Path
    key: str | None
    tokens: int
    size: int
    used: float
    hits: int = 0

    def score(self, now: float) -> float:
        """Worth keeping: hits, recency, and small size count for an entry."""
        return (1 + self.hits) / ((1 + max(0.0, now - self.used) / AGE_UNIT_S) * max(1, self.size))


@dataclass
class CacheCounts:
    """What the cache did since the server started."""

    hits: int = 0      # requests that loaded a stored prefix
    misses: int = 0    # requests with no stored prefix of their prompt
    saved: int = 0     # entries written
    evicted: int = 0   # entries deleted to fit the space limit
    refused: int = 0   # entries that did not load (damaged, another layout) and were removed


class PrefixCache:
    """Session files of prompt prefixes in one directory, under a space limit, for one engine."""

    def __init__(self, engine: Engine, directory: str | os.PathLike[str], space_mb: float,
                 min_tokens: int = MIN_TOKENS, interval: int = INTERVAL):
        if not space_mb > 0:
            raise UsageError(f"--kv-disk-space-mb must be > 0, got {space_mb}")
        self.engine, self.dir, self.limit = engine, Path(directory), int(space_mb * 2**20)
        self.min_tokens, self.interval = min_tokens, interval
        self.prefix = engine.model_id[:16]
        self.entries: dict[Path, Entry] = {}
        self.lock = threading.Lock()
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ds4-kv-disk")
        self.enabled = True
        self.counts = CacheCounts()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe.{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
            self._scan()
        except OSError as e:
            self._disable(f"cannot use {self.dir} ({e.strerror or e})")

    def _disable(self, why: str) -> None:
        """Turn the cache off with one warning."""
        if self.enabled:
            self.enabled = False
            log.warning("ds4 KV disk cache off: %s; requests go on without it", why)

    def _scan(self) -> None:
        """Index the files already in the directory (another process's, a previous run's)."""
        for path in self.dir.glob(f"*{SUFFIX}"):
            stat = path.stat()
            key, tokens = self._key_of(path), 0
            if key:
                try:
                    tokens = int(session_file.read_header(path)["n_tokens"])
                except (SessionFileError, KeyError, TypeError, ValueError) as e:
                    self._refuse(Entry(path, key, 0, stat.st_size, stat.st_mtime), e)
                    continue
            self.entries[path] = Entry(path, key, tokens, stat.st_size, stat.st_mtime)

    def _key_of(self, path: Path) -> str | None:
        """The key in an entry's file name, None for another model's file."""
        head = self.prefix + "-"
        return path.name[len(head):-len(SUFFIX)] if path.name.startswith(head) else None

    def key(self, ids: list[int]) -> str:
        """The key of a session holding exactly `ids`."""
        h = hashlib.sha256(self.engine.model_id.encode())
        h.update(b"".join(i.to_bytes(4, "little") for i in ids))
        return h.hexdigest()[:40]

    def path(self, ids: list[int]) -> Path:
        """The file of the entry holding exactly `ids`."""
        return self.dir / f"{self.prefix}-{self.key(ids)}{SUFFIX}"

    def longest(self, ids: list[int], limit: int) -> Entry | None:
        """The stored entry holding the longest prefix of `ids` of at most `limit` tokens."""
        if not self.enabled:
            return None
        with self.lock:
            mine = {e.key: e for e in self.entries.values() if e.key}
            lengths = sorted({e.tokens for e in mine.values() if 0 < e.tokens <= limit}, reverse=True)
        for n in lengths:
            entry = mine.get(self.key(ids[:n]))
            if entry is not None and entry.tokens == n:
                return entry
        return None

    def load(self, ids: list[int], better_than: int) -> Session | None:
        """A session holding the longest stored prefix of `ids` (leaving one token to feed) when it is longer
        than `better_than` tokens, else None. A file that does not load is dropped with a warning."""
        entry = self.longest(ids, len(ids) - 1)
        if entry is None or entry.tokens <= better_than:
            self.counts.misses += entry is None
            return None
        try:
            session = self.engine.session_from_file(entry.path)
            if session.tokens != ids[:entry.tokens]:
                raise SessionFileError(f"{entry.path}: holds other tokens than its name says")
        except (SessionFileError, OSError) as e:
            self._refuse(entry, e)
            return None
        entry.hits, entry.used = entry.hits + 1, time.time()
        self.counts.hits += 1
        try:
            os.utime(entry.path)  # the file's mtime is its last use for the next server's eviction
        except OSError:
            pass
        return session

    def maybe_save(self, session: Session) -> bool:
        """Save `session` (its tokens: a prompt minus its last token) when the policy asks; True when queued."""
        ids = list(session.tokens)
        if not self.enabled or len(ids) < self.min_tokens:
            return False
        stored = self.longest(ids, len(ids))
        if stored is not None and (stored.tokens == len(ids) or len(ids) - stored.tokens < self.interval):
            return False
        state = session_file.state(session, self.engine.model_id)  # host copies: the session may go on at once
        self.writer.submit(self._write, self.path(ids), len(ids), state)
        return True

    def _write(self, path: Path, tokens: int, state: session_file.SavedSession) -> None:
        """The background write of one entry, then eviction; a disk error turns the cache off."""
        if not self.enabled:
            return
        try:
            session_file.write(path, state)
            size = path.stat().st_size
        except OSError as e:
            self._disable(f"writing {path.name} failed ({e.strerror or e})")
            return
        with self.lock:
            self.entries[path] = Entry(path, self._key_of(path), tokens, size, time.time())
            self.counts.saved += 1
        self._evict()

    def _evict(self) -> None:
        """Delete the entries least worth keeping until the directory's entries fit the space limit."""
        now = time.time()
        with self.lock:
            ranked = sorted(self.entries.values(), key=lambda e: e.score(now))
            total = sum(e.size for e in ranked)
        for entry in ranked:
            if total <= self.limit:
                break
            total -= entry.size
            self._remove(entry)
            self.counts.evicted += 1

    def _refuse(self, entry: Entry, why: Exception) -> None:
        """Drop an entry that does not load (damaged, another model's layout) with a warning."""
        log.warning("ds4 KV disk cache: entry refused and removed: %s", why)
        self.counts.refused += 1
        self._remove(entry)

    def _remove(self, entry: Entry) -> None:
        with self.lock:
            self.entries.pop(entry.path, None)
        try:
            entry.path.unlink()
        except OSError:
            pass

    def size(self) -> int:
        """Bytes of the entries in the directory."""
        with self.lock:
            return sum(e.size for e in self.entries.values())

    def flush(self) -> None:
        """Wait for the writes queued so far."""
        self.writer.submit(lambda: None).result()

    def close(self) -> None:
        """Finish the queued writes and stop the writer thread."""
        self.writer.shutdown(wait=True)
