"""Workload generation and the streaming client: requests to /v1/completions,
sent open-loop (Poisson or gamma arrivals) or closed-loop (a concurrency cap)."""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass

import aiohttp

from .metrics import RequestRecord

# Words for text prompts (--prompt-kind text): one word is about one token of a
# small vocabulary; the server's usage.prompt_tokens gives the real count.
WORDS = ("once upon a time there was a little girl named lily she liked to play in the park with her "
         "friend tom one day they saw a big red ball and ran to get it the sun was warm and happy").split()


@dataclass
class Prompt:
    prompt: object  # a list of token ids or a string
    input_len: int
    output_len: int


def lengths(rng: random.Random, mean: int, range_ratio: float) -> int:
    """A length uniform in [mean * (1 - r), mean * (1 + r)] (vLLM's random dataset); mean when r = 0."""
    lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return rng.randint(lo, hi)


def make_prompts(n: int, input_len: int, output_len: int, range_ratio: float, seed: int, kind: str,
                 vocab_size: int) -> list:
    """n seeded prompts. Token ids are drawn from [3, vocab_size): 0-2 are llama2.c's unk, BOS and EOS."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        il, ol = lengths(rng, input_len, range_ratio), lengths(rng, output_len, range_ratio)
        if kind == "tokens":
            prompt = [rng.randrange(3, vocab_size) for _ in range(il)]
        else:
            prompt = " ".join(rng.choice(WORDS) for _ in range(il))
        out.append(Prompt(prompt, il, ol))
    return out


def shared_prefix_prompts(groups: int, per_group: int, prefix_len: int, suffix_len: int, output_len: int,
                          seed: int, vocab_size: int) -> list:
    """groups x per_group token prompts: each group's requests share a prefix of prefix_len tokens
    (a system prompt) and differ in a suffix of suffix_len; interleaved (group 0, 1, ..., 0, 1, ...)
    so that the groups compete for the workers."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab_size) for _ in range(prefix_len)] for _ in range(groups)]
    out = []
    for _ in range(per_group):
        for g in range(groups):
            suffix = [rng.randrange(3, vocab_size) for _ in range(suffix_len)]
            out.append(Prompt(prefixes[g] + suffix, prefix_len + suffix_len, output_len))
    return out


@dataclass
class Conversation:
    system: object    # the system prompt every turn starts with: words, or token ids
    users: list       # the user's words (or token ids) of each turn
    output_len: int   # max_tokens of each turn


def conversations(n: int, turns: int, system_len: int, user_len: int, output_len: int, seed: int,
                  history: str = "text", vocab_size: int = 512) -> list:
    """n seeded conversations of `turns` turns: a system prompt of system_len words, then per turn
    user_len new words. history "text": a turn's prompt is the history with the server's answers in
    it, and only the server's tokenizer turns those back into tokens (as a chat client's); "tokens":
    the prompt is token ids (system_len and user_len of them, drawn from [3, vocab_size)) with the
    answers' own ids in it (return_token_ids), so every token resent is one the server saw."""
    rng = random.Random(seed)
    if history == "tokens":
        part = lambda k: [rng.randrange(3, vocab_size) for _ in range(k)]  # noqa: E731
    else:
        part = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    return [Conversation(part(system_len), [part(user_len) for _ in range(turns)], output_len) for _ in range(n)]


async def run_conversations(session, url: str, model: str, convs: list, max_concurrency, temperature: float,
                            seed: int, label: str = ""):
    """Every conversation at once (at most max_concurrency in flight), each turn sent when the
    previous one has answered; turn t's prompt is the system prompt, then each earlier turn's user
    words and answer, then turn t's words (the history a chat client resends). Returns (records
    in conversation, turn order; wall time in s)."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    progress = Progress(sum(len(c.users) for c in convs), label)

    async def converse(k: int, c: Conversation) -> list:
        tokens = isinstance(c.system, list)
        history, records = (list(c.system) if tokens else c.system), []
        for t, user in enumerate(c.users):
            history = history + user if tokens else history + " " + user
            body = payload(model, Prompt(list(history) if tokens else history, 0, c.output_len), temperature,
                           seed + 1000 * k + t)
            if tokens:
                body["return_token_ids"] = True
            if limit is None:
                rec = await send(session, url, body, 0)
            else:
                async with limit:
                    rec = await send(session, url, body, 0)
            rec.turn = t + 1
            records.append(rec)
            progress.step()
            if rec.error is not None:
                break  # a conversation whose turn failed ends there
            if tokens and len(rec.token_ids) != rec.output_tokens:
                rec.error = "token_ids_missing"  # (a server without return_token_ids)
                break
            history = history + rec.token_ids if tokens else history + rec.text
        return records

    start = time.perf_counter()
    per_conversation = await asyncio.gather(*(converse(k, c) for k, c in enumerate(convs)))
    return [r for rs in per_conversation for r in rs], time.perf_counter() - start


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list:
    """Delays before requests 2..n (the first goes at once): gamma with shape = burstiness and
    mean 1/rate (burstiness 1 = Poisson arrivals), as vLLM's get_request; all 0 for rate inf."""
    if math.isinf(rate):
        return [0.0] * max(0, n - 1)
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(max(0, n - 1))]


