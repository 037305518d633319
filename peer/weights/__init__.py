"""Weights travel peer to peer: the manifest, a chunk server, a fetcher, and its part files.

A peer that holds a layer serves its bytes (`source.py`); a peer that lacks the layers
of the span it claims learns the manifest, checks it against the model id, and fetches
those layers' tensors from several peers at once (`fetcher.py`), checking every chunk
and writing it to a resumable part file (`parts.py`); a finished set becomes the
folder's safetensors file by an atomic rename. `bootstrap.py` sets up a folder for a
model this machine has never seen.
"""
