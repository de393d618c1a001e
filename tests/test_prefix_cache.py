"""The server's disk prefix cache: shared by server instances in sequence, exact, bounded, never failing a request."""
import asyncio
import errno
import logging

import pytest
import torch

import ds4
from ds4 import session_file
from ds4.errors import UsageError
from ds4.sampling import SamplingParams
from ds4.server.app import parse_args
from ds4.server.prefix_cache import SUFFIX, PrefixCache
from ds4.server.worker import Failed, Finished, Job, Worker

CTX, CHUNK = 256, 16  # forwards of <= 16 rows are batch-invariant: a warm prefill equals a cold one bit for bit
MIN_TOKENS, INTERVAL = 24, 24


@pytest.fixture(scope="module")
def engine(tiny_gguf):
    return ds4.load(*tiny_gguf, backend="torch", ctx=CTX, prefill_chunk=CHUNK)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def ask(worker: Worker, prompt: list[int], max_tokens: int = 6) -> tuple[str, Finished]:
    """Run one request through the worker's queue, as the routes do: (text, how it finished)."""
    async def run():
        job = worker.submit(Job(prompt, max_tokens, SamplingParams(), asyncio.get_running_loop()))
        text = []
        while not isinstance(event := await job.events.get(), Finished | Failed):
            text.append(event)
        assert isinstance(event, Finished), event
        return "".join(text), event
    return asyncio.run(run())


def cache(engine, directory, space_mb: float = 64, min_tokens: int = MIN_TOKENS) -> PrefixCache:
    return PrefixCache(engine, directory, space_mb, min_tokens=min_tokens, interval=INTERVAL)


def entries(directory) -> list:
    return sorted(directory.glob(f"*{SUFFIX}"))


def test_two_servers_in_sequence_share_the_cache(engine, tmp_path):
    """The first server saves the conversation's first long prompt; a second one, started after the first has
    closed, loads it for the next turn, prefills only the rest, and answers exactly as a cold server does."""
    turn1 = ids(40, 1)
    turn2 = turn1 + ids(30, 2)
    cold = Worker(engine)
    cold_text, cold_done = ask(cold, turn2)
    cold_rows = cold.session.counters["forward_rows"]
    cold.close()
    assert cold_done.cached_tokens == 0

    first = Worker(engine, prefix_cache=cache(engine, tmp_path))
    ask(first, turn1)
    first.close()
    assert [p.name.split("-")[0] for p in entries(tmp_path)] == [engine.model_id[:16]]

    second = Worker(engine, prefix_cache=cache(engine, tmp_path))
    warm_text, warm_done = ask(second, turn2)
    forward_rows = second.session.counters["forward_rows"]
    second.close()
    assert warm_done.cached_tokens == len(turn1) - 1     # the stored prompt minus its last token
    stored = len(turn1) - 1  # the loaded counters hold the first server's prefill of these rows
    assert forward_rows - stored == cold_rows - stored  # the second server ran all but the stored rows
    assert warm_text == cold_text
    assert second.prefix_cache.counts.hits == 1
    assert len(entries(tmp_path)) == 2  # turn 2 grew INTERVAL past its stored prefix: saved again


def test_policy_saves_first_long_prompt_then_at_intervals(engine, tmp_path):
    c = cache(engine, tmp_path)
    base = ids(60, 3)
    saved = []
    for n in (MIN_TOKENS - 1, MIN_TOKENS, MIN_TOKENS + 5, MIN_TOKENS + INTERVAL - 1, MIN_TOKENS + INTERVAL):
        session = engine.session()
        session.forward(base[:n], None)
        saved.append(c.maybe_save(session))
        c.flush()
    c.close()
    assert saved == [False, True, False, False, True]
    assert len(entries(tmp_path)) == 2


