"""The weight group shared by the learner (sender, rank 0) and rollout engines (receivers).

Both mirror halves (`learner.weight_sender`, `rollout.weight_receiver`) use these helpers,
so the bucket layout is defined once. The group is a bare gloo/NCCL backend on a
`PrefixStore` of the learner's TCPStore, one prefix per membership epoch: it never touches
torch.distributed's default group (the learner's FSDP group, vLLM's own groups).

torch is imported inside functions: `services` must import without it.
"""

from __future__ import annotations

from datetime import timedelta

from services.protocol import Bucket, TensorSpec, WeightBackend

ALIGN_BYTES = 64
CHUNK_BYTES = 16 << 20
"""Runs of small tensors are packed and sent in pieces of at most this size."""
DIRECT_BYTES = 4 << 20
"""A tensor at least this large is sent from its own memory (no pack copy)."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4, "uint8": 1}


def plan_buckets(specs: list[tuple[str, list[int], str]], bucket_bytes: int) -> list[Bucket]:
    """Pack (name, shape, dtype) into flat buckets of at most `bucket_bytes` (a tensor larger
    than that gets a bucket of its own). Offsets are 64-byte aligned so every slice can be
    viewed as its dtype."""
    buckets: list[Bucket] = []
    current: list[TensorSpec] = []
    used = 0
    for name, shape, dtype in specs:
        nbytes = DTYPE_BYTES[dtype]
        for dim in shape:
            nbytes *= dim
        offset = _align(used)
        if current and offset + nbytes > bucket_bytes:
            buckets.append(Bucket(nbytes=used, tensors=current))
            current, offset = [], 0
        current.append(TensorSpec(name=name, shape=list(shape), dtype=dtype, offset=offset, nbytes=nbytes))
        used = offset + nbytes
    if current:
        buckets.append(Bucket(nbytes=used, tensors=current))
    return buckets


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def unpack(bucket: Bucket, buf) -> list[tuple[str, object]]:
    """Views of `buf` as the bucket's named tensors (no copies)."""
    import torch

    pairs = []
    for spec in bucket.tensors:
        dtype = getattr(torch, spec.dtype)
        view = buf[spec.offset : spec.offset + spec.nbytes].view(dtype).view(spec.shape)
        pairs.append((spec.name, view))
    return pairs


def host_store(port: int, timeout_s: float, host: str = "127.0.0.1"):
    """The learner's rendezvous store (a TCPStore server; workers connect later), listening
    only on `host`, the address rollout servers are told. A TCPStore has no authentication
    and, left to bind its own socket, listens on every interface whatever host it is given."""
    import socket

    from torch.distributed import TCPStore

    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listener = socket.create_server(address, family=family)
    except OSError as error:
        raise OSError(
            f"cannot listen for the weight rendezvous on {host}:{port} ({error.strerror}): "
            "the advertised host must be an address of this machine"
        ) from error
    return TCPStore(
        host,
        listener.getsockname()[1],
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=listener.detach(),
    )


def connect_store(host: str, port: int, timeout_s: float):
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def reached_key(epoch: int, rank: int) -> str:
    return f"tandem/weights/epoch{epoch}/reached/{rank}"


def mark_reached(store, epoch: int, rank: int) -> None:
    """A receiver reached the learner's store for `epoch` (before joining its group): when
    the group fails, the learner tells a member that never got this far from one that did."""
    store.set(reached_key(epoch, rank), "1")


def unreached(store, epoch: int, ranks: dict[str, int]) -> list[str]:
    """The members (server -> rank) that never reached the store in `epoch`."""
    return sorted(server for server, rank in ranks.items() if not store.check([reached_key(epoch, rank)]))


def device_identity(device) -> str:
    """Which physical device `device` is, comparable across processes: "cpu", or "cuda:"
    and the GPU's UUID (two processes may number one GPU differently, by
    CUDA_VISIBLE_DEVICES)."""
    if device.type != "cuda":
        return "cpu"
    import torch

    properties = torch.cuda.get_device_properties(device)
    uuid = getattr(properties, "uuid", None)
    # torch's stubs leave out pci_bus_id, which CUDA builds have (torch.numa reads it too)
    return f"cuda:{uuid}" if uuid is not None else f"cuda:{properties.pci_bus_id}"  # type: ignore[attr-defined]


def choose_backend(sender: str, receivers: list[list[str]]) -> tuple[WeightBackend, str]:
    """The weight group's backend, from both ends: (backend, why). `sender` is the learner's
    `device_identity`; `receivers` the identities of each receiver's workers ([] when a
    receiver has not said). NCCL needs every rank on its own GPU: it refuses two ranks on
    one device (a learner and an engine sharing a GPU) and cannot reach a CPU engine.
    Anything else goes over gloo, which moves CUDA tensors too (staged through the host)."""
    if not sender.startswith("cuda:"):
        return "gloo", "the learner is on CPU"
    devices = [sender]
    for workers in receivers:
        if not workers:
            return "gloo", "a rollout server has not reported its devices"
        devices += workers
    if any(not device.startswith("cuda:") for device in devices):
        return "gloo", "a rollout engine is on CPU"
    if len(set(devices)) < len(devices):
        return "gloo", "two ranks share a GPU"
    return "nccl", "every rank on its own GPU"


