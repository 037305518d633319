"""GGUF (ggml) block types as stored: `blocks` dequantizes the classic types (Q4_0 ... Q6_K) from
their bytes, `scaled` every lower type as scaled codes (with `kquants`, `iq` and `fp4` holding
the codes' layouts), and `linear` the matmul over rows kept in their blocks."""
