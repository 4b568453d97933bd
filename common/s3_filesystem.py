"""The S3 filesystem blockray uses, in a module of its own: importing s3fs (aiobotocore,
aiohttp) costs about 0.4 CPU-s, which every Ray worker would pay at start for nothing
when the run reads and writes local files."""
from __future__ import annotations

import s3fs


class SingleLayerS3FileSystem(s3fs.S3FileSystem):
    """S3FileSystem without s3fs's own retry loop (its `retries` class attribute: up to 5
    tries of every botocore call, each with botocore's retries inside). A class attribute,
    not an instance one, so that it survives pickling to Ray tasks (fsspec pickles the
    constructor arguments only)."""

    retries = 1
