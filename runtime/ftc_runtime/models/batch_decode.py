"""`BatchDecode`: the entries every family's model gives the generation loop for a decode step of
several sequences, `decode_batch`, and for a speculative verification pass of one sequence,
`verify_pass`. What all families share is which path a step takes: one CUDA graph where the
experts run the step on the device and a graph for that width exists, else the one-token forward
for a single sequence, the family's eager batch (`_eager_batch`) or its forward of a chunk."""

from __future__ import annotations

import torch


class BatchDecode:
    """Mixed into a family's model, which has `decode_graphs` (`DecodeGraphs` or None), `forward`
    (one sequence's tokens) and `_eager_batch` (one token of each of several sequences)."""

    @torch.inference_mode()
    def decode_batch(self, tokens: list[int], caches: list) -> torch.Tensor:
        """One new token for each of several sequences, each after its own cache's tokens: logits
        [B, vocab] fp32. On a GPU whose experts run a step on the device, the whole step is one
        CUDA graph (`step_batch`)."""
        if len(tokens) != len(caches) or not tokens:
            raise ValueError(f"decode_batch: {len(tokens)} tokens for {len(caches)} caches")
        if self.decode_graphs is not None and self.decode_graphs.batch_ready(len(tokens)):
            return self.decode_graphs.step_batch(tokens, caches)
        if len(tokens) == 1:
            return self.forward(torch.tensor(tokens), caches[0])
        return self._eager_batch(tokens, caches)

    @torch.inference_mode()
    def verify_pass(self, tokens: list[int], cache, checkpoint_at: tuple[int, ...] = (),
                    hidden: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Every position's logits [n, vocab] fp32 of `tokens` run after the cache's tokens (a
        sequence's next token and its drafts), as the forward of a chunk gives them: with the
        recurrent state after each token in `checkpoint_at` in `cache.checkpoints` and the final
        hidden states appended to `hidden`. On a GPU whose experts run a step on the device, one
        CUDA graph per number of tokens (`step_pass`)."""
        graphs = self.decode_graphs
        if graphs is not None and graphs.pass_ready(len(tokens), cache, checkpoint_at):
            return graphs.step_pass(tokens, cache, checkpoint_at, hidden)
        more = {} if hidden is None else {"hidden": hidden}
        return self.forward(torch.tensor(tokens, dtype=torch.long), cache, True, checkpoint_at=checkpoint_at, **more)
