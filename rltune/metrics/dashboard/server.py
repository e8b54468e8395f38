"""The dashboard's HTTP server: the page, its static files and a small JSON API over the
run directories it watches. Standard library only (``http.server``).

Pages and files
    ``GET /`` (or ``/index.html``)  the page
    ``GET /static/PATH``           a file under the package's ``static/`` folder; only
                                   ``.html .js .css .svg .png`` files, never a listing,
                                   never a path outside the folder (404)
    ``GET /image?run=ID&path=images/NAME``
                                   an image of a rollout, ``path`` as the run's
                                   ``samples.jsonl`` gives it: only a stored image's name
                                   (``<16 hex digits>.<ext>``), a plain file directly in
                                   that run's ``images/`` folder, never a link (404
                                   otherwise); sent with its image type, cacheable (the
                                   name is the content's digest)

JSON API (every answer is ``application/json`` with ``Cache-Control: no-store``; an error
is ``{"error": "..."}`` with status 400 for a bad request, 404 for an unknown run, 403 for
a run file that is a link leading out of its run directory (never read), 409 for a run
file that exists but cannot be read (a directory, a FIFO, no permission), 413 for a
config over 1 MiB; the message names the file and why. Any method but GET and HEAD is
answered 405 with ``Allow: GET, HEAD``, on any path)
    ``GET /api/runs``
        ``{"now": UNIX_S, "live_window_s": S, "sample_cap": N,
        "roots": [{"path", "runs", "error": TEXT|null}], "runs": [RUN, ...]}`` where
        ``RUN`` is ``{"id", "name", "path", "last_step": INT|null, "last_write":
        UNIX_S|null, "live": BOOL, "files": {"metrics", "samples", "config": BOOL},
        "errors": [TEXT, ...]}``. The folders are looked at again on each call, so a run
        started later appears and one deleted is no longer listed. ``live``: a file of the
        run was written within the last ``live_window_s`` seconds. ``last_step`` comes
        from the last complete line of ``metrics.jsonl``. ``files``: which files exist
        and can be read; ``errors``: ``"FILE: why"`` for each that exists but cannot be
        read (that run only; the others are served). A root's ``error``: what could not
        be looked into (the folder removed, replaced by a file, no permission). Names
        that are not UTF-8 are shown (and run ids made) with ``\\xNN`` for each such byte.
    ``GET /api/metrics?run=ID[&cursor=C]``
        ``{"run", "rows": [ROW, ...], "cursor": C, "reset": BOOL, "more": BOOL,
        "bad_lines": N, "first_bad": TEXT|null}``: the rows of ``metrics.jsonl`` (training
        and evaluation rows as written, non-finite values as null, ``step`` an integer)
        after cursor ``C`` (from the first row
        without one), at most 2000 per answer. Send the returned ``cursor`` (opaque
        text) next time to get only new rows. ``reset: true`` means the file was
        rewritten (a resumed run truncates it) or the server restarted since the cursor
        was handed out: drop what you hold for the run, ``rows`` start from the first
        row again. ``more: true``: more rows are ready, ask again now. A line still
        being written is returned once it is complete. ``bad_lines``: lines skipped,
        among those read for this answer, because they are not JSON objects or have no
        integer ``step`` (``5.0`` counts as 5); ``first_bad``: the first of them, as
        ``line N: why``. The server keeps no metrics rows in memory; each answer parses
        the file from the cursor. A cursor is at most 20 digits after its colon.
    ``GET /api/samples?run=ID[&cursor=C]``
        The same for ``samples.jsonl`` (at most 1000 rows per answer), from the newest
        ``sample_cap`` rows of the run that the server keeps in memory; a cursor older
        than those continues from the oldest row kept.
    ``GET /api/config?run=ID``
        ``{"run", "path", "text": YAML|null}``: the run's ``config.yaml`` as written.
    ``GET /api/keys``
        The metric names the page charts (:func:`rltune.metrics.keys.for_dashboard`), so
        that the page holds no second list of them.

Files are read by byte offset, so a poll reads only what was appended since the last one.

Security
    The server binds 127.0.0.1 unless told otherwise (an IPv6 address may be given in
    brackets, as the dashboard writes it in a URL). Binding any other address needs a
    token (:class:`DashboardError` otherwise) of printable ASCII; ``+ & # %``, which a URL's
    query would change, are written percent-encoded in ``/?token=`` (the start-up lines say
    so). With a token every request must carry it,
    as ``Authorization: Bearer TOKEN`` or as the cookie the page sets: ``GET /?token=TOKEN``
    answers with a redirect to ``/`` that sets an ``HttpOnly; SameSite=Strict`` cookie, so
    the token leaves the address bar and the page's own requests carry it. Anything else
    gets 401. Tokens are compared with :func:`hmac.compare_digest`. Bound to a loopback
    address, the server answers 403 to a request whose ``Host`` header is not a loopback
    name or address, so a web page on another site cannot reach it by pointing a name at
    127.0.0.1 (DNS rebinding). The page is sent with a Content-Security-Policy that allows
    only the server itself. A run's files are read only when they are regular files that
    resolve inside the run directory: a link leading elsewhere is refused (403), so a
    run directory cannot expose other files of this machine.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import socket
import traceback
from collections.abc import Callable, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote

from rltune.metrics import keys
from rltune.metrics.dashboard.errors import DashboardError
from rltune.metrics.dashboard.readers import CursorError, JsonlLog, JsonlTail
from rltune.metrics.dashboard.runs import CONFIG_FILE, Run, RunIndex, shown
from rltune.metrics.images import content_type, resolve_image
from rltune.metrics.jsonl import RunFileError, json_bytes

STATIC_DIR = Path(__file__).parent / "static"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
PAGE_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
PAGE_PATHS = ("/", "/index.html")
COOKIE_PREFIX = "rltune_dashboard_"
"""The cookie is named after the port too: browsers share cookies between the ports of
one host, and two dashboards on one machine must not overwrite each other's."""
TOKEN_ENV = "RLTUNE_DASHBOARD_TOKEN"
MIN_TOKEN_CHARS = 16
TOKEN_URL_CHARS = "+&#%"
"""Characters a token written in ``/?token=...`` must percent-encode: there they mean
something else (a space, the next parameter, the fragment, an escape)."""
METRICS_ROWS_PER_ANSWER = 2000
SAMPLE_ROWS_PER_ANSWER = 1000
LOOPBACK_NAMES = frozenset({"localhost", "localhost."})


