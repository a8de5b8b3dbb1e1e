"""Trajectory API benchmark: ingest throughput and latency with a trainer draining, and memory.

    PYTHONPATH=src python bench/bench_api.py                      # quick: 2,000 posts, 10,000 queued
    PYTHONPATH=src python bench/bench_api.py --queued 100000      # the full memory measurement
    PYTHONPATH=src python bench/bench_api.py --atropos-path DIR   # same run against Atropos' server
    PYTHONPATH=src python bench/bench_api.py --stall --posts 200 --skip-memory   # stalls from one post
    PYTHONPATH=src python bench/bench_api.py --baseline 82a3919 --skip-memory     # against an earlier commit
    PYTHONPATH=src python bench/bench_api.py --repeat 3 --skip-memory ...         # medians of interleaved runs

Each post is one group of 16 sequences x 300 tokens (tokens, masks, scores, and by default
inference_logprobs and per-episode metadata, as `serve` sends them), gzip-compressed as
atroposlib and our EnvClient send it, with an Idempotency-Key. While the posts run, a trainer
pulls batches of 16 groups as fast as it can. The server runs as its own process (uvicorn,
one worker), so its resident memory is measured alone.

The baseline is Atropos 0.4.0's in-memory server run by the same script in the same run:
pass a directory holding an unpacked `atroposlib` (e.g. `pip download atroposlib==0.4.0
--no-deps` and unzip the wheel); it is not a dependency of this project.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]


def make_group(rng: random.Random, n: int, length: int, logprobs: bool) -> dict[str, Any]:
    prompt = length * 2 // 3  # a shared prompt, then the model's turns
    head = [rng.randrange(49152) for _ in range(prompt)]
    tokens, masks, lps = [], [], []
    for _ in range(n):
        seq = head + [rng.randrange(49152) for _ in range(length - prompt)]
        tokens.append(seq)
        masks.append([-100] * prompt + seq[prompt:])
        lps.append([1.0] * prompt + [-rng.random() * 4 for _ in range(length - prompt)])
    group: dict[str, Any] = {
        "tokens": tokens,
        "masks": masks,
        "scores": [rng.choice([1.0, 0.0, -1.0]) for _ in range(n)],
        "advantages": [],
        "ref_logprobs": [],
        "messages": [],
        "group_overrides": {},
        "overrides": [],
        "images": [],
        "env_id": 0,
        "episodes": [{"seed": 1234, "index": i, "outcome": "win", "actions": ["hit", "stick"]} for i in range(n)],
    }
    if logprobs:
        group["inference_logprobs"] = lps
    return group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_s(pid: int) -> tuple[float, float]:
    """User + system CPU seconds of a process, and of its living children (ingest workers) (Linux)."""
    own = children = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(stat.parent.name) == pid:
            own += int(fields[11]) + int(fields[12])
        elif int(fields[1]) == pid:
            children += int(fields[11]) + int(fields[12])
    tick = os.sysconf("SC_CLK_TCK")
    return own / tick, children / tick


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class Server:
    kind: str  # "ours", "baseline" (ours at an earlier commit) or "atropos"
    proc: subprocess.Popen[bytes]
    url: str
    db: Path | None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_server(kind: str, workdir: Path, args: argparse.Namespace) -> Server:
    port = free_port()
    env = dict(os.environ)
    db = None
    if kind != "atropos":
        db = workdir / f"bench-{port}.sqlite"
        src = args.baseline_src if kind == "baseline" else ROOT / "src"
        env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")])
        env.pop("BLACKJACK_RL_API_TOKEN", None)
        cmd = [sys.executable, "-m", "blackjack_rl.api", "--port", str(port), "--db", str(db),
               "--max-queued-sequences", str(10**9), "--log-level", "warning", "--sync", args.sync]
        if args.ingest_workers is not None:
            cmd += ["--ingest-workers", str(args.ingest_workers)]
    else:
        env["PYTHONPATH"] = os.pathsep.join([str(args.atropos_path), env.get("PYTHONPATH", "")])
        cmd = [sys.executable, "-m", "uvicorn", "atroposlib.api.server:app", "--port", str(port),
               "--log-level", "warning", "--no-access-log"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/status", timeout=1)
            return Server(kind, proc, url, db)
        except httpx.TransportError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{kind} server did not start")


def setup_run(server: Server, group_size: int, groups_per_batch: int) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        http.post("/register", json={
            "wandb_group": "bench", "wandb_project": "bench", "batch_size": group_size * groups_per_batch,
            "max_token_len": 4096, "checkpoint_dir": "", "save_checkpoint_interval": -1,
            "starting_step": 0, "num_steps": -1,
        }).raise_for_status()
        http.get("/batch").raise_for_status()
        reg = http.post("/register-env", json={"max_token_length": 4096, "desired_name": "bench", "weight": 1.0,
                                               "group_size": group_size, "min_batch_allocation": None}).json()
        assert reg["env_id"] == 0, reg


class RawHttp:
    """A minimal keep-alive HTTP/1.1 client, so the load generator costs the server little CPU.

    (httpx spends ~2 ms of CPU per 24 KiB post here; on a small machine that would be
    measured as the server's slowness.)
    """

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        head = f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Length: {len(body)}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        self.writer.write(head.encode() + body)
        status_line = await self.reader.readline()
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        return int(status_line.split()[1]), await self.reader.readexactly(length)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def post_many(url: str, bodies: list[bytes], count: int, concurrency: int, kind: str) -> list[float]:
    """POST `count` bodies with `concurrency` requests in flight; returns each latency (s)."""
    latencies: list[float] = []
    todo = iter(range(count))

    async def worker() -> None:
        http = RawHttp(url)
        try:
            for i in todo:
                headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
                if kind != "atropos":
                    headers["Idempotency-Key"] = uuid.uuid4().hex
                t0 = time.perf_counter()
                status, text = await http.post("/scored_data_list", bodies[i % len(bodies)], headers)
                latencies.append(time.perf_counter() - t0)
                if status != 200:
                    raise RuntimeError(f"post failed: {status} {text[:300]!r}")
        finally:
            http.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


class Drainer(threading.Thread):
    """A trainer pulling batches as fast as it can (reads each batch fully, ignores its content).

    Raw keep-alive HTTP on a socket: a real trainer's parsing is the trainer's cost, not the API's.
    """

    def __init__(self, server: Server) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.batches = 0
        self.bytes = 0
        self.stop = threading.Event()

    def _get(self, sock: socket.socket, reader: Any, path: str) -> bytes:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
        reader.readline()
        length = 0
        while (line := reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        return bytes(reader.read(length))

    def run(self) -> None:
        ack = 0
        host, port = self.server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock, sock.makefile("rb") as reader:
            while not self.stop.is_set():
                path = f"/batch?ack={ack}" if self.server.kind != "atropos" else "/batch"
                body = self._get(sock, reader, path)
                if body.startswith(b'{"batch":null'):
                    time.sleep(0.005)
                    continue
                self.batches += 1
                self.bytes += len(body)
                if self.server.kind != "atropos":
                    tail = body[body.rindex(b'"batch_id":') + 11:]
                    ack = int(tail[: tail.index(b",")])


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def throughput(kind: str, workdir: Path, bodies: list[bytes], args: argparse.Namespace) -> dict[str, float]:
    server = start_server(kind, workdir, args)
    try:
        setup_run(server, args.seqs, args.groups_per_batch)
        asyncio.run(post_many(server.url, bodies, args.warmup, args.concurrency, kind))
        drainer = Drainer(server)
        drainer.start()
        load_before = os.getloadavg()[0]
        t0, cpu0, own0 = time.perf_counter(), cpu_s(server.proc.pid), time.process_time()
        latencies = asyncio.run(post_many(server.url, bodies, args.posts, args.concurrency, kind))
        elapsed = time.perf_counter() - t0
        cpu1 = cpu_s(server.proc.pid)
        server_cpu, worker_cpu = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
        client_cpu = time.process_time() - own0
        drainer.stop.set()
        drainer.join(timeout=30)
        return {
            "posts_per_s": args.posts / elapsed,
            "p50_ms": statistics.median(latencies) * 1e3,
            "p99_ms": pct(latencies, 0.99) * 1e3,
            "drained_groups_per_s": drainer.batches * args.groups_per_batch / elapsed,
            "rss_mb": rss_mb(server.proc.pid),
            "server_cpu_ms": (server_cpu + worker_cpu) / args.posts * 1e3,
            "server_process_cpu_ms": server_cpu / args.posts * 1e3,
            "worker_cpu_ms": worker_cpu / args.posts * 1e3,
            "client_cpu_ms": client_cpu / args.posts * 1e3,
            "load_before": load_before,
            "load_after": os.getloadavg()[0],
        }
    finally:
        server.stop()


def memory(kind: str, workdir: Path, bodies: list[bytes], queued: int, args: argparse.Namespace) -> dict[str, Any]:
    server = start_server(kind, workdir, args)
    try:
        setup_run(server, args.seqs, args.groups_per_batch)
        start = rss_mb(server.proc.pid)
        samples = [(0, start)]
        done = 0
        step = max(1, queued // 10)
        t0 = time.perf_counter()
        while done < queued:
            n = min(step, queued - done)
            asyncio.run(post_many(server.url, bodies, n, args.concurrency, kind))
            done += n
            samples.append((done, rss_mb(server.proc.pid)))
            print(f"  {kind}: {done:>7} groups queued, server RSS {samples[-1][1]:7.1f} MB "
                  f"({time.perf_counter() - t0:5.0f} s)", flush=True)
        status = httpx.get(f"{server.url}/status", timeout=30).json()
        assert status["queue_size"] == queued, status
        disk = sum(p.stat().st_size for p in workdir.glob(f"{server.db.name}*")) / 2**20 if server.db else 0.0
        return {"start_mb": start, "end_mb": samples[-1][1], "samples": samples, "disk_mb": disk,
                "kb_per_group": (samples[-1][1] - start) * 1024 / queued}
    finally:
        server.stop()


def stall(kind: str, workdir: Path, body: bytes, headers: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """How long other requests wait while the server handles one hostile or huge post.

    One thread posts `body`; meanwhile GET /status is asked every 20 ms, and the longest of
    those waits is what every other client of the server would have suffered.
    """
    server = start_server(kind, workdir, args)
    try:
        setup_run(server, args.seqs, args.groups_per_batch)
        answer: dict[str, Any] = {}

        def post() -> None:
            started = time.perf_counter()
            with httpx.Client(timeout=600) as http:
                r = http.post(f"{server.url}/scored_data_list", content=body, headers=headers)
            answer.update(status=r.status_code, post_s=time.perf_counter() - started)

        worker = threading.Thread(target=post)
        longest = 0.0
        with httpx.Client(base_url=server.url, timeout=600) as http:
            http.get("/status")
            worker.start()
            while worker.is_alive():
                started = time.perf_counter()
                http.get("/status")
                longest = max(longest, time.perf_counter() - started)
                time.sleep(0.02)
        worker.join()
        return {**answer, "longest_status_ms": longest * 1000}
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--posts", type=int, default=2000, help="timed posts (one group each)")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=8, help="posts in flight")
    parser.add_argument("--queued", type=int, default=10_000, help="groups queued for the memory measurement")
    parser.add_argument("--seqs", type=int, default=16, help="sequences per group")
    parser.add_argument("--tokens", type=int, default=300, help="tokens per sequence")
    parser.add_argument("--groups-per-batch", type=int, default=16)
    parser.add_argument("--no-logprobs", action="store_true", help="leave inference_logprobs out of the groups")
    parser.add_argument("--sync", choices=["NORMAL", "FULL"], default="FULL")
    parser.add_argument("--ingest-workers", type=int, help="server's --ingest-workers (default: its own)")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--repeat", type=int, default=1,
                        help="throughput runs per server, interleaved; medians are reported and compared")
    parser.add_argument("--stall", action="store_true",
                        help="also measure how long other requests wait during one hostile or huge post")
    parser.add_argument("--atropos-path", type=Path, help="directory holding an unpacked atroposlib (baseline)")
    parser.add_argument("--atropos-queued", type=int, default=2000,
                        help="groups queued in Atropos' memory measurement (it holds them all in RAM)")
    parser.add_argument("--workdir", type=Path, help="where the SQLite files go (default: a temp dir)")
    parser.add_argument("--baseline", metavar="REV", help="also run this project's API at an earlier commit")
    args = parser.parse_args(argv)
    args.baseline_src = None
    if args.baseline:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import baseline

        args.baseline_src = baseline.unpack(args.baseline)

    rng = random.Random(0)
    groups = [make_group(rng, args.seqs, args.tokens, not args.no_logprobs) for _ in range(16)]
    bodies = [gzip.compress(json.dumps([g]).encode(), compresslevel=1) for g in groups]
    raw = len(json.dumps(groups[0]))
    print(f"group: {args.seqs} x {args.tokens} tokens, logprobs={'no' if args.no_logprobs else 'yes'}: "
          f"{raw / 1024:.0f} KiB JSON, {len(bodies[0]) / 1024:.0f} KiB gzip | sync={args.sync} | "
          f"concurrency {args.concurrency} | ingest workers {'default' if args.ingest_workers is None else args.ingest_workers} | {os.cpu_count()} CPUs | "
          f"load average {os.getloadavg()[0]:.2f}")
    kinds = ["ours"] + (["baseline"] if args.baseline else []) + (["atropos"] if args.atropos_path else [])
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-api-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    try:
        runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
        for round_ in range(args.repeat):  # interleaved, so a change in the machine's load hits every kind alike
            for kind in kinds:
                label = f" (round {round_ + 1} of {args.repeat})" if args.repeat > 1 else ""
                print(f"\n[{kind}] ingest with a trainer draining: {args.posts} posts{label}")
                r = throughput(kind, workdir, bodies, args)
                runs[kind].append(r)
                print(f"  {r['posts_per_s']:8.0f} posts/s  ({r['posts_per_s'] * args.seqs:,.0f} sequences/s)   "
                      f"p50 {r['p50_ms']:6.1f} ms   p99 {r['p99_ms']:6.1f} ms   "
                      f"trainer drained {r['drained_groups_per_s']:6.0f} groups/s   server RSS {r['rss_mb']:.0f} MB   "
                      f"(load average {r['load_before']:.2f} before, {r['load_after']:.2f} after)")
                print(f"  CPU per post: server {r['server_cpu_ms']:.2f} ms (its process {r['server_process_cpu_ms']:.2f}, "
                      f"worker processes {r['worker_cpu_ms']:.2f}), load generator and trainer {r['client_cpu_ms']:.2f} ms")
        for kind in kinds:
            results[kind] = {key: statistics.median(r[key] for r in runs[kind]) for key in runs[kind][0]}
            if args.repeat > 1:
                r = results[kind]
                each = ", ".join(f"{x['posts_per_s']:.0f}" for x in runs[kind])
                print(f"\n[{kind}] median of {args.repeat}: {r['posts_per_s']:.0f} posts/s, p50 {r['p50_ms']:.1f} ms, "
                      f"p99 {r['p99_ms']:.1f} ms, server CPU {r['server_cpu_ms']:.2f} ms per post (each run: {each} posts/s)")
        if args.stall:
            members = gzip.compress(b"") * 100_000
            big = json.dumps([groups[0]] * max(1, (15 * 1024 * 1024) // raw)).encode()
            cases = [("100,000 empty gzip members (2 MB)", members, {"Content-Encoding": "gzip"}),
                     (f"{len(big) / 2**20:.0f} MB plain JSON list of groups", big, {})]
            for kind in kinds:
                for label, body, extra in cases:
                    r = stall(kind, workdir, body, {"Content-Type": "application/json", **extra}, args)
                    print(f"\n[{kind}] one post of {label}: answered {r['status']} after {r['post_s']:.2f} s; "
                          f"longest wait of another request meanwhile {r['longest_status_ms']:.0f} ms")
        if not args.skip_memory:
            for kind in kinds:
                queued = args.queued if kind != "atropos" else min(args.queued, args.atropos_queued)
                print(f"\n[{kind}] memory with {queued:,} groups queued (no trainer draining)")
                m = memory(kind, workdir, bodies, queued, args)
                results[kind]["memory"] = m
                print(f"  server RSS {m['start_mb']:.0f} MB empty -> {m['end_mb']:.0f} MB with {queued:,} groups "
                      f"({m['kb_per_group']:.2f} KB per group); on disk {m['disk_mb']:.0f} MB")
        if "baseline" in results:
            print(f"\ningest throughput, ours / ours at {args.baseline}: "
                  f"x{results['ours']['posts_per_s'] / results['baseline']['posts_per_s']:.2f}")
        if "atropos" in results:
            ours, base = results["ours"], results["atropos"]
            print("\nratios (ours / Atropos 0.4.0, same machine, same run):")
            print(f"  ingest throughput  x{ours['posts_per_s'] / base['posts_per_s']:.2f}")
            print(f"  p99 latency        x{ours['p99_ms'] / base['p99_ms']:.2f}")
            if "memory" in ours and "memory" in base:
                print(f"  memory per group   x{ours['memory']['kb_per_group'] / base['memory']['kb_per_group']:.4f}")
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
        if args.baseline_src is not None:
            shutil.rmtree(args.baseline_src.parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
