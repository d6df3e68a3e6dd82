"""L2 bookkeeping: bounded capacity, LRU eviction that never touches pinned or filling entries."""

from pathlib import Path

import pytest

from exaserve_hpc.cache.l2_shm import READY, L2Cache, L2Entry, L2Full, choose_victims, entry_key, l2_page_note


def entry(key, nbytes, last_used, pins=(), state=READY):
    return L2Entry(key, key, nbytes, state, set(pins), last_used)


def test_victims_are_least_recently_used_first_and_only_as_many_as_needed():
    entries = [entry("a", 40, 3.0), entry("b", 40, 1.0), entry("c", 20, 2.0)]
    assert choose_victims(entries, 10, 120) == []
    assert choose_victims(entries, 30, 120) == ["b"]
    assert choose_victims(entries, 70, 120) == ["b", "c"]


def test_pinned_and_filling_entries_are_never_evicted():
    entries = [entry("old-pinned", 50, 0.0, pins={"r1"}), entry("filling", 30, 0.5, state="filling"),
               entry("new", 20, 9.0)]
    assert choose_victims(entries, 20, 100) == ["new"]
    with pytest.raises(L2Full, match="pinned or filling"):
        choose_victims(entries, 40, 100)
    with pytest.raises(L2Full, match="whole L2 capacity"):
        choose_victims([], 101, 100)


def fill(cache, key, nbytes, now):
    d = cache.begin_fill(key, key, nbytes, now)
    (d / "blob").write_bytes(b"x" * nbytes)
    cache.finish_fill(key, d, now)


def test_cache_evicts_lru_directories_and_counts(tmp_path):
    cache = L2Cache(tmp_path / "l2", capacity=100)
    fill(cache, "a", 40, 1.0)
    fill(cache, "b", 40, 2.0)
    cache.pin("a", "r1", 3.0)
    cache.unpin("a", "r1", 4.0)  # a is now more recently used than b
    fill(cache, "c", 40, 5.0)
    assert set(cache.entries) == {"a", "c"} and not (tmp_path / "l2" / "b").exists()
    assert cache.evictions == 1 and cache.used() == 80
    cache.pin("a", "r1", 6.0)
    cache.pin("c", "r2", 6.0)
    with pytest.raises(L2Full):
        cache.begin_fill("d", "d", 40, 7.0)
    status = cache.status(8.0)
    assert {(e.model, e.pins, e.state) for e in status.entries} == {("a", 1, "ready"), ("c", 1, "ready")}


def test_a_new_agent_adopts_complete_entries_and_drops_partial_fills(tmp_path):
    cache = L2Cache(tmp_path / "l2", capacity=100)
    fill(cache, "a", 10, 1.0)
    partial = cache.begin_fill("b", "b", 10, 1.0)
    assert partial.exists()
    again = L2Cache(tmp_path / "l2", capacity=100)
    assert again.adopt(now=5.0) == ["a"] and not partial.exists()
    assert again.entries["a"].state == READY and again.entries["a"].nbytes == 10


def test_entry_key_changes_with_the_checkpoint_version():
    assert entry_key("m/x", b"v1") != entry_key("m/x", b"v2")
    assert entry_key("m/x", b"v1").startswith("m_x-")

# /proc/mounts lines captured on a Debian 12 node (the huge one mounted for L2)
MOUNTS = """\
/dev/vda / ext4 rw,relatime 0 0
tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0
tmpfs /dev/shm/exaserve tmpfs rw,relatime,size=6291456k,huge=within_size 0 0
tmpfs /mnt/l2\\040space tmpfs rw,relatime,huge=always 0 0
"""


def test_l2_page_note_names_a_tmpfs_without_huge_pages_and_the_fix():
    note = l2_page_note("/dev/shm/exaserve-l2-0/n1", MOUNTS, "always within_size advise [never] deny force")
    assert note is not None and "/dev/shm/exaserve-l2-0/n1" in note and "(/dev/shm)" in note
    assert "huge=within_size" in note and "weight_cache.l2_path" in note


def test_l2_page_note_is_quiet_on_huge_tmpfs_disks_and_forced_shmem():
    never = "always within_size advise [never] deny force"
    assert l2_page_note("/dev/shm/exaserve/exaserve-l2-0/n1", MOUNTS, never) is None  # deepest mount wins
    assert l2_page_note("/mnt/l2 space/x", MOUNTS, never) is None  # escaped space in the mount point
    assert l2_page_note("/var/cache/l2", MOUNTS, never) is None  # not a tmpfs: nothing to say
    assert l2_page_note("/dev/shm/x", MOUNTS, "always within_size advise never deny [force]") is None
    assert l2_page_note("/dev/shmother/x", MOUNTS, never) is None  # a prefix of a name is not a parent


def test_l2_page_note_counts_advise_and_deny_as_no_huge_pages_for_l2():
    advise = MOUNTS.replace("huge=within_size", "huge=advise")  # only madvise()d mappings; L2 is pwritten
    assert l2_page_note("/dev/shm/exaserve/n1", advise, "always within_size advise [never] deny force") is not None
    assert l2_page_note("/dev/shm/exaserve/n1", MOUNTS, "always within_size advise never [deny] force") is not None


def test_agent_l2_lives_under_the_site_configs_l2_path(tmp_path):
    from exaserve_hpc.agent.node_agent import NodeAgent, default_l2_root
    from exaserve_hpc.config.schema import load_site
    site = load_site(Path(__file__).parents[3] / "site-configs" / "local.yaml")
    site.weight_cache.l2_path = str(tmp_path)
    agent = NodeAgent("tcp://127.0.0.1:1", "n1", l2_capacity=1 << 20,
                      l2_root=str(default_l2_root("n1", site.weight_cache.l2_path)))
    try:
        assert agent.cache.root.is_dir() and agent.cache.root.name == "n1"
        assert agent.cache.root.parent.parent == tmp_path
    finally:
        agent.context.destroy(linger=0)
