"""Statistics for the sampling-exactness tests of speculative decoding: the exact law of a few new tokens by full
forwards over every continuation (tiny vocabularies), empirical counts from `mtpkit.generate`, and Pearson's
chi-square test between them."""

from __future__ import annotations

import torch

import mtpkit
from mtpkit.decode.sampling import probs


def chi2_pvalue(counts: torch.Tensor, expected_p: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit; cells expected below min_expected are pooled into one."""
    n = counts.sum()
    exp = expected_p.double() * n
    small = exp < min_expected
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([exp[~small], exp[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.double), stat / 2))


def exact_joint(model, prompt, params, n_tokens):
    """P(first n_tokens new tokens) [V]*n_tokens, by full forwards over every continuation (tiny vocab)."""
    V = model.config.vocab_size
    joint = torch.ones(())
    seqs = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n_tokens):
            p = probs(model(seqs).logits[:, -1], params).double()  # [V^t, V]
            joint = (joint.reshape(-1, 1) * p).reshape(-1)
            seqs = torch.cat([seqs.repeat_interleave(V, 0), torch.arange(V).repeat(seqs.shape[0])[:, None]], 1)
    return joint


def empirical_counts(model, params, prompt, k, seed, rows=12_000, **options):
    """Counts [V^3] of the first 3 new tokens over `rows` independent samples (one batch of the same prompt), and
    the run's stats; `options` go to `mtpkit.generate` (draft_vocab, draft_widths, ...)."""
    r = mtpkit.generate(model, torch.tensor([prompt] * rows), max_new_tokens=3, draft_tokens=k,
                        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=seed, **options)
    V = model.config.vocab_size
    idx = torch.tensor([t[0] * V * V + t[1] * V + t[2] for t in r.tokens])
    return torch.bincount(idx, minlength=V**3), r.stats
