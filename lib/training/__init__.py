"""Training the `trained` tiny preset on the task mix (`dsv4gen train-tiny`): its corpus and tokenizer (corpus.py), the
target through the reference forward (target.py), and the official-format checkpoint it writes (export.py)."""
