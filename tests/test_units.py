"""colo/units.py: sizes as people type them and sizes and durations as colo prints them.

Every unit of the table, binary against decimal, each format's boundaries (one below, at, one
above) and the input refused. Pure: no daemon.
"""
from __future__ import annotations

import pytest

from colo.units import BadSize, format_duration, format_size, format_size_exact, parse_size

KiB, MiB, GiB, TiB = 1024, 1024**2, 1024**3, 1024**4


@pytest.mark.parametrize("text,n", [
    ("512", 512), ("512b", 512), ("512B", 512),
    ("3k", 3 * KiB), ("3KiB", 3 * KiB), ("3kb", 3000), ("3KB", 3000),
    ("3m", 3 * MiB), ("3MiB", 3 * MiB), ("3mb", 3 * 1000**2), ("3MB", 3 * 1000**2),
    ("3g", 3 * GiB), ("3GiB", 3 * GiB), ("3gb", 3 * 1000**3), ("3GB", 3 * 1000**3),
    ("3t", 3 * TiB), ("3TiB", 3 * TiB), ("3tb", 3 * 1000**4), ("3TB", 3 * 1000**4),
    ("4G", 4 * GiB), ("4gib", 4 * GiB),  # a bare letter is binary, as docker reads it; any case
])
def test_every_unit_of_the_table(text, n):
    assert parse_size(text) == n


def test_fractions_blanks_and_whole_numbers():
    assert parse_size(" 4.5 GiB ") == 4 * GiB + GiB // 2
    assert parse_size("1.5k") == 1536
    assert parse_size("0.5KB") == 500
    assert parse_size("2.5") == 2  # bytes: a fraction of one is cut
    assert parse_size(1) == 1 and parse_size(7 * GiB) == 7 * GiB  # a number is bytes already


@pytest.mark.parametrize("bad", ["", "   ", "GiB", "4PiB", "4 P", "-4GiB", "+4GiB", "4.GiB", ".5GiB", "4.5.1G",
                                 "4 G i B", "4GiB!", "4e3", "4_000", "0x10", "4 GiB 2", "1,5G"])
def test_malformed_sizes_are_refused(bad):
    with pytest.raises(BadSize, match="malformed size"):
        parse_size(bad)


@pytest.mark.parametrize("bad", ["0", "0GiB", "0.0001b", 0, -1])
def test_a_size_must_be_greater_than_zero(bad):
    with pytest.raises(BadSize, match="greater than zero"):
        parse_size(bad)


def test_bad_size_is_a_value_error():
    assert issubclass(BadSize, ValueError)


@pytest.mark.parametrize("n,text", [
    (None, "-"), (0, "0B"), (1, "1B"), (1023, "1023B"), (1024, "1.0KiB"), (1536, "1.5KiB"), (2048, "2.0KiB"),
    (9.5 * KiB, "9.5KiB"), (10 * KiB - 1, "10.0KiB"), (10 * KiB, "10KiB"), (1023 * KiB, "1023KiB"),
    (MiB, "1.0MiB"), (512 * MiB, "512MiB"), (GiB, "1.0GiB"), (4 * GiB, "4.0GiB"), (15.75 * GiB, "16GiB"),
    (TiB, "1.0TiB"), (2 * TiB, "2.0TiB"), (20 * TiB, "20TiB"), (1024 * TiB, "1024TiB"),  # TiB is the last unit
    (-2048, "-2.0KiB"), (1536.0, "1.5KiB"),
])
def test_format_size_is_short_and_binary(n, text):
    assert format_size(n) == text


@pytest.mark.parametrize("n,text", [
    (None, "-"), (0, "0B"), (1023, "1,023B"), (1_000_001, "1,000,001B"), (1000, "1,000B"),
    (KiB, "1KiB"), (1536, "1.5KiB"), (1280, "1.25KiB"), (1025, "1,025B"),
    (MiB, "1MiB"), (2.5 * MiB, "2.5MiB"), (MiB - KiB, "1023KiB"),
    (GiB, "1GiB"), (16 * GiB, "16GiB"), (15.75 * GiB, "15.75GiB"), (GiB + 1, "1,073,741,825B"),
    (TiB, "1TiB"), (1.25 * TiB, "1.25TiB"), (1024 * TiB, "1024TiB"), (-GiB, "-1GiB"),
])
def test_format_size_exact_rounds_nothing_away(n, text):
    assert format_size_exact(n) == text


@pytest.mark.parametrize("s,text", [
    (None, "-"), (-5, "0s"), (0, "0s"), (1, "1s"), (59, "59s"), (59.9, "59s"),
    (60, "1m00s"), (61, "1m01s"), (120, "2m00s"), (125, "2m05s"), (3599, "59m59s"),
    (3600, "1h00m"), (3720, "1h02m"), (7200, "2h00m"), (86399, "23h59m"),
    (86400, "1d00h"), (90061, "1d01h"), (93600, "1d02h"), (172800, "2d00h"), (259199, "2d23h"),
])
def test_format_duration_at_each_boundary(s, text):
    assert format_duration(s) == text


@pytest.mark.parametrize("text", ["٤GiB", "４G", "1.٥GiB", "١٠٢٤"])
def test_sizes_take_ascii_digits_only(text):
    with pytest.raises(BadSize):
        parse_size(text)
