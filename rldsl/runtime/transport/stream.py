"""Buckets streamed over a weight group, a couple in flight at a time.

Each bucket goes as three broadcasts from rank 0: a 3-integer frame
(header bytes, payload bytes, kind), a JSON header (version, and each
tensor's name, dtype, shape and offset) and the payload, every tensor's
bytes back to back at 16-byte aligned offsets so a receiver can view them
in place. A frame of kind END closes a version; one of kind ABORT tells
the receivers the sender failed half way, so nobody waits out a timeout.

The sender posts a bucket and goes on gathering the next while it is
sent; it waits for the oldest once ``max_in_flight`` are posted. The
receiver reads the next frame before it hands a bucket over, so it can
say whether that bucket is the version's last (engines change version on
the last one).
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping

import torch

from rldsl.runtime.transport.group import TransportAborted, WeightGroup

BUCKET, END, ABORT = 0, 1, 2
_ALIGN = 16  # bytes: every dtype's view of the payload starts aligned


@dataclass
class StreamStats:
    """What one push moved: buckets, bytes, seconds, and the most payload
    bytes this side held at once (the memory bound the transport keeps)."""

    buckets: int = 0
    bytes: int = 0
    seconds: float = 0.0
    peak_held_bytes: int = 0
    _held: int = field(default=0, repr=False)

    def hold(self, nbytes: int) -> None:
        self._held += nbytes
        self.peak_held_bytes = max(self.peak_held_bytes, self._held)

    def release(self, nbytes: int) -> None:
        self._held -= nbytes

    def as_dict(self) -> dict:
        return {"buckets": self.buckets, "bytes": self.bytes, "seconds": round(self.seconds, 6),
                "peak_held_bytes": self.peak_held_bytes}


class BucketSender:
    """Rank 0's side of one push."""

    def __init__(self, group: WeightGroup, version: int, max_in_flight: int = 2) -> None:
        if group.rank != 0:
            raise ValueError(f"only rank 0 of a weight group sends; this is rank {group.rank}")
        self.group, self.version, self.max_in_flight = group, version, max(1, max_in_flight)
        self.stats = StreamStats()
        self._posted: deque[tuple[list, int, list]] = deque()  # (works, payload bytes, tensors kept alive)
        self._started = time.perf_counter()

    def send(self, bucket: Mapping[str, torch.Tensor]) -> None:
        while len(self._posted) >= self.max_in_flight:
            self._wait_oldest()
        header, payload = _pack(bucket, self.version, self.group.device)
        self.stats.hold(payload.numel())
        self._post(BUCKET, header, payload)
        self.stats.buckets += 1
        self.stats.bytes += payload.numel()

    def finish(self) -> StreamStats:
        """Close the version and wait until every receiver has it all."""
        self._post(END)
        self._drain()
        self.stats.seconds = time.perf_counter() - self._started
        return self.stats

    def abort(self) -> None:
        """Tell the receivers this version will not complete (best effort:
        the group itself may be what failed)."""
        try:
            self._post(ABORT)
            self._drain()
        except RuntimeError:  # TransportAborted included
            pass

    def _post(self, kind: int, header: bytes = b"", payload: torch.Tensor | None = None) -> None:
        """Broadcast one frame (and its header and payload) without waiting for it."""
        device = self.group.device
        payload_bytes = 0 if payload is None else payload.numel()
        frame = torch.tensor([len(header), payload_bytes, kind], dtype=torch.int64, device=device)
        tensors = [frame]
        if header:
            tensors.append(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device))
        if payload is not None and payload_bytes:
            tensors.append(payload)
        works = [self.group.broadcast(t) for t in tensors]
        self._posted.append((works, payload_bytes, tensors))  # the tensors live until their works end

    def _wait_oldest(self) -> None:
        works, nbytes, _ = self._posted.popleft()
        for work in works:
            self.group.wait(work)
        self.stats.release(nbytes)

    def _drain(self) -> None:
        while self._posted:
            self._wait_oldest()


def send_buckets(group: WeightGroup, buckets: Iterable[Mapping[str, torch.Tensor]], version: int,
                 max_in_flight: int = 2) -> StreamStats:
    """Stream every bucket of ``version``; the next is produced while one is sent.
    If producing a bucket fails, the receivers are told and the error raised."""
    sender = BucketSender(group, version, max_in_flight)
    try:
        for bucket in buckets:
            sender.send(bucket)
            del bucket  # packed: the next one is gathered without this one alive
    except BaseException:
        sender.abort()
        raise
    return sender.finish()


def receive_buckets(group: WeightGroup, version: int | None = None,
                    stats: StreamStats | None = None) -> Iterator[tuple[dict[str, torch.Tensor], bool]]:
    """Each bucket of the next version as ``(tensors, last)``; the tensors
    are views of the received payload, valid until the next bucket is asked
    for. ``version``, when given, must be the one the sender sends."""
    stats = stats if stats is not None else StreamStats()
    started = time.perf_counter()
    frame = _receive_frame(group)
    while frame[2] == BUCKET:
        header = json.loads(_receive(group, frame[0]).cpu().numpy().tobytes())
        if version is not None and header["version"] != version:
            raise RuntimeError(f"expected weights version {version}, the sender sends {header['version']}")
        payload = _receive(group, frame[1])
        stats.hold(payload.numel())
        frame = _receive_frame(group)
        if frame[2] == ABORT:
            break
        stats.buckets += 1
        stats.bytes += payload.numel()
        yield _unpack(header, payload), frame[2] == END
        stats.release(payload.numel())
        del payload
    stats.seconds = time.perf_counter() - started
    if frame[2] == ABORT:
        raise TransportAborted(f"the sender of weights version {version} failed during the push")


def _receive_frame(group: WeightGroup) -> list[int]:
    frame = torch.zeros(3, dtype=torch.int64, device=group.device)
    group.wait(group.broadcast(frame))
    return [int(x) for x in frame.tolist()]


def _receive(group: WeightGroup, nbytes: int) -> torch.Tensor:
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
    if nbytes:
        group.wait(group.broadcast(buffer))
    return buffer


def _pack(bucket: Mapping[str, torch.Tensor], version: int, device: torch.device) -> tuple[bytes, torch.Tensor]:
    entries, offset = [], 0
    for name, tensor in bucket.items():
        nbytes = tensor.numel() * tensor.element_size()
        entries.append({"name": name, "dtype": str(tensor.dtype).removeprefix("torch."),
                        "shape": list(tensor.shape), "offset": offset, "bytes": nbytes})
        offset += -(-nbytes // _ALIGN) * _ALIGN
    payload = torch.empty(offset, dtype=torch.uint8, device=device)
    for entry, tensor in zip(entries, bucket.values()):
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        payload[entry["offset"]: entry["offset"] + entry["bytes"]].copy_(flat)
    return json.dumps({"version": version, "tensors": entries}).encode(), payload


def _unpack(header: dict, payload: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {}
    for entry in header["tensors"]:
        raw = payload[entry["offset"]: entry["offset"] + entry["bytes"]]
        out[entry["name"]] = raw.view(getattr(torch, entry["dtype"])).reshape(entry["shape"])
    return out
