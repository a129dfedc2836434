"""Splitting an nn.Sequential (or a list of modules) into pipeline stages."""
import torch


def split_sequential(model, num_stages, *, by="params", boundaries=None):
    """Cuts `model` (an nn.Sequential or a list of modules) into
    `num_stages` nn.Sequential parts, in order, none empty.

    boundaries: the index of each part's first module after the first
    (num_stages - 1 increasing indices), which wins over `by`. by="index":
    as equal module counts as can be; by="params": the cut whose largest part
    has the fewest parameters (an exact search over the chain).
    """
    layers = list(model.children()) if isinstance(model, torch.nn.Module) else list(model)
    n, k = len(layers), int(num_stages)
    if k < 1 or k > n:
        raise ValueError(f"split_sequential: {k} stages from {n} modules: each stage needs at "
                         f"least one")
    if boundaries is not None:
        cuts = [int(b) for b in boundaries]
        if len(cuts) != k - 1 or any(not 0 < c < n for c in cuts) or cuts != sorted(set(cuts)):
            raise ValueError(f"split_sequential: boundaries {list(boundaries)} must be "
                             f"{k - 1} increasing indices in 1..{n - 1}")
    elif by == "index":
        cuts = [round(i * n / k) for i in range(1, k)]
    elif by == "params":
        cuts = _balanced_cuts([sum(p.numel() for p in m.parameters()) for m in layers], k)
    else:
        raise ValueError(f"split_sequential: by={by!r}: use 'params' or 'index'")
    edges = [0] + cuts + [n]
    return [torch.nn.Sequential(*layers[a:b]) for a, b in zip(edges, edges[1:])]


def _balanced_cuts(weights, k):
    """Cuts of a chain into k non-empty runs minimising the largest run's
    weight (dynamic programming, O(k n^2))."""
    n = len(weights)
    pre = [0]
    for w in weights:
        pre.append(pre[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    arg = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for j in range(1, k + 1):
        for e in range(j, n - (k - j) + 1):
            for s in range(j - 1, e):
                v = max(best[j - 1][s], pre[e] - pre[s])
                if v < best[j][e]:
                    best[j][e], arg[j][e] = v, s
    cuts, e = [], n
    for j in range(k, 1, -1):
        e = arg[j][e]
        cuts.append(e)
    return sorted(cuts)
