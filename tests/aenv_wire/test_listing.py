"""What E2B's lists show and how they page (aenv_wire/listing.py): page tokens round-trip
and refuse anything else with BadToken; times as the API writes them read back exactly;
the SDK's metadata filter decodes what the SDK encodes. Pure."""
from __future__ import annotations

import base64
import datetime
import json
import urllib.parse

from hypothesis import given
from hypothesis import strategies as st

from aenv_wire.errors import BadToken
from aenv_wire.listing import (decode_token, encode_token, iso, micros, micros_of, parse_metadata_filter,
                               started_at_or_after)


@given(st.floats(min_value=0, max_value=2e9), st.text(max_size=30))
def test_page_token_round_trip(started: float, sid: str) -> None:
    assert decode_token(encode_token(started, sid)) == (started, sid)


@given(st.text(max_size=60) | st.binary(max_size=60).map(lambda b: base64.urlsafe_b64encode(b).decode()))
def test_anything_else_is_a_bad_token(token: str) -> None:
    try:
        started, sid = decode_token(token)
    except BadToken as e:
        assert str(e) == "nextToken is not a token this server issued"
        return
    assert isinstance(started, float) and isinstance(sid, str)


def test_tokens_of_the_wrong_shape_are_bad() -> None:
    for value in ([True, "s"], [1.0, 2], ["1", "s"], [1.0], {"a": 1}, [10**400, "s"], [[[[]]], "s"]):
        token = base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")
        try:
            decode_token(token)
        except BadToken:
            continue
        raise AssertionError(f"{value!r} was accepted")


@given(st.floats(min_value=0, max_value=4e9, allow_nan=False))
def test_iso_reads_back_at_the_microseconds_it_shows(ts: float) -> None:
    shown = iso(ts)
    assert shown.endswith("Z") and len(shown) == len("2026-01-01T00:00:00.000000Z")
    assert micros_of(shown) == micros(ts)
    # a client passing a sandbox's startedAt back finds it, and not one microsecond later
    assert started_at_or_after(ts, micros_of(shown) / 1e6)
    assert not started_at_or_after(ts, (micros_of(shown) + 1) / 1e6)


@given(st.datetimes(min_value=datetime.datetime(1971, 1, 1), max_value=datetime.datetime(2999, 1, 1),
                    timezones=st.none() | st.just(datetime.timezone.utc)
                    | st.builds(lambda m: datetime.timezone(datetime.timedelta(minutes=m)), st.integers(-720, 720))))
def test_micros_of_reads_any_rfc3339_time(dt: datetime.datetime) -> None:
    """A client's ``startedAfter`` may carry an offset, or none (UTC, as the node reads it)."""
    want = dt if dt.tzinfo is not None else dt.replace(tzinfo=datetime.timezone.utc)
    epoch = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
    assert micros_of(dt.isoformat()) == (want - epoch) // datetime.timedelta(microseconds=1)


@given(st.text(max_size=40))
def test_micros_of_anything_else_is_a_value_error(stamp: str) -> None:
    try:
        micros_of(stamp)
    except ValueError:
        pass


@given(st.dictionaries(st.text(min_size=1, max_size=20), st.text(max_size=20), min_size=1, max_size=5))
def test_metadata_filter_decodes_what_the_sdk_encodes(metadata: dict[str, str]) -> None:
    # e2b's paginator: quote keys and values, urlencode the pairs; the HTTP client
    # then encodes that value once more in the query string, which aiohttp decodes.
    sent = urllib.parse.urlencode({urllib.parse.quote(k): urllib.parse.quote(v) for k, v in metadata.items()})
    wire = urllib.parse.urlencode({"metadata": sent})
    received = urllib.parse.parse_qs(wire)["metadata"][0]
    assert parse_metadata_filter(received) == metadata


@given(st.text(max_size=80))
def test_metadata_filter_of_anything_is_a_dict_of_strings(raw: str) -> None:
    got = parse_metadata_filter(raw)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in got.items())
