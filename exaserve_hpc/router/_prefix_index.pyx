# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The prefix index compiled: `prefix_index.PrefixIndex`'s behaviour, one C hash table.

The pure-Python `PrefixIndex` is the reference (tests/router/test_prefix_index_compiled.py runs
the same operations through both and compares every result); this one exists because the
router's one thread spent most of a request in the index (two dicts probed per block, a dict of
holders per block). Same rules, other storage:

- one open-addressing table (linear probing) of block hash -> entry; an entry's generation
  number replaces the young/old pair of dicts: young = the current generation, old = the one
  before, older = gone (its slot is reused, and the table is rebuilt without such entries when
  it fills). A rotation is a counter increment, as dropping the old dict was O(1) for Python;
- an entry's holders are (replica slot, epoch) pairs packed in 64 bits, oldest first: one
  inline, more in a small malloc'd array (most blocks have one holder);
- replica ids are numbered once (slot), their epochs kept in a C array.

Block hashes are 64-bit (signed, as Python's tuple hash gives them, or unsigned, as the
engine's blake2b names are): another int raises OverflowError. They come as a list of ints or,
from a packed request (protocol.unpack_hashes), as an array('q') or array('Q'), whose buffer is
read as it is: no Python int is made for them.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_AsUnsignedLongLong
from libc.stdint cimport uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memmove

from array import array as _array

from exaserve_hpc.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

cdef uint64_t GOLDEN = 0x9E3779B97F4A7C15ULL
cdef Py_ssize_t MAX_HOLDERS = 60000  # holder counts are 16-bit


cdef struct Entry:
    uint64_t key
    uint32_t gen  # 0: never used; live while >= the current generation - 1
    uint16_t n  # holders
    uint16_t cap  # holder storage: 1 = the inline `one`, else `many`
    uint64_t one
    uint64_t* many


cdef inline uint64_t* holders_of(Entry* e) noexcept nogil:
    return e.many if e.cap > 1 else &e.one


cdef inline uint64_t hash_key(object h) except? 0:
    cdef int overflow = 0
    cdef long long v = PyLong_AsLongLongAndOverflow(h, &overflow)
    if overflow == 0:
        return <uint64_t>v
    return PyLong_AsUnsignedLongLong(h)  # above 2**63: an unsigned name; beyond 64 bits: OverflowError


cdef struct Keys:
    uint64_t* keys  # the block hashes as table keys
    Py_ssize_t n
    uint64_t* owned  # malloc'd here (from a list), freed by keys_close
    Py_buffer view  # an array's own buffer, released by keys_close
    bint has_view


cdef int keys_open(object hashes, Keys* k) except -1:
    """The hashes as C keys: an array('q'/'Q')'s buffer as it is, else each int converted once."""
    cdef Py_ssize_t i, n
    k.owned, k.has_view = NULL, False
    if type(hashes) is _array and (hashes.typecode == "q" or hashes.typecode == "Q"):
        PyObject_GetBuffer(hashes, &k.view, PyBUF_SIMPLE)
        k.has_view = True
        k.keys, k.n = <uint64_t*>k.view.buf, k.view.len // 8
        return 0
    hs = hashes if type(hashes) is list else list(hashes)
    n = len(hs)
    k.owned = <uint64_t*>malloc((n if n else 1) * sizeof(uint64_t))
    if k.owned == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            k.owned[i] = hash_key(hs[i])
    except BaseException:
        free(k.owned)
        k.owned = NULL
        raise
    k.keys, k.n = k.owned, n
    return 0


cdef void keys_close(Keys* k) noexcept:
    if k.has_view:
        PyBuffer_Release(&k.view)
        k.has_view = False
    free(k.owned)
    k.owned = NULL


cdef inline int find_holder(Entry* e, uint32_t slot) noexcept nogil:
    cdef uint64_t* hs = holders_of(e)
    cdef int i
    for i in range(e.n):
        if <uint32_t>(hs[i] >> 32) == slot:
            return i
    return -1


cdef inline void remove_at(Entry* e, int i) noexcept nogil:
    cdef uint64_t* hs = holders_of(e)
    if i < e.n - 1:
        memmove(&hs[i], &hs[i + 1], (e.n - 1 - i) * sizeof(uint64_t))
    e.n -= 1


cdef int append_holder(Entry* e, uint64_t v) except -1:
    cdef uint64_t* grown
    cdef int size
    if e.n == e.cap:
        if e.cap == 1:
            grown = <uint64_t*>malloc(4 * sizeof(uint64_t))
            if grown == NULL:
                raise MemoryError()
            grown[0] = e.one
            e.many, e.cap = grown, 4
        else:
            size = 2 * e.cap
            if size > 65535:
                size = 65535
            grown = <uint64_t*>realloc(e.many, size * sizeof(uint64_t))
            if grown == NULL:
                raise MemoryError()
            e.many, e.cap = grown, size
    holders_of(e)[e.n] = v
    e.n += 1
    return 0


cdef class PrefixIndex:
    cdef Entry* table
    cdef size_t mask
    cdef int shift
    cdef size_t used  # slots ever claimed since the last rebuild (live or gone)
    cdef size_t young_n, old_n
    cdef uint32_t gen
    cdef uint32_t* epochs
    cdef size_t epochs_cap
    cdef dict _slots  # replica id -> slot
    cdef list _ids  # slot -> replica id
    cdef readonly Py_ssize_t max_blocks, max_holders
    cdef public Py_ssize_t evicted_generations

    def __cinit__(self, Py_ssize_t max_blocks=1_000_000, Py_ssize_t max_holders=16):
        if max_blocks < 2:
            raise ValueError(f"max_blocks must be >= 2, got {max_blocks}")
        if max_holders > MAX_HOLDERS:
            raise ValueError(f"max_holders must be <= {MAX_HOLDERS} in the compiled index, got {max_holders}")
        self.max_blocks, self.max_holders = max_blocks, max_holders
        self.evicted_generations = 0
        self.gen = 2  # 0 marks a free slot, and gen - 1 (the old generation) must stay above it
        self._slots, self._ids = {}, []
        self._alloc(1024)

    def __dealloc__(self):
        self._free_table(self.table, self.mask + 1 if self.table != NULL else 0)
        free(self.epochs)

    cdef int _alloc(self, size_t size) except -1:
        self.table = <Entry*>calloc(size, sizeof(Entry))
        if self.table == NULL:
            raise MemoryError()
        self.mask = size - 1
        self.shift = 64 - (size.bit_length() - 1)
        self.used = 0
        return 0

    cdef void _free_table(self, Entry* table, size_t size) noexcept:
        cdef size_t i
        if table == NULL:
            return
        for i in range(size):
            if table[i].gen and table[i].cap > 1:
                free(table[i].many)
        free(table)

    cdef int _rebuild(self) except -1:
        """Drop gone entries; double the table while the live ones would fill more than 30% of it."""
        cdef Entry* old = self.table
        cdef size_t old_size = self.mask + 1, size = old_size, live = self.young_n + self.old_n, i, j
        cdef uint32_t floor = self.gen - 1
        while live * 10 > size * 3:
            size *= 2
        self._alloc(size)
        for i in range(old_size):
            if old[i].gen >= floor:
                j = <size_t>((old[i].key * GOLDEN) >> self.shift)
                while self.table[j].gen:
                    j = (j + 1) & self.mask
                self.table[j] = old[i]
                self.used += 1
            elif old[i].gen and old[i].cap > 1:
                free(old[i].many)
        free(old)
        return 0

    cdef inline Entry* _find(self, uint64_t key) noexcept:
        """The live entry of a block, or NULL."""
        cdef size_t i = <size_t>((key * GOLDEN) >> self.shift)
        cdef Entry* e
        while True:
            e = &self.table[i]
            if e.gen == 0:
                return NULL
            if e.key == key:
                return e if e.gen + 1 >= self.gen else NULL
            i = (i + 1) & self.mask

    cdef Entry* _claim(self, uint64_t key, bint* fresh) except NULL:
        """The live entry of a block, or a new empty one (fresh): a gone entry's slot is reused."""
        cdef size_t i
        cdef Entry* e
        cdef Entry* reuse = NULL
        cdef uint32_t floor
        if (self.used + 1) * 5 > (self.mask + 1) * 3:
            self._rebuild()
        floor = self.gen - 1
        i = <size_t>((key * GOLDEN) >> self.shift)
        while True:
            e = &self.table[i]
            if e.gen == 0:
                break
            if e.key == key:
                if e.gen >= floor:
                    fresh[0] = False
                    return e
                reuse = e  # this block's own gone entry: no other can exist further on
                break
            if reuse == NULL and e.gen < floor:
                reuse = e
            i = (i + 1) & self.mask
        if reuse != NULL:
            e = reuse  # keeps its holder storage for the new holders
        else:
            self.used += 1
            e.cap = 1
            e.many = NULL
        e.key, e.n = key, 0
        fresh[0] = True
        return e

    # ---------------------------------------------------------------- replicas

    cdef Py_ssize_t _slot(self, str replica_id, bint create) except -2:
        """A replica's number, or -1 (create False) for one never seen; a new one starts at epoch 0."""
        slot = self._slots.get(replica_id)
        if slot is not None:
            return <Py_ssize_t>slot
        if not create:
            return -1
        cdef Py_ssize_t s = len(self._ids)
        cdef uint32_t* grown
        if <size_t>s >= self.epochs_cap:
            grown = <uint32_t*>realloc(self.epochs, (2 * self.epochs_cap + 64) * sizeof(uint32_t))
            if grown == NULL:
                raise MemoryError()
            self.epochs, self.epochs_cap = grown, 2 * self.epochs_cap + 64
        self.epochs[s] = 0
        self._ids.append(replica_id)
        self._slots[replica_id] = s
        return s

    cdef inline bint _holds(self, Entry* e, uint32_t slot, uint64_t v) noexcept:
        cdef uint64_t* hs
        cdef int i
        if e == NULL:
            return False
        hs = holders_of(e)
        for i in range(e.n):
            if hs[i] == v:
                return True
        return False

    # ---------------------------------------------------------------- filling

    def record(self, str replica_id, hashes, Py_ssize_t held=0):
        """As `prefix_index.PrefixIndex.record`."""
        cdef Keys k
        cdef Py_ssize_t start = 0, hi, mid
        cdef Py_ssize_t slot = self._slot(replica_id, False)
        cdef uint64_t v
        cdef Entry* e
        keys_open(hashes, &k)
        try:
            if held and slot >= 0:
                v = (<uint64_t>slot << 32) | self.epochs[slot]
                hi = held if held <= k.n else k.n
                while start < hi:
                    mid = (start + hi + 1) >> 1
                    e = self._find(k.keys[mid - 1])
                    if e != NULL and e.gen == self.gen and self._holds(e, <uint32_t>slot, v):
                        start = mid
                    else:
                        hi = mid - 1
            self._add(replica_id, k.keys, k.n, start)
        finally:
            keys_close(&k)

    cdef int _add(self, str replica_id, uint64_t* hs, Py_ssize_t n, Py_ssize_t start) except -1:
        cdef Py_ssize_t slot = self._slot(replica_id, True), j, cap = self.max_holders
        cdef uint64_t v = (<uint64_t>slot << 32) | self.epochs[slot]
        cdef Entry* e
        cdef bint fresh
        cdef int i
        for j in range(start, n):
            e = self._claim(hs[j], &fresh)
            if fresh:
                e.gen = self.gen
                self.young_n += 1
                holders_of(e)[0] = v
                e.n = 1
                continue
            if e.gen != self.gen:  # old generation: touched, so young again
                e.gen = self.gen
                self.young_n += 1
                self.old_n -= 1
            i = find_holder(e, <uint32_t>slot)
            if i >= 0:
                remove_at(e, i)
            append_holder(e, v)  # newest holder last
            if e.n > cap:
                remove_at(e, 0)
        if self.young_n >= <size_t>(self.max_blocks // 2):
            self.old_n, self.young_n = self.young_n, 0
            self.gen += 1
            self.evicted_generations += 1
        return 0

    def apply_events(self, str replica_id, events):
        """As `prefix_index.PrefixIndex.apply_events`."""
        cdef Keys k
        cdef Py_ssize_t slot
        cdef Entry* e
        cdef int i
        for event in events:
            if isinstance(event, BlockStored):
                keys_open(event.block_hashes, &k)
                try:
                    self._add(replica_id, k.keys, k.n, 0)
                finally:
                    keys_close(&k)
            elif isinstance(event, BlockRemoved):
                slot = self._slot(replica_id, False)
                if slot < 0:
                    continue
                for h in event.block_hashes:
                    e = self._find(hash_key(h))
                    if e != NULL:
                        i = find_holder(e, <uint32_t>slot)
                        if i >= 0:
                            remove_at(e, i)
            elif isinstance(event, AllBlocksCleared):
                self.forget(replica_id)

    def forget(self, str replica_id):
        """As `prefix_index.PrefixIndex.forget`: O(1), entries of older epochs stop counting."""
        cdef Py_ssize_t slot = self._slot(replica_id, True)
        self.epochs[slot] += 1

    # ---------------------------------------------------------------- lookup

    cdef Py_ssize_t _deepest(self, uint64_t* hs, Py_ssize_t n) noexcept:
        cdef Py_ssize_t lo = 0, hi = n, mid
        cdef Entry* e
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            e = self._find(hs[mid - 1])
            if e != NULL and e.n:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def deepest(self, hashes):
        cdef Keys k
        keys_open(hashes, &k)
        try:
            return self._deepest(k.keys, k.n)
        finally:
            keys_close(&k)

    def match(self, hashes, allowed=None, exclude=(), Py_ssize_t limit=4, Py_ssize_t scan=8):
        """As `prefix_index.PrefixIndex.match`."""
        cdef Keys keys
        keys_open(hashes, &keys)
        try:
            return self._match(keys.keys, keys.n, allowed, exclude, limit, scan)
        finally:
            keys_close(&keys)

    cdef list _match(self, uint64_t* hs, Py_ssize_t n, allowed, exclude, Py_ssize_t limit, Py_ssize_t scan):
        cdef Py_ssize_t depth = self._deepest(hs, n), level, step = 1, halvings = 3, seen, nstale, k
        cdef Entry* e
        cdef uint64_t* holders
        cdef uint64_t h
        cdef uint32_t slot
        cdef int i
        cdef uint32_t stale[64]
        cdef dict found
        if depth == 0:
            return []
        found = {}
        ids = self._ids
        level = depth
        while level >= 1 and len(found) < limit:
            e = self._find(hs[level - 1])
            if e != NULL and e.n:
                nstale = 0
                seen = 0
                holders = holders_of(e)
                i = e.n - 1
                while i >= 0:
                    if seen >= scan:
                        break
                    seen += 1
                    h = holders[i]
                    i -= 1
                    slot = <uint32_t>(h >> 32)
                    replica_id = ids[slot]
                    if replica_id in found:
                        continue
                    if self.epochs[slot] != <uint32_t>h:
                        if nstale < 64:
                            stale[nstale] = slot
                            nstale += 1
                    elif replica_id not in exclude and (allowed is None or replica_id in allowed):
                        found[replica_id] = level
                        if len(found) >= limit:
                            break
                for k in range(nstale):
                    i = find_holder(e, stale[k])
                    if i >= 0:
                        remove_at(e, i)
            if depth - level >= 1:  # after the deepest two levels, halve (at most `halvings` times)
                if halvings == 0:
                    break
                halvings -= 1
                step = level - level // 2
            level -= step
        out = []
        for replica_id, lvl in found.items():
            if lvl < depth - 1:
                lvl = self._depth_of(<uint32_t>self._slots[replica_id], hs, lvl, depth)
            out.append((replica_id, lvl))
        return out

    def held(self, str replica_id, hashes, Py_ssize_t deepest):
        """As `prefix_index.PrefixIndex.held`."""
        cdef Py_ssize_t slot = self._slot(replica_id, False)
        cdef Keys k
        cdef Entry* e
        if slot < 0 or deepest < 1:
            return 0
        keys_open(hashes, &k)
        try:
            if k.n == 0:
                raise IndexError("held() of an empty list of hashes")
            e = self._find(k.keys[0])
            if e == NULL or not self._holds(e, <uint32_t>slot, (<uint64_t>slot << 32) | self.epochs[slot]):
                return 0
            return self._depth_of(<uint32_t>slot, k.keys, 1, deepest if deepest <= k.n else k.n)
        finally:
            keys_close(&k)

    cdef Py_ssize_t _depth_of(self, uint32_t slot, uint64_t* hs, Py_ssize_t lo, Py_ssize_t hi) noexcept:
        cdef uint64_t v = (<uint64_t>slot << 32) | self.epochs[slot]
        cdef Py_ssize_t mid
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._holds(self._find(hs[mid - 1]), slot, v):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def holders(self, h):
        """Current holders of one block, oldest first (tests, status)."""
        cdef Entry* e = self._find(hash_key(h))
        cdef uint64_t* hs
        cdef int i
        out = []
        if e != NULL:
            hs = holders_of(e)
            for i in range(e.n):
                if self.epochs[hs[i] >> 32] == <uint32_t>hs[i]:
                    out.append(self._ids[hs[i] >> 32])
        return out

    def __len__(self):
        return self.young_n + self.old_n
