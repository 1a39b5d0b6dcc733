"""generate:openai — the target's completions from an OpenAI-compatible server (vLLM, SGLang, TGI,
llama.cpp, ``transformers serve``), in the records ``generate:hf`` writes.

At 27B and thousands of tokens a completion, regeneration belongs on a serving engine on as many
GPUs and hosts as the user has; they all speak ``POST /v1/chat/completions``. Prompts are read as
``generate:hf`` reads them (:func:`dflash_stages.generate.stage.read_prompts`); the server applies
the chat template, so ``extra_body`` carries what the template reads
(``chat_template_kwargs: {enable_thinking: true}``). Out, one record per prompt (or ``samples``
records, named ``<id>#<seed>`` as ``generate:hf`` names them)::

    {"id", "messages": [...prompt, {"role": "assistant", "content", "reasoning_content"?}],
     "finish", "tokens", "prompt_tokens", "source", "line"}

* ``reasoning_content`` (vLLM's and SGLang's reasoning parsers; ``reasoning`` in newer vLLM) is
  kept as the assistant message's field, which tokenize puts back where the template wants it.
* Requests run ``concurrency`` at a time over the ``endpoints``, each to the one with the fewest in
  flight. 429, 5xx, timeouts, dropped connections and malformed answers are retried with
  exponential backoff and jitter (at least ``Retry-After``). An endpoint that refuses connections, or
  that ``OUT_AFTER`` requests in a row could not reach, is taken out for ``endpoint_cooldown_s``, then
  tried again; a refused request goes on to another endpoint without counting as a retry. A prompt
  that still fails, or that the server refuses (another 4xx), is written to
  ``failed.jsonl`` with its reason and counted; it never stops the run. 401/403/404 mean the key,
  model name or URL is wrong for every prompt: the run fails at once.
* Shards of ``shard_records`` prompts in file order, as in ``generate:hf`` (each sample of a shard
  a file of its own; a prompt's samples are asked one after another, so a server's prefix cache
  holds the prompt for the next): each finished request is
  appended to its shard's journal at once, and a shard is written (temp file + rename) when all its
  prompts are done. A resumed run reads the finished shards and journals back and sends only the
  other requests, so a killed run loses the requests in flight and no record is written twice.
  Failed prompts are not journaled: a resumed run tries them again.
* The API key is read from the environment variable ``api_key_env`` names; it goes only into the
  ``Authorization`` header, never into logs, records, the summary or the cache key.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import os
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Mapping
from urllib.parse import urlsplit

from dflash_core.items import FILE_ITEM
from dflash_core.retry import call_with_retries
from dflash_core.stage import Stage, StageContext
from dflash_stages.generate.stage import (Prompt, as_sample, check_samples, read_prompts, sample_numbers,
                                          sample_params, shard_file, shard_key, write_atomic)

OUT_AFTER = 3
"""Failures to reach an endpoint in a row after which it is taken out for a cooldown."""

UNREACHABLE = ("connection_refused", "connection", "timeout")
"""Failures that say the endpoint is unwell; an HTTP error status says it is up (and retries wait)."""

FATAL_STATUS = {401: "the API key was refused", 403: "the API key was refused",
                404: "no such model or path (is the endpoint's path /v1, and the model name the server's?)"}

# params that change what the server answers; the others (where and how fast to ask) do not
OUTPUT_PARAMS = ("model", "max_tokens", "temperature", "top_p", "seed", "samples", "extra_body", "shard_records",
                 "limit")


@dataclass
class OpenAIGenerateConfig:
    model: str = field(metadata={
        "help": "The model name the server serves (as /v1/models lists it), sent with every "
                "request."})
    endpoints: str | list[str] = field(default="http://127.0.0.1:8000/v1", metadata={
        "help": "Base URL(s) of the API, http://host:port/v1; requests are spread over them."})
    api_key_env: str | None = field(default=None, metadata={
        "help": "Name of the environment variable holding the API key (sent as Authorization: "
                "Bearer); None: no key. The key itself never goes in the pipeline file."})
    concurrency: int = field(default=64, metadata={
        "help": "Requests in flight at once, over all endpoints (the server batches them)."})
    max_tokens: int = field(default=2048, metadata={
        "help": "Longest completion (reasoning included); longer ones are cut (finish: length)."})
    temperature: float = field(default=0.0, metadata={
        "help": "0: greedy; above 0: sampling with top_p and a seed per prompt."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass."})
    seed: int | None = field(default=0, metadata={
        "help": "Each prompt's request gets seed + its index in the input; None: no seed is sent."})
    samples: int = field(default=1, metadata={
        "help": "Completions per prompt, each a record of its own; above 1 they must be sampled "
                "(temperature > 0; SpecForge regenerates at 0.7, top_p 0.95). Sample k is "
                "asked with the seeds a one-sample run with seed + k sends, and named "
                "<id>#<seed + k> (<id>#<k> unseeded)."})
    extra_body: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "Fields merged into every request body last, e.g. chat_template_kwargs: "
                "{enable_thinking: true} or engine-specific sampling (top_k)."})
    timeout_s: float = field(default=600.0, metadata={
        "help": "Longest wait for one whole response; a slower one is abandoned and retried."})
    retries: int = field(default=6, metadata={
        "help": "Retries of a request after its first attempt (429, 5xx, timeouts, dropped "
                "connections)."})
    backoff_s: float = field(default=1.0, metadata={
        "help": "First retry's wait; doubled at each retry, ×0.5-1.5 jitter, at most "
                "max_backoff_s."})
    max_backoff_s: float = field(default=60.0, metadata={
        "help": "Longest backoff wait (a longer Retry-After is still honoured)."})
    endpoint_cooldown_s: float = field(default=30.0, metadata={
        "help": "How long a failing endpoint is left out before it is tried again."})
    shard_records: int = field(default=512, metadata={"help": "Prompts per output shard."})
    limit: int | None = field(default=None, metadata={"help": "Use the first N usable prompts only."})

    def __post_init__(self) -> None:
        self.endpoints = [self.endpoints] if isinstance(self.endpoints, str) else list(self.endpoints)
        if not self.endpoints or not all(urlsplit(u).scheme in ("http", "https") for u in self.endpoints):
            raise ValueError("endpoints must be one or more http(s):// URLs")
        if not self.model:
            raise ValueError("model must name the served model")
        if min(self.concurrency, self.max_tokens, self.shard_records) < 1:
            raise ValueError("concurrency, max_tokens and shard_records must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        check_samples(self.samples, self.temperature)
        if self.timeout_s <= 0 or self.retries < 0 or self.backoff_s < 0 or self.endpoint_cooldown_s < 0:
            raise ValueError("timeout_s must be > 0; retries, backoff_s and endpoint_cooldown_s >= 0")
        if self.limit is not None and self.limit < 1:
            raise ValueError("limit must be >= 1")


class RequestFailed(Exception):
    """One failed attempt; ``reason`` is counted in the summary (``http_503``, ``timeout``, …)."""

    def __init__(self, reason: str, detail: str, retry: bool, retry_after: float | None = None,
                 endpoint_down: bool = False) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.retry, self.retry_after, self.endpoint_down = reason, retry, retry_after, endpoint_down


class ServerRefused(RuntimeError):
    """An answer that is wrong for every prompt (bad key, model or URL): the run stops."""


class Endpoints:
    """The endpoints' health and load: each request goes to the live one with the fewest in flight."""

    def __init__(self, urls: list[str], cooldown_s: float, log: Callable[[str], None]) -> None:
        self.urls = [u.rstrip("/") + ("/v1" if not urlsplit(u).path.strip("/") else "") for u in urls]
        self.cooldown_s, self.log = cooldown_s, log
        self.in_flight = [0] * len(urls)
        self.failures = [0] * len(urls)
        self.out_until = [0.0] * len(urls)
        self.taken_out = 0
        self.turn = 0
        self.cond = threading.Condition()

    def acquire(self, stop: Callable[[], bool], exclude: set[int]) -> int:
        """A live endpoint's index, not one of ``exclude``, waiting while there is none (or until ``stop()``)."""
        with self.cond:
            while True:
                now = time.monotonic()
                live = [i for i, t in enumerate(self.out_until) if t <= now and i not in exclude]
                if live:
                    self.turn += 1
                    i = min(live, key=lambda j: (self.in_flight[j], (j - self.turn) % len(self.urls)))
                    self.in_flight[i] += 1
                    return i
                if stop():
                    raise RequestFailed("stopped", "the run is stopping", retry=False)
                self.cond.wait(min([1.0] + [t - now for i, t in enumerate(self.out_until)
                                            if i not in exclude and t > now]))

    def release(self, i: int, error: RequestFailed | None) -> None:
        with self.cond:
            self.in_flight[i] -= 1
            if error is None:
                self.failures[i] = 0
            elif error.reason in UNREACHABLE:
                self.failures[i] += 1
                if error.endpoint_down or self.failures[i] >= OUT_AFTER:
                    self.failures[i] = 0
                    self.out_until[i] = time.monotonic() + self.cooldown_s
                    self.taken_out += 1
                    self.log(f"generate: endpoint {self.urls[i]} taken out for {self.cooldown_s:g} s ({error})")
            self.cond.notify_all()


