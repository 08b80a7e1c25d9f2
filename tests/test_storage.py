"""storage.py against real servers: moto's S3 server and fake-gcs-server on 127.0.0.1 (tests/buckets.py), and a
local folder: the same calls, the same bytes; throttling and reset connections retried; a bad path said in one
sentence."""

import http.server
import json
import os
import re
import socket
import threading
import time
import urllib.request

import boto3
import pytest
from buckets import S3_ENV, forget_filesystems

import checkpoint
import storage


@pytest.fixture(params=["local", "s3", "gs"])
def root(request, tmp_path):
    if request.param == "local":
        return tmp_path / "root"
    return request.getfixturevalue(f"{'gcs' if request.param == 'gs' else 's3'}_bucket") + "/runs/a"


def test_the_same_calls_give_the_same_bytes_on_disk_and_in_buckets(root, tmp_path):
    blob = os.urandom(100_003)  # an odd size: ranges at the end are short
    storage.makedirs(root)
    assert storage.ls(root) == [] and not storage.exists(storage.join(root, "step-1/x.bin"))
    storage.write_bytes(storage.join(root, "step-1/x.bin"), blob)
    storage.write_text(storage.join(root, "step-1/manifest.json"), "{}")
    storage.write_bytes(storage.join(root, "step-12/x.bin"), b"old")
    storage.write_bytes(storage.join(root, "step-12/x.bin"), b"new, longer")  # replaced whole
    (tmp_path / "local.txt").write_text("uploaded")
    storage.upload(tmp_path / "local.txt", storage.join(root, "log.jsonl"))
    assert storage.read_bytes(storage.join(root, "step-1/x.bin")) == blob
    for start, end in ((0, 1), (7, 70_001), (99_990, 100_003)):
        assert storage.read_bytes(storage.join(root, "step-1/x.bin"), start, end) == blob[start:end]
    assert storage.read_text(storage.join(root, "step-12/x.bin")) == "new, longer"
    assert storage.read_text(storage.join(root, "log.jsonl")) == "uploaded"
    assert storage.size(storage.join(root, "step-1/x.bin")) == 100_003
    assert storage.ls(root) == ["log.jsonl", "step-1", "step-12"]
    assert [storage.name(p) for p in storage.glob(root, "step-*/manifest.json")] == ["manifest.json"]
    assert [str(p) for p in storage.glob(root, "step-*/x.bin")] == \
        [str(storage.join(root, "step-1/x.bin")), str(storage.join(root, "step-12/x.bin"))]
    storage.rm(storage.join(root, "step-1"), recursive=True)
    storage.rm(storage.join(root, "step-1"), recursive=True)  # nothing left: no error
    assert storage.ls(root) == ["log.jsonl", "step-12"]
    assert not storage.exists(storage.join(root, "step-1/x.bin"))
    assert not [p for p in (tmp_path / "root").rglob("*tmp*")]  # no temporary file left behind locally


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_a_url_names_the_same_objects_however_it_is_typed(kind, request):
    """A prefix with spaces, unicode and glob characters, typed with double or trailing slashes, an upper-case scheme,
    or gcs:// for gs://: every call, and the checkpoint listing resume goes by, sees the objects the plain URL names."""
    plain = request.getfixturevalue(f"{'gcs' if kind == 'gs' else 's3'}_bucket") + "/runs/exp [1] *?#/ü 漢字"
    storage.write_text(storage.join(plain, "step-000003/manifest.json"), "{}")
    storage.write_bytes(storage.join(plain, "step-000004/x.bin"), b"half-written step")
    if kind == "s3":  # S3 holds an object and a prefix of one name side by side (fake-gcs-server cannot)
        storage.write_text(storage.join(plain, "step-000004"), "an object named as the step")
    typed = [plain + "/", plain.replace("/runs/", "//runs//") + "//", kind.upper() + plain[len(kind):],
             *(["gcs" + plain[2:]] if kind == "gs" else [])]
    for url in (plain, *typed):
        assert storage.ls(url) == ["step-000003", "step-000004"], url
        assert storage.exists(f"{url}/step-000003/manifest.json") and storage.exists(storage.join(url, "step-000004")), url
        assert storage.read_bytes(f"{url}/step-000004/x.bin", 5, 12) == b"written", url
        assert storage.file_sizes(storage.join(url, "step-000004")) == {"x.bin": 17}, url
        assert [storage.name(storage.parent(p)) for p in storage.glob(url, "step-*/manifest.json")] == ["step-000003"]
        assert [storage.name(p) for p in checkpoint.checkpoints(url)] == ["step-000003"], url  # what resume takes
    with pytest.raises(FileNotFoundError, match=rf"^{re.escape(plain)}/step-000005/x.bin: no such object"):
        storage.read_bytes(storage.join(typed[1], "step-000005/x.bin"))


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_removing_a_path_with_glob_characters_removes_it_alone(kind, request):
    """fsspec's rm reads [ ] * ? as a pattern: removing data[1]'s .info.json removed data1's (another dataset's) and
    kept its own; removing run*b's step removed runXb's too. Every name here is a name."""
    b = request.getfixturevalue(f"{'gcs' if kind == 'gs' else 's3'}_bucket")
    kept = {f"{b}/data1/.nv-meta/.info.json": "another dataset", f"{b}/runXb/step-1/manifest.json": "another run"}
    ours = {f"{b}/data[1]/.nv-meta/.info.json": "ours", f"{b}/run*b/step-1/manifest.json": "ours",
            f"{b}/run*b/step-1/__0_0.distcp": "ours"}
    for path, text in (kept | ours).items():
        storage.write_text(path, text)
    storage.rm(f"{b}/data[1]/.nv-meta/.info.json")
    storage.rm(f"{b}/run*b/step-1", recursive=True)
    assert not any(storage.exists(path) for path in ours)
    assert {path: storage.read_text(path) for path in kept} == kept


