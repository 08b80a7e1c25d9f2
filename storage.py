"""
Where files live: a local path, or an object in a bucket (s3://bucket/key, gs://bucket/key) read and written
through fsspec (s3fs, gcsfs: optional packages, needed only for bucket paths). Every function takes either.

What a bucket has and a disk has not, and what follows for callers:
- no rename, no append, no directories: a "directory" is a key prefix; makedirs is a no-op; ls lists a prefix;
- an object appears whole when its upload completes, or not at all: write_bytes is atomic on both (locally: a
  temporary file, then os.replace of that one file; a directory is never renamed);
- requests are throttled (429, 503 SlowDown) and connections reset: each call here is retried with exponential
  backoff (reads: s3fs, gcsfs and botocore retry their own requests too; uploads: botocore and s3fs try each request
  once, our retry is theirs, and a request unanswered for STALL_S is abandoned);
- an endpoint that stops answering (a partition, a frozen server) must not hang a run: every call has one deadline,
  its attempts and the clients' own retries together (deadline(): from STALL_S, plus the bytes it moves), and then
  fails in one sentence; a signal that comes while the main thread waits on a call ends the wait (Interrupted);
- a URL names one prefix however it is typed (normal: doubled and trailing slashes, the scheme's case), and
  [ ] * ? in it are names, never patterns (fsspec's glob and rm would expand them).
Endpoints and credentials come only from the standard places: AWS_ENDPOINT_URL, the other AWS_* variables or
~/.aws for S3; STORAGE_EMULATOR_HOST or application default credentials (gcloud, GOOGLE_APPLICATION_CREDENTIALS,
a VM's service account) for GCS.
"""

import builtins
import contextlib
import errno
import functools
import importlib.util
import json
import os
import random
import re
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

PACKAGES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}  # the schemes we read and write, and who serves each
RETRIES = 6  # attempts of one call on a transient error
BACKOFF = 0.25  # seconds before the first retry, doubled before each next one (with jitter)
# The most a call whose answer is small (a listing, a probe, a ranged read) may take, its attempts together: an
# endpoint that is down, or that takes connections and never answers, would otherwise hold each attempt for the
# clients' own timeouts times their own retries (s3fs x botocore: ~7 minutes; gcsfs: longer).
FIRST_CONTACT = 30  # seconds: a run's first look at a bucket (check_bucket): a mistyped endpoint said at once
SLOWEST_RATE = 2**20  # bytes/s: the slowest transfer a deadline still waits for (a big object's share of it)


class StorageError(OSError):
    """A bucket path that cannot work as given: said in one sentence (the programs print it and stop)."""


class Interrupted(StorageError):
    """A signal came while the main thread waited on storage: the wait was abandoned (the handler raised this)."""


def is_url(path):
    return re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", str(path)) is not None


def scheme(url):
    return str(url).split("://", 1)[0].lower()


def normal(url):
    """url as every call here names it: the scheme in lower case, no empty key segment (a doubled or trailing slash),
    so that s3://b//runs/a/ and s3://b/runs/a are one prefix (s3fs and gcsfs each keep some of those slashes and drop
    others, so a URL typed with them was listed in one place and read from another)."""
    kind, rest = str(url).split("://", 1)
    return f"{kind.lower()}://{'/'.join(part for part in rest.split('/') if part)}"


def canonical(path):
    """path however it is typed, as one string: a URL normal, a local path without ./, // or a trailing slash."""
    return normal(path) if is_url(path) else os.path.normpath(str(path))


def join(base, *names):
    """base/names: a Path for a local base, a URL (str, normal) for a bucket."""
    if is_url(base):
        return normal("/".join([str(base), *map(str, names)]))
    return Path(base, *names)


def name(path):
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def parent(path):
    return str(path).rstrip("/").rsplit("/", 1)[0] if is_url(path) else Path(path).parent


# -----------------------------------------------------------------------------
# the filesystem of a URL: package, endpoint and credentials checked once, each with a sentence


STALL_S = 60.0  # a request (a part of an upload included) with no answer this long is abandoned (train.py sets it
# from storage_stall_s)


