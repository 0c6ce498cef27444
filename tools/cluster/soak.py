"""Chaos soak of a fleet: replayed robots through a flaky link and HAProxy while replicas die and drain.

    python -m tools.cluster.soak [--replicas 3] [--robots 6] [--duration-s 90] [--cut-every-s 3]
                                 [--kill-every-s 12] [--down-s 4] [--out docs/cluster_soak]

Robots (asyncio, one connection each, light: they replay tools/traces like
tools/bench/loadgen.py) -> tools.cluster.netem proxy (the link, cut every --cut-every-s) ->
HAProxy -> replicas (server_bridge/ops/fleet.py). Every --kill-every-s the replica other than
r0 that holds the most robots is SIGKILLed, or every third time drained
(SIGTERM), and started again --down-s later. A robot that loses its link reconnects at once (a 1012 close from
a draining replica) or after 50 ms, re-opens its session with its committed
prefix on whichever replica the balancer picks, and goes on: a generation is
never abandoned.

Checked at the end: every generation's ids are the target's greedy ids (so
nothing was lost or duplicated across the disconnects), every generation started
was finished, and r0 (never killed) did not grow in memory past warm-up. The
recorded trace came from one-token passes; under load a session's rows come from
batched passes of other shapes, which round differently (tools/bench/divergence.py), so
a generation that leaves the trace is checked position by position against the
target run alone: each id must be its argmax there, or its runner-up within
tools.bench.loadgen.NEAR_TIE logits of it (a near-tie, counted). Anything else fails.
Writes cluster_soak.json and .md into --out (when given) and prints a summary line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from websockets.exceptions import ConnectionClosed, InvalidHandshake

from protocol import wire
from server_bridge.ops.fleet import Cluster, health
from server_bridge.ops.loadtest import LoadConfig, Robot, Trace, next_draft
from tools.bench.loadgen import NEAR_TIE, TRACES
from tools.cluster.netem import LinkProfile, NetemProxy

log = logging.getLogger(__name__)

RECOVERABLE = {"unknown_session", "desync", "overloaded"}


@dataclass
class SoakGeneration:
    robot: str
    prompt: int
    goal: int
    tokens: list[int] = field(default_factory=list)
    reopens: int = 0
    replicas: list[str] = field(default_factory=list)  # the replicas that served it, in order
    done: bool = False


@dataclass
class SoakLog:
    generations: list[SoakGeneration] = field(default_factory=list)
    disconnects: int = 0  # links a robot lost mid-run (cuts, kills, drains)
    restarts: int = 0  # of those, closed on purpose (1012: a replica draining)
    reconnect_ms: list[float] = field(default_factory=list)  # link lost -> the session re-opened
    errors: list[str] = field(default_factory=list)  # errors a robot saw (none expected)
    overloaded: int = 0  # opens and rounds the verifier refused as overloaded (retried: nothing lost)
    stale: int = 0  # replies for a round or session no longer waited for


class SoakRobot(Robot):
    """loadtest's robot, generations back to back; a lost link is reconnected and the session re-opened, never
    given up."""

    def __init__(
        self,
        name: str,
        url: str,
        trace: Trace,
        out: SoakLog,
        halt: asyncio.Event,
        gamma: int = 4,
        tokens: int = 48,
        draft_ms: float = 4.0,
        seed: int = 0,
    ):
        cfg = LoadConfig(gamma=gamma, draft_ms=draft_ms, tokens=tokens, recv_timeout_s=15.0, seed=seed)
        super().__init__(0, url, trace, cfg, out, halt)  # out: a SoakLog, with the stale count Robot keeps
        self.name = self.robot_id = name
        self.client = f"soak/{name}"
        self.gamma, self.tokens, self.draft_ms = gamma, tokens, draft_ms
        self.rng = random.Random(seed)
        self.replica = ""
        self.lost_at: float | None = None
        self.resume = ("", "")  # (sid, its resume secret from its last opened): a re-open on a new link takes it over

    async def run(self) -> None:
        g = 0
        while not self.halt.is_set():
            prompt_no = self.rng.randrange(len(self.trace.prompts))
            prompt = self.trace.prompts[prompt_no]
            gen = SoakGeneration(self.name, prompt_no, min(self.tokens, len(prompt.target_ids)))
            self.out.generations.append(gen)
            await self.generate(f"{self.name}-g{g}", prompt, gen)
            g += 1
        if self.ws is not None:
            await self.ws.close()

    async def generate(self, sid: str, prompt, gen: SoakGeneration) -> None:
        is_open = False
        rnd = 0
        while len(gen.tokens) < gen.goal:
            try:
                if self.ws is None:
                    await self.connect()
                if not is_open:
                    await self.open(sid, prompt, gen)
                    is_open = True
                draft = next_draft(prompt, gen.tokens, min(self.gamma, gen.goal - len(gen.tokens) - 1))
                await asyncio.sleep(len(draft) * self.draft_ms / 1e3)
                await self.send(
                    wire.Verify(sid, rnd, len(prompt.prompt_ids) + len(gen.tokens), draft, {"kind": "none"})
                )
                reply = await self.recv(wire.Result, sid, rnd)
                rnd += 1
                if isinstance(reply, wire.Error):
                    is_open = await self.recover(reply, gen)
                    continue
                gen.tokens += draft[: reply.accepted] + [reply.token]
                if reply.token in self.trace.eos_ids:
                    break
                if reply.n_committed != len(prompt.prompt_ids) + len(gen.tokens):
                    raise RuntimeError(
                        f"{sid}: the server has {reply.n_committed} committed, the robot "
                        f"{len(prompt.prompt_ids) + len(gen.tokens)}"
                    )
            except (ConnectionClosed, OSError, InvalidHandshake, TimeoutError) as e:
                self.lost(e)
                is_open = False
                restart = isinstance(e, ConnectionClosed) and e.rcvd is not None and e.rcvd.code == 1012
                await asyncio.sleep(0 if restart else 0.05)
        gen.tokens = gen.tokens[: gen.goal]
        gen.done = True
        try:
            if self.ws is not None:
                await self.send(wire.Close(sid))
        except ConnectionClosed:
            pass

    def lost(self, e: Exception) -> None:
        if self.ws is not None:  # a link that was up went down
            self.out.disconnects += 1
            self.out.restarts += isinstance(e, ConnectionClosed) and e.rcvd is not None and e.rcvd.code == 1012
            self.lost_at = time.monotonic() if self.lost_at is None else self.lost_at
        self.ws = None

    async def connect(self) -> None:
        self.ws = await self.dial(open_timeout=5)
        self.replica = (await self.handshake()).replica

    async def open(self, sid: str, prompt, gen: SoakGeneration) -> None:
        await self.send(
            wire.Open(
                sid,
                prompt.prompt_ids + gen.tokens,
                {"temperature": 0.0, "top_k": 0, "seed": 0},
                payload={"kind": "none", "k": 0},
                resume=self.resume[1] if self.resume[0] == sid else "",
            )
        )
        reply = await self.recv(wire.Opened, sid)
        if isinstance(reply, wire.Error):
            if reply.code == "overloaded":  # the verifier's admission control under load: retried, nothing lost
                self.out.overloaded += 1
                await asyncio.sleep(0.1)
            else:
                self.out.errors.append(f"{sid}: open refused: {reply.code}: {reply.message}")
            raise TimeoutError(f"open refused: {reply.code}")  # treated as a lost link: reconnect, retry
        self.resume = (sid, reply.resume)
        if not gen.replicas or gen.replicas[-1] != reply.replica:
            gen.replicas.append(reply.replica)
        if self.lost_at is not None:
            self.out.reconnect_ms.append((time.monotonic() - self.lost_at) * 1e3)
            self.lost_at = None

    async def recover(self, err: wire.Error, gen: SoakGeneration) -> bool:
        if err.code not in RECOVERABLE:
            self.out.errors.append(f"{gen.robot}: {err.code}: {err.message}")
        self.out.overloaded += err.code == "overloaded"
        gen.reopens += 1
        await asyncio.sleep(0.1 if err.code == "overloaded" else 0)
        return False  # re-open with the committed prefix


def judge(gens: list[SoakGeneration], trace: Trace) -> tuple[list[str], list[dict]]:
    """Per generation "exact" (the recorded ids), "near_tie" (off the record only where the target's top
    two are within NEAR_TIE, the target's own argmax everywhere else) or "inexact"; and the divergences."""
    from tools.logit_margin import top2

    verdicts, divergences, solo = [], [], None
    for g in gens:
        ref = trace.prompts[g.prompt].target_ids[: g.goal]
        if g.tokens == ref:
            verdicts.append("exact")
            continue
        at = next(
            (i for i, (a, b) in enumerate(zip(g.tokens, ref, strict=False)) if a != b), min(len(g.tokens), len(ref))
        )
        if solo is None:
            from server_bridge.target import load_target

            solo = load_target(trace.target, threads=1, max_sequences=2, kv_tokens=4096)
        prompt = trace.prompts[g.prompt].prompt_ids
        rows = solo.score(solo.new_state(prompt + g.tokens[:at]), g.tokens[at:])  # [len - at + 1, vocab]
        verdict, ties = "near_tie", []
        for j, tok in enumerate(g.tokens[at:]):
            best, second, _, margin = top2(rows[j].astype("float64"))
            if tok == best:
                continue
            if tok == second and margin <= NEAR_TIE:
                ties.append({"at": at + j, "id": tok, "argmax": best, "margin": round(margin, 5)})
            else:
                verdict = "inexact"
                ties.append({"at": at + j, "id": tok, "argmax": best, "margin": round(margin, 5), "tie": False})
                break
        verdicts.append(verdict)
        divergences.append({"robot": g.robot, "prompt": g.prompt, "verdict": verdict, "positions": ties})
    return verdicts, divergences


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def serving(cluster: Cluster, name: str, timeout_s: float = 120.0) -> None:
    """Wait, without blocking the robots, until a restarted replica answers /healthz and HAProxy routes to it."""
    loop = asyncio.get_running_loop()
    replica = cluster.replica(name)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not replica.alive:
            raise RuntimeError(f"replica {name} exited while starting:\n{replica.log_tail()}")
        try:
            up = (await loop.run_in_executor(None, health, replica.port))[0] == 200
        except OSError:
            up = False
        if up and (await loop.run_in_executor(None, cluster.lb_stats)).get(name, {}).get("status") == "UP":
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"replica {name} did not come back in {timeout_s:.0f}s")