def test_a_local_write_renames_only_a_file(tmp_path, monkeypatch):
    real_replace, renamed = os.replace, []

    def replace_files_only(src, dst):  # a mount that cannot rename folders (gcsfuse without rename-dir-limit)
        if os.path.isdir(src):
            raise OSError(95, "Operation not supported", str(src))
        renamed.append(os.path.basename(dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_files_only)
    monkeypatch.setattr(os, "rename", replace_files_only)
    (tmp_path / "sub").mkdir()
    storage.write_text(tmp_path / "sub" / "a.json", "1")
    storage.write_text(tmp_path / "sub" / "a.json", "2")
    assert (tmp_path / "sub/a.json").read_text() == "2" and renamed == ["a.json", "a.json"]
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["a.json"]


def test_a_local_folder_written_into_while_it_is_removed_is_removed(tmp_path, monkeypatch):
    """A run that took out_dir over removes an unfinished step (checkpoint.remove_step) while the run it took it from
    still writes there: between the removal's listing and its unlinks, a file it listed is renamed away (a put's
    temporary file, storage.write_bytes) and another appears. The folder is removed all the same."""
    step = tmp_path / "step-000012"
    step.mkdir()
    for name in ("__0_0.distcp", ".metadata", ".rng.safetensors.tmp-4242"):
        (step / name).write_bytes(b"x")
    real_unlink, zombie_wrote = os.unlink, []

    def unlink(path, *args, **kwargs):
        if not zombie_wrote:  # the zombie's writes land once the removal has listed the folder
            os.replace(step / ".rng.safetensors.tmp-4242", step / "rng.safetensors")
            (step / "tokenizer.model").write_bytes(b"x")
            zombie_wrote.append(True)
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    storage.rm(step, recursive=True)
    assert zombie_wrote and not step.exists()


def test_bad_paths_are_one_sentence(s3_server, gcs_server, monkeypatch):
    cases = [("ftp://host/x", "unknown storage scheme 'ftp://'"),
             ("s3://llavax-no-such-bucket/run", "bucket 'llavax-no-such-bucket' does not exist"),
             ("gs://llavax-no-such-bucket/run", "bucket 'llavax-no-such-bucket' does not exist")]
    for url, said in cases:
        with pytest.raises(storage.StorageError, match=said):
            storage.check_bucket(url)
    with pytest.raises(storage.StorageError, match="bucket 'llavax-no-such-bucket' does not exist"):
        storage.write_text("gs://llavax-no-such-bucket/run/x", "1")
    real = storage.importlib.util.find_spec
    monkeypatch.setattr(storage.importlib.util, "find_spec", lambda name: None if name == "gcsfs" else real(name))
    with pytest.raises(storage.StorageError, match=r"gs:// paths need the gcsfs package: pip install gcsfs"):
        storage.exists("gs://bucket/x")


def test_missing_credentials_are_named(s3_server, tmp_path, monkeypatch):
    for k in [k for k in os.environ if k.startswith(("AWS_ACCESS", "AWS_SECRET", "AWS_SESSION", "AWS_PROFILE",
                                                     "GOOGLE_", "STORAGE_EMULATOR"))]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws, no gcloud's application default credentials
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    forget_filesystems()
    try:
        with pytest.raises(storage.StorageError, match="no AWS credentials: set AWS_ACCESS_KEY_ID"):
            storage.check_bucket("s3://some-bucket/run")
        with pytest.raises(storage.StorageError, match="no AWS credentials"):
            storage.write_text("s3://some-bucket/run/x", "1")
        with pytest.raises(storage.StorageError, match="no Google credentials: run `gcloud auth application-default"):
            storage.exists("gs://some-bucket/run/x")
    finally:
        monkeypatch.undo()
        forget_filesystems()


def moto_auth(endpoint, count):
    """moto's server checks IAM credentials after `count` more requests ('inf': never), as its /moto-api says."""
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=count.encode(), method="POST",
                                                  headers={"Content-Type": "text/plain"}))