def deadline(nbytes=0):
    """The most one operation may take, its attempts and the clients' own retries together: one request left
    unanswered for STALL_S and one more try, plus the bytes it moves at SLOWEST_RATE. Without it, a frozen endpoint
    held a lease refresh for 20 minutes (s3fs's retries x botocore's x ours, each waiting out a read timeout)."""
    return 2 * STALL_S + nbytes / SLOWEST_RATE


# Per thread: the latest moment any call may still wait until (within()), and whether the main thread is in a call
# now (a signal handler asks waiting_now(): train.py's raises Interrupted there, so that a signal always wins)
LIMITS, WAITS = threading.local(), [0]


@contextlib.contextmanager
def within(seconds):
    """Every call made inside takes at most `seconds` from now, all together (a run that is ending: its lease removed,
    its last words written, however the storage answers)."""
    before = getattr(LIMITS, "until", None)
    LIMITS.until = min(before or float("inf"), time.monotonic() + seconds)
    try:
        yield
    finally:
        LIMITS.until = before


@contextlib.contextmanager
def waiting():
    main = threading.current_thread() is threading.main_thread()
    WAITS[0] += main
    try:
        yield
    finally:
        WAITS[0] -= main


def waiting_now():
    """Whether the main thread is waiting on storage at this moment (asked from a signal handler)."""
    return WAITS[0] > 0


def options(url, one_attempt=False):
    """fsspec options for url's filesystem (also what DCP's FsspecWriter/Reader take): credentials, and each
    request's wait bounded by STALL_S. one_attempt (uploads: write_bytes and upload, retried by call(); a
    checkpoint's shards, written again as a whole by the Checkpointer): botocore tries each request once (s3fs's own
    loop: one_attempt_only). gcsfs's retries are fixed where its class is defined (six attempts of a 5xx); a request
    it timed out it does not try again."""
    if scheme(url) in ("gs", "gcs"):  # the emulator takes no credentials; otherwise ADC only, never anonymous
        return {"token": "anon" if os.environ.get("STORAGE_EMULATOR_HOST") else "google_default",
                "requests_timeout": STALL_S}
    config = {"connect_timeout": min(STALL_S, 30.0), "read_timeout": STALL_S}
    if one_attempt:
        return {"config_kwargs": config | {"retries": {"total_max_attempts": 1}}}
    return {"config_kwargs": config}


def one_attempt_only(fs, url):
    """fs (made with options(url, one_attempt=True), used by nothing else) tries each request once: s3fs's retry
    loop reads the instance's `retries`, which its constructor does not take."""
    if scheme(url) == "s3":
        fs.retries = 1


def written(url):
    """After a write through the one-attempt filesystem: the other (reads, listings) forgets what it had listed, so
    that it sees the new object (its size and ETag) and not a cached one."""
    filesystem(url).invalidate_cache()


STALL_TYPES = {"ReadTimeoutError", "ConnectTimeoutError", "TimeoutError", "FSTimeoutError", "ServerTimeoutError"}


def stalled(e):
    """A request that had no answer in STALL_S (its client gave up on it): abandoned, not tried again."""
    return any({c.__name__ for c in type(err).__mro__} & STALL_TYPES for err in causes(e))


def filesystem(url, one_attempt=False):
    """url's fsspec filesystem (fsspec keeps one instance per options and process). one_attempt: the one our writes
    use, whose clients try each request once (options), our call() being their retry."""
    kind = scheme(url)
    if kind not in PACKAGES:
        raise StorageError(f"{url}: unknown storage scheme '{kind}://': use a local path, s3://bucket/... or "
                           f"gs://bucket/...")
    package = PACKAGES[kind]
    check_endpoint_form(url)
    if importlib.util.find_spec(package) is None:
        raise StorageError(f"{url}: {kind}:// paths need the {package} package: pip install {package}")
    if package == "gcsfs" and os.environ.get("STORAGE_EMULATOR_HOST"):
        # gcsfs's hierarchical-namespace probe costs ~60 s a bucket against a plain-HTTP emulator
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    import fsspec

    try:
        with CREATING:
            fs = fsspec.filesystem(kind, **options(url, one_attempt))
            if one_attempt:
                one_attempt_only(fs, url)
            return fs
    except Exception as e:  # noqa: BLE001  gcsfs looks for credentials here
        if (plain := plain_error(e, url)) is not None:
            raise plain from None
        raise


