"""What every layer shares, with neither torch nor Ray: storage (fsspec, S3 options),
model sources (local / s3 / hub, the node cache), the column schema between stages,
the tokenizer loader and lazy package exports (`lazy.py`). engine/, actors/ and pipeline/
import it; it imports none of them."""
