"""Text around the model: the tokenizer, the V4 chat encoding and the DSML tool-call format.

Pure string and token-id work. Must not import torch models, weights, the engine or the server.
"""