# Forks (DataLoader workers): fsspec forgets the parent's filesystems in a child and makes new ones there, and the
# clean-up of a forgotten one would run on the child's event loop and print "attached to a different loop"
# tracebacks; the child keeps the copies it inherits (INHERITED), unused. CREATING serialises making one, which fsspec
# does not: threads that ask at once (ranged reads) would each make their own.
INHERITED, CREATING = [], threading.Lock()


def before_fork():
    classes = [getattr(sys.modules[package], name)
               for package, name in (("s3fs", "S3FileSystem"), ("gcsfs", "GCSFileSystem")) if package in sys.modules]
    INHERITED[:] = [fs for cls in classes for fs in list(cls._cache.values())]  # list(): one step, as threads add more


def after_fork_in_child():
    global CREATING
    CREATING = threading.Lock()  # a parent's thread may have held it at the fork


os.register_at_fork(before=before_fork, after_in_child=after_fork_in_child)


def bucket(url):
    return str(url).split("://", 1)[1].split("/", 1)[0]


def key(url):
    """The path within the filesystem, as fsspec names it: bucket/key."""
    return normal(url).split("://", 1)[1]


def check_key(url):
    """A StorageError when url's key cannot be addressed as named. Every other character a bucket key may hold works
    (:: spaces # ? % [ ] = + and unicode: fsspec's URL parsing is never asked, its patterns are escaped), but s3fs
    cuts a key at ?versionId= (the rest is an object version to it, whatever version_aware says)."""
    if scheme(url) == "s3" and "?versionId=" in key(url):
        cut = key(url).partition("?versionId=")[0]
        raise StorageError(f"{url}: s3fs reads ?versionId= in a key as an object version, so this one would be read "
                           f"and written as s3://{cut}; name it without ?versionId=")


# -----------------------------------------------------------------------------
# retries and errors


TRANSIENT_TYPES = {"ConnectionError", "ClientConnectionError", "ServerDisconnectedError", "ClientPayloadError",
                   "EndpointConnectionError", "ConnectionClosedError", "IncompleteRead", "ProtocolError",
                   "ReadTimeoutError", "TimeoutError"}
# (s3fs turns SlowDown into OSError(EBUSY, "Please reduce your request rate."): all a rank's failure keeps once DCP
# has pickled it to gather it, its cause dropped)
TRANSIENT_TEXT = re.compile(r"SlowDown|reduce your request rate|Throttl|TooManyRequests|Too Many Requests|"
                            r"Service Unavailable|RequestTimeout|InternalError|\b(429|500|502|503|504)\b")


def causes(e):
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


def transient(e):
    """Throttling (429, 503 SlowDown), a server error or a dropped connection: worth trying again."""
    for err in causes(e):
        if isinstance(err, (FileNotFoundError, PermissionError, StorageError)):
            return False
        if {c.__name__ for c in type(err).__mro__} & TRANSIENT_TYPES:
            return True
        if getattr(err, "code", None) in (429, 500, 502, 503, 504) or TRANSIENT_TEXT.search(str(err)):
            return True
    return False


