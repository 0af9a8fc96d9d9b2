"""Writes `experts.ftw` in one sequential pass, computing its row checksums and sha256 on the way."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from ftc.compile.checkpoint import nonfinite_count
from ftc_runtime.formats.base import EXPERT_TENSORS, Expert, expert_shapes
from ftc_runtime.io.ftw import FtwHeader, encode_trailer, round_up, row_checksum


class FtwWriter:
    """Append experts in id order (`l·E + e`), each as its float tensors {"gate_up": [2I, H] (gate
    rows first), "down": [H, I]} (any float dtype), which the header's expert format encodes, or
    as the quantized matrices {"gate", "up", "down"} of a checkpoint in that format, which it repacks."""

    def __init__(self, path: Path, header: FtwHeader):
        self.path, self.header = path, header
        self.format = header.format
        self._f = open(path, "wb")
        self._sha = hashlib.sha256()
        self._checksums: dict[str, list[int]] = {b.name: [] for b in header.banks}
        self._write(header.encode())

    def _write(self, data: bytes | memoryview) -> None:
        self._f.write(data)
        self._sha.update(data)

    def append(self, expert: Expert) -> None:
        h = self.header
        n = len(self._checksums[h.banks[0].name])
        if n >= h.num_rows:
            raise ValueError(f"{self.path.name}: more than {h.num_rows} experts appended")
        where = f"expert {n} (MoE layer {n // h.num_experts}, expert {n % h.num_experts})"
        if "gate_up" in expert:
            for name, shape in expert_shapes(h.hidden, h.intermediate).items():
                t = expert[name]
                if tuple(t.shape) != shape or not t.is_floating_point():
                    raise ValueError(f"{where}, bank '{name}': got {t.dtype} {tuple(t.shape)}, expected a float "
                                     f"tensor of shape {shape}")
        rows = self.format.rows_of(expert)
        # What the engine will hold, decoded: NaN or Inf in the input, or beyond the format's range.
        for name, t in zip(EXPERT_TENSORS, self.format.dequantize(rows, h.hidden, h.intermediate), strict=True):
            bad = nonfinite_count(t)
            if bad:
                raise ValueError(f"{self.path}: {where}, bank '{name}': {bad} NaN or Inf values of {t.numel()} "
                                 f"({self.format.name}); an engine holds finite weights only")
        for bank in h.banks:
            raw = rows[bank.name]
            if raw.dtype != torch.uint8 or raw.shape != (bank.row_bytes,):
                raise ValueError(f"{where}: the {self.format.name} encoder gave bank '{bank.name}' a row of "
                                 f"{raw.dtype} {tuple(raw.shape)}, expected {bank.row_bytes} bytes")
            self._checksums[bank.name].append(row_checksum(raw))
            self._write(memoryview(raw.numpy()))
            self._write(bytes(round_up(bank.row_bytes) - bank.row_bytes))

    def close(self) -> str:
        """Writes the checksum trailer; returns the file's sha256."""
        got = len(self._checksums[self.header.banks[0].name])
        if got != self.header.num_rows:
            raise ValueError(f"{self.path.name}: {got} experts written, expected {self.header.num_rows}")
        self._write(encode_trailer(self._checksums))
        self._f.close()
        return self._sha.hexdigest()
