"""An LLM judge behind an OpenAI-compatible chat-completions endpoint, as a reward.

Name it in a config as ``rltune.rewards.judge:llm_judge``::

    reward:
    - fn: rltune.rewards.judge:llm_judge
      kwargs:
        base_url: https://api.example.com/v1     # POST {base_url}/chat/completions
        model: judge-large
        api_key_env: JUDGE_API_KEY               # the *name* of the variable
        template: "Question: {prompt}\\nReference: {answer}\\nReply: {completion}\\n..."
        concurrency: 16

Each sample becomes one request whose user message is ``template`` filled with
``{prompt}``, ``{completion}`` and any field of the prompt's ``meta`` (``{answer}``). The
reply's score (``Score: N``, else its last number, or ``score_regex``) is mapped from
``[min_score, max_score]`` to ``[0, 1]``.

It is one ``async`` batched function rather than a per-sample coroutine so that
``concurrency`` is a real bound over the whole scoring round (one semaphore shared by every
request of the round) and the round's requests overlap without the scorer knowing anything
about HTTP. The config's per-reward ``timeout_s`` bounds that whole call, so give it room
for the round (``timeout_s: 600``, or null).

Failures are errors, never a 0: a reply without a score, a score outside the scale, a
reply that is not the OpenAI shape, or an HTTP failure after ``max_retries`` retries is an
exception in that sample's place (with the status and the start of the body). 429, 5xx,
connection errors and timeouts are retried with exponential backoff (and the server's
``Retry-After`` when it sends one); other 4xx are not, since the same request fails again.

Security: the API key is read from the environment variable named by ``api_key_env``,
never from the config. A key is never sent in clear text: ``http://`` with a key is refused
unless the host is the loopback interface (a judge served on this machine). ``http://``
without a key is allowed anywhere (an in-cluster server on a private network).

Requests use the standard library (``http.client`` in a thread pool of ``concurrency``
threads); proxy environment variables are not consulted.
"""

from __future__ import annotations

import asyncio
import http.client
import ipaddress
import json
import math
import os
import random
import re
import ssl
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from rltune.data.records import Prompt
from rltune.rewards.contract import batched
from rltune.rewards.keyed_cache import KeyedCache

DEFAULT_TEMPLATE = (
    "You are grading a response to a task. Rate how well the response accomplishes the "
    "task on a scale from 0 (useless or wrong) to 10 (excellent).\n\n"
    "Task:\n{prompt}\n\nResponse:\n{completion}\n\n"
    "Reply with a short justification, then a final line of the form `Score: N`."
)
"""The template used when none is given; its 0-10 scale matches the default
``min_score``/``max_score``."""

