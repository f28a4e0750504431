"""Model FLOPs per token for a decoder-only transformer: the numerator of MFU."""

from __future__ import annotations

__all__ = ["transformer_flops_per_token"]


def transformer_flops_per_token(
    *,
    n_params: int,
    n_layers: int,
    n_heads: int,
    head_dim: int,
    seq_len: int,
    n_embedding_params: int = 0,
) -> int:
    """Training FLOPs (forward + backward) per token of a decoder-only transformer.

    The count is the one PaLM (Chowdhery et al. 2022, arXiv:2204.02311, Appendix B) uses for MFU and
    torchtitan copies (``get_num_flop_per_token``)::

        6 * (n_params - n_embedding_params)  +  12 * n_layers * n_heads * head_dim * seq_len

    * ``6 * N``: every weight that takes part in a matmul costs 2 FLOPs per token forward (one multiply,
      one add) and 4 backward (gradient w.r.t. the input and w.r.t. the weight); Kaplan et al. 2020,
      arXiv:2001.08361, section 2.1. The embedding *lookup* table is a gather, not a matmul, so pass its
      size as ``n_embedding_params`` to exclude it; the output head (``dim -> vocab``) is a matmul and
      stays in. With tied embeddings the one shared table *is* the head: pass ``n_embedding_params=0``.
      Norm gains and biases are counted as if they did matmuls; they are a rounding error (< 0.1%).
    * ``12 * L * H * Q * T``: per token and layer, ``Q K^T`` and ``A V`` each cost ``2 * H * Q * T``
      forward, times 3 for forward + backward. **Causal masking is not halved**: the whole ``T x T``
      score matrix is counted, as PaLM and torchtitan do (and as a dense kernel computes it), so MFU from
      this count is comparable with theirs; a flash kernel that skips masked blocks does about half of
      this attention work. With grouped-query attention ``n_heads`` is the number of *query* heads.

    Recomputation (activation checkpointing) is not counted: MFU is about model FLOPs, not hardware FLOPs.

    Args:
      n_params: all parameters of the model (including the embedding table).
      n_layers: transformer blocks.
      n_heads: query heads per block.
      head_dim: width of one head.
      seq_len: the training sequence length (attention span per token).
      n_embedding_params: parameters of the input embedding lookup, excluded from the ``6N`` term.

    Returns:
      FLOPs per token, an int.

    Example:
      >>> transformer_flops_per_token(n_params=1000, n_layers=2, n_heads=4, head_dim=8, seq_len=16,
      ...                             n_embedding_params=200)
      17088
    """
    for name, value in (
        ("n_params", n_params),
        ("n_layers", n_layers),
        ("n_heads", n_heads),
        ("head_dim", head_dim),
        ("seq_len", seq_len),
        ("n_embedding_params", n_embedding_params),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"transformer_flops_per_token: {name} must be a non-negative int, got {value!r}")
    if n_embedding_params > n_params:
        raise ValueError(
            f"transformer_flops_per_token: n_embedding_params={n_embedding_params} exceeds n_params={n_params}; "
            "n_params must count every parameter, the embedding table included"
        )
    dense = 6 * (n_params - n_embedding_params)
    attention = 12 * n_layers * n_heads * head_dim * seq_len
    return dense + attention
