"""Files: the ``Trace`` object, the canonical Parquet file, a session's streamed segments, the
output-name claim, PyTorch profiler (Kineto) import, and ``load`` for all of them."""
