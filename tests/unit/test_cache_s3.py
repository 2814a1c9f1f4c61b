"""``agent.cache.fetch.s3`` without a server: its parsers on any bytes, its URLs, the region it starts from, and its
signatures, which must be the ones botocore makes for the same request at the same moment."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from urllib.parse import parse_qs, quote_plus, urlsplit

import botocore.auth
import botocore.awsrequest
import botocore.credentials
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.cache.fetch import s3 as s3_module
from agent.cache.fetch.s3 import S3, Listed, Page, parse_error, parse_list, profile_region
from agent.cache.fetch.transfer import Limits
from spotdrain.retry import ApiError

LIMITS = Limits(connect_s=1.0, read_s=1.0, total_s=5.0)
NS = "http://s3.amazonaws.com/doc/2006-03-01/"
ACCESS, SECRET, TOKEN = "AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "session/token+="


@pytest.fixture
def credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)


def listing(*contents: tuple[str, str, str], truncated: str | None = None, encoded: bool = True) -> bytes:
    """A ListObjectsV2 answer as S3 writes it (https://docs.aws.amazon.com/AmazonS3/latest/API/API_ListObjectsV2.html),
    each item's key, size and ETag given as they appear in it."""
    items = "".join(
        f"<Contents><Key>{key}</Key><LastModified>2026-01-01T00:00:00.000Z</LastModified><ETag>{etag}</ETag>"
        f"<Size>{size}</Size><StorageClass>STANDARD</StorageClass></Contents>"
        for key, size, etag in contents
    )
    more = f"<IsTruncated>true</IsTruncated><NextContinuationToken>{truncated}</NextContinuationToken>"
    return (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult xmlns="{NS}"><Name>b</Name><Prefix>m/</Prefix>'
        f"<KeyCount>{len(contents)}</KeyCount><MaxKeys>1000</MaxKeys>"
        + ("<EncodingType>url</EncodingType>" if encoded else "")
        + (more if truncated else "<IsTruncated>false</IsTruncated>")
        + f"{items}</ListBucketResult>"
    ).encode()


def test_a_page_is_read_as_s3_writes_it_keys_url_decoded_and_folder_markers_left_out() -> None:
    body = listing(
        ("m/a+b%2Bc.safetensors", "12", "&quot;9b2cf535f27731c974343645a3985328&quot;"),
        ("m/sub/", "0", "&quot;d41d8cd98f00b204e9800998ecf8427e&quot;"),
        ("m/%E2%9C%93/x", "3", "&quot;abc-2&quot;"),
        truncated="1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=",
    )
    assert parse_list(body) == Page(
        [Listed("m/a b+c.safetensors", 12, '"9b2cf535f27731c974343645a3985328"'), Listed("m/\u2713/x", 3, '"abc-2"')],
        "1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=",
    )
    plain = parse_list(listing(("m/a+b", "1", "e"), encoded=False))  # a server that did not encode: taken as it is
    assert plain == Page([Listed("m/a+b", 1, "e")], None)


@given(st.text(st.characters(codec="utf-8"), min_size=1, max_size=80))
def test_any_key_s3_encodes_is_read_back_whole(key: str) -> None:
    assert parse_list(listing((quote_plus(key, safe="/"), "5", "e"))).objects == [Listed(key, 5, "e")] or key.endswith(
        "/"
    )


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"", "not XML"),
        (b"<html>503</html>", "not a ListBucketResult"),
        (listing(("m/a", "-1", "e")), "without a key or a size"),
        (listing(("m/a", "\u0661", "e")), "without a key or a size"),  # a digit, but not an ASCII one
        (f'<ListBucketResult xmlns="{NS}"><IsTruncated>true</IsTruncated></ListBucketResult>'.encode(), "token"),
        (b"<a>" * 100_000, "not XML"),
    ],
)
def test_what_is_no_page_is_malformed(body: bytes, why: str) -> None:
    with pytest.raises(ApiError, match=why) as raised:
        parse_list(body)
    assert raised.value.failure == "malformed"


