"""The transformers peer for the parity tests; it lives in lib/bench/hf_peer.py, which `dsv4gen bench` shares."""
from lib.bench.hf_peer import hf_config_from_official, hf_incremental_logits, hf_logits, load_hf_model  # noqa: F401
