"""Int2HostPool: a host-memory tier of the INT2 pool for SGLang's hierarchical cache (HiCache).

Wired into HiCache through runtime/hooks.py (HiRadixCache.__init__ gets this pool for an INT2
device pool; the backend waits for each layer's load before reading it). What it cannot serve
(other host layouts, io backends, storage backends than `file`) is refused at start by
runtime/refusals.py's hicache_problems; measured by bench/path_invariance.py --hicache and
bench/hicache.py.

Host memory (`kv_buffer`): uint8 [page_num, page_bytes], one contiguous blob per page. A page's
blob holds, layer after layer (local layers 0..L-1), four sections, each padded to 16 bytes so
that every section can be viewed as its dtype, each head-major like the device pool's memory:

    K codes   uint8 [H, B, code_bytes(k_bits[l], D)]   (the layer's own key bits)
    K params  fp16  per-channel layout: [H, D, 2], the page's one (scale, min) row per head
                    per-token layout:   [H, B, D / G, 2], one per slot
    V codes   uint8 [H, B, Dv / 4]
    V params  fp16  [H, B, Dv / Gv, 2]

(B = page size.) Head-major because the device pool is ([H, N, ...] memory viewed as [N, H, ...],
runtime/pool.py): a page's section is then H contiguous runs on both sides. `get_size_per_token`
is page_bytes / B, so `--hicache-ratio` / `--hicache-size` size the tier in INT2 bytes.

Copies (`backup_from_device_all_layer`, `load_to_device_per_layer`) are ops.copy_pages: one
Triton launch a layer (four sections) between the pool's buffers and `host_view`, for a CUDA
device pool a CUDA tensor over the pinned blob (the same memory, reachable from the GPU through
unified addressing), so they run on the calling stream (HiCacheController's write / load
stream), read or write host memory over PCIe with no staging copy, and never synchronise with
the host: the indices (whole pages only: runs [p * B, ..., p * B + B - 1]) are checked in the
kernel, a run that is not one is copied nowhere and raises a flag, and the next copy call raises
once the flag has reached host memory (torch gathers with a checked index cost ~12 indexing ops a
layer and a synchronisation that, on the write path, waited for the forward in flight before the
first token went out). The views and checks of each layer's buffers are made once (ops.plan_page_copy),
so a copy is the launch and little else. For a CPU device pool (the tests) the blob itself,
checked at once.
io_backend "kernel" (SGLang's default with --hicache-mem-layout page_first) names this copy;
"direct" / "kernel_ascend" are refused.

The page-0 sink travels with no page: its BF16 copy is kept by the request's first token ids in
the device's sink store (runtime/sink_store.py), which gives it to every request whose prefix
comes from a cache, this tier included.

Load: the first layer's load (layer_id 0) marks every loaded device slot as having no BF16 side
copy (slot_entry = -1: the store kernel's rule for a fresh write).

Streams: backups run on HiCacheController's write stream, loads on its load stream; the page
bytes are safe there (SGLang locks the pages). The layer-0 load's slot_entry write rides the load
stream too, ahead of the layer's completion that the backend waits for (LayerDoneCounter) before
it reads that layer.

Storage keys. SGLang's `file` backend names a page `<page hash><config_suffix>.bin`; the page hash
is a chain of token hashes (mem_cache/utils.get_hash_str, HiCacheController), and
HiCacheFile.__init__ builds config_suffix from HiCacheStorageConfig.model_name and the TP / PP
ranks. HiCacheController._generate_storage_config returns that config, so an AFTER hook on it
that appends `storage_salt(kv_format, rotation_sha256)` to model_name
(`after_generate_storage_config` below, registered in runtime/hooks.py) gives every int2 format
and rotation its own keys, none shared with a BF16 server; BLOB_LAYOUT is hashed in too, so pages
stored in an earlier blob layout are never read as this one. Whether the other storage backends
use model_name in their keys was not checked.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from sglang.srt.mem_cache.pool_host.base import HostKVCache
from sglang.srt.mem_cache.pool_host.common import HostTensorAllocator

from oscar_kernels import ops
from oscar_kernels.format import code_bytes

ALIGN = 16  # bytes each blob section is padded to (fp16 / bf16 views need aligned offsets)
IO_BACKEND = "kernel"
LAYOUT = "page_first"
# the blob layout above; part of the storage keys (a change of it must change this name)
BLOB_LAYOUT = "head-major-1"
# storage backends whose page API this pool serves (flat pages through get_data_page /
# set_from_flat_data_page); the zero-copy and shared-memory ones are refused at start
STORAGE_BACKENDS = ("file",)


def _pad(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Section:
    layer: int        # local layer
    name: str         # k_codes | k_params | v_codes | v_params (the pool's attribute)
    offset: int       # bytes into the page blob
    nbytes: int       # unpadded
    shape: tuple      # one page's shape, head-major
    dtype: torch.dtype
    per_page: bool    # one row per page (per-channel key params) instead of one per slot


def page_sections(pool) -> tuple[list[Section], int]:
    """The fixed order of one page's blob for `pool` (an OscarInt2KVPool), and its size."""
    B, H, D, Dv = pool.page_size, pool.head_num, pool.head_dim, pool.v_head_dim
    fmt = pool.kv_format
    channel = pool.layout.name == "channel"
    out, off = [], 0
    for i in range(pool.layer_num):
        kb = code_bytes(fmt.k_bits[pool.start_layer + i], D)
        kp = (H, D, 2) if channel else (H, B, D // fmt.k_group, 2)
        for name, shape, dtype, per_page in (
            ("k_codes", (H, B, kb), torch.uint8, False),
            ("k_params", kp, torch.float16, channel),
            ("v_codes", (H, B, Dv // 4), torch.uint8, False),
            ("v_params", (H, B, Dv // fmt.v_group, 2), torch.float16, False),
        ):
            n = dtype.itemsize
            for s in shape:
                n *= s
            out.append(Section(i, name, off, n, shape, dtype, per_page))
            off += _pad(n)
    return out, off


def page_slots(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Every slot of `pages`, page after page."""
    return (pages[:, None] * page_size + torch.arange(page_size, device=pages.device)).reshape(-1)


def page_buffer(pool, sec: Section) -> torch.Tensor:
    """The pool's buffer of `sec` as [H, pages, one page's run of a head] (a view: the pool keeps
    [H, N, ...] memory behind its [N, H, ...] views)."""
    buf = getattr(pool, sec.name)[sec.layer].transpose(0, 1)
    H = buf.shape[0]
    return buf if sec.per_page else buf.reshape(H, buf.shape[1] // pool.page_size, -1)


def copy_plans(pool, blob, sections) -> list:
    """ops.plan_page_copy of `sections` (any layers) between `pool` and the blob rows (blob: uint8
    [rows, page_bytes] on the pool's device, or a CUDA view of pinned host memory), one a layer
    (a launch each)."""
    by_layer: dict[int, list] = {}
    for sec in sections:
        by_layer.setdefault(sec.layer, []).append((page_buffer(pool, sec), sec.offset))
    return [ops.plan_page_copy(blob, group) for group in by_layer.values()]


def copy_sections(pool, plans, host_slots, device_slots, bad, to_host: bool) -> None:
    """Whole pages between `pool` and the blob rows of copy_plans' `plans`."""
    for plan in plans:
        ops.run_page_copy(plan, host_slots, device_slots, pool.page_size, bad, to_host)


def raise_if_bad(bad: torch.Tensor, what: str) -> None:
    """The copies' flag (ops.copy_pages) as an error."""
    if int(bad.reshape(-1)[0]) != 0:
        raise ValueError(f"{what}: slots that are not page-aligned runs of whole pages were handed to "
                         "the INT2 host pool (it copies whole pages only); those pages were not copied")


def storage_salt(kv_format_name: str, rotation_sha256: str) -> str:
    """Short, file-name-safe tag of what the stored bytes mean: the KV format and the rotation."""
    digest = hashlib.sha256(f"{kv_format_name}|{rotation_sha256}|{BLOB_LAYOUT}".encode()).hexdigest()
    return f"oscar-int2-{digest[:12]}"


def after_generate_storage_config(result, controller, *args, **kwargs):
    """AFTER hook on HiCacheController._generate_storage_config: int2 servers' storage keys carry
    storage_salt (through model_name, which the file backend puts in every key). Inert unless
    the device pool is the INT2 pool."""
    from .pool import OscarInt2KVPool
    from .state import RUNTIME_INFO

    if not isinstance(getattr(controller, "mem_pool_device", None), OscarInt2KVPool):
        return result
    salt = storage_salt(RUNTIME_INFO["kv_format"], RUNTIME_INFO["rotation_sha256"])
    result.model_name = f"{result.model_name or ''}_{salt}"
    return result


class _PinnedAsCuda:
    """`__cuda_array_interface__` of a pinned uint8 host tensor, for torch.as_tensor."""

    def __init__(self, t: torch.Tensor):
        self.__cuda_array_interface__ = {"shape": tuple(t.shape), "typestr": "|u1",
                                         "data": (t.data_ptr(), False), "version": 3}


def host_view(blob: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`blob` as a tensor on `device`: a CUDA tensor over the same (pinned) memory for a CUDA
    device (GPU kernels read and write it through unified addressing), the blob itself for CPU."""
    if device.type == "cpu":
        return blob
    if device.type != "cuda" or not blob.is_pinned():
        raise ValueError(f"the INT2 host tier is read and written by GPU kernels and needs pinned "
                         f"host memory next to a CUDA device pool (device {device}, pinned "
                         f"{blob.is_pinned()})")
    with torch.cuda.device(device):
        view = torch.as_tensor(_PinnedAsCuda(blob), device=device)
    if view.data_ptr() != blob.data_ptr():  # not the same memory: the copies would go nowhere
        raise ValueError("the pinned host tier has no GPU address equal to its host address "
                         "(unified addressing is required)")
    return view


class Int2HostPool(HostKVCache):
    """SGLang's HostKVCache for OscarInt2KVPool (module docstring); page_first, io "kernel"."""

    def __init__(self, device_pool, host_to_device_ratio: float, host_size: int, page_size: int,
                 layout: str = LAYOUT, pin_memory: bool | None = None, device: str = "cpu",
                 allocator_type: str = "default", *, pool_label: str = "kv"):
        if layout != LAYOUT:
            raise ValueError(f"the INT2 host pool has the {LAYOUT} layout only, not {layout!r}: "
                             f"use --hicache-mem-layout {LAYOUT}")
        if page_size != device_pool.page_size:
            raise ValueError(f"host page size {page_size} != device page size {device_pool.page_size}")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        super().__init__(device_pool, host_to_device_ratio, host_size, page_size, layout,
                         pin_memory, device, allocator_type, pool_label=pool_label)

    # ---------------------------------------------------------------- sizes and memory
    def get_size_per_token(self):
        pool = self.device_pool
        self.sections, self.page_bytes = page_sections(pool)
        self.layer_num = pool.layer_num
        self.layer_sections = [[s for s in self.sections if s.layer == i] for i in range(self.layer_num)]
        return self.page_bytes / self.page_size

    def _empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype, device=self.device, pin_memory=self.pin_memory)

    def init_kv_buffer(self):
        pool = self.device_pool
        if type(self.allocator) is not HostTensorAllocator:
            # shm / mooncake / mori allocators share or register their own memory; this pool
            # allocates torch (pinned) tensors
            raise ValueError(f"the INT2 host pool allocates its own host memory, not through "
                             f"{type(self.allocator).__name__}: use --hicache-storage-backend file "
                             "or none")
        blob = self._empty((self.page_num, self.page_bytes), torch.uint8)
        blob.zero_()  # the sections' padding stays zero: copies never write it
        self.host_view = host_view(blob, pool.slot_entry.device)
        return blob

    def destroy(self):
        # torch pinned tensors (not cudaHostRegister'd mmap like SGLang's pools): nothing to
        # unregister, torch frees them
        self._destroyed = True
        self.kv_buffer = self.host_view = self._own_plans = None

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        return self.page_bytes % page_size_bytes == 0

    # ---------------------------------------------------------------- checks
    def _page_of(self, index) -> int:
        """The host page whose first slot is `index` (the storage backends' page handle)."""
        index = int(index)
        if index % self.page_size or not 0 <= index < self.page_num * self.page_size:
            raise ValueError(f"host slot {index} is not the first slot of a host page "
                             f"(page size {self.page_size}, {self.page_num} pages)")
        return index // self.page_size

    @staticmethod
    def _check_io(io_backend) -> None:
        if io_backend != IO_BACKEND:
            raise ValueError(f"the INT2 host pool copies with its own kernel, io backend "
                             f"{IO_BACKEND!r} (--hicache-io-backend {IO_BACKEND}), not {io_backend!r}")

    def _flag(self, device) -> torch.Tensor:
        """The copies' bad-run flag on the copying device (module docstring); a CUDA flag is
        mirrored into pinned host memory after each copy, read back without waiting by the next."""
        if getattr(self, "_bad", None) is None:
            self._bad = torch.zeros(1, dtype=torch.int32, device=device)
            self._bad_seen = (torch.zeros(1, dtype=torch.int32, pin_memory=True)
                              if self._bad.is_cuda else self._bad)
        return self._bad

    def _plans(self, device_pool, layer: int | None) -> list:
        """copy_plans of one layer (None: every layer) against `device_pool`; those of this pool's
        own device pool (HiCache's only one) are made once, the buffers never move."""
        if device_pool is not self.device_pool:
            return copy_plans(device_pool, self.host_view,
                              self.sections if layer is None else self.layer_sections[layer])
        if getattr(self, "_own_plans", None) is None:
            self._own_plans = copy_plans(device_pool, self.host_view, self.sections)  # a plan a layer
        return self._own_plans if layer is None else self._own_plans[layer:layer + 1]

    def _copy(self, device_pool, layer, host_indices, device_indices, io_backend, to_host: bool,
              mirror: bool = True) -> None:
        """Whole pages of one layer (None: all) between `device_pool` and the host tier; mirror:
        copy the flag to host memory after it (a load does so after its last layer only)."""
        self._check_io(io_backend)
        dev = self.host_view.device
        bad = self._flag(dev)
        raise_if_bad(self._bad_seen, "an earlier HiCache copy")
        copy_sections(device_pool, self._plans(device_pool, layer), host_indices.to(dev),
                      device_indices.to(dev), bad, to_host)
        if bad.is_cuda:
            if mirror:
                self._bad_seen.copy_(bad, non_blocking=True)
        else:
            raise_if_bad(bad, "a HiCache copy")

    # ---------------------------------------------------------------- device <-> host
    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend) -> None:
        """Whole pages device -> host, every layer (a launch a layer)."""
        self._copy(device_pool, None, host_indices, device_indices, io_backend, to_host=True)

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend) -> None:
        """One layer of whole pages host -> device (one launch); layer 0 also resets the loaded
        slots' side-copy pointers (module docstring)."""
        self._copy(device_pool, layer_id, host_indices, device_indices, io_backend, to_host=False,
                   mirror=layer_id == self.layer_num - 1)
        if layer_id == 0:
            # index_fill_, not `[...] = -1`: the latter copies the -1 from pageable host memory,
            # which syncs the load stream with the host (and the stream waits for the forward
            # in flight)
            device_pool.slot_entry.index_fill_(0, device_indices.to(device_pool.slot_entry.device, torch.int64), -1)

    # ---------------------------------------------------------------- flat pages (storage)
    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        """A host page (index: its first host slot) as uint8 [page_bytes] (a view of its blob)."""
        if not flat:
            raise NotImplementedError("the INT2 host pool hands out flat pages only (flat=True)")
        return self.kv_buffer[self._page_of(index)]

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return self._empty((self.page_bytes,), torch.uint8).zero_()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        page = self._page_of(index)
        data = data_page.reshape(-1).view(torch.uint8)
        if data.numel() != self.page_bytes:
            raise ValueError(f"a flat INT2 page has {self.page_bytes} bytes, got {data.numel()}")
        self.kv_buffer[page] = data.to(self.kv_buffer.device)

    def get_page_buffer_meta(self, indices):
        raise NotImplementedError("zero-copy storage backends are not supported by the INT2 host "
                                  "pool yet; use --hicache-storage-backend file")
