from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from exaserve_hpc.config.hostlist import compress_hostlist, expand_hostlist
from exaserve_hpc.units import format_size, parse_duration, parse_size


@pytest.mark.parametrize("text,expected", [("1024", 1024), ("512MiB", 512 * 2**20), ("80GiB", 80 * 2**30),
                                           ("64GB", 64 * 10**9), (4096, 4096), ("1.5KiB", 1536)])
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["80 gigs", "-1", True, None, "GiB"])
def test_bad_sizes_name_the_forms(bad):
    with pytest.raises(ValueError, match="GiB|zero or more"):
        parse_size(bad)


@pytest.mark.parametrize("bad", ["soon", "-5s", True, [1]])
def test_bad_durations(bad):
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_format_size():
    assert format_size(80 * 2**30) == "80.0 GiB"
    assert format_size(12) == "12 B"


def test_expand_hostlist_forms():
    assert expand_hostlist("n[1-4]") == ["n1", "n2", "n3", "n4"]
    assert expand_hostlist("gpu[001-003,007],login1") == ["gpu001", "gpu002", "gpu003", "gpu007", "login1"]
    assert expand_hostlist("localhost") == ["localhost"]


@pytest.mark.parametrize("bad", ["n[4-1]", "n[1-", "n[a-b]", "n]1["])
def test_bad_hostlists(bad):
    with pytest.raises(ValueError):
        expand_hostlist(bad)


@given(st.sets(st.integers(0, 300), min_size=1, max_size=40), st.sampled_from(["n", "gpu", "rack1-node"]))
def test_compress_expand_round_trip(numbers, prefix):
    hosts = [f"{prefix}{n}" for n in sorted(numbers)]
    assert expand_hostlist(compress_hostlist(hosts)) == hosts
