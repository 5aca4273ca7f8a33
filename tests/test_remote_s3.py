"""Remote sources over S3: a real S3-compatible server (moto's server mode, its own process on
loopback) that checks every request's SigV4 signature against the IAM keys it issued. Every
source reads the same bytes as from local files, with the credential chain through botocore
and through the environment alone; wrong credentials, missing objects and an object replaced
mid-epoch are typed errors; credentials never appear in a message or a log."""

from __future__ import annotations

import json
import logging
import os
import pickle
import socket
import subprocess
import sys
import time

import pytest
from remote_helpers import assert_no_threads_left, check_every_source, make_data

from torch_fastload import ArrayDataset, DataLoader, config, remote
from torch_fastload.remote import url as remote_url

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto")

BUCKET = "fastload-data"
POLICY = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's server with authentication on, an IAM user's keys, and the test data uploaded;
    yields (endpoint, keys, local data directory)."""
    root = tmp_path_factory.mktemp("s3") / "data"
    make_data(str(root))
    port = free_port()
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}  # the 3 IAM calls below, then SigV4 checked
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("moto's server did not start") from None
                time.sleep(0.1)
        endpoint = f"http://127.0.0.1:{port}"
        common = dict(endpoint_url=endpoint, region_name="us-east-1")
        iam = boto3.client("iam", aws_access_key_id="setup", aws_secret_access_key="setup", **common)
        iam.create_user(UserName="trainer")
        iam.put_user_policy(UserName="trainer", PolicyName="all", PolicyDocument=json.dumps(POLICY))
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        keys = (key["AccessKeyId"], key["SecretAccessKey"])
        client = boto3.client("s3", aws_access_key_id=keys[0], aws_secret_access_key=keys[1], **common)
        client.create_bucket(Bucket=BUCKET)
        for directory, _, names in os.walk(root):
            for name in names:
                path = os.path.join(directory, name)
                client.upload_file(path, BUCKET, "data/" + os.path.relpath(path, root))
        yield endpoint, keys, root, client
    finally:
        server.terminate()
        server.wait(30)


@pytest.fixture
def aws(s3, monkeypatch):
    """The environment a training job would have: keys, region and endpoint in AWS's variables."""
    endpoint, keys, _, _ = s3
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "TORCH_FASTLOAD_S3_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", keys[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", keys[1])
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    remote.reset()
    with config.override(remote_backoff=0.01, remote_timeout=10.0):
        yield s3
    remote.reset()
    assert_no_threads_left()


def s3_url(name: str) -> str:
    return f"s3://{BUCKET}/data/{name}"


@pytest.mark.parametrize("chain", ["botocore", "environment"])
def test_every_source_reads_the_same_bytes_as_local_files(aws, chain, monkeypatch):
    _, _, root, _ = aws
    if chain == "environment":  # without botocore: the AWS_* variables, the endpoint as a config option
        monkeypatch.setattr(remote_url, "_botocore_session", lambda: None)
        monkeypatch.delenv("AWS_ENDPOINT_URL")
        monkeypatch.setenv("TORCH_FASTLOAD_S3_ENDPOINT_URL", aws[0])
    stats = check_every_source(lambda name: str(root / name), s3_url)
    assert all(s.io_bytes.get("remote-http", 0) > 0 for s in stats.values())


def test_a_prefix_lists_its_objects(aws):
    _, _, root, _ = aws
    listed = remote.expand(s3_url("pack/"))
    assert listed == sorted(s3_url(f"pack/{n}") for n in os.listdir(root / "pack"))
    assert remote.expand([s3_url("x.npy"), s3_url("y.npy")]) == [s3_url("x.npy"), s3_url("y.npy")]
    _, _, _, client = aws
    client.put_object(Bucket=BUCKET, Key="odd/a b+c=d%.bin", Body=b"0123456789")  # signed with the key encoded
    assert remote.expand(f"s3://{BUCKET}/odd/") == [f"s3://{BUCKET}/odd/a b+c=d%.bin"]
    assert remote.objects.read(f"s3://{BUCKET}/odd/a b+c=d%.bin", 3, 4) == b"3456"


def test_wrong_credentials_are_refused_without_showing_them(aws, monkeypatch):
    _, keys, _, _ = aws
    dataset = ArrayDataset(s3_url("x.npy"))
    loader = DataLoader(dataset, batch_size=100, device="cpu")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-for-the-test")
    remote_url.reset()
    with pytest.raises(remote.RemoteAccessError, match="HTTP 403") as info:
        next(iter(loader))
    loader.close()
    text = str(info.value) + repr(info.value) + "".join(getattr(info.value, "__notes__", []))
    assert s3_url("x.npy") in text
    for secret in ("wrong-secret-for-the-test", keys[0], keys[1]):
        assert secret not in text
    with pytest.raises(remote.RemoteAccessError) as info:
        remote.open_object(s3_url("y.npy"))
    assert "SignatureDoesNotMatch" in str(info.value) or "HTTP 403" in str(info.value)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
    remote_url.reset()
    with pytest.raises(remote.RemoteAccessError) as info:
        remote.open_object(s3_url("y.npy"))
    assert "AKIAUNKNOWNKEY000000" not in str(info.value)


def test_credentials_never_reach_logs_or_reprs(aws, caplog):
    _, keys, _, _ = aws
    caplog.set_level(logging.DEBUG)
    dataset = ArrayDataset(s3_url("x.npy"))
    loader = DataLoader(dataset, batch_size=500, device="cpu")
    list(loader)
    text = caplog.text + str(loader.stats()) + remote.describe_settings() + config.describe() + repr(dataset.files)
    loader.close()
    creds = remote_url.credentials()
    assert repr(creds) == str(creds) == "Credentials(<hidden>)"
    with pytest.raises(TypeError):
        pickle.dumps(creds)
    text += repr(creds) + repr(pickle.loads(pickle.dumps(dataset)).files)
    assert "torch_fastload reads remote objects with remote-http" in caplog.text
    for secret in keys:
        assert secret not in text


def test_missing_objects_and_buckets_are_typed_errors(aws):
    with pytest.raises(remote.RemoteNotFoundError, match=f"s3://{BUCKET}/data/nope.npy"):
        ArrayDataset(s3_url("nope.npy"))
    with pytest.raises(FileNotFoundError, match="s3://no-such-bucket-here/x.npy"):
        ArrayDataset("s3://no-such-bucket-here/x.npy")


def test_an_object_replaced_mid_epoch_is_an_error(aws):
    _, _, root, client = aws
    client.upload_file(str(root / "x.npy"), BUCKET, "live/x.npy")
    dataset = ArrayDataset(f"s3://{BUCKET}/live/x.npy")
    # no read-ahead: the later batches are read after the change (read ahead, every batch of
    # this small object could be read, whole and of the old version, before it)
    with config.override(remote_read_ahead=0):
        loader = DataLoader(dataset, batch_size=100, device="cpu", prefetch=1)
        batches = iter(loader)
        first = next(batches)
    data = (root / "x.npy").read_bytes()
    client.put_object(Bucket=BUCKET, Key="live/x.npy", Body=data[:128] + bytes(255 - b for b in data[128:]))
    with pytest.raises(remote.ObjectChangedError, match=f"s3://{BUCKET}/live/x.npy"):
        for _ in batches:  # the prefetched batch may still come (the old version, read before the change)
            pass
    assert first.shape == (100, 33)
    loader.close()