async def error_code(resp: aiohttp.ClientResponse) -> str:
    """"STATUS code" from an OpenAI error body ({"error": {"code": ...}}), else "STATUS"."""
    try:
        body = await resp.json(content_type=None)
        code = body.get("error", {}).get("code") if isinstance(body, dict) else None
    except (ValueError, aiohttp.ClientError):
        code = None
    return f"{resp.status} {code}" if code else str(resp.status)


async def send(session: aiohttp.ClientSession, url: str, payload: dict, prompt_len: int) -> RequestRecord:
    """One streamed completion. Server-sent events are read as vLLM's client does: one
    `data: ` line per event, JSON through the json module, until `data: [DONE]`."""
    rec = RequestRecord(send_time=time.perf_counter(), prompt_tokens=prompt_len)
    usage_tokens = None
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                rec.error = await error_code(resp)
            else:
                done = False
                async for raw in resp.content:
                    now = time.perf_counter()
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[len(b"data:"):].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if event.get("error"):
                        rec.error = f"stream {event['error'].get('code') or 'error'}"
                        break
                    if event.get("choices"):
                        rec.chunk_times.append(now)
                        rec.text += event["choices"][0].get("text") or ""
                        rec.token_ids += event["choices"][0].get("token_ids") or []
                    if event.get("usage"):
                        usage_tokens = event["usage"].get("completion_tokens")
                        rec.prompt_tokens = event["usage"].get("prompt_tokens", prompt_len)
                        details = event["usage"].get("prompt_tokens_details") or {}
                        rec.cached_tokens = details.get("cached_tokens") or 0
                if rec.error is None and not done:
                    rec.error = "incomplete_stream"
    except asyncio.TimeoutError:
        rec.error = "client_timeout"
    except aiohttp.ClientError as e:
        rec.error = type(e).__name__
    except ValueError:  # a malformed event or a line over aiohttp's limit
        rec.error = "bad_stream"
    rec.output_tokens = usage_tokens if usage_tokens is not None else len(rec.chunk_times)
    rec.end_time = time.perf_counter()
    return rec


def payload(model: str, p: Prompt, temperature: float, seed: int) -> dict:
    return {"model": model, "prompt": p.prompt, "max_tokens": p.output_len, "temperature": temperature,
            "seed": seed, "stream": True, "stream_options": {"include_usage": True}}


class Progress:
    """A one-line progress bar on stdout when it is a terminal; silent otherwise."""

    def __init__(self, total: int, label: str):
        self.total, self.done, self.label = total, 0, label
        self.on = sys.stdout.isatty() and total > 0

    def step(self):
        self.done += 1
        if self.on:
            width = 30
            filled = width * self.done // self.total
            sys.stdout.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}")
            if self.done == self.total:
                sys.stdout.write("\n")
            sys.stdout.flush()


async def run(session, url: str, model: str, prompts: list, rate: float, burstiness: float,
              max_concurrency, temperature: float, seed: int, label: str = ""):
    """Sends every prompt (arrivals per rate, at most max_concurrency in flight); returns
    (records in prompt order, wall time in s from the first send to the last reply)."""
    gaps = arrival_gaps(len(prompts), rate, burstiness, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    progress = Progress(len(prompts), label)

    async def one(i: int, p: Prompt) -> RequestRecord:
        body = payload(model, p, temperature, seed + i)
        if limit is None:
            rec = await send(session, url, body, p.input_len)
        else:
            async with limit:
                rec = await send(session, url, body, p.input_len)
        progress.step()
        return rec

    start = time.perf_counter()
    tasks = []
    for i, p in enumerate(prompts):
        if i > 0 and gaps[i - 1] > 0:
            await asyncio.sleep(gaps[i - 1])
        tasks.append(asyncio.create_task(one(i, p)))
    records = await asyncio.gather(*tasks)
    return records, time.perf_counter() - start