@given(st.binary(max_size=2000))
def test_any_bytes_are_a_page_or_malformed_and_an_error_document_or_nothing(body: bytes) -> None:
    try:
        page = parse_list(body)
    except ApiError as error:
        failure = error.failure
    else:
        failure = None
        assert all(isinstance(item.size, int) for item in page.objects)
    assert failure in (None, "malformed")
    code, message, region = parse_error(body)
    assert all(isinstance(field, str) and len(field) <= 300 for field in (code, message, region))


def test_an_error_document_gives_its_code_message_and_region() -> None:
    body = (
        b"<Error><Code>AuthorizationHeaderMalformed</Code><Message>the region 'us-east-1' is wrong; expecting "
        b"'eu-west-1'</Message><Region>eu-west-1</Region><RequestId>1</RequestId></Error>"
    )
    assert parse_error(body) == (
        "AuthorizationHeaderMalformed",
        "the region 'us-east-1' is wrong; expecting 'eu-west-1'",
        "eu-west-1",
    )
    assert parse_error(b"") == ("", "", "")


def test_urls_are_virtual_hosted_where_the_name_allows_and_path_style_otherwise(
    credentials: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def url(bucket: str, key: str, region: str = "eu-west-1", endpoint: str | None = None) -> str:
        return S3(bucket, region=region, endpoint_url=endpoint, limits=LIMITS).object_url(key)

    assert url("models", "a b/c+d~e.bin") == "https://models.s3.eu-west-1.amazonaws.com/a%20b/c%2Bd~e.bin"
    assert url("models", "") == "https://models.s3.eu-west-1.amazonaws.com/"
    assert url("my.models", "x") == "https://s3.eu-west-1.amazonaws.com/my.models/x"
    assert url("models", "x", "cn-north-1") == "https://models.s3.cn-north-1.amazonaws.com.cn/x"
    assert url("models", "", endpoint="http://127.0.0.1:9000/") == "http://127.0.0.1:9000/models"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio:9000")
    assert url("models", "x") == "http://minio:9000/models/x"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://s3-only:9000")
    assert url("models", "x") == "http://s3-only:9000/models/x"
    assert url("models", "x", endpoint="http://given:1") == "http://given:1/models/x"


def test_without_a_region_the_profiles_is_taken_else_us_east_1(
    credentials: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = tmp_path / "config"
    config.write_text("[default]\nregion = eu-central-1\n\n[profile gpu]\nregion=ap-south-1\n[default]\nx = 1\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    assert profile_region() == "eu-central-1"
    monkeypatch.setenv("AWS_PROFILE", "gpu")
    assert S3("b", region=None, endpoint_url=None, limits=LIMITS).region == "ap-south-1"
    assert S3("b", region="us-west-2", endpoint_url=None, limits=LIMITS).region == "us-west-2"
    monkeypatch.setenv("AWS_PROFILE", "other")
    assert profile_region() is None
    config.write_bytes(b"\xff\xfe not a config [")
    assert profile_region() is None
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "missing"))
    assert S3("b", region=None, endpoint_url=None, limits=LIMITS).region == "us-east-1"


def _botocore_signed(request: botocore.awsrequest.AWSRequest, when: datetime.datetime, signer: type) -> None:
    credentials = botocore.credentials.Credentials(ACCESS, SECRET, TOKEN)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(botocore.auth, "get_current_datetime", lambda: when)
        if signer is botocore.auth.S3SigV4QueryAuth:
            signer(credentials, "s3", "eu-west-1", expires=3600).add_auth(request)
        else:
            signer(credentials, "s3", "eu-west-1").add_auth(request)


def _amz_date(value: str) -> datetime.datetime:
    return datetime.datetime.strptime(value, "%Y%m%dT%H%M%SZ").replace(tzinfo=datetime.UTC)


KEYS = st.text(st.characters(codec="utf-8"), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=KEYS)
async def test_a_presigned_get_is_the_one_botocore_signs(credentials: None, key: str) -> None:
    s3 = S3("models", region="eu-west-1", endpoint_url="http://127.0.0.1:9000", limits=LIMITS)
    ours = await s3.presign(key, 3600)
    query = parse_qs(urlsplit(ours).query)
    request = botocore.awsrequest.AWSRequest(method="GET", url=s3.object_url(key))
    _botocore_signed(request, _amz_date(query["X-Amz-Date"][0]), botocore.auth.S3SigV4QueryAuth)
    theirs = urlsplit(str(request.url))
    assert urlsplit(ours).path == theirs.path
    assert query == parse_qs(theirs.query)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=KEYS, part=st.none() | st.integers(1, 10_000))