class DashboardServer(ThreadingHTTPServer):
    """Serves the dashboard of the runs in ``index``; built by :func:`make_server`, bound
    but not yet serving (call ``serve_forever``)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], index: RunIndex, *, token: str | None,
                 loopback: bool, family: socket.AddressFamily, log: Callable[[str], None] = print) -> None:
        self.address_family = family
        self.index = index
        self.token = token
        self.loopback = loopback
        self.log = log
        self.cookie_value = _cookie_value(token) if token is not None else None
        self.static_dir = STATIC_DIR
        super().__init__(address, _Handler)
        self.cookie_name = f"{COOKIE_PREFIX}{self.port}"

    def server_bind(self) -> None:
        """Bind without the reverse name lookup ``HTTPServer`` does (it can stall for
        seconds on a machine without DNS)."""
        super(ThreadingHTTPServer, self).server_bind()  # TCPServer.server_bind
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    @property
    def port(self) -> int:
        """The port listened on (the one picked when 0 was asked for)."""
        return int(self.server_address[1])

    @property
    def url(self) -> str:
        """Where to open the page. For a wildcard address (0.0.0.0, ::) this is the
        loopback address of that family; other machines use this machine's address."""
        host = str(self.server_address[0])
        if host in ("0.0.0.0", ""):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/"


