# ruff: noqa  (a measurement record)
# The batched_select of socket_batched.py before 62e98e1 (read by ab_socket_probs.py)
def batched_select(method: Socket, layer: int, q: torch.Tensor, view: DecodeView) -> torch.Tensor:
    """The batch's selection ``[B, h_kv, W]`` (``SparseMethod.decode_select``)."""
    c, width = method.config, view.width_tokens
    ids_pool, norm_pool = page_pools(method, layer, view.cache)
    h_kv = ids_pool.shape[1]
    k_max = method.budget(width)[2] if c.top_k is None else min(c.top_k, width)
    n = view.seqlens.long()[:, None]  # [B, 1]
    if k_max == 0:
        # No row of the bucket scores a token (the budget holds no more than the sinks and the local window,
        # k non-decreasing in n): the selection is the forced tokens, so the collision scores are not computed.
        score = torch.zeros(n.shape[0], h_kv, width, device=q.device)
    else:
        probs = batch_bucket_probs(method, layer, q, h_kv)
        # norm_pool is None unless the scorer uses value norms
        if triton_wanted(q, ids_pool):
            score = paged_collision(probs, ids_pool, norm_pool, view.kv.page_table, view.seqlens)
        else:
            score = paged_collision_torch(probs, ids_pool, norm_pool, view.kv.page_table, view.seqlens)
    sink, local, top = budget_rows(method, n)
    j = torch.arange(width, device=q.device)
    middle = ((j >= sink) & (j < n - local))[:, None, :]
    forced = ((j < sink) | ((j >= n - local) & (j < n)))[:, None, :]
    # The list selection's encoding: +inf forced (sinks, local window), -inf outside the middle.
    score = torch.where(forced, math.inf, torch.where(middle, score, -math.inf))
    out_width = min(width, min(c.sink_tokens, width) + min(c.local_tokens, width) + k_max)
    return select_list(score.flatten(0, 1), top.expand(-1, h_kv).flatten(), k_max,
                       max(out_width, 1)).view(*score.shape[:2], -1)