async def soak(cluster: Cluster, proxy: NetemProxy, trace: Trace, args) -> dict:
    out = SoakLog()
    halt = asyncio.Event()
    robots = [
        SoakRobot(f"soak-{i}", proxy.url("ws"), trace, out, halt, seed=args.seed + i, tokens=args.tokens)
        for i in range(args.robots)
    ]
    tasks = [asyncio.create_task(r.run()) for r in robots]
    loop = asyncio.get_running_loop()
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    pid0 = cluster.replica("r0").proc.pid
    faults = []
    cuts = 0
    next_cut, next_kill, n_kill = t0 + args.cut_every_s, t0 + args.kill_every_s, 0
    rss = {}
    down = None  # (replica, when to start it again)
    while time.monotonic() - t0 < args.duration_s:
        await asyncio.sleep(0.1)
        now = time.monotonic()
        if "warm" not in rss and now - t0 > args.warmup_s:
            rss["warm"] = rss_mb(pid0)
        if now >= next_cut:
            cuts += 1
            await loop.run_in_executor(None, proxy.disconnect_all)
            next_cut = now + args.cut_every_s
        if now >= next_kill and args.replicas > 1:
            # the replica (not r0) holding the most robots now, so every fault moves someone
            held = await loop.run_in_executor(None, cluster.lb_stats)
            victim = max(
                (r.name for r in cluster.replicas[1:]),
                key=lambda name: (held.get(name, {}).get("scur", 0), rng.random()),
            )
            how = "drain" if n_kill % 3 == 2 else "kill"
            n_kill += 1
            faults.append({"t_s": round(now - t0, 1), "replica": victim, "fault": how})
            print(
                f"[{now - t0:5.1f}s] {how} {victim}; {out.disconnects} disconnects, "
                f"{sum(g.done for g in out.generations)} generations done",
                flush=True,
            )
            # children are started from this (the main) thread only: they die with it (ops.fleet.child_setup)
            if how == "kill":
                cluster.kill(victim)
            else:
                cluster.drain(victim, wait=False)
            down = (victim, time.monotonic() + args.down_s)
            next_kill = float("inf")
        if down is not None and now >= down[1] and not cluster.replica(down[0]).alive:
            cluster.restart(down[0], wait=False)  # back up; the next fault counts from when it serves
            await serving(cluster, down[0])
            down = None
            next_kill = time.monotonic() + args.kill_every_s
    if down is not None:
        if cluster.replica(down[0]).alive:
            cluster.replica(down[0]).proc.wait(30)  # a drain still finishing
        cluster.restart(down[0], wait=False)
        await serving(cluster, down[0])
    halt.set()
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)  # each robot finishes its generation
    rss["end"] = rss_mb(pid0)
    verdicts, divergences = judge(out.generations, trace)
    ms = sorted(out.reconnect_ms)
    return {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "wall_s": round(time.monotonic() - t0, 1),
        "generations": len(out.generations),
        "finished": sum(g.done for g in out.generations),
        "exact": verdicts.count("exact"),
        "near_tie": verdicts.count("near_tie"),
        "inexact": verdicts.count("inexact"),
        "divergences": divergences[:20],
        "tokens": sum(len(g.tokens) for g in out.generations),
        "disconnects": out.disconnects,
        "restarts_1012": out.restarts,
        "link_cuts": cuts,
        "faults": faults,
        "moved_generations": sum(len(set(g.replicas)) > 1 for g in out.generations),
        "reconnect_ms": {
            "n": len(ms),
            "median": ms[len(ms) // 2] if ms else None,
            "p99": ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else None,
        },
        "r0_rss_mb": {k: round(v, 1) for k, v in rss.items()},
        "errors": out.errors[:20],
        "overloaded": out.overloaded,
        "r0_health": health(cluster.replica("r0").port)[1],
    }


def render_markdown(r: dict) -> str:
    rc = r["reconnect_ms"]
    return "\n".join(
        [
            "# Chaos soak: robots through a flaky link and HAProxy while replicas die and drain",
            "",
            f"`python -m tools.cluster.soak --replicas {r['config']['replicas']} --robots {r['config']['robots']} "
            f"--duration-s {r['config']['duration_s']:g}`: {r['wall_s']} s, pair {r['config']['trace']}, T = 0.",
            "",
            "| generations | finished | exact | near-tie | inexact | tokens | disconnects | of them 1012 | link cuts | "
            "replica faults | "
            "moved | reconnect median ms | p99 | r0 RSS MB (warm -> end) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            f"| {r['generations']} | {r['finished']} | {r['exact']} | {r['near_tie']} | {r['inexact']} | "
            f"{r['tokens']} | {r['disconnects']} | "
            f"{r['restarts_1012']} | {r['link_cuts']} | {len(r['faults'])} | {r['moved_generations']} | "
            f"{rc['median'] and round(rc['median'])} | {rc['p99'] and round(rc['p99'])} | "
            f"{r['r0_rss_mb'].get('warm')} -> {r['r0_rss_mb'].get('end')} |",
            "",
            "Faults: " + ", ".join(f"{f['fault']} {f['replica']} at {f['t_s']} s" for f in r["faults"]) + ".",
            "",
            f"Near-tie: the generation left the recorded ids only where the target's top two logits are within "
            f"{NEAR_TIE} (batched passes round differently from the one-token passes that recorded the trace), and "
            f"is the target's argmax everywhere else. Divergences: {r['divergences']}",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--robots", type=int, default=6)
    ap.add_argument("--duration-s", type=float, default=90.0)
    ap.add_argument("--warmup-s", type=float, default=10.0, help="r0's memory is measured from here to the end")
    ap.add_argument("--cut-every-s", type=float, default=3.0, help="the link drops every robot's connection")
    ap.add_argument("--kill-every-s", type=float, default=12.0, help="a replica other than r0 is killed or drained")
    ap.add_argument("--down-s", type=float, default=4.0, help="how long it stays down")
    ap.add_argument("--tokens", type=int, default=48, help="tokens a generation")
    ap.add_argument("--trace", default="smollm2-q4_1__smollm2-f32")
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--haproxy")
    ap.add_argument("--out", help="directory for cluster_soak.json and .md")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    trace = Trace.load(TRACES / f"{args.trace}.json")
    with (
        Cluster(
            args.replicas,
            haproxy=args.haproxy,
            target=trace.target,
            server_args=["--detached-grace-s", "30", "--drain-timeout-s", "10"],
        ) as cluster,
        NetemProxy("127.0.0.1", cluster.lb_port, LinkProfile.from_rtt(args.rtt_ms)) as proxy,
    ):
        result = asyncio.run(soak(cluster, proxy, trace, args))
    print(
        json.dumps(
            {
                k: result[k]
                for k in (
                    "generations",
                    "finished",
                    "exact",
                    "near_tie",
                    "inexact",
                    "disconnects",
                    "restarts_1012",
                    "reconnect_ms",
                    "r0_rss_mb",
                    "errors",
                )
            }
        )
    )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "cluster_soak.json").write_text(json.dumps(result, indent=1))
        (out / "cluster_soak.md").write_text(render_markdown(result))
    ok = result["finished"] == result["generations"] and result["inexact"] == 0 and not result["errors"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