def make_server(run_dirs: Sequence[Path], *, host: str = "127.0.0.1", port: int = 8765,
                token: str | None = None, max_samples: int = 5000, live_window_s: float = 60.0,
                log: Callable[[str], None] = print) -> DashboardServer:
    """A dashboard server for ``run_dirs`` (run directories or folders of them), bound to
    ``host:port`` (port 0 picks a free one) but not serving yet.

    A token is required unless ``host`` is a loopback address. ``max_samples``: newest
    rollouts kept in memory per run. ``live_window_s``: a run written to within this many
    seconds is shown as live. ``log`` receives request errors."""
    if not 0 <= port <= 65535:
        raise DashboardError(f"port {port} is not a port number (0-65535; 0 picks a free one)")
    if host.startswith("[") and host.endswith("]"):  # an IPv6 address as a URL writes it
        host = host[1:-1]
    if token is not None:
        _check_token(token)
    loopback = _is_loopback(host)
    if not loopback and token is None:
        raise DashboardError(
            f"binding to {host} exposes the runs to other machines; it needs --token or "
            f"{TOKEN_ENV} (or bind 127.0.0.1 and use an SSH tunnel)")
    index = RunIndex(run_dirs, max_samples=max_samples, live_window_s=live_window_s)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return DashboardServer((host, port), index, token=token, loopback=loopback, family=family, log=log)
    except OSError as err:
        raise DashboardError(f"cannot listen on {host}:{port}: {err.strerror or err}"
                             " (pick another --port; 0 picks a free one)") from None


def serve(run_dirs: Sequence[Path], *, host: str = "127.0.0.1", port: int = 8765,
          token: str | None = None, log: Callable[[str], None] = print) -> None:
    """Serve the dashboard of ``run_dirs`` until Ctrl-C, printing where to open it."""
    server = make_server(run_dirs, host=host, port=port, token=token, log=log)
    log(f"rltune dashboard: {server.url}")
    for root in server.index.roots():
        count = f"{root.runs} run{'s' if root.runs != 1 else ''}" if root.runs else "no runs yet"
        log(f"  watching {root.path} ({count})")
    if not server.loopback:
        log(f"  from other machines: http://THIS-MACHINE:{server.port}/")
    if token is not None:
        log("  token required: open the page once as /?token=TOKEN, or send 'Authorization: Bearer TOKEN'")
        if any(ch in TOKEN_URL_CHARS for ch in token):
            log("  the token holds + & # or %: in /?token= write them as %2B %26 %23 %25")
    for root in server.index.roots():
        if root.error:
            log(f"  warning: {root.error}")
    log("  press Ctrl-C to stop")
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        log("dashboard stopped")
    finally:
        server.server_close()


def _check_token(token: str) -> None:
    if len(token) < MIN_TOKEN_CHARS:
        raise DashboardError(
            f"the dashboard token is {len(token)} characters long; use at least {MIN_TOKEN_CHARS} "
            "(for example: python -c 'import secrets; print(secrets.token_urlsafe())')")
    if not token.isascii() or not token.isprintable() or any(ch.isspace() for ch in token):
        raise DashboardError("the dashboard token must be printable ASCII without spaces")


