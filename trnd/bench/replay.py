"""Replays agent sessions (bench/sessions.py) against any OpenAI-compatible server and reports AgentX's columns.

Every session runs as its own client: turn after turn, after each answer it waits its think time, then
sends the next prompt (the whole conversation so far) as a streamed /v1/completions request with its
`session_id` and `prompt_cache_key`, greedy, `ignore_eos`, `max_tokens` = the recorded answer's length.
All sessions run at once (N concurrent agents), or `concurrency` at a time.

A 503 is overload by contract (Retry-After): the client waits that long and sends the same turn again,
counted as a retry, never as a failure. Every request and token is counted and checked: a turn that did
not get all of its answer's tokens, or whose prompt the server counted otherwise, is a problem row.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import httpx

from trnd.bench.sessions import Session

MAX_RETRIES = 20  # 503s answered for one turn before the replay gives up on it


@dataclass
class TurnResult:
    sid: str
    turn: int
    prompt: int  # tokens sent
    max_tokens: int
    prompt_counted: int = 0  # usage.prompt_tokens
    cached: int = 0  # usage.prompt_tokens_details.cached_tokens
    output: int = 0  # usage.completion_tokens
    ttft_s: float | None = None
    decode_tps: float | None = None  # (output - 1) / (last token - first token)
    e2e_s: float = 0.0
    retries: int = 0
    error: str | None = None


@dataclass
class Replay:
    rows: list[TurnResult] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict:
        ok = [r for r in self.rows if r.error is None]
        minutes = self.wall_s / 60 if self.wall_s else float("nan")
        cold = [r.ttft_s for r in ok if r.turn == 0 and r.ttft_s is not None]
        warm = [r.ttft_s for r in ok if r.turn > 0 and r.ttft_s is not None]
        tps = [r.decode_tps for r in ok if r.decode_tps is not None]
        prompt = sum(r.prompt_counted for r in ok)
        return {
            "requests": len(self.rows), "completed": len(ok), "failed": len(self.rows) - len(ok),
            "retries_503": sum(r.retries for r in self.rows),
            "prompt_tokens": prompt, "cached_tokens": sum(r.cached for r in ok),
            "output_tokens": sum(r.output for r in ok), "wall_s": round(self.wall_s, 2),
            "requests_per_min": len(ok) / minutes,
            "tokens_per_min": (prompt + sum(r.output for r in ok)) / minutes,
            "decode_tps_user_p50": statistics.median(tps) if tps else None,
            "ttft_cached_p50_s": statistics.median(warm) if warm else None,
            "ttft_cold_p50_s": statistics.median(cold) if cold else None,
            "cached_share": sum(r.cached for r in ok) / prompt if prompt else 0.0,
        }

    def problems(self) -> list[str]:
        out = []
        for r in self.rows:
            if r.error is not None:
                out.append(f"{r.sid} turn {r.turn}: {r.error}")
            elif r.output != r.max_tokens:
                out.append(f"{r.sid} turn {r.turn}: {r.output} of {r.max_tokens} tokens generated")
            elif r.prompt_counted != r.prompt:
                out.append(f"{r.sid} turn {r.turn}: server counted {r.prompt_counted} prompt tokens of {r.prompt}")
        return out


async def one_turn(client: httpx.AsyncClient, url: str, model: str, s: Session, t: int,
                   headers: dict[str, str]) -> TurnResult:
    prompt = s.prompt(t)
    res = TurnResult(s.sid, t, len(prompt), len(s.turns[t].answer))
    body = {"model": model, "prompt": prompt, "max_tokens": res.max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0, "session_id": s.sid, "prompt_cache_key": s.sid,
            "stream_options": {"include_usage": True}}
    while True:
        t0 = time.perf_counter()
        first = last = None
        usage = None
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=1800) as r:
            if r.status_code == 503 and res.retries < MAX_RETRIES:
                await r.aread()
                res.retries += 1
                await asyncio.sleep(float(r.headers.get("retry-after") or 1))
                continue
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):  # a server that fails a request mid-stream says so in an event
                    res.error = f"stream error: {str(chunk['error'])[:200]}"
                    return res
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    last = time.perf_counter()
                    first = first or last
                usage = chunk.get("usage") or usage
        break
    res.e2e_s = time.perf_counter() - t0
    if first is None or usage is None:
        res.error = "no token or no usage in the stream"
        return res
    res.ttft_s = first - t0
    res.prompt_counted = usage.get("prompt_tokens") or 0
    res.output = usage.get("completion_tokens") or 0
    res.cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    if res.output > 1 and last > first:
        res.decode_tps = (res.output - 1) / (last - first)
    return res


async def replay(url: str, model: str, sessions: list[Session], concurrency: int | None = None,
                 api_key: str | None = None, think: bool = True) -> Replay:
    """Every session's turns in order, `concurrency` sessions at a time (None: all at once)."""
    out = Replay()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(concurrency or len(sessions))
    limits = httpx.Limits(max_connections=len(sessions) + 4, max_keepalive_connections=len(sessions) + 4)

    async with httpx.AsyncClient(limits=limits) as client:
        async def run(s: Session) -> None:
            async with sem:
                for t, turn in enumerate(s.turns):
                    if think and turn.think_s:
                        await asyncio.sleep(turn.think_s)
                    res = await one_turn(client, url, model, s, t, headers)
                    out.rows.append(res)
                    if res.error is not None:
                        return  # the rest of this session builds on a turn that failed

        t0 = time.perf_counter()
        await asyncio.gather(*(run(s) for s in sessions))
        out.wall_s = time.perf_counter() - t0
    return out


async def model_name(url: str, api_key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient() as client:
        r = await client.get(url + "/v1/models", headers=headers, timeout=30)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