def token_endpoint_refusing():
    """An OAuth token endpoint that answers every request as Google's does a revoked or forged service-account key."""
    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = b'{"error": "invalid_grant", "error_description": "Invalid JWT Signature."}'
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_wrong_credentials_are_named(s3_bucket, tmp_path, monkeypatch):
    """Credentials that are there but wrong: moto enforcing IAM (an unknown key id; a known key with a wrong secret),
    a GOOGLE_APPLICATION_CREDENTIALS file that is no key, and a service-account key its token endpoint refuses
    (gcsfs alone retried that for a minute as if the server were down): one sentence each, nothing written."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    endpoint, run = os.environ["AWS_ENDPOINT_URL"], f"{s3_bucket}/run"
    iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1")
    iam.create_user(UserName="llavax")
    known = iam.create_access_key(UserName="llavax")["AccessKey"]["AccessKeyId"]
    moto_auth(endpoint, "0")
    try:
        for key_id, secret, said in (("AKIAIOSFODNN7EXAMPLE", "wrong", "InvalidAccessKeyId"),
                                     (known, "wrong", "SignatureDoesNotMatch")):
            monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
            monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
            forget_filesystems()
            for fn in (storage.check_bucket, lambda url: storage.write_text(f"{url}/x", "1")):
                with pytest.raises(storage.StorageError, match=rf"^{run}.*: access denied \(.*{said}.*\); check the "):
                    fn(run)
    finally:
        moto_auth(endpoint, "inf")
        monkeypatch.undo()
    assert storage.ls(s3_bucket) == []

    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # its probe would go to Google's servers
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "key.json"))
    (tmp_path / "key.json").write_text("not a key")
    token = token_endpoint_refusing()
    pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()
    refused = {"type": "service_account", "project_id": "p", "private_key_id": "1", "private_key": pem,
               "client_email": "llavax@p.iam.gserviceaccount.com", "client_id": "1",
               "token_uri": f"http://127.0.0.1:{token.server_address[1]}/token"}
    try:
        forget_filesystems()
        with pytest.raises(storage.StorageError, match=rf"^gs://llavax-b/run: GOOGLE_APPLICATION_CREDENTIALS="
                                                       rf"{tmp_path}/key.json cannot be used \(.*not a valid json"):
            storage.check_bucket("gs://llavax-b/run")
        (tmp_path / "key.json").write_text(json.dumps(refused))
        forget_filesystems()
        t0 = time.monotonic()
        with pytest.raises(storage.StorageError, match=r"^gs://llavax-b/run: the Google credentials were refused "
                                                       r"\(.*invalid_grant: Invalid JWT Signature"):
            storage.check_bucket("gs://llavax-b/run")
        assert time.monotonic() - t0 < 10
    finally:
        token.shutdown()
        monkeypatch.undo()
        forget_filesystems()


def test_an_endpoint_that_refuses_or_never_answers_fails_in_bounded_time(monkeypatch):
    """AWS_ENDPOINT_URL or STORAGE_EMULATOR_HOST naming a port nothing listens on, or a server that takes connections
    and never answers (a wedged proxy; each attempt would wait out the clients' read timeouts times their own retries,
    ~7 minutes on S3): the first call gives up within FIRST_CONTACT seconds, a ranged read within its deadline (twice
    storage_stall_s), each in one sentence that names the endpoint."""
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(storage, "FIRST_CONTACT", 0.5)
    monkeypatch.setattr(storage, "STALL_S", 0.25)
    wedged = socket.create_server(("127.0.0.1", 0), backlog=64)  # the kernel accepts; nobody answers
    with socket.create_server(("127.0.0.1", 0)) as s:
        dead = s.getsockname()[1]
    cases = [("s3", "AWS_ENDPOINT_URL", dead), ("s3", "AWS_ENDPOINT_URL", wedged.getsockname()[1]),
             ("gs", "STORAGE_EMULATOR_HOST", dead), ("gs", "STORAGE_EMULATOR_HOST", wedged.getsockname()[1])]
    try:
        for kind, var, port in cases:
            monkeypatch.setenv(var, f"http://127.0.0.1:{port}")
            forget_filesystems()
            for url, fn in ((f"{kind}://llavax-b/run", storage.check_bucket),
                            (f"{kind}://llavax-b/run/shard.tar", lambda url: storage.read_bytes(url, 0, 512))):
                t0 = time.monotonic()
                with pytest.raises(storage.StorageError) as e:
                    fn(url)
                said = str(e.value)
                assert re.fullmatch(rf"{url}: still failing after \d+ attempts? in \d+ s \(.+\) at "
                                    rf"http://127.0.0.1:{port} \({var}\)", said), said
                assert time.monotonic() - t0 < 5, (said, time.monotonic() - t0)
    finally:
        wedged.close()
        forget_filesystems()


def test_throttling_and_resets_are_retried_on_s3(s3_bucket, s3_proxy, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore gives up at once: storage.py's own retries are tested
    monkeypatch.setattr(storage, "BACKOFF", 0.02)
    forget_filesystems()
    blob, path = os.urandom(10_007), s3_bucket + "/data/shard-0.tar"
    bucket = storage.bucket(s3_bucket)
    s3_proxy.inject(f"^PUT /{bucket}/data/shard-0.tar", 503, 2)
    s3_proxy.inject(f"^PUT /{bucket}/data/shard-0.tar", "reset", 1)
    storage.write_bytes(path, blob)
    for fault, count in ((503, 3), (429, 2), ("reset", 2)):
        s3_proxy.inject(f"^GET /{bucket}/data/shard-0.tar", fault, count)
        assert storage.read_bytes(path, 1000, 5001) == blob[1000:5001]
    assert s3_proxy.faults == 10
    s3_proxy.inject(f"^GET /{bucket}/data/shard-0.tar", 503, 1000)  # an outage: given up on, said in one sentence
    monkeypatch.setattr(storage, "RETRIES", 3)
    with pytest.raises(storage.StorageError, match=r"shard-0.tar: still failing after 3 attempts"):
        storage.read_bytes(path, 0, 10)


def test_throttling_and_resets_are_retried_on_gcs(gcs_bucket, gcs_proxy):
    blob, path = os.urandom(10_007), gcs_bucket + "/data/shard-0.tar"
    gcs_proxy.inject(r"^POST /upload/", 503, 1)
    gcs_proxy.inject(r"^POST /upload/", "reset", 1)
    storage.write_bytes(path, blob)
    for fault in (503, 429, "reset"):
        gcs_proxy.inject(r"^GET .*data%2Fshard-0.tar", fault, 1)
        assert storage.read_bytes(path, 1000, 5001) == blob[1000:5001]
    assert gcs_proxy.faults == 5


def test_throttling_stays_transient_after_dcp_pickles_a_ranks_failure():
    """DCP gathers each rank's write failure by pickling it, which drops its cause: all a multi-rank save sees of S3's
    SlowDown is s3fs's OSError(EBUSY, "Please reduce your request rate."). It must still be retried (one rank's 503
    made a 2-rank save give up at once), and a refusal must still not be."""
    import pickle

    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    for code, message, retried in (("SlowDown", "Please reduce your request rate.", True),
                                   ("AccessDenied", "Access Denied", False)):
        error = ClientError({"Error": {"Code": code, "Message": message}}, "PutObject")
        try:
            raise translate_boto_error(error) from error
        except OSError as e:
            seen = pickle.loads(pickle.dumps(e))
        assert seen.__cause__ is None and storage.transient(seen) is retried, (code, repr(seen))


def answering_every_request(status, body):
    """An HTTP server that answers every request with status and an S3 error body (what AWS sends a client that
    signs for the wrong region), and the header AWS adds naming the bucket's region."""
    class Answer(http.server.BaseHTTPRequestHandler):
        def reply(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("x-amz-bucket-region", "eu-west-1")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_PUT = do_HEAD = do_POST = reply

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


WRONG_REGION = (b"<Error><Code>AuthorizationHeaderMalformed</Code><Message>The authorization header is malformed; the "
                b"region 'us-east-1' is wrong; expecting 'eu-west-1'</Message><Region>eu-west-1</Region></Error>")


def test_configuration_errors_are_one_sentence_naming_the_variable(s3_bucket, shapes_data, monkeypatch):
    """What a user mistypes in the environment: an endpoint without its scheme (botocore's 63-line 'Invalid endpoint'
    traceback once), a malformed one, a host that does not resolve, STORAGE_EMULATOR_HOST without a scheme, a region
    that is no region name, a bucket in another region than the one configured: each is one sentence naming the
    variable, said by the first look at the bucket (and by train.py at start, before anything is written)."""
    port = int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    wrong_region = answering_every_request(400, WRONG_REGION)
    cases = [
        ({"AWS_ENDPOINT_URL": f"127.0.0.1:{port}"}, "s3",
         rf"AWS_ENDPOINT_URL=127.0.0.1:{port}: an endpoint needs its scheme: set AWS_ENDPOINT_URL=http://127.0.0.1:{port} "
         r"\(or https://...\)"),
        ({"AWS_ENDPOINT_URL_S3": "localhost:9000"}, "s3", r"AWS_ENDPOINT_URL_S3=localhost:9000: an endpoint needs its"),
        ({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}/ x"}, "s3", r"AWS_ENDPOINT_URL=.*: not an endpoint URL"),
        ({"AWS_ENDPOINT_URL": f"http://no-such-host.invalid:{port}"}, "s3",
         r"AWS_ENDPOINT_URL=http://no-such-host.invalid:\d+: unknown host 'no-such-host.invalid'"),
        ({"STORAGE_EMULATOR_HOST": "127.0.0.1:4443"}, "gs",
         r"STORAGE_EMULATOR_HOST=127.0.0.1:4443: an endpoint needs its scheme: set STORAGE_EMULATOR_HOST=http://"),
        ({"AWS_DEFAULT_REGION": "us east 1"}, "s3", r"AWS_DEFAULT_REGION=us east 1 is not a region name"),
        ({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{wrong_region.server_address[1]}"}, "s3",
         r"bucket 'llavax-b' is in region eu-west-1, not AWS_DEFAULT_REGION=us-east-1: set AWS_REGION=eu-west-1"),
    ]
    try:
        for env, kind, said in cases:
            with monkeypatch.context() as mp:
                for k, v in env.items():
                    mp.setenv(k, v)
                forget_filesystems()
                t0 = time.monotonic()
                with pytest.raises(storage.StorageError) as e:
                    storage.check_bucket(f"{kind}://llavax-b/run")
                assert re.search(said, str(e.value)) and "\n" not in str(e.value), (env, str(e.value))
                assert time.monotonic() - t0 < 20, (env, time.monotonic() - t0)
        with monkeypatch.context() as mp:  # train.py: before out_dir is taken or anything written
            mp.setenv("AWS_ENDPOINT_URL", f"127.0.0.1:{port}")
            forget_filesystems()
            import train

            with pytest.raises(SystemExit) as e:
                shapes = shapes_data(n=200, seed=3, val_fraction=0.1)
                train.main(["configs/debug.py", f"--out_dir={s3_bucket}/run", f"--data_dir={shapes / 'shards'}",
                            f"--tokenizer={shapes / 'tokenizer.model'}"])
            assert re.fullmatch(r".*AWS_ENDPOINT_URL=127\.0\.0\.1:\d+: an endpoint needs its scheme: .*", str(e.value))
    finally:
        wrong_region.shutdown()
        forget_filesystems()
    assert storage.ls(s3_bucket) == []
