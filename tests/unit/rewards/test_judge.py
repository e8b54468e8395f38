"""The LLM judge against a real HTTP server on 127.0.0.1 that speaks the OpenAI
chat-completions shape. Its "judge" is deterministic: the score is the number of ``x`` in
the user message, so every expected reward is known. The request's ``model`` picks how the
server behaves (rate-limited once, failing, slow, malformed, ...)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from rltune.data.records import Prompt
from rltune.rewards.contract import is_batched
from rltune.rewards.judge import JudgeError, llm_judge, parse_score, prompt_text

KEY_ENV, KEY = "RLTUNE_TEST_JUDGE_KEY", "sekrit-123"
FAST = {"backoff_s": 0.01, "timeout_s": 5.0}
GATHER_S = 25.0
"""How long the server holds a "gather-N" request for the rest of its batch (below
GATHER_TIMEOUT_S, the client's timeout in those tests; the longer, the less a loaded
machine can split a batch: at 4 s a loaded 2-core machine once delivered a batch's third
request after its first had given up). Only a split batch waits this long."""
GATHER_TIMEOUT_S = 30.0
SLOW_S = 30.0
"""How long the server holds a "slow" request unless the test lets it go first (far beyond
any client timeout used here: a client that waited for the answer would get a score)."""


class JudgeServer(ThreadingHTTPServer):
    """Records every request, how many were in flight at once and how many got an answer."""

    daemon_threads = True
    block_on_close = False

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), JudgeHandler)
        self.lock = threading.Condition()
        self.release = threading.Event()
        self.reset()

    def reset(self) -> None:
        self.release.set()  # let go of any request a previous test left held
        self.release = threading.Event()
        with self.lock:
            self.requests: list[dict[str, Any]] = []
            self.seen: Counter[str] = Counter()
            self.in_flight = 0
            self.max_in_flight = 0
            self.arrived = 0
            self.answered = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class JudgeHandler(BaseHTTPRequestHandler):
    server: JudgeServer

    def log_message(self, *args: object) -> None:  # keep the test output clean
        pass

    def do_POST(self) -> None:
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        content = body["messages"][-1]["content"]
        with srv.lock:
            srv.requests.append({"path": self.path, "body": body,
                                 "auth": self.headers.get("Authorization")})
            srv.seen[content] += 1
            attempt = srv.seen[content]
            srv.in_flight += 1
            srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
            srv.arrived += 1
            self.arrival = srv.arrived
            srv.lock.notify_all()
        try:
            self._answer(body["model"], content, attempt)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
            pass
        finally:
            with srv.lock:
                srv.in_flight -= 1

    def _answer(self, mode: str, content: str, attempt: int) -> None:
        if self.path != "/v1/chat/completions":
            return self._send(404, b'{"error": "no such route"}')
        if self.headers.get("Authorization") != f"Bearer {KEY}":
            return self._send(401, b'{"error": {"message": "invalid api key"}}')
        if mode == "flaky" and attempt == 1:
            return self._send(429, b'{"error": "slow down"}', {"Retry-After": "0"})
        if mode == "down":
            return self._send(500, b"upstream exploded")
        if mode == "garbage":
            return self._send(200, b"this is {not json")
        if mode == "shapeless":
            return self._send(200, b'{"choices": []}')
        if mode == "slow":
            self.server.release.wait(SLOW_S)
        if mode.startswith("gather-"):  # hold requests until N have arrived (or GATHER_S pass)
            n = int(mode[7:])
            batch_end = -(-self.arrival // n) * n
            with self.server.lock:
                self.server.lock.wait_for(lambda: self.server.arrived >= batch_end, GATHER_S)
        reply = "I cannot decide." if mode == "mute" else f"Fine work.\nScore: {content.count('x')}"
        self._send(200, json.dumps({
            "id": "chatcmpl-1", "object": "chat.completion", "model": mode,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": reply}}],
        }).encode())

    def _send(self, status: int, payload: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)
        with self.server.lock:
            self.server.answered += 1


@pytest.fixture(scope="module")
def server() -> Iterator[JudgeServer]:
    srv = JudgeServer()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.release.set()
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=5)


@pytest.fixture(autouse=True)
def _key(server: JudgeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    server.reset()
    monkeypatch.setenv(KEY_ENV, KEY)


def judge(server: JudgeServer, prompts, completions, mode: str = "count", **kwargs) -> list:
    settings = {"base_url": server.base_url, "model": mode, "api_key_env": KEY_ENV,
                "template": "{completion}", **FAST, **kwargs}
    return asyncio.run(llm_judge(prompts, completions, **settings))


def prompts(n: int) -> list[Prompt]:
    return [Prompt(id=f"p{i}", text=f"question {i}") for i in range(n)]


def test_is_an_async_batched_reward() -> None:
    assert is_batched(llm_judge) and asyncio.iscoroutinefunction(llm_judge)


def test_scores_are_the_judges_mapped_to_unit_range(server) -> None:
    rows = [Prompt(id="a", text="Add: 1+1", meta={"answer": "xx"}),
            Prompt(id="b", messages=[{"role": "user", "content": "Say x"}], meta={"answer": ""})]
    got = judge(server, rows, ["x", "xxxxxxx"],
                template="Q: {prompt}\nRef: {answer}\nA: {completion}", system="Be strict.")
    # a: "xx" + "x" -> 3 of 10; b: "Say x" + 7 x -> 8 of 10
    assert got == [0.3, 0.8]
    sent = sorted(server.requests, key=lambda r: r["body"]["messages"][-1]["content"])
    assert [r["body"]["messages"] for r in sent] == [
        [{"role": "system", "content": "Be strict."},
         {"role": "user", "content": "Q: Add: 1+1\nRef: xx\nA: x"}],
        [{"role": "system", "content": "Be strict."},
         {"role": "user", "content": "Q: Say x\nRef: \nA: xxxxxxx"}],
    ]
    assert all(r["path"] == "/v1/chat/completions" and r["body"]["model"] == "count"
               and r["body"]["temperature"] == 0.0 for r in sent)


def test_min_and_max_score_set_the_mapping(server) -> None:
    assert judge(server, prompts(2), ["xx", "xxxxxx"], min_score=2, max_score=6) == [0.0, 1.0]
    (outside,) = judge(server, prompts(1), ["x"], min_score=2, max_score=6)
    assert isinstance(outside, JudgeError) and "score 1 is outside [2, 6]" in str(outside)


def test_the_key_comes_from_the_named_environment_variable(server, monkeypatch) -> None:
    judge(server, prompts(1), ["x"])
    assert server.requests[0]["auth"] == f"Bearer {KEY}"
    monkeypatch.setenv(KEY_ENV, "wrong")
    (err,) = judge(server, prompts(1), ["xx"], max_retries=3)
    assert isinstance(err, JudgeError) and "HTTP 401" in str(err) and "invalid api key" in str(err)
    assert len(server.requests) == 2  # a 401 is not retried
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(ValueError, match=f"{KEY_ENV}.*not set"):
        judge(server, prompts(1), ["x"])


def test_rate_limit_is_retried_until_the_judge_answers(server) -> None:
    assert judge(server, prompts(3), ["x", "xx", "xxx"], mode="flaky") == [0.1, 0.2, 0.3]
    assert sorted(server.seen.values()) == [2, 2, 2]  # one 429, then the answer


def test_server_errors_fail_the_sample_after_the_retries(server) -> None:
    (err,) = judge(server, prompts(1), ["x"], mode="down", max_retries=2)
    assert isinstance(err, JudgeError)
    assert "HTTP 500" in str(err) and "upstream exploded" in str(err)
    assert "after 3 attempts" in str(err) and "'p0'" in str(err)
    assert len(server.requests) == 3


@pytest.mark.parametrize(
    "mode, message",
    [
        ("garbage", "not JSON: 'this is {not json'"),
        ("shapeless", "no choices[0].message.content"),
        ("mute", "no score in the judge's reply 'I cannot decide.'"),
    ],
)
def test_unusable_replies_are_errors_not_zeros(server, mode: str, message: str) -> None:
    (err,) = judge(server, prompts(1), ["x"], mode=mode)
    assert isinstance(err, JudgeError) and message in str(err)
    assert len(server.requests) == 1


def test_a_slow_judge_times_out_instead_of_hanging(server) -> None:
    start = time.perf_counter()
    (err,) = judge(server, prompts(1), ["x"], mode="slow", timeout_s=0.3, max_retries=1)
    elapsed = time.perf_counter() - start
    assert isinstance(err, JudgeError) and "timed out" in str(err)
    assert "after 2 attempts" in str(err)
    # the server still holds every request it got (it answers none before SLOW_S or the
    # next test): the client gave up rather than waited; and it gave each attempt its
    # 0.3 s (a lower bound, which a slower machine only exceeds)
    assert server.answered == 0
    assert elapsed >= 0.6


def test_an_unreachable_judge_is_an_error(server) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (err,) = judge(server, prompts(1), ["x"], base_url=f"http://127.0.0.1:{port}/v1",
                   max_retries=1)
    assert isinstance(err, JudgeError) and "ConnectionRefusedError" in str(err)


def test_requests_overlap_up_to_the_concurrency(server) -> None:
    # The server holds requests back until 8 have arrived (or GATHER_S pass) and counts
    # how many it holds at once: sent together, all 8 are in flight together; sent one
    # after another, never more than 1 (and each waits GATHER_S).
    got = judge(server, prompts(8), ["x" * i for i in range(8)], mode="gather-8", concurrency=8,
                timeout_s=GATHER_TIMEOUT_S)
    assert got == [i / 10 for i in range(8)]
    assert server.max_in_flight == 8
    server.reset()  # a client that ignored the limit would have all 6 in flight at once
    judge(server, prompts(6), ["x" * i for i in range(6)], mode="gather-3", concurrency=3,
          timeout_s=GATHER_TIMEOUT_S)
    assert server.max_in_flight == 3


def test_a_template_field_missing_from_meta_is_an_error(server) -> None:
    (err,) = judge(server, [Prompt(id="q", text="hi", meta={"tests": []})], ["x"],
                   template="{answer}: {completion}")
    assert isinstance(err, JudgeError) and "{answer}" in str(err) and "['tests']" in str(err)
    assert server.requests == []


def test_the_key_never_goes_over_plain_http_to_another_host() -> None:
    with pytest.raises(ValueError, match="clear text"):
        asyncio.run(llm_judge(prompts(1), ["x"], base_url="http://judge.example.com/v1",
                              model="m", api_key_env=KEY_ENV))
    with pytest.raises(ValueError, match="not an http"):
        asyncio.run(llm_judge(prompts(1), ["x"], base_url="ftp://judge.example.com", model="m"))


@pytest.mark.parametrize(
    "reply, regex, expected",
    [
        ("Reasoning: 3 issues, 2 minor.\nScore: 7/10", None, 7.0),
        ("score = 4.5 and later Score: 6", None, 6.0),
        ("I rate it 8", None, 8.0),
        ("Rating: [[9]] (was 3)", r"\[\[(\d+)\]\]", 9.0),
        ("grade=B, points=-2", r"points=(?P<score>-?\d+)", -2.0),
        ("verdict 1 then verdict 0", r"verdict \d", None),
    ],
)
def test_parse_score(reply: str, regex: str | None, expected: float | None) -> None:
    pattern = re.compile(regex) if regex else None
    if expected is None:
        with pytest.raises(JudgeError, match="is not a number"):
            parse_score(reply, pattern)
    else:
        assert parse_score(reply, pattern) == expected


def test_prompt_text_of_a_conversation() -> None:
    convo = Prompt(id="c", messages=[{"role": "system", "content": "S"},
                                     {"role": "user", "content": "U"}])
    assert prompt_text(convo) == "system: S\nuser: U"