SCORE_LINE = re.compile(r"\bscore\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
LAST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
RETRY_STATUSES = frozenset({408, 429}) | frozenset(range(500, 600))
MAX_REPLY_BYTES = 4 * 1024 * 1024
EXCERPT_CHARS = 200
MAX_BACKOFF_S = 60.0

_POOLS: KeyedCache[ThreadPoolExecutor] = KeyedCache()


class JudgeError(RuntimeError):
    """The judge gave no usable score for one sample."""


@dataclass(frozen=True)
class _Endpoint:
    """Where and how requests go: the full URL split for ``http.client``."""

    url: str
    https: bool
    host: str
    port: int | None
    path: str


@dataclass(frozen=True)
class _Reply:
    status: int
    body: bytes
    retry_after: float | None


@batched
async def llm_judge(
    prompts: Sequence[Prompt],
    completions: Sequence[str],
    *,
    base_url: str,
    model: str,
    template: str = DEFAULT_TEMPLATE,
    api_key_env: str | None = None,
    score_regex: str | None = None,
    min_score: float = 0.0,
    max_score: float = 10.0,
    system: str | None = None,
    temperature: float | None = 0.0,
    max_tokens: int | None = None,
    concurrency: int = 8,
    timeout_s: float = 60.0,
    max_retries: int = 3,
    backoff_s: float = 1.0,
) -> list[float | Exception]:
    """``(score - min_score) / (max_score - min_score)`` of each sample as judged by
    ``model`` at ``base_url``, or a :class:`JudgeError` in its place.

    ``score_regex``: where the score is in the reply; the last match counts, read from its
    group ``score`` if it has one, else its first group, else the whole match. Default: the
    last ``Score: N``, else the last number of the reply. ``system``: an optional system
    message. ``temperature``, ``max_tokens``: sent when not None. ``timeout_s``: the
    longest wait for the server to accept the connection or to send the next bytes of its
    reply. ``max_retries``: retries after the first attempt; the n-th waits
    ``backoff_s * 2**n`` seconds, jittered down by up to half, or longer when the server's
    ``Retry-After`` says so (at most 60 s).

    Raises ValueError for settings that cannot work (every sample of the call is an error).
    """
    _check_settings(min_score=min_score, max_score=max_score, concurrency=concurrency,
                    timeout_s=timeout_s, max_retries=max_retries, backoff_s=backoff_s)
    if len(prompts) != len(completions):
        raise ValueError(f"llm_judge: {len(prompts)} prompts but {len(completions)} completions")
    headers = _headers(api_key_env)
    endpoint = _endpoint(base_url, with_key="Authorization" in headers)
    pattern = _compile(score_regex) if score_regex is not None else None
    pool = _POOLS.get((endpoint.url, concurrency),
                      lambda: ThreadPoolExecutor(concurrency, "llm-judge"))
    gate = asyncio.Semaphore(concurrency)

    async def judge_one(prompt: Prompt, completion: str) -> float | Exception:
        try:
            content = fill_template(template, prompt, completion)
            body = _request_body(model, content, system=system, temperature=temperature,
                                 max_tokens=max_tokens)
            reply = await _post_with_retries(endpoint, headers, body, pool=pool, gate=gate,
                                             timeout_s=timeout_s, max_retries=max_retries,
                                             backoff_s=backoff_s)
            score = parse_score(_reply_text(reply, endpoint), pattern)
            return _to_unit(score, min_score=min_score, max_score=max_score)
        except JudgeError as err:
            return JudgeError(f"prompt {prompt.id!r}: {err}")

    return list(await asyncio.gather(*(judge_one(p, c) for p, c in zip(prompts, completions))))


def fill_template(template: str, prompt: Prompt, completion: str) -> str:
    """``template`` with ``{prompt}``, ``{completion}`` and the prompt's meta fields filled.

    ``{prompt}`` is the prompt's text; a conversation is written one message per line as
    ``role: content``, except a lone user message, which is its content alone."""
    fields = {**prompt.meta, "prompt": prompt_text(prompt), "completion": completion}
    try:
        return template.format_map(fields)
    except KeyError as err:
        raise JudgeError(
            f"the template names field {{{err.args[0]}}}, which is neither prompt, completion "
            f"nor a field of this prompt's meta ({sorted(prompt.meta)})"
        ) from None
    except (IndexError, ValueError, AttributeError) as err:
        raise JudgeError(f"the template cannot be filled: {err}") from None


def prompt_text(prompt: Prompt) -> str:
    """The prompt as the judge reads it (see :func:`fill_template`)."""
    if prompt.text is not None:
        return prompt.text
    messages = prompt.messages or []
    if len(messages) == 1 and messages[0].get("role") == "user":
        return messages[0]["content"]
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def parse_score(reply: str, pattern: re.Pattern[str] | None = None) -> float:
    """The score in the judge's ``reply`` (see :func:`llm_judge`); JudgeError if none."""
    if pattern is not None:
        matches = list(pattern.finditer(reply))
        text = _match_text(matches[-1]) if matches else None
    else:
        lines = SCORE_LINE.findall(reply)
        numbers = LAST_NUMBER.findall(reply)
        text = lines[-1] if lines else (numbers[-1] if numbers else None)
    if text is None:
        raise JudgeError(f"no score in the judge's reply {_excerpt(reply)!r}")
    try:
        value = float(text)
    except ValueError:
        raise JudgeError(f"the judge's score {text!r} is not a number") from None
    if not math.isfinite(value):
        raise JudgeError(f"the judge's score {text!r} is not finite")
    return value


def _compile(score_regex: str) -> re.Pattern[str]:
    try:
        return re.compile(score_regex, re.IGNORECASE)
    except re.error as err:
        raise ValueError(
            f"llm_judge: score_regex {score_regex!r} is not a valid regular expression: {err}"
        ) from None


def _match_text(match: re.Match[str]) -> str:
    if "score" in match.re.groupindex:
        return match.group("score")
    return match.group(1) if match.re.groups else match.group(0)


def _to_unit(score: float, *, min_score: float, max_score: float) -> float:
    if not min_score <= score <= max_score:
        raise JudgeError(f"the judge's score {score:g} is outside [{min_score:g}, {max_score:g}]")
    return (score - min_score) / (max_score - min_score)


def _check_settings(*, min_score: float, max_score: float, concurrency: int, timeout_s: float,
                    max_retries: int, backoff_s: float) -> None:
    if not (math.isfinite(min_score) and math.isfinite(max_score) and min_score < max_score):
        raise ValueError(
            f"llm_judge: need finite min_score < max_score, got {min_score} and {max_score}"
        )
    for name, value, low in (("concurrency", concurrency, 1), ("max_retries", max_retries, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"llm_judge: {name} must be an integer >= {low}, got {value!r}")
    if not timeout_s > 0 or not backoff_s >= 0:
        raise ValueError(
            f"llm_judge: need timeout_s > 0 and backoff_s >= 0, got {timeout_s} and {backoff_s}"
        )


def _headers(api_key_env: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if api_key_env is None:
        return headers
    key = os.environ.get(api_key_env, "")
    if not key:
        raise ValueError(
            f"llm_judge: api_key_env names the environment variable {api_key_env!r}, which is "
            f"not set or empty; export it with the judge's API key"
        )
    headers["Authorization"] = f"Bearer {key}"
    return headers


def _endpoint(base_url: str, *, with_key: bool) -> _Endpoint:
    """``{base_url}/chat/completions``, checked: http(s), a host, no key in clear text."""
    parts = urlsplit(base_url.rstrip("/"))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"llm_judge: base_url {base_url!r} is not an http(s) URL with a host "
            f"(e.g. https://api.example.com/v1)"
        )
    if parts.scheme == "http" and with_key and not _is_loopback(parts.hostname):
        raise ValueError(
            f"llm_judge: base_url {base_url!r} is plain http to another machine, which would "
            f"send the API key in clear text; use https, or drop api_key_env for a server "
            f"that needs no key"
        )
    path = f"{parts.path}/chat/completions" + (f"?{parts.query}" if parts.query else "")
    return _Endpoint(
        url=f"{parts.scheme}://{parts.netloc}{path}", https=parts.scheme == "https",
        host=parts.hostname, port=parts.port, path=path,
    )


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _request_body(model: str, content: str, *, system: str | None, temperature: float | None,
                  max_tokens: int | None) -> bytes:
    """The chat-completions request; ``temperature`` and ``max_tokens`` are left out when
    None (some reasoning models reject them)."""
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": content}
    ]
    body: dict[str, Any] = {"model": model, "messages": messages}
    if temperature is not None:
        body["temperature"] = temperature
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return json.dumps(body).encode()


async def _post_with_retries(endpoint: _Endpoint, headers: Mapping[str, str], body: bytes, *,
                             pool: ThreadPoolExecutor, gate: asyncio.Semaphore, timeout_s: float,
                             max_retries: int, backoff_s: float) -> _Reply:
    """The first reply that is not worth retrying, or JudgeError once retries run out.

    The semaphore is held only while a request is in flight, not while backing off. The
    timeout is the socket's (connecting, and waiting for each read), so a request that
    times out also frees its thread; no thread is left behind running an abandoned call."""
    loop = asyncio.get_running_loop()
    for attempt in range(max_retries + 1):
        retry_after = None
        async with gate:
            try:
                reply = await loop.run_in_executor(pool, _post, endpoint, headers, body, timeout_s)
            except ssl.SSLCertVerificationError as err:  # does not go away on retry
                raise JudgeError(f"{endpoint.url}: TLS failed: {err}") from None
            except (OSError, http.client.HTTPException) as err:
                problem = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
                failure = f"request failed ({problem})"
            else:
                if reply.status not in RETRY_STATUSES:
                    return reply
                failure = f"HTTP {reply.status}: {_excerpt(reply.body)!r}"
                retry_after = reply.retry_after
        if attempt == max_retries:
            break
        delay = backoff_s * 2**attempt * random.uniform(0.5, 1.0)
        await asyncio.sleep(min(max(delay, retry_after or 0.0), MAX_BACKOFF_S))
    raise JudgeError(f"{endpoint.url}: {failure} after {max_retries + 1} attempts")


def _post(endpoint: _Endpoint, headers: Mapping[str, str], body: bytes, timeout_s: float) -> _Reply:
    """One blocking POST on a fresh connection (run in the pool's threads)."""
    if endpoint.https:
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            endpoint.host, endpoint.port, timeout=timeout_s, context=ssl.create_default_context()
        )
    else:
        conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=timeout_s)
    try:
        conn.request("POST", endpoint.path, body=body, headers=dict(headers))
        response = conn.getresponse()
        data = response.read(MAX_REPLY_BYTES)
        return _Reply(response.status, data, _retry_after(response.getheader("Retry-After")))
    finally:
        conn.close()


def _retry_after(value: str | None) -> float | None:
    """Seconds of a ``Retry-After`` header in its delta-seconds form (the HTTP-date form is
    ignored: the exponential backoff applies instead)."""
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _reply_text(reply: _Reply, endpoint: _Endpoint) -> str:
    """``choices[0].message.content`` of a chat-completions reply; JudgeError otherwise."""
    if not 200 <= reply.status < 300:
        raise JudgeError(f"{endpoint.url}: HTTP {reply.status}: {_excerpt(reply.body)!r}")
    try:
        data = json.loads(reply.body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise JudgeError(
            f"{endpoint.url}: HTTP {reply.status} with a body that is not JSON: "
            f"{_excerpt(reply.body)!r}"
        ) from None
    try:
        content = data["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        content = None
    if not isinstance(content, str):
        raise JudgeError(
            f"{endpoint.url}: the reply has no choices[0].message.content string: "
            f"{_excerpt(reply.body)!r}"
        )
    return content


def _excerpt(text: str | bytes) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    text = " ".join(text.split())
    return text if len(text) <= EXCERPT_CHARS else text[: EXCERPT_CHARS - 3] + "..."
