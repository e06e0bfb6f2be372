"""``redact_url`` never lets a password through, whatever it contains, and keeps where the URL points."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from poolgate.kernel.redaction import MASK, redact_text, redact_url

passwords = st.text(st.characters(codec="utf-8"), min_size=4, max_size=30).filter(
    lambda p: MASK not in p)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["redis", "rediss", "unix"]), st.sampled_from(["", "default", "app"]), passwords,
       st.sampled_from(["127.0.0.1:6379", "[::1]:7000", "redis.internal", ""]), st.sampled_from(["", "/0", "/3"]),
       st.booleans())
def test_no_password_survives(scheme: str, user: str, password: str, host: str, path: str, as_query: bool) -> None:
    quoted = quote(password, safe="")
    if as_query:
        url = f"{scheme}://{host}{path}?db=1&password={quoted}"
    else:
        url = f"{scheme}://{user}:{quoted}@{host}{path}"
    # A password that is also part of what the URL shows (say "redi" in "redis://") cannot be told apart.
    assume(password not in f"{scheme}://{user}@{host}{path}?db=1&password=")
    redacted = redact_url(url)
    assert quoted not in redacted and (len(password) < 4 or password not in redacted.replace(MASK, ""))
    if redacted != MASK:
        assert redacted.startswith(f"{scheme}://")
        assert host.split(":")[0] in redacted


@pytest.mark.parametrize(("url", "expected"), [
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
    ("rediss://app:s3cr3t@h:6380/0?ssl_ca_certs=/ca.pem", "rediss://app:***@h:6380/0?ssl_ca_certs=/ca.pem"),
    ("redis://lonely@h", "redis://***@h"),
    ("unix:///run/redis.sock?password=x&db=2", "unix:///run/redis.sock?password=***&db=2"),
    ("redis://u:p@h:notaport", "***"),
])
def test_examples(url: str, expected: str) -> None:
    assert redact_url(url) == expected


def test_redact_text_masks_every_known_secret_longest_first() -> None:
    assert redact_text("token abc and abcdef", ["abc", "abcdef", None, ""]) == "token *** and ***"