def plain_error(e, path):
    """A StorageError sentence for the errors a user can fix (credentials, a bucket that is not there), else None."""
    text = " ".join(f"{type(err).__name__}: {err}" for err in causes(e))
    if re.search(r"NoCredentialsError|Unable to locate credentials|PartialCredentialsError", text):
        return StorageError(f"{path}: no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                            f"AWS_PROFILE with ~/.aws/credentials")
    google = {type(err).__name__: " ".join(str(err).split())[:200] for err in causes(e)}
    if "DefaultCredentialsError" in google and os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
        return StorageError(f"{path}: GOOGLE_APPLICATION_CREDENTIALS={os.environ['GOOGLE_APPLICATION_CREDENTIALS']} "
                            f"cannot be used ({google['DefaultCredentialsError']}): point it at a service account key, "
                            f"or unset it and run `gcloud auth application-default login`")
    if "DefaultCredentialsError" in google:
        return StorageError(f"{path}: no Google credentials: run `gcloud auth application-default login`, or set "
                            f"GOOGLE_APPLICATION_CREDENTIALS to a service account key")
    if "RefreshError" in google:
        return StorageError(f"{path}: the Google credentials were refused ({google['RefreshError']}): a key revoked "
                            f"or of another project? Check GOOGLE_APPLICATION_CREDENTIALS, or run `gcloud auth "
                            f"application-default login` again")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    named = f"AWS_REGION={region}" if os.environ.get("AWS_REGION") else f"AWS_DEFAULT_REGION={region}" if region else \
        "the default region"
    if "InvalidRegionError" in google:
        return StorageError(f"{path}: {named} is not a region name ({google['InvalidRegionError']})")
    if m := re.search(r"AuthorizationHeaderMalformed.*?expecting '([\w-]+)'|PermanentRedirect|IllegalLocationConstraint"
                      r"|\b301\b|x-amz-bucket-region: ([\w-]+)", text):
        there = next((g for g in m.groups() if g), None)
        return StorageError(f"{path}: bucket '{bucket(path)}' is in {f'region {there}' if there else 'another region'}, "
                            f"not {named}: set AWS_REGION={there or '<its region>'}")
    if re.search(r"NoSuchBucket|specified bucket does not exist", text):
        return StorageError(f"{path}: bucket '{bucket(path)}' does not exist (create it first, or check its name)")
    if re.search(r"InvalidAccessKeyId|SignatureDoesNotMatch|AccessDenied|\b403\b|Forbidden", text):
        return StorageError(f"{path}: access denied ({text.splitlines()[0][:200]}); check the credentials and the "
                            f"bucket's permissions")
    return None


def call(path, fn, *args, seconds, **kwargs):
    """fn(*args, **kwargs), retried with exponential backoff while it fails transiently; an error the user can fix
    becomes a StorageError that says how. seconds: the most its attempts may take together (fn: a method of an
    fsspec async filesystem, whose sync wrapper takes a timeout and cancels the request when it is up); None for
    opening a stream (no such wrapper; each request is still bounded by STALL_S)."""
    if is_url(path):  # whatever the operation (a tokenizer read too): never an object other than the one named
        check_key(path)
    t0, said = time.monotonic(), None
    until = getattr(LIMITS, "until", None)
    if until is not None and seconds is not None:
        seconds = max(min(seconds, until - t0), 0.1)
    for attempt in range(RETRIES):
        left = None if seconds is None else seconds - (time.monotonic() - t0)
        try:
            with waiting():
                return fn(*args, **kwargs) if left is None else fn(*args, **kwargs, timeout=max(left, 0.1))
        except Interrupted:
            raise
        except Exception as e:  # noqa: BLE001  whatever the filesystem raises: sorted below
            said = e if str(e) or said is None else said  # fsspec's timeout says nothing: the error before it does
            pause = BACKOFF * 2**attempt * random.uniform(0.5, 1.0)
            in_time = seconds is None or time.monotonic() + pause - t0 < seconds - 1
            if attempt + 1 < RETRIES and transient(e) and in_time:
                with waiting():
                    time.sleep(pause)
                continue
            if not is_url(path):
                raise
            if (plain := plain_error(e, path)) is not None:
                raise plain from None
            if transient(e):
                reason = " ".join(str(said).split())[:200] or "no answer in time"
                raise StorageError(f"{path}: still failing after {attempt + 1} attempt{'s' if attempt else ''} in "
                                   f"{time.monotonic() - t0:.0f} s ({type(said).__name__}: {reason}) at "
                                   f"{endpoint(path)}") from e
            if isinstance(e, FileNotFoundError) and not bucket_exists(path):  # gcsfs names only the URL it used
                raise StorageError(f"{path}: bucket '{bucket(path)}' does not exist (create it first, or check its "
                                   f"name)") from None
            if isinstance(e, FileNotFoundError):  # s3fs says bucket/key, gcsfs its request's URL
                raise FileNotFoundError(f"{normal(path)}: no such object") from None
            raise


def endpoint(url):
    """Where url's requests go, and who said so: for a sentence."""
    if found := endpoint_variable(url):
        return f"{found[1]} ({found[0]})"
    return "the S3 endpoint" if scheme(url) == "s3" else "storage.googleapis.com"


def endpoint_variable(url):
    """(name, value) of the variable that moves url's requests to another endpoint, or None."""
    names = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL") if scheme(url) == "s3" else ("STORAGE_EMULATOR_HOST",)
    named = next((name for name in names if os.environ.get(name)), None)
    return (named, os.environ[named]) if named else None


def check_endpoint_form(url):
    """An endpoint variable that botocore or gcsfs would take apart later, in a traceback (botocore: 'Invalid
    endpoint'), or silently read another way (gcsfs puts http:// before a bare host:port): said here, naming it."""
    if not (found := endpoint_variable(url)):
        return
    name, value = found
    if not re.match(r"https?://", value, re.IGNORECASE):
        bare = re.sub(r"^[A-Za-z][A-Za-z0-9+.-]*:/*", "", value) if re.match(r"[A-Za-z]+:/", value) else value
        raise StorageError(f"{name}={value}: an endpoint needs its scheme: set {name}=http://{bare} (or https://...)")
    if not re.fullmatch(r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._~-]+)(:\d{1,5})?(/\S*)?", value, re.IGNORECASE):
        raise StorageError(f"{name}={value}: not an endpoint URL (expected http(s)://host[:port][/path])")