async def test_a_header_signed_head_is_the_one_botocore_signs(credentials: None, key: str, part: int | None) -> None:
    s3 = S3("models", region="eu-west-1", endpoint_url="http://127.0.0.1:9000", limits=LIMITS)
    query = {"partNumber": str(part)} if part is not None else None
    url, headers = await s3._signed("HEAD", s3.object_url(key, query), {"x-amz-checksum-mode": "ENABLED"})
    request = botocore.awsrequest.AWSRequest(method="HEAD", url=url, headers={"x-amz-checksum-mode": "ENABLED"})
    _botocore_signed(request, _amz_date(headers["X-Amz-Date"]), botocore.auth.S3SigV4Auth)
    assert headers["Authorization"] == request.headers["Authorization"]
    assert headers["X-Amz-Security-Token"] == TOKEN


async def test_a_listing_query_is_signed_as_botocore_signs_it(credentials: None) -> None:
    s3 = S3("models", region="eu-west-1", endpoint_url="http://127.0.0.1:9000", limits=LIMITS)
    query = {"list-type": "2", "prefix": "llama 3/+x=", "encoding-type": "url", "continuation-token": "a/b+c=="}
    url, headers = await s3._signed("GET", s3.object_url("", query), {})
    assert "&prefix=llama%203%2F%2Bx%3D&" in url  # every value encoded as botocore sends it, "/" too
    request = botocore.awsrequest.AWSRequest(method="GET", url=url)
    _botocore_signed(request, _amz_date(headers["X-Amz-Date"]), botocore.auth.S3SigV4Auth)
    assert headers["Authorization"] == request.headers["Authorization"]


@given(st.one_of(st.binary(max_size=300), st.recursive(st.none() | st.text() | st.integers(), st.lists, max_leaves=8)))
def test_any_answer_from_imds_is_the_roles_credentials_or_one_of_the_errors_the_fetch_reports(answer: object) -> None:
    """Whatever IMDS answers for the role's document (bytes, or JSON with any ``Expiration``): the credentials, or
    an error the signing reports as "no credentials", never another exception that would end the fetch."""
    fields = {"AccessKeyId": "A", "SecretAccessKey": "S", "Token": "T", "Expiration": answer}
    document = answer if isinstance(answer, bytes) else json.dumps(fields).encode()
    replies = iter([b"token", b"role\n", document])

    def imds(base: str, method: str, path: str, headers: dict[str, str]) -> str:
        return next(replies).decode()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(s3_module, "_imds", imds)
        patch.setattr(s3_module, "_instance_roles", {})
        try:
            found = s3_module.instance_role()
        except s3_module.ROLE_ERRORS:
            return
    assert (found.access_key_id, found.secret_access_key, found.session_token) == ("A", "S", "T")


def test_the_role_document_imds_gives_is_taken() -> None:
    document = {"Code": "Success", "AccessKeyId": "A", "SecretAccessKey": "S", "Token": "T"}
    replies = iter(["token", "role\n", json.dumps({**document, "Expiration": "2099-01-01T00:00:00Z"})])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(s3_module, "_imds", lambda *_: next(replies))
        patch.setattr(s3_module, "_instance_roles", {})
        found = s3_module.instance_role()
        assert s3_module.instance_role() is found  # kept: IMDS is not asked again
    assert (found.access_key_id, found.session_token) == ("A", "T")
