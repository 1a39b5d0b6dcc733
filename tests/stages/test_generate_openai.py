"""generate:openai against a real OpenAI-compatible server: ``transformers serve`` on SmolLM2-135M
(fp32, CPU, 127.0.0.1), behind a fault-injecting proxy of ours that answers 5xx, 429 with
``Retry-After``, cuts connections before and in the middle of a response, stalls past the timeout
and records the ``Authorization`` header it is sent.

Each prompt's faults are fixed by the test (the proxy finds the prompt in the request body), so
what reaches the server, and how often, is the same whatever the threads' timing.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

import pytest

from dflash_core.stage import StageContext
from dflash_stages.generate.openai_api import OpenAIGenerate, OpenAIGenerateConfig, ServerRefused
from tests.stages.test_generate import run_generate, write_lines

pytest.importorskip("fastapi", reason="transformers serve needs the transformers[serving] extra")

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-test-4e1d9c0b7a"
SLOW_S = 5.0
"""The request timeout of the stalled-answer test (a stalled answer waits longer); the others wait
for the server as long as it takes (it answers one request at a time)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(base URL, model name) of ``transformers serve`` on SmolLM2 saved as safetensors (it cannot
    serve the GGUF form); stopped at the end of the module."""
    from dflash_model.target.smollm2 import load_smollm2

    model_dir = tmp_path_factory.mktemp("smollm2")
    model, tok = load_smollm2()
    # transformers serve samples only where the model's generation config does: a request's
    # temperature turns sampling off (0) but never on
    model.generation_config.do_sample = True
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    port = free_port()
    log = open(model_dir / "serve.log", "wb")
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "transformers"), "serve", str(model_dir),
                             "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32"],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (model_dir / "serve.log").read_text()[-3000:]
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "transformers serve did not start"
            time.sleep(0.5)
        # the model loads on the first request: not inside a test's timeouts
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=180)
        conn.request("POST", "/v1/chat/completions", json.dumps(
            {"model": str(model_dir), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
            {"Content-Type": "application/json"})
        assert conn.getresponse().status == 200
        yield f"{url}/v1", str(model_dir)
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


class FaultProxy:
    """An HTTP proxy in front of the server. ``plan[prompt]`` lists the faults of that prompt's next
    requests (``500``, ``503``, ``400``, ``401``, ``429`` with ``Retry-After: 1``, ``drop``: close
    without answering, ``cut``: half the server's answer then close, ``slow``: answer after the
    timeout, ``hold``: close without answering once ``release`` is set, the server never asked:
    its sampling would draw from the random state the requests after it use); ``seen`` has (prompt, Authorization, time,
    fault) of every request, ``bodies`` its request body."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urlsplit(upstream)
        self.plan: dict[str, list[str]] = {}
        self.seen: list[tuple[str, str | None, float, str | None]] = []
        self.bodies: list[dict] = []
        self.release = threading.Event()
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                prompt = json.loads(body)["messages"][-1]["content"]
                with proxy.lock:
                    faults = proxy.plan.get(prompt) or []
                    fault = faults.pop(0) if faults else None
                    proxy.seen.append((prompt, self.headers.get("Authorization"), time.monotonic(), fault))
                    proxy.bodies.append(json.loads(body))
                try:
                    proxy.answer(self, fault, body)
                except OSError:  # the client gave up (a stalled answer)
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def forward(self, body: bytes) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=300)
        conn.request("POST", self.upstream.path + "/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()

    def answer(self, h: BaseHTTPRequestHandler, fault: str | None, body: bytes) -> None:
        if fault == "drop":
            return
        if fault == "slow":
            time.sleep(SLOW_S + 1.5)
        if fault == "hold":
            self.release.wait(300)
            return
        if fault in ("500", "503", "400", "401", "429"):
            status, payload = int(fault), b'{"error": {"message": "injected"}}'
        else:
            status, payload = self.forward(body)
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(payload)))
        if fault == "429":
            h.send_header("Retry-After", "1")
        h.end_headers()
        h.wfile.write(payload[:len(payload) // 2] if fault == "cut" else payload)
        h.wfile.flush()

    def attempts(self, prompt: str) -> list[tuple[float, str | None]]:
        return [(t, f) for p, _, t, f in self.seen if p == prompt]

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def proxy(server: tuple[str, str]) -> Iterator[FaultProxy]:
    p = FaultProxy(server[0])
    yield p
    p.close()


PROMPTS = ["Name a colour.", "What is 2+2?", "Say hi.", "Name a fruit.", "What is the capital of France?"]


def run_openai(tmp_path: Path, src: Path, name: str, **params: Any) -> tuple[list[dict], StageContext, list[dict]]:
    cfg = OpenAIGenerateConfig(**params)
    ctx = StageContext(stage="generate", config=cfg, work_dir=str(tmp_path / name / "work"),
                       cache_dir=str(tmp_path / name / "cache"))
    Path(ctx.work_dir).mkdir(parents=True, exist_ok=True)
    items = list(OpenAIGenerate(cfg).run({"files": iter([{"path": str(src), "source": src.name}])}, ctx))
    return items, ctx, [json.loads(x) for it in items for x in Path(it["path"]).read_text().splitlines()]


def test_every_prompt_gets_one_record_through_faults_equal_to_generate_hf(
        tmp_path: Path, server: tuple[str, str], proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Through 5xx, 429, dropped and cut connections and a dead endpoint, every
    usable prompt ends as one record or one failure with its reason; each fault costs exactly one
    more request; Retry-After is waited; the records are generate:hf's greedy completions (both fp32
    on the CPU); tokenize reads them; the key reaches the server and nothing else."""
    from tests.stages.test_tokenize import run_stage

    monkeypatch.setenv("GEN_KEY", KEY)
    caplog.set_level(logging.DEBUG, logger="dflash_pipe")
    always_500, refused = "Never answered.", "Refused with 400."
    src = write_lines(tmp_path / "prompts.jsonl", [{"prompt": p} for p in PROMPTS]
                      + [{"prompt": always_500}, {"prompt": " "}, {"prompt": refused}])
    plan = {PROMPTS[0]: ["500", "429"], PROMPTS[1]: ["cut"], PROMPTS[2]: ["drop"], PROMPTS[3]: ["cut", "503"],
            always_500: ["500"] * 4, refused: ["400"]}
    proxy.plan = {k: list(v) for k, v in plan.items()}
    dead = f"http://127.0.0.1:{free_port()}/v1"
    items, ctx, records = run_openai(
        tmp_path, src, "openai", model=server[1], endpoints=[dead, proxy.url], api_key_env="GEN_KEY",
        concurrency=3, max_tokens=16, timeout_s=300, retries=3, backoff_s=0.05, endpoint_cooldown_s=1.0,
        shard_records=3)
    s = ctx.summary

    assert sorted(r["messages"][0]["content"] for r in records) == sorted(PROMPTS)
    failed = [json.loads(x) for x in (Path(ctx.work_dir) / "failed.jsonl").read_text().splitlines()]
    assert sorted((f["line"], f["reason"]) for f in failed) == [(6, "http_500"), (8, "http_400")]
    assert (s["prompts"], s["records_out"], s["failed"], s["skipped"]) == (7, 5, {"http_500": 1, "http_400": 1},
                                                                          {"empty": 1})
    # one request more per fault; the failing prompt's 4th 500 ends its retries, a 400 is not retried
    expected = {**{p: 1 + len(plan.get(p, [])) for p in PROMPTS}, always_500: 4, refused: 1}
    assert {p: len(proxy.attempts(p)) for p in expected} == expected
    (t_429, _), (t_next, _) = proxy.attempts(PROMPTS[0])[1:]
    assert t_next - t_429 >= 0.95  # Retry-After: 1, against a 0.05 s backoff
    assert s["retries"] == 3 + 2 + 1 + 1 + 2  # the failing prompt's 3, then one per fault
    assert s["endpoints_taken_out"] >= 1 and s["requests"] == 7

    _, _, hf = run_generate(tmp_path, [src], "hf", model=server[1], max_new_tokens=16)  # the served weights
    by_id = {r["id"]: r for r in hf}
    for r in records:
        ref = by_id[r["id"]]
        assert (r["messages"], r["finish"], r["tokens"], r["line"]) == \
            (ref["messages"], ref["finish"], ref["tokens"], ref["line"])
    assert {r["finish"] for r in records} == {"stop", "length"}
    assert s["generated_tokens"] == sum(r["tokens"] for r in records)
    assert s["finish_stop"] + s["finish_length"] == 5

    _, tctx, _ = run_stage(tmp_path, items, tokenizer="smollm2", min_loss_tokens=1)
    assert tctx.summary["samples_out"] == 5

    assert {auth for _, auth, _, _ in proxy.seen} == {f"Bearer {KEY}"}
    stored = [p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file()]
    assert not any(KEY in text for text in [caplog.text, json.dumps(s), *stored])
    assert "taken out" in caplog.text and "retry" in caplog.text


@pytest.mark.parametrize("samples", [1, 2])
def test_a_killed_run_resumes_with_the_requests_it_had_not_finished(
        tmp_path: Path, server: tuple[str, str], proxy: FaultProxy, samples: int) -> None:
    """A run SIGKILLed while one request is in flight (the first shard written, the second's first
    prompt journaled: with two samples, both of its samples) is resumed: only the unfinished requests
    are sent again, and the records are an uninterrupted run's, each once."""
    prompts = PROMPTS[:4]
    src = write_lines(tmp_path / "prompts.jsonl", [{"prompt": p} for p in prompts])
    params = dict(model=server[1], endpoints=[proxy.url], concurrency=1, max_tokens=8, shard_records=2,
                  **({} if samples == 1 else {"samples": samples, "temperature": 0.7, "top_p": 0.95}))
    _, _, whole = run_openai(tmp_path, src, "whole", **params)
    assert len(whole) == 4 * samples and len({r["id"] for r in whole}) == 4 * samples

    proxy.plan = {PROMPTS[3]: ["hold"]}
    proxy.seen.clear()
    script = ("import json, sys; from pathlib import Path; from tests.stages.test_generate_openai import run_openai; "
              "run_openai(Path(sys.argv[1]), Path(sys.argv[2]), 'resumed', **json.loads(sys.argv[3]))")
    child = subprocess.Popen([sys.executable, "-c", script, str(tmp_path), str(src), json.dumps(params)], cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 120
        while not proxy.attempts(PROMPTS[3]):
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    proxy.release.set()
    shard_dir = next((tmp_path / "resumed" / "cache").iterdir())
    names = [""] if samples == 1 else [f".s{k}" for k in range(samples)]
    assert sorted(p.name for p in shard_dir.iterdir()) == sorted(
        [f"shard-00000{n}.failed.jsonl" for n in names] + [f"shard-00000{n}.jsonl" for n in names]
        + [f"shard-00001{n}.partial.jsonl" for n in names])
    # a prompt's samples are asked in turn; the kill came with the last prompt's first
    assert [p for p, *_ in proxy.seen] == [p for p in prompts[:3] for _ in range(samples)] + prompts[3:]

    proxy.seen.clear()
    _, ctx, resumed = run_openai(tmp_path, src, "resumed", **params)
    assert [p for p, *_ in proxy.seen] == prompts[3:] * samples
    s = ctx.summary
    assert (s["resumed_shards"], s["resumed_records"], s["requests"], s["records_out"]) == \
        (samples, samples, samples, 4 * samples)
    assert resumed == whole
    assert not list(shard_dir.glob("*.partial.jsonl"))


def test_several_sampled_completions_per_prompt_are_records_of_their_own(
        tmp_path: Path, server: tuple[str, str], proxy: FaultProxy) -> None:
    """``samples: 2`` asks each prompt twice, with seeds ``seed + k + n`` and the sampling params,
    and writes two records named ``<id>#<seed + k>``; sample k is what a one-sample run with seed
    ``seed + k`` writes; a rerun writes the same records, and the two samples of a prompt differ."""
    prompts = ["Write a line about the sea.", "Invent a name for a cat.", "Describe a cloud."]
    src = write_lines(tmp_path / "prompts.jsonl", [{"id": f"q{n}", "prompt": p} for n, p in enumerate(prompts)])
    params = dict(model=server[1], endpoints=[proxy.url], concurrency=1, max_tokens=12, shard_records=2,
                  temperature=0.7, top_p=0.95, seed=3)
    items, ctx, records = run_openai(tmp_path, src, "two", samples=2, **params)
    assert [r["id"] for r in records] == ["q0#3", "q1#3", "q0#4", "q1#4", "q2#3", "q2#4"]
    assert [Path(it["path"]).name for it in items] == ["shard-00000.s3.jsonl", "shard-00000.s4.jsonl",
                                                       "shard-00001.s3.jsonl", "shard-00001.s4.jsonl"]
    assert [(b["messages"][-1]["content"], b["seed"], b["temperature"], b["top_p"]) for b in proxy.bodies] == [
        (prompts[n], 3 + k + n, 0.7, 0.95) for n in range(3) for k in range(2)]
    for n in range(3):
        assert len({r["messages"][-1]["content"] for r in records if r["id"].startswith(f"q{n}#")}) == 2

    def strip(r: dict) -> dict:
        return {k: v for k, v in r.items() if k != "sample"} | {"id": r["id"].split("#")[0]}

    _, _, alone = run_openai(tmp_path, src, "alone", **{**params, "seed": 4})
    assert alone == [strip(r) for r in records if r["sample"] == 4]
    _, _, again = run_openai(tmp_path, src, "again", samples=2, **params)
    assert again == records


def test_an_answer_slower_than_the_timeout_is_abandoned_and_asked_again(
        tmp_path: Path, server: tuple[str, str], proxy: FaultProxy) -> None:
    src = write_lines(tmp_path / "prompts.jsonl", [{"prompt": PROMPTS[2]}])
    proxy.plan = {PROMPTS[2]: ["slow"]}
    _, ctx, records = run_openai(tmp_path, src, "slow", model=server[1], endpoints=proxy.url, max_tokens=4,
                                 timeout_s=SLOW_S, backoff_s=0.05)
    (t_first, _), (t_second, fault), *more = proxy.attempts(PROMPTS[2])
    # the stalled answer is given up at the timeout (a loaded machine may time out a real answer too)
    assert fault is None and SLOW_S - 0.5 <= t_second - t_first < SLOW_S + 1.5
    assert len(records) == 1 and ctx.summary["retries"] == 1 + len(more) and ctx.summary["failed"] == {}


def test_a_refused_key_stops_the_run_without_showing_it(tmp_path: Path, server: tuple[str, str],
                                                         proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEN_KEY", KEY)
    src = write_lines(tmp_path / "prompts.jsonl", [{"prompt": PROMPTS[0]}])
    proxy.plan = {PROMPTS[0]: ["401"]}
    with pytest.raises(ServerRefused, match="answered 401: the API key was refused") as err:
        run_openai(tmp_path, src, "refused", model=server[1], endpoints=proxy.url, api_key_env="GEN_KEY")
    assert KEY not in str(err.value) and len(proxy.seen) == 1
    monkeypatch.delenv("GEN_KEY")
    with pytest.raises(ValueError, match="GEN_KEY"):
        run_openai(tmp_path, src, "nokey", model=server[1], endpoints=proxy.url, api_key_env="GEN_KEY")


def test_reasoning_is_kept_for_tokenize_to_mask() -> None:
    """A reasoning parser's answer (vLLM / SGLang ``reasoning_content``; ``reasoning`` in newer vLLM)
    keeps the reasoning as the assistant message's field, which tokenize reads."""
    from dflash_stages.generate.openai_api import assistant_record
    from dflash_stages.generate.stage import Prompt

    p = Prompt("a", "f.jsonl", 3, [{"role": "user", "content": "Why?"}], [])
    for field in ("reasoning_content", "reasoning"):
        answer = {"choices": [{"message": {"role": "assistant", "content": "Because.", field: "Think."},
                               "finish_reason": "stop"}], "usage": {"completion_tokens": 9, "prompt_tokens": 4}}
        assert assistant_record(p, answer) == {
            "id": "a", "messages": [*p.messages, {"role": "assistant", "content": "Because.",
                                                  "reasoning_content": "Think."}],
            "finish": "stop", "tokens": 9, "prompt_tokens": 4, "source": "f.jsonl", "line": 3}


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="http"):
        OpenAIGenerateConfig(model="m", endpoints=["127.0.0.1:8000"])
    with pytest.raises(ValueError, match="top_p"):
        OpenAIGenerateConfig(model="m", top_p=0)
    with pytest.raises(ValueError, match="samples > 1 needs sampling"):
        OpenAIGenerateConfig(model="m", samples=3)
    assert OpenAIGenerateConfig(model="m", endpoints="http://h:1/v1").endpoints == ["http://h:1/v1"]