def check_endpoint_host(url):
    """An endpoint whose host does not resolve: said at start (the clients would retry it as a dropped connection)."""
    if not (found := endpoint_variable(url)):
        return
    name, value = found
    host = re.match(r"https?://(\[[^]]+\]|[^:/]+)", value, re.IGNORECASE).group(1).strip("[]")
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as e:
        raise StorageError(f"{name}={value}: unknown host '{host}' ({e.strerror if hasattr(e, 'strerror') else e})") \
            from None


def bucket_exists(url):
    try:
        return filesystem(url).exists(bucket(url), timeout=FIRST_CONTACT)
    except Exception:  # noqa: BLE001  unknown: let the caller's own error stand
        return True


def check_google_credentials(url):
    """gcsfs takes a refused token for a server error and retries it for a minute: one token asked for says why."""
    import google.auth
    from google.auth.transport.requests import Request

    try:
        credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/devstorage.read_write"])
        credentials.refresh(functools.partial(Request(), timeout=FIRST_CONTACT))
    except Exception as e:  # noqa: BLE001  google-auth's kinds, and the transport's
        if (plain := plain_error(e, url)) is not None:
            raise plain from None
        raise StorageError(f"{url}: no Google access token ({type(e).__name__}: {' '.join(str(e).split())[:200]})") \
            from None


def check_bucket(url):
    """Stop early, in one sentence, when url's bucket is not there or these credentials cannot reach it."""
    check_endpoint_form(url)
    check_endpoint_host(url)
    if PACKAGES.get(scheme(url)) == "gcsfs" and not os.environ.get("STORAGE_EMULATOR_HOST"):
        filesystem(url)  # the package there, first
        check_google_credentials(url)
    try:  # s3fs's exists(bucket) says False for any failure, missing credentials included: a listing tells them apart
        call(url, filesystem(url).ls, key(url), detail=False, seconds=FIRST_CONTACT)
    except FileNotFoundError:  # a new prefix in a bucket that is there (call() names a missing bucket)
        pass


# -----------------------------------------------------------------------------
# the operations


def exists(path):
    if not is_url(path):
        return Path(path).exists()
    fs = filesystem(path)
    fs.invalidate_cache(key(path))  # another process (a rank, a host) may have written it since we looked
    return call(path, fs.exists, key(path), seconds=deadline())


def is_object(path):
    """Whether a bucket URL names an object (a file), not a prefix: a write "under" it would make object/... keys beside
    it, where a local path that is a file is refused by the file system itself."""
    if not is_url(path):
        return Path(path).is_file()
    fs = filesystem(path)
    fs.invalidate_cache(key(path))
    return call(path, fs.isfile, key(path), seconds=deadline())


