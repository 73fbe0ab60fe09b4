"""The one glossary of dimension names used in configs, code, shapes in docstrings and reports.

Config fields and shape letters mean the same thing everywhere:

    B   batch                 sequences in flight (<= runtime.max_batch)
    L   seq_len               tokens of a prefill step
    S   max_seq               cache capacity in tokens (runtime.max_seq)
    D   dim                   model (residual stream) width
    V   vocab_size            rows of the embedding / head
    H   n_heads               query heads of an attention mixer
    Hkv n_kv_heads            key/value heads (GQA: H % Hkv == 0; MQA: Hkv == 1)
    Dh  head_dim              width of one attention head
    F   ffn_dim               hidden width of a dense FFN (gated: two projections of F)
    E   n_experts             routed experts of a MoE FFN
    K   top_k                 experts chosen per token
    R   rot_dim               channels of a head that RoPE rotates (<= head_dim)
    C   kv_lora_rank          MLA latent width cached per token
    N   n_streams             residual streams of mHC
    T   context               tokens already in the cache (reports; a prompt's length is L)
    Hk  n_k_heads             query/key heads of a Gated DeltaNet mixer
    Hv  n_v_heads             its value heads (Hv % Hk == 0; state per value head [Dk, Dv])
    Dk  k_head_dim            width of one DeltaNet query/key head
    Dv  v_head_dim            width of one DeltaNet value head
    W   conv_kernel           width of the DeltaNet causal conv
    Cc  conv_dim              channels of that conv, [q|k|v] = 2*Hk*Dk + Hv*Dv (derived)
    Lc  chunk_size            tokens per chunk of the chunked DeltaNet prefill
    Sw  window                sliding window: keys a query sees, itself included (ring slots of
                              a sliding-window cache: min(window, max_seq))
    Cq  q_lora_rank           width of a low-rank query projection (wq_a -> q_norm -> wq_b)
    Dn  qk_nope_dim           MLA query/key channels of a head without RoPE (q.k width: Dn + R)
    G   o_groups              head groups of a grouped output projection
    Go  o_lora_rank           per-group width of that projection
    Hi  index_n_heads         heads of a DSA lightning indexer
    Di  index_head_dim        width of one indexer head, and of the one indexer key per token
    Ks  index_topk            cached tokens a DSA query attends to (chosen by the indexer)
    m   compress_ratio        tokens pooled into one compressed-attention entry
    Dc  (compressor out_dim)  width of one compressed entry (the attention head width it is read at)
    Wc  (compressor width)    channels a compressor projects per token: Dc, or 2 Dc with overlap
    Ne  (entries)             compressed-entry slots per sequence: max_seq // m (at least one)
    Ci  d_inner               channels of a Mamba / Mamba2 mixer's inner stream (expand * D)
    Ns  d_state               state entries per channel (Mamba) or per head (Mamba2) of an SSM
    Rt  dt_rank               width of Mamba's low-rank time-step projection
    Hs  n_heads (SSM)         Mamba2 heads (Ci = Hs * Ps), one scalar decay each
    Ps  head_dim (SSM)        channels of one Mamba2 head
    Gs  n_groups              Mamba2 B/C groups (each serves Hs / Gs heads)
    Kd  draft_tokens          tokens a drafter proposes per speculative step (runtime.speculative)
    Nl  n_layers              decoder layers (the per-layer inputs' layer axis)
    Dp  per_layer_dim         width of one layer's per-layer input embedding (Gemma 4's PLE)
    Vp  per_layer_vocab       rows of the per-layer embedding table
    P   (ranks)               processes of a tensor/expert-parallel run (runtime.parallel: tp is 1
                              or P, ep divides P; see compiler/parallel/)

Module paths are fixed whatever the layer kind, so checkpoint rules and reports address
parameters uniformly:

    embed                     token embedding [V, D]
    layers.{i}.mixer_norm     norm before the mixer
    layers.{i}.mixer          attention / MLA / DeltaNet ...
    layers.{i}.ffn_norm       norm before the FFN
    layers.{i}.ffn            dense or MoE FFN
    layers.{i}.mixer_residual residual connection around the mixer (prenorm: no parameters)
    layers.{i}.ffn_residual   residual connection around the FFN
    norm                      final norm
    per_layer_inputs          per-layer input table / projection / norm (Gemma 4; layers.{i}.per_layer its gate)
    head                      output projection [V, D] (shares embed's storage when tied)
"""

DIMENSIONS = {
    "B": "batch",
    "L": "seq_len",
    "S": "max_seq",
    "D": "dim",
    "V": "vocab_size",
    "H": "n_heads",
    "Hkv": "n_kv_heads",
    "Dh": "head_dim",
    "F": "ffn_dim",
    "E": "n_experts",
    "K": "top_k",
    "R": "rot_dim",
    "C": "kv_lora_rank",
    "N": "n_streams",
    "T": "context",
    "Hk": "n_k_heads",
    "Hv": "n_v_heads",
    "Dk": "k_head_dim",
    "Dv": "v_head_dim",
    "W": "conv_kernel",
    "Cc": "conv_dim",
    "Lc": "chunk_size",
    "Sw": "window",
    "Cq": "q_lora_rank",
    "Dn": "qk_nope_dim",
    "G": "o_groups",
    "Go": "o_lora_rank",
    "Hi": "index_n_heads",
    "Di": "index_head_dim",
    "Ks": "index_topk",
    "m": "compress_ratio",
    "Dc": "compressed entry width",
    "Wc": "compressor width",
    "Ne": "compressed entries",
    "Ci": "d_inner",
    "Ns": "d_state",
    "Rt": "dt_rank",
    "Hs": "ssm n_heads",
    "Ps": "ssm head_dim",
    "Gs": "n_groups",
    "Kd": "draft_tokens",
    "P": "ranks",
}
