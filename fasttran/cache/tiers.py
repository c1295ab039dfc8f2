"""Tiers of an activation cache: where each shard's rows live.

Shards fill the tiers in build order: the CUDA device's memory while the shards fit in
`device_bytes` (only with an encoder on CUDA; None or 0 = no device tier), then host memory
while they fit in `host_bytes` (None = no limit), then disk (the shard's memory-mapped file, when
the cache has a directory), else nowhere: those examples are recomputed when read. Every placed
shard's rows are registered with the C store (_C.CacheStore), which reads them; a disk shard
reopened from a file is checked against its CRC-32C there before its first read. A device shard
is one device allocation holding its encoded values (int8 scales stay in host memory: the C
reader puts each row's scale in the gather table it hands to the device)."""
import numpy as np

from .. import _C

TIERS = ("device", "host", "disk")


class _Arena:
    """Host-tier memory: shards are copied into large NumPy buffers (4 MiB, doubling up to
    256 MiB; NumPy asks the kernel to back allocations of 4 MiB and more with huge pages), so
    a batch of rows scattered over the cache costs few TLB misses: with 4 KiB pages, random
    rows read at ~80% of a sequential copy; with huge pages, at the copy's speed."""

    def __init__(self):
        self.buf, self.pos, self.next_size = None, 0, 4 << 20

    def take(self, a):
        """A copy of array `a` in the arena."""
        need = (a.nbytes + 63) & ~63
        if self.buf is None or self.pos + need > len(self.buf):
            self.buf, self.pos = np.empty(max(self.next_size, need), np.uint8), 0
            self.next_size = min(2 * self.next_size, 256 << 20)
        out = self.buf[self.pos:self.pos + a.nbytes].view(a.dtype).reshape(a.shape)
        out[...] = a
        self.pos += need
        return out


class Shard:
    __slots__ = ("file", "bytes", "crc", "nbytes", "tier", "values", "scales", "examples")


# the codec's storage as a dtype fasttran.Tensor carries (the C store checks the element size only)
_DEVICE_VIEW = {np.dtype(np.float32): np.float32, np.dtype(np.uint16): np.int16, np.dtype(np.int8): np.int8}


class Tiers:
    def __init__(self, store, host_bytes, device_bytes=None, device=None):
        self.store = store
        self.host_bytes = host_bytes
        self.device_bytes = device_bytes if device else None   # device: "cuda:N" of the device tier
        self.device = device
        self.shards = []
        self.used = dict.fromkeys(TIERS, 0)
        self.arena = _Arena()

    def fits_host(self, nbytes):
        return self.host_bytes is None or self.used["host"] + nbytes <= self.host_bytes

    def fits_device(self, nbytes):
        return bool(self.device_bytes) and self.used["device"] + nbytes <= self.device_bytes

    def fits_memory(self, nbytes):
        """the shard goes to the device or the host (not served from its file)"""
        return self.fits_device(nbytes) or self.fits_host(nbytes)

    def place(self, examples, values, scales, nbytes, file=None, mapped=None, verified=True):
        """Put a shard in the first tier it fits. values/scales: arrays in memory, or views of
        the shard file's map `mapped` (`verified`: its checksum was checked already, or the
        file was just written). file = (name, bytes, crc32c). Returns the Shard, or None when
        it fits nowhere (no host room and no file map)."""
        s = Shard()
        s.examples = np.ascontiguousarray(examples, np.int64)
        s.file, s.bytes, s.crc = file if file else (None, 0, None)
        s.nbytes = int(nbytes)
        check = None
        on_device = None
        if self.fits_device(nbytes):
            host = np.require(values, requirements=["C", "W"])   # DLPack exports no read-only array
            try:
                on_device = _C.Tensor.from_dlpack(host.view(_DEVICE_VIEW[host.dtype])).to(self.device)
            except MemoryError:   # the device is fuller than device_bytes said: the tier ends here
                self.device_bytes = self.used["device"]
        if on_device is not None:
            s.tier = "device"
            values = on_device
            scales = None if scales is None else np.array(scales, np.float32)
        elif self.fits_host(nbytes):
            s.tier = "host"
            values = self.arena.take(values)
            scales = None if scales is None else self.arena.take(scales)
        elif mapped is not None:
            s.tier = "disk"
            check = None if verified else mapped
        else:
            return None
        s.values, s.scales = values, scales
        self.store.add_shard(name=s.file or "host shard", examples=s.examples, values=values, scales=scales,
                             file=check, crc32c=s.crc or 0)
        self.shards.append(s)
        self.used[s.tier] += s.nbytes
        return s

    def stats(self):
        out = {}
        for t in TIERS:
            sh = [s for s in self.shards if s.tier == t]
            out[t] = {"bytes": int(sum(s.nbytes for s in sh)), "entries": int(sum(len(s.examples) for s in sh))}
        return out
