"""Writes `experts.ftw` in one sequential pass, computing its row checksums and sha256 on the way."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from ftc.compile.checkpoint import nonfinite_count
from ftc_runtime.io.ftw import FtwHeader, encode_trailer, round_up, row_checksum


class FtwWriter:
    """Append experts in id order (`l·E + e`), each as {bank name: bf16 tensor of the row shape}."""

    def __init__(self, path: Path, header: FtwHeader):
        self.path, self.header = path, header
        self._f = open(path, "wb")
        self._sha = hashlib.sha256()
        self._checksums: dict[str, list[int]] = {b.name: [] for b in header.banks}
        self._write(header.encode())

    def _write(self, data: bytes | memoryview) -> None:
        self._f.write(data)
        self._sha.update(data)

    def append(self, rows: dict[str, torch.Tensor]) -> None:
        n = len(self._checksums[self.header.banks[0].name])
        if n >= self.header.num_rows:
            raise ValueError(f"{self.path.name}: more than {self.header.num_rows} experts appended")
        for bank in self.header.banks:
            t = rows[bank.name]
            if tuple(t.shape) != bank.row_shape or t.dtype != torch.bfloat16:
                raise ValueError(f"expert {n}, bank '{bank.name}': got {t.dtype} {tuple(t.shape)}, "
                                 f"expected bfloat16 {bank.row_shape}")
            bad = nonfinite_count(t)
            if bad:
                layer, expert = divmod(n, self.header.num_experts)
                raise ValueError(f"{self.path}: expert {n} (MoE layer {layer}, expert {expert}), bank "
                                 f"'{bank.name}': {bad} NaN or Inf values of {t.numel()}; an engine holds "
                                 "finite weights only")
            raw = t.contiguous().view(torch.uint8).reshape(-1)
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