def refuse_object(path, what):
    """A StorageError when path (an output folder or prefix) names an existing file or object."""
    if is_object(path):
        raise StorageError(f"{what} {path}: an existing {'object' if is_url(path) else 'file'}, not a folder or prefix; "
                           f"give a folder (a prefix in a bucket) to write into")


def size(path):
    return Path(path).stat().st_size if not is_url(path) else call(path, filesystem(path).size, key(path),
                                                                   seconds=deadline())


def ls(path):
    """The names directly under path (files and sub-folders / prefixes), sorted; [] when there is none."""
    if not is_url(path):
        return sorted(p.name for p in Path(path).iterdir()) if Path(path).is_dir() else []
    fs = filesystem(path)
    fs.invalidate_cache(key(path))
    try:
        found = call(path, fs.ls, key(path), detail=False, seconds=deadline())
    except FileNotFoundError:
        return []
    return sorted({name(p) for p in found if p.rstrip("/") != key(path)})  # S3: an object and a prefix may share one


def file_sizes(path):
    """{name: bytes} of the files directly under path, from one listing (a bucket answers it in one request, where
    asking each object's size would be a request each)."""
    if not is_url(path):
        return {p.name: p.stat().st_size for p in Path(path).iterdir() if p.is_file()} if Path(path).is_dir() else {}
    fs = filesystem(path)
    fs.invalidate_cache(key(path))
    try:
        found = call(path, fs.ls, key(path), detail=True, seconds=deadline())
    except FileNotFoundError:
        return {}
    return {name(e["name"]): e["size"] for e in found if e["type"] == "file" and e["name"].rstrip("/") != key(path)}


def glob(path, pattern):
    """The paths under path that match pattern ('step-*/manifest.json'), as join(path, ...) gives them."""
    if not is_url(path):
        return sorted(Path(path).glob(pattern))
    fs = filesystem(path)
    fs.invalidate_cache(key(path))
    prefix = key(path) + "/"
    # a prefix is a name, even with [ * ? in it
    found = call(path, fs.glob, escape_glob(prefix) + pattern, seconds=deadline())
    return [join(path, p[len(prefix):]) for p in sorted(found)]


def escape_glob(name):
    """name as a glob pattern that matches name alone."""
    return re.sub(r"([*?[])", r"[\1]", name)


def makedirs(path):
    """A local folder and its parents; nothing on a bucket (its folders are key prefixes)."""
    if not is_url(path):
        Path(path).mkdir(parents=True, exist_ok=True)


def rm(path, recursive=False):
    """Remove a file or object (a folder or prefix with recursive=True); nothing when there is none."""
    if not is_url(path):
        p = Path(path)
        if p.is_dir() and not p.is_symlink() and recursive:
            for _ in range(3):  # another process (a zombie still writing its step) may add or remove files meanwhile
                shutil.rmtree(p, onerror=gone_or_refilled)
                if not p.exists():
                    break
        elif p.is_dir() and not p.is_symlink():
            p.rmdir()
        else:
            p.unlink(missing_ok=True)
        return
    fs = filesystem(path)
    try:  # fsspec's rm expands [ * ? as a pattern: removing data[1] would remove data1
        call(path, fs.rm, escape_glob(key(path)), recursive=recursive, seconds=deadline())
    except FileNotFoundError:
        pass
    fs.invalidate_cache(key(path))


def gone_or_refilled(function, path, exc_info):
    """rmtree's onerror: a file that vanished, or a folder that filled again, is not an error (the loop looks again)."""
    if not isinstance(exc_info[1], FileNotFoundError) and getattr(exc_info[1], "errno", None) != errno.ENOTEMPTY:
        raise exc_info[1]


def open(path, mode="rb"):  # noqa: A001  the storage layer's open: callers write storage.open
    """A file object. Writing to a bucket, the object appears when it is closed, complete; a local write is not
    atomic (use write_bytes for that)."""
    if not is_url(path):
        if "r" not in mode:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        return builtins.open(path, mode)
    return call(path, filesystem(path).open, key(path), mode, seconds=None)  # a stream: each request bounded by STALL_S


