"""The softmax top-k router (`layers/router.route`) against numpy's sort of the softmax, on the CPU
(torch) and on a GPU (marked `gpu`: its Triton kernel), on fresh random logits."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ftc_runtime.models.layers.router import route


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_route_picks_the_most_probable_experts(device, seed):
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    for trial in range(20):
        t, e, k = rng.choice([1, 2, 16, 300]), rng.choice([16, 60, 128, 512]), rng.choice([1, 4, 8])
        hidden, renormalize = rng.choice([32, 256]), rng.random() < 0.5
        h, gate = torch.randn(t, hidden, generator=g), torch.randn(e, hidden, generator=g)
        ids, weights = route(h.to(device), gate.to(device), k, renormalize)
        logits = (h.double() @ gate.double().T).numpy()
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        want_ids = np.argsort(-probs, axis=1, kind="stable")[:, :k]
        got_ids = ids.cpu().numpy()
        what = f"trial {trial}: {t} tokens, {e} experts, top {k}, renormalize {renormalize}"
        assert ids.dtype == torch.int64 and weights.dtype == torch.float32, what
        # The reference's experts in its order, but where two probabilities lie within fp32's
        # rounding of each other (then either order is right): compared by their probabilities.
        got_p = np.take_along_axis(probs, got_ids, 1)
        assert all(len(set(row)) == k for row in got_ids.tolist()), what
        assert np.allclose(got_p, np.take_along_axis(probs, want_ids, 1), rtol=1e-4, atol=0), what
        assert (got_ids == want_ids).mean() > 0.99, what  # near-ties are rare
        want_w = got_p / got_p.sum(1, keepdims=True) if renormalize else got_p
        assert np.allclose(weights.cpu().numpy(), want_w, rtol=1e-4, atol=1e-6), what
