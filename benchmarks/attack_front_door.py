"""The front door as an attacker would try it, against ``spear serve`` on a model in a process of its own.

slow-bodies: one client (127.0.0.1) holds ``--connections`` connections that each send a request's
headers with ``Content-Length: 1000000`` and then trickle the body a byte every ``--trickle-s``
seconds, reopening each connection the server closes, for ``--seconds``; meanwhile another client
(127.0.0.2) asks ``/health`` every second and sends a greedy completion stream every few seconds,
whose text must equal the one of a clean run before the attack. Then ``--drops`` uploads are sent
halfway and dropped, and the server's log growth per dropped upload is measured.

abandoned-prompts: ``--prompts`` prompts of ``--chars`` characters each sent and dropped at once
(their clients leave), then a 9,000-character prompt: its time against the same prompt alone.

    python benchmarks/attack_front_door.py slow-bodies              # the default model, 2,100 connections, 60 s
    python benchmarks/attack_front_door.py slow-bodies --connections 500 --seconds 20
    python benchmarks/attack_front_door.py abandoned-prompts --chars 1000000
    python benchmarks/attack_front_door.py abandoned-prompts --chars 600000   # prompts that may fit the context

Each prints one JSON line (and writes it to ``--out``): for slow-bodies the answered shares, whether
every victim text matched, the log bytes per dropped upload, the server's connection-close counts
(``/metrics``) and memory; for abandoned-prompts the seconds alone and after the dropped prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

_HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
         b"Content-Length: 1000000\r\n\r\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


def _client(source: str, timeout: float = 10.0) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=timeout)


def _victim_text(client: httpx.Client, url: str, model: str, prompt: str, tokens: int) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}
    text = []
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


async def _attack(port: int, connections: int, seconds: float, trickle_s: float, stats: dict) -> None:
    """``connections`` slow uploads from 127.0.0.1, each reopened when the server closes it."""
    end = time.monotonic() + seconds

    async def one() -> None:
        while time.monotonic() < end:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.1", 0))
            except OSError:
                stats["refused_opens"] += 1
                await asyncio.sleep(0.5)
                continue
            stats["opened"] += 1
            try:
                writer.write(_HEAD)
                await writer.drain()
                while time.monotonic() < end:
                    try:
                        data = await asyncio.wait_for(reader.read(4096), timeout=trickle_s)
                    except asyncio.TimeoutError:
                        writer.write(b" ")
                        await writer.drain()
                        continue
                    stats["cut"] += 1  # an answer (408) or the close: the server cut it
                    break
            except (ConnectionError, OSError):
                stats["cut"] += 1
            finally:
                writer.close()

    await asyncio.gather(*(one() for _ in range(connections)))


def _drop_uploads(port: int, n: int) -> None:
    for _ in range(n):
        with socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.4", 0)) as s:
            s.sendall(_HEAD + b'{"model": "x", "prompt": "' + b"a" * 1000)
            time.sleep(0.02)


@contextlib.contextmanager
def serving(model: str | None):
    """``spear serve`` on ``model`` (None: the default) on a free port, healthy; yields (url, served
    name, process, log path)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="spear-serve-", suffix=".log", delete=False)
    cmd = [os.path.join(os.path.dirname(sys.executable), "spear"), "serve", "--port", str(port), "--log-level", "info"]
    if model:
        cmd += ["--model", model]
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        with _client("127.0.0.3", 2) as probe:
            while True:
                assert server.poll() is None, open(log.name).read()[-3000:]
                try:
                    if probe.get(url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "the server did not become healthy"
                time.sleep(0.5)
            name = probe.get(url + "/v1/models").json()["data"][0]["id"]
        yield url, name, server, log.name
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        os.unlink(log.name)


def slow_bodies(args) -> dict:
    with serving(args.model) as (url, model, server, log):
        port = int(url.rsplit(":", 1)[1])
        prompt, tokens = "The history of the city begins", 16
        with _client("127.0.0.2", 120) as victim:
            clean = _victim_text(victim, url, model, prompt, tokens)
            clean_seconds = []
            for _ in range(3):
                t0 = time.monotonic()
                _victim_text(victim, url, model, prompt, tokens)
                clean_seconds.append(round(time.monotonic() - t0, 3))

        stats = {"opened": 0, "cut": 0, "refused_opens": 0}
        health = {"asked": 0, "ok": 0}
        streams = {"asked": 0, "ok": 0, "matched": 0, "seconds": []}
        rss_before = _rss_mb(server.pid)

        def observe(stop: list[bool]) -> None:
            with _client("127.0.0.3", 5) as probe, _client("127.0.0.2", 60) as victim:
                last_stream = 0.0
                while not stop[0]:
                    health["asked"] += 1
                    try:
                        health["ok"] += probe.get(url + "/health").status_code == 200
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() - last_stream > 5:
                        last_stream = time.monotonic()
                        streams["asked"] += 1
                        try:
                            t0 = time.monotonic()
                            text = _victim_text(victim, url, model, prompt, tokens)
                            streams["seconds"].append(round(time.monotonic() - t0, 3))
                            streams["ok"] += 1
                            streams["matched"] += text == clean
                        except httpx.HTTPError:
                            pass
                    time.sleep(1.0)

        stop = [False]
        watcher = threading.Thread(target=observe, args=(stop,), daemon=True)
        watcher.start()
        asyncio.run(_attack(port, args.connections, args.seconds, args.trickle_s, stats))
        stop[0] = True
        watcher.join(120)
        rss_attack = _rss_mb(server.pid)

        time.sleep(2)
        log_before = os.path.getsize(log)
        _drop_uploads(port, args.drops)
        time.sleep(2)
        log_per_drop = (os.path.getsize(log) - log_before) / max(args.drops, 1)
        with _client("127.0.0.3", 5) as probe:
            metrics = probe.get(url + "/metrics").text
        closed = {m.group(1): float(m.group(2)) for m in
                  re.finditer(r'spear_http_connections_closed_total\{reason="(\w+)"\} ([0-9.e+]+)', metrics)}
        return {
            "attack": "slow-bodies", "connections": args.connections, "seconds": args.seconds,
            "trickle_s": args.trickle_s, "opens": stats, "health_answered": round(health["ok"] / max(health["asked"], 1), 4),
            "health_asked": health["asked"], "streams_answered": round(streams["ok"] / max(streams["asked"], 1), 4),
            "streams_asked": streams["asked"], "streams_matched_clean": streams["matched"] == streams["ok"],
            "stream_seconds_clean": clean_seconds, "stream_seconds": streams["seconds"], "log_bytes_per_dropped_upload": round(log_per_drop, 1),
            "closed": closed, "server_rss_mb": {"before": round(rss_before), "attack_end": round(rss_attack)},
        }


def abandoned_prompts(args) -> dict:
    with serving(args.model) as (url, model, _, _):
        body = {"model": model, "prompt": "word " * 1800, "max_tokens": 1, "temperature": 0}  # 9,000 characters

        def timed() -> float:
            with _client("127.0.0.2", 300) as c:
                t0 = time.monotonic()
                r = c.post(url + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return time.monotonic() - t0

        timed()  # the first request pays one-time costs (the tokenizer copies)
        alone = min(timed() for _ in range(3))
        dropped = {"model": model, "prompt": "a" * args.chars, "max_tokens": 1}
        statuses = []

        def drop() -> None:
            try:
                with _client("127.0.0.4", 0.5) as c:
                    statuses.append(c.post(url + "/v1/completions", json=dropped).status_code)
            except httpx.TimeoutException:
                statuses.append("left")

        senders = [threading.Thread(target=drop) for _ in range(args.prompts)]
        for t in senders:
            t.start()
        for t in senders:
            t.join(60)
        after = timed()
        return {"attack": "abandoned-prompts", "prompts": args.prompts, "chars": args.chars,
                "dropped_answers": {str(k): statuses.count(k) for k in set(statuses)},
                "seconds_alone": round(alone, 3), "seconds_after": round(after, 3),
                "added_s": round(after - alone, 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("attack", choices=["slow-bodies", "abandoned-prompts"])
    p.add_argument("--model", default=None, help="a model folder (default: the embedded default model)")
    p.add_argument("--connections", type=int, default=2100, help="slow-bodies: connections held")
    p.add_argument("--seconds", type=float, default=60.0, help="slow-bodies: how long")
    p.add_argument("--trickle-s", type=float, default=5.0, help="slow-bodies: seconds between the body's bytes")
    p.add_argument("--drops", type=int, default=200, help="slow-bodies: uploads dropped halfway, for the log")
    p.add_argument("--prompts", type=int, default=20, help="abandoned-prompts: prompts sent and dropped")
    p.add_argument("--chars", type=int, default=1_000_000, help="abandoned-prompts: characters of each")
    p.add_argument("--out", default=None, help="also write the JSON line here")
    args = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    result = slow_bodies(args) if args.attack == "slow-bodies" else abandoned_prompts(args)
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
