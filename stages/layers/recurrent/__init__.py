"""The mixers that keep a fixed-size recurrent state instead of a KV cache (their state kind is
layers/state.py's): Gated DeltaNet (Qwen3-Next, Qwen3.5), Kimi Delta Attention (Kimi Linear),
Mamba2 (Nemotron-H), the delta rule the first two share token by token, and the short causal
convolution in front of each."""