def _is_loopback(host: str) -> bool:
    """Whether every address ``host`` stands for is a loopback one."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror as err:
        raise DashboardError(f"cannot bind {host!r}: not an address this machine knows ({err})") from None
    return all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def _cookie_value(token: str) -> str:
    """What the cookie holds: derived from the token, so the token itself is not stored."""
    return hmac.new(token.encode(), b"rltune dashboard cookie", hashlib.sha256).hexdigest()


def _cookie_value_in(header: str, name: str) -> str | None:
    """The value of cookie ``name`` in a ``Cookie`` header; cookies of other sites on the
    same host, well-formed or not, are passed over."""
    for part in header.split(";"):
        key, sep, value = part.strip().partition("=")
        if sep and key == name:
            return value
    return None


def _host_is_loopback(header: str | None) -> bool:
    """Whether a ``Host`` header names a loopback host (``localhost``, ``127.x.y.z``,
    ``[::1]``), with or without a port."""
    if not header:
        return False
    host = header.strip().lower()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _BadRequest(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Handler(BaseHTTPRequestHandler):
    server: DashboardServer
    protocol_version = "HTTP/1.1"
    timeout = 120  # seconds a kept-alive connection may stay idle before it is closed
    server_version = "rltune-dashboard"
    sys_version = ""

    def do_GET(self) -> None:
        self._handle(head=False)

    def do_HEAD(self) -> None:
        self._handle(head=True)

    def _not_allowed(self) -> None:
        """405 with ``Allow: GET, HEAD`` (http.server would answer 501 with an HTML page).
        The connection is closed: the request's body, if any, is not read."""
        self._head = self.command == "HEAD"
        self.close_connection = True
        body = {"error": f"method {self.command} is not allowed: the dashboard only reads (GET, HEAD)"}
        data = json.dumps(body).encode("utf-8")
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, data, "application/json; charset=utf-8",
                   {"Allow": "GET, HEAD", "Cache-Control": "no-store", "Connection": "close"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _not_allowed

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: no line per request."""

    def _handle(self, *, head: bool) -> None:
        self._head = head
        path, _, query = self.path.partition("?")
        try:
            if self.server.loopback and not _host_is_loopback(self.headers.get("Host")):
                self._text(HTTPStatus.FORBIDDEN, "forbidden: this dashboard answers only requests "
                           "addressed to localhost or a loopback address\n")
                return
            if self.server.token is not None and not self._authorized(path, query):
                return
            self._route(path, parse_qs(query, keep_blank_values=True))
        except _BadRequest as err:
            self._json({"error": str(err)}, err.status)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception:  # a bug: answer 500 and say where, keep serving
            self.server.log(f"dashboard: error answering {self.path!r}:\n{traceback.format_exc()}")
            self._text(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error; see the dashboard's console\n")

    def _authorized(self, path: str, query: str) -> bool:
        """True if the request carries the token; otherwise answers it (401, or the
        redirect that sets the cookie) and returns False."""
        token = self.server.token
        assert token is not None and self.server.cookie_value is not None
        given_in_url = parse_qs(query).get("token", [""])[0]
        if path in PAGE_PATHS and given_in_url and _same(given_in_url, token):
            self._redirect_setting_cookie()  # even with the cookie: the token leaves the URL
            return False
        scheme, _, given = (self.headers.get("Authorization") or "").partition(" ")
        if scheme.lower() == "bearer" and _same(given.strip(), token):
            return True
        cookie = _cookie_value_in(self.headers.get("Cookie") or "", self.server.cookie_name)
        if cookie is not None and _same(cookie, self.server.cookie_value):
            return True
        self._text(HTTPStatus.UNAUTHORIZED,
                   "unauthorized: this dashboard needs its token (open /?token=TOKEN once, "
                   "or send 'Authorization: Bearer TOKEN')\n",
                   extra={"WWW-Authenticate": 'Bearer realm="rltune dashboard"'})
        return False

    def _redirect_setting_cookie(self) -> None:
        cookie = f"{self.server.cookie_name}={self.server.cookie_value}; Path=/; HttpOnly; SameSite=Strict"
        self._send(HTTPStatus.SEE_OTHER, b"", "text/plain; charset=utf-8",
                   {"Location": "/", "Set-Cookie": cookie, "Cache-Control": "no-store"})

    def _route(self, path: str, params: dict[str, list[str]]) -> None:
        if path in PAGE_PATHS:
            self._static("index.html", page=True)
        elif path.startswith("/static/"):
            self._static(unquote(path[len("/static/"):]))
        elif path == "/image":
            self._image(self._run(params), _param(params, "path") or "")
        elif path == "/api/runs":
            self._json(self.server.index.summaries())
        elif path == "/api/keys":
            self._json(keys.for_dashboard())
        elif path == "/api/metrics":
            run = self._run(params)
            self._json(self._rows(run.id, run.metrics, params, METRICS_ROWS_PER_ANSWER))
        elif path == "/api/samples":
            run = self._run(params)
            self._json(self._rows(run.id, run.samples, params, SAMPLE_ROWS_PER_ANSWER))
        elif path == "/api/config":
            run = self._run(params)
            try:
                text = run.config_text()
            except DashboardError as err:
                raise _BadRequest(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, str(err)) from None
            except RunFileError as err:
                raise _file_error(err) from None
            self._json({"run": run.id, "path": shown(str(run.path / CONFIG_FILE)), "text": text})
        elif path.startswith("/api/"):
            raise _BadRequest(HTTPStatus.NOT_FOUND,
                              f"no API {path}; there are /api/runs, /api/metrics, /api/samples, /api/config, /api/keys")
        else:
            self._text(HTTPStatus.NOT_FOUND, "not found\n")

    def _run(self, params: dict[str, list[str]]) -> Run:
        run_id = _param(params, "run")
        if run_id is None:
            raise _BadRequest(HTTPStatus.BAD_REQUEST, "missing ?run=ID (ids are listed by /api/runs)")
        try:
            return self.server.index.get(run_id)
        except KeyError as err:
            raise _BadRequest(HTTPStatus.NOT_FOUND, err.args[0]) from None

    @staticmethod
    def _rows(run_id: str, reader: JsonlLog | JsonlTail, params: dict[str, list[str]], limit: int) -> dict[str, Any]:
        try:
            chunk = reader.read(_param(params, "cursor"), limit=limit)
        except CursorError as err:
            raise _BadRequest(HTTPStatus.BAD_REQUEST, str(err)) from None
        except RunFileError as err:
            raise _file_error(err) from None
        return {"run": run_id, "rows": chunk.rows, "cursor": chunk.cursor, "reset": chunk.reset,
                "more": chunk.more, "bad_lines": chunk.bad_lines, "first_bad": chunk.first_bad}

    def _static(self, relative: str, *, page: bool = False) -> None:
        """A file under the static folder; 404 for anything that is not a plain file of
        a served type inside it (directories, hidden files, ``..``, backslashes, links
        that lead out of it)."""
        parts = relative.split("/")
        unsafe = any(part in ("", ".", "..") or part.startswith(".") or "\\" in part or "\x00" in part
                     for part in parts)
        root = self.server.static_dir.resolve()
        target = (root / relative).resolve() if not unsafe else root
        if unsafe or not target.is_relative_to(root) or not target.is_file() or target.suffix not in CONTENT_TYPES:
            self._text(HTTPStatus.NOT_FOUND, "not found\n")
            return
        headers = {"Cache-Control": "no-cache"}
        if page:
            headers.update({"Content-Security-Policy": PAGE_CSP, "X-Frame-Options": "DENY",
                            "Cache-Control": "no-store"})
        self._send(HTTPStatus.OK, target.read_bytes(), CONTENT_TYPES[target.suffix], headers)

    def _image(self, run: Run, relative: str) -> None:
        """A stored image of ``run`` (:func:`rltune.metrics.images.resolve_image`); 404 for
        any other path."""
        target = resolve_image(run.path, relative)
        try:
            data = target.read_bytes() if target is not None else None
        except OSError:  # removed since
            data = None
        if target is None or data is None:
            self._text(HTTPStatus.NOT_FOUND, "not found\n")
            return
        self._send(HTTPStatus.OK, data, content_type(target),
                   {"Cache-Control": "private, max-age=86400, immutable"})

    def _json(self, body: Any, status: HTTPStatus = HTTPStatus.OK) -> None:
        # a lone surrogate read back from samples.jsonl is sent as its JSON escape
        data = json_bytes(body, separators=(",", ":"), allow_nan=False)
        self._send(status, data, "application/json; charset=utf-8", {"Cache-Control": "no-store"})

    def _text(self, status: HTTPStatus, text: str, *, extra: dict[str, str] | None = None) -> None:
        headers = {"Cache-Control": "no-store", **(extra or {})}
        self._send(status, text.encode("utf-8"), "text/plain; charset=utf-8", headers)

    def _send(self, status: HTTPStatus, body: bytes, content_type: str, headers: dict[str, str]) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if not self._head:
            self.wfile.write(body)


def _file_error(err: RunFileError) -> _BadRequest:
    """A run file that is not served: 403 for a link out of the run directory, 409 for a
    file that cannot be read; the message names the file (by its name) and why."""
    status = HTTPStatus.FORBIDDEN if err.outside else HTTPStatus.CONFLICT
    return _BadRequest(status, f"{shown(err.path.name)}: {err.reason}")


def _param(params: dict[str, list[str]], name: str) -> str | None:
    values = params.get(name)
    return values[0] if values else None


def _same(given: str, expected: str) -> bool:
    """Constant-time comparison of two strings."""
    return hmac.compare_digest(given.encode("utf-8", errors="surrogateescape"), expected.encode("utf-8"))