def read_bytes(path, start=None, end=None, big=False):
    """The bytes [start, end) of a file or object (one ranged request on a bucket), or all of them. big: a whole
    object that may be large (weights, a shard): its deadline allows for its size, asked first."""
    if not is_url(path):
        with builtins.open(path, "rb") as f:
            f.seek(start or 0)
            return f.read() if end is None else f.read(end - (start or 0))
    nbytes = end - (start or 0) if end is not None else size(path) if big else 0
    return call(path, filesystem(path).cat_file, key(path), start=start, end=end, seconds=deadline(nbytes))


def read_text(path):
    return read_bytes(path).decode()


# local folders that refuse renames, overwrites and appends (Mountpoint for S3 does, by default): found by
# check_renames, written there as on a bucket, each file created whole and never renamed (an old one deleted first)
WRITE_ONCE = set()


def check_renames(folder):
    """Whether `folder` (local) renames and overwrites files; if it does not (a Mountpoint for S3 mount), its
    writes from now on create each file in place, deleting an old one first (write_bytes). Returns True if so."""
    folder = Path(folder).resolve()
    probe, moved = folder / f".llavax-probe-{os.getpid()}", folder / f".llavax-probe-{os.getpid()}-moved"
    refused = False
    try:
        probe.write_bytes(b"1")
        try:
            with builtins.open(probe, "wb") as f:  # an overwrite
                f.write(b"2")
            os.replace(probe, moved)
        except OSError:
            refused = True
    finally:
        for p in (probe, moved):
            with contextlib.suppress(OSError):
                p.unlink()
    if refused:
        WRITE_ONCE.add(str(folder))
    return refused


def write_once(path):
    resolved = str(Path(path).resolve())
    return any(resolved == f or resolved.startswith(f + os.sep) for f in WRITE_ONCE)


def write_bytes(path, data):
    """Write a whole file atomically: readers see the old one or the new one, never a part. Locally a temporary file
    in the same folder is fsynced and os.replace'd over the name (a file rename; folders are never renamed); under a
    folder that refuses renames and overwrites (check_renames), the old file is deleted and the new one created in
    place, as an object in a bucket is."""
    if is_url(path):
        call(path, filesystem(path, one_attempt=True).pipe_file, key(path), bytes(data), seconds=deadline(len(data)))
        return written(path)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)  # as on a bucket, where a key needs no folder
    if write_once(path):
        path.unlink(missing_ok=True)
        with builtins.open(path, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return None
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with builtins.open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path, text):
    write_bytes(path, text.encode())


def upload(local_file, path):
    """Copy a local file to path (an object appears whole, a local copy is replaced atomically)."""
    if is_url(path):
        call(path, filesystem(path, one_attempt=True).put_file, str(local_file), key(path),
             seconds=deadline(Path(local_file).stat().st_size))
        return written(path)
    write_bytes(path, Path(local_file).read_bytes())


# -----------------------------------------------------------------------------
# conditional writes (out_dir's lease, lease.py): an object written only if it is still the version read, or only if
# there is none; bucket URLs only (a local lease is written under a lock). S3 documents If-None-Match: * and If-Match
# on a PUT (and If-Match on a DELETE), GCS ifGenerationMatch on every request; the servers the tests run do less, as
# conditions() finds (tests/test_lease.py asks each): moto 5.2.5 honours all three; fake-gcs-server 1.54 honours
# ifGenerationMatch only on a multipart upload (not on a media or resumable one, a copy or a delete: so the writes
# here are multipart); gcp-storage-emulator 2026.7.19 ignores it everywhere, and its downloads name no generation.


def object_key(url):
    """url's key within its bucket (the name the S3 and GCS APIs take; key() is fsspec's bucket/key)."""
    return key(url).split("/", 1)[1]


def precondition_failed(e):
    """The object was not at the version named: 412 (gcsfs raises FileExistsError, s3fs an OSError caused by a
    PreconditionFailed), 409 (S3: another conditional write to it in progress), or 404 (a version named, none there)."""
    for err in causes(e):
        if isinstance(err, (FileExistsError, FileNotFoundError)):
            return True
        answer = getattr(err, "response", None) or {}
        if answer.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey") or \
                answer.get("ResponseMetadata", {}).get("HTTPStatusCode") in (409, 412):
            return True
    return False