def post_json(url: str, body: bytes, headers: Mapping[str, str], timeout_s: float) -> tuple[int, Any, bytes]:
    """(status, headers, body) of one POST, the whole response within ``timeout_s``; connection
    problems and a body cut short raise :class:`RequestFailed`."""
    u = urlsplit(url)
    conn_cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    deadline = time.monotonic() + timeout_s
    conn = conn_cls(u.hostname or "", u.port, timeout=timeout_s)
    try:
        conn.request("POST", u.path, body=body, headers=dict(headers))
        sock = conn.sock  # the response keeps reading it after the connection lets it go
        resp = conn.getresponse()
        chunks = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no whole response in {timeout_s:g} s")
            sock.settimeout(left)
            chunk = resp.read1(1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        if resp.length:  # the server closed the connection before the Content-Length it announced
            raise http.client.IncompleteRead(b"".join(chunks), resp.length)
        return resp.status, resp.headers, b"".join(chunks)
    except ConnectionRefusedError as exc:
        raise RequestFailed("connection_refused", str(exc), retry=True, endpoint_down=True) from None
    except TimeoutError as exc:
        raise RequestFailed("timeout", str(exc) or f"no response in {timeout_s:g} s", retry=True) from None
    except (OSError, http.client.HTTPException) as exc:
        raise RequestFailed("connection", f"{type(exc).__name__}: {exc}"[:200], retry=True) from None
    finally:
        conn.close()


def retry_after_s(value: str | None) -> float | None:
    """Seconds a ``Retry-After`` header asks for (a number or an HTTP date)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def assistant_record(p: Prompt, answer: Any) -> dict:
    """The record of one chat completion; a malformed answer raises :class:`RequestFailed`."""
    try:
        choice = answer["choices"][0]
        msg = choice["message"]
        content = msg.get("content") or ""
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        usage = answer.get("usage") or {}
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        raise RequestFailed("bad_response", f"no choices[0].message ({exc!r})", retry=True) from None
    turn = {"role": "assistant", "content": content}
    if reasoning:
        turn["reasoning_content"] = reasoning
    return {"id": p.id, "messages": p.messages + [turn], "finish": choice.get("finish_reason") or "unknown",
            "tokens": usage.get("completion_tokens"), "prompt_tokens": usage.get("prompt_tokens"),
            "source": p.source, "line": p.line}


class OpenAIGenerate(Stage):
    """The target's completions of prompt records from OpenAI-compatible servers (resumable)."""

    kind = "generate"
    name = "openai"
    version = "1"
    Config = OpenAIGenerateConfig
    inputs = {"files": FILE_ITEM}
    output = FILE_ITEM
    default_link = "materialize"
    default_executor = "thread"

    def run(self, inputs: Mapping[str, Any], ctx: StageContext) -> Iterator[dict]:
        from dflash_stages.tokenize.stage import file_items

        cfg: OpenAIGenerateConfig = self.config
        headers = {"Content-Type": "application/json"}
        if cfg.api_key_env:
            key = os.environ.get(cfg.api_key_env)
            if not key:
                raise ValueError(f"generate: the environment variable {cfg.api_key_env} (api_key_env) is not set")
            headers["Authorization"] = f"Bearer {key}"
        items = file_items(inputs["files"], ctx.stage, ctx.upstream("files"))
        skipped: dict[str, int] = {}
        with open(os.path.join(ctx.work_dir, "skipped.jsonl"), "w", encoding="utf-8") as skip_file:
            prompts = list(read_prompts(items, lambda msgs: [], cfg.limit, skipped, skip_file))
        if not prompts:
            raise ValueError(f"generate: no usable prompt in {len(items)} file(s); skipped {skipped} "
                             f"(see {os.path.join(ctx.work_dir, 'skipped.jsonl')})")
        params = {k: v for k, v in asdict(cfg).items() if k in OUTPUT_PARAMS}
        shard_dir = os.path.join(ctx.cache_dir, shard_key(self.version, sample_params(params), items))
        os.makedirs(shard_dir, exist_ok=True)
        endpoints = Endpoints(cfg.endpoints, cfg.endpoint_cooldown_s, ctx.logger.warning)
        ctx.logger.info("generate: %d prompts (%d skipped) over %d endpoint(s) -> %s", len(prompts),
                        sum(skipped.values()), len(cfg.endpoints), shard_dir)
        with open(os.path.join(ctx.work_dir, "failed.jsonl"), "w", encoding="utf-8") as failed_file:
            yield from _Run(cfg, ctx, prompts, shard_dir, endpoints, headers, skipped, failed_file).shards()

    @classmethod
    def report(cls, summary: dict[str, Any]) -> Any:
        skipped, failed = summary.get("skipped") or {}, summary.get("failed") or {}
        return (f"generate: {summary.get('records_out', 0)} completions of {summary.get('prompts', 0)} prompts "
                f"({summary.get('finish_length', 0)} cut at max_tokens), {summary.get('generated_tokens', 0)} "
                f"tokens at {summary.get('tokens_per_s')} tokens/s, {summary.get('requests_per_s')} requests/s, "
                f"{summary.get('retries', 0)} retries; failed {sum(failed.values())} {dict(sorted(failed.items()))}; "
                f"skipped {sum(skipped.values())} {dict(sorted(skipped.items()))}")


class _Run:
    """One run of the stage: the request loop, the shards' journals and the counts."""

    def __init__(self, cfg: OpenAIGenerateConfig, ctx: StageContext, prompts: list[Prompt], shard_dir: str,
                 endpoints: Endpoints, headers: dict[str, str], skipped: dict[str, int], failed_file: Any) -> None:
        self.cfg, self.ctx, self.prompts, self.shard_dir = cfg, ctx, prompts, shard_dir
        self.endpoints, self.headers, self.failed_file = endpoints, headers, failed_file
        self.stopping = threading.Event()
        self.lock = threading.Lock()  # the counters the request threads add to
        self.stats: dict[str, Any] = {
            "prompts": len(prompts), "skipped": skipped, "records_out": 0, "failed": {}, "finish_stop": 0,
            "finish_length": 0, "generated_tokens": 0, "prompt_tokens": 0, "requests": 0, "retries": 0,
            "endpoints_taken_out": 0, "shards": 0, "resumed_shards": 0, "resumed_records": 0,
            "generate_s": 0.0, "requests_per_s": None, "tokens_per_s": None}
        ctx.summary.update(self.stats)
        self.numbers = sample_numbers(cfg.seed, cfg.samples)

    # a shard file ``s`` holds one sample (``s % samples``) of one shard's prompts (``s // samples``)
    def path(self, s: int, suffix: str = "") -> str:
        N = self.cfg.samples
        return os.path.join(self.shard_dir, shard_file(s // N, self.numbers[s % N], suffix))

    def size(self, s: int) -> int:
        """How many records shard file ``s`` holds once whole: its shard's prompts."""
        first = s // self.cfg.samples * self.cfg.shard_records
        return len(self.prompts[first:first + self.cfg.shard_records])

    def stop(self) -> bool:
        return self.stopping.is_set() or self.ctx.should_stop() or self.ctx.interrupted()

    def shards(self) -> Iterator[dict]:
        """Sends every request not on disk yet and yields each shard file, in order, once it is whole."""
        ctx, N = self.ctx, self.cfg.samples
        n_shards = -(-len(self.prompts) // self.cfg.shard_records) * N
        done = [{} if os.path.exists(self.path(s)) else _read_journal(self.path(s, ".partial"))
                for s in range(n_shards)]
        failed: list[list[dict]] = [[] for _ in range(n_shards)]
        self.stats["resumed_records"] = sum(len(got) for got in done)
        # a prompt's samples one after another: the server still holds the prompt's prefix
        todo = deque((s, i) for first in range(0, n_shards, N) for i in range(self.size(first))
                     for s in range(first, first + N) if i not in done[s] and not os.path.exists(self.path(s)))
        resumed = len(self.prompts) * N - len(todo)
        ctx.progress(0, total=len(self.prompts) * N, unit="requests", start=resumed or None)
        journals: dict[int, Any] = {}
        in_flight: dict[Future, tuple[int, int]] = {}
        pool = ThreadPoolExecutor(self.cfg.concurrency, thread_name_prefix="generate-openai")
        t0, next_shard, last_metrics = time.perf_counter(), 0, 0.0
        try:
            while True:
                while todo and len(in_flight) < self.cfg.concurrency and not self.stop():
                    s, i = todo.popleft()
                    in_flight[pool.submit(self.ask, s, i)] = (s, i)
                while next_shard < n_shards and self._whole(next_shard, done, failed):
                    yield self._finish_shard(next_shard, done[next_shard], failed[next_shard], journals)
                    next_shard += 1
                if not in_flight or self.stop():
                    return  # stopping: the requests in flight are lost, the journals hold the rest
                finished, _ = wait(in_flight, timeout=1.0, return_when=FIRST_COMPLETED)
                for f in finished:
                    s, i = in_flight.pop(f)
                    outcome = f.result()  # ServerRefused ends the run
                    if "messages" in outcome:
                        done[s][i] = outcome
                        if s not in journals:
                            journals[s] = _open_journal(self.path(s, ".partial"))
                        journals[s].write(json.dumps({"i": i, "record": outcome}, ensure_ascii=False) + "\n")
                        journals[s].flush()
                        ctx.progress(1, unit="requests", tokens=outcome.get("tokens") or 0)
                    elif outcome["reason"] != "stopped":
                        failed[s].append(outcome)
                        ctx.progress(1, unit="requests")
                self.stats["generate_s"] = time.perf_counter() - t0
                if time.monotonic() - last_metrics >= 1.0 or not in_flight:
                    last_metrics = time.monotonic()
                    ctx.emit({"type": "metrics", "in_flight": len(in_flight),
                              "failed": sum(len(x) for x in failed), "retries": self.stats["retries"]})
        finally:
            self.stopping.set()
            pool.shutdown(wait=False, cancel_futures=True)
            for j in journals.values():
                j.close()
            self._rates()

    def _whole(self, s: int, done: list[dict[int, dict]], failed: list[list[dict]]) -> bool:
        return os.path.exists(self.path(s)) or len(done[s]) + len(failed[s]) == self.size(s)

    def _finish_shard(self, s: int, got: dict[int, dict], failed: list[dict], journals: dict[int, Any]) -> dict:
        """Writes a whole shard (unless a run before did) and its failures; counts; the item to yield."""
        path = self.path(s)
        if os.path.exists(path):
            records = [json.loads(x) for x in open(path, encoding="utf-8")]
            self.stats["resumed_shards"] += 1
            if os.path.exists(self.path(s, ".failed")):
                failed = [json.loads(x) for x in open(self.path(s, ".failed"), encoding="utf-8")]
        else:
            records = [got[i] for i in sorted(got)]
            write_atomic(self.path(s, ".failed"), failed)
            write_atomic(path, records)
        if s in journals:
            journals.pop(s).close()
        if os.path.exists(self.path(s, ".partial")):
            os.remove(self.path(s, ".partial"))
        for r in records:
            self.stats[f"finish_{r['finish']}"] = self.stats.get(f"finish_{r['finish']}", 0) + 1
            self.stats["generated_tokens"] += r.get("tokens") or 0
            self.stats["prompt_tokens"] += r.get("prompt_tokens") or 0
        for r in failed:
            self.stats["failed"][r["reason"]] = self.stats["failed"].get(r["reason"], 0) + 1
            self.failed_file.write(json.dumps(r, ensure_ascii=False) + "\n")
        self.failed_file.flush()
        self.stats["records_out"] += len(records)
        self.stats["shards"] += 1
        self._rates()
        return {"path": path, "source": f"generate/{os.path.basename(path)}", "records": len(records),
                "size": os.path.getsize(path)}

    def _rates(self) -> None:
        st = self.stats
        st["endpoints_taken_out"] = self.endpoints.taken_out
        if st["generate_s"]:
            st["requests_per_s"] = round(st["requests"] / st["generate_s"], 2)
            st["tokens_per_s"] = round(st["generated_tokens"] / st["generate_s"], 1)
        self.ctx.summary.update(st)

    def _post(self, url: str, data: bytes) -> Any:
        """The JSON answer of one chat completion request; failures raise :class:`RequestFailed`
        (retried or not) or :class:`ServerRefused` (the run stops)."""
        status, headers, payload = post_json(url + "/chat/completions", data, self.headers, self.cfg.timeout_s)
        if status in FATAL_STATUS:
            raise ServerRefused(f"generate: {url} answered {status}: {FATAL_STATUS[status]}; {payload[:200]!r}")
        if status != 200:
            raise RequestFailed(f"http_{status}", payload[:200].decode("utf-8", "replace"),
                                retry=status in (408, 409, 429) or status >= 500,
                                retry_after=retry_after_s(headers.get("Retry-After")))
        try:
            return json.loads(payload)
        except ValueError:
            raise RequestFailed("bad_response", f"not JSON: {payload[:100]!r}", retry=True) from None

    def ask(self, s: int, i: int) -> dict:
        """The record of prompt ``i`` of shard file ``s``, or its failure record ({id, source, line,
        reason, detail}); sample k of prompt n is asked with seed ``seed + k + n``."""
        cfg, k = self.cfg, s % self.cfg.samples
        n = s // cfg.samples * cfg.shard_records + i
        p, number = self.prompts[n], self.numbers[k]
        body = {"model": cfg.model, "messages": p.messages, "max_tokens": cfg.max_tokens,
                "temperature": cfg.temperature, "top_p": cfg.top_p, "stream": False,
                **({} if cfg.seed is None else {"seed": cfg.seed + k + n}), **cfg.extra_body}
        data = json.dumps(body, ensure_ascii=False).encode()

        def attempt() -> dict:
            """One try; an endpoint that refuses the connection sends it on to another (a dead
            endpoint costs a prompt a retry only once every endpoint has refused it)."""
            refused: set[int] = set()
            while True:
                e = self.endpoints.acquire(self.stop, refused)
                error = None
                try:
                    return as_sample(assistant_record(p, self._post(self.endpoints.urls[e], data)), number)
                except RequestFailed as exc:
                    error = exc
                    if not exc.endpoint_down:
                        raise
                finally:
                    self.endpoints.release(e, error)
                refused.add(e)
                if len(refused) == len(self.endpoints.urls):
                    raise error

        def on_retry(k: int, exc: BaseException, delay: float) -> None:
            with self.lock:
                self.stats["retries"] += 1
            self.ctx.logger.debug("generate: %s: retry %d in %.1f s after %s", p.id, k, delay, exc)

        try:
            record = call_with_retries(attempt, retries=cfg.retries, backoff=cfg.backoff_s,
                                       permanent=lambda e: not (isinstance(e, RequestFailed) and e.retry),
                                       stop=self.stop, on_retry=on_retry, max_delay=cfg.max_backoff_s,
                                       wait_at_least=lambda e: getattr(e, "retry_after", None))
        except RequestFailed as exc:
            return as_sample({"id": p.id, "source": p.source, "line": p.line, "reason": exc.reason,
                              "detail": str(exc)[:300]}, number)
        finally:
            with self.lock:
                self.stats["requests"] += 1
        return record


def _read_journal(path: str) -> dict[int, dict]:
    """Records an unfinished shard's journal holds, by index (a line cut by a kill is ignored)."""
    got: dict[int, dict] = {}
    if os.path.exists(path):
        for line in open(path, encoding="utf-8"):
            try:
                entry = json.loads(line)
                got[int(entry["i"])] = entry["record"]
            except (ValueError, KeyError, TypeError):
                continue
    return got


def _open_journal(path: str) -> Any:
    """The journal to append to; a line a kill cut short is ended first, so the next one stays whole."""
    cut = os.path.exists(path) and os.path.getsize(path) > 0 and open(path, "rb").read()[-1:] != b"\n"
    f = open(path, "a", encoding="utf-8")
    if cut:
        f.write("\n")
    return f