def close_group(group) -> None:
    """Abort a group this process is done with (a failed collective, a new membership):
    an NCCL communicator left open keeps its GPU memory and threads, and a failed one must
    be aborted before anything else runs on its stream. Errors are ignored: the group is
    being thrown away."""
    abort = getattr(group, "abort", None)
    if abort is None:
        return
    try:
        abort()
    except Exception:  # closing a broken group may itself fail; it is discarded either way
        pass


def open_group(store, backend: str, epoch: int, rank: int, world_size: int, timeout_s: float):
    """Join epoch `epoch`'s group; blocks until all `world_size` ranks have joined."""
    from torch.distributed import PrefixStore

    prefixed = PrefixStore(f"tandem/weights/epoch{epoch}", store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        from torch.distributed.distributed_c10d import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return ProcessGroupNCCL(prefixed, rank, world_size, options)
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    return ProcessGroupGloo(prefixed, rank, world_size, timeout=timeout)


def broadcast_async(group, tensor):
    """Start a broadcast from rank 0 in place; returns the work handle."""
    from torch.distributed import BroadcastOptions

    options = BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    return group.broadcast([tensor], options)


def broadcast(group, tensor, timeout_s: float) -> None:
    """Broadcast from rank 0 in place; raises on timeout instead of hanging."""
    broadcast_async(group, tensor).wait(timedelta(seconds=timeout_s))


def segments(bucket: Bucket) -> list[tuple[int, int, str | None]]:
    """How a bucket travels, as (start, stop, name) byte ranges both sides derive from the
    plan: a tensor of at least DIRECT_BYTES goes alone, straight from its own memory
    (`name`); runs of smaller tensors go packed, in pieces of at most CHUNK_BYTES (`name`
    None). Alignment gaps between tensors are not sent."""
    out: list[tuple[int, int, str | None]] = []
    run: list[int] = []  # [start, stop] of the current run of small tensors

    def flush() -> None:
        if run:
            out.extend((a, min(a + CHUNK_BYTES, run[1]), None) for a in range(run[0], run[1], CHUNK_BYTES))
            run.clear()

    for spec in bucket.tensors:
        if spec.nbytes >= DIRECT_BYTES:
            flush()
            out.append((spec.offset, spec.offset + spec.nbytes, spec.name))
        else:
            run[:] = [run[0] if run else spec.offset, spec.offset + spec.nbytes]
            if run[1] - run[0] >= CHUNK_BYTES:
                flush()
    flush()
    return out


def send_buckets(group, buckets: list[Bucket], fetch, timeout_s: float, device, buffers: list) -> int:
    """Rank 0: broadcast every bucket segment by segment (see `segments`): large tensors
    without a copy, small ones packed into a buffer piece by piece while earlier pieces are
    on the wire. Two buffers alternate between buckets; `buffers` (two slots) keeps them
    across updates. `fetch(bucket)` returns the bucket's named tensors. Returns bytes sent."""
    import torch

    in_flight: list[list] = [[], []]
    timeout = timedelta(seconds=timeout_s)
    sent = 0
    for i, bucket in enumerate(buckets):
        slot = i % 2
        for work in in_flight[slot]:  # the buffer's previous bucket must be off the wire
            work.wait(timeout)
        if buffers[slot] is None or buffers[slot].numel() < bucket.nbytes:
            buffers[slot] = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        buf, tensors = buffers[slot], fetch(bucket)
        small = iter([spec for spec in bucket.tensors if spec.nbytes < DIRECT_BYTES])  # offset order
        unpacked = next(small, None)
        works = []
        for start, stop, name in segments(bucket):
            if name is not None:
                data = _as_bytes(tensors[name])
            else:
                while unpacked is not None and unpacked.offset < stop:  # everything this piece holds
                    buf[unpacked.offset : unpacked.offset + unpacked.nbytes].copy_(_as_bytes(tensors[unpacked.name]))
                    unpacked = next(small, None)
                data = buf[start:stop]
            works.append((broadcast_async(group, data), data))  # `data` must outlive its send
            sent += stop - start
        in_flight[slot] = [work for work, _ in works]
    for pending in in_flight:
        for work in pending:
            work.wait(timeout)
    return sent


def _as_bytes(tensor):
    import torch

    return tensor.detach().contiguous().view(-1).view(torch.uint8)


def receive_buckets(group, buckets: list[Bucket], timeout_s: float, device, buffers: list) -> list[tuple[str, object]]:
    """Ranks > 0: receive every bucket segment by segment into `buffers` (one per bucket,
    kept across updates); returns (name, tensor) views into them, valid until the next update."""
    import torch

    pairs = []
    for i, bucket in enumerate(buckets):
        if len(buffers) <= i:
            buffers.append(None)
        if buffers[i] is None or buffers[i].numel() < bucket.nbytes:
            buffers[i] = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        # All of a bucket's receives are posted at once: gloo runs them in order, and the
        # sender's next piece does not wait for a round trip per piece.
        works = [broadcast_async(group, buffers[i][start:stop]) for start, stop, _ in segments(bucket)]
        for work in works:
            work.wait(timedelta(seconds=timeout_s))
        pairs += unpack(bucket, buffers[i])
    return pairs