def test_eviction_keeps_the_directory_under_its_limit(engine, tmp_path):
    """50 conversations through a cache that fits a handful of entries: the directory never exceeds the
    limit, and the conversation that keeps coming back survives (hits count)."""
    n = 9  # short conversations (one prefill chunk), saved from their first prompt on
    probe = engine.session()
    probe.forward(ids(n - 1, 0), None)
    session_file.save(probe, tmp_path / "probe")
    entry_mb = (tmp_path / "probe").stat().st_size / 2**20
    (tmp_path / "probe").unlink()
    limit = 4.5 * entry_mb
    worker = Worker(engine, mtp_draft=0, prefix_cache=cache(engine, tmp_path, limit, min_tokens=n - 1))
    regular = ids(n, 100)
    for k in range(50):
        ask(worker, regular if k % 4 == 0 else ids(n, 200 + k), max_tokens=1)
        worker.prefix_cache.flush()
        assert sum(p.stat().st_size for p in entries(tmp_path)) <= limit * 2**20
    worker.close()
    c = worker.prefix_cache
    assert c.counts.saved == 38 and c.counts.hits == 12  # 37 one-off conversations, 1 asked back 12 times
    assert c.counts.evicted == c.counts.saved - len(entries(tmp_path)) and len(entries(tmp_path)) <= 5
    assert c.path(regular[:-1]).exists()


@pytest.mark.parametrize("trouble", ["unwritable dir", "full disk"])
def test_disk_trouble_warns_once_and_requests_go_on(engine, tmp_path, caplog, monkeypatch, trouble):
    directory = tmp_path / "cache"
    if trouble == "unwritable dir":
        (tmp_path / "file").write_text("x")
        directory = tmp_path / "file" / "cache"   # a path through a file: no one (root included) can create it
    else:
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(session_file, "write", full)
    with caplog.at_level(logging.WARNING, logger="ds4.server"):
        worker = Worker(engine, mtp_draft=0, prefix_cache=cache(engine, directory))
        for seed in (5, 6, 7):
            ask(worker, ids(MIN_TOKENS + 2, seed), max_tokens=2)
            worker.prefix_cache.flush()
        worker.close()
    warnings = [r for r in caplog.records if "KV disk cache off" in r.getMessage()]
    assert len(warnings) == 1
    assert not worker.prefix_cache.enabled
    assert not directory.exists() or entries(directory) == []


@pytest.mark.parametrize("damage", ["truncated", "other layout"])
def test_a_bad_or_foreign_entry_is_refused_not_fatal(engine, tiny_gguf, tmp_path, caplog, damage):
    prompt = ids(40, 9)
    writer = Worker(engine, mtp_draft=0, prefix_cache=cache(engine, tmp_path))
    expected, _ = ask(writer, prompt)
    writer.close()
    (path,) = entries(tmp_path)
    reader_engine = engine
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:-100])
    else:  # the same files with another switch: a different layout, so the same file names
        reader_engine = ds4.load(*tiny_gguf, backend="torch", ctx=CTX, prefill_chunk=CHUNK, kv_fp8_sim=False)
        writer_session = engine.session()
        writer_session.forward(prompt[:-1], None)
        session_file.save(writer_session, path, engine.model_id)
    reader = Worker(reader_engine, mtp_draft=0, prefix_cache=cache(reader_engine, tmp_path))
    with caplog.at_level(logging.WARNING, logger="ds4.server"):
        text, done = ask(reader, prompt + [7])
    reader.close()
    assert done.cached_tokens == 0 and reader.prefix_cache.counts.refused == 1
    assert any("entry refused" in r.getMessage() for r in caplog.records)
    assert not path.exists()


def test_flags(engine, tmp_path):
    a = parse_args(["--kv-disk-dir", str(tmp_path), "--kv-disk-space-mb", "12.5"])
    assert (a.kv_disk_dir, a.kv_disk_space_mb) == (str(tmp_path), 12.5)
    assert parse_args([]).kv_disk_dir is None
    with pytest.raises(UsageError, match="--kv-disk-space-mb must be > 0"):
        PrefixCache(engine, tmp_path, 0)


def test_kvdisk_bench_conversation_and_flags():
    """The kvdisk suite's pieces that need no server processes (the run itself is measured in docs/server.md)."""
    import argparse

    from ds4.bench import kvdisk
    from ds4.engine import default_model_paths
    turn1, turn2 = kvdisk.conversation(default_model_paths()[0], 50, 7)
    assert len(turn1) == 50 and turn2[:50] == turn1 and len(turn2) == 57
    p = argparse.ArgumentParser()
    kvdisk.add_args(p, False)
    with pytest.raises(UsageError, match="--first must be >= 2"):
        kvdisk.rows(p.parse_args(["--first", "1"]), None)
