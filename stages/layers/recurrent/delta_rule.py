"""The delta rule Gated DeltaNet (gated_deltanet.py) and Kimi Delta Attention (kda.py) both run, token
by token, and what their chunked forms share.

Per head, over the tokens of a step (S [dk, dv] the head's state; q, k [dk] normed, q scaled; v
[dv]; beta a scalar; g <= 0 the log of the decay):

    S = diag(exp(g_t)) S;   S = S + k_t ((v_t - k_tᵀ S) beta_t)ᵀ;   o_t = q_tᵀ S

g is one number per head and token in Gated DeltaNet (it decays the head's whole state: g [H, T, 1])
and one per key channel in KDA (each row of the state decays by its own: g [H, T, dk]); the token-by-
token form is one for both (`recurrent_delta_rule`, what a one-token decode step runs). The chunked
forms are each layer's own: with one decay per head a chunk's decays between positions are a [c, c]
matrix and the chunk runs as matmuls (gated_deltanet.py `chunked_delta_rule`, the reference's order);
with one per channel they are [c, c, dk] (kda.py `chunked_kda`). Each is its reference's algorithm
step for step, so that logits agree with transformers' to ~1e-6: one code path for both would round
otherwise than one of the two references.
"""

from __future__ import annotations

import torch

CHUNK = 64  # tokens per chunk of the chunked forms (both references' chunk_size)
L2_EPS = 1e-6  # l2norm's epsilon (both references', FLA's)


def recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule token by token. q, k [H, T, dk] (normed, q scaled), v [H, T, dv], g [H, T, 1] (a
    decay per head) or [H, T, dk] (per key channel), beta [H, T]; state [H, dk, dv]. Returns (o [H, T, dv],
    the final state, a new tensor)."""
    outs = []
    for t in range(q.shape[1]):
        state = state * g[:, t, :, None].exp()  # decay: the whole state, or each key channel's row
        k_t = k[:, t, :, None]  # [H, dk, 1]
        remembered = torch.bmm(k_t.transpose(1, 2), state)  # [H, 1, dv]: k_tᵀ S
        delta = (v[:, t, None, :] - remembered) * beta[:, t, None, None]
        state = torch.baddbmm(state, k_t, delta)  # S + k_t deltaᵀ
        outs.append(torch.bmm(q[:, t, None, :], state))  # [H, 1, dv]
    return torch.cat(outs, dim=1), state
