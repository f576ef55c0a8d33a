"""Where a worker's message buffers live: host memory on a CPU, device memory with CUDA-aware
MPI, else pinned host memory that the payload is staged through (one copy each way per
step). The header is always read and written on the host."""

from __future__ import annotations

import numpy as np

from mpilb.mpi import wire, wire_format


class DeviceMessages:
    """Message buffers (:class:`wire.MessageBuffer`) for one backend.

    Args:
        backend: the worker's compute backend (mpilb/backend.py).
        cuda_aware: MPI reads and writes device memory (--workers-cuda-aware; GPU only).
    """

    def __init__(self, backend, cuda_aware: bool):
        self.backend = backend
        self.on_cpu = backend.name == "cpu"
        # With CUDA-aware MPI, messages live in device memory and MPI reads them there;
        # otherwise a GPU worker stages them through pinned host buffers.
        self.cuda_aware = cuda_aware and not self.on_cpu
        # The payload is already on the compute device (CPU, or CUDA-aware GPU): the
        # parameters are used where they were received, no copy per step.
        self.device_payload = self.on_cpu or self.cuda_aware

    def new(self, floats: int) -> wire.MessageBuffer:
        """A message of `floats` payload floats."""
        if self.on_cpu:
            return wire.new_message(floats)
        nbytes = wire.HEADER_BYTES + 4 * floats
        if self.cuda_aware:
            buf = self.backend.xp.zeros(nbytes, dtype=np.uint8)
            return wire.MessageBuffer(buf, wire.new_header(), buf[wire.HEADER_BYTES:].view(np.float32))
        buf = self.backend.empty_host(nbytes)
        buf[:] = 0
        return wire.MessageBuffer(buf, wire.header_view(buf), buf[wire.HEADER_BYTES:].view(np.float32))

    def new_wire(self, fmt: wire_format.WireFormat, floats: int, state: int = 0) -> tuple:
        """A message of `floats` values of the wire format `fmt`, then `state` float32
        values: (the MessageBuffer, whose payload holds the wire values, and the state view).
        Where MPI reads host memory, the payload is converted on the device into `staging`
        (a device array of the wire type, returned as the third item) and copied over."""
        nbytes = wire_format.message_bytes(fmt, floats, state)
        if self.on_cpu:
            buf = np.zeros(nbytes, dtype=np.uint8)
            header = wire.header_view(buf)
        elif self.cuda_aware:
            buf = self.backend.xp.zeros(nbytes, dtype=np.uint8)
            header = wire.new_header()
        else:
            buf = self.backend.empty_host(nbytes)
            buf[:] = 0
            header = wire.header_view(buf)
        payload, state_view = wire_format.views(buf, fmt, floats, state)
        staging = None if self.device_payload else self.backend.xp.empty(floats, fmt.wire_dtype)
        return wire.MessageBuffer(buf, header, payload), state_view, staging

    def header_to_buffer(self, msg: wire.MessageBuffer) -> None:
        """Before a send: the host header into a device buffer (and the stream synchronised)."""
        if self.cuda_aware:
            msg.buf[:wire.HEADER_BYTES].set(msg.header.view(np.uint8))
            self.backend.synchronize()

    def header_from_buffer(self, msg: wire.MessageBuffer) -> None:
        """After a receive: a device buffer's header into its host copy."""
        if self.cuda_aware:
            msg.header[:] = msg.buf[:wire.HEADER_BYTES].get().view(np.float64)