async def s3_get(fs, bucket_name, object_name):
    answer = await fs._call_s3("get_object", Bucket=bucket_name, Key=object_name)
    try:
        return await answer["Body"].read(), answer["ETag"]
    finally:
        answer["Body"].close()


def read_versioned(url):
    """(bytes, version) of the object url from one request, the version that of those bytes (S3: its ETag, GCS: its
    generation; None from a server that does not say it). FileNotFoundError when there is none."""
    fs = filesystem(url)
    if scheme(url) == "s3":
        from fsspec.asyn import sync

        return call(url, sync, fs.loop, s3_get, fs, bucket(url), object_key(url), seconds=deadline())
    headers, data = call(url, fs.call, "GET", fs.url(key(url)), seconds=deadline())
    return data, headers.get("X-Goog-Generation")


def write_if(url, data, version):
    """Write the object url only if it is at `version` (None: only if there is none), in one request: its new version,
    or None when it was not (another writer's since, or gone). A retry of ours whose first attempt landed is refused
    too: the caller reads the object to tell."""
    data, fs = bytes(data), filesystem(url, one_attempt=True)
    try:
        if scheme(url) == "s3":
            condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
            answer = call(url, fs.call_s3, "put_object", Bucket=bucket(url), Key=object_key(url), Body=data,
                          **condition, seconds=deadline(len(data)))
            new = answer["ETag"]
        else:  # gcsfs's own simple upload, with the generation: the multipart form fake-gcs-server checks it on
            head = json.dumps({"name": object_key(url)})
            body = (f"--==0==\nContent-Type: application/json; charset=UTF-8\n\n{head}\n--==0==\nContent-Type: "
                    f"application/octet-stream\n\n").encode() + data + b"\n--==0==--"
            answer = call(url, fs.call, "POST", f"{fs._location}/upload/storage/v1/b/{bucket(url)}/o",
                          uploadType="multipart", ifGenerationMatch=str(version or 0), data=body, json_out=True,
                          headers={"Content-Type": 'multipart/related; boundary="==0=="'}, seconds=deadline(len(data)))
            new = str(answer["generation"])
    except OSError as e:
        if isinstance(e, StorageError) or not precondition_failed(e):
            raise
        return None
    finally:
        written(url)
    return new


def rm_if(url, version):
    """Remove the object url only if it is at `version`: whether it was removed."""
    fs = filesystem(url, one_attempt=True)
    try:
        if scheme(url) == "s3":
            call(url, fs.call_s3, "delete_object", Bucket=bucket(url), Key=object_key(url), IfMatch=version,
                 seconds=deadline())
        else:
            call(url, fs.call, "DELETE", "b/{}/o/{}", bucket(url), object_key(url), ifGenerationMatch=str(version),
                 seconds=deadline())
    except OSError as e:
        if isinstance(e, StorageError) or not precondition_failed(e):
            raise
        return False
    finally:
        written(url)
    return True


def conditions(folder):
    """The conditions the server of folder (a bucket URL) honours, asked of a probe object written there and removed:
    "create" (write_if(.., None) refuses an object that is there), "replace" (write_if refuses another version and
    takes the object's own), "delete" (rm_if likewise). A server may ignore one (and write anyway) or refuse it."""
    probe, honoured = join(folder, f".llavax-conditions-{os.getpid()}-{random.getrandbits(48):012x}"), set()
    wrong = '"00000000000000000000000000000000"' if scheme(folder) == "s3" else "1"  # no object's: GCS counts in µs
    try:
        if write_if(probe, b"1", None) is not None and write_if(probe, b"2", None) is None:
            honoured.add("create")
        version = read_versioned(probe)[1]
        if version is not None and write_if(probe, b"3", wrong) is None and \
                (version := write_if(probe, b"4", version)) is not None:
            honoured.add("replace")
            if not rm_if(probe, wrong) and rm_if(probe, version):
                honoured.add("delete")
    except StorageError:
        raise
    except Exception:  # noqa: BLE001  a server that refuses a condition (400, 501): what it honoured so far
        pass
    finally:
        with contextlib.suppress(OSError):
            rm(probe)
    return honoured
