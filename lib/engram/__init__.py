"""DeepSeek-V4.1 Engram on the host: everything that depends on token ids only, not on weights.

`token_map` (the compressed token map, built from a tokenizer), `buckets` (each Engram layer's bucket
primes, column offsets and table rows), `multipliers` (the per-layer hash multipliers), `hashing`
(hash ids of a sequence of compressed ids, vectorised over positions) and `state` (a sequence's
decode state: the last engram_max_ngram_size - 1 compressed ids, and the incremental step). Hash ids
depend only on tokens the host already has, so computing them here needs no device sync.

The model's side of Engram (table lookup, projection, gate) is not here. Plain numpy integer work:
must not import torch models, weights, backends, the runtime, the engine or the server; imports only
`spec` (the config) and the `tokenizers` library's normalizers. A tokenizer is passed in, duck-typed
as lib/text/tokenizer.py's `Tokenizer` (`lib.text` is a sibling layer, not imported).
"""
