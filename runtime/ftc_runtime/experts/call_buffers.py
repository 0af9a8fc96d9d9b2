"""`CallBuffers`: the buffers that the offloaded experts' calls reuse, by name: a call's staged input
on the device and its copy on the host, the two parts of its output, its device pairs, a streamed
prompt chunk's CPU part. CUDA graphs hold the addresses of one-token buffers, so those are sized
once and never move; the others grow when a call needs more."""

from __future__ import annotations

import torch

from ftc_runtime.experts.device.device_plan import PLANNED_TOKENS


class CallBuffers:
    """Buffers [t, width] by name and by whether t is 1, on the device or on the host (pinned beside
    a GPU, so that copies between the two run asynchronously). A staged call of T tokens routed to
    k experts each is one row [hidden + 2k] fp32 a token: x, ids, weights (ids are exact in fp32
    below 2^24)."""

    def __init__(self, device: torch.device, hidden: int):
        self.device, self.hidden = device, hidden
        self.on_gpu = device.type == "cuda"
        self.held: dict[tuple[str, bool], torch.Tensor] = {}

    def get(self, name: str, t: int, width: int, device: torch.device | None = None,
            dtype: torch.dtype = torch.float32, zeroed: bool = False) -> torch.Tensor:
        """The buffer `name` [t, width] on `device` (None: the host), all zeros when made where
        `zeroed`."""
        key = (name, t == 1)
        n = t * width
        buf = self.held.get(key)
        if buf is None or buf.numel() < n:
            on_host = device is None or device.type == "cpu"
            make = torch.zeros if zeroed else torch.empty
            with torch.inference_mode(False):  # written in place by later calls, in or out of inference mode
                buf = make(n, dtype=dtype, device=device or "cpu", pin_memory=on_host and self.on_gpu)
            self.held[key] = buf
        return buf[:n].view(t, width)

    def host(self, name: str, t: int, width: int, dtype: torch.dtype = torch.float32,
             zeroed: bool = False) -> torch.Tensor:
        """A host buffer, as a streamed chunk's CPU part takes them (`stream_cpu.HostBuffer`)."""
        return self.get(name, t, width, None, dtype, zeroed)

    def stage(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Queues x (fp32), ids and weights into the staged call's device buffer and, beside a GPU,
        its copy to the host. Capturable in a CUDA graph."""
        (t, hidden), k = x.shape, ids.shape[1]
        packed = self.staged(t, k)
        packed[:, :hidden].copy_(x)
        packed[:, hidden:hidden + k].copy_(ids)
        packed[:, hidden + k:].copy_(weights)
        if self.on_gpu:
            self.get("in_host", t, hidden + 2 * k).copy_(packed, non_blocking=True)

    def staged(self, t: int, k: int) -> torch.Tensor:
        """The staged call on the device."""
        return self.get("in", t, self.hidden + 2 * k, self.device)

    def staged_host(self, t: int, k: int) -> torch.Tensor:
        """The staged call on the host: its pinned copy beside a GPU, else the buffer itself."""
        if self.on_gpu:
            return self.get("in_host", t, self.hidden + 2 * k)
        return self.staged(t, k)

    def device_out(self, t: int) -> torch.Tensor:
        """A call's device part [t, hidden] fp32: its hits and fills."""
        return self.get("device_out", t, self.hidden, self.device)

    def cpu_out(self, t: int) -> torch.Tensor:
        """A call's CPU part [t, hidden] fp32, on the host."""
        return self.get("cpu_out", t, self.hidden)

    def step_out(self, t: int) -> torch.Tensor:
        """Where a decode step's call of t tokens leaves its device part, for graphs to read: a
        batch's is a view of one buffer of PLANNED_TOKENS rows, never regrown."""
        if t == 1:
            return self.device_out(1)
        return self.get("batch_out", PLANNED_TOKENS, self.hidden, self.device)[:t]
