"""`MtpDrafter`: drafts from the checkpoint's own multi-token-prediction layer (`--speculate mtp:K`).

The layer joins the final hidden state at position p with the embedding of the token at p + 1 and
predicts the token at p + 2, attending over its own keys and values of the earlier positions. Each
pass of the model hands over the hidden states of the positions it ran and kept (`observe`); once
the token after each is known, the layer runs over them in one call, its last row's prediction the
first draft (the token after the sequence's next one). Each further draft runs the layer on one
position more, its own output standing in for the hidden state there; those positions' keys and
values are cut off again (a compressed state, DeepSeek-V4's, rewound), since a verification pass
gives the true hidden states.

The drafts are the layer's greedy tokens (a point mass, which the acceptance rule takes as it is:
`verify`). A sequence resumed from the prefix cache starts the layer's keys and values at the point
it resumed from, the hidden states before it being gone."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ftc_runtime.experts.device.device_plan import PLANNED_TOKENS


class MtpDrafter:
    reads_hidden = True

    def __init__(self, model: Any, context: Iterable[int], start: int):
        """`model`: the family's model (`new_mtp_cache`, `mtp_forward`); `context`: the prompt;
        `start`: the position of the first hidden state it will be told (where the sequence resumed)."""
        self.model, self.tokens, self.start = model, list(context), start
        self.cache = model.new_mtp_cache()
        self.pending: list[torch.Tensor] = []  # hidden states the layer has not run yet, in order

    def add(self, token: int) -> None:
        self.tokens.append(token)

    def observe(self, hidden: torch.Tensor) -> None:
        """The final hidden states [T, hidden] of the next T positions that the sequence keeps."""
        self.pending.append(hidden)

    def propose(self, k: int) -> list[int]:
        if k < 1 or not self.pending:
            return []
        first = self.start + self.cache.length
        rows = sum(h.shape[0] for h in self.pending)
        after = self.tokens[first + 1:first + 1 + rows]  # the token after each position
        if len(after) != rows:
            raise RuntimeError(f"MTP drafter: hidden states up to position {first + rows - 1}, "
                               f"tokens up to {len(self.tokens) - 1}")
        done = 0
        for hidden in self._calls():
            t = hidden.shape[0]
            logits, out = self.model.mtp_forward(hidden, self._ids(after[done:done + t]), self.cache, first + done)
            done += t
        kept, position = self.cache.length, first + rows
        further = k > 1  # further drafts run positions that are cut off again
        mark = self.cache.mark() if further and self.cache.rewinds_by_replay else None  # cut back by rewinding
        drafts = [int(logits[-1].argmax())]
        while len(drafts) < k:
            logits, out = self.model.mtp_forward(out[-1:], self._ids(drafts[-1:]), self.cache, position)
            drafts.append(int(logits[-1].argmax()))
            position += 1
        if mark is not None:
            self.cache.rewind(mark)
        elif further:
            self.cache.truncate(kept)
        return drafts

    def _calls(self) -> list[torch.Tensor]:
        """The pending hidden states as the layer's calls: a prompt chunk's in one (as the prompt
        ran, on the expert backend's host path), the decode passes' since the last drafts joined
        into calls of at most PLANNED_TOKENS rows, which the backend runs on its device plan (a
        longer one would take the host path, and the next step would capture its graphs anew)."""
        calls, run, rows = [], [], 0
        for hidden in self.pending:
            if run and rows + hidden.shape[0] > PLANNED_TOKENS:
                calls.append(torch.cat(run))
                run, rows = [], 0
            run.append(hidden)
            rows += hidden.shape[0]
        self.pending = []
        return [*calls, torch.cat(run)]

    def _ids(self, tokens: list[int]) -> torch.Tensor:
        return torch.tensor(tokens, dtype=torch.long)
